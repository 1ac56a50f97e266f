"""Admission of waiting requests (DESIGN.md section 3): the one test of whether a request fits
now, and moving it into the running set with its first chunk scheduled.

A mixin of `Scheduler`, like `engine/core/slack_policy.py`: it reads and changes the scheduler's
state (declared below for readers and type checkers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.block_pool import KVBlock
from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue
from engine.core.step_record import Admission, StepRecord


@dataclass(frozen=True)
class AdmissionPlan:
    num_new: int  # tokens of its first chunk
    computed_blocks: list[KVBlock]  # prefix-cache hits
    num_cached: int  # tokens in them


class AdmissionControl:
    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    waiting: RequestQueue
    running: list[Request]
    held: set[str]

    if TYPE_CHECKING:
        def _chunk(self, owed: int, budget: int) -> int:
            ...

    def _admit_waiting(
        self, budget: int, scheduled: dict[str, tuple[Request, int]], record: StepRecord
    ) -> int:
        """Admit waiting requests in queue order while they fit. Returns the budget left."""
        with self.waiting_past_held() as next_waiter:
            while budget > 0 and (request := next_waiter()) is not None:
                num_new = self._admit(request, budget, scheduled, record)
                if num_new is None:
                    break  # head-of-line: nothing behind it jumps ahead, so it cannot starve
                self.waiting.pop()
                budget -= num_new
        return budget

    @contextmanager
    def waiting_past_held(self) -> Iterator[Callable[[], Request | None]]:
        """Yields a function that peeks at the first waiting request that is not held back.

        A held victim waits for its turn without blocking anyone queued behind it: held
        requests met at the head are lifted off the queue, and put back in their order (and
        so at their places, ahead of everyone left) on exit.
        """
        lifted: list[Request] = []

        def next_waiter() -> Request | None:
            while self.waiting:
                request = self.waiting.peek()
                if request.request_id not in self.held:
                    return request
                lifted.append(self.waiting.pop())
            return None

        try:
            yield next_waiter
        finally:
            for request in reversed(lifted):
                self.waiting.prepend(request)

    def _plan_admission(self, request: Request, budget: int) -> AdmissionPlan | None:
        """The one test of whether a waiting request can be admitted now, with ``budget``
        tokens left in the step: a sequence slot, a first chunk within the budget (without
        chunked prefill, all it owes), and KV blocks for it past the watermark reserve. With
        full-sequence admission the blocks must hold its whole input (prompt and tokens
        generated before a preemption) as vLLM's ``scheduler_reserve_full_isl`` does; decode
        growth is what KV preemption is for. Admission and every other "would it fit"
        question (a mid-forward preemption's pause-or-recompute choice) ask this, so the
        answers cannot disagree. Changes nothing."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        computed_blocks: list[KVBlock] = []
        num_cached = 0
        if request.num_computed_tokens == 0:
            computed_blocks, num_cached = kv.get_computed_blocks(request)
        owed = request.num_tokens_owed - num_cached
        if self.config.enable_chunked_prefill:
            num_new = self._chunk(owed, budget)
        else:
            num_new = owed if owed <= budget else 0
        if num_new == 0:
            return None
        if self.config.full_sequence_admission:
            # add_request caps num_tokens at max_model_len.
            num_total = request.num_tokens
        else:
            num_total = request.num_computed_tokens + num_cached + num_new
        if not kv.can_allocate(request, num_total, computed_blocks, admission=True,
                               num_running=len(self.running)):
            return None
        return AdmissionPlan(num_new, computed_blocks, num_cached)

    def can_admit(self, request: Request) -> bool:
        """Whether ``request`` would be admitted by a step with the whole token budget."""
        return self._plan_admission(request, self.config.max_num_batched_tokens) is not None

    def _admit(
        self, request: Request, budget: int, scheduled: dict[str, tuple[Request, int]],
        record: StepRecord
    ) -> int | None:
        """Move a waiting request into the running set with its first chunk scheduled (the
        caller takes it off the queue). Returns the tokens scheduled, or None if it cannot run
        now (see ``_plan_admission``)."""
        plan = self._plan_admission(request, budget)
        if plan is None:
            return None
        kv = self.kv_cache_manager
        num_new, num_cached = plan.num_new, plan.num_cached
        prev_num_computed = request.num_computed_tokens
        num_blocks_before = len(kv.req_blocks.get(request.request_id, ()))
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        block_ids = kv.allocate_slots(request, num_new, num_cached, plan.computed_blocks,
                                      admission=True, num_running=len(self.running))
        assert block_ids is not None, "the admission plan said it fits"
        record.admitted.append(Admission(request, request.status, request.num_cached_tokens,
                                         request.first_scheduled_time,
                                         prefix_cache_queries=kv.prefix_cache_queries - queries,
                                         prefix_cache_hits=kv.prefix_cache_hits - hits))
        record.prev_num_computed_tokens[request.request_id] = prev_num_computed
        record.new_block_ids[request.request_id] = block_ids[num_blocks_before:]
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens += num_cached
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        scheduled[request.request_id] = (request, num_new)
        return num_new
