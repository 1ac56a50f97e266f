"""bench/diagnostics/process_cpu.py: a command's processes and their CPU seconds, read from
/proc, over the whole run and over a flood's window. A child that spins and a parent that
sleeps show as such (no figure is asserted beyond that split)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.diagnostics.process_cpu import ProcessTrack, flood_window

REPO = Path(__file__).resolve().parents[2]

SPIN_THEN_WRITE_FLOOD = """
import json, subprocess, sys, time
began = time.time()
subprocess.run([sys.executable, "-c",
                "import time\\nend = time.time() + 0.6\\nwhile time.time() < end: pass"])
ended = time.time()
json.dump({"requests": [{"sent_at": began, "e2e_ms": (ended - began) * 1e3}]},
          open(sys.argv[1], "w"))
"""


def test_the_spinning_child_holds_the_cpu_and_the_flood_window_is_read(tmp_path):
    flood_json = tmp_path / "flood.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.diagnostics.process_cpu", "--output-dir", str(tmp_path),
         "--interval-s", "0.02", "--flood-json", str(flood_json), "--",
         sys.executable, "-c", SPIN_THEN_WRITE_FLOOD, str(flood_json)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "process_cpu.json").read_text())
    whole = report["report"]["whole run"]["cpu_s_by_kind"]
    # The spinning child is an "other" process of the command; the command itself waits.
    assert whole["other"] > 0.2 and whole["other"] > 2 * whole["client (the command)"]
    assert "flood" in report["report"] and "flood's first 0.6 s" in report["report"]
    assert report["report"]["flood"]["cpu_s_by_kind"]["other"] > 0.2
    assert "CPU seconds by process, flood" in run.stdout


def test_cpu_between_samples_is_interpolated():
    track = ProcessTrack(pid=1, kind="other", title="x", parent=0,
                         samples=[(10.0, 1.0), (11.0, 2.0), (12.0, 2.0)])
    assert track.used(10.5, 11.5) == 0.5
    assert track.used(0.0, 10.0) == 0.0  # nothing before it was seen
    assert track.used(11.0, 99.0) == 0.0  # idle after its last sample


def test_the_flood_window_runs_from_the_first_send_to_the_last_end(tmp_path):
    path = tmp_path / "flood.json"
    now = time.time()
    path.write_text(json.dumps({"requests": [
        {"sent_at": now, "e2e_ms": 500.0}, {"sent_at": now + 0.1, "e2e_ms": 900.0},
        {"sent_at": None}]}))
    start, end = flood_window(path)
    assert start == now and abs(end - (now + 1.0)) < 1e-6
    assert flood_window(tmp_path / "absent.json") is None
