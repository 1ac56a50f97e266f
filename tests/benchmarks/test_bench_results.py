"""Result arithmetic, paired aggregation, reports and the clairvoyant bound, on hand-made data."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from engine.benchmarks.attainment.clairvoyant import (clairvoyant_attainment, prefill_cost_s,
                                                      simulate_ttft)
from engine.benchmarks.attainment.report import (markdown_table, plot_attainment_vs_rate,
                                                 plot_ttft_cdf, read_json, tpot_tiers, urgent_tier,
                                                 write_json)
from engine.benchmarks.attainment.results import RequestResult, RunResult, aggregate, summarize
from engine.benchmarks.attainment.traces import Trace, TraceRequest


def req(rid: str, tier: str, slo_ms: float | None, ttft: float | None, e2e: float | None,
        out: int, prompt: int = 100, error: str | None = None,
        tpot_slo_ms: float | None = None) -> RequestResult:
    return RequestResult(request_id=rid, tier=tier, arrival_s=0.0, prompt_tokens=prompt,
                         output_tokens=out, ttft_slo_ms=slo_ms, ttft_s=ttft, e2e_s=e2e,
                         tpot_s=RequestResult.tpot_from(ttft, e2e, out), error=error,
                         tpot_slo_ms=tpot_slo_ms)


def hand_run() -> RunResult:
    return RunResult(
        runner="inprocess", policy="fcfs", budget=512, workload="mixed", rate=2.0, seed=0,
        duration_s=10.0,
        requests=[
            req("u1", "urgent", 100, 0.05, 0.20, 4),  # met, tpot 50 ms
            req("u2", "urgent", 100, 0.15, 0.30, 4),  # missed, tpot 50 ms
            req("u3", "urgent", 100, None, None, 0, error="boom"),  # failed: a miss
            req("r1", "relaxed", 1000, 0.50, 1.50, 11, prompt=1000),  # met, tpot 100 ms
            req("n1", "relaxed", None, 0.30, 0.30, 1, prompt=500),  # no SLO, no tpot
        ],
        engine={"num_preemptions_kv": 1, "num_preemptions_slo": 2, "wasted_tokens": 30,
                "computed_tokens": 1200})


# ---------------------------------------------------------------------------------------------
# summarize


def test_request_result_slo_met_and_tpot() -> None:
    assert req("a", "t", 100, 0.1, 0.1, 1).slo_met is True  # at the deadline: met (engine's <=)
    assert req("a", "t", 100, 0.1001, 0.2, 1).slo_met is False
    assert req("a", "t", None, 0.1, 0.2, 1).slo_met is None
    assert req("a", "t", 100, None, None, 0, error="x").slo_met is False
    assert req("a", "t", 100, 0.05, 0.06, 1, error="cut").slo_met is False  # error after a token
    assert RequestResult.tpot_from(0.1, 0.4, 4) == pytest.approx(0.1)
    assert RequestResult.tpot_from(0.1, 0.4, 1) is None


def test_request_result_tpot_slo_met_and_good() -> None:
    # TPOT 125 ms: (0.625 - 0.25) / 3, exact in binary.
    assert req("a", "t", None, 0.25, 0.625, 4, tpot_slo_ms=125).tpot_slo_met is True  # <=
    assert req("a", "t", None, 0.25, 0.625, 4, tpot_slo_ms=124.9).tpot_slo_met is False
    assert req("a", "t", None, 0.25, 0.625, 4).tpot_slo_met is None
    assert req("a", "t", None, 0.1, 0.1, 1, tpot_slo_ms=1e-3).tpot_slo_met is True  # no gap
    assert req("a", "t", None, None, None, 0, error="x", tpot_slo_ms=100).tpot_slo_met is False
    assert req("a", "t", None, 0.1, 0.2, 2, error="cut", tpot_slo_ms=1e3).tpot_slo_met is False
    # Good: every objective it carries met; none carried: completing is enough.
    assert req("a", "t", 250, 0.25, 0.625, 4, tpot_slo_ms=125).good is True
    assert req("a", "t", 250, 0.25, 0.625, 4, tpot_slo_ms=124).good is False  # TPOT missed
    assert req("a", "t", 249, 0.25, 0.625, 4, tpot_slo_ms=125).good is False  # TTFT missed
    assert req("a", "t", None, 0.25, 0.625, 4).good is True
    assert req("a", "t", None, None, None, 0, error="x").good is False


def goodput_run() -> RunResult:
    """Both objectives on the `stream` tier, TTFT alone on `chat`; 10 s."""
    return RunResult(
        runner="inprocess", policy="fcfs", budget=512, workload="mixed", rate=2.0, seed=0,
        duration_s=10.0,
        requests=[
            req("s1", "stream", 500, 0.25, 0.625, 4, tpot_slo_ms=125),  # both met: good
            req("s2", "stream", 500, 0.25, 1.0, 4, tpot_slo_ms=125),  # TTFT met, TPOT 250 ms
            req("s3", "stream", 500, 0.75, 1.125, 4, tpot_slo_ms=125),  # TPOT met, TTFT missed
            req("s4", "stream", 500, None, None, 0, error="boom", tpot_slo_ms=125),  # both missed
            req("s5", "stream", 500, 0.25, 0.25, 1, tpot_slo_ms=125),  # one token: no gap, good
            req("c1", "chat", 100, 0.05, 0.2, 4),  # TTFT met, no TPOT objective: good
            req("c2", "chat", 100, 0.15, 0.2, 4),  # TTFT missed
            req("n1", "chat", None, 0.3, 0.6, 4),  # no objective, completed: good
        ])


def test_summarize_joint_goodput() -> None:
    s = summarize(goodput_run())
    assert (s["num_slo_requests"], s["num_slo_met"]) == (7, 4)  # s1 s2 s5 c1
    assert s["ttft_slo_attainment"] == pytest.approx(4 / 7)
    assert (s["num_tpot_slo_requests"], s["num_tpot_slo_met"]) == (5, 3)  # s1 s3 s5
    assert s["tpot_slo_attainment"] == pytest.approx(3 / 5)
    assert s["num_good"] == 4  # s1 s5 c1 n1
    assert s["goodput_attainment"] == pytest.approx(4 / 8)
    assert s["request_goodput"] == pytest.approx(4 / 10)
    assert "median_tpot_slo_ms" not in s  # per tier only
    stream, chat = s["tiers"]["stream"], s["tiers"]["chat"]
    assert stream["tpot_slo_attainment"] == pytest.approx(3 / 5)
    assert stream["goodput_attainment"] == pytest.approx(2 / 5)
    assert stream["median_tpot_slo_ms"] == 125
    assert stream["median_tpot_ms"] == pytest.approx(125)  # 125, 250, 125 (s5 has no gap)
    assert stream["request_goodput"] == pytest.approx(0.2)
    assert chat["tpot_slo_attainment"] is None and chat["median_tpot_slo_ms"] is None
    assert chat["goodput_attainment"] == pytest.approx(2 / 3)


def test_old_results_without_tpot_fields_load() -> None:
    run = hand_run().to_json()
    for r in run["requests"]:
        del r["tpot_slo_ms"]
    back = RunResult.from_json(run)
    assert back == hand_run() and all(r.tpot_slo_ms is None for r in back.requests)


def test_summarize_overall() -> None:
    s = summarize(hand_run())
    assert (s["num_requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["duration"] == 10.0
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(20 / 10)  # 4 + 4 + 11 + 1, failed left out
    assert s["total_token_throughput"] == pytest.approx((1700 + 20) / 10)
    # TTFTs of completed requests: 50, 150, 500, 300 ms; numpy linear percentiles.
    assert s["mean_ttft_ms"] == pytest.approx(250)
    assert s["median_ttft_ms"] == pytest.approx(225)
    assert s["p90_ttft_ms"] == pytest.approx(300 + 0.7 * 200)
    assert s["p99_ttft_ms"] == pytest.approx(300 + 0.97 * 200)
    # TPOTs: 50, 50, 100 ms (n1 has one output token: no TPOT).
    assert s["median_tpot_ms"] == pytest.approx(50)
    assert s["p99_tpot_ms"] == pytest.approx(50 + 0.98 * 50)
    # 4 requests carry an SLO, 2 met (u3 failed counts as missed).
    assert (s["num_slo_requests"], s["num_slo_met"]) == (4, 2)
    assert s["ttft_slo_attainment"] == pytest.approx(0.5)
    # Good: u1, r1 (met) and n1 (no SLO, completed) over 10 s.
    assert s["request_goodput"] == pytest.approx(0.3)
    assert s["goodput_attainment"] == pytest.approx(3 / 5)
    assert s["tpot_slo_attainment"] is None and s["num_tpot_slo_requests"] == 0
    assert (s["num_preemptions_kv"], s["num_preemptions_slo"]) == (1, 2)
    assert s["wasted_tokens_share"] == pytest.approx(30 / 1200)


def test_summarize_per_tier() -> None:
    tiers = summarize(hand_run())["tiers"]
    assert set(tiers) == {"urgent", "relaxed"}
    u, r = tiers["urgent"], tiers["relaxed"]
    assert (u["completed"], u["failed"]) == (2, 1)
    assert u["ttft_slo_attainment"] == pytest.approx(1 / 3)
    assert u["request_goodput"] == pytest.approx(0.1)
    assert u["median_ttft_ms"] == pytest.approx(100)
    assert u["median_ttft_slo_ms"] == 100
    assert r["ttft_slo_attainment"] == pytest.approx(1.0)  # n1 has no SLO: not counted
    assert r["request_goodput"] == pytest.approx(0.2)
    assert r["total_token_throughput"] == pytest.approx((1500 + 12) / 10)


def test_summarize_without_slos_or_engine_counters() -> None:
    run = hand_run()
    run.requests = [req("a", "only", None, 0.1, 0.5, 5), req("b", "only", None, 0.2, 0.6, 5),
                    req("c", "only", None, None, None, 0, error="x")]
    run.engine = {}
    s = summarize(run)
    assert s["ttft_slo_attainment"] is None
    assert s["tiers"]["only"]["ttft_slo_attainment"] is None
    assert s["request_goodput"] == pytest.approx(2 / 10)  # completed requests are good
    assert s["wasted_tokens_share"] is None
    assert s["num_preemptions_slo"] is None
    run.requests = []
    s = summarize(run)
    assert s["completed"] == 0 and s["p99_ttft_ms"] is None and s["mean_ttft_ms"] is None


# ---------------------------------------------------------------------------------------------
# aggregate


def run_with(policy: str, seed: int, met: int, budget: int = 512, rate: float = 2.0,
             bound: float | None = None) -> RunResult:
    """10 urgent requests of which `met` meet 100 ms, and 2 relaxed ones that all meet theirs."""
    reqs = [req(f"u{i}", "urgent", 100, 0.05 if i < met else 0.2, 0.5, 4) for i in range(10)]
    reqs += [req(f"r{i}", "relaxed", 5000, 1.0, 2.0, 4, prompt=1000) for i in range(2)]
    clair = None if bound is None else {"ttft_slo_attainment": bound,
                                        "tiers": {"urgent": bound, "relaxed": 1.0}}
    return RunResult(runner="inprocess", policy=policy, budget=budget, workload="mixed",
                     rate=rate, seed=seed, duration_s=4.0, requests=reqs,
                     engine={"num_preemptions_kv": 0, "num_preemptions_slo": seed,
                             "wasted_tokens": 10 * seed, "computed_tokens": 1000},
                     clairvoyant=clair)


def sample_runs() -> list[RunResult]:
    runs = [run_with("fcfs", s, m, bound=0.95) for s, m in zip((0, 1, 2), (5, 4, 6))]
    runs += [run_with("slo", s, m, bound=0.95) for s, m in zip((2, 0, 1), (8, 9, 6))]  # shuffled
    runs += [run_with("slo", s, 10, budget=4096) for s in (0, 1, 2)]  # no fcfs at this budget
    return runs


def test_aggregate_median_range_and_paired_diff() -> None:
    cells = aggregate(sample_runs())
    assert [(c["policy"], c["budget"]) for c in cells] == [("fcfs", 512), ("slo", 512),
                                                           ("slo", 4096)]
    fcfs, slo, big = cells
    assert fcfs["num_seeds"] == 3 and fcfs["seeds"] == [0, 1, 2]
    # fcfs urgent attainment per seed 0.5, 0.4, 0.6 -> overall adds the 2 met relaxed of 12.
    u = fcfs["tiers"]["urgent"]["ttft_slo_attainment"]
    assert (u["median"], u["min"], u["max"]) == pytest.approx((0.5, 0.4, 0.6))
    o = fcfs["metrics"]["ttft_slo_attainment"]
    assert (o["median"], o["min"], o["max"]) == pytest.approx((7 / 12, 6 / 12, 8 / 12))
    assert fcfs["diff"] is None
    # slo per seed: 0.9 (s0), 0.6 (s1), 0.8 (s2); paired with fcfs: +0.4, +0.2, +0.2.
    d = slo["diff"]["tiers"]["urgent"]["ttft_slo_attainment"]
    assert (d["median"], d["min"], d["max"], d["n"]) == pytest.approx((0.2, 0.2, 0.4, 3))
    d = slo["diff"]["metrics"]["request_goodput"]
    assert d["median"] == pytest.approx(0.2 * 10 / 4)
    assert slo["diff"]["metrics"]["wasted_tokens_share"]["median"] == 0.0  # same seeds, same counts
    g = slo["metrics"]["request_goodput"]
    assert (g["median"], g["min"], g["max"]) == pytest.approx((10 / 4, 8 / 4, 11 / 4))
    w = slo["metrics"]["wasted_tokens_share"]
    assert (w["median"], w["min"], w["max"]) == pytest.approx((0.01, 0.0, 0.02))
    # The bound and the per-seed gap to it (0.95 - overall attainment).
    assert slo["clairvoyant"]["ttft_slo_attainment"]["median"] == pytest.approx(0.95)
    assert slo["clairvoyant"]["gap_to_clairvoyant"]["median"] == pytest.approx(0.95 - 10 / 12)
    assert big["diff"] is None and big["clairvoyant"] is None  # no baseline cell, no bound


def tpot_run(policy: str, seed: int, tpot_met: int) -> RunResult:
    """4 `stream` requests that meet their TTFT SLO, of which `tpot_met` meet the 125 ms TPOT
    objective (the rest take 250 ms a token), and 2 `chat` ones with a TTFT SLO only, all met."""
    reqs = [req(f"s{i}", "stream", 500, 0.25, 0.625 if i < tpot_met else 1.0, 4,
                tpot_slo_ms=125) for i in range(4)]
    reqs += [req(f"c{i}", "chat", 100, 0.05, 0.2, 4) for i in range(2)]
    return RunResult(runner="inprocess", policy=policy, budget=512, workload="mixed", rate=2.0,
                     seed=seed, duration_s=4.0, requests=reqs)


def tpot_runs() -> list[RunResult]:
    return [tpot_run("fcfs", 0, 1), tpot_run("fcfs", 1, 2), tpot_run("slo", 0, 3),
            tpot_run("slo", 1, 4)]


def test_aggregate_carries_tpot_and_goodput_attainment() -> None:
    fcfs, slo = aggregate(tpot_runs())
    t = fcfs["metrics"]["tpot_slo_attainment"]
    assert (t["median"], t["min"], t["max"]) == pytest.approx((0.375, 0.25, 0.5))
    g = fcfs["metrics"]["goodput_attainment"]
    assert (g["median"], g["min"], g["max"]) == pytest.approx((7 / 12, 3 / 6, 4 / 6))
    assert fcfs["metrics"]["ttft_slo_attainment"]["median"] == 1.0  # TTFT alone: all met
    stream = fcfs["tiers"]["stream"]
    assert stream["median_tpot_slo_ms"]["median"] == 125
    assert (stream["median_tpot_ms"]["min"], stream["median_tpot_ms"]["max"]) == \
        pytest.approx((187.5, 250))
    assert fcfs["tiers"]["chat"]["tpot_slo_attainment"] is None
    # Paired by seed: slo meets two more TPOT objectives on each seed.
    d = slo["diff"]["metrics"]["goodput_attainment"]
    assert (d["median"], d["min"], d["max"]) == pytest.approx((2 / 6, 2 / 6, 2 / 6))
    assert slo["diff"]["metrics"]["request_goodput"]["median"] == pytest.approx(2 / 4)
    d = slo["diff"]["tiers"]["stream"]
    assert d["tpot_slo_attainment"]["median"] == pytest.approx(0.5)
    assert d["goodput_attainment"]["median"] == pytest.approx(0.5)
    assert d["ttft_slo_attainment"]["median"] == 0.0


def test_aggregate_explicit_bounds_and_duplicates() -> None:
    runs = sample_runs()
    bounds = {("mixed", 2.0, 4096, s): {"ttft_slo_attainment": 0.99, "tiers": {}}
              for s in range(3)}
    big = aggregate(runs, clairvoyant=bounds)[2]
    assert big["clairvoyant"]["ttft_slo_attainment"]["median"] == pytest.approx(0.99)
    with pytest.raises(ValueError, match="same seed"):
        aggregate(runs + [run_with("fcfs", 0, 5)])


# ---------------------------------------------------------------------------------------------
# JSON and reports


def test_json_round_trip(tmp_path: Path) -> None:
    runs = sample_runs()
    for run in runs:
        assert RunResult.from_json(json.loads(json.dumps(run.to_json()))) == run
    cells = aggregate(runs)
    path = tmp_path / "out" / "results.json"
    write_json(path, runs, cells)
    doc = json.loads(path.read_text())
    assert doc["runs"][0]["summary"]["ttft_slo_attainment"] == pytest.approx(7 / 12)
    back_runs, back_cells = read_json(path)
    assert back_runs == runs
    assert back_cells == json.loads(json.dumps(cells))


def test_a_run_as_figure_records_rebuilds_the_run_and_its_summary(tmp_path: Path) -> None:
    """`sloserve bench run` writes each finished run to results.jsonl as these records: a
    `request` per request (with its cell), then the `run` with its summary."""
    from engine.benchmarks.measure.figures import FigureLog, read_figures

    run = hand_run()
    path = tmp_path / "results.jsonl"
    with FigureLog(path) as log:
        for kind, record in run.figure_records():
            log.write(kind, **record)
    records = read_figures(path)
    assert [r["kind"] for r in records] == ["request"] * len(run.requests) + ["run"]
    cell = {"runner": "inprocess", "policy": "fcfs", "budget": 512, "workload": "mixed",
            "rate": 2.0, "seed": 0, "busy": 0}
    assert all({k: r[k] for k in cell} == cell for r in records)
    last = records[-1]
    assert last["summary"] == json.loads(json.dumps(summarize(run)))
    assert last["num_requests"] == len(run.requests) and "requests" not in last
    # The lines hold the whole run: results.json's form of it comes back from them.
    requests = [{k: v for k, v in r.items() if k not in ("kind", *cell)} for r in records[:-1]]
    rebuilt = {**{k: v for k, v in last.items() if k not in ("kind", "num_requests")},
               "requests": requests}
    assert RunResult.from_json(rebuilt) == run


def test_markdown_table_rows() -> None:
    cells = aggregate(sample_runs())
    assert urgent_tier(cells) == "urgent"  # the tightest SLO
    md = markdown_table(cells)
    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(cells)
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    assert head[4:7] == ["TTFT %", "urgent TTFT %", "good %"]  # no TPOT objective: no columns
    assert "Δ TTFT vs fcfs (pp)" in head and "Δ good vs fcfs (pp)" in head
    assert head[-1] == "clairvoyant TTFT %"  # the bound is on TTFT only
    fcfs_row, slo_row, big_row = lines[2:]
    assert fcfs_row.startswith("| fcfs | 512 | 2 | 3 |")
    assert "| 50.0 [40.0–60.0] |" in fcfs_row
    assert "| +20.0 [+20.0–+40.0] |" in slo_row  # Δ urgent, paired by seed
    assert "| 95.0 |" in slo_row  # clairvoyant bound
    assert big_row.startswith("| slo | 4096 |") and "| 100.0 |" in big_row


def test_markdown_table_tpot_columns() -> None:
    cells = aggregate(tpot_runs())
    assert tpot_tiers(cells) == ["stream"]
    lines = markdown_table(cells).strip().splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    fcfs, slo = ([v.strip() for v in line.strip("|").split("|")] for line in lines[2:])
    col = {name: i for i, name in enumerate(head)}
    # One tier carries a TPOT objective: its attainment is the overall one, shown once.
    assert "stream TPOT %" not in col
    assert fcfs[col["TPOT %"]] == "37.5 [25.0–50.0]"
    assert fcfs[col["stream median TPOT (ms)"]] == "218.8 [187.5–250.0]"  # 250 and 187.5
    assert fcfs[col["good %"]] == "58.3 [50.0–66.7]"
    assert slo[col["Δ good vs fcfs (pp)"]] == "+33.3"
    assert slo[col["TTFT %"]] == "100.0"
    # With two such tiers the tightest one gets its own attainment column.
    runs = tpot_runs()
    for run in runs:
        for r in run.requests:
            if r.tier == "chat":
                r.tpot_slo_ms = 1000.0
    head = markdown_table(aggregate(runs)).splitlines()[0]
    assert "| TPOT % | stream TPOT % | stream median TPOT (ms) |" in head


def test_plots_write_png(tmp_path: Path) -> None:
    runs = sample_runs() + [run_with(p, s, m, rate=4.0, bound=0.9)
                            for p, m in (("fcfs", 2), ("slo", 7)) for s in range(3)]
    cells = aggregate(runs)
    for name, draw in (("rate.png", lambda p: plot_attainment_vs_rate(cells, p)),
                       ("cdf.png", lambda p: plot_ttft_cdf(runs, p, rate=2.0))):
        path = tmp_path / name
        draw(path)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="no run at rate"):
        plot_ttft_cdf(runs, tmp_path / "x.png", rate=9.0)


# ---------------------------------------------------------------------------------------------
# Clairvoyant bound (1 ms per token, no intercept: costs are easy to read)


def per_token(n: int) -> float:
    return n * 1e-3


def trace(*reqs: tuple[str, float, int, float | None]) -> Trace:
    """(tier, arrival_s, prompt_tokens, slo_ms) per request."""
    return Trace([TraceRequest(f"r{i}", tier, arr, [1] * n, 16, slo)
                  for i, (tier, arr, n, slo) in enumerate(reqs)])


def test_clairvoyant_preempts_where_fcfs_misses() -> None:
    # FCFS finishes B at 1.1 s (TTFT 1.0 s > 200 ms); preemptive EDF runs B at 0.1 s.
    t = trace(("relaxed", 0.0, 1000, 5000), ("urgent", 0.1, 100, 200))
    assert simulate_ttft(t, per_token) == pytest.approx([1.1, 0.1])
    res = clairvoyant_attainment(t, per_token)
    assert res["ttft_slo_attainment"] == 1.0
    assert res["tiers"] == {"relaxed": 1.0, "urgent": 1.0}


def test_clairvoyant_doomed_goes_to_the_back() -> None:
    # A needs 1 s for a 0.5 s deadline: doomed at arrival. Plain EDF would run it first (earlier
    # deadline) and make B miss too; to the back, B meets its 0.6 s deadline.
    t = trace(("a", 0.0, 1000, 500), ("b", 0.0, 300, 600))
    for overload in ("edf", "moore-hodgson"):
        assert simulate_ttft(t, per_token, overload=overload) == pytest.approx([1.3, 0.3])
        res = clairvoyant_attainment(t, per_token, overload=overload)
        assert res["ttft_slo_attainment"] == 0.5
        assert res["tiers"] == {"a": 0.0, "b": 1.0}


def test_clairvoyant_overload_sets_aside_long_job() -> None:
    # Each is feasible alone, not together. EDF runs L (meets 0.5 s) and both short ones miss;
    # Moore-Hodgson sets L aside and meets both short ones.
    t = trace(("l", 0.0, 500, 500), ("s", 0.0, 100, 550), ("s", 0.0, 100, 580))
    assert clairvoyant_attainment(t, per_token, overload="edf")["ttft_slo_attainment"] == \
        pytest.approx(1 / 3)
    assert clairvoyant_attainment(t, per_token)["ttft_slo_attainment"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        clairvoyant_attainment(t, per_token, overload="lifo")


def test_clairvoyant_ignores_requests_without_slo() -> None:
    # The no-SLO request is served after SLO requests present, and preempted by later ones.
    t = trace(("batch", 0.0, 2000, None), ("urgent", 0.0, 100, 150),
              ("urgent", 0.5, 100, 150))
    assert simulate_ttft(t, per_token) == pytest.approx([2.2, 0.1, 0.1])
    res = clairvoyant_attainment(t, per_token)
    assert res["ttft_slo_attainment"] == 1.0 and res["num_slo_requests"] == 2
    assert res["tiers"] == {"batch": None, "urgent": 1.0}
    assert clairvoyant_attainment(trace(("b", 0.0, 10, None)), per_token)[
        "ttft_slo_attainment"] is None


def test_clairvoyant_idle_gaps_and_chunked_cost() -> None:
    t = trace(("x", 0.0, 100, 100), ("x", 5.0, 200, 150))
    assert simulate_ttft(t, per_token) == pytest.approx([0.1, 0.2])
    assert clairvoyant_attainment(t, per_token)["tiers"]["x"] == 0.5

    def line(n: int) -> float:
        return 0.01 + n * 1e-3

    assert prefill_cost_s(1000, line, 512) == pytest.approx(line(512) + line(488))
    assert prefill_cost_s(1024, line, 512) == pytest.approx(2 * line(512))
    assert prefill_cost_s(300, line, 512) == pytest.approx(line(300))
    # The extra intercept of the second chunk makes a tight deadline miss under the budget.
    t = trace(("x", 0.0, 1000, 1015))
    assert clairvoyant_attainment(t, line)["ttft_slo_attainment"] == 1.0
    assert clairvoyant_attainment(t, line, budget_tokens=512)["ttft_slo_attainment"] == 0.0


def test_clairvoyant_optimal_when_all_arrive_together() -> None:
    # Without release dates the schedule must be optimal (Moore-Hodgson): compare with brute
    # force over subsets (a subset is feasible iff EDF order meets all of its deadlines).
    rng = random.Random(0)
    for _ in range(200):
        jobs = [(rng.randint(1, 50), rng.choice([None, rng.randint(5, 120)])) for _ in range(6)]
        t = trace(*(("x", 0.0, n, slo) for n, slo in jobs))
        slo_jobs = [(n, slo) for n, slo in jobs if slo is not None]
        best = 0
        for k in range(len(slo_jobs), 0, -1):
            for sub in itertools.combinations(sorted(slo_jobs, key=lambda j: j[1]), k):
                done = list(itertools.accumulate(n for n, _ in sub))
                if all(d <= slo for d, (_, slo) in zip(done, sub)):
                    best = k
                    break
            if best:
                break
        res = clairvoyant_attainment(t, per_token)
        if slo_jobs:
            assert res["num_slo_met"] == best, jobs
        else:
            assert res["ttft_slo_attainment"] is None
