"""Fitting the step-time model (monitor.step_time_model) to measured steps: weighted least
squares on step points (`fit_step`, and its special cases `fit_line` and `fit_quadratic`), the
range the points cover and the cost per unit at its edge (`with_range`), and the error margins
a model's residuals give it (`error_quantiles`).

Used by the calibrations (monitor/step_model_choice.py: `sloserve calibrate`, the engine's
startup calibration) and by the online refit (monitor/predictor.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from monitor.step_point import StepPoint
from monitor.step_time_model import StepTimeModel

# No model of a machine whose steps range from milliseconds to seconds is better than this.
MIN_RELATIVE_ERROR = 0.05
# A point within this share above the floor is taken as floor-bound, not fitted by the terms.
FLOOR_TOLERANCE = 0.1


def fit_line(points: Iterable[tuple[float, float]]) -> StepTimeModel:
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
    return StepTimeModel(seconds_per_token=slope, intercept_s=intercept, r2=r2)


def fit_quadratic(points: Iterable[tuple[int, int, float]]) -> StepTimeModel:
    """Least squares on (tokens, attention work, seconds); a negative attention term falls
    back to the plain line, a negative intercept to a fit through the origin."""
    pts = list(points)
    if len({x for x, _, _ in pts}) < 3:
        raise ValueError(f"fitting the quadratic term needs points at three or more token "
                         f"counts, got {sorted({x for x, _, _ in pts})}")
    return fit_step(((n, q, 0, s) for n, q, s in pts), quadratic=True, decode=False)


def point_table(points: Iterable[Sequence[float]] | np.ndarray) -> np.ndarray:
    """Step points as one float array, a row per point in StepPoint's field order (tokens,
    attention, decode_context, seconds, share); 4-tuples take a share of 1. An array passes
    through: the online refit tabulates its windows once and fits on the table twice."""
    if isinstance(points, np.ndarray):
        return points
    rows = [p if isinstance(p, StepPoint) else StepPoint(*p) for p in points]
    return np.array(rows, dtype=float).reshape(-1, 5)


def fit_step(points: Iterable[Sequence[float]] | np.ndarray, *, quadratic: bool, decode: bool,
             weights: Sequence[float] | np.ndarray | None = None, floor_s: float = 0.0,
             decode_s: float | None = None, keep_range: bool = True) -> StepTimeModel:
    """Least squares on step points (StepPoint, (tokens, attention, decode_context, seconds)
    tuples, or a point_table): the line plus the attention term if `quadratic` and the decode
    term if `decode` (the attention term only where three or more prefill shapes determine
    it). A term whose coefficient comes out <= 0 is dropped and the rest refitted (no
    step gets cheaper with more work); a negative intercept refits through the origin; a
    slope <= 0 falls back to `fit_line`. `weights` multiply each point's weight (recency).

    With `floor_s`, the model is `max(floor_s, terms)`: points within FLOOR_TOLERANCE of
    the floor are its, and the terms are fitted on the others.

    Residuals are weighted by 1 / seconds, so the fit minimizes relative errors: steps range
    from 60 ms decodes to 10 s prefills, and in plain least squares the long ones would
    decide every coefficient, the decode term included (on the default model that halved
    it), while the scheduler's margin and caps work in relative error.

    With `decode_s`, the decode coefficient is that value, not fitted (StepTimePredictor fits
    it on the steps that determine it, and the rest with it fixed). The model keeps the range
    of the points (with_range) unless `keep_range` is false (a fit whose coefficients are all
    that is read)."""
    # Columns: share (the intercept's feature), tokens, attention, decode_context, seconds.
    table = point_table(points)[:, [4, 0, 1, 2, 3]]
    measured = table
    extra = np.ones(len(table)) if weights is None else np.asarray(weights, dtype=float)
    if floor_s > 0:
        kept = table[:, 4] > floor_s * table[:, 0] * (1 + FLOOR_TOLERANCE)
        table, extra = table[kept], extra[kept]
    # Whole-step sizes and prefill shapes (partial points of one shape share them).
    whole = np.round(table[:, 1:3] / table[:, :1], 3)
    sizes = set(whole[:, 0].tolist())
    if len(sizes) < 2:
        raise ValueError(f"fitting a step model needs points at two or more token counts, "
                         f"got {sorted(sizes)}")
    shapes = set(map(tuple, whole[table[:, 2] > 0].tolist()))
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
        line = fit_line(zip(table[:, 1] / table[:, 0],
                            (y - fixed * features[:, 3]) / table[:, 0]))
        line = dataclasses.replace(line, floor_s=floor_s, seconds_per_decode_context=fixed)
        return _with_range(line, measured) if keep_range else line
    full = np.zeros(4)
    full[[0, 1, *terms]] = coef
    full[3] = full[3] if decode_s is None else fixed
    residual = y - features @ full
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((residual ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
    model = StepTimeModel(seconds_per_token=float(full[1]), intercept_s=float(full[0]), r2=r2,
                          seconds_per_token_sq=float(full[2]),
                          seconds_per_decode_context=float(full[3]), floor_s=floor_s)
    return _with_range(model, measured) if keep_range else model


def with_range(model: StepTimeModel, points: Iterable[Sequence[float]] | np.ndarray
               ) -> StepTimeModel:
    """`model` calibrated on `points` (as fit_step takes them): the largest whole-step value of
    each feature among them, and each term's edge cost.

    The edge cost of a term is what a unit of its feature cost at the point where that
    feature is largest (the longest measured point): that point's time less the model's
    other terms, per unit, between 0 and the coefficient (the median over points tied at
    the top; the coefficient itself where the point is the floor's). Past the range, a
    term grows by it rather than by a coefficient that points elsewhere determined: a decode
    slope fitted on 259-token contexts once charged 0.24 s for 3949 tokens of context that
    cost about half that."""
    return _with_range(model, point_table(points)[:, [4, 0, 1, 2, 3]])


def _with_range(model: StepTimeModel, table: np.ndarray) -> StepTimeModel:
    """with_range on rows of (share, tokens, attention, decode_context, seconds)."""
    table = table[table[:, 0] > 0]
    if not len(table):
        return model
    coefs = np.array([model.seconds_per_token, model.seconds_per_token_sq,
                      model.seconds_per_decode_context])
    whole = table[:, 1:4] / table[:, :1]
    limits = whole.max(axis=0)
    edges = [_edge_cost(model, j, table[whole[:, j] >= limits[j] * (1 - 1e-9)], coefs)
             for j in range(3)]
    return dataclasses.replace(
        model, calibrated_tokens=float(limits[0]), calibrated_attention=float(limits[1]),
        calibrated_decode_context=float(limits[2]), edge_seconds_per_token=edges[0],
        edge_seconds_per_token_sq=edges[1], edge_seconds_per_decode_context=edges[2])


def _edge_cost(model: StepTimeModel, j: int, tops: np.ndarray, coefs: np.ndarray
               ) -> float | None:
    """Feature j's edge cost from the rows where it is largest (see with_range)."""
    share, features, seconds = tops[:, 0], tops[:, 1:4], tops[:, 4]
    if coefs[j] <= 0 or (features[:, j] <= 0).any():
        return None  # nothing measured, or no term: nothing to charge differently
    if (seconds <= model.floor_s * share * (1 + FLOOR_TOLERANCE)).any():
        return None  # the floor's point says nothing of the terms
    others = model.intercept_s * share + features @ np.where(np.arange(3) == j, 0.0, coefs)
    implied = (seconds - others) / features[:, j]
    return float(min(coefs[j], max(0.0, float(np.median(implied)))))


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
