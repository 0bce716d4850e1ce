"""Which kernel ISA runs, what the CPU offers, and the kernels' thread pool.

The best ISA the CPU and the build support runs (avx512 > avx2 > scalar);
HYBRIDMOE_ISA=scalar|avx2|avx2bf16|avx512|avx512bf16 forces one (an unusable value raises ValueError naming the
missing CPU features). avx512bf16 runs bf16 and fp8 weights with bf16 dot products (activations rounded to
bf16); avx2bf16 emulates those on AVX2 to test them anywhere. Neither is chosen by itself: avx512bf16 measured
no faster than avx512 (docs/kernels.md).
HYBRIDMOE_NUM_THREADS sets the pool size (default: the CPUs this process may use).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hybridmoe.kernels import _native


def all_isas() -> list[str]:
    """Every ISA the kernels know, best first."""
    return list(_native.isa_names())


def available_isas() -> list[str]:
    """ISAs this CPU and this build can run, best first (always includes "scalar")."""
    return [name for name in _native.isa_names() if not _native.isa_unavailable_reason(name)]


def unavailable_reason(name: str) -> str:
    """Why `name` cannot run here ("" when it can)."""
    return _native.isa_unavailable_reason(name)


def auto_selected(name: str) -> bool:
    """Whether `name` may run without being forced (False for the bf16 dot-product ISAs, see the module's doc)."""
    return _native.isa_auto_selected(name)


def bf16_dot(name: str | None = None) -> bool:
    """Whether ISA `name` (default: the active one) rounds the activations of bf16 and fp8 weight matmuls to
    bf16 and multiplies them with bf16 dot products; ValueError if it cannot run here."""
    return _native.isa_bf16_dot(name or active_isa())


def active_isa() -> str:
    """The ISA the kernels use now (HYBRIDMOE_ISA on first use, else the best available)."""
    return _native.active_isa()


def set_isa(name: str) -> None:
    """Switch kernels to `name` (after in-flight work finishes); ValueError if it cannot run here."""
    _native.set_isa(name)


@contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the block with ISA `name`, then restore the previous one."""
    previous = active_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def cpu_features() -> dict[str, bool]:
    """The SIMD features the kernels care about, as detected (OS support included)."""
    return dict(_native.cpu_features())


def configure_threads(num_threads: int | None = None, cpus: list[int] | None = None) -> None:
    """Replace the kernels' thread pool: `num_threads` threads (default: available CPUs), thread i pinned to
    cpus[i % len(cpus)] when `cpus` is given."""
    if num_threads is None:
        num_threads = _native.available_cpus()
    _native.configure_threads(int(num_threads), list(cpus or []))


def num_threads() -> int:
    return _native.num_threads()


def thread_cpus() -> list[int]:
    """The CPUs threads are pinned to ([] when not pinned)."""
    return list(_native.thread_cpus())
