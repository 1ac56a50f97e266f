"""The mixture-of-experts layer on its own: the router against HF's, the CPU path against the
reference loop, and the tensor-parallel split of the experts (each rank's partial sums add up
to the whole layer)."""

from __future__ import annotations

import pytest
import torch

from workers.layers.moe import FusedMoE, experts_reference, experts_sorted, select_experts

E, K, H, I = 8, 2, 48, 40


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_hf(renormalize: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(1))
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(torch.nn.functional.linear(x, router.weight), K, renormalize)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_sorted_path_equals_the_reference_loop(num_tokens: int) -> None:
    w13, w2 = _weights()
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=g)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=g), K, True)
    if num_tokens == 64:  # some experts get no token at all
        ids = ids % 5
        assert set(ids.flatten().tolist()) < set(range(E))
    torch.testing.assert_close(experts_sorted(x, w13, w2, weights, ids),
                               experts_reference(x, w13, w2, weights, ids), atol=1e-6, rtol=1e-6)


def test_tensor_parallel_slices_add_up_to_the_layer() -> None:
    """Two ranks each load every expert's half of the intermediate dimension from the same
    per-expert checkpoint tensors; their outputs (before the all-reduce) sum to one rank's."""
    w13, w2 = _weights(3)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(4))
    weights, ids = select_experts(torch.randn(9, E, generator=torch.Generator().manual_seed(5)),
                                  K, False)

    def layer(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE(E, H, I, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=size)
        for e in range(E):
            moe.weight_loader(moe.w13_weight, w13[e, :I], (e, "w1"))
            moe.weight_loader(moe.w13_weight, w13[e, I:], (e, "w3"))
            moe.weight_loader(moe.w2_weight, w2[e], (e, "w2"))
        moe.tp_size = 1  # the all-reduce is the sum below
        return moe

    whole = layer(0, 1)(x, weights, ids)
    parts = layer(0, 2)(x, weights, ids) + layer(1, 2)(x, weights, ids)
    assert layer(1, 2).w13_weight.shape == (E, I, H)  # probe: each rank holds half
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(whole, experts_reference(x, w13, w2, weights, ids))


def test_an_intermediate_size_the_ranks_cannot_split_is_named() -> None:
    with pytest.raises(ValueError, match=r"moe intermediate size \(40\) is not divisible by "
                                         r"tp_size \(3\)"):
        FusedMoE(E, H, I, dtype=torch.float32, device="cpu", tp_rank=0, tp_size=3)


def test_cuda_graphs_are_off_where_experts_read_counts_on_the_host(tiny_model, monkeypatch):
    """On CUDA a MoE model whose experts run in PyTorch (the torch attention backend) runs eager:
    its per-expert counts are read on the host, which a graph capture cannot do. With the fused
    kernel the layer is capturable."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from workers.graphs import cuda_graphs
    from workers.models import build_model

    model = build_model(AutoConfig.from_pretrained(tiny_model("qwen3_moe")), torch.float32, "cpu")
    runner = SimpleNamespace(enforce_eager=False, device=torch.device("cuda"), model=model)
    monkeypatch.setattr(cuda_graphs, "CudaGraphBackend", lambda device: "captured")
    assert cuda_graphs.select_graph_backend(runner) is None
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in experts:
        layer.fused_experts = experts_reference  # stands in for the Triton kernel
    assert cuda_graphs.select_graph_backend(runner) == "captured"  # probe: only the experts


@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_bf16_experts_round_as_the_reference(num_tokens: int, weights_dtype) -> None:
    """In bf16 every path rounds where HF's loop rounds, bit for bit: Mixtral's float32 routing
    weights promote the weighted product before it is rounded, Qwen's bf16 ones do not."""
    w13, w2 = (w.to(torch.bfloat16) for w in _weights(7))
    g = torch.Generator().manual_seed(8)
    x = torch.randn(num_tokens, H, generator=g).to(torch.bfloat16)
    weights, ids = select_experts(torch.randn(num_tokens, E, generator=g), K, True,
                                  weights_dtype)
    assert torch.equal(experts_sorted(x, w13, w2, weights, ids),
                       experts_reference(x, w13, w2, weights, ids))
