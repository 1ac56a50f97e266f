"""`sloserve bench run`: a 20-request smoke run of each runner on a tiny model, through the CLI,
down to the JSON results, the Markdown table and the plots."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from engine.entrypoints.cli import main
from monitor.step_time_model import StepTimeModel

NUM_REQUESTS = 20
# The relaxed tier's TPOT objective in these runs: two isolated prefills of a 512-token chunk,
# clipped to the longest prompt (max-model-len 512 minus 16 output tokens), on the line below.
RELAXED_TPOT_MS = 2 * (0.01 + 2e-5 * 496) * 1000


def _bench(tiny_model, tmp_path: Path, *extra: str) -> dict:
    ttft = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
    out = tmp_path / "out"
    code = main(["bench", "run", "--model", tiny_model("llama"), "--dtype", "float32",
                 "--max-model-len", "512", "--num-kv-blocks", "400", "--ttft-model", str(ttft),
                 "--workload", "mixed", "--num-requests", str(NUM_REQUESTS), "--rates", "40",
                 "--seeds", "0", "--budgets", "128", "--output-dir", str(out), *extra])
    assert code == 0
    for name in ("summary.md", "attainment_vs_rate.png", "ttft_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    summary_md = (out / "summary.md").read_text()
    assert "| TPOT % | relaxed median TPOT (ms) |" in summary_md and "good %" in summary_md
    return json.loads((out / "results.json").read_text())


def _check_run(run: dict, runner: str, policy: str) -> None:
    assert (run["runner"], run["policy"], run["budget"]) == (runner, policy, 128)
    assert len(run["requests"]) == NUM_REQUESTS
    assert all(r["error"] is None and r["ttft_s"] > 0 for r in run["requests"])
    assert all(r["output_tokens"] == 16 for r in run["requests"])
    assert {r["tier"] for r in run["requests"]} == {"urgent", "relaxed"}
    for r in run["requests"]:  # the trace's objectives, recorded with each result
        expected = RELAXED_TPOT_MS if r["tier"] == "relaxed" else None
        assert r["tpot_slo_ms"] == pytest.approx(expected)
    summary = run["summary"]
    assert summary["completed"] == NUM_REQUESTS
    assert 0.0 <= summary["ttft_slo_attainment"] <= 1.0
    assert summary["num_tpot_slo_requests"] == 16 and 0.0 <= summary["tpot_slo_attainment"] <= 1
    # Every request has a TTFT SLO, so a good one met it (and its TPOT objective, if any).
    assert summary["num_good"] <= summary["num_slo_met"]
    assert summary["goodput_attainment"] == pytest.approx(summary["num_good"] / NUM_REQUESTS)
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
        # Every request carries a TTFT SLO, and the engine admitted each one.
        assert all(r["slack_at_admission_ms"] is not None for r in run["requests"])
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
    # The server's own TTFT beside the client's, and each stream's longest gap between chunks.
    assert all(r["server_ttft_s"] > 0 and r["max_stream_gap_s"] >= 0 for r in run["requests"])
    summary = run["summary"]
    assert summary["median_server_ttft_ms"] > 0
    assert summary["max_abs_ttft_client_minus_server_ms"] >= 0
    assert summary["max_stream_gap_ms"] >= summary["p99_max_stream_gap_ms"] > 0


def test_user_trace_file_runs(tiny_model, tmp_path):
    """`--trace` takes the user's own JSONL requests too (text or token-id prompts)."""
    user = tmp_path / "mine.jsonl"
    rows = [{"prompt": "The quick brown fox jumps over the lazy dog", "output_tokens": 4,
             "ttft_slo_ms": 5000, "arrival_s": 0.0},
            {"prompt": [5, 6, 7, 8, 9, 10], "output_tokens": 3, "ttft_slo_ms": None,
             "arrival_s": 0.05, "tier": "batch"}]
    user.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ttft = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
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
    StepTimeModel(seconds_per_token=2e-5, intercept_s=0.01).save(ttft)
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

    from engine.benchmarks.attainment.policies import POLICIES
    from engine.benchmarks.attainment.runners import EnginePool, run_inprocess
    from engine.benchmarks.attainment.workloads import build_workload

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


