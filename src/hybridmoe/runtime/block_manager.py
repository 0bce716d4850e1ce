"""`BlockManager`: hands out the paged KV cache's blocks to requests (plain Python, no torch).

The KV cache is num_blocks blocks of block_size token slots. A request's block table lists the blocks holding
its tokens in order: token at position p lives in slot block_table[p // block_size] * block_size +
p % block_size. Blocks are never shared between requests; a request grows its table as it computes more
tokens and returns all of it when it finishes or is preempted.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class _HasKVProgress(Protocol):
    req_id: str
    num_computed_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockManager: block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Freed blocks go to the back, allocation takes from the front: a block stays unused as long as
        # possible after it is freed (helps catch a stale block table in tests and debugging).
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request: _HasKVProgress, num_new_tokens: int) -> int:
        """Blocks request must still get to hold its computed tokens plus num_new_tokens more."""
        owned = len(self._block_tables.get(request.req_id, ()))
        return max(0, self.blocks_needed(request.num_computed_tokens + num_new_tokens) - owned)

    def can_allocate(self, request: _HasKVProgress, num_new_tokens: int) -> bool:
        return self.num_new_blocks_needed(request, num_new_tokens) <= len(self._free_blocks)

    def allocate_slots(self, request: _HasKVProgress, num_new_tokens: int) -> bool:
        """Make request own blocks for num_computed_tokens + num_new_tokens tokens; all or nothing.

        Returns False (and changes nothing) when there are not enough free blocks."""
        if num_new_tokens < 0:
            raise ValueError(f"allocate_slots: num_new_tokens must be >= 0, got {num_new_tokens}")
        needed = self.num_new_blocks_needed(request, num_new_tokens)
        if needed > len(self._free_blocks):
            return False
        table = self._block_tables.setdefault(request.req_id, [])
        table.extend(self._free_blocks.popleft() for _ in range(needed))
        return True

    def free(self, request: _HasKVProgress | str) -> None:
        """Return all blocks of request (or of the req_id); a request that holds none is ignored."""
        req_id = request if isinstance(request, str) else request.req_id
        self._free_blocks.extend(self._block_tables.pop(req_id, ()))

    def get_block_table(self, req_id: str) -> list[int]:
        """A copy of req_id's block table (empty when it holds no blocks)."""
        return list(self._block_tables.get(req_id, ()))
