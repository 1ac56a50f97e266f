"""Late as little as possible: a request the predictor deems doomed is ranked by its
lateness, ahead of every request whose slack covers its predicted prefill; the monitor may stop
a step for it where serving it now makes it less late than waiting and costs nobody their
deadline; it ages after one of its own objectives past its deadline (the bound a ceiling).
Unit tests of monitor/policy.py, the waiting queue, and the slo policy over a scheduler."""

from __future__ import annotations

import random
import time

import pytest

from engine.core.request_queue import UrgencyQueue
from monitor.policy import (AGING_SLO_MULTIPLE, RequestView, aging_threshold, choose_slo_preemption,
                            rank, should_slo_preempt, urgency, view_of)
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import FakeRunner, _request, _slo_scheduler

NOW = 1000.0
# 1 ms per token, no intercept: a 300-token prefill takes 0.3 s.
PREDICT = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0).predict


def view(rid: str, deadline_in: float | None, tokens: int, preempted: bool = False,
         slo_s: float | None = None) -> RequestView:
    deadline = None if deadline_in is None else NOW + deadline_in
    return RequestView(rid, deadline, tokens, slo_preempted=preempted, slo_s=slo_s)


def ids(views) -> list[str]:
    return [v.request_id for v in views]


# ---- the ranking ------------------------------------------------------------------------------

def test_a_doomed_request_goes_ahead_of_every_one_whose_slack_covers_its_prefill():
    """The defect: a 300-token turn with 0.25 s left (needs 0.3 s) ranked last, behind relaxed
    requests with a minute of slack, and waited for all of them. Now it goes ahead of every
    request that can afford its 0.3 s, behind the one that cannot (0.1 s of slack)."""
    views = [view("relaxed", 60.0, 4000), view("doomed", 0.25, 300),
             view("tight", 0.2, 100), view("relaxed2", 55.0, 4000)]
    assert ids(rank(views, NOW, PREDICT)) == ["tight", "doomed", "relaxed2", "relaxed"]
    # Probe: by the scalar priority alone (the old order) it came last.
    by_priority = sorted(views, key=lambda v: -urgency(v, NOW, PREDICT).priority)
    assert ids(by_priority)[-1] == "doomed"


def test_doomed_requests_go_earliest_deadline_first_and_count_against_the_slack_behind():
    """Each 0.2 s doomed prefill fits the slack the rescuable request can lend alone (0.24 s:
    its 0.35 s of slack less DEADLINE_HEADROOM of its 0.45 s left); both do not: the first
    (the most overdue) goes ahead of it, the second behind."""
    views = [view("late", -0.5, 200), view("later", -1.0, 200), view("r", 0.45, 100)]
    assert ids(rank(views, NOW, PREDICT)) == ["later", "r", "late"]
    # With room for both, both go first, the most overdue first.
    views[2] = view("r", 1.0, 100)
    assert ids(rank(views, NOW, PREDICT)) == ["later", "late", "r"]


def test_requests_without_a_deadline_come_after_every_one_with_one_in_their_order():
    views = [view("free-a", None, 10), view("doomed", 0.1, 500), view("free-b", None, 10),
             view("r", 5.0, 10)]
    assert ids(rank(views, NOW, PREDICT)) == ["doomed", "r", "free-a", "free-b"]
    no_deadline = [view(f"f{i}", None, 10 * i) for i in range(5)]
    assert ids(rank(no_deadline, NOW, PREDICT)) == ids(no_deadline)  # fcfs's order


def test_aged_requests_still_go_first_the_longest_overdue_first():
    views = [view("r", 0.2, 10), view("aged", -6.0, 100), view("aged-more", -9.0, 100),
             view("doomed", -1.0, 100)]
    assert ids(rank(views, NOW, PREDICT, aging_bound_s=5.0)) == ["aged-more", "aged", "doomed",
                                                                 "r"]


