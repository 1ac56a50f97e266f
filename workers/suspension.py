"""Suspended passes (docs/design.md section 4, mode ``suspend``): the activations of prefill chunks
whose forward pass was unwound, kept on the worker so that the chunk resumes at the layer it
stopped at instead of being computed again.

The KV of the layers below that layer is already in the chunk's blocks (the engine keeps them);
what is missing is the residual stream entering the stopped layer, two [tokens, hidden] tensors
per chunk. Every rank keeps its own copy (hidden states are replicated across TP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.scheduler_output import ScheduledRequest
from workers.models import LayerJoin
from workers.preempt_vote import StepPreempted


@dataclass
class SuspendedChunk:
    start_pos: int
    num_tokens: int
    join: LayerJoin


class SuspendedChunks:
    def __init__(self) -> None:
        self._chunks: dict[str, SuspendedChunk] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def free(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._chunks.pop(req_id, None)

    def layer_of(self, request: ScheduledRequest) -> int:
        return self._get(request).join.layer

    def join_for(self, request: ScheduledRequest) -> LayerJoin:
        return self._get(request).join

    def _get(self, request: ScheduledRequest) -> SuspendedChunk:
        chunk = self._chunks.get(request.req_id)
        if chunk is None:
            raise ValueError(f"request {request.req_id!r} resumes a pass this worker did not "
                             f"suspend")
        if (chunk.start_pos, chunk.num_tokens) != (request.start_pos, len(request.token_ids)):
            raise ValueError(
                f"request {request.req_id!r} resumes tokens [{request.start_pos}, "
                f"{request.start_pos + len(request.token_ids)}) but the suspended chunk is "
                f"[{chunk.start_pos}, {chunk.start_pos + chunk.num_tokens})")
        return chunk

    def suspend(self, stop: StepPreempted,
                prefill_rows: list[tuple[ScheduledRequest, int]]) -> list[str]:
        """Keep each prefill chunk's rows of the stopped layer's inputs. ``prefill_rows``: the
        step's prefill chunks with their first row. A resumed chunk that had not joined yet keeps
        the activations it had. Returns the chunks now suspended."""
        hidden, residual = stop.hidden_states, stop.residual
        if hidden is None or residual is None:
            # Stopped before the first layer finished: nothing computed worth keeping.
            return [r.req_id for r, _ in prefill_rows if r.req_id in self._chunks and r.resume]
        active_rows = hidden.shape[0]
        suspended: list[str] = []
        for request, first_row in prefill_rows:
            end = first_row + len(request.token_ids)
            if end <= active_rows:
                # clone: a view would keep the whole step's activations alive.
                join = LayerJoin(stop.layer, hidden[first_row:end].clone(),
                                 residual[first_row:end].clone())
                self._chunks[request.req_id] = SuspendedChunk(request.start_pos,
                                                              len(request.token_ids), join)
            elif not (request.resume and request.req_id in self._chunks):
                continue
            suspended.append(request.req_id)
        return suspended


__all__ = ["SuspendedChunk", "SuspendedChunks"]
