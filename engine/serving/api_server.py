"""The OpenAI-compatible HTTP server (FastAPI on uvicorn), in front of the EngineCore process."""

from __future__ import annotations

import asyncio
import hmac
import itertools
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.serving.api_errors import (APIError, BodyLimit, InternalErrors, JSONBody,
                                       api_error_body, describe_error, error_for)
from engine.ipc.async_client import AsyncEngineClient, EngineDeadError
from engine.ipc.core_launch import CoreLaunch
from engine.config import EngineConfig, ShutdownConfig
from engine.serving.drain import Drain, DrainGate
from engine.serving.edge_clock import EdgeClock, EdgeStampedStream
from engine.serving.metrics import ServerMetrics
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.processing.input_processor import InputProcessor, check_fits_context
from engine.serving.chat_prompt import ChatPromptError, chat_prompt
from engine.serving.choices import (EnginePrompt, best_of_choices, fan_out,
                                    finals_unless_disconnected, merged)
from engine.serving.openai_protocol import (MAX_N, ChatCompletionRequest, CompletionRequest,
                                            GenerationRequest, error_body)
from engine.serving.openai_responses import (ResponseContext, full_response, stream_events,
                                             usage_body)
from engine.serving.request_fields import shown, unsupported_field
from engine.serving.responses_api import ResponsesShape
from engine.serving.responses_protocol import (RequestError, ResponsesRequest,
                                               as_responses_error, chat_request, refused_field)
from engine.serving.admission import RETRY_AFTER_S, AdmissionLedger, QueueBounds, QueueFull
from engine.serving.doomed import DoomedCheck, OnDoomed, RequestDoomed
from engine.serving.harmony import HARMONY_REASONING, HARMONY_TOOLS, renders_harmony
from engine.serving.harmony import answer_started as harmony_answer_started
from engine.serving.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from engine.serving.tool_calls.calling import ToolCalling, tool_calling
from engine.serving.tool_calls.parsers import parser_for_template
from engine.structured_output.grammar import CheckedGrammars, grammar_of
from engine.serving.tokenize_lanes import TokenizeLanes, text_size
from engine.serving.tokenize_api import (DetokenizeRequest, TokenizeRequest, detokenize_request,
                                         tokenize_request)

VERSION = "0.1.0"
SLO_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
T = TypeVar("T")


@dataclass
class ServerSettings:
    # The name responses carry; /v1/models lists it first.
    served_model_name: str
    # Further names listed and accepted (`--served-model-name A B C`: these are B and C).
    other_served_names: tuple[str, ...] = ()
    # The model folder, listed as each model's `root`; its base name is accepted too.
    model_root: str | None = None
    api_key: str | None = None
    max_request_body_bytes: int = 1 << 20
    default_ttft_slo_ms: float | None = None
    default_tpot_slo_ms: float | None = None
    # The tightest TTFT objective a client may ask for: clients choose their own SLOs, and a
    # stream of needlessly tight ones would hold every other request back.
    min_ttft_slo_ms: float | None = None
    # /metrics and /debug/stats behind the API key too (/health stays open for probes).
    metrics_require_api_key: bool = False
    # On SIGTERM: abort what is in flight, or drain first (engine.serving.drain).
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    # The tool-call format the model writes (engine.serving.tool_calls.parsers; `openai`:
    # harmony's); None: the one its chat template shows, if exactly one.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is split from its answer (engine.serving.
    # reasoning_parsers; `openai_gptoss`: harmony's channels); None: not split, all of it is
    # content, unless the chat template writes harmony.
    reasoning_parser: str | None = None
    # --max-num-queued-reqs / --max-num-queued-tokens (engine.serving.admission).
    queue_bounds: QueueBounds = field(default_factory=QueueBounds)
    # --on-doomed: a request this server cannot serve within its TTFT objective even ahead of
    # everything it holds is served anyway, or refused with 429 (engine.serving.doomed).
    on_doomed: OnDoomed = "serve"


