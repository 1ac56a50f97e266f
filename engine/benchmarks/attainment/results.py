"""Result schema of a benchmark run, its summary metrics, and paired aggregation over seeds.

Both runners (in-process and HTTP) fill the same `RunResult`; everything downstream (JSON,
Markdown table, plots) reads only this schema. Metric keys follow `vllm bench serve`
(`mean_ttft_ms`, `p99_ttft_ms`, `request_goodput`, ...) so the numbers can be compared directly.

Conventions (the ones a reader of the numbers needs):
- A request *failed* when it has an error or never produced a token (`ttft_s is None`). Failed
  requests are left out of latency and throughput figures, as in vLLM, but count as *missed* for
  every objective they carry: a scheduler must not look better by dropping requests.
- A request may carry a TTFT SLO (`ttft_slo_ms`) and a TPOT objective (`tpot_slo_ms`). TPOT is
  the mean gap after the first token, `(e2e - ttft) / (output_tokens - 1)`, and meets its
  objective when within it; a one-token output has no gap to miss (the engine's test).
- `ttft_slo_attainment` / `tpot_slo_attainment` are over the requests that carry that objective
  only; None when none does.
- A request is *good* when it completed and met every objective it carries, as
  `vllm bench serve --goodput ttft:X tpot:Y` defines it (no objective: completing is all that was
  asked). `goodput_attainment` is the share of all requests that are good, `request_goodput` the
  good requests per second of run duration.
- Per-tier throughputs divide by the whole run's duration, so tiers add up to the overall figure.
- Percentiles are numpy's default linear interpolation, as `vllm bench serve` computes them.

`RunResult.figure_records` is a finished run as JSON lines (`request` records, then the `run`
with its summary): `sloserve bench run` appends them to OUTPUT_DIR/results.jsonl as each run
ends, before results.json is written at the end.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.benchmarks.measure.stats import percentile


@dataclass
class RequestResult:
    request_id: str
    tier: str
    arrival_s: float  # offset from run start when it was sent/submitted
    prompt_tokens: int
    output_tokens: int  # tokens actually generated
    ttft_slo_ms: float | None
    ttft_s: float | None  # None: failed / no token
    e2e_s: float | None
    tpot_s: float | None  # (e2e - ttft) / (output_tokens - 1) when output_tokens > 1
    num_preemptions: int = 0
    error: str | None = None
    # Deadline - admission time - predicted TTFT, in ms, as the engine reports it (None without
    # a TTFT SLO, or from a server that does not report it).
    slack_at_admission_ms: float | None = None
    tpot_slo_ms: float | None = None  # None: no TPOT objective
    # HTTP runs: the server's own TTFT (its `metrics.ttft_ms`), to set beside the client's, and
    # the longest wait between two streamed chunks carrying text (None: fewer than two).
    server_ttft_s: float | None = None
    max_stream_gap_s: float | None = None
    # HTTP runs: the replica that served it (a fleet's `x-sloserve-replica` header), the HTTP
    # status when it was not 200, and the predicted TTFT a 429 of a fleet's admission carried.
    replica: str | None = None
    http_status: int | None = None
    rejected_predicted_ttft_ms: float | None = None
    # A fleet's: the router's predicted TTFT on the replica it chose, when it chose it
    # (`x-sloserve-predicted-ttft-ms`): a miss it did not foresee is the routing decision's.
    routed_predicted_ttft_ms: float | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None or self.ttft_s is None

    @property
    def slo_met(self) -> bool | None:
        """The TTFT SLO: None when the request has none; False when it failed. Same test as the
        engine's."""
        if self.ttft_slo_ms is None:
            return None
        if self.failed:
            return False
        assert self.ttft_s is not None
        return self.ttft_s * 1000.0 <= self.ttft_slo_ms

    @property
    def tpot_slo_met(self) -> bool | None:
        """The TPOT objective: None when the request has none; False when it failed. Same test as
        the engine's: the mean gap after the first token within it (one token: no gap)."""
        if self.tpot_slo_ms is None:
            return None
        if self.failed:
            return False
        return self.tpot_s is None or self.tpot_s * 1000.0 <= self.tpot_slo_ms

    @property
    def good(self) -> bool:
        """Completed and met every objective it carries (vLLM's goodput)."""
        return not self.failed and self.slo_met is not False and self.tpot_slo_met is not False

    @staticmethod
    def tpot_from(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
        """Time per output token after the first, for runners to fill `tpot_s` consistently."""
        if ttft_s is None or e2e_s is None or output_tokens <= 1:
            return None
        return (e2e_s - ttft_s) / (output_tokens - 1)


@dataclass
class RunResult:
    runner: str  # "inprocess" | "http"
    policy: str  # label, e.g. "fcfs", "slo+mf-conservative-pause"
    budget: int  # max_num_batched_tokens
    workload: str
    rate: float
    seed: int
    duration_s: float  # first arrival to last finish
    requests: list[RequestResult]
    # {"num_preemptions_kv", "num_preemptions_slo", "wasted_tokens", "computed_tokens"}; computed
    # counts every token scheduled, wasted included. May be {} when the runner cannot know.
    engine: dict[str, Any] = field(default_factory=dict)
    # Output of engine.benchmarks.attainment.clairvoyant.clairvoyant_attainment on this run's trace
    # (same for every
    # policy on it); aggregate() reports it beside the measured attainment. None: not computed.
    clairvoyant: dict[str, Any] | None = None
    # Free-form provenance (model, trace file, predictor line, command line, ...).
    meta: dict[str, Any] = field(default_factory=dict)
    # Busy neighbours beside the server or engine (`sloserve bench run --busy N`): 0 for a
    # quiet run; what they consumed is in meta["busy_load"] (measure/busy_neighbours.py).
    busy: int = 0

    def to_json(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    def cell(self) -> dict[str, Any]:
        """What tells this run from the others of one invocation."""
        return {"runner": self.runner, "policy": self.policy, "budget": self.budget,
                "workload": self.workload, "rate": self.rate, "seed": self.seed,
                "busy": self.busy}

    def figure_records(self) -> list[tuple[str, dict[str, Any]]]:
        """The run as JSON-lines records (engine/benchmarks/measure/figures.py), written as it ends so that
        a
        benchmark killed later keeps it: a `request` per request (its cell's fields beside
        its own), then the `run` (as in results.json, its `summary` included, the requests
        left to their own lines)."""
        cell = self.cell()
        records: list[tuple[str, dict[str, Any]]] = [
            ("request", {**cell, **json_safe(asdict(r))}) for r in self.requests]
        run = {k: v for k, v in self.to_json().items() if k != "requests"}
        records.append(("run", {**run, "num_requests": len(self.requests),
                                "summary": summarize(self)}))
        return records

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        d = dict(data)
        d.pop("summary", None)  # write_json stores summarize() beside the raw run
        d["requests"] = [RequestResult(**r) for r in d["requests"]]
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# Per-run summary


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _per_s(count: float, duration_s: float) -> float | None:
    return count / duration_s if duration_s > 0 else None


def _summarize_requests(reqs: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in reqs if not r.failed]
    ttfts_ms = [r.ttft_s * 1000.0 for r in done if r.ttft_s is not None]
    tpots_ms = [r.tpot_s * 1000.0 for r in done if r.tpot_s is not None and r.output_tokens > 1]
    e2els_ms = [r.e2e_s * 1000.0 for r in done if r.e2e_s is not None]
    with_slo = [r for r in reqs if r.ttft_slo_ms is not None]
    met = sum(1 for r in with_slo if r.slo_met)
    with_tpot = [r for r in reqs if r.tpot_slo_ms is not None]
    tpot_met = sum(1 for r in with_tpot if r.tpot_slo_met)
    good = sum(1 for r in reqs if r.good)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    # Client minus server TTFT (HTTP runs): what the client saw that the server's clock missed.
    ttft_skews_ms = [(r.ttft_s - r.server_ttft_s) * 1000.0 for r in done
                     if r.ttft_s is not None and r.server_ttft_s is not None]
    gaps_ms = [r.max_stream_gap_s * 1000.0 for r in done if r.max_stream_gap_s is not None]
    return {
        "num_requests": len(reqs),
        "completed": len(done),
        "failed": len(reqs) - len(done),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": _per_s(len(done), duration_s),
        "output_throughput": _per_s(output_tokens, duration_s),
        "total_token_throughput": _per_s(input_tokens + output_tokens, duration_s),
        "mean_ttft_ms": _mean(ttfts_ms),
        "median_ttft_ms": percentile(ttfts_ms, 50),
        "p90_ttft_ms": percentile(ttfts_ms, 90),
        "p99_ttft_ms": percentile(ttfts_ms, 99),
        "mean_tpot_ms": _mean(tpots_ms),
        "median_tpot_ms": percentile(tpots_ms, 50),
        "p99_tpot_ms": percentile(tpots_ms, 99),
        "mean_e2el_ms": _mean(e2els_ms),
        "median_e2el_ms": percentile(e2els_ms, 50),
        "p99_e2el_ms": percentile(e2els_ms, 99),
        "num_slo_requests": len(with_slo),
        "num_slo_met": met,
        "ttft_slo_attainment": met / len(with_slo) if with_slo else None,
        # The tier's typical objective, so a report can tell which tier is the urgent one.
        "median_ttft_slo_ms": percentile([r.ttft_slo_ms for r in with_slo
                                          if r.ttft_slo_ms is not None], 50),
        "num_tpot_slo_requests": len(with_tpot),
        "num_tpot_slo_met": tpot_met,
        "tpot_slo_attainment": tpot_met / len(with_tpot) if with_tpot else None,
        "median_tpot_slo_ms": percentile([r.tpot_slo_ms for r in with_tpot
                                          if r.tpot_slo_ms is not None], 50),
        "median_server_ttft_ms": percentile([r.server_ttft_s * 1000.0 for r in done
                                             if r.server_ttft_s is not None], 50),
        "median_ttft_client_minus_server_ms": percentile(ttft_skews_ms, 50),
        "max_abs_ttft_client_minus_server_ms": (max(abs(x) for x in ttft_skews_ms)
                                                if ttft_skews_ms else None),
        # Each request's longest wait between two streamed chunks, over the requests.
        "median_max_stream_gap_ms": percentile(gaps_ms, 50),
        "p99_max_stream_gap_ms": percentile(gaps_ms, 99),
        "max_stream_gap_ms": max(gaps_ms) if gaps_ms else None,
        "num_good": good,
        "goodput_attainment": good / len(reqs) if reqs else None,
        "request_goodput": _per_s(good, duration_s),
        "num_preemptions": sum(r.num_preemptions for r in reqs),
    }


def summarize(run: RunResult) -> dict[str, Any]:
    """Overall and per-tier metrics of one run (see the module docstring for conventions)."""
    out = _summarize_requests(run.requests, run.duration_s)
    del out["median_ttft_slo_ms"], out["median_tpot_slo_ms"]  # only meaningful per tier
    eng = run.engine or {}
    out["num_preemptions_kv"] = eng.get("num_preemptions_kv")
    out["num_preemptions_slo"] = eng.get("num_preemptions_slo")
    wasted, computed = eng.get("wasted_tokens"), eng.get("computed_tokens")
    out["wasted_tokens"] = wasted
    out["computed_tokens"] = computed
    out["wasted_tokens_share"] = (wasted / computed
                                  if wasted is not None and computed else None)
    tiers: dict[str, list[RequestResult]] = {}
    for r in run.requests:
        tiers.setdefault(r.tier, []).append(r)
    out["tiers"] = {t: _summarize_requests(rs, run.duration_s) for t, rs in sorted(tiers.items())}
    return json_safe(out)


# ---------------------------------------------------------------------------------------------
# Paired aggregation over seeds

# Overall metrics reported per cell (median and range over seeds) and paired against baseline.
HEADLINE_METRICS: tuple[str, ...] = (
    "ttft_slo_attainment", "tpot_slo_attainment", "goodput_attainment", "request_goodput",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "total_token_throughput",
    "output_throughput", "wasted_tokens_share", "num_preemptions_slo", "num_preemptions_kv",
    "median_server_ttft_ms", "median_ttft_client_minus_server_ms",
    "max_abs_ttft_client_minus_server_ms", "p99_max_stream_gap_ms", "max_stream_gap_ms",
)
# Per-tier metrics reported per cell.
TIER_METRICS: tuple[str, ...] = (
    "ttft_slo_attainment", "tpot_slo_attainment", "goodput_attainment", "median_ttft_ms",
    "median_server_ttft_ms", "p99_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_ttft_slo_ms", "median_tpot_slo_ms",
    "mean_e2el_ms",
)
# Per-tier metrics also paired against the baseline.
TIER_DIFF_METRICS: tuple[str, ...] = ("ttft_slo_attainment", "tpot_slo_attainment",
                                      "goodput_attainment")


def stat(values: Iterable[float | None]) -> dict[str, float] | None:
    """Median and range of the known values; None when no value is known."""
    vs = [float(v) for v in values if v is not None]
    if not vs:
        return None
    return {"median": float(statistics.median(vs)), "min": min(vs), "max": max(vs), "n": len(vs)}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# (runner, workload, rate, budget, policy, busy neighbours)
CellKey = tuple[str, str, float, int, str, int]


def aggregate(runs: list[RunResult], baseline_policy: str = "fcfs",
              clairvoyant: Mapping[tuple[str, float, int, int], Mapping[str, Any]] | None = None,
              ) -> list[dict[str, Any]]:
    """One dict per cell (runner, workload, rate, budget, policy, busy) over its seeds.

    Each metric is {"median", "min", "max", "n"} over seeds (None when unknown). `diff` holds the
    per-seed differences (cell minus baseline) against the `baseline_policy` cell with the same
    runner, workload, rate and budget, paired by seed — paired because seeds share a trace, so
    trace-to-trace noise cancels; None for the baseline cell itself or when it is missing.
    The clairvoyant bound (on TTFT-SLO attainment only: it simulates prefill, not decode) comes
    from each run's `clairvoyant` field, or from `clairvoyant` keyed by (workload, rate, budget,
    seed) which takes precedence; `gap_to_clairvoyant` is the per-seed bound minus the measured
    TTFT-SLO attainment.
    """
    cells: dict[CellKey, dict[int, RunResult]] = {}
    summaries: dict[int, dict[str, Any]] = {}
    for run in runs:
        key = (run.runner, run.workload, run.rate, run.budget, run.policy, run.busy)
        by_seed = cells.setdefault(key, {})
        if run.seed in by_seed:
            raise ValueError(f"two runs for cell {key} with the same seed {run.seed}")
        by_seed[run.seed] = run
        summaries[id(run)] = summarize(run)

    def bound(run: RunResult) -> Mapping[str, Any] | None:
        if clairvoyant is not None:
            b = clairvoyant.get((run.workload, run.rate, run.budget, run.seed))
            if b is not None:
                return b
        return run.clairvoyant

    out: list[dict[str, Any]] = []
    for key, by_seed in cells.items():
        runner, workload, rate, budget, policy, busy = key
        seeds = sorted(by_seed)
        sums = [summaries[id(by_seed[s])] for s in seeds]
        tiers = sorted({t for s in sums for t in s["tiers"]})
        cell: dict[str, Any] = {
            "runner": runner, "workload": workload, "rate": rate, "budget": budget,
            "policy": policy, "busy": busy, "num_seeds": len(seeds), "seeds": seeds,
            "metrics": {m: stat(s.get(m) for s in sums) for m in HEADLINE_METRICS},
            "tiers": {t: {m: stat(s["tiers"].get(t, {}).get(m) for s in sums)
                          for m in TIER_METRICS} for t in tiers},
            "diff": None, "clairvoyant": None,
        }
        base = cells.get((runner, workload, rate, budget, baseline_policy, busy))
        if policy != baseline_policy and base is not None:
            paired = [s for s in seeds if s in base]
            bsums = {s: summaries[id(base[s])] for s in paired}
            mine = dict(zip(seeds, sums))
            cell["diff"] = {
                "baseline": baseline_policy, "seeds": paired,
                "metrics": {m: stat(_diff(mine[s].get(m), bsums[s].get(m)) for s in paired)
                            for m in HEADLINE_METRICS},
                "tiers": {t: {m: stat(_diff(mine[s]["tiers"].get(t, {}).get(m),
                                            bsums[s]["tiers"].get(t, {}).get(m))
                                      for s in paired)
                              for m in TIER_DIFF_METRICS} for t in tiers},
            }
        bounds = [(s, bound(by_seed[s])) for s in seeds]
        known = [(s, b) for s, b in bounds if b is not None]
        if known:
            mine = dict(zip(seeds, sums))
            cell["clairvoyant"] = {
                "ttft_slo_attainment": stat(b.get("ttft_slo_attainment") for _, b in known),
                "tiers": {t: stat(b.get("tiers", {}).get(t) for _, b in known) for t in tiers},
                "gap_to_clairvoyant": stat(
                    _diff(b.get("ttft_slo_attainment"), mine[s].get("ttft_slo_attainment"))
                    for s, b in known),
            }
        out.append(cell)
    # Baseline first within each (runner, workload, budget, rate, busy) group, then first-seen
    # order.
    order = {k: i for i, k in enumerate(cells)}
    out.sort(key=lambda c: (c["runner"], c["workload"], c["budget"], c["rate"], c["busy"],
                            c["policy"] != baseline_policy,
                            order[(c["runner"], c["workload"], c["rate"], c["budget"],
                                   c["policy"], c["busy"])]))
    return json_safe(out)


def json_safe(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, so a long sweep's output never fails to serialize."""
    if isinstance(obj, float):  # np.float64 included
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    return obj


def format_met(met: int | None, total: int | None) -> str:
    """A table cell: met/total (percent), or a dash where nothing carried the objective."""
    if not total:
        return "–"
    return f"{met}/{total} ({100.0 * (met or 0) / total:.0f}%)"


def format_number(value: float | None, digits: int = 0) -> str:
    """A table cell: the number, or a dash where there is none."""
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_table(title: str, head: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]
                 ) -> str:
    """A markdown table under its title: one row a figure, one column a run."""
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join([name, *cells]) + " |" for name, cells in rows]
    return "\n".join(lines) + "\n"
