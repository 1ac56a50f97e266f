"""The experts of a mixture-of-experts layer, stacked, sharded for tensor parallelism.

``w13_weight`` [E, 2 * I/tp, H] holds every expert's gate and up projections (this rank's slice
of the intermediate dimension, gate rows first) and ``w2_weight`` [E, H, I/tp] its down
projection, as vLLM's ``FusedMoE`` stacks them. Each rank computes every routed expert on its
slice and the partial sums are all-reduced once, as in the dense MLP; the router runs replicated,
so every rank sends a token to the same experts and the ranks take part in the same collectives.

What runs: the backend's fused kernel where it has one (Triton on CUDA: tokens sorted by expert,
grouped GEMMs, no host sync, so CUDA graphs capture it), else ``experts_sorted`` (the CPU) on the
plain stacked weights: oneDNN-packed per-expert matrices (``workers.layers.cpu_prepack``) were
measured slower here, at 1 and 16 tokens 0.85 and 8.2 ms against 0.60 and 5.8 ms for a layer of
32 experts of 1024 x 384, 4 per token (AVX-512 Xeon, float32, 2 threads). A quantized
checkpoint's experts method (``workers.quantization``) creates and multiplies its own weights
instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers.layers.linear import _copy_checked, divide, weakly_bound
from workers.layers.moe.expert_compute import experts_sorted

# shard_id of a checkpoint tensor: (expert index, which projection), or (None, "w13"/"w2") for
# a tensor holding every expert (the stacked layout transformers keeps in memory).
ExpertShard = tuple[int | None, str]
FusedExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        torch.Tensor]
# HF's per-expert projection names -> ours (Qwen-MoE names them like the dense MLP, Mixtral
# w1/w3/w2).
PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
               "w1": "w1", "w3": "w3", "w2": "w2"}


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 dtype: torch.dtype, device: torch.device | str, tp_rank: int = 0,
                 tp_size: int = 1, tp_group: dist.ProcessGroup | None = None,
                 quant_method: Any = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.intermediate_per_partition = divide(intermediate_size, tp_size,
                                                 "moe intermediate size")
        self.quant_method = quant_method
        if quant_method is not None:
            quant_method.create_weights(self, dtype=dtype, device=device)
        else:
            size = self.intermediate_per_partition
            self.w13_weight = self.new_param((num_experts, 2 * size, hidden_size), "w13", dtype,
                                             device)
            self.w2_weight = self.new_param((num_experts, hidden_size, size), "w2", dtype, device)
        # The backend's fused experts kernel (use_kernels); None: experts_sorted.
        self.fused_experts: FusedExperts | None = None

    def new_param(self, shape: tuple[int, ...], stacked: str, dtype: torch.dtype,
                  device: torch.device | str) -> nn.Parameter:
        """A parameter of the ``stacked`` ("w13" or "w2") projections, loaded expert by expert
        through ``weight_loader`` (a quantized experts method makes its scales with it too)."""
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        param.weight_loader = weakly_bound(self.weight_loader)  # type: ignore[attr-defined]
        param.expected_shards = self.expected_shards(stacked)  # type: ignore[attr-defined]
        return param

    def expected_shards(self, stacked: str) -> set[ExpertShard]:
        """The shards a checkpoint must provide for a ``stacked`` ("w13" or "w2") parameter."""
        parts = ("w1", "w3") if stacked == "w13" else ("w2",)
        return {(expert, part) for expert in range(self.num_experts) for part in parts}

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: ExpertShard) -> None:
        """Copy this rank's slice of one expert's projection (or of every expert's, for the
        stacked layout) into ``param``. Scale tensors of a quantized layout slice the same way
        where their rows follow the weight's (per channel, per block)."""
        expert, part = shard_id
        if expert is None:
            if part == "w13":
                gate, up = loaded_weight.chunk(2, dim=1)
                for index in range(self.num_experts):
                    self.weight_loader(param, gate[index], (index, "w1"))
                    self.weight_loader(param, up[index], (index, "w3"))
            else:
                for index in range(self.num_experts):
                    self.weight_loader(param, loaded_weight[index], (index, "w2"))
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts")
        target = param.data[expert]
        if part in ("w1", "w3"):
            rows = divide(loaded_weight.shape[0], self.tp_size, "expert intermediate rows")
            offset = 0 if part == "w1" else rows
            _copy_checked(target.narrow(0, offset, rows),
                          loaded_weight.narrow(0, self.tp_rank * rows, rows))
        elif part == "w2":
            if loaded_weight.dim() > 1 and loaded_weight.shape[1] != target.shape[1]:
                cols = divide(loaded_weight.shape[1], self.tp_size, "expert intermediate columns")
                loaded_weight = loaded_weight.narrow(1, self.tp_rank * cols, cols)
            _copy_checked(target, loaded_weight)
        else:
            raise ValueError(f"unknown expert projection {part!r}")

    def use_kernels(self, kernels: Any) -> None:
        self.fused_experts = getattr(kernels, "fused_moe", None)

    def fused_options(self, experts: slice = slice(None)) -> dict[str, Any]:
        """What the fused kernel takes beside the weights (gpt-oss's experts add biases and
        their activation): nothing, for SwiGLU experts."""
        return {}

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture this layer: its experts never read a device value on
        the host (the fused kernel does not; the PyTorch paths read per-expert counts)."""
        # A quantized experts method on CUDA hands its dequantized weights to the same kernel
        # (workers.quantization.fp8_moe); one that reads the host says so with capturable=False.
        return (self.fused_experts is not None
                and bool(getattr(self.quant_method, "capturable", True)))

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H], reduced over the tensor-parallel ranks."""
        if self.quant_method is not None:
            out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        elif self.fused_experts is not None:
            out = self.fused_experts(hidden_states, self.w13_weight, self.w2_weight,
                                     topk_weights, topk_ids)
        else:
            out = experts_sorted(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                                 topk_ids)
        if self.tp_size > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate_per_rank={self.intermediate_per_partition}, "
                f"tp={self.tp_rank}/{self.tp_size}")