class _EngineLedger:
    """Stands in for EngineCore in an EnginePool: which engines are alive, and how many were
    alive when each was built."""

    def __init__(self) -> None:
        self.alive: list[Any] = []
        self.alive_at_build: list[int] = []

    def engine_class(self) -> type:
        ledger = self

        class LedgerEngine:
            def __init__(self, config: Any) -> None:
                self.device = config.model.device
                ledger.alive_at_build.append(len(ledger.alive))
                ledger.alive.append(self)

            def shutdown(self) -> None:
                ledger.alive.remove(self)

        return LedgerEngine


@pytest.fixture
def engine_ledger(monkeypatch) -> _EngineLedger:
    import engine.runtime.engine_core as engine_core

    ledger = _EngineLedger()
    monkeypatch.setattr(engine_core, "EngineCore", ledger.engine_class())
    return ledger


def _three_engines(pool: Any) -> list[Any]:
    from engine.benchmarks.attainment.policies import POLICIES

    return [pool.get(POLICIES[name], budget)
            for name, budget in (("fcfs", 128), ("slo", 128), ("fcfs", 256))]


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_engine_pool_holds_one_engine_at_a_time_on_cuda(tiny_model, engine_ledger, monkeypatch,
                                                         device):
    """On a GPU the next engine would size its KV pool from memory the previous one still
    holds: the pool shuts the previous one down before building the next. ``auto`` resolves
    to CUDA where torch sees a GPU (faked here)."""
    import engine.device
    from engine.benchmarks.attainment.policies import POLICIES
    from engine.benchmarks.attainment.runners import EnginePool

    monkeypatch.setattr(engine.device, "auto_device", lambda: ("cuda", "a faked GPU"))
    with EnginePool(tiny_model("llama"), device=device, dtype="float32") as pool:
        engines = _three_engines(pool)
        assert {e.device for e in engines} == {"cuda"}  # probe: the device was resolved
        assert engine_ledger.alive_at_build == [0, 0, 0]
        assert engine_ledger.alive == [engines[-1]]
        assert pool.get(POLICIES["fcfs"], 256) is engines[-1]  # the one alive is reused
    assert engine_ledger.alive == []


def test_engine_pool_keeps_more_engines_on_cuda_when_asked(tiny_model, engine_ledger):
    from engine.benchmarks.attainment.runners import EnginePool

    with EnginePool(tiny_model("llama"), max_engines=2, device="cuda", dtype="float32") as pool:
        engines = _three_engines(pool)
        assert engine_ledger.alive_at_build == [0, 1, 1]
        assert engine_ledger.alive == engines[1:]  # the oldest went
    assert engine_ledger.alive == []


def test_engine_pool_keeps_several_engines_on_the_cpu(tiny_model, engine_ledger):
    from engine.benchmarks.attainment.runners import CPU_MAX_ENGINES, EnginePool

    with EnginePool(tiny_model("llama"), device="cpu", dtype="float32") as pool:
        engines = _three_engines(pool)
        assert engine_ledger.alive_at_build == [0, 1, 2]
        assert engine_ledger.alive == engines
        assert pool.engine_limit("cpu") == CPU_MAX_ENGINES > len(engines)
    assert engine_ledger.alive == []
    with pytest.raises(ValueError, match="max_engines"):
        EnginePool(tiny_model("llama"), max_engines=0)


