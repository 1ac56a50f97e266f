"""A transformer layer's mixture of experts: the router, the routed experts, and Qwen2-MoE's
shared expert with its sigmoid gate. It sits between two attention ops like the dense MLP, so a
step stops, unwinds and resumes around it exactly as around a dense layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from workers.layers.moe import FusedMoE, TopKRouter
from workers.models.decoder import DecoderMLP, ParallelContext, check_silu


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, par: ParallelContext, prefix: str, *, num_experts: int,
                 intermediate_size: int, renormalize: bool, round_weights: bool,
                 shared_expert_size: int = 0) -> None:
        super().__init__()
        check_silu(config)
        hidden = config.hidden_size
        self.gate = TopKRouter(num_experts, hidden, config.num_experts_per_tok,
                               renormalize=renormalize, round_weights=round_weights,
                               dtype=par.dtype, device=par.device)
        self.experts = FusedMoE(num_experts, hidden, intermediate_size,
                                quant_method=par.experts_method(f"{prefix}.experts"),
                                **par.args(with_group=True))
        self.shared_expert: DecoderMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_size:
            self.shared_expert = DecoderMLP(config, par, f"{prefix}.shared_expert", bias=False,
                                            intermediate_size=shared_expert_size)
            # HF's nn.Linear(hidden, 1): one scalar gate per token, replicated on every rank.
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, dtype=par.dtype,
                                                device=par.device).requires_grad_(False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        out = self.experts(hidden_states, topk_weights, topk_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out
