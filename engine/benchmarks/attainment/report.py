"""Benchmark output: JSON results, a Markdown summary table, and PNG plots.

Reads only `engine.benchmarks.attainment.results` (RunResult and the cells of `aggregate`), so any
runner's output
renders the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on benchmark machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from engine.benchmarks.attainment.results import RunResult, json_safe, summarize  # noqa: E402


def write_json(path: str | Path, runs: Sequence[RunResult],
               aggregate: list[dict[str, Any]]) -> None:
    """Every run (raw requests plus its `summary`) and the aggregate cells, in one file."""
    doc = {"runs": [{**run.to_json(), "summary": summarize(run)} for run in runs],
           "aggregate": aggregate}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False))


def read_json(path: str | Path) -> tuple[list[RunResult], list[dict[str, Any]]]:
    doc = json.loads(Path(path).read_text())
    return [RunResult.from_json(r) for r in doc["runs"]], doc["aggregate"]


def _tightest_tier(cells: Sequence[dict[str, Any]], objective: str) -> str | None:
    best: tuple[float, str] | None = None
    for c in cells:
        for tier, ms in c["tiers"].items():
            slo = ms.get(objective)
            if slo is not None and (best is None or slo["median"] < best[0]):
                best = (slo["median"], tier)
    return None if best is None else best[1]


def urgent_tier(cells: Sequence[dict[str, Any]]) -> str | None:
    """The tier with the tightest typical SLO (e.g. `urgent` in mixed, `text` in flowprefill)."""
    return _tightest_tier(cells, "median_ttft_slo_ms")


def loosest_tier(cells: Sequence[dict[str, Any]]) -> str | None:
    """The tier with the loosest typical TTFT SLO (the documents of `burst`, `relaxed` of
    mixed): what preempting for the urgent ones delays."""
    best: tuple[float, str] | None = None
    for c in cells:
        for tier, ms in c["tiers"].items():
            slo = ms.get("median_ttft_slo_ms")
            if slo is not None and (best is None or slo["median"] > best[0]):
                best = (slo["median"], tier)
    return None if best is None else best[1]


def _completion_vs_baseline(cell: dict[str, Any], cells: Sequence[dict[str, Any]],
                            tier: str | None) -> str:
    """The tier's mean end-to-end latency against the baseline cell's (same runner, workload,
    rate and budget), as a signed percentage of the baseline's (medians over seeds)."""
    if tier is None or not cell["diff"]:
        return "–"
    base = next((c for c in cells if c["policy"] == cell["diff"]["baseline"]
                 and all(c.get(k) == cell.get(k)
                         for k in ("runner", "workload", "rate", "budget", "busy"))),
                None)
    mine = _get(cell, "tiers", tier, "mean_e2el_ms", "median")
    theirs = _get(base, "tiers", tier, "mean_e2el_ms", "median") if base else None
    if mine is None or not theirs:
        return "–"
    return f"{(mine / theirs - 1) * 100:+.1f}"


def tpot_tiers(cells: Sequence[dict[str, Any]]) -> list[str]:
    """The tiers whose requests carry a TPOT objective (e.g. `relaxed` in mixed), tightest
    first."""
    objectives: dict[str, float] = {}
    for c in cells:
        for tier, ms in c["tiers"].items():
            slo = ms.get("median_tpot_slo_ms")
            if slo is not None:
                objectives[tier] = min(slo["median"], objectives.get(tier, slo["median"]))
    return sorted(objectives, key=lambda t: (objectives[t], t))


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(s: dict[str, float] | None, scale: float = 1.0, digits: int = 1,
         signed: bool = False) -> str:
    """`median [min–max]` of a stat, or `–` when unknown; one value when all seeds agree."""
    if s is None:
        return "–"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    med, lo, hi = (f.format(s[k] * scale) for k in ("median", "min", "max"))
    return med if lo == hi else f"{med} [{lo}–{hi}]"


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


Column = tuple[str, Callable[[dict[str, Any]], str]]


def _tpot_columns(tiers: list[str]) -> list[Column]:
    """(header, cell) of the TPOT columns; none when no tier has a TPOT objective."""
    if not tiers:
        return []
    t = tiers[0]

    def overall(c: dict[str, Any]) -> str:
        return _fmt(_get(c, "metrics", "tpot_slo_attainment"), 100)

    def tier_attainment(c: dict[str, Any]) -> str:
        return _fmt(_get(c, "tiers", t, "tpot_slo_attainment"), 100)

    def tier_median(c: dict[str, Any]) -> str:
        return _fmt(_get(c, "tiers", t, "median_tpot_ms"))

    columns: list[Column] = [("TPOT %", overall)]
    if len(tiers) > 1:  # with one such tier, its attainment is the overall one
        columns.append((f"{t} TPOT %", tier_attainment))
    columns.append((f"{t} median TPOT (ms)", tier_median))
    return columns


