"""TTFT predictor: time to prefill `tokens` tokens on this model and machine, `a * tokens + c`,
plus `b * tokens**2` where attention makes long prompts grow faster than linearly.

Fitted by least squares (linear in the coefficients) on measured points: from `sloserve
calibrate` (saved as JSON; it keeps the quadratic term only if it beats the plain line on
held-out prompt sizes, docs/design.md section 5), or online from the engine's own prefill step
timings. A request's remaining TTFT counts only the tokens it still has to prefill.

A step of several chunks costs `c + a * tokens + b * attention + d * decode_context`, where
`attention` sums `n * (2 * prefix + n)` over its prefill chunks (n > 1 new tokens over a cached
prefix; for one fresh prompt that is `n**2`) and `decode_context` sums the KV tokens each decode
(a one-token chunk) reads, `prefix + 1`. One model predicts lone prompts, decode-only steps and
mixed steps alike. The decode term is separate from the attention term because a decode is bound
by reading its K/V, not by FLOPs: on the default model a decode over a 2000-token context costs
tens of milliseconds, far more than the attention FLOPs of one token suggest.

The model carries its own error: `relative_error` is a high quantile (``error_quantile``, 0.9 by
default) of how much longer than predicted recent steps ran, each residual taken against the
model as it stood before that step (out of sample). The monitor adds it as a safety margin, so a
misprediction of the size the engine keeps seeing does not turn a just-in-time preemption into
a miss.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

# Before any measurement: pessimistic for a 135M model on 2 CPU cores (about 1 ms per token plus
# 50 ms per step), so that slack is underestimated rather than overestimated.
DEFAULT_SECONDS_PER_TOKEN = 1e-3
DEFAULT_INTERCEPT_S = 0.05
# More tokens than any step could hold: the answer of max_tokens_within for "no limit".
MAX_TOKENS_WITHIN = 1 << 40
# The error margin is estimated from this many observed steps at least; before that the seed's
# (0 unless a calibration file carries one) stands.
MIN_ERROR_SAMPLES = 8


def attention_work(chunks: Iterable[tuple[int, int]]) -> int:
    """The quadratic feature of a step: sum of n * (2 * prefix + n) over its (prefix, n) prefill
    chunks (n > 1; a one-token chunk is a decode, see decode_context)."""
    return sum(n * (2 * prefix + n) for prefix, n in chunks if n > 1)


def decode_context(chunks: Iterable[tuple[int, int]]) -> int:
    """The decode feature of a step: the KV tokens its one-token chunks read, prefix + 1 each."""
    return sum(prefix + 1 for prefix, n in chunks if n == 1)


@dataclass(frozen=True)
class LinearTTFT:
    seconds_per_token: float = DEFAULT_SECONDS_PER_TOKEN
    intercept_s: float = DEFAULT_INTERCEPT_S
    # Coefficient of determination of the fit that produced it (None: not fitted).
    r2: float | None = None
    # Seconds per unit of attention work (0: a plain line).
    seconds_per_token_sq: float = 0.0
    # How much longer than predicted steps run, relative (0.1: 10% longer), at the error
    # quantile of recent steps; never negative (running faster needs no margin).
    relative_error: float = 0.0
    # Seconds per KV token read by a decode (0: decodes cost only their share of the line).
    seconds_per_decode_context: float = 0.0

    def margin(self, seconds: float) -> float:
        """The safety margin to add to a predicted duration of `seconds`."""
        return self.relative_error * seconds

    def predict(self, tokens: int, decode_context: int = 0) -> float:
        """Seconds to prefill `tokens` more tokens (0 when none are left), in steps that also
        carry decodes reading `decode_context` KV tokens."""
        if tokens <= 0:
            return 0.0
        return self.predict_step(tokens, tokens * tokens, decode_context)

    def predict_step(self, tokens: int, attention: int, decode_context: int = 0) -> float:
        """Seconds for a step of `tokens` tokens with `attention` work and `decode_context`
        (see attention_work and decode_context)."""
        return max(0.0, self.seconds_per_token * tokens + self.seconds_per_token_sq * attention
                   + self.seconds_per_decode_context * decode_context + self.intercept_s)

    def max_tokens_within(self, seconds: float, decode_context: int = 0) -> int:
        """The most tokens of one fresh prompt that `predict` keeps within `seconds` beside
        decodes reading `decode_context` KV tokens (at most MAX_TOKENS_WITHIN: a client's
        objective of 1e308 ms is no reason to overflow)."""
        budget = seconds - self.intercept_s - self.seconds_per_decode_context * decode_context
        if budget <= 0:
            return 0
        a, b = self.seconds_per_token, self.seconds_per_token_sq
        if b <= 0:
            tokens = budget / a
        else:
            tokens = (-a + math.sqrt(a * a + 4 * b * budget)) / (2 * b)
        return int(min(tokens, MAX_TOKENS_WITHIN))

    def max_chunk_within(self, seconds: float, tokens: int, attention: int,
                         decode_context: int, prefix: int) -> int:
        """The most tokens a prefill chunk over `prefix` cached tokens can add to a step that
        already holds `tokens` / `attention` / `decode_context` (predict_step's features) and
        keep the step within `seconds`. The chunk's attention over its prefix counts: a 2048-token
        chunk over a 28k prefix costs more than twice a fresh 2048-token prompt."""
        budget = seconds - self.predict_step(tokens, attention, decode_context)
        if budget <= 0:
            return 0
        # a * n + b * n * (2 * prefix + n) <= budget
        a = self.seconds_per_token + 2 * self.seconds_per_token_sq * prefix
        b = self.seconds_per_token_sq
        n = budget / a if b <= 0 else (-a + math.sqrt(a * a + 4 * b * budget)) / (2 * b)
        return int(min(n, MAX_TOKENS_WITHIN))

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
    def fit_step(cls, points: Iterable[tuple[int, int, int, float]], *, quadratic: bool,
                 decode: bool) -> LinearTTFT:
        """Least squares on (tokens, attention, decode_context, seconds) steps: the line plus the
        attention term if `quadratic` and the decode term if `decode`. A term whose coefficient
        comes out <= 0 is dropped and the rest refitted (no step gets cheaper with more work);
        a negative intercept refits through the origin; a slope <= 0 falls back to `fit`.

        Residuals are weighted by 1 / seconds, so the fit minimizes relative errors: steps range
        from 60 ms decodes to 10 s prefills, and in plain least squares the long ones would
        decide every coefficient, the decode term included (on the default model that halved
        it), while the scheduler's margin and caps work in relative error."""
        import numpy as np

        pts = list(points)
        if len({n for n, _, _, _ in pts}) < 2:
            raise ValueError(f"fitting a step model needs points at two or more token counts, "
                             f"got {sorted({n for n, _, _, _ in pts})}")
        features = np.array([[1.0, float(n), float(q), float(d)] for n, q, d, _ in pts])
        y = np.array([s for _, _, _, s in pts])
        weight = 1.0 / np.maximum(y, 1e-6)
        weighted, target = features * weight[:, None], y * weight
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
            return cls.fit((n, s) for n, _, _, s in pts)
        full = np.zeros(4)
        full[[0, 1, *terms]] = coef
        residual = y - features @ full
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((residual ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        return cls(seconds_per_token=float(full[1]), intercept_s=float(full[0]), r2=r2,
                   seconds_per_token_sq=float(full[2]),
                   seconds_per_decode_context=float(full[3]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearTTFT:
        try:
            data = json.loads(Path(path).read_text())
            model = cls(seconds_per_token=float(data["seconds_per_token"]),
                        intercept_s=float(data["intercept_s"]), r2=data.get("r2"),
                        seconds_per_token_sq=float(data.get("seconds_per_token_sq", 0.0)),
                        relative_error=float(data.get("relative_error", 0.0)),
                        seconds_per_decode_context=float(
                            data.get("seconds_per_decode_context", 0.0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"ttft model {str(path)!r} is not a calibration file written by "
                             f"`sloserve calibrate`: {exc}") from exc
        if (model.seconds_per_token <= 0 or model.seconds_per_token_sq < 0
                or model.seconds_per_decode_context < 0):
            raise ValueError(f"ttft model {str(path)!r}: seconds_per_token must be > 0, "
                             f"seconds_per_token_sq and seconds_per_decode_context >= 0, got "
                             f"{model.seconds_per_token}, {model.seconds_per_token_sq} and "
                             f"{model.seconds_per_decode_context}")
        if not 0 <= model.relative_error < math.inf:
            raise ValueError(f"ttft model {str(path)!r}: relative_error must be a finite number "
                             f">= 0, got {model.relative_error}")
        return model


def optimistic_prefill(model: LinearTTFT, tokens: int, decode_context: int = 0) -> float:
    """The fastest a prefill of `tokens` is likely to run: the prediction less the model's
    observed error (a request is written off as doomed only against this)."""
    return model.predict(tokens, decode_context) / (1.0 + model.relative_error)


class OnlineTTFT:
    """Refits the model from the engine's observed steps, starting from a seed until enough
    distinct step sizes were seen. Steps that prefill something and decode-only steps fill two
    sliding windows, and the fit runs on both: decode-only steps come every few hundred
    milliseconds while prefills are rare, and one shared window would forget the prefills. The
    quadratic term is refitted only when the seed has one (calibration found it beats the line);
    the decode term whenever decodes were seen. Every prefill step also updates the model's
    `relative_error` (see the module docstring): it is the margin on predicted prefills. Readers
    get the current model by reference; `observe` replaces it, never mutates it."""

    def __init__(self, seed: LinearTTFT | None = None, window: int = 256,
                 refit_every: int = 8, error_quantile: float = 0.9,
                 error_window: int = 64, decode_window: int = 128) -> None:
        if not 0.0 < error_quantile <= 1.0:
            raise ValueError(f"error_quantile must be in (0, 1], got {error_quantile}")
        self.current = seed or LinearTTFT()
        self.error_quantile = error_quantile
        self._quadratic = self.current.seconds_per_token_sq > 0
        # (tokens, attention, decode_context, seconds) of steps with and without a prefill chunk.
        self._points: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self._decode_points: deque[tuple[int, int, int, float]] = deque(maxlen=decode_window)
        # actual / predicted - 1 of each observed step, against the model before it. A shorter
        # window than the fit's: the margin should forget a seed's error once the refit
        # corrected it.
        self._residuals: deque[float] = deque(maxlen=error_window)
        self._refit_every = refit_every
        self._since_fit = 0

    def observe(self, tokens: int, seconds: float, attention: int | None = None,
                decode_context: int = 0) -> None:
        """One completed step: its tokens, wall time, attention work (default: one fresh prompt
        of `tokens`; 0: a decode-only step) and decode context (see attention_work and
        decode_context)."""
        if tokens <= 0 or seconds <= 0:
            return
        attention = tokens * tokens if attention is None else attention
        point = (tokens, attention, decode_context, seconds)
        if attention > 0:
            predicted = self.current.predict_step(tokens, attention, decode_context)
            if predicted > 0:
                self._residuals.append(seconds / predicted - 1.0)
            self._points.append(point)
        else:
            self._decode_points.append(point)
        model = self.current
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self._since_fit = 0
            fitted = self._refit()
            if fitted is not None and fitted.seconds_per_token > 0:
                model = fitted
        error = self.observed_error()
        if error is None:  # too few steps yet: the seed's margin stands
            error = self.current.relative_error
        if model is not self.current or error != model.relative_error:
            self.current = dataclasses.replace(model, relative_error=error)

    def _refit(self) -> LinearTTFT | None:
        """The model fitted on both windows, or None while the prefill steps span too few
        distinct sizes (decodes alone say nothing about prompts)."""
        prefill_sizes = {n for n, _, _, _ in self._points}
        if len(prefill_sizes) < (3 if self._quadratic else 2):
            return None
        return LinearTTFT.fit_step([*self._points, *self._decode_points],
                                   quadratic=self._quadratic, decode=bool(self._decode_points))

    def observed_error(self) -> float | None:
        """The error quantile of the recent residuals (clipped at 0), or None before
        MIN_ERROR_SAMPLES steps were seen."""
        if len(self._residuals) < MIN_ERROR_SAMPLES:
            return None
        ordered = sorted(self._residuals)
        # The smallest residual with at least `error_quantile` of them at or below it.
        index = max(0, math.ceil(self.error_quantile * len(ordered)) - 1)
        return max(0.0, ordered[index])

    def predict(self, tokens: int, decode_context: int = 0) -> float:
        return self.current.predict(tokens, decode_context)
