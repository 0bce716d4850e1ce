"""ISA detection and selection: what runs, what HYBRIDMOE_ISA forces, clear errors for what cannot run."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridmoe.kernels import _native, isa


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_best_available_isa_is_selected_by_default():
    available = isa.available_isas()
    assert available[-1] == "scalar"
    result = _run("from hybridmoe.kernels import isa; print(isa.active_isa())", HYBRIDMOE_ISA="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == [name for name in available if isa.auto_selected(name)][0]
    assert not isa.auto_selected("avx2bf16")  # only when forced
    assert isa.auto_selected("avx512bf16") == isa.cpu_features()["amd"]  # measured faster on Zen 4 only
    assert isa.auto_selected("amx")


def test_avx2_path_follows_the_cpu_features():
    features = isa.cpu_features()
    has_avx2 = features["avx"] and features["avx2"] and features["fma"] and features["f16c"]
    has_avx512 = (features["avx512f"] and features["avx512bw"] and features["avx512vl"] and features["avx512dq"]
                  and features["avx512_vnni"] and has_avx2)
    available = isa.available_isas()
    assert ("avx2" in available) == ("avx2bf16" in available) == has_avx2
    assert ("avx512" in available) == has_avx512
    assert ("avx512bf16" in available) == (has_avx512 and features["avx512_bf16"])
    assert ("amx" in available) == (has_avx512 and features["avx512_bf16"] and features["amx_tile"]
                                    and features["amx_bf16"])
    assert {name: isa.bf16_dot(name) for name in available} == {
        name: name in ("avx512bf16", "avx2bf16") for name in available}
    assert {name: isa.amx(name) for name in available} == {name: name == "amx" for name in available}


@pytest.mark.parametrize("name", isa.available_isas())
def test_env_var_forces_an_available_isa(name):
    result = _run("from hybridmoe.kernels import isa; print(isa.active_isa())", HYBRIDMOE_ISA=name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == name


def test_env_var_naming_an_unknown_isa_is_a_clear_error():
    result = _run("from hybridmoe.kernels import isa; isa.active_isa()", HYBRIDMOE_ISA="sse9")
    assert result.returncode != 0
    assert "HYBRIDMOE_ISA=sse9" in result.stderr and "unknown ISA" in result.stderr


def test_unavailable_isa_cannot_be_forced():
    missing = [name for name in isa.all_isas() if name not in isa.available_isas()]
    if not missing:
        pytest.skip("every ISA runs on this CPU")
    reason = isa.unavailable_reason(missing[0])
    assert "lacks" in reason or "no " in reason
    with pytest.raises(ValueError, match=missing[0]):
        isa.set_isa(missing[0])
    result = _run("from hybridmoe.kernels import isa; isa.active_isa()", HYBRIDMOE_ISA=missing[0])
    assert result.returncode != 0 and "cannot run" in result.stderr


def test_use_isa_restores_the_previous_one():
    before = isa.active_isa()
    with isa.use_isa("scalar"):
        assert isa.active_isa() == "scalar"
    assert isa.active_isa() == before


def test_info_prints_the_bf16_dot_product_thresholds():
    """`hybridmoe info` states, for each bf16 dot-product ISA that runs here, from how many tokens per expert it
    takes its bf16 dot products (the kernels' own thresholds, not a copy)."""
    min_tokens = isa.bf16_dot_min_tokens()
    assert set(min_tokens) == {"fp8", "bf16"} and all(n >= 1 for n in min_tokens.values())
    result = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "info"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    dot_isas = [name for name in isa.available_isas() if isa.bf16_dot(name)]
    lines = [line for line in result.stdout.splitlines() if "bf16 dot products" in line]
    assert len(lines) == len(dot_isas)
    for line in lines:
        assert (f"from {min_tokens['bf16']}/{min_tokens['fp8']} tokens per expert (bf16 rows of "
                f"{isa.bf16_dot_long_row_bytes()} bytes and more: from 1)") in line


def test_bad_idle_spin_values_are_clear_errors():
    with pytest.raises(ValueError, match="idle spin must be between 0 and 10000000 microseconds, got -1"):
        isa.set_idle_spin_us(-1)
    result = _run("from hybridmoe.kernels import isa; isa.num_threads()", HYBRIDMOE_SPIN_US="1ms")
    assert result.returncode != 0
    assert "HYBRIDMOE_SPIN_US must be an integer between 0 and 10000000 (microseconds), got '1ms'" in result.stderr
    result = _run("from hybridmoe.kernels import isa; print(isa.idle_spin_us())", HYBRIDMOE_SPIN_US="2500")
    assert result.returncode == 0 and result.stdout.strip() == "2500", result.stderr


def test_short_row_prefetch_defaults_by_cpu_and_can_be_set():
    """Short rows' far prefetch goes to L2 on CPUs with AVX-512, to L1 on the others, unless
    HYBRIDMOE_SHORT_ROW_PREFETCH or set_short_row_prefetch says otherwise."""
    assert isa.default_short_row_prefetch() == ("l2" if isa.cpu_features()["avx512f"] else "l1")
    code = "from hybridmoe.kernels import isa; isa.active_isa(); print(isa.short_row_prefetch())"
    result = _run(code, HYBRIDMOE_SHORT_ROW_PREFETCH="")
    assert result.returncode == 0 and result.stdout.strip() == isa.default_short_row_prefetch(), result.stderr
    for level in ("l1", "l2"):
        result = _run(code, HYBRIDMOE_SHORT_ROW_PREFETCH=level)
        assert result.returncode == 0 and result.stdout.strip() == level, result.stderr
    before = isa.short_row_prefetch()
    other = "l1" if before == "l2" else "l2"
    with isa.use_short_row_prefetch(other):
        assert isa.short_row_prefetch() == other
    assert isa.short_row_prefetch() == before


def test_long_row_prefetch_defaults_by_cpu_and_can_be_set():
    """One-row tiles of long rows prefetch the next row except on AMD Zen 3 (family 0x19 without AVX-512),
    unless HYBRIDMOE_LONG_ROW_PREFETCH or set_long_row_prefetch says otherwise; other values are clear errors."""
    features = isa.cpu_features()
    zen3 = features["amd"] and isa.cpu_family() == 0x19 and not features["avx512f"]
    assert isa.default_long_row_prefetch() == ("off" if zen3 else "on")
    code = "from hybridmoe.kernels import isa; isa.active_isa(); print(isa.long_row_prefetch())"
    result = _run(code, HYBRIDMOE_LONG_ROW_PREFETCH="")
    assert result.returncode == 0 and result.stdout.strip() == isa.default_long_row_prefetch(), result.stderr
    for state in ("on", "off"):
        result = _run(code, HYBRIDMOE_LONG_ROW_PREFETCH=state)
        assert result.returncode == 0 and result.stdout.strip() == state, result.stderr
    before = isa.long_row_prefetch()
    other = "on" if before == "off" else "off"
    with isa.use_long_row_prefetch(other):
        assert isa.long_row_prefetch() == other
    assert isa.long_row_prefetch() == before
    with pytest.raises(ValueError, match="long row prefetch must be on or off, got 'yes'"):
        isa.set_long_row_prefetch("yes")
    result = _run("from hybridmoe.kernels import isa; isa.active_isa()", HYBRIDMOE_LONG_ROW_PREFETCH="1")
    assert result.returncode != 0
    assert "HYBRIDMOE_LONG_ROW_PREFETCH must be on or off, got '1'" in result.stderr


def test_bad_short_row_prefetch_values_are_clear_errors():
    with pytest.raises(ValueError, match="prefetch level must be l1 or l2, got 'L3'"):
        isa.set_short_row_prefetch("L3")
    result = _run("from hybridmoe.kernels import isa; isa.active_isa()", HYBRIDMOE_SHORT_ROW_PREFETCH="l3")
    assert result.returncode != 0
    assert "HYBRIDMOE_SHORT_ROW_PREFETCH must be l1 or l2, got 'l3'" in result.stderr


def test_info_prints_the_prefetch_settings():
    result = subprocess.run([sys.executable, "-m", "hybridmoe.cli", "info"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "HYBRIDMOE_SHORT_ROW_PREFETCH": "l1",
                                              "HYBRIDMOE_LONG_ROW_PREFETCH": "off"})
    assert result.returncode == 0, result.stderr
    default = isa.default_short_row_prefetch().upper()
    assert (f"short rows' far prefetch (one token) into L1 (this CPU's default {default}; "
            "HYBRIDMOE_SHORT_ROW_PREFETCH=l1)") in result.stdout
    assert f"family {isa.cpu_family():#x}" in result.stdout
    assert (f"long rows' next-row prefetch (one token) off (this CPU's default {isa.default_long_row_prefetch()}; "
            "HYBRIDMOE_LONG_ROW_PREFETCH=off)") in result.stdout


@pytest.mark.parametrize("name", isa.available_isas())
def test_read_probe_reads_every_word_with_and_without_prefetch(name):
    """The bandwidth probe takes the best of a plain read and reads with software prefetches; each of them must sum
    the same words (the probe raises where they disagree), on every ISA, over a buffer that splits unevenly."""
    words = np.random.default_rng(0).integers(0, 2**63, size=(3 << 17) + 37, dtype=np.uint64)
    with isa.use_isa(name):
        assert _native.measure_read_bandwidth(words, 2) > 0
