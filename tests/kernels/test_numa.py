"""The fused MoE split over emulated NUMA nodes: each node computes its shard of every expert's intermediate
dimension and the partial outputs are summed. Compared with the single-node result (float tolerance) and the
float64 reference (the single-node tolerances), for every format and ISA here, 2 and 3 nodes, T in {1, 5, 40}; shard
boundaries on block / group boundaries, uneven I, shard copies (what several real nodes do), thread layout,
errors, and `hybridmoe info`."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch

from hybridmoe.kernels import _native, isa, numa, reference
from hybridmoe.kernels.moe import FusedMoE
from kernel_testing import bf16_activation_tolerance, random_experts, random_routing, seed

E, H, I, K = 5, 200, 300, 2  # I = 300: a partial fp8 block (44), a padded int group, not a multiple of N x 32
# (format, int group) -> the granularity the layer must cut I on
CASES = [("fp8", 32, 128), ("int4", 32, 32), ("int4", 128, 128), ("int8", 32, 32), ("int8", 128, 128),
         ("bf16", 32, 32), ("f32", 32, 32)]


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _reference_tolerance(fmt: str) -> float:
    # as test_moe (fp32 hidden; see its _tolerance)
    return 5e-2 if fmt in ("int4", "int8") else 2e-5 + bf16_activation_tolerance(fmt)


def _emulated_nodes(n: int) -> list[list[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return [[cpus[i % len(cpus)]] for i in range(n)]


def _batches(gen: torch.Generator):
    for tokens in (1, 5, 40, 500):  # 2 of 5 experts: 16 / 200 tokens an expert, the GEMM path of fp8 / of all
        yield (torch.randn(tokens, H, generator=gen),) + random_routing(tokens, K, E, gen)


def _check_shards(shards, granularity: int, nodes: int) -> None:
    assert len(shards) == nodes
    assert shards[0][0] == 0 and shards[-1][1] == I
    for (b0, e0, *_), (b1, _e1, *_) in zip(shards, shards[1:]):
        assert e0 == b1  # contiguous, no overlap: every I column on exactly one node
    for begin, end, *_ in shards:
        assert begin % granularity == 0 and (end % granularity == 0 or end == I) and begin < end


@pytest.mark.parametrize("nodes", [2, 3])
@pytest.mark.parametrize("fmt,group,granularity", CASES)
def test_split_over_nodes_matches_single_node_and_float64(each_isa, nodes, fmt, group, granularity):
    gen = torch.Generator().manual_seed(seed(fmt, group, nodes, each_isa))
    kwargs, exact = random_experts(fmt, E, H, I, gen, group=group)
    batches = list(_batches(gen))
    single = FusedMoE(**kwargs)
    assert [s[:2] for s in single.numa_shards] == [(0, I)]
    expected = [single(*batch) for batch in batches]
    with numa.use_numa(_emulated_nodes(nodes)):
        split = FusedMoE(**kwargs)
        _check_shards(split.numa_shards, granularity, nodes)
        assert all(s[2] == 0 for s in split.numa_shards)  # emulated: views, no copy
        for batch, single_out in zip(batches, expected):
            out = split(*batch)
            assert _error(out, single_out) < 1e-5, f"T={batch[0].shape[0]}"
            assert _error(out, reference.moe_reference(*batch, exact)) < _reference_tolerance(fmt)


@pytest.mark.parametrize("fmt,group,granularity", CASES)
def test_shard_copies_hold_every_weight_once(fmt, group, granularity):
    gen = torch.Generator().manual_seed(seed(fmt, group, "copy"))
    kwargs, exact = random_experts(fmt, E, H, I, gen, group=group)
    batches = list(_batches(gen))
    expected = [FusedMoE(**kwargs)(*batch) for batch in batches]
    with numa.use_numa(_emulated_nodes(2), copy_shards=True, memory_nodes=[0, 0]):  # bound to the real node 0
        split = FusedMoE(**kwargs)
        _check_shards(split.numa_shards, granularity, 2)
        weight_bytes = sum(t.numel() * t.element_size() for name in ("gate", "up", "down") for t in kwargs[name])
        scale_bytes = sum(t.numel() * t.element_size() for name in ("gate_scale", "up_scale", "down_scale")
                          for t in kwargs.get(name, []))
        copied = sum(s[2] for s in split.numa_shards)
        # every weight and scale once; plus fp8 code flags (2 bytes a row; down's H rows on each node) and
        # 64-byte alignment of each piece; a duplicated weight would exceed this
        extras = (E * 4 * (I + H) if fmt == "fp8" else 0) + 2 * E * 3 * 3 * 64
        assert weight_bytes + scale_bytes <= copied <= weight_bytes + scale_bytes + extras
        assert all(s[3] for s in split.numa_shards), "mbind to node 0 failed"
        for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
            for t in kwargs.get(name, []):  # the split layer must read its copies, not these
                t.view(torch.uint8).fill_(0x3C)
        for batch, single_out in zip(batches, expected):
            out = split(*batch)
            assert _error(out, single_out) < 1e-5
            assert _error(out, reference.moe_reference(*batch, exact)) < _reference_tolerance(fmt)
        # each node's intermediate activations and partial outputs live in its memory (node 0 here)
        buffers = _native.work_buffers()
        assert [b[:2] for b in buffers] == [(-1, -1), (0, 0), (1, 0)] and all(b[3] for b in buffers[1:])


@pytest.mark.parametrize("fmt,group,granularity", [("fp8", 32, 128), ("int4", 32, 32), ("bf16", 32, 32)])
def test_shard_copies_into_given_buffers_are_written_once_and_read_by_another_layer(fmt, group, granularity):
    """What two PD workers do with the segment they share: the first layer writes each node's copies into the
    buffers it is given (shard_copy_bytes long), a second one told they are filled lays its matrices over them
    without writing; both compute the single-node result, after the original weights are gone."""
    gen = torch.Generator().manual_seed(seed(fmt, group, "buffers"))
    kwargs, exact = random_experts(fmt, E, H, I, gen, group=group)
    batches = list(_batches(gen))
    expected = [FusedMoE(**kwargs)(*batch) for batch in batches]
    with numa.use_numa(_emulated_nodes(2), copy_shards=True, memory_nodes=[0, 0]):
        sizes = [s[2] for s in FusedMoE(**kwargs).numa_shards]
        buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        asked = []

        def storage(filled):
            def get(node, nbytes):
                asked.append((node, nbytes))
                return buffers[node], filled
            return get

        writer = FusedMoE(**kwargs, shard_storage=storage(False))
        assert asked == list(enumerate(sizes)) and all(b.any() for b in buffers)
        written = [b.clone() for b in buffers]
        reader = FusedMoE(**kwargs, shard_storage=storage(True))
        assert all(torch.equal(b, w) for b, w in zip(buffers, written)), "a filled buffer was written"
        assert writer.owns_weights and reader.owns_weights
        assert [s[2] for s in reader.numa_shards] == sizes
        for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
            for t in kwargs.get(name, []):  # both layers must read the buffers, not these
                t.view(torch.uint8).fill_(0x3C)
        for batch, single_out in zip(batches, expected):
            for layer in (writer, reader):
                out = layer(*batch)
                assert _error(out, single_out) < 1e-5
                assert _error(out, reference.moe_reference(*batch, exact)) < _reference_tolerance(fmt)
        with pytest.raises(ValueError, match="shard buffer of node 0: 7 bytes, its copies take"):
            FusedMoE(**kwargs, shard_storage=lambda node, nbytes: (torch.zeros(7 if node == 0 else nbytes,
                                                                               dtype=torch.uint8), False))
    with numa.use_numa(_emulated_nodes(2)):  # views, no copies: nothing is asked for
        FusedMoE(**kwargs, shard_storage=lambda node, nbytes: pytest.fail("asked for a buffer"))


def test_copied_layer_lets_the_original_weights_go():
    gen = torch.Generator().manual_seed(5)
    kwargs, exact = random_experts("fp8", E, H, I, gen)
    batch = (torch.randn(5, H, generator=gen),) + random_routing(5, K, E, gen)
    expected = reference.moe_reference(*batch, exact)
    names = [name for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale") if name in kwargs]
    with numa.use_numa(_emulated_nodes(2), copy_shards=True):
        owned = {name: [t.clone() for t in kwargs[name]] for name in names}
        refs = [weakref.ref(t) for name in names for t in owned[name]]
        layer = FusedMoE(**{**kwargs, **owned})
        assert layer.owns_weights
        del owned
        gc.collect()
        assert all(r() is None for r in refs), "the layer still holds the weights it copied"
        assert _error(layer(*batch), expected) < _reference_tolerance("fp8")
        with numa.use_numa(_emulated_nodes(2)):  # views: the layer must keep the weights alive
            views = FusedMoE(**kwargs)
            assert not views.owns_weights and views._tensors is not None
            views(*batch)
            assert [b[:2] for b in _native.work_buffers()] == [(-1, -1), (0, -1), (1, -1)]  # unbound
    assert not FusedMoE(**kwargs).owns_weights  # one node: views


def test_fewer_units_than_nodes_bf16_hidden_and_a_single_node_layer_on_a_split_pool():
    gen = torch.Generator().manual_seed(3)
    kwargs, exact = random_experts("fp8", E, H, 72, gen)  # one fp8 block for 3 nodes: two nodes idle
    hidden = torch.randn(6, H, generator=gen).bfloat16()
    ids, weights = random_routing(6, K, E, gen)
    single = FusedMoE(**kwargs)
    expected = single(hidden, ids, weights)
    with numa.use_numa(_emulated_nodes(3)):
        split = FusedMoE(**kwargs)
        assert sorted(s[1] - s[0] for s in split.numa_shards) == [0, 0, 72]
        assert torch.equal(split(hidden, ids, weights), expected)  # one node works: same sums
        assert torch.equal(single(hidden, ids, weights), expected)  # built for one node: all threads share it
        assert _error(expected, reference.moe_reference(hidden, ids, weights, exact)) < 1e-2


def test_thread_layout_and_errors():
    a, b = _emulated_nodes(2)  # this process's CPUs (a pytest-xdist worker keeps a share of them)
    with numa.use_numa([a, b], num_threads=5):
        assert numa.thread_nodes() == [0, 0, 0, 1, 1]
        assert isa.thread_cpus() == a * 3 + b * 2
        topo = numa.topology()
        assert topo["nodes"] == [a, b] and topo["emulated"] and "2 nodes (emulated)" in topo["description"]
        gen = torch.Generator().manual_seed(4)
        kwargs, _ = random_experts("bf16", E, H, I, gen)
        split = FusedMoE(**kwargs)
        with pytest.raises(ValueError, match="pinned to their node's CPUs"):
            isa.configure_threads(2, a)
        with pytest.raises(ValueError, match="at least one thread per NUMA node"):
            isa.configure_threads(1)
        numa.configure_numa([a, b, a])
        with pytest.raises(RuntimeError, match="split over 2 NUMA nodes but the thread pool has 3"):
            split(torch.randn(1, H), *random_routing(1, K, E, gen))
        with pytest.raises(ValueError, match="memory_nodes: one per node"):
            numa.configure_numa([a, b], memory_nodes=[0])
        with pytest.raises(ValueError, match="NUMA node 1: CPU -1 is not a valid CPU"):
            numa.configure_numa([a, [-1]])
        with pytest.raises(ValueError, match="NUMA node 1: CPU 1000 is not available to this process"):
            numa.configure_numa([a, [1000]])
    assert numa.topology() == numa.detected_topology()
    assert set(numa.thread_nodes()) == {0} or len(numa.topology()["nodes"]) > 1


@pytest.mark.parametrize("nodes,threads", [(1, 8), (3, 9)])
def test_many_short_calls_back_to_back_on_more_threads_than_cpus(nodes, threads):
    """The pool's task sets follow each other within microseconds and its workers join and leave them without a
    lock, so that a worker slow to wake meets the next set as the caller opens it (more threads than CPUs make
    such workers common): every call must give its own result, on a flat pool and on one split over nodes
    (whose sets wait for every worker)."""
    gen = torch.Generator().manual_seed(seed("back to back", nodes))
    kwargs, _ = random_experts("bf16", E, H, I, gen)
    batches = [(torch.randn(t, H, generator=gen),) + random_routing(t, K, E, gen) for t in (1, 2, 3, 7)]
    expected = [FusedMoE(**kwargs)(*batch) for batch in batches]
    with numa.use_numa(_emulated_nodes(nodes), num_threads=threads):
        assert isa.num_threads() == threads
        moe = FusedMoE(**kwargs)
        for step in range(400):
            i = step % len(batches)
            assert _error(moe(*batches[i]), expected[i]) < 1e-5, f"step {step}, batch {i}"


def test_split_range_is_even_on_whole_units():
    assert numa.split_range(300, 128, 2) == [(0, 128), (128, 300)]
    assert numa.split_range(300, 32, 3) == [(0, 96), (96, 192), (192, 300)]
    assert numa.split_range(72, 128, 2) == [(0, 0), (0, 72)]


def test_a_single_overridden_node_pins_its_threads_to_its_cpus():
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with numa.use_numa([[cpu]]):
        assert isa.num_threads() == 1 and isa.thread_cpus() == [cpu]
    assert isa.thread_cpus() == [] or len(numa.topology()["nodes"]) > 1  # detected one node: threads run free


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with `env` added to this environment (variables read at the pool's first use)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=120)


def test_bad_numa_nodes_in_the_environment_are_a_clear_error():
    [a] = _emulated_nodes(1)
    result = _run_python("from hybridmoe.kernels import numa; numa.topology()", HYBRIDMOE_NUMA_NODES=f"{a[0]};1000")
    assert result.returncode != 0
    assert "NUMA node 1: CPU 1000 is not available to this process" in result.stderr


def test_info_prints_the_numa_layout_from_the_environment():
    [a], [b] = _emulated_nodes(2)
    result = _run_python("from hybridmoe.cli import main; main(['info'])", HYBRIDMOE_NUMA_NODES=f"{a};{a},{b}")
    assert result.returncode == 0, result.stderr
    both = f"{a}-{b}" if b == a + 1 else f"{a},{b}"
    assert f"NUMA layout: 2 nodes (emulated); node 0 cpus {a} memory unbound; node 1 cpus {both}" in result.stdout
    assert "threads per node: node 0: 1, node 1: 2" in result.stdout


def _thp_available() -> bool:
    return os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def test_one_node_copies_on_huge_pages_compute_the_same():
    gen = torch.Generator().manual_seed(6)
    kwargs, exact = random_experts("fp8", 8, 1024, 512, gen)  # 12 MB of weights: the copy is advised for THP
    batch = (torch.randn(5, 1024, generator=gen),) + random_routing(5, K, 8, gen)
    views = FusedMoE(**kwargs)
    assert views.numa_shards == [(0, 512, 0, False, False)] and not views.owns_weights
    expected = views(*batch)
    with numa.use_numa(None, copy_shards=True):
        assert "experts copied at load into huge-page node memory" in numa.topology()["description"]
        copied = FusedMoE(**kwargs)
        [(begin, end, nbytes, bound, huge)] = copied.numa_shards
        weight_bytes = sum(t.numel() * t.element_size() for name in ("gate", "up", "down") for t in kwargs[name])
        assert (begin, end, bound) == (0, 512, False) and nbytes >= weight_bytes
        assert huge == _thp_available() and copied.owns_weights
        for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
            for t in kwargs[name]:  # the layer must read its copies
                t.view(torch.uint8).fill_(0x3C)
        assert torch.equal(copied(*batch), expected)  # the same single-node computation, bit for bit
        assert _error(expected, reference.moe_reference(*batch, exact)) < _reference_tolerance("fp8")
    assert numa.topology() == numa.detected_topology()


@pytest.mark.parametrize("value,copies", [("1", True), ("0", False)])
def test_copy_experts_from_the_environment(value, copies):
    here = os.path.dirname(os.path.abspath(__file__))  # kernel_testing's folder
    code = (f"import torch, sys; sys.path.insert(0, {here!r}); from kernel_testing import random_experts; "
            "from hybridmoe.kernels import numa; from hybridmoe.kernels.moe import FusedMoE; "
            "kw, _ = random_experts('int4', 4, 256, 256, torch.Generator().manual_seed(0)); "
            "print(numa.topology()['copy_shards'], FusedMoE(**kw).owns_weights)")
    result = _run_python(code, HYBRIDMOE_COPY_EXPERTS=value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(copies), str(copies)]


def test_bad_copy_experts_value_is_a_clear_error():
    result = _run_python("from hybridmoe.kernels import numa; numa.topology()", HYBRIDMOE_COPY_EXPERTS="yes")
    assert result.returncode != 0
    assert 'HYBRIDMOE_COPY_EXPERTS must be 0 (experts read in place) or 1' in result.stderr


def test_a_matrix_given_for_several_experts_is_copied_once():
    gen = torch.Generator().manual_seed(7)
    kwargs, exact = random_experts("int8", 2, H, I, gen)
    aliased = {name: [kwargs[name][e % 2] for e in range(6)] for name in kwargs if isinstance(kwargs[name], list)}
    batch = (torch.randn(4, H, generator=gen),) + random_routing(4, K, 6, gen)
    expected = FusedMoE(**{**kwargs, **aliased})(*batch)
    with numa.use_numa(None, copy_shards=True):
        two = FusedMoE(**kwargs).numa_shards[0][2]
        six = FusedMoE(**{**kwargs, **aliased})
        assert six.numa_shards[0][2] == two  # six experts over two distinct ones: two experts' bytes
        assert torch.equal(six(*batch), expected)
