"""What one ``schedule()`` call changed: the record a rollback of an abandoned step replays."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request, RequestStatus


@dataclass
class Admission:
    request: Request
    # WAITING or PREEMPTED: what the request goes back to if its admission is undone.
    prev_status: RequestStatus
    prev_num_cached_tokens: int
    # Before this admission (None if never scheduled): the time a client sees as "first
    # scheduled" must not point at an admission that was undone.
    prev_first_scheduled_time: float | None
    # What its prefix-cache lookup added to the KV manager's counters.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class StepRecord:
    """Everything one ``schedule()`` call changed, so an abandoned step can be rolled back.

    How ``rollback`` uses each field, in this order:

    - ``admitted``: remove each from ``running``, free its blocks, restore ``status``,
      ``num_cached_tokens`` and ``first_scheduled_time``, and put the requests back at the front
      of the waiting queue (prepend them in reverse so they keep their order).
    - ``new_block_ids``: for each still-running request, pop that many blocks off the tail of its
      block table and free them (fresh blocks and touched cache hits alike; none of them has a hash
      committed by this step, since commits happen only in ``update_from_output``).
    - ``prev_num_computed_tokens``: restore each scheduled request's counter; KV the abandoned pass
      wrote beyond it is simply overwritten when the tokens are scheduled again.
    - ``preempted``: stay preempted. Their blocks went back to the pool and the abandoned pass may
      already have written into them, so the only safe state is recompute, which they are in.
    - ``prev_scheduled_req_ids``: becomes the scheduler's previous-step set again.
    - each admission's ``prefix_cache_queries`` / ``prefix_cache_hits``: subtracted from the KV
      manager's counters.
    - ``step_id`` is never reused: step ids only grow, so a stale preempt signal cannot hit a
      later step. Prefix hashes that ``allocate`` evicted stay evicted (their blocks may have been
      overwritten).
    """

    step_id: int
    prev_scheduled_req_ids: frozenset[str]
    # Scheduled request id -> num_computed_tokens before this step (before cache hits, too).
    prev_num_computed_tokens: dict[str, int] = field(default_factory=dict)
    # Request id -> blocks appended to its table this step, in table order.
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    admitted: list[Admission] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def forget(self, req_id: str) -> None:
        """The request left this step's scheduled set (a KV-pressure victim): drop every entry
        about it, so that a rollback never replays a change the step no longer holds."""
        self.prev_num_computed_tokens.pop(req_id, None)
        self.new_block_ids.pop(req_id, None)
        self.admitted = [a for a in self.admitted if a.request.request_id != req_id]

    def admitted_ids(self) -> set[str]:
        return {a.request.request_id for a in self.admitted}
