"""compressed-tensors checkpoints (llm-compressor; the RedHat / Neural Magic FP8 models): the FP8
schemes among them, and a refusal naming any other.

Their ``quantization_config`` (compressed-tensors' ``QuantizationConfig`` and
``QuantizationArgs``, as vLLM's ``CompressedTensorsConfig`` reads them)::

    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {
         "targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                     "symmetric": true, "dynamic": false},
         "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                               "symmetric": true, "dynamic": true}}},
     "ignore": ["lm_head"], "kv_cache_scheme": null}

Weights are float8_e4m3fn ``weight`` with a ``weight_scale`` ([N, 1] per channel, [1] per
tensor, [N/128, K/128] per 128x128 block); a static activation scheme adds a per-tensor
``input_scale``. Served: 8-bit float, symmetric, static weights per tensor, channel or
128x128 block; activations dynamic per token / tensor / 128-group, static per tensor, or none
(weight-only). Everything else (int8, int4 / w4a16 packing, group-wise weights, NVFP4, sparsity,
an FP8 KV cache, transforms) is refused with the scheme named.
"""

from __future__ import annotations

import json
from typing import Any

from workers.quantization.fp8_config import Fp8Config, SchemeGroup
from workers.quantization.fp8_numerics import BLOCK
from workers.quantization.fp8_scheme import ActivationScheme, Fp8Scheme

# Formats whose weights are stored as plain float8_e4m3fn tensors.
_FP8_FORMATS = ("float-quantized", "naive-quantized")


def parse_compressed_tensors(raw: dict[str, Any]) -> Fp8Config:
    fmt = raw.get("format")
    for key, what in (("kv_cache_scheme", "an FP8 KV cache"),
                      ("sparsity_config", "sparse weights"),
                      ("transform_config", "weight transforms")):
        if raw.get(key):
            raise ValueError(f"compressed-tensors checkpoint with {key} ({what}) is not "
                             f"supported: {_short(raw[key])}")
    groups_raw = raw.get("config_groups") or {}
    if not groups_raw:
        raise ValueError("compressed-tensors checkpoint without config_groups: nothing says "
                         "how its weights are quantized")
    groups = []
    for name, group in groups_raw.items():
        group_format = group.get("format") or fmt
        where = f"compressed-tensors config group {name!r}"
        if group_format not in _FP8_FORMATS:
            raise ValueError(f"{where}: format {group_format!r} is not supported (FP8 "
                             f"checkpoints are {' or '.join(_FP8_FORMATS)})")
        if group.get("output_activations"):
            raise ValueError(f"{where}: quantized output activations are not supported")
        targets = tuple(str(t) for t in group.get("targets") or ())
        if not targets:
            raise ValueError(f"{where} has no targets")
        groups.append(SchemeGroup(_scheme(where, group.get("weights"),
                                          group.get("input_activations")), targets))
    return Fp8Config(name="compressed-tensors", groups=tuple(groups),
                     ignore=tuple(str(i) for i in raw.get("ignore") or ()), source=raw)


def _scheme(where: str, weights: dict[str, Any] | None,
            inputs: dict[str, Any] | None) -> Fp8Scheme:
    if not weights:
        raise ValueError(f"{where}: no weights scheme (only weight-quantized checkpoints are "
                         f"served)")
    strategy = weights.get("strategy", "tensor")
    block = _block_structure(weights.get("block_structure"))
    supported = (weights.get("type") == "float" and weights.get("num_bits") == 8
                 and weights.get("symmetric", True) and not weights.get("dynamic", False)
                 and strategy in ("tensor", "channel", "block")
                 and (strategy != "block" or block == (BLOCK, BLOCK)))
    if not supported:
        raise ValueError(f"{where}: weights {_describe(weights)} are not supported; served: "
                         f"8-bit float (FP8 e4m3), symmetric, static, per tensor, per channel "
                         f"or per {BLOCK}x{BLOCK} block")
    activations = _activations(where, inputs, strategy)
    return Fp8Scheme(weight_strategy=strategy, activations=activations)


def _activations(where: str, inputs: dict[str, Any] | None,
                 weight_strategy: str) -> ActivationScheme:
    if not inputs:
        return "none"
    strategy = inputs.get("strategy", "tensor")
    is_fp8 = inputs.get("type") == "float" and inputs.get("num_bits") == 8
    if is_fp8 and inputs.get("dynamic") is True and (
            strategy in ("token", "tensor") if weight_strategy != "block"
            else strategy == "group" and inputs.get("group_size") == BLOCK):
        return "dynamic"
    if (is_fp8 and inputs.get("dynamic") is False and strategy == "tensor"
            and inputs.get("symmetric", True) and weight_strategy != "block"):
        return "static"
    raise ValueError(f"{where}: input activations {_describe(inputs)} are not supported with "
                     f"{weight_strategy} weights; served: FP8 dynamic per token (per "
                     f"{BLOCK}-group with block weights) or static symmetric per tensor")


def _block_structure(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str):  # older compressed-tensors wrote "128x128"
        value = value.lower().split("x")
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        return None
    return rows, cols


def _describe(args: dict[str, Any]) -> str:
    keys = ("num_bits", "type", "strategy", "group_size", "block_structure", "symmetric",
            "dynamic")
    return "(" + ", ".join(f"{k}={args[k]!r}" for k in keys if k in args) + ")"


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
