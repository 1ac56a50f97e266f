"""When a response's tokens reach the client's side of the server: the HTTP-edge stamps that
every user-facing TTFT and TPOT figure (the `metrics` object, /metrics) is computed from.

EngineCore stamps a request's first token when the step that sampled it ends, and the
scheduler's slack decisions keep using that stamp. A client sees the token later: after
detokenization, the frame to this process and the event loop getting round to the request's
stream, which under load is seconds (a GPU burst once met 0/10 by the client's clock while
the engine's stamp counted 9 met). So the API server stamps each choice itself:

- first token, streamed: when the ASGI `send` of the first chunk carrying the choice's output
  (text or logprobs, not chat's role-only opening chunk) returns. uvicorn has then handed the
  bytes to the connection's transport, which asyncio writes to the socket at once unless the
  kernel's buffer is full (then `send` waits for it to drain first). This is the last moment
  the server can see; the network and the client's own reading are beyond it (a client that
  has already gone away is written nothing, yet `send` returns: one stamp nobody saw). A chunk that
  also finishes the choice carries the metrics, so it cannot carry its own write time: such a
  first token is stamped as its chunk is built, just before the write.
- first token, not streamed: when the choice's first output reaches the handler. The body is
  written once every choice has finished, so a write stamp would be the end-to-end latency.
- finish: when the choice's last output reaches the handler or the stream (the final chunk
  carries the metrics, so, as above, it is stamped as that chunk is built).

TPOT is (finish - first token) / (tokens - 1) over these two stamps, both on this side. The
arrival they count from is stamped as the request is read (engine.serving.arrival).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from engine.outputs import RequestMetrics, RequestOutput
from engine.serving.metrics import ServerMetrics


@dataclass
class _ChoiceStamps:
    position: int
    # The engine's metrics of the choice's request (arrival, SLOs, the engine's own stamps).
    engine: RequestMetrics | None = None
    first_token_time: float | None = None
    first_answer_time: float | None = None
    finish_time: float | None = None


class EdgeClock:
    """The edge stamps of one HTTP response's choices (by position in the response's list of
    engine requests), reported to /metrics as each is taken."""

    def __init__(self, num_choices: int, metrics: ServerMetrics,
                 on_first_output: Callable[[int, float], None] | None = None,
                 answer_started: Callable[[RequestOutput], bool] | None = None) -> None:
        """``on_first_output(position, when)``: called as each choice's first output is
        stamped (the API server tells EngineCore, whose TTFT deadline for it ends there).
        ``answer_started(out)``: whether an output holds answer (a reasoning model's content
        or tool call past its thinking); None: every output is answer."""
        self._choices = [_ChoiceStamps(position) for position in range(num_choices)]
        self._metrics = metrics
        self._on_first_output = on_first_output
        self._answer_started = answer_started
        # Choices whose first output is in the chunk being written: stamped once `send` returns.
        self._awaiting_write: list[_ChoiceStamps] = []
        # Choices whose first answer is in the chunk being written.
        self._answers_awaiting_write: list[_ChoiceStamps] = []

    # ---- streamed ---------------------------------------------------------------------------

    def output_in_next_write(self, position: int, out: RequestOutput) -> None:
        """The chunk about to be written carries output of this choice (its first, unless it
        was stamped already)."""
        stamps = self._choices[position]
        stamps.engine = out.metrics
        if stamps.first_token_time is None:
            self._awaiting_write.append(stamps)

    def answer_in_next_write(self, position: int) -> None:
        """The chunk about to be written carries answer of this choice (content or a tool
        call, not thinking)."""
        stamps = self._choices[position]
        if stamps.first_answer_time is None:
            self._answers_awaiting_write.append(stamps)

    def written(self) -> None:
        """A chunk's `send` returned: its choices' first tokens are with the client's side."""
        now = time.monotonic()
        for stamps in self._awaiting_write:
            self._stamp_first_token(stamps, now)
        self._awaiting_write.clear()
        for stamps in self._answers_awaiting_write:
            if stamps.first_answer_time is None:
                self._stamp_first_answer(stamps, now)
        self._answers_awaiting_write.clear()

    # ---- streamed and not -------------------------------------------------------------------

    def reached_handler(self, position: int, out: RequestOutput) -> None:
        """Not streamed: an output of this choice reached the handler."""
        stamps = self._choices[position]
        stamps.engine = out.metrics
        now = time.monotonic()
        if stamps.first_token_time is None:
            self._stamp_first_token(stamps, now)
        if stamps.first_answer_time is None and (self._answer_started is None
                                                 or self._answer_started(out)):
            self._stamp_first_answer(stamps, now)
        if out.finished:
            self.finished(position, out)

    def finished(self, position: int, out: RequestOutput,
                 answer_in_chunk: bool | None = None) -> RequestMetrics | None:
        """The choice's last output is here: stamps its finish (and its first token, when the
        chunk about to be written is its first with output) and returns its edge metrics.
        ``answer_in_chunk``: streamed, whether the final chunk carries answer (None: not
        streamed, `answer_started` says)."""
        stamps = self._choices[position]
        if stamps.finish_time is not None:  # its output object, updated in place, seen again
            return _edge_metrics(stamps)
        stamps.engine = out.metrics
        now = time.monotonic()
        if stamps.first_token_time is None:
            self._stamp_first_token(stamps, now)
        if answer_in_chunk is None:
            answer_in_chunk = self._answer_started is None or self._answer_started(out)
        if stamps.first_answer_time is None and answer_in_chunk:
            # The final chunk carries the metrics: an answer in it is stamped as it is built.
            self._stamp_first_answer(stamps, now)
        stamps.finish_time = now
        edge = _edge_metrics(stamps)
        if edge is not None and out.finish_reason != "error":
            self._metrics.on_edge_finish(edge)
        return edge

    def with_edge_metrics(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """Not streamed: the choices' final outputs (in position order) with edge metrics."""
        return [dataclasses.replace(out, metrics=_edge_metrics(stamps))
                for out, stamps in zip(outs, self._choices, strict=True)]

    def _stamp_first_token(self, stamps: _ChoiceStamps, now: float) -> None:
        stamps.first_token_time = now
        if self._on_first_output is not None:
            self._on_first_output(stamps.position, now)
        if (edge := _edge_metrics(stamps)) is not None:
            self._metrics.on_edge_first_token(edge)


    def _stamp_first_answer(self, stamps: _ChoiceStamps, now: float) -> None:
        stamps.first_answer_time = now
        if (edge := _edge_metrics(stamps)) is not None:
            self._metrics.on_edge_first_answer(edge)


def _edge_metrics(stamps: _ChoiceStamps) -> RequestMetrics | None:
    """The choice's metrics with the edge's stamps in place of the engine's (whose first-token
    stamp stays on as engine_first_token_time)."""
    if stamps.engine is None:
        return None
    return dataclasses.replace(stamps.engine, first_token_time=stamps.first_token_time,
                               finish_time=stamps.finish_time,
                               first_answer_time=stamps.first_answer_time,
                               engine_first_token_time=stamps.engine.first_token_time)


class EdgeStampedStream(StreamingResponse):
    """A streaming response that tells its clock when each chunk's `send` has returned (the
    stream's generator only yields: Starlette sends each chunk before it asks for the next)."""

    def __init__(self, content: AsyncIterator[str], clock: EdgeClock,
                 on_close: Callable[[], None] | None = None, **kwargs: Any) -> None:
        """``on_close``: run once the response is over, sent or not (a client gone before the
        stream began never starts its generator, whose own cleanup then never runs)."""
        super().__init__(content, **kwargs)
        self.clock = clock
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stamping_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body":
                self.clock.written()

        try:
            await super().__call__(scope, receive, stamping_send)
        finally:
            if self.on_close is not None:
                self.on_close()
