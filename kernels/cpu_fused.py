"""The CPU's fused kernels: RMSNorm with its residual add, rotary over q and k, SiLU·mul, and the
decodes' paged attention, each one C++ loop in place of the eager ops it replaces.

Why hand-written loops and not ``torch.compile``. On the 2-core AVX-512 machine this project
runs on, one eager op on a decode row costs ~2.7 us, most of it dispatch; the layer's RMSNorm
with its residual add is ~6 of them (15.6 us a call), rotary ~7 (15.5 us), SiLU·mul 3 (5.2 us):
~52 us a layer, ~1.6 ms of the default model's 28 ms one-row decode forward. A function compiled
by ``torch.compile`` (Inductor's C++ backend, ``dynamic=True``) costs ~25 us a call before it
computes anything (dynamo's cache lookup and guards ~5 us, the size bookkeeping ahead of the
graph ~8 us, the compiled region's wrappers ~14 us): the compiled add+RMSNorm took 37 us a call
at 1 row and 49 us at 8, against 15.6 and 17.7 eager, and was no faster at 512 rows (180 vs
178 us). So the loops below are compiled by Inductor's C++ toolchain (its compiler flags, its
precompiled ``at::vec`` header, its on-disk cache) and called through its thin Python binding,
without dynamo: the kernel itself ~0.6 us at one row, the call with its checks and output
allocations ~4-6 us (add+RMSNorm 6.2 us against 17.3 eager, rotary 4.7 against 15.8, SiLU·mul
3.8 against 5.2; at 512 rows, split across the threads, 71 / 44 / 206 us against 165 / 193 /
380).

The decodes' attention (``paged_attention``) reads K and V through the block tables in place:
the PyTorch path gathers every decode's blocks into a copy first, pads each group to its longest
context, and spends ~20 eager ops a layer (at one decode over 512 tokens, 4.4 ms of a 28 ms
forward). The loop gives each (decode, KV head) pair its query head group: scores, a float32
softmax, the weighted sum of values, with head_dim unrolled into vector registers; pairs are
split across the threads once there is enough to read (``PARALLEL_SLOTS``). Over the default
model's 30 layers at 512 tokens of context (medians of 9, the two alternating): 1 decode 4.38
-> 1.38 ms, 2 decodes 6.12 -> 2.43, 4 11.73 -> 5.77, 8 23.27 -> 12.82, 16 42.97 -> 24.64; at
2000 tokens, 1 decode 12.12 -> 8.06, 4 decodes 40.06 -> 29.54.

In a model, the fused ops replace the layers' eager arithmetic between the attention ops, and
the attention op's kernel (``KernelBackend.fused_paged_attention``): the op itself, where the
preemption vote runs before any kernel, stays where it was.

Numerics: every step rounds as the eager layers do (``workers.layers.norm``, ``rotary``,
``activation``): float32 throughout, no fused multiply-adds (Inductor compiles with
``-ffp-contract=off``), products rounded before they are summed, SiLU as ``g / (1 + exp(-g))``
with ATen's vectorized exp; rotary and SiLU·mul are bit-for-bit the eager ops. RMSNorm's row
reduction and attention's dot products and sums add up in another order than torch's (an ulp
or so). float32 only: a model in another dtype keeps the eager path.

The kernels compile once per process, when a model that uses them is set up
(``serves(dtype, hidden_size)``, from ``DecoderForCausalLM.use_kernels``): ~2 s each the first
time on a machine, ~2 s in all from Inductor's disk cache after (its CPU probes). A model below
``MIN_HIDDEN_SIZE`` (the tests' tiny models) keeps the eager path and compiles nothing; so does
every model when ``SLOSERVE_CPU_FUSED_OPS=0`` (or ``fused_ops="off"``), and when compiling
fails (no C++ compiler, or Inductor's binding API changed: a warm-up call of each kernel is
checked against the eager ops), with one log line.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

from kernels import torch_attention
from kernels.cpu_source import CppFunction, compile_unit
from kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

FUSED_ENV = "SLOSERVE_CPU_FUSED_OPS"
# Models narrower than this keep the eager layers: compiling (seconds, once per process) is not
# worth it for the tests' tiny models (hidden 64), and the eager ops are already cheap there.
MIN_HIDDEN_SIZE = 256
# Rows from which a kernel splits its rows across the OpenMP threads: a decode step's few rows
# stay on one thread (a parallel region costs more than the row), a prefill's are split.
PARALLEL_ROWS = 32
# Decode attention splits its (decode, KV head) pairs across the threads from this many cached
# slots read in all (decodes x KV heads x the longest context). Over the default model's 30
# layers (3 KV heads), one thread against two: one decode over 64 tokens 0.41 / 0.38 ms, over
# 512 1.86 / 1.45 ms; two decodes over 512 3.85 / 2.37 ms.
PARALLEL_SLOTS = 256
# The widest attention head the decode loop takes (its vector chunks are unrolled up to it).
MAX_HEAD_DIM = 128

# What every loop below reads (after kernels.cpu_source.PRELUDE).
CONSTANTS = r"""
static constexpr int64_t kParallelRows = %d;
""" % PARALLEL_ROWS

# out = w * (s * rsqrt(mean(s^2) + eps)) with s = x (+ residual, written to res_out). Row r of x
# is at x + (r / inner) * sxo + (r % inner) * sxi: [T, hidden] (inner 1) or [T, H, head_dim]
# views (a slice of a fused qkv output) without a copy. Outputs are contiguous.
_RMS_NORM = r"""
static void rms_norm_rows(const float* x, const float* res, const float* w, float* out,
                          float* res_out, const int64_t rows, const int64_t inner,
                          const int64_t sxo, const int64_t sxi, const int64_t sro,
                          const int64_t sri, const int64_t hidden, const int64_t has_res,
                          const float eps)
{
    #pragma omp parallel for if(rows >= kParallelRows)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + (r / inner) * sxo + (r % inner) * sxi;
        const float* s = xr;
        if (has_res) {
            const float* rr = res + (r / inner) * sro + (r % inner) * sri;
            float* sr = res_out + r * hidden;
            for (int64_t j = 0; j < hidden; j += kLanes) {
                const int64_t n = std::min(kLanes, hidden - j);
                (Vec::loadu(xr + j, n) + Vec::loadu(rr + j, n)).store(sr + j, n);
            }
            s = sr;
        }
        Vec acc(0.0f);
        for (int64_t j = 0; j < hidden; j += kLanes) {
            const int64_t n = std::min(kLanes, hidden - j);
            const Vec v = Vec::loadu(s + j, n);  // lanes past n load as 0
            acc = acc + v * v;
        }
        const float total = at::vec::vec_reduce_all<float>(
            [](Vec& a, Vec& b) { return a + b; }, acc);
        const float inv = 1.0f / std::sqrt(total / static_cast<float>(hidden) + eps);
        const Vec vinv(inv);
        float* o = out + r * hidden;
        for (int64_t j = 0; j < hidden; j += kLanes) {
            const int64_t n = std::min(kLanes, hidden - j);
            (Vec::loadu(w + j, n) * (Vec::loadu(s + j, n) * vinv)).store(o + j, n);
        }
    }
}
"""

# out[t, h] = (x1 * cos - x2 * sin, x2 * cos + x1 * sin) over the halves of x[t, h]; x rows at
# x + t * sxt + h * sxh, cos/sin rows at t * sct / t * sst; out contiguous [T, H, 2 * half].
_ROTARY = r"""
static void rotary_rows(const float* x, const float* cos, const float* sin, float* out,
                        const int64_t tokens, const int64_t heads, const int64_t half,
                        const int64_t sxt, const int64_t sxh, const int64_t sct,
                        const int64_t sst)
{
    #pragma omp parallel for if(tokens >= kParallelRows)
    for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos + t * sct;
        const float* s = sin + t * sst;
        for (int64_t h = 0; h < heads; ++h) {
            const float* x1 = x + t * sxt + h * sxh;
            const float* x2 = x1 + half;
            float* o1 = out + (t * heads + h) * 2 * half;
            float* o2 = o1 + half;
            for (int64_t j = 0; j < half; j += kLanes) {
                const int64_t n = std::min(kLanes, half - j);
                const Vec a = Vec::loadu(x1 + j, n), b = Vec::loadu(x2 + j, n);
                const Vec vc = Vec::loadu(c + j, n), vs = Vec::loadu(s + j, n);
                (a * vc - b * vs).store(o1 + j, n);
                (b * vc + a * vs).store(o2 + j, n);
            }
        }
    }
}
"""

# out[r] = silu(gate) * up for x[r] = [gate | up] (rows at r * sx), out contiguous [rows, width].
_SILU_AND_MUL = r"""
static void silu_and_mul_rows(const float* x, float* out, const int64_t rows, const int64_t sx,
                              const int64_t width)
{
    const Vec one(1.0f);
    #pragma omp parallel for if(rows >= kParallelRows)
    for (int64_t r = 0; r < rows; ++r) {
        const float* gate = x + r * sx;
        const float* up = gate + width;
        float* o = out + r * width;
        for (int64_t j = 0; j < width; j += kLanes) {
            const int64_t n = std::min(kLanes, width - j);
            const Vec g = Vec::loadu(gate + j, n);
            ((g / (one + g.neg().exp())) * Vec::loadu(up + j, n)).store(o + j, n);
        }
    }
}
"""

# Decode attention over the paged cache, one (decode, KV head) pair per work item: the pair's
# group of query heads scores the first ctx slots through the block table, softmax in float32,
# then sums the values. Slots past a context are never read (they may hold anything, NaN
# included). q rows at b * sqb + head * sqh, out rows at b * sob + head * soh.
_DECODE_ATTENTION = r"""
#include <vector>

