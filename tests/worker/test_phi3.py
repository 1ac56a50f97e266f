"""Phi-3 served as HF computes it: q/k/v and gate/up stored fused in the checkpoint (split by
the merged layers at load, each rank's slice under tensor parallelism), every layer sliding
when the config has a window, a partial rotary (Phi-4-mini's 0.75) on the PyTorch layers and
beside the CPU's fused kernels, in the engine; a fused tensor of the wrong size named."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kernels import cpu_fused, select_backend  # noqa: E402
from tests.utils.paged_helpers import PagedSequence, assert_chunks_match_hf  # noqa: E402
from tests.utils.tiny_models import load_tiny_model, make_tiny_model  # noqa: E402
from workers.layers import MergedColumnParallelLinear, QKVParallelLinear, apply_rotary  # noqa: E402

ATOL = 2e-4  # as tests/worker/test_models.py: float32 summation-order noise is ~1e-5


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("overrides, windows, rotary_dim", [
    ({}, [None] * 3, 16),
    ({"sliding_window": 24}, [24] * 3, 16),
    ({"sliding_window": 24, "partial_rotary_factor": 0.75}, [24] * 3, 12),
], ids=["full", "sliding", "sliding-partial-rotary"])
def test_phi3_matches_hf(tmp_path, overrides, windows, rotary_dim: int) -> None:
    model_dir = make_tiny_model(tmp_path, "phi3", seed=0, **overrides)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.qkv_proj.weight" in f.keys()  # probe: stored fused
    model = load_tiny_model(model_dir)
    assert model.layer_windows == windows
    assert model.model.rotary_emb.rotary_dim == rotary_dim
    seq = PagedSequence(_tokens(70, seed=1), blocks=[7, 2, 11, 4, 0])
    assert_chunks_match_hf(model, model_dir, seq, [40, 12], decodes=18, num_blocks=16,
                           atol=ATOL)


def test_a_partial_rotary_beside_the_fused_cpu_kernels_matches_hf(tmp_path) -> None:
    if not cpu_fused.warm_up():
        pytest.skip("the fused CPU kernels cannot be compiled here (no C++ compiler?)")
    model_dir = make_tiny_model(tmp_path, "phi3", seed=0, hidden_size=256,
                                intermediate_size=512, partial_rotary_factor=0.5,
                                initializer_range=0.1)
    model = load_tiny_model(model_dir)
    model.use_kernels(select_backend(torch.device("cpu")))
    attn = model.model.layers[0].self_attn
    # Probes: the norms are fused; the rotary stays the eager op, which turns part of a head.
    assert model.model.layers[0].input_layernorm.fused is cpu_fused.rms_norm
    assert attn.apply_rotary is apply_rotary
    seq = PagedSequence(_tokens(50, seed=2), blocks=[3, 1, 0, 2])
    assert_chunks_match_hf(model, model_dir, seq, [30, 10], decodes=10, num_blocks=8,
                           atol=ATOL)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_fused_tensor_loads_as_its_separate_shards_would(tp_rank: int) -> None:
    """Each rank's slice of a fused qkv / gate_up tensor equals what loading q, k and v (gate
    and up) one by one gives it, KV heads replicated where ranks outnumber them."""
    g = torch.Generator().manual_seed(0)
    hidden, head_dim = 32, 8
    for kv_heads in (2, 1):
        args = dict(bias=False, dtype=torch.float32, device="cpu", tp_rank=tp_rank, tp_size=2)
        fused, separate = (QKVParallelLinear(hidden, head_dim, 4, kv_heads, **args)
                           for _ in range(2))
        q, k, v = (torch.randn(n * head_dim, hidden, generator=g) for n in (4, kv_heads, kv_heads))
        fused.weight_loader(fused.weight, torch.cat([q, k, v]))
        for shard, tensor in zip("qkv", (q, k, v)):
            separate.weight_loader(separate.weight, tensor, shard)
        assert torch.equal(fused.weight, separate.weight)
    fused, separate = (MergedColumnParallelLinear(hidden, [48, 48], **args) for _ in range(2))
    gate, up = torch.randn(48, hidden, generator=g), torch.randn(48, hidden, generator=g)
    fused.weight_loader(fused.weight, torch.cat([gate, up]))
    separate.weight_loader(separate.weight, gate, 0)
    separate.weight_loader(separate.weight, up, 1)
    assert torch.equal(fused.weight, separate.weight)
    with pytest.raises(ValueError, match=r"a fused tensor of 95 rows; its shards \[0, 1\] hold "
                                         r"\[48, 48\]"):
        fused.weight_loader(fused.weight, torch.randn(95, hidden))


def test_the_engine_generates_as_hf(tmp_path) -> None:
    from engine import LLM, SamplingParams

    model_dir = make_tiny_model(tmp_path, "phi3", seed=0, sliding_window=24,
                                partial_rotary_factor=0.75)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [_tokens(50, seed=s) for s in range(3)]
    expected = [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    finally:
        llm.shutdown()
    assert [list(o.token_ids) for o in outputs] == expected
