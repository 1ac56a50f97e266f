"""The slack-aware scheduling policy (docs/design.md sections 4 and 5), composed into the
token-budget scheduler of `engine/core/scheduler.py`: the scheduler owns one `SlackPolicy` and
calls its hooks.

- `slo` policy: running and waiting requests are ranked by urgency every step; waiters more
  urgent than every running prefill are admitted first, and the rest of their step is capped to
  the tightest deadline it can still meet. Decodes with a TPOT objective come before everything
  else (their tokens are reserved before the urgent admissions), and the step's prefill is capped
  so that its predicted time fits the tightest of their next-token deadlines (Sarathi's
  stall-free batching, driven by deadlines).
- SLO preemption: applying the monitor's decision to its victim after a rollback,
  holding victims back until they are the most urgent again, admitting the waiter first, and
  the suspended chunks that resume where their pass stopped (suspend mode).

The policy ranks and admits, and applies a preemption to its victim; three collaborators hold
the rest, each with its own state: `caps` (engine/core/deadline_caps.py: the tokens a step may
take by the deadlines it serves), `holds` (engine/core/preemption_holds.py: victims and kept
chunks held back, and when they run again) and `suspensions` (engine/core/suspension_ledger.py:
the suspended chunks the workers hold, and the ones to free). The policy owns them, the step's
context the caps read (the running decodes), the urgent waiter, the preempt mode and the count
of SLO preemptions. The step-time predictor it prices prefills with is EngineCore's, handed in
through the scheduler. What it needs of the scheduler it gets through `SchedulerOps`, passed to
the hooks that need it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

from engine.config import SchedulingPolicy, SLOPreemptMode
from engine.core.deadline_caps import DeadlineCaps, StepContext, is_tpot_decode
from engine.core.preemption_holds import PreemptionHolds
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, UrgencyQueue
from engine.core.step_record import StepInProgress
from engine.core.suspension_ledger import SuspensionLedger
from monitor.policy import AGED_PRIORITY, rank_requests, request_urgency
from monitor.predictor import StepTimePredictor
from monitor.step_time_model import optimistic_prefill, predict_prefill

logger = logging.getLogger(__name__)


class SchedulerOps(Protocol):
    """What the slack policy sees of the scheduler and may ask it to do (`Scheduler` is one)."""

    @property
    def waiting(self) -> RequestQueue: ...

    @property
    def running(self) -> list[Request]:
        """Admission order; the policy may re-rank it in place (slo policy)."""

    def get_request(self, req_id: str) -> Request | None: ...

    def can_admit(self, request: Request) -> bool:
        """The admission test, with a whole step's budget."""

    def admit(self, request: Request, step: StepInProgress,
              budget: int | None = None) -> int | None:
        """Admit a waiting request into ``step`` (at most ``budget`` tokens, default: what the
        step has left); the caller takes it off the queue. The tokens scheduled, or None."""

    def requeue_for_recompute(self, request: Request) -> None:
        """Free a running request's KV and put it at the head of the waiting queue."""


def _running_rank(request: Request, position: int, contested: bool) -> tuple[int, int]:
    """Sort key of the running set under the slo policy: TPOT decodes first; then, while a
    running prefill has a live deadline (`contested`, a doomed one's too), every other decode;
    then by `position` in the ranking (SlackPolicy.rank, the waiting queue's order). A decode
    costs one token of the budget and the caps already count the running decodes' time
    (the step-time model's decode term); ranked by urgency instead, a request past its first
    token (no deadline) would wait behind every prefill with a deadline, however relaxed or
    late, for each of its next tokens. With no deadline anywhere nothing is contested and the
    ranking keeps the given order: the order stays fcfs's."""
    if is_tpot_decode(request):
        return (0, 0)
    if contested and request.num_tokens_owed == 1:
        return (1, 0)
    return (2, position)


