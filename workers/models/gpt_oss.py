"""gpt-oss (``GptOssForCausalLM``): attention with biases, a learned sink per head and sliding
windows on every other layer (``layer_types``), YaRN rotary, and a mixture of experts with a
biased router and clamped-SwiGLU experts (workers/layers/moe/gpt_oss_experts.py) after every
attention op. Served from the layout transformers saves (experts stacked, gate and up
interleaved), in the checkpoint's float dtype, or from its MXFP4 releases, whose experts are
dequantized at load (workers/quantization/mxfp4.py)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from workers.layers.moe.gpt_oss_experts import GptOssExperts, GptOssRouter
from workers.models.decoder import DecoderForCausalLM, ParallelContext
from workers.quantization.mxfp4 import Mxfp4ExpertsMethod


class GptOssMoeBlock(nn.Module):
    def __init__(self, config: Any, par: ParallelContext,
                 quant_method: Mxfp4ExpertsMethod | None = None) -> None:
        super().__init__()
        num_experts = config.num_local_experts
        self.router = GptOssRouter(num_experts, config.hidden_size, config.num_experts_per_tok,
                                   dtype=par.dtype, device=par.device)
        self.experts = GptOssExperts(num_experts, config.hidden_size, config.intermediate_size,
                                     alpha=float(getattr(config, "swiglu_alpha", 1.702)),
                                     limit=float(getattr(config, "swiglu_limit", 7.0)),
                                     quant_method=quant_method, **par.args(with_group=True))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.router(hidden_states)
        return self.experts(hidden_states, topk_weights, topk_ids)


class GptOssForCausalLM(DecoderForCausalLM):
    attention_sinks = True
    # The experts' stacked tensors and biases under our names (bias names first: the weight
    # names are their prefixes).
    checkpoint_renames: ClassVar[dict[str, str]] = {
        ".experts.gate_up_proj_blocks": ".experts.w13_blocks",
        ".experts.gate_up_proj_scales": ".experts.w13_scales",
        ".experts.down_proj_blocks": ".experts.w2_blocks",
        ".experts.down_proj_scales": ".experts.w2_scales",
        ".experts.gate_up_proj_bias": ".experts.w13_bias",
        ".experts.gate_up_proj": ".experts.w13_weight",
        ".experts.down_proj_bias": ".experts.w2_bias",
        ".experts.down_proj": ".experts.w2_weight"}

    def make_mlp(self, config: Any, par: ParallelContext, layer_idx: int,
                 prefix: str) -> nn.Module:
        method = par.experts_method(f"{prefix}.experts")
        if method is not None and not isinstance(method, Mxfp4ExpertsMethod):
            raise ValueError(f"gpt-oss experts in {type(method).__name__} are not served: its "
                             f"checkpoints are MXFP4 or bf16")
        return GptOssMoeBlock(config, par, method)
