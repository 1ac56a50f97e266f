"""The fleet's OpenAI-compatible front door: a Ray Serve deployment in front of the replicas,
serving HTTP on the fleet's port itself (engine.fleet.ingress_http).

Every request is read here once: the API key is checked, a generation request is tokenized for
its RouteHint (prompt length, TTFT objective, prefix-block hashes) and weighed by admission, and
the request is forwarded to the replica the router picks (engine.fleet.ray_router), whose engine
serves it with the single-engine server's own routes. The response streams back unchanged.

A chat request (and a Responses request, as the chat request it amounts to:
engine.serving.responses_protocol) is rendered for its hint by the replica's own function
(engine.serving.chat_prompt: its tools and template variables included), so the router weighs
the prompt the replica will prefill; the prompt's token ids travel with the request, and the
replica prefills them rather than tokenizing its text again. A request whose hint cannot be
computed is forwarded without one, the reason logged and counted
(`sloserve:fleet_unassessed_total`): a body or chat prompt the replica refuses gets the
replica's own 400; a failure of the hint's own code is logged with its traceback.

A replica that refuses a request at its queue bound (429, `x-sloserve-rejected` naming the
bound) has it tried on another that has not, while one is left; the router ranks it after the
replicas with room until it reports again. While every replica is at its bound as the router
counts them, a generation request gets that 429 at the ingress, before its hint is computed.

Faults: a replica that dies before any byte of its response reached the client is retried on
another (generation is a pure function of the request: nothing was shown twice); one that dies
mid-stream ends the stream with an OpenAI-shaped error event. `/health` says `degraded` while
the fleet runs short of its replicas or a replica stops reporting, and `unavailable` (503, the
last error in full) until the ingress's router has started: until then there is no router book
to predict or admit by.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.config import EngineConfig
from engine.fleet.admission import assess
from engine.fleet.asgi_bridge import ForwardedRequest, ResponseStart
from engine.fleet.fleet_health import FleetHealth, RouterStart
from engine.fleet.fleet_metrics import FleetMetrics, carries_output
from engine.fleet.ingress_http import IngressHttpServer
from engine.load.load_report import RouteHint
from engine.load.prefix_hashes import prompt_prefix_hashes
from engine.fleet.replica import PREDICTED_TTFT_HEADER, REPLICA_HEADER
from engine.fleet.book_registry import fleet_book
from engine.processing.input_processor import InputProcessor
from engine.serving.admission import (QUEUED_REQUESTS, QUEUED_TOKENS, REJECTED_HEADER,
                                      queue_full_headers)
from engine.serving.serving_engine import SLO_HEADER
from engine.serving.api_key import key_matches
from engine.serving.arrival import arrival_of, wall_clock
from engine.serving.chat_prompt import chat_prompt, chat_template_of
from engine.serving.responses_protocol import ResponsesRequest, chat_request
from engine.serving.doomed import DOOMED, OnDoomed
from engine.serving.due_first_outputs import DueFirstOutputs
from engine.serving.intake_turns import IntakeTurns
from engine.serving.openai_protocol import ChatCompletionRequest, error_body
from engine.serving.tokenize_lanes import TokenizeLanes

logger = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Routes behind the API key, as on the single-engine server.
_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
# A replica that died or cannot be reached; the request is tried on another.
_REPLICA_GONE = (RayActorError, ActorUnavailableError)
_HOP_BY_HOP = {b"connection", b"transfer-encoding", b"keep-alive", b"date", b"server"}
# Prefix blocks hashed for routing at most: the first 64k tokens at block size 16. A prompt
# longer than that is told apart by its first part.
MAX_ROUTED_BLOCKS = 4096
# Between two tries of the router's warm-up probe; and how often a probe that keeps failing
# with the same error is logged again (every new error is logged at once, in full).
ROUTER_RETRY_S = 0.5
ROUTER_RELOG_S = 30.0

# Why a generation request is forwarded without the router's prediction or admission (the
# reasons of sloserve:fleet_unassessed_total).
INVALID_BODY = "invalid_body"
CHAT_PROMPT = "chat_prompt"
HINT_ERROR = "hint_error"
ROUTER_NOT_STARTED = "router_not_started"


@dataclass(frozen=True)
class Unhinted:
    """A generation request whose route hint could not be computed: `reason` (one of the
    above) and what went wrong; `error` where it was a failure of the hint's own code."""

    reason: str
    detail: str
    error: BaseException | None = None


