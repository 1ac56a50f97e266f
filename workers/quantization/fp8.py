"""The FP8 linear method: a linear layer whose weight is float8_e4m3fn with float32 scales.

``create_weights`` registers on the layer the parameters the checkpoint names (``weight`` in
float8_e4m3fn; ``weight_scale_inv`` per 128x128 block, or ``weight_scale`` per channel or per
tensor; ``input_scale`` for static activations), each with a ``weight_loader`` that slices the
full checkpoint tensor to this rank's shard (``layer.shard_slice``; block scales in block
units). ``process_weights_after_loading`` checks the weights and turns per-tensor scales of a
fused layer (one per q/k/v or gate/up part) into one scale per output row, which dequantizes
the same numbers. ``--quantization fp8`` registers an fp8 ``weight`` too, and quantizes each
full-precision checkpoint tensor as it arrives (so no full-precision copy of the model is ever
held), one scale per output row from the full row's amax (the same scales at any TP size).

The forward pass:

- on the CPU, the weight stays in FP8 in memory and each call dequantizes it for the compute
  dtype (``fp8.float() * scale``, rounded once: ``workers.quantization.fp8_numerics``) and
  multiplies; ``workers.quantization.cpu_dequant`` says what that costs, and how its compiled
  kernels keep a decode step's GEMV near the bf16 one.
- on CUDA (compute capability 8.9 or newer), the GEMM runs in FP8: ``torch._scaled_mm`` with
  activations quantized per token for per-channel / per-tensor weights, the Triton block-scaled
  kernel (``kernels.triton_fp8``) for 128x128 blocks (``workers.quantization.fp8_cuda``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from workers.quantization.cpu_dequant import fp8_linear_cpu, warm_up
from workers.quantization.fp8_numerics import FP8_DTYPE, has_nan_codes, quantize_rows, row_scales
from workers.quantization.fp8_scheme import Fp8Scheme


def check_fp8_device(device: torch.device, what: str) -> None:
    """A ValueError where ``device`` is a GPU without FP8 (compute capability below 8.9)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return  # no GPU visible: the device check (engine.runtime.model_setup) says so
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"{what} needs a GPU with FP8 support (compute capability 8.9 or "
                         f"newer: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} "
                         f"has compute capability {major}.{minor}")


