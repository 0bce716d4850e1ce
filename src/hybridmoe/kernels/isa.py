"""Which kernel ISA runs, what the CPU offers, and the kernels' thread pool.

The best ISA the CPU and the build support runs (amx > avx512bf16 on AMD CPUs > avx512 > avx2 > scalar);
HYBRIDMOE_ISA=scalar|avx2|avx2bf16|avx512|avx512bf16|amx forces one (an unusable value raises ValueError naming the
missing CPU features). amx (CPUs with AMX-BF16, once Linux grants the process the tile state) multiplies bf16 and
fp8 weights by AMX tiles (activations rounded to bf16) from amx_min_tokens() tokens per expert, and runs as
avx512 otherwise. avx512bf16 runs bf16 and fp8 weights on the GEMV path with bf16 dot products
(activations rounded to bf16) from Matrix.bf16_dot_min_tokens tokens per expert (1 fp8, 4 bf16; 1 for bf16 rows
of 4 KB and more), and as avx512 otherwise; avx2bf16 emulates it on AVX2 to test it anywhere and is never chosen
by itself. avx512bf16 is chosen on AMD CPUs only: on an Emerald Rapids Xeon it was no faster than avx512
(docs/kernels.md, "ISA dispatch").
HYBRIDMOE_NUM_THREADS sets the pool size (default: the CPUs this process may use). HYBRIDMOE_SPIN_US sets how long
an idle worker spins for the next call before it sleeps (idle_spin_us; default 100 us): long enough to span the
accelerator's work between two MoE layers, the workers need no wake-up and their CPUs stay awake, but a spinning
worker holds its CPU from any other work, such as torch's where the CPU stands in for the accelerator.
HYBRIDMOE_SHORT_ROW_PREFETCH=l1|l2 sets where the GEMV's prefetch that reaches ahead puts rows under 3 KB at one
token (short_row_prefetch; default by CPU: l2 where the CPU has AVX-512, since the prefetch into L1 held up the L1
miss buffers of the AMD Zen 4 and the AMX Xeon measured; l1 on AVX2-only CPUs). HYBRIDMOE_LONG_ROW_PREFETCH=on|off
sets whether the GEMV's one-row tiles of rows of 4 KB and more (one token) prefetch the next row as they read their
own (long_row_prefetch; default by CPU: off on AMD Zen 3, where the hardware prefetchers alone read faster, on
elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

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
    """Whether `name` may run without being forced (never avx2bf16; avx512bf16 on AMD CPUs; see the module's
    doc)."""
    return _native.isa_auto_selected(name)


def bf16_dot(name: str | None = None) -> bool:
    """Whether ISA `name` (default: the active one) rounds the activations of bf16 and fp8 weight matmuls to
    bf16 and multiplies them with bf16 dot products; ValueError if it cannot run here."""
    return _native.isa_bf16_dot(name or active_isa())


def amx(name: str | None = None) -> bool:
    """Whether ISA `name` (default: the active one) multiplies bf16 and fp8 weights by AMX tiles, with their
    activations rounded to bf16, from amx_min_tokens() tokens per expert (and wherever the GEMM path runs);
    ValueError if it cannot run here."""
    return _native.isa_amx(name or active_isa())


def amx_min_tokens() -> int:
    """Tokens per expert from which the amx ISA's auto path takes its AMX tiles for bf16 and fp8 weights."""
    return int(_native.amx_min_tokens())


def amx_int_min_tokens() -> int:
    """Tokens per expert from which the amx ISA's auto path takes its AMX tiles for int4 and int8 weights (codes
    times scales and the activations rounded to bf16)."""
    return int(_native.amx_int_min_tokens())


def bf16_dot_min_tokens() -> dict[str, int]:
    """Per weight format ("fp8", "bf16"): the tokens per expert from which a bf16 dot-product ISA multiplies with
    bf16 dot products (fewer take its base ISA's float32 GEMV); bf16 rows of bf16_dot_long_row_bytes() and more
    take them from one token. Matrix.bf16_dot_min_tokens gives one matrix's threshold."""
    return dict(_native.bf16_dot_min_tokens())


def bf16_dot_long_row_bytes() -> int:
    """The bf16 row length in bytes from which a bf16 dot-product ISA takes its bf16 dot products from one token."""
    return int(_native.bf16_dot_long_row_bytes())


