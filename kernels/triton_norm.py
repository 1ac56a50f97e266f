"""Triton kernel: RMSNorm with an optional fused residual add, rounded like the PyTorch layer.

Same contract as `workers.layers.norm.RMSNorm.forward`: ``rms_norm(x, weight, eps)`` returns
``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``; with a residual it first forms
``s = x + residual`` (rounded to the model dtype, as torch's add does) and returns
``(rms_norm(s), s)``. Fusing the add, the reduction and the scale saves two round trips through
memory per sub-layer; matching the reference's rounding steps (normalize in float32, round to the
model dtype, then scale by the weight and round again) keeps bf16/fp16 outputs on HF's values.

Only the row reduction can differ from torch: its summation order is the compiler's (torch's own
order depends on the CPU's vector width, and differs again on CUDA), so the float32 variance can
be off by an ulp and a model-dtype output can land one ulp away. Every other step is elementwise
and rounds exactly as torch does.

A program normalizes one row, or several narrow ones: x is [T, hidden] or [T, H, hidden]
(Qwen3's per-head q/k norm), possibly a strided view such as a slice of a fused qkv output; rows
are addressed through the two leading strides, so no copy is made. The hidden size need not be a
power of two (576, 960, 80): the lane mask covers the tail. Outputs are new contiguous tensors;
the inputs are never written.

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.variants import launch

# The dtype of a tensor as the KIND constexpr of the conversion helpers below.
DTYPE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# bf16 converts by hand, through its bits: Triton's interpreter converts float32 to bfloat16 by
# truncation (even with fp_downcast_rounding="rtne"), where torch and the GPU round to nearest
# even, and mangles subnormals both ways. The bit manipulations are exact on either path and cost
# a few integer ops on the GPU.


@triton.jit
def to_float32(v, KIND: tl.constexpr):
    """Widen values of dtype KIND (see DTYPE_KIND) to float32, exactly."""
    if KIND == 2:
        v = (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def from_float32(v, KIND: tl.constexpr):
    """Round float32 values to dtype KIND, to nearest even like torch's casts."""
    if KIND == 2:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        # The carry would turn a NaN with a low-bit payload into inf; keep it a (quiet) NaN.
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        rounded = tl.where(is_nan, bits | 0x00400000, rounded)
        v = (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif KIND == 1:
        v = v.to(tl.float16)
    return v


@triton.jit
def round_float32_to(v, KIND: tl.constexpr):
    """Round float32 values to the precision of dtype KIND, kept as float32 for further math."""
    return to_float32(from_float32(v, KIND), KIND)


# The row count changes with the batch: specialized, 1 or a multiple of 16 would each compile
# their own variant mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     num_rows, inner, stride_x_outer, stride_x_inner, stride_r_outer,
                     stride_r_inner, hidden, hidden_f, eps,
                     HAS_RESIDUAL: tl.constexpr, KIND: tl.constexpr, W_KIND: tl.constexpr,
                     OUT_KIND: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # int64 so row offsets of long prefills cannot overflow.
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    outer = row // inner
    head = row % inner
    offs = tl.arange(0, BLOCK)
    mask = (row < num_rows)[:, None] & (offs < hidden)[None, :]
    x = to_float32(tl.load(x_ptr + (outer * stride_x_outer + head * stride_x_inner)[:, None]
                           + offs[None, :], mask=mask, other=0.0), KIND)
    if HAS_RESIDUAL:
        r = to_float32(tl.load(res_ptr + (outer * stride_r_outer + head * stride_r_inner)[:, None]
                               + offs[None, :], mask=mask, other=0.0), KIND)
        # torch rounds x + residual to the model dtype before normalizing it.
        x = round_float32_to(x + r, KIND)
        tl.store(res_out_ptr + (row * hidden)[:, None] + offs[None, :], from_float32(x, KIND),
                 mask=mask)
    # Masked lanes load 0, so they add nothing to the sum. hidden_f is hidden as a float (an int
    # argument equal to 1 would be specialized to a constexpr). div_rn and sqrt_rn: torch's CPU
    # mean is a correctly rounded sum / N and its rsqrt is 1 / sqrt with both steps correctly
    # rounded, while plain `/` and tl.math.rsqrt compile to approximations on CUDA (on the
    # H100, rsqrt put float32 outputs an ulp or two off on exact row sums).
    variance = tl.math.div_rn(tl.sum(x * x, axis=1), hidden_f)
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(variance + eps))
    w = to_float32(tl.load(w_ptr + offs, mask=offs < hidden, other=0.0), W_KIND)
    if SCALE_IN_FLOAT32:
        # Gemma's: the float32 product with the (float32) weight, rounded once to x's dtype.
        scaled = (x * inv_rms[:, None]) * w[None, :]
    else:
        # Llama's: rounded to the model dtype, then scaled; the product of two 16-bit floats is
        # exact in float32, so one rounding matches torch's mul.
        scaled = w[None, :] * round_float32_to(x * inv_rms[:, None], KIND)
    tl.store(out_ptr + (row * hidden)[:, None] + offs[None, :], from_float32(scaled, OUT_KIND),
             mask=mask)


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """t (2-D or 3-D) with a unit last stride, its inner row count and its two row strides."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, scale_in_float32: bool = False
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, hidden] or [T, H, hidden] over the last dim; with a residual, returns
    ``(rms_norm(x + residual), x + residual)``. All results are new contiguous tensors.

    ``scale_in_float32``: Gemma's order, ``(x32 * rsqrt(mean(x32^2) + eps) * weight).to(x.dtype)``
    (its weight, ``1 + w``, held in float32), in place of Llama's rounding before the scale."""
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [T, hidden] or [T, H, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},) for x "
                         f"{tuple(x.shape)}")
    if x.dtype not in DTYPE_KIND or weight.dtype not in DTYPE_KIND:
        raise ValueError(f"unsupported dtypes x {x.dtype} / weight {weight.dtype}; supported: "
                         f"{', '.join(map(str, DTYPE_KIND))}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} differs from x's {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    # As in torch, `weight * normalized` promotes when the weight's dtype differs from x's;
    # Gemma's casts the product to x's dtype.
    out_dtype = x.dtype if scale_in_float32 else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rows = x.numel() // hidden if hidden else 0
    if rows and hidden:
        x, inner, sxo, sxi = _rows_view(x)
        if residual is not None:
            residual, _, sro, sri = _rows_view(residual)
        else:
            # Unused when HAS_RESIDUAL is False; any tensor fills the pointer slots.
            residual, sro, sri = x, 0, 0
        block = triton.next_power_of_2(hidden)
        # Narrow rows (Qwen3's per-head norms, tiny test models) share a program, up to about
        # 4k elements; a model's hidden size gets one program per row. Fixed by the row width
        # alone, never by the row count: a batch-sized constexpr would compile mid-serving (a
        # small batch's program just masks its spare rows).
        block_rows = max(1, 4096 // block)
        launch(_rms_norm_kernel, (triton.cdiv(rows, block_rows),),
               x, residual, weight.contiguous(), out, res_out if res_out is not None else out,
               rows, inner, sxo, sxi, sro, sri, hidden, float(hidden), float(eps),
               HAS_RESIDUAL=res_out is not None, KIND=DTYPE_KIND[x.dtype],
               W_KIND=DTYPE_KIND[weight.dtype], OUT_KIND=DTYPE_KIND[out_dtype],
               SCALE_IN_FLOAT32=scale_in_float32, BLOCK_ROWS=block_rows, BLOCK=block,
               num_warps=min(max(block_rows * block // 256, 1), 8),
               # No fused multiply-adds: torch rounds every product and sum on its own.
               enable_fp_fusion=False)
    if res_out is None:
        return out
    return out, res_out