class Fp8LinearMethod:
    """FP8 weights of one linear layer (``prefix``: its dotted name, for errors)."""

    def __init__(self, scheme: Fp8Scheme, prefix: str) -> None:
        self.scheme = scheme
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"Fp8LinearMethod({self.scheme.describe()})"

    # ---- weights -------------------------------------------------------------------------

    def create_weights(self, layer: Any, dtype: torch.dtype, device: torch.device) -> None:
        check_fp8_device(device, f"{self.prefix}: FP8 weights")
        scheme = self.scheme
        rows, cols = layer.output_size_per_partition, layer.input_size_per_partition
        if scheme.weight_strategy == "block":
            self._check_block_alignment(layer)
        load_weight = self._load_and_quantize if scheme.online else self._load_fp8_weight
        layer.register_parameter("weight", _param((rows, cols), FP8_DTYPE, device,
                                                  _bound(load_weight, layer)))
        shards = len(layer.shard_ids)
        if scheme.online:
            # Filled by the weight's own loader: not a checkpoint tensor, so a buffer.
            layer.register_buffer("weight_scale", torch.ones(rows, device=device),
                                  persistent=False)
        elif scheme.weight_strategy == "block":
            bn, bk = scheme.block
            layer.register_parameter(scheme.scale_name, _param(
                (-(-rows // bn), -(-cols // bk)), torch.float32, device,
                _bound(self._load_block_scale, layer)))
        elif scheme.weight_strategy == "channel":
            layer.register_parameter(scheme.scale_name, _param(
                (rows,), torch.float32, device, _bound(self._load_channel_scale, layer)))
        else:  # tensor: one scale per checkpoint tensor (q, k, v ...), made per-row later
            layer.register_parameter(scheme.scale_name, _param(
                (shards,), torch.float32, device, _bound(self._load_tensor_scale, layer)))
        if scheme.activations == "static":
            layer.register_parameter("input_scale", _param(
                (shards,), torch.float32, device, _bound(self._load_tensor_scale, layer)))

    def _check_block_alignment(self, layer: Any) -> None:
        """Every shard of the weight must cover whole 128x128 blocks, or the block scales could
        not be split with it; the one exception is an unsplit, unfused weight, whose last
        blocks may be partial (as in the checkpoint)."""
        bn, bk = self.scheme.block
        for shard_id in layer.shard_ids:
            where = layer.shard_slice(shard_id)
            unit = bn if where.dim == 0 else bk
            whole = layer.tp_size == 1 and len(layer.shard_ids) == 1
            if not whole and (where.size % unit or where.offset % unit or where.start % unit):
                part = "" if shard_id is None else f" (part {shard_id!r})"
                axis = "output rows" if where.dim == 0 else "input columns"
                raise ValueError(
                    f"{self.prefix}{part}: {where.size} {axis} per rank from {where.start} is "
                    f"not a whole number of {unit}-wide FP8 blocks at tensor parallel size "
                    f"{layer.tp_size}; block-quantized weights split only at block edges "
                    f"(choose a tensor parallel size that keeps every shard a multiple of "
                    f"{unit})")

    def _load_fp8_weight(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor,
                         shard_id: Any) -> None:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"{self.scheme.describe()} expects float8_e4m3fn weights; this "
                             f"tensor is {str(loaded.dtype).removeprefix('torch.')}")
        where = layer.shard_slice(shard_id)
        _copy(param.data.narrow(where.dim, where.offset, where.size),
              loaded.narrow(where.dim, where.start, where.size))

    def _load_block_scale(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: Any) -> None:
        where = layer.shard_slice(shard_id)
        unit = self.scheme.block[where.dim]
        if loaded.dim() != 2:
            raise ValueError(f"block scales must be 2-d, this tensor has shape "
                             f"{tuple(loaded.shape)}")
        size = -(-where.size // unit)
        _copy(param.data.narrow(where.dim, where.offset // unit, size),
              loaded.narrow(where.dim, where.start // unit, size))

    def _load_channel_scale(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor,
                            shard_id: Any) -> None:
        if loaded.dim() == 2 and loaded.shape[1] == 1:  # compressed-tensors writes [N, 1]
            loaded = loaded[:, 0]
        where = layer.shard_slice(shard_id)
        if where.dim == 0:
            _copy(param.data.narrow(0, where.offset, where.size),
                  loaded.narrow(0, where.start, where.size))
        else:  # row-parallel: the output rows are not split
            _copy(param.data, loaded)

    def _load_tensor_scale(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor,
                           shard_id: Any) -> None:
        if loaded.numel() != 1:
            raise ValueError(f"a per-tensor scale has one value, this tensor has shape "
                             f"{tuple(loaded.shape)}")
        index = layer.shard_ids.index(shard_id)
        param.data[index] = loaded.reshape(()).to(torch.float32)

    def _load_and_quantize(self, layer: Any, param: torch.Tensor, loaded: torch.Tensor,
                           shard_id: Any) -> None:
        if not loaded.is_floating_point() or loaded.dtype == FP8_DTYPE:
            raise ValueError(f"quantization fp8 quantizes full-precision weights; this tensor "
                             f"is {str(loaded.dtype).removeprefix('torch.')}")
        where = layer.shard_slice(shard_id)
        full = loaded.to(param.device)
        if where.dim == 0:
            rows = full.narrow(0, where.start, where.size)
            scale = row_scales(rows)
            _copy(param.data.narrow(0, where.offset, where.size), quantize_rows(rows, scale))
            layer.weight_scale.narrow(0, where.offset, where.size).copy_(scale)
        else:  # row-parallel: the scale of a row is its amax over every rank's columns
            scale = row_scales(full)
            _copy(param.data, quantize_rows(full.narrow(1, where.start, where.size), scale))
            layer.weight_scale.copy_(scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        if getattr(layer, "fp8_processed", False):
            return  # per-tensor scales are made per-row once; a second call must not redo it
        layer.fp8_processed = True
        if has_nan_codes(layer.weight):
            raise ValueError(f"{self.prefix}.weight holds float8 NaN codes; a checkpoint's FP8 "
                             f"weights never should")
        scheme = self.scheme
        if scheme.weight_strategy == "tensor" and not scheme.online:
            per_part = getattr(layer, scheme.scale_name).data
            rows = torch.empty(layer.output_size_per_partition, device=per_part.device)
            for index, shard_id in enumerate(layer.shard_ids):
                where = layer.shard_slice(shard_id)
                if where.dim == 0:
                    rows.narrow(0, where.offset, where.size).fill_(per_part[index])
                else:
                    rows.fill_(per_part[index])
            setattr(layer, scheme.scale_name, nn.Parameter(rows, requires_grad=False))
        scale = self.weight_scale(layer)
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise ValueError(f"{self.prefix}.{scheme.scale_name}: every scale must be a "
                             f"positive finite number")
        if scheme.activations == "static":
            # One scale for the fused input (the parts share it): the largest, as vLLM does.
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1),
                                             requires_grad=False)
        if layer.weight.device.type == "cpu":
            warm_up(layer.weight, scale, scheme.weight_strategy == "block", layer.params_dtype)

    def weight_scale(self, layer: Any) -> torch.Tensor:
        """The weight's scale once loaded: [N/128, K/128] blocks, or [N] rows."""
        return getattr(layer, self.scheme.scale_name)

    # ---- forward -------------------------------------------------------------------------

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.device.type == "cuda":
            from workers.quantization.fp8_cuda import fp8_linear

            return fp8_linear(layer, self.scheme, self.weight_scale(layer), x, bias)
        return fp8_linear_cpu(layer.weight, self.weight_scale(layer),
                              self.scheme.weight_strategy == "block", x, bias)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           loader: Callable[..., None]) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _bound(method: Callable[..., None], layer: nn.Module) -> Callable[..., None]:
    """``method`` with the layer as its first argument, held weakly: the loader lives on the
    layer's own parameter, and a strong reference would make a layer -> parameter -> loader ->
    layer cycle that outlives the model (workers.layers.linear.weakly_bound)."""
    layer_ref = weakref.ref(layer)

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        owner = layer_ref()
        if owner is None:
            raise RuntimeError("the layer of this parameter is gone")
        method(owner, param, loaded, shard_id)

    return load


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, the checkpoint slice "
                         f"has {tuple(src.shape)}")
    dst.copy_(src)