def test_inprocess_runner_hands_the_engine_both_objectives(tiny_model, monkeypatch):
    from transformers import AutoTokenizer

    from engine.benchmarks.attainment.policies import POLICIES
    from engine.benchmarks.attainment.runners import EnginePool, run_inprocess
    from engine.benchmarks.attainment.workloads import build_workload

    model = tiny_model("llama")
    trace = build_workload("mixed", 6, 40.0, 0, AutoTokenizer.from_pretrained(model),
                           lambda n: 0.01 + 2e-5 * n, max_prompt_len=480)
    with EnginePool(model, dtype="float32", max_model_len=512, num_kv_blocks=400,
                    enable_prefix_caching=False) as pool:
        engine = pool.get(POLICIES["slo"], 128)
        seen: dict[str, tuple[float | None, float | None]] = {}
        submit = engine.submit_request

        def spy(request):  # what reached the engine, request by request
            seen[request.request_id] = (request.ttft_slo_ms, request.tpot_slo_ms)
            return submit(request)

        monkeypatch.setattr(engine, "submit_request", spy)
        run = run_inprocess(trace, POLICIES["slo"], model, 128, progress=False, pool=pool)
    assert seen == {r.request_id: (r.ttft_slo_ms, r.tpot_slo_ms) for r in trace.requests}
    assert any(tpot is not None for _, tpot in seen.values())
    assert [r.tpot_slo_ms for r in run.requests] == [r.tpot_slo_ms for r in trace.requests]
    assert all(r.tpot_slo_met is not None for r in run.requests if r.tier == "relaxed")


def test_http_runner_sends_both_objectives_and_reads_the_final_metrics(tiny_model):
    """Against the real API server app over a scripted core: the objectives reach the engine,
    and the final chunk's metrics (preemptions, slack at admission) reach the result."""
    from transformers import AutoTokenizer

    from engine.benchmarks.attainment.runners import _one_http
    from engine.benchmarks.attainment.traces import TraceRequest
    from engine.ipc.core_messages import CoreOutputs
    from engine.outputs import EngineCoreOutput, SchedulerStats
    from tests.utils.inprocess_server import FakeCore, app_client

    def three_tokens(message):
        outs = [EngineCoreOutput(req_id=message.request_id, new_token_ids=[5 + i],
                                 num_preemptions=1, slack_at_admission_s=0.042,
                                 finish_reason="length" if i == 2 else None) for i in range(3)]
        return [CoreOutputs(outputs=[out], stats=SchedulerStats()) for out in outs], False

    model_dir = tiny_model("llama")
    fake = FakeCore(len(AutoTokenizer.from_pretrained(model_dir)), script=three_tokens)
    tr = TraceRequest("r0", "relaxed", 0.0, [5, 6, 7, 8], 3, ttft_slo_ms=800.0,
                      tpot_slo_ms=35.5)

    async def run():
        async with app_client(model_dir, fake=fake) as (http, _):
            return await _one_http(http, tr, time.monotonic(), priority=0, model_name=None)

    result = asyncio.run(run())
    (sent,) = fake.requests
    assert (sent.ttft_slo_ms, sent.tpot_slo_ms) == (800.0, 35.5)
    assert result.error is None and result.output_tokens == 3
    assert (result.ttft_slo_ms, result.tpot_slo_ms) == (800.0, 35.5)
    assert result.num_preemptions == 1
    assert result.slack_at_admission_ms == pytest.approx(42.0)
    assert result.tpot_slo_met is not None
    assert result.server_ttft_s is not None and result.max_stream_gap_s is not None


