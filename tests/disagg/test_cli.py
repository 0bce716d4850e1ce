"""`hybridmoe serve`'s PD flags are checked before anything starts; CPU lists."""

from __future__ import annotations

import pytest

from hybridmoe.cli import main
from hybridmoe.disagg.cpus import parse_cpu_list, split_cpus


@pytest.mark.parametrize("argv, message", [
    (["serve", "--kv-budget", "0.5"], "--kv-budget sets up --pd's workers"),
    (["serve", "--pd-decode-cpus", "0"], "--pd-decode-cpus sets up --pd's workers"),
    (["serve", "--kv-importance", "position"], "--kv-importance sets up --pd's workers"),
    (["serve", "--no-kv-streaming"], "--no-kv-streaming sets up --pd's workers"),
    (["serve", "--pd", "--kv-budget", "0.01"], "kv budget must be in"),
    (["serve", "--pd", "--pd-prefill-cpus", "100000"], "prefill_cpus: CPUs [100000] are not among"),
    (["serve", "--pd", "--pd-decode-cpus", "3-1"], "expected numbers and ranges"),
])
def test_pd_flags_are_refused_without_pd_or_out_of_range(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cpu_lists():
    assert parse_cpu_list("0-3,8, 2") == [0, 1, 2, 3, 8]
    for bad in ("", "a", "1-", "-1", "4-2"):
        with pytest.raises(ValueError, match="expected numbers and ranges"):
            parse_cpu_list(bad)


def test_benchmark_cpu_splits(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert split_cpus("auto", 0.25) == ([0, 1], [2, 3, 4, 5, 6, 7])
    assert split_cpus("auto", 0.5) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert split_cpus("0:1-3", 0.5) == ([0], [1, 2, 3]) and split_cpus("none", 0.5) is None
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert split_cpus("auto", 0.5) is None
    with pytest.raises(ValueError, match="expected auto, none or PREFILL_CPUS:DECODE_CPUS"):
        split_cpus("0-3", 0.5)
