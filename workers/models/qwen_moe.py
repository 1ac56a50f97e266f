"""Qwen's mixtures of experts: Qwen3-MoE (Qwen3's attention with q/k norms, top-k routing that
renormalises where ``norm_topk_prob`` says) and Qwen2-MoE (Qwen2's biased q/k/v, and a shared
expert beside the routed ones). Layers listed in ``mlp_only_layers``, or off the
``decoder_sparse_step`` grid, keep a dense MLP, as in HF's models."""

from __future__ import annotations

from typing import Any

from torch import nn

from workers.models.decoder import DecoderForCausalLM, DecoderMLP, ParallelContext
from workers.models.moe_block import SparseMoeBlock


def _is_sparse_layer(config: Any, layer_idx: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % step == 0)


class QwenMoeForCausalLM(DecoderForCausalLM):
    """What both Qwen MoE generations share: which layers are sparse, and the routing."""

    has_shared_expert = False

    def make_mlp(self, config: Any, par: ParallelContext, layer_idx: int,
                 prefix: str) -> nn.Module:
        if not _is_sparse_layer(config, layer_idx):
            return DecoderMLP(config, par, prefix, bias=False)
        shared = config.shared_expert_intermediate_size if self.has_shared_expert else 0
        return SparseMoeBlock(config, par, prefix, num_experts=config.num_experts,
                              intermediate_size=config.moe_intermediate_size,
                              renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              round_weights=True, shared_expert_size=shared)


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    qkv_bias_always = True
    has_shared_expert = True
