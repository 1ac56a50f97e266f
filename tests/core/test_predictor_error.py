"""The TTFT predictor's own error (monitor.predictor: relative_error) and the safety margin the
monitor's necessity gate adds with it."""

from __future__ import annotations

import json
import time

import pytest

from monitor.monitor import MonitorSnapshot, SLOMonitor
import monitor.policy as gate_policy
from monitor.policy import DEADLINE_HEADROOM, RequestView, choose_slo_preemption
from monitor.predictor import StepTimePredictor
from monitor.step_time_fit import MIN_RELATIVE_ERROR
from monitor.step_time_model import StepTimeModel
from monitor.slo_preempt_signal import SLOPreemptSignal

SIZES = [128, 512, 256, 1024, 384, 768, 640, 896]


def test_the_error_is_how_wrong_the_current_model_is_both_ways():
    truth = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02)
    optimistic = StepTimeModel(seconds_per_token=1e-3 / 1.25, intercept_s=0.02 / 1.25)
    online = StepTimePredictor(optimistic)
    online.observe(SIZES[0], truth.predict(SIZES[0]))
    # One size: no refit yet, and the step ran 25% over the seed.
    assert online.current.seconds_per_token == optimistic.seconds_per_token
    assert online.current.relative_error == pytest.approx(0.25)
    online.observe(SIZES[1], truth.predict(SIZES[1]))
    # Two sizes refit at once; against the new (exact) model the residuals are 0, and the
    # margin is the floor.
    assert online.current.seconds_per_token == pytest.approx(1e-3)
    assert online.current.relative_error == MIN_RELATIVE_ERROR
    # Every size's steps alternately 20% over and 20% under the truth (the order shifted each
    # round, so that every size is seen both ways): the refit stays near it, and the margins
    # say how far steps stray from it each way. (Eight in a row 20% over after eight 20% under
    # would be the machine slowing down by half: monitor/speed_drift.py.)
    for i in range(48):
        over = (i + i // 8) % 2
        online.observe(SIZES[i % 8], truth.predict(SIZES[i % 8]) * (1.2 if over else 0.8))
    assert online.current.predict(512) == pytest.approx(truth.predict(512), rel=0.1)
    # (The fit weighs relative errors, so it leans to the faster runs: about 0.92x the truth.)
    assert 0.15 < online.current.relative_error < 0.35
    assert 0.1 < online.current.relative_speedup < 0.3
    assert online.current.optimistic(1.0) == 1.0 - online.current.relative_speedup


def test_the_error_is_never_0_after_a_seed_ten_times_too_pessimistic():
    """The H100 bug: residuals were taken against the model before each step and clipped at
    0, so against a pessimistic seed they were all 0 and the margin was 0 while the model was
    10x off."""
    truth = StepTimeModel(seconds_per_token=1e-4, intercept_s=0.003)
    seed = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.03)
    same_size = StepTimePredictor(seed)  # one size: nothing to refit on, the model stays 10x off
    for _ in range(20):
        same_size.observe(512, truth.predict(512))
        assert same_size.current.predict(512) == pytest.approx(10 * truth.predict(512))  # probe
        assert same_size.current.relative_error == pytest.approx(0.9)
        # A model that far off is unconfident; its observed speedup (0.9) is wider than the
        # uncertain one, and its optimistic bound is the truth.
        assert not same_size.current.confident
        assert same_size.current.optimistic(same_size.current.predict(512)) == \
            pytest.approx(truth.predict(512))
    refitted = StepTimePredictor(seed)
    for i in range(20):
        refitted.observe(SIZES[i % 8], truth.predict(SIZES[i % 8]))
        assert refitted.current.relative_error >= MIN_RELATIVE_ERROR
    assert refitted.current.predict(512) == pytest.approx(truth.predict(512))  # probe: refit


