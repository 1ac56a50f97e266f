"""Quantized weights: which checkpoint layouts are understood, and the methods that hold and
multiply by them.

``get_quant_config(hf_config, quantization)`` reads a checkpoint's ``quantization_config`` (or the
``--quantization`` a user asked for) and returns the ``QuantizationConfig`` the model files
consult: ``linear_method(prefix)`` for each linear layer (None: the layer keeps the model dtype),
``experts_method(prefix)`` for each mixture-of-experts layer. A method that is not understood is
refused here, at startup, by name. Served: FP8 (float8_e4m3fn) weights, block-wise (``"fp8"``
with ``weight_block_size`` [128, 128]) and per tensor / channel (``"fp8"``,
``"compressed-tensors"``), and ``--quantization fp8`` (per-channel FP8 from a full-precision
checkpoint, quantized at load): ``workers.quantization.config``.

After the weights are loaded, every module with a ``process_weights_after_loading()`` method
gets it called once (``workers.startup.weight_loader``): quantized layers finish their scales
there.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from workers.quantization.config import (QUANTIZATION_CHOICES, parse_quant_config,
                                         raw_quantization_config)
from workers.quantization.fp8_numerics import FP8_DTYPE, FP8_MAX

# The names quantized layers give their scales (checkpoint names): dummy weights fill them.
SCALE_NAMES = ("weight_scale_inv", "weight_scale", "input_scale")


class QuantizationConfig(Protocol):
    name: str

    def linear_method(self, prefix: str) -> Any | None: ...

    def experts_method(self, prefix: str) -> Any | None: ...


def get_quant_config(hf_config: Any, quantization: str | None = None) -> QuantizationConfig | None:
    """The quantization the model's weights use, or None for plain model-dtype weights.
    ValueError for a quant_method, scheme or ``quantization`` that is not served."""
    return parse_quant_config(raw_quantization_config(hf_config), quantization)


def check_quantization(hf_config: Any, quantization: str | None,
                       device: torch.device | str) -> QuantizationConfig | None:
    """What EngineCore checks before any rank starts: the quantization is understood, and the
    device can run it (FP8 needs compute capability 8.9 on a GPU)."""
    from workers.quantization.fp8 import check_fp8_device

    from workers.quantization.mxfp4 import Mxfp4Config

    config = get_quant_config(hf_config, quantization)
    if isinstance(config, Mxfp4Config):
        architectures = list(getattr(hf_config, "architectures", None) or [])
        if architectures != ["GptOssForCausalLM"]:
            raise ValueError(f"quant_method 'mxfp4' is served for gpt-oss's experts only "
                             f"(GptOssForCausalLM), not {architectures}")
    elif config is not None:
        check_fp8_device(torch.device(device), f"{config.name} quantization (FP8 weights)")
    return config


def describe_weights(model: torch.nn.Module) -> str:
    """What the loaded weights hold, for the startup log: how many tensors are FP8 and how much
    memory they and the rest take."""
    fp8_bytes = other_bytes = fp8_tensors = 0
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or tensor.is_mkldnn:
            continue
        seen.add(id(tensor))
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype == FP8_DTYPE:
            fp8_bytes += nbytes
            fp8_tensors += 1
        else:
            other_bytes += nbytes
    quant = getattr(model, "quant_config", None)
    name = getattr(quant, "name", "none")
    return (f"weights: quantization {name}; {fp8_tensors} FP8 weight tensors, "
            f"{fp8_bytes / 2**20:.0f} MiB; everything else (embeddings, head, norms, scales) "
            f"{other_bytes / 2**20:.0f} MiB")


def is_scale_name(name: str) -> bool:
    """Whether a parameter or buffer name (dotted) is a quantization scale."""
    return name.rpartition(".")[2] in SCALE_NAMES


__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZATION_CHOICES",
    "SCALE_NAMES",
    "QuantizationConfig",
    "check_quantization",
    "describe_weights",
    "get_quant_config",
    "is_scale_name",
]
