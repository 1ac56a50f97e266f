"""engine.fleet.routing: the router's bookkeeping and its five policies."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fleet.routing import ROUTER_POLICIES, FleetBook
from tests.fleet.builders import MODEL, NOW, hint, load


def flat(ranks: list[list[str]]) -> list[str]:
    assert all(len(rank) == 1 for rank in ranks)
    return [rank[0] for rank in ranks]


def scenario_book(a_preemption: bool = True) -> FleetBook:
    """A: 1.2 s left of a preemptible 30k-token prefill beside 16 decodes. B: an 8k document
    in a step it cannot stop (0.33 s left) and three more queued, none with a deadline.
    C: 0.1 s left of a 4k document and four short requests queued, no deadlines."""
    book = FleetBook(seed=0)
    book.on_report("A", load(running=[(30_000, None)], step_remaining_s=1.2,
                             step_preemptible=True, slo_preemption=a_preemption,
                             num_decoding=16))
    book.on_report("B", load(running=[(8192, None)], step_remaining_s=0.33,
                             waiting=[(8192, None)] * 3))
    book.on_report("C", load(running=[(4096, None)], step_remaining_s=0.1,
                             waiting=[(200, None)] * 4))
    return book


def test_urgent_request_goes_to_the_replica_whose_long_prefill_it_can_interrupt():
    # A: 0.02 + 0.035 s (met, by preempting: its 30k prefill waits 0.035 s more, 0.09 s of
    # delay in all); C: 0.1 + 0.035 s (met); B: 0.33 + 0.035 s (missed). At 145 ms C meets it
    # without its 10% error to spare (0.1485 s): at risk.
    book = scenario_book()
    assert flat(book.rank("slack", ["A", "B", "C"], hint(tokens=128, slo=0.15), NOW)) == \
        ["A", "C", "B"]
    assert flat(book.rank("slack", ["A", "B", "C"], hint(tokens=128, slo=0.145), NOW)) == \
        ["A", "C", "B"]


def test_an_idle_replica_is_preferred_to_stopping_a_prefill_even_on_a_slower_model():
    # D is idle, its model 15 ms slower than A's (independent fits differ): D's first token at
    # 0.05 s beats A's 0.055 s plus the 0.035 s its stopped prefill then waits.
    book = scenario_book()
    slower = MODEL.__class__(seconds_per_token=4e-5, intercept_s=0.045, relative_error=0.1,
                             relative_speedup=0.1)
    book.on_report("D", load(model=slower))
    assert flat(book.rank("slack", ["A", "B", "C", "D"], hint(tokens=128, slo=0.3), NOW))[:2] \
        == ["D", "A"]


def test_a_burst_spreads_over_replicas_that_all_meet_it():
    # Four replicas each stopping a long prefill for the first urgent turn it gets: the burst's
    # turns go one to each before any gets a second (each send lengthens that queue).
    book = FleetBook(seed=0)
    for rid in "WXYZ":
        book.on_report(rid, load(running=[(30_000, None)], step_remaining_s=1.2,
                                 step_preemptible=True))
    chosen = []
    for i in range(4):
        turn = hint(f"turn{i}", tokens=256, slo=0.3)
        best = flat(book.rank("slack", list("WXYZ"), turn, NOW))[0]
        book.on_sent(best, turn, NOW)
        chosen.append(best)
    assert sorted(chosen) == list("WXYZ")


def test_a_choice_counts_until_its_send_is_confirmed_or_a_report_would_hold_it():
    book = FleetBook(seed=0)
    for rid in "XY":
        book.on_report(rid, load(made_at=NOW - 0.01))
    first = hint("first", tokens=256, slo=0.3)
    book.on_chosen("X", first, NOW)
    assert book.load_of("X") == 1 and book.in_flight("X") == 0
    # Confirmed elsewhere (Ray Serve fell back to Y): counted there once, not at X.
    book.on_sent("Y", first, NOW + 0.01)
    assert (book.load_of("X"), book.load_of("Y"), book.in_flight("Y")) == (0, 1, 1)
    # Ranked again after a refusal: its choice is void before the new ranking.
    again = hint("again", tokens=256, slo=0.3)
    book.on_chosen("X", again, NOW)
    book.on_unchosen("again")
    assert book.load_of("X") == 0
    # Never confirmed (its client went away): a report made after it, which would count it
    # had it arrived, ends it.
    lost = hint("lost", tokens=256, slo=0.3)
    book.on_chosen("X", lost, NOW)
    book.on_report("X", load(made_at=NOW + 0.01))
    assert book.load_of("X") == 1
    book.on_report("X", load(made_at=NOW + book.send_skew_s + 0.01))
    assert book.load_of("X") == 0


def test_a_burst_ranked_before_any_send_is_confirmed_spreads_over_the_replicas():
    """Ray Serve's router calls choose_replicas for each request as it comes and hears the
    replica accept it (on_request_routed) a round trip later: a burst of urgent turns is
    ranked inside that round trip. Each is counted on its choice at once."""
    from types import SimpleNamespace

    from engine.fleet.ray_router import DeadlineRouter
    from engine.load.load_report import encode_load

    def burst(count_choices: bool) -> list[str]:
        router = DeadlineRouter.__new__(DeadlineRouter)  # Ray's __init__ needs a cluster
        router._deployment_id = SimpleNamespace(name=f"burst-{count_choices}")
        router.initialize_state(policy="slack", seed=0)
        if not count_choices:
            router.book.on_chosen = lambda *_: None
        now = time.time()
        replicas = [SimpleNamespace(
            replica_id=SimpleNamespace(unique_id=rid),
            routing_stats={"load": encode_load(load(made_at=now, running=[(30_000, None)],
                                                    step_remaining_s=1.2,
                                                    step_preemptible=True))})
            for rid in "WXYZ"]
        chosen = []
        for i in range(4):
            turn = hint(f"turn{i}", tokens=256, slo=0.3, arrived_at=now)
            pending = SimpleNamespace(kwargs={"hint": turn}, metadata=SimpleNamespace(
                internal_request_id=f"ray-{i}"))
            ranks = asyncio.run(router.choose_replicas(replicas, pending))
            chosen.append(ranks[0][0].replica_id.unique_id)
        return chosen

    assert sorted(burst(count_choices=True)) == list("WXYZ")
    # Probe: with the choices uncounted until confirmed, the burst piles onto one replica.
    assert len(set(burst(count_choices=False))) == 1


def test_the_book_keeps_the_prediction_on_the_replica_the_request_was_sent_to():
    """What the ingress puts in x-sloserve-predicted-ttft-ms: the slack ranking's prediction on
    the chosen replica (not a second one made after the send queued it there), taken once;
    under another policy the book predicts it at the send; none for a stale replica."""
    book = scenario_book()
    h = hint(request_id="r1", tokens=128, slo=0.15)
    assert flat(book.rank("slack", ["A", "B", "C"], h, NOW))[0] == "A"
    expected = book.predict("A", h, NOW).ttft_s
    book.on_sent("A", h, NOW)
    assert book.routed_prediction("r1") == pytest.approx(expected)  # 0.02 + 0.035 s
    assert book.routed_prediction("r1") is None
    # Sent to C by another policy: predicted there, at the send, before it queues there.
    h2 = hint(request_id="r2", tokens=128, slo=0.15)
    before = book.predict("C", h2, NOW).ttft_s
    book.on_sent("C", h2, NOW)
    assert book.routed_prediction("r2") == pytest.approx(before)
    # A replica whose report is too old to predict on gives none.
    book.on_sent("C", hint(request_id="r3"), NOW + 60.0)
    assert book.routed_prediction("r3") is None


def test_least_queue_sends_it_to_the_shortest_count():
    # waiting * 4 + running: A 0 + 1 + 16 decodes = 17, B 12 + 1 = 13, C 16 + 1 = 17.
    book = scenario_book()
    assert book.queue_score("A") == 17 and book.queue_score("B") == 13
    assert flat(book.rank("least-queue", ["A", "B", "C"], hint(), NOW))[0] == "B"


def test_without_slo_preemption_the_long_prefill_blocks_it():
    # A: 1.2 + 0.035 s, missed like B's 0.365 s: C alone meets it; B before A on TTFT.
    book = scenario_book(a_preemption=False)
    assert flat(book.rank("slack", ["A", "B", "C"], hint(tokens=128, slo=0.15), NOW)) == \
        ["C", "B", "A"]


def test_unreported_sends_count():
    # Two idle replicas; a 2000-token request with a 150 ms objective takes 0.11 s. A second
    # one sent where the first went would make one of them late: it goes to the other.
    book = FleetBook(seed=0)
    book.on_report("R1", load())
    book.on_report("R2", load())
    first = hint("first", tokens=2000, slo=0.15)
    assert flat(book.rank("slack", ["R1", "R2"], first, NOW)) == ["R1", "R2"]
    book.on_sent("R1", first, NOW)
    second = hint("second", tokens=2000, slo=0.15)
    assert flat(book.rank("slack", ["R1", "R2"], second, NOW))[0] == "R2"
    assert book.queue_score("R1") == 4 and book.load_of("R1") == 1
    assert flat(book.rank("least-queue", ["R1", "R2"], second, NOW))[0] == "R2"


def test_report_absorbs_sends_made_before_it_less_the_skew():
    book = FleetBook(send_skew_s=0.05)
    book.on_report("R", load())
    book.on_sent("R", hint("early"), NOW)
    book.on_sent("R", hint("late"), NOW + 0.08)
    book.on_report("R", load(made_at=NOW + 0.1))
    assert [h.request_id for h in book.replicas["R"].unreported_hints()] == ["late"]
    assert book.in_flight("R") == 2  # in flight until completed, reported or not
    # An older report arriving late changes nothing.
    book.on_report("R", load(made_at=NOW, waiting=[(100, None)]))
    assert book.replicas["R"].load.made_at == NOW + 0.1


def test_completion_and_removal():
    book = FleetBook()
    book.on_report("R", load())
    book.on_sent("R", hint("x"), NOW)
    book.on_completed("R", "x")
    assert book.in_flight("R") == 0 and book.replicas["R"].unreported == []
    book.on_completed("gone", "x")  # unknown replica: nothing to do
    book.on_removed("R")
    assert "R" not in book.replicas


def test_stale_replica_is_avoided_unless_nothing_fresh_is_left():
    book = FleetBook(report_period_s=0.1)  # stale after 0.3 s
    assert book.stale_after_s == pytest.approx(0.3)
    book.on_report("old", load(made_at=NOW - 0.5))  # idle, but silent for 0.5 s
    book.on_report("busy", load(running=[(8192, None)], step_remaining_s=0.3))
    h = hint(tokens=128, slo=0.15)
    assert not book.is_fresh("old", NOW) and book.is_fresh("busy", NOW)
    assert flat(book.rank("slack", ["old", "busy"], h, NOW)) == ["busy", "old"]
    assert flat(book.rank("slack", ["old", "never"], h, NOW)) in (["old", "never"],
                                                                  ["never", "old"])


def test_a_replica_seen_failing_is_avoided_until_it_reports_again():
    book = FleetBook(report_period_s=0.1)
    book.on_report("idle", load(made_at=NOW - 0.05))
    book.on_report("busy", load(running=[(8192, None)], step_remaining_s=0.3))
    h = hint(tokens=128, slo=0.15)
    assert flat(book.rank("slack", ["idle", "busy"], h, NOW))[0] == "idle"
    book.on_failed("idle", NOW)
    assert not book.is_fresh("idle", NOW)
    assert book.fresh_and_stale(NOW) == (["busy"], ["idle"])
    assert flat(book.rank("slack", ["idle", "busy"], h, NOW)) == ["busy", "idle"]
    # A report made before the failure (delivered late) does not bring it back; a newer does.
    book.on_report("idle", load(made_at=NOW - 0.01))
    assert not book.is_fresh("idle", NOW)
    book.on_report("idle", load(made_at=NOW + 0.01))
    assert book.is_fresh("idle", NOW + 0.02)


def test_the_router_remembers_the_prefixes_it_served_past_the_reports_window():
    # A conversation's 4k-token history was served on R1; R1's report no longer names its
    # blocks (documents since filled the report's window). The next turn: the history plus
    # 200 new tokens, with a 0.15 s objective that only a cached history meets.
    book = FleetBook()
    history = list(range(1, 257))  # 256 blocks of 16 tokens
    book.on_sent("R1", hint("turn-1", tokens=4096, slo=5.0, prefix=history), NOW - 1.0)
    # Reports made since: turn-1 is in them (not unreported), its blocks are not.
    book.on_report("R1", load(running=[(8192, None)], step_remaining_s=0.1))
    book.on_report("R2", load())
    turn = hint("turn-2", tokens=4296, slo=0.15, prefix=[*history, 900, 901])
    assert book.prefix_blocks("R1", turn) == 0  # still in flight: not known to be cached
    book.on_completed("R1", "turn-1")
    assert book.prefix_blocks("R1", turn) == 256 and book.prefix_blocks("R2", turn) == 0
    assert book.predict("R1", turn, NOW).ttft_s < 0.15 < book.predict("R2", turn, NOW).ttft_s
    assert flat(book.rank("slack", ["R2", "R1"], turn, NOW))[0] == "R1"
    assert flat(book.rank("prefix", ["R2", "R1"], turn, NOW))[0] == "R1"
    # Never more than the replica's KV pool holds (its report's num_blocks: 1000), the
    # least recently served forgotten first.
    book.on_sent("R1", hint("doc", tokens=16_000, slo=None, prefix=range(5000, 6000)), NOW)
    book.on_completed("R1", "doc")
    served = book.replicas["R1"].served_prefixes
    assert len(served) == 1000 and 1 not in served and 5999 in served


def test_prefix_affinity_breaks_ties_between_replicas_that_meet_the_deadline():
    # R1 holds the prompt's first 64 blocks, behind a 0.2 s step: 0.2 + 0.033 s. R2 is idle
    # without them: 0.074 s. Both meet 1 s: the cache wins.
    book = FleetBook()
    book.on_report("R1", load(cached=range(1, 65), running=[(5000, None)],
                              step_remaining_s=0.2))
    book.on_report("R2", load())
    h = hint(tokens=1100, slo=1.0, prefix=range(1, 69))
    assert flat(book.rank("slack", ["R2", "R1"], h, NOW)) == ["R1", "R2"]
    assert flat(book.rank("prefix", ["R2", "R1"], h, NOW)) == ["R1", "R2"]
    # A tight objective only R2 meets: misses come before affinity.
    tight = hint(tokens=1100, slo=0.1, prefix=range(1, 69))
    assert flat(book.rank("slack", ["R1", "R2"], tight, NOW)) == ["R2", "R1"]


def test_a_shared_first_block_does_not_pull_a_flood_of_documents_to_one_replica():
    """A chat template's system prompt gives every prompt the same first block: a document
    of 8k tokens behind it is sent where the wait is least, not where that one block is. The
    probe: the same documents, sharing half their blocks, do follow the cache."""
    def spread(shared_blocks: int) -> list[str]:
        book = FleetBook(seed=0)
        for rid in ("R1", "R2", "R3"):
            book.on_report(rid, load())
        chosen = []
        for i in range(6):
            doc = hint(f"doc{i}", tokens=8192, slo=15.0,
                       prefix=[*range(shared_blocks), *range(1000 * (i + 1),
                                                         1000 * (i + 1) + 512 - shared_blocks)])
            best = flat(book.rank("slack", ["R1", "R2", "R3"], doc, NOW))[0]
            book.on_sent(best, doc, NOW)
            chosen.append(best)
        return chosen

    assert sorted(set(spread(shared_blocks=1))) == ["R1", "R2", "R3"]
    assert len(set(spread(shared_blocks=256))) == 1


def test_a_replica_at_its_queue_bound_ranks_after_those_with_room():
    """Its report's requests plus those sent since reach its --max-num-queued-reqs, or it
    refused one at the bound since its last report: every policy sends elsewhere first."""
    import msgspec

    def bounded(report, bound):
        return msgspec.structs.replace(report, max_queued_requests=bound)

    book = FleetBook(seed=0)
    book.on_report("idle", bounded(load(), 2))
    book.on_report("open", load(waiting=[(100, None)] * 6))  # no bound: never full
    book.on_report("full", bounded(load(running=[(100, None)], num_decoding=1), 2))
    assert not book.has_room("full") and book.has_room("idle") and book.has_room("open")
    for policy in ROUTER_POLICIES:
        for _ in range(3):
            assert flat(book.rank(policy, ["full", "idle", "open"], hint(), NOW))[-1] == "full"
    # Requests sent since the report count toward the bound.
    book.on_sent("idle", hint("a", slo=None), NOW)
    book.on_sent("idle", hint("b", slo=None), NOW)
    assert not book.has_room("idle")
    # A 429 at the bound marks a replica full until a report made after it.
    book.on_report("spare", load())
    book.on_full("spare", NOW)
    assert not book.has_room("spare")
    book.on_report("spare", load(made_at=NOW - 0.01))  # made before the 429: still full
    assert not book.has_room("spare")
    book.on_report("spare", load(made_at=NOW + 0.1))
    assert book.has_room("spare")


def test_prefix_policy_ties_go_to_the_shorter_queue():
    book = FleetBook()
    book.on_report("R1", load(waiting=[(10, None)] * 3))
    book.on_report("R2", load(waiting=[(10, None)]))
    assert flat(book.rank("prefix", ["R1", "R2"], hint(prefix=[7]), NOW)) == ["R2", "R1"]


def test_no_deadline_request_under_slack_is_power_of_two_on_load():
    book = FleetBook(seed=1)
    book.on_report("idle", load())
    book.on_report("busy", load(waiting=[(100, None)] * 5))
    for _ in range(20):
        assert flat(book.rank("slack", ["busy", "idle"], hint(slo=None), NOW))[0] == "idle"


def test_pow2_prefers_fewer_in_flight_of_its_two_and_is_seedable():
    def picks(seed: int) -> list[str]:
        book = FleetBook(seed=seed)
        ids = [f"r{i}" for i in range(8)]
        for i, rid in enumerate(ids):
            for j in range(i):
                book.on_sent(rid, hint(f"{rid}-{j}"), NOW)
        out = []
        for _ in range(20):
            ranked = flat(book.rank("pow2", ids, hint(), NOW))
            assert book.in_flight(ranked[0]) <= book.in_flight(ranked[1])
            out.append(ranked[0])
        return out

    assert picks(3) == picks(3)
    assert picks(3) != picks(4)


def test_round_robin_rotates():
    book = FleetBook()
    firsts = [flat(book.rank("round-robin", ["b", "a", "c"], hint(), NOW))[0] for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]


def test_unknown_policy_and_empty_candidates():
    book = FleetBook()
    assert book.rank("slack", [], hint(), NOW) == []
    with pytest.raises(ValueError):
        book.rank("fastest", ["a"], hint(), NOW)  # type: ignore[arg-type]


replica_load = st.builds(
    lambda waiting, step, preemptible, age: load(
        made_at=NOW - age, waiting=waiting, step_remaining_s=step,
        running=[(4000, None)] if step else [], step_preemptible=preemptible),
    waiting=st.lists(st.tuples(st.integers(1, 20_000),
                               st.one_of(st.none(), st.floats(-1, 3))), max_size=6),
    step=st.floats(0, 1.5), preemptible=st.booleans(), age=st.floats(0, 1))


@settings(max_examples=150, deadline=None, database=None)
@given(policy=st.sampled_from(ROUTER_POLICIES),
       loads=st.dictionaries(st.sampled_from("abcdefgh"), st.one_of(st.none(), replica_load),
                             min_size=1),
       extra=st.lists(st.sampled_from("abcdefghij"), max_size=3),
       slo=st.one_of(st.none(), st.floats(0.01, 2)), seed=st.integers(0, 10))
def test_ranks_hold_every_candidate_exactly_once(policy, loads, extra, slo, seed):
    book = FleetBook(seed=seed)
    for rid, lo in loads.items():
        if lo is not None:
            book.on_report(rid, lo)
    candidates = list(loads) + extra
    ranks = book.rank(policy, candidates, hint(slo=slo), NOW)
    got = [rid for rank in ranks for rid in rank]
    assert sorted(got) == sorted(set(candidates))


def test_routing_cost_benchmark_runs(capsys):
    from engine.benchmarks.fleet.routing_cost import build_parser, main

    assert build_parser().parse_args([]).replicas == 8
    assert main(["--replicas", "3", "--queued", "4", "--prefix-hashes", "64",
                 "--decisions", "5"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in (*ROUTER_POLICIES, "slack+admission"))


def test_a_deep_queue_of_documents_with_time_to_spare_does_not_repel_an_urgent_turn():
    # Both replicas stop a document's prefill for the turn; A holds 30 more documents due in
    # 20 s, B 3, and A's model is 5 ms faster. The turn delays each document by its own 0.04 s,
    # which none of them minds: A, by its first token. Counting each document (as the
    # tie-break once did) would add 30 delays on A against 3 on B and send every turn to B.
    book = FleetBook(seed=0)
    faster = MODEL.__class__(seconds_per_token=4e-5, intercept_s=0.025, relative_error=0.1,
                             relative_speedup=0.1)
    running = [(30_000, 25.0)]
    book.on_report("A", load(running=running, step_remaining_s=1.0, step_preemptible=True,
                             waiting=[(24_000, 20.0)] * 30, model=faster))
    book.on_report("B", load(running=running, step_remaining_s=1.0, step_preemptible=True,
                             waiting=[(24_000, 20.0)] * 3))
    turn = hint("turn", tokens=256, slo=0.3)
    on_a = book.predict("A", turn, NOW)
    assert on_a is not None and on_a.preempts
    # Probe: the documents behind it count as one delay, not 31.
    assert on_a.delay_to_others_s == pytest.approx(on_a.prefill_s)
    assert flat(book.rank("slack", ["A", "B"], turn, NOW))[0] == "A"
    # Turns due soon behind it still count one by one: a burst queued on A sends the next to B.
    for i in range(3):
        book.on_sent("A", hint(f"queued{i}", tokens=256, slo=0.5), NOW)
    assert flat(book.rank("slack", ["A", "B"], turn, NOW))[0] == "B"