def build_app(config: EngineConfig, settings: ServerSettings,
              launch: CoreLaunch | None = None) -> FastAPI:
    """``launch``: the EngineCore process `sloserve serve` started ahead of the app
    (engine.ipc.core_launch); without one the app's start spawns it."""
    client = AsyncEngineClient(config, launch=launch)
    metrics = ServerMetrics(settings.served_model_name)
    client.observer = metrics
    ledger = AdmissionLedger(settings.queue_bounds, on_reject=metrics.on_rejected)
    request_ids = itertools.count()
    # Tokenization, chat templating and grammar checks run off the event loop, so that a 1 MiB
    # prompt does not stall every open stream, in two lanes, so that a turn does not queue
    # behind a document (engine.serving.tokenize_lanes).
    lanes = TokenizeLanes(client.inputs, lambda: InputProcessor.for_model(config.model))
    off_loop = lanes.run
    doomed = DoomedCheck(client.load_report, on_reject=metrics.on_rejected, off_loop=off_loop)
    checked_grammars = CheckedGrammars()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await client.start()
            # vLLM's per-request token histograms reach the context the engine settled on.
            metrics.vllm.add_request_token_histograms(client.max_model_len)
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

    app = FastAPI(title="sloserve", version=VERSION, lifespan=lifespan,
                  default_response_class=JSONBody)
    app.state.client = client
    app.state.metrics = metrics
    # `await app.state.drain.drain(timeout)`: what SIGTERM does in wait mode, and what a
    # fleet's replica calls when it is removed.
    drain = Drain(client)
    app.state.drain = drain
    app.add_middleware(BodyLimit, limit=settings.max_request_body_bytes)
    app.add_middleware(InternalErrors)
    # Outermost: a request refused while draining costs nothing, and one in flight counts
    # until its response's last byte is sent.
    app.add_middleware(DrainGate, drain=drain)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONBody:
        return JSONBody(api_error_body(exc), exc.status,
                        headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONBody:
        # Unknown routes (404) and wrong methods (405) answer in the OpenAI error shape too.
        return JSONBody(error_body(str(exc.detail), exc.status_code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
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

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONBody:
        return JSONBody(error_body(str(exc), 503), 503)

    expected_auth = (None if settings.api_key is None
                     else f"Bearer {settings.api_key}".encode())

    async def check_api_key(request: Request) -> None:
        if expected_auth is None:
            return
        # Constant time: how long a wrong key takes to refuse says nothing about the right one.
        # Bytes: compare_digest refuses non-ASCII str, and a header may hold anything.
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected_auth):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')")

    auth = [Depends(check_api_key)]
    monitoring_auth = auth if settings.metrics_require_api_key else []

    @app.get("/health")
    async def health() -> Response:
        if drain.draining:  # load balancers stop sending before the server goes away
            return JSONBody({"status": "draining"}, 503)
        return Response(status_code=200 if client.is_alive() else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.get("/metrics", dependencies=monitoring_auth)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/debug/stats", dependencies=monitoring_auth)
    async def debug_stats() -> dict:
        stats = client.stats
        return {"num_blocks": client.num_blocks, "num_free_blocks": stats.num_free_blocks,
                "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage, "num_steps": stats.num_steps,
                "ttft_model": stats.ttft_model}

    listed = (settings.served_model_name, *settings.other_served_names)
    accepted = set(listed)
    if settings.model_root is not None:
        accepted.add(served_name(settings.model_root))

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()),
                "owned_by": "sloserve", "root": settings.model_root,
                "max_model_len": client.max_model_len}

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in listed]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        _check_model_name(model_id)
        return card(model_id)

    def _check_model_name(name: str | None) -> None:
        if name is not None and name not in accepted:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(f'`{n}`' for n in listed)}", "model")

    def _check_model(body: GenerationRequest) -> None:
        _check_model_name(body.model)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model_name(body.model)
        size = text_size(body.prompt if body.prompt is not None
                         else [m.content for m in body.messages or ()])
        ids = await lanes.on_lane(size, lambda inputs: tokenize_request(inputs, body))
        strs = (await off_loop(client.inputs.tokenizer.convert_ids_to_tokens, ids)
                if body.return_token_strs else None)
        return {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model_name(body.model)
        return {"prompt": await off_loop(detokenize_request, client.inputs, body)}

    def _header_ms(request: Request, name: str, *, zero_ok: bool) -> float | None:
        """A milliseconds header (None when absent); a 400 naming it unless it is a finite
        number > 0 (>= 0 where zero_ok)."""
        header = request.headers.get(name)
        if header is None:
            return None
        try:
            value = float(header)
        except ValueError:
            value = float("nan")
        if not (value >= 0 if zero_ok else value > 0) or value == float("inf"):
            kind = "non-negative" if zero_ok else "positive"
            raise APIError(400, f"{name} must be a {kind} number of milliseconds, got "
                                f"{header!r}", name)
        return value

    def _slo(body: GenerationRequest, request: Request) -> float | None:
        if body.ttft_slo_ms is not None:  # the body wins over the header
            return _above_floor(body.ttft_slo_ms, "ttft_slo_ms")
        value = _header_ms(request, SLO_HEADER, zero_ok=True)
        return settings.default_ttft_slo_ms if value is None else _above_floor(value, SLO_HEADER)

    def _tpot_slo(body: GenerationRequest, request: Request) -> float | None:
        if body.tpot_slo_ms is not None:  # the body wins over the header
            return body.tpot_slo_ms
        value = _header_ms(request, TPOT_HEADER, zero_ok=False)
        return settings.default_tpot_slo_ms if value is None else value

    def _above_floor(slo_ms: float, param: str) -> float:
        floor = settings.min_ttft_slo_ms
        if floor is not None and slo_ms < floor:
            raise APIError(400, f"{param} {slo_ms:g} ms is tighter than this server's floor of "
                                f"{floor:g} ms (--min-ttft-slo-ms)", param)
        return slo_ms

    # What tool_choice auto reads the model's text with: the server's choice, else its
    # template's format (None: auto is a 400 naming the option).
    template = getattr(client.inputs.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    # gpt-oss's harmony: its channels are the reasoning, the tool calls and the content, read
    # from the special tokens the output keeps (engine.serving.harmony).
    harmony = (renders_harmony(template) or settings.reasoning_parser == HARMONY_REASONING
               or settings.tool_call_parser == HARMONY_TOOLS)
    tool_parser = None if harmony else (
        settings.tool_call_parser or parser_for_template(template))
    reasoning = (REASONING_PARSERS[settings.reasoning_parser]()
                 if settings.reasoning_parser in REASONING_PARSERS and not harmony else None)

    async def _serve(body: GenerationRequest, request: Request,
                     prompts: list[tuple[str | None, list[int]]], chat: bool,
                     tools: ToolCalling | None = None,
                     responses: ResponsesShape | None = None) -> Response:
        """Serve one HTTP request: each prompt (a completions list, else one), n samples each,
        as engine requests that run together; the response gathers them as choices.
        ``responses``: a chat request serving /v1/responses, answered in that API's shape."""
        arrival = request.state.arrival
        _check_model(body)
        if (unsupported := unsupported_field(body, chat)) is not None:
            name, value = unsupported
            raise APIError(400, f"`{name}` is not supported by this server "
                                f"(got {shown(value, 80)})", name)
        slo = _slo(body, request)
        tpot_slo = _tpot_slo(body, request)
        try:
            params_per_prompt = []
            for _, prompt_ids in prompts:
                client.validate(prompt_ids)
                # As OpenAI: completions default to 16 tokens, chat to what the context leaves.
                default_max = 16 if not chat else max(1, client.max_model_len - len(prompt_ids))
                params_per_prompt.append(body.sampling_params(default_max))
            _check_token_ids(params_per_prompt[0], client.vocab_size)
            if tools is not None:
                params_per_prompt = [_with_tool_calling(p, tools) for p in params_per_prompt]
            if chat and harmony:
                # The channels' markers are special tokens: the text must keep them.
                params_per_prompt = [msgspec.structs.replace(p, skip_special_tokens=False)
                                     for p in params_per_prompt]
            if (structured := params_per_prompt[0].structured_outputs) is not None:
                # A malformed schema, regex or grammar is refused before any work; EngineCore
                # compiles it for the vocabulary (engine.structured_output).
                if not checked_grammars.known(structured):
                    await off_loop(grammar_of, structured)
                    checked_grammars.add(structured)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        for _, prompt_ids in prompts:
            _check_fits_context(body, len(prompt_ids), client.max_model_len, chat)
        params = params_per_prompt[0]
        per_prompt = params.num_samples
        if len(prompts) * per_prompt > MAX_N:
            raise APIError(400, f"{len(prompts)} prompts x n={per_prompt} asks for "
                                f"{len(prompts) * per_prompt} completions; at most {MAX_N} "
                                f"per request", "n")
        if body.stream and params.ranks_samples:
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known "
                                "only once all have finished", "best_of")
        if slo is not None and settings.on_doomed == "reject":
            # Judged once, on arrival, before it holds anything: what was admitted stays.
            try:
                await doomed.check([ids for _, ids in prompts], slo, time.monotonic() - arrival)
            except RequestDoomed as exc:
                raise APIError(429, str(exc), None, {"Retry-After": str(exc.retry_after_s)},
                               exc.details) from None
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = (responses.response_id if responses is not None
                      else f"{prefix}-{uuid.uuid4().hex[:16]}-{next(request_ids)}")
        echo = getattr(body, "echo", False)
        engine_prompts = [EnginePrompt(prompt, prompt_ids, params) for (prompt, prompt_ids), params
                          in zip(prompts, params_per_prompt)]
        if echo:
            decode = client.inputs.tokenizer.decode
            for ep in engine_prompts:
                ep.echo_text = ep.text if ep.text is not None else await off_loop(
                    decode, ep.token_ids)
                ep.first_token_text = await off_loop(decode, ep.token_ids[:1])
        choices, sources, child_ids = fan_out(
            client, request_id, engine_prompts, per_prompt, arrival_time=arrival,
            priority=body.priority, ttft_slo_ms=slo, tpot_slo_ms=tpot_slo)
        if settings.queue_bounds.bounded:
            # A prompt's samples share its prefill: its tokens count once.
            tokens = [len(ep.token_ids) if sample == 0 else 0
                      for ep in engine_prompts for sample in range(per_prompt)]
            try:
                ledger.admit(child_ids, tokens)
            except QueueFull as exc:
                raise APIError(429, str(exc), None,
                               {"Retry-After": str(RETRY_AFTER_S)}) from None
            sources = [ledger.track(i, s) for i, s in zip(child_ids, sources)]

        def release() -> None:
            for child_id in child_ids:
                ledger.release(child_id)
        ctx = ResponseContext(request_id=request_id, model=settings.served_model_name, chat=chat,
                              include_usage=body.include_usage,
                              continuous_usage=body.continuous_usage,
                              stop_holdback=max((len(s) - 1 for s in params.stop), default=0),
                              echo=echo, echo_only=body.echo_only,
                              logprobs=params.logprobs is not None,
                              prompt_logprobs=body.prompt_logprobs is not None,
                              tokens_as_ids=body.return_tokens_as_token_ids,
                              tool_calling=tools,
                              reasoning=reasoning if chat else None,
                              include_reasoning=getattr(body, "include_reasoning", True),
                              harmony=chat and harmony)
        num_top = params.logprobs or 0
        # TTFT and TPOT as the client sees them: stamped where the tokens are sent to it.
        # The engine keeps a TTFT deadline live until the client has output (a first token
        # with no text, e.g. a special one, sends nothing): told as each choice's is written.
        clock = EdgeClock(len(choices), metrics, on_first_output=None if slo is None else (
            lambda position, when: client.note_first_output(child_ids[position], when)),
            answer_started=(_harmony_answer if chat and harmony else
                            _answer_after_thinking(reasoning)
                            if chat and reasoning is not None else None))
        if body.stream:
            events = stream_events(ctx, choices,
                                   _forget_on_exit(merged(sources), metrics, child_ids),
                                   num_top, lambda exc: error_for(exc, f"stream {request_id}"),
                                   clock, raw=responses is not None)
            if responses is not None:
                events = responses.stream(events)
            return EdgeStampedStream(events, clock, on_close=release,
                                     media_type="text/event-stream")
        try:
            finals = await finals_unless_disconnected(sources, request, clock.reached_handler)
        except Exception as exc:  # what the engine said about a request (or a bug)
            status, message, param = describe_error(exc, f"request {request_id}")
            raise APIError(status, message, param) from exc
        finally:
            release()
        if finals is None:  # the client went away; every request was aborted
            for child_id in child_ids:
                metrics.forget(child_id)
            return Response(status_code=499)
        finals = clock.with_edge_metrics(finals)
        usage = usage_body(ctx, choices, finals)  # every sample drawn, best_of's included
        if params.ranks_samples:
            choices, finals = best_of_choices(choices, finals, body.n,
                                              params.logprobs is not None)
        whole = full_response(ctx, choices, finals, num_top, usage)
        return JSONBody(whole if responses is None else responses.whole(whole))

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            given = body.prompts
        except ValueError as exc:
            raise APIError(400, str(exc), "prompt") from exc
        prompts: list[tuple[str | None, list[int]]] = []
        for prompt in given:
            if isinstance(prompt, str):
                prompts.append((prompt, await _encode(lanes, prompt)))
            else:
                prompts.append((None, list(prompt)))
        return await _serve(body, request, prompts, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _chat(body, request)

    async def _chat(body: ChatCompletionRequest, request: Request,
                    responses: ResponsesShape | None = None) -> Response:
        tools = body.tool_dicts
        if harmony:
            # Harmony's calls are messages to `functions.NAME`, read whatever the output holds;
            # a call cannot be forced in it by a JSON schema.
            if tools and body.tool_choice not in (None, "auto", "none"):
                raise APIError(400, f"tool_choice {_choice_name(body.tool_choice)} is not "
                                    "supported for a model that writes harmony (gpt-oss): "
                                    "use auto or none", "tool_choice")
            calling = None
        else:
            try:
                calling = tool_calling(tools, body.tool_choice, body.parallel_tool_calls,
                                       tool_parser)
            except ValueError as exc:
                raise APIError(400, str(exc), "tool_choice") from exc
        # What a fleet's router renders too (engine.serving.chat_prompt): the same prompt.
        try:
            prompt = chat_prompt(body, template)
        except ChatPromptError as exc:
            raise APIError(400, str(exc), exc.param) from exc
        try:
            ids = await lanes.apply_chat_template(prompt.messages, True, prompt.tools,
                                                  prompt.template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc
        return await _serve(body, request, [(None, ids)], chat=True, tools=calling,
                            responses=responses)

    @app.post("/v1/responses", dependencies=auth)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        # Served as the chat request it amounts to (engine.serving.responses_protocol), its
        # answer in the Responses shape (engine.serving.responses_api).
        if (refused := refused_field(body)) is not None:
            raise APIError(400, refused[1], refused[0])
        try:
            chat = chat_request(body)
        except RequestError as exc:
            raise APIError(400, str(exc), exc.param) from exc
        try:
            return await _chat(chat, request, ResponsesShape(body, settings.served_model_name))
        except APIError as exc:  # named as this route's request names the field
            exc.message, exc.param = as_responses_error(exc.message, exc.param)
            raise

    return app


def _harmony_answer(out: RequestOutput) -> bool:
    """Whether a harmony output holds answer: content or a call, not only analysis."""
    return harmony_answer_started(out.text, out.finished)


def _choice_name(choice: object) -> str:
    """A tool_choice as an error names it: the mode, or the function asked for."""
    function = getattr(choice, "function", None)
    return repr(choice) if function is None else f"function {function.name!r}"


def _answer_after_thinking(reasoning: ReasoningParser) -> Callable[[RequestOutput], bool]:
    """Whether an output holds answer: its thinking has closed."""
    return lambda out: reasoning.split(out.text, out.finished).content_start is not None


def _with_tool_calling(params: SamplingParams, tools: ToolCalling) -> SamplingParams:
    """The parameters a tool-calling request samples with: required and named functions held
    to their schema; a parser whose marker is a special token sees special tokens."""
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise ValueError(f"tool_choice {tools.mode} and a structured output "
                             "(response_format, structured_outputs or guided_*): give one")
        params = msgspec.structs.replace(params, structured_outputs=tools.constraint)
    if tools.parser is not None and tools.parser.keeps_special_tokens:
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    return params


async def _encode(lanes: TokenizeLanes, prompt: str) -> list[int]:
    try:
        return await lanes.encode(prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from exc


def _check_fits_context(body: GenerationRequest, prompt_len: int, max_model_len: int,
                        chat: bool) -> None:
    """A 400 (vLLM's message) when the completion the client asked for cannot fit beside the
    prompt; checked after the sampling parameters, so a max_tokens that is bad on its own
    (0, a string) keeps its own message. Not checked: a max_tokens left out (up to the
    context) and echo's max_tokens 0 (nothing generated)."""
    requested = body.requested_max_tokens()
    if requested is None or requested < 1:
        return
    try:
        check_fits_context(prompt_len, requested, max_model_len, messages=chat)
    except ValueError as exc:
        param = ("max_completion_tokens"
                 if getattr(body, "max_completion_tokens", None) is not None else "max_tokens")
        raise APIError(400, str(exc), param) from exc


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Token ids a client names must exist (else the request would fail in the sampler)."""
    for what, ids in (("logit_bias", params.logit_bias), ("stop_token_ids",
                                                          params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary "
                             f"(size {vocab_size})")


async def _forget_on_exit(outputs: AsyncIterator[T], metrics: ServerMetrics,
                          request_ids: list[str]) -> AsyncIterator[T]:
    try:
        async for out in outputs:
            yield out
    finally:
        await outputs.aclose()  # aborts the requests in the core that did not finish
        for request_id in request_ids:
            metrics.forget(request_id)


def served_name(model_dir: str) -> str:
    return Path(model_dir).name


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
                          timeout_graceful_shutdown=30)).run()
