"""The GPU suite's summary (bench/suite/gpu_summary.py) on folders a GPU suite call
could leave: steps killed at their limit (no final JSON, only the .jsonl of what they
measured), a suite killed mid-step (its row still `running`), steps the summary has no section
for, the suite's notes, a dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.suite import gpu_summary
from engine.benchmarks.device_throughput import benchmark as gpu_throughput
from engine.benchmarks.measure.figures import FigureLog, read_figures


@pytest.fixture(scope="module")
def throughput_run(tmp_path_factory) -> tuple[dict, list[str]]:
    """(the JSON, the .jsonl's lines) of a whole smoke run of the core call's throughput step
    (no HF): what a step killed part way would have written first."""
    out = tmp_path_factory.mktemp("throughput") / "throughput.json"
    assert gpu_throughput.main(["--smoke", "--device", "cpu", "--dtype", "float32", "--no-hf",
                                "--batches", "1", "4", "--output", str(out)]) == 0
    return json.loads(out.read_text()), out.with_suffix(".jsonl").read_text().splitlines()


def _steps(out: Path, *rows: tuple) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.tsv").write_text("".join("\t".join(map(str, row)) + "\n" for row in rows))


def _summary(out: Path, *flags: str) -> str:
    assert gpu_summary.main([str(out), "--device", "cpu", *flags]) == 0
    return (out / "summary.md").read_text()


def _cut_after(lines: list[str], kind: str, side: str, batch: int | None = None) -> list[str]:
    """The lines up to and with the first record of that kind, side (and batch)."""
    for i, line in enumerate(lines):
        record = json.loads(line)
        if (record["kind"], record.get("side"), record.get("batch")) == (kind, side, batch):
            return lines[:i + 1]
    raise AssertionError(f"no {kind} {side} {batch} record")


def test_a_suite_killed_mid_step_reports_what_the_step_measured(throughput_run, tmp_path):
    result, lines = throughput_run
    out = tmp_path / "suite"
    # Killed while the graphs engine ran decode 4: its prefill and decode 1 are in the .jsonl,
    # with a last line cut short mid-write.
    kept = _cut_after(lines, "decode", "engine", 1)
    _steps(out, ("smoke", 0, 21, 45), ("throughput", "running", 0, 100))
    (out / "throughput.jsonl").write_text("\n".join(kept) + '\n{"kind": "graphs_vs_ea')
    (out / "throughput.log").write_text("engine decode 1 x 32: progress\n")
    summary = _summary(out)

    assert "| throughput | killed (did not finish) | 0 |" in summary
    assert "| smoke | passed | 21 |" in summary
    section = summary[summary.index("## Throughput"):summary.index("### throughput:")]
    assert "**(partial: step killed)**" in section and "No table" not in section
    engine = {json.loads(line)["kind"]: json.loads(line) for line in kept
              if json.loads(line).get("side") == "engine"}
    prefill, decode = engine["prefill"], engine["decode"]
    # Prefill against the linear-layer bound and decode 1's TPOT against the HBM bound.
    assert (f"| prefill | 1 | {prefill['prompt_len']} | {prefill['tokens_per_s']:,.1f} "
            f"| {prefill['bound']['tokens_per_s']:,.1f} |") in section
    assert (f"| {decode['tpot_ms']:,.2f} | {decode['bound']['tpot_ms']:,.2f} |") in section
    assert "| decode | 4 |" not in section.split("#### CUDA graphs")[0]  # never measured
    # Graphs against eager: decode 1 has both sides, decode 4 only the eager engine's.
    eager_4 = result["eager"]["decode"]["4"]
    assert f"| decode | 4 | 4 | - | {eager_4['tpot_ms']:,.2f} |" in section
    speedup = decode["tpot_ms"] and result["eager"]["decode"]["1"]["tpot_ms"] / decode["tpot_ms"]
    assert f"decode 1 {speedup:.2f}x" in section
    assert "| graphs (as configured) |" in section and "| --enforce-eager |" in section
    # The step's log tail, as for any step that did not pass.
    assert "### throughput: killed (did not finish); last lines of its log" in summary

    suite = json.loads((out / "suite.json").read_text())
    assert suite["steps"]["throughput"] == {"rc": "running", "seconds": 0, "limit": 100}
    assert suite["throughput"]["partial"] is True
    assert suite["throughput"]["records"] == read_figures(out / "throughput.jsonl")


def test_a_step_timed_out_says_so_beside_its_partial_figures(throughput_run, tmp_path):
    _, lines = throughput_run
    out = tmp_path / "suite"
    _steps(out, ("throughput", 124, 110, 100))
    (out / "throughput.jsonl").write_text("\n".join(_cut_after(lines, "graphs", "eager")) + "\n")
    (out / "throughput.json").write_text('{"bench": "gpu_throughput", "engi')  # cut short
    summary = _summary(out)
    assert "| throughput | TIMED OUT at 100 s | 110 |" in summary
    assert "**(partial: step timed out)**" in summary
    assert "**engine not measured:** not measured: the step ended first" in summary


def test_a_whole_run_is_quoted_as_before(throughput_run, tmp_path):
    result, lines = throughput_run
    out = tmp_path / "suite"
    _steps(out, ("throughput", 0, 30, 100))
    (out / "throughput.json").write_text(json.dumps(result))
    (out / "throughput.jsonl").write_text("\n".join(lines) + "\n")
    summary = _summary(out)
    assert result["markdown"] in summary and "partial" not in summary


def test_notes_unknown_steps_and_partial_bursts(tmp_path):
    out = tmp_path / "suite"
    _steps(out, ("smoke", 3, 30, 45), ("startup", 0, 12, 40), ("calibrate", 0, 40, 50),
           ("burst-http-2048", 137, 85, 75), ("burst-http-unchunked", "skipped", 0, 0),
           ("stream-gaps", "killed", 7, 45))
    (out / "notes.txt").write_text(
        "CUDA graph capture failed in the smoke step: every later step ran --enforce-eager "
        "(smoke.log has the error)\n")
    (out / "ttft_model.json").write_text(json.dumps({"seconds_per_token": 2e-5,
                                                     "intercept_s": 0.01, "r2": 0.99}))
    # The smoke step's phases as it wrote them (bench/suite/gpu_smoke.py), no final JSON.
    with FigureLog(out / "smoke.jsonl") as log:
        log.write("engine", enforce_eager=False, error="RuntimeError: capture failed",
                  start_s=3.5)
        log.write("engine", enforce_eager=True, error=None, start_s=2.0, serve_s=1.0,
                  replays={"decode": None, "pieces": None})
    # One finished run of the burst at budget 2048 before its step was killed.
    summary_fields = {"tiers": {"urgent": {"num_slo_met": 9, "num_slo_requests": 10,
                                           "median_ttft_slo_ms": 250.0,
                                           "median_ttft_ms": 120.0}},
                      "num_preemptions_slo": 4, "max_stream_gap_ms": 30.0}
    with FigureLog(out / "burst-http-2048" / "results.jsonl") as log:
        log.write("request", policy="fcfs", request_id="0")
        log.write("run", runner="http", policy="fcfs", budget=2048, workload="burst",
                  summary=summary_fields, engine={})
    # The stream gaps' first context, before the suite was interrupted.
    with FigureLog(out / "stream_gaps.jsonl") as log:
        log.write("run", contexts=[16, 3000, 12000])
        log.write("startup", startup_s=41.5, startup_log=["kernel warm-up: 3.2 s"])
        log.write("row", context=16, first={"ttft_ms": 30.0, "gaps_ms": [9.0]},
                  first_max_gap_ms=9.0, warm_max_gap_ms=8.5, decode_step_ms=8.0,
                  max_gap_over_step=1.12, stalled=False)
    summary = _summary(out)

    lines = summary.splitlines()
    # The note first, under the title.
    assert lines[0] == "# GPU suite" and lines[2].startswith("- CUDA graph capture failed")
    for row in ("| smoke | FAILED (exit 3) | 30 |", "| startup | passed | 12 |",
                "| calibrate | passed | 40 |", "| burst-http-2048 | TIMED OUT at 75 s | 85 |",
                "| burst-http-unchunked | skipped (the call's deadline left too little time) | 0 |",
                "| stream-gaps | killed (the call was interrupted) | 7 |"):
        assert row in summary, row
    assert "Verdict: **not reached**" in summary and "RuntimeError: capture failed" in summary
    assert "ttft_model.json: seconds_per_token 2e-05, intercept_s 0.01, r2 0.99." in summary
    assert "| http-2048 (partial: step timed out) | fcfs | 9/10 | 250.0 | 120.0 |" in summary
    assert "| http-unchunked | no results (see burst-http-unchunked.log) |" in summary
    assert "**(partial: step killed)**: the contexts measured" in summary
    assert "| 16 | 30.0 | 9.0 | 8.5 | 8.0 | 1.12 |" in summary
    # No section for a step this folder did not run.
    assert "## Greedy equality" not in summary and "## Kernels" not in summary
    # A skipped step is no failure: no log tail for it; the others get theirs.
    assert "### burst-http-unchunked" not in summary
    assert "### burst-http-2048: TIMED OUT at 75 s; last lines of its log" in summary
    suite = json.loads((out / "suite.json").read_text())
    assert suite["burst"]["http-2048"]["partial"] is True
    assert suite["notes"] == [lines[2][2:]]


def test_partial_preemption_latency(tmp_path):
    out = tmp_path / "suite"
    _steps(out, ("preempt-latency", 124, 70, 60))
    size = {"prompt_tokens": 16384, "trials": 2, "unwound": 2, "not_unwound": 0,
            "layer_ms": 25.0, "urgent_slo_ms": 90.0, "long_step_ms": [800.0, 810.0],
            "arrival_to_unwind_ms": [10.0, 20.0], "arrival_to_decision_ms": [5.0, 6.0],
            "decision_to_unwind_ms": [5.0, 14.0], "long_step_ran_as": "eager",
            "long_steps": 4, "long_steps_as_pieces": 0, "unwinds_between_pieces": 0}
    with FigureLog(out / "preempt_latency.jsonl") as log:
        log.write("run", model="m", device="cuda", layers=32, threads=16)
        log.write("urgent_alone", urgent_ttft_alone_ms=15.0)
        log.write("size", **size)
        log.write("trial", prompt_tokens=512, trial=0, long_step_ms=20.0, urgent_slo_ms=17.0,
                  unwound=True, arrival_to_unwind_ms=1.5)
    summary = _summary(out)
    assert "**(partial: step timed out)**" in summary
    # p50 and p99 of [10, 20], interpolated as every benchmark does (engine/benchmarks/measure/stats.py).
    assert "| 16384 | eager | 0 | 805.0 | 25.00 | 90.0 | 2/2 | 15.00 | 19.90 |" in summary
    assert "Prompt size 512, not finished: 1 trials, 1 unwound; long step ms 20.0; arrival " \
           "to unwind ms 1.50." in summary


def test_a_dry_run_quotes_each_steps_last_line(tmp_path):
    out = tmp_path / "suite"
    _steps(out, ("smoke", 0, 2, 45), ("throughput", 0, 3, 100))
    (out / "smoke.log").write_text("dry run: engine configuration built: model m\n")
    summary = _summary(out, "--dry-run")
    assert summary.startswith("# GPU suite (dry run")
    assert "- smoke: `dry run: engine configuration built: model m`" in summary
    assert "- throughput: `no output`" in summary


def test_pytest_totals_are_read_with_and_without_a_marker(tmp_path: Path) -> None:
    """The GPU tests are picked by `-m gpu`: pytest then prints "N/M tests collected (K
    deselected)", which the summary must quote as it quotes a plain total."""
    (tmp_path / "tests-triton-compiled.log").write_text(
        "tests/kernels/test_x.py::test_y\n\n329/449 tests collected (120 deselected) in 1.77s\n")
    (tmp_path / "tests-cuda.log").write_text("....\n===== 3 passed, 1 skipped in 2.00s =====\n")
    assert gpu_summary._pytest_totals(tmp_path, "tests-triton-compiled") == \
        "329/449 tests collected (120 deselected) in 1.77s"
    assert gpu_summary._pytest_totals(tmp_path, "tests-cuda") == "3 passed, 1 skipped in 2.00s"


