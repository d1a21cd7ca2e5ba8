"""BlockPool: the KV cache blocks, their free queue and the prefix-cache hash map.

Every block is in exactly one of these states:

    in use     ref_cnt > 0, not in the free queue
    free       ref_cnt == 0, in the free queue; it may still carry a block_hash,
               in which case it is also in `cached_block_hash_to_block` and a
               prefix hit can take it back out of the queue (`touch`)

The free queue is in least-recently-freed order: `get_new_blocks` takes from the
head, and a block taken that still has a hash is evicted from the map first.
Requests free their blocks tail first, so a sequence's last blocks are evicted
before its first ones (those are the ones other prompts share).
"""

from __future__ import annotations

from typing import Iterable, Optional


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None
        # Links of the doubly linked free queue (None when not in it).
        self.prev_free: Optional[KVCacheBlock] = None
        self.next_free: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks: O(1) pop from the head, append at the
    tail and removal from the middle (a prefix hit on a free cached block)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels keep every real block's links non-None while it is queued.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Front (evicted first) to back; for tests and debugging."""
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Prefix-cache statistics (queries and hits are counted in tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> Optional[KVCacheBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks: {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Register a full block under its hash (first block wins on a duplicate)."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue's tail in order."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached_block_hash_to_block.values()):
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
