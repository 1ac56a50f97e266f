"""Reasoning models' thinking, split from their answer (`--reasoning-parser qwen3 |
deepseek_r1`): the text between `<think>` and `</think>` is `reasoning_content` (also sent as
vLLM's newer name, `reasoning`), the rest is `content`.

- `qwen3`: the output thinks only if it starts with `<think>` (with `enable_thinking: false`
  in `chat_template_kwargs`, Qwen3's template closes an empty think block in the prompt, and
  the output is all answer).
- `deepseek_r1`: the template opens the think block in the prompt, so the output is reasoning
  up to `</think>` (a leading `<think>` is dropped) and all of it if the block never closes.

Like the tool-call parsers, a parser re-reads the whole output as it grows; while streaming,
the first characters of a tag are held back until they turn out to be text.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.serving.held_text import held_from

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    # text[reasoning_start:reasoning_end] is the reasoning (empty when there is none).
    reasoning_start: int
    reasoning_end: int
    # text[content_start:] is the answer; None while the model is still thinking.
    content_start: int | None


class ReasoningParser:
    name = ""
    # Whether the output is reasoning from its first character, tag or not.
    opens_in_prompt = False

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        lead = len(text) - len(text.lstrip())
        begin = lead
        if text.startswith(START, lead):
            begin = lead + len(START)
        elif not self.opens_in_prompt:
            if not finished and START.startswith(text[lead:]):
                return ReasoningSplit(0, 0, None)  # may yet open a think block: wait
            return ReasoningSplit(0, 0, 0)  # no think block: all answer
        elif not finished and text[lead:] and START.startswith(text[lead:]):
            return ReasoningSplit(begin, begin, None)
        end = text.find(END, begin)
        if end >= 0:
            return ReasoningSplit(begin, end, end + len(END))
        if finished:
            return ReasoningSplit(begin, len(text), None)  # never closed: all reasoning
        return ReasoningSplit(begin, max(begin, held_from(text, END)), None)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}
