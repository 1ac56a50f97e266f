"""Uncertainty favours the deadline (docs/design.md section 5): while the predictor is
unconfident (few points, a large recent error, a change of speed not yet measured), the monitor
stops a relaxed prefill for an urgent waiter that a confident model would have let wait, and
writes no waiter off as doomed. Stopping the relaxed prefill costs it little (suspend keeps its
work); leaving the urgent one queued costs its deadline."""

from __future__ import annotations

import dataclasses
import time

import pytest

import monitor.policy as gate_policy
from monitor.monitor import MonitorSnapshot, SLOMonitor
from monitor.policy import RequestView
from monitor.predictor import UNCERTAIN_ERROR, UNCERTAIN_SPEEDUP, StepTimePredictor
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_time_model import StepTimeModel

LINE = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0, relative_error=0.05)


def _fires(model: StepTimeModel, waiter: RequestView, step_s: float) -> bool:
    """Whether the monitor stops a step of `step_s` (a relaxed document's chunk, just started)
    for `waiter`, judged on `model` as the engine publishes it."""
    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal)  # not started: check() is called directly
        running = (RequestView("document", time.monotonic() + 30.0, 3000),)
        monitor.publish(MonitorSnapshot(step_id=1, preemptible=True, waiting=(waiter,),
                                        running=running, predictor=model,
                                        started_at=time.monotonic(), predicted_step_s=step_s,
                                        num_layers=30))
        return monitor.check() is not None
    finally:
        signal.close()


def _unconfident(model: StepTimeModel) -> StepTimeModel:
    """`model` as StepTimePredictor publishes it while unconfident."""
    return dataclasses.replace(model, confident=False,
                               relative_error=max(model.relative_error, UNCERTAIN_ERROR),
                               relative_speedup=max(model.relative_speedup, UNCERTAIN_SPEEDUP))


def test_an_unconfident_model_stops_the_prefill_a_confident_one_lets_run(monkeypatch):
    monkeypatch.setattr(gate_policy, "DEADLINE_HEADROOM", 0.0)  # the margins alone
    # The step has 0.5 s left and the turn's 100-token prefill 0.1 s: 0.6 s of its 0.7 s.
    waiter = RequestView("turn", time.monotonic() + 0.7, 100)
    assert not _fires(LINE, waiter, 0.5)  # confident: the turn can wait, the step finishes
    assert _fires(_unconfident(LINE), waiter, 0.5)  # unconfident: 50% over would miss it


def test_an_unconfident_model_writes_no_waiter_off(monkeypatch):
    monkeypatch.setattr(gate_policy, "DEADLINE_HEADROOM", 0.0)
    # Predicted 0.3 s of prefill with 0.25 s left: doomed by a confident model (which has seen
    # steps run at most 5% faster), so it would not stop a step that has 0.2 s left for it.
    waiter = RequestView("turn", time.monotonic() + 0.25, 300)
    confident = dataclasses.replace(LINE, relative_speedup=0.05)
    assert not _fires(confident, waiter, 0.2)
    # An unconfident model dooms it only if it would miss even 4x faster than predicted (75 ms
    # of its 250 ms): the turn is served now, its best chance.
    assert _fires(_unconfident(confident), waiter, 0.2)


def test_the_default_seed_is_published_unconfident():
    """Probe for the two tests above: the engine's predictor publishes such a model before it
    has measured anything."""
    current = StepTimePredictor().current
    assert not current.confident and current.relative_error >= UNCERTAIN_ERROR
    assert current.optimistic(1.0) == pytest.approx(1 - UNCERTAIN_SPEEDUP)
