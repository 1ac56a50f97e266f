"""Over HTTP, timed by the client: an urgent request carrying X-SLO-TTFT-MS stops a
long prefill mid-forward (/metrics count the preemption, and nothing thrown away), and its
first sampled token shows nothing (tests/utils/silent_first_token.py blanks it, as a special token
would). Its TTFT objective is met only when its first *visible* output reaches the client, and
its stream does not stall behind the rest of the step it interrupted.

Before: the engine dropped the deadline (and released the victim) when the silent token was
sampled, and the victim's whole suspended chunk resumed beside the urgent request's next token:
the first visible output came after the rest of the long step (~0.6 s here, over a 500 ms
objective), and so did every gap after it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from tests.utils.server_helpers import SLOWED_LAYERS, SLOWED_US_PER_TOKEN, slowed_slo_server

# Alone (the README's serial run): an urgent turn's first output is checked against its
# deadline by the wall clock.
pytestmark = pytest.mark.serial

LONG_PROMPT = 400
URGENT_PROMPT = 20
URGENT_SLO_MS = 500
URGENT_TOKENS = 8


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _layers_sleep_s(tokens: int) -> float:
    """The slowed layers' sleep in a pass of `tokens` tokens through all of them."""
    return SLOWED_LAYERS * SLOWED_US_PER_TOKEN * tokens / 1e6


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def _stream(http: httpx.Client, prompt: list[int], slo_ms: int, max_tokens: int
            ) -> tuple[float, list[float], dict]:
    """Posts a streamed completion; returns when it was sent, the arrival time of each chunk
    that carries text (client clock), and the final chunk's metrics."""
    sent = time.monotonic()
    arrivals: list[float] = []
    metrics: dict = {}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"X-SLO-TTFT-MS": str(slo_ms)}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if any(choice.get("text") for choice in event["choices"]):
                arrivals.append(time.monotonic())
            metrics = event.get("metrics") or metrics
    return sent, arrivals, metrics


@pytest.mark.timeout(300)
def test_an_urgent_stream_whose_first_token_shows_nothing_comes_ahead_of_the_step_it_stopped(
        tiny_model, tmp_path, monkeypatch) -> None:
    server = slowed_slo_server(tiny_model, tmp_path, monkeypatch,
                               module="tests.utils.silent_first_token")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            long_result: dict = {}

            def long_request() -> None:
                long_result["out"] = _stream(http, _ids(LONG_PROMPT, 1), 60_000, 4)

            long = threading.Thread(target=long_request)
            long.start()
            time.sleep(0.3)  # a few layers into the long request's one-second step
            sent, arrivals, urgent = _stream(http, _ids(URGENT_PROMPT, 2), URGENT_SLO_MS,
                                             URGENT_TOKENS)
            long.join()
            _, long_arrivals, long_metrics = long_result["out"]

            # Probes: the long step was stopped for it, and its first token showed nothing:
            # the engine sampled it well before the client saw any text.
            assert long_metrics["num_slo_preemptions"] == 1
            assert long_metrics["num_kv_preemptions"] == 0
            assert long_metrics["num_preemptions"] == 1  # deprecated: both kinds
            assert urgent["engine_ttft_ms"] < urgent["ttft_ms"]
            assert len(arrivals) < URGENT_TOKENS
            client_ttft_ms = 1000 * (arrivals[0] - sent)
            # The server's TTFT is the client's (its first visible output), not the engine's.
            assert abs(urgent["ttft_ms"] - client_ttft_ms) < 50, (client_ttft_ms, urgent)
            # Served ahead of the step it interrupted, by steps rather than by a wall-clock
            # bound (on a busy 2-core host the visible output came at 501-773 ms against the
            # 500 ms objective, the scheduler filling the turn's steps up to its deadline by
            # a predictor that host made 30% wrong): its first visible output reached the
            # client more than any gap of its own stream before the interrupted request's
            # first output. In the stall the two came out of the same step.
            gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
            assert long_arrivals[0] - arrivals[0] > max(gaps, default=0.0), (
                arrivals, long_arrivals)
            # No stall after the unwind: the rest of the interrupted step resumes in pieces
            # between the urgent request's tokens, none of its gaps as long as that rest.
            # The rest is at least the slowed layers' sleep the long pass had not reached when
            # it stopped, which was before the urgent request's own first step (its layers'
            # sleep at least) ended with its first token: a floor set by the server's clock,
            # whatever the host's speed. (A wall-clock bound of 0.25 s failed the CI's serial
            # phase with gaps of 0.31 and 0.28 s. With the interactive turn's gap uncapped, the
            # stall came back here: a gap of 0.86 s against a floor of 0.53 s.)
            stopped_by = (urgent["arrival_time"] + urgent["engine_ttft_ms"] / 1000
                          - _layers_sleep_s(URGENT_PROMPT) - long_metrics["arrival_time"])
            rest_of_step = _layers_sleep_s(LONG_PROMPT) - stopped_by
            assert max(gaps) < rest_of_step, (gaps, rest_of_step)
            assert len(long_arrivals) > 0  # the long request completed
            assert long_metrics["ttft_ms"] > urgent["ttft_ms"]

            # The server counted the one preemption; the default suspend mode kept the
            # stopped pass, so nothing was thrown away.
            text = http.get("/metrics").text
            assert _metric(text, "sloserve:num_slo_preemptions_total") == 1
            assert _metric(text, "sloserve:slo_preempt_latency_seconds_count") == 1
            # The deprecated names count the same.
            assert _metric(text, "sloserve:num_preemptions_total", reason="slo") == 1
            assert _metric(text, "sloserve:preempt_latency_seconds_count") == 1
            assert _metric(text, "sloserve:preempt_wasted_tokens_total") == 0
            assert _metric(text, "sloserve:slo_preempt_wasted_tokens_total") == 0
            assert _metric(text, "sloserve:slo_preempt_wasted_layers_total") == 0
        server.assert_clean_stop()
    finally:
        server.kill()
