"""How the monitor weighs an urgent arrival against the running step at GPU time scales:
the step's time left from the layers the device finished, the join layers of resumed
chunks, the run-ahead window, and a waiter written off only when it is late even under the
optimistic estimate."""

from __future__ import annotations

import time

import pytest

from monitor.monitor import MonitorSnapshot, SLOMonitor
from monitor.policy import RequestView, choose_slo_preemption, urgency
from monitor.slo_preempt_signal import SLOPreemptSignal
from monitor.step_progress import predicted_layer_ends, remaining_seconds
from monitor.step_time_model import StepTimeModel
from workers.preemption.slo_preempt_vote import SLOPreemptVote

H100_LINE = StepTimeModel(seconds_per_token=3e-5, intercept_s=0.03, seconds_per_token_sq=8.3e-10)
LAYERS = 32
# A fresh 2048-token chunk beside a 24k-token chunk that resumes at layer 20.
CHUNKS = [(0, 2048, 0), (0, 24_000, 20)]


def _layer(tokens: int) -> float:
    return H100_LINE.predict_step(tokens, tokens * tokens) / LAYERS


def test_layers_below_a_resumed_chunks_join_carry_only_the_fresh_chunk():
    ends = predicted_layer_ends(H100_LINE.predict_step, CHUNKS, LAYERS)
    fresh = _layer(2048)
    both = H100_LINE.predict_step(26_048, 2048 ** 2 + 24_000 ** 2) / LAYERS
    assert ends[20] == pytest.approx(20 * fresh)
    assert ends[-1] == pytest.approx(20 * fresh + 12 * both)


def test_the_time_left_follows_the_measured_pace_and_never_undercuts_the_prediction():
    ends = predicted_layer_ends(H100_LINE.predict_step, CHUNKS, LAYERS)
    truth_left = ends[-1] - ends[10]
    # On pace: 10 layers done when predicted. The old estimate, elapsed / done x layers left,
    # priced the 12 layers that carry the resumed 24k tokens like the fresh-only ones.
    on_pace = remaining_seconds(ends, 10, reported_at=ends[10], started_at=0.0)
    assert on_pace == pytest.approx(truth_left)
    old_estimate = ends[10] / 10 * (LAYERS - 10)
    assert old_estimate < truth_left / 4
    # Twice as slow as predicted: twice the time left. Faster: never less than predicted.
    assert remaining_seconds(ends, 10, 2 * ends[10], 0.0) == pytest.approx(2 * truth_left)
    assert remaining_seconds(ends, 10, ends[10] / 2, 0.0) == pytest.approx(truth_left)
    # No layer of this step finished yet (a resumed-only step starts at its join): all of it.
    assert remaining_seconds(ends, 0, 0.0, 0.0) == pytest.approx(ends[-1])


def test_the_monitor_decides_for_a_waiter_the_resumed_layers_would_make_late():
    """10 of 32 layers done on pace, 0.33 s to go by the layers' real costs (0.04 s by the old
    estimate); a waiter with 0.2 s of slack gets a decision."""
    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal)
        ends = predicted_layer_ends(H100_LINE.predict_step, CHUNKS, LAYERS)
        now = time.monotonic()
        started = now - ends[10]
        waiter = RequestView("w", deadline=now + 0.25, remaining_prefill_tokens=128)
        running = RequestView("r", deadline=now + 60.0, remaining_prefill_tokens=26_048)
        monitor.publish(MonitorSnapshot(step_id=3, preemptible=True, waiting=(waiter,),
                                        running=(running,), predictor=H100_LINE,
                                        started_at=started, predicted_step_s=ends[-1],
                                        num_layers=LAYERS, layer_ends=ends))
        signal.report_progress(3, 10, at=now)
        decision = monitor.check()
        assert decision is not None and decision.decision.waiter_id == "w"
    finally:
        signal.close()


def test_progress_reports_the_layers_the_device_finished_not_the_host():
    """On a GPU the host votes up to `window` layers ahead of the device (workers/preemption/run_ahead.py):
    the progress the monitor reads is the device's."""
    signal = SLOPreemptSignal.create()
    try:
        vote = SLOPreemptVote(signal, LAYERS)
        vote.step_id = 4
        vote(10)
        assert signal.layers_done(4) == 10  # no run-ahead: the host is the device
        vote.progress_lag = 2
        vote(11)
        assert signal.layers_done(4) == 9
        vote(1)
        assert signal.layers_done(4) == 0
    finally:
        signal.close()


def test_a_waiter_is_doomed_only_if_late_under_the_optimistic_estimate():
    """A predictor running 2x pessimistic says a 128-token turn with 150 ms left needs 200 ms:
    doomed, and never preempted for. Under the optimistic estimate (here half) it is
    rescuable, and the gate decides for it. Probe: without the optimistic estimate, no
    decision."""
    now = 100.0
    pessimistic = lambda tokens: 0.2  # noqa: E731
    optimistic = lambda tokens: 0.1  # noqa: E731
    waiter = RequestView("w", deadline=now + 0.15, remaining_prefill_tokens=128)
    running = RequestView("r", deadline=now + 60.0, remaining_prefill_tokens=24_000)
    assert urgency(waiter, now, pessimistic).doomed
    assert not urgency(waiter, now, pessimistic, optimistic=optimistic).doomed
    # The step has 0.15 s left, less than the waiter's prefill: a doomed waiter would lose
    # more waiting for its prefill than it gains by stopping the step (monitor.policy).
    assert choose_slo_preemption([waiter], [running], now, pessimistic,
                             step_remaining_s=0.15) is None
    decision = choose_slo_preemption([waiter], [running], now, pessimistic, step_remaining_s=0.15,
                                 optimistic=optimistic)
    assert decision is not None and decision.waiter_id == "w"
