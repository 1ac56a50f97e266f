"""What a client is told when something goes wrong, and the pure-ASGI middleware around the app.

A client gets a short message in the OpenAI error shape; an internal failure is reported as
"internal error (id err-...)" and its traceback goes to the server log under that id, so an
operator can find it and a client learns nothing about the server's code or its paths.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.ipc.async_client import EngineDeadError, RequestFailedError, new_error_id
from engine.serving.openai_protocol import error_body

logger = logging.getLogger(__name__)


def encode_json(content: Any) -> bytes:
    """JSON as Starlette writes it, except for lone surrogates: a client may send one (as a
    \\ud800 escape), and error messages and completions echo what the client sent, where
    UTF-8 cannot encode it. It goes back out as the same escape, so the client reads back
    exactly what it sent."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8", "backslashreplace")


class JSONBody(JSONResponse):
    """The app's JSON response class (see encode_json)."""

    def render(self, content: Any) -> bytes:
        return encode_json(content)


class APIError(Exception):
    """An error the client caused (or may retry): status, message and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        # Response headers beside the body (a 429's Retry-After).
        self.headers = headers
        # Fields the error object carries beside OpenAI's (a doomed request's
        # predicted_ttft_ms and objective).
        self.details = details


def api_error_body(exc: APIError) -> dict[str, Any]:
    """The response body of an APIError: OpenAI's error shape, with its details."""
    body = error_body(exc.message, exc.status, exc.param)
    if exc.details:
        body["error"].update(exc.details)
    return body


def log_internal_error(exc: BaseException, where: str) -> str:
    """Logs `exc` with its traceback under a fresh id; returns the text a client may see."""
    error_id = new_error_id()
    logger.error("internal error %s in %s", error_id, where, exc_info=exc)
    return f"internal error (id {error_id})"


def describe_error(exc: Exception, where: str) -> tuple[int, str, str | None]:
    """(status, message, param) for an exception that ends a request. Messages of the known
    kinds are short by construction (EngineDeadError carries an error id, not the core's
    traceback; RequestFailedError is one line, its traceback logged where it happened;
    ValueError is what the engine says about bad input); anything else is a bug and is logged,
    never shown."""
    if isinstance(exc, APIError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, EngineDeadError):
        return 503, str(exc), None
    if isinstance(exc, RequestFailedError):
        return 500, str(exc), None
    if isinstance(exc, ValueError):
        return 400, str(exc), None
    return 500, log_internal_error(exc, where), None


def error_for(exc: Exception, where: str) -> dict[str, Any]:
    status, message, param = describe_error(exc, where)
    return error_body(message, status, param)


class InternalErrors:
    """Outermost middleware: an exception nothing else handled becomes a 500 in the OpenAI
    shape (its traceback logged under an id) instead of Starlette's plain-text page, and does
    not reach uvicorn, which would log it a second time without the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            message = log_internal_error(exc, f"{scope.get('method')} {scope.get('path')}")
            if not started:  # else the client sees the connection end mid-response
                await send_json(send, 500, error_body(message, 500))


class BodyLimit:
    """Refuses bodies over `limit` bytes with 413, by Content-Length up front or by counting a
    streamed body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen, too_large, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    too_large = True
                    raise _TooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns an exception raised while it reads the body into its own 400
            # ("There was an error parsing the body"): once the body is over the limit, drop
            # whatever the app answers and send the 413 below instead.
            nonlocal started
            if too_large:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large and not started:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        await send_json(send, 413, error_body(f"request body larger than {self.limit} bytes",
                                              413))


class _TooLarge(Exception):
    pass


async def send_json(send: Send, status: int, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> None:
    data = encode_json(body)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            *((k.lower().encode(), v.encode())
                              for k, v in (headers or {}).items())]})
    await send({"type": "http.response.body", "body": data})
