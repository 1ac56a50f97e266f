"""`sloserve bench run`: a 20-request smoke run of each runner on a tiny model, through the CLI,
down to the JSON results, the Markdown table and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.entrypoints.cli import main
from monitor.predictor import LinearTTFT

NUM_REQUESTS = 20


def _bench(tiny_model, tmp_path: Path, *extra: str) -> dict:
    ttft = tmp_path / "ttft.json"
    LinearTTFT(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    out = tmp_path / "out"
    code = main(["bench", "run", "--model", tiny_model("llama"), "--dtype", "float32",
                 "--max-model-len", "512", "--num-kv-blocks", "400", "--ttft-model", str(ttft),
                 "--workload", "mixed", "--num-requests", str(NUM_REQUESTS), "--rates", "40",
                 "--seeds", "0", "--budgets", "128", "--output-dir", str(out), *extra])
    assert code == 0
    for name in ("summary.md", "attainment_vs_rate.png", "ttft_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "results.json").read_text())


def _check_run(run: dict, runner: str, policy: str) -> None:
    assert (run["runner"], run["policy"], run["budget"]) == (runner, policy, 128)
    assert len(run["requests"]) == NUM_REQUESTS
    assert all(r["error"] is None and r["ttft_s"] > 0 for r in run["requests"])
    assert all(r["output_tokens"] == 16 for r in run["requests"])
    assert {r["tier"] for r in run["requests"]} == {"urgent", "relaxed"}
    summary = run["summary"]
    assert summary["completed"] == NUM_REQUESTS
    assert 0.0 <= summary["ttft_slo_attainment"] <= 1.0
    assert run["clairvoyant"]["ttft_slo_attainment"] is not None
    # Computed tokens cover at least every prompt and output token once.
    computed = sum(r["prompt_tokens"] + r["output_tokens"] - 1 for r in run["requests"])
    assert run["engine"]["computed_tokens"] >= computed


def test_inprocess_runner_smoke(tiny_model, tmp_path):
    doc = _bench(tiny_model, tmp_path, "--policies", "fcfs", "slo+mf-conservative-pause")
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == {"fcfs", "slo+mf-conservative-pause"}
    for policy, run in runs.items():
        _check_run(run, "inprocess", policy)
    # Both policies saw the identical trace.
    prompts = [[r["prompt_tokens"] for r in run["requests"]] for run in runs.values()]
    assert prompts[0] == prompts[1]
    assert any(c["diff"] is not None for c in doc["aggregate"])


@pytest.mark.timeout(300)
def test_http_runner_smoke(tiny_model, tmp_path):
    """The HTTP runner starts a fresh `sloserve serve` for the policy and streams the trace."""
    doc = _bench(tiny_model, tmp_path, "--policies", "slo", "--runner", "http")
    (run,) = doc["runs"]
    _check_run(run, "http", "slo")


def test_user_trace_file_runs(tiny_model, tmp_path):
    """`--trace` takes the user's own JSONL requests too (text or token-id prompts)."""
    user = tmp_path / "mine.jsonl"
    rows = [{"prompt": "The quick brown fox jumps over the lazy dog", "output_tokens": 4,
             "ttft_slo_ms": 5000, "arrival_s": 0.0},
            {"prompt": [5, 6, 7, 8, 9, 10], "output_tokens": 3, "ttft_slo_ms": None,
             "arrival_s": 0.05, "tier": "batch"}]
    user.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ttft = tmp_path / "ttft.json"
    LinearTTFT(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    out = tmp_path / "out"
    assert main(["bench", "run", "--model", tiny_model("llama"), "--dtype", "float32",
                 "--max-model-len", "512", "--ttft-model", str(ttft), "--trace", str(user),
                 "--policies", "fcfs", "--seeds", "0", "--budgets", "128",
                 "--output-dir", str(out)]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert [r["output_tokens"] for r in run["requests"]] == [4, 3]
    assert [r["tier"] for r in run["requests"]] == ["user", "batch"]


def test_sweep_searches_a_rate_and_runs_the_three_rates(tiny_model, tmp_path):
    ttft = tmp_path / "ttft.json"
    LinearTTFT(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    out = tmp_path / "out"
    assert main(["bench", "sweep", "--model", tiny_model("llama"), "--dtype", "float32",
                 "--max-model-len", "512", "--ttft-model", str(ttft), "--num-requests", "6",
                 "--seeds", "0", "--budgets", "128", "--policies", "fcfs",
                 "--search-steps", "2", "--output-dir", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    rates = sorted(r["rate"] for r in runs)
    assert len(rates) == 3 and rates[1] == pytest.approx(2 * rates[0], rel=1e-3)
    assert rates[2] == pytest.approx(3 * rates[0], rel=1e-3)


def test_engine_pool_reuses_one_engine_and_reports_each_runs_own_counters(tiny_model):
    from transformers import AutoTokenizer

    from bench.attainment.policies import POLICIES
    from bench.attainment.runners import EnginePool, run_inprocess
    from bench.attainment.workloads import build_workload

    model = tiny_model("llama")
    trace = build_workload("uniform", 8, 40.0, 0, AutoTokenizer.from_pretrained(model),
                           lambda n: 0.01 + 2e-5 * n, max_prompt_len=480)
    with EnginePool(model, dtype="float32", max_model_len=512, num_kv_blocks=400,
                    enable_prefix_caching=False) as pool:
        first = run_inprocess(trace, POLICIES["fcfs"], model, 128, progress=False, pool=pool)
        engine = pool.get(POLICIES["fcfs"], 128)
        steps_after_first = engine.scheduler.step_id
        second = run_inprocess(trace, POLICIES["fcfs"], model, 128, progress=False, pool=pool)
        assert pool.get(POLICIES["fcfs"], 128) is engine  # probe: the same engine ran both
        assert engine.scheduler.step_id > steps_after_first
    # Each run's counters cover that run only: every prompt and output token once (no
    # preemptions), not the sum over the engine's life.
    expected = sum(len(r.prompt_token_ids) + r.output_tokens - 1 for r in trace.requests)
    assert first.engine["computed_tokens"] == second.engine["computed_tokens"] == expected
    assert all(r.ttft_s is not None for r in second.requests)
