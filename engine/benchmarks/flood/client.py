"""The flood's requests and the client that sends them all at once.

Two kinds, drawn in a seeded order:

- `urgent`: a chat turn (`/v1/chat/completions`, one user message of real text) with a tight
  TTFT objective linear in its length, as `fleet-bursts`' turns (GPU time scales) or
  `cpu-bursts`' (the default model on a CPU) have;
- `relaxed`: a long prompt with a relaxed objective, as those workloads' documents: by default
  a chat turn too (a pasted document), or a completion of token ids (its first tokens salt;
  `relaxed_route="completions"`, as the attainment benchmark's replays send).

Both kinds coming as chat turns, the server reads them as a flood of users would send them:
it templates and tokenizes each (a turn in its short lane, a document in its long one) before
its queue bound admits or refuses it. A completion of token ids skips that work, so in a flood
that mixes them the completions reach the bound first.

Every request streams (with `stream_options.include_usage`) and carries its objective in the
body's `ttft_slo_ms`; `ignore_eos` fixes its output length. The client times each one from the
moment it sends it: to the first byte of the response body (TTFB), to the first chunk carrying
output (TTFT: text, or a finish; not chat's role-only opening chunk), and to the end. A 200 is
complete when every choice ended with a finish_reason other than "error", no error event came,
and the stream ended with [DONE]. A 429 keeps its Retry-After header and its error body (the
bound it names, `predicted_ttft_ms` where the server judged the request doomed).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.benchmarks.attainment.salts import PrefixSalts, salted
from engine.benchmarks.attainment.traces import PromptSource, Tokenizer, Uniform

URGENT, RELAXED = "urgent", "relaxed"

# Why a 429 came, from its error body: the queue bound it names (the servers' reasons, as the
# rejection counters label them), or `doomed` where it carries a predicted TTFT.
QUEUED_REQS, QUEUED_TOKENS, DOOMED, OTHER_429 = (
    "max_num_queued_reqs", "max_num_queued_tokens", "doomed", "other")


@dataclass(frozen=True)
class Linear:
    """An objective linear in the prompt's length between two points (flat outside them)."""

    lo_tokens: int
    lo_ms: float
    hi_tokens: int
    hi_ms: float

    def at(self, tokens: int) -> float:
        span = max(1, self.hi_tokens - self.lo_tokens)
        x = min(1.0, max(0.0, (tokens - self.lo_tokens) / span))
        return round(self.lo_ms + x * (self.hi_ms - self.lo_ms), 1)


@dataclass(frozen=True)
class Mix:
    """What the flood's two kinds ask for."""

    urgent_prompt: Uniform
    urgent_slo: Linear
    urgent_output_tokens: int
    relaxed_prompt: Uniform
    relaxed_slo: Linear
    relaxed_output_tokens: int

    def describe(self) -> dict[str, Any]:
        return {"urgent": {"prompt_tokens": [self.urgent_prompt.lo, self.urgent_prompt.hi],
                           "ttft_slo_ms": asdict(self.urgent_slo),
                           "output_tokens": self.urgent_output_tokens},
                "relaxed": {"prompt_tokens": [self.relaxed_prompt.lo, self.relaxed_prompt.hi],
                            "ttft_slo_ms": asdict(self.relaxed_slo),
                            "output_tokens": self.relaxed_output_tokens}}


# At GPU time scales (the simulated H100 serving an 8B model): `fleet-bursts`' urgent turns and
# documents (engine/benchmarks/fleet/bursts.py), the documents cut to 8k-16k tokens so that a
# flood of them fits the default --max-model-len of a simulated server.
GPU_MIX = Mix(urgent_prompt=Uniform(64, 512), urgent_slo=Linear(64, 150.0, 512, 300.0),
              urgent_output_tokens=16, relaxed_prompt=Uniform(8192, 16384),
              relaxed_slo=Linear(8192, 10_000.0, 16384, 20_000.0), relaxed_output_tokens=8)
# The default model on a few CPU cores: `cpu-bursts`' (engine/benchmarks/attainment/cpu_bursts.py).
CPU_MIX = Mix(urgent_prompt=Uniform(32, 160), urgent_slo=Linear(32, 250.0, 160, 700.0),
              urgent_output_tokens=16, relaxed_prompt=Uniform(2000, 5000),
              relaxed_slo=Linear(2000, 30_000.0, 5000, 30_000.0), relaxed_output_tokens=8)


@dataclass
class FloodRequest:
    index: int
    kind: str
    path: str
    body: dict[str, Any]
    prompt_tokens: int  # the message's or the prompt's own tokens (chat adds its template's)
    ttft_slo_ms: float


RELAXED_ROUTES = ("chat", "completions")


