"""Requests taken in one per event-loop iteration, so that a flood's intake does not hold up
the streams already running.

asyncio runs, in each iteration of its loop, every callback that was ready when the iteration
began. Under a flood the first step of every arrived request is ready at once: on a 2-core host,
80 requests that each take 2 ms to read, check and route or refuse made one iteration of 160
ms, and every wake-up posted meanwhile (a replica's first token for a stream already accepted,
handed over from the router's loop) waited for its end: the accepted urgent turns' first
outputs all left after the last request was taken in (bench/RESULTS.md, Overload). A request
now waits for its turn, and turns are granted one per iteration: an iteration holds one
request's intake and whatever else became ready, so a wake-up waits for one intake, not all.
"""

from __future__ import annotations

import asyncio
from collections import deque


class IntakeTurns:
    """Turns to take in a request, one per iteration of the event loop it is used from."""

    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._granting = False

    def __len__(self) -> int:
        """Requests waiting for their turn."""
        return len(self._waiting)

    async def turn(self) -> None:
        """Returns in an iteration of the loop in which no other request's turn began."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiting.append(turn)
        if not self._granting:
            self._granting = True
            loop.call_soon(self._grant, loop)
        await turn

    def _grant(self, loop: asyncio.AbstractEventLoop) -> None:
        # The granted request resumes in the next iteration, and so does this call, which
        # grants the one after it there: its resumption is queued behind that request's.
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # one whose client went away is skipped
                turn.set_result(None)
                break
        if self._waiting:
            loop.call_soon(self._grant, loop)
        else:
            self._granting = False
