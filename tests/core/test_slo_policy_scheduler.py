"""The `slo` scheduling policy: slack-EDF order for admissions, the running budget and the
KV-pressure victim ("step-level EDF", without mid-forward preemption)."""

from __future__ import annotations

import pytest

from tests.utils.scheduling import (FakeRunner, frozen_clock,  # noqa: F401
                                    run_to_completion, _slo_scheduler, _request)

# The scheduler's clock stands still: deadlines and a streaming turn's inter-token gaps (a few
# ms here) are weighed the same on a loaded host, where the wall clock's milliseconds between
# two schedule() calls once made a gap look missed and let the long prefill in.
pytestmark = pytest.mark.usefixtures("frozen_clock")


def test_admission_order_is_slack_edf():
    sched = _slo_scheduler(num_blocks=400, budget=1000, max_num_seqs=1)
    sched.add_request(_request("relaxed", 100, 10_000))
    sched.add_request(_request("doomed", 500, 100))  # needs 0.5 s, has 0.1 s
    sched.add_request(_request("best-effort", 100, None))
    sched.add_request(_request("urgent", 100, 400))
    # The doomed one goes ahead of every request whose slack covers its prefill (relaxed: 10 s
    # of slack for its 0.5 s), behind the ones whose slack does not (urgent: 0.3 s), and
    # ahead of those without a deadline (late as little as possible).
    assert [r.request_id for r in sched.waiting] == ["urgent", "doomed", "relaxed",
                                                     "best-effort"]
    out = sched.schedule()
    assert [r.req_id for r in out.requests] == ["urgent"]


def test_running_requests_get_the_budget_in_urgency_order():
    sched = _slo_scheduler(num_blocks=400, budget=100, max_num_seqs=4)
    runner = FakeRunner(sched)
    sched.add_request(_request("relaxed", 300, 60_000))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(_request("urgent", 300, 2_000))
    for _ in range(10):  # until both run, both mid-prefill
        if len(sched.running) == 2:
            break
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert len(sched.running) == 2
    assert all(r.num_tokens_owed == 200 for r in sched.running)
    out = sched.schedule()
    # fcfs would serve relaxed's chunk first; slack-EDF gives urgent the whole budget.
    assert [r.req_id for r in out.requests] == ["urgent"]


def test_a_prefill_with_a_deadline_does_not_starve_the_decodes():
    """A request past its first token has no deadline left (priority 0), a relaxed prefill
    still has one: the decode is served first in every step that the prefill's chunks fill."""
    sched = _slo_scheduler(num_blocks=400, budget=64, max_num_seqs=4)
    runner = FakeRunner(sched)
    sched.add_request(_request("chat", 20, 500, max_tokens=30, ignore_eos=True))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(_request("relaxed", 1000, 600_000))
    steps_with_decode = []
    for _ in range(10):
        out = sched.schedule()
        scheduled = {r.req_id: len(r.token_ids) for r in out.requests}
        sched.update_from_output(out, runner.execute(out))
        # Probe: the prefill really fills the budget, so its rank decides the decode's fate.
        assert scheduled.get("relaxed", 0) + scheduled.get("chat", 0) == 64
        steps_with_decode.append(scheduled.get("chat") == 1)
    assert all(steps_with_decode)


def test_kv_pressure_victim_is_the_least_urgent():
    sched = _slo_scheduler(num_blocks=12, budget=64, max_num_seqs=4)
    runner = FakeRunner(sched)
    sched.add_request(_request("urgent", 14, 800, max_tokens=12, ignore_eos=True))
    sched.add_request(_request("relaxed", 14, 90_000, max_tokens=12, ignore_eos=True))
    sched.add_request(_request("mid", 14, 5_000, max_tokens=12, ignore_eos=True))
    victims = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        victims += [r.request_id for r in sched.last_step_record.kv_preempted]
        sched.update_from_output(out, runner.execute(out))
    assert victims, "probe: the pool forced a KV preemption"
    assert "urgent" not in victims
    assert victims[0] == "relaxed"


def test_slo_policy_outputs_equal_the_reference():
    sched = _slo_scheduler(num_blocks=30, budget=16)
    runner = FakeRunner(sched)
    requests = [_request(f"r{i}", 5 + 7 * i, [300, None, 50, 5000][i % 4], max_tokens=6,
                         ignore_eos=True) for i in range(8)]
    for r in requests:
        sched.add_request(r)
    from tests.utils.scheduling import reference_output

    expected = {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params, None,
                                               sched.max_model_len) for r in requests}
    assert run_to_completion(sched, runner) == expected
    assert sched.kv_cache_manager.num_free_blocks == 30


def _long_prefill_running():
    """A scheduler whose first step ran a 2000-token prompt's first 400-token chunk: the
    scheduler, its runner and that step."""
    sched = _slo_scheduler(num_blocks=1200, budget=1000, max_num_seqs=4, threshold=400,
                           max_model_len=4096)
    runner = FakeRunner(sched)
    sched.add_request(_request("long", 2000, 60_000))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    return sched, runner, out


def test_urgent_waiter_jumps_the_running_prefill_and_caps_the_step():
    """A long prefill is running in chunks; an urgent request arrives. The next step admits the
    urgent request before the running prefill, and lets the running one add only as many tokens
    as keep the predicted step time (1 ms per token) within the urgent deadline."""
    sched, runner, out = _long_prefill_running()
    assert [(r.req_id, len(r.token_ids)) for r in out.requests] == [("long", 400)]
    sched.add_request(_request("urgent", 100, 300))  # 300 ms: room for about 300 tokens
    out = sched.schedule()
    chunks = [(r.req_id, len(r.token_ids)) for r in out.requests]
    assert chunks[0] == ("urgent", 100)
    assert chunks[1][0] == "long" and 100 < chunks[1][1] + 100 <= 300
    # Probe: without the deadline, the running prefill takes its full 400-token chunk. (Once
    # the urgent request has its first token it streams as an interactive turn, whose gaps of
    # two 1 ms decode steps leave the long prefill nothing until it finishes: on the frozen
    # clock no gap is ever missed, where a missed one would protect nothing: cap_for_tpot.)
    sched.update_from_output(out, runner.execute(out))
    while sched.get_request("urgent") is not None:
        out = sched.schedule()
        assert "long" not in {r.req_id for r in out.requests}
        sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert {r.req_id: len(r.token_ids) for r in out.requests}["long"] == 400


def test_each_outranking_admission_keeps_the_earlier_ones_in_time():
    """Two waiters outrank the running prefill: the urgent one (300 ms) and a relaxed one with a
    nearer deadline than the running request. The relaxed one is admitted second and may take
    only what keeps the urgent one's step within 300 ms; before, it took its whole prompt, the
    step's predicted time passed the urgent deadline, and the cap then saw the urgent request
    as doomed and let the running prefill take the rest of the budget too."""
    sched = _slo_scheduler(num_blocks=4000, budget=4000, max_num_seqs=4, max_model_len=8192)
    runner = FakeRunner(sched)
    sched.add_request(_request("long", 6000, 600_000))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(_request("urgent", 100, 300))
    sched.add_request(_request("relaxed", 1500, 20_000))
    out = sched.schedule()
    chunks = {r.req_id: len(r.token_ids) for r in out.requests}
    assert list(chunks)[:2] == ["urgent", "relaxed"]
    assert chunks["urgent"] == 100
    assert sum(chunks.values()) <= 300  # the step's predicted time fits the urgent deadline
    assert "long" not in chunks
