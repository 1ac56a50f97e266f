"""Mid-forward preemption at the scheduler level (rollback + the slack policy's preempt_for_slo, as
engine/runtime/slo_preemption.py's on_preempted drives them): held victims, the one admission test, the
step record, and what is reported."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SLOPreemptionConfig, SchedulerConfig, SLOPreemptMode
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import BS, FakeRunner, make_request, run_to_completion, scheduled


def _scheduler(mode: SLOPreemptMode = "suspend", *, num_blocks: int = 64, budget: int = 64,
               max_num_seqs: int = 8, watermark: float = 0.0, full_seq: bool = False,
               policy: str = "fcfs") -> Scheduler:
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         policy=policy,  # type: ignore[arg-type]
                         full_sequence_admission=full_seq)
    cc = CacheConfig(block_size=BS, num_blocks=num_blocks, watermark=watermark)
    sched = Scheduler(sc, cc, num_blocks, num_blocks * BS, SLOPreemptionConfig(mode=mode))
    sched.step_time_predictor.current = StepTimeModel(seconds_per_token=1e-4, intercept_s=0.0)
    return sched


def _slo(request: Request, slo_ms: float = 60_000) -> Request:
    request.ttft_slo_ms = slo_ms
    return request


def _step(sched: Scheduler, runner: FakeRunner) -> dict[str, int]:
    out = sched.schedule()
    sched.check_invariants()
    sched.update_from_output(out, runner.execute(out))
    sched.check_invariants()
    return scheduled(out)


def _unwind(sched: Scheduler, victim: str, waiter: str) -> SLOPreemptMode | None:
    """The monitor stopped the last step before its first layer finished (nothing kept)."""
    assert sched.last_step_record is not None
    sched.rollback(sched.last_step_record, keep=[])
    applied = sched.slack.preempt_for_slo(sched, victim, waiter)
    sched.check_invariants()
    return applied


def test_a_held_victim_at_the_head_of_the_queue_blocks_nobody() -> None:
    """V (no SLO) admitted by the unwound step goes back to the queue head, held;
    X queues behind it; once the waiter W is done and only V and X are left, X must run (it
    used to wait behind V forever, and the empty step with nothing running killed the
    engine)."""
    sched = _scheduler("suspend")
    runner = FakeRunner(sched)
    v = make_request("V", 64, max_tokens=4)
    sched.add_request(v)
    sched.add_request(_slo(make_request("W", 20, max_tokens=2)))
    assert scheduled(sched.schedule()) == {"V": 64}  # the budget: W did not fit beside V
    _unwind(sched, "V", "W")
    sched.add_request(_slo(x := make_request("X", 8, max_tokens=2)))
    # Probe: V really is held at the head of the queue, ahead of X.
    assert sched.slack.holds.is_held("V")
    assert [r.request_id for r in sched.waiting] == ["V", "W", "X"]
    steps = [_step(sched, runner) for _ in range(3)]
    assert "X" in steps[0] and x.first_token_time is not None
    assert all(steps), "no step may come back empty while requests are waiting"
    outputs = run_to_completion(sched, runner)
    assert set(outputs) >= {"V"} and sched.num_free_blocks == 64


def test_when_only_held_requests_can_run_they_are_released() -> None:
    """V is paused and held (it keeps its KV) for W; after W is done, X (more
    urgent than V, 10 blocks) cannot be admitted beside V's 16. The step must run V rather than
    come back empty again and again while V 'runs'."""
    sched = _scheduler("pause", num_blocks=24, budget=96)
    runner = FakeRunner(sched)
    v = make_request("V", 64, max_tokens=3, ignore_eos=True)
    sched.add_request(v)
    assert _step(sched, runner) == {"V": 64}  # 16 blocks, 17 with its next token
    sched.add_request(_slo(make_request("W", 8, max_tokens=1)))
    assert scheduled(sched.schedule()) == {"V": 1, "W": 8}
    assert _unwind(sched, "V", "W") == "pause"  # W fits beside V
    assert _step(sched, runner) == {"W": 8}
    sched.add_request(_slo(make_request("X", 40, max_tokens=1)))  # 10 blocks, 7 free
    # Probe: paused, held.
    assert sched.slack.holds.is_held("V") and v.status is RequestStatus.RUNNING
    assert sched.num_free_blocks < 10  # probe: X cannot come in beside V
    out = sched.schedule()
    assert scheduled(out) == {"V": 1}
    sched.update_from_output(out, runner.execute(out))
    outputs = run_to_completion(sched, runner)
    assert set(outputs) == {"V", "X"} and sched.num_free_blocks == 24


def test_a_request_admitted_this_step_is_never_its_kv_victim() -> None:
    """The urgent waiter W is admitted first and takes the last blocks; A's decode
    then needs a block. W used to be the victim (it is running[-1]) and stayed in the step
    record, so rolling the step back crashed on running.remove(W)."""
    sched = _scheduler("pause", num_blocks=16)
    runner = FakeRunner(sched)
    sched.add_request(a := make_request("A", 40, max_tokens=10, ignore_eos=True))
    assert _step(sched, runner) == {"A": 40}  # 10 blocks; its next token needs an 11th
    sched.add_request(make_request("V", 8, max_tokens=4))
    sched.add_request(w := _slo(make_request("W", 24, max_tokens=2)))  # 6 blocks
    assert scheduled(sched.schedule()) == {"A": 1, "V": 8}
    _unwind(sched, "V", "W")
    out = sched.schedule()
    record = sched.last_step_record
    assert record is not None and [r.request_id for r in record.kv_preempted] == ["A"]
    assert scheduled(out) == {"W": 24} and w.status is RequestStatus.RUNNING
    assert a.status is RequestStatus.PREEMPTED  # probe: KV pressure really struck this step
    sched.rollback(record, keep=[])
    sched.check_invariants()
    assert w.status is RequestStatus.WAITING and a.status is RequestStatus.PREEMPTED
    outputs = run_to_completion(sched, runner)
    assert set(outputs) == {"A", "V", "W"} and sched.num_free_blocks == 16


def test_a_victim_dropped_from_the_step_leaves_no_trace_in_its_record() -> None:
    """Under the priority policy a KV victim may have been served earlier in the same
    step; every record entry about it goes with it, so a rollback leaves it preempted."""
    sched = _scheduler("pause", num_blocks=8, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(low := make_request("low", 12, max_tokens=8, priority=5, ignore_eos=True))
    sched.add_request(make_request("high", 15, max_tokens=8, priority=0, ignore_eos=True))
    assert _step(sched, runner) == {"high": 15, "low": 12}  # 4 + 3 blocks of 8
    _step(sched, runner)  # low needs a 4th block: 8 in use
    out = sched.schedule()  # high needs a 5th: low, served first by admission order, goes
    record = sched.last_step_record
    assert record is not None and record.kv_preempted == [low]  # probe: it was a victim
    assert "low" not in scheduled(out)
    assert "low" not in record.new_block_ids and "low" not in record.prev_num_computed_tokens
    sched.rollback(record)
    sched.check_invariants()
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0


@pytest.mark.parametrize("crowded_by", ["max_num_seqs", "watermark"])
def test_pause_falls_back_to_recompute_when_admission_would_refuse_the_waiter(
        crowded_by: str) -> None:
    """Whether the victim may keep its KV is the admission test itself. The old check
    counted only the waiter's prompt blocks: the victim stayed paused and held, the waiter was
    never admitted, and every step came back empty while something 'ran'."""
    roomy = dict(num_blocks=32, max_num_seqs=8, watermark=0.0)
    crowded = dict(roomy, **{"max_num_seqs": dict(max_num_seqs=1),
                             "watermark": dict(watermark=0.25)}[crowded_by])
    for setup, expected in ((roomy, "pause"), (crowded, "recompute")):
        sched = _scheduler("pause", budget=96, **setup)  # type: ignore[arg-type]
        runner = FakeRunner(sched)
        sched.add_request(make_request("V", 30, max_tokens=8, ignore_eos=True))
        _step(sched, runner)
        _step(sched, runner)  # V: 32 tokens in 8 blocks, 24 free
        # 20 blocks: fit the free ones, not what the watermark (8 blocks) leaves of them.
        sched.add_request(w := _slo(make_request("W", 80, max_tokens=1)))
        sched.schedule()
        assert _unwind(sched, "V", "W") == expected
        assert "W" in scheduled(sched.schedule())  # the waiter it made room for comes in
        assert w.status is RequestStatus.RUNNING


def test_a_victim_sent_back_to_the_queue_is_reported_as_recompute() -> None:
    """A victim the rolled-back step had admitted is back in the queue with no KV;
    it was reported as the configured mode ("suspend")."""
    sched = _scheduler("suspend")
    sched.add_request(v := make_request("V", 64, max_tokens=4))
    sched.add_request(_slo(make_request("W", 20, max_tokens=2)))
    sched.schedule()
    sched.rollback(sched.last_step_record, keep=[])
    assert v.status is RequestStatus.WAITING and "V" not in sched.kv_cache_manager.req_blocks
    assert sched.slack.preempt_for_slo(sched, "V", "W") == "recompute"


def test_rollback_restores_first_scheduled_time() -> None:
    """An admission the rollback undid never ran; a re-admission of a request that
    ran before keeps the time of its first real scheduling."""
    sched = _scheduler("recompute")
    runner = FakeRunner(sched)
    sched.add_request(a := make_request("a", 8, max_tokens=4, ignore_eos=True))
    sched.schedule()
    assert a.first_scheduled_time is not None  # probe: the admission set it
    sched.rollback(sched.last_step_record)
    assert a.first_scheduled_time is None
    _step(sched, runner)
    first = a.first_scheduled_time
    sched.add_request(_slo(make_request("w", 8, max_tokens=4)))
    sched.schedule()
    assert _unwind(sched, "a", "w") == "recompute"  # a is back in the queue, no KV
    assert _step(sched, runner) == {"w": 8}  # a is held
    sched.schedule()
    assert a.status is RequestStatus.RUNNING  # probe: re-admitted, at a later time
    sched.rollback(sched.last_step_record)
    assert a.status is RequestStatus.PREEMPTED and a.first_scheduled_time == first
