"""Timing helpers shared by the profile and the benchmarks, and the cache size that sizes their working sets."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from pathlib import Path

MAX_RUNS = 50  # timed runs of one measurement at most


def last_level_cache_bytes() -> int:
    """Size of this CPU's largest cache (sysfs), 32 MiB when unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


def release_freed_memory() -> None:
    """Give the memory freed in this process's malloc heaps back to the system (glibc's malloc_trim; a no-op
    elsewhere). Freed medium-sized blocks (up to glibc's mmap threshold, which rises to 32 MiB after large frees)
    otherwise stay resident: measuring GBs of synthetic weights left a long-lived process GBs larger."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return
    if trim is not None:
        trim(0)


def best_time(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timed_runs(fn, min_repeats: int = 3, budget_s: float = 0.1) -> list[float]:
    """Seconds of each timed run of fn: one warm-up, then at least min_repeats runs (more while within
    budget_s, at most MAX_RUNS)."""
    fn()
    times: list[float] = []
    while len(times) < min_repeats or (sum(times) < budget_s and len(times) < MAX_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_s(fn, min_repeats: int = 3, budget_s: float = 0.1) -> float:
    return statistics.median(timed_runs(fn, min_repeats, budget_s))


class OpTimer:
    """Times single op calls the way they run inside the engine: each right after `between()` (untimed; the
    op tables pass a step of the engine on a minimal-width copy of the model), which leaves the core's caches,
    branch predictors and allocator as the engine's surrounding ops do. A small matmul timed in a tight loop of
    its own runs about 1.5x faster than inside engine steps; after a minimal-width step it runs as inside."""

    def __init__(self, between):
        self.between = between

    def median_s(self, fn, min_repeats: int = 5, budget_s: float = 0.1) -> float:
        """Median seconds of fn() over at least min_repeats calls (more while within budget_s, at most
        MAX_RUNS), each after between(); one untimed call first."""
        fn()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < MAX_RUNS):
            self.between()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def rotating(pool: list, op):
    """A call that applies op to the next item of pool each time (cyclically)."""
    cursor = [0]

    def call():
        op(pool[cursor[0] % len(pool)])
        cursor[0] += 1
    return call
