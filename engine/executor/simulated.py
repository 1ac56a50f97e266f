"""An executor that runs no model: each step's layers take the time a step-time profile gives.

Everything around it is the real engine: EngineCore's loop, the scheduler, the monitor thread,
the shared-memory signal, and the vote (workers.preemption.slo_preempt_vote.SLOPreemptVote, the
same object the model runner calls before each attention op), which reports each layer's progress to the
monitor and unwinds the pass when the monitor targets the step. So an arrival during a long
simulated prefill is decided, unwound, rolled back and re-admitted exactly as on a GPU, at the
GPU's time scale.

Layer by layer: a preemptible step votes before each layer and then sleeps that layer's share
of the step (only the chunks active in that layer count: a resumed suspended chunk joins at the
layer its pass stopped at). An unwound step keeps its prefill chunks' "activations" as the model
runner does in suspend mode (workers/preemption/suspension.py) and sleeps the profile's unwind time. Other
steps sleep their whole time at once.

The device is a stream (`DeviceStream`): `submit_model` queues a step behind the ones queued
before and returns at once, as a kernel launch does; its handle's `result()` sleeps until the
stream has run it. So async scheduling overlaps the host's work with the simulated device's
exactly as with a GPU's, and the stream's record of when it was busy is what the host
benchmark reads (engine/benchmarks/e2e/host.py). A decode scheduled ahead takes its input token
from the previous step's samples, as the model runner does on the device.

A sampled token is a fixed function of the last token and its position, never a model's: outputs
are the same whatever the scheduling, preemptions and chunking, and no token is an EOS (a
simulated request ends at max_tokens or a stop string, so runs of different policies do the same
work).
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.core.suspension_ledger import SuspendedChunk
from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.structured_output.bitmask import first_allowed_from
from engine.simulation.profile import StepTimeProfile
from workers.preemption.slo_preempt_vote import SLOPreemptVote, StepSLOPreempted, discarded_share


# Step spans the stream keeps (DeviceStream.busy).
BUSY_HISTORY = 16_384


class DeviceStream:
    """The simulated device's queue: each step starts when the one before it ended (or when it
    is queued, if the device was idle), and runs for its profile time. It keeps when it was
    busy and how long the host waited for it."""

    def __init__(self, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self._clock, self._sleep = clock, sleep
        self.free_at = 0.0
        # (start, end) of the latest steps it ran (a layer each, for a step that votes), on
        # `clock`: enough for a benchmark's window, bounded for a server that runs for days.
        # And the host's seconds asleep on it.
        self.busy: deque[tuple[float, float]] = deque(maxlen=BUSY_HISTORY)
        self.waited_s = 0.0

    def queue(self, seconds: float, start: float | None = None) -> tuple[float, float]:
        """A step of `seconds` behind everything queued: when it starts and ends. `start`: at
        that moment instead (the next layer of a step that runs layer by layer starts when the
        one before ended, however late the host woke up to vote)."""
        if start is None:
            start = max(self._clock(), self.free_at)
        self.free_at = start + seconds
        self.busy.append((start, self.free_at))
        return start, self.free_at

    def wait_until(self, moment: float) -> None:
        delay = moment - self._clock()
        if delay > 0:
            started = self._clock()
            self._sleep(delay)
            self.waited_s += self._clock() - started

    def busy_seconds(self, begin: float, end: float) -> float:
        """Seconds within [begin, end] the device ran a step (of the spans it still keeps)."""
        return sum(max(0.0, min(e, end) - max(s, begin)) for s, e in self.busy)


class _QueuedStep:
    """A simulated step's handle: its output is known at submission; it is ready at `ends`."""

    def __init__(self, stream: DeviceStream, ends: float, output: ModelRunnerOutput) -> None:
        self._stream, self._ends, self._output = stream, ends, output

    def result(self) -> ModelRunnerOutput:
        self._stream.wait_until(self._ends)
        return self._output


@dataclass(frozen=True)
class _Chunk:
    """A scheduled request's share of the step's features, and the first layer it runs."""

    tokens: int
    attention: int
    decode_context: int
    join: int


