"""Slack-EDF policy (docs/design.md section 5): slack, priority, the ranking and the
preemption gate.

time_to_deadline = deadline - now; slack = time_to_deadline - predicted remaining TTFT;
priority = sign(slack) / |time_to_deadline|, the sign taken against the optimistic estimate: a
request late even then is *doomed*. A request without a deadline has infinite time and
priority 0.

The order (`rank`) is not a sort by that scalar: late as little as possible. Rescuable requests
go by priority (the most urgent first); doomed ones among themselves by deadline (the most
overdue first), each ahead of every rescuable request whose slack covers its predicted prefill
(what the doomed ones placed ahead of it already take counted), behind those whose slack does
not; requests without a deadline after all of them, in the order given (arrival: with no
deadline anywhere the order is fcfs's).

Aging bounds how long a request can be kept behind: one still without its first token past its
deadline by more than AGING_SLO_MULTIPLE x its own objective (at most `aging_bound_s`) is
*aged*. It goes ahead of every other request (the longest overdue first), and a step that serves
it is stopped for someone else only for a rescuable waiter's short prefill, AGED_YIELD_SHARE of
its own objective in all, so no stream of tighter objectives can hold it back for good.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

SLOPreemptPolicy = Literal["conservative", "aggressive"]
T = TypeVar("T")

# Priority of an aged request: its seconds overdue on top of this, above any 1 / time_to_deadline
# a live deadline can give (that would need one closer than a picosecond).
AGED_PRIORITY = 1e12

# A request is aged once overdue by this many times its own TTFT objective (`aging_bound_s` is
# the ceiling). 1: its first token is then twice as late as its client asked, and the ranking has
# had that long to serve it ahead of everyone whose slack could afford it; what still holds it
# back is a stream of requests that could not (slack tighter than its prefill), and past that
# point it goes first. Lateness is thus bounded in the request's own units (a 150 ms turn waits
# about 150 ms more, not a fixed 5 s, 30x its objective). A larger multiple only lengthens the
# wait of exactly the requests the ranking failed to serve; 0 would age every doomed request at
# its deadline, putting overdue requests ahead of rescuable ones, and under overload turn every
# deadline into a miss (EDF's domino effect).
AGING_SLO_MULTIPLE = 1.0

# An aged request's step may still be stopped for a rescuable waiter whose predicted prefill fits
# what is left of this share of the aged request's own objective (all such waiters together):
# once a request is late by seconds, a turn's 100 ms more costs it little and saves a deadline,
# while a step that is never stopped makes every turn behind it miss (beside two busy processes,
# one 4k-token document aged 5 s past its 30 s objective held eight urgent turns 4-9 s behind
# it). Bounded, so aging still bounds how long the request waits: 3 s in all for a 30 s
# objective.
AGED_YIELD_SHARE = 0.1


class EngineRequest(Protocol):
    """What the policy reads of an engine request (engine.core.request.Request), named here so
    that the monitor, below the engine, imports nothing of it."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_cached_prefix_tokens(self) -> int: ...

    @property
    def num_slo_preemptions(self) -> int: ...

    @property
    def ttft_slo_ms(self) -> float | None: ...

    @property
    def live_deadline(self) -> float | None: ...

    @property
    def aged_yield_s(self) -> float: ...


R = TypeVar("R", bound=EngineRequest)


# Share of a protected request's time left that no plan may fill: the scheduler's caps leave it
# unfilled, and the monitor lets a waiter wait for the running step only if the step and the
# waiter's own prefill fit the rest (see choose_slo_preemption). The predictor's error and
# the running decodes are charged explicitly (relative_error, the decode term), but the model is
# fitted on the forward pass's time while a deadline counts the whole engine loop (scheduling,
# sampling, output processing), and the first steps run before any error is measured. With 0.1
# instead, tests/core/test_tpot_scheduling.py's inter-token gaps overran their 300 ms objective by
# up to 7%.
DEADLINE_HEADROOM = 0.25


