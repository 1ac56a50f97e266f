"""One HTTP request through an ASGI app in this process, its response as a stream of parts.

A fleet replica serves the project's own FastAPI app (every route, error and streaming format of
the single-engine server) without a socket of its own: the ingress forwards the request it read,
the replica runs it through the app here and streams back the response start and body chunks as
the app writes them. A client that goes away reaches the app as `http.disconnect`, exactly as
uvicorn would deliver it, so the engine aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Callable

import msgspec

from engine.serving.forwarded_prompts import FORWARDED_PROMPTS_STATE

# How long an app that was told its client left may take to finish (abort its engine
# requests, run its finalizers) before it is cancelled.
DISCONNECT_GRACE_S = 2.0


class ForwardedRequest(msgspec.Struct, kw_only=True, frozen=True):
    """An HTTP request as the ingress read it."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = []
    body: bytes = b""
    client: tuple[str, int] | None = None
    # When the ingress read it (time.time()): the request's arrival, which its TTFT counts from.
    arrived_at: float | None = None
    # The token ids of its prompts as the ingress rendered them to route it, which the app
    # uses rather than tokenizing again (engine.serving.forwarded_prompts); None: the app
    # tokenizes the body's text itself.
    prompt_token_ids: list[list[int]] | None = None


class ResponseStart(msgspec.Struct, kw_only=True, frozen=True):
    status: int
    headers: list[tuple[bytes, bytes]] = []


_DONE = object()


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if request.arrived_at is not None:
        # The same moment on this process's monotonic clock (what the app's edge stamps use);
        # wall clocks of one fleet agree to NTP accuracy.
        state["arrival"] = time.monotonic() - max(0.0, time.time() - request.arrived_at)
    if request.prompt_token_ids is not None:
        state[FORWARDED_PROMPTS_STATE] = request.prompt_token_ids
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": "http",
            "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers],
            "client": request.client, "server": ("sloserve-replica", 0), "state": state}


async def call_app(app: Callable, request: ForwardedRequest
                   ) -> AsyncIterator[ResponseStart | bytes]:
    """Run `request` through the ASGI `app`: yields one ResponseStart, then the body in chunks
    as the app writes them (chunks already written when the consumer asks are joined into one,
    so a slow consumer gets fewer, larger parts rather than falling behind). Closing the
    iterator early tells the app its client disconnected."""
    parts: asyncio.Queue = asyncio.Queue()
    client_gone = asyncio.Event()
    body_delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await client_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if client_gone.is_set():
            raise OSError("the client disconnected")  # what uvicorn raises on a closed socket
        parts.put_nowait(message)

    task = asyncio.ensure_future(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: parts.put_nowait(_DONE))
    started = False
    held: Any = None  # a part read ahead while joining chunks, handled next
    try:
        while True:
            message, held = (held, None) if held is not None else (await parts.get(), None)
            if message is _DONE:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
                if not started:
                    raise RuntimeError("the app finished without a response")
                return
            if message["type"] == "http.response.start":
                started = True
                yield ResponseStart(status=message["status"],
                                    headers=[(bytes(k), bytes(v))
                                             for k, v in message.get("headers", [])])
                continue
            if message["type"] != "http.response.body":
                continue
            chunk = bytearray(message.get("body", b""))
            more = message.get("more_body", False)
            while more and not parts.empty():
                following = parts.get_nowait()
                if following is _DONE or following.get("type") != "http.response.body":
                    held = following
                    break
                chunk += following.get("body", b"")
                more = following.get("more_body", False)
            if chunk:
                yield bytes(chunk)
            if not more:
                return
    finally:
        if not task.done():
            client_gone.set()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            if not task.done():
                task.cancel()
