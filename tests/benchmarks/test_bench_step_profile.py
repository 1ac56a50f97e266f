"""bench/diagnostics/step_profile.py without timing anything: it runs end to end on a tiny random model and
prints, per configuration, every part of a decode step (the figures themselves are the script's
to print, never a test's to assert)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_script_prints_the_step_split_on_a_tiny_model(tiny_model):
    model = tiny_model("llama")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench.diagnostics.step_profile", "--model", model, "--configs", "2x8", "3x40",
         "--max-tokens", "5", "--profile"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert [(c["concurrency"], c["context"]) for c in result["configs"]] == [(2, 8), (3, 40)]
    for config in result["configs"]:
        assert config["decode_steps"] == 2  # 4 decode steps, the first 2 skipped
        for part in ("iteration", "schedule", "prepare_inputs", "forward", "lm_head", "sampling",
                     "update_from_output", "output_processing", "host"):
            assert config[part] >= 0, part
        assert config["forward"] > 0 and config["iteration"] >= config["forward"]
        assert 0 < config["host_pct_of_iteration"] < 100
    assert "cProfile 3x40" in run.stderr


def test_the_timer_puts_back_what_it_wrapped(tiny_model):
    """Each configuration's StepTimer unwraps the engine's methods when it is done: the next
    one times the engine's own methods, not the last timer's wrappers."""
    from bench.diagnostics.step_profile import StepTimer
    from engine import LLM

    llm = LLM(model=tiny_model("llama"), dtype="float32", num_kv_blocks=16, max_model_len=64)
    try:
        scheduler, runner = llm.engine.scheduler, llm.engine.executor.runner
        timer = StepTimer(llm)
        # Probe: the timer did wrap them (instance attributes shadowing the methods).
        assert "schedule" in vars(scheduler) and "forward" in vars(runner.model)
        timer.restore()
        assert "schedule" not in vars(scheduler) and "forward" not in vars(runner.model)
        assert "execute" not in vars(runner) and "step" not in vars(llm.engine)
    finally:
        llm.shutdown()