// Lane sums of kTile vectors, stored to out[0..n): out[j] = the sum of a[j]'s lanes. With
// AVX-512 (16 lanes) a transposing tree: 15 shuffle-and-add steps for 16 sums, where one sum
// alone takes 4 (``hsum``); elsewhere one hsum each.
static constexpr int kTile = 16;
static inline void lane_sums(const Vec* a, float* out, const int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kLanes == kTile) {
        __m512 t[8], s[4];
        for (int i = 0; i < 8; ++i) {
            const __m512 x = a[2 * i], y = a[2 * i + 1];
            t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
        }
        for (int i = 0; i < 4; ++i) {
            const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
            s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
        }
        const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44),
                                         _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
        const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44),
                                         _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
        const Vec sums(_mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, 0x88),
                                     _mm512_shuffle_f32x4(q01, q23, 0xDD)));
        sums.store(out, n);
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) out[j] = hsum(a[j]);
}

// One decode's KV head over its visible slots [first, ctx): CH vector chunks of head_dim (the
// last one masked to `tail` lanes). Scores a tile of up to kTile slots of one block at a time,
// for each query head of the group in turn (the tile's keys stay in L1 between heads); the
// score of slot t is at scores[g * seen + t - first].
template <int CH>
static void attend_kv_head(const float* q, const float* key_cache, const float* value_cache,
                           const int64_t* table, const int64_t first, const int64_t ctx, float* out,
                           const int64_t group, const int64_t h, const int64_t head_dim,
                           const int64_t block_size, const int64_t slot_stride, const int64_t sqh,
                           const int64_t soh, const float scale, const float softcap, float* scores)
{
    const int64_t tail = head_dim - (CH - 1) * kLanes;
    const int64_t block_stride = block_size * slot_stride;
    const int64_t blocks = (ctx + block_size - 1) / block_size;
    const int64_t seen = ctx - first;
    auto load = [tail](const float* p, int c) {
        return c + 1 < CH ? Vec::loadu(p + c * kLanes) : Vec::loadu(p + c * kLanes, tail);
    };
    for (int64_t i = first / block_size; i < blocks; ++i) {
        const float* kb = key_cache + table[i] * block_stride + h * head_dim;
        const int64_t base = i * block_size;
        const int64_t slots = std::min(block_size, ctx - base);
        for (int64_t j0 = std::max<int64_t>(0, first - base); j0 < slots; j0 += kTile) {
            const int64_t n = std::min<int64_t>(kTile, slots - j0);
            for (int64_t g = 0; g < group; ++g) {
                const float* qr = q + (h * group + g) * sqh;
                Vec qv[CH];
                for (int c = 0; c < CH; ++c) qv[c] = load(qr, c) * Vec(scale);
                Vec dots[kTile];
                for (int64_t j = 0; j < kTile; ++j) {
                    if (j >= n) { dots[j] = Vec(0.0f); continue; }
                    const float* k = kb + (j0 + j) * slot_stride;
                    Vec dot = qv[0] * load(k, 0);
                    for (int c = 1; c < CH; ++c) dot = dot + qv[c] * load(k, c);
                    dots[j] = dot;
                }
                lane_sums(dots, scores + g * seen + base + j0 - first, n);
            }
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float* s = scores + g * seen;
        if (softcap > 0.0f) {  // Gemma 2: softcap * tanh(score / softcap)
            const Vec cap(softcap), inv_cap(1.0f / softcap);
            for (int64_t t = 0; t < seen; t += kLanes) {
                const int64_t n = std::min(kLanes, seen - t);
                ((Vec::loadu(s + t, n) * inv_cap).tanh() * cap).store(s + t, n);
            }
        }
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < seen; ++t) top = std::max(top, s[t]);
        Vec total(0.0f);
        for (int64_t t = 0; t < seen; t += kLanes) {
            const int64_t n = std::min(kLanes, seen - t);
            const Vec e = Vec::set(Vec(0.0f), (Vec::loadu(s + t, n) - Vec(top)).exp(), n);
            e.store(s + t, n);
            total = total + e;
        }
        const Vec inv(1.0f / hsum(total));
        for (int64_t t = 0; t < seen; t += kLanes) {
            const int64_t n = std::min(kLanes, seen - t);
            (Vec::loadu(s + t, n) * inv).store(s + t, n);
        }
        Vec acc[CH];
        for (int c = 0; c < CH; ++c) acc[c] = Vec(0.0f);
        for (int64_t i = first / block_size; i < blocks; ++i) {
            const float* vb = value_cache + table[i] * block_stride + h * head_dim;
            const int64_t base = i * block_size;
            const int64_t slots = std::min(block_size, ctx - base);
            const float* p = s + base - first;
            for (int64_t j = std::max<int64_t>(0, first - base); j < slots; ++j) {
                const Vec pj(p[j]);
                for (int c = 0; c < CH; ++c) acc[c] = acc[c] + pj * load(vb + j * slot_stride, c);
            }
        }
        float* o = out + (h * group + g) * soh;
        for (int c = 0; c < CH; ++c) {
            if (c + 1 < CH) acc[c].store(o + c * kLanes);
            else acc[c].store(o + c * kLanes, tail);
        }
    }
}

