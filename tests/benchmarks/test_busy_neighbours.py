"""Busy neighbours (engine/benchmarks/measure/busy_neighbours.py) and `sloserve bench run
--busy N`: the neighbours really load the CPU, end with the context (or by themselves: their
time bound, their parent gone), and a run shows its quiet and busy replays side by side."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from engine.benchmarks.attainment.busy import quiet_and_busy
from engine.benchmarks.attainment.results import RunResult
from engine.benchmarks.measure.busy_neighbours import busy_neighbours
from engine.benchmarks.measure.figures import read_figures
from monitor.step_time_model import StepTimeModel

# Alone (the README's serial run): these tests keep cores busy on purpose, which would slow the
# tests beside them, and their CPU-seconds probe needs cores that are not all taken.
pytestmark = pytest.mark.serial


def _gone(pid: int) -> bool:
    """No such process any more (a zombie left to an init that has not reaped it yet counts:
    it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_neighbours_keep_their_cores_busy_and_are_gone_after_the_context() -> None:
    with busy_neighbours(2, limit_s=120) as load:
        pids = load.pids
        assert len(pids) == 2 and all(psutil.Process(p).is_running() for p in pids)
        time.sleep(2.0)
    report = load.report
    assert report is not None and report.processes == 2 and report.ended_early == 0
    # The probe: they consumed CPU time on the scale of their wall time (a shared machine
    # gives them less than all of it, so only a fraction is asked for).
    assert report.cpu_s > 0.25 * report.wall_s * 2, report
    assert report.cpu_share is not None and report.cpu_share > 0.25
    assert report.machine_cpu_percent > 0 and report.cpu_count >= 1
    assert all(_gone(p) for p in pids)
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]


def test_a_neighbour_ends_by_itself_at_its_time_bound_and_its_cpu_time_is_still_read() -> None:
    with busy_neighbours(1, limit_s=0.5) as load:
        (pid,) = load.pids
        time.sleep(2.0)
        assert _gone(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    report = load.report
    assert report is not None and report.ended_early == 1
    assert report.cpu_s > 0.1, report  # read from the reaped child, not lost


def test_a_neighbour_ends_when_the_benchmark_that_started_it_is_killed() -> None:
    code = ("import sys, time\n"
            "from engine.benchmarks.measure.busy_neighbours import busy_neighbours\n"
            "with busy_neighbours(1, limit_s=600) as load:\n"
            "    print(load.pids[0], flush=True)\n"
            "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not _gone(pid)
        parent.kill()  # no context exit: the neighbour must notice on its own
        parent.wait()
        deadline = time.monotonic() + 30
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid)
    finally:
        parent.kill()
        parent.wait()


def test_no_neighbours_is_a_quiet_window_with_the_machines_own_load() -> None:
    with busy_neighbours(0, limit_s=10) as load:
        assert load.pids == []
        time.sleep(0.2)
    report = load.report
    assert report is not None and report.processes == 0 and report.cpu_s == 0
    assert report.cpu_share is None and report.wall_s > 0
    with pytest.raises(ValueError, match="processes"):
        with busy_neighbours(-1, limit_s=10):
            pass


def test_each_replay_runs_quiet_then_busy_and_carries_its_report() -> None:
    seen = []

    def replay(neighbours: int) -> list[RunResult]:
        seen.append(neighbours)
        return [RunResult(runner="http", policy="fcfs", budget=2048, workload="cpu-bursts",
                          rate=0.5, seed=0, duration_s=1.0, requests=[])]

    runs = quiet_and_busy(replay, 1, limit_s=30)
    assert seen == [0, 1] and [r.busy for r in runs] == [0, 1]
    assert [r.meta["busy_load"]["processes"] for r in runs] == [0, 1]
    assert quiet_and_busy(replay, 0, limit_s=30)[0].busy == 0 and seen[-1] == 0


@pytest.mark.timeout(300)
def test_bench_run_busy_replays_quiet_then_busy_and_shows_them_side_by_side(sim_model,
                                                                          tmp_path) -> None:
    """Over HTTP in the GPU-timed simulation, on servers started with their own defaults: the
    quiet replay, then the busy one, each in results.json (`busy` 0 and 1, with the neighbours'
    report) and side by side in summary.md with their CPU seconds."""
    from engine.entrypoints.cli import main

    from tests.utils.gpu_timed import simulated_run_argv

    out = tmp_path / "out"
    num_requests = 4
    assert main(simulated_run_argv(
        sim_model, tmp_path, "--workload", "cpu-bursts", "--num-requests", str(num_requests),
        "--rates", "4", "--seeds", "0", "--runner", "http", "--server-defaults", "--busy", "1",
        "--output-dir", str(out))) == 0
    doc = json.loads((out / "results.json").read_text())
    runs = doc["runs"]
    assert [(r["policy"], r["busy"]) for r in runs] == [("slo+mf-conservative-suspend", 0),
                                                        ("slo+mf-conservative-suspend", 1)]
    quiet, busy = (r["meta"]["busy_load"] for r in runs)
    assert quiet["processes"] == 0 and quiet["cpu_s"] == 0
    assert busy["processes"] == 1 and busy["cpu_s"] > 0 and busy["ended_early"] == 0
    for run in runs:
        assert run["meta"]["server_defaults"] is True and run["budget"] == 2048
        assert len(run["requests"]) == num_requests
        assert all(r["error"] is None for r in run["requests"]), run["requests"]
    assert sorted(c["busy"] for c in doc["aggregate"]) == [0, 1]
    summary = (out / "summary.md").read_text()
    assert "| busy |" in summary
    assert "slo+mf-conservative-suspend @ 2048, quiet | slo+mf-conservative-suspend @ 2048, " \
        "busy 1 |" in summary
    row = next(line for line in summary.splitlines()
               if line.startswith("| busy processes' CPU s"))
    assert row.split(" | ")[1] == "–" and f"{busy['cpu_s']:.1f}" in row.split(" | ")[2]
    assert "urgent TTFT attainment" in summary and "document TTFT p50 / p99" in summary
    # The busy replay's bound, costed by the step model its server ended with (/debug/stats):
    # its own calibration, refitted on the steps it served (not the benchmark's line, which
    # the server on its own defaults was never given).
    quiet_run, busy_run = runs
    assert "clairvoyant_server_line" not in quiet_run["meta"]
    own = StepTimeModel.from_dict(busy_run["meta"]["server_ttft_model"])
    assert own.seconds_per_token > 0 and own != StepTimeModel()  # measured, not the default
    assert busy_run["meta"]["clairvoyant_server_line"]["num_slo_requests"] == num_requests
    row = next(line for line in summary.splitlines()
               if line.startswith("| urgent: the bound on the server's own step model"))
    assert row.split(" | ")[1] == "–" and "/" in row.split(" | ")[2]
    # As each pair ended: both runs on disk before the end.
    records = read_figures(out / "results.jsonl")
    assert [(r["kind"], r.get("busy")) for r in records if r["kind"] != "request"] == [
        ("run", 0), ("run", 1), ("done", None)]
    # Each server calibrated itself at startup (a server handed a line skips that).
    log = (out / "server.log").read_text()
    assert log.count("own defaults") == 2 and log.count("startup calibration") >= 2