class SimulatedExecutor:
    # The simulated device is a stream (DeviceStream): the host goes on while a step runs.
    overlaps_host = True

    def __init__(self, profile: StepTimeProfile, num_kv_blocks: int, vocab_size: int,
                 avoid_token_ids: Iterable[int] = (), vote: SLOPreemptVote | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.profile = profile
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.avoid_token_ids = frozenset(avoid_token_ids)
        self.vote = vote
        self._sleep, self._clock = sleep, clock
        # req_id -> the segments (start_pos, num_tokens, layer) of its chunks whose stopped pass
        # is "held", in token order (workers/preemption/suspension.py: a chunk may resume in pieces).
        self.suspended: dict[str, list[SuspendedChunk]] = {}
        self.num_steps = 0
        self.stream = DeviceStream(clock, sleep)
        # When the latest step started on the device (its first layer's start).
        self.last_step_start = 0.0
        # What the last step that sampled sampled: the input of a decode scheduled ahead.
        self._last_sampled: dict[str, int] = {}

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.preemptible:
            return self.submit_model(scheduler_output).result()
        self.stream.wait_until(self.stream.free_at)  # behind whatever is queued
        started = self.last_step_start = self._clock()
        chunks = self._begin(scheduler_output)
        if chunks is None:
            return ModelRunnerOutput(step_id=scheduler_output.step_id)
        resumed_layers = _resumed_layers(scheduler_output, chunks)
        vote = self.vote
        try:
            if vote is None:
                self.stream.wait_until(
                    self.stream.queue(self._step_seconds(chunks.values(), 0))[1])
            else:
                vote.step_id = scheduler_output.step_id
                vote.discarded_share = discarded_share(scheduler_output)
                self._run_layers(chunks, vote, started)
        except StepSLOPreempted as stop:
            suspended = self._suspend(scheduler_output, chunks, stop.layer)
            self.stream.wait_until(self.stream.queue(self.profile.unwind_s)[1])
            return ModelRunnerOutput(step_id=scheduler_output.step_id,
                                     status=StepStatus.SLO_PREEMPTED,
                                     slo_preempted_layer=stop.layer,
                                     unwound_layers=[stop.layer], suspended_req_ids=suspended,
                                     resumed_layers=resumed_layers,
                                     execute_seconds=self._clock() - started)
        return self._completed(scheduler_output, resumed_layers, self._clock() - started)

    def submit_model(self, scheduler_output: SchedulerOutput) -> _QueuedStep:
        """A step that cannot be stopped: queued on the stream; its tokens are drawn now (they
        depend on nothing the device computes)."""
        assert not scheduler_output.preemptible, "a preemptible step votes as it runs"
        chunks = self._begin(scheduler_output)
        if chunks is None:
            return _QueuedStep(self.stream, 0.0,
                               ModelRunnerOutput(step_id=scheduler_output.step_id))
        seconds = self._step_seconds(chunks.values(), 0)
        self.last_step_start, ends = self.stream.queue(seconds)
        try:
            output = self._completed(scheduler_output,
                                     _resumed_layers(scheduler_output, chunks), seconds)
        except ValueError:  # as a worker reports a step it could not run
            output = ModelRunnerOutput(step_id=scheduler_output.step_id,
                                       status=StepStatus.ERROR, error=traceback.format_exc())
        return _QueuedStep(self.stream, ends, output)

    def _begin(self, scheduler_output: SchedulerOutput) -> dict[str, _Chunk] | None:
        """Frees what the step says, and the step's chunks (None: nothing to compute)."""
        for req_id in scheduler_output.free_suspended:
            self.suspended.pop(req_id, None)
        if not scheduler_output.requests:
            return None
        self.num_steps += 1
        return {r.req_id: self._chunk(r) for r in scheduler_output.requests}

    def _completed(self, scheduler_output: SchedulerOutput, resumed_layers: dict[str, int],
                   seconds: float) -> ModelRunnerOutput:
        for r in scheduler_output.requests:
            if r.resume:
                segments = self.suspended[r.req_id]
                segments[:1] = segments[0].tail(len(r.token_ids))
                if not segments:
                    del self.suspended[r.req_id]
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        for r in scheduler_output.requests:
            if r.sample:
                token = self._next_token(r)
                if token is None:
                    failed[r.req_id] = ("sampling failed: no token can be chosen: the grammar "
                                        "(structured outputs) allows none")
                else:
                    sampled[r.req_id] = token
        if sampled or failed:
            self._last_sampled = sampled
        return ModelRunnerOutput(step_id=scheduler_output.step_id, sampled_token_ids=sampled,
                                 failed=failed, resumed_layers=resumed_layers,
                                 execute_seconds=seconds)

    def shutdown(self) -> None:
        self.suspended.clear()

    # ---- timing -----------------------------------------------------------------------------

    def _chunk(self, r: ScheduledRequest) -> _Chunk:
        n = len(r.token_ids)
        join = 0
        if r.resume:
            segments = self.suspended.get(r.req_id)
            # As workers/preemption/suspension.py: a resume is of the first tokens of the first segment.
            if not segments or segments[0][0] != r.start_pos or n > segments[0][1]:
                raise ValueError(f"request {r.req_id!r} resumes [{r.start_pos}, +{n}) but the "
                                 f"executor holds {segments}")
            join = segments[0][2]
        if n == 1:
            return _Chunk(1, 0, r.start_pos + 1, join)
        return _Chunk(n, n * (2 * r.start_pos + n), 0, join)

    def _step_seconds(self, chunks: Iterable[_Chunk], layer: int) -> float:
        """Layer `layer`'s time x num_layers: the step as if every layer held the chunks
        active in `layer`."""
        active = [c for c in chunks if c.join <= layer]
        return self.profile.step_seconds(sum(c.tokens for c in active),
                                         sum(c.attention for c in active),
                                         sum(c.decode_context for c in active))

    def _run_layers(self, chunks: dict[str, _Chunk], vote: SLOPreemptVote, started: float) -> None:
        """Vote before each layer (the vote reports the progress the monitor reads, and raises
        StepSLOPreempted when the step is targeted), then sleep the layer. Sleeping to absolute
        times keeps the per-call overhead of sleep from adding up over the layers."""
        num_layers = self.profile.num_layers
        first = min(c.join for c in chunks.values())
        end = started
        for layer in range(first, num_layers):
            vote(layer)
            _, end = self.stream.queue(self._step_seconds(chunks.values(), layer) / num_layers,
                                       start=end)
            self.stream.wait_until(end)

    # ---- unwind and sampling ----------------------------------------------------------------

    def _suspend(self, scheduler_output: SchedulerOutput, chunks: dict[str, _Chunk],
                 layer: int) -> list[str]:
        """What the model runner keeps of an unwound pass (workers/preemption/suspension.py): stopped
        before the first layer finished, nothing new; otherwise every prefill chunk active at
        `layer` is held at `layer`, and a resumed piece the stop came before (or at its own
        layer) keeps its own; one that ran past it is held at `layer` ahead of the rest of its
        chunk."""
        if not scheduler_output.suspend_on_unwind:
            return []
        kept: list[str] = []
        for r in scheduler_output.requests:
            chunk = chunks[r.req_id]
            if chunk.tokens < 2 and not r.resume:
                continue  # decodes are never suspended
            segments = self.suspended.get(r.req_id) if r.resume else None
            if layer > chunk.join:
                piece = SuspendedChunk(r.start_pos, chunk.tokens, layer)
                if segments is None:
                    self.suspended[r.req_id] = [piece]
                else:
                    segments[:1] = [piece, *segments[0].tail(chunk.tokens)]
            elif segments is None:
                continue
            kept.append(r.req_id)
        return kept

    def _next_token(self, r: ScheduledRequest) -> int | None:
        position = r.start_pos + len(r.token_ids)
        if r.last_token_pending:
            last = self._last_sampled.get(r.req_id)
            if last is None:
                raise ValueError(f"request {r.req_id!r} was scheduled ahead, but the step "
                                 f"before sampled no token for it")
        else:
            last = r.token_ids[-1]
        token = (last * 1_000_003 + position * 7919) % self.vocab_size
        if r.allowed_token_bitmask is not None:
            # Structured outputs: the first token the grammar allows from there on (its stop
            # token too once the output is complete: the grammar, not the model, ends it).
            return first_allowed_from(r.allowed_token_bitmask, token, self.vocab_size)
        while token in self.avoid_token_ids:
            token = (token + 1) % self.vocab_size
        return token


def _resumed_layers(scheduler_output: SchedulerOutput,
                    chunks: dict[str, _Chunk]) -> dict[str, int]:
    """Where each resumed chunk joined the pass: the TTFT predictor's share of the layers."""
    return {r.req_id: chunks[r.req_id].join for r in scheduler_output.requests if r.resume}
