"""Paged KV cache tensors: per layer a (key_cache, value_cache) pair shaped
[num_blocks, block_size, num_kv_heads, head_dim] (the layout kernels.attention documents)."""

from __future__ import annotations

import torch


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (num_kv_heads local to a rank)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zero-filled rather than empty: the kernels read whole blocks (and padded block-table
    # entries) and mask the unused slots; uninitialized memory could hold NaN, which survives
    # a -inf mask (NaN * 0 = NaN).
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
