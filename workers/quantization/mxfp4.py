"""MXFP4 experts (gpt-oss's releases): dequantized at load to the model dtype.

The checkpoint holds each expert projection as ``<name>_blocks`` [E, rows, G, 16] uint8, two
FP4 (e2m1) values a byte (low nibble first), and ``<name>_scales`` [E, rows, G] uint8, one
power-of-two exponent (E8M0, bias 127) per group of 32 values along the input dimension. Each
value is ``e2m1 * 2 ** (scale - 127)``; the rows are the projection's outputs (gate and up
interleaved for ``gate_up_proj``). ``dequantize_mxfp4`` computes it exactly as transformers'
``convert_moe_packed_tensors`` does, so the served weights are HF's dequantized ones bit for
bit; the experts then run in the model dtype (workers/layers/moe/gpt_oss_experts.py). What that
costs: the experts take the model dtype's memory (bf16: 4x MXFP4's, about 38 GB for
gpt-oss-20b's 19B expert parameters against 10), and loading dequantizes every expert once.
Only gpt-oss's experts are quantized in these checkpoints; everything else loads as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Values per group that share one scale, and bytes a group's values take.
GROUP_SIZE = 32
GROUP_BYTES = GROUP_SIZE // 2
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     name: str = "mxfp4 weight") -> torch.Tensor:
    """[..., rows, G * 32] in ``dtype`` from ``blocks`` [..., rows, G, 16] and ``scales``
    [..., rows, G] (both uint8). A ValueError names ``name`` where they do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != GROUP_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: blocks of shape {tuple(blocks.shape)} and scales of shape "
                         f"{tuple(scales.shape)} do not pair up (blocks [..., groups, "
                         f"{GROUP_BYTES}], scales [..., groups])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    *prefix, groups, _ = blocks.shape
    out = torch.empty((*prefix, groups, GROUP_SIZE), dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    exponents = (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1)
    torch.ldexp(out, exponents, out=out)
    return out.reshape(*prefix, groups * GROUP_SIZE)


@dataclass
class Mxfp4ExpertsMethod:
    """How an MXFP4 experts layer loads: its packed tensors into uint8 parameters of their own,
    then (``process_weights_after_loading``) dequantized into the layer's weights, which the
    checkpoint does not hold, and dropped."""

    # Our projection -> the checkpoint's tensor names' stem (renamed into ours on load).
    projections: dict[str, str] = field(default_factory=lambda: {"w13": "gate_up_proj",
                                                                  "w2": "down_proj"})

    def create_weights(self, layer: torch.nn.Module, rows: dict[str, int],
                       columns: dict[str, int], device: torch.device | str) -> None:
        """uint8 ``<p>_blocks`` / ``<p>_scales`` for each projection (the whole tensors: every
        rank dequantizes them and keeps its slice), and the layer's ``<p>_weight`` marked as
        filled after loading."""
        experts = layer.num_experts
        for proj in self.projections:
            if columns[proj] % GROUP_SIZE:
                raise ValueError(f"MXFP4 {proj}: {columns[proj]} input features are not whole "
                                 f"groups of {GROUP_SIZE}")
            groups = columns[proj] // GROUP_SIZE
            for suffix, shape in (("blocks", (experts, rows[proj], groups, GROUP_BYTES)),
                                  ("scales", (experts, rows[proj], groups))):
                param = torch.nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device),
                                           requires_grad=False)
                setattr(layer, f"{proj}_{suffix}", param)
            getattr(layer, f"{proj}_weight").expected_shards = set()

    def process_weights_after_loading(self, layer: Any) -> None:
        dtype = layer.w13_weight.dtype
        for proj, stem in self.projections.items():
            blocks, scales = getattr(layer, f"{proj}_blocks"), getattr(layer, f"{proj}_scales")
            # [E, outputs, inputs] -> the checkpoint's float layout [E, inputs, outputs].
            weight = dequantize_mxfp4(blocks.data, scales.data, dtype, stem).transpose(1, 2)
            layer.load_float(proj, weight)
            delattr(layer, f"{proj}_blocks")
            delattr(layer, f"{proj}_scales")


@dataclass(frozen=True)
class Mxfp4Config:
    """``"quant_method": "mxfp4"``: gpt-oss's experts in MXFP4, every other weight in the
    checkpoint's float dtype (its ``modules_to_not_convert``)."""

    source: dict[str, Any]
    name: str = "mxfp4"

    def linear_method(self, prefix: str) -> None:
        return None

    def experts_method(self, prefix: str) -> Mxfp4ExpertsMethod:
        return Mxfp4ExpertsMethod()


def parse_mxfp4(raw: dict[str, Any]) -> Mxfp4Config:
    return Mxfp4Config(source=dict(raw))
