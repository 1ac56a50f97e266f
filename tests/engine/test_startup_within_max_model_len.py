"""Every step the engine runs on its own at startup keeps every sequence within max_model_len:
the KV-pool profile (workers/startup/kv_memory.py) and the startup calibration
(engine/runtime/startup_calibration.py). A position at or past max_model_len reads past the
rotary table of a model served at its full length: on a GPU a device-side assert at startup.

The steps are recorded where the model runner turns them into inputs, so the check sees the
positions the model computes, whatever made the step (a warm-up that prepares its inputs
there is checked with the rest)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.core.token_budget import largest_step_tokens, split_token_budget
from engine.runtime.engine_core import EngineCore
from engine.config import build_engine_config
from engine.runtime.startup_calibration import BUDGET_ENV
from tests.utils.fake_gpu_memory import play_a_gpu
from workers.model_runner import ModelRunner

# Below the step budget; long enough that the calibration's decode batch (8 prompts of 16
# tokens, run once a prompt that large was timed) has a place.
MAX_MODEL_LEN = 160
BUDGET = 256  # max_num_batched_tokens
MAX_NUM_SEQS = 16


@dataclass
class Sequence:
    req_id: str
    start_pos: int
    num_tokens: int


@dataclass
class Step:
    sequences: list[Sequence]
    max_position: int  # the largest position in the model's inputs

    @property
    def tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    def of(self, prefix: str) -> list[Sequence]:
        return [s for s in self.sequences if s.req_id.startswith(prefix)]


@pytest.fixture
def recorded(monkeypatch) -> list[Step]:
    """Every step any ModelRunner of this process prepares, as its inputs are built."""
    steps: list[Step] = []
    prepare = ModelRunner.prepare_inputs

    def recording(self, requests, **kwargs):
        inputs = prepare(self, requests, **kwargs)
        steps.append(Step([Sequence(r.req_id, r.start_pos, len(r.token_ids)) for r in requests],
                          int(inputs.positions.max())))
        return inputs

    monkeypatch.setattr(ModelRunner, "prepare_inputs", recording)
    return steps


def test_every_startup_step_keeps_its_sequences_within_max_model_len(
        tiny_model, monkeypatch, recorded) -> None:
    # The CPU engine as on a GPU: the pool is measured (its profile steps run for real).
    fake = play_a_gpu(monkeypatch)
    # Time enough for every calibration step of the tiny model on a busy machine (the suite's
    # 0.3 s may skip some); it stops once the sizes run out, long before.
    monkeypatch.setenv(BUDGET_ENV, "30")
    engine = EngineCore(build_engine_config(
        tiny_model("llama"), dtype="float32", max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=BUDGET, max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False))
    try:
        calibration = engine.startup_calibration
    finally:
        engine.shutdown()

    for step in recorded:
        assert step.max_position < MAX_MODEL_LEN, step
        for s in step.sequences:
            assert s.start_pos + s.num_tokens <= MAX_MODEL_LEN, (s, step)

    # Probes: the profile and every kind of calibration step ran.
    assert fake.profiles == 1
    profile = [step for step in recorded if step.of("profile-")]
    assert len(profile) == 2
    # The whole budget, spread over sequences of max_model_len (not cut to one of them).
    assert [step.tokens for step in profile] == [BUDGET, BUDGET]
    assert [len(step.sequences) for step in profile] == [-(-BUDGET // MAX_MODEL_LEN),
                                                        MAX_NUM_SEQS]
    assert calibration is not None
    ours = [s for step in recorded for s in step.of("startup-calibration-")]
    largest = max(s.num_tokens for s in ours if s.start_pos == 0)
    assert largest == MAX_MODEL_LEN - 1  # the ladder's top size: max_model_len - 1
    assert any(s.start_pos > 0 and s.num_tokens > 1 for s in ours)  # a chunk over a prefix
    assert any(len(step.of("startup-calibration-")) > 1
               and all(s.num_tokens == 1 for s in step.sequences)
               for step in recorded)  # a decode batch


@pytest.mark.parametrize("tokens,max_len,min_seqs", [
    (2048, 256, 1), (2048, 300, 1), (10, 4, 1), (10, 64, 4), (5, 8, 8), (1, 1, 3),
    (4096, 4096, 1), (7, 2, 1)])
def test_a_budget_splits_into_sequences_within_max_len(tokens, max_len, min_seqs) -> None:
    lengths = split_token_budget(tokens, max_len, min_seqs)
    assert sum(lengths) == tokens and max(lengths) <= max_len and min(lengths) >= 1
    assert max(lengths) - min(lengths) <= 1
    # As few sequences as that allows, at least min_seqs (never more than tokens).
    assert len(lengths) == min(tokens, max(min_seqs, -(-tokens // max_len)))


def test_the_largest_step_is_bounded_by_the_sequences_that_may_run() -> None:
    assert largest_step_tokens(2048, 128, 256) == 2048
    assert largest_step_tokens(2048, 4, 256) == 1024


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (4, 4, 0), (True, 4), (4.0, 4)])
def test_a_bad_split_is_a_clear_error(args) -> None:
    with pytest.raises(ValueError, match="split_token_budget: .* must be an integer >= 1"):
        split_token_budget(*args)
