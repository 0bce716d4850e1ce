"""Float-format matmul kernels (f32, bf16, f16, fp8 block-scaled) against float64, on every ISA path here:
GEMV and tiled GEMM paths, odd sizes, partial fp8 blocks, fp8 subnormals and NaN codes. Where the ISA runs bf16
and fp8 weights with bf16 dot products (avx512bf16, avx2bf16) the GEMV path is checked against what that
computes (reference.bf16_dot_matmul: activations rounded to bf16) to the same float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import isa, reference
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import kernel_matrix
from kernel_testing import random_fp8, random_int, seed

SHAPES = [(1, 1), (5, 7), (37, 100), (64, 256), (131, 300)]  # (N rows, K cols)
# GEMV token tiles of 3, 2 and 1 on 4-row tiles (3+2, 3+3, 3+3+3); on AVX2 3-row tiles of 4 tokens for 4 and
# from 7 tokens unless a multiple of 3 (4, 4+3, 4+4, 4+4+2, 4+4+4+3+2, ...; gemv_tile_rows); GEMM token blocks of
# 3 vectors (24 AVX2, 48 AVX-512): 1-3 vectors, then more blocks; 70: more than the float GEMV path takes (63), so
# a forced "gemv" runs the GEMM (the bf16 dot-product GEMV takes as few balanced tiles of up to 6 tokens
# (AVX-512) or 3 (AVX2) as cover them: 4+3, 5+4, 6+6+5, ...; 3+2, 3+2+2, ...)
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 24, 40, 57, 70]
MAX_GEMV_TOKENS = 63


def _check(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, rtol: float = 3e-6, bf16=None,
           keep: list[int] | None = None) -> None:
    """|out - x @ W^T| <= rtol * (|x| @ |W|^T) elementwise (float32 accumulation of K products). bf16: the
    matrix as (fmt, data, scales, block) when the kernel ran with bf16 activations (see _bf16); keep: check
    only these output columns."""
    if bf16:
        ref, size = reference.bf16_dot_matmul(x, *bf16)
    else:
        ref, size = x.double() @ w64.T, x.double().abs() @ w64.abs().T
    if keep is not None:
        out, ref, size = out[:, keep], ref[:, keep], size[:, keep]
    bound = rtol * size * (x.shape[1] ** 0.5) + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"


def _bf16(m, path: str, tokens: int, fmt: str, data, scales=None, block=(128, 128)):
    """(fmt, data, scales, block) when the active ISA runs this call with bf16 activations (bf16 dot products or
    AMX tiles), else None."""
    return (fmt, data, scales, block) if m.rounds_activations_to_bf16(tokens, path) else None


@pytest.mark.parametrize("fmt,dtype", [("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_dense_formats(each_isa, fmt, dtype, path):
    gen = torch.Generator().manual_seed(seed(fmt, path, each_isa))
    for rows, cols in SHAPES:
        w = torch.randn(rows, cols, generator=gen).to(dtype)
        m = kernel_matrix(fmt, w)
        for tokens in TOKENS:
            x = torch.randn(tokens, cols, generator=gen)
            _check(matmul(m, x, path), x, w.double(), bf16=_bf16(m, path, tokens, fmt, w))


@pytest.mark.parametrize("block", [(128, 128), (32, 48)])
@pytest.mark.parametrize("path", ["gemv", "gemm", "auto"])
def test_fp8_block_scaled(each_isa, block, path):
    gen = torch.Generator().manual_seed(seed(block, path, each_isa))
    for rows, cols in SHAPES + [(200, 1100)]:  # partial last blocks; K chunked on the GEMM path
        q, s = random_fp8(rows, cols, block, gen)
        w64 = reference.dequantize("fp8", q, s, block=block)
        m = kernel_matrix("fp8", q, s, block=block)
        for tokens in TOKENS:
            x = torch.randn(tokens, cols, generator=gen)
            _check(matmul(m, x, path), x, w64, bf16=_bf16(m, path, tokens, "fp8", q, s, block))


def _gemm_matrix(fmt: str, rows: int, cols: int, gen: torch.Generator):
    """A random [rows, cols] matrix in fmt (fp8 with 128 x 128 blocks) -> (float64 weights, kernel matrix,
    _bf16's matrix arguments)."""
    if fmt == "fp8":
        q, s = random_fp8(rows, cols, (128, 128), gen)
        return (reference.dequantize("fp8", q, s, block=(128, 128)), kernel_matrix("fp8", q, s, block=(128, 128)),
                (q, s))
    w = torch.randn(rows, cols, generator=gen).to(torch.float32 if fmt == "f32" else torch.bfloat16)
    return w.double(), kernel_matrix(fmt, w), (w,)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8"])
def test_gemm_in_one_and_several_token_blocks(each_isa, fmt):
    """The tokens go in blocks whose x^T over the whole K fits 2 MB: 9 and 130 tokens x 1100 cols in one block,
    475 in two (456 + 19 on AVX2, the last 3 by dot products; 432 + 43 on AVX-512). With partial K chunks, K not a
    multiple of the 8 x 8 transposes, a partial last row tile and prefetch across tiles."""
    gen = torch.Generator().manual_seed(seed(fmt, "orders", each_isa))
    cols = 1100
    w64, m, data = _gemm_matrix(fmt, 45, cols, gen)
    for tokens in (9, 130, 475):
        x = torch.randn(tokens, cols, generator=gen)
        _check(matmul(m, x, "gemm"), x, w64, bf16=_bf16(m, "gemm", tokens, fmt, *data))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "fp8"])
