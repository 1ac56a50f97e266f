"""Where every TTFT clock starts: the moment a request reaches the server, stamped by the
outermost of the app's middleware (`request.state.arrival`, on the monotonic clock).

The engine's deadline is this stamp plus the request's TTFT objective, and the edge stamps
(engine.serving.edge_clock) count the client's TTFT and TPOT from it.
"""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send


class ArrivalStamp:
    """ASGI middleware: stamps `scope["state"]["arrival"]` as an HTTP request comes in."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # setdefault: a fleet replica's bridge (engine.fleet.asgi_bridge) stamps the arrival
        # at the fleet's ingress, where the client's request was read.
        scope.setdefault("state", {}).setdefault("arrival", time.monotonic())
        # Requests that arrive together are read in one pass of the event loop, and each then
        # runs its handler up to its first wait (validation, routing: about a millisecond) in
        # turn: without this yield the sixteenth of a burst would be stamped some 20 ms after it
        # was read, time its client waits and its TTFT would not count. Every request of the
        # pass is stamped first; the yield costs one loop iteration.
        await asyncio.sleep(0)
        await self.app(scope, receive, send)
