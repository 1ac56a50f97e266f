"""The fleet's /metrics, served by the ingress: what the client sees, and each replica's load.

TTFT is stamped here, at the fleet's edge, when the first chunk carrying output (not chat's
role-only opening chunk) leaves for the client: the figure the client measures, a few Ray hops
after the replica's own stamp. Each replica's gauges come from its latest report to the router,
under the names llm-d's endpoint picker and vLLM dashboards read, labelled by replica.

Its 429s are counted by reason (`sloserve:fleet_rejected_total`): the doomed ones it refused
itself and the queue bounds' refusals its replicas sent back after no other could take the
request (those tried again elsewhere: `sloserve:fleet_rerouted_total`). What the fleet could
not weigh is counted too: requests forwarded without a route hint or
without admission (`sloserve:fleet_unassessed_total`, by reason) and the router's ranking
failures, after which it routed in Ray Serve's order (`sloserve:fleet_ranking_failures_total`,
by exception type, kept in the router's book).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.responses import Response

from engine.load.load_report import ReplicaLoad, RouteHint
from engine.fleet.routing import FleetBook

# vLLM's TTFT buckets, so that dashboards built for vLLM read the fleet's histogram as is.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class _ReplicaLoads:
    """A collector that reads the router's book at scrape time."""

    def __init__(self, book: Callable[[], FleetBook | None]) -> None:
        self._book = book

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        book = self._book()
        loads = sorted((book.loads() if book is not None else {}).items())
        now = time.time()
        for name, doc, value in _REPLICA_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, load in loads:
                family.add_metric([replica], value(load, now))
            yield family
        failures = CounterMetricFamily(
            "sloserve:fleet_ranking_failures", "Routing decisions the router failed to make "
            "(an exception in its ranking, logged with its traceback), each routed in Ray "
            "Serve's order instead, by exception type.", labels=["error"])
        # A copy: the router's event loop may count one while this scrape reads them.
        for error, count in sorted(dict(book.ranking_failures if book is not None
                                        else {}).items()):
            failures.add_metric([error], count)
        yield failures


# Each replica's gauges: (name, help, value of its latest report at scrape time).
_REPLICA_GAUGES: tuple[tuple[str, str, Callable[[ReplicaLoad, float], float]], ...] = (
    ("vllm:num_requests_waiting", "Requests waiting on each replica (its latest report).",
     lambda load, now: len(load.waiting)),
    ("vllm:num_requests_running", "Requests running on each replica (its latest report).",
     lambda load, now: load.num_requests - len(load.waiting)),
    ("vllm:kv_cache_usage_perc", "Fraction of each replica's KV blocks in use.",
     lambda load, now: 1.0 - load.num_free_blocks / load.num_blocks if load.num_blocks
     else 0.0),
    ("sloserve:fleet_report_age_seconds", "How old each replica's latest load report is.",
     lambda load, now: max(0.0, now - load.made_at)),
    ("sloserve:fleet_queued_prefill_tokens", "Prompt tokens each replica still has to prefill "
     "(waiting and running requests).",
     lambda load, now: sum(q.remaining_prefill_tokens for q in (*load.waiting, *load.running))),
    ("sloserve:fleet_step_remaining_seconds", "Predicted time left in each replica's running "
     "step.", lambda load, now: load.step_remaining_s),
)


class FleetMetrics:
    def __init__(self, book: Callable[[], FleetBook | None]) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_ReplicaLoads(book))
        self._ttft = [Histogram(name, "Time to first token at the fleet's edge.",
                                buckets=TTFT_BUCKETS, registry=r)
                      for name in ("sloserve:fleet_time_to_first_token_seconds",
                                   "vllm:time_to_first_token_seconds")]
        self._slo = Counter("sloserve:fleet_ttft_slo", "Requests with a TTFT objective, by "
                            "whether their first output reached the client's side in time.",
                            ["outcome"], registry=r)
        self._rejected = Counter(
            "sloserve:fleet_rejected", "Requests answered with a 429, by reason: doomed (no "
            "replica could meet the TTFT objective: --on-doomed reject), max_num_queued_reqs "
            "and max_num_queued_tokens (every replica tried was at its queue bound).",
            ["reason"], registry=r)
        self._rerouted = Counter(
            "sloserve:fleet_rerouted", "Refusals at a replica's queue bound after which the "
            "request was tried again on another replica (one request refused twice counts "
            "twice), by the bound's reason.", ["reason"], registry=r)
        self._retries = Counter("sloserve:fleet_retries", "Requests tried again on another "
                                "replica after theirs failed before answering.", registry=r)
        self._failed = Counter("sloserve:fleet_failed", "Requests that failed because their "
                               "replica did (mid-stream, or on every try).", registry=r)
        self._unassessed = Counter(
            "sloserve:fleet_unassessed", "Generation requests forwarded without the router's "
            "prediction or admission weighing them, by reason: invalid_body and chat_prompt "
            "(the replica answers with its own 400), hint_error (a failure computing the route "
            "hint, logged with its traceback), router_not_started (--on-doomed reject before "
            "the ingress's router exists).", ["reason"], registry=r)

    def first_output(self, hint: RouteHint, now: float) -> None:
        ttft = max(0.0, now - hint.arrived_at)
        for histogram in self._ttft:
            histogram.observe(ttft)
        if hint.ttft_slo_s is not None:
            self._slo.labels("met" if ttft <= hint.ttft_slo_s else "missed").inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def rerouted(self, reason: str) -> None:
        self._rerouted.labels(reason).inc()

    def retried(self) -> None:
        self._retries.inc()

    def failed(self) -> None:
        self._failed.inc()

    def unassessed(self, reason: str) -> None:
        self._unassessed.labels(reason).inc()

    def response(self) -> Response:
        return Response(generate_latest(self.registry),
                        media_type="text/plain; version=0.0.4; charset=utf-8")


def carries_output(chunk: bytes) -> bool:
    """Whether a streamed chunk (server-sent events) carries output a client shows: text, or a
    non-empty chat delta (not the role-only opening chunk). A non-SSE body always does."""
    if not chunk.startswith(b"data:") and b"\ndata:" not in chunk:
        return True
    for line in chunk.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        for choice in event.get("choices") or ():
            if choice.get("text") or choice.get("logprobs"):
                return True
            delta = choice.get("delta") or {}
            if any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content")):
                return True
            if choice.get("finish_reason") is not None:  # an empty answer: this is its first
                return True
        if "error" in event:
            return True
    return False