static void decode_attention_rows(const float* q, const float* key_cache, const float* value_cache,
                                  const int64_t* tables, const int64_t* context_lens, float* out,
                                  const int64_t batch, const int64_t heads, const int64_t kv_heads,
                                  const int64_t head_dim, const int64_t block_size,
                                  const int64_t table_stride, const int64_t sqb, const int64_t sqh,
                                  const int64_t sob, const int64_t soh, const int64_t parallel,
                                  const int64_t window, const float scale, const float softcap)
{
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * head_dim;
    const int64_t chunks = (head_dim + kLanes - 1) / kLanes;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1) if(parallel)
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t ctx = context_lens[b];
            // A sliding window W: the decode at position ctx - 1 sees the slots after
            // ctx - 1 - W (HF's mask).
            const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
            std::vector<float> scores(group * (ctx - first));
            const float* qb = q + b * sqb;
            float* ob = out + b * sob;
            const int64_t* table = tables + b * table_stride;
            #define ATTEND(CH) attend_kv_head<CH>(qb, key_cache, value_cache, table, first, ctx, ob, \
                group, h, head_dim, block_size, slot_stride, sqh, soh, scale, softcap, \
                scores.data())
            switch (chunks) {
                case 1: ATTEND(1); break;
                case 2: ATTEND(2); break;
                case 3: ATTEND(3); break;
                case 4: ATTEND(4); break;
                case 5: ATTEND(5); break;
                case 6: ATTEND(6); break;
                case 7: ATTEND(7); break;
                case 8: ATTEND(8); break;
                // 8-lane vectors (AVX2, and ATen's default): a head of 128 is 16 chunks.
                case 9: ATTEND(9); break;
                case 10: ATTEND(10); break;
                case 11: ATTEND(11); break;
                case 12: ATTEND(12); break;
                case 13: ATTEND(13); break;
                case 14: ATTEND(14); break;
                case 15: ATTEND(15); break;
                default: ATTEND(16); break;  // head_dim <= 128 (checked by the caller)
            }
            #undef ATTEND
        }
    }
}
"""

# The loops by the name their Python wrappers below call them by.
FUNCTIONS: dict[str, CppFunction] = {
    "rms_norm": CppFunction.parse("rms_norm_rows", _RMS_NORM),
    "rotary": CppFunction.parse("rotary_rows", _ROTARY),
    "silu_and_mul": CppFunction.parse("silu_and_mul_rows", _SILU_AND_MUL),
    "decode_attention": CppFunction.parse("decode_attention_rows", _DECODE_ATTENTION),
}

# The compiled kernels by name once built; {None: None} once building them failed.
_KERNELS: dict[Any, Any] = {}


def enabled() -> bool:
    """Whether the environment allows the fused kernels (``SLOSERVE_CPU_FUSED_OPS`` != "0")."""
    return os.environ.get(FUSED_ENV, "1") != "0"


def serves(dtype: torch.dtype, hidden_size: int) -> bool:
    """Whether a model of this dtype and hidden size runs on the fused kernels: float32, at
    least ``MIN_HIDDEN_SIZE`` wide, the switch on, and the kernels compiled (here, the first
    time one is asked; False with a log line when they cannot be)."""
    if dtype != torch.float32 or hidden_size < MIN_HIDDEN_SIZE or not enabled():
        return False
    return warm_up()


def warm_up() -> bool:
    """Compile the kernels (once per process) and check one call of each against the eager ops;
    False, with a warning, where that fails."""
    if _KERNELS:
        return None not in _KERNELS
    started = time.perf_counter()
    try:
        for name, function in FUNCTIONS.items():
            _KERNELS[name] = compile_unit(function, [CONSTANTS])
        _check()
    except Exception as e:  # noqa: BLE001 - any compiler or binding failure: eager layers
        logger.warning("CPU fused kernels unavailable (%s: %s); RMSNorm, rotary, SiLU·mul and "
                       "decode attention run as eager ops", type(e).__name__,
                       (str(e).splitlines() or [""])[0][:200])
        _KERNELS.clear()
        _KERNELS[None] = None
        return False
    logger.info("CPU fused kernels (%s) compiled and checked in %.1f s", ", ".join(FUNCTIONS),
                time.perf_counter() - started)
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of float32 x [T, hidden] or [T, H, hidden] over the last dim; with a residual,
    ``(rms_norm(x + residual), x + residual)``. New contiguous outputs; x is never written.
    (``workers.layers.norm.RMSNorm``'s contract, as ``kernels.triton_norm.rms_norm``.)"""
    # Checked at ~0.1 us each: at one decode row the whole call is ~6 us, the loop ~0.6.
    hidden = x.shape[-1]
    if (x.dtype != _F32 or weight.dtype != _F32 or weight.numel() != hidden
            or not weight.is_contiguous()):
        raise ValueError(f"float32 x [..., {hidden}] and weight [{hidden}] needed, got x "
                         f"{tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype}")
    x, inner, sxo, sxi = _rows(x)
    rows = x.numel() // hidden if hidden else 0
    out = _empty(x)
    if residual is None:
        _KERNELS["rms_norm"](x, x, weight, out, out, rows, inner, sxo, sxi, 0, 0, hidden, 0,
                             eps)
        return out
    if residual.shape != x.shape or residual.dtype != _F32:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} for x "
                         f"{tuple(x.shape)} {x.dtype}")
    residual, _, sro, sri = _rows(residual)
    summed = _empty(x)
    _KERNELS["rms_norm"](x, residual, weight, out, summed, rows, inner, sxo, sxi, sro, sri,
                         hidden, 1, eps)
    return out, summed


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate float32 x [T, H, D] by the per-token angles (cos/sin [T, 1, D/2]); returns a new
    contiguous tensor (``workers.layers.rotary.apply_rotary``'s contract)."""
    if x.dim() != 3 or x.dtype != _F32:
        raise ValueError(f"x must be float32 [T, H, D], got {tuple(x.shape)} {x.dtype}")
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if (head_dim % 2 or cos.shape != (tokens, 1, half) or sin.shape != cos.shape
            or cos.dtype != _F32 or sin.dtype != _F32):
        raise ValueError(f"cos/sin {tuple(cos.shape)} {cos.dtype} do not fit x "
                         f"{tuple(x.shape)}")
    if x.stride(2) != 1:
        x = x.contiguous()
    if cos.stride(2) != 1:
        cos = cos.contiguous()
    if sin.stride(2) != 1:
        sin = sin.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=_F32)
    _KERNELS["rotary"](x, cos, sin, out, tokens, heads, half, x.stride(0), x.stride(1),
                       cos.stride(0), sin.stride(0))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for float32 x = [gate | up] [T, 2 * I]; a new contiguous [T, I]
    (``workers.layers.activation.silu_and_mul``'s contract)."""
    if x.dim() != 2 or x.dtype != _F32 or x.shape[1] % 2:
        raise ValueError(f"x must be float32 [T, 2 * I], got {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=_F32)
    _KERNELS["silu_and_mul"](x, out, rows, x.stride(0), width)
    return out


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: Any, scale: float,
                    out: torch.Tensor | None = None,
                    sliding_window: int | None = None,
                    softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.torch_attention.paged_attention`` (same contract) with the decodes in one
    compiled loop over the paged cache: no gathered copy of K/V, no padding of contexts, a few
    microseconds of Python instead of ~20 eager ops a layer. Prefill chunks, and decodes the
    loop does not take (not float32, a head wider than 128, unusual strides, attention sinks),
    go to the PyTorch path."""
    num_decodes = meta.num_decodes
    if (not num_decodes or sinks is not None
            or not _decodes_fit(query, key_cache, value_cache, meta, out)):
        return torch_attention.paged_attention(query, key, value, key_cache, value_cache, meta,
                                               scale, out, sliding_window, softcap, sinks)
    out = torch_attention.output_for(query, key_cache, out)
    _, heads, head_dim = query.shape
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    # Split across the threads unless there is next to nothing to read (PARALLEL_SLOTS).
    seen = min(meta.decode_max_context, sliding_window or meta.decode_max_context)
    parallel = int(num_decodes * kv_heads * seen >= PARALLEL_SLOTS)
    _KERNELS["decode_attention"](query, key_cache, value_cache, tables, lens, out, num_decodes,
                                 heads, kv_heads, head_dim, block_size, tables.stride(0),
                                 query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                                 parallel, sliding_window or 0, scale, softcap or 0.0)
    if num_decodes < query.shape[0]:
        torch_attention.attend_prefills(out, query, key, value, key_cache, value_cache, meta,
                                        scale, sliding_window, softcap)
    return out


def _decodes_fit(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: Any, out: torch.Tensor | None) -> bool:
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    return (query.dtype == _F32 and key_cache.dtype == _F32 and value_cache.dtype == _F32
            and query.device.type == "cpu" and query.shape[2] <= MAX_HEAD_DIM
            and query.stride(2) == 1
            and (out is None or (out.stride(2) == 1 and out.dtype == _F32))
            and key_cache.is_contiguous()
            and value_cache.is_contiguous() and tables.dtype == torch.int64
            and tables.stride(1) == 1 and lens.dtype == torch.int64 and lens.stride(0) == 1)


_F32 = torch.float32


def _empty(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous float32 tensor of x's shape. Allocating is a good part of a decode
    row's call: ``empty_like`` costs ~0.9 us, ``torch.empty(*dims, dtype=)`` ~1.3 us and
    ``torch.empty(x.shape, dtype=)`` ~2.6 us."""
    if x.is_contiguous():
        return torch.empty_like(x)
    return torch.empty(*x.shape, dtype=_F32)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x (unit stride in its last dim) and how its rows are addressed: (x, inner, outer stride,
    inner stride), row r at (r // inner) * outer + (r % inner) * inner stride."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    dims = x.dim()
    if dims == 2:
        return x, 1, x.stride(0), 0
    if dims == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"x must be [T, hidden] or [T, H, hidden], got shape {tuple(x.shape)}")


def _check() -> None:
    """One call of each kernel on a strided input, against the eager ops (raises on a
    mismatch: a binding that passes its arguments differently must not serve a model)."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 2 * 40, generator=g)
    x, res = wide[:, :40], torch.randn(3, 40, generator=g)
    weight = torch.randn(40, generator=g)
    s = x + res
    expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5))
    got, summed = rms_norm(x, weight, 1e-5, res)
    cos, sin = torch.randn(3, 1, 10, generator=g), torch.randn(3, 1, 10, generator=g)
    heads = wide.view(3, 4, 20)
    x1, x2 = heads[..., :10], heads[..., 10:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    gate, up = wide.chunk(2, dim=-1)
    # Two decodes (contexts 7 and 3) over blocks of 4 slots, 2 KV heads of 4 query heads each,
    # head_dim 20 (a masked tail chunk).
    key_cache, value_cache = torch.randn(2, 5, 4, 2, 20, generator=g).unbind(0)
    query = torch.randn(2, 8, 20, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0, 0]), num_decodes=2,
        decode_block_tables=torch.tensor([[3, 1], [4, 0]]),
        decode_context_lens=torch.tensor([7, 3]), prefill_query_lens=[],
        prefill_context_lens=[], prefill_block_tables=[])
    attention = paged_attention(query, query, query, key_cache, value_cache, meta, 0.3)
    reference = torch_attention.paged_attention(query, query, query, key_cache, value_cache,
                                                meta, 0.3)
    # A sliding window of 5 slots (the first decode sees slots 2..6, from mid-block), scores
    # soft-capped at 2.
    windowed = paged_attention(query, query, query, key_cache, value_cache, meta, 0.3,
                               sliding_window=5, softcap=2.0)
    windowed_reference = torch_attention.paged_attention(query, query, query, key_cache,
                                                         value_cache, meta, 0.3,
                                                         sliding_window=5, softcap=2.0)
    checks: list[tuple[str, torch.Tensor, torch.Tensor]] = [
        ("rms_norm", got, expected), ("residual add", summed, s),
        ("rotary", apply_rotary(heads, cos, sin), rotated),
        ("silu_and_mul", silu_and_mul(wide), F.silu(gate) * up),
        ("decode attention", attention, reference),
        ("sliding-window soft-capped decode attention", windowed, windowed_reference)]
    for name, value, reference in checks:
        if not torch.allclose(value, reference, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"the compiled {name} differs from the eager ops")