def test_the_quantile_is_the_configured_one_and_both_directions_count():
    truth = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02)
    spread = [0.0, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.40, 0.45]
    errors = {}
    for quantile in (0.5, 0.9):
        online = StepTimePredictor(truth, refit_every=None, error_quantile=quantile)  # never refit
        for i, over in enumerate(spread * 3):
            online.observe(SIZES[i % 8], truth.predict(SIZES[i % 8]) * (1 + over))
        errors[quantile] = online.current.relative_error
        assert online.current.relative_speedup == MIN_RELATIVE_ERROR  # none ran faster
    assert errors[0.5] == pytest.approx(0.20)
    assert errors[0.9] == pytest.approx(0.40)
    faster = StepTimePredictor(truth, refit_every=None)
    for i in range(20):
        faster.observe(SIZES[i % 8], truth.predict(SIZES[i % 8]) * 0.5)
    # Overpredicting 2x is as wrong as underpredicting: the margin is not 0.
    assert faster.current.relative_error == pytest.approx(0.5)
    assert faster.current.relative_speedup == pytest.approx(0.5)
    assert faster.current.optimistic(truth.predict(512)) == pytest.approx(truth.predict(512) / 2)
    with pytest.raises(ValueError, match="error_quantile"):
        StepTimePredictor(error_quantile=0.0)


def test_the_error_survives_save_and_load(tmp_path):
    path = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=2e-3, intercept_s=0.01, relative_error=0.15).save(path)
    assert StepTimeModel.load(path).relative_error == 0.15
    # A seed's error is the online model's margin until enough steps were seen.
    assert StepTimePredictor(StepTimeModel.load(path)).current.relative_error == 0.15
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "relative_error": -0.1}))
    with pytest.raises(ValueError, match="relative_error"):
        StepTimeModel.load(path)


def test_the_gate_waits_only_if_the_step_and_its_prefill_fit_the_usable_time():
    """Waiting for the step is safe only if the step's rest and the waiter's prefill, each
    allowed the predictor's error, fit the waiter's time less DEADLINE_HEADROOM (75% of it)."""
    assert DEADLINE_HEADROOM == 0.25
    now = 100.0
    line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)
    waiter = RequestView("w", deadline=now + 1.2, remaining_prefill_tokens=200)  # slack 1.0 s
    running = [RequestView("r", deadline=None, remaining_prefill_tokens=3000)]
    # 0.6 + 0.2 s fits the usable 0.9 s: the waiter waits.
    assert choose_slo_preemption([waiter], running, now, line.predict, step_remaining_s=0.6) is None
    # With a 20% error, 1.2 x 0.8 = 0.96 s does not fit: preempt now.
    decision = choose_slo_preemption([waiter], running, now, line.predict, step_remaining_s=0.6,
                                     relative_error=0.2)
    assert decision is not None and decision.waiter_id == "w"
    # 0.9 + 0.2 s fits the slack (1.0 s) but not the usable time: preempt (before the headroom
    # counted here, it waited, and the turn met its deadline only if nothing else ran over).
    decision = choose_slo_preemption([waiter], running, now, line.predict, step_remaining_s=0.9)
    assert decision is not None and decision.waiter_id == "w"


def _ttft_with_gate(model: StepTimeModel, truth: StepTimeModel, slo_s: float) -> float:
    """A 3000-token step starts at t = 0 (30 layers, at the true speed); a 200-token request
    with a TTFT objective of `slo_s` arrives at t = 2 s. The monitor's gate runs every 2 ms with
    the step's remaining time from its own pace (exact here) and the waiter's prefill from
    `model`; the request's TTFT follows from the true times: the step unwinds one layer after
    the decision, or the request waits for the step's end."""
    step_s, layers = truth.predict(3000), 30
    arrival = 2.0
    waiter = RequestView("urgent", deadline=arrival + slo_s, remaining_prefill_tokens=200)
    running = [RequestView("long", deadline=None, remaining_prefill_tokens=3000)]
    now = arrival
    while now < step_s:
        decision = choose_slo_preemption([waiter], running, now, model.predict,
                                     step_remaining_s=step_s - now,
                                     relative_error=model.relative_error)
        if decision is not None:
            return now + step_s / layers + truth.predict(200) - arrival
        now += 0.002
    return step_s + truth.predict(200) - arrival


