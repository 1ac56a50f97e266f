"""The scheduler's ledger of suspended prefill chunks (suspend mode, docs/design.md section 4).

When the workers unwind a step in suspend mode they keep, for every prefill chunk of it, the
activations entering the layer where the pass stopped; the rollback keeps those chunks' blocks,
and each resumes at that layer, whole or in pieces, when it is scheduled again. This ledger is
the scheduler's side of what the workers hold (workers/preemption/suspension.py follows the
same rules): which requests hold which segments, the layer each resumes at, and which the
workers may free with the next step because nobody will resume them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class SuspendedChunk(NamedTuple):
    """Tokens of a prefill chunk whose stopped pass the workers hold: they join a resuming pass
    at `layer` (the layers below it are done). A chunk may resume in pieces, its first tokens
    first (docs/design.md section 4): a request's suspended tokens are a list of these
    segments, in token order, the first starting at its computed tokens."""

    start_pos: int
    num_tokens: int
    layer: int = 0

    def tail(self, num_tokens: int) -> list[SuspendedChunk]:
        """What is left once its first `num_tokens` resumed: [] or the one rest segment."""
        if num_tokens == self.num_tokens:
            return []
        return [self._replace(start_pos=self.start_pos + num_tokens,
                              num_tokens=self.num_tokens - num_tokens)]


class SuspensionLedger:
    """Request id -> the segments the workers hold for it, and the ones to free."""

    def __init__(self) -> None:
        # Request id -> the segments whose activations the workers hold, in token order.
        self.suspended: dict[str, list[SuspendedChunk]] = {}
        # Suspended chunks the workers can free; sent with the next step.
        self.unneeded: list[str] = []

    def is_suspended(self, req_id: str) -> bool:
        return req_id in self.suspended

    def next_chunk(self, req_id: str) -> SuspendedChunk | None:
        """The segment it resumes next (its first), or None."""
        segments = self.suspended.get(req_id)
        return segments[0] if segments else None

    def suspend(self, req_id: str, start_pos: int, num_tokens: int, layer: int) -> None:
        """A rollback kept this chunk, whose pass stopped before `layer`: the workers hold it.
        For a resumed piece (of the request's first segment), by the workers' rules
        (workers/preemption/suspension.py): if the stop came before its own layer, or at it,
        nothing changed; past it, the piece is held at `layer`, ahead of the rest of its
        segment."""
        segments = self.suspended.get(req_id)
        if segments is None:
            self.suspended[req_id] = [SuspendedChunk(start_pos, num_tokens, layer)]
            return
        first = segments[0]
        assert first.start_pos == start_pos and num_tokens <= first.num_tokens, \
            f"{req_id}: rolled back [{start_pos}, +{num_tokens}) but holds {first}"
        if layer > first.layer:
            segments[:1] = [SuspendedChunk(start_pos, num_tokens, layer),
                            *first.tail(num_tokens)]

    def resumed(self, req_id: str, num_tokens: int) -> None:
        """The first `num_tokens` of its first segment completed in a step: the workers
        dropped them with that step and hold the rest."""
        segments = self.suspended[req_id]
        segments[:1] = segments[0].tail(num_tokens)
        if not segments:
            del self.suspended[req_id]

    def drop(self, req_ids: Iterable[str]) -> None:
        """These suspended chunks will not resume: the workers free them with the next step."""
        for req_id in req_ids:
            self.suspended.pop(req_id, None)
            self.unneeded.append(req_id)

    def discard(self, req_id: str) -> None:
        """Drop its suspended chunk if it has one (it finished, or lost its blocks)."""
        if req_id in self.suspended:
            self.drop([req_id])

    def take_unneeded(self) -> list[str]:
        """The suspended chunks the workers may free, handed over with the step being sent."""
        unneeded, self.unneeded = self.unneeded, []
        return unneeded

    def check_invariants(self, running_ids: set[str]) -> None:
        assert set(self.suspended) <= running_ids, "a suspended chunk lost its request"