@pytest.mark.parametrize("kind", ["json", "tool"])
def test_inprocess_runner_constrains_the_urgent_tier_alone(tiny_model, monkeypatch, kind):
    """--urgent-constraint: the urgent turns carry the kind's grammar, the others none; each
    language is too long to finish, so every request decodes its full output."""
    from transformers import AutoTokenizer

    from engine.benchmarks.attainment.constraints import structured_params
    from engine.benchmarks.attainment.policies import POLICIES
    from engine.benchmarks.attainment.runners import EnginePool, run_inprocess
    from engine.benchmarks.attainment.workloads import build_workload

    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    trace = build_workload("mixed", 6, 40.0, 0, tokenizer, lambda n: 0.01 + 2e-5 * n,
                           max_prompt_len=480)
    with EnginePool(model, dtype="float32", max_model_len=512, num_kv_blocks=400,
                    enable_prefix_caching=False) as pool:
        engine = pool.get(POLICIES["slo"], 128)
        seen = {}
        submit = engine.submit_request

        def spy(request):
            seen[request.request_id] = request
            return submit(request)

        monkeypatch.setattr(engine, "submit_request", spy)
        run = run_inprocess(trace, POLICIES["slo"], model, 128, progress=False, pool=pool,
                            constraint=kind)
    assert run.policy == f"slo [{kind}]"
    tiers = {r.request_id: r.tier for r in trace.requests}
    assert "urgent" in tiers.values() and "relaxed" in tiers.values()
    for req_id, request in seen.items():
        constraint = request.sampling_params.structured_outputs
        assert constraint == (structured_params(kind) if tiers[req_id] == "urgent" else None)
    assert all(r.error is None and r.output_tokens == r_trace.output_tokens
               for r, r_trace in zip(run.requests, trace.requests))
    # Probe: the urgent outputs really are in the grammar's language (what of its opening 16
    # tokens reach, whitespace aside: the json kind allows it), and the others are not.
    opening = '{"summary":"' if kind == "json" else '[{"name":"'

    def opens(text: str) -> bool:
        compact = "".join(text.split())
        return bool(compact) and (compact.startswith(opening) or opening.startswith(compact))

    texts = {req_id: tokenizer.decode(request.output_token_ids)
             for req_id, request in seen.items()}
    assert all(opens(texts[req_id]) for req_id in texts if tiers[req_id] == "urgent"), texts
    assert not any(opens(texts[req_id]) for req_id in texts if tiers[req_id] != "urgent")


@pytest.mark.parametrize("kind", ["json", "tool"])
def test_http_runner_sends_the_urgent_constraint_as_the_api_takes_it(tiny_model, kind):
    """Over HTTP the constraint is a request field the API server parses (response_format for
    json, structured_outputs for the tool call's grammar): the engine gets the same grammar as
    in process, and a relaxed request gets none."""
    from transformers import AutoTokenizer

    from engine.benchmarks.attainment.constraints import structured_params
    from engine.benchmarks.attainment.runners import _one_http
    from engine.benchmarks.attainment.traces import TraceRequest
    from engine.ipc.core_messages import CoreOutputs
    from engine.outputs import EngineCoreOutput, SchedulerStats
    from tests.utils.inprocess_server import FakeCore, app_client

    def one_token(message):
        out = EngineCoreOutput(req_id=message.request_id, new_token_ids=[5],
                               finish_reason="length")
        return [CoreOutputs(outputs=[out], stats=SchedulerStats())], False

    model_dir = tiny_model("llama")
    fake = FakeCore(len(AutoTokenizer.from_pretrained(model_dir)), script=one_token)
    urgent = TraceRequest("u0", "urgent", 0.0, [5, 6, 7, 8], 1, ttft_slo_ms=800.0)
    relaxed = TraceRequest("r0", "relaxed", 0.0, [5, 6, 7, 8], 1, ttft_slo_ms=8000.0)

    async def run():
        async with app_client(model_dir, fake=fake) as (http, _):
            return [await _one_http(http, tr, time.monotonic(), priority=0, model_name=None,
                                    constraint=kind) for tr in (urgent, relaxed)]

    results = asyncio.run(run())
    assert all(r.error is None for r in results), [r.error for r in results]
    sent_urgent, sent_relaxed = fake.requests  # sent one after the other, in this order
    assert sent_urgent.sampling_params.structured_outputs == structured_params(kind)
    assert sent_relaxed.sampling_params.structured_outputs is None


def test_urgent_constraints_are_for_one_server_and_known_kinds(capsys):
    assert main(["bench", "run", "--replicas", "2", "--urgent-constraint", "json"]) == 2
    assert "--urgent-constraint runs on one server or engine" in capsys.readouterr().err
    assert main(["bench", "run", "--urgent-constraint", "yaml"]) == 2
    assert "invalid choice: 'yaml'" in capsys.readouterr().err


