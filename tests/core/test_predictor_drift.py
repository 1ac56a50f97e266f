"""The predictor follows a change of the machine's speed within a few steps, and widens its
margins and withholds its confidence until steps at the new speed have measured it
(monitor/speed_drift.py, monitor.predictor.StepTimePredictor)."""

from __future__ import annotations

import random

import pytest

from monitor.predictor import (MIN_ERROR_SAMPLES, UNCERTAIN_ERROR, UNCERTAIN_SPEEDUP,
                               StepTimePredictor)
from monitor.step_point import StepPoint
from monitor.step_time_fit import fit_step
from monitor.step_time_model import StepTimeModel
from monitor.speed_drift import RECENT_STEPS

TRUTH = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02, seconds_per_decode_context=5e-6)
SIZES = (128, 512, 256, 1024, 384, 768)


def _calibrated() -> StepTimePredictor:
    """Seeded as the startup calibration seeds it: its fit and its points (four sizes)."""
    points = ([StepPoint(n, n * n, 0, TRUTH.predict(n)) for n in (16, 64, 256, 1024)]
              + [StepPoint(1, 0, c, TRUTH.predict_step(1, 0, c)) for c in (64, 1024)])
    online = StepTimePredictor()
    online.reseed(fit_step(points, quadratic=False, decode=True), points)
    return online


def _serve(online: StepTimePredictor, steps: int, slowdown: float, rng: random.Random,
           noise: float = 0.05) -> list[float]:
    """Served steps, a prefill every third and decodes between, `slowdown` times TRUTH's time
    with a little noise; each step's prediction / actual for a 512-token prompt afterwards."""
    ratios = []
    for i in range(steps):
        jitter = 1 + rng.uniform(-noise, noise)
        if i % 3 == 0:
            n = SIZES[(i // 3) % len(SIZES)]
            online.observe(n, TRUTH.predict(n) * slowdown * jitter)
        else:
            online.observe(4, TRUTH.predict_step(4, 0, 2000) * slowdown * jitter,
                           attention=0, decode_context=2000)
        ratios.append(online.current.predict(512) / (TRUTH.predict(512) * slowdown))
    return ratios


@pytest.mark.parametrize("slowdown", [2.0, 3.0, 0.5])
def test_a_change_of_speed_is_followed_within_a_few_steps(slowdown):
    online, rng = _calibrated(), random.Random(0)
    quiet = _serve(online, 30, 1.0, rng)
    assert abs(quiet[-1] - 1) < 0.1 and online.current.confident
    changed = _serve(online, 12, slowdown, rng)
    # Probe: the change was there to follow: the model before it is off by the slowdown.
    assert abs(quiet[-1] * slowdown - slowdown) < 0.1 * slowdown
    # Within RECENT_STEPS (+ one step of noise) of the change, within 15% of the new speed.
    assert all(abs(r - 1) < 0.15 for r in changed[RECENT_STEPS + 1:]), changed


def test_margins_widen_and_confidence_waits_for_steps_at_the_new_speed():
    online, rng = _calibrated(), random.Random(1)
    _serve(online, 30, 1.0, rng)
    calm_error = online.current.relative_error
    assert online.current.confident and calm_error < 0.2
    _serve(online, RECENT_STEPS + 1, 3.0, rng)
    after = online.current
    # The departure followed (3x) stands as the error, beyond the uncertain floor.
    assert after.relative_error >= 1.0 and not after.confident
    # Nobody is written off on it unless even 4x faster than it says would miss.
    assert after.optimistic(1.0) <= 1 - UNCERTAIN_SPEEDUP
    # Decodes alone do not confirm it: a prefill step at the new speed does, MIN_ERROR_SAMPLES
    # of them.
    prefills = 0
    while not online.current.confident:
        _serve(online, 3, 3.0, rng)
        prefills += 1
        assert prefills <= MIN_ERROR_SAMPLES + 1
    assert prefills >= MIN_ERROR_SAMPLES - 2
    assert online.current.relative_error < 0.3


def test_a_stalled_step_now_and_then_is_not_a_change_of_speed():
    online, rng = _calibrated(), random.Random(2)
    _serve(online, 30, 1.0, rng)
    before = online.current
    for i in range(60):
        # One step in four stalls to 5x (a descheduled host, a GC pause); the rest as before.
        _serve(online, 1, 5.0 if i % 4 == 3 else 1.0, rng)
        assert abs(online.current.predict(512) / TRUTH.predict(512) - 1) < 0.35, i
    assert online.current.seconds_per_token == pytest.approx(before.seconds_per_token, rel=0.35)


def test_a_kind_the_fit_gets_wrong_as_a_rule_is_no_drift():
    """Decode steps that always run 30% under their prediction: the kind's usual ratio, not a
    change of speed; the prefill predictions stay where the prefill steps put them."""
    online = _calibrated()
    for i in range(120):
        if i % 3 == 0:
            n = SIZES[(i // 3) % len(SIZES)]
            online.observe(n, TRUTH.predict(n))
        else:
            online.observe(4, 0.7 * TRUTH.predict_step(4, 0, 2000), attention=0,
                           decode_context=2000)
        assert online.current.predict(512) == pytest.approx(TRUTH.predict(512), rel=0.15), i


def test_an_unconfident_seed_earns_confidence_from_served_prefills():
    """The default seed, or a calibration cut short, is unconfident: its margin is at least
    UNCERTAIN_ERROR and it dooms only what even UNCERTAIN_SPEEDUP faster would not save, until
    MIN_ERROR_SAMPLES prefill steps were served."""
    online = StepTimePredictor()
    assert not online.current.confident
    assert online.current.optimistic(1.0) == pytest.approx(1 - UNCERTAIN_SPEEDUP)
    for i in range(MIN_ERROR_SAMPLES):
        assert not online.current.confident
        assert online.current.relative_error >= UNCERTAIN_ERROR
        n = SIZES[i % len(SIZES)]
        online.observe(n, TRUTH.predict(n))
    assert online.current.confident
    assert online.current.relative_error < 0.1
    assert online.current.optimistic(1.0) > 0.5
    # A full calibration's seed is confident from the start.
    assert _calibrated().current.confident
