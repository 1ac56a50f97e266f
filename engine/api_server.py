"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), in front of the EngineCore process."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_client import AsyncEngineClient, EngineDeadError
from engine.config import EngineConfig
from engine.metrics import ServerMetrics
from engine.openai_protocol import (ChatCompletionRequest, CompletionRequest, GenerationRequest,
                                    error_body)
from engine.openai_responses import (ResponseContext, full_response, stream_events)
from engine.outputs import RequestOutput

VERSION = "0.1.0"
SLO_HEADER = "x-slo-ttft-ms"


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    default_ttft_slo_ms: float | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def build_app(config: EngineConfig, settings: ServerSettings) -> FastAPI:
    client = AsyncEngineClient(config)
    metrics = ServerMetrics(settings.served_model_name)
    client.observer = metrics
    request_ids = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        yield
        await client.shutdown()

    app = FastAPI(title="sloserve", version=VERSION, lifespan=lifespan)
    app.state.client = client
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, limit=settings.max_request_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status, exc.param), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405) answer in the OpenAI error shape too.
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"malformed JSON body: {reason}", 400), 400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
        return JSONResponse(error_body(message, 400, where or None), 400)

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 503), 503)

    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {settings.api_key}":
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    auth = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if client.is_alive() else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/stats")
    async def debug_stats() -> dict:
        stats = client.stats
        return {"num_blocks": client.num_blocks, "num_free_blocks": stats.num_free_blocks,
                "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage, "num_steps": stats.num_steps}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "sloserve", "max_model_len": client.max_model_len}]}

    def _check_model(body: GenerationRequest) -> None:
        if body.model is not None and body.model != settings.served_model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{settings.served_model_name}`", "model")

    def _slo(body: GenerationRequest, request: Request) -> float | None:
        if body.ttft_slo_ms is not None:  # the body wins over the header
            return body.ttft_slo_ms
        header = request.headers.get(SLO_HEADER)
        if header is None:
            return settings.default_ttft_slo_ms
        try:
            value = float(header)
        except ValueError:
            value = float("nan")
        if not value >= 0 or value == float("inf"):
            raise APIError(400, f"{SLO_HEADER} must be a non-negative number of milliseconds, "
                                f"got {header!r}", SLO_HEADER)
        return value

    async def _serve(body: GenerationRequest, request: Request, prompt: str | None,
                     prompt_ids: list[int], chat: bool) -> Response:
        arrival = request.state.arrival
        _check_model(body)
        slo = _slo(body, request)
        try:
            client.validate(prompt_ids)
            # As OpenAI: completions default to 16 tokens, chat to what the context leaves.
            default_max = 16 if not chat else max(1, client.max_model_len - len(prompt_ids))
            params = body.sampling_params(default_max)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex[:16]}-{next(request_ids)}"
        outputs = client.generate(request_id, prompt, prompt_ids, params, arrival_time=arrival,
                                  priority=body.priority, ttft_slo_ms=slo)
        ctx = ResponseContext(request_id=request_id, model=settings.served_model_name, chat=chat,
                              include_usage=body.include_usage,
                              stop_holdback=max((len(s) - 1 for s in params.stop), default=0))
        if body.stream:
            events = stream_events(ctx, _forget_on_exit(outputs, metrics, request_id),
                                   lambda message: error_body(message, 503))
            return StreamingResponse(events, media_type="text/event-stream")
        final = await _last_unless_disconnected(outputs, request)
        if final is None:  # the client went away; generate()'s cleanup aborted the request
            metrics.forget(request_id)
            return Response(status_code=499)
        return JSONResponse(full_response(ctx, final))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if isinstance(body.prompt, str):
            prompt, ids = body.prompt, _encode(client, body.prompt)
        else:
            prompt, ids = None, list(body.prompt)
        return await _serve(body, request, prompt, ids, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            messages = [m.as_template_input() for m in body.messages]
            ids = client.inputs.apply_chat_template(messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc
        return await _serve(body, request, None, ids, chat=True)

    return app


def _encode(client: AsyncEngineClient, prompt: str) -> list[int]:
    try:
        return client.inputs.encode(prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from exc


async def _forget_on_exit(outputs: AsyncIterator[RequestOutput], metrics: ServerMetrics,
                          request_id: str) -> AsyncIterator[RequestOutput]:
    try:
        async for out in outputs:
            yield out
    finally:
        await outputs.aclose()  # aborts the request in the core if it did not finish
        metrics.forget(request_id)


async def _last_unless_disconnected(outputs: AsyncIterator[RequestOutput],
                                    request: Request) -> RequestOutput | None:
    async def drain() -> RequestOutput | None:
        last = None
        async for out in outputs:
            last = out
        return last

    task = asyncio.create_task(drain())
    try:
        while True:
            done, _ = await asyncio.wait([task], timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await outputs.aclose()
                return None
    finally:
        if not task.done():
            task.cancel()


class _BodyLimit:
    """Pure ASGI middleware: stamps the arrival time and refuses bodies over `limit` bytes with
    413, by Content-Length up front or by counting a streamed body."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["arrival"] = time.monotonic()
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen, too_large, started = 0, False, False

        async def limited_receive():
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    too_large = True
                    raise _TooLarge()
            return message

        async def guarded_send(message) -> None:
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

    async def _refuse(self, send) -> None:
        body = json.dumps(error_body(f"request body larger than {self.limit} bytes", 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def served_name(model_dir: str) -> str:
    return Path(model_dir).name


def run_server(config: EngineConfig, settings: ServerSettings, host: str, port: int,
               log_level: str = "info") -> None:
    """Run uvicorn with one addition: a shutdown signal first ends every in-flight stream with
    an error event, so that uvicorn's wait for open connections does not wait on generation."""
    import uvicorn

    app = build_app(config, settings)
    client: AsyncEngineClient = app.state.client

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            loop = client.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(client.fail_all, "the server is shutting down")
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=30)).run()