def test_gemm_takes_a_few_last_tokens_by_dot_products(each_isa, fmt):
    """Past whole vectors of tokens, a few last ones go through the GEMV's dot-product tile over the decoded
    panel (dot_block_tokens): 1-5 after full 3-vector blocks, 1-3 past two vectors (19, 25, 28, 29 on AVX2;
    35, 49, 53 on AVX-512), next to counts that keep padded outer-product blocks (20, 33); the sums carried
    across K chunks (1100 columns)."""
    gen = torch.Generator().manual_seed(seed(fmt, "dot tokens", each_isa))
    cols = 1100
    w64, m, data = _gemm_matrix(fmt, 45, cols, gen)
    for tokens in (19, 20, 25, 28, 29, 33, 35, 49, 53, 145):
        x = torch.randn(tokens, cols, generator=gen)
        _check(matmul(m, x, "gemm"), x, w64, bf16=_bf16(m, "gemm", tokens, fmt, *data))


def test_fp8_subnormals_decode_exactly(each_isa):
    gen = torch.Generator().manual_seed(7)
    q, s = random_fp8(40, 264, (128, 128), gen, subnormal_only=True)
    w64 = reference.dequantize("fp8", q, s)
    assert (w64 != 0).any() and (w64.abs() < 2.0 ** -6 * s.double().max()).all()
    m = kernel_matrix("fp8", q, s)
    for tokens, path in [(1, "gemv"), (3, "gemv"), (9, "gemm")]:
        x = torch.randn(tokens, 264, generator=gen)
        _check(matmul(m, x, path), x, w64, bf16=_bf16(m, path, tokens, "fp8", q, s))


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_fp8_blocks_with_and_without_subnormals(each_isa, path):
    """Column blocks free of subnormal codes take the 3-operation decode, the others the exact one; a tile
    mixes both. Activations so large that the fast path's scaling would overflow fall back to the exact one."""
    gen = torch.Generator().manual_seed(13)
    rows, cols = 70, 600
    q, s = random_fp8(rows, cols, (32, 128), gen, normal_only=True)
    codes = q.view(torch.uint8).clone()
    codes[5, 300] = 0x03  # one subnormal in row 5, column block 2
    codes[40:44, 130] = 0x81  # rows 40-43, block 1
    q = codes.view(torch.float8_e4m3fn)
    m = kernel_matrix("fp8", q, s, block=(32, 128))
    assert m.flag_bytes == rows * (1 + 1)
    w64 = reference.dequantize("fp8", q, s, block=(32, 128))
    for tokens in (1, 2, 3, 9):
        x = torch.randn(tokens, cols, generator=gen)
        _check(matmul(m, x, path), x, w64, bf16=_bf16(m, path, tokens, "fp8", q, s, (32, 128)))
    big_scales = torch.full_like(s, 100.0)
    big = kernel_matrix("fp8", q, big_scales, block=(32, 128))
    for tokens in (2, 4):  # the float32 and (where the ISA has them) the bf16 dot-product tiles
        x = torch.randn(tokens, cols, generator=gen) * 1e6  # |x * scale| > 2^24: x * scale * 2^104 overflows
        _check(matmul(big, x, path), x, reference.dequantize("fp8", q, big_scales, block=(32, 128)),
               bf16=_bf16(big, path, tokens, "fp8", q, big_scales, (32, 128)))


