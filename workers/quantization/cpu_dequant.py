"""The CPU's FP8 linear layers: the weight stays float8_e4m3fn in memory (a quarter of float32,
half of bf16) and every call dequantizes it for the compute dtype, then multiplies.

What dequantizing costs. PyTorch's eager float8 -> float32 cast is scalar code, about 4.5 ns an
element on this project's 2-core AVX-512 machine (no AVX512-BF16/AMX): ``fp8.float() * scale``
of a 4096x4096 weight takes ~78 ms, of a 14336x4096 one ~270 ms, against ~2.3 and ~8 ms for a
one-row bf16 (or float32) ``F.linear`` over the same weight: eager dequantization costs ~35x a
decode step's GEMV. Two kernels compiled by TorchInductor's C++ backend
(vectorized) cut that:

- up to ``FUSED_MAX_ROWS`` rows (decode): dequantize and multiply in one loop, reading the FP8
  weight once and never writing the dequantized one. The float8 -> float32 widening is written
  on the bits (``_fp8_to_float32``): Inductor's own float8 cast made this kernel about twice as
  slow. Over one Llama-3.2-1B layer's four weights at one row: 9.0 ms computing in float32 and
  11.7 ms in bf16 (rounding each weight to bf16, as the eager path holds it, costs the
  difference), against 8.0 ms for float32 ``F.linear`` and 8.4 ms for bf16. Each row converts
  the weight again, so the cost grows with the rows, hence the cap of 2.
- more rows (prefill): dequantize into a scratch buffer shared by every layer (its size: the
  largest layer's weight in the compute dtype), then ``F.linear``: about twice the one-row
  float32 GEMV for the 16384x2048 gate/up weight, paid once per step.

These are one-off measurements (medians, kernels alternating; the machine is shared, so
absolute times drift). ``bench/diagnostics/cpu_fp8.py`` times whole decode steps side by side.
Each kernel element is the same float32 product ``fp8.float() * scale`` rounded once to the
compute dtype, bit for bit what the eager path (and a checkpoint dequantized in float32) holds;
the fused kernel sums the products in its own order, a float rounding difference like oneDNN's
against MKL's (``workers.layers.cpu_prepack``). Small layers (under ``MIN_COMPILED_ELEMENTS``:
tiny test models), machines without a C++ compiler, and ``SLOSERVE_FP8_CPU_COMPILE=0`` take the
eager path. Compiling costs ~16 s in a process at load (``warm_up``; ~5 s with Inductor's disk
cache warm), the same kernels serving every weight shape.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from workers.quantization.fp8_numerics import BLOCK, dequantize_block, dequantize_rows

logger = logging.getLogger(__name__)

COMPILE_ENV = "SLOSERVE_FP8_CPU_COMPILE"
# Layers smaller than this take the eager path: compiling them (once, ~16 s) costs more than it
# saves. Every weight of a 135M model (576 x 576 and up; the default model) is above it: with
# them all eager, its `--quantization fp8` decode step took 240 ms against 45 ms compiled.
MIN_COMPILED_ELEMENTS = 300_000
# The most rows the fused dequantize-and-multiply kernel takes (measured: at 2 rows it is still
# below the scratch path's cost, at 4 above).
FUSED_MAX_ROWS = 2


def dequantized_weight(weight: torch.Tensor, scale: torch.Tensor, block: bool,
                       dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (fp8 [N, K]) dequantized to ``dtype``: bit for bit ``fp8.float() * scale``
    rounded once to ``dtype``."""
    if block:
        return dequantize_block(weight, scale, dtype)
    return dequantize_rows(weight, scale, dtype)


