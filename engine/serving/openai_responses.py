"""Turning requests' outputs into OpenAI response bodies and server-sent-event chunks.

One HTTP request is one or more engine requests (prompt lists, n > 1): each is a choice, with
its index, and the response gathers them (engine.serving.choices runs them).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.logprobs import Logprob, PositionLogprobs
from engine.outputs import RequestMetrics, RequestOutput
from engine.serving.edge_clock import EdgeClock
from engine.serving.harmony import read_output
from engine.serving.reasoning_parsers import ReasoningParser
from engine.serving.tool_calls.calling import ToolCalling, call_body
from engine.serving.tool_calls.parsers import FunctionCall, ParsedOutput
from engine.serving.tool_calls.partial_json import ArgumentReaders

logger = logging.getLogger(__name__)

# time.monotonic() -> Unix time, for the timestamps reported to clients.
_UNIX_OFFSET = time.time() - time.monotonic()


@dataclass
class ResponseContext:
    request_id: str
    model: str
    chat: bool
    include_usage: bool
    # Longest stop string: that much text minus one is held back while streaming, since it may
    # yet turn out to be the start of a stop string that is cut from the output.
    stop_holdback: int
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
    continuous_usage: bool = False
    # Completions: the prompt's text (and, with logprobs, its scores) before the output.
    echo: bool = False
    # echo with max_tokens 0: the prompt alone (the one token computed is dropped).
    echo_only: bool = False
    # Chat: logprobs: true; completions: logprobs: k (both set SamplingParams.logprobs).
    logprobs: bool = False
    # vLLM's prompt_logprobs (completions and chat): returned per choice.
    prompt_logprobs: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>".
    tokens_as_ids: bool = False
    # Chat with tools: how the output splits into content and tool calls.
    tool_calling: ToolCalling | None = None
    # Chat with --reasoning-parser: how the thinking splits from the answer, and whether the
    # response carries it (vLLM's include_reasoning).
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True
    # Chat with a model that writes harmony (gpt-oss: engine.serving.harmony): its channels
    # are the reasoning, the content and the tool calls, whatever the two fields above say.
    harmony: bool = False

    @property
    def created(self) -> int:
        return int(time.time())


@dataclass
class Choice:
    """One engine request of a response: its choice index and its prompt's text (echo)."""

    index: int
    # Which prompt of the request it samples (n choices share one).
    prompt_index: int = 0
    prompt_text: str = ""
    # The prompt's first token's text (echo's logprobs list it; it has no score).
    first_prompt_token: str = ""


def metrics_body(metrics: RequestMetrics | None) -> dict[str, Any] | None:
    if metrics is None:
        return None

    def unix(t: float | None) -> float | None:
        return None if t is None else t + _UNIX_OFFSET

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000

    return {"arrival_time": unix(metrics.arrival_time),
            "first_token_time": unix(metrics.first_token_time),
            "ttft_ms": ms(metrics.ttft), "engine_ttft_ms": ms(metrics.engine_ttft),
            "time_to_first_answer_ms": ms(metrics.time_to_first_answer),
            "ttft_slo_ms": metrics.ttft_slo_ms,
            "ttft_slo_met": metrics.ttft_slo_met, "tpot_ms": ms(metrics.tpot),
            "tpot_slo_ms": metrics.tpot_slo_ms, "tpot_slo_met": metrics.tpot_slo_met,
            "num_kv_preemptions": metrics.num_kv_preemptions,
            "num_slo_preemptions": metrics.num_slo_preemptions,
            # Prompt tokens whose KV came from the prefix cache.
            "num_cached_tokens": metrics.num_cached_tokens,
            # Deprecated (README.md, "Deprecated names"): the sum of the two above.
            "num_preemptions": metrics.num_preemptions,
            "queue_time_ms": ms(metrics.queue_time),
            "slack_at_admission_ms": ms(metrics.slack_at_admission_s)}


def _completion_tokens(ctx: ResponseContext, out: RequestOutput) -> int:
    return 0 if ctx.echo_only else len(out.token_ids)