# Printed under the table (summary.md): what the columns that are not plain latencies mean.
TABLE_NOTES = (
    "TTFT % / TPOT %: requests meeting that objective, of those carrying it. good %: requests "
    "that completed and met every objective they carry (TTFT and TPOT), as `vllm bench serve "
    "--goodput` counts them; goodput is those per second. Failed requests miss every objective. "
    "Δ: paired by seed against the baseline, in percentage points. E2E vs baseline: the mean "
    "end-to-end latency of the loosest tier (what preempting for the urgent ones delays), as a "
    "change from the baseline's. clairvoyant TTFT %: the "
    "TTFT-SLO attainment of preemptive EDF on the prefill work alone, a bound on TTFT only.\n")


def markdown_table(aggregate: list[dict[str, Any]], urgent: str | None = None) -> str:
    """One row per cell; attainment in %, Δ in percentage points against the baseline, paired
    by seed. `urgent` names the tier shown in its own column (default: tightest SLO). TPOT
    columns appear when some tier carries a TPOT objective: the overall attainment, the tightest
    such tier's when several have one, and that tier's median TPOT."""
    urgent = urgent or urgent_tier(aggregate)
    base = next((c["diff"]["baseline"] for c in aggregate if c["diff"]), "fcfs")
    # Runner, workload and busy-neighbour columns only when they vary, to keep the common table
    # narrow.
    extra = [k for k in ("runner", "workload", "busy")
             if len({c.get(k, 0) for c in aggregate}) > 1]
    u = urgent or "urgent"
    tpot = _tpot_columns(tpot_tiers(aggregate))
    loose = loosest_tier(aggregate)
    loose = None if loose == urgent else loose
    head = [*extra, "policy", "budget", "rate (req/s)", "seeds", "TTFT %", f"{u} TTFT %",
            *(name for name, _ in tpot), "good %", "goodput (req/s)", "p99 TTFT (ms)", "tok/s",
            "wasted %", f"Δ TTFT vs {base} (pp)", f"Δ {u} TTFT vs {base} (pp)",
            f"Δ good vs {base} (pp)", f"{loose or 'loosest tier'} E2E vs {base} (%)",
            "clairvoyant TTFT %"]
    rows = [head, ["---"] * len(head)]
    for c in aggregate:
        m = c["metrics"]
        rows.append([
            # Budget 0: a peer server's run (engine/benchmarks/attainment/peers.py), at its own
            # settings.
            *(str(c.get(k, 0)) for k in extra), c["policy"], str(c["budget"] or "own"),
            f"{c['rate']:g}",
            str(c["num_seeds"]),
            _fmt(m["ttft_slo_attainment"], 100),
            _fmt(_get(c, "tiers", u, "ttft_slo_attainment"), 100),
            *(cell(c) for _, cell in tpot),
            _fmt(m.get("goodput_attainment"), 100),
            _fmt(m["request_goodput"], digits=2),
            _fmt(m["p99_ttft_ms"], digits=0),
            _fmt(m["total_token_throughput"], digits=0),
            _fmt(m["wasted_tokens_share"], 100, digits=2),
            _fmt(_get(c, "diff", "metrics", "ttft_slo_attainment"), 100, signed=True),
            _fmt(_get(c, "diff", "tiers", u, "ttft_slo_attainment"), 100, signed=True),
            _fmt(_get(c, "diff", "metrics", "goodput_attainment"), 100, signed=True),
            _completion_vs_baseline(c, aggregate, loose),
            _fmt(_get(c, "clairvoyant", "ttft_slo_attainment"), 100),
        ])
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


# ---------------------------------------------------------------------------------------------
# Plots


def _label(c: dict[str, Any], varying: Sequence[str]) -> str:
    return " ".join([c["policy"], *(f"{k}={c.get(k, 0)}" for k in varying)])


