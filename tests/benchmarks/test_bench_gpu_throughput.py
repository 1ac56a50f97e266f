"""The device throughput benchmark (engine/benchmarks/device_throughput) without timing
anything: its --smoke run (a tiny Llama on the CPU, with --profile) goes end to end through
the limits, the HF process, the eager engine, the engine and the engine's profile, and reports
every figure beside its bound, the mixed kind and the graphs-against-eager columns included;
the bounds match a hand count; the profile's per-step figures match a hand count on a
synthetic GPU timeline; --device auto and cuda resolve as documented.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.benchmarks.device_throughput import benchmark, bounds, engine_steps, report
from engine.benchmarks.measure.roofline import ModelShape
from tests.utils.figures_wait import wait_for_figures

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, stdout) of one smoke run, float32 (the quickest on any CPU), with the small
    tokenizer the bench trains itself when given none, and the engine profiled after it."""
    out = tmp_path_factory.mktemp("gpu-throughput") / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench.suite.gpu_throughput", "--smoke", "--device", "cpu",
         "--dtype", "float32", "--profile", "--profile-steps", "2", "--output", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def _positive(value: float, what: str) -> None:
    assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (what, value)


def test_smoke_run_reports_both_sides_against_the_bounds(smoke):
    result, _ = smoke
    assert result["smoke"] and result["device"]["type"] == "cpu"
    assert result["dtype"] == "float32" and result["limits"]["matmul_dtype"] == "float32"
    sizes = result["sizes"]
    assert sizes == {k: benchmark.SMOKE[k] for k in benchmark.FULL}
    assert result["config"]["hidden_size"] == benchmark.SMOKE_SHAPE["hidden_size"]
    _positive(result["limits"]["copy_bandwidth_gbs"], "copy bandwidth")
    _positive(result["limits"]["matmul_tflops"], "matmul")

    for side in ("engine", "hf"):
        figures = result[side]
        assert "error" not in figures, figures
        prefill = figures["prefill"]
        assert prefill["prompt_len"] == sizes["prefill_len"]
        for key in ("tokens_per_s", "step_ms", "pct_of_bound"):
            _positive(prefill[key], f"{side} prefill {key}")
        _positive(prefill["bound"]["tokens_per_s"], f"{side} prefill bound")
        assert set(figures["decode"]) == {str(b) for b in sizes["batches"]}
        for batch, row in figures["decode"].items():
            assert row["batch"] == int(batch) and row["context"] == sizes["context"]
            # Every timed step decoded the whole batch, past the prompt.
            assert row["steps_measured"] >= sizes["decode_steps"], (side, row)
            assert row["mean_context"] > sizes["context"]
            for key in ("tokens_per_s", "tpot_ms", "pct_of_bound", "step_ms_max"):
                _positive(row[key], f"{side} decode {batch} {key}")
            for key in ("tokens_per_s", "tpot_ms", "memory_ms", "compute_ms", "bytes_per_step"):
                _positive(row["bound"][key], f"{side} decode {batch} bound {key}")
            # TPOT is one sequence's time per token: the step time, batch tokens per step.
            assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1000 / row["tpot_ms"])
    # The engine's prefill ran one prompt per step (the prompt is the whole token budget).
    assert result["engine"]["prefill"]["steps"] == result["engine"]["prefill"]["prompts"]
    assert result["hf"]["transformers"]
    assert "mixed" not in result["hf"]  # HF has no step of decodes and a chunk together


def _check_mixed(mixed: dict, sizes: dict, what: str) -> None:
    decodes, chunk = sizes["mixed_decodes"], sizes["mixed_chunk"]
    assert (mixed["batch"], mixed["chunk"], mixed["context"]) == (decodes, chunk,
                                                                  sizes["context"])
    assert mixed["tokens_per_step"] == decodes + chunk
    # Probe: the steps timed ran every decode and one chunk, as many as the decode figures.
    assert mixed["steps_measured"] >= sizes["decode_steps"], (what, mixed)
    assert mixed["mean_context"] > sizes["context"]  # the decodes were past their prompts
    assert 0 < mixed["mean_chunk_start"] < mixed["prompt_len"]  # chunks of a long prompt
    assert mixed["prompt_len"] % chunk == 0 and mixed["long_prompts"] >= 2
    for key in ("step_ms", "tpot_ms", "tokens_per_s", "decode_tokens_per_s"):
        _positive(mixed[key], f"{what} mixed {key}")
    assert mixed["tokens_per_s"] == pytest.approx(mixed["tokens_per_step"] * 1000
                                                  / mixed["step_ms"])
    assert mixed["preemptible"] is False  # a 16-token chunk is under slo_preempt_min_tokens


def test_smoke_run_times_the_mixed_kind_against_its_bound(smoke):
    result, _ = smoke
    mixed = result["engine"]["mixed"]
    _check_mixed(mixed, result["sizes"], "engine")
    _positive(mixed["pct_of_bound"], "mixed % of bound")
    for key in ("tokens_per_s", "tpot_ms", "memory_ms", "compute_ms", "bytes_per_step"):
        _positive(mixed["bound"][key], f"mixed bound {key}")
    row = result["rows"][-1]
    assert (row["phase"], row["batch"], row["chunk"]) == ("mixed", mixed["batch"],
                                                          mixed["chunk"])
    assert row["hf_tokens_per_s"] is None and row["engine_tpot_ms"] == mixed["step_ms"]


