"""`sloserve bench throughput`'s roofline figures without timing anything: it runs
end to end on a tiny random model and prints every field with positive shares, and the FLOP and
byte accounting of engine/benchmarks/measure/roofline.py matches a hand count for a small config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.benchmarks.measure.roofline import (ModelShape, attention_flops, decode_bytes_per_step,
                            decode_flops_per_step, prefill_flops)

REPO = Path(__file__).resolve().parents[2]


def test_accounting_matches_a_hand_count():
    config = SimpleNamespace(hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=None,
                             vocab_size=100)
    shape = ModelShape.from_hf_config(config)
    assert shape.head_dim == 2
    # Per layer: q 8x8, k 8x4, v 8x4, o 8x8, gate/up 8x16 each, down 16x8.
    per_layer = 64 + 32 + 32 + 64 + 128 + 128 + 128
    assert shape.linear_params == 2 * per_layer
    assert shape.lm_head_params == 800

    flops = prefill_flops(shape, prompt_len=3)
    assert flops["linear"] == 2 * 2 * per_layer * 3
    assert flops["lm_head"] == 2 * 800  # the sampled row only
    # Causal: positions 0, 1, 2 attend to 1, 2, 3 keys; QK and PV at 2 FLOPs per MAC each.
    assert flops["attention"] == 2 * 4 * 2 * (1 + 2 + 3) * 4
    assert attention_flops(shape, start=5, length=1) == 2 * 4 * 2 * 6 * 4

    # Decode, 2 requests over 10 and 20 tokens, float32: weights once, each request's K and V.
    nbytes = decode_bytes_per_step(shape, [10, 20], dtype_bytes=4)
    assert nbytes["weights"] == (2 * per_layer + 800) * 4
    assert nbytes["kv"] == 2 * 2 * 2 * 2 * (10 + 20) * 4
    assert nbytes["total"] == nbytes["weights"] + nbytes["kv"]
    step = decode_flops_per_step(shape, [10, 20])
    assert step["linear"] == 2 * 2 * per_layer * 2
    assert step["attention"] == 4 * 2 * 4 * 2 * (10 + 20)


def test_bench_throughput_prints_roofline_json_on_a_tiny_model(tiny_model, tmp_path):
    model = tiny_model("llama")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    output = tmp_path / "throughput.json"
    run = subprocess.run(
        [sys.executable, "-m", "engine.entrypoints.cli", "bench", "throughput", "--model", model, "--dtype", "float32",
         "--prefill-lens", "16", "48", "--decode-batches", "1", "3", "--decode-contexts", "8",
         "40", "--decode-tokens", "4", "--repeats", "1", "--bandwidth-mib", "8",
         "--prefill-len", "16", "--prefill-prompts", "1", "--concurrency", "2",
         "--decode-prompt-len", "8", "--max-tokens", "3", "--hf-decode-requests", "1",
         "--output", str(output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert json.loads(output.read_text()) == result

    limits = result["roofline"]
    assert limits["bandwidth_gbs"] > 0 and limits["copy_bandwidth_gbs"] > 0
    assert limits["matmul_gflops_peak"] > 0 and limits["threads"] >= 1
    assert set(limits["matmul_gflops"]) == {"16", "48"}
    for length in ("16", "48"):
        p = result["prefill"][length]
        assert p["engine_steps"] == 1
        for key in ("engine_tokens_per_s", "linear_roofline_tokens_per_s",
                    "full_roofline_tokens_per_s", "linear_roofline_share", "full_roofline_share",
                    "attention_roofline_s"):
            assert p[key] > 0, key
        assert p["full_roofline_tokens_per_s"] < p["linear_roofline_tokens_per_s"]
    for batch in ("1", "3"):
        for ctx in ("8", "40"):
            d = result["decode"][batch][ctx]
            assert d["steps_measured"] == 3  # 4 tokens: the first comes from the prefill step
            assert d["mean_context"] == int(ctx) + 2  # contexts ctx+1 .. ctx+3 while decoding
            for key in ("engine_tokens_per_s", "bandwidth_bound_tokens_per_s", "bandwidth_share",
                        "roofline_tokens_per_s", "roofline_share"):
                assert d[key] > 0, key
    # The 40-token prompts share their first 24 tokens (one cached 16-token block).
    assert result["decode"]["3"]["40"]["setup_prefill_tokens"] < 3 * 40
    # The HF comparison is still there.
    assert result["prefill_ratio"][0] > 0 and result["decode_ratio"][0] > 0
    assert result["wall_s"] > 0


def test_a_mixture_of_experts_bound_counts_active_and_touched_experts():
    """Qwen3-30B-A3B's shape: a token multiplies by its 8 experts (3.3B active parameters of
    30.5B), and a decode step reads the experts its batch touches: 8 of 128 per layer at batch 1,
    nearly all at batch 64."""
    import transformers

    from engine.benchmarks.inputs.model_shapes import SHAPES
    from engine.benchmarks.measure.roofline import ModelShape, decode_bytes_per_step

    fields = {k: v for k, v in SHAPES["qwen3-30b-a3b"].items() if k != "model_type"}
    shape = ModelShape.from_hf_config(transformers.AutoConfig.for_model("qwen3_moe", **fields))
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate) == (128, 8, 768)
    assert shape.experts_touched(1) == pytest.approx(8)
    assert 125 < shape.experts_touched(64) < 128
    attention = 48 * 2048 * (32 * 128 * 2 + 4 * 128 * 2)
    assert shape.linear_params == attention + 48 * 8 * 3 * 2048 * 768
    one, many = (decode_bytes_per_step(shape, [100] * b, 2)["weights"] for b in (1, 64))
    assert one == 2 * (shape.linear_params + shape.lm_head_params)
    assert many > 8 * one  # nearly every expert's weights, at batch 64


def test_an_fp8_shape_reads_one_byte_a_linear_weight():
    """Llama-3.1-8B's FP8 shape: a decode step reads its linear weights at one byte each and the
    LM head at the compute dtype's two, against the bf16 shape's two for both."""
    import transformers

    from engine.benchmarks.inputs.model_shapes import SHAPES
    from engine.benchmarks.measure.roofline import ModelShape, decode_bytes_per_step

    def shape(name: str) -> ModelShape:
        fields = {k: v for k, v in SHAPES[name].items() if k != "model_type"}
        return ModelShape.from_hf_config(transformers.AutoConfig.for_model("llama", **fields))

    fp8, bf16 = shape("llama-3.1-8b-fp8"), shape("llama-3.1-8b")
    assert fp8.linear_weight_bytes == 1.0 and bf16.linear_weight_bytes is None
    fp8_bytes = decode_bytes_per_step(fp8, [1], 2)["weights"]
    assert fp8_bytes == fp8.linear_params + 2 * fp8.lm_head_params
    assert decode_bytes_per_step(bf16, [1], 2)["weights"] == 2 * (bf16.linear_params
                                                                   + bf16.lm_head_params)
