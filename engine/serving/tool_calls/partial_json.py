"""A call's arguments while the model writes them: the part of their final text that is already
certain, so that a stream sends `function.arguments` fragment by fragment, as OpenAI and vLLM
stream it.

A call's arguments go out re-serialized (`canonical`: `, ` and `: ` between elements, the
model's other whitespace and its escapes undone, non-ASCII kept), not as the model's raw text.
`settled_prefix` reads the raw text written so far and returns the longest prefix of that
serialization which no continuation can change, so the fragments a stream sends add up to
exactly the arguments of the finished call (what the openai SDK accumulates is what a
non-streamed response holds). Read token by token, not as a Python dict: a key the model
writes twice stays twice, in both (a client's JSON reader keeps the last, as `json.loads`).

Held back until they are whole: a key, a number (`12` may go on to `12.5`; `1e5` is written
`100000.0`), a literal, an escape cut in half, a lone high surrogate (its pair would make one
character with it). Nothing the model has not written is added: no closing quote or bracket
before the model's own. Text that stops being JSON settles nothing more.

A stream reads the same arguments again at every update, each time a little longer:
`SettledReader` resumes where its last read stopped when the text continues the one it read
(the pieces read so far are kept, a string value's characters decoded as they come), so a
stream's reads cost its arguments' length once, not once per update (read afresh each time, 5
KB of small fields cost a stream 1.1 s of the API server's loop on this project's CPU, 1.6 ms
for the last update; read on, 13 ms: `python -m bench.diagnostics.tool_call_stream`).
`ArgumentReaders` keeps a request's readers: one per call being written, per choice.
"""

from __future__ import annotations

import json
import re
from enum import Enum

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# A JSON string's body up to its closing quote: plain characters and whole escapes.
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*')
# An escape the text ends in the middle of.
_CUT_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_AFTER_NUMBER = frozenset(" \t\n\r,}]")
_LITERALS = ("true", "false", "null")


class _Next(Enum):
    """What the reader expects next."""
    OBJECT = "the arguments' opening brace"
    FIRST_KEY = "a key or the object's end"
    KEY = "a key"
    COLON = "a colon"
    FIRST_ITEM = "a value or the list's end"
    VALUE = "a value"
    AFTER_VALUE = "a comma or the container's end"
    NOTHING = "nothing: the object is whole, or the text is not JSON from here on"


