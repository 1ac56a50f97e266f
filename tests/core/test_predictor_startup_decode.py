"""The startup calibration times a decode over a long context even when its budget runs short:
the prompt ladder once spent the 5 s budget on short prompts, so decodes were timed
only up to 259 tokens of context and the decode term was extrapolated 15x to serve 3949.

A fake executor stands in for the model: each step takes the time a known step model gives it,
on a fake clock, so the test runs in well under a second and sees exactly what was planned."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.runtime import startup_calibration
from engine.runtime.model_setup import ResolvedModel
from monitor.step_time_model import StepTimeModel

# About the default model on 2 CPU cores: 1 ms per token, 20 ms per step, 10 us per KV token a
# decode reads.
TRUTH = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.02, seconds_per_token_sq=5e-8,
                      seconds_per_decode_context=1e-5)
MAX_MODEL_LEN = 4096


class FakeExecutor:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        seconds = TRUTH.predict_step(output.num_scheduled_tokens, output.attention_work,
                                     output.decode_context)
        self.clock[0] += seconds
        return ModelRunnerOutput(step_id=output.step_id, execute_seconds=seconds,
                                 sampled_token_ids={r.req_id: 7 for r in output.requests
                                                    if r.sample})


def _calibrate(monkeypatch, budget_s: float):
    clock = [0.0]
    monkeypatch.setattr(startup_calibration, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    blocks = MAX_MODEL_LEN // 16 + 16
    config = EngineConfig(model=ModelConfig(model="fake"), cache=CacheConfig(num_blocks=blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    model = ResolvedModel(model_dir="fake", hf_config=SimpleNamespace(vocab_size=100),
                          dtype=torch.float32, device=torch.device("cpu"),
                          max_model_len=MAX_MODEL_LEN, num_blocks=blocks)
    result = startup_calibration.calibrate_at_startup(FakeExecutor(clock), config, model,
                                                      budget_s=budget_s)
    return result, clock[0]


def test_a_short_budget_still_times_a_decode_over_a_long_context(monkeypatch):
    result, spent = _calibrate(monkeypatch, budget_s=5.0)
    assert result is not None
    decodes = [p for p in result.points if p.attention == 0 and p.decode_context > 0]
    longest = max(p.decode_context / p.tokens for p in decodes)
    # Probe: the ladder alone cannot reach it in this budget (a 2048-token prompt timed four
    # times costs more than the 5 s).
    assert 4 * TRUTH.predict(2048) > 5.0
    # The longest context a decode can read here (max_model_len less the decodes timed over
    # it), or half of it at least; before the fix: 259.
    assert longest >= (MAX_MODEL_LEN - 1 - startup_calibration.DECODE_STEPS) / 2
    assert spent <= 5.0 * 1.3  # within the budget (one step may overrun it)
    # The fitted decode term is the truth's, and a prompt beside decodes reading that much
    # context is inside the calibrated range (twice as much is not).
    assert abs(result.model.seconds_per_decode_context / TRUTH.seconds_per_decode_context
               - 1) < 0.05
    assert not result.model.is_extrapolated(105, decode_context=longest)
    assert result.model.is_extrapolated(105, decode_context=2 * longest)


def test_a_generous_budget_times_the_longest_context_a_decode_can_read(monkeypatch):
    result, _ = _calibrate(monkeypatch, budget_s=60.0)
    assert result is not None
    longest = max(p.decode_context / p.tokens for p in result.points
                  if p.attention == 0 and p.decode_context > 0)
    assert longest >= MAX_MODEL_LEN - 1 - startup_calibration.DECODE_STEPS