@pytest.mark.parametrize("seed", range(20))
def test_the_order_keeps_every_rescuable_request_in_time_and_places_doomed_ones_early(seed):
    """Random mixes, against the rule itself: rescuable ones keep their priority order and
    doomed ones their deadline order; no rescuable request has doomed ones ahead of it whose
    predicted prefills exceed the slack it can lend (Urgency.lendable_slack); and each doomed
    one is as early as that allows (one place earlier would break it for the rescuable request
    it would jump)."""
    rng = random.Random(seed)
    views = [view(f"q{i}", rng.choice([None, rng.uniform(-2, 3)]), rng.randrange(1, 800))
             for i in range(rng.randrange(1, 30))]
    scored = {v.request_id: urgency(v, NOW, PREDICT) for v in views}
    ranked = ids(rank(views, NOW, PREDICT))
    assert sorted(ranked) == sorted(ids(views))
    rescuable = [r for r in ranked if not scored[r].doomed and scored[r].priority > 0]
    doomed = [r for r in ranked if scored[r].doomed]
    free = [r for r in ranked if scored[r].priority == 0]
    assert ranked[len(ranked) - len(free):] == free
    assert [scored[r].priority for r in rescuable] == sorted(
        (scored[r].priority for r in rescuable), reverse=True)
    assert [scored[r].time_to_deadline for r in doomed] == sorted(
        scored[r].time_to_deadline for r in doomed)
    for pos, rid in enumerate(ranked):
        ahead = sum(scored[d].prefill for d in ranked[:pos] if scored[d].doomed)
        if rid in rescuable:
            ahead_of_it = [d for d in ranked[:pos] if scored[d].doomed]
            if ahead_of_it:
                assert ahead <= scored[rid].lendable_slack + 1e-9, (rid, ranked)
        if rid in doomed and pos > 0 and ranked[pos - 1] in rescuable:
            jumped = ranked[pos - 1]
            # Placed right behind a rescuable one: jumping it would not fit some rescuable
            # one from there on.
            behind = [r for r in ranked[pos - 1:] if r in rescuable]
            assert min(scored[r].lendable_slack for r in behind) - ahead < scored[rid].prefill, (
                rid, jumped, ranked)


# ---- aging ------------------------------------------------------------------------------------

def test_a_request_ages_one_objective_past_its_deadline_at_most_the_bound():
    assert AGING_SLO_MULTIPLE == 1.0
    assert aging_threshold(0.15, 5.0) == pytest.approx(0.15)
    assert aging_threshold(60.0, 5.0) == 5.0
    assert aging_threshold(None, 5.0) == 5.0
    assert aging_threshold(0.15, None) is None
    turn = view("turn", -0.16, 100, slo_s=0.15)  # 160 ms overdue, 150 ms objective
    assert urgency(turn, NOW, PREDICT, aging_bound_s=5.0).aged
    assert not urgency(view("turn", -0.14, 100, slo_s=0.15), NOW, PREDICT, 5.0).aged
    # The bound stays the ceiling; unknown objective: the bound alone (as before).
    assert not urgency(view("doc", -4.9, 100, slo_s=60.0), NOW, PREDICT, 5.0).aged
    assert urgency(view("doc", -5.1, 100, slo_s=60.0), NOW, PREDICT, 5.0).aged
    assert not urgency(view("turn", -0.16, 100), NOW, PREDICT, 5.0).aged


def test_an_engine_request_s_view_carries_its_objective():
    request = _request("turn", 100, 273)
    assert view_of(request).slo_s == pytest.approx(0.273)
    assert view_of(_request("free", 100, None)).slo_s is None


# ---- the gate ---------------------------------------------------------------------------------

def test_a_doomed_waiter_stops_a_long_step_that_every_running_request_can_afford():
    """A 300-token turn with 0.25 s left (needs 0.3 s: doomed) arrives with 1.2 s of a
    document's step left: waiting costs it 1.2 s, serving it now costs the document 0.3 s out
    of a minute of slack. The monitor stops the step for it (before: doomed, never)."""
    waiter = view("turn", 0.25, 300)
    running = [view("doc", 60.0, 24_000)]
    decision = choose_slo_preemption([waiter], running, NOW, PREDICT, step_remaining_s=1.2,
                                 relative_error=0.2)
    assert decision is not None and (decision.waiter_id, decision.victim_id) == ("turn", "doc")
    # Probes: a step with less left than the turn's prefill is waited for; without the step's
    # remaining time, a doomed waiter never preempts.
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, step_remaining_s=0.25) is None
    assert choose_slo_preemption([waiter], running, NOW, PREDICT) is None


