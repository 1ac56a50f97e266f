"""The server hardened on the HTTP side: no traceback reaches a client, the API key compare and
the /metrics option, the EngineCore channel accepts only its own peer, and tokenization runs
off the event loop.

The app runs in this process (tests/utils/inprocess_server.py), behind `FakeCore` where a test needs
an engine that fails on cue, and behind the real EngineCore process for the channel test.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import struct
import threading
import traceback

import httpx
import pytest

import engine.serving.api_server
import engine.serving.api_key
import engine.serving.openai_responses as engine_responses
from engine.serving.api_server import ServerSettings
from engine.ipc.async_client import _shows_token
from engine.ipc.core_launch import CoreLaunch
from engine.entrypoints.cli import main
from engine.ipc.core_messages import CoreFailed, CoreHello, CoreReady, frame
from engine.serving.tokenize_lanes import INLINE_INPUT_CHARS
from tests.utils.inprocess_server import FakeCore, app_client
from tests.utils.server_helpers import sse_data

C = "/v1/completions"
SECRET = "/srv/secret/engine_internals.py"


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def vocab_size(model_dir) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))


def a_traceback() -> str:
    """A real traceback text, as the core sends in CoreFailed, naming a secret path."""
    try:
        exec(compile("raise RuntimeError('CUDA error: device-side assert')", SECRET, "exec"))
    except RuntimeError:
        return traceback.format_exc()
    raise AssertionError("unreachable")


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text and 'File "' not in text and SECRET not in text, text


def error_id(message: str) -> str:
    match = re.search(r"\(id (err-[0-9a-f]+)", message)
    assert match, f"no error id in {message!r}"
    return match.group(1)


def assert_logged(caplog, err_id: str, *needles: str) -> None:
    """The server log has the record with this id, and the details (traceback) with it."""
    records = [r for r in caplog.records if err_id in r.getMessage()]
    assert records, f"{err_id} not in the log"
    text = "\n".join(r.getMessage() + (logging.Formatter().formatException(r.exc_info)
                                       if r.exc_info else "") for r in records)
    for needle in needles:
        assert needle in text, text


def stream_events(response: httpx.Response) -> list:
    return list(sse_data(response.text.splitlines()))


# ---- tracebacks never reach a client -----------------------------------------------------

def test_engine_failure_reaches_clients_as_an_error_id_not_a_traceback(model_dir, vocab_size,
                                                                       caplog) -> None:
    """The core relays its traceback in CoreFailed (as run_core_process does): the in-flight
    stream's error event, later requests' 503 bodies and /health carry none of it; the log has
    it under the id the clients see."""
    core_traceback = a_traceback()
    fake = FakeCore(vocab_size, lambda m: ([CoreFailed(error=core_traceback)], True))
    caplog.set_level(logging.INFO)

    async def run() -> None:
        async with app_client(model_dir, fake=fake) as (http, engine):
            stream = await http.post(C, json={"prompt": "Hello", "stream": True,
                                              "max_tokens": 4})
            assert fake.requests, "probe: the request reached the core before it failed"
            assert engine.dead is not None, "probe: the engine really failed"
            assert stream.status_code == 200
            assert_no_traceback(stream.text)
            errors = [e["error"] for e in stream_events(stream) if isinstance(e, dict)
                      and "error" in e]
            assert len(errors) == 1 and errors[0]["code"] == 503, stream.text
            assert_logged(caplog, error_id(errors[0]["message"]), "CUDA error", SECRET)
            later = await http.post(C, json={"prompt": "Hello", "max_tokens": 2})
            assert later.status_code == 503, later.text
            assert_no_traceback(later.text)
            assert error_id(later.json()["error"]["message"]) == error_id(errors[0]["message"])
            assert (await http.get("/health")).status_code == 503

    asyncio.run(run())


def test_unexpected_exception_is_a_500_with_an_error_id(model_dir, vocab_size, caplog,
                                                        monkeypatch) -> None:
    """A bug on the request's path (the EOS lookup, inside the engine client, or the tokenizer,
    before it: a 500 in the OpenAI shape, also for a stream, which has not begun), or in a
    stream's chunks once it has begun (a stream error event), saying only "internal error (id
    ...)"; the log has the traceback under that id."""
    caplog.set_level(logging.INFO)
    fake = FakeCore(vocab_size)

    def broken(*_args, **_kwargs):
        raise RuntimeError(f"bug in {SECRET}")

    async def run() -> None:
        async with app_client(model_dir, fake=fake) as (http, engine):
            bodies = []
            with monkeypatch.context() as m:
                m.setattr(engine.inputs, "with_eos", broken)
                full = await http.post(C, json={"prompt": "Hello", "max_tokens": 2})
                unstarted = await http.post(C, json={"prompt": "Hello", "max_tokens": 2,
                                                     "stream": True})
                m.setattr(engine.inputs, "encode", broken)
                tokenizer = await http.post(C, json={"prompt": "Hello", "max_tokens": 2})
            with monkeypatch.context() as m:
                m.setattr(engine_responses, "_stream_delta", broken)
                stream = await http.post(C, json={"prompt": "Hello", "max_tokens": 2,
                                                  "stream": True})
            for response in (full, unstarted, tokenizer):
                assert response.status_code == 500, response.text
                assert response.headers["content-type"].startswith("application/json")
                error = response.json()["error"]
                assert error["code"] == 500 and error["type"] == "InternalServerError"
                bodies.append(error["message"])
            assert stream.status_code == 200
            (event,) = [e["error"] for e in stream_events(stream) if isinstance(e, dict)]
            assert event["code"] == 500
            bodies.append(event["message"])
            for message in bodies:
                assert message.startswith("internal error (id err-"), message
                assert_no_traceback(message)
                assert_logged(caplog, error_id(message), "bug in", "Traceback")
            # The engine is fine: a bug in one request's path is not an engine failure.
            ok = await http.post(C, json={"prompt": "Hello", "max_tokens": 2})
            assert ok.status_code == 200, ok.text
            assert engine.is_alive()

    asyncio.run(run())


