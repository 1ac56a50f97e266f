"""The router of a mixture-of-experts layer: which experts see each token, and with what weight.

HF's routers (Qwen2/3-MoE, Mixtral) score the experts with one bias-free linear layer in the model
dtype, take the softmax in float32, keep the top k, and renormalise those k to sum to one where
the config says so (``norm_topk_prob``; Mixtral always). Qwen rounds the kept weights back to the
model dtype before they scale the experts' outputs, Mixtral keeps them in float32: both are
followed here so bf16 outputs round as HF's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.linear import default_weight_loader, weakly_bound


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype = torch.float32
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in ``weights_dtype``, expert ids [T, k] int64) from logits [T, E]."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class TopKRouter(nn.Module):
    """``gate.weight`` [E, hidden], replicated on every rank (it is small, and every rank must
    route a token to the same experts)."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, *, renormalize: bool,
                 round_weights: bool, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_experts "
                             f"({num_experts})")
        self.top_k, self.renormalize = top_k, renormalize
        self.weights_dtype = dtype if round_weights else torch.float32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        loader = weakly_bound(default_weight_loader)
        self.weight.weight_loader = loader  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(F.linear(hidden_states, self.weight), self.top_k,
                              self.renormalize, self.weights_dtype)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}")
