"""The fleet's HTTP server: uvicorn in the ingress replica's process, on the fleet's port.

The ingress serves its clients itself, as the single-engine server does, rather than through
Ray Serve's HTTP: neither its proxy (one more process and gRPC hop for every request and every
chunk) nor its direct ingress, which wraps each request in Ray Serve's own bookkeeping (its
request-id and proxy-header middlewares, a receive task, request metrics and an access-log
record) on the same event loop that takes in a flood and relays every stream. Under an
80-request flood on a 2-core host the fleet met 96 of 141 accepted urgent turns this way
against 70 of 145 through the direct ingress, alternated on one fleet (bench/RESULTS.md,
Overload). Ray Serve still places the ingress replica, checks its health, replaces it and stops
it; its HTTP proxy is not started (engine.fleet.launch).

The socket is bound when the ingress is constructed, so a port in use fails the replica at once
with the error naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from engine.serving.arrival import http_protocol

logger = logging.getLogger(__name__)

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
# uvicorn's own default.
LISTEN_BACKLOG = 2048


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (a client that connects before the
    server's task first runs waits in the backlog, not refused); `host` resolved as
    engine.ports.free_port resolves it. OSError naming the address when it cannot be bound (a
    port in use, a host that does not resolve)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        # A fleet deployed again takes its port back at once, past the last one's TIME_WAITs.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 clients too
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise OSError(exc.errno, f"the fleet cannot serve on {host}:{port}: "
                                 f"{exc.strerror or exc}") from exc
    return sock


class IngressHttpServer:
    """`app` served on (host, port) from the calling event loop until `stop`."""

    def __init__(self, app: ASGIApp, host: str, port: int, graceful_timeout_s: float) -> None:
        self.address = f"{host}:{port}"
        self._socket = bind_listener(host, port)
        self._server = uvicorn.Server(uvicorn.Config(
            app, interface="asgi3", lifespan="off", ws="none", access_log=False,
            # Stamps each request's arrival as its bytes are read (engine.serving.arrival).
            http=http_protocol(),
            log_level="warning", server_header=False,
            # Open streams finish within this once the ingress is told to stop.
            timeout_graceful_shutdown=max(1, round(graceful_timeout_s))))
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    def failure(self) -> str | None:
        """Why the server stopped serving on its own; None while it serves (or was stopped)."""
        if not self._task.done() or self._server.should_exit:
            return None
        exc = None if self._task.cancelled() else self._task.exception()
        return f"the HTTP server on {self.address} stopped: " + (
            f"{type(exc).__name__}: {exc}" if exc is not None else "it exited")

    async def stop(self) -> None:
        """Stop taking connections and let open responses finish (up to the graceful timeout)."""
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        self._socket.close()