def build_flood(num_requests: int, urgent_share: float, mix: Mix, tokenizer: Tokenizer,
                model_name: str, seed: int, max_prompt_len: int | None = None,
                relaxed_route: str = "chat") -> list[FloodRequest]:
    """`num_requests` requests, round(urgent_share * num_requests) of them urgent, in a seeded
    order. Prompts are windows of the corpus at seeded offsets; each completion's first tokens
    and each chat message's first word are salt drawn afresh (a server's prefix cache holds
    nothing of them, whatever ran before)."""
    if num_requests < 1 or not 0.0 <= urgent_share <= 1.0:
        raise ValueError(f"flood: need num_requests >= 1 and 0 <= urgent_share <= 1, got "
                         f"{num_requests}, {urgent_share}")
    if relaxed_route not in RELAXED_ROUTES:
        raise ValueError(f"flood: relaxed_route must be one of {RELAXED_ROUTES}, got "
                         f"{relaxed_route!r}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7041]))
    num_urgent = round(urgent_share * num_requests)
    kinds = [URGENT] * num_urgent + [RELAXED] * (num_requests - num_urgent)
    order = rng.permutation(num_requests)
    source = PromptSource(tokenizer)

    def window(n: int) -> list[int]:
        return [int(t) for t in source.window(int(rng.integers(len(source))), n)]

    def clip(n: int) -> int:
        return n if max_prompt_len is None else max(1, min(n, max_prompt_len))

    salts = PrefixSalts([source.tokens[:4096]])
    out: list[FloodRequest] = []
    for index, k in enumerate(order):
        kind = kinds[int(k)]
        common = {"model": model_name, "temperature": 0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
        urgent = kind == URGENT
        n = clip((mix.urgent_prompt if urgent else mix.relaxed_prompt).sample(rng))
        slo = (mix.urgent_slo if urgent else mix.relaxed_slo).at(n)
        output_tokens = mix.urgent_output_tokens if urgent else mix.relaxed_output_tokens
        if urgent or relaxed_route == "chat":
            text = tokenizer.decode(window(n))
            body = {**common, "messages": [{"role": "user",
                                            "content": f"{secrets.token_hex(4)} {text}"}],
                    "max_tokens": output_tokens, "ttft_slo_ms": slo}
            out.append(FloodRequest(index, kind, "/v1/chat/completions", body, n, slo))
        else:
            body = {**common, "prompt": salted(window(n), salts.draw()),
                    "max_tokens": output_tokens, "ttft_slo_ms": slo}
            out.append(FloodRequest(index, kind, "/v1/completions", body, n, slo))
    return out


@dataclass
class Record:
    """One request of the flood as the client saw it (times in ms from its own send)."""

    index: int
    kind: str
    path: str
    prompt_tokens: int
    ttft_slo_ms: float
    sent_ms: float = 0.0  # from the flood's start
    sent_at: float | None = None  # time.time() at the send: against the server's own stamps
    # When the client had handed the whole body to its connection (ms from its own send): the
    # one process playing every user of the flood writes them one after another, and a
    # request's clock runs from its send, before that.
    written_ms: float | None = None
    status: int | None = None
    ttfb_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    completed: bool = False
    finish_reasons: list[str | None] = field(default_factory=list)
    done: bool = False  # the stream ended with [DONE]
    output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    server_ttft_ms: float | None = None  # the response's own metrics.ttft_ms
    server_metrics: dict[str, Any] | None = None  # the response's metrics object, whole
    replica: str | None = None  # a fleet's x-sloserve-replica
    # A fleet's x-sloserve-predicted-ttft-ms: the router's prediction where it sent the request.
    routed_predicted_ttft_ms: float | None = None
    retry_after: str | None = None
    reject_reason: str | None = None
    predicted_ttft_ms: float | None = None
    error_body: Any = None
    error: str | None = None

    @property
    def met(self) -> bool:
        return (self.status == 200 and self.completed and self.ttft_ms is not None
                and self.ttft_ms <= self.ttft_slo_ms)


def reject_reason(body: Any) -> str:
    """Which bound a 429's error body names (the single server's messages name their flag; a
    doomed refusal, a server's or a fleet's, carries predicted_ttft_ms)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return OTHER_429
    if error.get("predicted_ttft_ms") is not None:
        return DOOMED
    message = str(error.get("message", ""))
    if "--max-num-queued-reqs" in message:
        return QUEUED_REQS
    if "--max-num-queued-tokens" in message:
        return QUEUED_TOKENS
    return OTHER_429


def _carries_output(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("finish_reason"):
            return True
    return "error" in event


async def send(http: Any, url: str, request: FloodRequest, body: bytes,
               start: float) -> Record:
    """Sends one request of the flood (`body`: its JSON, encoded beforehand) on the aiohttp
    session `http` and reads its answer to the end."""
    import aiohttp

    record = Record(request.index, request.kind, request.path, request.prompt_tokens,
                    request.ttft_slo_ms)
    sent = time.monotonic()
    record.sent_ms = round(1e3 * (sent - start), 2)
    record.sent_at = time.time()

    def ms() -> float:
        return round(1e3 * (time.monotonic() - sent), 2)

    finishes: dict[int, str | None] = {}
    errors: list[str] = []
    try:
        async with http.post(url + request.path, data=body, headers=_JSON,
                             trace_request_ctx=record) as response:
            record.status = response.status
            record.replica = response.headers.get("x-sloserve-replica")
            routed = response.headers.get("x-sloserve-predicted-ttft-ms")
            try:
                record.routed_predicted_ttft_ms = None if routed is None else float(routed)
            except ValueError:
                pass
            if response.status != 200:
                raw = await response.read()
                record.ttfb_ms = ms()
                record.retry_after = response.headers.get("retry-after")
                try:
                    record.error_body = json.loads(raw)
                except ValueError:
                    record.error_body = raw.decode(errors="replace")[:2000]
                if response.status == 429:
                    record.reject_reason = reject_reason(record.error_body)
                    if isinstance(record.error_body, dict):
                        predicted = (record.error_body.get("error") or {}).get(
                            "predicted_ttft_ms")
                        record.predicted_ttft_ms = (float(predicted) if isinstance(
                            predicted, (int, float)) else None)
            else:
                buffer = b""
                async for piece in response.content.iter_any():
                    if record.ttfb_ms is None and piece:
                        record.ttfb_ms = ms()
                    buffer += piece
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        _read_line(line.decode().strip(), record, finishes, errors, ms)
                _read_line(buffer.decode().strip(), record, finishes, errors, ms)
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError) as exc:
        # A broken connection, a timeout or bytes that are not text: it did not complete.
        errors.append(f"{type(exc).__name__}: {exc}")
    record.e2e_ms = ms()
    record.finish_reasons = [finishes[i] for i in sorted(finishes)]
    record.error = "; ".join(errors)[:2000] or None
    record.completed = (record.status == 200 and record.done and not errors
                        and bool(finishes)
                        and all(f is not None and f != "error" for f in finishes.values()))
    return record


_JSON = {"Content-Type": "application/json"}


def _write_stamps() -> Any:
    """An aiohttp trace that stamps each request's Record (its `trace_request_ctx`) with when
    its body was handed to the connection: the one chunk of a body sent whole."""
    import aiohttp

    async def on_chunk_sent(_session: Any, context: Any, _params: Any) -> None:
        record = context.trace_request_ctx
        if isinstance(record, Record) and record.written_ms is None and record.sent_at:
            record.written_ms = round(1e3 * (time.time() - record.sent_at), 2)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_chunk_sent)
    return trace


def _read_line(line: str, record: Record, finishes: dict[int, str | None],
               errors: list[str], ms: Any) -> None:
    if not line.startswith("data:"):
        return
    payload = line[5:].strip()
    if payload == "[DONE]":
        record.done = True
        return
    if record.done:
        errors.append("an event after [DONE]")
        return
    try:
        event = json.loads(payload)
    except ValueError:
        errors.append(f"an event that is not JSON: {payload[:200]}")
        return
    if "error" in event:
        errors.append(f"error event: {json.dumps(event['error'])[:500]}")
    if record.ttft_ms is None and _carries_output(event):
        record.ttft_ms = ms()
    for choice in event.get("choices") or ():
        index = int(choice.get("index", 0))
        finishes.setdefault(index, None)
        if choice.get("finish_reason") is not None:
            finishes[index] = choice["finish_reason"]
    if event.get("usage"):
        record.output_tokens = event["usage"].get("completion_tokens")
        record.usage_prompt_tokens = event["usage"].get("prompt_tokens")
    metrics = event.get("metrics")
    if isinstance(metrics, dict):
        record.server_metrics = metrics
        if metrics.get("ttft_ms") is not None:
            record.server_ttft_ms = float(metrics["ttft_ms"])


async def flood(url: str, requests: Sequence[FloodRequest], headers: dict[str, str],
                timeout_s: float) -> tuple[list[Record], float]:
    """Every request at once (each coroutine waits for one start signal, so none is sent
    before all are ready); returns the records in the requests' order and the seconds from
    the start to the last answer.

    One process plays all the flood's users, on the server's own host in a benchmark: its cost
    per request is time every request waits before the server even reads it, and CPU the
    server does not get. So the bodies are encoded before the signal, and the client is
    aiohttp (as vLLM's `vllm bench serve`). On a 2-core host, through httpx the urgent turns'
    TTFT p50 was 384-498 ms by the client's clock and 283-294 ms by the server's own, in
    three runs; through aiohttp against the same server, 130-197 ms and 94-154 ms: the
    httpx client's CPU was taken from the server (bench/RESULTS.md, Overload)."""
    import aiohttp

    bodies = [json.dumps(r.body).encode() for r in requests]
    connector = aiohttp.TCPConnector(limit=len(requests) + 8)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=60.0)
    async with aiohttp.ClientSession(headers=headers, connector=connector, timeout=timeout,
                                     trace_configs=[_write_stamps()]) as http:
        go = asyncio.Event()
        start = 0.0
        base = url.rstrip("/")

        async def one(request: FloodRequest, body: bytes) -> Record:
            await go.wait()
            return await send(http, base, request, body, start)

        tasks = [asyncio.create_task(one(r, b)) for r, b in zip(requests, bodies)]
        await asyncio.sleep(0)  # every task waits on the signal
        start = time.monotonic()
        go.set()
        records = await asyncio.gather(*tasks)
        return list(records), time.monotonic() - start
