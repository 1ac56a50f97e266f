"""The router's forecast of what will overtake a request (engine/load/arrivals.py) and its part
in the predictions and the routing of long-objective requests."""

from __future__ import annotations

import random

import pytest

from engine.load.arrivals import Overtakers, RecentArrivals
from engine.load.prediction import prefill_seconds
from engine.fleet.routing import FleetBook
from tests.fleet.builders import NOW, hint, load, prefill


def _fixed_point(sends: list[tuple[float, float]], seen_s: float, finish: float,
                 ttd: float) -> float:
    """The least T with T = finish + sum rate * min(T, max(0, ttd - slo)), by bisection on the
    definition (no segments): what expected_finish must agree with."""
    def f(t: float) -> float:
        return finish + sum(p / seen_s * min(t, max(0.0, ttd - slo)) for slo, p in sends)

    hi = finish + sum(p / seen_s * max(0.0, ttd - slo) for slo, p in sends)
    lo = finish
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) <= mid:
            hi = mid
        else:
            lo = mid
    return hi


def test_a_steady_flow_of_urgent_turns_stretches_a_documents_wait_by_one_over_one_minus_load():
    # 50 turns of 60 ms prefill in 5 s: 0.6 s of urgent work per second... of which the
    # document (due in 20 s) waits behind every one arriving in its wait.
    turns = Overtakers([(0.2, 0.06)] * 50, seen_s=5.0)
    assert turns.expected_finish(2.0, 20.0) == pytest.approx(2.0 / (1 - 0.6))


def test_an_urgent_turn_is_overtaken_by_nothing_due_later():
    turns = Overtakers([(0.2, 0.06)] * 50 + [(20.0, 1.0)] * 5, seen_s=5.0)
    assert turns.expected_finish(0.05, 0.15) == 0.05
    assert turns.expected_finish(0.05, 0.2) == 0.05  # due together: not before it


def test_an_overload_caps_at_the_work_due_before_the_deadline():
    # 2 s of urgent work per second: the wait never ends by itself, but only turns arriving
    # before 9.8 s from now (due before its 10 s deadline) go first.
    turns = Overtakers([(0.2, 0.2)] * 50, seen_s=5.0)
    assert turns.expected_finish(1.0, 10.0) == pytest.approx(1.0 + 2.0 * 9.8)


@pytest.mark.parametrize("seed", range(40))
def test_expected_finish_is_the_least_fixed_point(seed):
    rng = random.Random(seed)
    sends = [(rng.choice([0.15, 0.3, 1.0, rng.uniform(0.1, 30.0)]), rng.uniform(0.001, 0.5))
             for _ in range(rng.randint(1, 60))]
    seen_s = rng.uniform(0.5, 5.0)
    finish, ttd = rng.uniform(0.0, 5.0), rng.uniform(0.05, 40.0)
    got = Overtakers(sends, seen_s).expected_finish(finish, ttd)
    assert got == pytest.approx(_fixed_point(sends, seen_s, finish, ttd), rel=1e-9, abs=1e-9)


def test_recent_arrivals_forget_past_the_window_and_are_read_over_the_time_they_span():
    arrivals = RecentArrivals(window_s=5.0, min_span_s=0.2)
    assert arrivals.overtakers(NOW) is None
    arrivals.add(NOW + 1.0, 0.2, 0.1)
    arrivals.add(NOW + 2.0, 0.2, 0.1)
    seen = arrivals.overtakers(NOW + 3.0)
    assert seen is not None and len(seen) == 2 and seen.seen_s == pytest.approx(2.0)
    assert arrivals.overtakers(NOW + 5.5).seen_s == pytest.approx(4.5)  # type: ignore[union-attr]
    late = arrivals.overtakers(NOW + 6.5)  # the first has left the window
    assert late is not None and len(late) == 1 and late.seen_s == pytest.approx(4.5)
    assert arrivals.overtakers(NOW + 7.5) is None
    # A first send is not read as a flood: spread over at least the least span.
    young = RecentArrivals(window_s=5.0, min_span_s=0.2)
    young.add(NOW, 0.2, 0.1)
    assert young.overtakers(NOW).seen_s == pytest.approx(0.2)  # type: ignore[union-attr]
    # A flow that has just begun reads at its own rate past the least span.
    young.add(NOW + 0.3, 0.2, 0.1)
    assert young.overtakers(NOW + 0.4).seen_s == pytest.approx(0.4)  # type: ignore[union-attr]
    # A steady flow longer than the window is read over the window.
    steady = RecentArrivals(window_s=5.0, min_span_s=0.2)
    for k in range(21):
        steady.add(NOW + 0.5 * k, 0.2, 0.1)
    flow = steady.overtakers(NOW + 10.0)
    assert flow is not None and len(flow) == 11 and flow.seen_s == pytest.approx(5.0)


def _book_with_urgent_traffic(turns_on_a: int) -> FleetBook:
    """Two idle replicas; `turns_on_a` urgent turns of 512 tokens sent to "a" over the last 5 s
    (the whole window; and completed: nothing of them is queued any more), none to "b"."""
    book = FleetBook(report_period_s=0.1)
    assert book.arrival_window_s == pytest.approx(5.0)
    for rid in ("a", "b"):
        book.on_report(rid, load(made_at=NOW - 5.0))
    for i in range(turns_on_a):
        at = NOW - 5.0 + 5.0 * i / turns_on_a
        book.on_sent("a", hint(f"turn-{i}", tokens=512, slo=0.3, arrived_at=at), at)
        book.on_completed("a", f"turn-{i}")
    for rid in ("a", "b"):
        book.on_report(rid, load(made_at=NOW))
    return book


def test_a_document_is_predicted_behind_the_urgent_work_its_replica_keeps_getting():
    book = _book_with_urgent_traffic(turns_on_a=40)
    document = hint("doc", tokens=24_000, slo=20.0)
    on_a, on_b = book.predict("a", document, NOW), book.predict("b", document, NOW)
    assert on_a is not None and on_b is not None
    # Probe: "a" really has the turns in its window, and "b" none.
    assert len(book.replicas["a"].arrivals.overtakers(NOW)) == 40  # type: ignore[arg-type]
    assert book.replicas["b"].arrivals.overtakers(NOW) is None
    alone = prefill(24_000)
    turn_s = prefill_seconds(load(), 512)  # what each turn adds to a waiter's wait
    load_a = 40 * turn_s / 5.0  # per second of the 5 s window: 0.4
    assert on_b.ttft_s == pytest.approx(alone) and on_b.overtaken_s == 0.0
    assert on_a.ttft_s == pytest.approx(alone / (1 - load_a))
    assert on_a.overtaken_s == pytest.approx(on_a.ttft_s - alone)
    # The document goes where it is overtaken least; an urgent turn is not moved by it.
    assert book.rank("slack", ["a", "b"], document, NOW)[0] == ["b"]
    turn = hint("turn", tokens=256, slo=0.2)
    assert book.predict("a", turn, NOW).overtaken_s == 0.0  # type: ignore[union-attr]


def test_a_forecast_miss_counts_as_the_requests_own_but_not_in_the_optimistic_bound():
    book = _book_with_urgent_traffic(turns_on_a=300)  # 3 s of turns per second: an overload
    document = hint("doc", tokens=24_000, slo=3.0)
    on_a = book.predict("a", document, NOW)
    assert on_a is not None
    assert on_a.ttft_s > 3.0 and on_a.added_misses == 1
    # Admission's bound counts only work that exists: the forecast is not a reason to refuse.
    assert on_a.optimistic_ttft_s < 3.0
