"""The scheduler driven by hand, without a model (test helper).

A fake runner stands in for the model: it writes each scheduled token into a simulated paged KV
cache at the slots the block table names, and "samples" a deterministic function of the history
it reads back through the block table, so that any wrong block id, stale block or bad
prefix-cache hit changes the output, which is compared with a straight-line reference generation
(`reference_output`). Beside it: scheduler and request constructors (the `slo` policy's
included), and `FakeScheduler`, a stand-in for the slack policy's `SchedulerOps`."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import FCFSQueue, RequestQueue
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from engine.core.step_record import StepInProgress, StepRecord
from workers.block_tables import BlockTables
from engine.sampling_params import SamplingParams
from monitor.step_time_model import StepTimeModel


BS = 4
VOCAB = 50


class FrozenClock:
    """time.monotonic() as the scheduler's modules read it, standing still (a test may set
    `now`): a scheduling test whose decisions weigh deadlines and inter-token gaps
    against the clock then decides the same on a busy machine as on an idle one, where the
    wall clock would let a loaded host's milliseconds between two schedule() calls eat a
    150 ms objective."""

    MODULES = ("engine.core.admission", "engine.core.deadline_caps",
               "engine.core.preemption_holds", "engine.core.request", "engine.core.scheduler",
               "engine.core.slack_policy", "engine.runtime.slo_preemption", __name__)

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def install(self, monkeypatch, *test_modules: str) -> FrozenClock:
        """Each module's `time` (the scheduler's, these helpers', and `test_modules`: the
        calling test's, by name) becomes this clock for monotonic() and the real module for
        everything else, until the test ends."""
        import importlib

        clock = self

        class _Time:
            def __getattr__(self, name: str):
                return clock.monotonic if name == "monotonic" else getattr(time, name)

        for name in (*self.MODULES, *test_modules):
            monkeypatch.setattr(importlib.import_module(name), "time", _Time())
        return self


@pytest.fixture
def frozen_clock(monkeypatch, request) -> FrozenClock:
    """FrozenClock installed for one test: in the scheduler's modules, and in the test's own
    module where that reads `time` too. A scheduling test module that weighs deadlines or
    inter-token gaps uses it for all its tests: `pytestmark =
    pytest.mark.usefixtures("frozen_clock")`, with the fixture imported."""
    own = (request.module.__name__,) if getattr(request.module, "time", None) is time else ()
    return FrozenClock().install(monkeypatch, *own)


def next_token(history: list[int]) -> int:
    h = 0
    for t in history:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % VOCAB


def reference_output(
    prompt: list[int], params: SamplingParams, eos: int | None, max_model_len: int
) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if (not params.ignore_eos and t == eos) or t in params.stop_token_ids:
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


class FakeRunner:
    """Keeps each request's block table from the updates steps send, as the workers do
    (workers.block_tables.BlockTables), so a wrong update reads or writes a wrong slot."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[tuple[int, int], int] = {}
        self.tables = BlockTables(max_blocks=8)
        # The last step's samples: the input of a decode scheduled ahead (last_token_pending).
        self.last_sampled: dict[str, int] = {}

    def receive(self, out: SchedulerOutput) -> None:
        """What the workers do with a step before its pass (and so also for one the vote then
        unwinds): apply its block table updates."""
        self.tables.release(out.released_req_ids)
        for r in out.requests:
            self.tables.update(r)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        pool = self.sched.kv_cache_manager.pool
        sampled: dict[str, int] = {}
        self.tables.release(out.released_req_ids)
        for r in out.requests:
            assert len(r.token_ids) > 0
            table = self.tables.full_table(r)
            tokens = [self.last_sampled[r.req_id]] if r.last_token_pending else r.token_ids
            for i, tok in enumerate(tokens):
                pos = r.start_pos + i
                block = table[pos // BS]
                slot = (block, pos % BS)
                # A committed block is shared content: nobody may write different tokens into it.
                if pool.blocks[block].block_hash is not None:
                    assert self.kv[slot] == tok, f"overwrote committed block {block}"
                self.kv[slot] = tok
            if r.sample:
                end = r.start_pos + len(r.token_ids)
                history = [self.kv[(table[p // BS], p % BS)] for p in range(end)]
                sampled[r.req_id] = next_token(history)
        if sampled:
            self.last_sampled = sampled
        return ModelRunnerOutput(step_id=out.step_id, sampled_token_ids=sampled)


def make_scheduler(
    num_blocks: int = 64,
    max_model_len: int | None = None,
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    threshold: int = 0,
    chunked: bool = True,
    policy: str = "fcfs",
    full_seq: bool = False,
    watermark: float = 0.0,
    prefix: bool = True,
) -> Scheduler:
    sc = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
        policy=policy,  # type: ignore[arg-type]
        full_sequence_admission=full_seq,
    )
    cc = CacheConfig(block_size=BS, num_blocks=num_blocks, watermark=watermark, enable_prefix_caching=prefix)
    return Scheduler(sc, cc, num_blocks, max_model_len or num_blocks * BS)


def make_request(
    req_id: str,
    prompt: list[int] | int,
    max_tokens: int = 8,
    *,
    priority: int = 0,
    arrival: float | None = None,
    eos: int | None = None,
    **params: object,
) -> Request:
    if isinstance(prompt, int):
        gen = random.Random(req_id)  # str seeds are stable across processes, unlike hash()
        prompt = [gen.randrange(VOCAB) for _ in range(prompt)]
    kwargs: dict[str, object] = {} if arrival is None else {"arrival_time": arrival}
    return Request(
        request_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=eos,
        priority=priority,
        **kwargs,  # type: ignore[arg-type]
    )


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sched.check_invariants()
    finished = sched.update_from_output(out, runner.execute(out))
    sched.check_invariants()
    return out, finished


def run_ahead_to_completion(sched: Scheduler, runner: FakeRunner,
                            max_steps: int = 10_000) -> tuple[dict[str, list[int]], int]:
    """As EngineCore's async scheduling: while the scheduler can schedule ahead, the next step
    is scheduled (and run) before the one in flight is committed. Returns the outputs and the
    number of decodes scheduled ahead."""
    outputs: dict[str, list[int]] = {}
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    ahead = 0

    def commit(flight: tuple[SchedulerOutput, ModelRunnerOutput]) -> None:
        for r in sched.update_from_output(*flight):
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
        sched.check_invariants()

    for _ in range(max_steps):
        if in_flight is not None and not sched.can_schedule_ahead():
            commit(in_flight)
            in_flight = None
        if not sched.has_unfinished_requests():
            return outputs, ahead
        out = sched.schedule()
        sched.check_invariants()
        ahead += sum(r.last_token_pending for r in out.requests)
        ran = (out, runner.execute(out))
        if in_flight is not None:
            commit(in_flight)
        in_flight = ran
    raise AssertionError(f"not finished after {max_steps} steps")


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outputs
        _, reqs = step(sched, runner)
        for r in reqs:
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps")


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {r.req_id: len(r.token_ids) for r in out.requests}


def _slo_scheduler(**kwargs):
    sched = make_scheduler(policy="slo", **kwargs)
    # 1 ms per token: a 100-token prompt needs 0.1 s.
    sched.step_time_predictor.current = StepTimeModel(seconds_per_token=1e-3, intercept_s=0.0)
    return sched


def _request(rid, tokens, slo_ms, **kwargs):
    request = make_request(rid, tokens, arrival=time.monotonic(), **kwargs)
    request.ttft_slo_ms = slo_ms
    return request


@dataclass
class FakeScheduler:
    """Admits whatever it is asked to (unless ``admissible`` is False) and records it."""

    waiting: RequestQueue = field(default_factory=FCFSQueue)
    running: list[Request] = field(default_factory=list)
    admissible: bool = True
    admitted: list[str] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)

    def get_request(self, req_id: str) -> Request | None:
        return next((r for r in (*self.running, *self.waiting) if r.request_id == req_id), None)

    def can_admit(self, request: Request) -> bool:
        return self.admissible

    def admit(self, request: Request, step: StepInProgress,
              budget: int | None = None) -> int | None:
        if not self.admissible:
            return None
        num_new = min(request.num_tokens_owed, step.budget if budget is None else budget)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new)
        self.admitted.append(request.request_id)
        return num_new

    def requeue_for_recompute(self, request: Request) -> None:
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.prepend(request)
        self.requeued.append(request.request_id)


def _step(budget: int = 64) -> StepInProgress:
    return StepInProgress(StepRecord(step_id=1, prev_scheduled_req_ids=frozenset()), budget)