# ---- the API key --------------------------------------------------------------------------

def test_api_key_is_compared_in_constant_time(model_dir, vocab_size, monkeypatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def spy(a, b) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(engine.serving.api_key.hmac, "compare_digest", spy)
    settings = ServerSettings(served_model_name="tiny", api_key="k3y")

    async def run() -> None:
        async with app_client(model_dir, settings, fake=FakeCore(vocab_size)) as (http, _):
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer k3y"})
                    ).status_code == 200
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer k3z"})
                    ).status_code == 401
            # A header compare_digest would refuse as a str (non-ASCII) is just a wrong key.
            odd = await http.get("/v1/models", headers=[(b"authorization", b"Bearer \xe9\xff")])
            assert odd.status_code == 401, odd.text

    asyncio.run(run())
    assert (b"Bearer k3y", b"Bearer k3y") in calls and (b"Bearer k3z", b"Bearer k3y") in calls


def test_metrics_require_api_key(model_dir, vocab_size) -> None:
    key = {"Authorization": "Bearer k3y"}

    async def statuses(settings: ServerSettings) -> dict[str, tuple[int, int]]:
        out = {}
        async with app_client(model_dir, settings, fake=FakeCore(vocab_size)) as (http, _):
            for path in ("/metrics", "/debug/stats", "/health", "/v1/models"):
                out[path] = ((await http.get(path)).status_code,
                             (await http.get(path, headers=key)).status_code)
        return out

    guarded = asyncio.run(statuses(ServerSettings(served_model_name="tiny", api_key="k3y",
                                                  metrics_require_api_key=True)))
    assert guarded == {"/metrics": (401, 200), "/debug/stats": (401, 200),
                       "/health": (200, 200), "/v1/models": (401, 200)}
    default = asyncio.run(statuses(ServerSettings(served_model_name="tiny", api_key="k3y")))
    assert default["/metrics"] == (200, 200) and default["/v1/models"] == (401, 200)