def test_smoke_run_sets_graphs_beside_eager(smoke):
    result, stdout = smoke
    sizes, engine, eager = result["sizes"], result["engine"], result["eager"]
    assert "error" not in eager, eager
    # Probe: the second engine really ran with enforce_eager, the first without; on the CPU
    # neither captured a graph (so both ran the same code).
    assert eager["enforce_eager"] is True and engine["enforce_eager"] is False
    for side in (engine, eager):
        assert side["graphs"] == {"decode_graph_sizes": [], "decode_graph_replays": 0,
                                  "piecewise_step_sizes": [], "piecewise_replays": 0}
    assert eager["memory_left_gb"] is None  # the CPU has no device allocator
    # A prefill step of the whole budget (more than 512 tokens on a GPU) runs eager with graphs
    # on too: not measured twice.
    assert "prefill" not in eager
    assert list(eager["decode"]) == [str(b) for b in sizes["eager_batches"]]
    for batch, row in eager["decode"].items():
        assert row["steps_measured"] >= sizes["decode_steps"]
        _positive(row["tpot_ms"], f"eager decode {batch}")
    _check_mixed(eager["mixed"], sizes, "eager")

    rows = result["graphs_vs_eager"]
    assert [(r["phase"], r["batch"]) for r in rows] == (
        [("decode", b) for b in sizes["eager_batches"]] + [("mixed", sizes["mixed_decodes"])])
    for row in rows:
        for key in ("graphs_step_ms", "eager_step_ms", "graphs_tokens_per_s",
                    "eager_tokens_per_s", "speedup"):
            _positive(row[key], f"{row['phase']} {row['batch']} {key}")
        assert row["speedup"] == pytest.approx(row["eager_step_ms"] / row["graphs_step_ms"])
    assert rows[0]["graphs_step_ms"] == engine["decode"]["1"]["tpot_ms"]
    assert rows[-1]["eager_step_ms"] == eager["mixed"]["step_ms"]

    # The markdown table after the throughput table, one line per row, each with numbers.
    section = stdout[stdout.index("#### CUDA graphs against --enforce-eager"):]
    assert stdout.index("| phase | batch |") < stdout.index("#### CUDA graphs against")
    assert "On the CPU there are no CUDA graphs" in section
    header = ("| step | batch | tokens/step | graphs ms/step | eager ms/step | graphs tok/s "
              "| eager tok/s | speed-up |")
    lines = section.splitlines()
    first = lines.index(header)
    table = lines[first + 2:first + 2 + len(rows)]
    assert [line.split(" | ")[0] for line in table] == ["| decode"] * (len(rows) - 1) + ["| mixed"]
    for line, row in zip(table, rows):
        assert f"| {row['speedup']:.2f}x |" in line and " - " not in line


def test_smoke_run_prints_one_markdown_table(smoke):
    result, stdout = smoke
    rows = result["rows"]
    sizes = result["sizes"]
    assert [(r["phase"], r["batch"]) for r in rows] == \
        [("prefill", 1)] + [("decode", b) for b in sizes["batches"]] \
        + [("mixed", sizes["mixed_decodes"])]
    for row in rows:
        keys = ("engine_tokens_per_s", "bound_tokens_per_s", "engine_pct_of_bound")
        if row["phase"] != "mixed":
            keys += ("hf_tokens_per_s", "hf_pct_of_bound")
        for key in keys:
            _positive(row[key], f"{row['phase']} {row['batch']} {key}")
    # stdout is the markdown alone (progress, logs and the HF process's output go to stderr).
    assert stdout.startswith("### bench/gpu_throughput:")
    lines = stdout.strip().splitlines()
    assert "SMOKE RUN" in stdout
    # The throughput table is the first one (the profile's tables follow it).
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) == 2 + len(rows)  # header, alignment, one line per row
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "engine % of bound" in table[0] and "HF TPOT ms" in table[0]
    assert table[2].startswith("| prefill | 1 |")
    assert table[-1].startswith(f"| mixed | {sizes['mixed_decodes']} + {sizes['mixed_chunk']} |")


def test_a_failed_side_leaves_the_other_in_the_table(smoke):
    result, _ = smoke
    failed = {**result, "hf": {"error": "RuntimeError: the HF process exited with 1"}}
    failed["rows"] = report.table_rows(failed["engine"], failed["hf"])
    assert [r["hf_tokens_per_s"] for r in failed["rows"]] == [None] * len(result["rows"])
    assert all(r["engine_tokens_per_s"] for r in failed["rows"])
    text = report.markdown(failed)
    assert "**hf not measured:** RuntimeError: the HF process exited with 1" in text
    assert "| - | - |" in text  # HF's cells and the ratio