@dataclass(frozen=True)
class RequestView:
    """What the policy needs of a request (read from the scheduler's snapshot)."""

    request_id: str
    # time.monotonic(); None: no TTFT objective, or its first token is already out.
    deadline: float | None
    remaining_prefill_tokens: int
    # Rule 1: a request the monitor preempted once is never a victim again.
    slo_preempted: bool = False
    # Its TTFT objective in seconds (None: not known to the view): aging counts in it.
    slo_s: float | None = None
    # Once aged: the predicted prefill it may still yield to rescuable waiters
    # (AGED_YIELD_SHARE).
    aged_yield_left_s: float = 0.0


@dataclass(frozen=True)
class Urgency:
    time_to_deadline: float
    # Against the predictor's point estimate: what the necessity test weighs.
    slack: float
    priority: float
    # Late even if its prefill runs as fast as the predictor's optimistic estimate: nothing
    # done for it now can save its deadline. A request whose point slack is negative but whose
    # optimistic slack is not is still rescuable, and is treated as such.
    doomed: bool = False
    # Predicted seconds of its remaining prefill (point estimate; 0 without a deadline): what
    # serving it costs the requests behind it.
    prefill: float = 0.0

    @property
    def aged(self) -> bool:
        return self.priority >= AGED_PRIORITY

    @property
    def lendable_slack(self) -> float:
        """The slack it may lend a doomed request: DEADLINE_HEADROOM of its time left stays its
        own, as the scheduler's caps keep it. Lent down to its point slack, a relaxed document
        had nothing left for the steps around the doomed prefills (their decodes, its own
        chunks' granularity), was judged doomed itself, and then went behind every later turn
        (doomed ones go by deadline)."""
        return lendable_slack(self.time_to_deadline, self.prefill)


def lendable_slack(time_to_deadline: float, prefill: float) -> float:
    """Urgency.lendable_slack's formula (the fleet's predictor has a slotted Urgency of its
    own)."""
    return time_to_deadline * (1 - DEADLINE_HEADROOM) - prefill


def aging_threshold(slo_s: float | None, aging_bound_s: float | None) -> float | None:
    """Seconds past its deadline after which a request is aged: AGING_SLO_MULTIPLE x its
    objective, at most `aging_bound_s` (None: aging is off; an unknown objective: the bound)."""
    if aging_bound_s is None:
        return None
    if slo_s is None:
        return aging_bound_s
    return min(AGING_SLO_MULTIPLE * slo_s, aging_bound_s)


def urgency(view: RequestView, now: float, predict: Callable[[int], float],
            aging_bound_s: float | None = None,
            optimistic: Callable[[int], float] | None = None) -> Urgency:
    """`optimistic`: the fastest the remaining prefill is likely to run (default: `predict`);
    the sign of the priority (rescuable or doomed) is taken against it, so that a predictor
    that runs pessimistic never writes off a request that could still make it."""
    if view.deadline is None:
        return Urgency(math.inf, math.inf, 0.0)
    time_to_deadline = view.deadline - now
    predicted = predict(view.remaining_prefill_tokens)
    slack = time_to_deadline - predicted
    best_case = predicted if optimistic is None else min(
        predicted, optimistic(view.remaining_prefill_tokens))
    doomed = time_to_deadline - best_case <= 0
    threshold = aging_threshold(view.slo_s, aging_bound_s)
    if threshold is not None and -time_to_deadline > threshold:
        return Urgency(time_to_deadline, slack, AGED_PRIORITY - time_to_deadline, doomed=True,
                       prefill=predicted)
    if time_to_deadline == 0:
        return Urgency(0.0, slack, -math.inf, doomed=True, prefill=predicted)
    return Urgency(time_to_deadline, slack,
                   (-1.0 if doomed else 1.0) / abs(time_to_deadline), doomed=doomed,
                   prefill=predicted)


