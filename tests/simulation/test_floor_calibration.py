"""The startup calibration of a floor-bound device: an 8B model on an H100 (the shipped
`h100-llama-3.1-8b` profile) runs every step below some 900 tokens at the host's 30 ms, and of
the ladder's sizes (16, 64, 256, 1024, 2048) only the two largest rise above it. No floor model
could be scored on two sizes (one is held out at a time), so the line was kept: 28.7 ms plus
17 us a token, 72% off, and unconfident; its margins then kept urgent turns out of each other's
steps. The calibration now times sizes between those above the floor until a floor model can
be scored, and keeps it.

The simulated device runs on a fake clock here: the steps take no wall time."""

from __future__ import annotations

import pytest

from engine.config import build_engine_config
from engine.executor.simulated import SimulatedExecutor
from engine.runtime import startup_calibration
from engine.runtime.engine_core import EngineCore
from engine.runtime.startup_calibration import STARTUP_BUDGET_S, calibrate_at_startup
from engine.simulation.profile import load_profile
from tests.utils.device_clock import FakeClock

PROFILE = "h100-llama-3.1-8b"


def _calibrate(sim_model: str):
    engine = EngineCore(build_engine_config(sim_model, simulate=PROFILE, max_model_len=40_000,
                                            startup_calibration=False))
    try:
        profile = load_profile(PROFILE)
        clock = FakeClock()
        executor = SimulatedExecutor(profile, engine.model.num_blocks,
                                     engine.model.hf_config.vocab_size, sleep=clock.sleep,
                                     clock=clock)
        calibration = calibrate_at_startup(executor, engine.config, engine.model,
                                           budget_s=STARTUP_BUDGET_S)
    finally:
        engine.shutdown()
    assert calibration is not None
    return calibration, profile


def _prompt_sizes(calibration) -> list[float]:
    return sorted(p.tokens for p in calibration.points
                  if p.attention == p.tokens ** 2 and p.decode_context == 0)


def test_a_floor_bound_device_gets_a_floor_model(sim_model):
    calibration, profile = _calibrate(sim_model)
    sizes = _prompt_sizes(calibration)
    above = [n for n in sizes if profile.step_seconds(n, n * n, 0) > profile.floor_s]
    assert len(above) >= 3 and any(1024 < n < 2048 for n in sizes), sizes
    assert calibration.held_out_error["line+floor"] is not None
    model = calibration.model
    assert model.confident and model.relative_error <= 0.1
    assert model.floor_s == pytest.approx(profile.floor_s, rel=0.05)
    # It predicts the sizes it did not time as the device runs them.
    for n in (100, 700, 1200, 1800):
        truth = profile.step_seconds(n, n * n, 0)
        assert model.predict_step(n, n * n) == pytest.approx(truth, rel=0.1), n


def test_probe_the_ladder_alone_left_the_floor_unscored(sim_model, monkeypatch):
    monkeypatch.setattr(startup_calibration, "_next_size_above_floor", lambda plan: None)
    calibration, _ = _calibrate(sim_model)
    assert _prompt_sizes(calibration) == [16, 64, 256, 1024, 2048]
    assert calibration.held_out_error["line+floor"] is None
    assert not calibration.model.confident or calibration.model.relative_error > 0.5
