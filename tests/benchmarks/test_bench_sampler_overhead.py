"""bench/diagnostics/sampler_overhead.py without timing anything: it runs both samplers at tiny shapes and
reports their device-to-host reads per call (the times are the script's to print, never a test's
to assert)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_script_compares_both_samplers_and_counts_their_reads():
    run = subprocess.run([sys.executable, "-m", "bench.diagnostics.sampler_overhead", "--smoke"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert [(r["rows"], r["top_p"]) for r in report["results"]] == [
        (1, False), (4, False), (1, True), (4, True)]
    for result in report["results"]:
        assert result["batched_reads"] == 1
        # The baseline's reads grow with the rows (two per random row, one for the batch): the
        # probe that the counter sees reads at all.
        assert result["per_row_reads"] == 1 + 2 * result["rows"]
        assert result["per_row_ms"] > 0 and result["batched_ms"] > 0
    assert "| rows | top_p |" in run.stderr
