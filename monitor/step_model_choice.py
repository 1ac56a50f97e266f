"""Which step model a calibration keeps (docs/design.md section 5): a richer model must beat the
line on held-out data.

Candidates, simplest first: the line (with the decode term where decodes were timed), the line
plus the attention term, and each of those under a fitted floor, `max(floor_s, terms)`: on a GPU
small steps all take the host's launch time, which a sum of terms fits badly at small sizes.
Each candidate is scored by leaving out one prefill point at a time (decode points always stay
in: they pin the decode term, not the prompt cost) and predicting it from a fit on the rest; a
candidate is kept only if its error is below every simpler one's (by MIN_IMPROVEMENT).

Used by `sloserve calibrate` and by the engine's startup calibration.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from monitor.step_point import StepPoint
from monitor.step_time_fit import error_quantiles, fit_step
from monitor.step_time_model import StepTimeModel

Fitter = Callable[[Sequence[StepPoint]], StepTimeModel]
# A richer candidate must beat the simpler ones' held-out error by this much (RMS, absolute):
# on points it fits exactly, every candidate's error is rounding noise.
MIN_IMPROVEMENT = 0.005
# The floor is fitted over the cheapest points; at least this many stay for the terms.
MIN_POINTS_ABOVE_FLOOR = 2


def fit_with_floor(points: Sequence[StepPoint], quadratic: bool, decode: bool) -> StepTimeModel:
    """`max(floor, terms)`: the floor is the median time of the k cheapest points for the k
    whose model fits all points best (weighted like fit_step: relative errors)."""
    by_time = sorted(points, key=lambda p: p.seconds / p.share)
    best: tuple[float, StepTimeModel] | None = None
    for k in range(1, len(by_time) - MIN_POINTS_ABOVE_FLOOR + 1):
        floor = statistics.median(p.seconds / p.share for p in by_time[:k])
        try:
            model = fit_step(points, quadratic=quadratic, decode=decode,
                             floor_s=floor)
        except ValueError:  # too few sizes left above that floor
            continue
        error = sum(_prediction_error(model, p) ** 2 for p in points)
        if best is None or error < best[0]:
            best = (error, model)
    if best is None:
        raise ValueError("no floor leaves two or more sizes to fit the terms on")
    return best[1]


def candidates(decode: bool) -> dict[str, Fitter]:
    """The candidate models by name, simplest first."""
    return {
        "line": lambda pts: fit_step(pts, quadratic=False, decode=decode),
        "quadratic": lambda pts: fit_step(pts, quadratic=True, decode=decode),
        "line+floor": lambda pts: fit_with_floor(pts, quadratic=False, decode=decode),
        "quadratic+floor": lambda pts: fit_with_floor(pts, quadratic=True, decode=decode),
    }


def held_out_errors(points: Sequence[StepPoint], fitter: Fitter) -> list[float] | None:
    """predicted / actual - 1 of each prefill point from a fit on the others, or None when
    some fit cannot be made without it (too few sizes)."""
    errors = []
    for i, point in enumerate(points):
        if point.attention <= 0:
            continue
        try:
            model = fitter([p for j, p in enumerate(points) if j != i])
        except ValueError:
            return None
        errors.append(_prediction_error(model, point))
    return errors or None


def rms(errors: Sequence[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def choose_step_model(points: Sequence[StepPoint], error_quantile: float = 0.9
                      ) -> tuple[StepTimeModel, dict[str, float | None]]:
    """The kept model, fitted on all points, and every candidate's held-out error (root mean
    square of relative errors; None: too few points to tell). The kept model's margins come
    from its held-out errors (actual / predicted - 1 of each point left out), the honest
    estimate of how wrong it is on sizes it has not seen, or with too few points from its
    residuals."""
    decode = any(p.decode_context > 0 for p in points)
    scores: dict[str, float | None] = {}
    held_out: dict[str, list[float]] = {}
    for name, fitter in candidates(decode).items():
        errors = held_out_errors(points, fitter)
        scores[name] = None if errors is None else rms(errors)
        if errors is not None:
            held_out[name] = errors
    chosen = "line"
    for name, score in scores.items():
        best = scores[chosen]
        if score is not None and (best is None or score < best - MIN_IMPROVEMENT):
            chosen = name
    model = candidates(decode)[chosen](points)
    # Too few points to hold any out: the fit's own residuals (the margins' floor at least).
    errors = held_out.get(chosen) or [_prediction_error(model, p) for p in points]
    # predicted / actual - 1 -> actual / predicted - 1 (a prediction of nothing: the model is
    # no use there, which an error of 10x says).
    ratios = [1.0 / (1.0 + e) - 1.0 if e > -0.9 else 10.0 for e in errors]
    error, speedup = error_quantiles(ratios, error_quantile)
    model = dataclasses.replace(model, relative_error=error, relative_speedup=speedup)
    return model, scores


def _prediction_error(model: StepTimeModel, point: StepPoint) -> float:
    """predicted / actual - 1: relative to the actual time, as fit_step weighs residuals."""
    return model.predict_point(point) / point.seconds - 1.0
