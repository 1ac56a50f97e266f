"""gpt-oss's mixture of experts: its router (a biased linear layer, top k of the logits, the
softmax over those k) and its experts (biased projections and a clamped SwiGLU).

Each expert computes ``down(((up + 1) * glu(gate)) + b2`` from ``gate_up = x W13 + b13``, with
``gate`` clamped at ``limit`` from above, ``up`` to [-limit, limit], and ``glu(g) = g *
sigmoid(alpha g)`` (HF's ``GptOssExperts``; vLLM calls it "swigluoai"). The checkpoint stacks
every expert: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved column by column,
``down_proj`` [E, I, H], and their biases; the loaders split and transpose them into
``w13_weight`` [E, 2 I/tp, H] (gate rows then up rows, this rank's slice of the intermediate
dimension) and ``w2_weight`` [E, H, I/tp], as the other experts are laid out. Under tensor
parallelism the ranks' partial sums meet in one all-reduce, so the down projection's bias is
added on the first rank only.

Where the backend has the fused experts kernel (Triton on CUDA: ``kernels.triton_moe`` with the
biases and ``activation="swigluoai"``), it runs there without a host sync, so CUDA graphs
capture the layer as they capture the other experts. Elsewhere (the CPU) it runs on the PyTorch
side, the (token, expert) pairs sorted by expert and each expert run on its contiguous rows, the
results added back in ascending expert order as HF's loop adds them (``expert_compute.
by_expert``, as the other experts on a CPU); that path reads the counts per expert on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.layers.linear import _copy_checked, default_weight_loader, divide, weakly_bound
from workers.layers.moe.expert_compute import by_expert


class GptOssRouter(nn.Module):
    """``router.weight`` [E, hidden] and ``router.bias`` [E], replicated on every rank."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, *, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..num_local_experts "
                             f"({num_experts})")
        self.top_k = top_k
        self.weight = _param((num_experts, hidden_size), dtype, device, default_weight_loader)
        self.bias = _param((num_experts,), dtype, device, default_weight_loader)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in the model dtype, expert ids [T, k]): the softmax of the top k
        logits, as HF takes it (in the logits' dtype)."""
        logits = F.linear(hidden_states, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), ids


class GptOssExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 alpha: float, limit: float, dtype: torch.dtype, device: torch.device | str,
                 tp_rank: int = 0, tp_size: int = 1,
                 tp_group: dist.ProcessGroup | None = None, quant_method: Any = None) -> None:
        """``quant_method``: the checkpoint's experts method (MXFP4: packed tensors loaded
        beside the weights and dequantized into them after loading); None: float weights."""
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.alpha, self.limit = alpha, limit
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        size = self.intermediate_per_partition = divide(intermediate_size, tp_size,
                                                        "moe intermediate size")
        self.w13_weight = _param((num_experts, 2 * size, hidden_size), dtype, device,
                                 weakly_bound(self._load_gate_up))
        self.w13_bias = _param((num_experts, 2 * size), dtype, device,
                               weakly_bound(self._load_gate_up_bias))
        self.w2_weight = _param((num_experts, hidden_size, size), dtype, device,
                                weakly_bound(self._load_down))
        self.w2_bias = _param((num_experts, hidden_size), dtype, device,
                              weakly_bound(self._load_down_bias))
        self.quant_method = quant_method
        # The backend's fused experts kernel (use_kernels); None: the PyTorch path.
        self.fused_experts: Any = None
        if quant_method is not None:
            full = size * tp_size
            quant_method.create_weights(self, rows={"w13": 2 * full, "w2": hidden_size},
                                        columns={"w13": hidden_size, "w2": full}, device=device)

    def load_float(self, projection: str, weight: torch.Tensor) -> None:
        """Load ``projection`` ("w13" or "w2") from its full float tensor in the checkpoint's
        layout (what a quantized layout dequantizes to)."""
        if projection == "w13":
            self._load_gate_up(self.w13_weight, weight)
        else:
            self._load_down(self.w2_weight, weight)

    # -- loading: the checkpoint's stacked, interleaved layout into ours -------------------

    def _columns(self) -> slice:
        size = self.intermediate_per_partition
        return slice(self.tp_rank * size, (self.tp_rank + 1) * size)

    def _check(self, loaded: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(f"{name} of shape {tuple(loaded.shape)}, expected {shape} "
                             f"(num_local_experts, hidden_size, intermediate_size of the config)")

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor,
                      shard_id: Any = None) -> None:
        full = 2 * self.intermediate_per_partition * self.tp_size
        self._check(loaded, (self.num_experts, self.hidden_size, full), "gate_up_proj")
        cols = self._columns()
        gate, up = loaded[:, :, 0::2][:, :, cols], loaded[:, :, 1::2][:, :, cols]
        _copy_checked(param.data, torch.cat([gate, up], dim=2).transpose(1, 2))

    def _load_gate_up_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                           shard_id: Any = None) -> None:
        full = 2 * self.intermediate_per_partition * self.tp_size
        self._check(loaded, (self.num_experts, full), "gate_up_proj_bias")
        cols = self._columns()
        _copy_checked(param.data, torch.cat([loaded[:, 0::2][:, cols], loaded[:, 1::2][:, cols]],
                                            dim=1))

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        full = self.intermediate_per_partition * self.tp_size
        self._check(loaded, (self.num_experts, full, self.hidden_size), "down_proj")
        _copy_checked(param.data, loaded[:, self._columns(), :].transpose(1, 2))

    def _load_down_bias(self, param: torch.Tensor, loaded: torch.Tensor,
                        shard_id: Any = None) -> None:
        self._check(loaded, (self.num_experts, self.hidden_size), "down_proj_bias")
        # The ranks' partial sums are all-reduced: the bias counts once, on the first rank.
        _copy_checked(param.data, loaded if self.tp_rank == 0 else torch.zeros_like(loaded))

    # -- compute ---------------------------------------------------------------------------

    def use_kernels(self, kernels: Any) -> None:
        self.fused_experts = getattr(kernels, "fused_moe", None)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture this layer: on the fused kernel, which never reads
        a device value on the host (the PyTorch path reads the per-expert counts)."""
        return self.fused_experts is not None

    def fused_options(self, experts: slice = slice(None)) -> dict[str, Any]:
        """What the fused kernel takes beside the weights for this layer (``experts``: the
        biases of those experts only, as a warm-up launches them)."""
        return {"w13_bias": self.w13_bias[experts], "w2_bias": self.w2_bias[experts],
                "activation": "swigluoai", "alpha": self.alpha, "limit": self.limit}

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if self.fused_experts is not None:
            out = self.fused_experts(hidden_states, self.w13_weight, self.w2_weight,
                                     topk_weights, topk_ids, **self.fused_options())
        else:
            out = by_expert(hidden_states, topk_weights, topk_ids, self.num_experts,
                            self._expert)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out

    def _expert(self, rows: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert over its rows: the clamped SwiGLU between the biased projections."""
        size = self.intermediate_per_partition
        gate_up = F.linear(rows, self.w13_weight[expert], self.w13_bias[expert])
        gate = gate_up[:, :size].clamp(max=self.limit)
        up = gate_up[:, size:].clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return F.linear(gated, self.w2_weight[expert], self.w2_bias[expert])

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, intermediate={self.intermediate_per_partition} "
                f"per rank, alpha={self.alpha}, limit={self.limit}")


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
           loader: Any) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param
