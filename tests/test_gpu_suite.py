"""`bench/gpu_suite.sh` on the CPU (`--device cpu --smoke`, tiny shapes), so the one call that
measures everything on a GPU machine cannot rot where CI has no GPU: every step runs, writes its
JSON or log, and the summary quotes each of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["tests-cuda", "tests-triton-compiled", "equality", "throughput", "kernels",
         "preempt-latency", "stream-gaps", "burst-inprocess", "burst-http"]


@pytest.mark.timeout(1500)
def test_gpu_suite_smoke_runs_every_step_and_summarizes_them(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHON": sys.executable, "SLOSERVE_STARTUP_CALIBRATION_S": "0.3"}
    proc = subprocess.run(["bash", "bench/gpu_suite.sh", str(out), "--device", "cpu", "--smoke"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == STEPS
    failed = {name: (out / f"{name}.log").read_text()[-2000:] for name, rc, *_ in steps
              if rc != "0"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-3000:]

    equality = json.loads((out / "equality.json").read_text())
    assert equality["passed"] and set(equality["archs"]) == {"llama", "qwen2"}
    for scenarios in equality["archs"].values():
        assert scenarios["cramped_pool"]["probe"]["kv_preemptions"] > 0
        assert scenarios["urgent_mid_prefill"]["probe"]["slo_preemptions"] >= 1
    throughput = json.loads((out / "throughput.json").read_text())
    # Its structure is tests/test_bench_gpu_throughput.py's business; here: the suite's run has
    # the mixed kind and graphs beside eager, with numbers.
    assert throughput["engine"]["mixed"]["steps_measured"] > 0
    speedups = [row["speedup"] for row in throughput["graphs_vs_eager"]]
    assert [row["phase"] for row in throughput["graphs_vs_eager"]][-1] == "mixed"
    assert speedups and all(isinstance(x, float) and x > 0 for x in speedups)
    gaps = json.loads((out / "stream_gaps.json").read_text())
    assert [r["context"] for r in gaps["rows"]] == [16, 200]
    assert all(r["first"]["gaps_ms"] and r["decode_step_ms"] > 0 for r in gaps["rows"])
    http = json.loads((out / "burst-http" / "results.json").read_text())
    assert {r["policy"] for r in http["runs"]} == {"fcfs", "slo+mf-conservative-suspend"}
    for run in http["runs"]:  # the client's TTFT and the server's, side by side
        assert all(r["server_ttft_s"] is not None for r in run["requests"] if r["error"] is None)

    # Every step's figures, in one JSON document beside the summary.
    suite = json.loads((out / "suite.json").read_text())
    assert set(suite["steps"]) == set(STEPS)
    for key in ("equality", "throughput", "kernels", "preempt_latency", "stream_gaps"):
        assert suite[key], key
    # Two sizes on one engine: the long prompt and the smallest preemptible step (128 tokens);
    # no graphs on the CPU, so both ran eager.
    latency = suite["preempt_latency"]
    assert [size["prompt_tokens"] for size in latency["sizes"]] == [400, 128]
    for size in latency["sizes"]:
        assert size["trials"] == 3 and len(size["long_step_ms"]) == 3
        assert size["long_step_ran_as"] == "eager" and size["unwinds_between_pieces"] == 0
    assert suite["kernels"]["tables"] and suite["kernels"]["smoke"]
    assert set(suite["burst"]) == {"inprocess", "http"}
    assert all(suite["tests"].values())  # each pytest step printed its totals

    summary = (out / "summary.md").read_text()
    assert summary == proc.stdout[proc.stdout.index("# GPU suite"):]
    for heading in ("## GPU tests", "## Greedy equality against HF transformers",
                    "## Throughput against the hardware bound", "## Kernels",
                    "## Preemption latency", "## First requests after startup",
                    "## SLO burst"):
        assert heading in summary, heading
    assert "FAILED" not in summary and "TIMED OUT" not in summary
    assert "CUDA graphs against --enforce-eager (speed-up" in summary
    assert "#### CUDA graphs against --enforce-eager" in summary
    assert "| llama | urgent_mid_prefill | 2/2 |" in summary
    assert "| 400 | eager | 0 |" in summary and "| 128 | eager | 0 |" in summary
    assert "| http | slo+mf-conservative-suspend |" in summary


def test_gpu_suite_refuses_the_full_shapes_without_a_gpu(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "bench/gpu_suite.sh", str(tmp_path), "--device", "cpu"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "pass --smoke" in proc.stderr
    assert not (tmp_path / "steps.tsv").exists()  # nothing ran


def test_gpu_suite_needs_an_output_folder() -> None:
    proc = subprocess.run(["bash", "bench/gpu_suite.sh"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_gpu_suite_header_states_the_sum_of_its_step_limits() -> None:
    """The header's total is what the steps' limits add up to (a step in both branches of an
    if counts once), and it stays under 540 s (9 minutes)."""
    import re

    script = (ROOT / "bench" / "gpu_suite.sh").read_text()
    limits: dict[str, int] = {}
    for name, limit in re.findall(r"^\s*step (\S+) (\d+) ", script, flags=re.MULTILINE):
        limits[name] = max(limits.get(name, 0), int(limit))
    assert list(limits) == STEPS
    stated = re.search(r"they add up to (\d+) s", script)
    assert stated is not None
    assert sum(limits.values()) == int(stated.group(1)) < 540
