"""The slack-aware parts of the scheduler (DESIGN.md sections 4 and 5), kept apart from the
token-budget mechanics in `engine/core/scheduler.py`.

- `slo` policy: waiters more urgent than every running prefill are admitted first, and the rest
  of their step is capped to the tightest deadline it can still meet.
- Mid-forward preemption: applying the monitor's decision to its victim after a rollback,
  holding victims back until they are the most urgent again, and admitting the waiter first.

A mixin of `Scheduler`: it reads and changes the scheduler's state (declared below for readers
and type checkers) and calls its `_admit`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from engine.config import SLOPreemptMode, SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue
from engine.core.step_record import StepRecord
from monitor.policy import request_urgency
from monitor.predictor import OnlineTTFT


# Share of a protected request's time left that the deadline cap leaves unfilled: the predictor
# errs (10% RMS on held-out prompt sizes for the default model) and a decode over a long context
# costs far more than the one token the cap counts for it.
DEADLINE_HEADROOM = 0.25


class SlackAwareScheduling:
    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    requests: dict[str, Request]
    waiting: RequestQueue
    running: list[Request]
    ttft_predictor: OnlineTTFT
    held: set[str]
    urgent_waiter_id: str | None
    num_slo_preemptions: int
    suspended: dict[str, tuple[int, int]]
    slo_preempt_mode: SLOPreemptMode
    unneeded_suspensions: list[str]

    if TYPE_CHECKING:
        def _admit(self, request: Request, budget: int,
                   scheduled: dict[str, tuple[Request, int]], record: StepRecord) -> int | None:
            ...

        def can_admit(self, request: Request) -> bool:
            ...

        def waiting_past_held(self) -> AbstractContextManager[Callable[[], Request | None]]:
            ...

    def _admit_urgent_waiter(
        self, budget: int, scheduled: dict[str, tuple[Request, int]], record: StepRecord
    ) -> int:
        """Admit the waiter a mid-forward preemption made room for, ahead of the running set.
        Returns the budget it took (0 if it is gone or still does not fit)."""
        request = self.requests.get(self.urgent_waiter_id or "")
        self.urgent_waiter_id = None
        if request is None or request.status is RequestStatus.RUNNING:
            return 0
        num_new = self._admit(request, budget, scheduled, record)
        if num_new is None:
            return 0
        self.waiting.remove(request)
        return num_new

    def _admit_outranking_waiters(
        self, budget: int, scheduled: dict[str, tuple[Request, int]], record: StepRecord,
        running_urgency: dict[str, float]
    ) -> int:
        """slo policy: waiters with a deadline that are more urgent than every running prefill
        go before the running set, instead of getting what budget the running set leaves.
        `running_urgency`: this step's ranking of the running set. Returns the budget taken."""
        now = time.monotonic()
        predict = self.ttft_predictor.predict
        running_prefills = [running_urgency[r.request_id] for r in self.running
                            if r.first_token_time is None and r.request_id not in self.held
                            and r.request_id not in scheduled]
        if not running_prefills:
            return 0  # nothing to jump over: the usual order serves them just as well
        top = max(running_prefills)
        used = 0
        with self.waiting_past_held() as next_waiter:
            while used < budget and (request := next_waiter()) is not None:
                if request.deadline is None or request_urgency(request, now, predict) <= top:
                    break
                # Each admission may take only what keeps the ones before it (more urgent)
                # in time.
                allowed = self._cap_for_deadlines(budget - used, scheduled)
                if allowed <= 0:
                    break
                num_new = self._admit(request, allowed, scheduled, record)
                if num_new is None:
                    break
                self.waiting.pop()
                used += num_new
        return used

    def _cap_for_deadlines(self, budget: int, scheduled: dict[str, tuple[Request, int]]) -> int:
        """slo policy: a step lasts as long as all its tokens take, and every request in it
        gets its first token only at its end. So the requests added after the urgent ones may
        add only as many tokens as keep the predicted step time within the tightest deadline
        that this step can still meet (a deadline that its own chunk alone would miss
        constrains nothing)."""
        if not scheduled:
            return budget
        now = time.monotonic()
        line = self.ttft_predictor.current
        used = sum(n for _, n in scheduled.values())
        allowed = budget
        for request, num_new in scheduled.values():
            deadline = request.deadline
            if (deadline is None or request.first_token_time is not None
                    or request.num_computed_tokens + num_new < request.num_tokens):
                continue
            time_left = deadline - now
            if line.predict(num_new) > time_left:
                continue  # doomed even alone: nothing left to protect
            # As if the step were one prompt: overestimates a mixed step's attention, so the
            # cap errs on the side of the deadline.
            usable = time_left * (1 - DEADLINE_HEADROOM)
            allowed = min(allowed, max(0, line.max_tokens_within(usable) - used))
        return allowed

    # ---- mid-forward preemption (DESIGN.md section 4) --------------------------------------

    def preempt_for_slo(self, victim_id: str, waiter_id: str) -> SLOPreemptMode | None:
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
        start, which is what "recompute" reports."""
        victim = self.requests.get(victim_id)
        if victim is None or self.protected_by_rule1(victim):
            return None
        mode = self.slo_preempt_mode
        self.urgent_waiter_id = waiter_id
        victim.num_preemptions += 1
        victim.num_slo_preemptions += 1
        self.num_slo_preemptions += 1
        self.held.add(victim_id)
        if victim.status is not RequestStatus.RUNNING:
            return "recompute"
        waiter = self.requests.get(waiter_id)
        # The victim may keep its KV and its sequence slot only if the next step (which
        # admits the waiter first, before anything else changes) admits the waiter beside it:
        # else it would be held for a waiter that never comes in.
        if mode != "recompute" and (waiter is None or waiter.status is RequestStatus.RUNNING
                                    or self.can_admit(waiter)):
            return "suspend" if victim_id in self.suspended else "pause"
        if victim_id in self.suspended:
            self.drop_suspensions([victim_id])
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.waiting.prepend(victim)
        return "recompute"

    def protected_by_rule1(self, request: Request) -> bool:
        """Rule 1: a request the monitor preempted once is never its victim again, except in
        suspend mode (see preempt_for_slo)."""
        return self.slo_preempt_mode != "suspend" and request.num_slo_preemptions > 0

    def drop_suspensions(self, req_ids: list[str]) -> None:
        """These suspended chunks will not resume: the workers free them with the next step."""
        for req_id in req_ids:
            self.suspended.pop(req_id, None)
        self.unneeded_suspensions.extend(req_ids)

    def _release_held(self) -> None:
        """A held victim runs again once no request with prefill left (waiting or running,
        and not held itself) is more urgent than it."""
        now = time.monotonic()
        predict = self.ttft_predictor.predict
        held = self.held
        contenders = [r for r in (*self.waiting, *self.running)
                      if r.request_id not in held and r.first_token_time is None]
        best = max((request_urgency(r, now, predict) for r in contenders), default=-math.inf)
        for req_id in list(held):
            if request_urgency(self.requests[req_id], now, predict) >= best:
                held.discard(req_id)
