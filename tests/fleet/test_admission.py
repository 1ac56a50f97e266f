"""engine.fleet.admission: doomed iff the optimistic bound misses on every fresh replica."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fleet.admission import MIN_RETRY_AFTER_S, assess
from engine.load.prediction import PREEMPT_LATENCY_S
from engine.fleet.routing import FleetBook
from tests.fleet.builders import NOW, hint, load, prefill


def book_of(**loads) -> FleetBook:
    book = FleetBook()
    for rid, lo in loads.items():
        book.on_report(rid, lo)
    return book


def test_doomed_judged_on_the_optimistic_bound_not_the_point():
    # 10k tokens on an idle replica: 0.43 s predicted, 0.387 s at best.
    book = book_of(R=load())
    a = assess(book, hint(tokens=10_000, slo=0.4), NOW)
    assert not a.doomed  # the point estimate misses 0.4 s, the bound does not
    assert a.predicted_ttft_s == pytest.approx(prefill(10_000))
    assert a.optimistic_ttft_s == pytest.approx(0.9 * prefill(10_000))
    assert a.best_replica == "R"
    assert assess(book, hint(tokens=10_000, slo=0.38), NOW).doomed


def test_doomed_only_if_every_replica_misses():
    busy = load(running=[(30_000, None)], step_remaining_s=2.5)
    stoppable = load(running=[(30_000, None)], step_remaining_s=2.5, step_preemptible=True)
    h = hint(tokens=128, slo=0.15)
    a = assess(book_of(B1=busy, B2=stoppable), h, NOW)
    assert not a.doomed and a.best_replica == "B2"
    assert a.optimistic_ttft_s == pytest.approx(PREEMPT_LATENCY_S + 0.9 * prefill(128))
    doomed = assess(book_of(B1=busy, B2=busy), h, NOW)
    assert doomed.doomed
    assert doomed.predicted_ttft_s == pytest.approx(2.5 + prefill(128))
    # Retry when the shortest queue has drained: 2.5 s of step, rounded up.
    assert doomed.retry_after_s == 3


def test_doomed_by_the_urgent_work_queued_ahead_on_every_replica():
    """A burst of urgent turns queued on each replica, every one due before the new request:
    even packed into its steps their tokens leave it no time, and no reordering helps (they
    are more urgent). The probe: the same queue due after it leaves the request rescuable."""
    burst = [(1024, 0.06 + 0.01 * i) for i in range(4)]  # 4 x 40.96 ms of tokens ahead
    h = hint(tokens=256, slo=0.18)
    a = assess(book_of(A=load(waiting=burst), B=load(waiting=burst)), h, NOW)
    marginal = 4 * (prefill(1024) - 0.03)
    assert a.optimistic_ttft_s == pytest.approx(0.9 * (marginal + prefill(256)))  # 0.1843
    assert a.doomed
    later = [(1024, 5.0 + i) for i in range(4)]
    b = assess(book_of(A=load(waiting=later), B=load(waiting=burst)), h, NOW)
    assert not b.doomed and b.best_replica == "A"
    assert b.optimistic_ttft_s == pytest.approx(0.9 * prefill(256))


def test_retry_after_counts_the_whole_queue_of_the_least_loaded_replica():
    a = load(step_remaining_s=1.0, waiting=[(8192, None)] * 3)  # 1 + 3 * 0.35768 = 2.07
    b = load(step_remaining_s=4.2)
    out = assess(book_of(A=a, B=b), hint(tokens=128, slo=0.1), NOW)
    assert out.doomed and out.retry_after_s == 3
    assert assess(book_of(A=load()), hint(tokens=128, slo=0.01), NOW).retry_after_s == \
        MIN_RETRY_AFTER_S


def test_no_objective_is_never_doomed():
    book = book_of(R=load(step_remaining_s=100.0))
    a = assess(book, hint(tokens=128, slo=None), NOW)
    assert not a.doomed and a.predicted_ttft_s == pytest.approx(100 + prefill(128))


def test_stale_replicas_do_not_count_and_none_fresh_admits():
    book = book_of(old=load(made_at=NOW - 1.0), busy=load(step_remaining_s=2.0))
    assert assess(book, hint(tokens=128, slo=0.15), NOW).doomed  # only `busy` is fresh
    only_stale = book_of(old=load(made_at=NOW - 1.0, step_remaining_s=50.0))
    a = assess(only_stale, hint(tokens=128, slo=0.15), NOW)
    assert not a.doomed and a.predicted_ttft_s is None and a.best_replica is None


def test_candidates_and_precomputed_predictions():
    book = book_of(fast=load(), slow=load(step_remaining_s=2.0))
    h = hint(tokens=128, slo=0.15)
    assert assess(book, h, NOW, candidate_ids=["slow"]).doomed
    predictions = book.predictions(["fast", "slow"], h, NOW)
    assert assess(book, h, NOW, predictions=predictions) == assess(book, h, NOW)


@settings(max_examples=150, deadline=None, database=None)
@given(steps=st.lists(st.tuples(st.floats(0, 3), st.booleans()), min_size=1, max_size=6),
       tokens=st.integers(1, 20_000), slo=st.floats(0.01, 3))
def test_doomed_iff_optimistic_bound_misses_everywhere(steps, tokens, slo):
    book = FleetBook()
    for i, (step, preemptible) in enumerate(steps):
        book.on_report(f"r{i}", load(step_remaining_s=step, step_preemptible=preemptible,
                                     running=[(4000, None)] if step else []))
    h = hint(tokens=tokens, slo=slo)
    a = assess(book, h, NOW)
    bounds = [book.predict(rid, h, NOW).optimistic_ttft_s for rid in book.replicas]
    assert a.doomed == all(b > slo for b in bounds)
    assert a.retry_after_s >= MIN_RETRY_AFTER_S
