"""`--max-num-queued-reqs` and `--max-num-queued-tokens` (engine.serving.admission): a flood
past the bound gets 429s with Retry-After and an OpenAI error body (the SDK's RateLimitError),
never a 5xx; every request let in completes; the rejection counters count each 429 by reason;
the ledger holds nothing once the flood is over (streams, refused requests, a source closed
before it started); and the bound counts n samples as n and a prompt's tokens until its first
output."""

from __future__ import annotations

import asyncio
import re

import pytest

from engine.serving.admission import (QUEUED_REQUESTS, QUEUED_TOKENS, AdmissionLedger,
                                      QueueBounds, QueueFull)
from engine.serving.api_server import ServerSettings
from tests.utils.inprocess_server import app_client


def test_the_ledger_counts_requests_samples_and_prompt_tokens() -> None:
    rejected: list[str] = []
    ledger = AdmissionLedger(QueueBounds(max_requests=3, max_tokens=100),
                             on_reject=rejected.append)
    ledger.admit(["a"], [60])
    # n = 2 counts twice; its prompt once (the second sample shares the prefill).
    with pytest.raises(QueueFull, match=r"100 \(--max-num-queued-tokens\)"):
        ledger.admit(["b-0", "b-1"], [50, 0])
    assert (ledger.num_requests, ledger.queued_tokens) == (1, 60)  # nothing held by a refusal
    ledger.prefilled("a")  # its first output: its prompt no longer waits
    ledger.admit(["b-0", "b-1"], [50, 0])
    with pytest.raises(QueueFull, match=r"holds 3 requests .* bound of 3"):
        ledger.admit(["c"], [1])
    assert rejected == [QUEUED_TOKENS, QUEUED_REQUESTS]
    for request_id in ("a", "b-0", "b-1", "b-1"):  # released twice: once counts
        ledger.release(request_id)
    assert (ledger.num_requests, ledger.queued_tokens) == (0, 0)
    # Alone, a prompt over the token bound is taken: an idle server would serve it.
    ledger.admit(["long"], [500])
    with pytest.raises(ValueError, match="--max-num-queued-reqs must be >= 1, got 0"):
        QueueBounds(max_requests=0)


def test_a_place_reserved_on_arrival_counts_until_admitted_or_given_back() -> None:
    """The request bound is checked on arrival, before any tokenizing: reserved places count
    as held ones, admission moves a place into the ledger, and a place given back (the request
    failed before admission) frees it."""
    rejected: list[str] = []
    ledger = AdmissionLedger(QueueBounds(max_requests=3), on_reject=rejected.append)
    ledger.admit(["a"], [10])
    place = ledger.reserve(2)  # a completion of two samples, still being tokenized
    with pytest.raises(QueueFull, match=r"holds 3 requests .* adds 1: over its bound of 3"):
        ledger.reserve(1)
    ledger.admit(["b-0", "b-1"], [5, 0], place)
    assert (ledger.num_requests, ledger.reserved) == (3, 0)
    place.release()  # given back again on the way out: once counts
    assert ledger.reserved == 0
    ledger.release("a")
    failed = ledger.reserve(1)
    failed.release()  # its template failed: a 400, nothing held
    assert (ledger.num_requests, ledger.reserved, rejected) == (2, 0, [QUEUED_REQUESTS])


def test_a_source_closed_before_it_started_is_released() -> None:
    """A client gone before its response began: the engine request was never read, and closing
    its source (what the response's cleanup does) gives its place back and closes the engine
    request's stream (which aborts it in the core)."""
    class NeverRead:
        closed = False

        def close(self) -> None:
            self.closed = True

    async def run() -> tuple[int, int, bool]:
        ledger = AdmissionLedger(QueueBounds(max_requests=2))
        ledger.admit(["a"], [10])
        held = ledger.num_requests
        stream = NeverRead()
        await ledger.track("a", stream).aclose()  # type: ignore[arg-type]
        return held, ledger.num_requests, stream.closed

    assert asyncio.run(run()) == (1, 0, True)


