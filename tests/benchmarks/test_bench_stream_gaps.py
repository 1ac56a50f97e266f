"""bench/e2e/stream_gaps.py on a tiny model on the CPU: its rows land in the .jsonl twin as each
context is measured, and the server's info-level log lands beside them as the server runs, so a
run killed at a time limit leaves both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from engine.benchmarks.measure.figures import read_figures
from bench.e2e.stream_gaps import main, server_log_path
from tests.utils.figures_wait import wait_for_figures

REPO = Path(__file__).resolve().parents[2]


def test_rows_and_the_server_log_land_beside_the_json(tiny_model, tmp_path) -> None:
    model = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=512)
    out = tmp_path / "stream_gaps.json"
    assert main(["--model", model, "--device", "cpu", "--dtype", "float32", "--contexts", "16",
                 "32", "--max-tokens", "4", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    records = read_figures(out.with_suffix(".jsonl"))
    assert [r["kind"] for r in records] == ["run", "startup", "row", "row", "done"]
    assert records[0]["contexts"] == [16, 32]
    assert records[1]["startup_s"] == report["startup_s"]
    assert [{k: v for k, v in r.items() if k != "kind"} for r in records
            if r["kind"] == "row"] == report["rows"]
    log = server_log_path(out)
    assert log == tmp_path / "stream_gaps.server.log"
    # The server's own log at info level, kept (not only quoted on a failed start).
    assert " INFO " in log.read_text()


def test_a_killed_run_keeps_its_first_row_and_the_server_log(tiny_model, tmp_path) -> None:
    import psutil

    model = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=512)
    out = tmp_path / "stream_gaps.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.e2e.stream_gaps", "--model", model, "--device", "cpu",
         "--dtype", "float32", "--contexts", *["16"] * 20, "--max-tokens", "8",
         "--output", str(out)], cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    twin = out.with_suffix(".jsonl")
    server: list[psutil.Process] = []
    try:
        wait_for_figures(proc, twin, lambda rs: any(r["kind"] == "row" for r in rs),
                         "its first row")
        # The bench's server outlives a SIGKILL of the bench (the suite's `timeout` kills
        # the whole process group); this test stops it itself.
        server = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in server:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    assert not out.exists()
    records = read_figures(twin)
    assert [r["kind"] for r in records][:3] == ["run", "startup", "row"]
    # Its figures as measured: the first stream's TTFT, and its gaps (none where the 8 tokens'
    # text reached the client in one chunk, as it once did in a loaded CI run).
    first = records[2]["first"]
    assert records[2]["context"] == 16 and first["ttft_ms"] > 0
    assert isinstance(first["gaps_ms"], list)
    assert "done" not in [r["kind"] for r in records]
    assert " INFO " in server_log_path(out).read_text()
