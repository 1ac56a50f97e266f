"""The engine at GPU time scales, in the GPU-timed simulation (engine/simulation): the real
EngineCore, scheduler, monitor thread, signal, vote and unwind over the h100-llama-3.1-8b
profile (a 24k-token step ~1.2 s, 32 layers of ~37 ms), with urgent 150 ms turns arriving during
long documents' prefills. The engine is configured as a user would leave it: no TTFT model
file, mid-forward preemption in suspend mode."""

from __future__ import annotations

import pytest

from engine.core.scheduler_output import StepStatus
from tests.utils.gpu_timed import URGENT, URGENT_SLO_MS, StepLog, _burst, _engine, _replay

# Alone (the README's serial run): the simulated steps are real sleeps, checked against
# deadlines.
pytestmark = pytest.mark.serial

@pytest.mark.parametrize("budget", [2048, 40_000], ids=["chunked", "unchunked"])
def test_every_urgent_turn_during_a_long_prefill_gets_a_decision_and_a_step_of_its_own(
        sim_model, budget):
    engine = _engine(sim_model, budget)
    log = StepLog()
    log.wrap(engine)
    try:
        arrivals = _burst()
        requests = {r.request_id: r for _, r in arrivals}
        _replay(engine, arrivals)
        decisions = list(engine.slo_preemption.monitor.decisions)
        profile = engine.model.profile
        for _, rid, _ in URGENT:
            turn = requests[rid]
            # The step running when it arrived, if it had more than the SLO left to run.
            running = [s for s in log.steps if s[2] <= turn.arrival_time < s[3]
                       and s[3] - turn.arrival_time > URGENT_SLO_MS / 1000]
            if running:
                # Decided while that step ran (within one poll, give or take a loaded machine:
                # the step had at least the SLO left), and the step was unwound.
                out, status, _, end = running[0]
                mine = [d for d in decisions if d.decision.waiter_id == rid]
                assert mine and mine[0].step_id == out.step_id, (
                    rid, [(d.step_id, d.decision) for d in decisions])
                assert mine[0].decided_at < end and status is StepStatus.SLO_PREEMPTED
            # The step that gave it its first token resumed no kept chunk, and anything else
            # in it fits the time the turn had left (by the machine's own step times).
            out, _, started, _ = next(s for s in log.steps if s[1] is StepStatus.OK
                                      and any(r.req_id == rid and r.sample for r in s[0].requests))
            assert not [r.req_id for r in out.requests if r.resume], rid
            others = [r.req_id for r in out.requests if r.req_id != rid and len(r.token_ids) > 1]
            seconds = profile.step_seconds(out.num_scheduled_tokens, out.attention_work,
                                           out.decode_context)
            assert not others or seconds <= turn.deadline - started, (rid, others, seconds)
            assert turn.first_token_time is not None
    finally:
        engine.shutdown()


def test_outputs_are_the_same_whatever_the_preemptions(sim_model):
    """Greedy outputs of the simulated model are a function of the tokens alone: equal with and
    without mid-forward preemption. Probe: the default engine really unwound steps."""
    outputs = {}
    for mid_forward in (True, False):
        engine = _engine(sim_model, 40_000, slo_preemption=mid_forward)
        try:
            arrivals = _burst()
            _replay(engine, arrivals)
            outputs[mid_forward] = {r.request_id: list(r.output_token_ids) for _, r in arrivals}
            if mid_forward:
                assert engine.slo_preemption.events, "no step was unwound"
        finally:
            engine.shutdown()
    assert outputs[True] == outputs[False]
    assert all(len(tokens) == 8 for tokens in outputs[True].values())
