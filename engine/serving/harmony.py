"""gpt-oss's harmony format, read out of an assistant turn's text.

A harmony turn is a sequence of messages, each a header, `<|message|>` and a body that ends at
`<|end|>`, `<|call|>` or `<|return|>` (the last two end the turn: gpt-oss stops on them):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Rome"}<|call|>

The prompt ends with `<|start|>assistant`, so the output's first header has no role. A header
names the message's channel (`analysis`, `commentary`, `final`), perhaps its recipient
(`to=functions.NAME`, after the role or after the channel) and its content type (`json`,
often after `<|constrain|>`). How each reaches the OpenAI API, as vLLM's `openai_gptoss`
parsers map them:

- `analysis` without a recipient: the reasoning (`reasoning_content`);
- a recipient `functions.NAME` on any channel: a tool call of NAME, its body the arguments;
- `final`, and `commentary` without a recipient (a preamble the user is meant to see): the
  content;
- other recipients (gpt-oss's built-in browser and python tools): nothing, since this server
  runs no built-in tools.

Messages of one kind are joined by a newline. The reading re-reads the whole output as it grows
(the other parsers do too); while streaming, a message counts once its header is whole, and the
first characters of a marker at the end of its body are held back until they turn out to be
text. Every string it returns only grows as the output does, so a stream's deltas add up to the
whole response's message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.serving.held_text import held_from
from engine.serving.tool_calls.parsers import FunctionCall
from engine.serving.tool_calls.partial_json import ArgumentReaders

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
MARKERS = (START, MESSAGE, CHANNEL, CONSTRAIN, *TERMINATORS)
FUNCTIONS = "functions."
# vLLM's names for harmony's parsers (`--reasoning-parser`, `--tool-call-parser`); a chat
# template that writes harmony turns them on by itself.
HARMONY_REASONING, HARMONY_TOOLS = "openai_gptoss", "openai"


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str | None
    # `functions.get_weather`, `browser.search`; None for the user.
    recipient: str | None
    content_type: str | None
    body: str
    # The body has ended (a terminator, or the end of a finished output).
    complete: bool

    @property
    def function(self) -> str | None:
        """The function this message calls, when it is a call."""
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return self.recipient[len(FUNCTIONS):]
        return None


def _read_header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header: `[ROLE [to=R]]<|channel|>CHANNEL [to=R]
    [<|constrain|>]TYPE`."""
    role_part, _, channel_part = header.partition(CHANNEL)
    words = channel_part.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in [*role_part.split(), *words] if w.startswith("to=")), None)
    rest = [w for w in words if not w.startswith("to=")]
    channel = rest[0] if rest else None
    content_type = rest[1] if len(rest) > 1 else None
    return channel, recipient, content_type


def _first_terminator(text: str, start: int) -> tuple[int, str]:
    found = [(at, marker) for marker in TERMINATORS if (at := text.find(marker, start)) >= 0]
    return min(found) if found else (-1, "")


def _held_back(text: str, start: int) -> int:
    """Where the body from ``start`` is surely text: before a trailing marker's first
    characters."""
    return max(start, min(held_from(text, marker) for marker in TERMINATORS))


def parse_messages(text: str, finished: bool) -> list[HarmonyMessage]:
    """The messages of an assistant turn's output so far; the last may be incomplete (its body
    being written). A header still being written is no message yet."""
    messages: list[HarmonyMessage] = []
    at = 0
    while at < len(text):
        if messages:
            begin = text.find(START, at)
            if begin < 0:
                break  # nothing after the last message but what is not a message
            at = begin + len(START)
        opened = text.find(MESSAGE, at)
        if opened < 0:
            break
        channel, recipient, content_type = _read_header(text[at:opened])
        body_start = opened + len(MESSAGE)
        end, terminator = _first_terminator(text, body_start)
        if end < 0:
            body_end = len(text) if finished else _held_back(text, body_start)
            messages.append(HarmonyMessage(channel, recipient, content_type,
                                           text[body_start:body_end], finished))
            break
        messages.append(HarmonyMessage(channel, recipient, content_type, text[body_start:end],
                                       True))
        at = end + len(terminator)
    return messages


@dataclass(frozen=True)
class HarmonyOutput:
    """An output as the API gives it: what each part holds so far."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[FunctionCall, ...] = ()
    # The function of the call being written, and the settled start of its arguments.
    opening: str | None = None
    opening_arguments: str = ""
    # The output has a message at all (a finished output with none is all content).
    has_messages: bool = False


def _arguments(body: str, readers: ArgumentReaders) -> str:
    """A finished call's arguments as JSON text, serialized as a stream sent them where it did;
    a body that is not a JSON object stays as written (vLLM passes it on too)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()
    if not isinstance(value, dict):
        return body.strip()
    streamed = readers.canonical(body.lstrip())
    if streamed is not None and json.loads(streamed) == value:
        return streamed
    return json.dumps(value, ensure_ascii=False)


def read_output(text: str, finished: bool, readers: ArgumentReaders) -> HarmonyOutput:
    """The reasoning, content and tool calls of an output so far (``readers``: the choice's
    reads of the arguments being written, which a stream goes on from)."""
    messages = parse_messages(text, finished)
    if not messages:
        if finished:  # the model wrote no harmony at all: its text is the answer
            return HarmonyOutput(content=text)
        return HarmonyOutput()
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[FunctionCall] = []
    opening, opening_arguments = None, ""
    for message in messages:
        if (name := message.function) is not None:
            if message.complete:
                calls.append(FunctionCall(name, _arguments(message.body, readers)))
            else:
                opening = name
                opening_arguments = readers.settled(message.body.lstrip())
        elif message.recipient is not None:
            continue  # a built-in tool's call: not run here
        elif message.channel == "analysis":
            reasoning.append(message.body)
        elif message.channel in ("final", "commentary"):
            content.append(message.body)
    return HarmonyOutput("\n".join(reasoning), "\n".join(content), tuple(calls), opening,
                         opening_arguments, has_messages=True)


def answer_started(text: str, finished: bool) -> bool:
    """Whether an output holds answer yet: content or a tool call, not only reasoning."""
    output = read_output(text, finished, ArgumentReaders())
    return bool(output.content or output.calls or output.opening)


def renders_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's does)."""
    return bool(template) and CHANNEL in template and MESSAGE in template
