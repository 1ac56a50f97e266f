"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), in front of the EngineCore process.

`build_app` wires one app: the engine client and the serving objects, made once and kept on
`app.state` (engine.serving.serving_engine and the serving_* modules beside it hold what each
route does), the route handlers below, the error handlers and the middleware. `run_server`
runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import EngineConfig
from engine.ipc.async_client import AsyncEngineClient, EngineDeadError
from engine.ipc.core_launch import CoreLaunch
from engine.processing.input_processor import InputProcessor
from engine.serving.api_key import key_matches
from engine.serving.api_errors import APIError, BodyLimit, InternalErrors, JSONBody, api_error_body
from engine.serving.arrival import ArrivalStamp, http_protocol
from engine.serving.drain import Drain, DrainGate
from engine.serving.load_shedding import QueueShed
from engine.serving.metrics import ServerMetrics
from engine.serving.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from engine.serving.responses_protocol import ResponsesRequest
from engine.serving.server_settings import ServerSettings
from engine.serving.serving_chat import OpenAIServingChat
from engine.serving.serving_completion import OpenAIServingCompletion
from engine.serving.serving_engine import SLO_HEADER, OpenAIServing
from engine.serving.serving_models import OpenAIServingModels, served_name
from engine.serving.serving_tokenize import OpenAIServingTokenization
from engine.serving.tokenize_api import DetokenizeRequest, TokenizeRequest
from engine.serving.tokenize_lanes import TokenizeLanes

# Where they were first defined, for those who import them from here (the CLI, the fleet).
__all__ = ["SLO_HEADER", "VERSION", "ServerSettings", "build_app", "run_server", "served_name"]

VERSION = "0.1.0"


# ---- the serving objects of a request's app -----------------------------------------------

def _client(request: Request) -> AsyncEngineClient:
    return request.app.state.client


def _models(request: Request) -> OpenAIServingModels:
    return request.app.state.serving_models


def _chat(request: Request) -> OpenAIServingChat:
    return request.app.state.serving_chat


def _completion(request: Request) -> OpenAIServingCompletion:
    return request.app.state.serving_completion


def _tokenization(request: Request) -> OpenAIServingTokenization:
    return request.app.state.serving_tokenization


# ---- the API key --------------------------------------------------------------------------

async def check_api_key(request: Request) -> None:
    given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
    if not key_matches(given, request.app.state.expected_authorization):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")


async def check_monitoring_key(request: Request) -> None:
    """/metrics and /debug/stats ask for the API key only with --metrics-require-api-key."""
    if request.app.state.settings.metrics_require_api_key:
        await check_api_key(request)


auth = [Depends(check_api_key)]
monitoring_auth = [Depends(check_monitoring_key)]

# ---- the routes ---------------------------------------------------------------------------

router = APIRouter(default_response_class=JSONBody)


@router.get("/health")
async def health(request: Request) -> Response:
    drain: Drain = request.app.state.drain
    if drain.draining:  # load balancers stop sending before the server goes away
        return JSONBody({"status": "draining"}, 503)
    return Response(status_code=200 if _client(request).is_alive() else 503)


@router.get("/version")
async def version() -> dict:
    return {"version": VERSION}


@router.get("/metrics", dependencies=monitoring_auth)
async def prometheus(request: Request) -> Response:
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/debug/stats", dependencies=monitoring_auth)
async def debug_stats(request: Request) -> dict:
    client = _client(request)
    stats = client.stats
    return {"num_blocks": client.num_blocks, "num_free_blocks": stats.num_free_blocks,
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage, "num_steps": stats.num_steps,
            "ttft_model": stats.ttft_model}


@router.get("/v1/models", dependencies=auth)
async def models(request: Request) -> dict:
    return _models(request).list_models()


@router.get("/v1/models/{model_id:path}", dependencies=auth)
async def model(model_id: str, request: Request) -> dict:
    served = _models(request)
    served.check_model_name(model_id)
    return served.card(model_id)


@router.post("/tokenize", dependencies=auth)
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    return await _tokenization(request).tokenize(body)


@router.post("/detokenize", dependencies=auth)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return await _tokenization(request).detokenize(body)


@router.post("/v1/completions", dependencies=auth)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _completion(request).create_completion(body, request)


@router.post("/v1/chat/completions", dependencies=auth)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _chat(request).create_chat_completion(body, request)


@router.post("/v1/responses", dependencies=auth)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await _chat(request).create_response(body, request)


# ---- errors in OpenAI's shape ---------------------------------------------------------------

async def _api_error(_: Request, exc: APIError) -> JSONBody:
    return JSONBody(api_error_body(exc), exc.status, headers=exc.headers)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONBody:
    # Unknown routes (404) and wrong methods (405) answer in the OpenAI error shape too.
    return JSONBody(error_body(str(exc.detail), exc.status_code), exc.status_code,
                    headers=getattr(exc, "headers", None))


async def _invalid(_: Request, exc: RequestValidationError) -> JSONBody:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") != "json_invalid":
        # A field of several types (a prompt: text, token ids, or a list of either) fails
        # once per type; the error that got deepest into the value is the one that names
        # what is wrong (`prompt.list[int].2: ... a valid integer`, not `prompt.str: ...
        # a valid string` for a list with a null in it).
        field = tuple(first.get("loc", ())[:2])
        first = max((e for e in errors if tuple(e.get("loc", ())[:2]) == field),
                    key=lambda e: len(e.get("loc", ())), default=first)
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return JSONBody(error_body(f"malformed JSON body: {reason}", 400), 400)
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}"
    return JSONBody(error_body(message, 400, where or None), 400)