def usage_body(ctx: ResponseContext, choices: list[Choice],
               outs: list[RequestOutput | None]) -> dict[str, int]:
    """Prompt tokens once per prompt (its n samples share it), completion tokens of every
    choice, as vLLM counts (choices without output yet count nothing)."""
    prompts = {c.prompt_index: len(o.prompt_token_ids) for c, o in zip(choices, outs)
               if o is not None}
    prompt = sum(prompts.values())
    outs = [o for o in outs if o is not None]
    completion = sum(_completion_tokens(ctx, o) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


# ---- logprobs ---------------------------------------------------------------------------------

def _chosen(position: PositionLogprobs) -> tuple[int, Logprob]:
    return next(iter(position.items()))  # the chosen token comes first


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    """The k best alternatives (the chosen token counts only if it is among them)."""
    return sorted(position.items(), key=lambda item: item[1].rank)[:k]


def _token_text(token_id: int, logprob: Logprob, as_ids: bool) -> str:
    # vLLM's return_tokens_as_token_ids: a token's text need not round-trip, its id does.
    return f"token_id:{token_id}" if as_ids else logprob.decoded_token


def _completion_logprobs(positions: list[PositionLogprobs | None], offsets: list[int], k: int,
                         as_ids: bool) -> dict[str, list]:
    """OpenAI's completions form: parallel lists (None for a prompt's first token)."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                             "text_offset": list(offsets)}
    for position in positions:
        if position is None:
            body["tokens"].append(None)
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        chosen_id, chosen = _chosen(position)
        body["tokens"].append(_token_text(chosen_id, chosen, as_ids))
        body["token_logprobs"].append(chosen.logprob)
        body["top_logprobs"].append({_token_text(t, lp, as_ids): lp.logprob for t, lp in
                                     [*_top(position, k), (chosen_id, chosen)]})
    return body


def _chat_entry(token_id: int, logprob: Logprob, as_ids: bool) -> dict[str, Any]:
    text = _token_text(token_id, logprob, as_ids)
    return {"token": text, "logprob": logprob.logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(positions: list[PositionLogprobs], k: int, as_ids: bool
                   ) -> dict[str, list]:
    content = []
    for position in positions:
        entry = _chat_entry(*_chosen(position), as_ids)
        entry["top_logprobs"] = [_chat_entry(t, lp, as_ids) for t, lp in _top(position, k)]
        content.append(entry)
    return {"content": content}


def _vllm_prompt_logprobs(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, token id -> its logprob, rank and text."""
    if positions is None:
        return None
    return [None if p is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in p.items()} for p in positions]


class _LogprobSlicer:
    """Completions logprobs for a run of output tokens [start, end), with echo's prompt part
    before the first run."""

    def __init__(self, ctx: ResponseContext, k: int) -> None:
        self.ctx, self.k = ctx, k

    def prompt_part(self, choice: Choice, out: RequestOutput) -> dict[str, list]:
        positions = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        offsets, at = [], 0
        for position in positions:
            offsets.append(at)
            at += len(choice.first_prompt_token if position is None
                      else _chosen(position)[1].decoded_token)
        body = _completion_logprobs(positions, offsets, self.k, self.ctx.tokens_as_ids)
        if positions and positions[0] is None:
            body["tokens"][0] = (f"token_id:{out.prompt_token_ids[0]}" if self.ctx.tokens_as_ids
                                 else choice.first_prompt_token)
        return body

    def output_part(self, out: RequestOutput, start: int, end: int, base: int
                    ) -> dict[str, list]:
        assert out.logprobs is not None and out.text_offsets is not None
        offsets = [base + o for o in out.text_offsets[start:end]]
        return _completion_logprobs(out.logprobs[start:end], offsets, self.k,
                                    self.ctx.tokens_as_ids)


def _join(parts: list[dict[str, list]]) -> dict[str, list]:
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for part in parts:
        for key in joined:
            joined[key].extend(part[key])
    return joined


# ---- whole responses --------------------------------------------------------------------------

def _choice_body(ctx: ResponseContext, choice: Choice, out: RequestOutput, k: int
                 ) -> dict[str, Any]:
    """A finished choice: everything a stream of it would send, in one chunk; chat's delta is
    the message."""
    body = _stream_delta(ctx, _ChoiceStream(choice), out, _LogprobSlicer(ctx, k))
    assert body is not None, "a finished output always has a body"
    if ctx.chat:
        message = {"role": "assistant", **body.pop("delta")}
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                del call["index"]  # a stream's delta field; a message lists them in order
            message["content"] = message["content"] or None  # OpenAI: null beside calls
        if ctx.reasoning is not None or ctx.harmony:
            # vLLM's shape: null where a part is absent (no answer: thinking cut short).
            message["content"] = message["content"] or None
            if ctx.include_reasoning:
                thinking = message.get("reasoning_content") or None
                message["reasoning_content"] = message["reasoning"] = thinking
        body["message"] = message
    return body


