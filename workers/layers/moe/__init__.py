"""The mixture-of-experts layer: a router choosing each token's experts, and the experts stacked
and sharded (``FusedMoE``), with a PyTorch reference, a CPU path and the Triton kernel behind it."""

from workers.layers.moe.expert_compute import experts_reference, experts_sorted
from workers.layers.moe.fused_moe import PROJECTIONS, FusedMoE
from workers.layers.moe.router import TopKRouter, select_experts

__all__ = ["FusedMoE", "PROJECTIONS", "TopKRouter", "experts_reference", "experts_sorted",
           "select_experts"]
