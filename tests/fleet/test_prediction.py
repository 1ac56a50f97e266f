"""engine.load.prediction: a request's TTFT on one replica, by hand-computed scenarios."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.load.load_report import ReplicaLoad
from engine.load.prediction import PREEMPT_LATENCY_S, PreparedLoad, _urgency, predict
from monitor.policy import RequestView, urgency
from monitor.step_time_model import StepTimeModel
from tests.fleet.builders import MODEL, NOW, hint, load, prefill


def test_idle_replica_serves_at_once():
    p = predict(load(), [], hint(tokens=1000, slo=1.0), NOW)
    assert p.ttft_s == pytest.approx(prefill(1000))  # 0.07
    assert p.optimistic_ttft_s == pytest.approx(0.9 * prefill(1000))
    assert (p.misses_before, p.misses_after, p.drain_s) == (0, 0, 0.0)
    assert not p.preempts


def test_the_optimistic_bound_counts_the_marginal_work_queued_ahead():
    """Requests with earlier deadlines go first on the replica; at best it packs them into the
    new request's steps, so the bound charges their tokens but none of their step overheads. A
    queue with later deadlines is behind the request and counts nothing."""
    ahead = [(256, 0.05), (256, 0.06), (256, 0.07)]
    p = predict(load(waiting=ahead), [], hint(tokens=128, slo=0.15), NOW)
    # The point estimate serves them one step each, ahead of it.
    assert p.ttft_s == pytest.approx(3 * prefill(256) + prefill(128))
    assert p.optimistic_ttft_s == pytest.approx(0.9 * (3 * (prefill(256) - 0.03)
                                                       + prefill(128)))
    behind = predict(load(waiting=[(256, 5.0)] * 3), [], hint(tokens=128, slo=0.15), NOW)
    assert behind.optimistic_ttft_s == pytest.approx(0.9 * prefill(128))


def test_the_optimistic_bound_saves_a_step_overhead_per_chunk_of_the_budget():
    """A queued document ahead of the request, in chunks of the replica's step budget: each
    chunk is a step whose overhead batching could save."""
    lo = load(waiting=[(5000, 0.5)])
    chunked = ReplicaLoad(**{**msgspec.structs.asdict(lo), "max_num_batched_tokens": 2048})
    p = predict(chunked, [], hint(tokens=128, slo=1.0), NOW)
    three_chunks = 3 * 0.03 + 4e-5 * 5000  # 2048 + 2048 + 904 tokens
    assert p.ttft_s == pytest.approx(three_chunks + prefill(128))
    assert p.optimistic_ttft_s == pytest.approx(0.9 * (three_chunks - 3 * 0.03 + prefill(128)))


def test_time_waited_since_arrival_counts_in_ttft():
    p = predict(load(), [], hint(tokens=1000, slo=1.0, arrived_at=NOW - 0.5), NOW)
    assert p.ttft_s == pytest.approx(0.5 + prefill(1000))


def test_report_is_aged_to_now():
    # Made 0.1 s ago: the step has 0.2 s left, the waiter 0.1 s to its deadline. It finishes at
    # 0.2 + 0.07 = 0.27, late by 0.17; the new request (no deadline) after it at 0.34.
    lo = load(made_at=NOW - 0.1, step_remaining_s=0.3, waiting=[(1000, 0.2)])
    p = predict(lo, [], hint(tokens=1000, slo=None), NOW)
    assert p.misses_before == p.misses_after == 1
    assert p.lateness_before_s == pytest.approx(0.17)
    assert p.ttft_s == pytest.approx(0.2 + 2 * prefill(1000))
    assert p.drain_s == pytest.approx(0.27)


def test_deadline_ahead_of_no_deadline_and_tightest_first():
    lo = load(waiting=[(8192, None), (1000, 5.0)])
    urgent = predict(lo, [], hint(tokens=128, slo=0.15), NOW)
    assert urgent.ttft_s == pytest.approx(prefill(128))
    assert urgent.added_misses == 0
    # Without a deadline: first come first served, after the deadline one.
    free = predict(lo, [], hint(tokens=128, slo=None), NOW)
    assert free.ttft_s == pytest.approx(prefill(8192) + prefill(1000) + prefill(128))


def test_preemptible_long_prefill_is_stopped_for_an_urgent_waiter():
    # Replica A of the routing scenario: 1.2 s left of a 30k-token prefill without a deadline.
    lo = load(running=[(30_000, None)], step_remaining_s=1.2, step_preemptible=True)
    p = predict(lo, [], hint(tokens=128, slo=0.15), NOW)
    assert p.preempts
    assert p.ttft_s == pytest.approx(PREEMPT_LATENCY_S + prefill(128))
    assert p.optimistic_ttft_s == pytest.approx(PREEMPT_LATENCY_S + 0.9 * prefill(128))
    assert p.added_misses == 0


@pytest.mark.parametrize("preemptible,slo_preemption", [(False, True), (True, False)])
def test_step_not_stopped_without_preemption(preemptible, slo_preemption):
    lo = load(running=[(30_000, None)], step_remaining_s=1.2, step_preemptible=preemptible,
              slo_preemption=slo_preemption)
    p = predict(lo, [], hint(tokens=128, slo=0.15), NOW)
    assert not p.preempts
    assert p.ttft_s == pytest.approx(1.2 + prefill(128))
    assert p.optimistic_ttft_s == pytest.approx(1.2 + 0.9 * prefill(128))
    assert p.added_misses == 1


def test_necessity_a_waiter_whose_slack_covers_the_step_waits():
    lo = load(running=[(30_000, None)], step_remaining_s=1.2, step_preemptible=True)
    p = predict(lo, [], hint(tokens=128, slo=5.0), NOW)
    assert not p.preempts
    assert p.ttft_s == pytest.approx(1.2 + prefill(128))


def test_interrupted_prefill_keeps_its_remaining_work_and_can_miss():
    # The running request's deadline is 1.21 s away: alone it finishes at 1.2 (met). Stopped
    # for the urgent one, its remaining 1.18 s run after it: 0.02 + 0.03512 + 1.18 > 1.21.
    lo = load(running=[(30_000, 1.21)], step_remaining_s=1.2, step_preemptible=True)
    p = predict(lo, [], hint(tokens=128, slo=0.15), NOW)
    assert p.preempts
    assert p.misses_before == 0 and p.misses_after == 1
    assert p.lateness_after_s == pytest.approx(PREEMPT_LATENCY_S + prefill(128) + 1.18 - 1.21)
    # A deadline 1.5 s away survives the interruption.
    lo = load(running=[(30_000, 1.5)], step_remaining_s=1.2, step_preemptible=True)
    assert predict(lo, [], hint(tokens=128, slo=0.15), NOW).added_misses == 0


def test_queue_is_ranked_as_of_the_step_end():
    """The monitor ranks its queue when it schedules the next prefill: after the running step.
    A (1000 tokens, 0.07 s; 0.55 s to go) is rescuable now but doomed at the step's end 0.5 s
    on; B (20k tokens, 0.83 s; 1.35 s to go) then has 0.02 s of slack, less than A's prefill,
    so B goes first (1.33 s, met) and A after (1.40 s, late by 0.85). Ranked as of now, A would
    go first and both would miss."""
    lo = load(running=[(4000, None)], step_remaining_s=0.5,
              waiting=[(1000, 0.55), (20_000, 1.35)])
    p = predict(lo, [], hint(tokens=16, slo=None), NOW)
    assert p.misses_before == 1
    assert p.lateness_before_s == pytest.approx(0.85)


def test_unreported_sends_queue_ahead_fcfs():
    sent = hint("doc", tokens=8192, slo=None)
    p = predict(load(), [sent], hint(tokens=128, slo=None), NOW)
    assert p.ttft_s == pytest.approx(prefill(8192) + prefill(128))
    assert p.drain_s == pytest.approx(prefill(8192))


def test_prefix_cache_hit_shortens_the_prefill():
    lo = load(cached=range(1, 101))  # 100 blocks of 16 tokens
    p = predict(lo, [], hint(tokens=2048, slo=1.0, prefix=range(1, 129)), NOW)
    assert p.cached_blocks == 100
    assert p.ttft_s == pytest.approx(prefill(2048 - 1600))


def test_prefix_of_an_unreported_send_counts_as_cached():
    sent = hint("doc", tokens=2048, slo=None, prefix=range(1, 129))
    p = predict(load(), [sent], hint(tokens=2100, slo=None, prefix=range(1, 129)), NOW)
    assert p.cached_blocks == 128
    assert p.ttft_s == pytest.approx(prefill(2048) + prefill(2100 - 2048))


def test_prepared_load_gives_the_same_answer():
    lo = load(waiting=[(1000, 0.5), (4000, None)], running=[(2000, 1.0)], step_remaining_s=0.1)
    h = hint(tokens=300, slo=0.4)
    assert predict(PreparedLoad(lo), [], h, NOW) == predict(lo, [], h, NOW)


@settings(max_examples=200, deadline=None, database=None)
@given(ttd=st.floats(-5, 5, allow_nan=False), tokens=st.integers(1, 40_000))
def test_urgency_is_the_monitors(ttd, tokens):
    ttd = (NOW + ttd) - NOW  # what the monitor sees of an absolute deadline
    mine = _urgency(ttd, MODEL.predict(tokens), MODEL.optimistic(MODEL.predict(tokens)))
    theirs = urgency(RequestView("r", NOW + ttd, tokens), NOW, MODEL.predict,
                     optimistic=lambda t: MODEL.optimistic(MODEL.predict(t)))
    assert mine.doomed == theirs.doomed
    assert mine.priority == pytest.approx(theirs.priority)
    assert mine.slack == pytest.approx(theirs.slack)
    assert mine.time_to_deadline == pytest.approx(theirs.time_to_deadline)


queued = st.tuples(st.integers(1, 30_000), st.one_of(st.none(), st.floats(0.0, 5.0)))


@settings(max_examples=300, deadline=None, database=None)
@given(waiting=st.lists(queued, max_size=12), running=st.lists(queued, max_size=2),
       step=st.floats(0.0, 2.0), tokens=st.integers(1, 30_000),
       slo=st.one_of(st.none(), st.floats(0.01, 5.0)))
def test_adding_a_request_never_removes_a_miss_without_preemption_or_doomed(
        waiting, running, step, tokens, slo):
    """With no step to stop and no doomed request to merge, the queue is a fixed order of work
    (by priority, then first come first served) and the new request only delays those it goes
    ahead of: predicted misses and lateness can only grow."""
    lo = load(waiting=waiting, running=running, step_remaining_s=step)
    start = step if (step or running) else 0.0
    if any(ttd is not None and ttd - start <= 0.9 * prefill(t) for t, ttd in waiting):
        return  # doomed by the time the queue starts: the merge is not monotone (see below)
    p = predict(lo, [], hint(tokens=tokens, slo=slo), NOW)
    assert p.misses_after >= p.misses_before
    assert p.lateness_after_s >= p.lateness_before_s - 1e-9
    assert p.ttft_s >= p.optimistic_ttft_s - 1e-9
    assert math.isfinite(p.ttft_s)


def test_an_arrival_that_stops_the_step_can_save_others():
    """Not monotone, and rightly: an urgent arrival that opens the gate stops the step, and the
    queue then runs in slack order, the interrupted remainder included; a waiter the gate alone
    did not serve (its slack covered the step, less the model's error) is served early too."""
    # Runner: 1.2 s left, deadline 1.5 s away (priority 1/1.5). Waiter: 3000 tokens (0.15 s),
    # deadline 1.3 s away: priority 1/1.3 does not beat the runner's by the 1.2 margin, so it
    # waits for the step and finishes at 1.35 s, late. The urgent arrival stops the step: new at
    # 0.02 + 0.035, the waiter 0.15 s later (0.205), the runner's 1.18 s rest (1.385 < 1.5).
    lo = load(running=[(30_000, 1.5)], step_remaining_s=1.2, step_preemptible=True,
              waiting=[(3000, 1.3)])
    p = predict(lo, [], hint(tokens=128, slo=0.15), NOW)
    assert p.preempts
    assert (p.misses_before, p.misses_after, p.added_misses) == (1, 0, -1)
    assert p.ttft_s == pytest.approx(PREEMPT_LATENCY_S + prefill(128))


@settings(max_examples=300, deadline=None, database=None)
@given(jobs=st.lists(st.tuples(st.floats(-1.0, 3.0), st.floats(0.001, 1.0)), max_size=10))
def test_head_is_the_monitors_first(jobs):
    from engine.load.prediction import _head, _Job
    from monitor.policy import order

    built = [_Job(cost, 0.9 * cost, (ttd,), _urgency(ttd, cost, 0.9 * cost))
             for ttd, cost in jobs]
    head = _head(built)
    if not built:
        assert head is None
    else:
        assert head is order([(job.urgency, job) for job in built])[0][0]


def test_a_long_prompt_is_predicted_as_the_chunks_its_replica_prefills():
    """Two replicas of the same hardware whose refitted models split a step's cost differently
    (a large fixed cost and a small slope, or the reverse) agree on a document prefilled in
    2048-token chunks, and the router then sees them as equals; as one step, the first would
    look twice as fast and draw every document."""
    import msgspec

    from engine.load.prediction import prefill_seconds

    steep = StepTimeModel(seconds_per_token=3.0e-5, intercept_s=0.004)
    flat = StepTimeModel(seconds_per_token=1.6e-5, intercept_s=0.0327)
    chunked = [msgspec.structs.replace(load(model=m), max_num_batched_tokens=2048)
               for m in (steep, flat)]
    # A 2048-token chunk costs both the same: 65.4 ms.
    assert steep.predict(2048) == pytest.approx(flat.predict(2048), rel=1e-3)
    whole = [load(model=m) for m in (steep, flat)]  # no budget reported: one step
    assert prefill_seconds(whole[1], 20480) < 0.6 * prefill_seconds(whole[0], 20480)
    # In 10 chunks each pays its fixed cost: the two agree again.
    assert prefill_seconds(chunked[0], 20480) == pytest.approx(
        prefill_seconds(chunked[1], 20480), rel=1e-3)
    assert prefill_seconds(chunked[0], 20480) == pytest.approx(10 * steep.predict(2048))
    # A prompt within the budget is one step, as before.
    assert prefill_seconds(chunked[0], 1000) == steep.predict(1000)
    p = predict(chunked[1], [], hint(tokens=20480, slo=30.0), NOW)
    assert p.ttft_s == pytest.approx(prefill_seconds(chunked[1], 20480))
