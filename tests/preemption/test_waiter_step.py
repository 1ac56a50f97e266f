"""The step that serves an urgent waiter is its own, at GPU time scales: the
predictor below is the H100 / Llama-3.1-8B step model (monitor/predictor.py terms).

- Every chunk the rollback kept waits until the waiter's first token is out, even one short
  enough to fit the waiter's deadline; a waiter that is late anyway is made as little late as
  possible (nothing joins it). Before: only the victim was held, and a waiter deemed doomed
  capped nothing, so the other documents' suspended chunks resumed beside it (a 33k-token,
  1.6 s step for a 68-token turn).
- The cap charges the chunks that join the urgent one their attention over their prefix. Before:
  the step was priced as one fresh prompt, and a 2048-token chunk over a 26k-token prefix
  (~0.18 s) joined a turn with 150 ms to go.
"""

from __future__ import annotations

import time

import pytest

from engine.config import CacheConfig, SLOPreemptionConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.runtime.slo_preemption import unwind_step
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import (BS, FakeRunner, frozen_clock,  # noqa: F401
                                    make_request, scheduled, step)

H100_LINE = StepTimeModel(seconds_per_token=3e-5, intercept_s=0.03, seconds_per_token_sq=8.3e-10)


# The scheduler's clock stands still here (the steps take no time, as at GPU time scales
# against these objectives): on the wall clock a busy host's milliseconds between two schedule()
# calls ate a turn's 150 ms objective or its inter-token gap, and kept chunks resumed not at all
# instead of in pieces.
pytestmark = pytest.mark.usefixtures("frozen_clock")


def _scheduler(budget: int, num_blocks: int) -> Scheduler:
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, policy="slo")
    cc = CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=False)
    sched = Scheduler(sc, cc, num_blocks, num_blocks * BS, SLOPreemptionConfig(mode="suspend"))
    sched.step_time_predictor.current = H100_LINE
    return sched


def _request(req_id: str, tokens: int, slo_ms: float):
    request = make_request(req_id, tokens, max_tokens=4, arrival=time.monotonic())
    request.ttft_slo_ms = slo_ms
    return request


@pytest.mark.parametrize("waiter_slo_ms", [150.0, 20.0], ids=["rescuable", "late-anyway"])
def test_chunks_kept_from_the_unwound_step_wait_for_the_waiters_first_token(waiter_slo_ms):
    sched = _scheduler(budget=40_000, num_blocks=12_000)
    runner = FakeRunner(sched)
    sched.add_request(_request("A", 24_000, 60_000))
    # A short document: alone, its chunk would fit within the waiter's deadline.
    sched.add_request(_request("C", 600, 60_000))
    stopped = sched.schedule()
    assert scheduled(stopped) == {"A": 24_000, "C": 600}
    sched.add_request(_request("W", 128, waiter_slo_ms))
    runner.receive(stopped)  # the workers ran the step until the vote stopped it
    applied, kept_tokens = unwind_step(sched, stopped, ["A", "C"], target=stopped.step_id,
                                       victim_id="A", waiter_id="W", stopped_layer=9)
    # Probe: the step really was unwound, both chunks kept at the stopped layer.
    assert applied == "suspend" and kept_tokens == 24_600
    suspended = sched.slack.suspensions.suspended
    assert {k: c[0].layer for k, c in suspended.items()} == {"A": 9, "C": 9}
    sched.check_invariants()

    serving, _ = step(sched, runner)
    assert scheduled(serving) == {"W": 128}  # the waiter's step is its own
    assert sched.get_request("W").first_token_time is not None
    resumed, _ = step(sched, runner)
    # Its first token is out: the kept chunks resume at their layer, but only in pieces that
    # keep the turn streaming: its next token within two decode-only steps. Before:
    # the whole 24,600 tokens resumed beside its decode, a 1.2 s gap.
    served = scheduled(resumed)
    assert served["W"] == 1 and 0 < served["A"] < 24_000 and "C" not in served
    assert all(r.resume for r in resumed.requests if r.req_id in ("A", "C"))
    decode_step = H100_LINE.predict(1, 128)
    assert H100_LINE.predict_step(resumed.num_scheduled_tokens, resumed.attention_work,
                                  resumed.decode_context) <= 2 * decode_step
    while sched.get_request("W") is not None:
        step(sched, runner)
    # The turn is done: the rest of A resumes at once, whole, with C.
    done = sched.get_request("A").num_computed_tokens
    assert 0 < done < 24_000  # probe: A advanced in pieces while the turn streamed
    rest, _ = step(sched, runner)
    assert scheduled(rest) == {"A": 24_000 - done, "C": 600}


