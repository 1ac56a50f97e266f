"""Prometheus metrics of the API server, named after vLLM's under the `sloserve:` prefix.

vLLM's own set is exported beside them under vLLM's names (`vllm:`, engine.serving.
vllm_metrics), which gateways and dashboards read as they are: llm-d's endpoint picker scrapes
the queue gauges and the KV usage, Grafana's vLLM boards the token counters and the latency
histograms. Each such pair is one observation fed to both names (`_Both`): the two can never
disagree.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.outputs import RequestMetrics, RequestOutput, SchedulerStats
from engine.serving.vllm_metrics import VllmMetrics

_PREEMPT_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
# vLLM's time-per-output-token boundaries, which the project's TPOT histogram shares.
_VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _Both:
    """One gauge, counter or histogram under two names (the project's and vLLM's)."""

    def __init__(self, *children) -> None:
        self._children = children

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def inc(self, value: float = 1) -> None:
        for child in self._children:
            child.inc(value)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class ServerMetrics:
    """Fed by the engine client (stats snapshots, request updates); rendered at /metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self.vllm = vllm = VllmMetrics(r, model_name)

        def gauge(name: str, doc: str, prefix: str = "sloserve") -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, labelnames=list(labels), registry=r).labels(
                **labels)

        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(f"sloserve:{name}", doc, labelnames=[*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS,
                      prefix: str = "sloserve") -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labelnames=list(labels), registry=r,
                             buckets=buckets).labels(**labels)

        self._labels = labels
        self.num_requests_running = _Both(gauge("num_requests_running",
                                                "Requests in the running set."),
                                          vllm.num_requests_running)
        self.num_requests_waiting = _Both(gauge("num_requests_waiting",
                                                "Requests waiting to run."),
                                          vllm.num_requests_waiting)
        self.kv_cache_usage_perc = _Both(gauge("kv_cache_usage_perc",
                                               "Fraction of KV blocks in use (0 to 1)."),
                                         vllm.kv_cache_usage_perc)
        self.ttft_predictor_relative_error = gauge(
            "ttft_predictor_relative_error", "How far from what the TTFT predictor said recent "
            "prefill steps ran, longer or shorter (its error quantile, at least 0.05; the "
            "monitor's safety margin).")
        self.prefix_cache_queries = _Both(counter("prefix_cache_queries", "Prompt tokens "
                                                  "looked up in the prefix cache.").labels(
                                                      **labels), vllm.prefix_cache_queries)
        self.prefix_cache_hits = _Both(counter("prefix_cache_hits", "Prompt tokens found in "
                                               "the prefix cache.").labels(**labels),
                                       vllm.prefix_cache_hits)
        # vLLM's preemptions are recompute preemptions: this engine's KV preemptions.
        self.num_kv_preemptions = _Both(counter("num_kv_preemptions", "KV preemptions: running "
                                                "requests evicted for KV space, to be "
                                                "recomputed.").labels(**labels),
                                        vllm.num_preemptions)
        self.num_slo_preemptions = counter("num_slo_preemptions", "SLO preemptions: forward "
                                           "passes the monitor stopped for an urgent request."
                                           ).labels(**labels)
        self.slo_preempt_wasted_tokens = counter("slo_preempt_wasted_tokens", "Scheduled tokens "
                                                 "of forward passes unwound by an SLO "
                                                 "preemption.").labels(**labels)
        self.slo_preempt_wasted_layers = counter("slo_preempt_wasted_layers", "Layers unwound "
                                                 "forward passes had run.").labels(**labels)
        # Deprecated names (README.md, "Deprecated names"): the same counts, removed next release.
        self.num_preemptions = counter("num_preemptions", "Deprecated: num_kv_preemptions and "
                                       "num_slo_preemptions, as a reason label (kv, slo).",
                                       "reason")
        self.preempt_wasted_tokens = counter("preempt_wasted_tokens", "Deprecated: "
                                             "slo_preempt_wasted_tokens.").labels(**labels)
        self.preempt_wasted_layers = counter("preempt_wasted_layers", "Deprecated: "
                                             "slo_preempt_wasted_layers.").labels(**labels)
        self.monitor_errors = counter("monitor_errors", "Exceptions the SLO monitor thread "
                                      "caught (it keeps running; see the server log).").labels(
                                          **labels)
        self.scheduled_tokens = counter("scheduled_tokens", "Tokens handed to the model, "
                                        "unwound steps included.").labels(**labels)
        self.slo_preempt_latency = histogram("slo_preempt_latency_seconds", "SLO preemptions: "
                                             "monitor decision to unwound step.",
                                             _PREEMPT_LATENCY_BUCKETS)
        self.preempt_latency = histogram("preempt_latency_seconds", "Deprecated: "
                                         "slo_preempt_latency_seconds.", _PREEMPT_LATENCY_BUCKETS)
        self.prompt_tokens = _Both(counter("prompt_tokens", "Prefill tokens of finished "
                                           "requests.").labels(**labels), vllm.prompt_tokens)
        self.generation_tokens = _Both(counter("generation_tokens", "Generated tokens.").labels(
            **labels), vllm.generation_tokens)
        self.request_success = counter("request_success", "Finished requests, by reason.",
                                       "finished_reason")
        ttft_doc = "Arrival to the first token sent to the client."
        self.ttft = _Both(histogram("time_to_first_token_seconds", ttft_doc),
                          vllm.time_to_first_token)
        self.time_to_first_answer = histogram(
            "time_to_first_answer_token_seconds",
            "Arrival to the first answer token sent to the client: after a reasoning model's "
            "thinking, its content or tool call; the first token otherwise.")
        # Per finished request, as vLLM's request_time_per_output_token_seconds (its older
        # name, which gateways still read, is the one exported).
        tpot_doc = ("Mean time per output token of a finished request: its first token to its "
                    "last, as sent to the client, over the tokens after the first.")
        self.tpot = _Both(histogram("time_per_output_token_seconds", tpot_doc,
                                    _VLLM_TPOT_BUCKETS),
                          vllm.time_per_output_token, vllm.request_time_per_output_token)
        self.itl = _Both(histogram("inter_token_latency_seconds",
                                   "Time between two output tokens."), vllm.inter_token_latency)
        self.e2e = _Both(histogram("e2e_request_latency_seconds", "Arrival to last token."),
                         vllm.e2e_request_latency)
        self.queue_time = _Both(histogram("request_queue_time_seconds",
                                          "Arrival to first scheduled."), vllm.request_queue_time)
        self.slo_met = counter("ttft_slo_met", "Requests whose first token met their TTFT "
                               "SLO.").labels(**labels)
        self.slo_missed = counter("ttft_slo_missed", "Requests whose first token missed their "
                                  "TTFT SLO.").labels(**labels)
        self.tpot_slo_met = counter("tpot_slo_met", "Finished requests whose mean time per "
                                    "output token met their TPOT SLO.").labels(**labels)
        self.tpot_slo_missed = counter("tpot_slo_missed", "Finished requests whose mean time "
                                       "per output token missed their TPOT SLO.").labels(**labels)
        # Requests refused at the door (engine.serving.admission, engine.serving.doomed), by
        # reason, under both prefixes: the bound a gateway should know it hit.
        self.rejected = counter("num_requests_rejected", "Requests refused with 429, by "
                                "reason: the server's queue bound was reached "
                                "(max_num_queued_reqs, max_num_queued_tokens), or the TTFT "
                                "objective could not be met even served first (doomed, "
                                "--on-doomed reject).", "reason")
        self._last: SchedulerStats = SchedulerStats()
        # request id -> (tokens seen, time the last of them arrived)
        self._progress: dict[str, tuple[int, float]] = {}

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(**self._labels, reason=reason).inc()
        self.vllm.admission_rejection(reason)

    def on_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.ttft_predictor_relative_error.set(stats.ttft_predictor_relative_error)
        # The core's counters are cumulative: add what they moved since the last snapshot.
        last = self._last
        self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        kv = max(0, stats.num_kv_preemptions - last.num_kv_preemptions)
        slo = max(0, stats.num_slo_preemptions - last.num_slo_preemptions)
        wasted_tokens = max(0, stats.slo_preempt_wasted_tokens - last.slo_preempt_wasted_tokens)
        wasted_layers = max(0, stats.slo_preempt_wasted_layers - last.slo_preempt_wasted_layers)
        self.num_kv_preemptions.inc(kv)
        self.num_slo_preemptions.inc(slo)
        self.slo_preempt_wasted_tokens.inc(wasted_tokens)
        self.slo_preempt_wasted_layers.inc(wasted_layers)
        self.num_preemptions.labels(**self._labels, reason="kv").inc(kv)
        self.num_preemptions.labels(**self._labels, reason="slo").inc(slo)
        self.preempt_wasted_tokens.inc(wasted_tokens)
        self.preempt_wasted_layers.inc(wasted_layers)
        scheduled = max(0, stats.num_scheduled_tokens - last.num_scheduled_tokens)
        self.scheduled_tokens.inc(scheduled)
        if scheduled:
            self.vllm.iteration_tokens.observe(scheduled)
        self.monitor_errors.inc(max(0, stats.monitor_errors - last.monitor_errors))
        for latency in stats.slo_preempt_latencies_s:
            self.slo_preempt_latency.observe(latency)
            self.preempt_latency.observe(latency)
        self._last = stats

    def on_request_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        seen, last_time = self._progress.get(out.request_id, (0, 0.0))
        new_tokens = len(out.token_ids) - seen
        m = out.metrics
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
            if seen == 0 and m is not None and m.queue_time is not None:
                self.queue_time.observe(m.queue_time)
            elif seen > 0:
                self.itl.observe((now - last_time) / new_tokens)
            self._progress[out.request_id] = (len(out.token_ids), now)
        if out.finished:
            self._progress.pop(out.request_id, None)
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            reason = out.finish_reason or "unknown"
            self.request_success.labels(**self._labels, finished_reason=reason).inc()
            self.vllm.request_success(reason)
            self.vllm.request_tokens(len(out.prompt_token_ids), len(out.token_ids))
            if m is not None and m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)

    # TTFT and TPOT are judged by the API server's stamps, where the client is sent the tokens
    # (engine.serving.edge_clock), not by the engine's: the engine's first-token stamp cannot
    # see detokenization, the frame to the API server or its event loop.

    def on_edge_first_token(self, metrics: RequestMetrics) -> None:
        """A choice's first token was sent to its client (metrics: with the edge's stamps)."""
        if metrics.ttft is None:
            return
        self.ttft.observe(metrics.ttft)
        if metrics.ttft_slo_met is not None:
            (self.slo_met if metrics.ttft_slo_met else self.slo_missed).inc()

    def on_edge_first_answer(self, metrics: RequestMetrics) -> None:
        """A choice's first answer token was sent to its client."""
        if metrics.time_to_first_answer is not None:
            self.time_to_first_answer.observe(metrics.time_to_first_answer)

    def on_edge_finish(self, metrics: RequestMetrics) -> None:
        """A choice finished (not with an error) and its last output reached the handler."""
        if metrics.tpot is not None:
            self.tpot.observe(metrics.tpot)
        if metrics.tpot_slo_met is not None:
            (self.tpot_slo_met if metrics.tpot_slo_met else self.tpot_slo_missed).inc()

    def forget(self, request_id: str) -> None:
        """A request that ended without finishing (client gone)."""
        self._progress.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)