def test_fp8_runs_of_exact_and_fast_blocks(each_isa):
    """A tile's columns run as maximal runs of blocks alike (for_each_fp8_range): exact blocks first, last (a
    partial one), side by side, across the 64-block words of the subnormal bitmap, and alone. Those blocks hold
    many subnormal codes under a large scale, so that a block decoded wrongly or a column taken twice or not at
    all shows against float64."""
    gen = torch.Generator().manual_seed(29)
    rows, cols = 12, 64 * 128 + 300  # 67 column blocks, the last of 44 columns
    q, s = random_fp8(rows, cols, (128, 128), gen, normal_only=True)
    codes = q.view(torch.uint8).clone()
    exact_blocks = {0: [0], 1: [62, 63, 64], 2: [66], 4: [10, 12], 7: [63], 9: [0, 1, 65, 66]}
    for row, blocks in exact_blocks.items():
        for b in blocks:
            block = codes[row, b * 128:(b + 1) * 128]
            block[::2] = torch.randint(1, 8, block[::2].shape, generator=gen, dtype=torch.uint8)  # subnormal
    s[:] = 2.0 ** -6
    s[:, [0, 1, 10, 12, 62, 63, 64, 65, 66]] = 64.0  # subnormal codes (<= 2^-6) then weigh like normal ones
    q = codes.view(torch.float8_e4m3fn)
    m = kernel_matrix("fp8", q, s)
    w64 = reference.dequantize("fp8", q, s)
    for tokens in (1, 2, 3, 4, 8, 9, 10):
        x = torch.randn(tokens, cols, generator=gen)
        _check(matmul(m, x, "gemv"), x, w64, bf16=_bf16(m, "gemv", tokens, "fp8", q, s))


@pytest.mark.parametrize("fmt,cols", [("f32", 1600), ("bf16", 3100), ("f16", 3100), ("fp8", 6150), ("bf16", 1700),
                                      ("fp8", 3500), ("f32", 300), ("bf16", 600), ("fp8", 2100), ("fp8", 1500)])