def test_the_replay_order_rotates_per_trace_only_when_asked():
    from engine.benchmarks.attainment.cli import replay_order

    kinds = ["none", "json", "tool"]
    assert [replay_order(kinds, i, rotate=False) for i in range(3)] == [kinds] * 3
    rotated = [replay_order(kinds, i, rotate=True) for i in range(4)]
    assert rotated == [kinds, ["json", "tool", "none"], ["tool", "none", "json"], kinds]
    # Over as many traces as kinds, each kind replays once in each place.
    assert all(sorted(order[place] for order in rotated[:3]) == sorted(kinds)
               for place in range(3))


def test_rotated_constraints_replay_in_each_place_and_say_so(sim_model, tmp_path):
    """--rotate-constraints: the second seed replays its kinds from the second on; each run
    records its place (meta.replay), so a table's kinds can be read against their places."""
    from tests.utils.gpu_timed import simulated_run_argv

    out = tmp_path / "out"
    assert main(simulated_run_argv(
        sim_model, tmp_path, "--workload", "mixed", "--num-requests", "4", "--rates", "2",
        "--seeds", "0", "1", "--budgets", "2048", "--policies", "fcfs", "--urgent-constraint",
        "none", "json", "--rotate-constraints", "--output-dir", str(out))) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    placed = {(run["seed"], run["meta"]["replay"]): run["policy"] for run in runs}
    assert placed == {(0, 0): "fcfs", (0, 1): "fcfs [json]",
                      (1, 0): "fcfs [json]", (1, 1): "fcfs"}
    # Probe: the runs are in results.json in the order they ran.
    assert [(r["seed"], r["meta"]["replay"]) for r in runs] == sorted(placed)


def test_a_simulated_run_hands_its_servers_absolute_paths(tmp_path, monkeypatch):
    """`bench run --simulate PROFILE` without --model or --ttft-model writes the shape's folder
    and the calibrated TTFT line under the output folder; the HTTP runner's servers run from the
    project's root, so a relative output folder (the default, bench_results) must not leave them
    relative paths (the README's --urgent-constraint command failed at its first server)."""
    from pathlib import Path

    from engine.benchmarks.attainment.cli import _setup
    from engine.entrypoints.cli import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["bench", "run", "--simulate", "h100-llama-3.1-8b",
                                      "--workload", "burst"])
    setup = _setup(args, Path("bench_results"))
    try:
        assert Path(setup.model).is_absolute() and (Path(setup.model) / "config.json").exists()
        assert Path(setup.model).parent == tmp_path / "bench_results"
        ttft = setup.engine_overrides.get("ttft_model")
        assert ttft is not None and Path(ttft).is_absolute() and Path(ttft).exists()
    finally:
        setup.close()


def test_a_simulated_shape_with_a_smaller_vocabulary_gets_a_tokenizer_that_fits(tmp_path,
                                                                               monkeypatch):
    """Mixtral's 32000 tokens are fewer than the default tokenizer's 49152: the simulated run's
    folder gets a small tokenizer trained for it instead of failing on the default one (here
    in miniature: a 420-token shape and a 439-token default)."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.benchmarks.attainment import cli
    from engine.entrypoints import default_model
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    large = save_tiny_tokenizer(tmp_path / "large", vocab_size=600)  # 439 tokens: the corpus
    monkeypatch.setattr(default_model, "model_path_or_default", lambda model: str(large))
    from engine.benchmarks.inputs import model_shapes

    monkeypatch.setitem(model_shapes.SHAPES, "mixtral-8x7b",
                        {**model_shapes.SHAPES["mixtral-8x7b"], "vocab_size": 420})
    folder = cli._simulated_model("h200-mixtral-8x7b", tmp_path)
    assert len(AutoTokenizer.from_pretrained(str(large))) > 420  # probe: the default is too big
    assert len(AutoTokenizer.from_pretrained(folder)) <= 420
    assert AutoConfig.from_pretrained(folder).architectures == ["MixtralForCausalLM"]
