"""Suspended passes (docs/design.md section 4, mode ``suspend``): the activations of prefill chunks
whose forward pass was unwound, kept on the worker so that the chunk resumes at the layer it
stopped at instead of being computed again.

The KV of the layers below that layer is already in the chunk's blocks (the engine keeps them);
what is missing is the residual stream entering the stopped layer, two [tokens, hidden] tensors
per chunk. Every rank keeps its own copy (hidden states are replicated across TP ranks).

A suspended chunk may resume in pieces (docs/design.md section 4, "Resuming in pieces"): the
engine resumes its first tokens, and the rest stays held at the same layer. Rows are causal, so
a piece needs only the KV of the tokens before it, which the earlier pieces wrote at every layer
they ran. A piece whose pass is stopped again past its join layer is held at the new layer, ahead
of the rest of its chunk: a request's suspended tokens are a list of segments, each with its own
layer, resumed front first. The engine's scheduler keeps the same list
(engine.core.suspension_ledger) by the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.scheduler_output import ScheduledRequest
from workers.models import LayerJoin
from workers.preemption.slo_preempt_vote import StepSLOPreempted


@dataclass
class HeldChunk:
    """The worker's side of an engine.core.suspension_ledger.SuspendedChunk: the same tokens and
    layer, with the activations that enter that layer."""

    start_pos: int
    num_tokens: int
    join: LayerJoin

    def head(self, num_tokens: int) -> LayerJoin:
        """The join of its first ``num_tokens`` tokens (views: no copy)."""
        if num_tokens == self.num_tokens:
            return self.join
        return LayerJoin(self.join.layer, self.join.hidden_states[:num_tokens],
                         self.join.residual[:num_tokens])

    def tail(self, num_tokens: int) -> HeldChunk | None:
        """What is left once its first ``num_tokens`` tokens resumed (views of the same
        activations: slicing a held tensor copies nothing), or None."""
        if num_tokens == self.num_tokens:
            return None
        join = LayerJoin(self.join.layer, self.join.hidden_states[num_tokens:],
                         self.join.residual[num_tokens:])
        return HeldChunk(self.start_pos + num_tokens, self.num_tokens - num_tokens, join)


class HeldChunks:
    def __init__(self) -> None:
        # req_id -> its suspended segments, in token order (the first resumes next).
        self._chunks: dict[str, list[HeldChunk]] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def free(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._chunks.pop(req_id, None)

    def layer_of(self, request: ScheduledRequest) -> int:
        return self._get(request).join.layer

    def join_for(self, request: ScheduledRequest) -> LayerJoin:
        return self._get(request).head(len(request.token_ids))

    def consume(self, requests: list[ScheduledRequest]) -> None:
        """These resumed pieces completed their pass: drop them, keep the rest of their chunks."""
        for request in requests:
            segments = self._chunks[request.req_id]
            rest = segments[0].tail(len(request.token_ids))
            segments[:1] = [rest] if rest is not None else []
            if not segments:
                del self._chunks[request.req_id]

    def _get(self, request: ScheduledRequest) -> HeldChunk:
        segments = self._chunks.get(request.req_id)
        if not segments:
            raise ValueError(f"request {request.req_id!r} resumes a pass this worker did not "
                             f"suspend")
        chunk = segments[0]
        if chunk.start_pos != request.start_pos or len(request.token_ids) > chunk.num_tokens:
            raise ValueError(
                f"request {request.req_id!r} resumes tokens [{request.start_pos}, "
                f"{request.start_pos + len(request.token_ids)}) but the suspended chunk is "
                f"[{chunk.start_pos}, {chunk.start_pos + chunk.num_tokens})")
        return chunk

    def suspend(self, stop: StepSLOPreempted,
                prefill_rows: list[tuple[ScheduledRequest, int]]) -> list[str]:
        """Keep each prefill chunk's rows of the stopped layer's inputs. ``prefill_rows``: the
        step's prefill chunks with their first row. A resumed piece the stop came before (or at
        its own layer) keeps the activations it had; one that ran past its layer is held at the
        stopped layer, ahead of the rest of its chunk. Returns the chunks now suspended."""
        hidden, residual = stop.hidden_states, stop.residual
        if hidden is None or residual is None:
            # Stopped before the first layer finished: nothing computed worth keeping.
            return [r.req_id for r, _ in prefill_rows if r.req_id in self._chunks and r.resume]
        active_rows = hidden.shape[0]
        suspended: list[str] = []
        for request, first_row in prefill_rows:
            end = first_row + len(request.token_ids)
            segments = self._chunks.get(request.req_id) if request.resume else None
            if end <= active_rows and (segments is None or stop.layer > segments[0].join.layer):
                # clone: a view would keep the whole step's activations alive.
                join = LayerJoin(stop.layer, hidden[first_row:end].clone(),
                                 residual[first_row:end].clone())
                piece = HeldChunk(request.start_pos, len(request.token_ids), join)
                if segments is None:
                    self._chunks[request.req_id] = [piece]
                else:
                    rest = segments[0].tail(len(request.token_ids))
                    segments[:1] = [piece] + ([rest] if rest is not None else [])
            elif segments is None:
                continue
            suspended.append(request.req_id)
        return suspended


__all__ = ["HeldChunk", "HeldChunks"]
