"""The step-time model: seconds one forward step takes on this model and machine, from the
step's features (monitor.step_point): `max(floor_s, c + a * tokens + b * attention
+ d * decode_context)`.

`attention` sums `n * (2 * prefix + n)` over the step's prefill chunks (n > 1 new tokens over a
cached prefix; for one fresh prompt that is `n**2`): attention makes long prompts grow faster
than linearly. `decode_context` sums the KV tokens each decode (a one-token chunk) reads,
`prefix + 1`. One model predicts lone prompts, decode-only steps and mixed steps alike. The
decode term is separate from the attention term because a decode is bound by reading its K/V,
not by FLOPs. On a GPU a step also never runs faster than the host can launch its kernels
(about 30 ms for an 8B model in eager mode): `floor_s`, when fitted, is that floor. A step that
ran only some of the layers (unwound mid-forward, or resuming a suspended pass at its layer) is
a point too (monitor.step_point.step_point): each chunk's features are scaled by the share of
the layers it ran, the intercept and the floor by the share the step ran. A request's remaining
TTFT counts only the tokens it still has to prefill, chunk by chunk at the step budget
(`predict_prefill`).

Where a model comes from: least squares on measured points (monitor/step_time_fit.py), by the
engine itself at startup (engine/runtime/startup_calibration.py) and by `sloserve calibrate`
(saved as JSON by `save`, read by `load`: the field names are the file's format), and refitted
online from the engine's own step timings (monitor/predictor.py). A richer model is kept only
where it beats the line on held-out sizes (monitor/step_model_choice.py, docs/design.md
section 5).

The model carries its own error. `relative_error` is a high quantile (``error_quantile``, 0.9 by
default) of `|actual / predicted - 1|` over recent steps against the current model, both ways: a
model that overpredicts 2x is as untrustworthy for the monitor's necessity test as one that
underpredicts. `relative_speedup` is how much faster than predicted steps ran at the low
quantile (`optimistic`). Both have a floor of MIN_RELATIVE_ERROR (monitor.step_time_fit): no
margin is ever 0 while step times range 100x.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from monitor.step_point import StepPoint, attention_work

# Before any measurement: pessimistic for a 135M model on 2 CPU cores (about 1 ms per token plus
# 50 ms per step), so that slack is underestimated rather than overestimated.
DEFAULT_SECONDS_PER_TOKEN = 1e-3
DEFAULT_INTERCEPT_S = 0.05
# More tokens than any step could hold: the answer of max_tokens_within for "no limit".
MAX_TOKENS_WITHIN = 1 << 40


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


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one forward step from its features, with the margins of its own error and
    the range it was calibrated on. Immutable: whoever refits it publishes a new one, and
    readers on other threads hold the one they read."""

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
    # context; see StepPoint.full_tokens) among the points the model was fitted on
    # (monitor.step_time_fit.with_range). Beyond it a term is charged at its edge cost (below)
    # and `extrapolated` names it.
    calibrated_tokens: float | None = None
    calibrated_attention: float | None = None
    calibrated_decode_context: float | None = None
    # Seconds per unit of each feature beyond its calibrated range (None: the coefficient): the
    # cost per unit that the longest measured point implies, never more than the coefficient.
    # A slope fitted on short contexts, or dragged by other steps, is not extrapolated 15x past
    # the longest context anyone timed.
    edge_seconds_per_token: float | None = None
    edge_seconds_per_token_sq: float | None = None
    edge_seconds_per_decode_context: float | None = None
    # Whether the model rests on enough measurement to write a request off: a fit on fewer than
    # CONFIDENT_SIZES prompt sizes (a calibration cut short, the default seed) before
    # MIN_ERROR_SAMPLES served prefill steps, or right after the machine's speed changed, is
    # not (monitor.predictor.StepTimePredictor), and carries wide margins: UNCERTAIN_ERROR,
    # UNCERTAIN_SPEEDUP.
    confident: bool = True

    def margin(self, seconds: float) -> float:
        """The safety margin to add to a predicted duration of `seconds`."""
        return self.relative_error * seconds

    def optimistic(self, seconds: float) -> float:
        """A predicted duration of `seconds` as it comes out when steps run as much faster than
        predicted as they have been: the bound for deciding that a request is doomed. An
        unconfident model's speedup is at least UNCERTAIN_SPEEDUP (StepTimePredictor): it writes
        a request off only where even a step four times faster than it predicts would miss."""
        return seconds * max(0.0, 1.0 - self.relative_speedup)

    def scaled(self, factor: float) -> StepTimeModel:
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

    def to_dict(self) -> dict[str, float | bool | None]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepTimeModel:
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
    def from_dict(cls, data: dict, source: str = "ttft model") -> StepTimeModel:
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


# The optional fields of the calibrated range (monitor.step_time_fit.with_range).
_RANGE_FIELDS = ("calibrated_tokens", "calibrated_attention", "calibrated_decode_context",
                 "edge_seconds_per_token", "edge_seconds_per_token_sq",
                 "edge_seconds_per_decode_context")


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


# Before any measurement (no calibration file, no startup calibration): pessimistic, and
# unconfident until served steps have measured the machine.
DEFAULT_SEED = StepTimeModel(confident=False)


def predict_prefill(model: StepTimeModel, tokens: int, decode_context: int = 0,
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
def _chunk_costs(model: StepTimeModel, tokens: int, chunk_tokens: int
                 ) -> tuple[tuple[float, ...], float, float]:
    """Each chunk's predicted step without decodes and without the floor (predict_prefill), its
    sum and its least."""
    costs, done = [], 0
    while done < tokens:
        chunk = min(chunk_tokens, tokens - done)
        costs.append(model._terms(chunk, attention_work([(done, chunk)]), 0.0, 1.0))
        done += chunk
    return tuple(costs), sum(costs), min(costs)


def optimistic_prefill(model: StepTimeModel, tokens: int, decode_context: int = 0,
                       chunk_tokens: int = 0) -> float:
    """The fastest a prefill of `tokens` is likely to run (a request is written off as doomed
    only against this); chunked as predict_prefill."""
    return model.optimistic(predict_prefill(model, tokens, decode_context, chunk_tokens))
