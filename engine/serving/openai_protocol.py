"""OpenAI-compatible request bodies (pydantic, as FastAPI wants) and the error shape."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.serving.request_fields import shown, unsupported_message_field
from engine.serving.structured_fields import structured_outputs_from

# Every integer a request carries ends up in a msgpack frame to EngineCore (or a torch
# generator's seed), and both stop at 64 bits: Python's ints do not.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Samples per prompt, times prompts per request: each is a request in the engine.
MAX_N = 128


def _first_unfit(value: Any) -> str | None:
    """What is wrong with the first value in `value` (nested lists / dicts searched) that the
    engine cannot take: an integer beyond 64 bits, or a string that is not valid Unicode (a
    lone surrogate, which JSON's \\ud800 escape can carry but no tokenizer or UTF-8 encoder
    accepts). None when all is well."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        digits = len(str(abs(value)))
        shown = str(value) if digits <= 40 else f"an integer of {digits} digits"
        return (f"{shown} is outside the signed 64-bit integer range "
                f"[{INT64_MIN}, {INT64_MAX}]")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"not valid Unicode text: a lone surrogate "
                    f"{value[exc.start]!r} at character {exc.start}")
        return None
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        if _numbers_within_int64(value):
            return None
        return next((bad for v in value if (bad := _first_unfit(v)) is not None), None)
    return None


def _numbers_within_int64(values: list | tuple) -> bool:
    """True when `values` holds only numbers and they all lie within 64 bits: checked by
    min() and max() at C speed. A prompt of 30k token ids checked value by value took 12 ms
    of the API server's event loop (every other request's arrival stamp and stream waited on
    it); this takes a fraction of a millisecond. False sends the list through the item-by-item
    check, which names the culprit: strings, nested lists, or a number out of range (and a
    NaN, whose comparisons all fail)."""
    if not values or not isinstance(values[0], (int, float)):
        return False
    try:
        return INT64_MIN <= min(values) and max(values) <= INT64_MAX
    except TypeError:  # not all numbers
        return False


class _RequestModel(BaseModel):
    """Base of every request body model: the checks here hold for every field, present and
    future, so no field can smuggle in a value the engine cannot take."""

    # JSON parsers accept NaN and Infinity (and 1e999 overflows to inf): no sampling or SLO
    # field means anything with them, so every float field refuses them. Undeclared fields are
    # kept as extras: request_fields.py says which are refused (those asking for a feature this
    # server lacks), which are accepted without effect, and that the rest are ignored.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _engine_can_take(cls, value: Any) -> Any:
        problem = _first_unfit(value)
        if problem is not None:
            # The error's location names the field; the message says what is wrong with it.
            raise ValueError(problem)
        return value


class StreamOptions(_RequestModel):
    include_usage: bool = False
    # vLLM: every chunk carries the usage so far (with include_usage).
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_RequestModel):
    """OpenAI's `response_format.json_schema`."""

    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # OpenAI: follow the schema exactly. Always so here: the grammar allows nothing else.
    strict: bool | None = None


