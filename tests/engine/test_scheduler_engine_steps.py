"""EngineCore's steps with nothing to compute: suspended chunks
dropped meanwhile still reach the workers, and a request that can never be admitted fails on
its own instead of taking the engine down (or spinning on empty steps)."""

from __future__ import annotations

from engine.core.request import RequestStatus
from tests.utils.engine_steps import _request, _suspend_first_step


def _suspended(engine) -> dict[str, tuple[int, int]]:
    """The scheduler's suspended chunks as (start_pos, num_tokens) of their first segment."""
    return {req_id: segments[0][:2]
            for req_id, segments in engine.scheduler.slack.suspensions.suspended.items()}


def test_aborting_the_last_request_frees_its_suspended_chunk_on_the_worker(engine) -> None:
    """With nothing left to run no step follows, so the free must go out at once."""
    engine.add_request(_request("long", 64, seed=1))
    _suspend_first_step(engine)
    runner = engine.executor.runner
    assert _suspended(engine) == {"long": (0, 64)}  # probe: really suspended
    assert len(runner.suspended) == 1
    engine.abort_requests(["long"])
    assert len(runner.suspended) == 0 and engine.scheduler.slack.suspensions.unneeded == []
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 32


def test_an_unadmittable_request_fails_alone_and_empty_steps_deliver_frees(
        engine, monkeypatch) -> None:
    """An empty step with nothing running used to raise EngineStepError (the
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
    assert scheduler.slack.suspensions.unneeded == ["long"]  # stuck waits: no step has run yet
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