def test_bounds_match_a_hand_count():
    shape = ModelShape.from_hf_config(SimpleNamespace(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=None, vocab_size=100))
    limits = {"copy_bandwidth_gbs": 1e-6, "matmul_tflops": 1e-9}  # 1000 B/s, 1000 FLOP/s
    per_layer = 64 + 32 + 32 + 64 + 128 + 128 + 128

    prefill = bounds.prefill_bound(shape, 3, limits)
    flops = 2 * 2 * per_layer * 3 + 2 * 800 + 2 * 4 * 2 * (1 + 2 + 3) * 4
    assert prefill["flops"] == flops
    assert prefill["step_ms"] == pytest.approx(1000 * flops / 1000)
    assert prefill["tokens_per_s"] == pytest.approx(3 / (flops / 1000))

    # 2 requests of 10 keys, float32: the weights once, each request's K and V.
    decode = bounds.decode_bound(shape, 2, 10.0, 4, limits)
    nbytes = (2 * per_layer + 800) * 4 + 2 * 2 * 2 * 2 * 20 * 4
    step_flops = 2 * 2 * per_layer * 2 + 2 * 800 * 2 + 4 * 2 * 4 * 2 * 20
    assert decode["bytes_per_step"] == nbytes and decode["flops_per_step"] == step_flops
    assert decode["memory_ms"] == pytest.approx(nbytes)  # at 1000 B/s: bytes = milliseconds
    assert decode["compute_ms"] == pytest.approx(step_flops)
    assert decode["tpot_ms"] == max(decode["memory_ms"], decode["compute_ms"])
    assert decode["tokens_per_s"] == pytest.approx(2 / (decode["tpot_ms"] / 1000))


def test_mixed_bound_matches_a_hand_count():
    shape = ModelShape.from_hf_config(SimpleNamespace(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=None, vocab_size=100))
    limits = {"copy_bandwidth_gbs": 1e-6, "matmul_tflops": 1e-9}  # 1000 B/s, 1000 FLOP/s
    # 2 decodes at 10 keys and a 3-token chunk after 5 cached tokens, float32.
    figures = {"batch": 2, "mean_context": 10.0, "chunk": 3, "mean_chunk_start": 5.0,
               "tokens_per_step": 5}
    bound = bounds.mixed_bound(shape, figures, 4, limits)
    per_layer = 64 + 32 + 32 + 64 + 128 + 128 + 128
    kv_per_token = 2 * 2 * 2 * 2 * 4  # K and V, layers, KV heads, head_dim, bytes
    # The weights once, the decodes' K/V, and the chunk's prefix and its own K/V.
    assert bound["bytes_per_step"] == (2 * per_layer + 800) * 4 + kv_per_token * (10 + 10 + 8)
    attention = 4 * 2 * 4 * 2  # FLOPs per key: QK^T and PV, layers, heads, head_dim
    decodes = 2 * 2 * per_layer * 2 + 2 * 800 * 2 + attention * 10 * 2
    chunk = 2 * 2 * per_layer * 3 + attention * (3 * 5 + 1 + 2 + 3)
    assert bound["flops_per_step"] == decodes + chunk
    assert bound["memory_ms"] == pytest.approx(bound["bytes_per_step"])
    assert bound["tpot_ms"] == pytest.approx(decodes + chunk)  # compute-bound here
    assert bound["tokens_per_s"] == pytest.approx(5 / ((decodes + chunk) / 1000))


def test_mixed_workload_keeps_every_step_steady():
    workload = engine_steps.MixedWorkload.for_sizes(benchmark.FULL, 17)
    # 2048-token prompts in 8 whole chunks; three of them give the 17 steps and a spare prompt
    # for the first one's chunks that run beside the decodes' prefill.
    assert (workload.prompt_len, workload.prompts) == (2048, 4)
    # The decodes outlast every chunk: their own prefill (16 x 512 tokens beside a chunk),
    # every chunk, and two more.
    assert workload.decode_max_tokens == math.ceil(16 * 512 / (2048 - 16 - 256)) + 32 + 2
    steady = {"requests": [(600, 1)] * 16 + [(512, 256)]}
    assert workload.is_mixed_step(steady)
    assert not workload.is_mixed_step({"requests": [(600, 1)] * 16 + [(1792, 200)]})
    assert not workload.is_mixed_step({"requests": [(600, 1)] * 15 + [(512, 256)]})
    assert not workload.is_mixed_step({"requests": [(0, 256)] * 8})

    limits = engine_steps.engine_limits(benchmark.FULL)
    assert limits["max_num_seqs"] == 128
    # The context the full run had before the mixed kind: the decode graphs' captured table
    # width (and so their attention launch) stays the same.
    assert limits["max_model_len"] == 2048 + engine_steps.WARMUP_TOKENS + 1
    small = {**benchmark.FULL, "batches": [1, 4]}
    limits = engine_steps.engine_limits(small)
    assert limits["max_num_seqs"] == 17  # the mixed kind's decodes and one long prompt
    needs = 16 * math.ceil((512 + workload.decode_max_tokens + 1) / 16) + 2048 // 16 + 1
    assert limits["num_kv_blocks"] >= needs


def test_scheduler_settings_are_put_back():
    config = SimpleNamespace(long_prefill_token_threshold=0, max_num_seqs=128)
    llm = SimpleNamespace(engine=SimpleNamespace(scheduler=SimpleNamespace(config=config)))
    with pytest.raises(RuntimeError, match="inside"):
        with engine_steps.scheduler_settings(llm, long_prefill_token_threshold=256,
                                             max_num_seqs=17):
            assert (config.long_prefill_token_threshold, config.max_num_seqs) == (256, 17)
            raise RuntimeError("inside")
    assert (config.long_prefill_token_threshold, config.max_num_seqs) == (0, 128)
    with pytest.raises(AttributeError, match="no max_num_batched"):
        with engine_steps.scheduler_settings(llm, max_num_batched=1):
            pass


