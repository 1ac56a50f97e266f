"""Admission of waiting requests (docs/design.md section 3): the one test of whether a request fits
now, and moving it into the running set with its first chunk scheduled.

`Scheduler` owns one `AdmissionControl`. Admission, `Scheduler.can_admit` and the slack
policy's pause-or-recompute choice for a mid-forward preemption's victim all ask `plan`, so
their answers cannot disagree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import GroupTables, KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.step_record import Admission, StepInProgress


def chunk_size(owed: int, budget: int, long_prefill_token_threshold: int) -> int:
    """Tokens a request gets this step: ``min(owed, threshold, budget_left)`` (threshold 0: no
    cap). Prefill, chunked prefill, decode and resume differ only in how much is owed."""
    n = min(owed, budget)
    return min(n, long_prefill_token_threshold) if long_prefill_token_threshold > 0 else n


@dataclass(frozen=True)
class AdmissionPlan:
    num_new: int  # tokens of its first chunk
    computed_blocks: GroupTables  # prefix-cache hits, each KV cache group's
    num_cached: int  # tokens in them


class AdmissionControl:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager

    def plan(self, request: Request, budget: int, num_running: int) -> AdmissionPlan | None:
        """The one test of whether a waiting request can be admitted now, with ``budget``
        tokens left in the step and ``num_running`` requests running: a sequence slot, a first
        chunk within the budget (without chunked prefill, all it owes), and KV blocks for it
        past the watermark reserve. With full-sequence admission the blocks must hold its whole
        input (prompt and tokens generated before a preemption) as vLLM's
        ``scheduler_reserve_full_isl`` does; decode growth is what KV preemption is for.
        Changes nothing."""
        if num_running >= self.config.max_num_seqs:
            return None
        kv = self.kv_cache_manager
        computed_blocks: GroupTables = []
        num_cached = 0
        if request.num_computed_tokens == 0:
            computed_blocks, num_cached = kv.get_computed_blocks(request)
        owed = request.num_tokens_owed - num_cached
        if self.config.enable_chunked_prefill:
            num_new = chunk_size(owed, budget, self.config.long_prefill_token_threshold)
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
                               num_running=num_running):
            return None
        return AdmissionPlan(num_new, computed_blocks, num_cached)

    def admit(self, request: Request, step: StepInProgress, running: list[Request],
              budget: int) -> int | None:
        """Move a waiting request into ``running`` with its first chunk (at most ``budget``
        tokens) scheduled in ``step`` (the caller takes it off the queue). Returns the tokens
        scheduled, or None if it cannot run now (see ``plan``)."""
        plan = self.plan(request, budget, len(running))
        if plan is None:
            return None
        kv = self.kv_cache_manager
        num_new, num_cached = plan.num_new, plan.num_cached
        prev_num_computed = request.num_computed_tokens
        num_blocks_before = kv.num_blocks_of(request.request_id)
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        allocated = kv.allocate_slots(request, num_new, num_cached, plan.computed_blocks,
                                      admission=True, num_running=len(running))
        assert allocated, "the admission plan said it fits"
        record = step.record
        record.admitted.append(Admission(request, request.status, request.num_cached_tokens,
                                         request.first_scheduled_time,
                                         prefix_cache_queries=kv.prefix_cache_queries - queries,
                                         prefix_cache_hits=kv.prefix_cache_hits - hits))
        record.prev_num_computed_tokens[request.request_id] = prev_num_computed
        record.new_block_ids[request.request_id] = kv.block_ids_from(request.request_id,
                                                                     num_blocks_before)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens += num_cached
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        running.append(request)
        step.add(request, num_new)
        return num_new