def test_gemv_rows_of_1_kb_and_more(each_isa, fmt, cols):
    """Rows of >= 3 KB prefetch the next tile into L2, of >= 4 KB as one stream a row (NextRows); several tiles,
    a short last one, partial last vectors and (fp8) a partial last block and a block with a subnormal code
    (the exact decode beside the fast one). 4, 8 and 10 tokens: 3-row tiles on AVX2, for fp8 from 8 tokens only
    with rows of >= 4 KB (gemv_tile_rows). One token against rows of >= 1 KB: one-row tiles (one_row_tiles;
    fp8 with bf16 dot products from 2 KB, also at two tokens; fp8 in the float32 GEMV from 3 KB, on AVX-512
    only), over fp8 rows of two row blocks; with bf16 dot products one token's rows take one_token_row, but for
    the row with the subnormal code; rows under 3 KB prefetch the tile 8 KB ahead (kPrefetchAheadBytes). Both
    levels of short rows' far prefetch (isa.short_row_prefetch, by CPU), whose L2 level also asks for each line a
    second time, further ahead, in the one-row tiles of long rows, give the same output bit for bit."""
    gen = torch.Generator().manual_seed(seed(fmt, cols, each_isa))
    rows = 133 if fmt == "fp8" else 21
    if fmt == "fp8":
        q, s = random_fp8(rows, cols, (128, 128), gen, normal_only=True)
        codes = q.view(torch.uint8).clone()
        codes[9, cols // 2] = 0x05
        q = codes.view(torch.float8_e4m3fn)
        w64, m, bf16 = reference.dequantize("fp8", q, s), kernel_matrix("fp8", q, s), ("fp8", q, s, (128, 128))
    else:
        w = torch.randn(rows, cols, generator=gen).to({"f32": torch.float32, "bf16": torch.bfloat16,
                                                        "f16": torch.float16}[fmt])
        w64, m, bf16 = w.double(), kernel_matrix(fmt, w), (fmt, w, None, (128, 128))
    for tokens in (1, 2, 3, 4, 5, 8, 10):
        x = torch.randn(tokens, cols, generator=gen)
        outs = []
        for level in ("l1", "l2"):
            with isa.use_short_row_prefetch(level):
                outs.append(matmul(m, x, "gemv"))
        assert torch.equal(outs[0], outs[1]), f"{tokens} tokens"
        _check(outs[0], x, w64, bf16=bf16 if _bf16(m, "gemv", tokens, fmt, None) else None)


@pytest.mark.parametrize("fmt,cols", [("fp8", 700), ("fp8", 5000), ("bf16", 700), ("bf16", 2047), ("bf16", 2050)])
def test_bf16_dot_isas_run_fewer_tokens_as_their_float32_isa(fmt, cols):
    """Below Matrix.bf16_dot_min_tokens tokens (fp8 1: always; bf16 4, or 1 for rows of isa.bf16_dot_long_row_bytes()
    and more) a bf16 dot-product ISA runs the float32 GEMV of its base ISA, bit for bit; from there on it rounds
    the activations to bf16 (results differ)."""
    names = [name for name in isa.available_isas() if isa.bf16_dot(name)]
    if not names:
        pytest.skip("no bf16 dot-product ISA here")
    gen = torch.Generator().manual_seed(seed(fmt, cols, "threshold"))
    rows = 30
    if fmt == "fp8":
        q, s = random_fp8(rows, cols, (128, 128), gen)
        m = kernel_matrix("fp8", q, s)
    else:
        m = kernel_matrix("bf16", torch.randn(rows, cols, generator=gen).bfloat16())
    long_bf16_rows = fmt == "bf16" and 2 * cols >= isa.bf16_dot_long_row_bytes()
    assert long_bf16_rows == (fmt == "bf16" and cols == 2050)
    for name in names:
        with isa.use_isa(name):
            threshold = m.bf16_dot_min_tokens
        assert threshold == (1 if long_bf16_rows else isa.bf16_dot_min_tokens()[fmt])
        assert threshold == 1 if fmt == "fp8" else threshold in (1, 4)
        for tokens in range(1, threshold + 2):
            x = torch.randn(tokens, cols, generator=gen)
            with isa.use_isa(name):
                dot = matmul(m, x, "gemv")
            with isa.use_isa(name.removesuffix("bf16")):
                assert m.bf16_dot_min_tokens == -1
                plain = matmul(m, x, "gemv")
            assert torch.equal(dot, plain) == (tokens < threshold), (name, tokens)


def _any_format_matrix(fmt: str, rows: int, cols: int, gen: torch.Generator):
    """A random [rows, cols] kernel matrix in fmt: fp8 with 128 x 128 blocks, int4 / int8 in groups of 32 with
    bf16 scales, f32 or bf16."""
    if fmt == "fp8":
        return kernel_matrix("fp8", *random_fp8(rows, cols, (128, 128), gen))
    if fmt in ("int4", "int8"):
        return kernel_matrix(fmt, *random_int(fmt, rows, cols, 32, torch.bfloat16, gen), cols=cols)
    return kernel_matrix(fmt, torch.randn(rows, cols, generator=gen).to(torch.float32 if fmt == "f32" else
                                                                        torch.bfloat16))


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "f32", "int4", "int8"])
def test_amx_runs_fewer_tokens_and_other_formats_as_avx512(fmt):
    """The amx ISA runs what it does not give its AMX tiles as avx512, bit for bit: bf16 and fp8 weights below
    isa.amx_min_tokens() tokens on the auto path (or on a forced GEMV path), int weights below
    isa.amx_int_min_tokens(), f32 always. From the thresholds on, the tiles round the activations to bf16 (results
    differ)."""
    if "amx" not in isa.available_isas():
        pytest.skip("no AMX here")
    gen = torch.Generator().manual_seed(seed(fmt, "amx"))
    cols = 700
    m = _any_format_matrix(fmt, 40, cols, gen)
    threshold = isa.amx_min_tokens() if fmt in ("fp8", "bf16") else isa.amx_int_min_tokens()
    for tokens in (1, threshold - 1, threshold, threshold + 1):
        x = torch.randn(tokens, cols, generator=gen)
        for path in ("auto", "gemv"):
            with isa.use_isa("amx"):
                tiles = m.rounds_activations_to_bf16(tokens, path)
                amx = matmul(m, x, path)
            with isa.use_isa("avx512"):
                plain = matmul(m, x, path)
            assert tiles == (fmt != "f32" and path == "auto" and tokens >= threshold)
            assert torch.equal(amx, plain) == (not tiles), (tokens, path)


