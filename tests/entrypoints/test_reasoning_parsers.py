"""Thinking split from the answer (engine/serving/reasoning_parsers.py), as a stream sees the
output grow and at its end."""

from __future__ import annotations

from engine.serving.reasoning_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

THOUGHT = "<think>\nLet me see.\n</think>\n\nParis."


def _parts(split, text):
    reasoning = text[split.reasoning_start:split.reasoning_end]
    content = None if split.content_start is None else text[split.content_start:]
    return reasoning, content


def test_qwen3_splits_a_think_block_and_holds_tags_back_while_streaming():
    parser = Qwen3ReasoningParser()
    assert _parts(parser.split(THOUGHT, True), THOUGHT) == ("\nLet me see.\n", "\n\nParis.")
    sent_reasoning = ""
    for n in range(len(THOUGHT) + 1):
        split = parser.split(THOUGHT[:n], False)
        reasoning, content = _parts(split, THOUGHT[:n])
        assert "<" not in reasoning  # never a tag's first characters
        assert reasoning.startswith(sent_reasoning)  # only ever grows
        sent_reasoning = reasoning
        if n < THOUGHT.index("</think>") + len("</think>"):
            assert content is None  # still thinking
    # An output that does not open a think block is all answer (enable_thinking: false).
    plain = "Paris."
    assert _parts(parser.split(plain, True), plain) == ("", "Paris.")
    assert parser.split("<th", False).content_start is None  # may yet open one
    assert parser.split("Pa", False).content_start == 0
    # Cut short while thinking: all reasoning, no answer.
    cut = "<think>\nLet me"
    assert _parts(parser.split(cut, True), cut) == ("\nLet me", None)


def test_deepseek_r1_thinks_from_the_first_character():
    parser = DeepSeekR1ReasoningParser()
    text = "Let me see.\n</think>\n\nParis."
    assert _parts(parser.split(text, True), text) == ("Let me see.\n", "\n\nParis.")
    assert _parts(parser.split(THOUGHT, True), THOUGHT) == ("\nLet me see.\n", "\n\nParis.")
    assert _parts(parser.split("Let me", True), "Let me") == ("Let me", None)
    assert _parts(parser.split("Let me </thi", False), "Let me </thi") == ("Let me ", None)