class SlackPolicy:
    """The slack-aware hooks of one scheduler: ranking, admissions ahead of the running set,
    the KV-pressure victim and what an SLO preemption does to its victim."""

    def __init__(self, scheduling_policy: SchedulingPolicy, slo_preempt_mode: SLOPreemptMode,
                 predictor: StepTimePredictor, aging_bound_s: float | None = None,
                 chunk_tokens: int = 0) -> None:
        """`predictor`: the engine's step-time predictor, read here and never fed (its owner
        feeds it the engine's steps)."""
        self.scheduling_policy = scheduling_policy
        # The step budget: a longer prefill runs as chunks of it, each a step of its own
        # (monitor.step_time_model.predict_prefill); 0 prices any prefill as one step.
        self.chunk_tokens = chunk_tokens
        self.aging_bound_s = aging_bound_s
        # What a mid-forward preemption does to its victim (docs/design.md section 4).
        self.slo_preempt_mode = slo_preempt_mode
        # The slo policy ranks by slack, which needs predicted prefill times.
        self._predictor = predictor
        self.holds = PreemptionHolds()
        # Suspend mode: the chunks whose stopped passes the workers hold.
        self.suspensions = SuspensionLedger()
        # The running decodes and the deepest running prefix as of begin_step.
        self._context = StepContext()
        self.caps = DeadlineCaps(predictor, self._context, self.holds, self.predict_prefill)
        # The waiter a mid-forward preemption made room for: admitted first by the next step.
        self.urgent_waiter_id: str | None = None
        self.num_slo_preemptions = 0

    @property
    def predictor(self) -> StepTimePredictor:
        return self._predictor

    def urgency(self, request: Request, now: float | None = None) -> float:
        """Slack-EDF priority of a request (higher is more urgent); ``now`` defaults to now."""
        return request_urgency(request, time.monotonic() if now is None else now,
                               self.predict_prefill, self.aging_bound_s,
                               self._optimistic_prefill)

    def rank(self, requests: Iterable[Request], now: float | None = None) -> list[Request]:
        """The slo policy's order of `requests` (monitor.policy.rank; ties keep the given
        order): aged first; rescuable by urgency, each doomed one (earliest deadline first)
        ahead of every one whose slack covers its predicted prefill; then those without a
        deadline. The waiting queue, the running set, outranking admissions and the release of
        held victims all follow it."""
        return rank_requests(requests, time.monotonic() if now is None else now,
                             self.predict_prefill, self.aging_bound_s, self._optimistic_prefill)

    def _optimistic_prefill(self, tokens: int) -> float:
        """The fastest `tokens` of prefill are likely to run beside the running decodes: a
        request is doomed only if late even then."""
        return optimistic_prefill(self._predictor.current, tokens, self._context.decode_context,
                                  self.chunk_tokens)

    def predict_prefill(self, tokens: int) -> float:
        """Seconds to prefill `tokens` in chunks of the step budget, in steps that also carry
        the running decodes."""
        return predict_prefill(self._predictor.current, tokens, self._context.decode_context,
                               self.chunk_tokens)

    # ---- hooks of one step, in the order schedule() calls them ----------------------------

    def begin_step(self, ops: SchedulerOps) -> None:
        """slo policy: urgency moves with the clock, so rank running and waiting requests once
        per step; the least urgent running request ends up last, which makes it the
        KV-pressure victim. Then release the held victims whose turn came.

        One pass over the running set gathers what the step needs of it; where no running
        request has a live deadline or an inter-token objective (a batch of decodes past their
        first output, most steps of a busy server), the ranking is the given order and the
        running set is not sorted (the sort's keys would all be (2, position))."""
        context, holds = self._context, self.holds
        decodes: list[Request] = []
        decode_context = 0
        deepest_prefix = 0
        timed = False  # a live deadline or an inter-token objective somewhere in the running set
        for request in ops.running:
            timed = timed or request.live_deadline is not None or is_tpot_decode(request)
            if holds and holds.is_held(request.request_id):
                continue
            owed = request.num_tokens_owed
            if owed == 1:
                decodes.append(request)
                decode_context += request.num_tokens
            elif owed > 1 and request.num_computed_tokens > deepest_prefix:
                deepest_prefix = request.num_computed_tokens
        context.decodes, context.decode_context = decodes, decode_context
        if self.scheduling_policy == "slo":
            if timed:
                now = time.monotonic()
                position = {r.request_id: i for i, r in enumerate(self.rank(ops.running, now))}
                contested = any(r.live_deadline is not None for r in ops.running
                                if r.num_tokens_owed > 1)
                ops.running.sort(key=lambda r: _running_rank(r, position[r.request_id],
                                                             contested))
            waiting = ops.waiting
            assert isinstance(waiting, UrgencyQueue)
            waiting.refresh(self.rank)
        if holds:
            holds.release_due(ops, self.rank)
            deepest_prefix = max((r.num_computed_tokens for r in ops.running
                                  if r.num_tokens_owed > 1
                                  and not holds.is_held(r.request_id)), default=0)
        context.deepest_prefix = deepest_prefix

    def admit_first(self, ops: SchedulerOps, step: StepInProgress) -> None:
        """Admissions that go before the running set is served: the waiter a mid-forward
        preemption made room for; then (slo policy) waiters that outrank every running
        prefill, after which the rest of the step's budget is capped to the tightest deadline
        the step can still meet."""
        # slo policy: the TPOT decodes' tokens are kept out of the urgent admissions' reach.
        reserved = 0
        if self.scheduling_policy == "slo":
            reserved = min(step.budget, len(self.caps.tpot_decodes(ops, step)))
            step.budget -= reserved
        if self.urgent_waiter_id is not None:
            self._admit_urgent_waiter(ops, step)
        if self.scheduling_policy == "slo":
            self._admit_outranking_waiters(ops, step)
            # Admitted ahead of the running prefills for their deadlines: they stream as
            # interactive turns from now on (DeadlineCaps.cap_for_tpot), as a preemption's
            # waiter does.
            for request in step.with_deadline.values():
                request.served_urgently = True
            step.budget += reserved
            step.budget = min(self.caps.cap_for_deadlines(step),
                              self.caps.cap_for_tpot(ops, step))

    def join_budget(self, step: StepInProgress, request: Request) -> int:
        """The tokens `request` (a running chunk or a waiting admission) may add to `step`: the
        step's budget left, under the slo policy capped by the deadlines the step serves
        (DeadlineCaps.join_budget). A step that serves no deadline yet (most decode steps) caps
        nothing."""
        if self.scheduling_policy != "slo" or not step.with_deadline:
            return step.budget
        return self.caps.join_budget(step, request)

    def choose_kv_victim(self, running: list[Request], step: StepInProgress) -> Request:
        """The running request to preempt (recompute) when another cannot get KV blocks."""
        # Never one admitted by this very step: it was admitted because it fit (the urgent
        # waiter a mid-forward preemption made room for, first of all), and taking it back
        # would only undo that decision while the step record still lists the admission.
        admitted = step.record.admitted_ids()
        candidates = [r for r in running if r.request_id not in admitted]
        paused = [r for r in candidates if self.holds.is_held(r.request_id)]
        if paused:
            # A paused request holds KV nobody is using: under KV pressure it goes first
            # (pause falls back to recompute).
            return paused[-1]
        if self.scheduling_policy == "priority":
            # Scan newest first so that among equals the most recently admitted one goes.
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    # ---- the slo policy's admissions ------------------------------------------------------

    def _admit_urgent_waiter(self, ops: SchedulerOps, step: StepInProgress) -> None:
        waiter_id, self.urgent_waiter_id = self.urgent_waiter_id, None
        request = ops.get_request(waiter_id or "")
        if request is None:
            return  # gone
        # It streams as an interactive turn from now on (DeadlineCaps.cap_for_tpot). Marked
        # here, not when the preemption is applied: an arrival may reach the scheduler only
        # after that.
        request.served_urgently = True
        if request.status is RequestStatus.RUNNING:
            return  # already in
        if ops.admit(request, step) is not None:
            ops.waiting.remove(request)

    def _admit_outranking_waiters(self, ops: SchedulerOps, step: StepInProgress) -> None:
        """Waiters with a deadline that the ranking puts ahead of every running prefill go
        before the running set, instead of getting what budget the running set leaves (a
        doomed one too, where every running prefill's slack covers its prefill)."""
        now = time.monotonic()
        running_prefills = [r for r in ops.running
                            if r.awaiting_first_output and not self.holds.is_held(r.request_id)
                            and r.request_id not in step]
        if not running_prefills:
            return  # nothing to jump over: the usual order serves them just as well
        # Ranked together, running first: a waiter that only ties with a running prefill
        # does not jump it.
        waiters = [r for r in ops.waiting
                   if r.live_deadline is not None and not self.holds.is_held(r.request_id)]
        running_ids = {r.request_id for r in running_prefills}
        outranking: set[str] = set()
        for request in self.rank([*running_prefills, *waiters], now):
            if request.request_id in running_ids:
                break
            outranking.add(request.request_id)
        with self.holds.waiting_past_held(ops.waiting) as next_waiter:
            while step.budget > 0 and (request := next_waiter()) is not None:
                if request.request_id not in outranking:
                    break
                # Each admission may take only what keeps the ones before it (more urgent)
                # in time.
                allowed = self.caps.cap_for_deadlines(step)
                if allowed <= 0 or ops.admit(request, step, allowed) is None:
                    break
                ops.waiting.pop()

    # ---- mid-forward preemption (docs/design.md section 4) --------------------------------------

    def preempt_for_slo(self, ops: SchedulerOps, victim_id: str, waiter_id: str,
                        kept: Iterable[str] = ()) -> SLOPreemptMode | None:
        """Apply the monitor's preemption after the step was rolled back. Returns the mode
        applied: "pause" and "suspend" fall back to "recompute" when the waiter would not be
        admitted beside the victim (the admission test itself decides), and "suspend" to
        "pause" when the rollback kept no suspended chunk of the victim (its pass stopped
        before the first layer finished); None when the victim is gone (or was already
        preempted once: Rule 1), so the step just re-runs.

        Rule 1 exists so that no arrival pattern makes the engine redo work forever. In suspend
        mode an unwind throws no prefill work away (each chunk resumes where it stopped), so
        there a victim may be preempted again, and a step holding only earlier victims can
        still make room for an urgent arrival.

        A victim admitted by the rolled-back step itself and not kept is back in the waiting
        queue with no KV: whatever the mode, it is held back and computes its prompt from the
        start, which is what "recompute" reports.

        ``kept``: the chunks the rollback kept (suspend mode). They, and the victim, are held
        until the waiter's client has its first output: a chunk resumed beside the waiter would
        make the step that serves it as long as the one just stopped."""
        victim = ops.get_request(victim_id)
        if victim is None or self.protected_by_rule1(victim):
            return None
        self.urgent_waiter_id = waiter_id
        victim.num_preemptions += 1
        victim.num_slo_preemptions += 1
        self.num_slo_preemptions += 1
        waiter = ops.get_request(waiter_id)
        if waiter is not None:
            self._charge_aged_yield(ops, waiter)
        self.holds.hold(victim_id, kept, waiter_id)
        logger.debug("slo preemption: victim %s for waiter %s, held %s", victim_id, waiter_id,
                     sorted(self.holds.held))
        if victim.status is not RequestStatus.RUNNING:
            return "recompute"
        # The victim may keep its KV and its sequence slot only if the next step (which
        # admits the waiter first, before anything else changes) admits the waiter beside it:
        # else it would be held for a waiter that never comes in.
        if self.slo_preempt_mode != "recompute" and (
                waiter is None or waiter.status is RequestStatus.RUNNING or ops.can_admit(waiter)):
            return "suspend" if self.suspensions.is_suspended(victim_id) else "pause"
        self.suspensions.discard(victim_id)
        ops.requeue_for_recompute(victim)
        return "recompute"

    def _charge_aged_yield(self, ops: SchedulerOps, waiter: Request) -> None:
        """Every aged request running in the stopped step (aged: still awaiting its first
        output) yielded the waiter's predicted prefill (monitor.policy.AGED_YIELD_SHARE)."""
        now = time.monotonic()
        cost = self.predict_prefill(max(0, waiter.num_tokens - max(
            waiter.num_computed_tokens, waiter.num_cached_prefix_tokens)))
        for request in ops.running:
            if self.urgency(request, now) >= AGED_PRIORITY:
                request.aged_yield_s += cost

    def protected_by_rule1(self, request: Request) -> bool:
        """Rule 1: a request the monitor preempted once is never its victim again, except in
        suspend mode (see preempt_for_slo)."""
        return self.slo_preempt_mode != "suspend" and request.num_slo_preemptions > 0

    # ---- the end of a request ------------------------------------------------------------

    def on_finished(self, req_id: str) -> None:
        """Finished or aborted: nothing of it is held or resumed any more."""
        self.holds.release(req_id)
        self.suspensions.discard(req_id)

    def check_invariants(self, live_ids: set[str], running_ids: set[str]) -> None:
        self.holds.check_invariants(live_ids)
        self.suspensions.check_invariants(running_ids)
