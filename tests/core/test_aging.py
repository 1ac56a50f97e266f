"""Aging: a request past its TTFT deadline by more than the aging bound goes ahead of every other
and its step is stopped only for short prefills of rescuable waiters, a bounded share of its own
objective in all, so no stream of tighter objectives starves it."""

from __future__ import annotations

import time

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from monitor.policy import (AGED_PRIORITY, AGED_YIELD_SHARE, RequestView, choose_slo_preemption,
                           urgency, view_of)
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import FakeRunner, _request, _slo_scheduler

PREDICT = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0).predict


def test_aged_requests_go_first_the_longest_overdue_first():
    now = 1000.0
    late = [RequestView(f"late{s}", deadline=now - s, remaining_prefill_tokens=100)
            for s in (6.0, 9.0, 4.0)]
    ranked = sorted(late, key=lambda v: -urgency(v, now, PREDICT, aging_bound_s=5.0).priority)
    assert [v.request_id for v in ranked] == ["late9.0", "late6.0", "late4.0"]
    assert urgency(late[1], now, PREDICT, 5.0).priority == AGED_PRIORITY + 9.0
    rescuable = RequestView("rescuable", deadline=now + 0.001, remaining_prefill_tokens=0)
    assert urgency(late[0], now, PREDICT, 5.0).priority > urgency(rescuable, now, PREDICT).priority
    # Probe: without aging the same requests are doomed, last of all.
    assert all(urgency(v, now, PREDICT).priority < 0 for v in late)


def test_a_step_serving_an_aged_request_is_never_stopped():
    now = 1000.0
    waiter = RequestView("urgent", deadline=now + 0.5, remaining_prefill_tokens=50)
    running = [RequestView("aged", deadline=now - 6.0, remaining_prefill_tokens=2000),
               RequestView("relaxed", deadline=now + 60.0, remaining_prefill_tokens=2000)]
    # Probe: without aging the doomed runner gives up its slot at once.
    assert choose_slo_preemption([waiter], running, now, PREDICT, step_remaining_s=2.0) is not None
    assert choose_slo_preemption([waiter], running, now, PREDICT, step_remaining_s=2.0,
                             aging_bound_s=5.0) is None


def _aged_document(now: float, yield_left_s: float) -> RequestView:
    return RequestView("aged", deadline=now - 6.0, remaining_prefill_tokens=2000, slo_s=30.0,
                       aged_yield_left_s=yield_left_s)


def test_an_aged_step_yields_to_a_short_rescuable_prefill_within_its_share():
    """A document 6 s late (aged) may still yield a few hundred ms to an urgent turn that would
    otherwise miss: it costs the document little, and a step that is never stopped makes every
    turn behind it miss."""
    now = 1000.0
    turn = RequestView("urgent", deadline=now + 0.3, remaining_prefill_tokens=100)  # 0.1 s
    decision = choose_slo_preemption([turn], [_aged_document(now, 3.0)], now, PREDICT,
                                     step_remaining_s=2.0, aging_bound_s=5.0)
    assert decision is not None and decision.waiter_id == "urgent"
    # What is left of its share is too little for the turn's prefill: it runs on.
    assert choose_slo_preemption([turn], [_aged_document(now, 0.05)], now, PREDICT,
                                 step_remaining_s=2.0, aging_bound_s=5.0) is None
    # A turn that can wait for the step does.
    assert choose_slo_preemption([turn], [_aged_document(now, 3.0)], now, PREDICT,
                                 step_remaining_s=0.05, aging_bound_s=5.0) is None
    # A doomed waiter (already late) takes nothing from a request later still.
    late = RequestView("late", deadline=now - 0.01, remaining_prefill_tokens=100)
    assert choose_slo_preemption([late], [_aged_document(now, 3.0)], now, PREDICT,
                                 step_remaining_s=2.0, aging_bound_s=5.0) is None


