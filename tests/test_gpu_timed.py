"""The engine at GPU time scales, in the GPU-timed simulation (engine/simulation): the real
EngineCore, scheduler, monitor thread, signal, vote and unwind over the h100-llama-3.1-8b
profile (a 24k-token step ~1.2 s, 32 layers of ~37 ms), with urgent 150 ms turns arriving during
long documents' prefills. The engine is configured as a user would leave it: no TTFT model
file, mid-forward preemption in suspend mode."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest

from engine.benchmarks.arrivals import submit_on_schedule
from engine.config import build_engine_config
from engine.core.request import Request
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, StepStatus
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams

PROFILE = "h100-llama-3.1-8b"
URGENT_SLO_MS = 150.0


@dataclass
class StepLog:
    """Every step the executor ran: its requests, outcome and wall-clock span."""

    steps: list[tuple[SchedulerOutput, StepStatus, float, float]] = field(default_factory=list)

    def wrap(self, engine: EngineCore) -> None:
        execute = engine.executor.execute_model

        def logged(out: SchedulerOutput) -> ModelRunnerOutput:
            started = time.monotonic()
            result = execute(out)
            self.steps.append((out, result.status, started, time.monotonic()))
            return result

        engine.executor.execute_model = logged  # type: ignore[method-assign]


def _engine(model: str, budget: int, **kwargs) -> EngineCore:
    return EngineCore(build_engine_config(model, simulate=PROFILE, max_num_batched_tokens=budget,
                                          max_model_len=40_000, enable_prefix_caching=False,
                                          **kwargs))


def _request(req_id: str, tokens: int, slo_ms: float | None, seed: int) -> Request:
    rng = random.Random(seed)
    return Request(request_id=req_id, prompt_token_ids=[rng.randrange(5, 300)
                                                        for _ in range(tokens)],
                   sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   ttft_slo_ms=slo_ms)


def _replay(engine: EngineCore, arrivals: list[tuple[float, Request]]) -> None:
    """Submit each request at its offset from a thread (as the HTTP reader does) while the
    engine loop runs, until everything finished."""
    thread = submit_on_schedule(engine, arrivals)
    while thread.is_alive() or engine.has_unfinished_requests():
        if engine.has_unfinished_requests():
            engine.step()
        else:
            time.sleep(0.0005)


# Two documents prefilling (24k and 20k tokens) and three urgent turns arriving during them.
DOCUMENTS = [(0.0, "doc0", 24_000), (0.05, "doc1", 20_000)]
URGENT = [(0.35, "turn0", 64), (0.9, "turn1", 200), (1.6, "turn2", 256)]


def _burst() -> list[tuple[float, Request]]:
    arrivals = [(t, _request(rid, n, 20_000.0, i)) for i, (t, rid, n) in enumerate(DOCUMENTS)]
    arrivals += [(t, _request(rid, n, URGENT_SLO_MS, 10 + i))
                 for i, (t, rid, n) in enumerate(URGENT)]
    return sorted(arrivals, key=lambda a: a[0])


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
        decisions = list(engine.preemption.monitor.decisions)
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
                assert mine[0].decided_at < end and status is StepStatus.PREEMPTED
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
        engine = _engine(sim_model, 40_000, mid_forward_preemption=mid_forward)
        try:
            arrivals = _burst()
            _replay(engine, arrivals)
            outputs[mid_forward] = {r.request_id: list(r.output_token_ids) for _, r in arrivals}
            if mid_forward:
                assert engine.preemption.events, "no step was unwound"
        finally:
            engine.shutdown()
    assert outputs[True] == outputs[False]
    assert all(len(tokens) == 8 for tokens in outputs[True].values())
