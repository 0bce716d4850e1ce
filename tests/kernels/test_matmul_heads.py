"""kernels.moe.matmul_heads (one weight matrix per head, MLA's absorbed kv_b_proj) against float64 on fresh random data:
float32, bf16, f16 and fp8 block-scaled heads, odd sizes, GEMV and GEMM token counts, heads grouped into one task and
heads cut into several, strided inputs and outputs, float32 and bf16 outputs, 1 and 2 threads, every ISA here. Where
the ISA rounds the activations of bf16 and fp8 weights to bf16 (bf16 dot products, AMX tiles) the check is against
what that computes (reference.bf16_dot_matmul), per head."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.kernels import isa, reference
from hybridmoe.kernels.moe import MatrixHeads, matmul_heads
from hybridmoe.kernels.weights import kernel_matrix
from kernel_testing import random_fp8, seed

# (N heads, M rows, K cols): one row; odd sizes; many small heads in one task; heads of 256 KB cut into blocks
SHAPES = [(1, 1, 1), (3, 5, 37), (5, 131, 100), (16, 64, 128), (3, 1000, 512)]
TOKENS = [1, 2, 5, 9, 17, 70]  # GEMV tiles of 1-3 tokens, AMX from 8, the float GEMM from 64
FLOAT = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _heads(fmt: str, n: int, rows: int, cols: int, gen: torch.Generator):
    """Random per-head weights -> (MatrixHeads, float64 [N, M, K], per head the (fmt, data, scales, block) that
    reference.bf16_dot_matmul takes, the kernel matrices)."""
    if fmt in FLOAT:
        w = torch.randn(n, rows, cols, generator=gen).to(FLOAT[fmt])
        matrices = [kernel_matrix(fmt, w[h]) for h in range(n)]
        return MatrixHeads(matrices), w.double(), [(fmt, w[h], None, (128, 128)) for h in range(n)], matrices
    block = (32, 48)
    parts = [random_fp8(rows, cols, block, gen) for _ in range(n)]
    matrices = [kernel_matrix("fp8", q, s, block=block) for q, s in parts]
    w64 = torch.stack([reference.dequantize("fp8", q, s, block=block) for q, s in parts])
    return MatrixHeads(matrices), w64, [("fp8", q, s, block) for q, s in parts], matrices


def _check(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bf16_args: list, matrices: list, path: str,
           rtol: float = 3e-6) -> None:
    """|out - x @ W_n^T| <= rtol * (|x| @ |W_n|^T) * sqrt(K) per head, against bf16_dot_matmul where the kernel
    rounded the activations to bf16."""
    tokens = x.shape[0]
    ref, size = reference.matmul_heads(x, w64)
    for h, m in enumerate(matrices):
        if m.rounds_activations_to_bf16(tokens, path):
            ref[:, h], size[:, h] = reference.bf16_dot_matmul(x[:, h], *bf16_args[h])
    bound = rtol * size * (x.shape[2] ** 0.5) + 1e-30
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"


@pytest.fixture(params=[1, 2])
def threads(request):
    default = isa.num_threads()
    isa.configure_threads(request.param)
    try:
        yield request.param
    finally:
        isa.configure_threads(default)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16", "fp8"])
def test_against_float64(each_isa, threads, fmt):
    gen = torch.Generator().manual_seed(seed(fmt, each_isa, threads))
    for n, rows, cols in SHAPES:
        heads, w64, bf16_args, matrices = _heads(fmt, n, rows, cols, gen)
        assert (heads.heads, heads.rows, heads.cols) == (n, rows, cols)
        for tokens in TOKENS:
            x = torch.randn(tokens, n, cols, generator=gen)
            _check(matmul_heads(heads, x), x, w64, bf16_args, matrices, "auto")


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_forced_paths(threads, path):
    gen = torch.Generator().manual_seed(seed(path, threads))
    heads, w64, bf16_args, matrices = _heads("bf16", 4, 67, 130, gen)
    for tokens in (1, 6, 40):
        x = torch.randn(tokens, 4, 130, generator=gen)
        _check(matmul_heads(heads, x, path=path), x, w64, bf16_args, matrices, path)


def test_strided_inputs_and_outputs(threads):
    """x as MLA hands it over (q's no-rope half of [T, N, P+R], bf16; [N, T, K] transposed), out into the first M
    columns of [T, N, M+R] or transposed; a bf16 output is the float32 one rounded as torch rounds."""
    gen = torch.Generator().manual_seed(seed("strided", threads))
    n, rows, cols, extra = 6, 96, 40, 24
    heads, w64, bf16_args, matrices = _heads("f32", n, rows, cols, gen)
    for tokens in (1, 3, 12):
        q = torch.randn(tokens, n, cols + extra, generator=gen).bfloat16()
        x = q[..., :cols]  # [T, N, K], head stride K + extra
        full = torch.full((tokens, n, rows + extra), 7.0)
        got = matmul_heads(heads, x, full[..., :rows])
        assert got.data_ptr() == full.data_ptr()
        _check(full[..., :rows], x.float(), w64, bf16_args, matrices, "auto")
        assert (full[..., rows:] == 7.0).all()  # nothing written past each row
        xt = torch.randn(n, tokens, cols, generator=gen).transpose(0, 1)  # [T, N, K] over [N, T, K] memory
        out_t = torch.empty(n, tokens, rows).transpose(0, 1)
        matmul_heads(heads, xt, out_t)
        _check(out_t, xt, w64, bf16_args, matrices, "auto")
        want = matmul_heads(heads, x).bfloat16()
        got = matmul_heads(heads, x, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
        into = torch.zeros(tokens, n, rows + extra, dtype=torch.bfloat16)
        matmul_heads(heads, x, into[..., :rows])
        assert torch.equal(into[..., :rows].view(torch.int16), want.view(torch.int16))


def test_empty_and_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    heads, *_ = _heads("f32", 3, 8, 16, gen)
    assert matmul_heads(heads, torch.randn(0, 3, 16)).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="x: expected shape \\[T, 3, 16\\]"):
        matmul_heads(heads, torch.randn(2, 4, 16))
    with pytest.raises(ValueError, match="x: must be 3-D"):
        matmul_heads(heads, torch.randn(2, 48))
    with pytest.raises(ValueError, match="x: rows must be contiguous"):
        matmul_heads(heads, torch.randn(2, 3, 32)[..., ::2])
    with pytest.raises(ValueError, match="out: expected shape \\[2, 3, 8\\]"):
        matmul_heads(heads, torch.randn(2, 3, 16), torch.empty(2, 3, 9))
    with pytest.raises(ValueError, match="out: dtype must be float32 or bfloat16"):
        matmul_heads(heads, torch.randn(2, 3, 16), torch.empty(2, 3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out: rows overlap"):
        matmul_heads(heads, torch.randn(2, 3, 16), torch.empty(2, 8).unsqueeze(1).expand(2, 3, 8))
    with pytest.raises(ValueError, match="path must be one of"):
        matmul_heads(heads, torch.randn(1, 3, 16), path="fast")
    with pytest.raises(ValueError, match="matrices: need at least one"):
        MatrixHeads([])
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="matrices\\[1\\]: shape \\[8, 15\\] differs"):
        MatrixHeads([kernel_matrix("f32", w), kernel_matrix("f32", w[:, :15])])
    with pytest.raises(ValueError, match="matrices\\[1\\]: format differs"):
        MatrixHeads([kernel_matrix("f32", w), kernel_matrix("bf16", w.bfloat16())])
    with pytest.raises(ValueError, match="must be \\[N, M, K\\]"):
        MatrixHeads.dense(w)
