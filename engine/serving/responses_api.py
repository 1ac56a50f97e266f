"""A chat completion turned into an OpenAI Responses object, and a chat stream into the
`response.*` events the openai SDK reads (`client.responses.create(stream=True)`,
`client.responses.stream(...)`).

The Responses route runs the chat route's request (engine.serving.responses_protocol), so
everything the chat route reads out of a model's text arrives here already split: the thinking
a reasoning parser (or harmony's analysis channel) finds becomes a `reasoning` item, the
content a `message` item with one `output_text` part, each tool call a `function_call` item.
A stream turns each chat chunk into the events for what it adds, written as one piece, so the
HTTP edge's TTFT stamps (engine.serving.edge_clock) fall on the same writes as chat's.

As vLLM does, a response cut short by `max_output_tokens` ends with `response.completed`
(the SDK's stream helper needs that event) and says `status: "incomplete"` in it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.serving.responses_protocol import ResponsesRequest


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_id(chat_call_id: str) -> str:
    """The Responses form of a chat call's id (`chatcmpl-tool-<digest>` -> `call_<digest>`):
    still derived from the response's id, so a stream and a replay agree."""
    return f"call_{chat_call_id.rsplit('-', 1)[-1]}"


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's status and its incomplete_details, from the chat choice's finish."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _usage(chat_usage: dict[str, int] | None, metrics: dict[str, Any] | None
           ) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (metrics or {}).get("num_cached_tokens") or 0
    # Reasoning tokens are not counted apart from the rest of the output (0).
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    # The thinking is both the summary (what OpenAI's clients read) and the reasoning text
    # (what vLLM returns): nothing here summarizes it.
    return {"id": item_id, "type": "reasoning", "status": status,
            "summary": [{"type": "summary_text", "text": text}],
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": parts}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str
               ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


@dataclass
class ResponsesShape:
    """One Responses request: its id (the engine request's too) and what its response echoes
    of the request."""

    body: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], *,
                 usage: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        text_format = (body.text.format.model_dump(by_alias=True, exclude_none=True)
                       if body.text is not None and body.text.format is not None
                       else {"type": "text"})
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": text_format},
            "reasoning": (body.reasoning.model_dump(exclude_none=True)
                          if body.reasoning is not None else None),
            "previous_response_id": None, "store": False, "background": False,
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
            "usage": usage,
            # sloserve's: the TTFT and TPOT figures and objectives, as on the chat route.
            "metrics": metrics}

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Responses object for a finished chat completion body (one choice)."""
        (choice,) = chat["choices"]
        message = choice["message"]
        status, incomplete = _status(choice["finish_reason"])
        output: list[dict[str, Any]] = []
        if thinking := message.get("reasoning_content"):
            output.append(_reasoning_item(_new_id("rs"), thinking, "completed"))
        if content := message.get("content"):
            logprobs = ((choice.get("logprobs") or {}).get("content") or []
                        if self.body.wants_logprobs else None)
            output.append(_message_item(_new_id("msg"), [_text_part(content, logprobs)],
                                        "completed"))
        for call in message.get("tool_calls") or ():
            output.append(_call_item(_new_id("fc"), _call_id(call["id"]),
                                     call["function"]["name"], call["function"]["arguments"],
                                     "completed"))
        if incomplete is not None and output:
            output[-1]["status"] = "incomplete"
        return self.response(status, output, usage=_usage(chat.get("usage"), chat["metrics"]),
                             metrics=chat["metrics"], incomplete=incomplete)

    async def stream(self, chunks: AsyncGenerator[dict[str, Any] | str, None]
                     ) -> AsyncIterator[str]:
        """The SSE events for a chat stream's chunk bodies (engine.serving.openai_responses.
        stream_events with raw=True): one string per chunk that adds anything."""
        writer = _EventWriter(self)
        try:
            async for chunk in chunks:
                if text := writer.on_chunk(chunk):
                    yield text
        finally:
            # A client gone mid-stream closes this generator: the chat stream is closed at
            # once too, which aborts the request in the engine (not when it is collected).
            await chunks.aclose()


@dataclass
class _OpenItem:
    """The output item being streamed: its output index, what it holds so far."""

    kind: str  # reasoning, message or function_call
    item_id: str
    index: int
    text: str = ""  # the thinking, the message's text, or the call's arguments
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    call_id: str = ""
    name: str = ""
    chat_index: int = -1  # a call's index in chat's tool_calls


class _EventWriter:
    """Chat chunk bodies in, Responses events out (each with its sequence number)."""

    def __init__(self, shape: ResponsesShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items, by output index
        self.open: _OpenItem | None = None
        self.finish_reason: str | None = None
        self.metrics: dict[str, Any] | None = None
        self.usage: dict[str, int] | None = None
        self.failed = False
        # Logprobs that came in a chunk without text: they go out with the next text.
        self.held_logprobs: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def on_chunk(self, chunk: dict[str, Any] | str) -> str:
        if chunk == "[DONE]":
            return "" if self.failed else self._completed()
        assert isinstance(chunk, dict)
        if "error" in chunk:
            return self._failed(chunk["error"])
        if not chunk["choices"]:  # the usage chunk, last
            self.usage = chunk.get("usage")
            return ""
        (choice,) = chunk["choices"]
        delta = choice.get("delta") or {}
        if delta.get("role"):  # chat's opening chunk
            created = self.shape.response("in_progress", [])
            return (self._event("response.created", response=created)
                    + self._event("response.in_progress", response=created))
        events: list[str] = []
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if reasoning := delta.get("reasoning_content"):
            events += self._add_text("reasoning", reasoning, [])
        if content := delta.get("content"):
            events += self._add_text("message", content, [*self.held_logprobs, *logprobs])
            self.held_logprobs = []
        elif logprobs:
            self.held_logprobs += logprobs
        for call in delta.get("tool_calls") or ():
            events += self._add_call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.metrics = chunk.get("metrics")
            events += self._close()
        return "".join(events)

    # ---- items ----------------------------------------------------------------------------

    def _start(self, kind: str, prefix: str, **fields: Any) -> list[str]:
        """Closes the open item and opens one of `kind`: its added events."""
        events = self._close()
        self.open = opened = _OpenItem(kind, _new_id(prefix), len(self.output), **fields)
        where = {"item_id": opened.item_id, "output_index": opened.index}
        if kind == "reasoning":
            item = _reasoning_item(opened.item_id, "", "in_progress")
            item["summary"], item["content"] = [], []
            return [*events, self._event("response.output_item.added", output_index=opened.index,
                                         item=item),
                    self._event("response.reasoning_summary_part.added", **where,
                                summary_index=0, part={"type": "summary_text", "text": ""})]
        if kind == "message":
            part = _text_part("", [] if self.shape.body.wants_logprobs else None)
            return [*events, self._event("response.output_item.added", output_index=opened.index,
                                         item=_message_item(opened.item_id, [], "in_progress")),
                    self._event("response.content_part.added", **where, content_index=0,
                                part=part)]
        item = _call_item(opened.item_id, opened.call_id, opened.name, "", "in_progress")
        return [*events, self._event("response.output_item.added", output_index=opened.index,
                                     item=item)]

    def _add_text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> list[str]:
        events = [] if self.open is not None and self.open.kind == kind else self._start(
            kind, "rs" if kind == "reasoning" else "msg")
        opened = self.open
        assert opened is not None
        opened.text += text
        where = {"item_id": opened.item_id, "output_index": opened.index}
        if kind == "reasoning":
            return [*events, self._event("response.reasoning_summary_text.delta", **where,
                                         summary_index=0, delta=text)]
        opened.logprobs += logprobs
        return [*events, self._event("response.output_text.delta", **where, content_index=0,
                                     delta=text, logprobs=logprobs)]

    def _add_call(self, call: dict[str, Any]) -> list[str]:
        """A chat `tool_calls` delta entry: a call's header (id and name) opens its item; its
        argument fragments follow."""
        events: list[str] = []
        function = call.get("function") or {}
        if "id" in call:
            events += self._start("function_call", "fc", call_id=_call_id(call["id"]),
                                  name=function.get("name", ""), chat_index=call["index"])
        opened = self.open
        if (fragment := function.get("arguments")) and opened is not None \
                and opened.kind == "function_call" and opened.chat_index == call["index"]:
            opened.text += fragment
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=opened.item_id, output_index=opened.index,
                                      delta=fragment))
        return events

    def _close(self, cut_short: bool = False) -> list[str]:
        """The done events of the open item (none when none is open); `cut_short`: the
        response failed while it was being written."""
        opened, self.open = self.open, None
        if opened is None:
            return []
        status = ("incomplete" if cut_short or self.finish_reason == "length"
                  else "completed")
        where = {"item_id": opened.item_id, "output_index": opened.index}
        if opened.kind == "reasoning":
            item = _reasoning_item(opened.item_id, opened.text, status)
            events = [self._event("response.reasoning_summary_text.done", **where,
                                  summary_index=0, text=opened.text),
                      self._event("response.reasoning_summary_part.done", **where,
                                  summary_index=0, part=item["summary"][0])]
        elif opened.kind == "message":
            wanted = self.shape.body.wants_logprobs
            part = _text_part(opened.text, opened.logprobs if wanted else None)
            item = _message_item(opened.item_id, [part], status)
            events = [self._event("response.output_text.done", **where, content_index=0,
                                  text=opened.text, logprobs=opened.logprobs),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=part)]
        else:
            item = _call_item(opened.item_id, opened.call_id, opened.name, opened.text, status)
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=opened.name, arguments=opened.text)]
        self.output.append(item)
        return [*events, self._event("response.output_item.done", output_index=opened.index,
                                     item=item)]

    # ---- the end --------------------------------------------------------------------------

    def _completed(self) -> str:
        events = self._close()
        status, incomplete = _status(self.finish_reason)
        final = self.shape.response(status, self.output, usage=_usage(self.usage, self.metrics),
                                    metrics=self.metrics, incomplete=incomplete)
        return "".join([*events, self._event("response.completed", response=final)])

    def _failed(self, error: dict[str, Any]) -> str:
        """An `error` event and `response.failed`: the server could not finish (the engine
        stopped, the server is shutting down); the message is a short one (no traceback)."""
        self.failed = True
        events = self._close(cut_short=True)
        status = error.get("code")
        code = ("server_error" if not isinstance(status, int) or status >= 500 else
                "rate_limit_exceeded" if status == 429 else "invalid_prompt")
        message = error.get("message", "the response failed")
        failed = self.shape.response("failed", self.output, error={"code": code,
                                                                   "message": message})
        return "".join([*events, self._event("error", code=code, message=message,
                                             param=error.get("param")),
                        self._event("response.failed", response=failed)])