async def _dead(_: Request, exc: EngineDeadError) -> JSONBody:
    return JSONBody(error_body(str(exc), 503), 503)


# ---- the app --------------------------------------------------------------------------------

@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    client: AsyncEngineClient = app.state.client
    lanes: TokenizeLanes = app.state.lanes
    try:
        await client.start()
        # vLLM's per-request token histograms reach the context the engine settled on.
        app.state.metrics.vllm.add_request_token_histograms(client.max_model_len)
        yield
    finally:
        # On every way out: a normal shutdown, a failed start, and the lifespan task
        # cancelled (uvicorn skips the lifespan shutdown on a forced exit, a second Ctrl-C,
        # and asyncio.run then cancels the task): the EngineCore process is stopped and the
        # preempt signal's shared memory removed before the process exits.
        try:
            await client.shutdown()
        finally:
            lanes.shutdown()


def build_app(config: EngineConfig, settings: ServerSettings,
              launch: CoreLaunch | None = None) -> FastAPI:
    """``launch``: the EngineCore process `sloserve serve` started ahead of the app
    (engine.ipc.core_launch); without one the app's start spawns it."""
    client = AsyncEngineClient(config, launch=launch)
    metrics = ServerMetrics(settings.served_model_name)
    client.observer = metrics
    # Tokenization, chat templating and grammar checks run off the event loop, so that a 1 MiB
    # prompt does not stall every open stream, in two lanes, so that a turn does not queue
    # behind a document (engine.serving.tokenize_lanes).
    lanes = TokenizeLanes(client.inputs, lambda: InputProcessor.for_model(config.model))
    models = OpenAIServingModels(settings, client)
    serving = OpenAIServing(client, metrics, settings, models, lanes)

    app = FastAPI(title="sloserve", version=VERSION, lifespan=lifespan,
                  default_response_class=JSONBody)
    app.state.settings = settings
    app.state.client = client
    app.state.metrics = metrics
    app.state.lanes = lanes
    # `await app.state.drain.drain(timeout)`: what SIGTERM does in wait mode, and what a
    # fleet's replica calls when it is removed.
    drain = Drain(client)
    app.state.drain = drain
    app.state.expected_authorization = (None if settings.api_key is None
                                        else f"Bearer {settings.api_key}".encode())
    app.state.serving_models = models
    app.state.serving_chat = OpenAIServingChat(serving)
    app.state.serving_completion = OpenAIServingCompletion(serving)
    app.state.serving_tokenization = OpenAIServingTokenization(client, models, lanes)

    # Each middleware added goes around those added before it.
    app.add_middleware(BodyLimit, limit=settings.max_request_body_bytes)
    if settings.queue_bounds.max_requests is not None:
        # A full server refuses before the body is read (engine.serving.load_shedding).
        app.add_middleware(QueueShed, ledger=serving.ledger,
                           expected_authorization=lambda: app.state.expected_authorization)
    app.add_middleware(InternalErrors)
    # A request refused while draining costs nothing past its arrival stamp, and one in
    # flight counts until its response's last byte is sent.
    app.add_middleware(DrainGate, drain=drain)
    # Outermost: every TTFT clock starts at the first moment the app sees its request.
    app.add_middleware(ArrivalStamp)

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(EngineDeadError, _dead)
    app.include_router(router)
    return app


def run_server(config: EngineConfig, settings: ServerSettings, host: str, port: int,
               log_level: str = "info", launch: CoreLaunch | None = None) -> None:
    """Run uvicorn with one addition: a shutdown signal first ends every in-flight stream with
    an error event, so that uvicorn's wait for open connections does not wait on generation.
    With `settings.shutdown.mode == "wait"` the first SIGTERM drains instead (the server keeps
    listening to refuse new requests with a 503 while those in flight finish; it exits 0
    once they have), and stops as above past the timeout or on a second signal."""
    import uvicorn

    app = build_app(config, settings, launch)
    client: AsyncEngineClient = app.state.client
    drain: Drain = app.state.drain
    shutdown = settings.shutdown

    class Server(uvicorn.Server):
        draining = False
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig, frame) -> None:
            # A signal handler: only what is safe there (a flag, a kill); the rest goes through
            # the event loop.
            loop = client.loop
            if (shutdown.mode == "wait" and sig == signal.SIGTERM and not self.draining
                    and client.is_serving() and loop is not None and not loop.is_closed()):
                # (An engine still starting has nothing in flight: it is stopped at once.)
                self.draining = True
                loop.call_soon_threadsafe(self._start_drain, sig)
                return
            client.stop_soon()
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(client.fail_all, "the server is shutting down")
            super().handle_exit(sig, frame)

        def _start_drain(self, sig: int) -> None:
            # Held: the event loop keeps only a weak reference to a task.
            self.drain_task = asyncio.get_running_loop().create_task(self._drain(sig))

        async def _drain(self, sig: int) -> None:
            if await drain.drain(shutdown.timeout_s):
                # Nothing was cut short: exit 0, not by re-raising the signal as uvicorn
                # does (what an abort still does).
                self.should_exit = True
            else:
                self.handle_exit(sig, None)

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          timeout_graceful_shutdown=30, http=http_protocol())).run()