def test_chunks_joining_an_urgent_turn_are_charged_their_attention_over_the_prefix():
    sched = _scheduler(budget=2048, num_blocks=8_000)
    runner = FakeRunner(sched)
    sched.add_request(_request("R", 30_000, 600_000))
    while sched.get_request("R").num_computed_tokens < 26_000:
        step(sched, runner)
    prefix = sched.get_request("R").num_computed_tokens
    sched.add_request(_request("W", 128, 150.0))
    out = sched.schedule()
    served = scheduled(out)
    assert list(served)[0] == "W" and served["W"] == 128
    # Probe: the document still gets a chunk (the cap limits it, it does not stop it) ...
    assert 0 < served.get("R", 0) < 2048 - 128
    assert [r.start_pos for r in out.requests if r.req_id == "R"] == [prefix]
    # ... and the step as a whole is predicted, with its real attention, within the share of
    # the waiter's 150 ms that a cap may fill (DEADLINE_HEADROOM: 75%).
    predicted = H100_LINE.predict_step(out.num_scheduled_tokens, out.attention_work,
                                       out.decode_context)
    assert predicted <= 0.75 * 0.150


def test_a_turn_late_anyway_is_served_alone():
    """The turn a preemption was made for goes first even once it cannot make its deadline any
    more, and nothing joins it, not even a short document that would otherwise share the
    budget. Before: a deadline the turn's chunk alone would miss capped nothing. Probe: with a
    deadline it can make, the same document joins it."""
    for slo_ms, expected in [(20.0, {"W": 128}), (400.0, {"W": 128, "D": 1500})]:
        sched = _scheduler(budget=4096, num_blocks=2_000)
        runner = FakeRunner(sched)
        sched.add_request(_request("R", 6_000, 600_000))
        step(sched, runner)
        stopped = sched.schedule()
        sched.add_request(_request("W", 128, slo_ms))
        sched.add_request(_request("D", 1500, 600_000))
        runner.receive(stopped)
        applied, _ = unwind_step(sched, stopped, ["R"], target=stopped.step_id, victim_id="R",
                                 waiter_id="W", stopped_layer=3)
        assert applied == "suspend"  # probe: the preemption was made for W
        assert scheduled(sched.schedule()) == expected, slo_ms


def test_a_turn_admitted_beside_a_document_is_not_held_to_its_whole_prefill():
    """A turn and a 26k-token document arrive together while nothing runs (so no preemption and
    no outranking admission can help): the turn is admitted first and the document joins with
    the chunk that keeps the step within the turn's deadline. Before: the document's whole
    prompt shared the step and the turn waited ~1.4 s of simulated H100 time for 150 ms.
    Probe: without a deadline on the turn, the document is admitted whole."""
    for slo_ms in (150.0, None):
        sched = _scheduler(budget=40_000, num_blocks=8_000)
        sched.add_request(_request("D", 26_000, 600_000))
        turn = _request("W", 128, 150.0)
        turn.ttft_slo_ms = slo_ms
        sched.add_request(turn)
        out = sched.schedule()
        served = scheduled(out)
        if slo_ms is None:
            assert served == {"D": 26_000, "W": 128}
            continue
        assert list(served) == ["W", "D"] and 0 < served["D"] < 26_000
        predicted = H100_LINE.predict_step(out.num_scheduled_tokens, out.attention_work,
                                           out.decode_context)
        assert predicted <= 0.75 * slo_ms / 1000


