"""Slack-EDF policy (docs/design.md section 5): slack, priority, and the preemption gate.

time_to_deadline = deadline - now; slack = time_to_deadline - predicted remaining TTFT;
priority = sign(slack) / |time_to_deadline|: rescuable requests first, the most urgent first;
doomed ones (late even under the optimistic estimate) last. A request without a deadline has infinite time and priority 0.

Aging bounds how long "last" lasts: a request still without its first token more than
`aging_bound_s` past its deadline is *aged*. It goes ahead of every other request (the longest
overdue first), and a step that serves it is never stopped for someone else, so no stream of
tighter objectives can hold it back for good.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.core.request import Request

PreemptPolicy = Literal["conservative", "aggressive"]

# Priority of an aged request: its seconds overdue on top of this, above any 1 / time_to_deadline
# a live deadline can give (that would need one closer than a picosecond).
AGED_PRIORITY = 1e12


@dataclass(frozen=True)
class RequestView:
    """What the policy needs of a request (read from the scheduler's snapshot)."""

    request_id: str
    # time.monotonic(); None: no TTFT objective, or its first token is already out.
    deadline: float | None
    remaining_prefill_tokens: int
    # Rule 1: a request the monitor preempted once is never a victim again.
    slo_preempted: bool = False


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

    @property
    def aged(self) -> bool:
        return self.priority >= AGED_PRIORITY


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
    if aging_bound_s is not None and -time_to_deadline > aging_bound_s:
        return Urgency(time_to_deadline, slack, AGED_PRIORITY - time_to_deadline, doomed=True)
    if time_to_deadline == 0:
        return Urgency(0.0, slack, -math.inf, doomed=True)
    return Urgency(time_to_deadline, slack,
                   (-1.0 if doomed else 1.0) / abs(time_to_deadline), doomed=doomed)


def view_of(request: Request) -> RequestView:
    """The policy's view of an engine Request. A request whose client has its first output
    has met or missed its TTFT objective for good: it no longer has a deadline to protect."""
    return RequestView(request.request_id, request.live_deadline,
                       max(0, request.num_tokens - request.num_computed_tokens),
                       slo_preempted=request.num_slo_preemptions > 0)


def request_urgency(request: Request, now: float, predict: Callable[[int], float],
                    aging_bound_s: float | None = None,
                    optimistic: Callable[[int], float] | None = None) -> float:
    return urgency(view_of(request), now, predict, aging_bound_s, optimistic).priority


@dataclass(frozen=True)
class PreemptDecision:
    victim_id: str
    waiter_id: str


def should_preempt(waiter: Urgency, running: Urgency, margin: float) -> bool:
    """The four sign cases. Branch on signs first: a multiplicative margin on a negative
    priority would flip the inequality."""
    if waiter.doomed:  # W doomed (whether or not the running one is): never
        return False
    if running.doomed:  # only the running one is doomed: it gives up its slot
        return True
    return waiter.priority > margin * running.priority


def choose_preemption(waiting: Sequence[RequestView], running: Sequence[RequestView],
                      now: float, predict: Callable[[int], float],
                      policy: PreemptPolicy = "conservative",
                      margin: float = 1.2,
                      step_remaining_s: float | None = None,
                      relative_error: float = 0.0,
                      aging_bound_s: float | None = None,
                      optimistic: Callable[[int], float] | None = None
                      ) -> PreemptDecision | None:
    """Whether the best waiter should stop the running step, and whom to preempt.

    The gate compares the best waiter W with the MOST urgent eligible running request
    (conservative: W must beat every one of them) or the LEAST urgent one (aggressive). The
    victim is always the least urgent eligible running request: the step is unwound for all of
    them anyway, and that is the one whose delay costs least. Rule 1: requests already preempted
    by the monitor are not eligible.

    Doomed is judged against `optimistic` (see urgency): a waiter is written off only if even
    its fastest likely prefill misses its deadline.

    `step_remaining_s` (the running step's time left, from its measured progress) adds a
    necessity test: a waiter
    whose slack covers the rest of the step loses nothing by waiting for it, and unwinding the
    step would only throw work away. `relative_error` (the predictor's observed error, see
    monitor.predictor) widens that test by the same share of both predictions, the waiter's
    remaining prefill and the step's remaining time: waiting is safe only if the slack covers
    the step plus what the two may run over.

    Aging (`aging_bound_s`): a step serving an aged request is never stopped, and an aged waiter
    (doomed by definition) neither preempts nor keeps a rescuable waiter from preempting.
    """
    if policy not in ("conservative", "aggressive"):
        raise ValueError(f"preempt policy must be conservative or aggressive, got {policy!r}")
    if margin < 1.0:
        raise ValueError(f"preempt margin must be >= 1, got {margin}")
    scored_waiting = [(u, w) for w in waiting if w.deadline is not None
                      and not (u := urgency(w, now, predict, aging_bound_s, optimistic)).aged]
    # Scored once, with aging: an aged runner stops the search, the rest are the candidates.
    scored_all = [(urgency(r, now, predict, aging_bound_s, optimistic), r) for r in running]
    if not scored_waiting or any(u.aged for u, _ in scored_all):
        return None
    scored_running = sorted(((u, r) for u, r in scored_all if not r.slo_preempted),
                            key=lambda item: item[0].priority)
    if not scored_running:
        return None
    best_urgency, best = max(scored_waiting, key=lambda item: item[0].priority)
    if step_remaining_s is not None:
        safety = relative_error * (predict(best.remaining_prefill_tokens) + step_remaining_s)
        if best_urgency.slack >= step_remaining_s + safety:
            return None
    reference = scored_running[-1] if policy == "conservative" else scored_running[0]
    if not should_preempt(best_urgency, reference[0], margin):
        return None
    return PreemptDecision(victim_id=scored_running[0][1].request_id, waiter_id=best.request_id)
