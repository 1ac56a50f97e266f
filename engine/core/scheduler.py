"""Token-budget scheduler (DESIGN.md sections 3 and 4).

Every request is owed ``num_tokens - num_computed_tokens`` tokens and gets
``min(owed, long_prefill_token_threshold, budget_left)`` of them per step; prefill, chunked prefill,
decode and resume after preemption differ only in how much is owed. Running requests are served
first in admission order, then waiting ones are admitted while budget, sequence slots and KV blocks
last (`engine/core/admission.py`). When a running request cannot get blocks, the least deserving running
request is preempted with recompute. The slack-aware additions (the `slo` policy's urgent
admissions and step cap, mid-forward preemption victims) live in `engine/core/slack_policy.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.core.admission import AdmissionControl
from engine.config import CacheConfig, PreemptionConfig, SchedulerConfig, SLOPreemptMode
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.outputs import SchedulerStats
from engine.core.request_queue import RequestQueue, UrgencyQueue, create_request_queue
from engine.core.scheduler_output import (ModelRunnerOutput, ScheduledRequest, SchedulerOutput,
                                    StepStatus)
from engine.core.slack_policy import SlackAwareScheduling
from engine.core.step_record import StepRecord
from monitor.policy import request_urgency
from monitor.predictor import LinearTTFT, OnlineTTFT


class Scheduler(AdmissionControl, SlackAwareScheduling):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        preemption: PreemptionConfig | None = None,
        ttft_seed: LinearTTFT | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        budget = scheduler_config.max_num_batched_tokens
        if not scheduler_config.enable_chunked_prefill and budget < max_model_len:
            # Otherwise a long prompt (or a long resume after preemption) could never be scheduled.
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens ({budget}) must be >= "
                f"max_model_len ({max_model_len})"
            )
        self.config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(cache_config, num_blocks, max_model_len)
        self.requests: dict[str, Request] = {}
        # The slo policy ranks by slack, which needs predicted prefill times.
        self.ttft_predictor = OnlineTTFT(ttft_seed)
        # Steps with at least this many prefill tokens are marked preemptible (None: never).
        self.preempt_min_tokens = (preemption.min_tokens if preemption is not None
                                   and preemption.mid_forward_preemption else None)
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy, self.urgency)
        # Admission order: served first to last, preempted last to first (fcfs).
        self.running: list[Request] = []
        self.step_id = 0
        self.prev_scheduled_req_ids: frozenset[str] = frozenset()
        self.last_step_record: StepRecord | None = None
        self.num_kv_preemptions = 0
        self.num_slo_preemptions = 0
        # Tokens handed to the model so far, unwound steps included (the denominator of the
        # share of work that preemptions threw away).
        self.num_scheduled_tokens_total = 0
        # Victims of mid-forward preemptions, held back until no request with prefill left is
        # more urgent than they are: a paused one stays running with its KV but is not
        # scheduled; a recomputed one waits and is not admitted (else it would share the very
        # next step with the waiter it made room for).
        self.held: set[str] = set()
        # The waiter a mid-forward preemption made room for: admitted first by the next step.
        self.urgent_waiter_id: str | None = None
        # What a mid-forward preemption does to its victim (DESIGN.md section 4).
        self.slo_preempt_mode: SLOPreemptMode = (preemption.mode if preemption is not None
                                                 else "pause")
        # Suspended passes (suspend mode): request id -> (start_pos, tokens) of the chunk whose
        # activations the workers hold; it resumes whole or not at all.
        self.suspended: dict[str, tuple[int, int]] = {}
        # Suspended chunks the workers can free; sent with the next step.
        self.unneeded_suspensions: list[str] = []

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        limit = min(self.max_model_len, request.max_model_len or self.max_model_len)
        if request.num_tokens > limit:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={limit}"
            )
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id!r} is {request.status.name}, expected WAITING")
        # Stop checks and the full-sequence admission test both read the request's own limit.
        request.max_model_len = limit
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_requests(
        self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish requests from outside (abort, client disconnect): free their KV, drop them."""
        if not status.is_finished:
            raise ValueError(f"{status.name} is not a finished status")
        finished: list[Request] = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.held.discard(request.request_id)
        if request.request_id in self.suspended:
            self.drop_suspensions([request.request_id])
        request.status = status
        request.finish_time = time.monotonic()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # ---- one step ------------------------------------------------------------------------

    def _chunk(self, owed: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        n = min(owed, budget)
        return min(n, threshold) if threshold > 0 else n

    def _pick_victim(self, record: StepRecord) -> Request:
        # Never one admitted by this very step: it was admitted because it fit (the urgent
        # waiter a mid-forward preemption made room for, first of all), and taking it back
        # would only undo that decision while the step record still lists the admission.
        admitted = record.admitted_ids()
        candidates = [r for r in self.running if r.request_id not in admitted]
        paused = [r for r in candidates if r.request_id in self.held]
        if paused:
            # A paused request holds KV nobody is using: under KV pressure it goes first
            # (pause falls back to recompute).
            return paused[-1]
        if self.config.policy == "priority":
            # Scan newest first so that among equals the most recently admitted one goes.
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, record: StepRecord) -> None:
        if request.request_id in self.suspended:
            self.drop_suspensions([request.request_id])
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_kv_preemptions += 1
        self.waiting.prepend(request)
        record.preempted.append(request)

    def urgency(self, request: Request) -> float:
        """Slack-EDF priority of a request now (higher is more urgent)."""
        return request_urgency(request, time.monotonic(), self.ttft_predictor.predict)

    def schedule(self) -> SchedulerOutput:
        running_urgency: dict[str, float] = {}
        if self.config.policy == "slo":
            # Urgency moves with the clock: rank once per step, running and waiting alike. The
            # least urgent running request ends up last, which makes it the KV-pressure victim.
            now = time.monotonic()
            running_urgency = {r.request_id: request_urgency(r, now, self.ttft_predictor.predict)
                               for r in self.running}
            self.running.sort(key=lambda r: -running_urgency[r.request_id])
            assert isinstance(self.waiting, UrgencyQueue)
            self.waiting.refresh()
        if self.held:
            self._release_held()
        self.step_id += 1
        record = StepRecord(step_id=self.step_id, prev_scheduled_req_ids=self.prev_scheduled_req_ids)
        # req_id -> (request, tokens scheduled); dict order is scheduling order.
        scheduled: dict[str, tuple[Request, int]] = {}
        budget = self.config.max_num_batched_tokens
        if self.urgent_waiter_id is not None:
            budget -= self._admit_urgent_waiter(budget, scheduled, record)
        if self.config.policy == "slo":
            budget -= self._admit_outranking_waiters(budget, scheduled, record, running_urgency)
            budget = self._cap_for_deadlines(budget, scheduled)
        budget = self._schedule_running(budget, scheduled, record)
        if not record.preempted:
            # Blocks just taken from a victim must not go straight to a newcomer.
            budget = self._admit_waiting(budget, scheduled, record)
        if not scheduled and self.held and not record.preempted:
            # Holding a victim back is for letting someone else run first; when nobody else can
            # run, it only stalls the engine (an empty step that would repeat forever).
            self.held.clear()
            budget = self._schedule_running(budget, scheduled, record)
            if not record.preempted:
                self._admit_waiting(budget, scheduled, record)

        output = SchedulerOutput(step_id=self.step_id, requests=[],
                                 free_suspended=self.unneeded_suspensions)
        self.unneeded_suspensions = []
        num_prefill_tokens = 0
        for request, num_new in scheduled.values():
            start = request.num_computed_tokens
            end = start + num_new
            resume = request.request_id in self.suspended
            assert not resume or self.suspended[request.request_id] == (start, num_new)
            output.requests.append(
                ScheduledRequest(
                    req_id=request.request_id,
                    token_ids=request.all_token_ids[start:end],
                    start_pos=start,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    sample=end == request.num_tokens,
                    sampling_params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    resume=resume,
                )
            )
            if num_new > 1:
                num_prefill_tokens += num_new
            # Advanced at schedule time (as in vLLM v1) so the next step never re-schedules them.
            request.num_computed_tokens = end
        self.num_scheduled_tokens_total += output.num_scheduled_tokens
        # Decode-only and small steps end sooner than a preemption would pay off: no vote.
        output.preemptible = (self.preempt_min_tokens is not None and num_prefill_tokens > 0
                              and num_prefill_tokens >= self.preempt_min_tokens)
        output.suspend_on_unwind = output.preemptible and self.slo_preempt_mode == "suspend"
        self.prev_scheduled_req_ids = frozenset(scheduled)
        self.last_step_record = record
        return output

    def _schedule_running(
        self, budget: int, scheduled: dict[str, tuple[Request, int]], record: StepRecord
    ) -> int:
        """Serve running requests in admission order, preempting for KV space. Returns budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens_owed, budget)
            if (suspended := self.suspended.get(request.request_id)) is not None:
                num_new = suspended[1] if suspended[1] <= budget else 0
            if num_new == 0 or request.request_id in self.held or request.request_id in scheduled:
                # Its sampled token has not arrived yet; nothing to compute until it does.
                i += 1
                continue
            num_blocks_before = len(self.kv_cache_manager.req_blocks.get(request.request_id, ()))
            while self.kv_cache_manager.allocate_slots(request, num_new) is None:
                victim = self._pick_victim(record)
                if victim.request_id in scheduled:
                    # The priority and slo policies may pick a request already served this step.
                    budget += scheduled.pop(victim.request_id)[1]
                    record.forget(victim.request_id)
                self._preempt(victim, record)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                # It was its own victim: nothing left running can free blocks for anyone after it.
                break
            record.prev_num_computed_tokens[request.request_id] = request.num_computed_tokens
            new_block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[num_blocks_before:]
            record.new_block_ids[request.request_id] = new_block_ids
            scheduled[request.request_id] = (request, num_new)
            budget -= num_new
            # Victims of the priority policy may have sat before it, shifting its index.
            i = self.running.index(request) + 1
        return budget

    def rollback(self, record: StepRecord, keep: Iterable[ScheduledRequest] = ()) -> None:
        """Undo the last ``schedule()`` after its forward pass was abandoned (see StepRecord).

        Afterwards the scheduler is as it was before that call, except that step ids stay spent
        and requests preempted for KV space in that step stay preempted (their blocks may already
        be reused). ``keep``: chunks of that step whose pass is suspended (the workers hold its
        activations); their requests keep their admissions and blocks, and each chunk goes back
        to not computed, to be resumed whole (``self.suspended``).
        """
        if record is not self.last_step_record:
            raise ValueError(f"only the last step can be rolled back (step {record.step_id} "
                             f"given, last is {self.step_id})")
        kv = self.kv_cache_manager
        kept = {sr.req_id: sr for sr in keep}
        undone = [a for a in record.admitted if a.request.request_id not in kept]
        admitted = {a.request.request_id for a in record.admitted}
        for req_id, block_ids in record.new_block_ids.items():
            request = self.requests.get(req_id)
            if request is not None and req_id not in admitted and req_id not in kept:
                kv.release_tail(request, block_ids)
        for req_id, num_computed in record.prev_num_computed_tokens.items():
            if (request := self.requests.get(req_id)) is not None:
                request.num_computed_tokens = num_computed
        for req_id, sr in kept.items():
            # After its prefix-cache hits, where its chunk starts.
            self.requests[req_id].num_computed_tokens = sr.start_pos
            self.suspended[req_id] = (sr.start_pos, len(sr.token_ids))
        for admission in reversed(undone):
            request = admission.request
            self.running.remove(request)
            kv.free(request)
            request.status = admission.prev_status
            request.num_cached_tokens = admission.prev_num_cached_tokens
            request.first_scheduled_time = admission.prev_first_scheduled_time
            self.waiting.prepend(request)
            kv.prefix_cache_queries -= admission.prefix_cache_queries
            kv.prefix_cache_hits -= admission.prefix_cache_hits
        self.prev_scheduled_req_ids = record.prev_scheduled_req_ids
        self.last_step_record = None

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Commit a completed step: cache hashes, sampled tokens, stop checks.

        Returns the requests that received a token this step (finished ones included) or failed
        in it (``runner_output.failed``: finished with an error, nothing else changes), in
        scheduling order. Requests aborted or preempted since ``schedule()`` are skipped.
        """
        if runner_output.step_id != scheduler_output.step_id:
            raise ValueError(
                f"runner output is for step {runner_output.step_id}, scheduler output for step "
                f"{scheduler_output.step_id}"
            )
        if runner_output.status is not StepStatus.OK:
            raise ValueError(
                f"step {runner_output.step_id} did not complete ({runner_output.status.value}: "
                f"{runner_output.error}); roll it back instead of committing it"
            )
        live = [
            sr
            for sr in scheduler_output.requests
            if (r := self.requests.get(sr.req_id)) is not None and r.status is RequestStatus.RUNNING
        ]
        failed = runner_output.failed
        missing = [sr.req_id for sr in live if sr.sample and sr.req_id not in runner_output.sampled_token_ids
                   and sr.req_id not in failed]
        if missing:
            # Checked up front so a bad output changes nothing.
            raise ValueError(f"step {runner_output.step_id}: no sampled token for requests {missing}")

        outputs: list[Request] = []
        for sr in live:
            request = self.requests[sr.req_id]
            if sr.resume:
                del self.suspended[sr.req_id]  # the workers dropped it with the step's success
            if sr.req_id in failed:
                self.fail_request(request, failed[sr.req_id])
                outputs.append(request)
                continue
            self.kv_cache_manager.commit_computed_blocks(request, sr.start_pos + len(sr.token_ids))
            if not sr.sample:
                continue
            request.append_output_token(runner_output.sampled_token_ids[sr.req_id])
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            status = self._check_stop(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(request)
        return outputs

    def fail_request(self, request: Request, error: str) -> None:
        """Finish one request with an error (its sampling or its logits failed) and free its KV;
        its blocks' hashes are not committed, since their contents may be what went wrong."""
        self.running.remove(request)
        request.error = error
        self._finish(request, RequestStatus.FINISHED_ERROR)

    def fail_stalled(self) -> list[Request]:
        """After an empty step: if nothing runs and the step preempted nobody, nothing changed
        and the same empty step would come back forever. schedule() has already released every
        hold, and an idle pool admits any request add_request accepts, so only a bug gets here:
        the first waiting request finishes with an error naming what it needed, and the engine
        goes on. Returns the requests failed (none if the step made progress)."""
        record = self.last_step_record
        if self.running or not self.waiting or (record is not None and record.preempted):
            return []
        request = self.waiting.peek()
        kv = self.kv_cache_manager
        request.error = (
            f"request {request.request_id!r} could not be scheduled with nothing else running: "
            f"{request.num_tokens} tokens ({-(-request.num_tokens // kv.block_size)} KV blocks; "
            f"{kv.num_free_blocks} of {kv.pool.num_blocks} free), token budget "
            f"{self.config.max_num_batched_tokens}")
        return self.abort_requests([request.request_id], RequestStatus.FINISHED_ERROR)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        token = request.output_token_ids[-1]
        params = request.sampling_params
        if not params.ignore_eos and request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= (request.max_model_len or self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- introspection -------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def is_running(self, req_id: str) -> bool:
        request = self.requests.get(req_id)
        return request is not None and request.status is RequestStatus.RUNNING

    def get_request(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.prefix_cache_hits

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
                              prefix_cache_queries=kv.prefix_cache_queries,
                              prefix_cache_hits=kv.prefix_cache_hits,
                              num_kv_preemptions=self.num_kv_preemptions,
                              num_slo_preemptions=self.num_slo_preemptions,
                              num_scheduled_tokens=self.num_scheduled_tokens_total,
                              num_steps=self.step_id)

    def check_invariants(self) -> None:
        kv = self.kv_cache_manager
        kv.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is waiting twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert set(running_ids) | set(waiting_ids) == set(self.requests), "request lost or leaked"
        assert len(self.running) <= self.config.max_num_seqs
        assert set(kv.req_blocks) <= set(running_ids), "a request that is not running holds KV"
        assert self.held <= set(self.requests), "a finished request is still held back"
        assert set(self.suspended) <= set(running_ids), "a suspended chunk lost its request"
        if (record := self.last_step_record) is not None:
            # Every entry of the step record is about a request the step still schedules.
            stepped = self.prev_scheduled_req_ids
            assert record.admitted_ids() <= stepped, "record admits a request not in its step"
            assert set(record.new_block_ids) <= stepped, "record frees blocks of one not in it"
            assert set(record.prev_num_computed_tokens) <= stepped, "record restores one not in it"
        bs = kv.block_size
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id} in running is {r.status.name}"
            # A suspended first chunk has its blocks and layers but no computed tokens yet.
            assert 0 < r.num_computed_tokens <= r.num_tokens or r.request_id in self.suspended
            assert len(kv.req_blocks[r.request_id]) * bs >= r.num_computed_tokens
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status.name
            assert r.num_computed_tokens == 0
