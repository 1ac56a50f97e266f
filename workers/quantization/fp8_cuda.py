"""FP8 GEMMs on CUDA (compute capability 8.9 or newer; ``fp8.check_fp8_device`` refuses older
GPUs at startup).

- 128x128 block weights: activations quantized per token and 128-column group, then the Triton
  block-scaled kernel (``kernels.triton_fp8``), as vLLM's ``w8a8_block_fp8_matmul``.
- per-channel weights (per-tensor ones were made per-row at load): activations quantized per
  token (dynamic) or by the checkpoint's ``input_scale`` (static), then ``torch._scaled_mm``:
  row-wise scales in the GEMM's epilogue on Hopper and newer with a bf16 output; elsewhere
  (Ada's ``_scaled_mm`` takes only per-tensor scales, and any float16 output) unit scales and a
  float32 output scaled afterwards, as vLLM's channel-wise fallback.
- weight-only schemes (no activation quantization in the checkpoint), and shapes
  ``_scaled_mm`` does not take (K or N not a multiple of 16): the weight dequantized to the
  compute dtype and ``F.linear``, the CPU's path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from workers.quantization.fp8_numerics import (FP8_DTYPE, dequantize_block, dequantize_rows,
                                               quantize_per_token, quantize_per_token_group)
from workers.quantization.fp8_scheme import Fp8Scheme

# torch._scaled_mm wants every dimension of both operands a multiple of 16; M is padded.
_ALIGN = 16


def fp8_linear(layer: Any, scheme: Fp8Scheme, weight_scale: torch.Tensor, x: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    weight = layer.weight
    rows, cols = weight.shape
    block = scheme.weight_strategy == "block"
    if scheme.activations == "none" or (not block and (rows % _ALIGN or cols % _ALIGN)):
        dense = (dequantize_block(weight, weight_scale, x.dtype) if block
                 else dequantize_rows(weight, weight_scale, x.dtype))
        return F.linear(x, dense, bias)
    flat = x.reshape(-1, cols)
    if block:
        from kernels.triton_fp8 import w8a8_block_matmul

        quantized, scale = quantize_per_token_group(flat)
        out = w8a8_block_matmul(quantized, scale, weight, weight_scale, x.dtype)
    else:
        static = layer.input_scale if scheme.activations == "static" else None
        quantized, scale = quantize_per_token(flat, static)
        out = scaled_mm_rowwise(quantized, scale, weight, weight_scale, x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], rows)


def scaled_mm_rowwise(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                      b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale[:, None])^T`` for fp8 ``a`` [M, K] with ``a_scale``
    [M, 1] and fp8 ``b`` [N, K] with ``b_scale`` [N], in ``out_dtype``."""
    num_rows = a.shape[0]
    pad = -num_rows % _ALIGN
    if pad:
        a = torch.cat([a, torch.zeros((pad, a.shape[1]), dtype=FP8_DTYPE, device=a.device)])
        a_scale = torch.cat([a_scale, a_scale.new_ones((pad, 1))])
    # b^T of a row-major [N, K] weight is the column-major [K, N] operand _scaled_mm wants.
    b_scale_row = b_scale.reshape(1, -1).to(torch.float32).contiguous()
    if out_dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0):
        out = torch._scaled_mm(a, b.t(), scale_a=a_scale.contiguous(), scale_b=b_scale_row,
                               out_dtype=out_dtype)
    else:
        one = torch.ones((), dtype=torch.float32, device=a.device)
        out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = (out * a_scale * b_scale_row).to(out_dtype)
    return out[:num_rows]
