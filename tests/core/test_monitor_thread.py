"""The monitor thread's own state stays bounded and survives its own errors: a server
runs for weeks with mostly short, non-preemptible steps."""

from __future__ import annotations

import logging
import time

import pytest

from monitor.monitor import DECISION_HISTORY, MonitorSnapshot, SLOMonitor
from monitor.policy import RequestView
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_time_model import StepTimeModel

LINE = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)


@pytest.fixture
def signal():
    s = SLOPreemptSignal.create()
    yield s
    s.close()


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_arrivals_are_pruned_when_no_step_is_preemptible(signal):
    """Only short prompts: every snapshot is non-preemptible. The arrivals the scheduler has
    drained are dropped all the same, so the map holds only the requests not yet drained."""
    monitor = SLOMonitor(signal)
    monitor.start()
    try:
        for seq in range(1, 2001):
            monitor.publish(MonitorSnapshot(step_id=seq, preemptible=False, waiting=(),
                                            running=(), predictor=LINE, drained_arrivals=seq - 1))
            monitor.note_arrival(seq, RequestView(f"r{seq}", None, 16))
        monitor.publish(MonitorSnapshot(step_id=2001, preemptible=False, waiting=(), running=(),
                                        predictor=LINE, drained_arrivals=2000))
        monitor.note_arrival(2001, RequestView("last", None, 16))
        # Probe: the thread really saw the last arrival (it is the one left pending).
        _wait_until(lambda: list(monitor._arrivals) == [2001])
    finally:
        monitor.stop()


def test_decisions_are_bounded(signal):
    monitor = SLOMonitor(signal)  # not started: check() is called directly
    now = time.monotonic()
    waiter = RequestView("w", deadline=now + 60.0, remaining_prefill_tokens=10)
    running = RequestView("r", deadline=now - 1.0, remaining_prefill_tokens=3000)  # doomed
    for step in range(1, DECISION_HISTORY + 51):
        monitor.publish(MonitorSnapshot(step_id=step, preemptible=True, waiting=(waiter,),
                                        running=(running,), predictor=LINE, started_at=now,
                                        predicted_step_s=100.0, num_layers=30))
        assert monitor.check() is not None  # probe: every step really fired
    assert len(monitor.decisions) == DECISION_HISTORY
    assert monitor.decisions[-1].step_id == DECISION_HISTORY + 50


def test_an_exception_is_logged_counted_and_the_thread_keeps_going(signal, monkeypatch, caplog):
    monitor = SLOMonitor(signal, interval_s=0.001)
    real_check = monitor.check
    failures = {"left": 3}

    def flaky_check():
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("injected monitor fault")
        return real_check()

    monkeypatch.setattr(monitor, "check", flaky_check)
    now = time.monotonic()
    waiter = RequestView("w", deadline=now + 60.0, remaining_prefill_tokens=10)
    running = RequestView("r", deadline=now - 1.0, remaining_prefill_tokens=3000)
    with caplog.at_level(logging.ERROR, logger="monitor.monitor"):
        monitor.start()
        try:
            monitor.publish(MonitorSnapshot(step_id=5, preemptible=True, waiting=(waiter,),
                                            running=(running,), predictor=LINE, started_at=now,
                                            predicted_step_s=100.0, num_layers=30))
            # After three failed checks the thread is still alive and fires on step 5.
            _wait_until(lambda: signal.target_step_id == 5)
        finally:
            monitor.stop()
    assert monitor.num_errors == 3 and failures["left"] == 0
    # Logged with its traceback, once (repeats within the interval are only counted).
    logged = [r for r in caplog.records if "SLO monitor: check failed" in r.getMessage()]
    assert len(logged) == 1 and "injected monitor fault" in caplog.text


def test_monitor_errors_reach_prometheus():
    from engine.serving.metrics import ServerMetrics
    from engine.outputs import SchedulerStats

    metrics = ServerMetrics("m")
    metrics.on_stats(SchedulerStats(monitor_errors=2))
    metrics.on_stats(SchedulerStats(monitor_errors=5))
    text = metrics.render().decode()
    assert 'sloserve:monitor_errors_total{model_name="m"} 5.0' in text


@pytest.mark.parametrize("deadline_s, polls", [(None, False), (60.0, True)])
def test_the_monitor_polls_only_while_a_waiter_with_a_deadline_could_call(signal, monkeypatch,
                                                                         deadline_s, polls):
    """With nothing waiting that carries a deadline, no waiter can call for a preemption: the
    monitor sleeps through the step instead of polling it (no CPU spent on it)."""
    monitor = SLOMonitor(signal, interval_s=0.001)
    checks = {"n": 0}
    real_check = monitor.check

    def counting_check():
        checks["n"] += 1
        return real_check()

    monkeypatch.setattr(monitor, "check", counting_check)
    now = time.monotonic()
    deadline = None if deadline_s is None else now + deadline_s
    # A waiter with 60 s of slack and a step predicted to end in 1 s: waiting is safe, so the
    # gate never fires.
    waiter = RequestView("w", deadline=deadline, remaining_prefill_tokens=10)
    running = RequestView("r", deadline=now + 600.0, remaining_prefill_tokens=3000)
    monitor.start()
    try:
        monitor.publish(MonitorSnapshot(step_id=1, preemptible=True, waiting=(waiter,),
                                        running=(running,), predictor=LINE, started_at=now,
                                        predicted_step_s=1.0, num_layers=30))
        time.sleep(0.2)
    finally:
        monitor.stop()
    assert signal.target_step_id != 1  # probe: nothing fired, so polling never stopped
    if polls:
        assert checks["n"] >= 20  # about every 1 ms for 200 ms, on a busy machine too
    else:
        assert checks["n"] <= 2  # the wake of the publish (and of stop)


def test_a_long_prefill_is_priced_as_the_chunks_of_the_step_budget(signal):
    """A 20480-token document in 2048-token chunks pays a step's fixed cost ten times. With
    that counted (the snapshot's `chunk_tokens`, the scheduler's budget) the document cannot
    meet its deadline and gives its step up to a waiter that needs it; priced as one step, it
    looked 0.14 s early, more urgent than the waiter, and kept it (the probe: the same
    snapshot with `chunk_tokens=0`)."""
    from monitor.step_time_model import predict_prefill

    line = StepTimeModel(seconds_per_token=1.6e-5, intercept_s=0.0327)
    assert line.predict(20480) == pytest.approx(0.3604, rel=1e-3)  # one step: inside 0.5 s
    assert predict_prefill(line, 20480, chunk_tokens=2048) == pytest.approx(0.6547, rel=1e-3)
    decisions = {}
    for chunk_tokens in (0, 2048):
        monitor = SLOMonitor(signal)  # not started: check() is called directly
        now = time.monotonic()
        # Its slack (0.42 s) does not cover the step's time left (0.5 s): it needs the step.
        waiter = RequestView("w", deadline=now + 0.45, remaining_prefill_tokens=100)
        document = RequestView("doc", deadline=now + 0.5, remaining_prefill_tokens=20480)
        monitor.publish(MonitorSnapshot(step_id=1, preemptible=True, waiting=(waiter,),
                                        running=(document,), predictor=line, started_at=now,
                                        predicted_step_s=0.5, num_layers=30,
                                        chunk_tokens=chunk_tokens))
        decisions[chunk_tokens] = monitor.check()
    assert decisions[0] is None
    assert decisions[2048] is not None and decisions[2048].decision.victim_id == "doc"
