"""Per-request block tables on top of the block pool, with automatic prefix caching; one table
per KV cache group (engine.core.kv_groups), a sliding group's letting go of the blocks its window
has passed."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.core.block_pool import BlockPool, KVBlock
from engine.config import CacheConfig
from engine.core.kv_groups import KVCacheGroup, cdiv, pool_blocks_needed
from engine.core.long_rope import LONG_ROPE_ROOT_HASH
from engine.core.request import Request

# Parent of a request's first block: it only seeds the chain.
ROOT_HASH = bytes(32)


# One table per group: entry i holds positions [i * block_size, (i + 1) * block_size); a
# sliding group's entries before its window are None (given back, or never held).
GroupTables = list[list[KVBlock | None]]
# A table entry the workers are sent for a block not held: never read (a window's kernels start
# at its first block).
UNHELD_BLOCK_ID = 0


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (8 bytes each).

    Chaining makes a block's hash stand for the whole prefix up to it. A cryptographic hash
    because a hit hands out another request's KV: with Python's 64-bit ``hash()`` a client could
    craft a prompt whose blocks collide with someone else's prefix and read what follows it (vLLM
    moved to sha256 for the same reason). Fixed-width ids keep [1, 2] and [258] apart.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class KVCacheManager:
    """Owns which blocks each request holds, in each KV cache group; the scheduler only sees
    block ids.

    A block's hash is committed only after the step that wrote it completed
    (``commit_computed_blocks``), so a prefix-cache hit never points at KV of a forward pass that
    may still be abandoned. Each group's blocks are cached under its own key (the token hash,
    the group's index appended past the first group): the same tokens' KV differs by layer.

    Every group's table of a request has the same length (a block position each); a sliding
    group gives back the blocks before its window when the table next grows, so that a
    rolled-back step, whose first token is where the window was measured from, still finds
    every block it needs.
    """

    def __init__(self, cache_config: CacheConfig, num_blocks: int, max_model_len: int,
                 groups: Sequence[KVCacheGroup] | None = None,
                 max_chunk_tokens: int | None = None) -> None:
        """``groups``: the model's KV cache groups (default: one group of full attention);
        ``max_chunk_tokens``: the most tokens one request computes in a step (the token
        budget), which bounds what a sliding group holds."""
        self.block_size = cache_config.block_size
        self.groups = list(groups) if groups else [KVCacheGroup(())]
        self.max_chunk_tokens = max_chunk_tokens or max_model_len
        needed = pool_blocks_needed(self.groups, max_model_len, self.block_size,
                                    self.max_chunk_tokens)
        if needed > num_blocks:
            per_group = "" if len(self.groups) == 1 else f" over its {len(self.groups)} KV groups"
            raise ValueError(
                f"max_model_len={max_model_len} needs {needed} KV blocks of {self.block_size} "
                f"tokens{per_group}, but the pool has only {num_blocks} blocks; lower "
                f"max_model_len or give the KV cache more memory")
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.watermark_blocks = int(cache_config.watermark * num_blocks)
        self.req_blocks: dict[str, GroupTables] = {}
        # Sliding groups' first live entry of each request's table (entries before it None).
        self._first_live: dict[str, list[int]] = {}
        self._sliding = [g for g, group in enumerate(self.groups) if group.window is not None]
        self._key_suffix = [b""] + [g.to_bytes(2, "big") for g in range(1, len(self.groups))]
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

    def num_blocks_of(self, req_id: str) -> int:
        """The length of ``req_id``'s tables (the same in every group)."""
        tables = self.req_blocks.get(req_id)
        return len(tables[0]) if tables else 0

    def num_held_blocks(self, req_id: str) -> int:
        """The blocks ``req_id`` holds, over every group."""
        return sum(b is not None for table in self.req_blocks.get(req_id, ()) for b in table)

    def get_block_ids(self, req_id: str, group: int = 0) -> list[int]:
        """``req_id``'s table in ``group`` (UNHELD_BLOCK_ID where it holds no block)."""
        tables = self.req_blocks.get(req_id)
        return _ids(tables[group]) if tables else []

    def block_ids_from(self, req_id: str, start: int) -> list[list[int]]:
        """Each group's ids of ``req_id``'s table from index ``start`` on."""
        return [_ids(table[start:]) for table in self.req_blocks.get(req_id, ())]

    def table_update(self, req_id: str) -> tuple[int, list[int], list[list[int]]]:
        """What the workers need of ``req_id``'s block tables for a step they will be sent:
        (the index they hold up to, the first group's ids from there on, the other groups'
        ids from there on). Counts the tables as sent.

        The workers keep each request's tables across steps (workers/block_tables.py), so a
        decode sends a block id only when it starts a new block, not its whole table (at 30k
        tokens of context, ~1900 ids a request a step). A table only grows at its end or loses
        blocks from its end (a rolled-back step's tail, ``release_tail``) or all of them
        (``free``), which is what keeps the prefix the workers hold valid; a sliding group's
        blocks given back before its window stay in the workers' copy, never read again."""
        tables = self.req_blocks.get(req_id)
        if not tables:
            self._num_sent[req_id] = 0
            return 0, [], [[] for _ in self.groups[1:]]
        first = tables[0]
        length = len(first)
        start = min(self._num_sent.get(req_id, 0), length)
        self._num_sent[req_id] = length
        if start == length:  # most decodes: nothing new
            return start, [], [[] for _ in tables[1:]] if len(tables) > 1 else []
        # The first group holds every block it was given (full attention, or one group).
        ids = ([b.block_id for b in first[start:]] if self.groups[0].window is None
               else _ids(first[start:]))
        return start, ids, [_ids(table[start:]) for table in tables[1:]]

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

    def _cached(self, group: int, block_hash: bytes) -> KVBlock | None:
        return self.pool.get_cached_block(block_hash + self._key_suffix[group])

    def get_computed_blocks(self, request: Request) -> tuple[GroupTables, int]:
        """Longest committed prefix of ``request`` in the cache: (each group's blocks of it,
        number of tokens); ([], 0) when there is none.

        A full group needs every block of the prefix; a sliding group only those its window
        reaches from the prefix's end (the others are None in its list). Never the whole
        sequence: the last token must be computed to have logits to sample from. Pure lookup;
        stats are counted when an admission actually uses the result.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        self.update_block_hashes(request)
        bs = self.block_size
        hashes = request.block_hashes[:(request.num_tokens - 1) // bs]
        found: GroupTables = []
        length = len(hashes)
        for g, group in enumerate(self.groups):
            blocks: list[KVBlock | None] = []
            for block_hash in hashes[:length]:
                block = self._cached(g, block_hash)
                if block is None and group.window is None:
                    break  # a full group's hit ends at its first miss
                blocks.append(block)
            if group.window is None:
                length = len(blocks)
            found.append(blocks)
        # The longest prefix whose every sliding group holds the blocks its window reaches.
        while length > 0 and not all(
                all(b is not None for b in found[g][self.groups[g].first_needed_block(
                    length * bs, bs):length]) for g in self._sliding):
            length -= 1
        if length == 0:
            return [], 0
        hits: GroupTables = []
        for g, group in enumerate(self.groups):
            first = group.first_needed_block(length * bs, bs)
            hits.append([None] * first + found[g][first:length])
        return hits, length * bs

    def num_blocks_to_allocate(
        self, request: Request, num_total_tokens: int, new_computed_blocks: GroupTables = ()
    ) -> int:
        """Free-pool blocks that growing ``request`` to ``num_total_tokens`` would consume,
        less the sliding groups' blocks it would give back (a full-sequence estimate counts a
        sliding group's blocks up to its peak: engine.core.kv_groups)."""
        tables = self.req_blocks.get(request.request_id)
        length = (len(tables[0]) if tables else 0) + (
            len(new_computed_blocks[0]) if new_computed_blocks else 0)
        computed = request.num_computed_tokens + (
            len(new_computed_blocks[0]) * self.block_size if new_computed_blocks else 0)
        bs, end = self.block_size, cdiv(num_total_tokens, self.block_size)
        needed = 0
        for g, group in enumerate(self.groups):
            if group.window is None:
                needed += max(0, end - length)
                continue
            first = group.first_needed_block(computed, bs)
            needed += min(max(0, end - max(length, first)),
                          cdiv(group.window - 1 + self.max_chunk_tokens, bs) + 1)
            if tables:
                table = tables[g]
                live = self._first_live[request.request_id][g]
                needed -= sum(1 for b in table[live:first] if b is not None and b.ref_count == 1)
        # A cache hit on a free block takes it out of the free queue just like a fresh block does.
        revived = sum(1 for blocks in new_computed_blocks for b in blocks
                      if b is not None and b.ref_count == 0)
        return needed + revived

    def can_allocate(
        self,
        request: Request,
        num_total_tokens: int,
        new_computed_blocks: GroupTables = (),
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
        new_computed_blocks: GroupTables = (),
        *,
        admission: bool = False,
        num_running: int = 0,
    ) -> bool:
        """Grow ``request``'s block tables to hold its computed tokens, the cache hits and
        ``num_new_tokens`` more, the sliding groups first giving back the blocks before their
        windows. False (changing nothing) when the pool cannot provide the blocks. Runs for
        every scheduled request of every step: a decode whose tables already cover its next
        token returns at once.
        """
        bs = self.block_size
        assert num_new_computed_tokens == (len(new_computed_blocks[0]) * bs
                                           if new_computed_blocks else 0)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_id = request.request_id
        tables = self.req_blocks.get(req_id)
        if tables and not new_computed_blocks and len(tables[0]) * bs >= num_total:
            return True
        if not self.can_allocate(
            request, num_total, new_computed_blocks, admission=admission, num_running=num_running
        ):
            return False
        if not tables:
            tables = self.req_blocks[req_id] = [[] for _ in self.groups]
            self._first_live[req_id] = [0] * len(self.groups)
            # A recompute starts the commit cursor again: the new blocks have not been committed.
            self._num_committed[req_id] = 0
        if admission and request.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_new_computed_tokens
        if new_computed_blocks:
            for g, blocks in enumerate(new_computed_blocks):
                self.pool.touch([b for b in blocks if b is not None])
                tables[g].extend(blocks)
        computed = request.num_computed_tokens + num_new_computed_tokens
        # Every sliding group gives back first, so that any group's allocation may take them.
        firsts = {g: self.groups[g].first_needed_block(computed, bs) for g in self._sliding}
        for g, first in firsts.items():
            self._give_back_passed(req_id, g, first)
        end = cdiv(num_total, bs)
        for g, table in enumerate(tables):
            first = firsts.get(g, 0)
            if len(table) < first:  # positions its window passed before it held them
                table.extend([None] * (first - len(table)))
            if end > len(table):
                table.extend(self.pool.allocate(end - len(table)))
        return True

    def _give_back_passed(self, req_id: str, group: int, first_needed: int) -> None:
        """Free ``req_id``'s blocks of sliding ``group`` before block ``first_needed``."""
        table = self.req_blocks[req_id][group]
        first_live = self._first_live[req_id]
        start = first_live[group]
        end = min(first_needed, len(table))
        if end <= start:
            return
        passed = [b for b in table[start:end] if b is not None]
        table[start:end] = [None] * (end - start)
        first_live[group] = end
        self.pool.free(passed)

    def commit_computed_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Commit the hashes of ``request``'s full blocks whose KV is now computed.

        Call only once the step that computed them completed. ``num_computed_tokens`` is how far
        that step computed (defaults to the request's counter, which the scheduler advances at
        schedule time and so may already include a later step that has not completed).
        """
        if not self.enable_prefix_caching:
            return
        req_id = request.request_id
        tables = self.req_blocks.get(req_id)
        if not tables or not tables[0]:
            return
        if num_computed_tokens is None:
            num_computed_tokens = request.num_computed_tokens
        num_full = min(num_computed_tokens // self.block_size, len(tables[0]))
        start = self._num_committed.get(req_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        hashes = request.block_hashes
        for g, table in enumerate(tables):
            suffix = self._key_suffix[g]
            for i in range(start, num_full):
                block = table[i]
                if block is not None:  # a sliding group's block given back is not cached
                    self.pool.commit_hash(block, hashes[i] + suffix, recent=g == 0)
        self._num_committed[req_id] = num_full

    def release_tail(self, request: Request, block_ids: Sequence[Sequence[int]]) -> None:
        """Give back the blocks a rolled-back step appended to ``request``'s tables (their
        tails, one list of ids per group as ``block_ids_from`` gave them)."""
        count = len(block_ids[0]) if block_ids else 0
        if not count:
            return
        req_id = request.request_id
        tables = self.req_blocks[req_id]
        for table, ids in zip(tables, block_ids):
            tail = table[len(table) - count:]
            assert _ids(tail) == list(ids), "not the tail of the block table"
            del table[len(table) - count:]
            self.pool.free([b for b in tail if b is not None])
        first_live = self._first_live[req_id]
        for g in self._sliding:
            first_live[g] = min(first_live[g], len(tables[g]))
        if req_id in self._num_sent:
            self._num_sent[req_id] = min(self._num_sent[req_id], len(tables[0]))

    def free(self, request: Request) -> None:
        tables = self.req_blocks.pop(request.request_id, [])
        self._first_live.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        for table in tables:
            self.pool.free([b for b in table if b is not None])
        if self._num_sent.pop(request.request_id, None) is not None:
            self.released.append(request.request_id)

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for req_id, tables in self.req_blocks.items():
            assert len({len(table) for table in tables}) == 1, f"{req_id}'s tables differ in length"
            held = [b for table in tables for b in table if b is not None]
            assert len({b.block_id for b in held}) == len(held), f"{req_id} holds a block twice"
            for g, table in enumerate(tables):
                if self.groups[g].window is None:
                    assert all(b is not None for b in table), f"{req_id}: a hole in full group {g}"
                else:
                    live = self._first_live[req_id][g]
                    assert all(b is None for b in table[:live]), f"{req_id}: group {g} below its window"
            for b in held:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count={block.ref_count} but held by "
                f"{refs.get(block.block_id, 0)} requests"
            )


def _ids(blocks: Sequence[KVBlock | None]) -> list[int]:
    return [UNHELD_BLOCK_ID if b is None else b.block_id for b in blocks]
