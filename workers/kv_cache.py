"""Paged KV cache tensors: per layer a (key_cache, value_cache) pair shaped
[num_blocks, block_size, num_kv_heads, head_dim] (the layout kernels.attention documents).

A model with several KV cache groups (engine.core.kv_groups) has one pair per position within
a group, and the layers at the same position of every group share it: each reads and writes
it through its own group's block table, and a block id belongs to one group's table at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values (num_kv_heads local to a rank)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device: torch.device | str,
                       tensor_of_layer: Sequence[int] | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's pair; ``tensor_of_layer[i]``: which pair layer i uses (its position within
    its KV cache group; default: a pair of its own)."""
    # Zero-filled rather than empty: the kernels read whole blocks (and padded block-table
    # entries) and mask the unused slots; uninitialized memory could hold NaN, which survives
    # a -inf mask (NaN * 0 = NaN).
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    tensor_of_layer = list(range(num_layers)) if tensor_of_layer is None else tensor_of_layer
    pairs = [(torch.zeros(shape, dtype=dtype, device=device),
              torch.zeros(shape, dtype=dtype, device=device))
             for _ in range(max(tensor_of_layer, default=-1) + 1)]
    return [pairs[i] for i in tensor_of_layer]


def num_kv_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return kv_caches[0][0].shape[0] if kv_caches else 0


def resized_kv_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tensors like ``kv_caches`` (layers, block size, heads, dtype, device) with ``num_blocks``
    blocks: for a pool sized once the weights are loaded. The caller drops the old ones."""
    key = kv_caches[0][0]
    _, block_size, num_kv_heads, head_dim = key.shape
    return allocate_kv_caches(len(kv_caches), num_blocks, block_size, num_kv_heads, head_dim,
                              key.dtype, key.device, _tensor_of_layer(kv_caches))


def _tensor_of_layer(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Which distinct pair each layer uses, numbered in order of first use."""
    numbers: dict[int, int] = {}
    return [numbers.setdefault(id(key), len(numbers)) for key, _ in kv_caches]


def kv_caches_bytes_per_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Bytes one block takes in the distinct pairs (a KV cache group's layers)."""
    key = kv_caches[0][0]
    _, block_size, num_kv_heads, head_dim = key.shape
    return kv_cache_bytes_per_block(len(set(_tensor_of_layer(kv_caches))), block_size,
                                    num_kv_heads, head_dim, key.dtype)