def test_a_doomed_waiter_never_costs_a_running_request_its_deadline():
    waiter = view("turn", 0.25, 300)  # 0.3 s of prefill
    # The 0.35 s of slack "mid" can lend (0.5 s, less DEADLINE_HEADROOM of its 0.6 s left)
    # covers 0.3 s, not 0.3 s plus 50% error on both predictions.
    running = [view("doc", 60.0, 24_000), view("mid", 0.6, 100)]
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, step_remaining_s=1.2,
                             relative_error=0.0) is not None
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, step_remaining_s=1.2,
                             relative_error=0.5) is None
    # Not eligible as a victim (Rule 1) still counts: the whole step waits for the turn.
    running = [view("doc", 60.0, 24_000), view("mid", 0.35, 100, preempted=True)]
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, step_remaining_s=1.2) is None
    # The aggressive policy changes nothing for a doomed waiter.
    assert choose_slo_preemption([waiter], running, NOW, PREDICT, "aggressive",
                             step_remaining_s=1.2) is None


def test_four_sign_cases_with_the_step_s_time_left():
    """Branch on signs first. Rescuable cases as before; W doomed: only when the step's time
    left exceeds its prefill and R can afford it (R rescuable) or R's deadline is not earlier
    (R doomed)."""
    rescuable_w = urgency(view("w", 0.2, 100), NOW, PREDICT)
    doomed_w = urgency(view("w", 0.2, 400), NOW, PREDICT)
    relaxed_r = urgency(view("r", 60.0, 1000), NOW, PREDICT)
    doomed_r_later = urgency(view("r", 0.8, 1000), NOW, PREDICT)
    doomed_r_earlier = urgency(view("r", 0.1, 1000), NOW, PREDICT)
    assert should_slo_preempt(rescuable_w, relaxed_r, 1.2, step_remaining_s=1.0)
    assert should_slo_preempt(rescuable_w, doomed_r_later, 1.2, step_remaining_s=1.0)
    assert should_slo_preempt(doomed_w, relaxed_r, 1.2, step_remaining_s=1.0)
    assert not should_slo_preempt(doomed_w, relaxed_r, 1.2, step_remaining_s=0.3)
    assert should_slo_preempt(doomed_w, doomed_r_later, 1.2, step_remaining_s=1.0)
    assert not should_slo_preempt(doomed_w, doomed_r_earlier, 1.2, step_remaining_s=1.0)
    assert not should_slo_preempt(doomed_w, relaxed_r, 1.2)


def test_the_first_doomed_waiter_is_weighed_before_the_best_rescuable_one():
    """The doomed turn ranks ahead of a relaxed waiter (whose slack covers it): the step is
    stopped for it, not for the relaxed one, which needs no preemption."""
    waiting = [view("relaxed", 30.0, 100), view("turn", 0.25, 300)]
    decision = choose_slo_preemption(waiting, [view("doc", 60.0, 24_000)], NOW, PREDICT,
                                 step_remaining_s=1.2)
    assert decision is not None and decision.waiter_id == "turn"


def test_the_victim_is_the_last_in_the_ranking():
    """A doomed runner the ranking puts ahead of a relaxed one (whose slack covers it) is not
    the victim: the relaxed one is."""
    running = [view("doomed", 0.05, 300), view("relaxed", 60.0, 1000)]
    decision = choose_slo_preemption([view("w", 0.3, 50)], running, NOW, PREDICT, "aggressive")
    assert decision is not None and decision.victim_id == "relaxed"


def test_the_monitor_thread_fires_for_a_doomed_waiter():
    """Through SLOMonitor.check: a step predicted at 1.2 s, just started; a doomed 300-token turn
    waits. Probe: a step that is almost over is waited for."""
    from monitor.monitor import MonitorSnapshot, SLOMonitor
    from monitor.slo_preempt_signal import SLOPreemptSignal

    signal = SLOPreemptSignal.create()
    try:
        monitor = SLOMonitor(signal, aging_bound_s=5.0)
        line = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)
        for started_ago, fires in ((1.15, False), (0.0, True)):
            now = time.monotonic()
            waiter = RequestView("turn", deadline=now + 0.25, remaining_prefill_tokens=300,
                                 slo_s=0.27)
            running = RequestView("doc", deadline=now + 60.0, remaining_prefill_tokens=1200)
            snapshot = MonitorSnapshot(step_id=3 if fires else 2, preemptible=True,
                                       waiting=(waiter,), running=(running,), predictor=line,
                                       started_at=now - started_ago, predicted_step_s=1.2,
                                       num_layers=32)
            monitor.publish(snapshot)
            if not fires:
                signal.report_progress(2, 31, at=now)
            decision = monitor.check()
            assert (decision is not None) == fires
            if fires:
                assert decision.decision.waiter_id == "turn" and signal.target_step_id == 3
    finally:
        signal.close()


