"""INT4 / INT8 per-group kernels (int8 activations, maddubs / VNNI dot products) and their quantisers, on every
ISA path here: exact emulation of the kernels' arithmetic, closeness to the float64 product, odd sizes."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import _native, formats, isa, reference
from hybridmoe.kernels.moe import matmul
from hybridmoe.kernels.weights import kernel_matrix
from kernel_testing import amx_int_reference, random_int, seed

# (N, K); 1100: K chunks on GEMM; 6200, 3200: rows of >= 3 KB, whose GEMV prefetches the next tile into L2
# (NextRows) and, for int8 at one token, reads 2-row tiles (kInt8TwoRowTileMinBytes; last row tiles of 1 and 3 rows)
SHAPES = [(1, 1), (5, 7), (37, 100), (64, 256), (131, 300), (20, 1100), (13, 6200), (15, 3200)]
TOKENS = [1, 2, 3, 5, 9, 17]
CASES = [(fmt, group, dtype) for fmt in formats.INT_FORMATS for group in formats.INT_GROUPS
         for dtype in formats.INT_SCALE_DTYPES]


@pytest.mark.parametrize("fmt,group,scale_dtype", CASES)
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_int_kernels_match_their_exact_arithmetic(each_isa, fmt, group, scale_dtype, path):
    """Integer group sums are exact; only the float combination of scaled group sums rounds."""
    gen = torch.Generator().manual_seed(seed(fmt, group, str(scale_dtype), path, each_isa))
    for rows, cols in SHAPES:
        data, scales = random_int(fmt, rows, cols, group, scale_dtype, gen)
        m = kernel_matrix(fmt, data, scales, cols=cols)
        for tokens in TOKENS:
            x = torch.randn(tokens, cols, generator=gen)
            ref = reference.int_matmul_reference(fmt, data, scales, cols, x)
            magnitude = x.double().abs() @ reference.dequantize(fmt, data, scales, cols=cols).abs().T
            err = (matmul(m, x, path).double() - ref).abs()
            assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{rows}x{cols} T={tokens}: max error {err.max():.3g}"


@pytest.mark.parametrize("fmt,group", [(fmt, group) for fmt in formats.INT_FORMATS for group in formats.INT_GROUPS])
@pytest.mark.parametrize("path", ["auto", "gemv", "gemm"])
def test_int_kernels_take_many_tokens_in_blocks(each_isa, fmt, group, path):
    """A prompt's tokens run in blocks of 128 (kIntTokenBlock): a whole block, one token past it (a last block of
    one), several blocks with a partial last one, each token's dot products as the exact arithmetic gives them;
    float32 and bf16 inputs (bf16 is converted per token). The amx ISA's auto path takes its AMX tiles there
    instead, with bf16 activations and weights."""
    gen = torch.Generator().manual_seed(seed(fmt, group, path, each_isa, "blocks"))
    for rows, cols in [(37, 100), (20, 1100), (131, 300)]:
        data, scales = random_int(fmt, rows, cols, group, torch.bfloat16, gen)
        m = kernel_matrix(fmt, data, scales, cols=cols)
        for tokens in (128, 129, 300):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(tokens, cols, generator=gen).to(dtype)
                if path == "auto" and isa.amx():
                    ref = amx_int_reference(fmt, data, scales, cols, x)
                else:
                    ref = reference.int_matmul_reference(fmt, data, scales, cols, x.float())
                magnitude = x.double().abs() @ reference.dequantize(fmt, data, scales, cols=cols).abs().T
                err = (matmul(m, x, path).double() - ref).abs()
                assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{rows}x{cols} T={tokens} {dtype}: {err.max():.3g}"


@pytest.mark.skipif("amx" not in isa.available_isas(), reason="no AMX tiles on this CPU")
@pytest.mark.parametrize("fmt,group,scale_dtype", CASES)
def test_amx_tiles_take_int_weights_from_their_threshold(fmt, group, scale_dtype):
    """From isa.amx_int_min_tokens() tokens the amx ISA's auto path multiplies int weights by AMX tiles: code x
    scale and the activations rounded to bf16, summed in float32 (rows not a multiple of a 16-row tile, columns not
    of a 32-column step, 1-3 token tiles); below it, and on a forced path, the int kernels as avx512 runs them."""
    gen = torch.Generator().manual_seed(seed(fmt, group, scale_dtype, "amx int"))
    first = isa.amx_int_min_tokens()
    for rows, cols in [(37, 100), (40, 700), (131, 1100)]:
        data, scales = random_int(fmt, rows, cols, group, scale_dtype, gen)
        m = kernel_matrix(fmt, data, scales, cols=cols)
        magnitude = None
        for tokens in (first - 1, first, first + 1, 40):
            x = torch.randn(tokens, cols, generator=gen)
            with isa.use_isa("amx"):
                auto, gemv = matmul(m, x, "auto"), matmul(m, x, "gemv")
            with isa.use_isa("avx512"):
                plain = matmul(m, x, "auto")
            assert torch.equal(gemv, plain)
            if tokens < first:
                assert torch.equal(auto, plain)
                continue
            ref = amx_int_reference(fmt, data, scales, cols, x)
            magnitude = x.double().abs() @ reference.dequantize(fmt, data, scales, cols=cols).abs().T
            err = (auto.double() - ref).abs()
            assert (err <= 1e-5 * magnitude + 1e-6).all(), f"{rows}x{cols} T={tokens}: {err.max():.3g}"
        assert magnitude is not None


@pytest.mark.parametrize("fmt,group", [(fmt, group) for fmt in formats.INT_FORMATS for group in formats.INT_GROUPS])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_codes_do_not_overflow_integer_sums(each_isa, fmt, group, path, sign):
    """Every weight at its largest code and every activation at +-127 after quantisation: the kernels' integer
    partial sums (int16 pair sums over a 128-group for int4 on AVX2) are at their extremes; a wrapped sum would
    be off by thousands, while the float combination of group sums rounds only at 1e-7 relative."""
    rows, cols = 9, 512
    qmax = 7 if fmt == "int4" else 127
    w = torch.full((rows, cols), float(qmax))
    w[1::2] = -float(qmax)
    data, scales = (formats.quantize_int4 if fmt == "int4" else formats.quantize_int8)(w, group, torch.bfloat16)
    m = kernel_matrix(fmt, data, scales, cols=cols)
    for tokens in (1, 9):
        x = torch.full((tokens, cols), sign)
        ref = reference.int_matmul_reference(fmt, data, scales, cols, x)
        err = (matmul(m, x, path).double() - ref).abs()
        assert (err <= 1e-5 * ref.abs()).all(), f"T={tokens}: max error {err.max():.3g}"


@pytest.mark.parametrize("fmt,group,scale_dtype", CASES)
def test_int_kernels_approximate_the_float_product(fmt, group, scale_dtype):
    """Against float64 of the dequantised weights and unquantised activations: only the int8 activation
    rounding (half a step of amax/127 per element) separates them."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 64, 1000
    data, scales = random_int(fmt, rows, cols, group, scale_dtype, gen)
    w64 = reference.dequantize(fmt, data, scales, cols=cols)
    x = torch.randn(4, cols, generator=gen)
    err = (matmul(kernel_matrix(fmt, data, scales, cols=cols), x).double() - x.double() @ w64.T).abs()
    step = x.abs().max() / 127 / 2  # the largest activation rounding error
    assert (err <= step * w64.abs().sum(1)[None] * 0.2).all()


