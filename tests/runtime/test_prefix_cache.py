"""Prefix caching in the block manager (plain Python): block hashes, sharing of equal prefixes only, reference
counts, LRU eviction, and invariants under random interleavings."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from hybridmoe.runtime.block_manager import BlockManager
from hybridmoe.runtime.prefix_cache import PrefixCache, extend_block_hashes, hash_block


@dataclass
class FakeRequest:
    req_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.token_ids)


def run_prefill(manager: BlockManager, request: FakeRequest) -> int:
    """Admit request on its cached prefix and compute the rest of its tokens; -> tokens found cached."""
    cached = manager.find_cached_prefix(request)
    num_cached = len(cached) * manager.block_size
    assert manager.allocate_slots(request, request.num_tokens - num_cached, cached)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return num_cached


def test_block_hashes_chain_over_the_prefix():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [9, 2]), [3, 4])
    assert hash_block(None, [1, 2**40]) != hash_block(None, [1, 2**40 + 1])
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5], 2)  # the partial third block is not hashed
    assert hashes == [hash_block(None, [1, 2]), hash_block(hash_block(None, [1, 2]), [3, 4])]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6], 2)  # only the new full block is added
    assert hashes[2] == hash_block(hashes[1], [5, 6]) and len(hashes) == 3


def test_a_shared_prefix_is_found_and_a_different_earlier_block_breaks_the_match():
    manager = BlockManager(num_blocks=20, block_size=4)
    first = FakeRequest("first", list(range(1, 14)))  # 3 full blocks and 1 token
    assert run_prefill(manager, first) == 0
    assert manager.num_cached_blocks == 3
    table = manager.get_block_table("first")
    same_start = FakeRequest("same", list(range(1, 11)) + [99, 98])  # diverges inside the third block
    assert manager.find_cached_prefix(same_start) == table[:2]
    other_first_block = FakeRequest("other", [77] + list(range(2, 14)))  # later blocks equal, the first not
    assert manager.find_cached_prefix(other_first_block) == []
    assert manager.find_cached_prefix(FakeRequest("partial", list(range(1, 14)) + [5])) == table[:3]
    assert manager.find_cached_prefix(FakeRequest("short", [1, 2, 3])) == []  # no full block to share


def test_partial_and_uncomputed_blocks_are_never_shared():
    manager = BlockManager(num_blocks=20, block_size=4)
    running = FakeRequest("running", list(range(1, 11)))
    assert manager.allocate_slots(running, 10, manager.find_cached_prefix(running))
    running.num_computed_tokens = 6  # a chunk of the prefill: one full block computed
    manager.cache_full_blocks(running)
    later = FakeRequest("later", list(range(1, 11)))
    assert manager.find_cached_prefix(later) == manager.get_block_table("running")[:1]
    running.num_computed_tokens = 10
    manager.cache_full_blocks(running)  # the second block is full now; the third holds 2 tokens
    assert manager.find_cached_prefix(later) == manager.get_block_table("running")[:2]
    assert manager.num_cached_blocks == 2


def test_reference_counts_keep_a_shared_block_until_its_last_holder_lets_go():
    manager = BlockManager(num_blocks=6, block_size=2)
    a, b = FakeRequest("a", [1, 2, 3, 4, 5]), FakeRequest("b", [1, 2, 3, 4, 6])
    run_prefill(manager, a)
    assert run_prefill(manager, b) == 4
    assert manager.num_used_blocks == 3 + 1 and manager.num_free_blocks == 2
    manager.free(a)
    assert manager.num_used_blocks == 3  # b still holds the two shared blocks
    assert not any(manager.prefix_cache.is_evictable(block) for block in manager.get_block_table("b"))
    manager.free(b)
    assert manager.num_used_blocks == 0 and manager.num_free_blocks == 6 and manager.num_cached_blocks == 2
    assert manager.prefix_cache.num_evictable_blocks == 2


def test_freed_blocks_are_evicted_least_recent_first_tail_before_head():
    manager = BlockManager(num_blocks=6, block_size=2)
    old, new = FakeRequest("old", [1, 2, 3, 4]), FakeRequest("new", [5, 6, 7, 8])
    run_prefill(manager, old)
    run_prefill(manager, new)
    old_table, new_table = manager.get_block_table("old"), manager.get_block_table("new")
    manager.free(old)
    manager.free(new)
    # Two blocks never used go first, then old's tail, old's head, new's tail.
    taker = FakeRequest("taker", [9] * 10)
    assert manager.allocate_slots(taker, 10)
    assert manager.get_block_table("taker")[2:] == [old_table[1], old_table[0], new_table[1]]
    assert manager.num_cached_blocks == 1
    assert manager.find_cached_prefix(FakeRequest("x", [1, 2, 3, 4, 0])) == []  # evicted: the hash is gone
    assert manager.find_cached_prefix(FakeRequest("y", [5, 6, 3])) == [new_table[0]]


def test_a_matched_block_leaves_the_eviction_queue():
    manager = BlockManager(num_blocks=3, block_size=2)
    first = FakeRequest("first", [1, 2, 3, 4])
    run_prefill(manager, first)
    manager.free(first)
    again = FakeRequest("again", [1, 2, 3, 4, 5])
    assert run_prefill(manager, again) == 4  # takes both cached blocks back, and the third for token 5
    assert manager.num_free_blocks == 0
    assert not manager.allocate_slots(FakeRequest("more", [7]), 1)  # nothing to evict: all are in use


def test_allocation_evicts_cached_blocks_before_refusing_and_counts_revived_ones_as_taken():
    manager = BlockManager(num_blocks=4, block_size=2)
    cached = FakeRequest("cached", [1, 2, 3, 4, 5, 6])
    run_prefill(manager, cached)
    manager.free(cached)  # 3 cached evictable blocks, 1 never used
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 3
    reuser = FakeRequest("reuser", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefix = manager.find_cached_prefix(reuser)
    assert len(prefix) == 3
    # 3 revived + 2 new blocks > 4: refused, and nothing changed
    assert not manager.allocate_slots(reuser, 3, prefix)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 3 and manager.get_block_table("reuser") == []
    assert manager.allocate_slots(reuser, 2, prefix)  # 3 revived + 1 new fits
    assert manager.get_block_table("reuser")[:3] == prefix and manager.num_free_blocks == 0
    big = FakeRequest("big", [9] * 8)
    manager.free(reuser)
    assert manager.allocate_slots(big, 8)  # all four, the cached ones evicted
    assert manager.num_cached_blocks == 0


def test_two_requests_computing_the_same_block_keep_one_cached_copy():
    manager = BlockManager(num_blocks=6, block_size=2)
    a, b = FakeRequest("a", [1, 2, 3]), FakeRequest("b", [1, 2, 3])
    for request in (a, b):  # both admitted before either computed anything
        assert manager.allocate_slots(request, 3, manager.find_cached_prefix(request))
    for request in (a, b):
        request.num_computed_tokens = 3
        manager.cache_full_blocks(request)
    assert manager.num_cached_blocks == 1
    assert manager.find_cached_prefix(FakeRequest("c", [1, 2, 9])) == manager.get_block_table("a")[:1]
    manager.free(b)  # b's copy holds no hash: it is simply free
    manager.free(a)
    assert manager.num_free_blocks == 6 and manager.prefix_cache.num_evictable_blocks == 1


def test_query_and_hit_counters_count_admissions_in_tokens():
    manager = BlockManager(num_blocks=10, block_size=4)
    run_prefill(manager, FakeRequest("a", list(range(10))))
    run_prefill(manager, FakeRequest("b", list(range(9)) + [50, 51]))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10 + 11, 8)
    grow = FakeRequest("b", [])
    manager.allocate_slots(grow, 0)  # a running request growing is not a query
    assert manager.prefix_cache_queries == 21


def test_prefix_caching_off_never_caches():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    first = FakeRequest("first", [1, 2, 3, 4])
    run_prefill(manager, first)
    manager.free(first)
    assert manager.find_cached_prefix(FakeRequest("again", [1, 2, 3, 4, 5])) == []
    assert manager.num_cached_blocks == 0 and manager.prefix_cache_queries == manager.prefix_cache_hits == 0


def test_cached_blocks_are_only_for_a_request_without_kv():
    manager = BlockManager(num_blocks=4, block_size=2)
    request = FakeRequest("a", [1, 2, 3])
    manager.allocate_slots(request, 3, [])
    with pytest.raises(ValueError, match="cached_blocks given for 'a', which already has KV"):
        manager.allocate_slots(request, 1, [])


def test_prefix_cache_register_refuses_a_second_block_or_hash():
    cache = PrefixCache()
    assert cache.register(3, b"h")
    assert not cache.register(4, b"h") and cache.lookup(b"h") == 3
    assert not cache.register(3, b"other") and cache.hash_of(3) == b"h"


@pytest.mark.parametrize("seed", range(15))
def test_random_interleavings_keep_sharing_and_counts_consistent(seed):
    """Requests over a few shared prefixes are admitted on their cached prefix, grow, compute and are freed at
    random. Every block a table lists at an index holds the tokens the table's request has there (checked
    through the block hashes), blocks are never lost, and a shared block is always a cached one."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3])
    manager = BlockManager(num_blocks=rng.randint(4, 30), block_size=block_size)
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 9))] for _ in range(3)]
    active: dict[str, FakeRequest] = {}
    content: dict[int, bytes] = {}  # block -> hash of the tokens last computed into it
    hits = 0
    for step in range(300):
        if active and rng.random() < 0.3:
            victim = active.pop(rng.choice(sorted(active)))
            manager.free(victim)
        elif rng.random() < 0.5 or not active:
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            request = FakeRequest(f"r{step}", tokens)
            cached = manager.find_cached_prefix(request)
            num_cached = len(cached) * block_size
            for index, block in enumerate(cached):
                assert content[block] == request.block_hashes[index]
            num_new = rng.randint(1, request.num_tokens - num_cached)
            if manager.allocate_slots(request, num_new, cached):
                active[request.req_id] = request
                request.num_computed_tokens = num_cached
                hits += num_cached
        else:  # a running request computes the tokens it was given blocks for, then grows
            request = active[rng.choice(sorted(active))]
            table = manager.get_block_table(request.req_id)
            end = min(len(table) * block_size, request.num_tokens)
            for index in range(request.num_computed_tokens // block_size, manager.blocks_needed(end)):
                assert manager.prefix_cache.hash_of(table[index]) is None, "a cached block was written to"
                content[table[index]] = request.block_hashes[index] if index < end // block_size else b"partial"
            request.num_computed_tokens = end
            manager.cache_full_blocks(request)
            if end < request.num_tokens:
                manager.allocate_slots(request, rng.randint(1, request.num_tokens - end))
        tables = [manager.get_block_table(r) for r in active]
        held = [block for table in tables for block in table]
        assert manager.num_used_blocks == len(set(held))
        assert all(manager.prefix_cache.hash_of(b) is not None for b in set(held) if held.count(b) > 1)
        for table in tables:
            assert len(table) == len(set(table))
    assert manager.prefix_cache_hits == hits > 0
    for request in active.values():
        manager.free(request)
    assert manager.num_free_blocks == manager.num_blocks
