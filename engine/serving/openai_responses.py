"""Turning a request's outputs into OpenAI response bodies and server-sent-event chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.outputs import RequestMetrics, RequestOutput

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

    @property
    def created(self) -> int:
        return int(time.time())


def metrics_body(metrics: RequestMetrics | None) -> dict[str, Any] | None:
    if metrics is None:
        return None

    def unix(t: float | None) -> float | None:
        return None if t is None else t + _UNIX_OFFSET

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000

    return {"arrival_time": unix(metrics.arrival_time),
            "first_token_time": unix(metrics.first_token_time),
            "ttft_ms": ms(metrics.ttft), "ttft_slo_ms": metrics.ttft_slo_ms,
            "ttft_slo_met": metrics.ttft_slo_met, "tpot_ms": ms(metrics.tpot),
            "tpot_slo_ms": metrics.tpot_slo_ms, "tpot_slo_met": metrics.tpot_slo_met,
            "num_preemptions": metrics.num_preemptions,
            "queue_time_ms": ms(metrics.queue_time),
            "slack_at_admission_ms": ms(metrics.slack_at_admission_s)}


def usage_body(out: RequestOutput) -> dict[str, int]:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def full_response(ctx: ResponseContext, out: RequestOutput) -> dict[str, Any]:
    if ctx.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": out.finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None,
                  "finish_reason": out.finish_reason}
        kind = "text_completion"
    return {"id": ctx.request_id, "object": kind, "created": ctx.created, "model": ctx.model,
            "choices": [choice], "usage": usage_body(out), "metrics": metrics_body(out.metrics)}


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def stream_events(ctx: ResponseContext, outputs: AsyncIterator[RequestOutput],
                        on_error: Callable[[Exception], dict[str, Any]]) -> AsyncIterator[str]:
    """SSE chunks for one request; a failure ends the stream with the error event `on_error`
    makes of it (a short message: the headers are sent, so this is all the client gets)."""
    kind = "chat.completion.chunk" if ctx.chat else "text_completion"
    created = ctx.created
    sent = 0

    def chunk(delta: str, finish_reason: str | None, first: bool = False) -> dict[str, Any]:
        if ctx.chat:
            content: dict[str, Any] = {"content": delta}
            if first:
                content["role"] = "assistant"
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None,
                      "finish_reason": finish_reason}
        return {"id": ctx.request_id, "object": kind, "created": created, "model": ctx.model,
                "choices": [choice]}

    if ctx.chat:
        yield _sse(chunk("", None, first=True))
    last: RequestOutput | None = None
    try:
        async for out in outputs:
            last = out
            safe = len(out.text) if out.finished else max(sent, len(out.text) - ctx.stop_holdback)
            delta = out.text[sent:safe]
            sent = max(sent, safe)
            if out.finished:
                final = chunk(delta, out.finish_reason)
                final["metrics"] = metrics_body(out.metrics)
                yield _sse(final)
            elif delta:
                yield _sse(chunk(delta, None))
    except Exception as exc:  # the engine died, the server is shutting down, or a bug
        yield _sse(on_error(exc))
        yield _sse("[DONE]")
        return
    if ctx.include_usage and last is not None:
        yield _sse({"id": ctx.request_id, "object": kind, "created": created,
                    "model": ctx.model, "choices": [], "usage": usage_body(last)})
    yield _sse("[DONE]")
