"""vLLM's metric set at /metrics, as vLLM 0.3x's Prometheus logger serves it: every name in the
list below with its type, its label names (`model_name`, `engine`) and, for a histogram, vLLM's
bucket edges; and values that agree with what the responses themselves said (requests, prompt
and generated tokens, TTFT by the client's stamps)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from engine.serving.api_server import ServerSettings
from engine.serving.vllm_metrics import request_tokens_buckets
from tests.utils.inprocess_server import MAX_MODEL_LEN, app_client

LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS = "request tokens"  # vLLM's 1-2-5 series up to the context length
# vLLM's name (without the _total of a counter) -> its type and buckets.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", None),
    "vllm:request_prompt_tokens": ("histogram", TOKENS),
    "vllm:request_generation_tokens": ("histogram", TOKENS),
    "vllm:iteration_tokens_total": ("histogram", ITERATION),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL),
    "vllm:time_per_output_token_seconds": ("histogram", ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", LATENCY),
}
PROMPTS = ["Deadlines matter", "A paged KV cache stores keys", "Paris is the capital of"]


def test_vllms_metrics_are_served_as_vllm_serves_them(tiny_model):
    model = tiny_model("llama")

    async def run():
        settings = ServerSettings(served_model_name="tiny")
        async with app_client(model, settings, num_kv_blocks=64) as (http, _):
            responses = await asyncio.gather(*(
                http.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 6 + i, "ignore_eos": True,
                    "temperature": 0}) for i, prompt in enumerate(PROMPTS)))
            return [r.json() for r in responses], (await http.get("/metrics")).text

    bodies, page = asyncio.run(run())
    families = {f.name: f for f in text_string_to_metric_families(page)}
    for name, (kind, buckets) in VLLM_METRICS.items():
        family = families.get(name)
        assert family is not None, f"{name} is not served"
        assert family.type == kind, (name, family.type)
        assert family.samples, name
        for sample in family.samples:
            assert {"model_name", "engine"} <= set(sample.labels), (name, sample.labels)
            assert sample.labels["model_name"] == "tiny" and sample.labels["engine"] == "0"
        if buckets is not None:
            edges = [float(s.labels["le"]) for s in family.samples
                     if s.name.endswith("_bucket")]
            expected = (request_tokens_buckets(MAX_MODEL_LEN) if buckets == TOKENS
                        else buckets)
            assert edges == [*map(float, expected), float("inf")], name

    def value(name: str, **labels: str) -> float:
        return sum(s.value for family in families.values() for s in family.samples
                   if s.name == name and labels.items() <= s.labels.items())

    usage = [b["usage"] for b in bodies]
    assert value("vllm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert value("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert value("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert value("vllm:request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usage)
    assert value("vllm:request_generation_tokens_count") == len(PROMPTS)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_time_per_output_token_seconds"):
        assert value(f"vllm:{name}_count") == len(PROMPTS), name
    # TTFT by the client-side stamps the responses report.
    ttft_sum = sum(b["metrics"]["ttft_ms"] for b in bodies) / 1000
    assert abs(value("vllm:time_to_first_token_seconds_sum") - ttft_sum) < 1e-6 + 1e-6 * ttft_sum
    assert value("vllm:inter_token_latency_seconds_count") > 0
    assert value("vllm:iteration_tokens_total_count") > 0
    assert value("vllm:num_preemptions_total") == 0
