"""KVCacheManager: which KV blocks each request holds, and prefix-cache lookups.

A request's blocks cover its tokens in order: block i holds the KV of tokens
[i * block_size, (i + 1) * block_size). A block is *full* once all its token
slots are scheduled; a full block is registered in the pool under a hash that
chains the parent block's hash and the block's token IDs, so two requests with
the same first k * block_size tokens map to the same k blocks.

Full blocks are registered when they are scheduled, not when they are computed:
within one step every layer writes all KV before it reads any, so a request
scheduled later in the same step may already share them.
"""

from __future__ import annotations

from typing import Optional

from streamserve.engine.block_pool import BlockPool, KVCacheBlock
from streamserve.engine.request import Request

_ROOT_HASH = hash("streamserve-kv-root")


def hash_block_tokens(parent_hash: Optional[int], token_ids: tuple[int, ...]) -> int:
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, token_ids))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the hash map.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chained hashes to cover all of its full blocks."""
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for i in range(len(hashes), len(tokens) // size):
            # a LoRA request's blocks chain from its adapter's root: its KV is the adapter's
            parent = hashes[-1] if hashes else None if request.lora is None else request.lora.cache_root
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * size:(i + 1) * size])))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks, and how many tokens it covers.

        The last token is never taken from the cache: the request must compute at
        least one token to get logits to sample from. Nor is any while the request's
        prompt logprobs are not all computed.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Serve no block from the cache again (its hash forgotten); blocks stay where they are."""
        self.block_pool.reset_prefix_cache()

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a request's lookup at its first admission (not retries, not returns from preemption)."""
        if self.enable_caching:
            self.block_pool.prefix_cache_queries += num_query_tokens
            self.block_pool.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None,
                       num_draft_tokens: int = 0) -> Optional[list[KVCacheBlock]]:
        """Give the request blocks for `num_new_tokens` more tokens after its
        computed ones (and after `new_computed_blocks`, a prefix hit being taken).
        Returns the newly taken blocks, or None (and changes nothing) if the pool
        cannot supply them. The last `num_draft_tokens` of them are speculative guesses,
        which may be wrong: no block is registered for the prefix cache on their account."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is not None and not new_computed_blocks:
            # The common decode step: the tokens fit the blocks held and fill no new one.
            end = request.num_computed_tokens + num_new_tokens
            if end <= len(req_blocks) * self.block_size and (
                    not self.enable_caching
                    or (end - num_draft_tokens) // self.block_size <= self.num_cached_blocks.get(request.request_id, 0)):
                return []
        computed = new_computed_blocks or []
        num_new_blocks, num_free = self._blocks_wanted(request, num_new_tokens, computed)
        if num_new_blocks > num_free:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        if computed:
            self.block_pool.touch(computed)
            req_blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # (a block is registered once its tokens are known: under async scheduling, the token a
            # step in flight samples is read in the next step before it is)
            self._cache_full_blocks(request, req_blocks,
                                    min(num_computed + num_new_tokens - num_draft_tokens, request.num_tokens))
        return new_blocks

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Optional[list[KVCacheBlock]] = None) -> bool:
        """Whether allocate_slots would give the request these slots now (it takes nothing)."""
        num_new_blocks, num_free = self._blocks_wanted(request, num_new_tokens, new_computed_blocks or [])
        return num_new_blocks <= num_free

    def _blocks_wanted(self, request: Request, num_new_tokens: int,
                       computed: list[KVCacheBlock]) -> tuple[int, int]:
        """(new blocks the request needs for num_new_tokens more after its computed tokens and
        the prefix hit `computed`, free blocks the pool has for them)."""
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return num_needed - num_held - len(computed), self.block_pool.num_free_blocks - num_evictable_hits

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock],
                           num_scheduled_tokens: int) -> None:
        num_full = num_scheduled_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self.update_block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> Optional[int]:
        """Give back the request's blocks past those its first num_tokens tokens fill (taken for
        guesses that were refused: never full of its tokens, so never cached). Returns how many
        blocks it keeps, or None if it had none to give back."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return None
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        del blocks[keep:]
        return keep

    def free(self, request: Request) -> None:
        """Return the request's blocks, last block first (evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]
