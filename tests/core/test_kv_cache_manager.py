"""KVCacheManager: block tables, the watermark, chained prefix hashes, commit-after-completion."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_manager(num_blocks: int = 8, *, watermark: float = 0.0, prefix: bool = True) -> KVCacheManager:
    cfg = CacheConfig(block_size=BS, num_blocks=num_blocks, watermark=watermark, enable_prefix_caching=prefix)
    return KVCacheManager(cfg, num_blocks, max_model_len=num_blocks * BS)


def make_request(req_id: str, tokens: list[int]) -> Request:
    return Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=4))


def compute(kv: KVCacheManager, req: Request, n: int, **kwargs: object) -> list[int] | None:
    """Schedule-and-complete ``n`` tokens the way the scheduler does."""
    if not kv.allocate_slots(req, n, **kwargs):  # type: ignore[arg-type]
        return None
    req.num_computed_tokens += n
    kv.commit_computed_blocks(req)
    return kv.get_block_ids(req.request_id)


def test_refuses_max_model_len_that_cannot_fit() -> None:
    cfg = CacheConfig(block_size=16, num_blocks=4)
    KVCacheManager(cfg, 4, max_model_len=64)
    with pytest.raises(ValueError, match=r"max_model_len=65 needs 5 KV blocks of 16 tokens, but the pool has only 4 blocks"):
        KVCacheManager(cfg, 4, max_model_len=65)


def test_allocate_slots_grows_block_table() -> None:
    kv = make_manager()
    req = make_request("a", list(range(6)))
    assert compute(kv, req, 6) == [0, 1]
    # Positions 6 and 7 fit in block 1; position 8 needs a new block.
    for t in (6, 7, 8):
        req.append_output_token(t)
    assert compute(kv, req, 2) == [0, 1]
    assert kv.allocate_slots(req, 1) and kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.check_invariants()


def test_allocate_slots_failure_changes_nothing() -> None:
    kv = make_manager(num_blocks=4)
    a, b = make_request("a", list(range(12))), make_request("b", list(range(8)))
    assert compute(kv, a, 12) == [0, 1, 2]
    queries = kv.prefix_cache_queries
    assert kv.allocate_slots(b, 8, admission=True) is False
    assert kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.prefix_cache_queries == queries
    kv.check_invariants()


def test_watermark_holds_back_admissions_only_while_something_runs() -> None:
    kv = make_manager(num_blocks=10, watermark=0.2)  # 2 blocks reserved
    assert kv.watermark_blocks == 2
    a = make_request("a", list(range(28)))
    # An idle engine admits even into the reserve.
    assert compute(kv, a, 28, admission=True, num_running=0) is not None
    assert kv.num_free_blocks == 3
    b = make_request("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8, admission=True, num_running=1) is False
    c = make_request("c", list(range(200, 204)))
    assert kv.allocate_slots(c, 4, admission=True, num_running=1) is True
    # A running request may take the very last blocks.
    a.append_output_token(1)
    assert kv.allocate_slots(a, 1) is True
    a.num_computed_tokens += 1
    for _ in range(4):
        a.append_output_token(1)
    assert kv.allocate_slots(a, 5) is True
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_block_hashes_are_chained_and_lazy() -> None:
    kv = make_manager()
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8])
    kv.update_block_hashes(a)
    kv.update_block_hashes(b)
    assert len(a.block_hashes) == 2 and len(b.block_hashes) == 2
    # Identical second blocks, different prefixes: different hashes.
    assert a.block_hashes[1] != b.block_hashes[1]
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7, 8])
    kv.update_block_hashes(c)
    assert c.block_hashes == a.block_hashes
    for t in (10, 11, 12):
        a.append_output_token(t)
    kv.update_block_hashes(a)
    assert len(a.block_hashes) == 3


def test_prefix_hit_only_after_commit_and_never_whole_sequence() -> None:
    kv = make_manager()
    prompt = list(range(10))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 10, admission=True) is True
    a.num_computed_tokens = 10
    # Written but not yet committed: no hit.
    assert kv.get_computed_blocks(make_request("x", prompt)) == ([], 0)
    kv.commit_computed_blocks(a)
    (blocks,), n = kv.get_computed_blocks(make_request("y", prompt + [99]))
    assert n == 8 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]
    # A sequence made only of cached blocks keeps its last block to compute.
    (blocks,), n = kv.get_computed_blocks(make_request("z", prompt[:8]))
    assert n == 4 and len(blocks) == 1


def test_commit_only_full_computed_blocks() -> None:
    kv = make_manager()
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is True
    a.num_computed_tokens = 12
    kv.commit_computed_blocks(a, num_computed_tokens=6)
    assert [b.block_hash is not None for b in kv.req_blocks["a"][0]] == [True, False, False]
    kv.commit_computed_blocks(a)
    assert all(b.block_hash is not None for b in kv.req_blocks["a"][0])
    kv.check_invariants()


def test_hits_counted_in_tokens_at_admission_and_shared_blocks() -> None:
    kv = make_manager(num_blocks=6)
    prompt = list(range(9))
    a = make_request("a", prompt)
    blocks, n = kv.get_computed_blocks(a)
    assert n == 0
    assert compute(kv, a, 9, admission=True) is not None
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (9, 0)
    b = make_request("b", prompt + [50, 51])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    # Lookups alone count nothing; the admission that uses them does.
    assert kv.prefix_cache_queries == 9
    assert kv.allocate_slots(b, b.num_tokens - n, n, blocks, admission=True)
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    assert [blk.ref_count for blk in blocks[0]] == [2, 2]
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 6
    kv.check_invariants()


def test_hit_on_free_cached_block_consumes_free_capacity() -> None:
    kv = make_manager(num_blocks=4)
    prompt = list(range(8))
    a = make_request("a", prompt)
    assert compute(kv, a, 8) is not None
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request("b", prompt + list(range(100, 108)))
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8
    # 2 revived + 2 new = 4 blocks: fits exactly; one more block would not.
    assert kv.num_blocks_to_allocate(b, 16, blocks) == 4
    assert not kv.can_allocate(b, 17, blocks)
    assert kv.allocate_slots(b, 9, n, blocks) is False
    assert kv.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in blocks[0])
    assert kv.allocate_slots(b, 8, n, blocks) is True
    assert kv.num_free_blocks == 0
    kv.check_invariants()


def test_prefix_caching_disabled() -> None:
    kv = make_manager(prefix=False)
    a = make_request("a", list(range(9)))
    assert compute(kv, a, 9, admission=True) is not None
    assert all(b.block_hash is None for b in kv.req_blocks["a"][0])
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_recompute_after_free_recommits() -> None:
    kv = make_manager(num_blocks=3)
    a = make_request("a", list(range(8)))
    assert compute(kv, a, 8) is not None
    kv.free(a)
    a.num_computed_tokens = 0
    # Fill the pool so that a's cached blocks get evicted, then recompute a from scratch.
    filler = make_request("f", list(range(50, 62)))
    assert compute(kv, filler, 12) is not None
    kv.free(filler)
    assert compute(kv, a, 8) is not None
    assert all(b.block_hash is not None for b in kv.req_blocks["a"][0])
    kv.check_invariants()
