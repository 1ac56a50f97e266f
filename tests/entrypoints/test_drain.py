"""`sloserve serve --shutdown-mode wait`: SIGTERM drains the server (engine.serving.drain).
New generation requests get a 503 saying it is draining and /health a 503 {"status":
"draining"}, the stream in flight runs to its end, and the server exits 0; past
`--shutdown-timeout` what is left is aborted as in the default mode."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.utils.server_helpers import (ServerProcess, assert_clean_exit, collect_stream,
                                        descendants, sse_data, wait_gone)
from workers.preemption.layer_delay import LAYER_DELAY_ENV

MAX_MODEL_LEN = 8192
COMPLETIONS = "/v1/completions"
# The tiny model's 3 layers slowed to 5 ms a token each: a decode step takes at least 15 ms
# however fast the machine, so a stream of STREAM_TOKENS lasts seconds (the drain is seen
# while it runs) and one of LONG_TOKENS far outlasts a 1 s drain timeout.
SLOWED = {LAYER_DELAY_ENV: "5000"}
STREAM_TOKENS = 150
LONG_TOKENS = 4000


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama", max_position_embeddings=MAX_MODEL_LEN)


def _stream_in_thread(url: str, max_tokens: int) -> tuple[threading.Thread, dict,
                                                           threading.Event]:
    """A streamed completion on its own thread; the Event is set at its first token."""
    result: dict = {}
    first = threading.Event()

    def run() -> None:
        events: list = []
        body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(base_url=url, timeout=300) as client, \
                    client.stream("POST", COMPLETIONS, json=body) as response:
                result["status"] = response.status_code
                for event in sse_data(response.iter_lines()):
                    events.append(event)
                    if isinstance(event, dict) and event.get("choices"):
                        first.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            result["exception"] = repr(exc)
        finally:
            result.update(collect_stream(events))
            first.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result, first


def _wait_draining(url: str, timeout: float = 10.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{url}/health", timeout=5.0)
        if response.status_code == 503 or time.monotonic() > deadline:
            return response
        time.sleep(0.02)


def test_sigterm_in_wait_mode_lets_the_stream_finish_and_refuses_new_requests(model_dir,
                                                                               tmp_path):
    max_tokens = STREAM_TOKENS
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--shutdown-mode", "wait",
                        "--shutdown-timeout", "300", "--max-model-len", str(MAX_MODEL_LEN),
                        env=SLOWED)
    try:
        thread, streamed, first = _stream_in_thread(srv.url, max_tokens)
        assert first.wait(60), srv.log()
        tree = descendants(srv.pid)
        srv.proc.send_signal(signal.SIGTERM)
        health = _wait_draining(srv.url)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        refused = httpx.post(f"{srv.url}{COMPLETIONS}", timeout=10,
                             json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == 503 and "draining" in error["message"]
        assert refused.headers["connection"] == "close"
        assert thread.is_alive(), "the stream ended before the drain was checked"
        code = srv.proc.wait(300)
        thread.join(10)
        left = wait_gone(tree, 5.0)
    finally:
        srv.kill()
    log = srv.log(tail=100_000)
    assert code == 0, log[-4000:]
    assert_clean_exit(code, log)
    assert "drained: every request in flight finished" in log
    assert not left, f"processes left behind: {left}"
    assert "exception" not in streamed, streamed
    assert streamed["status"] == 200 and streamed["error"] is None, streamed
    assert streamed["done"] and streamed["finish_reason"] == "length"
    assert streamed["usage"]["completion_tokens"] == max_tokens


def test_a_drain_past_its_timeout_aborts_what_is_left(model_dir, tmp_path):
    srv = ServerProcess(model_dir, tmp_path / "server.log", "--shutdown-mode", "wait",
                        "--shutdown-timeout", "1", "--max-model-len", str(MAX_MODEL_LEN),
                        env=SLOWED)
    try:
        # Far longer than the timeout: it can only end by the abort.
        thread, streamed, first = _stream_in_thread(srv.url, LONG_TOKENS)
        assert first.wait(60), srv.log()
        tree = descendants(srv.pid)
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(60)
        took = time.monotonic() - started
        thread.join(10)
        left = wait_gone(tree, 5.0)
    finally:
        srv.kill()
    log = srv.log(tail=100_000)
    assert_clean_exit(code, log)
    assert "drain timed out" in log
    assert 1 <= took < 30
    assert not left, f"processes left behind: {left}"
    # As in the default mode: the stream ends with an error event and [DONE].
    assert "exception" not in streamed, streamed
    assert streamed["status"] == 200
    assert streamed["error"] is not None and streamed["error"]["code"] == 503, streamed
    assert "shutting down" in streamed["error"]["message"]
    assert streamed["done"] and streamed["finish_reason"] is None
