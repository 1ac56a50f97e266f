"""What a chat response's output is read for beside its text: tool calls, a reasoning model's
thinking, gpt-oss's harmony channels; and what each asks of the request's sampling parameters
and of the edge clock's first-answer stamp. Completions read none of these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.serving.harmony import answer_started as harmony_answer_started
from engine.serving.reasoning_parsers import ReasoningParser
from engine.serving.tool_calls.calling import ToolCalling


@dataclass(frozen=True)
class ChatReading:
    """How one chat request's output is read (engine.serving.openai_responses writes it)."""

    # What tool_choice asks, and the parser auto reads calls with (None: no tools, or harmony).
    tools: ToolCalling | None
    # The thinking split from the answer (None: not split, or harmony).
    reasoning: ReasoningParser | None
    # gpt-oss's harmony: its channels are the reasoning, the tool calls and the content, read
    # from the special tokens the output keeps (engine.serving.harmony).
    harmony: bool

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters the request samples with; a ValueError when tool_choice and a
        structured output both constrain it."""
        if self.tools is not None:
            params = _with_tool_calling(params, self.tools)
        if self.harmony:
            # The channels' markers are special tokens: the text must keep them.
            params = msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def answer_started(self) -> Callable[[RequestOutput], bool] | None:
        """Whether an output holds answer, for the edge clock's first-answer stamp; None: every
        output is answer."""
        if self.harmony:
            return _harmony_answer
        if self.reasoning is not None:
            return _answer_after_thinking(self.reasoning)
        return None


def _harmony_answer(out: RequestOutput) -> bool:
    """Whether a harmony output holds answer: content or a call, not only analysis."""
    return harmony_answer_started(out.text, out.finished)


def _answer_after_thinking(reasoning: ReasoningParser) -> Callable[[RequestOutput], bool]:
    """Whether an output holds answer: its thinking has closed."""
    return lambda out: reasoning.split(out.text, out.finished).content_start is not None


def _with_tool_calling(params: SamplingParams, tools: ToolCalling) -> SamplingParams:
    """The parameters a tool-calling request samples with: required and named functions held
    to their schema; a parser whose marker is a special token sees special tokens."""
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError(f"tool_choice {tools.mode} and a structured output "
                             "(response_format, structured_outputs or guided_*): give one")
        params = msgspec.structs.replace(params, structured_outputs=tools.constraint)
    if tools.parser is not None and tools.parser.keeps_special_tokens:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    return params
