"""BlockManager: all-or-nothing allocation, freeing, and invariants under random interleavings."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from hybridmoe.runtime.block_manager import BlockManager


@dataclass
class FakeRequest:
    req_id: str
    num_computed_tokens: int = 0


def _check_invariants(manager: BlockManager, req_ids) -> None:
    owned = [b for r in req_ids for b in manager.get_block_table(r)]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert manager.num_free_blocks + len(owned) == manager.num_blocks, "blocks were lost or made up"
    assert all(0 <= b < manager.num_blocks for b in owned)


def test_blocks_needed():
    manager = BlockManager(num_blocks=10, block_size=4)
    assert [manager.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_to_cover_computed_plus_new_tokens():
    manager = BlockManager(num_blocks=6, block_size=4)
    request = FakeRequest("a")
    assert manager.allocate_slots(request, 5)
    assert len(manager.get_block_table("a")) == 2 and manager.num_free_blocks == 4
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3)  # 8 tokens: still 2 blocks
    assert len(manager.get_block_table("a")) == 2
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1)  # the 9th token opens a third block
    table = manager.get_block_table("a")
    assert len(table) == 3 and table[:2] == manager.get_block_table("a")[:2]


def test_allocation_is_all_or_nothing():
    manager = BlockManager(num_blocks=4, block_size=2)
    assert manager.allocate_slots(FakeRequest("a"), 5)  # 3 blocks
    big = FakeRequest("b")
    assert not manager.can_allocate(big, 3)
    assert not manager.allocate_slots(big, 3)  # needs 2, 1 free
    assert manager.get_block_table("b") == [] and manager.num_free_blocks == 1
    assert manager.can_allocate(big, 2) and manager.allocate_slots(big, 2)


def test_free_returns_blocks_and_twice_is_harmless():
    manager = BlockManager(num_blocks=4, block_size=2)
    request = FakeRequest("a")
    manager.allocate_slots(request, 8)
    assert manager.num_free_blocks == 0
    manager.free(request)
    manager.free(request)
    manager.free("never-seen")
    assert manager.num_free_blocks == 4 and manager.get_block_table("a") == []


def test_block_table_is_a_copy():
    manager = BlockManager(num_blocks=4, block_size=2)
    manager.allocate_slots(FakeRequest("a"), 2)
    manager.get_block_table("a").append(3)
    assert len(manager.get_block_table("a")) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockManager(4, 0)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        BlockManager(4, 2).allocate_slots(FakeRequest("a"), -1)


@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_keep_invariants(seed):
    rng = random.Random(seed)
    manager = BlockManager(num_blocks=rng.randint(1, 40), block_size=rng.choice([1, 2, 3, 16]))
    requests = [FakeRequest(f"r{i}") for i in range(8)]
    ids = [r.req_id for r in requests]
    successes = 0
    for _ in range(400):
        request = rng.choice(requests)
        operation = rng.random()
        if operation < 0.6:
            num_new = rng.randint(0, 3 * manager.block_size)
            free_before = manager.num_free_blocks
            table_before = manager.get_block_table(request.req_id)
            expected = manager.can_allocate(request, num_new)
            assert manager.allocate_slots(request, num_new) == expected
            table = manager.get_block_table(request.req_id)
            if expected:
                successes += 1
                assert table[: len(table_before)] == table_before  # a table only grows at the end
                assert len(table) >= manager.blocks_needed(request.num_computed_tokens + num_new)
                assert free_before - manager.num_free_blocks == len(table) - len(table_before)
                request.num_computed_tokens += num_new if rng.random() < 0.8 else 0
            else:
                assert table == table_before and manager.num_free_blocks == free_before
        else:
            manager.free(request)
            if rng.random() < 0.3:
                manager.free(request)
            request.num_computed_tokens = 0
            assert manager.get_block_table(request.req_id) == []
        _check_invariants(manager, ids)
    assert successes > 0
    for request in requests:
        manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks
