"""Late as little as possible, as read back from a busy server's step log (the DEBUG step log,
engine/runtime/step_log.py): a doomed request borrows only the slack a relaxed one can lend,
waits neither for the decodes of turns served before it nor behind a joiner that could have
waited. Policy (monitor/policy.py) and scheduler (engine/core/slack_policy.py) level, at 1 ms
per predicted prompt token."""

from __future__ import annotations

import pytest

from monitor.policy import DEADLINE_HEADROOM, RequestView, rank, urgency
from monitor.step_time_model import StepTimeModel
from tests.utils.scheduling import (FakeRunner, _request, _slo_scheduler,
                                    frozen_clock)  # noqa: F401

NOW = 1000.0
PREDICT = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0).predict


# The scheduler's clock stands still: the streaming turns' gaps (a few ms) and the objectives
# are weighed alike on a loaded host (tests/utils/scheduling.FrozenClock).
pytestmark = pytest.mark.usefixtures("frozen_clock")


def _ids(views) -> list[str]:
    return [v.request_id for v in views]


def test_a_relaxed_request_lends_a_doomed_one_only_its_slack_beyond_the_headroom():
    """A document with 1 s left for 0.6 s of prefill has 0.4 s of slack, 0.15 s of it
    lendable (DEADLINE_HEADROOM of its time stays its own). Before, a doomed 0.3 s turn went
    ahead on the 0.4 s; lent to the last millisecond, the document had nothing left for the
    steps around the turn's prefill, was judged doomed itself, and then went behind every later
    turn. A 0.1 s doomed turn still goes first."""
    doc = RequestView("doc", NOW + 1.0, 600, slo_s=30.0)
    assert DEADLINE_HEADROOM == 0.25
    judged = urgency(doc, NOW, PREDICT)
    assert judged.slack == 0.4 and abs(judged.lendable_slack - 0.15) < 1e-9
    long_turn = RequestView("turn", NOW + 0.1, 300, slo_s=0.1)
    assert urgency(long_turn, NOW, PREDICT).doomed
    assert _ids(rank([doc, long_turn], NOW, PREDICT)) == ["doc", "turn"]
    short_turn = RequestView("turn", NOW + 0.05, 100, slo_s=0.05)
    assert urgency(short_turn, NOW, PREDICT).doomed
    assert _ids(rank([doc, short_turn], NOW, PREDICT)) == ["turn", "doc"]


def test_a_late_turns_step_is_not_joined_by_a_prefill_that_can_wait_for_it():
    """A turn and a document prefill in 400-token chunks; the turn falls late (here: its
    arrival set back 2 s) with 200 tokens left. Before, the document's chunk joined the turn's
    step (late whatever joins it: nothing left to protect) and the turn's first token waited
    for 400 more tokens (on the busy server, a 138-token turn's for 1908 of a document's:
    3.3 s); the document, with a minute of slack, now waits for the next step."""
    def started(doc_slo_ms: float):
        sched = _slo_scheduler(num_blocks=1200, budget=1000, max_num_seqs=4, threshold=400,
                               max_model_len=4096)
        runner = FakeRunner(sched)
        sched.add_request(_request("turn", 600, 1_000))
        sched.add_request(_request("doc", 2000, doc_slo_ms))
        out = sched.schedule()
        assert {r.req_id: len(r.token_ids) for r in out.requests} == {"turn": 400, "doc": 400}
        sched.update_from_output(out, runner.execute(out))
        sched.get_request("turn").arrival_time -= 2.0
        return sched, runner

    sched, runner = started(60_000)
    out = sched.schedule()
    assert [(r.req_id, len(r.token_ids)) for r in out.requests] == [("turn", 200)]
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert {r.req_id: len(r.token_ids) for r in out.requests} == {"turn": 1, "doc": 400}
    # Probe: a document that cannot afford the wait (1.6 s of prefill left, about as much
    # time) still joins: its deadline is protected first.
    sched, runner = started(1_700)
    out = sched.schedule()
    assert "doc" in {r.req_id for r in out.requests}


def test_the_interactive_pace_yields_to_a_doomed_turn_it_would_keep_waiting():
    """Two turns stream as interactive turns (each next token within two decode steps, as
    after a mid-forward preemption made for them), which leaves a waiting prompt a token or
    two a step. A third turn, doomed (200 ms of prefill, a 50 ms objective), would wait out
    the two turns' 190-odd tokens left at that pace (on the busy server, two turns of a burst
    waited 1.8 s so); it now joins at once, since the pace would add more to its lateness
    than its prefill stalls the two streams."""
    sched = _slo_scheduler(num_blocks=1200, budget=1000, max_num_seqs=8, threshold=400,
                           max_model_len=4096)
    runner = FakeRunner(sched)
    for name in ("a", "b"):
        sched.add_request(_request(name, 20, 300, max_tokens=200, ignore_eos=True))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    for name in ("a", "b"):
        # As a mid-forward preemption (or an admission ahead of a running prefill) marks the
        # turns it serves: from now on they stream as interactive turns.
        sched.get_request(name).served_urgently = True
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert all(sched.get_request(n).num_output_tokens >= 2 for n in ("a", "b"))
    sched.add_request(_request("late", 200, 50))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.get_request("late").first_token_time is not None
    # Probe: the turns were still streaming (the pace was in force) when it was served.
    assert all(sched.get_request(n) is not None for n in ("a", "b"))
