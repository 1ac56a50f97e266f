"""engine/benchmarks/reference/greedy_divergence.py: a divergence at a near-tie of the reference is accepted and
reported, one with a clear margin (or a token outside the reference's top two) fails."""

from __future__ import annotations

import pytest

from engine.benchmarks.reference.greedy_divergence import (NEAR_TIE_MARGIN, Divergence, TopTwo,
                                     assert_no_clear_divergence, compare_greedy, engine_top_two,
                                     first_difference, hf_top_two)

PROMPTS = [[1, 2, 3], [4, 5]]


class ConstructedReference:
    """Top two next tokens by the common prefix they follow; records what was asked."""

    def __init__(self, answers: dict[tuple[int, ...], TopTwo]) -> None:
        self.answers = answers
        self.asked: list[list[int]] = []

    def __call__(self, tokens: list[int]) -> TopTwo:
        self.asked.append(tokens)
        return self.answers[tuple(tokens)]


def test_equal_outputs_ask_the_reference_nothing() -> None:
    reference = ConstructedReference({})
    assert compare_greedy(PROMPTS, [[7, 8], [9]], [[7, 8], [9]], reference) == []
    assert reference.asked == []


def test_a_near_tie_is_reported_and_accepted() -> None:
    # Output 0 diverges at its token 1: the reference chose 8 over 11 by 1e-5.
    reference = ConstructedReference({(1, 2, 3, 7): TopTwo((8, 11), 1e-5)})
    divergences = compare_greedy(PROMPTS, [[7, 11, 30], [9]], [[7, 8, 12], [9]], reference)
    assert reference.asked == [[1, 2, 3, 7]]  # the prompt and the common prefix
    (tie,) = assert_no_clear_divergence(divergences)
    assert (tie.output, tie.position, tie.got, tie.want, tie.near_tie) == (0, 1, 11, 8, True)
    assert tie.top_two == TopTwo((8, 11), 1e-5)
    assert "a near-tie" in tie.describe() and "1e-05" in tie.describe()
    assert tie.as_dict()["margin"] == 1e-5


def test_a_clear_margin_fails() -> None:
    reference = ConstructedReference({(4, 5): TopTwo((9, 6), 2.5)})
    divergences = compare_greedy(PROMPTS, [[7], [6]], [[7], [9]], reference)
    assert [d.near_tie for d in divergences] == [False]
    with pytest.raises(AssertionError, match=r"output 1, token 0: got 6, want 9.*leading by "
                                             r"2\.5: a clear divergence"):
        assert_no_clear_divergence(divergences)


def test_a_token_outside_the_top_two_fails_however_small_the_margin() -> None:
    reference = ConstructedReference({(4, 5): TopTwo((9, 6), 1e-7)})
    (divergence,) = compare_greedy(PROMPTS, [[7], [3]], [[7], [9]], reference)
    assert not divergence.near_tie


def test_tolerance_zero_accepts_no_near_tie_and_still_reports_the_margin() -> None:
    reference = ConstructedReference({(4, 5): TopTwo((9, 6), 1e-7)})
    (divergence,) = compare_greedy(PROMPTS, [[7], [6]], [[7], [9]], reference, tolerance=0.0)
    assert not divergence.near_tie and divergence.top_two.margin == 1e-7


def test_outputs_of_different_lengths_fail_without_asking() -> None:
    reference = ConstructedReference({})
    (divergence,) = compare_greedy(PROMPTS, [[7, 8], [9]], [[7], [9]], reference)
    assert divergence == Divergence(0, 1, 8, None, None, near_tie=False)
    assert reference.asked == []
    assert first_difference([1, 2], [1, 2]) is None and first_difference([1], [2]) == 0


def test_the_margin_tolerance_is_small() -> None:
    assert 0 < NEAR_TIE_MARGIN <= 0.05


def test_an_engine_and_hf_give_the_same_top_two(tiny_model) -> None:
    """The engine's top two (from its logprobs) lead by the same logit margin as HF's, and its
    top one is its greedy token."""
    from engine.benchmarks.reference.hf_reference import load_hf_model
    from engine import LLM, SamplingParams

    model_dir = tiny_model("llama")
    prompt = [5, 17, 33, 2, 90, 41]
    llm = LLM(model=model_dir, dtype="float32", device="cpu", enforce_eager=True)
    try:
        engine = engine_top_two(llm)(prompt)
        (greedy,) = llm.generate([{"prompt_token_ids": prompt}],
                                 SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    finally:
        llm.shutdown()
    hf = hf_top_two(load_hf_model(model_dir))(prompt)
    assert engine.tokens == hf.tokens and engine.tokens[0] == greedy.token_ids[0]
    assert engine.margin == pytest.approx(hf.margin, abs=1e-4) and engine.margin > 0