@pytest.mark.parametrize("cols", [300, 3300])
@pytest.mark.parametrize("tokens,path", [(1, "gemv"), (2, "gemv"), (9, "gemm")])
def test_fp8_nan_codes_give_nan_rows(each_isa, tokens, path, cols):
    """Rows with a NaN code give NaN for every token; 3300 columns: one token takes one-row tiles, and two
    with bf16 dot products (one_row_tiles)."""
    gen = torch.Generator().manual_seed(11)
    q, s = random_fp8(50, cols, (128, 128), gen)
    codes = q.view(torch.uint8).clone()
    codes[3, 17] = 0x7F
    codes[10, cols - 1] = 0xFF  # in the row's tail (not a multiple of the vector width)
    codes[49, 128] = 0x7F
    q = codes.view(torch.float8_e4m3fn)
    x = torch.randn(tokens, cols, generator=gen)
    m = kernel_matrix("fp8", q, s)
    out = matmul(m, x, path)
    nan_rows = [3, 10, 49]
    assert m.nan_rows == nan_rows
    assert torch.isnan(out[:, nan_rows]).all()
    keep = [r for r in range(50) if r not in nan_rows]
    _check(out, x, reference.dequantize("fp8", q, s), bf16=_bf16(m, path, tokens, "fp8", q, s), keep=keep)


def test_rows_of_a_strided_view_are_used_in_place(each_isa):
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(16, 80, generator=gen)
    w = big[:, :50]  # rows contiguous, row stride 80
    x = torch.randn(2, 50, generator=gen)
    _check(matmul(kernel_matrix("f32", w), x), x, w.double())


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="dtype must be bfloat16"):
        kernel_matrix("bf16", torch.zeros(4, 4))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        kernel_matrix("f32", torch.zeros(8, 4).T)
    q, s = random_fp8(10, 20, (128, 128), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"scales: expected shape \[1, 1\], got \[2, 1\]"):
        kernel_matrix("fp8", q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="out of range"):
        kernel_matrix("fp8", q, torch.full((1, 1), 1e6))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel_matrix("fp8", q, s, block=(128, 100))
    with pytest.raises(ValueError, match="unknown weight format"):
        kernel_matrix("fp4", q)


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "f32", "int4", "int8"])
def test_auto_path_switches_to_gemm_at_the_format_threshold(each_isa, fmt):
    """path='auto' runs the GEMV path below m.gemm_min_tokens tokens and the GEMM path from it on: bit for bit
    the forced path's result (the two paths sum in different orders). The int formats stay on the GEMV path at
    any length (in blocks of 128 tokens)."""
    gen = torch.Generator().manual_seed(seed(fmt, "auto", each_isa))
    cols = 300
    m = _any_format_matrix(fmt, 20, cols, gen)
    threshold = m.gemm_min_tokens
    if fmt in ("int4", "int8"):
        assert threshold == 2**63 - 1
        # the amx ISA takes its AMX tiles from isa.amx_int_min_tokens() (test_matmul_int.py)
        x = torch.randn(isa.amx_int_min_tokens() - 1 if isa.amx() else 300, cols, generator=gen)
        assert torch.equal(matmul(m, x, "auto"), matmul(m, x, "gemv"))
        return
    if isa.amx() and fmt in ("fp8", "bf16"):
        assert threshold == isa.amx_min_tokens()  # the AMX tiles
    else:
        assert threshold == {"fp8": 64 if isa.bf16_dot() else 13}.get(fmt, 64)
    for tokens, path in [(threshold - 1, "gemv"), (threshold, "gemm")]:
        x = torch.randn(tokens, cols, generator=gen)
        assert torch.equal(matmul(m, x, "auto"), matmul(m, x, path)), f"{tokens} tokens"


@pytest.mark.parametrize("fmt,dtype,cols", [("f32", torch.float32, 1024), ("bf16", torch.bfloat16, 2304),
                                            ("f16", torch.float16, 4096)])
def test_long_row_prefetch_moves_no_result(each_isa, fmt, dtype, cols):
    """Whether one-row tiles of long rows (one token, rows of 4 KB and more) prefetch the next row
    (isa.long_row_prefetch: off on AMD Zen 3, on elsewhere) changes which hints the tiles issue and nothing else:
    both settings give the same output bit for bit, matching float64."""
    gen = torch.Generator().manual_seed(seed(fmt, each_isa, "long rows"))
    w = torch.randn(96, cols, generator=gen).to(dtype)
    m = kernel_matrix(fmt, w)
    x = torch.randn(1, cols, generator=gen)
    outs = {}
    for state in ("on", "off"):
        with isa.use_long_row_prefetch(state):
            outs[state] = matmul(m, x)
    assert torch.equal(outs["on"], outs["off"])
    _check(outs["on"], x, w.double(), bf16=_bf16(m, "auto", 1, fmt, w))