class SettledReader:
    """The settled serialization of a JSON object's text as the text grows: `read(text)` goes on
    from where the last read stopped when `text` continues the text it read, and starts over
    otherwise. The result is the same either way (tests/entrypoints/test_partial_json.py)."""

    def __init__(self) -> None:
        self._start_over("")

    @property
    def text(self) -> str:
        """The text last read."""
        return self._text

    @property
    def whole(self) -> bool:
        """Whether the text last read holds a whole object (what follows it is ignored)."""
        return self._whole

    def read(self, text: str) -> str:
        if not text.startswith(self._text):
            self._start_over(text)
        self._text = text
        self._advance()
        if len(self._pieces) > 1:  # joined once, not again at every read
            self._pieces = ["".join(self._pieces)]
        settled = self._pieces[0] if self._pieces else ""
        if self._string_at >= 0:  # a string value being written: its characters so far
            if len(self._string) > 1:
                self._string = ["".join(self._string)]
            settled += '"' + "".join(self._string)
        return settled

    def _start_over(self, text: str) -> None:
        self._text = text
        self._at = 0  # where the next piece starts (a piece not yet whole is read again)
        self._next = _Next.OBJECT
        self._whole = False
        self._closers: list[str] = []  # the open containers' closing brackets, innermost last
        self._pieces: list[str] = []  # the serialization of the pieces read whole
        # A string value being read: where its unread body starts (-1: none), and its
        # characters so far, serialized (no quotes).
        self._string_at = -1
        self._string: list[str] = []

    def _emit(self, piece: str, at: int, then: _Next) -> None:
        self._pieces.append(piece)
        self._at, self._next = at, then

    def _after_value(self) -> _Next:
        if self._closers:
            return _Next.AFTER_VALUE
        self._whole = True
        return _Next.NOTHING

    def _advance(self) -> None:
        """Reads pieces until one is not whole yet or the text stops being JSON."""
        text = self._text
        while self._next is not _Next.NOTHING:
            if self._string_at >= 0:
                if not self._read_string_value():
                    return
                continue
            at = _WHITESPACE.match(text, self._at).end()  # type: ignore[union-attr]
            if at == len(text):
                return
            char, expected = text[at], self._next
            if expected is _Next.OBJECT:
                if char != "{":
                    self._next = _Next.NOTHING  # not an object: nothing settles
                    return
                self._closers.append("}")
                self._emit("{", at + 1, _Next.FIRST_KEY)
            elif expected in (_Next.FIRST_KEY, _Next.FIRST_ITEM, _Next.AFTER_VALUE) \
                    and char == self._closers[-1]:
                self._closers.pop()
                self._emit(char, at + 1, self._after_value())
            elif expected is _Next.AFTER_VALUE:
                if char != ",":
                    self._next = _Next.NOTHING
                    return
                self._emit(", ", at + 1,
                           _Next.KEY if self._closers[-1] == "}" else _Next.VALUE)
            elif expected in (_Next.FIRST_KEY, _Next.KEY):
                if char != '"':
                    self._next = _Next.NOTHING
                    return
                end = _STRING_BODY.match(text, at + 1).end()  # type: ignore[union-attr]
                if end == len(text) or text[end] != '"':
                    if not self._may_continue(end):
                        self._next = _Next.NOTHING
                    return  # a key counts once whole
                self._emit(_serialized(text[at:end + 1]), end + 1, _Next.COLON)
            elif expected is _Next.COLON:
                if char != ":":
                    self._next = _Next.NOTHING
                    return
                self._emit(": ", at + 1, _Next.VALUE)
            elif char in "{[":
                self._closers.append("}" if char == "{" else "]")
                self._emit(char, at + 1, _Next.FIRST_KEY if char == "{" else _Next.FIRST_ITEM)
            elif char == '"':
                self._at, self._string_at, self._string = at, at + 1, []
            elif not self._read_scalar(at):
                return

    def _may_continue(self, end: int) -> bool:
        """Whether a string body that stops at `end` short of its closing quote may still go
        on: the text ends there, or in the middle of an escape."""
        return end == len(self._text) or _CUT_ESCAPE.fullmatch(self._text, end) is not None

    def _read_string_value(self) -> bool:
        """Reads on in the string value being written; True once its closing quote is read."""
        text, start = self._text, self._string_at
        body_end = end = _STRING_BODY.match(text, start).end()  # type: ignore[union-attr]
        closed = end < len(text) and text[end] == '"'
        if end > start:
            body = text[start:end]
            chars = json.loads(f'"{body}"') if "\\" in body else body
            if not closed and "\ud800" <= chars[-1] <= "\udbff":
                # A high surrogate waits for its pair, which would make one character with it.
                chars = chars[:-1]
                end -= 6 if text.startswith("\\u", end - 6) else 1
            self._string.append(json.dumps(chars, ensure_ascii=False)[1:-1]
                                if chars is not body else body)
            self._string_at = end
        if closed:
            self._string_at = -1
            self._emit('"' + "".join(self._string) + '"', end + 1, self._after_value())
            return True
        if not self._may_continue(body_end):
            # Not JSON from here on: what was read of the string stays settled.
            self._pieces.append('"' + "".join(self._string))
            self._string_at, self._next = -1, _Next.NOTHING
        return False

    def _read_scalar(self, at: int) -> bool:
        """Reads a number or a literal at `at`; False when it is not whole yet (or not one)."""
        text = self._text
        number = _NUMBER.match(text, at)
        if number is not None and number.end() > at:
            if number.end() == len(text) or text[number.end()] not in _AFTER_NUMBER:
                return False  # more digits, a fraction or an exponent may follow
            written = number.group()
            self._emit(written if written.isdigit() else json.dumps(json.loads(written)),
                       number.end(), self._after_value())
            return True
        for literal in _LITERALS:
            if text.startswith(literal, at):
                self._emit(literal, at + len(literal), self._after_value())
                return True
        return False


def _serialized(string_text: str) -> str:
    """A whole JSON string's text as the one serialization writes it (without escapes, as it
    was written: what needs one is not in a string's body unescaped)."""
    if "\\" not in string_text:
        return string_text
    return json.dumps(json.loads(string_text), ensure_ascii=False)


class ArgumentReaders:
    """A request's readers of arguments being written (one per call being written, per choice):
    each read goes on with the reader whose text the new text continues, the longest such."""

    def __init__(self, size: int = 8) -> None:
        self._readers: list[SettledReader] = []
        self._size = size

    def settled(self, raw: str) -> str:
        """settled_prefix(raw), read on from where an earlier read of its start stopped."""
        return self._reader_for(raw).read(raw)

    def canonical(self, raw: str) -> str | None:
        """canonical(raw), read on so too: a call that completed is read to its end once, not
        again at each update of the stream after it."""
        reader = self._reader_for(raw)
        serialized = reader.read(raw)
        return serialized if reader.whole else None

    def _reader_for(self, raw: str) -> SettledReader:
        reader = max((r for r in self._readers if raw.startswith(r.text)),
                     key=lambda r: len(r.text), default=None)
        if reader is None:
            reader = SettledReader()
            self._readers.append(reader)
            if len(self._readers) > self._size:
                self._readers.pop(0)
        return reader


def settled_prefix(raw: str) -> str:
    """The settled part of the serialization of the JSON object `raw` begins (text after it is
    ignored). Empty when `raw` does not start an object: such arguments go out whole."""
    return SettledReader().read(raw)


def canonical(raw: str) -> str | None:
    """The whole serialization of the JSON object `raw` begins with (what follows it ignored),
    or None when `raw` does not begin a whole object."""
    reader = SettledReader()
    serialized = reader.read(raw)
    return serialized if reader.whole else None