def full_response(ctx: ResponseContext, choices: list[Choice], outs: list[RequestOutput],
                  num_top: int, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """``usage``: when more samples were drawn than returned (best_of), theirs."""
    kind = "chat.completion" if ctx.chat else "text_completion"
    return {"id": ctx.request_id, "object": kind, "created": ctx.created, "model": ctx.model,
            "choices": [_choice_body(ctx, c, o, num_top) for c, o in zip(choices, outs)],
            "usage": usage or usage_body(ctx, choices, outs),
            "metrics": metrics_body(outs[0].metrics)}


# ---- streams ----------------------------------------------------------------------------------

def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


@dataclass
class _ChoiceStream:
    """What one choice has sent so far."""

    choice: Choice
    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    # Some output (text, logprobs or a tool call) has gone out, not only chat's role or echo's
    # prompt.
    output_sent: bool = False
    finished: bool = False
    # Tool calls sent so far, whole; and those whose id and name went out (a named call's
    # before its arguments).
    calls_sent: int = 0
    headers_sent: int = 0
    # The arguments sent of the call whose header went out last, while it is being written.
    arguments_sent: str = ""
    # Where the reasoning sent so far ends in the output text (harmony: in the reasoning).
    reasoning_sent: int = 0
    # Harmony: how much of the content has gone out, and the reads of a call's arguments.
    content_sent: int = 0
    harmony_arguments: ArgumentReaders = field(default_factory=ArgumentReaders)


async def stream_events(ctx: ResponseContext, choices: list[Choice],
                        outputs: AsyncIterator[tuple[int, RequestOutput]], num_top: int,
                        on_error: Callable[[Exception], dict[str, Any]], clock: EdgeClock,
                        raw: bool = False) -> AsyncIterator[Any]:
    """SSE chunks for one response: ``outputs`` yields (position in ``choices``, cumulative
    output) as any choice advances. A failure ends the stream with the error event
    ``on_error`` makes of it (a short message: the headers are sent, so this is all the client
    gets). ``clock`` is told which chunks carry a choice's output (the response stamps them
    once written) and stamps each choice's finish; the final chunks' metrics are its.
    ``raw``: the chunks' bodies (and "[DONE]") instead of their SSE text, for a route that
    writes them in its own shape (engine.serving.responses_api), one write per chunk."""
    frame = (lambda body: body) if raw else _sse
    kind = "chat.completion.chunk" if ctx.chat else "text_completion"
    created = ctx.created
    streams = [_ChoiceStream(c) for c in choices]
    latest: list[RequestOutput | None] = [None] * len(choices)
    slicer = _LogprobSlicer(ctx, num_top)

    def chunk(choice_body: dict[str, Any]) -> dict[str, Any]:
        body = {"id": ctx.request_id, "object": kind, "created": created, "model": ctx.model,
                "choices": [choice_body]}
        if ctx.include_usage and ctx.continuous_usage:
            body["usage"] = usage_body(ctx, choices, latest)
        return body

    if ctx.chat:
        for stream in streams:
            yield frame(chunk({"index": stream.choice.index,
                               "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}))
    try:
        async for position, out in outputs:
            latest[position] = out
            stream = streams[position]
            if stream.finished:
                # The engine client updates one output object in place: when the stream falls
                # behind, an update queued earlier already shows the finish, and the finishing
                # update then comes again.
                continue
            stream.finished = out.finished
            body = _stream_delta(ctx, stream, out, slicer)
            if body is not None:
                event = chunk(body)
                answer = _carries_answer(body)
                if out.finished:
                    event["metrics"] = metrics_body(clock.finished(position, out, answer))
                else:
                    if stream.output_sent:
                        clock.output_in_next_write(position, out)
                    if answer:
                        clock.answer_in_next_write(position)
                yield frame(event)
    except Exception as exc:  # the engine died, the server is shutting down, or a bug
        yield frame(on_error(exc))
        yield frame("[DONE]")
        return
    if ctx.include_usage and all(o is not None for o in latest):
        yield frame({"id": ctx.request_id, "object": kind, "created": created,
                     "model": ctx.model, "choices": [],
                     "usage": usage_body(ctx, choices, latest)})
    yield frame("[DONE]")


def _call_deltas(ctx: ResponseContext, stream: _ChoiceStream, parsed: ParsedOutput
                 ) -> tuple[list[dict[str, Any]], int]:
    """The `tool_calls` delta entries for what ``parsed`` adds, and how many calls they
    complete. A call goes out as OpenAI streams one: its id and name with empty arguments,
    then its arguments in fragments as they settle (the openai SDK appends each to the entry
    of the same index), the rest when it is complete; a call complete before its header went
    out, whole."""
    request_id, choice = ctx.request_id, stream.choice.index
    entries: list[dict[str, Any]] = []
    for i, call in enumerate(parsed.calls):
        if i < stream.calls_sent:
            continue
        if i < stream.headers_sent:
            # (arguments_sent stays as it is until the next header: a chunk with nothing else
            # in it is not sent, and this call then completes again in the next one.)
            sent = stream.arguments_sent if i == stream.headers_sent - 1 else ""
            if not call.arguments.startswith(sent):  # settled text cannot change
                logger.warning("tool call %d of %s: its arguments do not continue what was "
                               "streamed of them", i, request_id)
            if rest := call.arguments[len(sent):]:
                entries.append({"index": i, "function": {"arguments": rest}})
        else:
            entries.append({"index": i, **call_body(call, request_id, choice, i)})
    opening_index = len(parsed.calls)
    if parsed.opening is not None:
        if opening_index >= stream.headers_sent:
            header = call_body(FunctionCall(parsed.opening, ""), request_id, choice,
                               opening_index)
            entries.append({"index": opening_index, **header})
            stream.arguments_sent = ""
        elif (opening_index == stream.headers_sent - 1
              and len(settled := parsed.opening_arguments) > len(stream.arguments_sent)
              and settled.startswith(stream.arguments_sent)):
            entries.append({"index": opening_index,
                            "function": {"arguments": settled[len(stream.arguments_sent):]}})
            stream.arguments_sent = settled
    return entries, len(parsed.calls) - min(stream.calls_sent, len(parsed.calls))


def _carries_answer(body: dict[str, Any]) -> bool:
    """Whether a chunk carries answer: text, or a tool call (a reasoning model's thinking is
    not answer)."""
    if "delta" in body:
        return bool(body["delta"].get("content") or body["delta"].get("tool_calls"))
    return bool(body.get("text"))


def _stream_delta(ctx: ResponseContext, stream: _ChoiceStream, out: RequestOutput,
                  slicer: _LogprobSlicer) -> dict[str, Any] | None:
    """The chunk body for what ``out`` adds to its choice, or None when it adds nothing yet
    (text that may still turn out to start a stop string is held back)."""
    if ctx.echo_only and not out.finished:
        return None
    if ctx.harmony:
        return _harmony_delta(ctx, stream, out, slicer)
    safe = len(out.text) if out.finished else max(stream.text_sent,
                                                  len(out.text) - ctx.stop_holdback)
    reasoning_delta, answer_from, answering = "", 0, True
    if ctx.reasoning is not None:
        # The thinking goes out as it grows; the answer (content, tool calls) after it.
        split = ctx.reasoning.split(out.text, out.finished)
        reasoning_from = max(stream.reasoning_sent, split.reasoning_start)
        reasoning_delta = out.text[reasoning_from:split.reasoning_end]
        stream.reasoning_sent = max(reasoning_from, split.reasoning_end)
        answering = split.content_start is not None
        if not answering:
            safe = stream.text_sent  # still thinking: no answer yet
        else:
            answer_from = split.content_start
            stream.text_sent = max(stream.text_sent, answer_from)
            safe = max(safe, stream.text_sent)
        if not ctx.include_reasoning:
            reasoning_delta = ""
    new_calls: list[dict[str, Any]] = []
    completed, headers = 0, stream.headers_sent
    if ctx.tool_calling is not None and answering:
        # Content stops where tool calls begin (or may: a marker's start is held back).
        parsed = ctx.tool_calling.parse(out.text[answer_from:], out.finished)
        safe = max(stream.text_sent, min(safe, answer_from + parsed.content_end))
        new_calls, completed = _call_deltas(ctx, stream, parsed)
        headers = max(headers, len(parsed.calls) + (parsed.opening is not None))
    delta = "" if ctx.echo_only else out.text[stream.text_sent:safe]
    # Logprobs go with the tokens whose text is sent (all of them at the end).
    tokens_end = stream.tokens_sent
    if ctx.logprobs and out.logprobs is not None and out.text_offsets is not None:
        if out.finished:
            tokens_end = len(out.logprobs)
        else:
            ends = out.text_offsets[1:] + [len(out.text)]
            while tokens_end < len(out.logprobs) and ends[tokens_end] <= safe:
                tokens_end += 1
    first = not stream.started
    if not (delta or reasoning_delta or new_calls or tokens_end > stream.tokens_sent
            or out.finished or (first and ctx.echo)):
        return None
    index = stream.choice.index
    finish_reason = ("length" if ctx.echo_only else out.finish_reason) if out.finished else None
    if ctx.tool_calling is not None:
        finish_reason = ctx.tool_calling.finish_reason(
            finish_reason, stream.calls_sent + completed > 0)
    if ctx.chat:
        body: dict[str, Any] = {"index": index, "delta": {"content": delta}, "logprobs": None,
                                "finish_reason": finish_reason}
        if new_calls:
            body["delta"]["tool_calls"] = new_calls
        if reasoning_delta:
            # vLLM's two names: reasoning_content, and its newer reasoning.
            body["delta"]["reasoning_content"] = body["delta"]["reasoning"] = reasoning_delta
        if ctx.logprobs and out.logprobs is not None:
            body["logprobs"] = _chat_logprobs(out.logprobs[stream.tokens_sent:tokens_end],
                                              slicer.k, ctx.tokens_as_ids)
    else:
        text, parts = delta, []
        if first and ctx.echo:
            text = stream.choice.prompt_text + delta
            if ctx.logprobs:
                parts.append(slicer.prompt_part(stream.choice, out))
        if ctx.logprobs and out.logprobs is not None and not ctx.echo_only:
            base = len(stream.choice.prompt_text) if ctx.echo else 0
            parts.append(slicer.output_part(out, stream.tokens_sent, tokens_end, base))
        body = {"index": index, "text": text, "logprobs": _join(parts) if parts else None,
                "finish_reason": finish_reason}
    stream.text_sent = max(stream.text_sent, safe)
    return _sent(ctx, stream, out, body, output=bool(delta or reasoning_delta or new_calls),
                 completed=completed, headers=headers, tokens_end=tokens_end)


def _sent(ctx: ResponseContext, stream: _ChoiceStream, out: RequestOutput,
          body: dict[str, Any], *, output: bool, completed: int, headers: int,
          tokens_end: int) -> dict[str, Any]:
    """``body`` with what a choice's first and last chunks add, and the choice's stream told
    what it sends: ``output`` (text, reasoning or calls), ``completed`` more calls whole, the
    headers of ``headers`` calls, the tokens up to ``tokens_end``."""
    if not stream.started and ctx.prompt_logprobs:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_logprobs)
    if out.finished:
        body["stop_reason"] = out.stop_reason
    stream.started = True
    stream.output_sent = stream.output_sent or output or tokens_end > stream.tokens_sent
    stream.calls_sent += completed
    stream.headers_sent = max(headers, stream.calls_sent)
    stream.tokens_sent = tokens_end
    return body


def _harmony_delta(ctx: ResponseContext, stream: _ChoiceStream, out: RequestOutput,
                   slicer: _LogprobSlicer) -> dict[str, Any] | None:
    """A chat chunk body for what ``out`` adds to a harmony turn: the reasoning, content and
    tool calls its channels hold (engine.serving.harmony); None when nothing new is settled.
    Logprobs go out with every new token (a token's text may be a channel's markup)."""
    safe = len(out.text) if out.finished else max(0, len(out.text) - ctx.stop_holdback)
    read = read_output(out.text[:safe], out.finished, stream.harmony_arguments)
    reasoning_delta = read.reasoning[stream.reasoning_sent:]
    content_delta = read.content[stream.content_sent:]
    parsed = ParsedOutput(0, read.calls, read.opening, read.opening_arguments)
    new_calls, completed = _call_deltas(ctx, stream, parsed)
    tokens_end = len(out.logprobs) if ctx.logprobs and out.logprobs is not None else 0
    if not (reasoning_delta or content_delta or new_calls or tokens_end > stream.tokens_sent
            or out.finished):
        return None
    finish_reason = out.finish_reason if out.finished else None
    if finish_reason == "stop" and stream.calls_sent + completed > 0:
        finish_reason = "tool_calls"
    delta: dict[str, Any] = {"content": content_delta}
    if new_calls:
        delta["tool_calls"] = new_calls
    if reasoning_delta and ctx.include_reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reasoning_delta
    body: dict[str, Any] = {"index": stream.choice.index, "delta": delta, "logprobs": None,
                            "finish_reason": finish_reason}
    if ctx.logprobs and out.logprobs is not None:
        body["logprobs"] = _chat_logprobs(out.logprobs[stream.tokens_sent:tokens_end],
                                          slicer.k, ctx.tokens_as_ids)
    stream.reasoning_sent = len(read.reasoning)
    stream.content_sent = len(read.content)
    return _sent(ctx, stream, out, body,
                 output=bool(content_delta or reasoning_delta or new_calls), completed=completed,
                 headers=max(stream.headers_sent, len(read.calls) + (read.opening is not None)),
                 tokens_end=max(stream.tokens_sent, tokens_end))
