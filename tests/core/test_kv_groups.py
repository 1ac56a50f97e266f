"""KV cache groups (engine.core.kv_groups) and the KV manager's tables per group: a sliding
group gives back the blocks its window has passed and they serve others; its prefix-cache hits
need only what the window reaches; a rolled-back step's tail goes back in every group; what a
pool must hold for one request counts each group's peak."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_groups import (KVCacheGroup, kv_cache_groups, layer_groups,
                                   pool_blocks_needed)
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def test_layers_are_grouped_by_kind_in_groups_of_one_size() -> None:
    # Gemma 3's pattern: five sliding layers per global one, 12 layers.
    gemma3 = [None if i % 6 == 5 else 1024 for i in range(12)]
    groups = kv_cache_groups(gemma3)
    assert [g.window for g in groups] == [None] + [1024] * 5
    assert groups[0].layers == (5, 11)
    assert groups[1].layers == (0, 1) and groups[5].layers == (9, 10)
    assert layer_groups(groups)[11] == (0, 1) and layer_groups(groups)[4] == (3, 0)
    # Alternating (Gemma 2, gpt-oss): two groups of half the layers.
    assert [len(g.layers) for g in kv_cache_groups([4096, None] * 4)] == [4, 4]
    # One kind: one group, as before (every layer sliding keeps its window).
    assert kv_cache_groups([None] * 3) == [KVCacheGroup((0, 1, 2))]
    assert kv_cache_groups([64] * 3) == [KVCacheGroup((0, 1, 2), 64)]
    # Counts without a common divisor past 1: groups of one layer.
    assert len(kv_cache_groups([None, 64, 64])) == 3


def test_a_pool_counts_each_groups_peak() -> None:
    groups = [KVCacheGroup((0,)), KVCacheGroup((1,), 8), KVCacheGroup((2,), 8)]
    # 100 tokens: 25 blocks in the full group; a window of 8 before a chunk of 16, and a
    # block of alignment: 7 blocks in each sliding group.
    assert pool_blocks_needed(groups, 100, BS, 16) == 25 + 2 * 7
    assert pool_blocks_needed(groups, 8, BS, 16) == 3 * 2  # shorter than any window
    with pytest.raises(ValueError, match=r"needs 39 KV blocks of 4 tokens over its 3 KV groups"):
        KVCacheManager(CacheConfig(block_size=BS), 38, 100, groups, max_chunk_tokens=16)


def _manager(num_blocks: int, window: int = 8) -> KVCacheManager:
    groups = [KVCacheGroup((0,)), KVCacheGroup((1,), window)]
    return KVCacheManager(CacheConfig(block_size=BS, enable_prefix_caching=True), num_blocks,
                          max_model_len=64, groups=groups, max_chunk_tokens=8)


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=64, ignore_eos=True))


def _decode(kv: KVCacheManager, request: Request, steps: int) -> None:
    for _ in range(steps):
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        kv.commit_computed_blocks(request)
        request.append_output_token(7)


def test_a_sliding_group_gives_back_what_its_window_passed() -> None:
    kv = _manager(num_blocks=40)
    a = _request("a", list(range(8)))
    assert kv.allocate_slots(a, 8, admission=True)
    a.num_computed_tokens = 8
    kv.commit_computed_blocks(a)
    a.append_output_token(7)
    _decode(kv, a, 32)  # 41 tokens known, 40 computed: 10 blocks of positions
    full, sliding = kv.req_blocks["a"]
    assert len(full) == len(sliding) == 10 and all(b is not None for b in full)
    # Blocks go back when the table grows: the decode at position 36 started block 9 and
    # saw keys 29..36, so blocks 0-6 went back (the last decode, at 39, sees 32..39).
    assert sliding[:7] == [None] * 7 and all(b is not None for b in sliding[7:])
    assert kv.num_held_blocks("a") == 10 + 3
    assert kv.num_free_blocks == 40 - 13
    # What went back serves another request.
    b = _request("b", list(range(100, 160)))
    assert kv.allocate_slots(b, 8, admission=True)
    kv.check_invariants()
    # A rolled-back step's tail goes back in both groups.
    before = kv.num_blocks_of("a")
    a.append_output_token(7)
    a.append_output_token(7)
    a.append_output_token(7)
    assert kv.allocate_slots(a, 4)
    tail = kv.block_ids_from("a", before)
    assert [len(ids) for ids in tail] == [1, 1]
    kv.release_tail(a, tail)
    assert kv.num_blocks_of("a") == before
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 40
    kv.check_invariants()


def test_a_prefix_hit_needs_only_what_the_window_reaches() -> None:
    kv = _manager(num_blocks=40)
    a = _request("a", list(range(40)))
    for start in range(0, 40, 8):  # a prompt of 40 in chunks of 8
        assert kv.allocate_slots(a, 8, admission=start == 0)
        a.num_computed_tokens += 8
        kv.commit_computed_blocks(a)
    assert kv.req_blocks["a"][1][:6] == [None] * 6  # the window passed them by position 32
    kv.free(a)
    # The same 40 tokens and more: the full group hits every block, the sliding one the two its
    # window reaches from position 40 (keys 33..39: blocks 8 and 9).
    b = _request("b", list(range(40)) + [1, 2, 3])
    hits, tokens = kv.get_computed_blocks(b)
    assert tokens == 40
    full, sliding = hits
    assert len(full) == len(sliding) == 10 and all(block is not None for block in full)
    assert sliding[:8] == [None] * 8 and all(block is not None for block in sliding[8:])
    assert kv.allocate_slots(b, 3, 40, hits, admission=True)
    assert kv.prefix_cache_hits == 40
    kv.check_invariants()
    kv.free(b)
    # Where the window's last block is no longer cached (evicted), the hit stops where the
    # sliding group still has what the window reaches: 36 tokens (blocks 7 and 8).
    evicted = kv._cached(1, b.block_hashes[9])
    assert evicted is not None and evicted.ref_count == 0
    kv.pool.free_queue.remove(evicted)
    kv.pool._evict_hash(evicted)
    kv.pool.free_queue.appendleft(evicted)
    c = _request("c", list(range(40)) + [1, 2, 3])
    hits, tokens = kv.get_computed_blocks(c)
    assert tokens == 36 and len(hits[0]) == 9 and hits[1][:7] == [None] * 7
    assert kv._cached(0, b.block_hashes[9]) is not None  # the full group still had it
    kv.check_invariants()
