"""A whole CPU decode step through the decoder's layers in one compiled call.

A decode step of a small model on a CPU spends a good part of its time between kernels: at one
row of the default model (30 layers), the loops of ``kernels.cpu_fused`` and
``kernels.cpu_bf16_linear`` take ~11 ms of a ~15.7 ms forward, and the Python around them
(modules, views, output allocations, ~10 calls a layer at 4-15 us each) the rest. The GPU answer
is a CUDA graph of the decode step; this is the CPU's: one C++ function runs the embedding, every
layer (add+RMSNorm, q/k/v, q/k RMSNorm where the family has it, rotary, the KV cache write,
paged decode attention, o, add+RMSNorm, gate/up, SiLU·mul, down) and the final norm, calling the
same loops the layered path calls, on the same inputs, in the same order: its hidden states are
bit for bit the layered path's.

What a layer reads is a row of ``FIELDS`` int64 values in a table built once per model
(``workers.graphs.cpu_decode_pass``): the addresses of its norm weights, its bf16 weight copies
and biases, its KV caches, and its sliding window. The step's own inputs (token ids, positions,
KV slots, block tables, context lengths) are the model runner's tensors, passed as they are.

Decode-only steps never vote (docs/design.md, section 4), so nothing needs to stop between the
layers of this call; a step that may be preempted keeps the layered path with its vote.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kernels import cpu_bf16_linear, cpu_fused
from kernels.cpu_source import CppFunction, compile_unit

logger = logging.getLogger(__name__)

# A layer's row of the table: what each column holds (addresses are 0 where a layer has none).
FIELDS = ("input_norm", "qkv_weight", "qkv_bias", "q_norm", "k_norm", "o_weight", "o_bias",
          "post_norm", "gate_up_weight", "gate_up_bias", "down_weight", "down_bias",
          "key_cache", "value_cache", "window")
FIELD = {name: i for i, name in enumerate(FIELDS)}

_DEFINITION = r"""
#include <cstring>

static constexpr int64_t kFields = %(fields)d;

template <typename T>
static inline T* at_address(const int64_t* row, const int64_t i) {
    return reinterpret_cast<T*>(row[i]);
}

