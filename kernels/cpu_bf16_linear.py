"""A float32 linear layer whose weight is held in bfloat16, for the few-row steps of CPU decode.

A decode step multiplies a handful of rows by every weight of the model once: it is bound by
how fast the weights stream from memory, not by arithmetic. Most checkpoints are published in
bfloat16, and on a CPU without bf16 arithmetic (AVX-512 without AVX512-BF16, AVX2) the engine
computes in float32, so every weight is widened at load and then read at 4 bytes a value, twice
the bytes the checkpoint holds. Widening a bfloat16 value to float32 is exact (the bf16 bits
are the float's upper half), so a weight that is bfloat16 at heart can be held in bfloat16 and
widened in registers as it is multiplied: the same products, half the bytes read.

The loop here is that multiplication. The weight is packed once, at load, into blocks of
``ROWS_PER_BLOCK`` output rows interleaved by vector chunk (``[N / 4][K / lanes][4][lanes]``), so
each thread reads one sequential stream, prefetched ``PREFETCH_AHEAD`` values ahead; each chunk
is widened once and multiplied into up to four input rows held in registers (more rows: the
block is read again, from L1). Over the default model's 30 layers of projections in layer order
(2-core AVX-512 Xeon, ms, plain MKL / oneDNN packed / this loop): 1 row 15.7 / 19.1 / 9.4,
4 rows 26.3 / 21.5 / 10.6, 8 rows 32.8 / 24.5 / 14.4, 16 rows 35.6 / 29.5 / 24.2, 32 rows
44.3 / 39.7 / 43.6. From a few dozen rows a step is bound by arithmetic, where MKL and oneDNN
do better; ``workers.layers.cpu_bf16_weights`` decides, by measuring, up to how many rows this
loop serves.

Numerics: float32 products of the exact weights, summed with fused multiply-adds in another
order than MKL's (an ulp or so, as between MKL and oneDNN).

Compiled once per process, as ``kernels.cpu_fused`` is (Inductor's C++ toolchain and its
``at::vec`` header, called through its thin Python binding): ~2 s the first time on a machine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kernels.cpu_source import CppFunction, compile_unit

logger = logging.getLogger(__name__)

# Output rows packed together: each thread widens one chunk of each and multiplies it into
# every input row it holds. 4 rows x 4 input rows is 16 accumulators, half the 32 AVX-512
# registers, leaving room for the widened weights and the inputs.
ROWS_PER_BLOCK = 4
# How far ahead of the loop each thread prefetches its stream, in weight values. Measured at
# one row over the default model's weights: 256 21-24 GB/s, 1024 27-29, 2048 31-51, 4096 28-35
# (the hardware prefetcher alone: 19-39).
PREFETCH_AHEAD = 2048
# Weight values (rows x columns) from which the blocks are split across the OpenMP threads.
PARALLEL_VALUES = 32768

# The loop (after kernels.cpu_source.PRELUDE).
DEFINITION = r"""
using BVec = at::vec::Vectorized<at::BFloat16>;
static constexpr int64_t kChunk = BVec::size();  // bf16 values per chunk: two float vectors
static constexpr int kRows = %(rows)d;
static constexpr int64_t kAhead = %(ahead)d;
static constexpr int64_t kParallelValues = %(parallel)d;

// One packed block (kRows output rows, [chunks][kRows][kChunk]) against M <= 4 input rows of
// x (rows sx apart, K values, the packed chunks zero past K). Writes out[m * so + r].
template <int M>
static void bf16_block(const float* x, const at::BFloat16* p, float* out, const float* bias,
                       const int64_t K, const int64_t chunks, const int64_t sx, const int64_t so,
                       const int64_t rows, const bool prefetch)
{
    Vec acc[M][kRows];
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < kRows; ++r) acc[m][r] = Vec(0.0f);
    for (int64_t c = 0; c < chunks; ++c, p += kRows * kChunk) {
        if (prefetch)
            for (int r = 0; r < kRows; ++r) __builtin_prefetch(p + kAhead + r * kChunk, 0, 3);
        Vec lo[kRows], hi[kRows];
        for (int r = 0; r < kRows; ++r) {
            auto wide = at::vec::convert_to_float<at::BFloat16>(BVec::loadu(p + r * kChunk));
            lo[r] = std::get<0>(wide);
            hi[r] = std::get<1>(wide);
        }
        const int64_t k = c * kChunk;
        const int64_t left = K - k;  // x past K may hold anything: masked loads read zeros
        for (int m = 0; m < M; ++m) {
            const float* xm = x + m * sx + k;
            const Vec x0 = left >= kLanes ? Vec::loadu(xm) : Vec::loadu(xm, left);
            const Vec x1 = left >= kChunk ? Vec::loadu(xm + kLanes)
                         : left > kLanes ? Vec::loadu(xm + kLanes, left - kLanes) : Vec(0.0f);
            for (int r = 0; r < kRows; ++r)
                acc[m][r] = at::vec::fmadd(x1, hi[r], at::vec::fmadd(x0, lo[r], acc[m][r]));
        }
    }
    for (int m = 0; m < M; ++m)
        for (int r = 0; r < rows; ++r)
            out[m * so + r] = hsum(acc[m][r]) + (bias ? bias[r] : 0.0f);
}

