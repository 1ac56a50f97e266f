"""bench/gpu_throughput.py without timing anything: its --smoke run (a tiny Llama on the CPU)
goes end to end through the limits, the HF process and the engine, and reports every figure
beside its bound; the bounds match a hand count; --device auto and cuda resolve as documented.
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

from bench import gpu_throughput
from bench.roofline import ModelShape

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str]:
    """(the JSON, stdout) of one smoke run, float32 (the quickest on any CPU), with the small
    tokenizer the bench trains itself when given none."""
    out = tmp_path_factory.mktemp("gpu-throughput") / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_throughput", "--smoke", "--device", "cpu",
         "--dtype", "float32", "--out", str(out)],
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
    assert sizes == {k: gpu_throughput.SMOKE[k] for k in gpu_throughput.FULL}
    assert result["config"]["hidden_size"] == gpu_throughput.SMOKE_SHAPE["hidden_size"]
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


def test_smoke_run_prints_one_markdown_table(smoke):
    result, stdout = smoke
    rows = result["rows"]
    assert [(r["phase"], r["batch"]) for r in rows] == \
        [("prefill", 1)] + [("decode", b) for b in result["sizes"]["batches"]]
    for row in rows:
        for key in ("engine_tokens_per_s", "hf_tokens_per_s", "bound_tokens_per_s",
                    "engine_pct_of_bound", "hf_pct_of_bound"):
            _positive(row[key], f"{row['phase']} {row['batch']} {key}")
    # stdout is the markdown alone (progress, logs and the HF process's output go to stderr).
    assert stdout.startswith("### bench/gpu_throughput:")
    lines = stdout.strip().splitlines()
    assert "SMOKE RUN" in stdout
    table = [line for line in lines if line.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, alignment, one line per row
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "engine % of bound" in table[0] and "HF TPOT ms" in table[0]
    assert table[2].startswith("| prefill | 1 |")


def test_a_failed_side_leaves_the_other_in_the_table(smoke):
    result, _ = smoke
    failed = {**result, "hf": {"error": "RuntimeError: the HF process exited with 1"}}
    failed["rows"] = gpu_throughput.table_rows(failed["engine"], failed["hf"])
    assert [r["hf_tokens_per_s"] for r in failed["rows"]] == [None] * len(result["rows"])
    assert all(r["engine_tokens_per_s"] for r in failed["rows"])
    text = gpu_throughput.markdown(failed)
    assert "**hf not measured:** RuntimeError: the HF process exited with 1" in text
    assert "| - | - |" in text  # HF's cells and the ratio


def test_bounds_match_a_hand_count():
    shape = ModelShape.from_hf_config(SimpleNamespace(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=None, vocab_size=100))
    limits = {"copy_bandwidth_gbs": 1e-6, "matmul_tflops": 1e-9}  # 1000 B/s, 1000 FLOP/s
    per_layer = 64 + 32 + 32 + 64 + 128 + 128 + 128

    prefill = gpu_throughput.prefill_bound(shape, 3, limits)
    flops = 2 * 2 * per_layer * 3 + 2 * 800 + 2 * 4 * 2 * (1 + 2 + 3) * 4
    assert prefill["flops"] == flops
    assert prefill["step_ms"] == pytest.approx(1000 * flops / 1000)
    assert prefill["tokens_per_s"] == pytest.approx(3 / (flops / 1000))

    # 2 requests of 10 keys, float32: the weights once, each request's K and V.
    decode = gpu_throughput.decode_bound(shape, 2, 10.0, 4, limits)
    nbytes = (2 * per_layer + 800) * 4 + 2 * 2 * 2 * 2 * 20 * 4
    step_flops = 2 * 2 * per_layer * 2 + 2 * 800 * 2 + 4 * 2 * 4 * 2 * 20
    assert decode["bytes_per_step"] == nbytes and decode["flops_per_step"] == step_flops
    assert decode["memory_ms"] == pytest.approx(nbytes)  # at 1000 B/s: bytes = milliseconds
    assert decode["compute_ms"] == pytest.approx(step_flops)
    assert decode["tpot_ms"] == max(decode["memory_ms"], decode["compute_ms"])
    assert decode["tokens_per_s"] == pytest.approx(2 / (decode["tpot_ms"] / 1000))


def test_enough_tokens_that_the_whole_batch_decodes_together():
    # 128 prompts of 512 tokens in a 2048-token budget: the last is prefilled by step 35 (each
    # step's decodes take budget from the prefill); 16 full-batch steps must follow.
    assert gpu_throughput._decode_max_tokens(128, 512, 2048, 16) == 35 + 16 + 2
    assert gpu_throughput._decode_max_tokens(1, 512, 2048, 16) == 1 + 16 + 2


def test_device_auto_follows_cuda_availability(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_throughput.resolve_device("auto") == torch.device("cpu")
    assert "device auto -> cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        gpu_throughput.resolve_device("cuda")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert gpu_throughput.resolve_device("auto") == torch.device("cuda", 0)
    assert "device auto -> cuda" in capsys.readouterr().err
    assert gpu_throughput.resolve_device("cpu") == torch.device("cpu")


def test_sizes_are_checked():
    with pytest.raises(SystemExit):
        gpu_throughput.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):  # a 64-token budget cannot decode 64 requests in a step
        gpu_throughput.parse_args(["--smoke", "--batches", "64"])
    args = gpu_throughput.parse_args(["--smoke", "--batches", "2", "3"])
    assert args.batches == [2, 3] and args.context == gpu_throughput.SMOKE["context"]
    assert gpu_throughput.parse_args([]).batches == [1, 16, 64, 128]
