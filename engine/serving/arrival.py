"""Where every TTFT clock starts: the moment a request's first bytes are read off its connection
(`scope["state"]["arrival"]`, on the monotonic clock).

The engine's deadline is this stamp plus the request's TTFT objective, the edge stamps
(engine.serving.edge_clock) count the client's TTFT and TPOT from it, and a fleet's ingress
forwards it to the replica as the request's arrival.

uvicorn's HTTP protocol stamps it (`ArrivalStampingProtocol`, as its llhttp parser meets the
request line), not the app: a flood's requests are all read in one pass of the event loop, and
each request's app then starts only once the loop comes round to it, after the parsing, the
other requests' first steps and the responses written meanwhile. Stamped by the app, a 2-core
fleet's flood of 80 requests showed its clients a TTFT some 30 ms longer than its own
(bench/RESULTS.md, Overload): time the client waited and the deadline did not count, so the
scheduler thought it had slack it did not have and the router admitted turns it could not
serve in time. Without httptools (uvicorn's own choice then), the outermost middleware stamps
it (`ArrivalStamp`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed here
    HttpToolsProtocol = None  # type: ignore[assignment, misc]

ARRIVAL = "arrival"


def arrival_of(scope: Scope) -> float:
    """The request's arrival stamp (monotonic), stamping it now where nothing has yet."""
    return scope.setdefault("state", {}).setdefault(ARRIVAL, time.monotonic())


def wall_clock(monotonic_stamp: float) -> float:
    """The same moment as `monotonic_stamp` on the wall clock (time.time()), which the
    processes of a fleet share."""
    return time.time() - max(0.0, time.monotonic() - monotonic_stamp)


if HttpToolsProtocol is not None:

    class ArrivalStampingProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol, stamping each request as its request line begins:
        the loop has just read its bytes (a request on a kept-alive connection likewise)."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"][ARRIVAL] = time.monotonic()


def http_protocol() -> Any:
    """uvicorn's `http` setting: the stamping protocol, or "auto" without httptools."""
    return "auto" if HttpToolsProtocol is None else ArrivalStampingProtocol


class ArrivalStamp:
    """ASGI middleware: stamps `scope["state"]["arrival"]` as an HTTP request comes in, where
    the protocol has not (another server than uvicorn with httptools, or a test's client)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # A fleet replica's bridge (engine.fleet.asgi_bridge) has the arrival at the fleet's
        # ingress, where the client's request was read.
        if ARRIVAL not in scope.setdefault("state", {}):
            arrival_of(scope)
            # Requests that arrive together are read in one pass of the event loop, and each
            # then runs its handler up to its first wait (validation, routing: about a
            # millisecond) in turn: without this yield the sixteenth of a burst would be
            # stamped some 20 ms after it was read. Every request of the pass is stamped
            # first; the yield costs one loop iteration.
            await asyncio.sleep(0)
        await self.app(scope, receive, send)
