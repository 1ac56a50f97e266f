"""What a chat request's `tools` and `tool_choice` ask of its output, and the calls it holds.

- `none` (or no tools): the output is plain text (the tools are still in the prompt, as vLLM
  renders them);
- `auto` (OpenAI's default with tools): the model decides; its text is read by the server's
  tool-call parser (`parsers`), and text that does not parse stays plain content;
- `required`: at least one call, constrained by structured outputs to a JSON list of `{"name":
  ..., "parameters": ...}` whose parameters match that tool's schema (one call at most with
  `parallel_tool_calls: false`), as vLLM does; a stream sends each call's id and name once
  written and its arguments as they are written;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, constrained to its parameters' schema; a stream sends the call's id and
  name with the first token (its first visible output: what its TTFT counts) and the arguments
  as they are written.

Whatever the mode, a call's arguments are JSON text (OpenAI's shape; a stream sends them in
fragments that add up to the whole call's, engine.serving.tool_calls.partial_json) and its id
is derived from the response's id, the choice and the call's position, so a stream and its
replay agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.serving.tool_calls.parsers import (PARSERS, FunctionCall, ParsedOutput, ToolParser,
                                               call_from_json, list_items, name_written,
                                               opening_arguments, raw_arguments)
from engine.serving.tool_calls.partial_json import ArgumentReaders
from engine.structured_output.params import StructuredOutputsParams

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolCalling:
    mode: Mode
    # auto: the format the model writes its calls in.
    parser: ToolParser | None = None
    # named: the function the output is the arguments of.
    function: str | None = None
    # required / named: the schema the output is held to.
    constraint: StructuredOutputsParams | None = None
    # required / named: the stream's reads of the call being written (auto: the parser's).
    arguments: ArgumentReaders = field(default_factory=ArgumentReaders, compare=False,
                                       repr=False)

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        """The content's end and the calls complete so far in the output `text`."""
        if self.mode == "auto":
            assert self.parser is not None
            return self.parser.parse(text, finished)
        if self.mode == "named":
            # The output is the call's arguments, whatever it holds: its name is known from
            # the first token (a stream sends it then), and arguments cut short (max_tokens)
            # stay the call's, as vLLM returns them (their settled part: what a stream sent).
            if not finished:
                return ParsedOutput(0, opening=self.function,
                                    opening_arguments=self.arguments.settled(text))
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                arguments = self.arguments.settled(text) or text
            else:  # as a stream sent it
                arguments = (self.arguments.canonical(text)
                             or json.dumps(value, ensure_ascii=False))
            return ParsedOutput(0, (FunctionCall(self.function or "", arguments),))
        # required: a JSON list of {"name": ..., "parameters": ...}, written in that order
        # (the schema's); each call counts once its object is complete, and a stream sends
        # the next one's name as soon as it is written.
        items, writing = list_items(text)
        calls = [call for call in (call_from_json(item, raw, self.arguments)
                                   for item, raw in items)
                 if call is not None]
        if not finished:
            return ParsedOutput(0, tuple(calls), name_written(writing),
                                opening_arguments(writing, self.arguments))
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            # Cut short (max_tokens): the calls written whole, and the one being written
            # with its arguments as far as they got (a named function's are kept so too).
            if (name := name_written(writing)) is not None:
                calls.append(FunctionCall(name, opening_arguments(writing, self.arguments)
                                          or raw_arguments(writing) or ""))
            return ParsedOutput(0, tuple(calls)) if calls else ParsedOutput(len(text))
        whole = list_items(text)[0] if isinstance(value, list) else []
        calls = [call for call in (call_from_json(item, raw, self.arguments)
                                   for item, raw in whole)
                 if call is not None]
        return ParsedOutput(0, tuple(calls)) if calls else ParsedOutput(len(text))

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        """OpenAI's: `tool_calls` when the model chose to call (auto, required); a named
        function's call ends with `stop`."""
        if made_calls and reason == "stop" and self.mode != "named":
            return "tool_calls"
        return reason


def tool_calling(tools: list[dict[str, Any]] | None, tool_choice: Any,
                 parallel_tool_calls: bool | None, parser: str | None) -> ToolCalling | None:
    """The request's tool calling (None: its output is plain text). ValueError naming the
    field that is wrong: a `tool_choice` without tools, a named function the tools lack, auto
    with no parser for this model."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError(f"tool_choice {_shown(tool_choice)} needs tools")
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if tool_choice is None:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if parser is None:
            raise ValueError("tool_choice auto needs a tool-call parser for this model: start "
                             "the server with --tool-call-parser (one of "
                             f"{', '.join(PARSERS)}); none could be read from its chat "
                             "template")
        return ToolCalling("auto", parser=PARSERS[parser]())
    if tool_choice == "required":
        items = [{"type": "object", "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": _parameters(function)}}
                 for name, function in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolCalling("required", constraint=_compact(schema))
    name = tool_choice.function.name
    if name not in functions:
        raise ValueError(f"tool_choice names function {name!r}, which tools does not define "
                         f"(they define {', '.join(map(repr, functions))})")
    return ToolCalling("named", function=name, constraint=_compact(_parameters(functions[name])))


def _compact(schema: dict[str, Any]) -> StructuredOutputsParams:
    # The calls are read by the client's code, not by a person: no whitespace to spend tokens
    # (and a turn's time) on.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _shown(value: Any) -> str:
    return repr(value if isinstance(value, str) else getattr(value, "type", value))


def call_id(request_id: str, choice: int, position: int) -> str:
    digest = hashlib.sha256(f"{request_id}/{choice}/{position}".encode()).hexdigest()[:24]
    return f"chatcmpl-tool-{digest}"


def call_body(call: FunctionCall, request_id: str, choice: int, position: int
              ) -> dict[str, Any]:
    """One entry of a message's `tool_calls` (a stream's delta adds its `index`)."""
    return {"id": call_id(request_id, choice, position), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}