def order(scored: Sequence[tuple[Urgency, T]]) -> list[tuple[Urgency, T]]:
    """The ranking (see the module's docstring), most urgent first; ties keep the given order.

    Aged requests first, the longest overdue first. Then the rescuable ones by priority merged
    with the doomed ones by deadline: the next doomed one is placed as soon as the least slack
    among the rescuable ones still behind, less the predicted prefill of the doomed ones placed
    ahead of them, covers its own predicted prefill; else the next rescuable one is. Then those
    without a deadline. O(n log n)."""
    aged: list[tuple[Urgency, T]] = []
    rescuable: list[tuple[Urgency, T]] = []
    doomed: list[tuple[Urgency, T]] = []
    free: list[tuple[Urgency, T]] = []
    for item in scored:
        u = item[0]
        if u.aged:
            aged.append(item)
        elif u.time_to_deadline == math.inf:
            free.append(item)
        elif u.doomed:
            doomed.append(item)
        else:
            rescuable.append(item)
    aged.sort(key=lambda item: -item[0].priority)
    rescuable.sort(key=lambda item: -item[0].priority)
    doomed.sort(key=lambda item: item[0].time_to_deadline)
    # least_slack[i]: the least slack among rescuable[i:] (what a doomed one placed before
    # rescuable[i] delays).
    least_slack = [math.inf] * (len(rescuable) + 1)
    for i in range(len(rescuable) - 1, -1, -1):
        least_slack[i] = min(rescuable[i][0].lendable_slack, least_slack[i + 1])
    merged: list[tuple[Urgency, T]] = []
    i = spent = 0
    for item in doomed:
        while least_slack[i] - spent < item[0].prefill:
            merged.append(rescuable[i])
            i += 1
        merged.append(item)
        spent += item[0].prefill
    merged += rescuable[i:]
    return aged + merged + free


def rank(items: Iterable[T], now: float, predict: Callable[[int], float],
         aging_bound_s: float | None = None,
         optimistic: Callable[[int], float] | None = None,
         view: Callable[[T], RequestView] | None = None) -> list[T]:
    """`items` in the ranking's order (see `order`); `view`: each item's RequestView (default:
    the items are views)."""
    def as_view(item: T) -> RequestView:
        return view(item) if view is not None else item  # type: ignore[return-value]

    return [item for _, item in order([(urgency(as_view(item), now, predict, aging_bound_s,
                                                optimistic), item) for item in items])]


def view_of(request: EngineRequest, *, computed_tokens: int | None = None,
            slo_preempted: bool | None = None) -> RequestView:
    """The policy's view of an engine Request (the one place it is built). A request whose
    client has its first output has met or missed its TTFT objective for good: it no longer has
    a deadline to protect.

    A request still waiting for admission is credited with the prefix-cache hit found when it
    arrived (``num_cached_prefix_tokens``). For a request in the running step,
    ``computed_tokens`` is its chunk's start (the tokens computed before the step: the step's
    own are still to do until it ends), and
    ``slo_preempted`` whether Rule 1 protects it as the engine applies the rule (default: it
    was SLO-preempted before)."""
    if computed_tokens is not None:
        computed = computed_tokens
    else:
        # A request not yet admitted skips what the prefix cache holds of its prompt.
        computed = max(request.num_computed_tokens, request.num_cached_prefix_tokens)
    slo_s = None if request.ttft_slo_ms is None else request.ttft_slo_ms / 1000
    return RequestView(request.request_id, request.live_deadline,
                       max(0, request.num_tokens - computed),
                       slo_preempted=(request.num_slo_preemptions > 0 if slo_preempted is None
                                      else slo_preempted),
                       slo_s=slo_s,
                       aged_yield_left_s=0.0 if slo_s is None else max(
                           0.0, AGED_YIELD_SHARE * slo_s - request.aged_yield_s))


def request_urgency(request: EngineRequest, now: float, predict: Callable[[int], float],
                    aging_bound_s: float | None = None,
                    optimistic: Callable[[int], float] | None = None) -> float:
    return urgency(view_of(request), now, predict, aging_bound_s, optimistic).priority


