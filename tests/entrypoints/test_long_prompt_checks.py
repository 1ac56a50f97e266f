"""The checks every prompt passes on the API server's event loop (the body's 64-bit rule, the
vocabulary check) take the whole list at C speed when it is well formed, and still name the
first bad token of a long prompt wherever it is and whatever it is.

A 26,793-token prompt checked token by token held the event loop some 35 ms per request
(an urgent turn arriving beside a document had its arrival stamped that much late, and its
stream waited as long: the client's TTFT 18-29 ms over the server's in the 2048 burst)."""

from __future__ import annotations

import random

import pytest

from engine.processing.input_processor import validate_prompt
from engine.serving import openai_protocol
from engine.serving.openai_protocol import CompletionRequest

VOCAB = 128_256
LONG = 30_000


def _long_prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(LONG)]


def test_a_well_formed_long_prompt_passes() -> None:
    prompt = _long_prompt()
    validate_prompt(prompt, LONG, VOCAB)
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("bad", [VOCAB, -1, True, 7.0, "7", None])
@pytest.mark.parametrize("position", [0, LONG // 2, LONG - 1])
def test_the_first_bad_token_of_a_long_prompt_is_named(bad: object, position: int) -> None:
    prompt: list = _long_prompt()
    prompt[position] = bad
    with pytest.raises(ValueError, match=rf"token {bad!r} is outside the vocabulary"):
        validate_prompt(prompt, LONG, VOCAB)


def test_an_integer_beyond_64_bits_deep_in_a_long_prompt_is_named() -> None:
    for bad in (2**64, -2**70):
        prompt = _long_prompt()
        prompt[LONG - 2] = bad
        with pytest.raises(ValueError, match=f"{bad} is outside the signed 64-bit integer range"):
            CompletionRequest.model_validate({"prompt": prompt})
    batch = [_long_prompt(1)[:100], [*_long_prompt(2)[:100], 2**64]]
    with pytest.raises(ValueError, match="outside the signed 64-bit"):
        CompletionRequest.model_validate({"prompt": batch})


def test_a_list_of_numbers_is_checked_whole_not_item_by_item(monkeypatch) -> None:
    """The probe that the fast path is the one taken: the item-by-item check is entered a
    handful of times (once per field), not once per token."""
    calls = 0
    inner = openai_protocol._first_unfit

    def counted(value):
        nonlocal calls
        calls += 1
        return inner(value)

    monkeypatch.setattr(openai_protocol, "_first_unfit", counted)
    CompletionRequest.model_validate({"prompt": _long_prompt(), "max_tokens": 4})
    assert 0 < calls < 20, calls
    calls = 0
    CompletionRequest.model_validate({"prompt": ["a", "b", "c"] * 100})  # strings: one by one
    assert calls > 300
