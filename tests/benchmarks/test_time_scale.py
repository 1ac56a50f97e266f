"""`sloserve bench run --simulate PROFILE --time-scale K` (engine/benchmarks/attainment/
time_scale.py): the engines run a K-times slower profile, the trace arrives K times slower with
K times its objectives, and every figure comes back in the profile's time."""

from __future__ import annotations

import json

import pytest

from engine.benchmarks.attainment.results import RequestResult, RunResult
from engine.benchmarks.attainment.time_scale import (restored_run, slowed_line, slowed_profile,
                                                     slowed_trace)
from engine.benchmarks.attainment.traces import Trace, TraceRequest
from engine.simulation.profile import load_profile
from monitor.step_time_model import StepTimeModel, predict_prefill


@pytest.mark.parametrize("name", ["h100-llama-3.1-8b", "h100-qwen3-30b-a3b"])
def test_a_slowed_profile_and_line_take_k_times_as_long(name: str) -> None:
    profile = load_profile(name)  # dense, and a mixture of experts (its expert reads slowed too)
    slow = slowed_profile(profile, 4)
    assert slow.num_layers == profile.num_layers and slow.model_shape == profile.model_shape
    for features in [(1, 0, 300), (64, 0, 64 * 4096), (2048, 2048 * (2 * 8000 + 2048), 0),
                     (24_000, 24_000 ** 2, 0)]:
        assert slow.step_seconds(*features) == pytest.approx(4 * profile.step_seconds(*features))
        assert slow.compute_seconds(*features) == pytest.approx(
            4 * profile.compute_seconds(*features))
    assert slow.unwind_s == pytest.approx(4 * profile.unwind_s)
    line = StepTimeModel(seconds_per_token=2e-5, intercept_s=0.005, seconds_per_token_sq=1e-9,
                         seconds_per_decode_context=3e-7, floor_s=0.008, relative_error=0.1,
                         calibrated_tokens=8192, edge_seconds_per_token=1.5e-5)
    slow_line = slowed_line(line, 4)
    assert slow_line.relative_error == 0.1 and slow_line.calibrated_tokens == 8192
    for tokens in (16, 2048, 20_000):  # past the calibrated range too
        assert predict_prefill(slow_line, tokens, 500, 2048) == pytest.approx(
            4 * predict_prefill(line, tokens, 500, 2048))


def _request(rid: str, arrival: float, slo: float | None) -> TraceRequest:
    return TraceRequest(rid, "urgent", arrival, [1, 2, 3], 4, slo, tpot_slo_ms=None)


def test_a_slowed_replay_is_restored_to_the_profiles_time() -> None:
    trace = Trace([_request("a", 0.0, 150.0), _request("b", 0.3, None)],
                  meta={"workload": "w", "rate": 8.0, "seed": 0})
    slow = slowed_trace(trace, 3)
    assert [(r.arrival_s, r.ttft_slo_ms) for r in slow.requests] == [(0.0, 450.0),
                                                                    (pytest.approx(0.9), None)]
    assert slow.meta["rate"] == 8.0 and trace.requests[1].arrival_s == 0.3  # unchanged
    # What a client measures of the slowed replay: 3x the profile's times (plus nothing else).
    measured = RunResult(runner="http", policy="p", budget=2048, workload="w", rate=8.0, seed=0,
                         duration_s=3.0, requests=[
                             RequestResult("a", "urgent", 0.0, 3, 4, 450.0, ttft_s=0.42,
                                           e2e_s=0.6, tpot_s=0.06, server_ttft_s=0.39,
                                           slack_at_admission_ms=30.0),
                             RequestResult("b", "urgent", 0.9, 3, 0, None, ttft_s=None,
                                           e2e_s=None, tpot_s=None, error="HTTP 429",
                                           rejected_predicted_ttft_ms=600.0)])
    run = restored_run(measured, trace, 3)
    a, b = run.requests
    assert run.duration_s == pytest.approx(1.0) and run.meta["time_scale"] == 3
    assert (a.arrival_s, a.ttft_slo_ms) == (0.0, 150.0)  # the trace's own, exactly
    assert (a.ttft_s, a.e2e_s, a.tpot_s, a.server_ttft_s, a.slack_at_admission_ms) == \
        pytest.approx((0.14, 0.2, 0.02, 0.13, 10.0))
    assert a.slo_met and b.arrival_s == 0.3 and b.rejected_predicted_ttft_ms == pytest.approx(200)
    assert restored_run(measured, trace, 1.0) is measured


@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "4"], "needs --simulate"),
    (["--simulate", "h100-llama-3.1-8b", "--time-scale", "0.5"], "finite number >= 1"),
    (["--simulate", "h100-llama-3.1-8b", "--time-scale", "4", "--runner", "http", "--url",
      "http://127.0.0.1:9"], "not --url"),
])
def test_a_bad_time_scale_is_refused_before_anything_runs(argv, message, tmp_path,
                                                          capsys) -> None:
    from engine.entrypoints.cli import main

    out = tmp_path / "out"
    assert main(["bench", "run", "--output-dir", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()


@pytest.mark.timeout(300)
def test_a_slowed_run_reports_the_profiles_time(sim_model, tmp_path) -> None:
    """Four requests in process, three times slower. The probe that the engine really ran the
    slowed profile: a first token can come no sooner than its prefill step, and restored (/3)
    the first request's TTFT is still at least the profile's step; an engine at full speed would
    show a third of it."""
    from engine.entrypoints.cli import main

    from tests.utils.gpu_timed import simulated_run_argv

    out = tmp_path / "out"
    assert main(simulated_run_argv(
        sim_model, tmp_path, "--workload", "mixed", "--num-requests", "4", "--rates", "2",
        "--seeds", "0", "--budgets", "2048", "--policies", "fcfs", "--time-scale", "3",
        "--output-dir", str(out))) == 0
    written = json.loads((out / "slowed" / "profile-x3.json").read_text())
    profile = load_profile("h100-llama-3.1-8b")
    assert written["intercept_s"] == pytest.approx(3 * profile.intercept_s)
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["meta"]["time_scale"] == 3
    first = min(run["requests"], key=lambda r: r["arrival_s"])
    step_s = profile.step_seconds(first["prompt_tokens"], first["prompt_tokens"] ** 2, 0)
    assert first["ttft_s"] >= 0.95 * step_s, (first["ttft_s"], step_s)


def test_the_fleet_table_says_its_runs_were_slowed() -> None:
    from engine.benchmarks.fleet.fleet_run import fleet_table

    def run(scale: float) -> RunResult:
        return RunResult(runner="fleet", policy="slack", budget=2048, workload="fleet-chat",
                         rate=4.0, seed=0, duration_s=1.0, requests=[
                             RequestResult("a", "urgent", 0.0, 3, 4, 150.0, ttft_s=0.1,
                                           e2e_s=0.2, tpot_s=0.03, replica="r1")],
                         meta={"fleet": {"replicas": 4}, "time_scale": scale})

    assert "run 4x slower, figures in the profile's time" in fleet_table([run(4.0)])
    assert "slower" not in fleet_table([run(1.0)])