static void bf16_linear_rows(const float* x, const at::BFloat16* w, const float* bias, float* out,
                             const int64_t M, const int64_t N, const int64_t K, const int64_t sx,
                             const int64_t so, const int64_t has_bias)
{
    const int64_t chunks = (K + kChunk - 1) / kChunk;
    const int64_t blocks = (N + kRows - 1) / kRows;
    #pragma omp parallel for schedule(static) if(blocks * kRows * K >= kParallelValues)
    for (int64_t b = 0; b < blocks; ++b) {
        const at::BFloat16* p = w + b * kRows * chunks * kChunk;
        const float* bb = has_bias ? bias + b * kRows : nullptr;
        const int64_t rows = std::min<int64_t>(kRows, N - b * kRows);
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const float* xm = x + m0 * sx;
            float* om = out + m0 * so + b * kRows;
            const bool prefetch = m0 == 0;  // later groups read the block again from L1
            switch (std::min<int64_t>(4, M - m0)) {
                case 1: bf16_block<1>(xm, p, om, bb, K, chunks, sx, so, rows, prefetch); break;
                case 2: bf16_block<2>(xm, p, om, bb, K, chunks, sx, so, rows, prefetch); break;
                case 3: bf16_block<3>(xm, p, om, bb, K, chunks, sx, so, rows, prefetch); break;
                default: bf16_block<4>(xm, p, om, bb, K, chunks, sx, so, rows, prefetch); break;
            }
        }
    }
}

""" % dict(rows=ROWS_PER_BLOCK, ahead=PREFETCH_AHEAD, parallel=PARALLEL_VALUES)

FUNCTION = CppFunction.parse("bf16_linear_rows", DEFINITION)

# The compiled loop and its chunk width once built; {None: None} once building it failed.
_KERNEL: dict[Any, Any] = {}


@dataclass(frozen=True)
class Bf16Weight:
    """A [out_features, in_features] weight held in bfloat16, packed for :func:`linear`."""

    packed: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


def warm_up() -> bool:
    """Compile the loop (once per process) and check a call against ``F.linear``; False, with a
    warning, where that fails (no C++ compiler, Inductor's binding API changed)."""
    if _KERNEL:
        return None not in _KERNEL
    started = time.perf_counter()
    try:
        _KERNEL["linear"] = compile_unit(FUNCTION)
        _KERNEL["chunk"] = _chunk_values()
        _check()
    except Exception as e:  # noqa: BLE001 - any compiler or binding failure: float32 weights
        logger.warning("CPU bfloat16-weight linear kernel unavailable (%s: %s); weights stay "
                       "float32", type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        _KERNEL.clear()
        _KERNEL[None] = None
        return False
    logger.info("CPU bfloat16-weight linear kernel compiled and checked in %.1f s",
                time.perf_counter() - started)
    return True


def is_exactly_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 ``weight`` is a bfloat16 value (widening it back gives
    the same bits), so that holding it in bfloat16 loses nothing."""
    if weight.dtype != torch.float32:
        return False
    # The low 16 bits of every float are zero: one integer pass, no rounded copy.
    return not bool((weight.detach().contiguous().view(torch.int32) & 0xFFFF).any())


def pack(weight: torch.Tensor) -> Bf16Weight:
    """The bfloat16 copy of a float32 [N, K] ``weight`` in the loop's blocked layout (zero rows
    and columns pad it to whole blocks and chunks). Exact only if :func:`is_exactly_bf16`."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.is_mkldnn:
        raise ValueError(f"a plain float32 [N, K] weight is needed, got {tuple(weight.shape)} "
                         f"{weight.dtype}")
    rows, chunk = ROWS_PER_BLOCK, _chunk()
    n, k = weight.shape
    padded = torch.zeros(-(-n // rows) * rows, -(-k // chunk) * chunk, dtype=torch.bfloat16)
    padded[:n, :k] = weight.detach()
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // chunk, chunk)
    return Bf16Weight(blocks.transpose(1, 2).contiguous(), n, k)


def linear(x: torch.Tensor, weight: Bf16Weight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for float32 x [..., K] and the weight W that ``weight`` holds;
    a new contiguous float32 [..., N]."""
    n, k = weight.out_features, weight.in_features
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"x must be float32 [..., {k}], got {tuple(x.shape)} {x.dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,)
                             or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 [{n}], got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    # A decode step's [T, K] rows (a view with unit stride, as q/k/v slices are) go as they
    # are: at one row the Python around the loop is most of a small projection's cost.
    flat = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, k).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    _KERNEL["linear"](flat, weight.packed, out if bias is None else bias, out, rows, n, k,
                      flat.stride(0), n, int(bias is not None))
    return out if flat is x else out.view(*x.shape[:-1], n)


def _chunk() -> int:
    if "chunk" not in _KERNEL:
        raise RuntimeError("the bfloat16-weight kernel is not compiled (call warm_up first)")
    return _KERNEL["chunk"]


def _chunk_values() -> int:
    """The loop's chunk width (bf16 values per vector pair), from the compiled code itself."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    probe = CppPythonBindingsCodeCache.load_pybinding(
        ["int64_t*"], "#include <torch/csrc/inductor/cpp_prefix.h>\n"
        "extern \"C\" void kernel(int64_t* out) "
        "{ out[0] = at::vec::Vectorized<at::BFloat16>::size(); }")
    out = torch.zeros(1, dtype=torch.int64)
    probe(out)
    return int(out.item())


def _check() -> None:
    """One call with tails in every dimension (rows past a block, columns past a chunk, five
    input rows: a second group), with a bias and a strided x, against ``F.linear``."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 37, generator=g).bfloat16().float()
    bias = torch.randn(10, generator=g)
    x = torch.randn(5, 40, generator=g)[:, :37]
    expected = torch.nn.functional.linear(x, weight, bias)
    if not torch.allclose(linear(x, pack(weight), bias), expected, rtol=1e-5, atol=1e-5):
        raise RuntimeError("the compiled bfloat16-weight linear differs from F.linear")
