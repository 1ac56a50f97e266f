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

The policy owns that state (the TTFT predictor, held victims, the urgent waiter, suspended
chunks and the ones to free, the preempt mode, the count of SLO preemptions). What it needs of
the scheduler it gets through `SchedulerOps`, passed to the hooks that need it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple, Protocol

from engine.config import SchedulingPolicy, SLOPreemptMode
from engine.core.request import Request, RequestStatus
from engine.core.request_queue import RequestQueue, UrgencyQueue
from engine.core.step_record import StepInProgress
from monitor.policy import AGED_PRIORITY, DEADLINE_HEADROOM, rank_requests, request_urgency
from monitor.predictor import (LinearTTFT, OnlineTTFT, attention_work, optimistic_prefill,
                               predict_prefill)

logger = logging.getLogger(__name__)


# The share the running decodes may add to the predicted time of a step that already makes an
# urgent request late: below it they join (its lateness hardly changes, their streams go on).
DECODES_SHARE = 0.1


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
    (monitor/predictor.py's decode term); ranked by urgency instead, a request past its first
    token (no deadline) would wait behind every prefill with a deadline, however relaxed or
    late, for each of its next tokens. With no deadline anywhere nothing is contested and the
    ranking keeps the given order: the order stays fcfs's."""
    if _is_tpot_decode(request):
        return (0, 0)
    if contested and request.num_tokens_owed == 1:
        return (1, 0)
    return (2, position)


def _is_tpot_decode(request: Request) -> bool:
    """A decoding request with an inter-token objective: a TPOT objective, or the gap of an
    interactive turn (a request a mid-forward preemption was made for, see `gap_objective`):
    its next token is due. (One recomputing its sequence after a KV preemption owes more than
    a token: it is prefilling.)"""
    return ((request.tpot_slo_ms is not None or request.served_urgently)
            and request.last_token_time is not None and request.num_tokens_owed <= 1)


# An interactive turn's next token is due within this many decode-only steps of its last one.
INTERACTIVE_GAP_STEPS = 2.0


def gap_objective(request: Request, decode_step_s: float) -> float:
    """Seconds its next token may take after its last one: its TPOT objective; a request a
    mid-forward preemption was made for streams as an interactive turn, within
    max(2 x its TPOT objective, 2 x a decode-only step) (docs/design.md section 9). Its TPOT
    objective alone is the tighter of the two where it has one, and is what binds."""
    if request.tpot_slo_ms is not None:
        return request.tpot_slo_ms / 1000
    return INTERACTIVE_GAP_STEPS * decode_step_s


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


class SlackPolicy:
    def __init__(self, scheduling_policy: SchedulingPolicy, slo_preempt_mode: SLOPreemptMode,
                 ttft_seed: LinearTTFT | None = None, error_quantile: float = 0.9,
                 aging_bound_s: float | None = None, chunk_tokens: int = 0) -> None:
        self.scheduling_policy = scheduling_policy
        # The step budget: a longer prefill runs as chunks of it, each a step of its own
        # (monitor.predictor.predict_prefill); 0 prices any prefill as one step.
        self.chunk_tokens = chunk_tokens
        self.aging_bound_s = aging_bound_s
        # What a mid-forward preemption does to its victim (docs/design.md section 4).
        self.slo_preempt_mode = slo_preempt_mode
        # The slo policy ranks by slack, which needs predicted prefill times.
        self.predictor = OnlineTTFT(ttft_seed, error_quantile=error_quantile)
        # Not scheduled: victims of SLO preemptions and the chunks kept from the steps
        # they stopped, held back until their waiter's client has its first output (and
        # victims until no request with prefill left is more urgent than they are). A paused one stays running
        # with its KV; a recomputed one waits and is not admitted (else it would share the very
        # next step with the waiter it made room for).
        self.held: set[str] = set()
        # Held request -> the waiter of the preemption that held it: whatever else, it stays
        # held until that waiter's client has its first output (or it is gone), so that the
        # waiter's steps are its own (the victim, and every chunk kept from the unwound step).
        self.yielding_to: dict[str, str] = {}
        # The held requests that are victims: once their waiter is served, they also wait
        # until they are the most urgent again.
        self.victims: set[str] = set()
        # The waiter a mid-forward preemption made room for: admitted first by the next step.
        self.urgent_waiter_id: str | None = None
        # Suspend mode: request id -> the segments whose activations the workers hold.
        self.suspended: dict[str, list[SuspendedChunk]] = {}
        # Suspended chunks the workers can free; sent with the next step.
        self.unneeded_suspensions: list[str] = []
        self.num_slo_preemptions = 0
        # The running decodes as of begin_step: every step until they finish carries them, so
        # prefills are predicted beside the KV they read.
        self._decodes: list[Request] = []
        self._decode_context = 0
        # The deepest prefix a running prefill chunk would attend over this step (begin_step):
        # what the deadline cap charges the chunks that may join the urgent ones.
        self._deepest_prefix = 0

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
        return optimistic_prefill(self.predictor.current, tokens, self._decode_context,
                                  self.chunk_tokens)

    def predict_prefill(self, tokens: int) -> float:
        """Seconds to prefill `tokens` in chunks of the step budget, in steps that also carry
        the running decodes."""
        return predict_prefill(self.predictor.current, tokens, self._decode_context,
                               self.chunk_tokens)

    # ---- hooks of one step, in the order schedule() calls them ----------------------------

    def begin_step(self, ops: SchedulerOps) -> None:
        """slo policy: urgency moves with the clock, so rank running and waiting requests once
        per step; the least urgent running request ends up last, which makes it the
        KV-pressure victim. Then release the held victims whose turn came."""
        self._decodes = [r for r in ops.running
                         if r.num_tokens_owed == 1 and r.request_id not in self.held]
        self._decode_context = sum(r.num_tokens for r in self._decodes)
        if self.scheduling_policy == "slo":
            now = time.monotonic()
            position = {r.request_id: i for i, r in enumerate(self.rank(ops.running, now))}
            contested = any(r.live_deadline is not None for r in ops.running
                            if r.num_tokens_owed > 1)
            ops.running.sort(key=lambda r: _running_rank(r, position[r.request_id], contested))
            waiting = ops.waiting
            assert isinstance(waiting, UrgencyQueue)
            waiting.refresh(self.rank)
        if self.held:
            self._release_held(ops)
        self._deepest_prefix = max((r.num_computed_tokens for r in ops.running
                                    if r.num_tokens_owed > 1 and r.request_id not in self.held),
                                   default=0)

    def admit_first(self, ops: SchedulerOps, step: StepInProgress) -> None:
        """Admissions that go before the running set is served: the waiter a mid-forward
        preemption made room for; then (slo policy) waiters that outrank every running
        prefill, after which the rest of the step's budget is capped to the tightest deadline
        the step can still meet."""
        # slo policy: the TPOT decodes' tokens are kept out of the urgent admissions' reach.
        reserved = 0
        if self.scheduling_policy == "slo":
            reserved = min(step.budget, len(self._tpot_decodes(ops, step)))
            step.budget -= reserved
        if self.urgent_waiter_id is not None:
            self._admit_urgent_waiter(ops, step)
        if self.scheduling_policy == "slo":
            self._admit_outranking_waiters(ops, step)
            # Admitted ahead of the running prefills for their deadlines: they stream as
            # interactive turns from now on (cap_for_tpot), as a preemption's waiter does.
            for request in step.with_deadline.values():
                request.served_urgently = True
            step.budget += reserved
            step.budget = min(self.cap_for_deadlines(step), self.cap_for_tpot(ops, step))

    @contextmanager
    def waiting_past_held(self, waiting: RequestQueue) -> Iterator[Callable[[], Request | None]]:
        """Yields a function that peeks at the first waiting request that is not held back.

        A held victim waits for its turn without blocking anyone queued behind it: held
        requests met at the head are lifted off the queue, and put back in their order (and
        so at their places, ahead of everyone left) on exit.
        """
        lifted: list[Request] = []

        def next_waiter() -> Request | None:
            while waiting:
                request = waiting.peek()
                if request.request_id not in self.held:
                    return request
                lifted.append(waiting.pop())
            return None

        try:
            yield next_waiter
        finally:
            for request in reversed(lifted):
                waiting.prepend(request)

    def is_held(self, req_id: str) -> bool:
        return req_id in self.held

    def suspended_chunk(self, req_id: str) -> SuspendedChunk | None:
        """The segment it resumes next (its first), or None."""
        segments = self.suspended.get(req_id)
        return segments[0] if segments else None

    def is_suspended(self, req_id: str) -> bool:
        return req_id in self.suspended

    def choose_kv_victim(self, running: list[Request], step: StepInProgress) -> Request:
        """The running request to preempt (recompute) when another cannot get KV blocks."""
        # Never one admitted by this very step: it was admitted because it fit (the urgent
        # waiter a mid-forward preemption made room for, first of all), and taking it back
        # would only undo that decision while the step record still lists the admission.
        admitted = step.record.admitted_ids()
        candidates = [r for r in running if r.request_id not in admitted]
        paused = [r for r in candidates if r.request_id in self.held]
        if paused:
            # A paused request holds KV nobody is using: under KV pressure it goes first
            # (pause falls back to recompute).
            return paused[-1]
        if self.scheduling_policy == "priority":
            # Scan newest first so that among equals the most recently admitted one goes.
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def release_all_holds(self) -> None:
        """Holding a victim back is for letting someone else run first; when nobody else can
        run, it only stalls the engine (an empty step that would repeat forever)."""
        self.held.clear()
        self.yielding_to.clear()
        self.victims.clear()

    def take_unneeded_suspensions(self) -> list[str]:
        """The suspended chunks the workers may free, handed over with the step being sent."""
        unneeded, self.unneeded_suspensions = self.unneeded_suspensions, []
        return unneeded

    # ---- the slo policy's admissions ------------------------------------------------------

    def _admit_urgent_waiter(self, ops: SchedulerOps, step: StepInProgress) -> None:
        waiter_id, self.urgent_waiter_id = self.urgent_waiter_id, None
        request = ops.get_request(waiter_id or "")
        if request is None:
            return  # gone
        # It streams as an interactive turn from now on (cap_for_tpot). Marked here, not when
        # the preemption is applied: an arrival may reach the scheduler only after that.
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
                            if r.awaiting_first_output and r.request_id not in self.held
                            and r.request_id not in step]
        if not running_prefills:
            return  # nothing to jump over: the usual order serves them just as well
        # Ranked together, running first: a waiter that only ties with a running prefill
        # does not jump it.
        waiters = [r for r in ops.waiting
                   if r.live_deadline is not None and r.request_id not in self.held]
        running_ids = {r.request_id for r in running_prefills}
        outranking: set[str] = set()
        for request in self.rank([*running_prefills, *waiters], now):
            if request.request_id in running_ids:
                break
            outranking.add(request.request_id)
        with self.waiting_past_held(ops.waiting) as next_waiter:
            while step.budget > 0 and (request := next_waiter()) is not None:
                if request.request_id not in outranking:
                    break
                # Each admission may take only what keeps the ones before it (more urgent)
                # in time.
                allowed = self.cap_for_deadlines(step)
                if allowed <= 0 or ops.admit(request, step, allowed) is None:
                    break
                ops.waiting.pop()

    def cap_for_deadlines(self, step: StepInProgress) -> int:
        """slo policy: a step lasts as long as all its tokens take, and every request in it
        gets its first token only at its end. The step so far holds only the urgent admissions
        (admit_first); what joins them after (the running decodes, then other chunks, resumed
        suspended chunks first of all) may take only as many tokens (at most the step's budget
        left) as keep the predicted step within each urgent request's deadline. The chunks that
        may join are charged their attention over the deepest running prefix: a chunk over a
        28k-token prefix costs several fresh prompts of its size.

        An urgent request that its own chunk alone would make late is made as little late as
        possible: nothing joins it."""
        # The running decodes join the step after these admissions: they count now.
        pending_decodes = [r for r in self._decodes if r.request_id not in step]
        return self._deadline_cap(step, self._deepest_prefix, pending_decodes, late_blocks=True)

    def join_budget(self, step: StepInProgress, request: Request) -> int:
        """The tokens `request` (a running chunk or a waiting admission) may add to `step`:
        under the slo policy, no more than keep the predicted step within the deadline of every
        request it already gives a first token to (one whose chunk alone is late constrains
        nothing here: only the turns a preemption or an outranking admission put first are
        served alone). So an urgent turn admitted beside a long document is not made to wait
        for the document's whole prefill: the document joins with the chunk that fits."""
        if self.scheduling_policy != "slo":
            return step.budget
        return self._deadline_cap(step, request.num_computed_tokens, (), late_blocks=False,
                                  joiner=request)

    def _deadline_cap(self, step: StepInProgress, joining_prefix: int,
                      pending_decodes: Sequence[Request], late_blocks: bool,
                      joiner: Request | None = None) -> int:
        if not step.with_deadline:
            return step.budget
        now = time.monotonic()
        line = self.predictor.current
        tokens = step.num_tokens + len(pending_decodes)
        attention = step.attention
        context = step.decode_context + sum(r.num_tokens for r in pending_decodes)
        allowed = step.budget
        for request in step.with_deadline.values():
            assert request.deadline is not None
            num_new = step.scheduled[request.request_id][1]
            time_left = request.deadline - now
            alone = line.predict_step(num_new, attention_work([(request.num_computed_tokens,
                                                                num_new)]))
            usable = self._usable(time_left)
            with_decodes = line.predict_step(tokens, attention, context)
            if alone > time_left or with_decodes > usable:
                if not late_blocks:
                    if alone > time_left:
                        if joiner is not None and self._can_wait_for(joiner, alone, now):
                            # Late whatever joins it, so late as little as can be: a joiner
                            # whose own deadline allows a step of it waits for the next one
                            # (before, a document's 1908 suspended tokens joined a late
                            # 138-token turn's step, and its first token waited 3.3 s).
                            return 0
                        continue  # nothing left to protect from those that cannot wait
                    # It can still make it, but the step already fills the share of its time
                    # a cap may fill: nothing more joins. (Before: a 1355-token document
                    # joined a 53-token turn with 150 ms left, and both waited 1.8 s.)
                    return 0
                # Late whatever joins it, or the running decodes alone would make it late:
                # nothing joins, so it is as little late as can be; nothing but the running
                # decodes, where they cost the step little (a GPU's step is floor-bound: a few
                # decodes are free there, and without them every stream stalls a step).
                decodes_cost = with_decodes / line.predict_step(step.num_tokens, attention,
                                                                step.decode_context)
                return len(pending_decodes) if decodes_cost <= 1 + DECODES_SHARE else 0
            joining = line.max_chunk_within(usable, tokens, attention, context, joining_prefix)
            allowed = min(allowed, len(pending_decodes) + joining)
        return allowed

    def _tpot_decodes(self, ops: SchedulerOps, step: StepInProgress) -> list[Request]:
        return [r for r in ops.running if _is_tpot_decode(r) and r.request_id not in step
                and r.request_id not in self.held]

    def cap_for_tpot(self, ops: SchedulerOps, step: StepInProgress) -> int:
        """slo policy: the tokens the step may still schedule (its TPOT decodes' own included)
        so that its predicted time fits every TPOT decode's next-token deadline (the latest
        token's time plus its objective) that a step of just the decodes can still meet; a
        deadline it cannot constrains nothing, so prefill never stalls behind an objective no
        step could meet. Like the TTFT cap, it leaves DEADLINE_HEADROOM of the time unfilled and
        allows for the predictor's observed error."""
        decodes = self._tpot_decodes(ops, step)
        if not decodes:
            return step.budget
        now = time.monotonic()
        line = self.predictor.current
        context = self._decode_context
        minimal = step.num_tokens + len(decodes)
        decode_step = line.predict(len(decodes), context)
        allowed = step.budget
        # Interactive turns only: the tokens their gaps allow (enforced unless that pace would
        # make a prefill with a deadline miss it, or a late one later than it stalls them:
        # _pace_must_yield).
        interactive_allowed, interactive_gap, interactive_steps = step.budget, 0.0, 0
        num_interactive = 0
        for request in decodes:
            assert request.last_token_time is not None
            gap = gap_objective(request, decode_step)
            time_left = request.last_token_time + gap - now
            if decode_step > time_left:
                continue  # missed even by a step of the decodes alone: nothing to protect
            # The chunks that may join are charged their attention over the deepest running
            # prefix, as the TTFT cap does: a piece of a suspended 24k-token document is
            # not priced as a fresh prompt. Where the step already overruns the gap (an urgent
            # turn's prefill went first), nothing more joins: it overruns as little as can be.
            fits = len(decodes) + line.max_chunk_within(self._usable(time_left), minimal,
                                                        step.attention, context,
                                                        self._deepest_prefix)
            if request.tpot_slo_ms is None:
                num_interactive += 1
                interactive_allowed = min(interactive_allowed, fits)
                interactive_gap = max(interactive_gap, gap)
                interactive_steps = max(interactive_steps, request.sampling_params.max_tokens
                                        - request.num_output_tokens)
            else:
                allowed = min(allowed, fits)
        if interactive_allowed < allowed and not self._pace_must_yield(
                ops, step, interactive_allowed - len(decodes), interactive_gap,
                interactive_steps, num_interactive, now):
            allowed = interactive_allowed
        return allowed

    def _pace_must_yield(self, ops: SchedulerOps, step: StepInProgress,
                         prefill_per_step: int, step_s: float, num_steps: int,
                         num_streams: int, now: float) -> bool:
        """Whether the interactive turns' pace (for the next `num_steps` steps, their tokens
        left, only `prefill_per_step` prefill tokens join a step of `step_s`) costs a request
        with prefill left and a live deadline (running or waiting, not held, not served by
        `step` already) more than it protects:

        - its deadline: it would meet it at full speed, and miss it at the pace;
        - or, already late at full speed, more lateness than its prefill would stall the
          `num_streams` streams (each once, by about its prefill): late as little as possible.
          Before, such a request waited for every turn's last token: beside two busy
          processes, two turns of a burst the deadline cap had kept out of the first turn's
          step waited 1.8 s more behind the decodes of the turns served before them."""
        per_step = max(1, prefill_per_step)
        for request in (*ops.running, *ops.waiting):
            deadline = request.live_deadline
            owed = request.num_tokens_owed
            if (deadline is None or owed <= 1 or request.request_id in self.held
                    or request.request_id in step):
                continue
            if owed <= per_step * num_steps:
                paced = math.ceil(owed / per_step) * step_s
            else:  # at full speed once the turns are done
                paced = num_steps * step_s + self.predict_prefill(owed - per_step * num_steps)
            full_speed = self.predict_prefill(owed)
            if full_speed <= deadline - now:
                # Judged with the caps' margins (DEADLINE_HEADROOM, the predictor's error): a
                # relaxed document must not find out at its deadline that the turns took its
                # time.
                if paced > self._usable(deadline - now):
                    return True
            elif paced - full_speed > num_streams * full_speed:
                return True
        return False

    def _can_wait_for(self, request: Request, step_s: float, now: float) -> bool:
        """Whether `request` still meets its deadline if it waits for a step of `step_s`
        first, judged with the caps' margins. A request without a deadline (or past its first
        token) is not kept waiting here: nothing would age it, and nothing says when it may
        run."""
        deadline = request.live_deadline
        if deadline is None:
            return False
        wait = step_s + self.predict_prefill(request.num_tokens_owed)
        return wait <= self._usable(deadline - now)

    def _usable(self, time_left: float) -> float:
        """The part of `time_left` a cap may fill: DEADLINE_HEADROOM stays free, and the rest
        is shrunk by how far off the predictor has been running (its two-sided
        relative_error)."""
        return time_left * (1 - DEADLINE_HEADROOM) / (1 + self.predictor.current.relative_error)

    def _release_held(self, ops: SchedulerOps) -> None:
        """A held request runs again once the client of the waiter it yielded to has its first
        output (a first token with no text is not enough; docs/design.md section 9) (or it is
        gone); a held victim only once, also, no request with prefill left (waiting or
        running, and not held itself) is more urgent than it."""
        now = time.monotonic()
        contenders = [r for r in (*ops.waiting, *ops.running)
                      if r.request_id not in self.held and r.awaiting_first_output]

        def ranks_first(request: Request) -> bool:
            # Listed first, so that a tie releases it.
            return self.rank([request, *contenders], now)[0] is request

        for req_id in list(self.held):
            request = ops.get_request(req_id)
            assert request is not None, f"held request {req_id} is gone"
            waiter_id = self.yielding_to.get(req_id)
            if waiter_id is not None:
                waiter = ops.get_request(waiter_id)
                if waiter is not None and waiter.awaiting_first_output:
                    continue
                del self.yielding_to[req_id]
            if req_id not in self.victims or ranks_first(request):
                logger.debug("release held %s (victim %s)", req_id, req_id in self.victims)
                self._release(req_id)

    def _release(self, req_id: str) -> None:
        self.held.discard(req_id)
        self.victims.discard(req_id)
        self.yielding_to.pop(req_id, None)

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
        for req_id in {victim_id, *kept} - {waiter_id}:
            self.held.add(req_id)
            self.yielding_to[req_id] = waiter_id
        self.victims.add(victim_id)
        logger.debug("slo preemption: victim %s for waiter %s, held %s", victim_id, waiter_id,
                     sorted(self.held))
        if victim.status is not RequestStatus.RUNNING:
            return "recompute"
        # The victim may keep its KV and its sequence slot only if the next step (which
        # admits the waiter first, before anything else changes) admits the waiter beside it:
        # else it would be held for a waiter that never comes in.
        if self.slo_preempt_mode != "recompute" and (
                waiter is None or waiter.status is RequestStatus.RUNNING or ops.can_admit(waiter)):
            return "suspend" if victim_id in self.suspended else "pause"
        if victim_id in self.suspended:
            self.drop_suspensions([victim_id])
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

    # ---- suspended chunks and the end of a request -------------------------------------------

    def suspend(self, req_id: str, start_pos: int, num_tokens: int, layer: int) -> None:
        """A rollback kept this chunk, whose pass stopped before `layer`: the workers hold it.
        For a resumed piece (of the request's first segment), by the workers' rules
        (workers/preemption/suspension.py): if the stop came before its own layer, or at it, nothing
        changed; past it, the piece is held at `layer`, ahead of the rest of its segment."""
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

    def drop_suspensions(self, req_ids: Iterable[str]) -> None:
        """These suspended chunks will not resume: the workers free them with the next step."""
        for req_id in req_ids:
            self.suspended.pop(req_id, None)
            self.unneeded_suspensions.append(req_id)

    def on_kv_preempted(self, req_id: str) -> None:
        """Preempted with recompute for KV space: its suspended chunk lost its blocks. A held
        victim stays held, now waiting (it is still not its turn)."""
        if req_id in self.suspended:
            self.drop_suspensions([req_id])

    def on_finished(self, req_id: str) -> None:
        """Finished or aborted: nothing of it is held or resumed any more."""
        self._release(req_id)
        if req_id in self.suspended:
            self.drop_suspensions([req_id])

    def check_invariants(self, live_ids: set[str], running_ids: set[str]) -> None:
        assert self.held <= live_ids, "a finished request is still held back"
        assert set(self.yielding_to) | self.victims <= self.held, "a hold without its request"
        assert set(self.suspended) <= running_ids, "a suspended chunk lost its request"
