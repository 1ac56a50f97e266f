"""Greedy outputs compared token for token, with near-ties told apart from bugs.

Two correct runs of the same weights can still pick different greedy tokens where the
reference's top two next-token logits are nearly equal: CUDA graphs replay decode with the
captured split plan (``decode_max_context = max_model_len``) and cuBLAS picks its kernels by the
padded row count, so a graph run and an eager run sum in a different order, and a lead of a few
float32 ulps can flip. The outputs then differ from that token on, legitimately.

So at the first position where an output differs from the reference, the reference is asked
for its top two next tokens after the common prefix (the prompt and the tokens both produced).
When the two tokens the runs chose are those two and the reference's lead of the first over the
second is below a small tolerance, the divergence is a near-tie, reported (position, the two
tokens, the margin) and accepted; anything else, a clear margin or a token outside the top two,
is a divergence and fails.

    divergences = compare_greedy(prompts, got, want, engine_top_two(reference_llm))
    assert_no_clear_divergence(divergences)    # raises listing each; returns the near-ties
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The reference's lead of its top-1 over its top-2 token (a logit difference, equal to the
# logprob difference), below which a flipped argmax counts as a near-tie. Runs that differ only
# in summation order (graphs against eager, one kernel against another) move float32 logits by
# far less than this; a wrong result usually moves them by far more. Where the reference leads
# by more than this, the runs must agree.
NEAR_TIE_MARGIN = 1e-2


@dataclass(frozen=True)
class TopTwo:
    """The reference's two most likely next tokens, most likely first, and the lead of the
    first over the second."""

    tokens: tuple[int, int]
    margin: float


# The reference's top two next tokens after a token sequence (prompt + generated prefix).
TopTwoAfter = Callable[[list[int]], TopTwo]


@dataclass(frozen=True)
class Divergence:
    """Where one output first differs from the reference's."""

    output: int  # which prompt's output
    position: int  # index into the generated tokens
    got: int | None  # the run's token there (None: its output ended before)
    want: int | None  # the reference's token there
    top_two: TopTwo | None  # the reference's, after the common prefix (None: lengths differ)
    near_tie: bool

    def describe(self) -> str:
        where = f"output {self.output}, token {self.position}: got {self.got}, want {self.want}"
        if self.top_two is None:
            return f"{where} (one output is longer)"
        first, second = self.top_two.tokens
        verdict = "a near-tie" if self.near_tie else "a clear divergence"
        return (f"{where}; the reference's top two there are {first} and {second}, leading by "
                f"{self.top_two.margin:.3g}: {verdict}")

    def as_dict(self) -> dict[str, Any]:
        return {"output": self.output, "position": self.position, "got": self.got,
                "want": self.want, "near_tie": self.near_tie,
                "top_two": None if self.top_two is None else list(self.top_two.tokens),
                "margin": None if self.top_two is None else self.top_two.margin}


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first position where the outputs differ (or one ends first); None if equal."""
    for position, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return position
    return None if len(got) == len(want) else min(len(got), len(want))


def compare_greedy(prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]],
                   want: Sequence[Sequence[int]], top_two_after: TopTwoAfter,
                   tolerance: float = NEAR_TIE_MARGIN) -> list[Divergence]:
    """Every output that differs from the reference's, with its verdict. ``top_two_after`` is
    asked only where an output differs. ``tolerance`` 0 accepts no near-tie (exact runs) and
    still reports the margin."""
    if not len(prompts) == len(got) == len(want):
        raise ValueError(f"{len(prompts)} prompts, {len(got)} outputs, {len(want)} references")
    divergences = []
    for index, (prompt, g, w) in enumerate(zip(prompts, got, want)):
        position = first_difference(g, w)
        if position is None:
            continue
        if position >= len(g) or position >= len(w):
            divergences.append(Divergence(
                index, position, g[position] if position < len(g) else None,
                w[position] if position < len(w) else None, None, near_tie=False))
            continue
        top_two = top_two_after(list(prompt) + list(w[:position]))
        near_tie = ({g[position], w[position]} == set(top_two.tokens)
                    and top_two.margin < tolerance)
        divergences.append(Divergence(index, position, g[position], w[position], top_two,
                                      near_tie))
    return divergences


def assert_no_clear_divergence(divergences: Sequence[Divergence]) -> list[Divergence]:
    """Raise AssertionError naming every divergence that is not a near-tie (and the near-ties,
    for context); return the near-ties, to report."""
    clear = [d for d in divergences if not d.near_tie]
    if clear:
        raise AssertionError("greedy outputs differ:\n" + "\n".join(
            d.describe() for d in divergences))
    return list(divergences)


def engine_top_two(llm: Any) -> TopTwoAfter:
    """The top two next tokens of an engine (an ``engine.LLM``), from its logprobs (greedy: the
    log-softmax of the raw logits, whose differences are the logits')."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, ignore_eos=True)

    def top_two_after(tokens: list[int]) -> TopTwo:
        (out,) = llm.generate([{"prompt_token_ids": tokens}], params)
        ranked = sorted(out.logprobs[0].items(), key=lambda item: item[1].rank)
        (first, lp1), (second, lp2) = ranked[:2]
        return TopTwo((first, second), lp1.logprob - lp2.logprob)

    return top_two_after


def fresh_engine_top_two(model: str, **llm_args: Any) -> TopTwoAfter:
    """``engine_top_two`` of an engine built for each question and shut down after it: for a
    reference that has already been shut down (divergences are rare; a process should not hold
    a second engine on a GPU meanwhile)."""
    def top_two_after(tokens: list[int]) -> TopTwo:
        from engine import LLM

        llm = LLM(model=model, **llm_args)
        try:
            return engine_top_two(llm)(tokens)
        finally:
            llm.shutdown()

    return top_two_after


def hf_top_two(model: Any) -> TopTwoAfter:
    """The top two next tokens of an HF transformers causal LM, from its logits."""
    import torch

    def top_two_after(tokens: list[int]) -> TopTwo:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens], device=model.device)).logits[0, -1].float()
        top = torch.topk(logits, 2)
        first, second = top.indices.tolist()
        return TopTwo((first, second), float(top.values[0] - top.values[1]))

    return top_two_after
