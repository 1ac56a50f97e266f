"""Triton kernel: write a step's new keys and values into the paged KV cache by slot mapping.

Same contract as `kernels.torch_attention.write_kv_cache`: key/value [T, Hkv, D], caches
[num_blocks, block_size, Hkv, D], slot_mapping [T] int64 (a negative slot is skipped, as a
padding token would be). One program per (token, KV head) copies one head vector; D need not be
a power of two (head sizes 64, 80, 96, 128), so the lane mask covers the tail.

key and value may be strided views (the model's value is a slice of its fused qkv output): they
are read through their own strides, not copied. A copy would also change the variant Triton
compiles with the batch: torch counts a one-token view as contiguous and does not copy it, so a
decode of one token would pass other strides and pointers than a larger batch.

Runs compiled on CUDA, and on CPU under Triton's interpreter (TRITON_INTERPRET=1) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.variants import launch


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     key_stride_t, key_stride_h, value_stride_t, value_stride_h,
                     cache_stride_slot, cache_stride_h, head_dim, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_D)
        lanes = offs < head_dim
        dst = slot * cache_stride_slot + head * cache_stride_h + offs
        key = tl.load(key_ptr + token * key_stride_t + head * key_stride_h + offs, mask=lanes)
        tl.store(key_cache_ptr + dst, key, mask=lanes)
        value = tl.load(value_ptr + token * value_stride_t + head * value_stride_h + offs,
                        mask=lanes)
        tl.store(value_cache_ptr + dst, value, mask=lanes)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if key_cache.shape[2:] != (num_kv_heads, head_dim) or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not "
                         f"hold [*, *, {num_kv_heads}, {head_dim}] heads")
    if key_cache.dtype != key.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from the new keys' {key.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected "
                         f"({num_tokens},)")
    if num_tokens == 0:
        return
    # The lanes are addressed with unit stride; the other strides are honoured as given.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    launch(_write_kv_kernel, (num_tokens, num_kv_heads),
           key, value, key_cache, value_cache, slot_mapping,
           key.stride(0), key.stride(1), value.stride(0), value.stride(1),
           num_kv_heads * head_dim, head_dim, head_dim,
           BLOCK_D=triton.next_power_of_2(head_dim),
           # One head vector per program: a single warp has a lane per element.
           num_warps=1)
