"""The OpenAI-compatible HTTP server, driven as a user would: a real `sloserve serve` subprocess
(API server process + EngineCore process) on a loopback port, the official `openai` client and
raw httpx.

Two servers are started in all: one module-scoped server (API key, served name, default TTFT
SLO, a 64 KiB body limit) that every test but one shares, and one that the SIGTERM test shuts down
in the middle of a stream. Both are stopped with SIGTERM and must exit cleanly, leaving no
processes behind.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.utils.server_helpers import (
    CHAT_TEMPLATE,
    ServerProcess,
    assert_clean_exit,
    collect_stream,
    copy_with_chat_template,
    descendants,
    sample,
    scrape,
    sse_data,
)

API_KEY = "sloserve-test-key"
MODEL_NAME = "tiny-chat-llama"
DEFAULT_SLO_MS = 4321.0
BODY_LIMIT = 65536
NUM_BLOCKS = 1024
BLOCK_SIZE = 16
# A context long enough that a request can outlive the 1 s disconnect window by far (the tiny
# model decodes a token in ~2 ms).
MAX_MODEL_LEN = 8192
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the capital of France?"}]


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory) -> str:
    """A copy of the tiny Llama with a chat template, so the server and the offline LLM both
    read the same template."""
    return copy_with_chat_template(tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN),
                                   tmp_path_factory.mktemp("server-model") / "tiny-chat")


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model=model_dir, dtype="float32")
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("logs") / "server.log",
                        "--served-model-name", MODEL_NAME,
                        "--default-ttft-slo-ms", str(DEFAULT_SLO_MS),
                        "--max-request-body-bytes", str(BODY_LIMIT),
                        "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                        api_key=API_KEY)
    try:
        yield srv
        took = srv.assert_clean_stop()
        assert took < 30
    finally:
        srv.kill()  # only if it is still running (a failed stop)


@pytest.fixture(scope="module")
def oai(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=60)
    yield client
    client.close()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as client:
        yield client


def token_prompt(llm, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, len(llm.tokenizer)) for _ in range(n)]


def check_metrics(metrics: dict, slo_ms: float) -> None:
    assert metrics["ttft_slo_ms"] == slo_ms
    assert metrics["ttft_ms"] > 0
    assert metrics["ttft_slo_met"] is (metrics["ttft_ms"] <= slo_ms)
    assert metrics["num_kv_preemptions"] == metrics["num_slo_preemptions"] == 0
    assert metrics["num_preemptions"] == 0  # deprecated: the sum of the two
    assert 0 <= metrics["queue_time_ms"] <= metrics["ttft_ms"]
    assert metrics["arrival_time"] < metrics["first_token_time"]
    assert abs(metrics["arrival_time"] - time.time()) < 120  # Unix time, not monotonic
    assert math.isclose((metrics["first_token_time"] - metrics["arrival_time"]) * 1000,
                        metrics["ttft_ms"], abs_tol=1.0)


# ---- model listing, version, health ---------------------------------------------------------

def test_models_version_health(server, oai, http):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    listing = http.get("/v1/models").json()
    assert listing["object"] == "list" and listing["data"][0]["id"] == MODEL_NAME
    assert listing["data"][0]["max_model_len"] == MAX_MODEL_LEN
    version = httpx.get(f"{server.url}/version")
    assert version.status_code == 200 and isinstance(version.json()["version"], str)
    assert httpx.get(f"{server.url}/health").status_code == 200
    stats = server.stats()
    assert stats["num_blocks"] == NUM_BLOCKS
    assert stats["num_free_blocks"] == NUM_BLOCKS  # before any request too


# ---- completions and chat equal the offline engine ------------------------------------------

def _case_params(llm, case: str, prompt: str) -> SamplingParams:
    if case == "greedy":
        return SamplingParams(temperature=0, max_tokens=12)
    if case == "seeded":
        return SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=12)
    assert case == "stop"
    (full,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                          stop=[_stop_across_tokens(llm, full.token_ids, full.text)])


def _stop_across_tokens(llm, token_ids: list[int], text: str) -> str:
    """A two-character stop string whose first character ends one token and whose second
    starts the next, so that a stream must hold the first back until the next token shows
    whether it is the start of the stop string."""
    for k in range(3, len(token_ids) - 1):
        cut = len(llm.tokenizer.decode(token_ids[:k], skip_special_tokens=True))
        stop = text[cut - 1:cut + 1]
        if (text[:cut] == llm.tokenizer.decode(token_ids[:k], skip_special_tokens=True)
                and len(stop) == 2 and not stop.isspace() and "\ufffd" not in stop
                and text.find(stop) == cut - 1):
            return stop
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


def _request_kwargs(params: SamplingParams) -> tuple[dict, dict]:
    kwargs = {"max_tokens": params.max_tokens, "temperature": params.temperature,
              "top_p": params.top_p}
    extra = {"top_k": params.top_k, "ignore_eos": params.ignore_eos}
    if params.seed is not None:
        kwargs["seed"] = params.seed
    if params.stop:
        kwargs["stop"] = params.stop
    return kwargs, extra


@pytest.mark.parametrize("case", ["greedy", "seeded", "stop"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_completion_equals_offline(oai, llm, case, stream):
    prompt = "The quick brown fox"
    params = _case_params(llm, case, prompt)
    (ref,) = llm.generate(prompt, params)
    kwargs, extra = _request_kwargs(params)
    slo = 60000.0
    if stream:
        chunks = list(oai.completions.create(
            model=MODEL_NAME, prompt=prompt, stream=True,
            stream_options={"include_usage": True}, extra_body={"ttft_slo_ms": slo, **extra},
            **kwargs))
        with_choices = [c for c in chunks if c.choices]
        text = "".join(c.choices[0].text for c in with_choices)
        finish_reason = with_choices[-1].choices[0].finish_reason
        assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
        metrics = with_choices[-1].model_extra["metrics"]
        assert all(not (c.model_extra or {}).get("metrics") for c in with_choices[:-1])
        assert not chunks[-1].choices, "the usage chunk comes last, with no choices"
        assert all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert len({c.id for c in chunks}) == 1
    else:
        resp = oai.completions.create(model=MODEL_NAME, prompt=prompt,
                                      extra_body={"ttft_slo_ms": slo, **extra}, **kwargs)
        assert resp.object == "text_completion" and resp.model == MODEL_NAME
        text, finish_reason = resp.choices[0].text, resp.choices[0].finish_reason
        metrics, usage = resp.model_extra["metrics"], resp.usage
    assert text == ref.text
    assert finish_reason == ref.finish_reason
    if case == "stop":
        assert finish_reason == "stop" and len(ref.token_ids) < params.max_tokens
    assert usage.prompt_tokens == len(ref.prompt_token_ids) == len(llm.tokenizer.encode(prompt))
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    check_metrics(metrics, slo)
    assert metrics["ttft_slo_met"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_chat_equals_offline(oai, llm, stream):
    params = SamplingParams(temperature=0, max_tokens=12)
    (ref,) = llm.chat(MESSAGES, params)
    slo = 30000.0
    if stream:
        chunks = list(oai.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ttft_slo_ms": slo}))
        with_choices = [c for c in chunks if c.choices]
        assert with_choices[0].choices[0].delta.role == "assistant"
        assert chunks[0].object == "chat.completion.chunk"
        text = "".join(c.choices[0].delta.content or "" for c in with_choices)
        finish_reason = with_choices[-1].choices[0].finish_reason
        metrics = with_choices[-1].model_extra["metrics"]
        assert not chunks[-1].choices
        usage = chunks[-1].usage
    else:
        resp = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12,
                                           temperature=0, extra_body={"ttft_slo_ms": slo})
        assert resp.object == "chat.completion"
        assert resp.choices[0].message.role == "assistant"
        text, finish_reason = resp.choices[0].message.content, resp.choices[0].finish_reason
        metrics, usage = resp.model_extra["metrics"], resp.usage
    assert text == ref.text
    assert finish_reason == ref.finish_reason
    assert usage.prompt_tokens == len(llm.apply_chat_template(MESSAGES))
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    check_metrics(metrics, slo)


def test_chat_max_completion_tokens_and_header_slo(oai, llm):
    (ref,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    resp = oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                       max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True},
                                       extra_headers={"X-SLO-TTFT-MS": "777"})
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
    check_metrics(resp.model_extra["metrics"], 777.0)


def test_completion_with_token_ids_prompt(http, llm):
    ids = token_prompt(llm, 20, seed=3)
    (ref,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))
    body = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": ids,
                                              "max_tokens": 6, "temperature": 0}).json()
    assert body["choices"][0]["text"] == ref.text
    assert body["usage"]["prompt_tokens"] == 20


# ---- where the TTFT SLO comes from ----------------------------------------------------------

@pytest.mark.parametrize("body_slo,header_slo,expected", [
    (None, "250", 250.0),            # the header, when the body has none
    (123.5, "250", 123.5),           # the body wins over the header
    (0, "250", 0.0),                 # ... even when it is 0
    (None, None, DEFAULT_SLO_MS),    # --default-ttft-slo-ms when neither
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_slo_body_header_default(http, route, body_slo, header_slo, expected):
    body: dict = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
    if route == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "Deadlines matter"
    if body_slo is not None:
        body["ttft_slo_ms"] = body_slo
    headers = {"X-SLO-TTFT-MS": header_slo} if header_slo is not None else {}
    response = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                         json=body, headers=headers)
    assert response.status_code == 200, response.text
    check_metrics(response.json()["metrics"], expected)


def test_slo_header_on_stream(http):
    body = {"prompt": "Deadlines matter", "max_tokens": 3, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"x-slo-ttft-ms": "60000"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        result = collect_stream(sse_data(response.iter_lines()))
    assert result["done"] and result["error"] is None and result["usage"] is None
    check_metrics(result["metrics"], 60000.0)


def test_gateway_metrics_under_vllm_names_agree_with_the_projects(server, http):
    """llm-d's endpoint picker and vLLM's dashboards read vLLM's names: the queue gauges, the
    KV usage (0..1) and the TTFT / TPOT histograms (vLLM's buckets), fed by the same
    observations as the project's own names (the client-side stamps)."""
    body = {"prompt": "Deadlines matter", "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"x-slo-tpot-ms": "60000"}) as response:
        assert response.status_code == 200
        result = collect_stream(sse_data(response.iter_lines()))
    assert result["done"] and result["error"] is None
    families, samples = scrape(server.url)
    name = {"model_name": MODEL_NAME}
    for gauge in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert families[f"vllm:{gauge}"] == "gauge"
        assert sample(samples, f"vllm:{gauge}", **name) == sample(samples, f"sloserve:{gauge}",
                                                                  **name)
    assert sample(samples, "vllm:num_requests_waiting", **name) >= 0
    assert 0 <= sample(samples, "vllm:kv_cache_usage_perc", **name) <= 1
    for histogram, top in (("time_to_first_token_seconds", "2560.0"),
                           ("time_per_output_token_seconds", "80.0")):
        assert families[f"vllm:{histogram}"] == "histogram"
        count = sample(samples, f"vllm:{histogram}_count", **name)
        assert count >= 1
        assert count == sample(samples, f"sloserve:{histogram}_count", **name)
        assert sample(samples, f"vllm:{histogram}_sum", **name) == pytest.approx(
            sample(samples, f"sloserve:{histogram}_sum", **name))
        assert sample(samples, f"vllm:{histogram}_bucket", le=top, **name) == count
    # This stream's TTFT is among them: the one in its `metrics`, to the client's clock.
    assert 0 < result["metrics"]["ttft_ms"] / 1000 <= sample(
        samples, "vllm:time_to_first_token_seconds_sum", **name)


# ---- many concurrent streams ----------------------------------------------------------------

N_CONCURRENT = 32
CONCURRENT_MAX_TOKENS = 16


def test_concurrent_streams_complete_and_free_every_block(server, llm):
    prompts = [f"Request {i}: the quick brown fox" + " jumps" * (i % 5) for i in range(N_CONCURRENT)]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=CONCURRENT_MAX_TOKENS,
                                                ignore_eos=True))

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": CONCURRENT_MAX_TOKENS,
                "temperature": 0, "ignore_eos": True, "stream": True, "priority": i % 3,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
        return collect_stream(sse_data(lines))

    async def run() -> tuple[list[dict], int]:
        limits = httpx.Limits(max_connections=N_CONCURRENT + 4)
        async with httpx.AsyncClient(base_url=server.url, headers=server.auth, timeout=120,
                                     limits=limits) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(N_CONCURRENT)]
            peak = 0
            while not all(t.done() for t in tasks):  # probe: the requests overlap in the core
                stats = (await client.get("/debug/stats")).json()
                peak = max(peak, stats["num_running"] + stats["num_waiting"])
                await asyncio.sleep(0.01)
            return [t.result() for t in tasks], peak

    results, peak = asyncio.run(run())
    assert peak > 1, "the streams should have been in the engine at the same time"
    for result, ref in zip(results, refs):
        assert result["done"] and result["error"] is None
        assert result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == CONCURRENT_MAX_TOKENS
        assert result["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        assert result["text"] == ref.text
        assert result["metrics"]["ttft_slo_ms"] == DEFAULT_SLO_MS
    stats, _ = server.wait_all_blocks_free(timeout=5.0)
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_BLOCKS, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


# ---- a client that goes away ----------------------------------------------------------------

VICTIM_PROMPT_LEN = 1600  # 100 blocks of 16
VICTIM_MAX_TOKENS = 6000  # ~10 s of decoding if nobody stopped it
VICTIM_BLOCKS = math.ceil(VICTIM_PROMPT_LEN / BLOCK_SIZE)


def _victim_body(llm, seed: int, stream: bool) -> dict:
    return {"model": MODEL_NAME, "prompt": token_prompt(llm, VICTIM_PROMPT_LEN, seed=seed),
            "max_tokens": VICTIM_MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _wait_used_blocks(server, at_least: int, running: int, timeout: float = 10.0) -> dict:
    """Probe: polls /debug/stats until `at_least` blocks are in use by `running` requests."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        used = stats["num_blocks"] - stats["num_free_blocks"]
        if (used >= at_least and stats["num_running"] == running) or time.monotonic() > deadline:
            assert used >= at_least and stats["num_running"] == running, stats
            return stats
        time.sleep(0.01)


def _success_and_tokens(server) -> tuple[float, float]:
    _, samples = scrape(server.url)
    return (sample(samples, "sloserve:request_success_total"),
            sample(samples, "sloserve:generation_tokens_total"))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "full"])
def test_disconnect_aborts_and_frees_blocks_within_a_second(server, llm, stream):
    server.wait_all_blocks_free()
    success_before, tokens_before = _success_and_tokens(server)
    body = json.dumps(_victim_body(llm, seed=11 + stream, stream=stream)).encode()
    # A raw socket, so that "the client goes away" is exactly one close().
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    if stream:
        # The response has started; time the tokens for a while as a probe that the request
        # could not finish by itself within the 1 s window checked below.
        sock.settimeout(10)
        received = sock.recv(65536)
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        start, events_at_start = time.monotonic(), received.count(b"data: ")
        while time.monotonic() - start < 0.2:
            received += sock.recv(65536)
        seconds_per_token = ((time.monotonic() - start)
                             / max(1, received.count(b"data: ") - events_at_start))
        assert seconds_per_token * VICTIM_MAX_TOKENS > 3.0, \
            "probe: the victim request would finish too soon for this test to mean anything"
    _wait_used_blocks(server, VICTIM_BLOCKS, running=1)
    sock.close()
    stats, took = server.wait_all_blocks_free(timeout=1.0)
    assert stats["num_free_blocks"] == stats["num_blocks"], f"not freed within 1 s: {stats}"
    assert took <= 1.0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    # An aborted request is no success; the tokens it got before count as generated.
    success_after, tokens_after = _success_and_tokens(server)
    assert success_after == success_before
    assert 0 < tokens_after - tokens_before < VICTIM_MAX_TOKENS


def test_disconnect_mid_stream_leaves_other_stream_unaffected(server, llm):
    server.wait_all_blocks_free()
    other_prompt, other_max = "Paris is the capital of France", 1000
    (ref,) = llm.generate(other_prompt, SamplingParams(temperature=0, max_tokens=other_max,
                                                       ignore_eos=True))
    other_blocks = math.ceil((len(ref.prompt_token_ids) + other_max) / BLOCK_SIZE)
    assert other_blocks < VICTIM_BLOCKS
    result: dict = {}
    first_token = threading.Event()

    def other_stream() -> None:
        body = {"model": MODEL_NAME, "prompt": other_prompt, "max_tokens": other_max,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        try:
            with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as client, \
                    client.stream("POST", "/v1/completions", json=body) as response:
                for event in sse_data(response.iter_lines()):
                    events.append(event)
                    first_token.set()
        finally:
            result.update(collect_stream(events))
            first_token.set()

    thread = threading.Thread(target=other_stream)
    thread.start()
    try:
        assert first_token.wait(30)
        victim = _victim_body(llm, seed=13, stream=True)
        with httpx.Client(base_url=server.url, headers=server.auth, timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=victim) as response:
            assert response.status_code == 200
            # Keep the iterator referenced: a closed (garbage) iterator closes the connection.
            events = sse_data(response.iter_lines())
            first = next(events)
            assert first != "[DONE]" and "error" not in first
            _wait_used_blocks(server, VICTIM_BLOCKS + 1, running=2)
        closed = time.monotonic()  # leaving the `with` closed the connection mid-stream
        assert thread.is_alive(), "the other stream should still be running (probe)"
        while True:
            stats = server.stats()
            used = stats["num_blocks"] - stats["num_free_blocks"]
            if (stats["num_running"] <= 1 and used <= other_blocks) \
                    or time.monotonic() - closed > 1.0:
                break
            time.sleep(0.01)
        assert stats["num_running"] <= 1 and used <= other_blocks, \
            f"the victim's blocks were not freed within 1 s: {stats}"
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert result["done"] and result["error"] is None
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == other_max
    assert result["text"] == ref.text
    stats, _ = server.wait_all_blocks_free()
    assert stats["num_free_blocks"] == NUM_BLOCKS


# ---- bad input ------------------------------------------------------------------------------

C, CH = "/v1/completions", "/v1/chat/completions"
LONG_TEXT = "fox " * (MAX_MODEL_LEN + 100)  # more tokens than max_model_len, fewer bytes
assert len(LONG_TEXT) < BODY_LIMIT  # than the body limit


def _prompt(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **kw}


def _chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **kw}


def _raw(data: bytes) -> dict:
    return {"content": data, "headers": {"Content-Type": "application/json"}}


def _json(body: dict) -> dict:
    """A JSON body with NaN / Infinity tokens (httpx's json= refuses to write them)."""
    return _raw(json.dumps(body, allow_nan=True).encode())


def _chunked(size: int) -> dict:
    """A body sent with Transfer-Encoding: chunked (no Content-Length to refuse it by)."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(size // 1024):
            yield b"a" * 1024
        yield b'", "max_tokens": 2}'
    return {"content": chunks(), "headers": {"Content-Type": "application/json"}}


# (id, path, request kwargs (a callable: some are one-shot generators), auth, status, param)
BAD_INPUTS = [
    ("malformed-json", C, lambda: _raw(b'{"prompt": "Hello", "max_tokens": '), "key", 400, None),
    ("malformed-json-chat", CH, lambda: _raw(b'{"messages": [}'), "key", 400, None),
    ("not-an-object", C, lambda: {"json": ["Hello"]}, "key", 400, None),
    ("missing-prompt", C, lambda: {"json": {"max_tokens": 2}}, "key", 400, "prompt"),
    ("missing-messages", CH, lambda: {"json": {"max_tokens": 2}}, "key", 400, "messages"),
    ("empty-messages", CH, lambda: {"json": _chat(messages=[])}, "key", 400, "messages"),
    ("messages-not-a-list", CH, lambda: {"json": _chat(messages="hi")}, "key", 400, "messages"),
    ("unknown-role", CH, lambda: {"json": _chat(messages=[{"role": "wizard", "content": "x"}])},
     "key", 400, None),
    ("image-content-part", CH, lambda: {"json": _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])}, "key", 400,
     "messages"),
    ("max-tokens-string", C, lambda: {"json": _prompt(max_tokens="abc")}, "key", 400,
     "max_tokens"),
    ("max-tokens-string-chat", CH, lambda: {"json": _chat(max_tokens="abc")}, "key", 400,
     "max_tokens"),
    ("temperature-string", C, lambda: {"json": _prompt(temperature="hot")}, "key", 400,
     "temperature"),
    ("temperature-string-chat", CH, lambda: {"json": _chat(temperature="hot")}, "key", 400,
     "temperature"),
    ("stop-not-a-string", C, lambda: {"json": _prompt(stop=5)}, "key", 400, None),
    ("max-tokens-zero", C, lambda: {"json": _prompt(max_tokens=0)}, "key", 400, None),
    ("max-tokens-negative", C, lambda: {"json": _prompt(max_tokens=-3)}, "key", 400, None),
    ("max-tokens-zero-stream", C, lambda: {"json": _prompt(max_tokens=0, stream=True)}, "key",
     400, None),
    ("max-tokens-zero-chat", CH, lambda: {"json": _chat(max_tokens=0)}, "key", 400, None),
    ("max-tokens-negative-chat", CH, lambda: {"json": _chat(max_tokens=-1)}, "key", 400, None),
    ("max-completion-tokens-zero", CH,
     lambda: {"json": {"messages": MESSAGES, "max_completion_tokens": 0}}, "key", 400, None),
    ("temperature-negative", C, lambda: {"json": _prompt(temperature=-1)}, "key", 400, None),
    ("top-p-zero", C, lambda: {"json": _prompt(top_p=0)}, "key", 400, None),
    ("n-zero", C, lambda: {"json": _prompt(n=0)}, "key", 400, None),
    ("empty-prompt", C, lambda: {"json": _prompt(prompt="")}, "key", 400, None),
    ("prompt-over-max-model-len", C, lambda: {"json": _prompt(prompt=LONG_TEXT)}, "key", 400,
     None),
    ("token-prompt-over-max-model-len", C,
     lambda: {"json": _prompt(prompt=[5] * (MAX_MODEL_LEN + 1))}, "key", 400, None),
    ("token-outside-vocab", C, lambda: {"json": _prompt(prompt=[1, 2, 10**6])}, "key", 400,
     None),
    ("chat-over-max-model-len", CH,
     lambda: {"json": _chat(messages=[{"role": "user", "content": LONG_TEXT}])}, "key", 400,
     None),
    ("slo-negative", C, lambda: {"json": _prompt(ttft_slo_ms=-1)}, "key", 400, "ttft_slo_ms"),
    ("slo-not-a-number", C, lambda: {"json": _prompt(ttft_slo_ms="soon")}, "key", 400,
     "ttft_slo_ms"),
    ("slo-nan", C, lambda: _raw(b'{"prompt": "Hello", "max_tokens": 2, "ttft_slo_ms": NaN}'),
     "key", 400, "ttft_slo_ms"),
    ("slo-negative-chat", CH, lambda: {"json": _chat(ttft_slo_ms=-0.5)}, "key", 400,
     "ttft_slo_ms"),
    ("slo-header-negative", C, lambda: {"json": _prompt(), "headers": {"X-SLO-TTFT-MS": "-5"}},
     "key", 400, "x-slo-ttft-ms"),
    ("slo-header-not-a-number", C,
     lambda: {"json": _prompt(), "headers": {"X-SLO-TTFT-MS": "soon"}}, "key", 400,
     "x-slo-ttft-ms"),
    ("slo-header-nan", C, lambda: {"json": _prompt(), "headers": {"X-SLO-TTFT-MS": "nan"}},
     "key", 400, "x-slo-ttft-ms"),
    ("slo-header-inf", C, lambda: {"json": _prompt(), "headers": {"X-SLO-TTFT-MS": "inf"}},
     "key", 400, "x-slo-ttft-ms"),
    ("slo-header-chat", CH, lambda: {"json": _chat(), "headers": {"X-SLO-TTFT-MS": "abc"}},
     "key", 400, "x-slo-ttft-ms"),
    # JSON parsers accept NaN / Infinity (and 1e999 overflows to inf); every float
    # field refuses them, naming the field.
    ("temperature-nan", C, lambda: _json(_prompt(temperature=math.nan)), "key", 400,
     "temperature"),
    ("temperature-nan-chat", CH, lambda: _json(_chat(temperature=math.nan)), "key", 400,
     "temperature"),
    ("temperature-minus-infinity", C, lambda: _json(_prompt(temperature=-math.inf)), "key",
     400, "temperature"),
    ("top-p-infinity", C, lambda: _json(_prompt(top_p=math.inf)), "key", 400, "top_p"),
    ("top-p-nan-stream", C, lambda: _json(_prompt(top_p=math.nan, stream=True)), "key", 400,
     "top_p"),
    ("slo-1e999", C, lambda: _raw(b'{"prompt": "Hello", "max_tokens": 2, "ttft_slo_ms": 1e999}'),
     "key", 400, "ttft_slo_ms"),
    # Integers a signed 64-bit int cannot hold, wherever they are.
    ("seed-2**64", C, lambda: {"json": _prompt(seed=2**64)}, "key", 400, "seed"),
    ("seed-minus-2**70-chat", CH, lambda: {"json": _chat(seed=-2**70)}, "key", 400, "seed"),
    ("priority-2**63", C, lambda: {"json": _prompt(priority=2**63)}, "key", 400, "priority"),
    ("top-k-2**64", C, lambda: {"json": _prompt(top_k=2**64)}, "key", 400, "top_k"),
    ("max-tokens-2**64", C, lambda: {"json": _prompt(max_tokens=2**64)}, "key", 400,
     "max_tokens"),
    ("max-completion-tokens-2**64", CH,
     lambda: {"json": {"messages": MESSAGES, "max_completion_tokens": 2**64}}, "key", 400,
     "max_completion_tokens"),
    # A completion that cannot fit beside the prompt (vLLM's message).
    ("max-tokens-beyond-context", C, lambda: {"json": _prompt(max_tokens=2**62)}, "key", 400,
     "max_tokens"),
    ("max-tokens-beyond-context-stream", C,
     lambda: {"json": _prompt(max_tokens=MAX_MODEL_LEN, stream=True)}, "key", 400,
     "max_tokens"),
    ("max-tokens-beyond-context-chat", CH, lambda: {"json": _chat(max_tokens=MAX_MODEL_LEN)},
     "key", 400, "max_tokens"),
    ("max-completion-tokens-beyond-context", CH,
     lambda: {"json": {"messages": MESSAGES, "max_completion_tokens": 2**62}}, "key", 400,
     "max_completion_tokens"),
    ("token-id-2**64", C, lambda: {"json": _prompt(prompt=[1, 2**64])}, "key", 400, "prompt"),
    ("token-id-minus-2**70", C, lambda: {"json": _prompt(prompt=[-2**70])}, "key", 400,
     "prompt"),
    # A field of several types: the error names the type that got deepest into the value
    # (before: "prompt.str: Input should be a valid string" for a list with a null).
    ("token-id-null", C, lambda: {"json": _prompt(prompt=[1, 2, None])}, "key", 400,
     "prompt.list[int].2"),
    ("stop-token-id-2**64-stream", C,
     lambda: {"json": _prompt(stop_token_ids=[2**64], stream=True)}, "key", 400,
     "stop_token_ids"),
    # A lone surrogate (JSON's \ud800 escape) is not text: no tokenizer or UTF-8 encoder takes it.
    ("prompt-lone-surrogate", C, lambda: _json(_prompt(prompt="a\ud800b")), "key", 400,
     "prompt"),
    ("content-lone-surrogate-chat", CH,
     lambda: _json(_chat(messages=[{"role": "user", "content": "\udfff"}])), "key", 400,
     "messages.0.content"),
    ("model-lone-surrogate", C, lambda: _json(_prompt(model="\ud800")), "key", 400, "model"),
    ("unknown-model", C, lambda: {"json": _prompt(model="gpt-4o")}, "key", 404, "model"),
    ("unknown-model-chat", CH, lambda: {"json": _chat(model="gpt-4o")}, "key", 404, "model"),
    ("oversize-body", C, lambda: {"json": _prompt(prompt="a" * (BODY_LIMIT + 100))}, "key",
     413, None),
    ("oversize-chat-body", CH, lambda: {"json": _chat(messages=[
        {"role": "user", "content": "a" * BODY_LIMIT}])}, "key", 413, None),
    ("oversize-chunked-body", C, lambda: _chunked(BODY_LIMIT + 4096), "key", 413, None),
    ("missing-api-key", C, lambda: {"json": _prompt()}, None, 401, None),
    ("wrong-api-key", C, lambda: {"json": _prompt()}, "wrong", 401, None),
    ("missing-api-key-chat", CH, lambda: {"json": _chat()}, None, 401, None),
    ("wrong-api-key-chat", CH, lambda: {"json": _chat()}, "wrong", 401, None),
]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    return error


@pytest.mark.parametrize("name,path,make,auth,status,param", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, name, path, make, auth,
                                                              status, param):
    request = make()
    headers = dict(request.pop("headers", {}))
    if auth == "key":
        headers["Authorization"] = f"Bearer {API_KEY}"
    elif auth == "wrong":
        headers["Authorization"] = "Bearer not-the-key"
    response = httpx.post(f"{server.url}{path}", headers=headers, timeout=30, **request)
    error = assert_openai_error(response, status)
    if param is not None:
        assert error["param"] == param, error
    # Still serving, and nothing was left behind in the engine.
    ok = httpx.post(f"{server.url}{C}", headers=server.auth, timeout=30,
                    json=_prompt(max_tokens=3, ignore_eos=True))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 3
    stats, _ = server.wait_all_blocks_free()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_api_key_guards_v1_only(server):
    for path in ("/health", "/metrics", "/version", "/debug/stats"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    assert_openai_error(httpx.get(f"{server.url}/v1/models"), 401)
    assert_openai_error(httpx.get(f"{server.url}/v1/models",
                                  headers={"Authorization": "Bearer nope"}), 401)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)


def test_openai_client_sees_errors(oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="gpt-4o", prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                               extra_body={"ttft_slo_ms": -1})
    assert info.value.body["param"] == "ttft_slo_ms"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=0)


# ---- Prometheus metrics ---------------------------------------------------------------------

METRIC_FAMILIES = {
    "sloserve:num_requests_running": "gauge",
    "sloserve:num_requests_waiting": "gauge",
    "sloserve:kv_cache_usage_perc": "gauge",
    "sloserve:prefix_cache_queries": "counter",
    "sloserve:prefix_cache_hits": "counter",
    "sloserve:num_kv_preemptions": "counter",
    "sloserve:num_slo_preemptions": "counter",
    "sloserve:slo_preempt_wasted_tokens": "counter",
    "sloserve:slo_preempt_wasted_layers": "counter",
    "sloserve:slo_preempt_latency_seconds": "histogram",
    # Deprecated names, still served for one release (README.md, "Deprecated names").
    "sloserve:num_preemptions": "counter",
    "sloserve:preempt_wasted_tokens": "counter",
    "sloserve:preempt_wasted_layers": "counter",
    "sloserve:preempt_latency_seconds": "histogram",
    "sloserve:prompt_tokens": "counter",
    "sloserve:generation_tokens": "counter",
    "sloserve:request_success": "counter",
    "sloserve:time_to_first_token_seconds": "histogram",
    "sloserve:inter_token_latency_seconds": "histogram",
    "sloserve:e2e_request_latency_seconds": "histogram",
    "sloserve:request_queue_time_seconds": "histogram",
    "sloserve:ttft_slo_met": "counter",
    "sloserve:ttft_slo_missed": "counter",
}


def test_metrics_parse_and_move(server, http, llm):
    families, before = scrape(server.url)  # no API key needed
    for name, kind in METRIC_FAMILIES.items():
        assert families.get(name) == kind, (name, families.get(name))
    max_tokens = 8
    ids = token_prompt(llm, 40, seed=21)  # two full blocks: the repeat hits the prefix cache
    missed = http.post(C, json=_prompt(prompt=ids, max_tokens=max_tokens, ignore_eos=True,
                                       ttft_slo_ms=0)).json()  # impossible: 0 ms
    assert missed["metrics"]["ttft_slo_met"] is False
    met = http.post(C, json=_prompt(prompt=ids, max_tokens=max_tokens, ignore_eos=True,
                                    ttft_slo_ms=600000)).json()
    assert met["metrics"]["ttft_slo_met"] is True
    with http.stream("POST", CH, json=_chat(max_tokens=max_tokens, ignore_eos=True, stream=True,
                                            stream_options={"include_usage": True}),
                     headers={"X-SLO-TTFT-MS": "600000"}) as response:
        streamed = collect_stream(sse_data(response.iter_lines()))
    assert streamed["metrics"]["ttft_slo_met"] is True
    _, after = scrape(server.url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    prompt_tokens = (missed["usage"]["prompt_tokens"] + met["usage"]["prompt_tokens"]
                     + streamed["usage"]["prompt_tokens"])
    assert delta("sloserve:request_success_total", finished_reason="length") == 3
    assert delta("sloserve:request_success_total") == 3
    assert delta("sloserve:generation_tokens_total") == 3 * max_tokens
    assert delta("sloserve:prompt_tokens_total") == prompt_tokens
    assert delta("sloserve:ttft_slo_met_total") == 2
    assert delta("sloserve:ttft_slo_missed_total") == 1
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"):
        assert delta(f"sloserve:{histogram}_count") == 3, histogram
        assert delta(f"sloserve:{histogram}_bucket", le="+Inf") == 3, histogram
    assert delta("sloserve:time_to_first_token_seconds_sum") > 0
    assert delta("sloserve:e2e_request_latency_seconds_sum") > 0
    assert delta("sloserve:inter_token_latency_seconds_count") == 3 * (max_tokens - 1)
    assert delta("sloserve:prefix_cache_queries_total") >= prompt_tokens
    assert delta("sloserve:prefix_cache_hits_total") >= 32
    # Gauges after the last request finished; every sample carries the served model name.
    assert sample(after, "sloserve:num_requests_running") == 0
    assert sample(after, "sloserve:num_requests_waiting") == 0
    assert sample(after, "sloserve:kv_cache_usage_perc") == 0
    assert any(n == "sloserve:num_kv_preemptions_total" for n, labels in after)
    assert any(n == "sloserve:num_preemptions_total" and ("reason", "kv") in labels
               for n, labels in after)  # deprecated
    for (name, labels) in after:
        if name.startswith("sloserve:"):
            assert ("model_name", MODEL_NAME) in labels, (name, labels)


# ---- shutdown with a stream in flight (its own server) --------------------------------------

def test_sigterm_ends_inflight_stream_with_error_and_exits_clean(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--served-model-name", MODEL_NAME)
    try:
        streamed: dict = {}
        full: dict = {}
        first_token = threading.Event()

        def stream() -> None:
            events: list = []
            body = _chat(max_tokens=MAX_MODEL_LEN - 64, ignore_eos=True, stream=True,
                         stream_options={"include_usage": True})
            try:
                with httpx.Client(base_url=srv.url, timeout=40) as client, \
                        client.stream("POST", CH, json=body) as response:
                    streamed["status"] = response.status_code
                    for event in sse_data(response.iter_lines()):
                        events.append(event)
                        if isinstance(event, dict) and event.get("choices") and \
                                event["choices"][0]["delta"].get("content"):
                            first_token.set()
            except Exception as exc:  # noqa: BLE001 - reported below
                streamed["exception"] = repr(exc)
            finally:
                streamed.update(collect_stream(events))
                first_token.set()

        def non_streaming() -> None:
            try:
                response = httpx.post(f"{srv.url}{C}", timeout=40,
                                      json=_prompt(max_tokens=MAX_MODEL_LEN - 64,
                                                   ignore_eos=True))
                full["response"] = response
            except Exception as exc:  # noqa: BLE001 - reported below
                full["exception"] = repr(exc)

        threads = [threading.Thread(target=stream), threading.Thread(target=non_streaming)]
        threads[0].start()
        assert first_token.wait(30)
        threads[1].start()
        _wait_used_blocks(srv, 2, running=2)  # probe: both requests are in the engine
        assert descendants(srv.pid), "EngineCore should be a child process of the server"
        code, took, left = srv.stop(timeout=30)
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a client hung after the server exited"
    finally:
        srv.kill()
    assert_clean_exit(code, srv.log(tail=100_000))
    assert took < 30
    assert not left, f"processes left behind: {left}"
    # The stream ended with an error event (and [DONE]), not by hanging or a cut connection.
    assert "exception" not in streamed, streamed
    assert streamed["status"] == 200
    assert streamed["error"] is not None, streamed
    assert streamed["error"]["code"] == 503 and "shutting down" in streamed["error"]["message"]
    assert streamed["done"] and streamed["finish_reason"] is None
    # The non-streaming request in flight got an error answer too.
    assert "exception" not in full, full
    assert_openai_error(full["response"], 503)


def test_unknown_route_and_method_answer_in_openai_shape(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here", headers=server.auth), 404)
    assert_openai_error(httpx.get(f"{server.url}{C}", headers=server.auth), 405)
    headers = {**server.auth, "Content-Type": "application/json"}
    error = assert_openai_error(httpx.post(f"{server.url}{C}", headers=headers,
                                           content=b'{"prompt": '), 400)
    assert "malformed JSON" in error["message"] and error["param"] is None
