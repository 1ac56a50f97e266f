"""EngineCore's steps with nothing to compute (issue 12, findings 7 and 8): suspended chunks
dropped meanwhile still reach the workers, and a request that can never be admitted fails on
its own instead of taking the engine down (or spinning on empty steps)."""

from __future__ import annotations

import pytest
import torch

from engine.config import build_engine_config
from engine.runtime.engine_core import EngineCore
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.utils.paged_helpers import StopAt

NUM_LAYERS = 4


def _suspended(engine) -> dict[str, tuple[int, int]]:
    """The scheduler's suspended chunks as (start_pos, num_tokens) of their first segment."""
    return {req_id: segments[0][:2]
            for req_id, segments in engine.scheduler.slack.suspended.items()}


@pytest.fixture
def engine(tiny_model):
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS)
    core = EngineCore(build_engine_config(model, dtype="float32", num_kv_blocks=32,
                                          max_model_len=256, block_size=16,
                                          preempt_min_tokens=16, slo_preempt_mode="suspend"))
    yield core
    core.shutdown()


def _request(req_id: str, n: int, seed: int) -> Request:
    prompt = torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return Request(request_id=req_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                  ignore_eos=True))


def _suspend_first_step(engine: EngineCore) -> None:
    """Runs one step that the 'monitor' unwinds at layer 2: its prefill chunks stay suspended
    on the worker (no victim: the signal targets nothing, the step just re-runs later)."""
    runner = engine.executor.runner
    vote = runner.vote
    runner.vote = StopAt(2)
    try:
        assert engine.step() == []
    finally:
        runner.vote = vote


def test_aborting_the_last_request_frees_its_suspended_chunk_on_the_worker(engine) -> None:
    """Finding 8: with nothing left to run no step follows, so the free must go out at once."""
    engine.add_request(_request("long", 64, seed=1))
    _suspend_first_step(engine)
    runner = engine.executor.runner
    assert _suspended(engine) == {"long": (0, 64)}  # probe: really suspended
    assert len(runner.suspended) == 1
    engine.abort_requests(["long"])
    assert len(runner.suspended) == 0 and engine.scheduler.slack.unneeded_suspensions == []
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 32


def test_an_unadmittable_request_fails_alone_and_empty_steps_deliver_frees(
        engine, monkeypatch) -> None:
    """Findings 7 and 8: an empty step with nothing running used to raise EngineStepError (the
    engine was dead), and the frees it carried were dropped. The admission test is made to
    refuse one request, as a bug would: only that request fails, with a message naming it."""
    scheduler = engine.scheduler
    plan = scheduler.admission.plan
    monkeypatch.setattr(scheduler.admission, "plan",
                        lambda r, budget, num_running: None if r.request_id == "stuck"
                        else plan(r, budget, num_running))
    engine.add_request(_request("long", 64, seed=1))
    _suspend_first_step(engine)
    runner = engine.executor.runner
    assert len(runner.suspended) == 1  # probe: a chunk to free
    engine.add_request(stuck := _request("stuck", 8, seed=2))
    engine.abort_requests(["long"])
    assert scheduler.slack.unneeded_suspensions == ["long"]  # stuck waits: no step has run yet
    (out,) = engine.step()  # empty: nothing runs, stuck cannot come in
    assert len(runner.suspended) == 0  # the empty step delivered the free
    assert out.req_id == "stuck" and out.finish_reason == "error" and "'stuck'" in out.error
    assert stuck.status is RequestStatus.FINISHED_ERROR
    engine.add_request(after := _request("after", 8, seed=3))
    while engine.has_unfinished_requests():
        engine.step()
    assert after.status is RequestStatus.FINISHED_LENGTH and after.num_output_tokens == 3
    scheduler.check_invariants()
    assert scheduler.kv_cache_manager.num_free_blocks == 32
