"""FP8 checkpoints served end to end on the CPU: the engine's greedy output equals HF
transformers' on the same weights dequantized (the engine dequantizes bit for bit what the
test's own dequantization wrote), the weights really stay FP8 in memory, ``--quantization fp8``
quantizes a float32 checkpoint as the test's reference does, and TP=2 equals TP=1."""

from __future__ import annotations

import logging
import multiprocessing
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.benchmarks.reference.hf_reference import hf_greedy
from tests.utils.fp8_checkpoints import write_online_reference

MAX_NEW = 12
# One prompt longer than the token budget below, so prefill is chunked.
LENGTHS = [90, 7, 33]
ENGINE = dict(dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64, max_model_len=256)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in LENGTHS]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return [list(o.token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _linear_layers(llm: LLM) -> list[torch.nn.Module]:
    model = llm.engine.executor.runner.model
    return [m for name, m in model.named_modules() if name.endswith("_proj")]


def _weight_bytes(llm: LLM) -> int:
    """Bytes the attention and MLP projections hold (weights and their scales)."""
    return sum(t.numel() * t.element_size() for m in _linear_layers(llm)
               for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])


@pytest.mark.parametrize("arch,layout", [("llama", "block"), ("qwen3", "channel"),
                                         ("llama", "tensor")])
def test_greedy_equals_hf_on_the_dequantized_weights(fp8_checkpoint, fp8_source, arch, layout):
    quantized, reference = fp8_checkpoint(arch, layout)
    llm = LLM(model=quantized, **ENGINE)
    try:
        prompts = _prompts(llm.engine.vocab_size)
        got = _greedy(llm, prompts)
        layers = _linear_layers(llm)
        # Probe: the engine holds FP8 weights, not a dequantized copy.
        assert len(layers) == 8 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
        fp8_bytes = _weight_bytes(llm)
    finally:
        llm.shutdown()
    assert got == hf_greedy(reference, prompts, MAX_NEW)
    plain = LLM(model=fp8_source(arch), **ENGINE)
    try:
        float32_bytes = _weight_bytes(plain)
    finally:
        plain.shutdown()
    # One byte a weight against float32's four (half of bf16's two), plus the scales.
    assert 0.25 <= fp8_bytes / float32_bytes < 0.26


def test_quantization_fp8_quantizes_a_float32_checkpoint_at_load(fp8_source, tmp_path):
    source = fp8_source("qwen3")
    llm = LLM(model=source, quantization="fp8", **ENGINE)
    try:
        prompts = _prompts(llm.engine.vocab_size)
        got = _greedy(llm, prompts)
        layers = _linear_layers(llm)
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
        assert all(m.weight_scale.shape == (m.weight.shape[0],) for m in layers)  # per row
    finally:
        llm.shutdown()
    reference = write_online_reference(source, tmp_path / "reference")
    assert got == hf_greedy(reference, prompts, MAX_NEW)


def _greedy_at_tp(model: str, tp: int) -> list[list[int]]:
    llm = LLM(model=model, tensor_parallel_size=tp, **ENGINE)
    try:
        return _greedy(llm, _prompts(llm.engine.vocab_size))
    finally:
        llm.shutdown()


def test_block_layout_tp2_equals_tp1(fp8_checkpoint):
    quantized, _ = fp8_checkpoint("llama", "block")
    assert _greedy_at_tp(quantized, 2) == _greedy_at_tp(quantized, 1)
    assert not multiprocessing.active_children()


def test_dummy_weights_of_an_fp8_model_are_valid(fp8_checkpoint):
    quantized, _ = fp8_checkpoint("llama", "block")
    llm = LLM(model=quantized, load_format="dummy", **ENGINE)
    try:
        layer = _linear_layers(llm)[0]
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert bool((layer.weight_scale_inv > 0).all())
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                           SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].token_ids) == 3
    finally:
        llm.shutdown()


MOE_SHAPE = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                 num_hidden_layers=2)


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_experts_equal_hf_on_the_dequantized_weights(tiny_model, tmp_path, layout):
    from tests.utils.fp8_checkpoints import write_fp8_checkpoint

    source = tiny_model("qwen3_moe", **MOE_SHAPE)
    quantized, reference = write_fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "ref",
                                                layout)
    llm = LLM(model=quantized, **ENGINE)
    try:
        prompts = _prompts(llm.engine.vocab_size)
        got = _greedy(llm, prompts)
        experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
        assert experts.w13_weight.dtype == torch.float8_e4m3fn
        assert experts.w2_weight.dtype == torch.float8_e4m3fn
    finally:
        llm.shutdown()
    assert got == hf_greedy(reference, prompts, MAX_NEW)


def test_quantization_fp8_quantizes_experts_at_load(tiny_model, tmp_path):
    source = tiny_model("qwen3_moe", **MOE_SHAPE)
    llm = LLM(model=source, quantization="fp8", **ENGINE)
    try:
        prompts = _prompts(llm.engine.vocab_size)
        got = _greedy(llm, prompts)
        experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
        assert experts.w13_weight.dtype == torch.float8_e4m3fn
    finally:
        llm.shutdown()
    assert got == hf_greedy(write_online_reference(source, tmp_path / "ref"), prompts, MAX_NEW)


def test_the_startup_log_says_what_the_weights_hold(fp8_checkpoint, caplog):
    """The FP8 tensors and their memory, beside the rest, as a user reads them at startup."""
    folder, _ = fp8_checkpoint("llama", "block")
    with caplog.at_level(logging.INFO, logger="workers.model_runner"):
        llm = LLM(model=folder, dtype="float32", startup_calibration=False)
    llm.shutdown()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:")]
    # 2 layers x (qkv, o, gate_up, down)
    assert line.startswith("weights: quantization fp8; 8 FP8 weight tensors, ")


def test_fp8_experts_tp2_equal_tp1(tiny_model, tmp_path):
    """Per-channel FP8 experts split over two ranks: each rank's slice of every expert keeps its
    rows' scales, and the outputs equal one rank's."""
    from tests.utils.fp8_checkpoints import write_fp8_checkpoint

    source = tiny_model("qwen3_moe", **MOE_SHAPE)
    quantized, _ = write_fp8_checkpoint(source, tmp_path / "fp8", tmp_path / "ref", "channel")
    assert _greedy_at_tp(quantized, 2) == _greedy_at_tp(quantized, 1)
    assert not multiprocessing.active_children()
