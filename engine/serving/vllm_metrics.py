"""vLLM's own metrics (`vllm:`), as vLLM 0.3x's Prometheus logger serves them: the same names,
types, label names (`model_name`, `engine`; engine "0", this server's one engine core) and bucket
edges, so that vLLM's Grafana boards, llm-d's endpoint picker and autoscalers read this server
as they read vLLM. Each is fed by the same observation as its `sloserve:` counterpart
(engine.serving.metrics.ServerMetrics), so the two can never disagree.

What vLLM counts that this engine counts differently, and how it is mapped:
- `vllm:num_preemptions`: vLLM's recompute preemptions, which are this engine's KV preemptions
  (an SLO preemption unwinds a forward pass, which vLLM has no name for:
  `sloserve:num_slo_preemptions_total`);
- `vllm:iteration_tokens_total`: the tokens of each engine step as the engine's statistics
  report them (steps between two reports are observed as one);
- `vllm:admission_rejections`: `--max-num-queued-reqs` / `--max-num-queued-tokens` refusals, by
  vLLM's reasons, and `--on-doomed reject`'s under the reason `doomed` (vLLM has no such
  refusal).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ENGINE = "0"


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length: 1, 2, 5, 10, 20, 50, ..."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = {"model_name": model_name, "engine": ENGINE}
        names = list(labels)
        self._registry, self._labels = registry, labels

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vllm:{name}", doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"vllm:{name}", doc, names, registry=registry).labels(**labels)

        histogram = self._histogram

        self.num_requests_running = gauge("num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self._request_success = Counter("vllm:request_success",
                                        "Count of successfully processed requests.",
                                        [*names, "finished_reason"], registry=registry)
        self._admission_rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"], registry=registry)
        # Bucketed up to the context length, known once the engine has started
        # (add_request_token_histograms).
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.iteration_tokens = histogram("iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS)
        tpot_doc = "Histogram of time_per_output_token_seconds per request."
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", tpot_doc, INTER_TOKEN_LATENCY_BUCKETS)
        # Its older name, which gateways still read.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", tpot_doc, INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)

    def _histogram(self, name: str, doc: str, buckets) -> Histogram:
        return Histogram(f"vllm:{name}", doc, list(self._labels), registry=self._registry,
                         buckets=buckets).labels(**self._labels)

    def add_request_token_histograms(self, max_model_len: int) -> None:
        """vLLM's per-request prompt and generation token histograms, its 1-2-5 buckets up to
        ``max_model_len`` (once; the engine's context does not change). None when there is no
        engine to say it (a server told to stop while its engine started)."""
        if self.request_prompt_tokens is not None or max_model_len < 1:
            return
        buckets = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", buckets)

    def request_tokens(self, prompt: int, generated: int) -> None:
        if self.request_prompt_tokens is not None and self.request_generation_tokens is not None:
            self.request_prompt_tokens.observe(prompt)
            self.request_generation_tokens.observe(generated)

    def request_success(self, finished_reason: str) -> None:
        self._request_success.labels(**self._labels, finished_reason=finished_reason).inc()

    def admission_rejection(self, reason: str) -> None:
        self._admission_rejections.labels(model_name=self._labels["model_name"],
                                          reason=reason).inc()
