"""The FP8 experts method: a mixture-of-experts layer (``workers.layers.moe.FusedMoE``) whose
stacked expert weights are float8_e4m3fn with float32 scales.

Parameters, named as the checkpoint's experts name their tensors (the weight loader maps
``<prefix>.experts.<e>.<gate|up|down>_proj.<tensor>`` to ``<prefix>.experts.w13_<tensor>`` or
``w2_<tensor>`` with shard id ``(e, "w1" | "w3" | "w2")``):

- ``w13_weight`` [E, 2*I/tp, H] and ``w2_weight`` [E, H, I/tp], float8_e4m3fn;
- block layout: ``w13_weight_scale_inv`` [E, 2*I/tp/128, H/128], ``w2_weight_scale_inv``
  [E, H/128, I/tp/128];
- per channel: ``w13_weight_scale`` [E, 2*I/tp], ``w2_weight_scale`` [E, H] (one per row);
- per tensor: ``w13_weight_scale`` [E, 2] (gate, up), ``w2_weight_scale`` [E, 1], made one per
  row after loading; static activations add ``w13_input_scale`` / ``w2_input_scale`` (kept;
  the experts' activations are not quantized here);
- ``--quantization fp8``: the weights quantized per row as they load (scales are buffers).

The forward pass dequantizes, for the compute dtype, the experts the step routes tokens to (on
the CPU one expert at a time, each as ``experts_sorted`` reaches it; on CUDA every expert of the
layer into a scratch buffer, then the layer's fused kernel: no host sync, so a CUDA graph can
hold it), and runs the model-dtype experts path on them. No FP8 GEMM runs for experts yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.layers.moe.expert_compute import experts_sorted
from workers.quantization.fp8 import _bound, check_fp8_device
from workers.quantization.fp8_numerics import (BLOCK, FP8_DTYPE, dequantize_block, dequantize_rows,
                                               has_nan_codes, quantize_rows, row_scales)
from workers.quantization.fp8_scheme import Fp8Scheme

Shard = tuple[int | None, str]


class Fp8ExpertsMethod:
    def __init__(self, scheme: Fp8Scheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"Fp8ExpertsMethod({self.scheme.describe()})"

    # ---- weights -------------------------------------------------------------------------

    def create_weights(self, layer: Any, dtype: torch.dtype,
                       device: torch.device | str) -> None:
        device = torch.device(device)
        check_fp8_device(device, f"{self.prefix}: FP8 expert weights")
        experts, hidden = layer.num_experts, layer.hidden_size
        inter = layer.intermediate_per_partition
        scheme = self.scheme
        if scheme.weight_strategy == "block" and inter % BLOCK:
            raise ValueError(f"{self.prefix}: {inter} expert intermediate rows per rank is not "
                             f"a whole number of {BLOCK}-wide FP8 blocks at tensor parallel "
                             f"size {layer.tp_size}")
        self._add(layer, "w13_weight", (experts, 2 * inter, hidden), FP8_DTYPE, device, "weight")
        self._add(layer, "w2_weight", (experts, hidden, inter), FP8_DTYPE, device, "weight")
        if scheme.online:
            layer.register_buffer("w13_weight_scale", torch.ones(experts, 2 * inter,
                                                                 device=device),
                                  persistent=False)
            layer.register_buffer("w2_weight_scale", torch.ones(experts, hidden, device=device),
                                  persistent=False)
        elif scheme.weight_strategy == "block":
            name = scheme.scale_name
            self._add(layer, f"w13_{name}", (experts, 2 * inter // BLOCK, -(-hidden // BLOCK)),
                      torch.float32, device, "block")
            self._add(layer, f"w2_{name}", (experts, -(-hidden // BLOCK), inter // BLOCK),
                      torch.float32, device, "block")
        elif scheme.weight_strategy == "channel":
            self._add(layer, "w13_weight_scale", (experts, 2 * inter), torch.float32, device,
                      "rows")
            self._add(layer, "w2_weight_scale", (experts, hidden), torch.float32, device, "rows")
        else:
            self._add(layer, "w13_weight_scale", (experts, 2), torch.float32, device, "tensor")
            self._add(layer, "w2_weight_scale", (experts, 1), torch.float32, device, "tensor")
        if scheme.activations == "static" and not scheme.online:
            self._add(layer, "w13_input_scale", (experts, 2), torch.float32, device, "tensor")
            self._add(layer, "w2_input_scale", (experts, 1), torch.float32, device, "tensor")

    def _add(self, layer: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device, kind: str) -> None:
        stacked = name[:3]  # "w13" or "w2_"
        parts = ("w1", "w3") if stacked == "w13" else ("w2",)
        param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        def load(owner: Any, param: torch.Tensor, loaded: torch.Tensor, shard_id: Shard) -> None:
            self._load(owner, param, loaded, shard_id, kind)

        param.weight_loader = _bound(load, layer)  # type: ignore[attr-defined]
        param.expected_shards = {(e, p) for e in range(layer.num_experts)  # type: ignore
                                 for p in parts}
        layer.register_parameter(name, param)

    def _load(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor, shard_id: Shard,
              kind: str) -> None:
        expert, part = shard_id
        if expert is None:  # every expert in one tensor (gate and up stacked along dim 1)
            halves = loaded.chunk(2, dim=1) if part == "w13" else (loaded,)
            names = ("w1", "w3") if part == "w13" else ("w2",)
            for index in range(layer.num_experts):
                for half, name in zip(halves, names):
                    self._load(layer, param, half[index], (index, name), kind)
            return
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{layer.num_experts} experts")
        inter, rank = layer.intermediate_per_partition, layer.tp_rank
        target = param.data[expert]
        if kind == "tensor":
            if loaded.numel() != 1:
                raise ValueError(f"a per-tensor scale has one value, this tensor has shape "
                                 f"{tuple(loaded.shape)}")
            target[1 if part == "w3" else 0] = loaded.reshape(()).to(torch.float32)
            return
        if kind == "weight" and self.scheme.online:
            self._quantize_into(layer, expert, part, loaded, target)
            return
        if kind == "weight" and loaded.dtype != FP8_DTYPE:
            raise ValueError(f"{self.scheme.describe()} expects float8_e4m3fn weights; this "
                             f"tensor is {str(loaded.dtype).removeprefix('torch.')}")
        if kind == "rows" and loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded[:, 0]
        unit = BLOCK if kind == "block" else 1
        size = inter // unit
        if part in ("w1", "w3"):  # rows of the intermediate dimension, gate first
            offset = 0 if part == "w1" else size
            _copy(target.narrow(0, offset, size), loaded.narrow(0, rank * size, size))
        elif part == "w2":  # columns of the intermediate dimension (a scale per row: whole)
            _copy(target, loaded if kind == "rows" else loaded.narrow(1, rank * size, size))
        else:
            raise ValueError(f"unknown expert projection {part!r}")

    def _quantize_into(self, layer: Any, expert: int, part: str, loaded: torch.Tensor,
                       target: torch.Tensor) -> None:
        inter, rank = layer.intermediate_per_partition, layer.tp_rank
        full = loaded.to(target.device)
        if part in ("w1", "w3"):
            rows = full.narrow(0, rank * inter, inter)
            scale = row_scales(rows)
            offset = 0 if part == "w1" else inter
            _copy(target.narrow(0, offset, inter), quantize_rows(rows, scale))
            layer.w13_weight_scale[expert].narrow(0, offset, inter).copy_(scale)
        else:  # a row's scale from its amax over every rank's columns
            scale = row_scales(full)
            _copy(target, quantize_rows(full.narrow(1, rank * inter, inter), scale))
            layer.w2_weight_scale[expert].copy_(scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        if getattr(layer, "fp8_processed", False):
            return
        layer.fp8_processed = True
        for stacked in ("w13", "w2"):
            if has_nan_codes(getattr(layer, f"{stacked}_weight")):
                raise ValueError(f"{self.prefix}.{stacked}_weight holds float8 NaN codes")
        if self.scheme.weight_strategy == "tensor" and not self.scheme.online:
            inter = layer.intermediate_per_partition
            gate_up = layer.w13_weight_scale.data.repeat_interleave(inter, dim=1)
            down = layer.w2_weight_scale.data.expand(-1, layer.hidden_size).contiguous()
            layer.w13_weight_scale = nn.Parameter(gate_up, requires_grad=False)
            layer.w2_weight_scale = nn.Parameter(down, requires_grad=False)
        for scale in self._scales(layer):
            if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
                raise ValueError(f"{self.prefix}: every expert weight scale must be a positive "
                                 f"finite number")

    def _scales(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.scheme.scale_name if not self.scheme.online else "weight_scale"
        return getattr(layer, f"w13_{name}"), getattr(layer, f"w2_{name}")

    # ---- forward -------------------------------------------------------------------------

    def apply(self, layer: Any, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13_scale, w2_scale = self._scales(layer)
        block = self.scheme.weight_strategy == "block" and not self.scheme.online
        dtype = hidden_states.dtype
        if hidden_states.device.type == "cuda":
            w13 = _dequantize_all(layer.w13_weight, w13_scale, block, dtype)
            w2 = _dequantize_all(layer.w2_weight, w2_scale, block, dtype)
            if layer.fused_experts is not None:
                return layer.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids)
            return experts_sorted(hidden_states, w13, w2, topk_weights, topk_ids)
        return experts_sorted(hidden_states,
                              DequantizedExperts(layer.w13_weight, w13_scale, block, dtype),
                              DequantizedExperts(layer.w2_weight, w2_scale, block, dtype),
                              topk_weights, topk_ids)


class DequantizedExperts:
    """Stacked FP8 expert weights that dequantize one expert when it is indexed: what
    ``experts_sorted`` reads, so only the experts a step routes tokens to are dequantized."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: bool,
                 dtype: torch.dtype) -> None:
        self.weight, self.scale, self.block, self.dtype = weight, scale, block, dtype

    def __len__(self) -> int:
        return self.weight.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        dequantize: Callable[..., torch.Tensor] = dequantize_block if self.block \
            else dequantize_rows
        return dequantize(self.weight[expert], self.scale[expert], self.dtype)


def _dequantize_all(weight: torch.Tensor, scale: torch.Tensor, block: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """Every expert of ``weight`` [E, R, C] dequantized to ``dtype`` in one pass."""
    experts, rows, cols = weight.shape
    wide = weight.to(torch.float32)
    if block:
        wide = (wide.view(experts, rows // BLOCK, BLOCK, -(-cols // BLOCK), -1)
                * scale[:, :, None, :, None]).view(experts, rows, cols) if cols % BLOCK == 0 \
            else torch.stack([dequantize_block(weight[e], scale[e], torch.float32)
                              for e in range(experts)])
    else:
        wide = wide * scale[:, :, None]
    return wide.to(dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, the checkpoint slice "
                         f"has {tuple(src.shape)}")
    dst.copy_(src)