@dataclass(frozen=True)
class Hinted:
    """A generation request's route hint, and the token ids of the prompts it was computed
    from: forwarded with the request, so that its replica does not tokenize them again
    (engine.serving.forwarded_prompts)."""

    hint: RouteHint
    prompts: list[list[int]]


@dataclass(frozen=True)
class IngressSettings:
    engine_deployment: str
    # Where the ingress serves HTTP itself (engine.fleet.ingress_http); its open streams get
    # `shutdown_timeout_s` to finish once it is told to stop.
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_timeout_s: float = 30.0
    on_doomed: OnDoomed = "serve"
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    default_ttft_slo_ms: float | None = None
    # Tries of one request on replicas that die under it before it fails with a 503.
    forward_attempts: int = 3


class FleetIngress:
    """The ingress deployment's class (engine.fleet.launch wraps it in `serve.deployment`)."""

    async def __init__(self, engine: Any, config: EngineConfig,
                       settings: IngressSettings) -> None:
        # The replicas' responses come back over Ray Serve's inter-deployment gRPC channel
        # rather than as Ray objects (`_by_reference=False`: the data plane of Ray's
        # documented RAY_SERVE_THROUGHPUT_OPTIMIZED mode). Every chunk of every stream crosses
        # this hop; as objects each one costs an object-store round trip in both processes,
        # which on a busy host delays first tokens by tens of ms (bench/RESULTS.md, Fleet).
        self.engine = engine.options(stream=True, _by_reference=False)
        self.settings = settings
        # Hints are computed off the event loop (which relays every open stream), in the API
        # server's two lanes (engine.serving.tokenize_lanes): a flood of documents to template
        # and tokenize must not hold up a short urgent turn's hint until its objective is gone,
        # nor take a core from the requests whose first outputs are due before theirs.
        self.due = DueFirstOutputs()
        self.intake = IntakeTurns()
        self.lanes = TokenizeLanes(InputProcessor.for_model(config.model),
                                   lambda: InputProcessor.for_model(config.model), self.due)
        self.inputs = self.lanes.inputs
        self._chat_template = chat_template_of(self.inputs)
        self.block_size = config.cache.block_size
        self.metrics = FleetMetrics(lambda: fleet_book(settings.engine_deployment))
        self.router_start = RouterStart()
        self.health = FleetHealth(settings.engine_deployment,
                                  lambda: fleet_book(settings.engine_deployment),
                                  self.router_start)
        self._expected_auth = (None if settings.api_key is None
                               else f"Bearer {settings.api_key}".encode())
        # Generation requests whose hints are being computed: counted against the fleet's
        # room (`_fleet_full`). From then until the router has routed one (and counts it), it
        # is counted nowhere: a moment in which more may pass than there is room for, which
        # the replicas' own bounds then refuse.
        self._preparing = 0
        self._warm_up = asyncio.create_task(self._start_router())
        self.http = IngressHttpServer(self._serve_http, settings.host, settings.port,
                                      settings.shutdown_timeout_s)
        # Ray Serve calls (and awaits) the deployment's `__del__` when it stops the ingress.
        # Set on the instance, not the class: Python's own finalizer calls only the class's,
        # and would leave an async one's coroutine unawaited.
        self.__del__ = self.http.stop
        logger.info("fleet ingress: serving HTTP on %s", self.http.address)

    async def _serve_http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app the ingress's HTTP server runs: every request through `__call__`. An
        error of the ingress's own code is logged with its traceback and answered with an
        OpenAI-shaped 500 (no traceback reaches the client)."""
        if scope["type"] != "http":
            return
        try:
            response = await self(Request(scope, receive))
        except Exception:
            logger.exception("fleet ingress: %s %s failed", scope.get("method"),
                             scope.get("path"))
            response = _error(500, "the fleet's ingress failed on this request (its log has "
                                   "the error); retry it")
        await response(scope, receive, send)

    async def check_health(self) -> None:
        """Ray Serve's health check: an ingress whose HTTP server stopped is replaced."""
        if (failure := self.http.failure()) is not None:
            raise RuntimeError(failure)

    async def _start_router(self) -> None:
        """Route one request (a replica's /health) so that this process's router exists and
        follows the replicas' reports before the first client request: admission and /health
        read its book. Tried until it succeeds; meanwhile /health answers 503 with the last
        error, and each new error is logged with its traceback."""
        probe = ForwardedRequest(method="GET", path="/health")
        start = self.router_start
        began = time.monotonic()
        logged: tuple[str, float] | None = None  # (error, when it was last logged)
        while True:
            start.attempts += 1
            try:
                async for _ in self.engine.handle.remote(probe):
                    pass
            except Exception as exc:
                start.error = f"{type(exc).__name__}: {exc}"
                now = time.monotonic()
                if logged is None or logged[0] != start.error:
                    # A fleet still starting may fail a try or two: a warning, in full.
                    logger.warning("fleet ingress: the router cannot start (attempt %d; "
                                   "/health is unavailable until it does)", start.attempts,
                                   exc_info=exc)
                    logged = (start.error, now)
                elif now - logged[1] >= ROUTER_RELOG_S:
                    logger.error("fleet ingress: the router still cannot start after %.0f s "
                                 "(attempt %d): %s", now - began, start.attempts, start.error)
                    logged = (start.error, now)
                await asyncio.sleep(ROUTER_RETRY_S)
                continue
            if start.error is not None:
                logger.info("fleet ingress: the router started (attempt %d)", start.attempts)
            start.started, start.error = True, None
            return

    async def __call__(self, request: Request) -> Response:
        # As its bytes were read (engine.serving.arrival), on the clock the fleet shares.
        arrived_at = wall_clock(arrival_of(request.scope))
        path = request.url.path
        if path == "/health":
            return await self.health.response()
        if path == "/metrics":
            return self.metrics.response()
        if path.startswith(_KEYED_PREFIXES) and not self._authorized(request):
            return _error(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")
        body = await request.body()
        if len(body) > self.settings.max_request_body_bytes:
            return _error(413, f"request body of {len(body)} bytes is over the limit of "
                               f"{self.settings.max_request_body_bytes}")
        forwarded = ForwardedRequest(
            method=request.method, path=path, query_string=request.url.query.encode(),
            headers=[(k, v) for k, v in request.headers.raw if k.lower() != b"authorization"],
            body=body, client=(request.client.host, request.client.port) if request.client
            else None, arrived_at=arrived_at)
        if request.method != "POST" or path not in GENERATION_PATHS:
            return await self._forward(forwarded, None)
        if (full := self._fleet_full()) is not None:
            return full
        slo_header = request.headers.get(SLO_HEADER)
        deadline = self._deadline(body, slo_header, arrived_at)
        # Owed from its arrival to its first output (the relay's), or to its end without one:
        # a document's tokenization defers to it from now (engine.serving.due_first_outputs).
        owed = object()
        self.due.due(owed, deadline)
        response: Response | None = None
        try:
            response = await self._generate(forwarded, slo_header, deadline, owed)
            return response
        finally:
            # A stream's relay says when it is out; any other answer is out now.
            if not isinstance(response, StreamingResponse):
                self.due.out(owed)

    async def _generate(self, forwarded: ForwardedRequest, slo_header: str | None,
                        deadline: float | None, owed: object) -> Response:
        """A generation request from its intake turn: its hint, admission and forwarding."""
        path, body, arrived_at = forwarded.path, forwarded.body, forwarded.arrived_at
        self._preparing += 1
        try:
            # In turn, the earliest deadline first: a flood's intake in slices, with the
            # streams' relays between them.
            await self.intake.turn(deadline)
            # The body's size stands for its text's (the lane's measure).
            computed = await self.lanes.on_lane(
                len(body), lambda inputs: self._hint(path, body, slo_header, arrived_at,
                                                     inputs), deadline)
        finally:
            self._preparing -= 1
        if isinstance(computed, Unhinted):
            self._unhinted(path, computed)
            return await self._forward(forwarded, None, owed)
        if (refused := self._admit(computed.hint)) is not None:
            return refused
        forwarded = msgspec.structs.replace(forwarded, prompt_token_ids=computed.prompts)
        return await self._forward(forwarded, computed.hint, owed)

    def _fleet_full(self) -> Response | None:
        """A 429 for a generation request that arrives while every replica is at its queue
        bound, as the router counts them (beside the requests whose hints are being computed
        here): refused before its hint is computed, as one server refuses before tokenizing,
        so that a flood's refused requests take no host time from those being served. None
        while there is room, or the router cannot tell (the replicas' own bounds decide)."""
        book = fleet_book(self.settings.engine_deployment)
        room = None if book is None else book.room(time.time())
        if room is None or room > self._preparing:
            return None
        self.metrics.rejected(QUEUED_REQUESTS)
        return _error(429, "every replica of the fleet is at its queue bound "
                           "(--max-num-queued-reqs); retry later",
                      queue_full_headers(QUEUED_REQUESTS))

    def _authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        return key_matches(given, self._expected_auth)

    # ---- the route hint and admission -------------------------------------------------------

    def _deadline(self, body: bytes, slo_header: str | None, arrived_at: float) -> float | None:
        """A generation request's TTFT deadline (wall clock), read before its hint is computed:
        its intake turn's place, and a long body's wait for its lane (TokenizeLanes.on_lane).
        None for a request without an objective, or one the hint will refuse (a malformed
        body: its hint says why)."""
        try:
            data = json.loads(body)
            slo_s = self._objective_s(data, slo_header) if isinstance(data, dict) else None
        except (ValueError, TypeError):
            return None
        return None if slo_s is None else arrived_at + slo_s

    def _objective_s(self, data: dict[str, Any], slo_header: str | None) -> float | None:
        """A request's TTFT objective in seconds: the body's field, else the header, else the
        server's default; None for none (or an infinite one). ValueError for a malformed one."""
        slo_ms = data.get("ttft_slo_ms")
        if slo_ms is None and slo_header is not None:
            slo_ms = float(slo_header)
        if slo_ms is None:
            slo_ms = self.settings.default_ttft_slo_ms
        return (None if slo_ms is None or not math.isfinite(float(slo_ms))
                else float(slo_ms) / 1e3)

    def _hint(self, path: str, body: bytes, slo_header: str | None, arrived_at: float,
              inputs: InputProcessor | None = None) -> Hinted | Unhinted:
        """What the router needs of a generation request, or why it cannot have it: a body or
        a chat prompt the replica will refuse (it answers with the server's own 400, which
        names what is wrong), or a failure of this code. ``inputs``: the tokenizing lane's
        (default: the short lane's)."""
        inputs = inputs or self.inputs
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                return Unhinted(INVALID_BODY, "the body is not a JSON object")
            if path != "/v1/completions":
                # A Responses request is served as the chat request it amounts to.
                chat = (ChatCompletionRequest.model_validate(data)
                        if path == "/v1/chat/completions"
                        else chat_request(ResponsesRequest.model_validate(data)))
                try:
                    # The replica's own rendering: tools and template variables included.
                    prompts = [chat_prompt(chat, self._chat_template).render(inputs)]
                except ValueError as exc:
                    return Unhinted(CHAT_PROMPT, str(exc))
            else:
                prompts = _completion_prompts(data.get("prompt"), inputs.encode)
            slo_s = self._objective_s(data, slo_header)
        except (ValueError, TypeError) as exc:
            return Unhinted(INVALID_BODY, _first_line(exc))
        except Exception as exc:
            return Unhinted(HINT_ERROR, f"{type(exc).__name__}: {exc}", exc)
        if not prompts:
            return Unhinted(INVALID_BODY, "no prompt of a known form")
        hint = RouteHint(request_id=uuid.uuid4().hex, prompt_tokens=sum(map(len, prompts)),
                         ttft_slo_s=slo_s, arrived_at=arrived_at,
                         prefix_hashes=prompt_prefix_hashes(prompts[0], self.block_size,
                                                            MAX_ROUTED_BLOCKS))
        return Hinted(hint, prompts)

    def _unhinted(self, path: str, unhinted: Unhinted) -> None:
        """A request forwarded without a hint: routed as one without a deadline, and neither
        predicted nor admitted. Counted by reason, and logged: a failure of the hint's code
        with its traceback, a request the replica will refuse in one line."""
        self.metrics.unassessed(unhinted.reason)
        if unhinted.error is not None:
            logger.error("fleet ingress: could not compute the route hint of a %s request; "
                         "forwarding it unrouted and unadmitted", path, exc_info=unhinted.error)
        else:
            logger.info("fleet ingress: %s request forwarded without a route hint (%s: %s); "
                        "its replica answers it", path, unhinted.reason, unhinted.detail)

    def _admit(self, hint: RouteHint | None) -> Response | None:
        """A 429 for a request no replica can serve in time, when the operator chose `reject`;
        None to serve it."""
        if hint is None or hint.ttft_slo_s is None or self.settings.on_doomed != "reject":
            return None
        book = fleet_book(self.settings.engine_deployment)
        if book is None:
            # No router yet (its warm-up has not routed; /health says why): nothing is known
            # to refuse it on. Served, and said so.
            self.metrics.unassessed(ROUTER_NOT_STARTED)
            logger.warning("fleet ingress: a request with a TTFT objective was admitted "
                           "unassessed: the router has not started (%s)",
                           self.router_start.error or "its warm-up has not finished")
            return None
        admission = assess(book, hint, time.time())
        if not admission.doomed:
            return None
        self.metrics.rejected(DOOMED)
        predicted_ms = admission.predicted_ttft_s * 1e3
        message = (f"no replica can serve this request within its TTFT objective of "
                   f"{hint.ttft_slo_s * 1e3:.0f} ms: the best predicted TTFT is "
                   f"{predicted_ms:.0f} ms (--on-doomed reject)")
        content = error_body(message, 429)
        # The fields a single server's 429 carries too (engine.serving.doomed).
        content["error"].update(predicted_ttft_ms=round(predicted_ms, 1),
                                ttft_slo_ms=round(hint.ttft_slo_s * 1e3, 3))
        return Response(json.dumps(content), 429, media_type="application/json",
                        headers={"Retry-After": str(admission.retry_after_s),
                                 REJECTED_HEADER: DOOMED})

    # ---- forwarding -------------------------------------------------------------------------

    def _routed_prediction(self, hint: RouteHint | None) -> float | None:
        """The router's predicted TTFT for the request on the replica it chose (FleetBook.
        on_sent), taken once; None without a hint or a fresh report there."""
        if hint is None:
            return None
        book = fleet_book(self.settings.engine_deployment)
        return None if book is None else book.routed_prediction(hint.request_id)

    async def _forward(self, forwarded: ForwardedRequest, hint: RouteHint | None,
                       owed: object | None = None) -> Response:
        """`owed`: the request's key in `self.due`, out at its first output."""
        failure: BaseException | None = None
        attempt = 0
        # Replicas that refused the request at their queue bound: it goes to another while one
        # is left that has not (the router ranks them last from then on: FleetBook.on_full).
        refused_by: list[str] = []
        while attempt < self.settings.forward_attempts:
            stream = self.engine.handle.remote(forwarded, hint=hint)
            try:
                start = await stream.__anext__()
            except _REPLICA_GONE as exc:
                failure = exc
                attempt += 1
                self.metrics.retried()
                logger.warning("a replica failed before answering (%s); trying another "
                               "(attempt %d)", type(exc).__name__, attempt)
                continue
            if not isinstance(start, ResponseStart):
                raise TypeError(f"a replica answered {type(start).__name__} first")
            replica = next((v.decode() for k, v in start.headers if k.lower() == REPLICA_HEADER),
                           None)
            queue_full = _queue_bound_refusal(start)
            if queue_full is not None:
                if self._try_elsewhere(replica, refused_by, queue_full):
                    stream.cancel()
                    continue
                self.metrics.rejected(queue_full)  # no replica left to try: the client's 429
            headers = [(k, v) for k, v in start.headers if k.lower() not in _HOP_BY_HOP]
            predicted_s = self._routed_prediction(hint)
            if predicted_s is not None:
                headers.append((PREDICTED_TTFT_HEADER, f"{predicted_s * 1e3:.1f}".encode()))
            sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                      for k, v in headers)
            response = StreamingResponse(self._relay(stream, hint, sse, replica, owed),
                                         status_code=start.status)
            response.raw_headers = headers
            return response
        self.metrics.failed()
        return _error(503, f"no replica could take the request ({type(failure).__name__}); "
                           f"the fleet is recovering, retry shortly")

    def _try_elsewhere(self, replica: str | None, refused_by: list[str], reason: str) -> bool:
        """Whether a request `replica` refused at its queue bound is tried again: a replica is
        left that has not refused it, and it has not been tried as many times as there are
        replicas (the router may pick a refusing one again when all look full). The router is
        told the replica is full."""
        book = fleet_book(self.settings.engine_deployment)
        if replica is None or book is None:
            return False
        refused_by.append(replica)
        book.on_full(replica, time.time())
        replicas = set(book.replicas)
        if replicas <= set(refused_by) or len(refused_by) >= len(replicas):
            return False
        self.metrics.rerouted(reason)
        return True

    async def _relay(self, stream: Any, hint: RouteHint | None, sse: bool,
                     replica: str | None, owed: object | None = None) -> AsyncIterator[bytes]:
        # A JSON body arrives whole: its first byte is the end of the request, not its TTFT
        # (the replica's own metrics have that one); it is owed nothing after it.
        awaiting_first = sse
        finished = False
        try:
            async for chunk in stream:
                yield chunk
                # Stamped once the chunk is handed to the connection, as the server's edge
                # clock does (engine.serving.edge_clock).
                if awaiting_first and carries_output(chunk):
                    awaiting_first = False
                    if hint is not None:
                        self.metrics.first_output(hint, time.time())
                if owed is not None and not awaiting_first:
                    self.due.out(owed)
                    owed = None  # out once, not again with every chunk
            finished = True
        except Exception as exc:  # the replica died mid-response
            logger.warning("replica %s failed mid-response: %s", replica, type(exc).__name__)
            self.metrics.failed()
            book = fleet_book(self.settings.engine_deployment)
            if book is not None and replica is not None:
                book.on_failed(replica, time.time())
            if not sse:
                raise  # a JSON body cannot carry an error after it began: the connection ends
            error = error_body("the replica serving this request failed; the stream ends "
                               "here (retry the request)", 503)
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
            finished = True
        finally:
            if owed is not None:
                self.due.out(owed)
            if not finished:  # the client went away: the replica aborts the request
                stream.cancel()


def _completion_prompts(prompt: Any, encode: Any) -> list[list[int]]:
    """The token ids of each prompt of a completions request (a string, a list of them, token
    ids, or lists of token ids)."""
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
    return []


def _queue_bound_refusal(start: ResponseStart) -> str | None:
    """The reason of a replica's 429 at its queue bound (engine.serving.admission); None for
    any other answer (a doomed request's 429 included: no replica would do better)."""
    if start.status != 429:
        return None
    reason = next((v.decode() for k, v in start.headers
                   if k.lower() == REJECTED_HEADER.encode()), None)
    return reason if reason in (QUEUED_REQUESTS, QUEUED_TOKENS) else None


def _first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (pydantic's run to several)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(error_body(message, status)), status,
                    media_type="application/json", headers=headers)
