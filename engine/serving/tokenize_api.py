"""`/tokenize` and `/detokenize`, in vLLM's request and response shapes: benchmark tools and
clients count tokens or turn ids back into text with the server's own tokenizer."""

from __future__ import annotations

from pydantic import Field, model_validator

from engine.processing.input_processor import InputProcessor
from engine.serving.api_errors import APIError
from engine.serving.openai_protocol import ChatMessage, _RequestModel


class TokenizeRequest(_RequestModel):
    """A plain prompt, or chat messages (rendered with the chat template), never both."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # vLLM's defaults: a plain prompt gets the tokenizer's special tokens (BOS, ...), chat
    # messages only what the template writes.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(_RequestModel):
    model: str | None = None
    tokens: list[int]


def tokenize_request(inputs: InputProcessor, body: TokenizeRequest) -> list[int]:
    try:
        if body.messages is not None:
            if body.add_special_tokens:
                raise APIError(400, "add_special_tokens is not supported with `messages`: the "
                                    "chat template writes the special tokens", "add_special_tokens")
            messages = [m.as_template_input() for m in body.messages]
            return inputs.apply_chat_template(messages, body.add_generation_prompt)
        assert body.prompt is not None
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return inputs.encode(body.prompt, add_special_tokens=add_special)
    except ValueError as exc:
        raise APIError(400, str(exc), "messages" if body.messages is not None else "prompt") \
            from exc


def detokenize_request(inputs: InputProcessor, body: DetokenizeRequest) -> str:
    tokenizer = inputs.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model folder has no tokenizer", "tokens")
    size = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token {bad} is outside the tokenizer's vocabulary "
                            f"[0, {size})", "tokens")
    return tokenizer.decode(body.tokens)
