"""What a step asks of the workers for one scheduled request (`Scheduler.schedule` builds its
SchedulerOutput from these), and the counters that advance as it is asked."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler_output import PENDING_TOKEN, ScheduledRequest
from engine.core.suspension_ledger import SuspensionLedger


def scheduled_request(request: Request, num_new: int, kv: KVCacheManager,
                      suspensions: SuspensionLedger) -> ScheduledRequest:
    """`request`'s `num_new` tokens from its computed ones: the slice of tokens (or the
    pending token of a decode scheduled ahead), the block table update, whether a token is
    sampled and what the sampler reads. Advances the request's counters as vLLM v1 does at
    schedule time, so that the next step never schedules the same tokens: computed tokens, and
    an output placeholder for the token sampled."""
    req_id = request.request_id
    start = request.num_computed_tokens
    end = start + num_new
    all_token_ids = request.all_token_ids
    num_tokens = len(all_token_ids)
    # A decode scheduled ahead (Scheduler.can_schedule_ahead): its input is the token in flight.
    pending = end > num_tokens
    resume = suspensions.is_suspended(req_id)
    if resume:
        held = suspensions.next_chunk(req_id)
        assert held is not None and held.start_pos == start and num_new <= held.num_tokens
    table_start, new_block_ids, group_block_ids = kv.table_update(req_id)
    placeholders = request.num_output_placeholders
    scheduled = ScheduledRequest(
        req_id=req_id,
        token_ids=[PENDING_TOKEN] if pending else all_token_ids[start:end],
        start_pos=start,
        block_ids=new_block_ids,
        block_table_start=table_start,
        group_block_ids=group_block_ids,
        sample=end == num_tokens + placeholders,
        sampling_params=request.step_sampling_params,
        num_output_tokens=len(request.output_token_ids) + placeholders,
        resume=resume,
        # Most requests ask for no prompt logprobs: the list's default, without a call.
        prompt_logprob_targets=(request.prompt_logprob_targets(start, end)
                                if request.prompt_logprobs is not None else []),
        last_token_pending=pending,
        long_rope=request.long_rope,
    )
    if scheduled.sample:
        add_sampling_history(scheduled, request)
        request.num_output_placeholders += 1
    request.num_computed_tokens = end
    return scheduled


def add_sampling_history(scheduled: ScheduledRequest, request: Request) -> None:
    """What the worker's logits processors read for this request (see TokenHistory)."""
    params = request.sampling_params
    if params.has_penalties:
        # Copies: an in-process executor reads them while the request grows.
        scheduled.output_token_ids = list(request.output_token_ids)
        if params.repetition_penalty != 1.0:
            scheduled.prompt_token_ids = list(request.prompt_token_ids)
    if scheduled.num_output_tokens < params.min_tokens:
        blocked = list(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            blocked.append(request.eos_token_id)
        scheduled.blocked_token_ids = blocked
    if request.grammar is not None:
        scheduled.allowed_token_bitmask = request.grammar.next_token_bitmask()
