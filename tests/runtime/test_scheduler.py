"""Scheduler: driven by a fake paged "model" (plain Python) through fixed scenarios and random workloads.

The fake model stores every computed token in a fake paged KV cache through the request's block table and,
to predict the next token, reads the whole sequence back through the block table. A fake KV entry is what real
KV depends on: the token, its position and every token before it. A block wrongly shared by two requests (prefix
caching shares only equal prefixes), a stale table after preemption, or a token computed twice or never all
show up as a wrong read or as different output tokens; a write into a block the prefix cache holds is an error.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from hybridmoe.runtime.block_manager import BlockManager
from hybridmoe.runtime.request import Request, RequestStatus
from hybridmoe.runtime.sampling_params import SamplingParams
from hybridmoe.runtime.scheduler import Scheduler, SchedulerOutput

VOCAB = 50
EOS = 0


def next_token(sequence: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence (EOS about 1 time in VOCAB)."""
    weighted = sum((i + 1) * t for i, t in enumerate(sequence))
    return (weighted * 2654435761 + 97 * len(sequence)) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """What the request must produce when run alone with unlimited resources."""
    sequence, output = list(prompt), []
    while True:
        token = next_token(sequence)
        output.append(token)
        if (token == EOS and not params.ignore_eos) or token in params.stop_token_ids:
            return output, "stop"
        if len(output) >= params.max_tokens:
            return output, "length"
        sequence.append(token)


