"""Per-request block tables on top of the block pool, with automatic prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.core.block_pool import BlockPool, KVBlock
from engine.config import CacheConfig
from engine.core.long_rope import LONG_ROPE_ROOT_HASH
from engine.core.request import Request

# Parent of a request's first block: it only seeds the chain.
ROOT_HASH = bytes(32)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (8 bytes each).

    Chaining makes a block's hash stand for the whole prefix up to it. A cryptographic hash
    because a hit hands out another request's KV: with Python's 64-bit ``hash()`` a client could
    craft a prompt whose blocks collide with someone else's prefix and read what follows it (vLLM
    moved to sha256 for the same reason). Fixed-width ids keep [1, 2] and [258] apart.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    """Owns which blocks each request holds; the scheduler only sees block ids.

    A block's hash is committed only after the step that wrote it completed
    (``commit_computed_blocks``), so a prefix-cache hit never points at KV of a forward pass that
    may still be abandoned.
    """

    def __init__(self, cache_config: CacheConfig, num_blocks: int, max_model_len: int) -> None:
        self.block_size = cache_config.block_size
        if cdiv(max_model_len, self.block_size) > num_blocks:
            raise ValueError(
                f"max_model_len={max_model_len} needs {cdiv(max_model_len, self.block_size)} KV blocks "
                f"of {self.block_size} tokens, but the pool has only {num_blocks} blocks; lower "
                f"max_model_len to at most {num_blocks * self.block_size} or give the KV cache more memory"
            )
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = int(cache_config.watermark * num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request have been through commit (hashed or skipped).
        self._num_committed: dict[str, int] = {}
        # How many leading blocks of each request's table the workers hold (sent in earlier
        # steps and not given back since): a step sends only the rest (``table_update``).
        self._num_sent: dict[str, int] = {}
        # Requests whose blocks were all freed since the last step the workers were sent: they
        # drop their copies of the tables (``take_released``).
        self.released: list[str] = []
        # In tokens: queried = tokens of admitted requests looked up, hit = tokens served from cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def block_ids_from(self, req_id: str, start: int) -> list[int]:
        """The ids of ``req_id``'s blocks from index ``start`` of its table on."""
        return [b.block_id for b in self.req_blocks.get(req_id, ())[start:]]

    def table_update(self, req_id: str) -> tuple[int, list[int]]:
        """What the workers need of ``req_id``'s block table for a step they will be sent:
        (the index they hold up to, the ids from there on). Counts the table as sent.

        The workers keep each request's table across steps (workers/block_tables.py), so a
        decode sends a block id only when it starts a new block, not its whole table (at 30k
        tokens of context, ~1900 ids a request a step). A table only grows at its end or loses
        blocks from its end (a rolled-back step's tail, ``release_tail``) or all of them
        (``free``), which is what keeps the prefix the workers hold valid."""
        blocks = self.req_blocks.get(req_id, ())
        start = min(self._num_sent.get(req_id, 0), len(blocks))
        self._num_sent[req_id] = len(blocks)
        return start, [b.block_id for b in blocks[start:]]

    def take_released(self) -> list[str]:
        released, self.released = self.released, []
        return released

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its tokens. The chain
        starts from its rotary regime's root: LongRoPE's long and short KV of the same tokens
        differ (engine.core.long_rope)."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        root = LONG_ROPE_ROOT_HASH if request.long_rope else ROOT_HASH
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest committed prefix of ``request`` in the cache: (blocks, number of tokens).

        Never the whole sequence: the last token must be computed to have logits to sample from.
        Pure lookup; stats are counted when an admission actually uses the result.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def num_blocks_to_allocate(
        self, request: Request, num_total_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> int:
        """Free-pool blocks that growing ``request`` to ``num_total_tokens`` would consume."""
        num_held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        num_new = max(0, cdiv(num_total_tokens, self.block_size) - num_held)
        # A cache hit on a free block takes it out of the free queue just like a fresh block does.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_count == 0)
        return num_new + num_revived

    def can_allocate(
        self,
        request: Request,
        num_total_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        *,
        admission: bool = False,
        num_running: int = 0,
    ) -> bool:
        """Whether ``request`` can hold ``num_total_tokens`` tokens' worth of blocks.

        The watermark reserve only holds back admissions while something runs: a running request
        may take the last blocks (the alternative is preempting someone), and an idle engine must
        always be able to admit, or nothing would ever run.
        """
        reserve = self.watermark_blocks if admission and num_running > 0 else 0
        needed = self.num_blocks_to_allocate(request, num_total_tokens, new_computed_blocks)
        return needed <= self.pool.num_free_blocks - reserve

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVBlock] = (),
        *,
        admission: bool = False,
        num_running: int = 0,
    ) -> bool:
        """Grow ``request``'s block table to hold its computed tokens, the cache hits and
        ``num_new_tokens`` more. False (changing nothing) when the pool cannot provide the
        blocks. Runs for every scheduled request of every step: a decode whose table already
        covers its next token returns at once.
        """
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        held = self.req_blocks.get(request.request_id)
        if held and not new_computed_blocks and len(held) * self.block_size >= num_total:
            return True
        if not self.can_allocate(
            request, num_total, new_computed_blocks, admission=admission, num_running=num_running
        ):
            return False
        req_id = request.request_id
        blocks = self.req_blocks.setdefault(req_id, [])
        if not blocks:
            # A recompute starts the commit cursor again: the new blocks have not been committed.
            self._num_committed[req_id] = 0
        if admission and request.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        num_new_blocks = cdiv(num_total, self.block_size) - len(blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.allocate(num_new_blocks))
        return True

    def commit_computed_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Commit the hashes of ``request``'s full blocks whose KV is now computed.

        Call only once the step that computed them completed. ``num_computed_tokens`` is how far
        that step computed (defaults to the request's counter, which the scheduler advances at
        schedule time and so may already include a later step that has not completed).
        """
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        start = self._num_committed.get(req_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            self.pool.commit_hash(blocks[i], request.block_hashes[i])
        self._num_committed[req_id] = num_full

    def release_tail(self, request: Request, block_ids: Sequence[int]) -> None:
        """Give back the blocks a rolled-back step appended to ``request``'s table (its tail)."""
        if not block_ids:
            return
        blocks = self.req_blocks[request.request_id]
        tail = blocks[len(blocks) - len(block_ids):]
        assert [b.block_id for b in tail] == list(block_ids), "not the tail of the block table"
        del blocks[len(blocks) - len(block_ids):]
        self.pool.free(tail)
        req_id = request.request_id
        if req_id in self._num_sent:
            self._num_sent[req_id] = min(self._num_sent[req_id], len(blocks))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_committed.pop(request.request_id, None)
        self.pool.free(blocks)
        if self._num_sent.pop(request.request_id, None) is not None:
            self.released.append(request.request_id)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for req_id, blocks in self.req_blocks.items():
            assert len({b.block_id for b in blocks}) == len(blocks), f"{req_id} holds a block twice"
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count={block.ref_count} but held by "
                f"{refs.get(block.block_id, 0)} requests"
            )
