"""gpt-oss served as HF transformers computes it: attention sinks, biases on q/k/v/o, every
other layer sliding, YaRN rotary, and a mixture of experts with a biased router (softmax over
the top k logits) and clamped-SwiGLU experts with biases, loaded from the stacked, interleaved
layout transformers saves, or from MXFP4 blocks and scales dequantized at load."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from tests.utils.hf_greedy import engine_greedy, hf_greedy  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import load_tiny_model, make_tiny_model  # noqa: E402
from workers.layers.moe.gpt_oss_experts import GptOssExperts  # noqa: E402

ATOL = 2e-4  # float32 summation-order noise


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_gpt_oss_matches_hf(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "gpt_oss", seed=0)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        # Probes: the layout transformers saves (experts stacked, gate and up interleaved).
        assert tuple(f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").shape) == (4, 64, 256)
        assert "model.layers.0.self_attn.sinks" in f.keys()
    model = load_tiny_model(model_dir)
    assert model.layer_windows == [24, None, 24]
    assert all(s is not None for s in model.layer_sinks)
    # On the PyTorch path its experts read their counts on the host, which no CUDA graph can
    # capture; on the fused kernel (Triton's, kernels.triton_moe) they can be captured.
    assert not all(getattr(m, "capturable", True) for m in model.modules())
    experts = [m for m in model.modules() if isinstance(m, GptOssExperts)]
    for layer in experts:
        layer.use_kernels(SimpleNamespace(fused_moe=lambda *args, **options: None))
    assert all(getattr(m, "capturable", True) for m in model.modules())
    for layer in experts:
        layer.use_kernels(SimpleNamespace())
    # A prompt of three windows, chunks that straddle them, and decodes past them.
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)


def test_the_engine_generates_as_hf(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path, "gpt_oss", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [_tokens(50, seed=s) for s in range(3)]
    prompts.append(list(prompts[0]))  # a prefix-cache hit
    expected = hf_greedy(hf, prompts, 20)
    # Probe: without its sinks the model generates otherwise.
    for layer in hf.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert hf_greedy(hf, prompts[1:2], 20) != expected[1:2]
    outputs, hits = engine_greedy(model_dir, prompts, 20, num_kv_blocks=64, max_model_len=256,
                                  max_num_batched_tokens=32)
    assert outputs == expected
    assert hits > 0


def test_an_mxfp4_checkpoint_loads_as_hf_dequantizes_it(tmp_path) -> None:
    """The experts' MXFP4 blocks and scales, packed by the test's own quantizer, dequantize
    exactly as transformers' converter does, and the engine generates as HF does on those
    dequantized weights; a scale missing from the checkpoint is a startup error naming it."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine import LLM
    from tests.utils.mxfp4_checkpoints import write_mxfp4_checkpoint
    from workers.quantization.mxfp4 import dequantize_mxfp4

    float_dir = make_tiny_model(tmp_path / "float", "gpt_oss", seed=0)
    packed = write_mxfp4_checkpoint(float_dir, tmp_path / "mxfp4")
    # The reference: the float checkpoint with HF's own dequantization of the packed experts.
    original = load_file(f"{float_dir}/model.safetensors")
    reference = dict(original)
    for name in [n for n in packed if n.endswith("_blocks")]:
        stem = name.removesuffix("_blocks")
        blocks, scales = packed[name], packed[f"{stem}_scales"]
        hf_weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        ours = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
        assert torch.equal(ours, hf_weight), stem
        assert not torch.equal(hf_weight, original[stem])  # probe: quantizing changed it
        reference[stem] = hf_weight.contiguous()
    (tmp_path / "ref").mkdir()
    save_file(reference, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "ref" / "config.json").write_text((tmp_path / "float" / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
    prompts = [_tokens(40, seed=s) for s in range(2)]
    expected = hf_greedy(hf, prompts, 16)
    outputs, _ = engine_greedy(str(tmp_path / "mxfp4"), prompts, 16, num_kv_blocks=64,
                               max_model_len=256, max_num_batched_tokens=32)
    assert outputs == expected
    # A scale missing: named at startup.
    broken = dict(load_file(str(tmp_path / "mxfp4" / "model.safetensors")))
    del broken["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(broken, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: .*layers\.1\.mlp\.experts\.w2_scales"):
        LLM(model=str(tmp_path / "mxfp4"), dtype="float32", num_kv_blocks=64, max_model_len=256)
