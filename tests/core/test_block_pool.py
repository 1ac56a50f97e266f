"""BlockPool: reference counts, LRU free queue with removal from the middle, committed-hash map."""

from __future__ import annotations

import random

import pytest

from engine.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_append_popleft_remove() -> None:
    blocks = [KVBlock(block_id=i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert not blocks[2].in_free_queue
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    q.remove(blocks[4])
    q.remove(blocks[0])
    assert [b.block_id for b in q] == [1, 3] and len(q) == 2
    q.popleft()
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0


def test_allocate_and_free_counts() -> None:
    pool = BlockPool(8)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 5 and pool.usage == pytest.approx(3 / 8)
    pool.check_invariants()
    pool.free(blocks)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0
    pool.check_invariants()


def test_allocate_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_free_is_tail_first_so_tail_blocks_are_evicted_first() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        assert pool.commit_hash(b, 100 + i)
    pool.free(blocks)
    # Never-used blocks first, then the request's blocks from its tail to its head.
    assert free_ids(pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    reused = pool.allocate(5)
    assert [b.block_id for b in reused] == [4, 5, 6, 7, 3]
    # Reusing block 3 evicted its prefix; the head blocks of the prefix stay cached.
    assert pool.get_cached_block(103) is None and blocks[3].block_hash is None
    assert [pool.get_cached_block(100 + i) for i in range(3)] == blocks[:3]
    pool.check_invariants()


def test_unhashed_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.commit_hash(blocks[0], 7)
    pool.free(blocks)
    assert free_ids(pool)[-1] == 0
    assert pool.allocate(3)[0].block_id != 0
    assert pool.get_cached_block(7) is blocks[0]
    pool.check_invariants()


def test_touch_revives_cached_free_block_from_the_middle() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.commit_hash(b, 10 + i)
    pool.free(blocks)
    hit = pool.get_cached_block(11)
    assert hit is blocks[1] and hit.ref_count == 0 and hit.in_free_queue
    pool.touch([hit])
    assert hit.ref_count == 1 and not hit.in_free_queue
    assert pool.num_free_blocks == 5 and 1 not in free_ids(pool)
    pool.check_invariants()
    # allocate never hands out a touched block, and the hit keeps its hash.
    others = pool.allocate(5)
    assert hit not in others and pool.get_cached_block(11) is hit
    pool.check_invariants()


def test_shared_block_stays_owned_until_last_reference() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.commit_hash(b, 1)
    pool.touch([b])
    assert b.ref_count == 2
    pool.free([b])
    assert b.ref_count == 1 and not b.in_free_queue
    pool.free([b])
    assert b.ref_count == 0 and b.in_free_queue
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_commit_hash_duplicate_and_rehash() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.commit_hash(a, 5)
    # Same content computed twice in one step: the first copy wins, the second stays private.
    assert not pool.commit_hash(b, 5)
    assert b.block_hash is None and pool.get_cached_block(5) is a
    assert not pool.commit_hash(a, 5)
    with pytest.raises(AssertionError):
        pool.commit_hash(a, 6)
    pool.check_invariants()


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.blocks[0].ref_count = 1  # owned yet still in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool = BlockPool(3)
    pool.blocks[1].block_hash = 42  # hashed but not in the map
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_random_operations_keep_invariants() -> None:
    rng = random.Random(0)
    pool = BlockPool(16)
    owned: list[list[KVBlock]] = []
    next_hash = 0
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            owned.append(pool.allocate(rng.randint(1, pool.num_free_blocks)))
        elif op < 0.6 and owned:
            seq = rng.choice(owned)
            for b in seq:
                if b.block_hash is None and rng.random() < 0.5:
                    pool.commit_hash(b, next_hash)
                    next_hash += 1
        elif op < 0.75 and pool.cached_blocks:
            hit = pool.get_cached_block(rng.choice(list(pool.cached_blocks)))
            assert hit is not None
            pool.touch([hit])
            owned.append([hit])
        elif owned:
            pool.free(owned.pop(rng.randrange(len(owned))))
        pool.check_invariants()
    for seq in owned:
        pool.free(seq)
    pool.check_invariants()
    assert pool.num_free_blocks == 16
