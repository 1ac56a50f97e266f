"""`sloserve bench run --busy N`: every replay twice, on the machine as it is (quiet) and then
beside N busy neighbours (engine/benchmarks/measure/busy_neighbours.py), and the two side by
side.

The neighbours start before the server (or the in-process runner's engines) does and stop after
it has stopped, so a server's startup calibration times its steps under the load, as a user's
server on a busy machine would. Each run records how many neighbours it had (`RunResult.busy`)
and what the window held (`meta["busy_load"]`: the neighbours' CPU seconds, the machine's CPU use
and load average), the quiet run too: on a shared machine "quiet" is whatever else was running,
and its report shows it.

`side_by_side` prints one table per trace with a column per (policy, budget) and busy count: each
tier's TTFT attainment (met/total) and TTFT p50 / p99, failures, and the load probe.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine.benchmarks.attainment.results import (RunResult, format_met, format_number,
                                                  markdown_table, summarize)
from engine.benchmarks.attainment.traces import Trace
from engine.benchmarks.measure.busy_neighbours import busy_neighbours

# How much slower than its isolated prefills a replay may run beside the neighbours before they
# stop by themselves (their bound is a safety net for a crashed benchmark, not a measurement:
# a neighbour that ends before its replay does is counted in the report as `ended_early`).
SLOWDOWN_ALLOWANCE = 8.0
# Room for each server's start and stop (model load and startup calibration), in seconds.
STARTUP_ALLOWANCE_S = 300.0


def neighbour_limit_s(trace: Trace, predict_ttft_s: Callable[[int], float],
                      replays: int = 1) -> float:
    """How long neighbours may spin for `replays` replays of `trace` on one server: its start,
    and per replay the trace's span plus SLOWDOWN_ALLOWANCE times its isolated work (each
    request's prompt and output as one prefill: a generous stand-in for its decode)."""
    span = max((r.arrival_s for r in trace.requests), default=0.0)
    work = sum(predict_ttft_s(len(r.prompt_token_ids) + r.output_tokens)
               for r in trace.requests)
    return STARTUP_ALLOWANCE_S + replays * (span + SLOWDOWN_ALLOWANCE * work + 60.0)


def quiet_and_busy(replay: Callable[[int], list[RunResult]], busy: int,
                   limit_s: float) -> list[RunResult]:
    """`replay(n)` (a server or engines started, the trace replayed, all stopped) once quiet and
    once beside `busy` neighbours, each labelled with its neighbours and their report. `busy` 0:
    one replay, as without --busy (no report)."""
    if busy == 0:
        return replay(0)
    runs: list[RunResult] = []
    for neighbours in (0, busy):
        print("quiet" if neighbours == 0 else f"beside {neighbours} busy neighbours",
              file=sys.stderr)
        with busy_neighbours(neighbours, limit_s) as load:
            made = replay(neighbours)
        assert load.report is not None
        report = load.report.as_dict()
        for run in made:
            run.busy = neighbours
            run.meta["busy_load"] = report
        runs += made
    return runs


def _tiers(group: Sequence[RunResult]) -> list[str]:
    """The tiers of the runs, tightest median TTFT objective first (no objective: last)."""
    objectives: dict[str, float] = {}
    for run in group:
        for tier, s in summarize(run)["tiers"].items():
            slo = s.get("median_ttft_slo_ms")
            objectives[tier] = min(objectives.get(tier, float("inf")),
                                   float("inf") if slo is None else slo)
    return sorted(objectives, key=lambda t: (objectives[t], t))


def column_name(run: RunResult) -> str:
    where = "quiet" if run.busy == 0 else f"busy {run.busy}"
    return f"{run.policy} @ {run.budget}, {where}"


def _bound_met(bound: dict[str, Any] | None, tier: str, run: RunResult) -> str:
    """The clairvoyant bound's met/total for `tier`, costed by the server's own step model
    (`meta["clairvoyant_server_line"]`); '–' where there is none (a quiet run, a peer)."""
    share = (bound or {}).get("tiers", {}).get(tier)
    if share is None:
        return "–"
    total = sum(1 for r in run.requests if r.tier == tier and r.ttft_slo_ms is not None)
    return format_met(round(share * total), total)


def _load(run: RunResult, key: str) -> Any:
    return (run.meta.get("busy_load") or {}).get(key)


def side_by_side(runs: Sequence[RunResult]) -> str:
    """One Markdown table per trace (workload, rate, seed) with busy runs: a row per figure, a
    column per run in the order they were made; '' when no run had neighbours."""
    if not any(r.busy for r in runs):
        return ""
    traces: dict[tuple[str, float, int], list[RunResult]] = {}
    for run in runs:
        traces.setdefault((run.workload, run.rate, run.seed), []).append(run)
    parts = []
    for (workload, rate, seed), group in traces.items():
        sums = [summarize(r) for r in group]
        rows: list[tuple[str, list[str]]] = []
        for tier in _tiers(group):
            rows.append((f"{tier} TTFT attainment (met/total)",
                         [format_met(s["tiers"].get(tier, {}).get("num_slo_met"),
                                 s["tiers"].get(tier, {}).get("num_slo_requests"))
                          for s in sums]))
        bounds = [r.meta.get("clairvoyant_server_line") for r in group]
        if any(bounds):
            for tier in _tiers(group):
                rows.append((f"{tier}: the bound on the server's own step model (met/total)",
                             [_bound_met(b, tier, r) for b, r in zip(bounds, group)]))
        for tier in _tiers(group):
            rows.append((f"{tier} TTFT p50 / p99 (ms)",
                         [" / ".join(format_number(s["tiers"].get(tier, {}).get(k))
                                     for k in ("median_ttft_ms", "p99_ttft_ms"))
                          for s in sums]))
        rows += [
            ("failed", [str(s["failed"]) for s in sums]),
            ("busy processes' CPU s (share of their wall time)",
             [f"{format_number(_load(r, 'cpu_s'), 1)} "
              f"({format_number(100 * (_load(r, 'cpu_share') or 0))}%)"
              if r.busy else "–" for r in group]),
            ("machine CPU use over the window (%)",
             [format_number(_load(r, "machine_cpu_percent")) for r in group]),
            ("load average (1 min) at the end",
             [format_number(_load(r, "load_avg_1m_end"), 2) for r in group]),
            ("window (s)", [format_number(_load(r, "wall_s")) for r in group]),
        ]
        defaults = any(r.meta.get("server_defaults") for r in group)
        parts.append(markdown_table(
            f"{workload} at {rate:g} req/s, seed {seed}: quiet, then beside busy "
            f"neighbours{' (servers on their own defaults)' if defaults else ''}",
            ["", *(column_name(r) for r in group)], rows))
    return "\n".join(parts)


BUSY_NOTES = (
    "Each replay ran twice: quiet (the machine as it was), then beside N busy neighbours "
    "(processes each spinning on one core), started before the server and stopped after it, "
    "so its startup calibration ran under the load. TTFT is timed by the client at the first "
    "streamed chunk carrying text (over HTTP). busy processes' CPU s: what the neighbours "
    "consumed (the kernel's accounting), and its share of their wall time x N; machine CPU "
    "use: all cores, over the same window (a quiet window's shows what else ran). The bound "
    "on the server's own step model: the clairvoyant bound (preemptive EDF on the prefill "
    "work alone) costed by the step model the busy server held at the end of its replay "
    "(/debug/stats: its startup calibration under the load, refined by the steps it served): "
    "what any scheduler could meet on the machine as it was then.\n")
