"""OpenAI's Responses API request (`POST /v1/responses`), read into the chat request the chat
route serves: `instructions` become a system message, `input` items become messages (a
`function_call` an assistant message's tool call, a `function_call_output` a tool message, a
`reasoning` item the next assistant message's `reasoning_content`), the flat `tools` and
`tool_choice` chat's nested ones, `text.format` a `structured_outputs` constraint,
`reasoning.effort` the template's `reasoning_effort`, `max_output_tokens` chat's
`max_completion_tokens`.

What is refused, and why, is in `REFUSED`: this server keeps no state between requests, so a
field that asks it to store a response or to read one back is a 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from pydantic import Field, ValidationError

from engine.sampling_params import MAX_LOGPROBS
from engine.serving.openai_protocol import ChatCompletionRequest, _RequestModel
from engine.serving.request_fields import asks_for_nothing, shown

# Field -> (the values that ask for nothing, why any other value is refused).
_STATELESS = ("this server keeps no responses (it is stateless, as a fleet's replicas must be): "
              "send the earlier turns as `input` items")
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), _STATELESS),
    "store": ((False,), "this server stores no responses: send `store: false` or leave it out"),
    "conversation": ((), _STATELESS),
    "background": ((False,), "background responses need a store to be fetched from"),
    "prompt": ((), "prompt templates are kept by OpenAI, not here"),
    "truncation": (("disabled",), "an input too long for the context is a 400, never cut"),
    "service_tier": (("auto", "default"), "this server has one tier"),
    "enable_response_messages": ((False,), "not built here"),
    "previous_input_messages": (([],), _STATELESS),
    # vLLM's request id, prefix-cache salt, disaggregated prefill and extension arguments.
    "request_id": ((), "the response's id is the server's"),
    "cache_salt": ((), "not built here"), "kv_transfer_params": ((), "not built here"),
    "mm_processor_kwargs": (({},), "this server takes text only"),
    "vllm_xargs": (({},), "not built here"),
}
# `include` values: logprobs switch on logprobs; the others name outputs of hosted tools and
# images this server never produces, or reasoning's encrypted content, which it does not
# encrypt (a reasoning item carries its text instead, and a next turn's input may send it back).
INCLUDE_LOGPROBS = "message.output_text.logprobs"
Include = Literal["message.output_text.logprobs", "reasoning.encrypted_content",
                  "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                  "file_search_call.results", "message.input_image.image_url",
                  "web_search_call.action.sources", "web_search_call.results"]


class RequestError(ValueError):
    """What is wrong with a Responses request, and the field to blame (`param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class FunctionTool(_RequestModel):
    """A function the model may call (the Responses API's flat form)."""

    # Checked by `chat_request`: a hosted tool's type is refused by name.
    type: str
    name: str | None = Field(default=None, min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_RequestModel):
    """`text.format`: plain text, a JSON object, or JSON for a schema (the fields flat)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_RequestModel):
    format: TextFormat | None = None
    # OpenAI's hint for how long an answer should be: not built here (null asks nothing).
    verbosity: str | None = None


class ReasoningConfig(_RequestModel):
    # `minimal` is read as `low`, as vLLM reads it.
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    # The reasoning item's summary is the model's thinking itself, whatever this says: nothing
    # here summarizes it.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_RequestModel):
    model: str | None = None
    # Text (one user message) or a list of items: checked by `messages_from_input`, whose
    # errors name the item and its field.
    input: Any
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    # "none", "auto", "required" or {"type": "function", "name": ...}: checked by
    # `chat_request`, which names what else was sent (a hosted tool's choice).
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    include: list[Include] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    # Accepted without effect: tags OpenAI keeps with a stored response; an end user's id.
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extensions on this route.
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # sloserve: the TTFT and TPOT objectives (milliseconds), as on the other routes.
    ttft_slo_ms: float | None = Field(default=None, ge=0)
    tpot_slo_ms: float | None = Field(default=None, gt=0)
    priority: int = 0

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ()) or bool(self.top_logprobs)


def refused_field(body: ResponsesRequest) -> tuple[str, str] | None:
    """The first field of `body` that asks for what this server does not do, with the message
    that says so; None when there is none."""
    for name, value in (body.model_extra or {}).items():
        entry = REFUSED.get(name)
        if entry is not None and not asks_for_nothing(value, entry[0]):
            return name, f"`{name}` is not supported (got {shown(value, 60)}): {entry[1]}"
    return None


# ---- input items ------------------------------------------------------------------------------

class _Part(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


class InputText(_Part, tag="input_text"):
    text: str


class OutputText(_Part, tag="output_text"):
    text: str


class Refusal(_Part, tag="refusal"):
    refusal: str


Part = InputText | OutputText | Refusal


class _Item(msgspec.Struct, tag_field="type", forbid_unknown_fields=False):
    pass


class MessageItem(_Item, tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(_Item, tag="function_call"):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item, tag="function_call_output"):
    call_id: str
    output: str | list[Part]


class _ReasoningText(msgspec.Struct, forbid_unknown_fields=False):
    """A reasoning item's `summary_text` or `reasoning_text` part."""

    text: str


class ReasoningItem(_Item, tag="reasoning"):
    summary: list[_ReasoningText] = []
    content: list[_ReasoningText] | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _text_of(parts: str | list[Part]) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in parts)


def _items(raw: list[Any]) -> list[Item]:
    """`input`'s items, checked; RequestError naming the first that is wrong (its position and
    field)."""
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise RequestError("input", f"input[{i}]: an item must be an object, got "
                                        f"{shown(item, 40)}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind is None:
            raise RequestError("input", f"input[{i}]: an item needs a `type` (or a `role`, for "
                                        "a message)")
        if kind == "item_reference":
            raise RequestError("input", f"input[{i}]: item_reference is not supported: "
                                        f"{_STATELESS}")
        if kind not in ITEM_TYPES:
            raise RequestError("input", f"input[{i}].type: unknown item type {shown(kind, 40)}; "
                                        f"this server takes {', '.join(ITEM_TYPES)}")
    # A message may leave its type out (the SDK's EasyInputMessage).
    typed = [item if "type" in item else {**item, "type": "message"} for item in raw]
    try:
        return msgspec.convert(typed, list[Item])
    except msgspec.ValidationError as exc:
        # msgspec says "Expected `str`, got `int` - at `$[0].content`": the path goes first.
        message, _, where = str(exc).partition(" - at `")
        where = where.rstrip("`").replace("$", "input", 1) if where else "input"
        if re.search(r"\.(content|output)\[\d+\]\.type$", where):  # an image, a file, audio
            message += " (this server takes text parts only: input_text, output_text, refusal)"
        raise RequestError("input", f"{where}: {message[:1].lower()}{message[1:]}") from None


def messages_from_input(instructions: str | None, given: Any) -> list[dict[str, Any]]:
    """The chat messages for `instructions` and `input` (RequestError naming what is wrong).
    Consecutive function calls (and the message or reasoning before them) are one assistant
    turn, as chat templates expect a turn's calls in one message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise RequestError("input", f"input: must be text or a list of items, got "
                                    f"{shown(given, 40)}")
    if not given:
        raise RequestError("input", "input: must not be empty")
    # A reasoning item's text, for the assistant turn after it (dropped if none follows).
    thinking: str | None = None
    for item in _items(given):
        last = messages[-1] if messages else None
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            thinking = (thinking or "") + "".join(p.text for p in parts)
        elif isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text_of(item.content)})
            if item.role == "assistant" and thinking is not None:
                messages[-1]["reasoning_content"], thinking = thinking, None
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thinking is not None:
                    messages[-1]["reasoning_content"], thinking = thinking, None
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text_of(item.output)})
    return messages


# ---- the chat request -------------------------------------------------------------------------

def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `body`. RequestError naming the field that is wrong."""
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages_from_input(body.instructions, body.input),
        "max_completion_tokens": body.max_output_tokens, "stream": body.stream,
        # Responses always report usage: streams in their last event.
        "stream_options": {"include_usage": True},
        "seed": body.seed, "stop": body.stop, "ignore_eos": body.ignore_eos,
        "logit_bias": body.logit_bias, "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "repetition_penalty": body.repetition_penalty,
        "structured_outputs": body.structured_outputs,
        "chat_template_kwargs": body.chat_template_kwargs,
        "ttft_slo_ms": body.ttft_slo_ms, "tpot_slo_ms": body.tpot_slo_ms,
        "priority": body.priority, "parallel_tool_calls": body.parallel_tool_calls}
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    if body.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    for i, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise RequestError("tools", f"tools[{i}].type: only function tools are supported "
                                        f"(got {shown(tool.type, 40)}): this server runs no "
                                        "hosted tools")
        if tool.name is None:
            raise RequestError("tools", f"tools[{i}]: a function tool needs a `name`")
    if body.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in body.tools]
    fields["tool_choice"] = _chat_tool_choice(body.tool_choice)
    if body.reasoning is not None and body.reasoning.effort is not None:
        effort = body.reasoning.effort
        fields["reasoning_effort"] = "low" if effort == "minimal" else effort
    if body.text is not None and body.text.verbosity is not None:
        raise RequestError("text.verbosity", f"text.verbosity is not supported (got "
                                             f"{shown(body.text.verbosity, 20)})")
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type != "text":
        if body.structured_outputs is not None:
            raise RequestError("text.format", "text.format and structured_outputs: give one "
                                              "way to constrain the output")
        if text_format.type == "json_schema" and text_format.schema_ is None:
            raise RequestError("text.format", "text.format: type json_schema needs `schema` "
                                              "(the JSON schema the output must match)")
        # As vLLM holds it: JSON without whitespace beyond ", " and ": " (no tokens, and no
        # turn's time, spent on padding a program reads past).
        fields["structured_outputs"] = (
            {"json_object": True} if text_format.type == "json_object" else
            {"json": text_format.schema_, "disable_any_whitespace": True})
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # a value the chat route takes in a narrower form
        error = exc.errors()[0]
        first, *rest = [str(p) for p in error.get("loc", ())] or ["input"]
        param = _RENAMED.get(first, first)
        raise RequestError(param, f"{'.'.join([param, *rest])}: {error.get('msg')}") from None


def _chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """Chat's form of `tool_choice` (a named function nests its name)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("tool_choice", "tool_choice: 'none', 'auto', 'required' or {\"type\": "
                                      "\"function\", \"name\": ...} (this server runs no hosted "
                                      f"tools), got {shown(choice, 60)}")


# The chat request's names for the Responses request's fields, in what it says about them.
_RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "messages": "input", "response_format": "text.format",
            "reasoning_effort": "reasoning.effort"}


def as_responses_error(message: str, param: str | None) -> tuple[str, str | None]:
    """An error from the chat route (its message and the field it blames), naming the field
    as this route's request names it."""
    if param is None or param not in _RENAMED:
        return message, param
    if message.startswith(f"{param}:"):
        message = _RENAMED[param] + message[len(param):]
    return message, _RENAMED[param]