def rank_requests(requests: Iterable[R], now: float, predict: Callable[[int], float],
                  aging_bound_s: float | None = None,
                  optimistic: Callable[[int], float] | None = None) -> list[R]:
    """Engine requests in the ranking's order (the scheduler's waiting queue and running set).

    Those without a live deadline rank last in the given order (``urgency``'s first case) and
    weigh on nobody else's place, so they go there without a view or an urgency each: in a
    serving engine most running requests are decodes past their first output, and this runs
    every step."""
    timed: list[R] = []
    free: list[R] = []
    for request in requests:
        (free if request.live_deadline is None else timed).append(request)
    return rank(timed, now, predict, aging_bound_s, optimistic, view=view_of) + free


@dataclass(frozen=True)
class SLOPreemptDecision:
    victim_id: str
    waiter_id: str


def should_slo_preempt(waiter: Urgency, running: Urgency, margin: float,
                   step_remaining_s: float | None = None, relative_error: float = 0.0) -> bool:
    """Whether waiter W may stop a step for running request R. The four sign cases, branched
    on first: a multiplicative margin on a negative priority would flip the inequality.

    - both rescuable: W's priority must exceed `margin` x R's;
    - only R doomed: always (it gives up its slot);
    - only W doomed: only where serving W now makes it less late than waiting and costs R
      nothing: the step's time left (`step_remaining_s`) exceeds W's predicted prefill (W saves
      more lateness than the step's requests are delayed by), and R's slack covers W's
      predicted prefill plus the predictor's error on both predictions (`relative_error`);
    - both doomed: the same time test, and W's deadline is not later than R's (the ranking's
      order among doomed requests: the most overdue first).

    Without `step_remaining_s` a doomed waiter never preempts. Aged requests are out of it: a
    step serving one stops only as choose_slo_preemption's _yield_of_aged allows, and an aged
    waiter does not preempt."""
    if waiter.aged or running.aged:
        return False
    if not waiter.doomed:
        if running.doomed:
            return True
        return waiter.priority > margin * running.priority
    if step_remaining_s is None or step_remaining_s <= waiter.prefill:
        return False  # waiting for the step costs it no more than serving it costs the others
    if running.doomed:
        return waiter.time_to_deadline <= running.time_to_deadline
    return running.lendable_slack >= waiter.prefill + relative_error * (waiter.prefill
                                                                         + running.prefill)


def may_wait(waiter: Urgency, step_remaining_s: float, relative_error: float) -> bool:
    """The necessity test: whether `waiter` still meets its deadline if it waits for the running
    step to end, judged with the scheduler's margins: the step's time left and the waiter's own
    prefill, each allowed to run over by the predictor's error, must fit the share of its time
    that a plan may fill (DEADLINE_HEADROOM stays free for the engine loop and the HTTP edge).
    Before, only the error counted: a 182-token turn that arrived 8 ms into a step filled to
    another turn's deadline waited for it, was admitted with 18 ms left for a 30 ms prefill,
    and missed by 23 ms (GPU-timed burst, seed 0)."""
    needed = (step_remaining_s + waiter.prefill) * (1 + relative_error)
    return needed <= waiter.time_to_deadline * (1 - DEADLINE_HEADROOM)