# ---- the waiting queue and the slo policy over a scheduler --------------------------------------

def test_the_waiting_queue_takes_the_ranking():
    reqs = [_request("relaxed", 4000, 60_000), _request("doomed", 300, 250),
            _request("free", 10, None)]
    for i, r in enumerate(reqs):
        r.arrival_time = NOW + i * 1e-3
    queue = UrgencyQueue(lambda r: urgency(view_of(r), NOW, PREDICT).priority)
    for r in reqs:
        queue.add(r)
    assert [r.request_id for r in queue] == ["relaxed", "free", "doomed"]  # by the scalar
    queue.refresh(lambda rs: rank(rs, NOW, PREDICT, view=view_of))
    assert [r.request_id for r in queue] == ["doomed", "relaxed", "free"]
    late = _request("later", 10, None)
    late.arrival_time = NOW + 1.0
    queue.add(late)  # re-sorted on the next peek with the ordering it was given
    assert queue.peek().request_id == "doomed"
    assert [r.request_id for r in queue][-2:] == ["free", "later"]


def test_the_scheduler_admits_a_doomed_request_before_a_relaxed_one():
    sched = _slo_scheduler(num_blocks=4000, budget=1000, max_num_seqs=1, max_model_len=8192)
    sched.add_request(_request("relaxed", 3000, 60_000))
    sched.add_request(_request("doomed", 300, 250))  # needs 0.3 s, has 0.25 s
    out = sched.schedule()
    assert [r.req_id for r in out.requests] == ["doomed"]


def test_a_doomed_arrival_jumps_a_running_relaxed_prefill():
    """The defect: relaxed requests with a minute of slack were served for seconds ahead of a
    doomed turn. The relaxed document prefills in 1000-token chunks; the doomed turn arrives
    and is admitted by the very next step, ahead of the document's chunk."""
    sched = _slo_scheduler(num_blocks=4000, budget=1000, max_num_seqs=4, max_model_len=8192)
    runner = FakeRunner(sched)
    sched.add_request(_request("doc", 6000, 60_000))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(_request("turn", 300, 250))  # needs 0.3 s, has 0.25 s
    out = sched.schedule()
    assert out.requests[0].req_id == "turn" and len(out.requests[0].token_ids) == 300
    # A turn late whatever joins it is served as little late as can be: alone.
    assert [r.req_id for r in out.requests] == ["turn"]


def test_a_held_doomed_victim_is_released_when_the_rest_can_afford_it():
    """A held victim (doomed by now) waits only for requests whose slack does not cover its
    prefill; a relaxed one does not hold it back."""
    sched = _slo_scheduler(num_blocks=4000, budget=100, max_num_seqs=4, max_model_len=8192)
    runner = FakeRunner(sched)
    victim = _request("victim", 300, 150)  # 0.2 s of prefill left after one chunk, 0.15 s
    sched.add_request(victim)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert victim.num_computed_tokens == 100
    assert urgency(view_of(victim), time.monotonic(), sched.slack.predict_prefill).doomed
    sched.add_request(_request("relaxed", 2000, 60_000))
    sched.slack.holds.held.add("victim")
    sched.slack.holds.victims.add("victim")
    sched.slack.begin_step(sched)
    assert not sched.slack.holds.is_held("victim")
    # Probe: a tight request (50 ms of slack, less than the victim's 0.2 s) keeps it held.
    sched.add_request(_request("tight", 50, 100))
    sched.slack.holds.held.add("victim")
    sched.slack.holds.victims.add("victim")
    sched.slack.begin_step(sched)
    assert sched.slack.holds.is_held("victim")
