// The vectorised kernels, written once over a vector vocabulary V (simd_avx2.h / simd_avx512.h) and
// instantiated by each ISA's translation unit (kernels_avx2.cpp, kernels_avx512.cpp).
//
// matmul computes y[m, r] = sum_k x[m, k] * W[r, k] for a block of rows r of one weight matrix:
//  - float formats (f32, bf16, f16, fp8): weights are decoded to float32 in registers (fp8 by bit placement,
//    with the block scale and 2^120 folded into one multiply) and FMA'd against fp32 activations;
//  - int formats (int4, int8): int8 activations quantised per group, integer dot products (maddubs or VNNI),
//    one float multiply-add per group with the weight and activation scales (int4 with 32-groups: per 8
//    groups, their integer sums folded into one vector first).
//  - tables whose vocabulary has kAmx (amx) multiply bf16 and fp8 weights by AMX tiles where use_amx says
//    (kernels_amx.h);
//  - tables whose vocabulary has kBf16Dot (avx512bf16; avx2bf16 emulates it) run bf16 and fp8 weights on the
//    GEMV path from bf16_dot_min_tokens tokens with bf16 activations and bf16 dot products (kernels_simd_bf16.h);
// GEMV path (few tokens): register tiles of R rows x MT tokens over whole rows (vectors along K), sharing each
// decoded weight vector across tokens, the next tile's rows prefetched (NextRows, by row length). GEMM path
// (many tokens), K in chunks: float formats decode a panel of rows once and multiply it by the transposed
// activations as outer products (vectors along tokens); int formats keep row x token tiles of integer dot
// products, partial sums accumulating in y.
//
// Everything here has internal linkage (anonymous namespace) and uses no std:: templates, so that code
// compiled for one ISA can never be linked into another ISA's path.
//
// Legend: M tokens, K input features, R rows per register tile, MT tokens per register tile, W vector lanes.
#pragma once

#include "activation_quant.h"
#include "kernels_amx.h"
#include "kernels_simd_bf16.h"
#include "kernels_simd_float.h"
#include "kernels_simd_int.h"