def choose_slo_preemption(waiting: Sequence[RequestView], running: Sequence[RequestView],
                      now: float, predict: Callable[[int], float],
                      policy: SLOPreemptPolicy = "conservative",
                      margin: float = 1.2,
                      step_remaining_s: float | None = None,
                      relative_error: float = 0.0,
                      aging_bound_s: float | None = None,
                      optimistic: Callable[[int], float] | None = None
                      ) -> SLOPreemptDecision | None:
    """Whether a waiter should stop the running step, and whom to preempt.

    The victim is always the least urgent eligible running request (the last in the ranking,
    `order`): the step is unwound for all of them anyway, and that is the one whose delay costs
    least. Rule 1: requests already preempted by the monitor are not eligible.

    A doomed waiter first: the one the ranking puts ahead of every other waiter, if any, stops
    the step where `should_slo_preempt` allows it against every running request (eligible or not:
    the whole step waits for it), whatever the policy. Doomed is judged against `optimistic`
    (see urgency): a waiter is written off only if even its fastest likely prefill misses its
    deadline.

    Else the best rescuable waiter W (highest priority) is weighed against the eligible running
    requests: conservative, W must beat every one of them (in effect the MOST urgent one);
    aggressive, one of them (the LEAST urgent).

    `step_remaining_s` (the running step's time left, from its measured progress) adds a
    necessity test (`may_wait`): a waiter that can wait for the rest of the step and still meet
    its deadline loses nothing by waiting, and unwinding the step would only throw work away.
    `relative_error` (the predictor's observed error, see monitor.predictor) widens that test by
    the same share of both predictions, the waiter's remaining prefill and the step's remaining
    time, and DEADLINE_HEADROOM of the waiter's time stays out of it, as out of the
    scheduler's caps.

    Aging (`aging_bound_s`, see aging_threshold): a step serving an aged request stops only for
    the best rescuable waiter whose prefill fits what the aged requests may still yield
    (AGED_YIELD_SHARE of their objectives, `_yield_of_aged`), and an aged waiter (doomed by
    definition) neither preempts nor keeps another waiter from preempting.
    """
    if policy not in ("conservative", "aggressive"):
        raise ValueError(f"preempt policy must be conservative or aggressive, got {policy!r}")
    if margin < 1.0:
        raise ValueError(f"preempt margin must be >= 1, got {margin}")
    scored_waiting = [(u, w) for w in waiting if w.deadline is not None
                      and not (u := urgency(w, now, predict, aging_bound_s, optimistic)).aged]
    scored_all = [(urgency(r, now, predict, aging_bound_s, optimistic), r) for r in running]
    if not scored_waiting:
        return None
    eligible = [(u, r) for u, r in scored_all if not r.slo_preempted]
    if not eligible:
        return None
    victim_id = order(eligible)[-1][1].request_id
    aged = [r for u, r in scored_all if u.aged]
    if aged:
        return _yield_of_aged(aged, scored_waiting, victim_id, step_remaining_s,
                              relative_error)
    head_urgency, head = order(scored_waiting)[0]
    if head_urgency.doomed and all(
            should_slo_preempt(head_urgency, u, margin, step_remaining_s, relative_error)
            for u, _ in scored_all):
        return SLOPreemptDecision(victim_id=victim_id, waiter_id=head.request_id)
    best_urgency, best = max(scored_waiting, key=lambda item: item[0].priority)
    if best_urgency.doomed:
        return None  # every waiter is doomed, and the first of them may not stop the step
    if step_remaining_s is not None and may_wait(best_urgency, step_remaining_s, relative_error):
        return None
    verdicts = (should_slo_preempt(best_urgency, u, margin) for u, _ in eligible)
    if not (all(verdicts) if policy == "conservative" else any(verdicts)):
        return None
    return SLOPreemptDecision(victim_id=victim_id, waiter_id=best.request_id)


def _yield_of_aged(aged: Sequence[RequestView],
                   scored_waiting: Sequence[tuple[Urgency, RequestView]], victim_id: str,
                   step_remaining_s: float | None,
                   relative_error: float) -> SLOPreemptDecision | None:
    """A step serving aged requests stops only for the most urgent rescuable waiter whose
    predicted prefill fits what every aged one may still yield (AGED_YIELD_SHARE), and only
    where that waiter cannot wait for the step (`may_wait`)."""
    best_urgency, best = max(scored_waiting, key=lambda item: item[0].priority)
    if best_urgency.doomed:
        return None
    if best_urgency.prefill > min(r.aged_yield_left_s for r in aged):
        return None
    if step_remaining_s is not None and may_wait(best_urgency, step_remaining_s, relative_error):
        return None
    return SLOPreemptDecision(victim_id=victim_id, waiter_id=best.request_id)
