"""Triton kernel: SwiGLU's ``silu(gate) * up`` over the gate_up projection's output, in one pass
(and Gemma's GeGLU, ``gelu_tanh(gate) * up``, the same way: ``gelu_tanh_and_mul``).

Same contract as the PyTorch arithmetic in `workers.models.llama.DecoderMLP` (and HF's LlamaMLP,
``act_fn(gate_proj(x)) * up_proj(x)``): x is [T, 2 * I], gate its first I columns and up the last
I; the result is ``(F.silu(gate) * up)`` [T, I] in the model dtype. torch rounds twice there:
``F.silu`` computes ``g / (1 + exp(-g))`` in float32 and rounds it to the model dtype, then the
product with ``up`` is rounded again. The kernel rounds at the same two places, so bf16/fp16
results land on torch's values unless the float32 ``exp`` differs by an ulp right at a rounding
boundary. The eager version launches two kernels and writes and reads a [T, I] intermediate; this
one reads x once and writes the result once.

On CUDA the exponential is libdevice's ``expf``, the function torch's CUDA silu calls, rather than
Triton's default (``ex2.approx``, a few ulps off); Triton's interpreter has no libdevice and uses
numpy's ``exp``. The division is correctly rounded (``div_rn``), as torch's ``/`` is.

x may be a row-strided view (any row stride, unit column stride): rows are addressed through
their stride, so no copy is made. I need not be a power of two: the lane mask covers the tail.

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.triton_norm import DTYPE_KIND, from_float32, round_float32_to, to_float32
from kernels.variants import launch

try:  # Compiled kernels only; the interpreter has no extern functions.
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every Triton 3.x has it
    libdevice = None

# Elements per program: a row's columns are cut into tiles of at most this many, and narrow rows
# (tiny test models) share a program. Fixed by the width alone, never by the row count: a
# batch-sized constexpr would compile a variant per batch size mid-serving.
_TILE = 1024


# The row count changes with the batch (see triton_norm's kernel).
@triton.jit
def _tanh(y, PRECISE: tl.constexpr):
    """tanh in float32: libdevice's on CUDA (the function torch's CUDA GELU calls), else from
    exp (the interpreter has no libdevice), within an ulp or two."""
    if PRECISE:
        t = libdevice.tanh(y)
    else:
        t = 1.0 - tl.math.div_rn(2.0, tl.exp(2.0 * y) + 1.0)
    return t


@triton.jit
def _gelu_tanh(g, PRECISE: tl.constexpr):
    """torch's GELU with the tanh approximation, in float32, as its kernels write it:
    ``0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g^3)))``."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    return 0.5 * g * (1.0 + _tanh(inner, PRECISE))


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(x_ptr, out_ptr, num_rows, stride_x, width,
                         KIND: tl.constexpr, PRECISE_EXP: tl.constexpr,
                         ACTIVATION: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
    # int64 so row offsets of long prefills cannot overflow.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]
    src = x_ptr + (rows * stride_x)[:, None] + cols[None, :]
    gate = to_float32(tl.load(src, mask=mask, other=0.0), KIND)
    up = to_float32(tl.load(src + width, mask=mask, other=0.0), KIND)
    if ACTIVATION == 0:
        if PRECISE_EXP:
            e = libdevice.exp(-gate)
        else:
            e = tl.exp(-gate)
        # F.silu: g / (1 + exp(-g)) in float32, rounded to the model dtype (its own op).
        act = round_float32_to(tl.math.div_rn(gate, 1.0 + e), KIND)
    else:
        # F.gelu(approximate="tanh") in float32, rounded to the model dtype (Gemma's GeGLU).
        act = round_float32_to(_gelu_tanh(gate, PRECISE_EXP), KIND)
    # A product of two 16-bit floats is exact in float32: one rounding is torch's mul.
    tl.store(out_ptr + (rows * width)[:, None] + cols[None, :], from_float32(act * up, KIND),
             mask=mask)


# Decided when the kernel was decorated (on import), as Triton decides it.
_INTERPRETED = isinstance(_silu_and_mul_kernel, InterpretedFunction)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for x = [gate | up] of shape [T, 2 * I]; returns a new contiguous
    [T, I] tensor in x's dtype and leaves x untouched."""
    return _act_and_mul(x, 0)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(gate, approximate="tanh") * up`` (Gemma's GeGLU), as ``silu_and_mul``."""
    return _act_and_mul(x, 1)


def _act_and_mul(x: torch.Tensor, activation: int) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, 2 * intermediate], got shape {tuple(x.shape)}")
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns; gate and up need two equal halves")
    if x.dtype not in DTYPE_KIND:
        raise ValueError(f"unsupported dtype {x.dtype}; supported: "
                         f"{', '.join(map(str, DTYPE_KIND))}")
    num_rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # The lanes are addressed with unit stride; the row stride is honoured as given.
    x = x if x.stride(1) == 1 else x.contiguous()
    block = min(triton.next_power_of_2(width), _TILE)
    block_rows = max(1, _TILE // block)
    launch(_silu_and_mul_kernel, (triton.cdiv(num_rows, block_rows), triton.cdiv(width, block)),
           x, out, num_rows, x.stride(0), width, KIND=DTYPE_KIND[x.dtype],
           PRECISE_EXP=libdevice is not None and not _INTERPRETED, ACTIVATION=activation,
           BLOCK_ROWS=block_rows, BLOCK=block, num_warps=4,
           # No fused multiply-adds: torch rounds every product and sum on its own.
           enable_fp_fusion=False)
    return out
