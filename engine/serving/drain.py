"""Draining the HTTP server: stop taking generation requests, let those in flight finish.

On SIGTERM with `--shutdown-mode wait` (and when a fleet removes its replica, which calls the
same `Drain.drain`), the server keeps listening but answers every new generation request with
a 503 that says it is draining, and /health with 503 `{"status": "draining"}`, so that load
balancers send their traffic elsewhere; the requests in flight run to their normal end (a
stream to its last chunk and [DONE]). Past the timeout the rest is aborted as in the default
`abort` mode: their streams end with an error event.

A request is in flight from the moment its HTTP request reaches a generation route until its
response is completely written (a stream's last chunk): counted by an ASGI gate around the
app, so that a request still being tokenized, or a stream whose engine work is done but whose
last chunks are not yet sent, holds the drain too.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.ipc.async_client import AsyncEngineClient
from engine.serving.openai_protocol import error_body

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
DRAINING_MESSAGE = ("the server is draining (shutting down once the requests in flight have "
                    "finished): send this request to another replica")
# After a drain's timeout aborts what was left: how long their error events get to be written.
ABORT_GRACE_S = 5.0


class Drain:
    """The server's drain state, one per app (`app.state.drain`)."""

    def __init__(self, client: AsyncEngineClient) -> None:
        self.client = client
        self.draining = False
        self.in_flight = 0
        self._changed = asyncio.Event()

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        self._changed.set()

    async def drain(self, timeout: float) -> bool:
        """Stop taking generation requests and wait up to `timeout` seconds for the ones in
        flight to finish. True when they all did; False when the timeout came first, and
        then they were aborted (their streams end with an error event, written before this
        returns, up to ABORT_GRACE_S more). Idempotent; the server stays up either way (its
        owner stops it)."""
        if not self.draining:
            self.draining = True
            logger.info("draining: %d request(s) in flight, refusing new ones (timeout %g s)",
                        self.in_flight, timeout)
        if await self._until_idle(timeout):
            logger.info("drained: every request in flight finished")
            return True
        logger.warning("drain timed out after %g s with %d request(s) in flight: aborting "
                       "them", timeout, self.in_flight)
        self.client.fail_all("the server is shutting down")
        await self._until_idle(ABORT_GRACE_S)
        return False

    async def _until_idle(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight > 0:
            left = deadline - loop.time()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return self.in_flight == 0
        return True


class DrainGate:
    """ASGI middleware: counts the generation requests in flight, and refuses new ones with a
    503 (OpenAI's error shape, `Connection: close`) while the server drains."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _refuse(send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


async def _refuse(send: Send) -> None:
    body = json.dumps(error_body(DRAINING_MESSAGE, 503)).encode()
    # Connection: close: a keep-alive client reconnects, and its balancer sends it elsewhere.
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
