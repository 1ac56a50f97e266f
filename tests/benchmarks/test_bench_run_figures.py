"""`sloserve bench run` writes each run to OUTPUT_DIR/results.jsonl as it ends, and the HTTP
runner's servers write their info-level logs to OUTPUT_DIR/server.log as they run: a benchmark
killed at a time limit keeps the runs it finished and what its servers did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.benchmarks.measure.figures import read_figures
from engine.entrypoints.cli import main
from monitor.step_time_model import StepTimeModel
from tests.utils.figures_wait import wait_for_figures

REPO = Path(__file__).resolve().parents[2]


def _args(tiny_model, tmp_path: Path, num_requests: int, rate: str) -> list[str]:
    ttft = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    return ["bench", "run", "--model", tiny_model("llama"), "--dtype", "float32",
            "--max-model-len", "512", "--num-kv-blocks", "400", "--ttft-model", str(ttft),
            "--workload", "mixed", "--num-requests", str(num_requests), "--rates", rate,
            "--seeds", "0", "--budgets", "128", "--output-dir", str(tmp_path / "out")]


@pytest.mark.timeout(300)
def test_http_runs_land_in_results_jsonl_and_the_server_log_in_the_folder(tiny_model,
                                                                           tmp_path) -> None:
    assert main([*_args(tiny_model, tmp_path, 6, "40"), "--runner", "http",
                 "--policies", "fcfs", "slo"]) == 0
    out = tmp_path / "out"
    doc = json.loads((out / "results.json").read_text())
    records = read_figures(out / "results.jsonl")
    assert [r["kind"] for r in records] == (["request"] * 6 + ["run"]) * 2 + ["done"]
    runs = [r for r in records if r["kind"] == "run"]
    assert [r["policy"] for r in runs] == [run["policy"] for run in doc["runs"]]
    for line, run in zip(runs, doc["runs"]):
        assert line["summary"] == run["summary"]
        mine = [{k: v for k, v in r.items() if k in run["requests"][0]} for r in records
                if r["kind"] == "request" and r["policy"] == run["policy"]]
        assert mine == run["requests"]
    # Each server's log, at info level, one after the other under a header naming its cell.
    log = (out / "server.log").read_text()
    headers = [line for line in log.splitlines() if line.startswith("== sloserve serve")]
    assert [h.split(",")[0] for h in headers] == ["== sloserve serve: policy fcfs",
                                                  "== sloserve serve: policy slo"]
    assert "budget 128" in headers[0] and " INFO " in log


@pytest.mark.timeout(300)
def test_a_killed_bench_run_keeps_the_runs_it_finished(tiny_model, tmp_path) -> None:
    args = _args(tiny_model, tmp_path, 12, "4")
    proc = subprocess.Popen([sys.executable, "-m", "engine", *args, "--runner", "inprocess",
                             "--policies", "fcfs", "slo", "priority"], cwd=REPO,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jsonl = tmp_path / "out" / "results.jsonl"
    try:
        wait_for_figures(proc, jsonl, lambda rs: any(r["kind"] == "run" for r in rs),
                         "its first run")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (tmp_path / "out" / "results.json").exists()
    records = read_figures(jsonl)
    assert [r["kind"] for r in records][:13] == ["request"] * 12 + ["run"]
    first = records[12]
    assert first["policy"] == "fcfs" and first["summary"]["num_requests"] == 12
    assert "done" not in [r["kind"] for r in records]