@pytest.mark.parametrize("fmt,qmax", [("int4", formats.INT4_MAX), ("int8", formats.INT8_MAX)])
@pytest.mark.parametrize("group", formats.INT_GROUPS)
@pytest.mark.parametrize("scale_dtype", formats.INT_SCALE_DTYPES)
def test_quantiser_round_trip(fmt, qmax, group, scale_dtype):
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(33, 300, generator=gen) * 0.05
    data, scales = (formats.quantize_int4 if fmt == "int4" else formats.quantize_int8)(w, group, scale_dtype)
    kp = formats.padded_cols(300, group)
    assert scales.shape == (33, kp // group) and scales.dtype == scale_dtype
    assert data.shape == ((33, kp // 2) if fmt == "int4" else (33, kp))
    codes = formats.int_codes(fmt, data)
    assert codes.min() >= -8 if fmt == "int4" else codes.min() >= -qmax
    assert codes.max() <= qmax
    assert (codes[:, 300:] == 0).all()  # padding
    per_col_scale = scales.double().repeat_interleave(group, 1)[:, :300]
    err = (reference.dequantize(fmt, data, scales, cols=300) - w.double()).abs()
    # rounding to the nearest code: half a step, plus the scale's own rounding stretching the largest codes
    rel_scale_rounding = 2.0 ** -8 if scale_dtype == torch.bfloat16 else 2.0 ** -11
    assert (err <= per_col_scale * (0.5 + qmax * rel_scale_rounding) + 1e-12).all()


def test_int4_packing_round_trip():
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(-8, 8, (7, 96), generator=gen, dtype=torch.int8)
    packed = formats.pack_int4(q)
    assert packed.shape == (7, 48) and packed.dtype == torch.uint8
    assert torch.equal(formats.unpack_int4(packed), q)
    assert packed[0, 0].item() == (q[0, 0] + 8).item() | ((q[0, 16] + 8).item() << 4)


@pytest.mark.parametrize("cols", [300, 256, 2048])  # a partial last group, whole groups of both sizes
def test_activation_quantiser_matches_its_reference_exactly(each_isa, cols):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, cols, generator=gen) * torch.logspace(-3, 3, 8)[:, None]
    x[2, 40] = float("nan")  # its group: q = 0, scale NaN
    x[3, :] = 0.0  # all-zero groups: q = 0, scale 0
    x[4, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])  # amax 127: ties, rounded to even
    x[5, 200] = float("-inf")
    x[6, 130:160] = -0.0
    x[7, :] = x[7, :].clamp(-0.01, 0.01)  # many codes at the clamp
    for group in formats.INT_GROUPS:
        padded = formats.padded_cols(cols, group)
        q, scale, qsum = _native.quantize_rows(x.numpy(), padded, group)
        ref_q, ref_scale = formats.quantize_activations(x, padded, group)
        assert torch.equal(torch.from_numpy(q).int(), ref_q)
        assert torch.equal(torch.from_numpy(scale).isnan(), ref_scale.isnan())
        finite = ~ref_scale.isnan()
        assert torch.equal(torch.from_numpy(scale)[finite], ref_scale[finite])
        sums = ref_q.view(8, -1, group).sum(-1).float() * ref_scale
        assert torch.equal(torch.from_numpy(qsum)[finite], sums[finite])  # scale * the exact int sum
        assert torch.isnan(torch.from_numpy(scale)[2, 40 // group])
        assert torch.isnan(torch.from_numpy(qsum)[5, 200 // group])
    assert ref_q[4, :6].tolist() == [127, 0, 2, 2, 0, -2]


def test_quantiser_rejects_what_it_cannot_represent():
    with pytest.raises(ValueError, match="group size"):
        formats.quantize_int4(torch.ones(2, 64), group=64)
    with pytest.raises(ValueError, match="NaN or Inf"):
        formats.quantize_int8(torch.tensor([[1.0, float("inf")]]), group=32)
    with pytest.raises(ValueError, match="overflows"):
        formats.quantize_int8(torch.full((1, 32), 1e7), group=32, scale_dtype=torch.float16)


def test_bad_int_matrices_are_clear_errors():
    data, scales = formats.quantize_int4(torch.randn(4, 100), 32)
    with pytest.raises(ValueError, match=r"expected shape \[4, 112\], got \[4, 64\]"):
        kernel_matrix("int4", data, scales, cols=200)  # 200 columns pad to 224: 112 bytes a row
    with pytest.raises(ValueError, match="int8 data dtype must be torch.int8"):
        kernel_matrix("int8", data, scales, cols=100)