def test_a_failed_eager_engine_leaves_the_graphs_figures(smoke):
    result, _ = smoke
    failed = {**result, "eager": {"error": "RuntimeError: out of memory"},
              "graphs_vs_eager": []}
    text = report.markdown(failed)
    assert "**eager engine not measured:** RuntimeError: out of memory" in text
    assert "| phase | batch |" in text  # the throughput table is all there
    args = benchmark.parse_args(["--smoke"])
    assert benchmark._failed(args, failed) and not benchmark._failed(args, result)
    args = benchmark.parse_args(["--smoke", "--no-eager"])
    assert not benchmark._failed(args, failed)


def test_enough_tokens_that_the_whole_batch_decodes_together():
    # 128 prompts of 512 tokens in a 2048-token budget: the last is prefilled by step 35 (each
    # step's decodes take budget from the prefill); 16 full-batch steps must follow.
    assert engine_steps._decode_max_tokens(128, 512, 2048, 16) == 35 + 16 + 2
    assert engine_steps._decode_max_tokens(1, 512, 2048, 16) == 1 + 16 + 2


def test_device_auto_follows_cuda_availability(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert benchmark.resolve_device("auto") == torch.device("cpu")
    assert "device auto -> cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        benchmark.resolve_device("cuda")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert benchmark.resolve_device("auto") == torch.device("cuda", 0)
    assert "device auto -> cuda" in capsys.readouterr().err
    assert benchmark.resolve_device("cpu") == torch.device("cpu")


def test_sizes_are_checked():
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):  # a 64-token budget cannot decode 64 requests in a step
        benchmark.parse_args(["--smoke", "--batches", "64"])
    with pytest.raises(SystemExit):  # 2 decodes and a 63-token chunk overflow a 64 budget
        benchmark.parse_args(["--smoke", "--mixed-chunk", "63"])
    with pytest.raises(SystemExit):  # a 1-token chunk would be one more decode
        benchmark.parse_args(["--smoke", "--mixed-chunk", "1"])
    with pytest.raises(SystemExit):  # no graphs figure to set batch 3 beside
        benchmark.parse_args(["--smoke", "--eager-batches", "3"])
    args = benchmark.parse_args(["--smoke", "--batches", "2", "3", "--eager-batches", "3"])
    assert args.batches == [2, 3] and args.context == benchmark.SMOKE["context"]
    assert args.eager_batches == [3] and args.mixed_chunk == benchmark.SMOKE["mixed_chunk"]
    full = benchmark.parse_args([])
    assert full.batches == [1, 16, 64, 128] and full.eager_batches == [1, 64]
    assert (full.mixed_decodes, full.mixed_chunk) == (16, 256)


# ---------------------------------------------------------------------------------------------
# --profile


