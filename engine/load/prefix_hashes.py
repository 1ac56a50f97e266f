"""The prefix-block hashes the router compares: the engine's own chain hashes, truncated."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from engine.core.kv_cache_manager import ROOT_HASH, hash_block_tokens


def short_hash(block_hash: bytes) -> int:
    """The first 8 bytes of a block's chain hash: what a replica reports and the router matches
    (a collision costs at worst a worse tie-break, never a wrong output)."""
    return int.from_bytes(block_hash[:8], "big")


def prompt_prefix_hashes(token_ids: Sequence[int], block_size: int,
                         max_blocks: int | None = None) -> list[int]:
    """Short chain hashes of the full blocks of a prompt, as the engine would hash them."""
    hashes: list[int] = []
    parent = ROOT_HASH
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    for i in range(full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(short_hash(parent))
    return hashes


def cached_prompt_blocks(token_ids: Sequence[int], block_size: int,
                         cached: Collection[int]) -> int:
    """How many leading full blocks of a prompt are among `cached` (short hashes, as a report
    carries them), hashing only as far as they match: a prompt that misses at its first block
    costs one hash, however long it is."""
    parent = ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        if short_hash(parent) not in cached:
            return i
    return len(token_ids) // block_size


def cached_prefix_blocks(prompt_hashes: Sequence[int], cached: Iterable[int]) -> int:
    """How many leading blocks of a prompt a replica holds (its prefix-cache hit, in blocks)."""
    have = cached if isinstance(cached, (set, frozenset)) else set(cached)
    hit = 0
    for h in prompt_hashes:
        if h not in have:
            break
        hit += 1
    return hit
