"""`BlockManager`: hands out the paged KV cache's blocks to requests and shares cached prefixes between them
(plain Python, no torch).

The KV cache is num_blocks blocks of block_size token slots. A request's block table lists the blocks holding
its tokens in order: token at position p lives in slot block_table[p // block_size] * block_size +
p % block_size. A request grows its table as it computes more tokens and gives all of it back when it finishes
or is preempted.

Automatic prefix caching (on unless enable_prefix_caching=False): once a request has computed a full block,
the block is registered in the `PrefixCache` under the hash of its tokens and prefix. Blocks are reference
counted; a cached block whose last holder lets go keeps its KV as "evictable", and a later request whose
leading blocks hash the same starts its table with those blocks instead of computing them
(`find_cached_prefix`, then `allocate_slots(..., cached_blocks=...)`). Only full, computed blocks are shared,
and a shared block is never written to: a request writes only at positions past its cached prefix, which lie
in blocks of its own. Allocation takes blocks that hold no cached KV first, then evicts the least recently
freed cached block. A request whose cache holds KV that a prefill here would not compute (`kv_exact` False: a
compressed prompt handed over by hybridmoe.disagg, quantised or with dropped tokens) offers none of its blocks:
another request must never start from them.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from hybridmoe.runtime.prefix_cache import BlockHash, PrefixCache, extend_block_hashes


class _HasKVProgress(Protocol):
    req_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]  # hashes of its leading full blocks; this class extends it

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> list[int]: ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockManager: block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache()
        # Blocks that hold no cached KV. Freed ones go to the back, allocation takes from the front: a block stays
        # unused as long as possible after it is freed (helps catch a stale block table in tests and debugging).
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks  # requests whose table holds the block
        self._block_tables: dict[str, list[int]] = {}
        self._num_offered: dict[str, int] = {}  # leading blocks of a table already registered (or cache hits)
        # Cumulative, in tokens: all tokens of each admitted request were looked up; hits were found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (allocatable), cached evictable ones included."""
        return len(self._free_blocks) + self.prefix_cache.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a full block registered in the prefix cache, in use or evictable."""
        return self.prefix_cache.num_cached_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request: _HasKVProgress, num_new_tokens: int) -> int:
        """Blocks request must still get to hold its computed tokens plus num_new_tokens more."""
        owned = len(self._block_tables.get(request.req_id, ()))
        return max(0, self.blocks_needed(request.num_computed_tokens + num_new_tokens) - owned)

    def can_allocate(self, request: _HasKVProgress, num_new_tokens: int) -> bool:
        return self.num_new_blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    def find_cached_prefix(self, request: _HasKVProgress) -> list[int]:
        """The cached blocks holding request's leading full blocks, longest match first to last; changes nothing.

        The match covers at most num_tokens - 1 tokens: the last token is always computed, for the logits that
        sample the next one. When that token ends a cached full block, the whole block is computed again into a
        block of the request's own (as vLLM does), so that a shared block is never written to."""
        if not self.enable_prefix_caching:
            return []
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size)
        blocks = []
        for block_hash in hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.prefix_cache.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, request: _HasKVProgress, num_new_tokens: int,
                       cached_blocks: list[int] | None = None) -> bool:
        """Make request own blocks for num_computed_tokens + num_new_tokens tokens; all or nothing.

        cached_blocks is given when request is admitted (it holds no blocks and has computed nothing): what
        find_cached_prefix returned, possibly []. They start its table, num_new_tokens are the tokens after them
        (the caller sets num_computed_tokens to len(cached_blocks) * block_size), and the admission counts as a
        prefix-cache query of request.num_tokens tokens with len(cached_blocks) * block_size hits.
        Returns False (and changes nothing) when there are not enough free blocks."""
        if num_new_tokens < 0:
            raise ValueError(f"allocate_slots: num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.req_id
        cached = cached_blocks or []
        if cached_blocks is not None and (request.num_computed_tokens or req_id in self._block_tables):
            raise ValueError(f"allocate_slots: cached_blocks given for {req_id!r}, which already has KV")
        num_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        owned = len(self._block_tables.get(req_id, ()))
        needed = max(0, self.blocks_needed(num_tokens) - owned - len(cached))
        # A cached block nobody holds counts as free: taking it leaves one block fewer to hand out.
        num_revived = sum(1 for block in cached if self._ref_counts[block] == 0)
        if needed > self.num_free_blocks - num_revived:
            return False
        for block in cached:
            if self._ref_counts[block] == 0:
                self.prefix_cache.reuse(block)
            self._ref_counts[block] += 1
        table = self._block_tables.setdefault(req_id, [])
        table += cached
        table += (self._take_free_block() for _ in range(needed))
        if cached_blocks is not None and self.enable_prefix_caching:
            self._num_offered[req_id] = len(cached)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(cached) * self.block_size
        return True

    def cache_full_blocks(self, request: _HasKVProgress) -> None:
        """Register the full blocks among request's num_computed_tokens in the prefix cache. Called once their
        KV is computed; a request that still runs thereby already shares its prefix with later ones. Nothing for a
        request whose KV is not exact (`kv_exact` False): its blocks hold compressed or masked-out KV."""
        if not self.enable_prefix_caching or not getattr(request, "kv_exact", True):
            return
        req_id = request.req_id
        num_full = request.num_computed_tokens // self.block_size
        offered = self._num_offered.get(req_id, 0)
        if num_full <= offered:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size)
        table = self._block_tables[req_id]
        for i in range(offered, num_full):
            self.prefix_cache.register(table[i], hashes[i])
        self._num_offered[req_id] = num_full

    def free(self, request: _HasKVProgress | str) -> None:
        """Let go of all blocks of request (or of the req_id); a request that holds none is ignored.

        Blocks are released last first: a cached sequence's tail is evicted before its head, so what stays
        cached is the longest prefix that can be kept."""
        req_id = request if isinstance(request, str) else request.req_id
        self._num_offered.pop(req_id, None)
        for block in reversed(self._block_tables.pop(req_id, ())):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self.prefix_cache.hash_of(block) is None:
                self._free_blocks.append(block)
            else:
                self.prefix_cache.release(block)

    def get_block_table(self, req_id: str) -> list[int]:
        """A copy of req_id's block table (empty when it holds no blocks)."""
        return list(self._block_tables.get(req_id, ()))

    def _take_free_block(self) -> int:
        """A block for new KV: one holding no cached KV if any, else the least recently freed cached one."""
        block = self._free_blocks.popleft() if self._free_blocks else self.prefix_cache.evict()
        self._ref_counts[block] = 1
        return block
