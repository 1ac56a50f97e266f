"""The step-time predictor: the engine's step-time model (monitor.step_time_model), kept true to
this machine by refitting it online from the steps the engine serves (StepTimePredictor).

The engine owns one (engine/runtime/engine_core.py): the scheduler ranks and caps steps by its
current model, the monitor decides by the model each step's snapshot carries, and the step loop
feeds it every completed, resumed or unwound step (engine/runtime/step_observation.py). Readers
take `current` by reference; `observe_point` replaces it, never mutates it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from monitor.speed_drift import Drift, SpeedDrift
from monitor.step_point import StepPoint
from monitor.step_time_fit import FLOOR_TOLERANCE, error_quantiles, fit_step, point_table
from monitor.step_time_model import DEFAULT_SEED, StepTimeModel

# The error margins are estimated from this many observed prefill steps at least; before that
# the larger of the seed's and the steps' stands. Until then every prefill step refits.
MIN_ERROR_SAMPLES = 8
# Online fits weight a point by 2 ** (-age / RECENCY_HALF_LIFE), age counted in its window's
# steps: the machine's speed drifts (other processes, clocks) and recent steps tell it best.
RECENCY_HALF_LIFE = 64
# Online refits: a mixed (prefill and decodes) or partial (unwound, resumed) step weighs this
# much of a whole step of one kind, and fits no decode term (StepTimePredictor._refit).
MIXED_WEIGHT = 0.25
# A decode-only step above the floor that implies this many times the decode term the
# floor-bound steps allow is a stall of the host, not the KV it read (StepTimePredictor's
# _decode_coefficient).
STALL_FACTOR = 2.0
# Confidence (StepTimePredictor): a startup calibration that timed fewer prompt sizes than this
# seeds an unconfident model; a model whose observed error exceeds CONFIDENT_ERROR is
# unconfident; an unconfident model's error margin is at least UNCERTAIN_ERROR, and its speedup
# (how much faster than predicted steps may run: the bound a request is written off as doomed
# against) at least UNCERTAIN_SPEEDUP.
CONFIDENT_SIZES = 3
CONFIDENT_ERROR = 0.5
UNCERTAIN_ERROR = 0.5
UNCERTAIN_SPEEDUP = 0.75


def recency_weights(count: int, half_life: float = RECENCY_HALF_LIFE) -> np.ndarray:
    """Weights of a window's points, oldest first, the newest at 1."""
    return 0.5 ** (np.arange(count - 1, -1, -1) / half_life)


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


class StepTimePredictor:
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

    Confidence (StepTimeModel.confident): a seed fitted on fewer than CONFIDENT_SIZES prompt
    sizes, or the default seed, is unconfident until MIN_ERROR_SAMPLES prefill steps were
    served; so is any model whose observed error exceeds CONFIDENT_ERROR, or that follows a
    drift not yet confirmed by MIN_ERROR_SAMPLES prefill steps. While it is, its error margin
    is at least UNCERTAIN_ERROR and its speedup at least UNCERTAIN_SPEEDUP: deadlines get the
    benefit of the doubt (docs/design.md section 5)."""

    def __init__(self, seed: StepTimeModel | None = None, window: int = 256,
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

    def reseed(self, seed: StepTimeModel, points: Iterable[StepPoint] = ()) -> None:
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
        self.current: StepTimeModel = (seed if seed.confident else dataclasses.replace(
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

    def _follow_drift(self, model: StepTimeModel, drift: Drift) -> StepTimeModel:
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

    def _publish(self, model: StepTimeModel) -> None:
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

    def _refit(self, base: StepTimeModel) -> StepTimeModel | None:
        """The model fitted on both windows (recent points weigh more), with `base`'s floor
        (the model it replaces, at the machine's current speed); None while the prefill steps
        span too few distinct sizes (decodes alone say nothing about prompts).

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
        first = prefills[0].full_tokens if prefills else 0.0
        if not any(abs(p.full_tokens - first) > 1e-6 for p in prefills):
            return None  # one prefill size at most
        table = point_table([*prefills, *decodes])
        weights = np.concatenate([recency_weights(len(prefills)),
                                  recency_weights(len(decodes))])
        tokens, attention, context, seconds, share = table.T
        # A whole step of decodes only or of prefill chunks only weighs 1, any other
        # MIXED_WEIGHT.
        single = (share >= 1.0 - 1e-9) & ((attention <= 0) | (context <= 0))
        weights = weights * np.where(single, 1.0, MIXED_WEIGHT)
        decode = bool((context > 0).any())
        decode_s = self._decode_coefficient(table, weights, single, base) if decode else None
        try:
            return fit_step(table, quadratic=True, decode=decode, weights=weights,
                            floor_s=base.floor_s, decode_s=decode_s)
        except ValueError:  # too few distinct sizes (above the floor)
            return None

    def _decode_coefficient(self, table: np.ndarray, weights: np.ndarray, single: np.ndarray,
                            base: StepTimeModel) -> float | None:
        """The decode term as the whole decode-only steps (the seed's among them, until served
        steps push them out) show it: what they cost beyond the intercept and the per-token
        cost of a fit on every point of `table` (point_table rows, weighed by `weights`,
        mixed and partial ones already at MIXED_WEIGHT), per KV token read. The intercept and
        the per-token cost are determined by every step; the decode term, the one coefficient
        left, only by the steps where it is all the rest. None (a joint fit: the other steps
        are all the evidence there is) where no whole decode-only step is in the windows."""
        tokens, attention, context, seconds, _ = table.T
        decodes = single & (attention <= 0) & (context > 0)
        if not decodes.any():
            return None
        try:
            joint = fit_step(table, quadratic=True, decode=True, floor_s=base.floor_s,
                             weights=weights, keep_range=False)
        except ValueError:
            return None
        tokens, context, seconds = tokens[decodes], context[decodes], seconds[decodes]
        weight = weights[decodes]
        # What each decode step cost beyond the intercept and the per-token term.
        beyond = seconds - joint.intercept_s - joint.seconds_per_token * tokens
        # A step at the floor bounds the term: its decodes cost no more than the floor leaves
        # them.
        at_floor = seconds <= joint.floor_s * (1 + FLOOR_TOLERANCE)
        bound = (float((np.maximum(0.0, beyond[at_floor]) / context[at_floor]).min())
                 if at_floor.any() else math.inf)
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
        used = ~at_floor & ~(beyond > STALL_FACTOR * bound * context)
        x = context[used] / seconds[used]
        den = float((weight[used] * x * x).sum())
        if den <= 0:
            # Every decode-only step ran at the floor: they show the floor, not what a KV
            # token costs, and the mixed steps would put the floor's time into the decode
            # term (in the GPU-timed simulation, 11x the profile's). Keep what it was, within
            # what the floor-bound steps allow (a seed timed on a noisy CPU once said 1.3e-4 s
            # a KV token, where its decode steps at 2000 tokens of context ran at the floor).
            return min(base.seconds_per_decode_context, bound)
        num = float((weight[used] * x * beyond[used] / seconds[used]).sum())
        return min(max(0.0, num / den), bound)

    def predict(self, tokens: int, decode_context: int = 0) -> float:
        return self.current.predict(tokens, decode_context)


def _residual(model: StepTimeModel, point: StepPoint) -> float:
    predicted = model.predict_point(point)
    return point.seconds / predicted - 1.0 if predicted > 0 else 0.0
