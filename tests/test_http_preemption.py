"""Over HTTP: a request carrying X-SLO-TTFT-MS stops a long running prefill mid-forward; its
response metrics show the SLO met, the victim's show one preemption, and /metrics counts it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from monitor.predictor import LinearTTFT
from tests.server_helpers import ServerProcess
from workers.model_runner import LAYER_DELAY_ENV

NUM_LAYERS = 8
LONG_PROMPT = 400
# 400 tokens x 300 us = 120 ms per layer: the long step lasts about a second.
DELAY_US_PER_TOKEN = 300


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


@pytest.mark.timeout(300)
def test_slo_header_preempts_a_long_prefill(tiny_model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(LAYER_DELAY_ENV, str(DELAY_US_PER_TOKEN))
    model = tiny_model("llama", num_hidden_layers=NUM_LAYERS, max_position_embeddings=1024)
    # The slowed layers' TTFT line (2.4 ms per token), so that the monitor knows how much of
    # the long step is left when the urgent request arrives.
    ttft = tmp_path / "ttft.json"
    LinearTTFT(seconds_per_token=NUM_LAYERS * DELAY_US_PER_TOKEN * 1e-6, intercept_s=0.02).save(
        ttft)
    server = ServerProcess(model, tmp_path / "server.log", "--scheduling-policy", "slo",
                           "--preempt-min-tokens", "32", "--num-kv-blocks", "160",
                           "--max-num-batched-tokens", "1024", "--ttft-model", str(ttft))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            results: dict[str, dict] = {}

            def post(name: str, prompt: list[int], slo_ms: str) -> None:
                response = http.post("/v1/completions", headers={"X-SLO-TTFT-MS": slo_ms},
                                     json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert response.status_code == 200, response.text
                results[name] = response.json()

            long = threading.Thread(target=post, args=("long", _ids(LONG_PROMPT, 1), "60000"))
            long.start()
            time.sleep(0.3)  # a few layers into the long request's one-second step
            post("urgent", _ids(20, 2), "500")
            long.join()

            urgent_metrics, long_metrics = results["urgent"]["metrics"], results["long"]["metrics"]
            assert urgent_metrics["ttft_slo_met"] is True
            assert urgent_metrics["num_preemptions"] == 0
            assert long_metrics["num_preemptions"] == 1
            assert urgent_metrics["ttft_ms"] < long_metrics["ttft_ms"]

            text = http.get("/metrics").text
            assert _metric(text, "sloserve:num_preemptions_total", reason="slo") == 1
            assert _metric(text, "sloserve:preempt_latency_seconds_count") == 1
            # The default suspend mode kept the stopped pass: nothing was thrown away.
            assert _metric(text, "sloserve:preempt_wasted_tokens_total") == 0
            assert _metric(text, "sloserve:preempt_wasted_layers_total") == 0
        server.assert_clean_stop()
    finally:
        server.kill()
