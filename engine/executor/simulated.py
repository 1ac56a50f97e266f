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

A sampled token is a fixed function of the last token and its position, never a model's: outputs
are the same whatever the scheduling, preemptions and chunking, and no token is an EOS (a
simulated request ends at max_tokens or a stop string, so runs of different policies do the same
work).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.core.suspension_ledger import SuspendedChunk
from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.structured_output.bitmask import first_allowed_from
from engine.simulation.profile import StepTimeProfile
from workers.preemption.slo_preempt_vote import SLOPreemptVote, StepSLOPreempted, discarded_share


@dataclass(frozen=True)
class _Chunk:
    """A scheduled request's share of the step's features, and the first layer it runs."""

    tokens: int
    attention: int
    decode_context: int
    join: int


class SimulatedExecutor:
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = self._clock()
        for req_id in scheduler_output.free_suspended:
            self.suspended.pop(req_id, None)
        if not scheduler_output.requests:
            return ModelRunnerOutput(step_id=scheduler_output.step_id)
        self.num_steps += 1
        chunks = {r.req_id: self._chunk(r) for r in scheduler_output.requests}
        # Where each resumed chunk joined the pass: the TTFT predictor's share of the layers.
        resumed_layers = {r.req_id: chunks[r.req_id].join for r in scheduler_output.requests
                          if r.resume}
        vote = self.vote if scheduler_output.preemptible else None
        try:
            if vote is None:
                self._wait_until(started + self._step_seconds(chunks.values(), 0))
            else:
                vote.step_id = scheduler_output.step_id
                vote.discarded_share = discarded_share(scheduler_output)
                self._run_layers(chunks, vote, started)
        except StepSLOPreempted as stop:
            suspended = self._suspend(scheduler_output, chunks, stop.layer)
            self._wait_until(self._clock() + self.profile.unwind_s)
            return ModelRunnerOutput(step_id=scheduler_output.step_id,
                                     status=StepStatus.SLO_PREEMPTED,
                                     slo_preempted_layer=stop.layer,
                                     unwound_layers=[stop.layer], suspended_req_ids=suspended,
                                     resumed_layers=resumed_layers,
                                     execute_seconds=self._clock() - started)
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
        return ModelRunnerOutput(step_id=scheduler_output.step_id, sampled_token_ids=sampled,
                                 failed=failed,
                                 resumed_layers=resumed_layers,
                                 execute_seconds=self._clock() - started)

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
            end += self._step_seconds(chunks.values(), layer) / num_layers
            self._wait_until(end)

    def _wait_until(self, moment: float) -> None:
        delay = moment - self._clock()
        if delay > 0:
            self._sleep(delay)

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
        token = (r.token_ids[-1] * 1_000_003 + position * 7919) % self.vocab_size
        if r.allowed_token_bitmask is not None:
            # Structured outputs: the first token the grammar allows from there on (its stop
            # token too once the output is complete: the grammar, not the model, ends it).
            return first_allowed_from(r.allowed_token_bitmask, token, self.vocab_size)
        while token in self.avoid_token_ids:
            token = (token + 1) % self.vocab_size
        return token