def test_smoke_profile_counts_each_step_kind(smoke):
    result, stdout = smoke
    profile = result["profile"]
    sizes = result["sizes"]
    assert profile["device"] == "cpu" and profile["steps"] == 2
    assert "skipped" not in profile
    mixed_label = f"mixed {sizes['mixed_decodes']} + {sizes['mixed_chunk']}"
    labels = ([f"prefill {sizes['prefill_len']}", mixed_label]
              + [f"decode {b}" for b in sizes["batches"]])
    assert list(profile["kinds"]) == labels
    timed = result["engine"]
    for label, kind in profile["kinds"].items():
        assert "error" not in kind, (label, kind)
        assert kind["steps"] == 2 and len(kind["step_indices"]) == 2
        # The CPU has no kernel events: torch ops dispatched are counted, and say so.
        assert "CPU: no kernel events" in kind["ops_counted"]
        assert isinstance(kind["ops_per_step"], int) and kind["ops_per_step"] > 0
        assert all(isinstance(n, int) and n > 0 for n in kind["ops_each_step"])
        # No device timeline: busy time is marked unavailable, not made up.
        assert kind["busy_pct"] is None and kind["busy_ms_per_step"] is None
        assert kind["busy_unavailable"]
        _positive(kind["wall_ms_per_step"], f"{label} wall")
        assert 1 <= len(kind["top_ops"]) <= 10 and 1 <= len(kind["top_host"]) <= 10
        shares = [op["share_pct"] for op in kind["top_ops"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 100 + 1e-6
        assert all("::" in op["name"] for op in kind["top_ops"])
        assert all(0 <= h["pct_of_wall"] <= 100 for h in kind["top_host"])
        # The profile ran after the timed figures, which it names beside its own.
        expected = {"prefill": lambda: timed["prefill"]["step_ms"],
                    "mixed": lambda: timed["mixed"]["step_ms"],
                    "decode": lambda: timed["decode"][str(kind["batch"])]["tpot_ms"]}
        assert kind["timed_step_ms"] == expected[kind["phase"]]()
        # The measured steps are the kind's: one whole-budget prefill, the decodes beside one
        # chunk, or a decode step of the full batch (not the batch's own prefill steps).
        assert kind["scheduled"] == [{"requests": kind["batch"], "tokens": kind["tokens"]}] * 2
    assert profile["kinds"][labels[0]]["tokens"] == sizes["prefill_len"]
    mixed = profile["kinds"][mixed_label]
    assert (mixed["batch"], mixed["tokens"]) == (sizes["mixed_decodes"] + 1,
                                                 sizes["mixed_decodes"] + sizes["mixed_chunk"])

    # The markdown carries the section, after the throughput table, one row per kind; the JSON
    # carries the same markdown (bench/suite/gpu_summary.py quotes it).
    assert result["markdown"] == stdout.rstrip("\n")
    section = stdout[stdout.index("#### Engine profile (torch.profiler)"):]
    assert stdout.index("| phase | batch |") < stdout.index("#### Engine profile")
    assert "torch ops dispatched" in section
    for label in labels:
        kind = profile["kinds"][label]
        assert f"| {label} | 2 | {kind['ops_per_step']:,} | - |" in section
        assert f"**{label}**: top torch ops" in section


def test_profile_summary_on_a_gpu_timeline_matches_a_hand_count():
    from engine.benchmarks.device_throughput.engine_profile import (MARK, MARK_END,
                                                                    PYTHON_OUTSIDE_OPS, Event,
                                                                    summarize_steps)

    def mark(index, start, self_us=0.0):
        return Event(f"{MARK}{index}", "marker", start, start + 900, self_us)

    def kernel(name, start, end):
        return Event(name, "device", start, end)

    def call(name, start, self_us):
        return Event(name, "cpu", start, start + self_us, self_us)

    events = [
        mark(4, 0), kernel("warm-up kernel", 500, 600), call("cudaLaunchKernel", 400, 99),
        # Step 5, [1000, 2000): two overlapping kernels, a copy, one running into step 6.
        mark(5, 1000, self_us=300), kernel("void gemv<bf16>", 1100, 1400),
        kernel("rmsnorm", 1300, 1500), kernel("Memcpy HtoD (Pageable -> Device)", 1600, 1650),
        kernel("attn", 1950, 2100),
        *[call("cudaLaunchKernel", 1010 + 20 * i, 10) for i in range(3)],
        call("aten::mm", 1100, 5),
        # Step 6, [2000, 3000).
        mark(6, 2000, self_us=100), kernel("void gemv<bf16>", 2100, 2400),
        call("cudaLaunchKernel", 2010, 10), call("cudaEventSynchronize", 2500, 200),
        Event(MARK_END, "marker", 3000, 3001), kernel("after the window", 3100, 3200)]
    summary = summarize_steps(events, [5, 6], on_gpu=True, timed_step_ms=0.8)

    assert summary["steps"] == 2 and summary["ops_each_step"] == [3, 1]
    assert summary["ops_per_step"] == 2 and summary["copies_per_step"] == 0  # medians of 1, 0
    assert summary["launch_calls_per_step"] == 2
    assert summary["wall_ms_per_step"] == pytest.approx(1.0)
    # Busy: 1100-1500 (overlap counted once), 1600-1650, 1950-2000 (clipped), 2100-2400.
    assert summary["busy_ms_per_step"] == pytest.approx((400 + 50 + 50 + 300) / 2 / 1000)
    assert summary["busy_pct"] == pytest.approx(40.0)
    assert summary["busy_pct_of_timed_step"] == pytest.approx(50.0)
    assert [(op["name"], op["share_pct"]) for op in summary["top_ops"]] == [
        ("void gemv<bf16>", pytest.approx(60.0)), ("rmsnorm", pytest.approx(20.0)),
        ("attn", pytest.approx(15.0)), ("Memcpy HtoD (Pageable -> Device)", pytest.approx(5.0))]
    assert summary["top_ops"][0]["calls_per_step"] == 1.0
    host = {h["name"]: h for h in summary["top_host"]}
    assert list(host)[:2] == [PYTHON_OUTSIDE_OPS, "cudaEventSynchronize"]
    assert host[PYTHON_OUTSIDE_OPS]["self_ms_per_step"] == pytest.approx(0.2)
    assert host["cudaEventSynchronize"]["pct_of_wall"] == pytest.approx(10.0)
    assert host["cudaLaunchKernel"]["calls_per_step"] == 2.0  # the warm-up step's is not counted
    assert host["cudaLaunchKernel"]["self_ms_per_step"] == pytest.approx(0.02)

    with pytest.raises(ValueError, match=r"steps \[7\] have no complete marked interval"):
        summarize_steps(events, [6, 7], on_gpu=True)


def test_profiler_events_keep_kernels_and_drop_gpu_annotations():
    from torch.autograd import DeviceType

    from engine.benchmarks.device_throughput.engine_profile import MARK, events_from_profiler

    def fe(name, device, start, end, **extra):
        return SimpleNamespace(name=name, device_type=device, is_async=False,
                               time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=end - start, **extra)

    events = events_from_profiler([
        fe(f"{MARK}3", DeviceType.CPU, 0, 10, is_user_annotation=True),
        fe(f"{MARK}3", DeviceType.CUDA, 2, 8, is_user_annotation=True),  # its GPU copy
        fe("gpu_user_annotation of an op", DeviceType.CUDA, 2, 8, is_user_annotation=True),
        fe("cudaLaunchKernel", DeviceType.CPU, 1, 2),
        fe("ampere_bf16_gemm", DeviceType.CUDA, 3, 5),
        SimpleNamespace(**{**vars(fe("async", DeviceType.CPU, 0, 1)), "is_async": True})])
    assert [(e.name, e.kind) for e in events] == [
        (f"{MARK}3", "marker"), ("cudaLaunchKernel", "cpu"), ("ampere_bf16_gemm", "device")]


def test_profile_markdown_names_a_failed_or_skipped_kind():
    from engine.benchmarks.device_throughput.engine_profile import markdown as profile_markdown

    lines = profile_markdown({"device": "cuda", "steps": 3, "kinds": {
        "decode 64": {"error": "RuntimeError: the profile window never opened"}},
        "skipped": "decode 128 (the run had reached its --profile-until-s before they started)"})
    text = "\n".join(lines)
    assert "| decode 64 | not profiled: RuntimeError: the profile window never opened |" in text
    assert "Not profiled: decode 128" in text
    assert "| step | steps | kernels/step | launch calls/step |" in text


def test_profile_flags_are_checked():
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--smoke", "--profile", "--profile-steps", "0"])
    args = benchmark.parse_args(["--smoke", "--profile", "--profile-until-s", "75"])
    assert args.profile and args.profile_steps == 3 and args.profile_until_s == 75


def test_the_gpu_suite_summary_quotes_the_table_and_the_profile(smoke, tmp_path):
    from bench.suite import gpu_summary

    result, stdout = smoke
    (tmp_path / "throughput.json").write_text(json.dumps(result))
    section = "\n".join(gpu_summary._throughput(tmp_path))
    assert result["markdown"] in section and "#### Engine profile (torch.profiler)" in section
    # The graphs' speed-ups, one line at the section's top.
    headline = next(line for line in section.splitlines() if line.startswith("CUDA graphs"))
    for row in result["graphs_vs_eager"]:
        assert f"{row['speedup']:.2f}x" in headline
    # No JSON (an older run, or none written): what the bench printed last in its log.
    (tmp_path / "throughput.json").unlink()
    (tmp_path / "throughput.log").write_text("engine decode 4 x 32: progress on stderr\n"
                                             + stdout)
    section = "\n".join(gpu_summary._throughput(tmp_path))
    assert stdout.strip() in section and "progress on stderr" not in section


def test_a_profile_past_its_deadline_names_the_kinds_it_left_out():
    def step():
        raise AssertionError("no step runs past the deadline")

    llm = SimpleNamespace(engine=SimpleNamespace(step=step),
                          generate=lambda *a, **k: pytest.fail("no generate past the deadline"))
    sizes = {**benchmark.SMOKE}
    timed = {"prefill": {"step_ms": 1.0}, "mixed": {"step_ms": 1.0},
             "decode": {str(b): {"tpot_ms": 1.0} for b in sizes["batches"]}}
    profile = engine_steps.profile_engine(llm, [], torch.device("cpu"), 512, sizes, 0, timed,
                                          steps=2, deadline=0.0)
    assert profile["kinds"] == {}
    assert profile["skipped"].startswith("prefill 64, mixed 2 + 16, decode 1, decode 4 (")
    assert llm.engine.step is step  # the step wrapper is taken off again


# ---------------------------------------------------------------------------------------------
# Figures as they are measured, each engine's startup, one engine at a time


def _records(path: Path) -> list[dict]:
    from engine.benchmarks.measure.figures import read_figures

    return read_figures(path)


def test_smoke_run_writes_every_figure_to_its_jsonl_twin(smoke, tmp_path_factory):
    result, _ = smoke
    out = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("gpu-throughput*/result.json"))
    records = _records(out.with_suffix(".jsonl"))
    kinds = [r["kind"] for r in records]
    assert kinds[:2] == ["run", "limits"] and kinds[-1] == "done"
    assert records[1]["matmul_tflops"] == result["limits"]["matmul_tflops"]
    # Each side's figures as the final JSON has them, bound included, in the order measured:
    # HF (at once, when its process ends), the eager engine, then the graphs engine.
    by_side = [(r["side"], r["kind"]) for r in records if "side" in r]
    assert [side for side, _ in by_side] == sorted(
        [side for side, _ in by_side], key=["hf", "eager", "engine"].index)
    for side in ("engine", "hf", "eager"):
        figures = result[side]
        mine = {(r["kind"], r.get("batch")): r for r in records if r.get("side") == side
                and r["kind"] in ("prefill", "decode", "mixed")}
        expected = {("decode", int(b)): row for b, row in figures["decode"].items()}
        if "prefill" in figures:
            expected[("prefill", None)] = figures["prefill"]
        if "mixed" in figures:  # HF has no mixed step
            expected[("mixed", figures["mixed"]["batch"])] = figures["mixed"]
        assert set(mine) == set(expected), side
        for key, row in expected.items():
            record = {k: v for k, v in mine[key].items() if k not in ("kind", "side")}
            if side == "eager":  # the final JSON has no bounds for the eager side
                record.pop("bound"), record.pop("pct_of_bound")
            assert record == row, (side, key)
    # Each graphs-against-eager row, the moment the graphs engine had its kind.
    assert [{k: v for k, v in r.items() if k != "kind"} for r in records
            if r["kind"] == "graphs_vs_eager"] == result["graphs_vs_eager"]
    startups = [r for r in records if r["kind"] == "startup"]
    assert [r["side"] for r in startups] == ["eager", "engine"]


def test_smoke_run_reports_each_engines_startup(smoke):
    result, stdout = smoke
    assert set(result["startup"]) == {"engine", "eager"}
    for name, startup in result["startup"].items():
        assert startup == result[name]["startup"]
        _positive(startup["build_s"], f"{name} build")
        _positive(startup["bench_warmup_s"], f"{name} warm-up")
        assert startup["enforce_eager"] is (name == "eager")
    section = stdout[stdout.index("#### Engine startup"):]
    assert "| graphs (as configured) |" in section and "| --enforce-eager |" in section


def test_startup_figures_take_the_runners_report_as_it_is():
    import dataclasses

    @dataclasses.dataclass
    class Report:
        warmup_s: float
        capture_s: float
        graph_memory_bytes: int | None
        graphs: int

    def llm(runner):
        return SimpleNamespace(engine=SimpleNamespace(
            executor=SimpleNamespace(runner=runner), schedules_ahead=False,
            config=SimpleNamespace(model=SimpleNamespace(enforce_eager=False))))

    with_report = SimpleNamespace(startup_report=Report(1.5, 2.25, 3 * 2**30, 51))
    figures = engine_steps.startup_figures(llm(with_report), 9.0, 0.5)
    assert figures == {"build_s": 9.0, "bench_warmup_s": 0.5, "enforce_eager": False,
                       "async_scheduling": False, "report": {"warmup_s": 1.5, "capture_s": 2.25,
                                  "graph_memory_bytes": 3 * 2**30, "graphs": 51}}
    # A runner without the report (an older one), one whose report is None, or none here.
    for runner in (SimpleNamespace(), SimpleNamespace(startup_report=None), None):
        assert engine_steps.startup_figures(llm(runner), 1.0, 0.1)["report"] is None
    text = "\n".join(report.startup_markdown({"engine": figures, "eager": {
        **figures, "report": {**figures["report"], "graph_memory_bytes": None}}}))
    assert "| graphs (as configured) | 9.00 | 0.50 | warmup_s 1.5, capture_s 2.25, " \
           "graph_memory_bytes 3,221,225,472 (3.00 GiB), graphs 51 |" in text
    assert "| --enforce-eager | 9.00 | 0.50 | warmup_s 1.5, capture_s 2.25, " \
           "graph_memory_bytes -, graphs 51 |" in text
    ahead = "\n".join(report.startup_markdown({"engine": {**figures, "async_scheduling": True}}))
    assert "| graphs (as configured), async scheduling | 9.00 |" in ahead


def test_without_hf_the_table_has_no_hf_columns(smoke):
    result, _ = smoke
    skipped = {**result, "hf": {"error": "skipped (--no-hf)", "skipped": True}}
    skipped["rows"] = report.table_rows(skipped["engine"], skipped["hf"])
    text = report.markdown(skipped)
    assert "HF transformers not measured (--no-hf)" in text and "hf not measured" not in text
    header = next(line for line in text.splitlines() if line.startswith("| phase |"))
    assert header == ("| phase | batch | context | engine tok/s | bound tok/s | engine % of "
                      "bound | engine TPOT ms | bound TPOT ms |")
    lines = text.splitlines()
    first = lines.index(header) + 2
    rows = lines[first:first + len(result["rows"])]
    # Prefill, decode at each batch and mixed, each with the engine's figure and its bound.
    assert [row.split(" | ")[0] for row in rows] == [f"| {r['phase']}" for r in result["rows"]]
    assert all(row.count("|") == header.count("|") for row in rows)
    assert all(" - | - |" not in row for row in rows[1:])  # decodes and mixed have TPOTs
    engine_decode_1 = result["engine"]["decode"]["1"]
    assert f"| {engine_decode_1['tpot_ms']:,.2f} | {engine_decode_1['bound']['tpot_ms']:,.2f} |" \
        in text


def test_eager_batches_follow_batches():
    core = benchmark.parse_args(["--shape", "llama-3.1-8b", "--no-hf", "--batches", "1",
                                      "64"])
    assert core.batches == [1, 64] and core.eager_batches == [1, 64] and core.no_hf
    # The preset's eager batches that --batches has; else every one of --batches.
    assert benchmark.parse_args(["--batches", "1", "16"]).eager_batches == [1]
    assert benchmark.parse_args(["--batches", "2", "16"]).eager_batches == [2, 16]
    assert benchmark.parse_args(["--smoke", "--batches", "2"]).eager_batches == [2]


@pytest.mark.parametrize("eager_fails", [False, True])
def test_one_engine_at_a_time_freed_without_the_garbage_collector(tmp_path, monkeypatch,
                                                                  eager_fails):
    """When the graphs engine starts, the eager engine (its EngineCore and runner) is gone by
    reference counting alone, whether it measured everything or failed part way (its failure's
    frames hold it): with the garbage collector off, on a GPU the next engine would otherwise
    find its memory still taken."""
    import gc
    import time
    import weakref

    from engine.benchmarks.measure.figures import FigureLog

    args = benchmark.parse_args(["--smoke", "--device", "cpu", "--dtype", "float32",
                                      "--no-hf"])
    alive_at_start: list[list[bool]] = []
    earlier: list[weakref.ref] = []
    start_engine = engine_steps.start_engine

    def probed_start(*a, **k):
        alive_at_start.append([ref() is not None for ref in earlier])
        llm, steps_log, info = start_engine(*a, **k)
        earlier.extend([weakref.ref(llm), weakref.ref(llm.engine),
                        weakref.ref(llm.engine.executor.runner)])
        return llm, steps_log, info

    monkeypatch.setattr(engine_steps, "start_engine", probed_start)
    if eager_fails:
        def fail(*a, **k):
            raise RuntimeError("the mixed kind failed")

        monkeypatch.setattr(engine_steps, "measure_mixed", fail)
    monkeypatch.setattr(gc, "collect", lambda *a: 0)
    model_dir, _ = benchmark.prepare_model(args, tmp_path)
    from engine.benchmarks.measure.roofline import ModelShape
    from engine.runtime.model_setup import load_hf_config

    shape = ModelShape.from_hf_config(load_hf_config(model_dir))
    recorder = bounds.FigureRecorder(
        FigureLog(None), shape, 4, {"copy_bandwidth_gbs": 1.0, "matmul_tflops": 1.0})
    sizes = {k: getattr(args, k) for k in benchmark.FULL}
    gc.disable()
    try:
        sides = benchmark.measure_sides(args, torch.device("cpu"), torch.float32, sizes,
                                             model_dir, tmp_path, time.perf_counter(), recorder)
    finally:
        gc.enable()
    assert ("error" in sides["eager"]) is eager_fails, sides["eager"]
    assert alive_at_start == [[], [False, False, False]]
    assert all(ref() is None for ref in earlier)


def test_a_killed_run_keeps_the_figures_it_measured(tmp_path):
    """SIGKILL once the eager engine's first decode figure is in the .jsonl: the limits, the
    startup and that figure (with its bound) stay there, whole; no final JSON is written."""
    import signal

    from workers.preemption.layer_delay import LAYER_DELAY_ENV

    out = tmp_path / "throughput.json"
    twin = out.with_suffix(".jsonl")
    # Slowed layers, so the run is still going when the first figure lands.
    env = dict(os.environ, HF_HUB_OFFLINE="1", **{LAYER_DELAY_ENV: "3000"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.suite.gpu_throughput", "--smoke", "--device", "cpu",
         "--dtype", "float32", "--no-hf", "--output", str(out)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_figures(proc, twin, lambda rs: any(r["kind"] == "decode" for r in rs),
                         "its first decode figure")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists()
    records = _records(twin)
    kinds = [r["kind"] for r in records]
    assert kinds[:3] == ["run", "limits", "startup"] and "done" not in kinds
    decode = next(r for r in records if r["kind"] == "decode")
    assert decode["side"] == "eager" and decode["batch"] == 1
    _positive(decode["tpot_ms"], "decode TPOT")
    _positive(decode["bound"]["tpot_ms"], "decode bound")


def test_the_suites_dry_run_and_enforce_eager_flags(tmp_path):
    """`gpu_suite.sh --dry-run` runs the core call's command with --enforce-eager (as after a
    failed capture) on a CPU, through the dry run's launcher: it builds the engine
    configuration for CUDA and stops there, before measuring the device."""
    from bench.suite import dry_run
    args = benchmark.parse_args(["--smoke", "--enforce-eager"])
    assert args.enforce_eager
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop(dry_run.DRY_RUN_ENV, None)  # the launcher is the switch
    run = subprocess.run(
        [sys.executable, "-m", "bench.suite.dry_run", "bench.suite.gpu_throughput", "--device",
         "cuda", "--shape", "llama-3.1-8b", "--no-hf", "--batches", "1", "64", "--enforce-eager",
         "--output", str(tmp_path / "throughput.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(dry_run.DONE_PREFIX) and "device cuda" in last
    assert "enforce_eager True" in last


def test_the_pool_holds_the_biggest_batch_in_every_kv_group():
    """A Gemma-3 layout (five sliding layers per global one, window 1024 above the runs'
    contexts) holds a block table per group: the pool the bench asks for must hold the full
    run's biggest batch at its longest in all of them, or that batch never runs together."""
    from engine.core.kv_cache_manager import KVCacheManager
    from engine.core.kv_groups import kv_cache_groups
    from engine.core.request import Request
    from engine.config import CacheConfig
    from engine.sampling_params import SamplingParams

    groups = kv_cache_groups(([1024] * 5 + [None]) * 8)
    assert len(groups) == 6
    sizes = benchmark.FULL
    limits = engine_steps.engine_limits(sizes, groups)
    # The one-group pool is about a sixth of what this layout needs.
    assert limits["num_kv_blocks"] > 5 * engine_steps.engine_limits(sizes)["num_kv_blocks"]
    biggest = max(sizes["batches"])
    tokens = sizes["context"] + engine_steps._decode_max_tokens(
        biggest, sizes["context"], sizes["prefill_len"], sizes["decode_steps"])
    kv = KVCacheManager(CacheConfig(block_size=engine_steps.BLOCK_SIZE),
                        limits["num_kv_blocks"], limits["max_model_len"], groups,
                        max_chunk_tokens=sizes["prefill_len"])
    for i in range(biggest):
        request = Request(str(i), [1] * sizes["context"],
                          SamplingParams(max_tokens=tokens, ignore_eos=True))
        assert kv.allocate_slots(request, tokens, admission=True), f"request {i} of {biggest}"
    kv.check_invariants()
