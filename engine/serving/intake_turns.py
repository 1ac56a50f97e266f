"""Requests taken in by slices of the event loop's time, so that a flood's intake does not hold
up the streams already running.

asyncio runs, in each iteration of its loop, every callback that was ready when the iteration
began. Under a flood the first step of every arrived request is ready at once, and each one
reads, tokenizes, admits and routes its request before it first waits: traced in a fleet's
ingress on a 2-core host, some 40 requests made one iteration of 190 ms, and every wake-up
posted meanwhile (a replica's first token for a stream already accepted, handed over from the
router's loop) waited for its end (bench/RESULTS.md, Overload). A request now takes its turn
before that work: turns are granted in slices of about ``slice_s`` of the loop's time, and a
slice ends at the next iteration, so a wake-up waits for one slice of intake, not all of it.

Slices rather than one turn per iteration: every iteration releases the GIL in its poll, and in
a process whose other threads run Python (Ray Serve's router loop, a tokenizing lane) taking it
back costs up to a switch interval; one intake per iteration took in a flood at half the rate.
Turns go by TTFT deadline, the earliest first (arrival order among equals; a request without
one after every deadline), as the engine orders its steps: of a flood that arrives at once,
the urgent turns are read, tokenized and routed before the documents beside them. A request
that waits for a turn is counted where it is admitted against (the ingress counts it among
those being prepared).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time

# One slice of intake: a wake-up posted during a slice waits about this long for the loop.
DEFAULT_SLICE_S = 0.008
# The estimate of one intake's cost follows the intakes measured, at this weight for the newest.
_COST_WEIGHT = 0.5


class IntakeTurns:
    """Turns to take in a request, granted by deadline, about ``slice_s`` of one event loop's
    time per iteration of it. Used from that loop only."""

    def __init__(self, slice_s: float = DEFAULT_SLICE_S) -> None:
        if not slice_s > 0:
            raise ValueError(f"slice_s must be positive, not {slice_s}")
        self.slice_s = slice_s
        # (deadline, arrival number, turn): a heap, the earliest deadline first.
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        # When the open slice's first turn began (perf_counter). None: no slice is open, the
        # next turn opens one.
        self._slice_began: float | None = None
        self._last_take = 0.0  # when the open slice's latest turn began
        # Turns granted whose requests have not yet resumed (they come before any new one).
        self._woken = 0
        self._cost_s = slice_s / 4  # one intake's loop time, as measured between turns
        self.slices = 0  # slices opened (for tests and diagnostics)

    def __len__(self) -> int:
        """Requests waiting for their turn."""
        return len(self._waiting)

    @property
    def cost_s(self) -> float:
        """The measured loop time of one intake (between consecutive turns of a slice)."""
        return self._cost_s

    async def turn(self, deadline: float | None = None) -> None:
        """Returns when this request's intake may run: at once while the open slice has time
        left and nobody waits, else once the turns with earlier deadlines (any clock, the same
        for every request; None: none, after every deadline) and the earlier arrivals among
        equal ones have been granted, in a later iteration of the loop."""
        loop = asyncio.get_running_loop()
        key = (math.inf if deadline is None else deadline, next(self._arrivals))
        woken = False
        while True:
            if (woken or not (self._waiting or self._woken)) and self._take(loop):
                return
            # Waits at its place; one woken that found the slice spent keeps it.
            turn: asyncio.Future[None] = loop.create_future()
            heapq.heappush(self._waiting, (*key, turn))
            try:
                await turn
            except asyncio.CancelledError:
                # Its request is gone. A turn granted but not taken passes to the next.
                if turn.done() and not turn.cancelled():
                    self._woken -= 1
                    self._wake(1)
                raise
            self._woken -= 1
            woken = True

    def _take(self, loop: asyncio.AbstractEventLoop) -> bool:
        now = time.perf_counter()
        if self._slice_began is None:
            self._slice_began = now
            self.slices += 1
            # Runs in the next iteration, after the callbacks ready with this one: the slice
            # is over by then.
            loop.call_soon(self._end_slice)
        elif now - self._slice_began >= self.slice_s:
            return False
        else:
            # Since the turn before it in this slice: that intake's time. A slice's own span
            # would not do: it runs to the next iteration, and the iteration that opens a
            # flood's first slice also holds the first steps of every request that arrived
            # with it (60 ms of them on a 2-core host, against 3-5 ms an intake).
            self._cost_s += _COST_WEIGHT * (now - self._last_take - self._cost_s)
        self._last_take = now
        return True

    def _end_slice(self) -> None:
        self._slice_began = None
        # As many as the measured cost fits in a slice wake for the next iteration, and never
        # fewer than two, so that a slice measures; one that finds the slice spent waits again
        # at its place.
        self._wake(max(2, math.ceil(self.slice_s / max(self._cost_s, 1e-6))))

    def _wake(self, grants: int) -> None:
        while grants and self._waiting:
            *_, turn = heapq.heappop(self._waiting)
            if not turn.done():  # a cancelled one is skipped
                turn.set_result(None)
                self._woken += 1
                grants -= 1