class FakePagedModel:
    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        # Per slot: (position, the tokens up to and including it).
        self.slots: list[tuple[int, tuple[int, ...]] | None] = [None] * (block_manager.num_blocks * self.block_size)

    def _slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def run(self, output: SchedulerOutput) -> dict[str, int]:
        for item in output.scheduled:  # write this step's KV of every sequence first (one batched forward)
            request, start = item.request, item.request.num_computed_tokens
            tokens = tuple(request.all_token_ids)
            for position in range(start, start + item.num_new_tokens):
                block = item.block_table[position // self.block_size]
                assert self.block_manager.prefix_cache.hash_of(block) is None, "a cached block was written to"
                self.slots[self._slot(item.block_table, position)] = (position, tokens[: position + 1])
        sampled = {}
        for item in output.scheduled:  # then attend over everything through the block table
            request = item.request
            end = request.num_computed_tokens + item.num_new_tokens
            tokens = tuple(request.all_token_ids)
            read = [self.slots[self._slot(item.block_table, p)] for p in range(end)]
            assert read == [(p, tokens[: p + 1]) for p in range(end)]
            if end == request.num_tokens:
                sampled[request.req_id] = next_token(list(tokens[:end]))
        return sampled


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Budgets and block invariants of one scheduled step."""
    manager = scheduler.block_manager
    num_new = [item.num_new_tokens for item in output.scheduled]
    ids = [item.request.req_id for item in output.scheduled]
    assert all(n >= 1 for n in num_new)
    assert output.num_batched_tokens == sum(num_new) <= scheduler.max_num_batched_tokens
    assert len(ids) == len(set(ids)) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert not set(ids) & set(output.preempted)
    for item in output.scheduled:
        request = item.request
        assert request.status is RequestStatus.RUNNING
        assert request.num_computed_tokens + item.num_new_tokens <= request.num_tokens
        assert len(item.block_table) >= manager.blocks_needed(request.num_computed_tokens + item.num_new_tokens)
    tables = [manager.get_block_table(r.req_id) for r in scheduler.running + list(scheduler.waiting)]
    assert all(len(table) == len(set(table)) for table in tables)
    index_of_shared: dict[int, int] = {}  # a block in several tables holds the same positions in each, and is cached
    for table in tables:
        for index, block in enumerate(table):
            if sum(block in other for other in tables) > 1:
                assert index_of_shared.setdefault(block, index) == index
                assert manager.prefix_cache.hash_of(block) is not None
    owned = {b for table in tables for b in table}
    assert manager.num_free_blocks + len(owned) == manager.num_blocks == manager.num_free_blocks + manager.num_used_blocks
    assert all(manager.get_block_table(r.req_id) == [] for r in scheduler.waiting)
    # First come, first served: running then waiting, in arrival order (preempted ones rejoin at the front).
    arrival = [r.arrival_time for r in scheduler.running + list(scheduler.waiting)]
    assert arrival == sorted(arrival)
    # At most one running request is still mid-prefill after this step, and it is the newest.
    num_new_by_id = dict(zip(ids, num_new))
    unfinished_prefill = [
        r for r in scheduler.running if r.num_tokens - r.num_computed_tokens - num_new_by_id.get(r.req_id, 0) > 1
    ]
    assert unfinished_prefill in ([], scheduler.running[-1:])


def run_until_done(
    scheduler: Scheduler,
    pending: list[Request],
    rng: random.Random | None = None,
    end_early_rate: float = 0.0,
    max_steps: int = 20000,
):
    """Add pending requests (a few per step when rng is given) and step until all finish; with end_early_rate,
    requests are also aborted or stopped (as by a stop string) at random.
    -> (steps, preemptions, req_ids ended early)."""
    model = FakePagedModel(scheduler.block_manager)
    pending = list(pending)
    steps = preemptions = 0
    ended_early: set[str] = set()
    while pending or scheduler.has_unfinished_requests():
        arrivals = len(pending) if rng is None else rng.randint(0, 3)
        for _ in range(min(arrivals, len(pending))):
            scheduler.add_request(pending.pop(0))
        output = scheduler.schedule()
        check_step(scheduler, output)
        preemptions += len(output.preempted)
        sampled = model.run(output)
        if rng is not None and rng.random() < end_early_rate:
            victim = rng.choice(scheduler.running + list(scheduler.waiting))
            ended_early.add(victim.req_id)
            if rng.random() < 0.5:
                scheduler.abort_request(victim.req_id)
            else:
                scheduler.finish_request(victim.req_id, RequestStatus.FINISHED_STOPPED, "stop")
        for request in scheduler.update_from_output(output, sampled):
            assert request.is_finished and scheduler.block_manager.get_block_table(request.req_id) == []
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    return steps, preemptions, ended_early


def make_requests(rng: random.Random, count: int, max_prompt: int, max_tokens: int) -> list[Request]:
    requests = []
    for i in range(count):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))]
        params = SamplingParams(
            max_tokens=rng.randint(1, max_tokens),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else [],
        )
        requests.append(Request(f"req-{i}", prompt, params, eos_token_ids=(EOS,), arrival_time=float(i)))
    return requests


def assert_outputs_match_reference(requests: list[Request]) -> None:
    for request in requests:
        expected_tokens, expected_reason = reference_output(request.prompt_token_ids, request.sampling_params)
        assert request.output_token_ids == expected_tokens, request.req_id
        assert request.finish_reason == expected_reason
        assert request.status is (
            RequestStatus.FINISHED_STOPPED if expected_reason == "stop" else RequestStatus.FINISHED_LENGTH
        )


@dataclass
class Workload:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    tight_cache: bool  # just enough blocks for the longest request: forces preemption


MAX_PROMPT, MAX_TOKENS = 40, 30
MAX_MODEL_LEN = MAX_PROMPT + MAX_TOKENS


def _scheduler(block_size, num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
               enable_prefix_caching=True):
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching), max_num_seqs,
                     max_num_batched_tokens, max_model_len)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_finish_with_reference_tokens(seed):
    rng = random.Random(seed)
    workload = Workload(
        block_size=rng.choice([1, 2, 4, 16]),
        max_num_seqs=rng.randint(1, 8),
        max_num_batched_tokens=rng.choice([1, 3, 8, 32, 128]),
        tight_cache=seed % 2 == 0,
    )
    requests = make_requests(rng, 25, MAX_PROMPT, MAX_TOKENS)
    min_blocks = -(-MAX_MODEL_LEN // workload.block_size)
    num_blocks = min_blocks if workload.tight_cache else 25 * min_blocks
    scheduler = _scheduler(workload.block_size, num_blocks, workload.max_num_seqs, workload.max_num_batched_tokens)
    run_until_done(scheduler, requests, rng)
    assert_outputs_match_reference(requests)


@pytest.mark.parametrize("seed", range(6))
def test_random_aborts_and_stops_leave_the_others_intact(seed):
    rng = random.Random(500 + seed)
    requests = make_requests(rng, 25, MAX_PROMPT, MAX_TOKENS)
    scheduler = _scheduler(2, -(-MAX_MODEL_LEN // 2) + rng.randint(0, 20), rng.randint(1, 6), rng.choice([4, 16, 64]))
    _, _, ended_early = run_until_done(scheduler, requests, rng, end_early_rate=0.15)
    assert ended_early
    for request in requests:
        if request.req_id in ended_early:
            expected, _ = reference_output(request.prompt_token_ids, request.sampling_params)
            assert request.output_token_ids == expected[: request.num_output_tokens]
            assert request.finish_reason in ("abort", "stop")
    assert_outputs_match_reference([r for r in requests if r.req_id not in ended_early])


def test_preemption_under_kv_pressure_keeps_outputs_identical():
    total_preemptions = 0
    for seed in range(6):
        rng = random.Random(1000 + seed)
        requests = make_requests(rng, 20, MAX_PROMPT, MAX_TOKENS)
        roomy = [Request(r.req_id, r.prompt_token_ids, r.sampling_params, (EOS,), r.arrival_time) for r in requests]
        _, preemptions, _ = run_until_done(_scheduler(4, 18, 8, 64), requests)  # 18 blocks of 4 = one longest request
        _, roomy_preemptions, _ = run_until_done(_scheduler(4, 2000, 8, 64), roomy)
        assert roomy_preemptions == 0
        assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in roomy]
        assert [r.finish_reason for r in requests] == [r.finish_reason for r in roomy]
        assert_outputs_match_reference(requests)
        total_preemptions += preemptions
    assert total_preemptions > 10


def _new(req_id: str, prompt_len: int, max_tokens: int = 10, **params) -> Request:
    prompt = [1 + (i % (VOCAB - 1)) for i in range(prompt_len)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), (EOS,))


def _scheduled(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(item.request.req_id, item.num_new_tokens) for item in output.scheduled]


def _step(scheduler: Scheduler, model: FakePagedModel) -> SchedulerOutput:
    output = scheduler.schedule()
    check_step(scheduler, output)
    scheduler.update_from_output(output, model.run(output))
    return output


def test_chunked_prefill_and_decode_first():
    # The prompts share their first tokens: prefix caching (tested below) would shorten c's prefill.
    scheduler = _scheduler(block_size=4, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=100,
                           enable_prefix_caching=False)
    model = FakePagedModel(scheduler.block_manager)
    scheduler.add_request(_new("a", 3))
    assert _scheduled(_step(scheduler, model)) == [("a", 3)]  # prefill done, first token sampled
    scheduler.add_request(_new("b", 20))
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 7)]  # a decodes first; b gets the rest
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 7)]
    scheduler.add_request(_new("c", 5))
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 6), ("c", 1)]  # c starts in the leftover
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 1), ("c", 4)]
    assert [r.num_output_tokens for r in scheduler.running] == [5, 2, 1]


def test_max_num_seqs_limits_running_requests():
    scheduler = _scheduler(block_size=4, num_blocks=100, max_num_seqs=2, max_num_batched_tokens=100)
    model = FakePagedModel(scheduler.block_manager)
    for name in "abc":
        scheduler.add_request(_new(name, 4, max_tokens=3))
    assert _scheduled(_step(scheduler, model)) == [("a", 4), ("b", 4)]
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 1)]
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 1)]  # a and b finish (3 tokens)
    assert _scheduled(_step(scheduler, model)) == [("c", 4)]


def test_newest_running_request_is_preempted_and_recomputes():
    # 4 blocks of 2 tokens: a and b (prompts of 3) fill them after their prefill and one decode each. Their
    # sequences are equal: with prefix caching b would come back at once on a's blocks (tested below).
    scheduler = _scheduler(block_size=2, num_blocks=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=8,
                           enable_prefix_caching=False)
    model = FakePagedModel(scheduler.block_manager)
    a, b = _new("a", 3, max_tokens=5), _new("b", 3, max_tokens=5)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert _scheduled(_step(scheduler, model)) == [("a", 3), ("b", 3)]
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 1)]  # position 3: still in block 2
    output = _step(scheduler, model)  # a's position 4 needs a third block: b (the newest) makes room
    assert output.preempted == ["b"] and _scheduled(output) == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_output_tokens == 2
    assert list(scheduler.waiting) == [b] and scheduler.block_manager.get_block_table("b") == []
    later = []
    while scheduler.has_unfinished_requests():
        later.append(_scheduled(_step(scheduler, model)))
    # b waits until a finishes, then recomputes its prompt and both earlier outputs in one chunk.
    assert later[:3] == [[("a", 1)], [("a", 1)], [("b", 5)]]
    assert_outputs_match_reference([a, b])


def test_abort_waiting_and_running_requests():
    scheduler = _scheduler(block_size=4, num_blocks=10, max_num_seqs=1, max_num_batched_tokens=64)
    model = FakePagedModel(scheduler.block_manager)
    a, b = _new("a", 6), _new("b", 6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    _step(scheduler, model)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    scheduler.abort_request("b")
    assert b.status is RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    output = scheduler.schedule()  # a is scheduled, then aborted while "the model runs"
    scheduler.abort_request("a")
    assert scheduler.update_from_output(output, model.run(output)) == []
    assert a.finish_reason == "abort" and a.num_output_tokens == 1
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 10
    scheduler.abort_request("a")  # twice, and unknown ids, are harmless
    scheduler.abort_request("zzz")


def test_finish_request_for_a_stop_string_frees_blocks():
    scheduler = _scheduler(block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64)
    model = FakePagedModel(scheduler.block_manager)
    request = _new("a", 6)
    scheduler.add_request(request)
    _step(scheduler, model)
    scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED, "stop")
    assert request.status is RequestStatus.FINISHED_STOPPED and request.finish_reason == "stop"
    assert scheduler.block_manager.num_free_blocks == 10 and not scheduler.running
    assert scheduler.schedule().scheduled == []


def test_a_request_that_outgrows_the_whole_cache_ends_with_length():
    scheduler = _scheduler(block_size=2, num_blocks=3, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    model = FakePagedModel(scheduler.block_manager)
    request = _new("a", 5, max_tokens=50)  # the prompt fits in 3 blocks; the 7th token does not
    scheduler.add_request(request)
    _step(scheduler, model)  # prefill (5 tokens), sample the 6th
    _step(scheduler, model)  # position 5 fills block 3, sample the 7th
    assert scheduler.schedule().scheduled == []  # position 6 needs a 4th block
    finished = scheduler.update_from_output(SchedulerOutput([], [], 0), {})
    assert finished == [request] and request.finish_reason == "length" and request.num_output_tokens == 2
    assert scheduler.block_manager.num_free_blocks == 3 and not scheduler.has_unfinished_requests()


def test_add_request_rejects_what_can_never_run():
    scheduler = _scheduler(block_size=4, num_blocks=3, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=20)
    with pytest.raises(ValueError, match="'e': the prompt is empty"):
        scheduler.add_request(_new("e", 0))
    with pytest.raises(ValueError, match=r"prompt too long: 15 tokens \+ max_tokens 10 > max_model_len 20"):
        scheduler.add_request(_new("long", 15, max_tokens=10))
    with pytest.raises(ValueError, match="prompt too long: 13 tokens need 4 KV blocks of 4 tokens, the whole cache has 3"):
        scheduler.add_request(_new("big", 13, max_tokens=1))
    scheduler.add_request(_new("ok", 12, max_tokens=1))
    with pytest.raises(ValueError, match="already queued or running"):
        scheduler.add_request(_new("ok", 1))
    assert scheduler.num_unfinished_requests == 1


def test_missing_sampled_token_is_an_error():
    scheduler = _scheduler(block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(_new("a", 3))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="'a' computed all its 3 tokens this step but has no sampled token"):
        scheduler.update_from_output(output, {})


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1"):
        _scheduler(block_size=4, num_blocks=10, max_num_seqs=0, max_num_batched_tokens=64)


def test_no_request_starves_under_a_steady_stream_of_new_ones():
    """New requests arrive faster than they finish, under KV pressure: the oldest unfinished request is
    scheduled in every single step, so each request in turn makes progress until it finishes."""
    rng = random.Random(77)
    scheduler = _scheduler(block_size=4, num_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
    model = FakePagedModel(scheduler.block_manager)
    requests = make_requests(rng, 1000, MAX_PROMPT, MAX_TOKENS)
    arrivals = iter(requests)
    preemptions = 0
    for _ in range(400):
        for _ in range(2):
            scheduler.add_request(next(arrivals))
        oldest = next(r for r in requests if not r.is_finished)
        output = scheduler.schedule()
        check_step(scheduler, output)
        preemptions += len(output.preempted)
        assert oldest in [item.request for item in output.scheduled]
        scheduler.update_from_output(output, model.run(output))
    finished = [r for r in requests if r.is_finished]
    assert len(finished) > 30 and preemptions > 0
    assert_outputs_match_reference(finished)


# ---- prefix caching ------------------------------------------------------------------------------------------


def make_shared_prefix_requests(rng: random.Random, count: int) -> list[Request]:
    """Prompts that start with one of three shared "system prompts" (some are nothing else) and random tails."""
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    requests = make_requests(rng, count, 10, MAX_TOKENS)
    for request in requests:
        tail = request.prompt_token_ids[: rng.choice([0, rng.randint(1, 10)])]
        request.prompt_token_ids = rng.choice(prefixes) + tail
    return requests


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_shared_prefixes_reuse_kv_and_keep_reference_tokens(seed):
    rng = random.Random(2000 + seed)
    block_size = rng.choice([1, 2, 4])
    min_blocks = -(-MAX_MODEL_LEN // block_size)
    num_blocks = min_blocks + rng.choice([0, 5, 25 * min_blocks])  # tight caches evict and preempt
    max_num_seqs, budget = rng.randint(1, 8), rng.choice([3, 8, 32, 128])
    requests = make_shared_prefix_requests(rng, 25)
    uncached = [Request(r.req_id, r.prompt_token_ids, r.sampling_params, (EOS,), r.arrival_time) for r in requests]
    scheduler = _scheduler(block_size, num_blocks, max_num_seqs, budget)
    reference = _scheduler(block_size, num_blocks, max_num_seqs, budget, enable_prefix_caching=False)
    run_until_done(scheduler, requests, random.Random(seed))
    run_until_done(reference, uncached, random.Random(seed))
    assert_outputs_match_reference(requests)
    stats, reference_stats = scheduler.stats(), reference.stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert stats.computed_tokens < reference_stats.computed_tokens
    assert reference_stats.prefix_cache_queries == reference_stats.prefix_cache_hits == 0
    assert reference_stats.kv_blocks_cached == 0 < stats.kv_blocks_cached
    assert stats.kv_blocks_free == stats.kv_blocks_total == num_blocks and stats.kv_blocks_used == 0


def test_a_later_request_computes_only_the_tokens_past_a_shared_prefix():
    scheduler = _scheduler(block_size=4, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    model = FakePagedModel(scheduler.block_manager)
    system = list(range(1, 19))  # 18 tokens: 4 full blocks and 2 tokens of a fifth
    a = Request("a", system + [40, 41], SamplingParams(max_tokens=20, ignore_eos=True), (EOS,))
    scheduler.add_request(a)
    assert _scheduled(_step(scheduler, model)) == [("a", 20)]
    b = Request("b", system + [42], SamplingParams(max_tokens=3, ignore_eos=True), (EOS,))
    scheduler.add_request(b)  # a still runs: its computed full blocks are shared already
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 3)]  # b's 19 tokens: 16 cached
    table_a, table_b = (scheduler.block_manager.get_block_table(r) for r in "ab")
    assert table_a[:4] == table_b[:4] and table_a[4] != table_b[4]
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.computed_tokens) == (20 + 19, 16, 24)
    # a holds 6 blocks (21 tokens computed: 5 full ones, cached), b 4 of those and one of its own
    assert stats.kv_blocks_used == 6 + 1 and stats.kv_blocks_cached == 5
    while scheduler.has_unfinished_requests():
        _step(scheduler, model)
    assert_outputs_match_reference([a, b])


@pytest.mark.parametrize("prompt_len,expected_new", [(8, 4), (9, 1), (3, 3)])
def test_a_whole_cached_prompt_still_computes_its_last_token(prompt_len, expected_new):
    """A prompt ending in a cached full block recomputes that block into one of its own (shared blocks are never
    written to); a prompt ending in a partial block computes only that."""
    scheduler = _scheduler(block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64)
    model = FakePagedModel(scheduler.block_manager)
    first, again = _new("first", prompt_len, max_tokens=2), _new("again", prompt_len, max_tokens=2)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        _step(scheduler, model)
    scheduler.add_request(again)
    assert _scheduled(_step(scheduler, model)) == [("again", expected_new)]
    assert scheduler.stats().prefix_cache_hits == prompt_len - expected_new
    while scheduler.has_unfinished_requests():
        _step(scheduler, model)
    assert again.output_token_ids == first.output_token_ids
    assert_outputs_match_reference([first, again])


def test_a_preempted_request_comes_back_on_what_is_left_of_its_cached_blocks():
    # 5 blocks of 2 tokens. a (3 tokens) and b (5 tokens) fill them; when a needs a sixth, b steps back: its
    # blocks are released last first, so a's new block evicts b's third and b keeps its first two.
    scheduler = _scheduler(block_size=2, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=10)
    model = FakePagedModel(scheduler.block_manager)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), (EOS,))
    b = Request("b", [20, 21, 22, 23, 24], SamplingParams(max_tokens=5, ignore_eos=True), (EOS,))
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert _scheduled(_step(scheduler, model)) == [("a", 3), ("b", 5)]
    assert _scheduled(_step(scheduler, model)) == [("a", 1), ("b", 1)]
    b_blocks = scheduler.block_manager.get_block_table("b")
    output = _step(scheduler, model)
    assert output.preempted == ["b"] and _scheduled(output) == [("a", 1)] and a.is_finished
    # b knows 7 tokens; positions 0-3 are still cached in its first two blocks: it computes 3, not 7.
    assert _scheduled(_step(scheduler, model)) == [("b", 3)]
    assert scheduler.block_manager.get_block_table("b")[:2] == b_blocks[:2]
    later = []
    while scheduler.has_unfinished_requests():
        later.append(_scheduled(_step(scheduler, model)))
    assert later == [[("b", 1)], [("b", 1)]]
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3 + 5 + 7, 4)
    assert stats.computed_tokens == 8 + 2 + 1 + 3 + 1 + 1
    assert_outputs_match_reference([a, b])


def test_without_prefix_caching_nothing_is_shared_or_counted():
    scheduler = _scheduler(block_size=4, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=64,
                           enable_prefix_caching=False)
    model = FakePagedModel(scheduler.block_manager)
    for name in "ab":
        scheduler.add_request(_new(name, 9, max_tokens=2))
        while scheduler.has_unfinished_requests():
            output = _step(scheduler, model)
    assert _scheduled(output) == [("b", 1)]
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.kv_blocks_cached) == (0, 0, 0)
    assert stats.computed_tokens == 2 * (9 + 1)
