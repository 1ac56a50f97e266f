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

So a long input waits, before its lane takes it, while a request whose deadline is both earlier
than its own and within URGENT_HORIZON_S still owes its first output, for MAX_DEFER_S at most:
slack-ordered host work, as the engine orders its steps. A document's objective is seconds;
the wait costs it at most MAX_DEFER_S of it. A request with no deadline waits as if its
deadline were infinitely far away. Requests with far deadlines never hold one back (two
documents do not wait for each other).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Hashable

# Deadlines further away than this do not hold a long input back: the host time its
# tokenization takes (a tenth of a second or so) is no risk to them.
URGENT_HORIZON_S = 1.0
# The longest a long input waits for others' first outputs: a document's objective is seconds.
MAX_DEFER_S = 0.5


class DueFirstOutputs:
    """Requests between their admission and their first output, by deadline (wall clock, as
    the arrival stamps). One per API process; used from its event loop only."""

    def __init__(self, clock: Callable[[], float] = time.time, *,
                 horizon_s: float = URGENT_HORIZON_S, max_defer_s: float = MAX_DEFER_S) -> None:
        self._clock = clock
        self.horizon_s = horizon_s
        self.max_defer_s = max_defer_s
        self._deadlines: dict[Hashable, float] = {}
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._deadlines)

    def due(self, key: Hashable, deadline: float | None) -> None:
        """`key`'s first output is owed by `deadline` (None: no deadline; not recorded)."""
        if deadline is not None and math.isfinite(deadline):
            self._deadlines[key] = deadline

    def out(self, key: Hashable) -> None:
        """`key` has had its first output, or ended without one (refused, failed, gone).
        Idempotent."""
        if self._deadlines.pop(key, None) is not None:
            self._changed.set()

    def holding_back(self, deadline: float | None) -> int:
        """How many owed first outputs hold back a long input with `deadline` now."""
        now = self._clock()
        own = math.inf if deadline is None else deadline
        return sum(1 for d in self._deadlines.values()
                   if d < own and d - now < self.horizon_s)

    async def wait_for_earlier(self, deadline: float | None) -> float:
        """Returns once no owed first output holds back a long input with `deadline`, or after
        max_defer_s; the seconds it waited."""
        began = self._clock()
        while self.holding_back(deadline):
            left = self.max_defer_s - (self._clock() - began)
            if left <= 0:
                break
            self._changed.clear()
            try:
                # Woken by each first output; rechecked at least every few ms, as deadlines
                # move into the horizon with the clock.
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.05))
            except asyncio.TimeoutError:
                pass
        return self._clock() - began