def test_a_just_in_time_decision_misses_and_the_learned_margin_saves_it(monkeypatch):
    """The probe-paired survival test: with a calibration 30% optimistic, the gate without a
    margin lets the urgent request wait out the step and it misses; after the engine saw steps
    run 30% over, the same gate preempts and the request meets its objective. The learned
    margin alone: DEADLINE_HEADROOM (which would cover most of a 30% error by itself) is off."""
    monkeypatch.setattr(gate_policy, "DEADLINE_HEADROOM", 0.0)
    truth = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02)
    seed = StepTimeModel(seconds_per_token=1e-3 / 1.3, intercept_s=0.02 / 1.3)
    slo_s = 1.22  # waiting out the step takes 1.02 s + the request's own 0.22 s
    assert _ttft_with_gate(seed, truth, slo_s) > slo_s  # probe: the error really costs a miss
    online = StepTimePredictor(seed, refit_every=None)  # the margin alone, no refit
    for i in range(16):
        online.observe(SIZES[i % 8], truth.predict(SIZES[i % 8]))
    assert online.current.relative_error == pytest.approx(0.3)
    assert _ttft_with_gate(online.current, truth, slo_s) <= slo_s


def test_the_monitor_applies_the_margin_of_the_snapshot_s_predictor(monkeypatch):
    monkeypatch.setattr(gate_policy, "DEADLINE_HEADROOM", 0.0)  # the margin alone
    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal)  # not started: check() is called directly
        now = time.monotonic()
        waiter = RequestView("w", deadline=now + 1.2, remaining_prefill_tokens=200)
        running = (RequestView("r", None, 3000),)
        for step, error in ((1, 0.0), (2, 0.2)):
            line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0, relative_error=error)
            monitor.publish(MonitorSnapshot(step_id=step, preemptible=True, waiting=(waiter,),
                                            running=running, predictor=line, started_at=now,
                                            predicted_step_s=0.9, num_layers=30))
            fired = monitor.check()
            assert (fired is not None) == (error > 0)
    finally:
        signal.close()


def test_a_refit_from_the_first_steps_of_two_and_three_sizes():
    """The seed is replaced as soon as the steps determine a model: two sizes for the line,
    three for the attention term (tried whatever the seed had)."""
    line = StepTimeModel(seconds_per_token=2e-4, intercept_s=0.004)
    online = StepTimePredictor()  # the pessimistic default, a plain line
    online.observe(128, line.predict(128))
    assert online.current.seconds_per_token == StepTimeModel().seconds_per_token  # one size
    online.observe(1024, line.predict(1024))
    assert online.current.predict(512) == pytest.approx(line.predict(512))
    curved = StepTimeModel(seconds_per_token=2e-4, intercept_s=0.004, seconds_per_token_sq=1e-7)
    online = StepTimePredictor()
    for n in (128, 1024, 2048):
        online.observe(n, curved.predict(n))
    assert online.current.seconds_per_token_sq == pytest.approx(1e-7)
    assert online.current.predict(4096) == pytest.approx(curved.predict(4096))


def test_every_field_survives_save_and_load_and_older_files_still_load(tmp_path):
    path = tmp_path / "ttft.json"
    model = StepTimeModel(seconds_per_token=2e-4, intercept_s=0.002, r2=0.99,
                          seconds_per_token_sq=1e-10, relative_error=0.12,
                          seconds_per_decode_context=3e-6, floor_s=0.03, relative_speedup=0.08)
    model.save(path)
    assert StepTimeModel.load(path) == model
    # A file from before the floor and the speedup: both 0, the rest as written.
    path.write_text(json.dumps({"seconds_per_token": 2e-4, "intercept_s": 0.002, "r2": 0.9,
                                "seconds_per_token_sq": 0.0, "relative_error": 0.1,
                                "seconds_per_decode_context": 0.0}))
    old = StepTimeModel.load(path)
    assert (old.floor_s, old.relative_speedup, old.relative_error) == (0.0, 0.0, 0.1)
    assert old.optimistic(1.0) == 1.0
    for bad in ({"floor_s": -0.01}, {"relative_speedup": 1.0}):
        path.write_text(json.dumps({"seconds_per_token": 2e-4, "intercept_s": 0.0, **bad}))
        with pytest.raises(ValueError, match="floor_s"):
            StepTimeModel.load(path)
