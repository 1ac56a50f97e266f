"""The tool-call formats models write, read out of their output text.

Each parser reads the whole output so far (a stream reads it again as it grows; a call's
arguments are read on from the last read, partial_json.ArgumentReaders): `content_end` is
how far the text is surely content (a tool call starts after it, or may: a marker's first
characters are held back), `calls` the calls complete so far, `opening` the name of the call
being written, once written, and `opening_arguments` what of its arguments is settled
(engine.serving.tool_calls.partial_json: a stream sends them fragment by fragment); at the end
(`finished`), a call that does not parse makes the whole output plain content, as vLLM falls
back, never an error (a stream that sent that call's name has sent it: vLLM's streams do the
same).

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after any content.
- `llama3_json` (Llama 3.1+): the output is the calls, `{"name": ..., "parameters": {...}}`,
  separated by `;`, after an optional `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (the marker is
  a special token: requests keep special tokens in the text, `skip_special_tokens: false`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.serving.held_text import held_from
from engine.serving.tool_calls.partial_json import ArgumentReaders


@dataclass(frozen=True)
class FunctionCall:
    name: str
    # The arguments as JSON text, OpenAI's shape.
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    # The text up to where tool calls begin (all of it when there are none).
    content_end: int
    calls: tuple[FunctionCall, ...] = ()
    # The function of the call being written after `calls`, once its name is (a named function
    # from the first token, a parsed format once the name is written): a stream sends its id
    # and name then, and its arguments as they settle.
    opening: str | None = None
    # The settled start of that call's arguments (a prefix of their text once the call is
    # complete; empty when they are not an object being written after the name).
    opening_arguments: str = ""


# A call object's start, its name written whole: `{"name": "get_weather"`.
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# What comes between the name and the arguments, in the formats' call objects.
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"(arguments|parameters)"\s*:\s*')


def name_written(text: str) -> str | None:
    """The function name at the start of a call object still being written, once its string
    is closed: a stream sends the call's id and name then, before its arguments (vLLM does
    too), so the name is the turn's first visible output. None before that, or when the
    object does not start with its name."""
    match = _NAME_FIRST.match(text)
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"')
    except json.JSONDecodeError:
        return None


def raw_arguments(text: str) -> str | None:
    """The raw text from the start of the arguments' value on, in a call object that starts
    with its name and has its arguments next; None in any other object."""
    name = _NAME_FIRST.match(text)
    key = _ARGUMENTS_KEY.match(text, name.end()) if name is not None else None
    return text[key.end():] if key is not None else None


def opening_arguments(text: str, readers: ArgumentReaders) -> str:
    """The settled start of the arguments of the call object being written in `text`, read on
    by `readers` from where the last read of the same call stopped."""
    raw = raw_arguments(text)
    return readers.settled(raw) if raw is not None else ""


def call_from_json(value: Any, raw: str, readers: ArgumentReaders) -> FunctionCall | None:
    """A call from a decoded JSON object (its arguments under `arguments`, or `parameters` as
    Llama 3 writes them), or None when it is not one. `raw`, the object's text: its arguments
    are serialized as a stream sent them (partial_json.canonical, read on by `readers` from
    the stream's last read of them), where they mean the same."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    written = raw_arguments(raw)
    if written is not None and (streamed := readers.canonical(written)) is not None:
        if json.loads(streamed) == arguments:
            text = streamed
    return FunctionCall(value["name"], text)


class ToolParser:
    """One request's parser (a stream's reads of a call's arguments go on from the last)."""
    name = ""
    # What the parser needs the text to keep (mistral's marker is a special token).
    keeps_special_tokens = False

    def __init__(self) -> None:
        self.arguments = ArgumentReaders()

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        raise NotImplementedError


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(self.OPEN)
        if start < 0:
            return ParsedOutput(len(text) if finished else held_from(text, self.OPEN))
        calls: list[FunctionCall] = []
        at = start
        while (begin := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, begin)
            if end < 0 and not finished:  # still being written
                writing = text[begin + len(self.OPEN):]
                return ParsedOutput(start, tuple(calls), name_written(writing),
                                    opening_arguments(writing, self.arguments))
            body = text[begin + len(self.OPEN):end if end >= 0 else len(text)]
            try:
                call = call_from_json(json.loads(body), body, self.arguments)
            except json.JSONDecodeError:
                call = None
            if call is None:
                if finished:
                    return ParsedOutput(len(text))  # malformed: plain text, as vLLM
                break
            calls.append(call)
            if end < 0:
                break
            at = end + len(self.CLOSE)
        # Content is what came before the first call (text between or after calls is not).
        return ParsedOutput(start, tuple(calls))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        stripped = text.lstrip()
        body = stripped[len(self.TAG):] if stripped.startswith(self.TAG) else stripped
        could_be_call = (body.lstrip().startswith("{") or stripped.startswith(self.TAG)
                         or (not finished and (not stripped or self.TAG.startswith(stripped))))
        if not could_be_call:
            return ParsedOutput(len(text))
        if not finished:
            # The calls are known once the output ends; the first one's name and arguments
            # before that.
            return ParsedOutput(0, opening=name_written(body),
                                opening_arguments=opening_arguments(body, self.arguments))
        calls: list[FunctionCall] = []
        decoder, at = json.JSONDecoder(), 0
        body = body.strip()
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ParsedOutput(len(text))
            call = call_from_json(value, body[at:end], self.arguments)
            at = end
            if call is None:
                return ParsedOutput(len(text))
            calls.append(call)
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:]
            at = len(body) - len(rest.lstrip())
        if not calls:
            return ParsedOutput(len(text))
        return ParsedOutput(0, tuple(calls))


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str, finished: bool) -> ParsedOutput:
        start = text.find(self.MARKER)
        if start < 0:
            return ParsedOutput(len(text) if finished else held_from(text, self.MARKER))
        listed = text[start + len(self.MARKER):]
        if not finished:
            # The calls are known once the output ends; the first one's name and arguments
            # before that.
            first = listed.lstrip().removeprefix("[")
            return ParsedOutput(start, opening=name_written(first),
                                opening_arguments=opening_arguments(first, self.arguments))
        try:
            value = json.loads(listed)
        except json.JSONDecodeError:
            return ParsedOutput(len(text))
        if isinstance(value, list):
            items = list_items(listed)[0]
        else:
            items = [(value, listed)]
        calls = [call_from_json(item, raw, self.arguments) for item, raw in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(len(text))
        return ParsedOutput(start, tuple(c for c in calls if c is not None))


def list_items(text: str) -> tuple[list[tuple[Any, str]], str]:
    """The items of a JSON list being written that are whole, each with its text, and the text
    of the one after them (empty when none is begun)."""
    body = text.lstrip()
    if not body.startswith("["):
        return [], ""
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        rest = body[at:].lstrip()
        if rest.startswith(","):
            rest = rest[1:].lstrip()
        if not rest or rest.startswith("]"):
            return items, ""
        begin = len(body) - len(rest)
        try:
            item, at = decoder.raw_decode(body, begin)
        except json.JSONDecodeError:
            return items, rest
        items.append((item, body[begin:at]))


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser,
                                                             MistralParser)}
# What each format's chat template writes: a parser is picked when exactly one is found.
_TEMPLATE_SIGNS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>",),
                   "mistral": ("[TOOL_CALLS]",)}


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's tool format says, when exactly one fits; else None."""
    if not template:
        return None
    found = [name for name, signs in _TEMPLATE_SIGNS.items()
             if any(sign in template for sign in signs)]
    return found[0] if len(found) == 1 else None
