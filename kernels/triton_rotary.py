"""Triton kernel: rotary position embedding, rounded bit for bit like the PyTorch reference.

Same contract as `workers.layers.rotary.apply_rotary`: x [T, H, D], cos/sin [T, 1, D/2] in the
model dtype; returns a new tensor with ``out1 = x1*cos - x2*sin`` and ``out2 = x2*cos + x1*sin``
(x1, x2 the two halves of each head). The reference rounds each product to the model dtype before
the subtraction/addition (as HF does), so the kernel does the same: products in float32, each
rounded to the model dtype, then the sum in float32 rounded once more. Being elementwise, it
reproduces torch's float32, float16 and bfloat16 results exactly.

x may be a strided view, such as the q or k slice of a fused qkv output: tokens and heads are
addressed through their strides, so no copy is made (only a non-unit last stride forces one).
A program rotates a block of (token, head) rows; D/2 need not be a power of two (head sizes 64,
80, 96, 128), so the lane mask covers the tail.

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_norm import DTYPE_KIND, from_float32, round_float32_to, to_float32
from kernels.variants import launch


# The row count changes with the batch (see triton_norm's kernel).
@triton.jit(do_not_specialize=["num_rows"])
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr,
                   stride_x_t, stride_x_h, stride_cos_t, stride_sin_t, num_rows, num_heads, half,
                   KIND: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # A row is one (token, head) pair; int64 so offsets of long prefills cannot overflow.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = rows // num_heads
    head = rows % num_heads
    offs = tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (offs < half)[None, :]
    src = x_ptr + (token * stride_x_t + head * stride_x_h)[:, None] + offs[None, :]
    x1 = to_float32(tl.load(src, mask=mask, other=0.0), KIND)
    x2 = to_float32(tl.load(src + half, mask=mask, other=0.0), KIND)
    cos = to_float32(tl.load(cos_ptr + (token * stride_cos_t)[:, None] + offs[None, :],
                             mask=mask, other=0.0), KIND)
    sin = to_float32(tl.load(sin_ptr + (token * stride_sin_t)[:, None] + offs[None, :],
                             mask=mask, other=0.0), KIND)
    # Each product of two 16-bit floats is exact in float32; rounding it to the model dtype is
    # torch's `x1 * cos` (a separate op whose result is stored in the model dtype).
    out1 = round_float32_to(x1 * cos, KIND) - round_float32_to(x2 * sin, KIND)
    out2 = round_float32_to(x2 * cos, KIND) + round_float32_to(x1 * sin, KIND)
    dst = out_ptr + (rows * (2 * half))[:, None] + offs[None, :]
    tl.store(dst, from_float32(out1, KIND), mask=mask)
    tl.store(dst + half, from_float32(out2, KIND), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by the per-token angles (cos/sin [T, 1, D/2]); returns a new
    contiguous tensor and leaves x untouched."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D], got shape {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"head dim {head_dim} is odd; rotary needs two equal halves")
    half = head_dim // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, 1, half):
            raise ValueError(f"{name} has shape {tuple(table.shape)}, expected "
                             f"({num_tokens}, 1, {half}) for x {tuple(x.shape)}")
        # A float32 table would change where the reference rounds (its products would not be
        # rounded to the model dtype), so the kernel only takes the model dtype.
        if table.dtype != x.dtype:
            raise ValueError(f"{name} dtype {table.dtype} differs from x's {x.dtype}")
        if table.device != x.device:
            raise ValueError(f"{name} is on {table.device}, x on {x.device}")
    if x.dtype not in DTYPE_KIND:
        raise ValueError(f"unsupported dtype {x.dtype}; supported: "
                         f"{', '.join(map(str, DTYPE_KIND))}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # The lanes are addressed with unit stride; other strides are honoured as given.
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block = triton.next_power_of_2(half)
    num_rows = num_tokens * num_heads
    # About 4k elements per program: many heads of a token (or several tokens) per program keep
    # the GPU's programs busy, and the interpreter's per-program overhead low. Fixed by the head
    # size alone, never by the row count, which would compile a variant per batch size class.
    block_rows = max(1, 4096 // block)
    launch(_rotary_kernel, (triton.cdiv(num_rows, block_rows),),
           x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
           num_rows, num_heads, half, KIND=DTYPE_KIND[x.dtype], BLOCK_ROWS=block_rows,
           BLOCK=block,
           # No fused multiply-adds: the reference rounds every product before the sum.
           enable_fp_fusion=False)
    return out