def test_a_killed_test_step_names_its_failures_and_the_test_it_was_running(tmp_path: Path) -> None:
    """The H100's tests-cuda step (2026-11-28) was killed at its limit with one failure in its
    -q dots and no pytest summary: neither the failing test nor the slow one could be named.
    With -v each is on a line of its own."""
    _steps(tmp_path, ("tests-cuda", 124, 120, 120), ("tests-triton-compiled", 0, 50, 120))
    (tmp_path / "tests-cuda.log").write_text(
        "tests/gpu/test_a.py::test_fast[device_cuda] PASSED                    [ 10%]\n"
        "tests/gpu/test_a.py::test_cpu_flag FAILED                           [ 20%]\n"
        "tests/gpu/test_b.py::test_pool[cuda] 2026-11-28 02:52:07 INFO loading\n")
    (tmp_path / "tests-triton-compiled.log").write_text(
        "tests/kernels/test_k.py::test_norm PASSED [100%]\n===== 1 passed in 3.00s =====\n")
    summary = _summary(tmp_path)
    assert "  - `tests/gpu/test_a.py::test_cpu_flag FAILED`" in summary
    assert "  - running when it ended: `tests/gpu/test_b.py::test_pool[cuda]`" in summary
    # A step that ended by itself was running nothing.
    assert summary.count("running when it ended") == 1
