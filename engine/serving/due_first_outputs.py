"""The first outputs an API process owes soon, so that its long tokenizing lane can wait for them.

A document's template and tokenization take a core for 75-100 ms (12k tokens, the default
model's tokenizer, measured alone on a 2-core host; 100-340 ms each under a flood). On a host
the serving processes share, a flood of documents tokenized as they arrive takes that core from
everything an urgent turn needs in its first few hundred milliseconds: the event loop that
forwards it and relays its first token, the replica's server, its engine. Traced through a
3-replica fleet on 2 cores, the long lane tokenized without a pause from the flood's 59th
millisecond, the ingress took in its last request at 312 ms and relayed the urgent turns' first
outputs at 463-541 ms; with every document held 0.6 s (an experiment), it took in the last at
210 ms and relayed four of the turns' first outputs at 223-243 ms (bench/RESULTS.md, Overload).

So a long input waits, before its lane takes it and again between the pieces it is encoded in
(engine.processing.piecewise_encoding: a piece is some 10 ms of a core), while a request whose
deadline is both earlier than its own and within URGENT_HORIZON_S still owes its first output,
for MAX_DEFER_S at most in all: slack-ordered host work, as the engine orders its steps, and
stopped between pieces as the engine stops a forward pass between layers. Encoded whole, a
document that arrived a few milliseconds before a flood's urgent turns (before any of them was
owed) took a core for 300 ms of the turns' first 350. A first output is owed from its request's
arrival, as soon as its deadline is read, not from its route: the turns of a flood wait their
turns to be taken in, and a document taken in before them must already defer to them. A
document's objective is seconds; the wait costs it at most MAX_DEFER_S of it. A request with no
deadline waits as if its deadline were infinitely far away. Requests with far deadlines never
hold one back (two documents do not wait for each other).

The record is written on the event loop and read from the long lane's thread too: a lock keeps
the two apart.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Hashable

# Deadlines further away than this do not hold a long input back: the host time its
# tokenization takes (a tenth of a second or so) is no risk to them.
URGENT_HORIZON_S = 1.0
# The longest a long input waits for others' first outputs: a document's objective is seconds.
MAX_DEFER_S = 0.5


class DueFirstOutputs:
    """Requests between their arrival and their first output, by deadline (wall clock, as the
    arrival stamps). One per API process; written from its event loop, read from any thread."""

    def __init__(self, clock: Callable[[], float] = time.time, *,
                 horizon_s: float = URGENT_HORIZON_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self._clock = clock
        self.horizon_s = horizon_s
        self.max_defer_s = max_defer_s
        self._deadlines: dict[Hashable, float] = {}
        # Guards _deadlines; a lane thread paused between pieces waits on it for a first output.
        self._lock = threading.Condition()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._deadlines)

    def due(self, key: Hashable, deadline: float | None) -> None:
        """`key`'s first output is owed by `deadline` (None: no deadline; not recorded)."""
        if deadline is not None and math.isfinite(deadline):
            with self._lock:
                self._deadlines[key] = deadline

    def out(self, key: Hashable) -> None:
        """`key` has had its first output, or ended without one (refused, failed, gone).
        Idempotent. On the event loop."""
        with self._lock:
            if self._deadlines.pop(key, None) is None:
                return
            self._lock.notify_all()
        self._changed.set()

    def holding_back(self, deadline: float | None) -> int:
        """How many owed first outputs hold back a long input with `deadline` now."""
        with self._lock:
            return self._holding_back(deadline)

    def _holding_back(self, deadline: float | None) -> int:
        now = self._clock()
        own = math.inf if deadline is None else deadline
        return sum(1 for d in self._deadlines.values()
                   if d < own and d - now < self.horizon_s)

    def deferral(self, deadline: float | None) -> Deferral:
        """The waits of one long input with `deadline`, max_defer_s in all from now."""
        return Deferral(self, deadline, self._clock() + self.max_defer_s)

    async def wait_for_earlier(self, deadline: float | None) -> float:
        """Returns once no owed first output holds back a long input with `deadline`, or after
        max_defer_s; the seconds it waited."""
        return await self.deferral(deadline).wait()


class Deferral:
    """One long input's waits for earlier first outputs: on the event loop before its lane
    takes it (`wait`), then on the lane's thread between its pieces (`pause`), sharing one
    allowance."""

    def __init__(self, due: DueFirstOutputs, deadline: float | None, until: float) -> None:
        self.due = due
        self.deadline = deadline
        self.until = until
        self.waited_s = 0.0

    async def wait(self) -> float:
        """On the event loop: returns once nothing holds the input back, or its allowance is
        spent; the seconds it waited."""
        due, began = self.due, self.due._clock()
        while (left := self._left_s(due.holding_back(self.deadline))) > 0:
            due._changed.clear()
            try:
                # Woken by each first output; rechecked at least every few ms, as deadlines
                # move into the horizon with the clock.
                await asyncio.wait_for(due._changed.wait(), timeout=min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return self._spent(began)

    def pause(self) -> float:
        """On the lane's thread, between two pieces: as `wait`, blocking that thread."""
        due, began = self.due, self.due._clock()
        with due._lock:
            while (left := self._left_s(due._holding_back(self.deadline))) > 0:
                due._lock.wait(timeout=min(left, 0.05))
        return self._spent(began)

    def _left_s(self, holding_back: int) -> float:
        """How long to wait on: the allowance left while something holds the input back; 0
        to go on."""
        return max(0.0, self.until - self.due._clock()) if holding_back else 0.0

    def _spent(self, began: float) -> float:
        waited = self.due._clock() - began
        self.waited_s += waited
        return waited
