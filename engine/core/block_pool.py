"""A fixed pool of paged-KV blocks with an LRU free queue and a prefix-cache hash map.

A free block may still hold the KV of a committed prefix (it keeps its ``block_hash``); it stays
findable through the hash map until ``allocate`` hands it out again, so a prefix-cache hit can pull
it back out of the middle of the free queue. That is why the queue is an intrusive doubly-linked list
rather than a deque.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # Chained hash of the tokens this block holds; set only once the step that wrote it completed.
    block_hash: bytes | None = None
    # Links of the free queue; both None while the block is not in the queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Free blocks, head evicted first. O(1) append, appendleft, popleft and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        # Sentinels spare every operation the empty-list and end-of-list special cases.
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        assert not block.in_free_queue, f"block {block.block_id} is already free"
        nxt = prev.next_free
        assert nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Most recently used end: evicted last."""
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Evicted first."""
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block


class BlockPool:
    """Owns every KV block: reference counts, the free queue and the committed-hash map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}
        # The committed hashes again, most recently committed or reused last: a load report
        # tells the fleet's router the newest few thousand (engine.runtime.load_report). Kept
        # in order where a hash is committed, reused or evicted, so that a report never scans
        # the pool.
        self.recent_hashes: dict[bytes, None] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out, including cached ones it would evict."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the LRU end, dropping any prefix they still cached."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_count == 0
            self._evict_hash(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference to (cached) blocks, reviving them if they were free."""
        recent = self.recent_hashes
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
            if block.block_hash in recent:  # a prefix-cache hit: its chain is in use again
                del recent[block.block_hash]
                recent[block.block_hash] = None

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference to each of a request's blocks, given in block-table order.

        They are released tail-first so that a request's last blocks are evicted before its first:
        a prefix is far more likely to be shared than a suffix. Blocks holding no committed hash go
        to the front of the queue, since reusing them throws away no cached prefix.
        """
        for block in reversed(blocks):
            assert block.ref_count > 0, f"double free of block {block.block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def commit_hash(self, block: KVBlock, block_hash: bytes, recent: bool = True) -> bool:
        """Make ``block`` findable by ``block_hash``. Returns False when it is not (re)committed.

        Two requests that computed the same prefix in one step both try to commit it; the first wins
        and the second block simply stays uncached (it is freed like any private block). ``recent``
        false keeps it out of ``recent_hashes`` (a KV cache group's key past the first: the fleet's
        router reads the token hashes).
        """
        assert block.ref_count > 0, f"committing a hash to free block {block.block_id}"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, f"block {block.block_id} re-hashed differently"
            return False
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if recent:
            self.recent_hashes[block_hash] = None
        return True

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            self.recent_hashes.pop(block.block_hash, None)
            block.block_hash = None

    def newest_hashes(self, limit: int) -> list[bytes]:
        """The hashes of the `limit` most recently committed or reused cached blocks, most
        recent last. Safe from another thread while the engine thread commits or evicts:
        the copy runs in C under the GIL, and is retried in the unlikely case that a thread
        switch inside it (a finalizer) let the map change."""
        for _ in range(8):
            try:
                newest = list(islice(reversed(self.recent_hashes), limit))
            except RuntimeError:  # changed size during the copy
                continue
            newest.reverse()
            return newest
        return []

    def check_invariants(self) -> None:
        in_queue = list(self.free_queue)
        assert len(in_queue) == len(self.free_queue) == self.num_free_blocks
        assert len({b.block_id for b in in_queue}) == len(in_queue), "block twice in the free queue"
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert block.in_free_queue == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count={block.ref_count}, in_free_queue={block.in_free_queue}"
            )
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, (
                    f"hashed block {block.block_id} missing from the hash map"
                )
        assert sum(b.ref_count == 0 for b in self.blocks) == self.num_free_blocks
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, f"hash map entry for block {block.block_id} is stale"
        assert self.recent_hashes.keys() <= self.cached_blocks.keys(), (
            "a recently cached hash is not committed")
