"""Triton kernel: the block-scaled FP8 GEMM (W8A8) of the 128x128-block weight layout.

``C[M, N] = sum over k-groups g of (A_g @ B_g^T) * a_scale[m, g] * b_scale[n // 128, g]``: A is
the activations in float8_e4m3fn, quantized per token and per 128-column group (``a_scale``
[M, K/128]); B the weight [N, K] in float8_e4m3fn with one scale per 128x128 block (``b_scale``
[N/128, K/128], the checkpoint's ``weight_scale_inv``). Each program computes a BLOCK_M x
BLOCK_N tile; its K loop takes one 128-column group at a time, multiplies the two FP8 tiles on
the tensor cores (exact products, float32 sums), scales the group's partial result and adds it
to a float32 accumulator. Scaling per group, outside the tensor-core sum, is also what keeps the
sum accurate on Hopper, whose FP8 MMA accumulates with fewer bits than float32 (DeepSeek-V3's
report promotes partial sums to float32 every 128 columns for the same reason).

Runs compiled on CUDA (compute capability 8.9 or newer: FP8 tensor cores), and on the CPU under
Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_norm import DTYPE_KIND, from_float32
from kernels.variants import launch

GROUP = 128  # the K width of one scale group, of activations and weights alike


# M changes with the batch: one variant for every M, or serving would compile mid-step.
@triton.jit(do_not_specialize=["num_rows"])
def _w8a8_block_matmul_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr,
                              num_rows, num_cols, depth,
                              stride_a, stride_a_scale, stride_b, stride_b_scale, stride_c,
                              OUT_KIND: tl.constexpr, GROUP_N: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    # int64 row offsets: a long prefill's M x K can pass 2**31.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    a_rows = a_ptr + rows[:, None] * stride_a
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_b
    a_scales = a_scale_ptr + rows * stride_a_scale
    b_scales = b_scale_ptr + (cols // GROUP_N) * stride_b_scale
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(tl.cdiv(depth, BLOCK_K)):
        k = group * BLOCK_K + ks
        k_ok = k < depth
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(a_scales + group, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scales + group, mask=col_ok, other=0.0)
        acc += tl.dot(a, b, out_dtype=tl.float32) * a_scale[:, None] * b_scale[None, :]
    out = c_ptr + rows[:, None] * stride_c + cols[None, :]
    # Rounded to nearest even as torch casts (kernels.triton_norm: the interpreter would truncate
    # a plain .to(bfloat16)).
    tl.store(out, from_float32(acc, OUT_KIND), mask=row_ok[:, None] & col_ok[None, :])


def w8a8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                      b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a`` [M, K] and ``b`` [N, K] float8_e4m3fn, ``a_scale`` [M, ceil(K/128)] and ``b_scale``
    [ceil(N/128), ceil(K/128)] float32 -> ``a @ b^T`` dequantized, [M, N] in ``out_dtype``."""
    if out_dtype not in DTYPE_KIND:
        raise ValueError(f"out_dtype must be one of {', '.join(map(str, DTYPE_KIND))}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] must share K; got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    num_rows, depth = a.shape
    num_cols = b.shape[0]
    groups = triton.cdiv(depth, GROUP)
    if tuple(a_scale.shape) != (num_rows, groups) or \
            tuple(b_scale.shape) != (triton.cdiv(num_cols, GROUP), groups):
        raise ValueError(f"scales must be [M, K/{GROUP}] and [N/{GROUP}, K/{GROUP}]; got "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    a, b = a.contiguous(), b.contiguous()
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    out = torch.empty((num_rows, num_cols), dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    # Decode rows (a few tokens) fill a 16-row tile; prefill chunks a 64-row one. Two variants
    # per weight shape, both met by the startup warm-up.
    block_m = 16 if num_rows <= 16 else 64
    block_n = 128
    launch(_w8a8_block_matmul_kernel,
           (triton.cdiv(num_rows, block_m), triton.cdiv(num_cols, block_n)),
           a, a_scale, b, b_scale, out, num_rows, num_cols, depth,
           a.stride(0), a_scale.stride(0), b.stride(0), b_scale.stride(0), out.stride(0),
           OUT_KIND=DTYPE_KIND[out_dtype], GROUP_N=GROUP, BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=GROUP, num_warps=4, num_stages=3)
    return out
