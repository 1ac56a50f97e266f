"""Noticing that the machine's steps have started to run slower or faster than the fitted step
model says: a neighbour taking the cores, a throttled clock, a slower GPU clock.

The online fit (monitor.predictor.StepTimePredictor) weighs recent steps more, but it refits
every few steps over windows of hundreds with a half-life of 64 steps: after a change of speed
its predictions trail the machine for tens of steps, and an urgent deadline is lost in one or
two.
So the change is looked for apart from the fit:

- each whole step (every layer ran) gives a ratio, its time over the model's prediction;
- each of the last RECENT_STEPS served steps' ratio is compared with the usual ratio of its
  kind (decode-only, or carrying a prefill chunk: the median of that kind's steps before
  them): what the fit gets wrong about a kind as a rule (decode steps 20% under their
  prediction, say) is its bias, not a change of speed, and only a departure from it is;
- when every one of the last RECENT_STEPS departs from it by more than TOLERANCE the same way,
  the machine's speed has changed, by the median departure. One step of five out of the
  tolerance is what noise does now and then (a stalled step, a cache-cold one); five in a row
  it is not: with 10% noise per step, a detector on the median of five instead fired 7 to 27
  times in 400 steps of a machine whose speed never changed.

The predictor then rescales what it measured before the change by that factor and refits
(StepTimePredictor._follow_drift): the fit's shape stays, and its scale follows within RECENT_STEPS
steps.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from monitor.step_point import StepPoint

RECENT_STEPS = 5
BASELINE_STEPS = 64
# A recent median within this share of the kind's usual ratio is noise: on a 2-core machine the
# same step varies by 10-15% from run to run.
TOLERANCE = 0.2
# A drift is followed within these factors at once; a model further off is refitted in steps.
MIN_FACTOR, MAX_FACTOR = 0.125, 8.0


class PointModel(Protocol):
    def predict_point(self, point: StepPoint) -> float: ...


@dataclass(frozen=True)
class Drift:
    # The steps run this many times what the model predicted, relative to the kind's usual.
    factor: float
    # Observation index of the first step at the new speed: steps before it ran at the old one.
    since: int


def _kind(point: StepPoint) -> str:
    return "decode" if point.attention <= 0 else "prefill"


def _whole(point: StepPoint) -> bool:
    return point.share >= 1.0 - 1e-9


class SpeedDrift:
    """Each kind's recent whole steps, their observation indices and their ratios against the
    current model (see the module's text)."""

    def __init__(self) -> None:
        self._steps: dict[str, deque[tuple[int, StepPoint, float]]] = {
            "decode": deque(maxlen=BASELINE_STEPS + RECENT_STEPS),
            "prefill": deque(maxlen=BASELINE_STEPS + RECENT_STEPS)}
        # The observation indices of the last RECENT_STEPS served whole steps, of either kind.
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)

    def reseed(self, model: PointModel, points: Iterable[StepPoint]) -> None:
        """Start over from the points `model` was calibrated on (observed before every step,
        index -1): the kinds' usual ratios until served steps push them out."""
        for steps in self._steps.values():
            steps.clear()
        self._recent.clear()
        for point in points:
            if _whole(point) and point.seconds > 0:
                self._steps[_kind(point)].append((-1, point, _ratio(model, point)))

    def observe(self, model: PointModel, point: StepPoint, index: int) -> Drift | None:
        """One served step (index: its observation number) and the model it was predicted
        with; the drift the last RECENT_STEPS served steps show, if any. Partial steps do not
        count: their prediction is rougher than any drift worth following."""
        if not _whole(point) or point.seconds <= 0:
            return None
        self._steps[_kind(point)].append((index, point, _ratio(model, point)))
        self._recent.append(index)
        if len(self._recent) < RECENT_STEPS:
            return None
        # Each kind's steps are in observation order, and the recent ones are the last whole
        # steps of either kind: a kind's recent steps are the tail from the first recent index.
        first_recent = self._recent[0]
        departures = []
        for steps in self._steps.values():
            tail = 0
            while tail < len(steps) and steps[-1 - tail][0] >= first_recent:
                tail += 1
            if not tail:
                continue
            all_ratios = [ratio for _, _, ratio in steps]
            ratios, before = all_ratios[-tail:], all_ratios[:-tail]
            if len(before) < RECENT_STEPS:
                return None  # no usual ratio to depart from yet
            usual = statistics.median(before)
            if usual <= 0:
                return None
            departures += [ratio / usual for ratio in ratios]
        # Every one of them beyond the tolerance, the same way: noise puts one step of five
        # out of it now and then, a change of speed puts them all.
        if not (min(departures) > 1.0 + TOLERANCE
                or max(departures) < 1.0 / (1.0 + TOLERANCE)):
            return None
        factor = statistics.median(departures)
        return Drift(min(MAX_FACTOR, max(MIN_FACTOR, factor)), self._recent[0])

    def rescale(self, drift: Drift, model: PointModel) -> None:
        """After the predictor followed `drift` (the steps before it rescaled, `model` fitted
        anew): the same for the ratios kept here, so that the kinds' usual ratios hold at the
        new speed and the same departure is not seen twice."""
        for kind, steps in self._steps.items():
            rescaled = [(i, p._replace(seconds=p.seconds * drift.factor) if i < drift.since
                         else p) for i, p, _ in steps]
            self._steps[kind] = deque(((i, p, _ratio(model, p)) for i, p in rescaled),
                                      maxlen=steps.maxlen)

    def refit(self, model: PointModel) -> None:
        """The ratios against a new fit of the same speed (a periodic refit)."""
        for kind, steps in self._steps.items():
            self._steps[kind] = deque(((i, p, _ratio(model, p)) for i, p, _ in steps),
                                      maxlen=steps.maxlen)


def _ratio(model: PointModel, point: StepPoint) -> float:
    predicted = model.predict_point(point)
    return point.seconds / predicted if predicted > 0 else 1.0