def active_isa() -> str:
    """The ISA the kernels use now (HYBRIDMOE_ISA on first use, else the best available)."""
    return _native.active_isa()


def set_isa(name: str) -> None:
    """Switch kernels to `name` (after in-flight work finishes); ValueError if it cannot run here."""
    _native.set_isa(name)


@contextmanager
def _set_within(get: Callable[[], str], set_to: Callable[[str], None], value: str) -> Iterator[None]:
    """The block runs with set_to(value); the value get() gave before is set again after it."""
    previous = get()
    set_to(value)
    try:
        yield
    finally:
        set_to(previous)


def use_isa(name: str) -> AbstractContextManager[None]:
    """Run the block with ISA `name`, then restore the previous one."""
    return _set_within(active_isa, set_isa, name)


def cpu_features() -> dict[str, bool]:
    """The SIMD features the kernels care about, as detected (OS support included), and "amd" (the CPU's vendor
    is AMD: the automatic choice takes avx512bf16 there)."""
    return dict(_native.cpu_features())


def cpu_family() -> int:
    """The CPU's cpuid display family (AMD: 0x19 Zen 3 / Zen 4, 0x1A Zen 5; 0 where not x86)."""
    return int(_native.cpu_family())


def configure_threads(num_threads: int | None = None, cpus: list[int] | None = None) -> None:
    """Replace the kernels' thread pool: `num_threads` threads (default: available CPUs), thread i pinned to
    cpus[i % len(cpus)] when `cpus` is given."""
    if num_threads is None:
        num_threads = _native.available_cpus()
    _native.configure_threads(int(num_threads), list(cpus or []))


def num_threads() -> int:
    return _native.num_threads()


def idle_spin_us() -> int:
    """How long an idle pool worker spins for the next call before it sleeps, in microseconds."""
    return int(_native.idle_spin_us())


def set_idle_spin_us(us: int) -> None:
    """Set idle_spin_us() for every pool, workers spinning now included; ValueError outside 0-10,000,000."""
    _native.set_idle_spin_us(int(us))


def short_row_prefetch() -> str:
    """Where the GEMV's prefetch that reaches ahead puts rows under 3 KB at one token (any tokens with bf16 dot
    products): "l1" or "l2". At "l2" each line is asked for twice, the first time about twice as far ahead, and so
    are the lines of long rows read one row at a time (docs/kernels.md, "How the kernels compute")."""
    return str(_native.short_row_prefetch())


def default_short_row_prefetch() -> str:
    """This CPU's short_row_prefetch() without HYBRIDMOE_SHORT_ROW_PREFETCH: "l2" with AVX-512, else "l1"."""
    return str(_native.default_short_row_prefetch())


def set_short_row_prefetch(level: str) -> None:
    """Set short_row_prefetch() ("l1" or "l2", else ValueError) for the matrices computed from now on."""
    _native.set_short_row_prefetch(str(level))


def use_short_row_prefetch(level: str) -> AbstractContextManager[None]:
    """short_row_prefetch() is `level` within the block, then back to what it was."""
    return _set_within(short_row_prefetch, set_short_row_prefetch, level)


def long_row_prefetch() -> str:
    """Whether the GEMV's one-row tiles of long rows (one token, rows of 4 KB and more: attention projections,
    the LM head) prefetch the next row into L2 as they read their own: "on" or "off" (docs/kernels.md, "Prefetch")."""
    return str(_native.long_row_prefetch())


def default_long_row_prefetch() -> str:
    """This CPU's long_row_prefetch() without HYBRIDMOE_LONG_ROW_PREFETCH: "off" on AMD Zen 3, else "on"."""
    return str(_native.default_long_row_prefetch())


def set_long_row_prefetch(state: str) -> None:
    """Set long_row_prefetch() ("on" or "off", else ValueError) for the matrices computed from now on."""
    _native.set_long_row_prefetch(str(state))


def use_long_row_prefetch(state: str) -> AbstractContextManager[None]:
    """long_row_prefetch() is `state` within the block, then back to what it was."""
    return _set_within(long_row_prefetch, set_long_row_prefetch, state)


def pool_sleeps() -> int:
    """Times the pool's workers went to sleep after spinning idle (each then needed a wake-up)."""
    return int(_native.pool_sleeps())


def thread_cpus() -> list[int]:
    """The CPUs threads are pinned to ([] when not pinned)."""
    return list(_native.thread_cpus())