def test_a_waiter_keeps_its_protection_until_its_client_has_output():
    """The deadline is met when the client sees the first output, not when a token
    is sampled. A waiter whose first token shows nothing (a special token) keeps the victim
    and the kept chunks held, and its next tokens come from steps of its own, until its
    consumer reports the first visible output; then they resume. Before: the hold ended with
    the first sampled token, and the victim's whole suspended chunk resumed beside the
    waiter's next (its first visible) token."""
    sched = _scheduler(budget=40_000, num_blocks=12_000)
    runner = FakeRunner(sched)
    sched.add_request(_request("A", 24_000, 60_000))
    stopped = sched.schedule()
    waiter = _request("W", 128, 150.0)
    waiter.sampling_params.max_tokens = 8
    waiter.reports_first_output = True
    sched.add_request(waiter)
    runner.receive(stopped)
    applied, _ = unwind_step(sched, stopped, ["A"], target=stopped.step_id, victim_id="A",
                             waiter_id="W", stopped_layer=9)
    assert applied == "suspend"  # probe: the preemption was made for W
    serving, _ = step(sched, runner)
    assert scheduled(serving) == {"W": 128} and waiter.first_token_time is not None
    # Sampled, not seen: the waiter's deadline is live, the victim stays held.
    assert waiter.awaiting_first_output and waiter.live_deadline is not None
    for _ in range(2):
        alone, _ = step(sched, runner)
        assert scheduled(alone) == {"W": 1}
    assert sched.slack.holds.is_held("A")
    waiter.first_output_time = time.monotonic()  # as EngineCore.note_first_output sets it
    resumed, _ = step(sched, runner)
    assert not sched.slack.holds.is_held("A")
    assert scheduled(resumed)["W"] == 1 and scheduled(resumed).get("A", 0) > 0


def test_a_turn_late_anyway_keeps_the_running_decodes_beside_it():
    """Nothing joins a turn that is late anyway, except the running decodes where they cost
    the step little: a few decodes add 0.1 ms to a 30 ms step, and without them every stream
    stalls a whole step. Probe: the document's chunk still does not join."""
    sched = _scheduler(budget=2048, num_blocks=2_000)
    runner = FakeRunner(sched)
    sched.add_request(_request("D", 200, 600_000))
    sched.add_request(_request("R", 7_000, 600_000))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert scheduled(out).get("D") == 1 and scheduled(out).get("R", 0) > 1  # probe: D decodes
    sched.add_request(_request("W", 128, 20.0))  # 20 ms: late whatever the step holds
    out = sched.schedule()
    assert scheduled(out) == {"W": 128, "D": 1}


def test_an_interactive_pace_yields_to_a_deadline_it_would_cost():
    """A turn served for its deadline streams within two decode steps, so a running document
    gets only the piece that fits beside its next token; but not where that pace, for the
    turn's tokens left, would make the document miss a deadline it meets at full speed (judged
    with the caps' margins). Probe: with its deadline far off, the document gets the piece."""
    sched = _scheduler(budget=2048, num_blocks=2_000)
    runner = FakeRunner(sched)
    document = _request("D", 7_000, 600_000)
    sched.add_request(document)
    step(sched, runner)
    turn = _request("W", 128, 150.0)
    turn.sampling_params.max_tokens = 64
    sched.add_request(turn)
    out, _ = step(sched, runner)
    assert scheduled(out)["W"] == 128 and turn.served_urgently  # admitted ahead: interactive
    paced = scheduled(sched.schedule())
    assert paced["W"] == 1 and 0 < paced.get("D", 0) < 1024
    sched.rollback(sched.last_step_record)
    # Its deadline now close: 2048-token chunks still make it, the turn's pace would not.
    document.ttft_slo_ms = (time.monotonic() + 0.5 - document.arrival_time) * 1000
    full = scheduled(sched.schedule())
    assert full["W"] == 1 and full["D"] == 2047


def test_a_tight_turn_admitted_in_order_gets_no_document_beside_it():
    """A turn admitted in queue order (nothing running to jump over) whose own chunk can still
    make its deadline, but whose step already fills the share of its time a cap may fill
    (DEADLINE_HEADROOM), gets nothing beside it. Before: such a turn counted as late whatever
    joined it, and a whole document joined its step (on this CPU a 53-token turn with 150 ms
    left waited 1.8 s for a 1355-token document). Probe: with room to spare, the document
    joins with the chunk that fits."""
    for slo_ms, document_joins in [(40.0, False), (400.0, True)]:
        sched = _scheduler(budget=4096, num_blocks=2_000)
        sched.add_request(_request("W", 128, slo_ms))
        sched.add_request(_request("D", 3_000, 600_000))
        served = scheduled(sched.schedule())
        assert served["W"] == 128
        assert ("D" in served) is document_joins, (slo_ms, served)
