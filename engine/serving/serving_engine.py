"""What the generation routes share (completions, chat, and /v1/responses through chat): the
TTFT and TPOT objectives read from the body or a header, the checks before any work, admission
(the queue bounds, `--on-doomed`), and `OpenAIServing.serve`, which submits one HTTP request's
engine requests and answers with the whole response or its stream."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from engine.ipc.async_client import AsyncEngineClient
from engine.processing.input_processor import check_fits_context
from engine.sampling_params import SamplingParams
from engine.serving.admission import (REJECTED_HEADER, AdmissionLedger, Place, QueueFull,
                                      queue_full_headers)
from engine.serving.api_errors import APIError, JSONBody, describe_error, error_for
from engine.serving.chat_reading import ChatReading
from engine.serving.choices import (EnginePrompt, best_of_choices, fan_out,
                                    finals_unless_disconnected, merged)
from engine.serving.doomed import DOOMED, DoomedCheck, RequestDoomed
from engine.serving.edge_clock import EdgeClock, EdgeStampedStream
from engine.serving.metrics import ServerMetrics
from engine.serving.openai_protocol import MAX_N, GenerationRequest
from engine.serving.openai_responses import (ResponseContext, full_response, stream_events,
                                             usage_body)
from engine.serving.request_fields import shown, unsupported_field
from engine.serving.responses_api import ResponsesShape
from engine.serving.server_settings import ServerSettings
from engine.serving.serving_models import OpenAIServingModels
from engine.serving.tokenize_lanes import LONG_INPUT_CHARS, TokenizeLanes
from engine.structured_output.grammar import CheckedGrammars, grammar_of

SLO_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
T = TypeVar("T")
# A prompt: its text when the client sent text (echo writes it back), and its token ids.
Prompt = tuple[str | None, list[int]]


@dataclass(frozen=True)
class Arrival:
    """A request as `OpenAIServing.arriving` checked it: its objectives (ms; None: none) and
    its place under the queue bound (None: no bound)."""

    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    place: Place | None


class OpenAIServing:
    """One per app: the state every generation request goes through (one admission ledger,
    one run of request ids, the grammars already checked), and `serve`."""

    def __init__(self, client: AsyncEngineClient, metrics: ServerMetrics,
                 settings: ServerSettings, models: OpenAIServingModels,
                 lanes: TokenizeLanes) -> None:
        self.client = client
        self.metrics = metrics
        self.settings = settings
        self.models = models
        # Tokenization, chat templating and grammar checks run off the event loop, so that a
        # 1 MiB prompt does not stall every open stream (engine.serving.tokenize_lanes).
        self.lanes = lanes
        self.ledger = AdmissionLedger(settings.queue_bounds, on_reject=metrics.on_rejected)
        # A long prompt's prefix matching (milliseconds) on the long lane: never ahead of a
        # short turn's template.
        self.doomed = DoomedCheck(client.load_report, on_reject=metrics.on_rejected,
                                  off_loop=lambda fn, *args: lanes.on_lane(
                                      LONG_INPUT_CHARS, lambda _inputs: fn(*args)))
        self.checked_grammars = CheckedGrammars()
        self._request_ids = itertools.count()

    # ---- the objectives ---------------------------------------------------------------------

    @staticmethod
    def samples_per_prompt(body: GenerationRequest) -> int:
        """The engine requests each prompt starts (best_of when set, else n), read before the
        sampling parameters are built."""
        return getattr(body, "best_of", None) or body.n

    def ttft_slo(self, body: GenerationRequest, request: Request) -> float | None:
        if body.ttft_slo_ms is not None:  # the body wins over the header
            return self._above_floor(body.ttft_slo_ms, "ttft_slo_ms")
        value = _header_ms(request, SLO_HEADER, zero_ok=True)
        return (self.settings.default_ttft_slo_ms if value is None
                else self._above_floor(value, SLO_HEADER))

    def tpot_slo(self, body: GenerationRequest, request: Request) -> float | None:
        if body.tpot_slo_ms is not None:  # the body wins over the header
            return body.tpot_slo_ms
        value = _header_ms(request, TPOT_HEADER, zero_ok=False)
        return self.settings.default_tpot_slo_ms if value is None else value

    def _above_floor(self, slo_ms: float, param: str) -> float:
        floor = self.settings.min_ttft_slo_ms
        if floor is not None and slo_ms < floor:
            raise APIError(400, f"{param} {slo_ms:g} ms is tighter than this server's floor of "
                                f"{floor:g} ms (--min-ttft-slo-ms)", param)
        return slo_ms

    # ---- serving ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def arriving(self, body: GenerationRequest, request: Request, num_prompts: int,
                 chat: bool) -> Iterator[Arrival]:
        """What is checked as soon as a request is read, before its prompt is templated or
        tokenized: the model's name, fields this server does not support, the objectives, how
        many completions it asks for (each a 400 or 404 naming what is wrong), then its place
        under the queue bound, so that a request over it is refused with 429 before any work
        (engine.serving.admission). `serve` admits it into the place; the place is given back
        if it fails before then."""
        self.models.check_model_name(body.model)
        if (unsupported := unsupported_field(body, chat)) is not None:
            name, value = unsupported
            raise APIError(400, f"`{name}` is not supported by this server "
                                f"(got {shown(value, 80)})", name)
        slo = self.ttft_slo(body, request)
        tpot_slo = self.tpot_slo(body, request)
        per_prompt = self.samples_per_prompt(body)
        if num_prompts * per_prompt > MAX_N:
            raise APIError(400, f"{num_prompts} prompts x n={per_prompt} asks for "
                                f"{num_prompts * per_prompt} completions; at most {MAX_N} "
                                f"per request", "n")
        place = None
        if self.settings.queue_bounds.bounded:
            try:
                place = self.ledger.reserve(num_prompts * per_prompt)
            except QueueFull as exc:
                raise APIError(429, str(exc), None, queue_full_headers(exc.reason)) from None
        try:
            yield Arrival(slo, tpot_slo, place)
        finally:
            if place is not None:
                place.release()

    async def serve(self, body: GenerationRequest, request: Request, prompts: list[Prompt],
                    checked: Arrival, chat: ChatReading | None = None,
                    responses: ResponsesShape | None = None) -> Response:
        """Serve one HTTP request: each prompt (a completions list, else one), n samples each,
        as engine requests that run together; the response gathers them as choices.
        ``checked``: what `arriving` found of it. ``chat``: how a chat request's output is read
        (None: a completion). ``responses``: a chat request serving /v1/responses, answered in
        that API's shape."""
        client, metrics = self.client, self.metrics
        arrival = request.state.arrival
        slo, tpot_slo = checked.ttft_slo_ms, checked.tpot_slo_ms
        params_per_prompt = await self._sampling_params(body, prompts, chat)
        params = params_per_prompt[0]
        per_prompt = params.num_samples
        if body.stream and params.ranks_samples:
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known "
                                "only once all have finished", "best_of")
        if slo is not None and self.settings.on_doomed == "reject":
            # Judged once, on arrival, before it holds anything: what was admitted stays.
            try:
                await self.doomed.check([ids for _, ids in prompts], slo,
                                        time.monotonic() - arrival)
            except RequestDoomed as exc:
                raise APIError(429, str(exc), None, {"Retry-After": str(exc.retry_after_s),
                                                     REJECTED_HEADER: DOOMED},
                               exc.details) from None
        prefix = "chatcmpl" if chat is not None else "cmpl"
        request_id = (responses.response_id if responses is not None
                      else f"{prefix}-{uuid.uuid4().hex[:16]}-{next(self._request_ids)}")
        echo = getattr(body, "echo", False)
        engine_prompts = [EnginePrompt(prompt, prompt_ids, params) for (prompt, prompt_ids), params
                          in zip(prompts, params_per_prompt)]
        if echo:
            decode = client.inputs.tokenizer.decode
            for ep in engine_prompts:
                ep.echo_text = ep.text if ep.text is not None else await self.lanes.run(
                    decode, ep.token_ids)
                ep.first_token_text = await self.lanes.run(decode, ep.token_ids[:1])
        choices, sources, child_ids = fan_out(
            client, request_id, engine_prompts, per_prompt, arrival_time=arrival,
            priority=body.priority, ttft_slo_ms=slo, tpot_slo_ms=tpot_slo)
        if self.settings.queue_bounds.bounded:
            # A prompt's samples share its prefill: its tokens count once.
            tokens = [len(ep.token_ids) if sample == 0 else 0
                      for ep in engine_prompts for sample in range(per_prompt)]
            try:
                self.ledger.admit(child_ids, tokens, checked.place)
            except QueueFull as exc:
                for source in sources:
                    source.close()
                raise APIError(429, str(exc), None, queue_full_headers(exc.reason)) from None
            sources = [self.ledger.track(i, s) for i, s in zip(child_ids, sources)]

        def release() -> None:
            # The requests were handed to the engine already: a response that ended before
            # its stream was read to the end (or began) aborts them.
            for source in sources:
                source.close()
            for child_id in child_ids:
                self.ledger.release(child_id)
                metrics.forget(child_id)  # (a no-op for a request that finished)
        try:  # until a response owns them (its on_close, or the gathering below)
            ctx = ResponseContext(request_id=request_id, model=self.settings.served_model_name,
                                  chat=chat is not None,
                                  include_usage=body.include_usage,
                                  continuous_usage=body.continuous_usage,
                                  stop_holdback=max((len(s) - 1 for s in params.stop), default=0),
                                  echo=echo, echo_only=body.echo_only,
                                  logprobs=params.logprobs is not None,
                                  prompt_logprobs=body.prompt_logprobs is not None,
                                  tokens_as_ids=body.return_tokens_as_token_ids,
                                  tool_calling=None if chat is None else chat.tools,
                                  reasoning=None if chat is None else chat.reasoning,
                                  include_reasoning=getattr(body, "include_reasoning", True),
                                  harmony=chat is not None and chat.harmony)
            num_top = params.logprobs or 0
            # TTFT and TPOT as the client sees them: stamped where the tokens are sent to it.
            # The engine keeps a TTFT deadline live until the client has output (a first token
            # with no text, e.g. a special one, sends nothing): told as each choice's is written.
            clock = EdgeClock(len(choices), metrics, on_first_output=None if slo is None else (
                lambda position, when: client.note_first_output(child_ids[position], when)),
                answer_started=None if chat is None else chat.answer_started())
            if body.stream:
                events = stream_events(ctx, choices,
                                       _forget_on_exit(merged(sources), metrics, child_ids),
                                       num_top, lambda exc: error_for(exc, f"stream {request_id}"),
                                       clock, raw=responses is not None)
                if responses is not None:
                    events = responses.stream(events)
                return EdgeStampedStream(events, clock, on_close=release,
                                         media_type="text/event-stream")
        except BaseException:
            release()
            raise
        try:
            finals = await finals_unless_disconnected(sources, request, clock.reached_handler)
        except Exception as exc:  # what the engine said about a request (or a bug)
            status, message, param = describe_error(exc, f"request {request_id}")
            raise APIError(status, message, param) from exc
        finally:
            release()
        if finals is None:  # the client went away; every request was aborted (and forgotten)
            return Response(status_code=499)
        finals = clock.with_edge_metrics(finals)
        usage = usage_body(ctx, choices, finals)  # every sample drawn, best_of's included
        if params.ranks_samples:
            choices, finals = best_of_choices(choices, finals, body.n,
                                              params.logprobs is not None)
        whole = full_response(ctx, choices, finals, num_top, usage)
        return JSONBody(whole if responses is None else responses.whole(whole))

    async def _sampling_params(self, body: GenerationRequest, prompts: list[Prompt],
                               chat: ChatReading | None) -> list[SamplingParams]:
        """Each prompt's sampling parameters, checked before any work: a 400 naming what is
        wrong (a prompt the engine refuses, a token id outside the vocabulary, a malformed
        schema, a completion that cannot fit beside its prompt)."""
        client = self.client
        try:
            params_per_prompt = []
            for _, prompt_ids in prompts:
                client.validate(prompt_ids)
                # As OpenAI: completions default to 16 tokens, chat to what the context leaves.
                default_max = (16 if chat is None
                               else max(1, client.max_model_len - len(prompt_ids)))
                params_per_prompt.append(body.sampling_params(default_max))
            _check_token_ids(params_per_prompt[0], client.vocab_size)
            if chat is not None:
                params_per_prompt = [chat.sampling_params(p) for p in params_per_prompt]
            if (structured := params_per_prompt[0].structured_outputs) is not None:
                # A malformed schema, regex or grammar is refused before any work; EngineCore
                # compiles it for the vocabulary (engine.structured_output).
                if not self.checked_grammars.known(structured):
                    await self.lanes.run(grammar_of, structured)
                    self.checked_grammars.add(structured)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        for _, prompt_ids in prompts:
            _check_fits_context(body, len(prompt_ids), client.max_model_len, chat is not None)
        return params_per_prompt


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

