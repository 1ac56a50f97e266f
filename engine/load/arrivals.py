"""What will arrive at a replica while a request waits there: the work the router sent it lately,
taken as the rate of what comes next (docs/design.md, section 10).

A replica's monitor serves the most urgent request first, so a request with a long objective (a
document due in 20 s) is overtaken by every request that arrives while it waits and is due
before it: each urgent turn that comes in during its wait is prefilled ahead of it. A
prediction from the queue alone says the document's first token is seconds away when, under a
steady flow of turns, it is tens of seconds away: its miss is then blamed on the routing
decision, and the router cannot prefer the replica whose traffic overtakes it least.

`RecentArrivals` keeps, per replica, the requests with an objective the router sent there in the
last `window_s` seconds (each with its objective and its predicted prefill there) and reads
them as a rate: each one recurs once per the time they span. The whole prefill, not the part
no batching saves (what admission's optimistic bound counts): a turn that stops a document's
prefill runs in a step of its own and pays that step's fixed cost; a burst's turns packed into
one step pay it once, so the forecast errs towards the late side there, which makes a
prediction late, not a routing decision wrong (a document predicted late still goes where it
is least late, and is not refused for it). `expected_finish` is then the
preemptive-priority queue's answer for a request whose queue alone finishes it at `finish`
seconds from now and whose deadline is `time_to_deadline` away: a request of objective `s`
arriving `t` seconds from now is due first iff `t + s < time_to_deadline`, so each recent
request of objective `s` adds its prefill at its rate over the first `time_to_deadline - s`
seconds of the wait, and the wait `T` solves

    T = finish + sum_i rate_i * min(T, max(0, time_to_deadline - s_i)).

An urgent turn is overtaken only by turns due still sooner that arrive within its short
objective, so its prediction moves by tens of milliseconds at most; a document's grows with the
urgent work per second of the replica it would wait on.
The bound admission judges on (`Prediction.optimistic_ttft_s`) does not count this: it is a
forecast, not work anyone has sent, and refusing on it would refuse what a lull would serve.
"""

from __future__ import annotations

import bisect
from collections import deque

# How long the recent sends are kept, in report periods (engine.fleet.routing): 5 s at the
# default 0.1 s, which holds a burst of urgent turns and the lull after it, and follows a
# change of traffic within a few seconds (a document's objective is tens of them).
ARRIVAL_WINDOW_PERIODS = 50
# The least time the sends are read over, in report periods (RecentArrivals): short, because
# a flow that has just started (a fleet's first burst) must read at its own rate within a few
# of its requests, or a document routed then is predicted behind a trickle and served behind a
# flood; long enough that one send is read as at most a few per second.
MIN_SPAN_PERIODS = 2


class Overtakers:
    """A snapshot of one replica's recent sends, for predictions: their objectives ascending and
    the running sums of their prefills in that order (so that "those due before" a request is
    a prefix), read as rates over `seen_s` seconds (the time they span: RecentArrivals)."""

    __slots__ = ("slos", "prefill_upto", "seen_s")

    def __init__(self, sends: list[tuple[float, float]], seen_s: float) -> None:
        ordered = sorted(sends)  # (objective, prefill), by objective
        self.slos = [slo for slo, _ in ordered]
        upto = [0.0] * (len(ordered) + 1)
        for k, (_, prefill) in enumerate(ordered):
            upto[k + 1] = upto[k] + prefill
        self.prefill_upto = upto
        self.seen_s = seen_s

    def __len__(self) -> int:
        return len(self.slos)

    def expected_finish(self, finish: float, time_to_deadline: float) -> float:
        """The wait `T` (see the module's docstring) of a request the queue alone finishes at
        `finish` seconds from now, due `time_to_deadline` from now. f(T) is piecewise linear and
        concave, so the least fixed point is found segment by segment from T = 0: in each, the
        sends whose horizon `time_to_deadline - s` is past T add their rate times T, the others
        their rate times their horizon."""
        # The sends that can overtake at all (objective under the time to deadline): a prefix.
        m = bisect.bisect_left(self.slos, time_to_deadline)
        if m == 0:
            return finish
        per_second = 1.0 / self.seen_s
        fixed = 0.0  # sum of rate * horizon over the sends whose horizon T has passed
        for k in range(m, 0, -1):
            # Sends 0..k-1 are still overtaking at this segment; the shortest horizon is k-1's.
            slope = self.prefill_upto[k] * per_second
            horizon = time_to_deadline - self.slos[k - 1]
            if slope < 1.0:
                t = (finish + fixed) / (1.0 - slope)
                if t <= horizon:
                    return t
            fixed += (self.prefill_upto[k] - self.prefill_upto[k - 1]) * per_second * horizon
        return finish + fixed


class RecentArrivals:
    """One replica's sends with an objective in the last `window_s` seconds (router thread only).

    They are read as rates over the time they span, from the oldest kept to now (at least
    `min_span_s`, so that a first send is not read as a flood): traffic that starts with a
    burst is seen as the burst's rate at once, where dividing by the whole window would dilute
    it until the window filled."""

    __slots__ = ("window_s", "min_span_s", "_sends", "_snapshot")

    def __init__(self, window_s: float, min_span_s: float) -> None:
        self.window_s = window_s
        self.min_span_s = min(min_span_s, window_s)
        self._sends: deque[tuple[float, float, float]] = deque()  # (sent at, objective, prefill)
        self._snapshot: Overtakers | None = None

    def add(self, now: float, slo_s: float, prefill_s: float) -> None:
        self._sends.append((now, slo_s, prefill_s))
        self._snapshot = None

    def overtakers(self, now: float) -> Overtakers | None:
        """The sends of the last window as rates (None: none)."""
        cutoff = now - self.window_s
        while self._sends and self._sends[0][0] < cutoff:
            self._sends.popleft()
            self._snapshot = None
        if not self._sends:
            return None
        if self._snapshot is None:
            self._snapshot = Overtakers([(slo, prefill) for _, slo, prefill in self._sends],
                                        self.window_s)
        span = now - self._sends[0][0]
        self._snapshot.seen_s = min(self.window_s, max(span, self.min_span_s))
        return self._snapshot
