"""OpenAI-compatible request bodies (pydantic, as FastAPI wants) and the error shape."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationRequest(BaseModel):
    # Unknown OpenAI fields (user, logprobs=None, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # sloserve: the time-to-first-token objective, in milliseconds from arrival.
    ttft_slo_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    priority: int = 0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises ValueError naming the bad field (max_tokens < 1, temperature < 0, ...)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = getattr(self, "max_completion_tokens", None)
        if max_tokens is None:  # not `or`: max_completion_tokens=0 is an error, not "unset"
            max_tokens = self.max_tokens
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, n=self.n)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: only text is understood here
            texts = [part.get("text", "") for part in content if part.get("type") == "text"]
            if len(texts) != len(content):
                raise ValueError("messages: only text content parts are supported")
            content = "".join(texts)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            413: "RequestTooLargeError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
