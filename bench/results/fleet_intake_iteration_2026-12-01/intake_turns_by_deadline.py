"""Requests taken in one per event-loop iteration, most urgent first.

asyncio runs, in each iteration of its loop, every callback that was ready when the iteration
began. Under a flood the first step of every arrived request is ready at once: traced in a
fleet's ingress on a 2-core host, 40 requests read, checked and routed or refused back to back
made one iteration of 190 ms, and every wake-up posted meanwhile (a replica's response for a
stream already accepted, handed over from the router's loop) waited for its end: the accepted
urgent turns' first outputs all left after the last request was taken in (bench/RESULTS.md,
Overload). A request now waits for its turn, and turns are granted one per iteration: an
iteration holds one request's intake and whatever else became ready, so a wake-up waits for
one intake, not all of them. Turns go by deadline (the earliest first; none last, in arrival
order), as the engine orders its steps: of a flood that arrives at once, the turns with tight
objectives are read, routed and admitted first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math


class IntakeTurns:
    """Turns to take in a request, one per iteration of the event loop it is used from."""

    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._granting = False

    def __len__(self) -> int:
        """Requests waiting for their turn."""
        return len(self._waiting)

    async def turn(self, deadline: float | None = None) -> None:
        """Returns in an iteration of the loop in which no other request's turn began, once no
        request waiting with an earlier `deadline` (any clock, the same for all) is left."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        key = math.inf if deadline is None else deadline
        heapq.heappush(self._waiting, (key, next(self._order), turn))
        if not self._granting:
            self._granting = True
            loop.call_soon(self._grant, loop)
        await turn

    def _grant(self, loop: asyncio.AbstractEventLoop) -> None:
        # The granted request resumes in the next iteration, and so does this call, which
        # grants the one after it there: its resumption is queued behind that request's.
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # one whose client went away is skipped
                turn.set_result(None)
                break
        if self._waiting:
            loop.call_soon(self._grant, loop)
        else:
            self._granting = False
