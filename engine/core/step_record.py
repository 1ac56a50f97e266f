"""One ``schedule()`` call: the step being built (`StepInProgress`) and what it changed
(`StepRecord`, the record a rollback of an abandoned step replays)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
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

    def undo(self, kv: KVCacheManager) -> None:
        """Free the request's KV and restore what the admission changed (the caller moves it
        from the running set back to the head of the waiting queue)."""
        request = self.request
        kv.free(request)
        request.status = self.prev_status
        request.num_cached_tokens = self.prev_num_cached_tokens
        request.first_scheduled_time = self.prev_first_scheduled_time
        request.num_output_placeholders = 0
        kv.prefix_cache_queries -= self.prefix_cache_queries
        kv.prefix_cache_hits -= self.prefix_cache_hits


@dataclass
class StepRecord:
    """Everything one ``schedule()`` call changed, so an abandoned step can be rolled back.

    How a rollback (``Scheduler.rollback``, replaying it with ``undo``) uses each field:

    - ``admitted``: remove each from ``running``, free its blocks, restore ``status``,
      ``num_cached_tokens`` and ``first_scheduled_time``, and put the requests back at the front
      of the waiting queue (prepend them in reverse so they keep their order).
    - ``new_block_ids``: for each still-running request, pop that many blocks off the tail of its
      block table and free them (fresh blocks and touched cache hits alike; none of them has a hash
      committed by this step, since commits happen only in ``update_from_output``).
    - ``prev_num_computed_tokens``: restore each scheduled request's counter; KV the abandoned pass
      wrote beyond it is simply overwritten when the tokens are scheduled again.
    - ``kv_preempted``: stay preempted. Their blocks went back to the pool and the abandoned pass
      may already have written into them, so the only safe state is recompute, which they are
      in.
    - ``sampled``: each still-running request gives back the output placeholder the step took
      (its token will never arrive).
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
    # Request id -> blocks appended to its tables this step, in table order, one list per KV
    # cache group.
    new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    admitted: list[Admission] = field(default_factory=list)
    kv_preempted: list[Request] = field(default_factory=list)
    # Requests the step samples a token for (set when the step is output).
    sampled: list[str] = field(default_factory=list)

    def forget(self, req_id: str) -> None:
        """The request left this step's scheduled set (a KV-pressure victim): drop every entry
        about it, so that a rollback never replays a change the step no longer holds."""
        self.prev_num_computed_tokens.pop(req_id, None)
        self.new_block_ids.pop(req_id, None)
        self.admitted = [a for a in self.admitted if a.request.request_id != req_id]

    def admitted_ids(self) -> set[str]:
        return {a.request.request_id for a in self.admitted}

    def undo(self, requests: Mapping[str, Request], kv: KVCacheManager,
             kept: Mapping[str, int]) -> list[Admission]:
        """The rollback's replay over the requests still live (``requests``) and the KV
        manager: blocks appended to requests admitted earlier go back to the pool, computed-token
        counters are restored, and each kept (suspended) chunk, request id -> its start position,
        goes back to not computed while its request keeps its blocks. Returns the admissions to
        undo, in admission order: the kept chunks' are not among them."""
        admitted = self.admitted_ids()
        for req_id, block_ids in self.new_block_ids.items():
            request = requests.get(req_id)
            if request is not None and req_id not in admitted and req_id not in kept:
                kv.release_tail(request, block_ids)
        for req_id, num_computed in self.prev_num_computed_tokens.items():
            if (request := requests.get(req_id)) is not None:
                request.num_computed_tokens = num_computed
        for req_id in self.sampled:
            if (request := requests.get(req_id)) is not None and request.num_output_placeholders:
                request.num_output_placeholders -= 1
        for req_id, start_pos in kept.items():
            # After its prefix-cache hits, where its chunk starts.
            requests[req_id].num_computed_tokens = start_pos
        return [a for a in self.admitted if a.request.request_id not in kept]

    def check_invariants(self, scheduled_req_ids: frozenset[str]) -> None:
        """Every entry is about a request the step (``scheduled_req_ids``) still schedules."""
        assert self.admitted_ids() <= scheduled_req_ids, "record admits a request not in its step"
        assert set(self.new_block_ids) <= scheduled_req_ids, "record frees blocks of one not in it"
        assert set(self.prev_num_computed_tokens) <= scheduled_req_ids, (
            "record restores one not in it")


@dataclass
class StepInProgress:
    """The step one ``schedule()`` call is building: what it schedules, the token budget it has
    left, and the record of what it changed. Every hook that adds to the step takes this."""

    record: StepRecord
    # Tokens the step may still schedule.
    budget: int
    # Request id -> (request, tokens scheduled); dict order is scheduling order.
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)
    # The step's cost features so far (monitor.predictor's step model), kept as running sums:
    # the deadline caps read them once per request they weigh.
    num_tokens: int = 0
    attention: int = 0
    decode_context: int = 0
    # The requests this step gives an output token while their TTFT deadline is live (their
    # client has seen no output yet): the ones the slo policy's caps protect.
    with_deadline: dict[str, Request] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = (request, num_tokens)
        self.budget -= num_tokens
        self._count(request, num_tokens, 1)
        if (request.live_deadline is not None
                and request.num_computed_tokens + num_tokens >= request.num_tokens):
            self.with_deadline[request.request_id] = request

    def drop(self, req_id: str) -> None:
        """A request served earlier in this step became a KV-pressure victim: its tokens go back
        to the budget and the record forgets it."""
        request, num_tokens = self.scheduled.pop(req_id)
        self.budget += num_tokens
        self._count(request, num_tokens, -1)
        self.with_deadline.pop(req_id, None)
        self.record.forget(req_id)

    def _count(self, request: Request, num_tokens: int, sign: int) -> None:
        # Counters advance only when the step is output: the chunk starts at num_computed_tokens.
        prefix = request.num_computed_tokens
        self.num_tokens += sign * num_tokens
        if num_tokens > 1:
            self.attention += sign * num_tokens * (2 * prefix + num_tokens)
        else:
            self.decode_context += sign * (prefix + 1)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.scheduled