def plot_attainment_vs_rate(aggregate: list[dict[str, Any]], path: str | Path) -> None:
    """Attainment vs request rate: one subplot for overall and one per tier, one line per
    policy (and budget/runner/workload when those vary), median with the min–max band over
    seeds; the clairvoyant bound dashed where known."""
    varying = [k for k in ("budget", "runner", "workload", "busy")
               if len({c.get(k, 0) for c in aggregate}) > 1]
    tiers = sorted({t for c in aggregate for t in c["tiers"]})
    panels: list[tuple[str, tuple[str, ...]]] = [("overall", ())]
    panels += [(t, ("tiers", t)) for t in tiers]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False,
                             sharey=True)
    lines: dict[str, list[dict[str, Any]]] = {}
    for c in aggregate:
        lines.setdefault(_label(c, varying), []).append(c)
    for ax, (title, prefix) in zip(axes[0], panels):
        bounds: dict[str, list[tuple[float, float]]] = {}
        for label, cells in lines.items():
            pts = []
            for c in sorted(cells, key=lambda c: c["rate"]):
                if prefix:  # a tier: cell["tiers"][t], bound["tiers"][t]
                    s = _get(c, *prefix, "ttft_slo_attainment")
                    b = _get(c, "clairvoyant", *prefix)
                else:
                    s = c["metrics"]["ttft_slo_attainment"]
                    b = _get(c, "clairvoyant", "ttft_slo_attainment")
                if s is not None:
                    pts.append((c["rate"], s["median"], s["min"], s["max"]))
                if b is not None:
                    # The bound is the trace's: the same quiet and busy.
                    bkey = " ".join(f"{k}={c.get(k, 0)}" for k in varying if k != "busy")
                    bounds.setdefault(bkey, []).append((c["rate"], b["median"]))
            if not pts:
                continue
            x, med, lo, hi = (np.array(v, dtype=float) for v in zip(*pts))
            (line,) = ax.plot(x, med * 100, marker="o", label=label)
            ax.fill_between(x, lo * 100, hi * 100, alpha=0.15, color=line.get_color())
        for bkey, pts in bounds.items():
            xs, ys = zip(*sorted(set(pts)))
            ax.plot(xs, np.array(ys) * 100, "k--", linewidth=1,
                    label=f"clairvoyant {bkey}".strip())
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT-SLO attainment (%)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))),
               fontsize="small", bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, values: list[float], total: int, label: str) -> None:
    """Empirical CDF over `total` requests: failed ones (not in `values`) keep it below 1."""
    if not values:
        return
    xs = np.sort(np.array(values))
    ax.step(xs, np.arange(1, len(xs) + 1) / total, where="post", label=label)


def plot_ttft_cdf(runs: Sequence[RunResult], path: str | Path, rate: float | None = None) -> None:
    """TTFT CDF per policy at one rate (default: the middle of the rates present), seeds pooled.
    Left: TTFT in ms; right: TTFT / SLO, where 1 is the deadline (requests with an SLO only)."""
    rates = sorted({r.rate for r in runs})
    if not rates:
        raise ValueError("no runs to plot")
    rate = rates[len(rates) // 2] if rate is None else rate
    chosen = [r for r in runs if r.rate == rate]
    if not chosen:
        raise ValueError(f"no run at rate {rate}; rates present: {rates}")
    varying = [k for k in ("budget", "runner", "workload", "busy")
               if len({getattr(r, k) for r in chosen}) > 1]
    groups: dict[str, list[RunResult]] = {}
    for r in chosen:
        label = " ".join([r.policy, *(f"{k}={getattr(r, k)}" for k in varying)])
        groups.setdefault(label, []).append(r)
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for label, group in groups.items():
        reqs = [q for r in group for q in r.requests]
        ok = [q for q in reqs if not q.failed and q.ttft_s is not None]
        _cdf(ax_t, [q.ttft_s * 1000.0 for q in ok if q.ttft_s is not None], len(reqs), label)
        slo = [q for q in reqs if q.ttft_slo_ms]
        _cdf(ax_r, [q.ttft_s * 1000.0 / q.ttft_slo_ms for q in slo
                    if not q.failed and q.ttft_s is not None and q.ttft_slo_ms], len(slo), label)
    ax_t.set_xlabel("TTFT (ms)")
    ax_r.set_xlabel("TTFT / SLO")
    ax_r.axvline(1.0, color="k", linestyle="--", linewidth=1)
    for ax in (ax_t, ax_r):
        ax.set_xscale("log")
        # Plain numbers (0.5, 1, 2) read better than 5x10^-1 on a log axis.
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_ylabel("fraction of requests")
    ax_t.set_title(f"TTFT CDF at {rate:g} req/s")
    ax_r.set_title("TTFT relative to the deadline")
    ax_t.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
