"""KV cache groups: which layers share a block table (vLLM's hybrid allocator, in small).

A full-attention layer needs the KV of every position of a request; a sliding-window layer only
the last W (a query at position p sees the keys after p - W). With one block table for every
layer, a sliding layer holds its blocks for the whole context like a full one. So the layers are
split into groups of one attention kind, each group with a block table of its own per request:
a full group's table covers the whole sequence, a sliding group's lets go of the blocks its
window has passed (engine.core.kv_cache_manager), and those go back to the pool for anyone.

Every group has the same number of layers, so a block of the one pool is the same size in every
group: the KV of ``group_size`` layers for ``block_size`` tokens. Physically (workers/kv_cache.py)
there are ``group_size`` cache tensors, and the layer at position i of each group uses tensor i,
indexed by its own group's table: a block id belongs to one group's table at a time.

A model whose layers all attend alike has one group of all its layers: one table, as before.
Gemma 3 (5 sliding per global layer, 48 layers) has 6 groups of 8; Gemma 2 and gpt-oss
(alternating) 2 groups of half the layers each; a Mistral whose every layer slides, one sliding
group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (model indices, ascending) that share one block table; their sliding window
    (None: full attention)."""

    layers: tuple[int, ...]
    window: int | None = None

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block a request's next tokens can read, its next token being at position
        ``num_computed``: 0 for full attention; for a window W, the block of the first key
        after num_computed - W."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size

    def peak_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds in this group at once,
        computed in chunks of at most ``max_chunk`` tokens: all of them for full attention;
        for a window, the window before a chunk and the chunk (and a block of alignment)."""
        whole = cdiv(num_tokens, block_size)
        if self.window is None:
            return whole
        return min(whole, cdiv(self.window - 1 + max_chunk, block_size) + 1)


def kv_cache_groups(layer_windows: Sequence[int | None]) -> list[KVCacheGroup]:
    """The groups of a model whose layer i attends within ``layer_windows[i]`` (None: fully).
    Layers of one kind are grouped in order, every group of the greatest common divisor of the
    kinds' layer counts; full-attention groups first (the first group's table is the one whose
    prefix hashes a fleet's router reads), then by their first layer."""
    if not layer_windows:
        raise ValueError("a model without layers has no KV cache groups")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    order = sorted(kinds.items(), key=lambda kind: (kind[0] is not None, kind[1][0]))
    return [KVCacheGroup(tuple(layers[i:i + size]), window)
            for window, layers in order for i in range(0, len(layers), size)]


def layer_groups(groups: Sequence[KVCacheGroup]) -> list[tuple[int, int]]:
    """Each layer's (group, position within the group): the group's block table and the cache
    tensor it uses."""
    slots: dict[int, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for position, layer in enumerate(group.layers):
            slots[layer] = (g, position)
    return [slots[layer] for layer in range(len(slots))]


def pool_blocks_needed(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int,
                       max_chunk: int) -> int:
    """Blocks one request of ``num_tokens`` tokens needs at its peak, over every group."""
    return sum(g.peak_blocks(num_tokens, block_size, max_chunk) for g in groups)