namespace hm {
namespace {

// A float format's path: GEMV up to kMaxGemvTokens tokens unless `gemm` (for bf16 and fp8 weights with bf16
// dot products where V has them, from bf16_dot_min_tokens tokens), else the GEMM panels.
template <class V, WFormat F>
void matmul_fp(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  if (gemm || x.m > kMaxGemvTokens) return matmul_fp_gemm<V, F>(w, r0, r1, x, y, ldy);
  if constexpr (V::kBf16Dot && has_bf16_dot_path(F))
    if (x.m >= bf16_dot_min_tokens(F, w.row_bytes)) return matmul_bf16_dot_gemv<V, F>(w, r0, r1, x, y, ldy);
  return matmul_fp_gemv<V, F>(w, r0, r1, x, y, ldy);
}

// Tokens [m0, m0 + n) of x.
inline Activations token_block(const Activations& x, I64 m0, I64 n) {
  Activations b = x;
  b.m = n;
  if (x.rows) {
    b.rows = x.rows + m0;
  } else {
    if (b.x) b.x += m0 * x.ldx;
    if (b.q) b.q += m0 * x.ldq;
    if (b.qscale) b.qscale += m0 * x.ldg;
    if (b.qsum) b.qsum += m0 * x.ldg;
  }
  return b;
}

// An int format's matmul, kIntTokenBlock tokens at a time. Not inlined into matmul: there it slowed the AMX
// table's bf16 experts by 10-15% (measured alternating, 32 experts of 2048 x 768 at 128 tokens).
template <class V, WFormat F, ScaleType ST>
__attribute__((noinline)) void matmul_int_blocks(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, MatmulPath path) {
  for (I64 m0 = 0; m0 < x.m; m0 += kIntTokenBlock) {
    const Activations b = token_block(x, m0, imin(kIntTokenBlock, x.m - m0));
    matmul_int_group<V, F, ST>(w, r0, r1, b, y + m0 * ldy, ldy, use_gemm(path, b.m, w.fmt, V::kBf16Dot));
  }
}

#ifdef __AMX_BF16__
// The AMX tiles by format. Not inlined into matmul, which a decode step calls for every projection.
template <class V>
__attribute__((noinline)) void matmul_amx_any(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y,
                                              I64 ldy) {
  switch (w.fmt) {
    case WFormat::FP8: return matmul_amx<V, WFormat::FP8>(w, r0, r1, x, y, ldy);
    case WFormat::INT4: return matmul_amx<V, WFormat::INT4>(w, r0, r1, x, y, ldy);
    case WFormat::INT8: return matmul_amx<V, WFormat::INT8>(w, r0, r1, x, y, ldy);
    default: return matmul_amx<V, WFormat::BF16>(w, r0, r1, x, y, ldy);
  }
}
#endif

template <class V>
void matmul(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, MatmulPath path) {
#ifdef __AMX_BF16__
  if constexpr (V::kAmx) {
    if (use_amx(path, x.m, w.fmt)) return matmul_amx_any<V>(w, r0, r1, x, y, ldy);
  }
#endif
  const bool gemm = use_gemm(path, x.m, w.fmt, V::kBf16Dot);
  const bool bf16_scales = w.scale_type == ScaleType::BF16;
  switch (w.fmt) {
    case WFormat::F32: return matmul_fp<V, WFormat::F32>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::BF16: return matmul_fp<V, WFormat::BF16>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::F16: return matmul_fp<V, WFormat::F16>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::FP8: return matmul_fp<V, WFormat::FP8>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::INT4:
      return bf16_scales ? matmul_int_blocks<V, WFormat::INT4, ScaleType::BF16>(w, r0, r1, x, y, ldy, path)
                         : matmul_int_blocks<V, WFormat::INT4, ScaleType::F16>(w, r0, r1, x, y, ldy, path);
    case WFormat::INT8:
      return bf16_scales ? matmul_int_blocks<V, WFormat::INT8, ScaleType::BF16>(w, r0, r1, x, y, ldy, path)
                         : matmul_int_blocks<V, WFormat::INT8, ScaleType::F16>(w, r0, r1, x, y, ldy, path);
  }
}

// quantize_row (activation_quant.h) in vectors, bit for bit: the same multiply, rounded to nearest even by
// cvtps2dq as nearbyint rounds in the default mode, the clamp, the scale and qsum from the group's int sum (V::abs_max,
// V::quantize_i8). Whole groups of a multiple of 32 elements; a last partial group (k not a multiple of the group)
// through the scalar one. The scalar one calls libm's nearbyint per element (this library's portable files are
// compiled for the baseline ISA): Qwen3-30B-A3B shapes, int4, one thread, T = 1: 3.6% of the MoE's time.
template <class V>
void quantize_row_simd(const float* x, I64 k, I64 padded, int group, int8_t* q, float* scale, float* qsum) {
  const I64 whole = group % 32 == 0 ? k / group : 0;
  for (I64 g = 0; g < whole; ++g) {
    const float* xg = x + g * group;
    int8_t* qg = q + g * group;
    bool finite;
    const float m = V::abs_max(xg, group, finite);
    if (!finite) {
      std::memset(qg, 0, static_cast<size_t>(group));
      scale[g] = qsum[g] = NAN;
      continue;
    }
    const int32_t sum = V::quantize_i8(xg, group, m > 0.0f ? 127.0f / m : 0.0f, qg);
    scale[g] = m / 127.0f;
    qsum[g] = scale[g] * static_cast<float>(sum);
  }
  const I64 done = whole * group;
  if (done < padded) quantize_row(x + done, k - done, padded - done, group, q + done, scale + whole, qsum + whole);
}

template <class V>
void silu_mul(const float* gate, const float* up, float* out, I64 n) {
  constexpr int W = V::W;
  I64 i = 0;
  for (; i + W <= n; i += W) {
    const typename V::F g = V::load(gate + i);
    const typename V::F sig = V::div(V::set1(1.0f), V::add(V::set1(1.0f), V::exp(V::mul(g, V::set1(-1.0f)))));
    V::store(out + i, V::mul(V::mul(g, sig), V::load(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + __builtin_expf(-gate[i])) * up[i];
}

uint64_t read_sum(const uint64_t* p, I64 n, I64 ahead) {
  const auto load = [p](I64 i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)); };
  const auto prefetch = [p, ahead](I64 i) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i) + ahead, _MM_HINT_T1);
  };
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  I64 i = 0;
  if (ahead) {
    for (; i + 16 <= n; i += 16) {  // each line's prefetch beside its loads (see accumulate_steps)
      a0 = _mm256_add_epi64(a0, load(i));
      prefetch(i);
      a1 = _mm256_add_epi64(a1, load(i + 4));
      a2 = _mm256_add_epi64(a2, load(i + 8));
      prefetch(i + 8);
      a3 = _mm256_add_epi64(a3, load(i + 12));
    }
  }
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, load(i));
    a1 = _mm256_add_epi64(a1, load(i + 4));
    a2 = _mm256_add_epi64(a2, load(i + 8));
    a3 = _mm256_add_epi64(a3, load(i + 12));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  uint64_t sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; i < n; ++i) sum += p[i];
  return sum;
}

template <class V>
double fma_peak(I64 iters) {
  constexpr int kChains = 12;
  typename V::F acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = V::set1(1.0f + 0.001f * c);
  const typename V::F a = V::set1(0.999999f), b = V::set1(1e-7f);
  for (I64 it = 0; it < iters; ++it)
    for (int c = 0; c < kChains; ++c) acc[c] = V::fma(acc[c], a, b);
  typename V::F total = acc[0];
  for (int c = 1; c < kChains; ++c) total = V::add(total, acc[c]);
  volatile float sink = V::hsum(total);
  (void)sink;
  return 2.0 * V::W * kChains * static_cast<double>(iters);
}

}  // namespace
}  // namespace hm
