"""FP8 (float8_e4m3fn) arithmetic in plain PyTorch: dequantizing the checkpoint layouts,
quantizing weights and activations. One definition of each formula, shared by the CPU path, the
CUDA path and the tests' references.

Scales multiply: ``w = fp8 * scale``. The block layout calls its scale ``weight_scale_inv``, the
inverse of the quantizing scale, and multiplies by it all the same: DeepSeek-V3's
``inference/fp8_cast_bf16.py`` dequantizes with ``weight_dequant(weight, scale_inv)``, whose
kernel (``inference/kernel.py``) computes ``y = x * s`` per 128x128 block, and vLLM's block FP8
path (``Fp8LinearMethod``, ``w8a8_block_fp8_matmul``) multiplies the GEMM's partial sums by
``weight_scale_inv`` the same way.

Dequantization is exact to the bit against ``fp8.float() * scale`` in float32 (each element is
one float32 product, rounded once), then one rounding to the compute dtype: what HF transformers
computes on a checkpoint whose weights were dequantized in float32 and loaded in that dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
# The largest finite float8_e4m3fn value: a quantizing scale maps a tensor's amax onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# e4m3fn has no infinities; its only non-finite codes are the NaNs S.1111.111.
_NAN_CODE = 0x7F
# A row (or token) of zeros gets this amax, so its scale is tiny rather than 0 (0 / 0 is NaN).
_MIN_AMAX = 1e-12
BLOCK = 128  # the only block size of the block layout served here


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int,
                       block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """A [ceil(rows / bn), ceil(cols / bk)] block scale repeated to one value per element
    [rows, cols] (partial blocks at the edges cut off)."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                     block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """``weight`` [N, K] fp8 times its block scale, w[i, j] = fp8[i, j] * s[i // bn, j // bk],
    in float32, rounded once to ``dtype``."""
    rows, cols = weight.shape
    bn, bk = block
    wide = weight.to(torch.float32)
    if rows % bn == 0 and cols % bk == 0:
        # A broadcast over a blocked view: no [N, K] scale is materialized.
        out = (wide.view(rows // bn, bn, cols // bk, bk)
               * scale_inv.to(torch.float32)[:, None, :, None]).view(rows, cols)
    else:
        out = wide * expand_block_scale(scale_inv.to(torch.float32), rows, cols, block)
    return out if dtype == torch.float32 else out.to(dtype)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                    ) -> torch.Tensor:
    """``weight`` [N, K] fp8 times one scale per output row (``scale`` [N]), in float32, rounded
    once to ``dtype``."""
    out = weight.to(torch.float32) * scale.to(torch.float32)[:, None]
    return out if dtype == torch.float32 else out.to(dtype)


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """The per-output-channel quantizing scale of a full-precision [N, K] weight, float32 [N]:
    each row's largest magnitude maps onto FP8_MAX (vLLM's ``--quantization fp8`` scheme)."""
    amax = weight.abs().amax(dim=1).to(torch.float32).clamp(min=_MIN_AMAX)
    return amax / FP8_MAX


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] divided by its per-row ``scale`` [N] (from :func:`row_scales`),
    rounded to fp8 (to nearest even; saturated at FP8_MAX)."""
    scaled = weight.to(torch.float32) / scale.to(torch.float32)[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_token(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] in fp8 with one float32 scale per row [M, 1] (dynamic: each row's amax
    onto FP8_MAX), or the one ``static_scale`` of a checkpoint's ``input_scale``, broadcast."""
    wide = x.to(torch.float32)
    if static_scale is None:
        scale = wide.abs().amax(dim=1, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    else:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    return (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.contiguous()


def quantize_per_token_group(x: torch.Tensor, group: int = BLOCK
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] in fp8 with one float32 scale per row and ``group`` columns
    [M, ceil(K / group)] (the activation side of the block layout's W8A8 GEMM)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    wide = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - cols))
    wide = wide.view(rows, groups, group)
    scale = wide.abs().amax(dim=2, keepdim=True).clamp(min=_MIN_AMAX) / FP8_MAX
    quantized = (wide / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(rows, groups * group)[:, :cols].contiguous(), scale.view(rows, groups)


def has_nan_codes(weight: torch.Tensor) -> bool:
    """Whether an fp8 tensor holds a NaN (no weight of a working checkpoint does)."""
    return bool(((weight.view(torch.uint8) & _NAN_CODE) == _NAN_CODE).any())