class ResponseFormat(_RequestModel):
    """OpenAI's `response_format` (engine.serving.structured_fields)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class GenerationRequest(_RequestModel):

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=MAX_N)
    # Sample this many per prompt, return the n with the highest cumulative logprob.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    # OpenAI sends the token ids as JSON object keys, so as strings.
    logit_bias: dict[str, float] | None = None
    # vLLM: logprobs of every prompt token but the first, with this many alternatives.
    prompt_logprobs: int | None = None
    # vLLM: logprobs name each token "token_id:<id>" (its text need not round-trip).
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # sloserve: the time-to-first-token objective, in milliseconds from arrival.
    ttft_slo_ms: float | None = Field(default=None, ge=0)
    # sloserve: the time-per-output-token objective, in milliseconds between two tokens.
    tpot_slo_ms: float | None = Field(default=None, gt=0)
    priority: int = 0
    # Structured outputs (engine.serving.structured_fields; vLLM's guided_* are extras).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The prompt's parameters (``child(i)``: its i-th sample's). Raises ValueError naming the
        bad field (max_tokens < 1, temperature < 0, ...)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens
        elif max_tokens == 0 and self.echo_only:
            max_tokens = 1  # one token is computed (and dropped): the prompt's scores need it
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, n=self.n, best_of=self.best_of,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0), min_p=_or(self.min_p, 0.0),
            min_tokens=self.min_tokens, logit_bias=dict(self.logit_bias or {}),
            logprobs=self.sample_logprobs, prompt_logprobs=self.prompt_logprobs_wanted,
            structured_outputs=structured_outputs_from(
                self.response_format, self.structured_outputs, self.model_extra or {}))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def sample_logprobs(self) -> int | None:
        """Alternatives per generated token (None: no logprobs)."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """The prompt back with its scores and nothing generated (echo with max_tokens 0)."""
        return False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(GenerationRequest):
    # A string, a list of token ids, or a list of either (one choice per prompt and sample).
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    # Alternatives per token, 0..20 (OpenAI's completions form).
    logprobs: int | None = None
    suffix: str | None = None

    @property
    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(prompt)

    @property
    def sample_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        # Echo with logprobs scores the prompt too (what evaluation harnesses read).
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
RESERVED_TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "documents", "chat_template",
                               "add_generation_prompt", "continue_final_message", "tokenize",
                               "padding", "truncation", "max_length", "return_tensors",
                               "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class FunctionDefinition(_RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema of the arguments (none: an object of no particular shape).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_RequestModel):
    name: str


class NamedToolChoice(_RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # A participant's name: passed to the chat template, as vLLM does (most templates ignore it).
    name: str | None = None
    # An assistant's earlier calls, and which call a tool message answers: to the template.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # An assistant's earlier thinking (vLLM's two names): to the template, which may keep or
    # drop it (Qwen3's drops all but the last turn's).
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as the chat template reads it. ValueError for a key that would carry
        something to the template that this server does not render (tool calls, reasoning)."""
        unsupported = unsupported_message_field(self.model_extra or {})
        if unsupported is not None:
            key, value = unsupported
            raise ValueError(f"messages: `{key}` in a message is not supported by this server "
                             f"(got {shown(value, 60)})")
        content = self.content
        if isinstance(content, list):  # OpenAI content parts: only text is understood here
            texts = [part.get("text") for part in content if part.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ValueError("messages: only text content parts (with a string `text`) "
                                 "are supported")
            content = "".join(texts)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [_template_tool_call(call, i)
                                     for i, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if (thinking := self.reasoning_content or self.reasoning) is not None:
            message["reasoning_content"] = thinking
        return message


def _template_tool_call(call: dict[str, Any], position: int) -> dict[str, Any]:
    """An earlier call as chat templates read it: the arguments as an object (OpenAI sends
    them as JSON text; templates write them with `tojson`), as vLLM passes them."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"messages: tool_calls[{position}] needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"messages: tool_calls[{position}].function.arguments is not "
                             f"JSON (got {shown(arguments, 60)})") from None
    return {**call, "function": {**function, "arguments": arguments}}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (engine.serving.tool_calls): the tools go to the chat template.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (Qwen3's `enable_thinking`).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: with a reasoning parser, false leaves the thinking out of the response.
    include_reasoning: bool = True
    # OpenAI's: how long a reasoning model thinks, as its chat template reads it (gpt-oss's
    # `Reasoning: low|medium|high`); refused for a template that does not read it.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"`{reserved[0]}` is not a template variable a request may set "
                             f"(it is an argument of the templating itself)")
        return value

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool-call schema read them."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def sample_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        # Not `or`: max_completion_tokens=0 is an error, not "unset".
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError",
            503: "ServiceUnavailableError"}.get(status, "ServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
