"""Automatic prefix caching's bookkeeping: block hashes, the hash -> block map, and the LRU of evictable blocks
(plain Python, no torch).

A full KV block is named by a hash of its token ids and the hash of the block before it, so equal hashes mean
the same tokens at the same positions after the same prefix: the block's KV is exactly what a request with that
prefix would compute. Only full blocks are hashed; a partial block is never shared.

The hash is SHA-256. Python's hash() of a tuple is faster, but it is 64 bits and not collision resistant: a
client could craft a prompt whose block collides with another user's and read KV computed from their tokens.
SHA-256 over one block costs about a microsecond, against milliseconds of CPU compute per token.

`PrefixCache` maps hashes to the blocks holding them. A cached block that no request uses is "evictable": it
keeps its KV for a later request with the same prefix until its memory is needed, least recently freed first.
Reference counts and truly free blocks belong to the `BlockManager`, which drives this class.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block holding token_ids, after the block whose hash is parent (None: the first block)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())  # fixed 8 bytes per id: no two id lists share a byte string
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int) -> None:
    """Append to hashes (those of token_ids' first len(hashes) blocks) the hashes of its remaining full blocks."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start : start + block_size]))


class PrefixCache:
    def __init__(self) -> None:
        self._block_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block: dict[int, BlockHash] = {}
        # Cached blocks no request holds, least recently freed first (the next to evict).
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered hash, in use or evictable."""
        return len(self._hash_by_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding block_hash, or None."""
        return self._block_by_hash.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_by_block.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Record that block holds block_hash; False (nothing changes) when another block holds it already, as when
        two requests computed the same prefix at the same time (the second copy stays uncached)."""
        if block_hash in self._block_by_hash or block in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block
        self._hash_by_block[block] = block_hash
        return True

    def release(self, block: int) -> None:
        """The last request holding cached block let it go: it becomes the most recent evictable block."""
        self._evictable[block] = None

    def reuse(self, block: int) -> None:
        """An evictable block was matched by a request: it is in use again and cannot be evicted."""
        del self._evictable[block]

    def evict(self) -> int:
        """Forget the least recently freed evictable block's hash and return the block for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_by_hash[self._hash_by_block.pop(block)]
        return block
