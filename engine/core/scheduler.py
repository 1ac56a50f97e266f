"""Token-budget scheduler (docs/design.md sections 3 and 4).

Every request is owed ``num_tokens - num_computed_tokens`` tokens and gets
``min(owed, long_prefill_token_threshold, budget_left)`` of them per step; prefill, chunked prefill,
decode and resume after preemption differ only in how much is owed. Running requests are served
first in admission order, then waiting ones are admitted while budget, sequence slots and KV blocks
last (`engine/core/admission.py`: the one admission test). When a running request cannot get
blocks, a running request is preempted with recompute.

The slack-aware parts are a policy object, ``self.slack`` (`engine/core/slack_policy.py`), called
through named hooks: who goes first in a step and how much of the step the rest may take, the
KV-pressure victim, and what a mid-forward preemption does to its victim. Who is held back
(``self.slack.holds``) and which chunks resume a suspended pass (``self.slack.suspensions``)
the scheduler asks the policy's collaborators directly. A step's own bookkeeping:
`engine/core/step_record.py` (building it, and undoing it after an abandoned forward pass),
`engine/core/step_outcome.py` (reading the output of a completed one).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from engine.config import CacheConfig, SLOPreemptionConfig, SchedulerConfig
from engine.core.admission import AdmissionControl, chunk_size
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_groups import KVCacheGroup
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, create_request_queue
from engine.core.sibling_gate import SiblingGate
from engine.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.core.slack_policy import SlackPolicy
from engine.core.step_outcome import live_requests, stop_status
from engine.core.step_output import scheduled_request
from engine.core.step_record import StepInProgress, StepRecord
from engine.outputs import SchedulerStats
from monitor.predictor import StepTimePredictor

# The smallest piece a suspended segment resumes in, and the least it leaves held.
MIN_RESUME_PIECE = 16


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        slo_preemption: SLOPreemptionConfig | None = None,
        predictor: StepTimePredictor | None = None,
        long_rope_after: int | None = None,
        kv_groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        """`predictor`: the step-time predictor the slack policy prices prefills with, the
        engine's (EngineCore owns and feeds it); without one, a scheduler of its own (a test, a
        simulation, the startup calibration's scratch scheduler) gets one from the default
        seed. `long_rope_after`: a LongRoPE model's threshold (engine.core.long_rope), past
        which a sequence is rotated by the long factors; None: one rotary regime. `kv_groups`:
        the model's KV cache groups (engine.core.kv_groups; default: one of full attention)."""
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
        self.long_rope_after = long_rope_after
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(cache_config, num_blocks, max_model_len, kv_groups,
                                               max_chunk_tokens=budget)
        self.admission = AdmissionControl(scheduler_config, self.kv_cache_manager)
        if predictor is None:
            predictor = StepTimePredictor(error_quantile=slo_preemption.predictor_error_quantile
                                          if slo_preemption is not None else 0.9)
        self.slack = SlackPolicy(scheduler_config.policy,
                                 slo_preemption.mode if slo_preemption is not None else "pause",
                                 predictor, scheduler_config.aging_bound_ms / 1000,
                                 chunk_tokens=budget)
        # Steps with at least this many prefill tokens are marked preemptible (None: never).
        self.slo_preempt_min_tokens = (slo_preemption.min_tokens if slo_preemption is not None
                                   and slo_preemption.enabled else None)
        self.requests: dict[str, Request] = {}
        self.siblings = SiblingGate()
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy, self.urgency,
                                                          order=self.slack.rank)
        # Admission order: served first to last, preempted last to first (fcfs).
        self.running: list[Request] = []
        self.step_id = 0
        self.prev_scheduled_req_ids: frozenset[str] = frozenset()
        self.last_step_record: StepRecord | None = None
        self.num_kv_preemptions = 0
        # Tokens handed to the model so far, unwound steps included (the denominator of the
        # share of work that preemptions threw away).
        self.num_scheduled_tokens_total = 0
        # The predictor's model as stats() last reported it, and its fields.
        self._stats_model: object | None = None
        self._stats_model_fields: dict[str, float | bool | None] = {}

    # ---- requests in and out -------------------------------------------------------------

    def note_cached_prefix(self, request: Request) -> None:
        """Record how much of `request`'s prompt the prefix cache holds now (a pure lookup: the
        blocks are claimed at admission, and may be evicted before it), for the slack ranking
        and the monitor (monitor.policy.view_of)."""
        request.num_cached_prefix_tokens = self.kv_cache_manager.get_computed_blocks(request)[1]

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
        self._choose_rope_regime(request)
        self.note_cached_prefix(request)
        self.requests[request.request_id] = request
        leader = (self.requests.get(request.prefill_after)
                  if request.prefill_after is not None
                  and self.kv_cache_manager.enable_prefix_caching else None)
        if not self.siblings.park(request, leader):
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
            elif self.siblings.remove(req_id) is None:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Drop a request already taken out of ``running`` or ``waiting``; free its KV."""
        self.slack.on_finished(request.request_id)
        request.status = status
        request.finish_time = time.monotonic()
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._release_siblings(request)

    def _release_siblings(self, leader: Request) -> None:
        for sibling in self.siblings.release(leader.request_id):
            self.waiting.add(sibling)

    def fail_request(self, request: Request, error: str) -> None:
        """Finish one running request with an error (its sampling or its logits failed) and free
        its KV; its blocks' hashes are not committed, since their contents may be what went
        wrong."""
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
        if self.running or not self.waiting or (record is not None and record.kv_preempted):
            return []
        request = self.waiting.peek()
        kv = self.kv_cache_manager
        request.error = (
            f"request {request.request_id!r} could not be scheduled with nothing else running: "
            f"{request.num_tokens} tokens ({-(-request.num_tokens // kv.block_size)} KV blocks; "
            f"{kv.num_free_blocks} of {kv.pool.num_blocks} free), token budget "
            f"{self.config.max_num_batched_tokens}")
        return self.abort_requests([request.request_id], RequestStatus.FINISHED_ERROR)

    # ---- admission and preemption (also what the slack policy may ask for) ---------------

    def can_admit(self, request: Request) -> bool:
        """Whether ``request`` would be admitted by a step with the whole token budget."""
        return self.admission.plan(request, self.config.max_num_batched_tokens,
                                   len(self.running)) is not None

    def admit(self, request: Request, step: StepInProgress,
              budget: int | None = None) -> int | None:
        """Admit a waiting request into ``step`` with at most ``budget`` tokens (default: what the
        step has left); the caller takes it off the queue. The tokens scheduled, or None."""
        scheduled = self.admission.admit(request, step, self.running,
                                         step.budget if budget is None else budget)
        if (scheduled is not None and request.slack_at_admission_s is None
                and request.deadline is not None):
            now = time.monotonic()
            remaining = request.num_tokens - request.num_computed_tokens
            request.slack_at_admission_s = (request.deadline - now
                                            - self.slack.predict_prefill(remaining))
        return scheduled

    def requeue_for_recompute(self, request: Request) -> None:
        """Free a running request's KV and put it at the head of the waiting queue: it computes
        its whole sequence again when re-admitted (docs/design.md section 3)."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token in flight for it is dropped when it arrives: it samples that token again.
        request.num_output_placeholders = 0
        request.restart_prompt_logprobs()
        self._choose_rope_regime(request)
        self.waiting.prepend(request)

    def _choose_rope_regime(self, request: Request) -> None:
        """A request with nothing computed takes the rotary regime its sequence calls for
        (engine.core.long_rope); its block hashes chain from that regime's root."""
        assert request.num_computed_tokens == 0
        long_rope = (self.long_rope_after is not None
                     and request.num_tokens > self.long_rope_after)
        if long_rope != request.long_rope:
            request.long_rope = long_rope
            request.block_hashes.clear()

    def _crosses_long_rope(self, request: Request) -> bool:
        """Whether `request`'s KV is in LongRoPE's short regime while its sequence, pending
        tokens included, is now longer than the threshold."""
        return (self.long_rope_after is not None and not request.long_rope
                and request.num_tokens + request.num_output_placeholders > self.long_rope_after)

    def _preempt_for_kv(self, request: Request, step: StepInProgress) -> None:
        # Its suspended chunk (if any) lost its blocks; a held victim stays held, now waiting.
        self.slack.suspensions.discard(request.request_id)
        self.requeue_for_recompute(request)
        request.num_preemptions += 1
        request.num_kv_preemptions += 1
        self.num_kv_preemptions += 1
        step.record.kv_preempted.append(request)

    def urgency(self, request: Request) -> float:
        """Slack-EDF priority of a request now (higher is more urgent)."""
        return self.slack.urgency(request)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step: the slack policy's admissions first, then the running requests in
        order, then waiting ones while they fit."""
        self.slack.begin_step(self)
        self.step_id += 1
        step = StepInProgress(StepRecord(self.step_id, self.prev_scheduled_req_ids),
                              budget=self.config.max_num_batched_tokens)
        self.slack.admit_first(self, step)
        self._schedule_running(step)
        if not step.record.kv_preempted:
            # Blocks just taken from a victim must not go straight to a newcomer.
            self._admit_waiting(step)
        if not step.scheduled and not step.record.kv_preempted and self.slack.holds:
            # Only held requests could run: release them rather than send an empty step that
            # would come back forever.
            self.slack.holds.release_all()
            self._schedule_running(step)
            if not step.record.kv_preempted:
                self._admit_waiting(step)
        return self._output_of(step)

    def _schedule_running(self, step: StepInProgress) -> None:
        """Serve running requests in admission order, preempting for KV space."""
        kv = self.kv_cache_manager
        slack, holds, record = self.slack, self.slack.holds, step.record
        long_rope_after = self.long_rope_after
        i = 0
        while i < len(self.running) and step.budget > 0:
            request = self.running[i]
            req_id = request.request_id
            if long_rope_after is not None and self._crosses_long_rope(request) \
                    and req_id not in step.scheduled:
                if request.num_output_placeholders:
                    i += 1  # its crossing token is in flight: it switches once it arrives
                    continue
                # HF computes the whole sequence again with the long factors: so does it,
                # from the waiting queue's head (engine.core.long_rope).
                self.slack.suspensions.discard(req_id)
                self.requeue_for_recompute(request)
                continue
            num_new = self._tokens_for_running(request, slack.join_budget(step, request))
            if num_new == 0 or (holds and holds.is_held(req_id)) or req_id in step.scheduled:
                # Its sampled token has not arrived yet; nothing to compute until it does.
                i += 1
                continue
            num_blocks_before = kv.num_blocks_of(req_id)
            num_victims = len(record.kv_preempted)
            while not kv.allocate_slots(request, num_new):
                victim = self.slack.choose_kv_victim(self.running, step)
                if victim.request_id in step:
                    # The priority and slo policies may pick a request already served this step.
                    step.drop(victim.request_id)
                self._preempt_for_kv(victim, step)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                # It was its own victim: nothing left running can free blocks for anyone after it.
                break
            record.prev_num_computed_tokens[req_id] = request.num_computed_tokens
            if kv.num_blocks_of(req_id) > num_blocks_before:
                # Most decodes' tables already cover their token: nothing to record.
                record.new_block_ids[req_id] = kv.block_ids_from(req_id, num_blocks_before)
            step.add(request, num_new)
            # Victims of the priority policy may have sat before it, shifting its index (a
            # search only then: at every request it would make the step quadratic in the batch).
            i = (i + 1 if len(record.kv_preempted) == num_victims
                 else self.running.index(request) + 1)

    def _tokens_for_running(self, request: Request, budget: int) -> int:
        suspended = self.slack.suspensions.next_chunk(request.request_id)
        if suspended is not None:
            # The workers hold its stopped pass: it resumes as much of its first segment as the
            # budget (capped by the deadlines and TPOT of the step) allows.
            return resume_piece(suspended.num_tokens, budget)
        if request.num_output_placeholders and not request.may_decode_ahead(self.max_model_len):
            return 0  # its next input is in flight, and it may not be decoded ahead of it
        return chunk_size(request.num_tokens_owed, budget, self.config.long_prefill_token_threshold)

    def _admit_waiting(self, step: StepInProgress) -> None:
        """Admit waiting requests (held victims skipped) in queue order while they fit."""
        with self.slack.holds.waiting_past_held(self.waiting) as next_waiter:
            while step.budget > 0 and (request := next_waiter()) is not None:
                budget = self.slack.join_budget(step, request)
                if budget <= 0 or self.admit(request, step, budget) is None:
                    break  # head-of-line: nothing behind it jumps ahead, so it cannot starve
                self.waiting.pop()

    def _output_of(self, step: StepInProgress) -> SchedulerOutput:
        kv = self.kv_cache_manager
        output = SchedulerOutput(step_id=self.step_id, requests=[],
                                 free_suspended=self.slack.suspensions.take_unneeded(),
                                 released_req_ids=kv.take_released())
        num_prefill_tokens = 0
        for request, num_new in step.scheduled.values():
            scheduled = scheduled_request(request, num_new, kv, self.slack.suspensions)
            if scheduled.sample:
                step.record.sampled.append(request.request_id)
            output.requests.append(scheduled)
            if num_new > 1:
                num_prefill_tokens += num_new
        self.num_scheduled_tokens_total += output.num_scheduled_tokens
        # Decode-only and small steps end sooner than a preemption would pay off: no vote.
        output.preemptible = (self.slo_preempt_min_tokens is not None and num_prefill_tokens > 0
                              and num_prefill_tokens >= self.slo_preempt_min_tokens)
        output.suspend_on_unwind = output.preemptible and self.slack.slo_preempt_mode == "suspend"
        self.prev_scheduled_req_ids = frozenset(step.scheduled)
        self.last_step_record = step.record
        return output

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the step in flight is read back
        (async scheduling): only as a decode of the running requests, which never votes.
        Nothing may wait, be held or be suspended (a prefill step waits for the pipeline to
        drain), and every running request must be a decode that may run ahead of its token."""
        slack = self.slack
        if (not self.running or self.waiting or slack.holds or slack.suspensions.suspended
                or slack.urgent_waiter_id is not None):
            return False
        max_model_len = self.max_model_len
        return all(r.num_tokens_owed == 1 and r.may_decode_ahead(max_model_len)
                   for r in self.running)

    # ---- after the forward pass ----------------------------------------------------------

    def rollback(self, record: StepRecord, keep: Iterable[ScheduledRequest] = (),
                 stopped_layer: int = 0) -> None:
        """Undo the last ``schedule()`` after its forward pass was abandoned (see StepRecord).

        Afterwards the scheduler is as it was before that call, except that step ids stay spent
        and requests preempted for KV space in that step stay preempted (their blocks may already
        be reused). ``keep``: chunks of that step whose pass is suspended (the workers hold its
        activations); their requests keep their admissions and blocks, and each chunk goes back
        to not computed, to be resumed whole at ``stopped_layer``, the layer the pass stopped
        before (the slack policy's suspended chunks).
        """
        if record is not self.last_step_record:
            raise ValueError(f"only the last step can be rolled back (step {record.step_id} "
                             f"given, last is {self.step_id})")
        kept = {sr.req_id: sr for sr in keep}
        undone = record.undo(self.requests, self.kv_cache_manager,
                             {req_id: sr.start_pos for req_id, sr in kept.items()})
        for req_id, sr in kept.items():
            self.slack.suspensions.suspend(req_id, sr.start_pos, len(sr.token_ids), stopped_layer)
        for admission in reversed(undone):
            self.running.remove(admission.request)
            admission.undo(self.kv_cache_manager)
            self.waiting.prepend(admission.request)
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
        live = live_requests(scheduler_output, runner_output, self.is_running)
        outputs: list[Request] = []
        requests, commit = self.requests, self.kv_cache_manager.commit_computed_blocks
        failed, prompt_logprobs_of = runner_output.failed, runner_output.prompt_logprobs
        sampled, logprobs_of = runner_output.sampled_token_ids, runner_output.logprobs
        # The moment this step's tokens are taken in: one clock read for all of them.
        now = time.monotonic()
        for sr in live:
            req_id = sr.req_id
            request = requests[req_id]
            if sr.resume:
                self.slack.suspensions.resumed(req_id, len(sr.token_ids))
            if failed and (error := failed.get(req_id)) is not None:
                self.fail_request(request, error)
                outputs.append(request)
                continue
            commit(request, sr.start_pos + len(sr.token_ids))
            if (prompt_logprobs_of
                    and (prompt_logprobs := prompt_logprobs_of.get(req_id)) is not None):
                request.add_prompt_logprobs(prompt_logprobs)
            if not sr.sample:
                continue
            request.num_output_placeholders -= 1
            token = sampled[req_id]
            if request.grammar is not None and not request.grammar.accept(token):
                # The step's mask allowed it, so the grammar and the mask disagree: a bug, and
                # this request's alone.
                self.fail_request(request, f"structured outputs: the grammar refused sampled "
                                           f"token {token}")
                outputs.append(request)
                continue
            request.append_output_token(token, logprobs_of.get(req_id) if logprobs_of else None)
            request.last_token_time = now
            if request.first_token_time is None:
                request.first_token_time = request.last_token_time
                self._release_siblings(request)
            status = stop_status(request, self.max_model_len)
            if status is None and request.grammar is not None and request.grammar.is_terminated:
                status = RequestStatus.FINISHED_STOPPED  # its stop token (ignore_eos): complete
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(request)
        return outputs

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
    def step_time_predictor(self) -> StepTimePredictor:
        """The step-time predictor the slack policy prices prefills with, for code that holds
        only a scheduler; whoever feeds it steps holds it from its owner (EngineCore)."""
        return self.slack.predictor

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
                              num_slo_preemptions=self.slack.num_slo_preemptions,
                              num_scheduled_tokens=self.num_scheduled_tokens_total,
                              num_steps=self.step_id,
                              ttft_predictor_relative_error=(
                                  self.slack.predictor.current.relative_error),
                              ttft_model=self._ttft_model_fields())

    def _ttft_model_fields(self) -> dict[str, float | bool | None]:
        """The predictor's current model as fields, built once per model (a refit replaces
        the model; stats are taken every step)."""
        current = self.slack.predictor.current
        if self._stats_model is not current:
            self._stats_model, self._stats_model_fields = current, current.to_dict()
        return self._stats_model_fields

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants()
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        assert len(set(running_ids)) == len(running_ids), "a request is running twice"
        assert len(set(waiting_ids)) == len(waiting_ids), "a request is waiting twice"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        parked = self.siblings.parked_ids
        assert not parked & (set(running_ids) | set(waiting_ids)), "a parked request is queued"
        assert set(running_ids) | set(waiting_ids) | parked == set(self.requests), \
            "request lost or leaked"
        assert len(self.running) <= self.config.max_num_seqs
        kv = self.kv_cache_manager
        assert set(kv.req_blocks) <= set(running_ids), "a request that is not running holds KV"
        self.slack.check_invariants(set(self.requests), set(running_ids))
        if (record := self.last_step_record) is not None:
            record.check_invariants(self.prev_scheduled_req_ids)
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id} in running is {r.status.name}"
            # A suspended first chunk has its blocks and layers but no computed tokens yet.
            assert (0 < r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders
                    or self.slack.suspensions.is_suspended(r.request_id))
            assert 0 <= r.num_output_placeholders <= 2, r.num_output_placeholders
            assert kv.num_blocks_of(r.request_id) * kv.block_size >= r.num_computed_tokens
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status.name
            assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0


def resume_piece(held: int, budget: int) -> int:
    """Tokens of a suspended segment of `held` tokens to resume within `budget`: all of it,
    else a piece of at least MIN_RESUME_PIECE tokens that leaves at least that many (a
    one-token piece would look like a decode to everything that counts steps), else none."""
    if held <= budget:
        return held
    piece = min(budget, held - MIN_RESUME_PIECE)
    return piece if piece >= MIN_RESUME_PIECE else 0
