"""The slack policy through its own interface (engine/core/slack_policy.py), without a scheduler:
a stand-in for `SchedulerOps` records what the policy asks of the scheduler."""

from __future__ import annotations

import pytest

from engine.config import SchedulingPolicy, SLOPreemptMode
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import FCFSQueue
from engine.core.slack_policy import SchedulerOps, SlackPolicy
from engine.core.step_record import Admission
from monitor.predictor import StepTimePredictor
from tests.utils.scheduling import make_request, make_scheduler, FakeScheduler, _step


def _running(*req_ids: str) -> list[Request]:
    requests = []
    for req_id in req_ids:
        request = make_request(req_id, 16)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = 16
        requests.append(request)
    return requests


def _policy(mode: SLOPreemptMode = "pause", scheduling: SchedulingPolicy = "fcfs") -> SlackPolicy:
    return SlackPolicy(scheduling, mode, StepTimePredictor())


def test_the_scheduler_and_the_fake_both_offer_what_the_policy_may_ask() -> None:
    members = {name for name in vars(SchedulerOps) if not name.startswith("_")}
    assert {"waiting", "running", "admit", "can_admit"} <= members  # probe: read the Protocol
    fake: SchedulerOps = FakeScheduler()
    assert members <= set(dir(fake)) and members <= set(dir(make_scheduler()))


def test_a_held_request_is_the_kv_victim_before_the_policy_order() -> None:
    policy = _policy()
    running = _running("a", "b", "c")
    assert policy.choose_kv_victim(running, _step()).request_id == "c"  # fcfs: the newest
    policy.holds.held.add("b")
    assert policy.choose_kv_victim(running, _step()).request_id == "b"


def test_the_kv_victim_is_never_one_this_step_admitted() -> None:
    policy = _policy(scheduling="priority")
    running = _running("a", "b", "c")
    running[2].priority = 9  # the least important, but admitted by this very step
    running[0].priority = 5
    step = _step()
    step.record.admitted.append(Admission(running[2], RequestStatus.WAITING, -1, None))
    policy.holds.held.add("c")
    assert policy.choose_kv_victim(running, step).request_id == "a"


@pytest.mark.parametrize("mode", ["pause", "recompute"])
def test_rule1_protects_a_request_the_monitor_preempted_once(mode: SLOPreemptMode) -> None:
    policy = _policy(mode)
    ops = FakeScheduler(running=_running("v"))
    ops.waiting.add(make_request("w", 8))
    assert policy.preempt_for_slo(ops, "v", "w") is not None
    victim = ops.get_request("v")
    assert victim is not None and victim.num_slo_preemptions == 1  # probe: preempted once
    policy.holds.held.clear()
    assert policy.protected_by_rule1(victim)
    assert policy.preempt_for_slo(ops, "v", "w") is None  # the step just re-runs
    assert victim.num_slo_preemptions == 1 and policy.num_slo_preemptions == 1
    assert not policy.holds.held


def test_suspend_mode_may_preempt_a_victim_again() -> None:
    policy = _policy("suspend")
    ops = FakeScheduler(running=_running("v"))
    ops.waiting.add(make_request("w", 8))
    policy.suspensions.suspend("v", 0, 16, 1)
    assert policy.preempt_for_slo(ops, "v", "w") == "suspend"
    victim = ops.get_request("v")
    assert victim is not None and not policy.protected_by_rule1(victim)
    assert policy.preempt_for_slo(ops, "v", "w") == "suspend"
    assert victim.num_slo_preemptions == 2


def test_pause_falls_back_to_recompute_when_the_waiter_would_not_fit() -> None:
    for admissible, expected in ((True, "pause"), (False, "recompute")):
        policy = _policy("pause")
        ops = FakeScheduler(running=_running("v"), admissible=admissible)
        ops.waiting.add(make_request("w", 8))
        assert policy.preempt_for_slo(ops, "v", "w") == expected
        # Either way the victim is held back and the waiter goes first next step.
        assert policy.holds.held == {"v"} and policy.urgent_waiter_id == "w"
        assert ops.requeued == ([] if admissible else ["v"])


def test_a_suspended_victim_that_must_recompute_frees_its_chunk() -> None:
    policy = _policy("suspend")
    ops = FakeScheduler(running=_running("v"), admissible=False)
    ops.waiting.add(make_request("w", 8))
    policy.suspensions.suspend("v", 0, 16, 1)
    assert policy.preempt_for_slo(ops, "v", "w") == "recompute"
    assert not policy.suspensions.is_suspended("v") and policy.suspensions.take_unneeded() == ["v"]
    assert policy.suspensions.take_unneeded() == []


def test_the_urgent_waiter_is_admitted_first_and_held_victims_wait() -> None:
    policy = _policy("pause")
    ops = FakeScheduler(running=_running("v"))
    for req_id in ("x", "w"):
        ops.waiting.add(make_request(req_id, 8))
    assert policy.preempt_for_slo(ops, "v", "w") == "pause"
    step = _step()
    policy.admit_first(ops, step)
    assert ops.admitted == ["w"] and [r.request_id for r in ops.waiting] == ["x"]
    assert policy.urgent_waiter_id is None and policy.holds.is_held("v")
    policy.holds.release_all()
    assert not policy.holds.is_held("v")


def test_admission_skips_held_waiters_and_puts_them_back_in_place() -> None:
    policy = _policy()
    waiting = FCFSQueue()
    for req_id in ("h1", "h2", "a", "b"):
        waiting.add(make_request(req_id, 8))
    policy.holds.held.update({"h1", "h2"})
    with policy.holds.waiting_past_held(waiting) as next_waiter:
        first = next_waiter()
        assert first is not None and first.request_id == "a"
        waiting.pop()
    assert [r.request_id for r in waiting] == ["h1", "h2", "b"]


def test_a_finished_request_leaves_no_hold_and_no_suspension() -> None:
    policy = _policy("suspend")
    policy.holds.held.add("v")
    policy.suspensions.suspend("v", 0, 16, 1)
    policy.on_finished("v")
    assert not policy.holds.is_held("v") and not policy.suspensions.is_suspended("v")
    assert policy.suspensions.unneeded == ["v"]
    # A KV-pressure victim stays held (it waits for its turn) but its chunk is gone.
    policy.holds.held.add("k")
    policy.suspensions.suspend("k", 0, 16, 1)
    policy.suspensions.discard("k")
    assert policy.holds.is_held("k") and not policy.suspensions.is_suspended("k")


def test_the_scheduler_prices_a_long_waiting_prompt_as_chunks_of_its_budget() -> None:
    """The slack ranking and the caps price a prompt longer than the step budget as the chunks
    the scheduler will give it (the monitor's snapshots carry the same `chunk_tokens`)."""
    from monitor.step_time_model import StepTimeModel

    sched = make_scheduler(budget=512, policy="slo")
    line = StepTimeModel(seconds_per_token=1e-5, intercept_s=0.03)
    sched.step_time_predictor.reseed(line)
    assert sched.slack.chunk_tokens == 512
    assert sched.slack.predict_prefill(512) == pytest.approx(line.predict(512))
    # Four steps of 512 (no attention term in this line): four fixed costs, not one.
    assert sched.slack.predict_prefill(2048) == pytest.approx(4 * line.predict(512))
    assert sched.slack.predict_prefill(2048) > line.predict(2048) + 0.08