// One decode step of `rows` decodes (one token each) through every layer: the embeddings of
// token_ids, then per layer (table row `layers + l * kFields`) the layered path's loops, then
// the final norm into out [rows, hidden]. scratch holds decode_pass_scratch(...) floats.
static void decode_pass(const int64_t* layers, const float* embedding, const float* cos_sin,
                        const float* final_norm, const int64_t* token_ids,
                        const int64_t* positions, const int64_t* slots, const int64_t* tables,
                        const int64_t* context_lens, float* scratch, float* out,
                        const int64_t rows, const int64_t num_layers, const int64_t hidden,
                        const int64_t heads, const int64_t kv_heads, const int64_t head_dim,
                        const int64_t intermediate, const int64_t block_size,
                        const int64_t table_stride, const int64_t parallel_slots,
                        const float eps, const float scale, const float softcap)
{
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
    const int64_t qkv_width = q_size + 2 * kv_size, half = head_dim / 2;
    const int64_t gate_up_width = 2 * intermediate;
    float* residual = scratch;                        // [rows, hidden]
    float* h = residual + rows * hidden;              // [rows, hidden]: a sub-layer's output
    float* normed = h + rows * hidden;                // [rows, hidden]
    float* qkv = normed + rows * hidden;              // [rows, qkv_width]
    float* q = qkv + rows * qkv_width;                // [rows, heads, head_dim], rotated
    float* k = q + rows * q_size;                     // [rows, kv_heads, head_dim], rotated
    float* attn = k + rows * kv_size;                 // [rows, heads * head_dim]
    float* gate_up = attn + rows * q_size;            // [rows, 2 * intermediate]
    float* act = gate_up + rows * gate_up_width;      // [rows, intermediate]
    float* cos = act + rows * intermediate;           // [rows, half]
    float* sin = cos + rows * half;                   // [rows, half]

    // The embedding rows and each row's rotary angles (the table's row is [cos | sin]).
    int64_t max_context = 0;
    for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(h + r * hidden, embedding + token_ids[r] * hidden, hidden * sizeof(float));
        const float* angles = cos_sin + positions[r] * head_dim;
        std::memcpy(cos + r * half, angles, half * sizeof(float));
        std::memcpy(sin + r * half, angles + half, half * sizeof(float));
        max_context = std::max(max_context, context_lens[r]);
    }
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t* f = layers + l * kFields;
        if (l == 0) {  // the embeddings are the residual stream entering the first layer
            std::memcpy(residual, h, rows * hidden * sizeof(float));
            rms_norm_rows(h, h, at_address<const float>(f, %(input_norm)d), normed, normed,
                          rows, 1, hidden, 0, 0, 0, hidden, 0, eps);
        } else {
            rms_norm_rows(h, residual, at_address<const float>(f, %(input_norm)d), normed,
                          residual, rows, 1, hidden, 0, hidden, 0, hidden, 1, eps);
        }
        const float* qkv_bias = at_address<const float>(f, %(qkv_bias)d);
        bf16_linear_rows(normed, at_address<const at::BFloat16>(f, %(qkv_weight)d),
                         qkv_bias ? qkv_bias : qkv, qkv, rows, qkv_width, hidden, hidden,
                         qkv_width, qkv_bias != nullptr);
        const float* q_norm = at_address<const float>(f, %(q_norm)d);
        const float* k_norm = at_address<const float>(f, %(k_norm)d);
        if (q_norm != nullptr) {  // Qwen3: each head normed before rotary, then turned in place
            rms_norm_rows(qkv, qkv, q_norm, q, q, rows * heads, heads, qkv_width, head_dim,
                          0, 0, head_dim, 0, eps);
            rms_norm_rows(qkv + q_size, qkv, k_norm, k, k, rows * kv_heads, kv_heads,
                          qkv_width, head_dim, 0, 0, head_dim, 0, eps);
            rotary_rows(q, cos, sin, q, rows, heads, half, q_size, head_dim, half, half);
            rotary_rows(k, cos, sin, k, rows, kv_heads, half, kv_size, head_dim, half, half);
        } else {
            rotary_rows(qkv, cos, sin, q, rows, heads, half, qkv_width, head_dim, half, half);
            rotary_rows(qkv + q_size, cos, sin, k, rows, kv_heads, half, qkv_width, head_dim,
                        half, half);
        }
        float* key_cache = at_address<float>(f, %(key_cache)d);
        float* value_cache = at_address<float>(f, %(value_cache)d);
        for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(key_cache + slots[r] * kv_size, k + r * kv_size,
                        kv_size * sizeof(float));
            std::memcpy(value_cache + slots[r] * kv_size, qkv + r * qkv_width + q_size + kv_size,
                        kv_size * sizeof(float));
        }
        const int64_t window = f[%(window)d];
        const int64_t seen = window > 0 ? std::min(max_context, window) : max_context;
        decode_attention_rows(q, key_cache, value_cache, tables, context_lens, attn, rows, heads,
                              kv_heads, head_dim, block_size, table_stride, q_size, head_dim,
                              q_size, head_dim, rows * kv_heads * seen >= parallel_slots,
                              window, scale, softcap);
        const float* o_bias = at_address<const float>(f, %(o_bias)d);
        bf16_linear_rows(attn, at_address<const at::BFloat16>(f, %(o_weight)d),
                         o_bias ? o_bias : h, h, rows, hidden, q_size, q_size, hidden,
                         o_bias != nullptr);
        rms_norm_rows(h, residual, at_address<const float>(f, %(post_norm)d), normed, residual,
                      rows, 1, hidden, 0, hidden, 0, hidden, 1, eps);
        const float* gate_up_bias = at_address<const float>(f, %(gate_up_bias)d);
        bf16_linear_rows(normed, at_address<const at::BFloat16>(f, %(gate_up_weight)d),
                         gate_up_bias ? gate_up_bias : gate_up, gate_up, rows, gate_up_width,
                         hidden, hidden, gate_up_width, gate_up_bias != nullptr);
        silu_and_mul_rows(gate_up, act, rows, gate_up_width, intermediate);
        const float* down_bias = at_address<const float>(f, %(down_bias)d);
        bf16_linear_rows(act, at_address<const at::BFloat16>(f, %(down_weight)d),
                         down_bias ? down_bias : h, h, rows, hidden, intermediate, intermediate,
                         hidden, down_bias != nullptr);
    }
    rms_norm_rows(h, residual, final_norm, out, residual, rows, 1, hidden, 0, hidden, 0, hidden,
                  1, eps);
}
""" % dict(fields=len(FIELDS), **FIELD)

FUNCTION = CppFunction.parse("decode_pass", _DEFINITION)

# The compiled pass once built; {None: None} once building it failed.
_KERNEL: dict[Any, Any] = {}


def scratch_floats(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                   intermediate: int) -> int:
    """The floats of working memory a pass over ``rows`` decodes needs (its layout: above)."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    per_row = (3 * hidden + (q_size + 2 * kv_size) + q_size + kv_size + q_size
               + 3 * intermediate + head_dim)
    return rows * per_row


def warm_up() -> bool:
    """Compile the pass (once per process, after the loops it calls are known to compile);
    False, with a warning, where that fails."""
    if _KERNEL:
        return None not in _KERNEL
    if not (cpu_fused.warm_up() and cpu_bf16_linear.warm_up()):
        _KERNEL[None] = None
        return False
    started = time.perf_counter()
    try:
        parts = [cpu_fused.CONSTANTS] + [f.definition for f in cpu_fused.FUNCTIONS.values()]
        _KERNEL["pass"] = compile_unit(FUNCTION, parts + [cpu_bf16_linear.DEFINITION])
    except Exception as e:  # noqa: BLE001 - any compiler or binding failure: layered path
        logger.warning("CPU decode pass unavailable (%s: %s); decode steps run layer by layer",
                       type(e).__name__, (str(e).splitlines() or [""])[0][:200])
        _KERNEL.clear()
        _KERNEL[None] = None
        return False
    logger.info("CPU decode pass compiled in %.1f s", time.perf_counter() - started)
    return True


def run(*args: Any) -> None:
    """One call of the compiled pass, with ``decode_pass``'s arguments in order (tensors for
    addresses); ``warm_up`` first."""
    _KERNEL["pass"](*args)


def address(tensor: torch.Tensor | None) -> int:
    """A tensor's data address for a table column (0 for None)."""
    return 0 if tensor is None else tensor.data_ptr()
