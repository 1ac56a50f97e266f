"""A step as the step-time model sees it: its features (attention work, decode context) and
one timed step (`StepPoint`), whole or partial (monitor.step_time_model, monitor.step_time_fit,
monitor.predictor, monitor.speed_drift)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class StepPoint(NamedTuple):
    """One timed step as the fit sees it (see attention_work, decode_context, step_point)."""

    tokens: float
    attention: float
    decode_context: float
    seconds: float
    # Share of the layers the step ran: the intercept's (and the floor's) feature.
    share: float = 1.0

    @property
    def full_tokens(self) -> float:
        """Tokens of the whole-step equivalent: partial points of one size share it."""
        return self.tokens / self.share


def attention_work(chunks: Iterable[tuple[int, int]]) -> int:
    """The quadratic feature of a step: sum of n * (2 * prefix + n) over its (prefix, n) prefill
    chunks (n > 1; a one-token chunk is a decode, see decode_context)."""
    return sum(n * (2 * prefix + n) for prefix, n in chunks if n > 1)


def decode_context(chunks: Iterable[tuple[int, int]]) -> int:
    """The decode feature of a step: the KV tokens its one-token chunks read, prefix + 1 each."""
    return sum(prefix + 1 for prefix, n in chunks if n == 1)


def step_point(chunks: Iterable[tuple[int, int, int, int]], num_layers: int,
               seconds: float) -> StepPoint | None:
    """The point of a step whose chunks ran only some layers: `chunks` are (prefix, n,
    start_layer, end_layer), the chunk having run layers [start_layer, end_layer). Each chunk's
    features are scaled by its share of the layers; the intercept by the share of the layers the
    step ran at all (lowest start to highest end among the chunks that ran any), since the
    per-step cost (launches, norms, the LM head) is mostly per layer. None when nothing ran."""
    tokens = attention = context = 0.0
    first, last = num_layers, 0
    for prefix, n, start, end in chunks:
        if end <= start:
            continue
        share = (end - start) / num_layers
        tokens += n * share
        if n > 1:
            attention += n * (2 * prefix + n) * share
        else:
            context += (prefix + 1) * share
        first, last = min(first, start), max(last, end)
    if last <= first:
        return None
    return StepPoint(tokens, attention, context, seconds, (last - first) / num_layers)
