"""A server on a machine 3x slower (workers/preemption/slowdown.py, inherited by EngineCore from
the server's environment): the same completions as on the quiet machine, its startup
calibration run and kept on the slow machine, and its first tokens as much later as the machine
is slower, by the client's clock and the server's alike."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest

from tests.utils.server_helpers import ServerProcess
from workers.preemption.layer_delay import LAYER_DELAY_ENV
from workers.preemption.slowdown import SLOWDOWN_ENV

# Timed by the wall clock: alone.
pytestmark = pytest.mark.serial

# The layers sleep per token, so that a step's time is mostly a sleep proportional to its
# tokens: the slowed server's steps are then about 3x the quiet one's on a busy machine too.
DELAY_US_PER_TOKEN = "1000"
PROMPTS = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i % 3)
           for i in range(6)]


def _complete(server: ServerProcess, model: str) -> tuple[list[str], list[float], list[float]]:
    """Each prompt's greedy completion, its client-timed TTFT (first byte of the stream's first
    token) and the server's `metrics.ttft_ms`, one request at a time."""
    texts, client_ms, server_ms = [], [], []
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            sent = time.monotonic()
            first = None
            text = ""
            metrics = None
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    for choice in event.get("choices", []):
                        if choice.get("text") and first is None:
                            first = time.monotonic()
                        text += choice.get("text", "")
                    metrics = event.get("metrics", metrics)
            assert first is not None
            texts.append(text)
            client_ms.append((first - sent) * 1000)
            if metrics is not None:
                server_ms.append(metrics["ttft_ms"])
    return texts, client_ms, server_ms


def test_a_slowed_server_answers_the_same_later(tiny_model, tmp_path):
    model = tiny_model("llama")
    runs = {}
    for factor in ("1", "3"):
        server = ServerProcess(model, tmp_path / f"server-{factor}.log",
                               env={LAYER_DELAY_ENV: DELAY_US_PER_TOKEN, SLOWDOWN_ENV: factor})
        try:
            runs[factor] = _complete(server, model)
            log = server.log(tail=200_000)
        finally:
            server.stop()
        # The startup calibration ran (on the slowed machine for the slowed server) and was
        # kept, whatever it managed to time.
        assert "startup calibration" in log and "skipped" not in log
    quiet, slowed = runs["1"], runs["3"]
    assert slowed[0] == quiet[0]  # the same completions
    # Probe: the machine really was slower, by the client's clock (each first token waits for
    # a prefill that sleeps 3x as long).
    assert statistics.median(slowed[1]) > 2.0 * statistics.median(quiet[1])
    if quiet[2] and slowed[2]:
        assert statistics.median(slowed[2]) > 2.0 * statistics.median(quiet[2])
