"""TTFT predictor: time to prefill `tokens` tokens on this model and machine, `a * tokens + c`,
plus `b * tokens**2` where attention makes long prompts grow faster than linearly.

Fitted by least squares (linear in the coefficients) on measured points: by the engine itself at
startup (engine/runtime/startup_calibration.py), by `sloserve calibrate` (saved as JSON), and
online from the engine's own step timings. A richer model is kept only where it beats the line on
held-out sizes (monitor/step_model_choice.py, docs/design.md section 5). A request's remaining
TTFT counts only the tokens it still has to prefill.

A step of several chunks costs `c + a * tokens + b * attention + d * decode_context`, where
`attention` sums `n * (2 * prefix + n)` over its prefill chunks (n > 1 new tokens over a cached
prefix; for one fresh prompt that is `n**2`) and `decode_context` sums the KV tokens each decode
(a one-token chunk) reads, `prefix + 1`. One model predicts lone prompts, decode-only steps and
mixed steps alike. The decode term is separate from the attention term because a decode is bound
by reading its K/V, not by FLOPs. On a GPU a step also never runs faster than the host can launch
its kernels (about 30 ms for an 8B model in eager mode): `floor_s`, when fitted, makes the step
model `max(floor_s, terms)`.

A step that ran only some of the layers (unwound mid-forward, or resuming a suspended pass at its
layer) is a point too: each chunk's features are scaled by the share of the layers it ran, the
intercept and the floor by the share the step ran (`step_point`).

The model carries its own error. `relative_error` is a high quantile (``error_quantile``, 0.9 by
default) of `|actual / predicted - 1|` over recent steps against the current model, both ways: a
model that overpredicts 2x is as untrustworthy for the monitor's necessity test as one that
underpredicts. `relative_speedup` is how much faster than predicted steps ran at the low quantile
(`optimistic`). Both have a floor of MIN_RELATIVE_ERROR: no margin is ever 0 while step times
range 100x.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from monitor.speed_drift import Drift, SpeedDrift
from monitor.step_point import StepPoint

# Before any measurement: pessimistic for a 135M model on 2 CPU cores (about 1 ms per token plus
# 50 ms per step), so that slack is underestimated rather than overestimated.
DEFAULT_SECONDS_PER_TOKEN = 1e-3
DEFAULT_INTERCEPT_S = 0.05
# More tokens than any step could hold: the answer of max_tokens_within for "no limit".
MAX_TOKENS_WITHIN = 1 << 40
# The error margins are estimated from this many observed prefill steps at least; before that
# the larger of the seed's and the steps' stands. Until then every prefill step refits.
MIN_ERROR_SAMPLES = 8
# No model of a machine whose steps range from milliseconds to seconds is better than this.
MIN_RELATIVE_ERROR = 0.05
# A point within this share above the floor is taken as floor-bound, not fitted by the terms.
FLOOR_TOLERANCE = 0.1
# Online fits weight a point by 2 ** (-age / RECENCY_HALF_LIFE), age counted in its window's
# steps: the machine's speed drifts (other processes, clocks) and recent steps tell it best.
RECENCY_HALF_LIFE = 64
# Online refits: a mixed (prefill and decodes) or partial (unwound, resumed) step weighs this
# much of a whole step of one kind, and fits no decode term (OnlineTTFT._refit).
MIXED_WEIGHT = 0.25
# A decode-only step above the floor that implies this many times the decode term the
# floor-bound steps allow is a stall of the host, not the KV it read (OnlineTTFT's
# _decode_coefficient).
STALL_FACTOR = 2.0
# Confidence (OnlineTTFT): a startup calibration that timed fewer prompt sizes than this seeds
# an unconfident model; a model whose observed error exceeds CONFIDENT_ERROR is unconfident;
# an unconfident model's error margin is at least UNCERTAIN_ERROR, and its speedup (how much
# faster than predicted steps may run: the bound a request is written off as doomed against) at
# least UNCERTAIN_SPEEDUP.
CONFIDENT_SIZES = 3
CONFIDENT_ERROR = 0.5
UNCERTAIN_ERROR = 0.5
UNCERTAIN_SPEEDUP = 0.75


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


def _beyond(value: float, limit: float, share: float) -> bool:
    """Whether a feature of a step that ran `share` of the layers lies past `limit` (a
    whole-step value): partial steps are compared as the whole steps they are shares of."""
    return value > limit * share * (1 + 1e-9) and value > 0


def _term(coef: float, edge: float | None, limit: float | None, value: float,
          share: float) -> float:
    """One term of the step model: `coef * value` inside the calibrated range, and past its
    end (`limit`, scaled to the step's share) the end's cost plus the edge cost per unit."""
    if limit is None or not _beyond(value, limit, share):
        return coef * value
    end = limit * share
    return coef * end + (coef if edge is None else edge) * (value - end)


def _most_within(fits: Callable[[int], bool], start: int) -> int:
    """The largest n <= MAX_TOKENS_WITHIN with fits(n), for fits monotone (true up to some n),
    searched from `start` (a closed form's answer, at most a rounding away from fitting)."""
    low = max(0, start)
    while low > 0 and not fits(low):
        low -= 1
    if not fits(low):
        return 0
    high = low + 1
    while high <= MAX_TOKENS_WITHIN and fits(high):
        low, high = high, 2 * high
    high = min(high, MAX_TOKENS_WITHIN + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def _as_point(point: Sequence[float]) -> StepPoint:
    return point if isinstance(point, StepPoint) else StepPoint(*point)


def recency_weights(count: int, half_life: float = RECENCY_HALF_LIFE) -> list[float]:
    """Weights of a window's points, oldest first, the newest at 1."""
    return [0.5 ** ((count - 1 - i) / half_life) for i in range(count)]


@dataclass(frozen=True)
class LinearTTFT:
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN
    intercept_s: float = DEFAULT_INTERCEPT_S
    # Coefficient of determination of the fit that produced it (None: not fitted).
    r2: float | None = None
    # Seconds per unit of attention work (0: a plain line).
    seconds_per_token_sq: float = 0.0
    # How wrong the model is, relative (0.1: steps ran up to 10% longer or shorter than
    # predicted) at the error quantile of recent steps: the safety margin.
    relative_error: float = 0.0
    # Seconds per KV token read by a decode (0: decodes cost only their share of the line).
    seconds_per_decode_context: float = 0.0
    # No step of all layers runs faster than this (a GPU's host launch floor; 0: none).
    floor_s: float = 0.0
    # How much faster than predicted steps ran, relative, at the low error quantile (0.2: 20%
    # faster): `optimistic` shrinks a prediction by it.
    relative_speedup: float = 0.0
    # The calibrated range (None: unknown, as for the default seed and files written before it
    # was kept): the largest whole-step value of each feature (tokens, attention work, decode
    # context; see StepPoint.full) among the points the model was fitted on. Beyond it a term
    # is charged at its edge cost (below) and `extrapolated` names it.
    calibrated_tokens: float | None = None
    calibrated_attention: float | None = None
    calibrated_decode_context: float | None = None
    # Seconds per unit of each feature beyond its calibrated range (None: the coefficient): the
    # cost per unit that the longest measured point implies (edge_unit_cost), never more than
    # the coefficient. A slope fitted on short contexts, or dragged by other steps, is not
    # extrapolated 15x past the longest context anyone timed.
    edge_seconds_per_token: float | None = None
    edge_seconds_per_token_sq: float | None = None
    edge_seconds_per_decode_context: float | None = None
    # Whether the model rests on enough measurement to write a request off: a fit on fewer than
    # CONFIDENT_SIZES prompt sizes (a calibration cut short, the default seed) before
    # MIN_ERROR_SAMPLES served prefill steps, or right after the machine's speed changed, is
    # not (OnlineTTFT), and carries wide margins: UNCERTAIN_ERROR, UNCERTAIN_SPEEDUP.
    confident: bool = True

    def margin(self, seconds: float) -> float:
        """The safety margin to add to a predicted duration of `seconds`."""
        return self.relative_error * seconds

    def optimistic(self, seconds: float) -> float:
        """A predicted duration of `seconds` as it comes out when steps run as much faster than
        predicted as they have been: the bound for deciding that a request is doomed. An
        unconfident model's speedup is at least UNCERTAIN_SPEEDUP (OnlineTTFT): it writes a
        request off only where even a step four times faster than it predicts would miss."""
        return seconds * max(0.0, 1.0 - self.relative_speedup)

    def scaled(self, factor: float) -> LinearTTFT:
        """The same model on a machine `factor` times slower: every time term, the floor and
        the edge costs multiplied (the calibrated range and the margins stay)."""
        def times(value: float | None) -> float | None:
            return None if value is None else value * factor

        return dataclasses.replace(
            self, seconds_per_token=self.seconds_per_token * factor,
            intercept_s=self.intercept_s * factor,
            seconds_per_token_sq=self.seconds_per_token_sq * factor,
            seconds_per_decode_context=self.seconds_per_decode_context * factor,
            floor_s=self.floor_s * factor,
            edge_seconds_per_token=times(self.edge_seconds_per_token),
            edge_seconds_per_token_sq=times(self.edge_seconds_per_token_sq),
            edge_seconds_per_decode_context=times(self.edge_seconds_per_decode_context))

    def predict(self, tokens: int, decode_context: int = 0) -> float:
        """Seconds to prefill `tokens` more tokens (0 when none are left), in steps that also
        carry decodes reading `decode_context` KV tokens."""
        if tokens <= 0:
            return 0.0
        return self.predict_step(tokens, tokens * tokens, decode_context)

    def predict_step(self, tokens: float, attention: float, decode_context: float = 0,
                     share: float = 1.0) -> float:
        """Seconds for a step of `tokens` tokens with `attention` work and `decode_context`
        (see attention_work and decode_context) that runs `share` of the layers. A feature
        beyond the calibrated range is charged at its edge cost past the range's end
        (`extrapolated` says which)."""
        return max(0.0, self.floor_s * share, self._terms(tokens, attention, decode_context,
                                                          share))

    def _terms(self, tokens: float, attention: float, decode_context: float,
               share: float) -> float:
        """The sum of the terms, without the floor."""
        return (_term(self.seconds_per_token, self.edge_seconds_per_token,
                      self.calibrated_tokens, tokens, share)
                + _term(self.seconds_per_token_sq, self.edge_seconds_per_token_sq,
                        self.calibrated_attention, attention, share)
                + _term(self.seconds_per_decode_context, self.edge_seconds_per_decode_context,
                        self.calibrated_decode_context, decode_context, share)
                + self.intercept_s * share)

    @property
    def has_range(self) -> bool:
        """Whether the model knows the range it was calibrated on (a fitted one does)."""
        return any(limit is not None for limit in (self.calibrated_tokens,
                                                   self.calibrated_attention,
                                                   self.calibrated_decode_context))

    def extrapolated(self, tokens: float, attention: float, decode_context: float = 0,
                     share: float = 1.0) -> tuple[str, ...]:
        """The features of a step (predict_step's arguments) that lie beyond the range the
        model was fitted on: "tokens", "attention", "decode_context"; empty inside it, or when
        the range is unknown. Such a prediction rests on the edge cost, not on a measurement."""
        features = (("tokens", self.calibrated_tokens, tokens),
                    ("attention", self.calibrated_attention, attention),
                    ("decode_context", self.calibrated_decode_context, decode_context))
        return tuple(name for name, limit, value in features
                     if limit is not None and _beyond(value, limit, share))

    def is_extrapolated(self, tokens: float, attention: float | None = None,
                        decode_context: float = 0, share: float = 1.0) -> bool:
        """Whether a prediction left the calibrated range: a step's (predict_step's
        arguments), or with `attention` None a fresh prompt's (predict's)."""
        attention = tokens * tokens if attention is None else attention
        return bool(self.extrapolated(tokens, attention, decode_context, share))

    def predict_point(self, point: StepPoint) -> float:
        return self.predict_step(point.tokens, point.attention, point.decode_context,
                                 point.share)

    def max_tokens_within(self, seconds: float, decode_context: int = 0) -> int:
        """The most tokens of one fresh prompt that `predict` keeps within `seconds` beside
        decodes reading `decode_context` KV tokens (at most MAX_TOKENS_WITHIN: a client's
        objective of 1e308 ms is no reason to overflow)."""
        if self.has_range:
            budget = seconds - self._terms(0, 0, decode_context, 1.0)
        else:
            budget = seconds - self.intercept_s - self.seconds_per_decode_context * decode_context
        if budget <= 0 or seconds < self.floor_s:
            return 0
        a, b = self.seconds_per_token, self.seconds_per_token_sq
        if b <= 0:
            tokens = budget / a
        else:
            tokens = (-a + math.sqrt(a * a + 4 * b * budget)) / (2 * b)
        tokens = int(min(tokens, MAX_TOKENS_WITHIN))
        if not self.has_range:
            return tokens
        # Past the range the terms grow by their edge costs (at most the coefficients): the
        # closed form above is a lower bound, the most that fits is found by search from it.
        return _most_within(lambda n: self._terms(n, n * n, decode_context, 1.0) <= seconds,
                            tokens)

    def max_chunk_within(self, seconds: float, tokens: int, attention: int,
                         decode_context: int, prefix: int) -> int:
        """The most tokens a prefill chunk over `prefix` cached tokens can add to a step that
        already holds `tokens` / `attention` / `decode_context` (predict_step's features) and
        keep the step within `seconds`. The chunk's attention over its prefix counts: a 2048-token
        chunk over a 28k prefix costs more than twice a fresh 2048-token prompt."""
        if seconds < self.floor_s:
            return 0
        # The floor is a lower bound on the step, not a cost: only the terms count against it.
        budget = seconds - dataclasses.replace(self, floor_s=0.0).predict_step(
            tokens, attention, decode_context)
        if budget <= 0:
            return 0
        # a * n + b * n * (2 * prefix + n) <= budget
        a = self.seconds_per_token + 2 * self.seconds_per_token_sq * prefix
        b = self.seconds_per_token_sq
        n = budget / a if b <= 0 else (-a + math.sqrt(a * a + 4 * b * budget)) / (2 * b)
        n = int(min(n, MAX_TOKENS_WITHIN))
        if not self.has_range:
            return n
        return _most_within(lambda m: self._terms(tokens + m, attention + m * (2 * prefix + m),
                                                  decode_context, 1.0) <= seconds, n)

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]]) -> LinearTTFT:
        """Least-squares line through (tokens, seconds); needs two distinct token counts."""
        pts = list(points)
        xs = [float(x) for x, _ in pts]
        ys = [float(y) for _, y in pts]
        n = len(pts)
        if n < 2 or len(set(xs)) < 2:
            raise ValueError(f"fitting a line needs points at two or more token counts, "
                             f"got {sorted(set(xs))}")
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        slope = sxy / sxx
        intercept = my - slope * mx
        if intercept < 0:
            # Prefill time grows faster than linearly at the top (attention is quadratic), which
            # pulls a free intercept below zero and predicts 0 s for short prompts. A step never
            # costs less than nothing: refit through the origin instead.
            slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
            intercept = 0.0
        ss_tot = sum((y - my) ** 2 for y in ys)
        ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
        return cls(seconds_per_token=slope, intercept_s=intercept, r2=r2)

    @classmethod
    def fit_quadratic(cls, points: Iterable[tuple[int, int, float]]) -> LinearTTFT:
        """Least squares on (tokens, attention work, seconds); a negative attention term falls
        back to the plain line, a negative intercept to a fit through the origin."""
        pts = list(points)
        if len({x for x, _, _ in pts}) < 3:
            raise ValueError(f"fitting the quadratic term needs points at three or more token "
                             f"counts, got {sorted({x for x, _, _ in pts})}")
        return cls.fit_step(((n, q, 0, s) for n, q, s in pts), quadratic=True, decode=False)

    @classmethod
    def fit_step(cls, points: Iterable[Sequence[float]], *, quadratic: bool, decode: bool,
                 weights: Sequence[float] | None = None, floor_s: float = 0.0,
                 decode_s: float | None = None) -> LinearTTFT:
        """Least squares on step points (StepPoint, or (tokens, attention, decode_context,
        seconds) tuples): the line plus the attention term if `quadratic` and the decode term if
        `decode` (the attention term only where three or more prefill shapes determine it). A
        term whose coefficient comes out <= 0 is dropped and the rest refitted (no
        step gets cheaper with more work); a negative intercept refits through the origin; a
        slope <= 0 falls back to `fit`. `weights` multiply each point's weight (recency).

        With `floor_s`, the model is `max(floor_s, terms)`: points within FLOOR_TOLERANCE of
        the floor are its, and the terms are fitted on the others.

        Residuals are weighted by 1 / seconds, so the fit minimizes relative errors: steps range
        from 60 ms decodes to 10 s prefills, and in plain least squares the long ones would
        decide every coefficient, the decode term included (on the default model that halved
        it), while the scheduler's margin and caps work in relative error.

        With `decode_s`, the decode coefficient is that value, not fitted (OnlineTTFT fits it
        on the steps that determine it, and the rest with it fixed). The model keeps the range
        of the points (see calibrated_tokens and edge_unit_costs)."""
        import numpy as np

        # Columns: share (the intercept's feature), tokens, attention, decode_context, seconds.
        rows = [(p.share, p.tokens, p.attention, p.decode_context, p.seconds)
                for p in map(_as_point, points)]
        table = np.array(rows, dtype=float).reshape(-1, 5)
        measured = table
        extra = np.ones(len(table)) if weights is None else np.asarray(weights, dtype=float)
        if floor_s > 0:
            kept = table[:, 4] > floor_s * table[:, 0] * (1 + FLOOR_TOLERANCE)
            table, extra = table[kept], extra[kept]
        # Whole-step sizes and prefill shapes (partial points of one shape share them).
        whole = np.round(table[:, 1:3] / table[:, :1], 3)
        sizes = np.unique(whole[:, 0])
        if len(sizes) < 2:
            raise ValueError(f"fitting a step model needs points at two or more token counts, "
                             f"got {sizes.tolist()}")
        shapes = np.unique(whole[table[:, 2] > 0], axis=0)
        quadratic = quadratic and len(shapes) >= 3  # else the term is not determined
        features, y = table[:, :4], table[:, 4]
        weight = extra / np.maximum(y, 1e-6)
        fixed = 0.0 if decode_s is None else decode_s
        weighted, target = features * weight[:, None], (y - fixed * features[:, 3]) * weight
        decode = decode and decode_s is None
        terms = [column for column, on in ((2, quadratic), (3, decode)) if on]
        while True:
            columns = [0, 1, *terms]
            coef = np.linalg.lstsq(weighted[:, columns], target, rcond=None)[0]
            if coef[0] < 0:
                columns = columns[1:]
                coef = np.concatenate([[0.0], np.linalg.lstsq(weighted[:, columns], target,
                                                              rcond=None)[0]])
            dropped = [c for c, value in zip(terms, coef[2:]) if value <= 0]
            if not dropped:
                break
            terms.remove(dropped[0])
        if coef[1] <= 0:
            line = cls.fit(zip(table[:, 1] / table[:, 0],
                               (y - fixed * features[:, 3]) / table[:, 0]))
            return dataclasses.replace(line, floor_s=floor_s, seconds_per_decode_context=fixed
                                       ).with_range(measured)
        full = np.zeros(4)
        full[[0, 1, *terms]] = coef
        full[3] = full[3] if decode_s is None else fixed
        residual = y - features @ full
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((residual ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        return cls(seconds_per_token=float(full[1]), intercept_s=float(full[0]), r2=r2,
                   seconds_per_token_sq=float(full[2]),
                   seconds_per_decode_context=float(full[3]), floor_s=floor_s
                   ).with_range(measured)

    def with_range(self, points: Iterable[Sequence[float]]) -> LinearTTFT:
        """This model calibrated on `points` (StepPoints, or rows of share, tokens, attention,
        decode_context, seconds as fit_step tabulates them): the largest whole-step value of
        each feature among them, and each term's edge cost.

        The edge cost of a term is what a unit of its feature cost at the point where that
        feature is largest (the longest measured point): that point's time less the model's
        other terms, per unit, between 0 and the coefficient (the median over points tied at
        the top; the coefficient itself where the point is the floor's). Past the range, a
        term grows by it rather than by a coefficient that points elsewhere determined: a decode
        slope fitted on 259-token contexts once charged 0.24 s for 3949 tokens of context that
        cost about half that."""
        rows = [(p.share, p.tokens, p.attention, p.decode_context, p.seconds)
                if isinstance(p, StepPoint) else tuple(p) for p in points]
        rows = [r for r in rows if r[0] > 0]
        if not rows:
            return self
        coefs = (self.seconds_per_token, self.seconds_per_token_sq,
                 self.seconds_per_decode_context)
        limits: list[float] = []
        edges: list[float | None] = []
        for j in range(3):
            whole = [r[1 + j] / r[0] for r in rows]
            limit = max(whole)
            limits.append(limit)
            edges.append(self._edge_cost(j, [r for r, w in zip(rows, whole)
                                             if w >= limit * (1 - 1e-9)], coefs))
        edges = [None if e is None else float(e) for e in edges]
        return dataclasses.replace(
            self, calibrated_tokens=float(limits[0]), calibrated_attention=float(limits[1]),
            calibrated_decode_context=float(limits[2]), edge_seconds_per_token=edges[0],
            edge_seconds_per_token_sq=edges[1], edge_seconds_per_decode_context=edges[2])

    def _edge_cost(self, j: int, tops: list[tuple[float, ...]],
                   coefs: tuple[float, float, float]) -> float | None:
        """Feature j's edge cost from the points where it is largest (see with_range)."""
        implied = []
        for share, *features, seconds in tops:
            if features[j] <= 0 or coefs[j] <= 0:
                return None  # nothing measured, or no term: nothing to charge differently
            if seconds <= self.floor_s * share * (1 + FLOOR_TOLERANCE):
                return None  # the floor's point says nothing of the terms
            others = self.intercept_s * share + sum(c * x for i, (c, x)
                                                    in enumerate(zip(coefs, features))
                                                    if i != j)
            implied.append((seconds - others) / features[j])
        return min(coefs[j], max(0.0, statistics.median(implied)))

    def to_dict(self) -> dict[str, float | bool | None]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearTTFT:
        """A file `save` wrote; fields added since (the floor, the speedup) default to 0 when an
        older file lacks them, the calibrated range and edge costs to None (unknown: the terms
        are trusted everywhere, as before)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"ttft model {str(path)!r} is not a calibration file written by "
                             f"`sloserve calibrate`: {exc}") from exc
        return cls.from_dict(data, source=f"ttft model {str(path)!r}")

    @classmethod
    def from_dict(cls, data: dict, source: str = "ttft model") -> LinearTTFT:
        """What `to_dict` gave (a file's contents, a server's /debug/stats `ttft_model`)."""
        try:
            model = cls(seconds_per_token=float(data["seconds_per_token"]),
                        intercept_s=float(data["intercept_s"]), r2=data.get("r2"),
                        seconds_per_token_sq=float(data.get("seconds_per_token_sq", 0.0)),
                        relative_error=float(data.get("relative_error", 0.0)),
                        seconds_per_decode_context=float(
                            data.get("seconds_per_decode_context", 0.0)),
                        floor_s=float(data.get("floor_s", 0.0)),
                        relative_speedup=float(data.get("relative_speedup", 0.0)),
                        **{name: _optional_float(data.get(name)) for name in _RANGE_FIELDS})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{source} is not a step model as `sloserve calibrate` writes "
                             f"it: {exc}") from exc
        if (model.seconds_per_token <= 0 or model.seconds_per_token_sq < 0
                or model.seconds_per_decode_context < 0):
            raise ValueError(f"{source}: seconds_per_token must be > 0, "
                             f"seconds_per_token_sq and seconds_per_decode_context >= 0, got "
                             f"{model.seconds_per_token}, {model.seconds_per_token_sq} and "
                             f"{model.seconds_per_decode_context}")
        if not 0 <= model.relative_error < math.inf:
            raise ValueError(f"{source}: relative_error must be a finite number "
                             f">= 0, got {model.relative_error}")
        bad_range = [name for name in _RANGE_FIELDS
                     if not 0 <= (getattr(model, name) or 0.0) < math.inf]
        if bad_range:
            raise ValueError(f"{source}: {', '.join(bad_range)} must be finite "
                             f"numbers >= 0 (or null)")
        if not 0 <= model.floor_s < math.inf or not 0 <= model.relative_speedup < 1:
            raise ValueError(f"{source}: floor_s must be a finite number >= 0 "
                             f"and relative_speedup in [0, 1), got {model.floor_s} and "
                             f"{model.relative_speedup}")
        return model


# The optional fields of the calibrated range (LinearTTFT.with_range).
_RANGE_FIELDS = ("calibrated_tokens", "calibrated_attention", "calibrated_decode_context",
                 "edge_seconds_per_token", "edge_seconds_per_token_sq",
                 "edge_seconds_per_decode_context")


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


# Before any measurement (no calibration file, no startup calibration): pessimistic, and
# unconfident until served steps have measured the machine.
DEFAULT_SEED = LinearTTFT(confident=False)


def predict_prefill(model: LinearTTFT, tokens: int, decode_context: int = 0,
                    chunk_tokens: int = 0) -> float:
    """Seconds to prefill `tokens` more tokens of one prompt in chunks of at most
    `chunk_tokens` (the step budget; 0: one step), each a step of its own over the chunks
    before it, beside decodes reading `decode_context` KV tokens. Priced as one step, a
    30k-token document in 2048-token chunks would be charged one step's fixed cost instead of
    fifteen: its slack would look larger than it is by fourteen intercepts."""
    if tokens <= 0:
        return 0.0
    if chunk_tokens <= 0 or tokens <= chunk_tokens:
        return model.predict(tokens, decode_context)
    # The step loop ranks every waiter each step and the monitor polls every few ms: the chunks'
    # costs without the decode term are kept per (model, prompt, budget); the decode term is the
    # same in every chunk.
    chunks, total, least = _chunk_costs(model, tokens, chunk_tokens)
    decode = _term(model.seconds_per_decode_context, model.edge_seconds_per_decode_context,
                   model.calibrated_decode_context, decode_context, 1.0)
    floor = max(0.0, model.floor_s)
    if least + decode >= floor:
        return total + len(chunks) * decode
    return sum(max(floor, cost + decode) for cost in chunks)


@functools.lru_cache(maxsize=4096)
def _chunk_costs(model: LinearTTFT, tokens: int, chunk_tokens: int
                 ) -> tuple[tuple[float, ...], float, float]:
    """Each chunk's predicted step without decodes and without the floor (predict_prefill), its
    sum and its least."""
    costs, done = [], 0
    while done < tokens:
        chunk = min(chunk_tokens, tokens - done)
        costs.append(model._terms(chunk, attention_work([(done, chunk)]), 0.0, 1.0))
        done += chunk
    return tuple(costs), sum(costs), min(costs)


def optimistic_prefill(model: LinearTTFT, tokens: int, decode_context: int = 0,
                       chunk_tokens: int = 0) -> float:
    """The fastest a prefill of `tokens` is likely to run (a request is written off as doomed
    only against this); chunked as predict_prefill."""
    return model.optimistic(predict_prefill(model, tokens, decode_context, chunk_tokens))


def error_quantiles(ratios: Iterable[float], quantile: float) -> tuple[float, float]:
    """(relative_error, relative_speedup) of `actual / predicted - 1` residuals: the
    `quantile` of their sizes, and how far below 0 their `1 - quantile` lies (each at least
    MIN_RELATIVE_ERROR; the speedup below 1)."""
    ordered = sorted(ratios)
    if not ordered:
        return MIN_RELATIVE_ERROR, MIN_RELATIVE_ERROR
    sizes = sorted(abs(r) for r in ordered)
    # The smallest value with at least `quantile` of them at or below it.
    high = sizes[max(0, math.ceil(quantile * len(sizes)) - 1)]
    low = ordered[max(0, math.ceil((1 - quantile) * len(ordered)) - 1)]
    return max(MIN_RELATIVE_ERROR, high), min(0.95, max(MIN_RELATIVE_ERROR, -low))


class _Window:
    """A sliding window of step points with the observation index of each (-1: a calibration
    point, older than every served step), so that a change of the machine's speed can rescale
    the points measured before it."""

    def __init__(self, maxlen: int) -> None:
        self.points: deque[StepPoint] = deque(maxlen=maxlen)
        self._indices: deque[int] = deque(maxlen=maxlen)

    def __iter__(self) -> Iterator[StepPoint]:
        return iter(self.points)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, i: int) -> StepPoint:
        return self.points[i]

    def append(self, index: int, point: StepPoint) -> None:
        self.points.append(point)
        self._indices.append(index)

    def clear(self) -> None:
        self.points.clear()
        self._indices.clear()

    def rescale(self, factor: float, before: int) -> None:
        """Every point observed before index `before` as if it had taken `factor` times as
        long (measured at the old speed, it stands for the new one)."""
        self.points = deque((p._replace(seconds=p.seconds * factor) if i < before else p
                             for i, p in zip(self._indices, self.points)),
                            maxlen=self.points.maxlen)


class OnlineTTFT:
    """Refits the model from the engine's observed steps, starting from a seed (the startup
    calibration's, a file's, or the pessimistic default). Steps that prefill something and
    decode-only steps fill two sliding windows, and the fit runs on both: decode-only steps come
    every few milliseconds while prefills are rare, and one shared window would forget the
    prefills. Every prefill step refits until MIN_ERROR_SAMPLES were seen, then every
    `refit_every` steps; the attention term is always tried (fit_step drops it if the data
    contradicts it), the decode term whenever decodes ran; recent points weigh more.

    After each refit the margins are recomputed from the residuals of the recent prefill steps
    against the new model; between refits each prefill step adds its residual against the model
    it was predicted with. `refit_every=None` never refits: the seed's coefficients stay and
    only its margins are learned. Readers get the current model by reference; `observe`
    replaces it, never mutates it.

    The machine's speed can change under a fitted model (monitor.speed_drift): when recent
    steps depart from it, every point measured before the change is rescaled by the departure
    and the model refitted at once (`_follow_drift`), and until MIN_ERROR_SAMPLES prefill steps
    have been served at the new speed the departure stands as the model's error and the model
    is unconfident.

    Confidence (LinearTTFT.confident): a seed fitted on fewer than CONFIDENT_SIZES prompt
    sizes, or the default seed, is unconfident until MIN_ERROR_SAMPLES prefill steps were
    served; so is any model whose observed error exceeds CONFIDENT_ERROR, or that follows a
    drift not yet confirmed by MIN_ERROR_SAMPLES prefill steps. While it is, its error margin
    is at least UNCERTAIN_ERROR and its speedup at least UNCERTAIN_SPEEDUP: deadlines get the
    benefit of the doubt (docs/design.md section 5)."""

    def __init__(self, seed: LinearTTFT | None = None, window: int = 256,
                 refit_every: int | None = 8, error_quantile: float = 0.9,
                 error_window: int = 64, decode_window: int = 128) -> None:
        if not 0.0 < error_quantile <= 1.0:
            raise ValueError(f"error_quantile must be in (0, 1], got {error_quantile}")
        self.error_quantile = error_quantile
        self._refit_every = refit_every
        self._points = _Window(window)
        self._decode_points = _Window(decode_window)
        # The recent observed prefill steps and their residuals actual / predicted - 1 against
        # the current model (recomputed at every refit). A shorter window than the fit's: the
        # margin should forget errors the refits have corrected.
        self._recent = _Window(error_window)
        self._residuals: deque[float] = deque(maxlen=error_window)
        self._drift = SpeedDrift()
        self.reseed(seed or DEFAULT_SEED)

    def reseed(self, seed: LinearTTFT, points: Iterable[StepPoint] = ()) -> None:
        """Start over from `seed` (a startup calibration's), with the points it was fitted on
        as the windows' oldest: real steps outweigh them as they come, then push them out.
        Calibration points add no residuals: the seed's own relative_error (held out)
        stands for them until MIN_ERROR_SAMPLES steps were observed."""
        self._seed = seed
        for window in (self._points, self._decode_points, self._recent):
            window.clear()
        self._residuals.clear()
        points = list(points)
        for point in points:
            (self._points if point.attention > 0 else self._decode_points).append(-1, point)
        self._drift.reseed(seed, points)
        self._since_fit = 0
        self._observed = 0
        # Prefill steps served since the seed, and since the last drift followed.
        self._prefills_served = 0
        self._prefills_since_drift: int | None = None
        self._drift_error = 0.0
        # An unconfident seed carries the uncertain margins from the start (see _publish).
        self.current = (seed if seed.confident else dataclasses.replace(
            seed, relative_error=max(seed.relative_error, UNCERTAIN_ERROR),
            relative_speedup=max(seed.relative_speedup, UNCERTAIN_SPEEDUP)))

    def observe(self, tokens: int, seconds: float, attention: int | None = None,
                decode_context: int = 0) -> None:
        """One completed step that ran all layers: its tokens, wall time, attention work
        (default: one fresh prompt of `tokens`; 0: a decode-only step) and decode context (see
        attention_work and decode_context)."""
        attention = tokens * tokens if attention is None else attention
        self.observe_point(StepPoint(tokens, attention, decode_context, seconds))

    def observe_point(self, point: StepPoint) -> None:
        """One completed, unwound or resumed step (see step_point)."""
        if point.tokens <= 0 or point.seconds <= 0 or point.share <= 0:
            return
        model = self.current
        index = self._observed
        self._observed += 1
        prefill = point.attention > 0
        if prefill:
            self._points.append(index, point)
            self._recent.append(index, point)
            self._residuals.append(_residual(model, point))
            self._prefills_served += 1
            if self._prefills_since_drift is not None:
                self._prefills_since_drift += 1
        else:
            self._decode_points.append(index, point)
        self._since_fit += 1
        drift = self._drift.observe(model, point, index)
        settling = prefill and len(self._recent.points) <= MIN_ERROR_SAMPLES
        if drift is not None and self._refit_every is not None:
            model = self._follow_drift(model, drift)
        elif self._refit_every is not None and (settling
                                                or self._since_fit >= self._refit_every):
            self._since_fit = 0
            fitted = self._refit(model)
            if fitted is not None and fitted.seconds_per_token > 0:
                model = fitted
                self._residuals = deque((_residual(model, p) for p in self._recent.points),
                                        maxlen=self._residuals.maxlen)
                self._drift.refit(model)
        self._publish(model)

    def _follow_drift(self, model: LinearTTFT, drift: Drift) -> LinearTTFT:
        """The machine runs `drift.factor` times as long as `model` says since step
        `drift.since`: what was measured before then is rescaled to the new speed and the
        model refitted on it (or, where the points fit no model, scaled)."""
        for window in (self._points, self._decode_points, self._recent):
            window.rescale(drift.factor, drift.since)
        scaled = model.scaled(drift.factor)
        fitted = self._refit(scaled)
        if fitted is None or fitted.seconds_per_token <= 0:
            fitted = scaled
        self._since_fit = 0
        self._residuals = deque((_residual(fitted, p) for p in self._recent.points),
                                maxlen=self._residuals.maxlen)
        self._drift.rescale(drift, fitted)
        self._prefills_since_drift = 0
        self._drift_error = abs(drift.factor - 1.0)
        return fitted

    def _publish(self, model: LinearTTFT) -> None:
        """`model` with the margins and the confidence the observed steps allow."""
        error, speedup = error_quantiles(self._residuals, self.error_quantile)
        if len(self._residuals) < MIN_ERROR_SAMPLES:  # too few steps to overrule the seed
            error = max(error, self._seed.relative_error)
            speedup = max(speedup, self._seed.relative_speedup)
        after_drift = (self._prefills_since_drift is not None
                       and self._prefills_since_drift < MIN_ERROR_SAMPLES)
        if after_drift:
            # The departure that was followed is the error there is evidence of, until steps
            # served at the new speed measure it.
            error = max(error, self._drift_error)
            speedup = max(speedup, min(0.95, self._drift_error))
        confident = ((self._seed.confident or self._prefills_served >= MIN_ERROR_SAMPLES)
                     and not after_drift and error <= CONFIDENT_ERROR)
        if not confident:
            error = max(error, UNCERTAIN_ERROR)
            speedup = max(speedup, UNCERTAIN_SPEEDUP)
        if (model is not self.current or error != model.relative_error
                or speedup != model.relative_speedup or confident != model.confident):
            self.current = dataclasses.replace(model, relative_error=error,
                                               relative_speedup=speedup, confident=confident)

    def _refit(self, base: LinearTTFT) -> LinearTTFT | None:
        """The model fitted on both windows (recent points weigh more), with `base`'s floor
        (the model it replaces, at the machine's current speed); None while the prefill steps span too few distinct sizes (decodes alone say
        nothing about prompts).

        The decode term is fitted first, on whole decode-only steps (_decode_coefficient),
        and the other terms then on every point with it fixed, mixed and partial points
        weighing MIXED_WEIGHT each. Why: a mixed step's decode context is large and varies
        independently of its prefill, and a partial step's features are the layers' shares,
        so whatever such a step costs that the model does not account for (an unwind's or a
        resume's own work, decodes and a prefill contending for the caches) was fitted into
        the decode term, where it has the most leverage; and the decode term is a small share
        of such steps, so they say little about it anyway. On a server where nearly every step
        carries a prefill chunk, the online fit once doubled the decode term that way
        (tests/core/test_predictor_refit_decode.py)."""
        prefills, decodes = self._points.points, self._decode_points.points
        points = [*prefills, *decodes]
        weights = [*recency_weights(len(prefills)), *recency_weights(len(decodes))]
        first = prefills[0].full_tokens if prefills else 0.0
        if not any(abs(p.full_tokens - first) > 1e-6 for p in prefills):
            return None  # one prefill size at most
        decode = any(p.decode_context > 0 for p in points)
        decode_s = self._decode_coefficient(points, weights, base) if decode else None
        weights = [w * (1.0 if _single_kind(p) else MIXED_WEIGHT)
                   for p, w in zip(points, weights)]
        try:
            return LinearTTFT.fit_step(points, quadratic=True, decode=decode, weights=weights,
                                       floor_s=base.floor_s, decode_s=decode_s)
        except ValueError:  # too few distinct sizes (above the floor)
            return None

    def _decode_coefficient(self, points: Sequence[StepPoint], weights: Sequence[float],
                            base: LinearTTFT) -> float | None:
        """The decode term as the whole decode-only steps (the seed's among them, until served
        steps push them out) show it: what they cost beyond the intercept and the per-token
        cost of a fit on every point (mixed and partial ones weighing MIXED_WEIGHT), per KV
        token read. The intercept and the per-token cost are determined by every step; the
        decode term, the one coefficient left, only by the steps where it is all the rest.
        None (a joint fit: the other steps are all the evidence there is) where no whole
        decode-only step is in the windows."""
        fallback = None
        decodes = [(p, w) for p, w in zip(points, weights)
                   if _single_kind(p) and p.attention <= 0 and p.decode_context > 0]
        if not decodes:
            return fallback
        try:
            joint = LinearTTFT.fit_step(
                points, quadratic=True, decode=True, floor_s=base.floor_s,
                weights=[w * (1.0 if _single_kind(p) else MIXED_WEIGHT)
                         for p, w in zip(points, weights)])
        except ValueError:
            return fallback

        def rest(point: StepPoint) -> float:
            return point.seconds - joint.intercept_s - joint.seconds_per_token * point.tokens

        # A step at the floor bounds the term: its decodes cost no more than the floor leaves
        # them.
        at_floor = [p.seconds <= joint.floor_s * (1 + FLOOR_TOLERANCE) for p, _ in decodes]
        bound = min((max(0.0, rest(p)) / p.decode_context
                     for (p, _), floor_bound in zip(decodes, at_floor) if floor_bound),
                    default=math.inf)
        # Weighted least squares of relative residuals, one coefficient: d = sum(w x r) /
        # sum(w x x), x the context and r what the step cost beyond the other terms, both
        # relative to its time (as fit_step weighs them). Over the steps above the floor that
        # the floor-bound ones do not contradict: one that implies STALL_FACTOR times what
        # they allow was slowed by something else (a GC pause, another process on the core).
        # Where every other decode step ran at the floor, such a step set the term alone: one
        # decode step of 190 ms at 20k tokens of context made it 9e-6 s a KV token in the
        # GPU-timed simulation, a 200-token prefill beside 100k tokens of decodes was predicted
        # at 944 ms, and urgent turns were ranked as doomed for the 128 decode steps it stayed
        # in the window.
        num = den = 0.0
        for (point, weight), floor_bound in zip(decodes, at_floor):
            beyond = rest(point)
            if floor_bound or beyond > STALL_FACTOR * bound * point.decode_context:
                continue
            x = point.decode_context / point.seconds
            num += weight * x * beyond / point.seconds
            den += weight * x * x
        if den <= 0:
            # Every decode-only step ran at the floor: they show the floor, not what a KV
            # token costs, and the mixed steps would put the floor's time into the decode
            # term (in the GPU-timed simulation, 11x the profile's). Keep what it was, within
            # what the floor-bound steps allow (a seed timed on a noisy CPU once said 1.3e-4 s
            # a KV token, where its decode steps at 2000 tokens of context ran at the floor).
            return min(base.seconds_per_decode_context, bound)
        return min(max(0.0, num / den), bound)

    def predict(self, tokens: int, decode_context: int = 0) -> float:
        return self.current.predict(tokens, decode_context)


def _single_kind(point: StepPoint) -> bool:
    """A whole step of decodes only or of prefill chunks only (see OnlineTTFT._refit)."""
    return point.share >= 1.0 - 1e-9 and (point.attention <= 0 or point.decode_context <= 0)


def _residual(model: LinearTTFT, point: StepPoint) -> float:
    predicted = model.predict_point(point)
    return point.seconds / predicted - 1.0 if predicted > 0 else 0.0