def _completion(stream: bool = False, max_tokens: int = 24) -> dict:
    return {"model": "tiny", "prompt": "Count to ten:", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


async def _flood(http, count: int, **body) -> list:
    return await asyncio.gather(*(http.post("/v1/completions", json=_completion(**body))
                                  for _ in range(count)))


def _counter(text: str, name: str, reason: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_flood_past_the_bound_gets_429s_and_every_admitted_request_completes(tiny_model):
    import openai

    model = tiny_model("llama")

    async def run():
        settings = ServerSettings(served_model_name="tiny", queue_bounds=QueueBounds(3))
        async with app_client(model, settings, num_kv_blocks=64) as (http, _):
            plain = await _flood(http, 8)
            streamed = await _flood(http, 8, stream=True)
            sdk = openai.AsyncOpenAI(base_url="http://sloserve/v1", api_key="none",
                                     http_client=http, max_retries=0)
            through_sdk = await asyncio.gather(*(sdk.completions.create(
                model="tiny", prompt="hi", max_tokens=24, extra_body={"ignore_eos": True})
                for _ in range(6)), return_exceptions=True)
            metrics = (await http.get("/metrics")).text
            after = await _flood(http, 3)  # the flood is over: nothing is held
            return plain, streamed, through_sdk, metrics, after

    plain, streamed, through_sdk, metrics, after = asyncio.run(run())
    responses = plain + streamed
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 3
    for response in plain:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 24
    for response in streamed:
        if response.status_code == 200:
            assert response.text.rstrip().endswith("data: [DONE]")
    refused = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" for r in refused)
    # The reason, for a gateway (a fleet's ingress tries such a 429 on another replica).
    assert all(r.headers["x-sloserve-rejected"] == QUEUED_REQUESTS for r in refused)
    error = refused[0].json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert "--max-num-queued-reqs" in error["message"]
    # The openai SDK sees a RateLimitError (no retries here), the others their completions.
    sdk_refused = [r for r in through_sdk if isinstance(r, Exception)]
    assert sdk_refused and all(isinstance(r, openai.RateLimitError) for r in sdk_refused)
    served = [r for r in through_sdk if not isinstance(r, Exception)]
    assert served and all(r.choices[0].finish_reason == "length" for r in served)
    for name in ("vllm:admission_rejections_total", "sloserve:num_requests_rejected_total"):
        assert _counter(metrics, name, QUEUED_REQUESTS) == len(refused) + len(sdk_refused)
    assert [r.status_code for r in after] == [200] * 3


def test_a_refused_request_is_never_templated_or_tokenized(tiny_model, monkeypatch, tmp_path):
    """Under a flood, the requests over the bound are refused on arrival: the chat template
    and the tokenizer run for exactly the requests admitted, none for the 429s (which would
    otherwise take the host from the requests being served)."""
    from engine.serving.tokenize_lanes import TokenizeLanes

    templated: list[int] = []
    render = TokenizeLanes.apply_chat_template

    async def counted(self, *args, **kwargs):
        templated.append(1)
        return await render(self, *args, **kwargs)

    monkeypatch.setattr(TokenizeLanes, "apply_chat_template", counted)
    model = tiny_model("llama")
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}assistant:")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Count to ten:"}],
            "max_tokens": 24, "ignore_eos": True}

    async def run():
        settings = ServerSettings(served_model_name="tiny", queue_bounds=QueueBounds(2))
        async with app_client(model, settings, num_kv_blocks=64,
                              chat_template=str(template)) as (http, _):
            flood = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat)
                                           for _ in range(12)))
            metrics = (await http.get("/metrics")).text
            return [r.status_code for r in flood], metrics

    codes, metrics = asyncio.run(run())
    assert set(codes) == {200, 429} and codes.count(429) >= 8
    assert len(templated) == codes.count(200)
    assert _counter(metrics, "vllm:admission_rejections_total",
                    QUEUED_REQUESTS) == codes.count(429)


def test_a_full_server_sheds_a_request_before_reading_its_body() -> None:
    """While the held and reserved requests fill the bound, a generation request gets the
    bound's 429 from its headers alone: its body is never read (probe: the app and `receive`
    are never called), the refusal is counted; with room, or without the right API key, or
    on another route, the app has the request."""
    from engine.serving.load_shedding import QueueShed

    rejected: list[str] = []
    ledger = AdmissionLedger(QueueBounds(max_requests=2), on_reject=rejected.append)
    reached: list[str] = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    shed = QueueShed(app, ledger, expected_authorization=lambda: b"Bearer k")

    async def call(path: str, key: bytes = b"Bearer k") -> list[dict]:
        sent: list[dict] = []
        read: list[int] = []

        async def receive():
            read.append(1)
            return {"type": "http.request", "body": b"{not json", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path,
                 "headers": [(b"authorization", key)]}
        await shed(scope, receive, send)
        assert not read  # the middleware itself never reads a body
        return sent

    async def run() -> None:
        ledger.admit(["a"], [10])
        assert await call("/v1/chat/completions") == [] and reached == ["/v1/chat/completions"]
        place = ledger.reserve(1)  # full: one held, one being tokenized
        sent = await call("/v1/completions")
        assert sent[0]["status"] == 429 and reached == ["/v1/chat/completions"]
        headers = dict(sent[0]["headers"])
        assert headers[b"retry-after"] == b"1"
        assert headers[b"x-sloserve-rejected"] == QUEUED_REQUESTS.encode()
        assert b"--max-num-queued-reqs" in sent[1]["body"]
        await call("/v1/completions", key=b"Bearer wrong")  # left to the app's 401
        await call("/tokenize")  # not a generation route
        assert reached[1:] == ["/v1/completions", "/tokenize"]
        place.release()
        await call("/v1/responses")
        assert reached[-1] == "/v1/responses"

    asyncio.run(run())
    assert rejected == [QUEUED_REQUESTS]