def fp8_linear_cpu(weight: torch.Tensor, scale: torch.Tensor, block: bool, x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantized weight, bias)`` on the CPU, by the cheapest path."""
    kernels = _compiled() if _compiles(weight, block) else None
    if kernels is None:
        return F.linear(x, dequantized_weight(weight, scale, block, x.dtype), bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= FUSED_MAX_ROWS and x.dtype in (torch.float32, torch.bfloat16):
        fused = kernels["fused_block" if block else "fused_rows"]
        out = fused(flat.to(torch.float32), weight, scale, x.dtype == torch.bfloat16)
        out = out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    dense = _scratch(weight.shape, x.dtype)
    kernels["into_block" if block else "into_rows"](dense, weight, scale)
    return F.linear(x, dense, bias)


def warm_up(weight: torch.Tensor, scale: torch.Tensor, block: bool, dtype: torch.dtype) -> None:
    """Compile the kernels a layer of this shape will call, at load rather than in the first
    step (a compile would stall it by seconds, and the startup calibration would time it)."""
    if not _compiles(weight, block) or _compiled() is None:
        return
    with torch.inference_mode():
        for rows in (1, FUSED_MAX_ROWS + 1):
            x = torch.zeros(rows, weight.shape[1], dtype=dtype)
            try:
                fp8_linear_cpu(weight, scale, block, x, None)
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back to eager
                logger.warning("FP8 CPU kernels could not be compiled (%s: %s); FP8 layers "
                               "dequantize eagerly (~35x slower per decode GEMV)",
                               type(e).__name__, e)
                _KERNELS.clear()
                _KERNELS[None] = None
                return


def _compiles(weight: torch.Tensor, block: bool) -> bool:
    if weight.device.type != "cpu" or weight.numel() < MIN_COMPILED_ELEMENTS:
        return False
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return False
    # The blocked view of the block kernels needs whole blocks.
    return not block or (weight.shape[0] % BLOCK == 0 and weight.shape[1] % BLOCK == 0)


# The compiled kernels once built; {None: None} once compiling failed.
_KERNELS: dict[Any, Any] = {}
# Dequantized weights of the prefill path, one per size and dtype, shared by every layer.
_SCRATCH: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _scratch(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    key = (shape[0] * shape[1], dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(key[0], dtype=dtype)
    return _SCRATCH[key].view(shape)


def _compiled() -> dict[str, Callable[..., Any]] | None:
    if None in _KERNELS:
        return None
    if not _KERNELS:
        import torch._inductor.config as inductor_config

        # Compile in this process: no pool of compiler subprocesses left behind in a worker.
        inductor_config.compile_threads = 1
        for name, fn in (("fused_rows", _fused_rows), ("fused_block", _fused_block),
                         ("into_rows", _into_rows), ("into_block", _into_block)):
            # dynamic: one kernel for every weight shape and row count (a shape-specialized
            # kernel per layer shape would meet dynamo's recompile limit on larger models).
            _KERNELS[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _KERNELS


def _fp8_to_float32(weight: torch.Tensor) -> torch.Tensor:
    """``weight.to(torch.float32)`` from the bits, which Inductor vectorizes (its own float8
    cast made the fused kernel ~2x slower). e4m3fn is S.EEEE.MMM with bias 7: a normal code is
    the float32 with the exponent rebiased by 127 - 7 = 120 and the mantissa moved up 20 bits; a
    subnormal one (exponent 0) is MMM * 2**-9, built in arithmetic rather than as a float32
    denormal times 2**120 (denormal operands take microcode assists: ~10x slower). The NaN codes
    S.1111.111 come out as +-480; loading refuses weights that hold them."""
    code = weight.view(torch.uint8).to(torch.int32)
    magnitude = code & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).view(torch.float32)
    subnormal = (magnitude & 0x7).to(torch.float32) * 2.0**-9
    value = torch.where(magnitude < 0x8, subnormal, normal)
    return torch.where(code >= 0x80, -value, value)


def _round_to_bfloat16(value: torch.Tensor) -> torch.Tensor:
    """``value.to(torch.bfloat16).to(torch.float32)`` (round to nearest even) on the bits, for
    finite values: vectorized where the two casts are not."""
    bits = value.view(torch.int32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return rounded.view(torch.float32)


def _rows_dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8_to_float32(weight) * scale[:, None]


def _blocks_dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    blocked = _fp8_to_float32(weight).view(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return (blocked * scale[:, None, :, None]).view(rows, cols)


def _fused(x: torch.Tensor, dense: torch.Tensor, bfloat16: bool) -> torch.Tensor:
    # x is float32 (bf16 activations widened by the caller: exact). The weight is rounded to the
    # compute dtype, as the eager path holds it; the sums are float32.
    weight = _round_to_bfloat16(dense) if bfloat16 else dense
    return (x[:, None, :] * weight[None]).sum(-1)


def _fused_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bfloat16: bool
                ) -> torch.Tensor:
    return _fused(x, _rows_dequantized(weight, scale), bfloat16)


def _fused_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bfloat16: bool
                 ) -> torch.Tensor:
    return _fused(x, _blocks_dequantized(weight, scale), bfloat16)


def _into_rows(out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    out.copy_(_rows_dequantized(weight, scale))


def _into_block(out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    out.copy_(_blocks_dequantized(weight, scale))
