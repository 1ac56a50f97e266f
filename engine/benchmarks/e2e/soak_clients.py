"""The soak benchmark's clients (`sloserve bench soak`, engine/benchmarks/e2e/soak.py): what each
request sends, how its answer is classified, and the client loops that send them."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.benchmarks.attainment.traces import CORPUS_PATH as CORPUS

# (label, ttft_slo_ms): urgent is tight enough that the scheduler has to put it first.
SLOS: tuple[tuple[str, float | None], ...] = (("urgent", 500.0), ("relaxed", 5000.0),
                                               ("none", None))
# 1e-40 is below float32's normal range: it must be served greedy, not kill the engine.
TEMPERATURES = (0.0, 0.0, 0.7, 1.0, 1e-40)
# Request kinds and their weights in each client's mix.
MIX: dict[str, int] = {"stream_completion": 25, "completion": 12, "stream_chat": 20, "chat": 10,
                       "hangup_stream": 12, "hangup_wait": 6, "bad_input": 15}
TRACEBACK_MARKS = ("Traceback", 'File "')
MAX_EXAMPLES = 20


# ---- what came back -----------------------------------------------------------------------------

@dataclass
class Tally:
    """Every request's outcome, shared by all clients (one event loop, so no lock)."""

    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    bad_inputs: dict[str, Counter] = field(default_factory=dict)
    lost_reasons: Counter = field(default_factory=Counter)
    lost_examples: list[dict[str, Any]] = field(default_factory=list)
    status_5xx: int = 0
    tracebacks: int = 0
    ttft_ms: dict[str, list[float]] = field(default_factory=dict)
    # (seconds, kind, what the prompt was like) of the slowest requests: where a stall shows.
    slowest: list[tuple[float, str, str]] = field(default_factory=list)

    def timed(self, seconds: float, kind: str, shape: str) -> None:
        self.slowest = sorted([*self.slowest, (round(seconds, 2), kind, shape)], reverse=True)[:5]

    def record(self, kind: str, outcome: str, reason: str = "", snippet: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome == "lost":
            self.lost_reasons[reason] += 1
            if len(self.lost_examples) < MAX_EXAMPLES:
                self.lost_examples.append({"kind": kind, "reason": reason,
                                           "body": snippet[:400]})

    def saw(self, text: str) -> None:
        """Counts a traceback in any body or SSE event the server sent."""
        if any(mark in text for mark in TRACEBACK_MARKS):
            self.tracebacks += 1


def error_message(text: str) -> str | None:
    """The message of an OpenAI-shaped error body, None when the body is not one."""
    try:
        body = json.loads(text)
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return message if isinstance(message, str) else None


def classify_status(tally: Tally, kind: str, status: int, text: str, bad: bool) -> None:
    """Outcome of a request answered with a non-200 status."""
    if status >= 500:
        tally.status_5xx += 1
        tally.record(kind, "lost", f"HTTP {status}", text)
    elif not bad:
        tally.record(kind, "lost", f"HTTP {status} for a valid request", text)
    elif status >= 400 and error_message(text) is not None:
        tally.record(kind, "rejected_as_expected")
    else:
        tally.record(kind, "lost", f"HTTP {status} without an OpenAI error body", text)


def classify_stream(tally: Tally, kind: str, lines: list[str], bad: bool) -> None:
    """Outcome of a complete 200 event stream, from its lines."""
    done, finish, error, after_done = False, None, None, False
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            done = True
            continue
        after_done |= done
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            return tally.record(kind, "lost", "SSE event that is not a JSON object", payload)
        if "error" in event:
            error = payload
            # An error event is the streaming form of an error status: count its 5xx too.
            code = event["error"].get("code") if isinstance(event["error"], dict) else None
            tally.status_5xx += isinstance(code, int) and code >= 500
        for choice in event.get("choices") or []:
            finish = choice.get("finish_reason") or finish
    if bad:
        tally.record(kind, "lost", "bad input answered with 200", error or "")
    elif error is not None:
        tally.record(kind, "lost", "error event in stream", error)
    elif after_done:
        tally.record(kind, "lost", "event after [DONE]")
    elif not done:
        tally.record(kind, "lost", "stream ended without [DONE]")
    elif finish is None:
        tally.record(kind, "lost", "stream without a finish_reason")
    else:
        tally.record(kind, "completed")


def classify_body(tally: Tally, kind: str, text: str, bad: bool) -> None:
    """Outcome of a 200 non-streaming response."""
    if bad:
        return tally.record(kind, "lost", "bad input answered with 200", text)
    try:
        choices = json.loads(text)["choices"]
        finish = choices[0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return tally.record(kind, "lost", "200 body without choices", text)
    if finish is None:
        return tally.record(kind, "lost", "response without a finish_reason", text)
    tally.record(kind, "completed")


# ---- what is sent -------------------------------------------------------------------------------

@dataclass
class Target:
    """What the clients need to know about the server."""

    url: str
    model_name: str
    max_model_len: int
    headers: dict[str, str]
    slos: tuple[tuple[str, float | None], ...] = SLOS


class Prompts:
    """Text slices of engine/benchmarks/corpus.txt. A prompt has at most `budget` characters: every
    token
    of a byte-level or byte-fallback tokenizer covers at least one byte, so it always fits."""

    def __init__(self) -> None:
        self.words = CORPUS.read_text().split()

    def text(self, rng: random.Random, budget: int) -> str:
        # Mostly short turns; one in ten a long document, long enough to be worth preempting
        # (and slow enough on a CPU that a bigger share would starve everything else).
        n = rng.randint(4, 48) if rng.random() < 0.9 else rng.randint(100, 800)
        start = rng.randrange(len(self.words))
        words = (self.words * 2)[start:start + n] if n < len(self.words) else self.words
        return " ".join(words)[:max(8, budget)]


def bad_request(rng: random.Random, target: Target) -> tuple[str, str, bytes, dict[str, str]]:
    """One bad input: (label, path, raw body, extra headers). Raw bytes, so that NaN, huge
    integers and malformed JSON go out exactly as written."""
    stream = rng.random() < 0.5
    completion = {"prompt": "Hello there", "max_tokens": 4, "stream": stream}
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
            "stream": stream}
    cases: dict[str, tuple[str, Any]] = {
        "nan_temperature": ("c", {**completion, "temperature": float("nan")}),
        "inf_top_p": ("h", {**chat, "top_p": float("inf")}),
        "nan_ttft_slo": ("c", {**completion, "ttft_slo_ms": float("nan")}),
        "seed_2**70": ("c", {**completion, "seed": 2**70}),
        "max_tokens_2**64": ("h", {**chat, "max_tokens": 2**64}),
        "priority_-2**70": ("c", {**completion, "priority": -2**70}),
        "top_k_2**80": ("h", {**chat, "top_k": 2**80}),
        "token_id_2**70": ("c", {**completion, "prompt": [1, 2**70]}),
        "stop_token_id_2**70": ("c", {**completion, "stop_token_ids": [2**70]}),
        "token_id_beyond_vocab": ("c", {**completion, "prompt": [1, 10**9]}),
        "negative_token_id": ("c", {**completion, "prompt": [-1]}),
        "max_tokens_wrong_type": ("c", {**completion, "max_tokens": "ten"}),
        "prompt_wrong_type": ("c", {**completion, "prompt": {"text": 1}}),
        "messages_wrong_type": ("h", {**chat, "messages": "hello"}),
        "unknown_role": ("h", {**chat, "messages": [{"role": "wizard", "content": "hi"}]}),
        "unknown_model": ("h", {**chat, "model": "no-such-model"}),
        "over_long_prompt": ("c", {**completion, "prompt": [1] * (target.max_model_len + 1)}),
        "negative_temperature": ("c", {**completion, "temperature": -1}),
        "zero_max_tokens": ("h", {**chat, "max_tokens": 0}),
        "lone_surrogate": ("c", {**completion, "prompt": "\ud800 hello"}),
        "malformed_json": ("c", None),
        "bad_slo_header": ("c", completion),
        "oversized_body": ("c", {**completion, "prompt": "word " * (1 << 19)}),
    }
    label = rng.choice(sorted(cases))
    route, body = cases[label]
    path = "/v1/completions" if route == "c" else "/v1/chat/completions"
    raw = b'{"prompt": "unfinished", ' if body is None else json.dumps(body).encode()
    headers = {"x-slo-ttft-ms": "soon"} if label == "bad_slo_header" else {}
    return label, path, raw, headers


def good_request(rng: random.Random, target: Target, prompts: Prompts, kind: str,
                 max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of a valid request; hang-ups ask for the most tokens so they are cut."""
    hangup = kind.startswith("hangup")
    tokens = max_tokens if hangup else rng.randint(1, max_tokens)
    budget = target.max_model_len - tokens - 64  # room for a chat template
    body: dict[str, Any] = {"model": target.model_name, "max_tokens": tokens,
                            "temperature": rng.choice(TEMPERATURES),
                            "ignore_eos": hangup or rng.random() < 0.5,
                            "stream": "stream" in kind}
    if body["temperature"] > 0 and rng.random() < 0.5:
        body["seed"] = rng.randrange(2**63)
    slo = rng.choice(target.slos)[1]
    if slo is not None:
        body["ttft_slo_ms"] = slo
    if "chat" in kind or (hangup and rng.random() < 0.5):
        body["messages"] = [{"role": "user", "content": prompts.text(rng, budget)}]
        return "/v1/chat/completions", body
    body["prompt"] = prompts.text(rng, budget)
    return "/v1/completions", body


def slo_label(target: Target, body: dict[str, Any]) -> str:
    return next(label for label, ms in target.slos if ms == body.get("ttft_slo_ms"))


# ---- the clients --------------------------------------------------------------------------------

async def send_bad(http: httpx.AsyncClient, tally: Tally, rng: random.Random,
                   target: Target) -> None:
    label, path, raw, headers = bad_request(rng, target)
    response = await http.post(path, content=raw,
                               headers={"content-type": "application/json", **headers})
    tally.bad_inputs.setdefault(label, Counter())[str(response.status_code)] += 1
    tally.saw(response.text)
    kind = f"bad_input:{label}"
    if response.status_code == 200:
        # A streamed 200 is read whole by post(): classify it as the stream it is.
        if "text/event-stream" in response.headers.get("content-type", ""):
            classify_stream(tally, kind, response.text.splitlines(), bad=True)
        else:
            classify_body(tally, kind, response.text, bad=True)
    else:
        classify_status(tally, kind, response.status_code, response.text, bad=True)


def carries_output(line: str) -> bool:
    """Whether an SSE line carries generated text or the end (chat's first event carries only
    the assistant role, sent before any token, so it says nothing about the TTFT)."""
    try:
        event = json.loads(line[len("data:"):])
    except ValueError:
        return True  # [DONE] or garbage: the stream's classification says which
    if not isinstance(event, dict) or not event.get("choices"):
        return True
    choice = event["choices"][0]
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return bool(text) or choice.get("finish_reason") is not None


async def send_stream(http: httpx.AsyncClient, tally: Tally, rng: random.Random, kind: str,
                      path: str, body: dict[str, Any], target: Target) -> None:
    # A hang-up closes the connection after a few events, while the request still runs.
    hang_up_after = rng.randint(1, 4) if kind == "hangup_stream" else None
    started = time.perf_counter()
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            tally.saw(text)
            return classify_status(tally, kind, response.status_code, text, bad=False)
        lines: list[str] = []
        events, first_token = 0, False
        async for line in response.aiter_lines():
            tally.saw(line)
            lines.append(line)
            if not line.startswith("data:"):
                continue
            if not first_token and carries_output(line):
                first_token = True
                tally.ttft_ms.setdefault(slo_label(target, body), []).append(
                    1000 * (time.perf_counter() - started))
            events += 1
            if hang_up_after is not None and events >= hang_up_after and "[DONE]" not in line:
                return tally.record(kind, "dropped_on_purpose")
    classify_stream(tally, kind, lines, bad=False)


async def send_body(http: httpx.AsyncClient, tally: Tally, rng: random.Random, kind: str,
                    path: str, body: dict[str, Any], target: Target) -> None:
    post = http.post(path, json=body)
    if kind == "hangup_wait":
        # A non-streaming client that gives up waiting: cancelling the request closes the
        # connection, which the server must notice and abort the request on.
        try:
            response = await asyncio.wait_for(post, timeout=rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            return tally.record(kind, "dropped_on_purpose")
    else:
        response = await post
    tally.saw(response.text)
    if response.status_code != 200:
        return classify_status(tally, kind, response.status_code, response.text, bad=False)
    classify_body(tally, kind, response.text, bad=False)


async def one_request(http: httpx.AsyncClient, tally: Tally, rng: random.Random, target: Target,
                      prompts: Prompts, max_tokens: int, timeout_s: float,
                      kind: str | None = None) -> None:
    """One request of `kind` (default: drawn from MIX)."""
    if kind is None:
        kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    tally.sent += 1
    started, shape = time.perf_counter(), ""
    try:
        if kind == "bad_input":
            coro = send_bad(http, tally, rng, target)
        else:
            path, body = good_request(rng, target, prompts, kind, max_tokens)
            text = body.get("prompt") or body["messages"][0]["content"]
            shape = (f"{len(text)} prompt chars, max_tokens {body['max_tokens']}, "
                     f"slo {body.get('ttft_slo_ms')}")
            send = send_stream if body["stream"] else send_body
            coro = send(http, tally, rng, kind, path, body, target)
        await asyncio.wait_for(coro, timeout=timeout_s)
    except asyncio.TimeoutError:
        tally.record(kind, "lost", f"no answer within {timeout_s:g} s")
    except httpx.HTTPError as exc:  # connection refused / reset, protocol errors
        tally.record(kind, "lost", f"{type(exc).__name__}", str(exc))
    tally.timed(time.perf_counter() - started, kind, shape)


async def client_loop(index: int, http: httpx.AsyncClient, tally: Tally, target: Target,
                      prompts: Prompts, args: argparse.Namespace, stop_at: float) -> None:
    rng = random.Random(f"{args.seed}-{index}")
    # The clients' first requests take the kinds in turn (client i's k-th: kind i + k x clients),
    # so that even a short soak exercises every kind once; then each draws from the mix.
    kinds = list(MIX)
    turn = index
    while time.monotonic() < stop_at and tally.sent < args.max_requests:
        kind = kinds[turn] if turn < len(kinds) else None
        turn += args.clients
        await one_request(http, tally, rng, target, prompts, args.max_tokens,
                          args.request_timeout_s, kind)


async def progress(tally: Tally, started: float, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        o = tally.outcomes
        print(f"[soak {time.monotonic() - started:6.1f} s] sent {tally.sent}  completed "
              f"{o['completed']}  dropped {o['dropped_on_purpose']}  rejected "
              f"{o['rejected_as_expected']}  lost {o['lost']}  5xx {tally.status_5xx}",
              file=sys.stderr, flush=True)


async def run_clients(target: Target, args: argparse.Namespace) -> tuple[Tally, float]:
    tally, prompts = Tally(), Prompts()
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=target.url, headers=target.headers, timeout=timeout,
                                 limits=limits) as http:
        ticker = asyncio.create_task(progress(tally, started, 10.0))
        try:
            await asyncio.gather(*(client_loop(i, http, tally, target, prompts, args,
                                               started + args.duration_s)
                                   for i in range(args.clients)))
        finally:
            ticker.cancel()
    return tally, time.monotonic() - started
