"""Replaying a trace against the engine: in process (exact engine timestamps) or over HTTP
against a running `sloserve serve`, or any OpenAI-compatible server (TTFT and TPOT measured at
the client). Both send each request's TTFT and TPOT objectives to the engine and return a
`RunResult`.

Over HTTP, the first PREFIX_SALT_TOKENS tokens of every prompt are replaced by salt tokens drawn
afresh for each request of each replay, the warm-up included
(engine/benchmarks/attainment/salts.py): a
server keeps its prefix cache from one replay to the next, and without the salt a second replay
of a trace (another budget or seed, a warm-up of the first request, another benchmark run
against the same server) would find its prompts cached. Prompt lengths stay the trace's, so
every server and every run does the same work.

Arrivals follow the trace's offsets in real time. In process, a separate thread submits each
request at its time, as the HTTP reader thread would, so the SLO monitor sees arrivals that land
in the middle of a step.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from engine.benchmarks.attainment.constraints import (check_constraint, constrains,
                                                      http_fields, labelled, structured_params)
from engine.benchmarks.attainment.policies import PolicySpec, tier_priorities
from engine.benchmarks.attainment.results import RequestResult, RunResult
from engine.benchmarks.attainment.salts import PREFIX_SALT_TOKENS, PrefixSalts, salted
from engine.benchmarks.attainment.traces import Trace, TraceRequest


def _priorities(trace: Trace, policy: PolicySpec) -> dict[str, int]:
    if not policy.uses_tier_priority:
        return {}
    slos: dict[str, list[float | None]] = {}
    for r in trace.requests:
        slos.setdefault(r.tier, []).append(r.ttft_slo_ms)
    return tier_priorities(slos)


def _meta(trace: Trace) -> tuple[str, float, int]:
    meta = trace.meta
    return str(meta.get("workload", "custom")), float(meta.get("rate", 0.0)), int(
        meta.get("seed", 0))


# ---- in process -----------------------------------------------------------------------------

# Engines an EnginePool keeps at once where they run on the CPU, unless told otherwise.
CPU_MAX_ENGINES = 8


class EnginePool:
    """In-process engines kept alive across the runs of a grid, one per (policy, budget), so a
    run pays no model load and warm-up. Between runs an engine is idle: every request of the
    previous trace finished. Counters are read as differences over a run. Run with prefix
    caching off (the bench does), or prompts of an earlier trace could hit the cache.

    On a CUDA device the pool holds one engine at a time unless ``max_engines`` says more: an
    engine sizes its KV pool from the device memory left free, so a second 8B engine beside the
    first finds none. The engine that makes room is shut down and dropped before the next one
    is built (an engine's memory is freed at once when it is dropped: workers.graphs.cuda_graphs)."""

    def __init__(self, model: str, max_engines: int | None = None,
                 **engine_overrides: Any) -> None:
        """``max_engines``: how many engines may be alive at once; left out, one on a CUDA
        device and CPU_MAX_ENGINES elsewhere."""
        if max_engines is not None and max_engines < 1:
            raise ValueError(f"max_engines must be at least 1, got {max_engines}")
        self.model, self.max_engines, self.overrides = model, max_engines, engine_overrides
        self._engines: dict[tuple[str, int], Any] = {}

    def engine_limit(self, device: str) -> int:
        """How many engines may be alive at once for engines on ``device`` ('cpu' or 'cuda',
        as the engine configuration resolved it)."""
        if self.max_engines is not None:
            return self.max_engines
        return 1 if device == "cuda" else CPU_MAX_ENGINES

    def get(self, policy: PolicySpec, budget: int) -> Any:
        from engine.config import build_engine_config
        from engine.runtime.engine_core import EngineCore

        key = (policy.name, budget)
        if key not in self._engines:
            config = build_engine_config(self.model, max_num_batched_tokens=budget,
                                         **{**policy.engine_kwargs(), **self.overrides})
            limit = self.engine_limit(config.model.device)
            while len(self._engines) >= limit:  # memory: the oldest ones go first
                oldest = next(iter(self._engines))
                self._engines.pop(oldest).shutdown()
            self._engines[key] = EngineCore(config)
        return self._engines[key]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()
        self._engines.clear()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_inprocess(trace: Trace, policy: PolicySpec, model: str, budget: int,
                  progress: bool = True, pool: EnginePool | None = None,
                  constraint: str = "none", **engine_overrides: Any) -> RunResult:
    """Replay `trace` on an engine of `pool` (or on a fresh one, shut down afterwards).
    `constraint`: what the urgent tier's requests carry (attainment.constraints)."""
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams

    own_pool = pool is None
    if pool is None:
        pool = EnginePool(model, **engine_overrides)
    engine = pool.get(policy, budget)
    priorities = _priorities(trace, policy)

    # As the API server does, the bench tells the engine when each request's first visible
    # text is out (a special or partial first token shows nothing): TTFT counts to that.
    visible = FirstVisibleText(_tokenizer(model))

    structured = structured_params(constraint)

    def make(tr: TraceRequest, req_id: str) -> Request:
        constrained = constrains(constraint, tr.tier)
        request = Request(request_id=req_id, prompt_token_ids=list(tr.prompt_token_ids),
                          sampling_params=SamplingParams(
                              max_tokens=tr.output_tokens, temperature=0.0, ignore_eos=True,
                              structured_outputs=structured if constrained else None),
                          ttft_slo_ms=tr.ttft_slo_ms, tpot_slo_ms=tr.tpot_slo_ms,
                          priority=priorities.get(tr.tier, 0),
                          reports_first_output=tr.ttft_slo_ms is not None)
        visible.add(request)
        return request

    try:
        if structured is not None:
            # The vocabulary's description (a server builds it before it reports ready:
            # engine/ipc/core_process.py) and the kind's schema, as the HTTP runner's warm-up
            # compiles it (attainment.constraints): compile builds both.
            engine.grammars.compile(structured)
        if engine.scheduler.step_id == 0:
            # Warm-up outside the measurement: first-call allocations and kernel selection.
            engine.add_request(make(trace.requests[0], "warmup"))
            while engine.has_unfinished_requests():
                engine.step()
        before = engine.stats()
        submitted: list[tuple[TraceRequest, Request]] = []
        start = time.monotonic()

        def submit_on_schedule() -> None:
            for tr in trace.requests:
                delay = start + tr.arrival_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                request = make(tr, tr.request_id)
                request.arrival_time = time.monotonic()
                engine.submit_request(request)
                submitted.append((tr, request))

        submitter = threading.Thread(target=submit_on_schedule, name="bench-arrivals",
                                     daemon=True)
        submitter.start()
        bar = tqdm(total=len(trace.requests), desc=f"{policy.name} @ {budget}",
                   disable=not progress, leave=False)
        while submitter.is_alive() or engine.has_unfinished_requests():
            if engine.has_unfinished_requests():
                outputs = engine.step()
                for req_id in visible.shown(outputs, time.monotonic()):
                    engine.note_first_output(req_id, visible.times[req_id])
                bar.update(sum(1 for o in outputs if o.finish_reason is not None))
            else:
                time.sleep(0.0005)
        bar.close()
        stats = engine.stats()
    finally:
        if own_pool:
            pool.close()

    results = [_inprocess_result(tr, r, start, visible.times.get(r.request_id))
               for tr, r in submitted]
    end = max((r.finish_time or start) for _, r in submitted)
    workload, rate, seed = _meta(trace)
    return RunResult(
        runner="inprocess", policy=labelled(policy.name, constraint), budget=budget,
        workload=workload, rate=rate, seed=seed,
        duration_s=end - (start + trace.requests[0].arrival_s), requests=results,
        engine={"num_preemptions_kv": stats.num_kv_preemptions - before.num_kv_preemptions,
                "num_preemptions_slo": stats.num_slo_preemptions - before.num_slo_preemptions,
                "wasted_tokens": stats.slo_preempt_wasted_tokens - before.slo_preempt_wasted_tokens,
                "computed_tokens": stats.num_scheduled_tokens - before.num_scheduled_tokens})


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


class FirstVisibleText:
    """Detokenizes each request's output as a client would see it, to tell when its first
    non-empty text is out."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._waiting: dict[str, Any] = {}
        # Request id -> when its first text was out (time.monotonic()).
        self.times: dict[str, float] = {}

    def add(self, request: Any) -> None:
        from engine.processing.detokenizer import IncrementalDetokenizer

        if request.reports_first_output:
            self._waiting[request.request_id] = IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids)

    def shown(self, outputs: list[Any], now: float) -> list[str]:
        """The requests whose first text is in these outputs, received at `now` (or that
        finished without any: nothing more will come)."""
        shown = []
        for out in outputs:
            detokenizer = self._waiting.get(out.req_id)
            if detokenizer is None:
                continue
            detokenizer.update(out.new_token_ids)
            if detokenizer.output_text or out.finish_reason is not None:
                del self._waiting[out.req_id]
                self.times[out.req_id] = now
                shown.append(out.req_id)
        return shown


def _inprocess_result(tr: TraceRequest, request: Any, start: float,
                      first_text_at: float | None = None) -> RequestResult:
    # The first visible output where the bench saw one (else the engine's first token).
    first = first_text_at or request.first_token_time
    ttft = first - request.arrival_time if first is not None else None
    e2e = request.finish_time - request.arrival_time if request.finish_time is not None else None
    n = request.num_output_tokens
    tpot = RequestResult.tpot_from(ttft, e2e, n)
    return RequestResult(request_id=tr.request_id, tier=tr.tier,
                         arrival_s=request.arrival_time - start,
                         prompt_tokens=len(tr.prompt_token_ids), output_tokens=n,
                         ttft_slo_ms=tr.ttft_slo_ms, tpot_slo_ms=tr.tpot_slo_ms, ttft_s=ttft,
                         e2e_s=e2e, tpot_s=tpot, num_preemptions=request.num_preemptions,
                         error=None if ttft is not None else "no token",
                         slack_at_admission_ms=(None if request.slack_at_admission_s is None
                                                else 1000 * request.slack_at_admission_s))


# ---- over HTTP ------------------------------------------------------------------------------

# Engine counters of a sloserve server, as RunResult.engine reports them over a run.
_COUNTERS = {
    "num_preemptions_kv": ("sloserve:num_preemptions_total", 'reason="kv"'),
    "num_preemptions_slo": ("sloserve:num_preemptions_total", 'reason="slo"'),
    "wasted_tokens": ("sloserve:slo_preempt_wasted_tokens_total", ""),
    "computed_tokens": ("sloserve:scheduled_tokens_total", ""),
}


def parse_engine_counters(metrics_text: str) -> dict[str, int]:
    """The engine-side counters a run reports, from a sloserve server's Prometheus text; {} for
    another server (a peer's counters under other names are not sloserve's)."""
    if not re.search(r"^sloserve:", metrics_text, re.MULTILINE):
        return {}
    found = {key: 0 for key in _COUNTERS}
    for line in metrics_text.splitlines():
        for key, (name, label) in _COUNTERS.items():
            if re.match(rf"{re.escape(name)}[{{ ]", line) and label in line:
                found[key] = int(float(line.rsplit(" ", 1)[1]))
    return found


def server_counter(metrics_text: str, name: str) -> int | None:
    """A counter any server may export under its own prefix (`<prefix>:<name>_total`, as
    sloserve's and vLLM's `request_success` and `prefix_cache_hits`), summed over its labels;
    None when the server exports no such counter. A server that exports it under several
    prefixes (sloserve serves vLLM's names beside its own, one observation feeding both) is
    counted under the first one only."""
    total, prefix = 0.0, None
    pattern = re.compile(rf"([a-zA-Z_]\w*):{re.escape(name)}_total[{{ ]")
    for line in metrics_text.splitlines():
        match = pattern.match(line)
        if match and prefix in (None, match.group(1)):
            prefix = match.group(1)
            total += float(line.rsplit(" ", 1)[1])
    return int(total) if prefix is not None else None


# What every run records of a server's own counters, whichever server it is (RunResult.engine):
# probes that the run's requests reached it, and that none found its prompt in the prefix cache.
_SERVER_COUNTERS = {"server_finished_requests": "request_success",
                    "server_prefix_cache_hit_tokens": "prefix_cache_hits"}


async def served_model_name(url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models (vLLM serves a model under its path unless
    started with --served-model-name)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0) as client:
        response = await client.get("/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


async def _one_http(client: Any, tr: TraceRequest, start: float, priority: int,
                    model_name: str | None, salt: Sequence[int] = (),
                    constraint: str = "none") -> RequestResult:
    delay = start + tr.arrival_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    prompt = salted(tr.prompt_token_ids, salt)
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": tr.output_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}, "priority": priority}
    if constrains(constraint, tr.tier):
        body.update(http_fields(constraint))
    if model_name:
        body["model"] = model_name
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        if getattr(tr, name) is not None:
            body[name] = getattr(tr, name)
    sent = time.monotonic()
    first: float | None = None
    output_tokens, error = 0, None
    last, max_gap = 0.0, 0.0  # the longest wait between two chunks carrying text
    metrics: dict[str, Any] = {}  # the engine's per-request metrics, on the finishing chunk
    replica, status, predicted_ms, routed_ms = None, None, None, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            replica = response.headers.get("x-sloserve-replica")
            routed_ms = _float_header(response.headers.get("x-sloserve-predicted-ttft-ms"))
            if response.status_code != 200:
                status = response.status_code
                text = (await response.aread()).decode()
                error = f"HTTP {response.status_code}: {text[:200]}"
                predicted_ms = _rejected_prediction(text) if status == 429 else None
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = str(chunk["error"])
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        now = time.monotonic()
                        if first is None:
                            first = now
                        else:
                            max_gap = max(max_gap, now - last)
                        last = now
                    if chunk.get("metrics"):
                        metrics = chunk["metrics"]
                    if chunk.get("usage"):
                        output_tokens = int(chunk["usage"]["completion_tokens"])
    except Exception as exc:  # a broken connection is a failed request, not a failed run
        error = f"{type(exc).__name__}: {exc}"
    finished = time.monotonic()
    ttft = first - sent if first is not None else None
    e2e = finished - sent if error is None else None
    tpot = RequestResult.tpot_from(ttft, e2e, output_tokens)
    return RequestResult(request_id=tr.request_id, tier=tr.tier, arrival_s=sent - start,
                         prompt_tokens=len(prompt), output_tokens=output_tokens,
                         ttft_slo_ms=tr.ttft_slo_ms, tpot_slo_ms=tr.tpot_slo_ms, ttft_s=ttft,
                         e2e_s=e2e, tpot_s=tpot,
                         num_preemptions=int(metrics.get("num_preemptions") or 0), error=error,
                         slack_at_admission_ms=metrics.get("slack_at_admission_ms"),
                         server_ttft_s=(metrics["ttft_ms"] / 1000.0
                                        if metrics.get("ttft_ms") is not None else None),
                         max_stream_gap_s=max_gap if first is not None and output_tokens > 1
                         else None,
                         replica=replica, http_status=status,
                         rejected_predicted_ttft_ms=predicted_ms,
                         routed_predicted_ttft_ms=routed_ms)


def _float_header(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def _rejected_prediction(body: str) -> float | None:
    """The predicted TTFT (ms) a fleet's 429 carries (`error.predicted_ttft_ms`; see
    engine/fleet/ingress.py), None from another server's."""
    try:
        value = json.loads(body)["error"]["predicted_ttft_ms"]
    except (ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


async def run_http_async(trace: Trace, url: str, policy: PolicySpec, budget: int,
                         api_key: str | None = None, model_name: str | None = None,
                         progress: bool = True, label: str | None = None,
                         salt_tokens: int = PREFIX_SALT_TOKENS,
                         constraint: str = "none") -> RunResult:
    """Replay `trace` against the server at `url`. `label` names the run in place of the
    policy's name (a peer server's name: its own settings, not `policy`, run it); every prompt
    starts with `salt_tokens` fresh salt tokens in place of its own (see the module docstring;
    0: none); `constraint`: what the urgent tier's requests carry (attainment.constraints)."""
    check_constraint(constraint)
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    priorities = _priorities(trace, policy)
    salts = PrefixSalts((r.prompt_token_ids for r in trace.requests), salt_tokens)
    limits = httpx.Limits(max_connections=len(trace.requests) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None,
                                 limits=limits) as client:
        # Warm-up outside the measurement, as the in-process runner does: a fresh server's
        # first steps pay first-call allocations and kernel selection. Salted like the rest, so
        # that it leaves nothing in a prefix cache for the first request to find.
        warmup = trace.requests[0]
        response = await client.post("/v1/completions", json={
            "prompt": salted(warmup.prompt_token_ids, salts.draw()),
            "max_tokens": warmup.output_tokens, "temperature": 0, "ignore_eos": True,
            # The kind's schema compiles here, outside the measurement (attainment.constraints).
            **http_fields(constraint),
            **({"model": model_name} if model_name else {})})
        if response.status_code != 200:
            raise RuntimeError(f"{url}: the warm-up request failed with HTTP "
                               f"{response.status_code}: {response.text[:300]}")
        metrics_before = (await client.get("/metrics")).text
        before = parse_engine_counters(metrics_before)
        # Drawn before the clock starts: what each request sends is fixed up front.
        # One salt per session: its turns share their history's prefix, as a user's would.
        session_salts: dict[str, list[int]] = {}
        request_salts: dict[str, list[int]] = {}
        for tr in trace.requests:
            if tr.session is None:
                request_salts[tr.request_id] = salts.draw()
            else:
                if tr.session not in session_salts:
                    session_salts[tr.session] = salts.draw()
                request_salts[tr.request_id] = session_salts[tr.session]
        start = time.monotonic()
        bar = tqdm(total=len(trace.requests),
                   desc=f"{labelled(label or policy.name, constraint)} @ {budget} (http)",
                   disable=not progress, leave=False)

        async def tracked(tr: TraceRequest) -> RequestResult:
            result = await _one_http(client, tr, start, priorities.get(tr.tier, 0), model_name,
                                     request_salts[tr.request_id], constraint)
            bar.update()
            return result

        results = await asyncio.gather(*(tracked(tr) for tr in trace.requests))
        bar.close()
        end = time.monotonic()
        metrics_after = (await client.get("/metrics")).text
        after = parse_engine_counters(metrics_after)
    engine: dict[str, Any] = {k: after[k] - before[k] for k in after if k in before}
    for key, name in _SERVER_COUNTERS.items():
        counted = (server_counter(metrics_before, name), server_counter(metrics_after, name))
        if None not in counted:
            engine[key] = counted[1] - counted[0]
    workload, rate, seed = _meta(trace)
    return RunResult(runner="http", policy=labelled(label or policy.name, constraint),
                     budget=budget,
                     workload=workload, rate=rate, seed=seed,
                     duration_s=end - (start + trace.requests[0].arrival_s),
                     requests=list(results), engine=engine,
                     meta={"url": url, "model_name": model_name,
                           "prefix_salt_tokens": salt_tokens})


def run_http(trace: Trace, url: str, policy: PolicySpec, budget: int, **kwargs: Any
             ) -> RunResult:
    return asyncio.run(run_http_async(trace, url, policy, budget, **kwargs))