def test_what_an_aged_request_yielded_is_charged_and_bounds_what_it_yields_next():
    sched = _slo_scheduler(num_blocks=400, budget=1000)
    document = _request("document", 600, 30_000)
    document.arrival_time -= 40.0  # 10 s past its deadline: aged (bound 5 s)
    sched.add_request(document)
    out = sched.schedule()  # the document prefills
    assert document.request_id in {r.req_id for r in out.requests}
    assert sched.slack.urgency(document) >= AGED_PRIORITY  # probe: it is aged
    turn = _request("turn", 200, 400)
    sched.add_request(turn)
    view = view_of(document)
    assert view.aged_yield_left_s == AGED_YIELD_SHARE * 30.0
    sched.slack.preempt_for_slo(sched, "document", "turn")
    assert document.aged_yield_s == pytest.approx(0.2)  # the turn's predicted prefill
    assert view_of(document).aged_yield_left_s == pytest.approx(AGED_YIELD_SHARE * 30.0 - 0.2)


def test_an_aged_waiter_does_not_keep_a_rescuable_one_from_preempting():
    now = 1000.0
    aged = RequestView("aged", deadline=now - 6.0, remaining_prefill_tokens=10)
    urgent = RequestView("urgent", deadline=now + 0.5, remaining_prefill_tokens=50)
    running = [RequestView("relaxed", deadline=now + 60.0, remaining_prefill_tokens=2000)]
    decision = choose_slo_preemption([aged, urgent], running, now, PREDICT, step_remaining_s=2.0,
                                 aging_bound_s=5.0)
    assert decision is not None and decision.waiter_id == "urgent"


@pytest.mark.parametrize("aging_bound_s,slo_ms,threshold_s", [
    (0.05, 100, 0.05),   # the bound is the ceiling
    (60.0, 30, 0.03),    # below it, one of its own objectives past its deadline
    (None, 30, None),    # probe: without aging it is never served
])
def test_aging_bounds_how_long_a_doomed_request_waits(aging_bound_s, slo_ms, threshold_s):
    """One sequence slot and a new rescuable request every step, each with less slack (280 ms)
    than the doomed request's prefill (0.5 s), so the ranking keeps it behind them: slack-EDF
    serves the stream and leaves the doomed request behind for as long as the stream lasts,
    until it is aged: min(its objective, the bound) past its deadline. Probe: without aging
    the same 40 steps (over 200 ms) never serve it."""
    sched = _slo_scheduler(num_blocks=400, budget=1000, max_num_seqs=1)
    sched.slack.aging_bound_s = aging_bound_s
    runner = FakeRunner(sched)
    doomed = _request("doomed", 500, slo_ms)  # needs 0.5 s
    sched.add_request(doomed)
    stream = []
    steps = []  # (before, after) each schedule() call
    for i in range(40):
        stream.append(_request(f"u{i}", 20, 300, max_tokens=1))
        sched.add_request(stream[-1])
        before = time.monotonic()
        out = sched.schedule()
        steps.append((before, time.monotonic()))
        sched.update_from_output(out, runner.execute(out))
        if doomed.first_scheduled_time is not None:
            break
        time.sleep(0.005)
    if threshold_s is not None:
        # It ran in the first step that began once it was aged (however slow the machine
        # makes the steps), ahead of that step's new arrival.
        aged_at = doomed.deadline + threshold_s
        assert steps[-1][1] >= aged_at and all(before < aged_at for before, _ in steps[:-1])
        assert len(stream) < 40 and stream[-1].first_scheduled_time is None
    else:
        assert doomed.first_scheduled_time is None
        assert all(r.first_token_time is not None for r in stream)  # the stream was served


def test_the_bound_comes_from_the_scheduler_config():
    config = SchedulerConfig(policy="slo", aging_bound_ms=1234.0)
    sched = Scheduler(config, CacheConfig(num_blocks=8), 8, 128)
    assert sched.slack.aging_bound_s == pytest.approx(1.234)
    with pytest.raises(ValueError, match="aging_bound_ms"):
        SchedulerConfig(aging_bound_ms=-1.0)
