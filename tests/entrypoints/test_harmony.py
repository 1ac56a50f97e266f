"""Reading gpt-oss's harmony turns (engine.serving.harmony): each channel to its API part, the
recipient where either header places it, built-in tools' calls left out, a turn with no harmony
at all, and — read at every prefix of a turn, as a stream reads it — parts that only grow and
never show a marker's characters."""

from __future__ import annotations

import json

import pytest

from engine.serving.harmony import (MARKERS, answer_started, parse_messages, read_output,
                                    renders_harmony)
from engine.serving.tool_calls.partial_json import ArgumentReaders
from tests.utils.harmony_template import ANSWER, TURN


def _read(text: str, finished: bool = True):
    return read_output(text, finished, ArgumentReaders())


def test_each_channel_goes_to_its_part() -> None:
    messages = parse_messages(TURN, finished=True)
    assert [(m.channel, m.recipient, m.content_type) for m in messages] == [
        ("analysis", None, None), ("commentary", None, None),
        ("commentary", "functions.get_weather", "json")]
    assert all(m.complete for m in messages)
    out = _read(TURN)
    assert out.reasoning == "The user wants the weather in Rome."
    assert out.content == "Let me look that up."
    (call,) = out.calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Rome", "unit": "C"}
    answer = _read(ANSWER)
    assert (answer.reasoning, answer.content, answer.calls) == (
        "It is sunny.", "Sunny, 24 C in Rome.", ())


def test_a_recipient_after_the_role_and_messages_of_one_kind_joined() -> None:
    text = ("<|channel|>analysis<|message|>First.<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>Second.<|end|>"
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
            '{"zone": "CET"}<|call|>')
    out = _read(text)
    assert out.reasoning == "First.\nSecond."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_time", {"zone": "CET"})]


def test_built_in_tools_and_a_turn_without_harmony() -> None:
    browsing = ("<|channel|>analysis<|message|>Search.<|end|>"
                "<|start|>assistant<|channel|>analysis to=browser.search<|message|>"
                '{"query": "rome"}<|call|>')
    out = _read(browsing)
    assert out.reasoning == "Search." and out.calls == () and out.content == ""
    # A model that writes plain text: all of it is the answer, once it has ended.
    assert _read("Just text.").content == "Just text."
    assert _read("Just text.", finished=False).content == ""
    # Cut short (max_tokens) in the middle of a call: the call as far as it was written, as
    # the other formats return one.
    cut = _read(TURN[:TURN.index('"unit"')], finished=True)
    assert cut.content == "Let me look that up." and cut.calls[0].name == "get_weather"
    assert cut.calls[0].arguments == '{"city": "Rome",'


def test_arguments_that_are_not_an_object_stay_as_written() -> None:
    text = "<|channel|>commentary to=functions.f<|message|>not json<|call|>"
    assert _read(text).calls[0].arguments == "not json"


@pytest.mark.parametrize("turn", [TURN, ANSWER], ids=["call", "answer"])
def test_read_at_every_prefix_the_parts_only_grow(turn: str) -> None:
    """As a stream reads a turn (one reader of arguments for the whole stream): each part is a
    prefix of the whole turn's, a call once complete never changes, and no marker's characters
    reach the reasoning, the content or the arguments."""
    final = _read(turn)
    readers = ArgumentReaders()
    for end in range(len(turn) + 1):
        out = read_output(turn[:end], False, readers)
        assert final.reasoning.startswith(out.reasoning), end
        assert final.content.startswith(out.content), end
        assert final.calls[:len(out.calls)] == out.calls, end
        for part in (out.reasoning, out.content, out.opening_arguments):
            assert "<|" not in part, (end, part)
        if out.opening is not None:
            whole = final.calls[len(out.calls)]
            assert out.opening == whole.name
            assert whole.arguments.startswith(out.opening_arguments), end
    # Probe: the reads did see the call being written, its arguments settled in pieces.
    assert any(read_output(turn[:end], False, ArgumentReaders()).opening_arguments
               for end in range(len(turn))) == (turn is TURN)


def test_the_answer_starts_with_content_or_a_call() -> None:
    thinking = TURN[:TURN.index("<|start|>")]
    assert not answer_started(thinking, finished=False)
    assert answer_started(TURN[:TURN.index("Let me") + 3], finished=False)
    assert answer_started(TURN, finished=True)


def test_a_template_that_writes_harmony_is_recognised() -> None:
    assert renders_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not renders_harmony("<|im_start|>{{ m.content }}<|im_end|>")
    assert not renders_harmony(None)
    assert all(m.startswith("<|") and m.endswith("|>") for m in MARKERS)


def test_a_turn_of_special_tokens_reads_through_the_detokenizer(tmp_path) -> None:
    """gpt-oss's markers are special tokens: decoded token by token as the engine does, with
    special tokens kept (what the server asks for a harmony model's requests), the turn reads
    as written; with them skipped, as by default, the channels are gone."""
    from transformers import AutoTokenizer

    from engine.processing.detokenizer import IncrementalDetokenizer
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_tokenizer(tmp_path / "tok"))
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    ids = tokenizer(TURN, add_special_tokens=False)["input_ids"]
    # Probe: each marker is one special token.
    assert sum(i in tokenizer.all_special_ids for i in ids) == sum(TURN.count(m) for m in MARKERS)
    prompt = tokenizer("<|start|>assistant", add_special_tokens=False)["input_ids"]
    kept = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    readers = ArgumentReaders()
    for token_id in ids:
        kept.update([token_id])
        partial = read_output(kept.output_text, False, readers)
        assert "<|" not in partial.content + partial.reasoning
    kept.flush()
    out = read_output(kept.output_text, True, ArgumentReaders())
    assert (out.reasoning, out.content, [c.name for c in out.calls]) == (
        "The user wants the weather in Rome.", "Let me look that up.", ["get_weather"])
    skipped = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    skipped.update(ids)
    skipped.flush()
    assert parse_messages(skipped.output_text, True) == []