def test_metrics_require_api_key_needs_a_key(model_dir, monkeypatch, capsys) -> None:
    monkeypatch.delenv("SLOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(["serve", "--model", model_dir, "--metrics-require-api-key"]) == 2
    assert "--metrics-require-api-key needs an API key" in capsys.readouterr().err


# ---- tokenization off the event loop --------------------------------------------------------

def test_tokenization_does_not_stall_the_event_loop(model_dir, vocab_size, monkeypatch) -> None:
    """While one request's tokenization is stuck (a stand-in for a 1 MiB prompt), /health and
    the rest of the server still answers; then the stuck request completes. (Chat templating
    goes through the same executor.)"""
    entered, release = threading.Event(), threading.Event()
    state = {"returned": False}

    async def run() -> None:
        fake = FakeCore(vocab_size, max_model_len=100_000)
        async with app_client(model_dir, fake=fake) as (http, engine):
            encode = engine.inputs.encode

            def slow_encode(prompt: str) -> list[int]:
                entered.set()
                # The bound only keeps a broken build from hanging the suite; the assertions
                # below do not depend on time.
                release.wait(timeout=30)
                state["returned"] = True
                return encode(prompt)

            monkeypatch.setattr(engine.inputs, "encode", slow_encode)
            # Long enough to be tokenized off the loop (a turn's few words are inline).
            prompt = "a stuck prompt " * (INLINE_INPUT_CHARS // 15 + 1)
            stuck = asyncio.create_task(http.post(C, json={"prompt": prompt,
                                                           "max_tokens": 2}))
            assert await asyncio.to_thread(entered.wait, 30)  # probe: it is in the tokenizer
            health = await http.get("/health")
            assert health.status_code == 200
            assert not state["returned"], "/health only answered after the tokenizer returned"
            release.set()
            response = await stuck
            assert response.status_code == 200, response.text
            assert state["returned"]

    asyncio.run(run())


# ---- the EngineCore channel -------------------------------------------------------------------

def test_impostor_connecting_first_does_not_get_the_engine_channel(model_dir, caplog) -> None:
    """Two local processes connect to the EngineCore port before the real EngineCore is even
    spawned: one says nothing, one pretends to be a ready core. Neither gets the channel; the
    real core does, and the impostors receive no byte of any prompt."""
    caplog.set_level(logging.INFO)
    impostors: list[socket.socket] = []

    def launch_after_impostors() -> CoreLaunch:
        launch = CoreLaunch.listen()
        silent = socket.create_connection(("127.0.0.1", launch.port))
        talker = socket.create_connection(("127.0.0.1", launch.port))
        ready = CoreReady(max_model_len=4096, vocab_size=1 << 20, num_blocks=1 << 20)
        talker.sendall(frame(ready))  # what the real core says first, before this fix
        impostors.extend([silent, talker])
        return launch.spawn(model_dir)

    async def run() -> None:
        async with app_client(model_dir, launch_core=launch_after_impostors) as (http, engine):
            assert len(impostors) == 2, "probe: both connected before EngineCore was spawned"
            assert engine.vocab_size != 1 << 20, "the fake CoreReady was taken"
            response = await http.post(C, json={"prompt": "the secret prompt",
                                                "max_tokens": 3, "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 3

    asyncio.run(run())
    for sock in impostors:
        sock.settimeout(30)
        received = b""
        while chunk := sock.recv(1 << 16):  # the server hung up on them: EOF, not a hang
            received += chunk
        assert received == b"", received[:200]
        sock.close()
    dropped = [r for r in caplog.records if "did not present the start-up token" in r.message]
    assert len(dropped) == 2, "probe: the server saw and dropped both impostors"


def test_hello_frame_is_bounded() -> None:
    """A peer announcing a huge first frame is dropped without the server buffering it."""
    async def run(data: bytes) -> bool:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await _shows_token(reader, b"t" * 32)

    assert not asyncio.run(run(struct.pack(">I", 1 << 31)))
    assert not asyncio.run(run(frame(CoreReady(max_model_len=1, vocab_size=1, num_blocks=1))))
    assert not asyncio.run(run(b"\x00\x00"))
    assert not asyncio.run(run(frame(CoreHello(token=b"u" * 32))))
    assert asyncio.run(run(frame(CoreHello(token=b"t" * 32))))


def test_json_bodies_carry_lone_surrogates_back_as_escapes() -> None:
    """A message that echoes what a client sent (a lone surrogate arrives as a \\ud800 escape)
    still renders, and the client reads back exactly what it sent."""
    from engine.serving.api_errors import encode_json

    body = {"error": {"message": "The model `a\ud800b` does not exist", "code": 404}}
    data = encode_json(body)
    assert json.loads(data) == body
    assert "é".encode() in encode_json({"m": "é"})  # other text stays UTF-8, not escaped


def test_the_engine_core_side_of_the_channel_sends_frames_without_nagle_delay() -> None:
    """A step's outputs are one small frame; with Nagle's algorithm on, it waited for the ACK
    of the previous frame, which delayed ACKs held back ~200 ms: every first token over HTTP
    took 215 ms on an idle tiny-model server (1 ms offline)."""
    import socket

    from engine.ipc.core_messages import FrameSocket

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        try:
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # probe
            FrameSocket(client)
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            client.close()
