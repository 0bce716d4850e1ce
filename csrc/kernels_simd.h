// The vectorised kernels, written once over a vector vocabulary V (simd_avx2.h / simd_avx512.h) and
// instantiated by each ISA's translation unit (kernels_avx2.cpp, kernels_avx512.cpp).
//
// matmul computes y[m, r] = sum_k x[m, k] * W[r, k] for a block of rows r of one weight matrix:
//  - float formats (f32, bf16, f16, fp8): weights are decoded to float32 in registers (fp8 by bit placement,
//    with the block scale and 2^120 folded into one multiply) and FMA'd against fp32 activations;
//  - int formats (int4, int8): int8 activations quantised per group, integer dot products (maddubs or VNNI),
//    one float multiply-add per group with the weight and activation scales.
// Register tiles of R rows x MT tokens share each decoded weight vector across tokens. GEMV path (few tokens):
// whole rows at once. GEMM path (many tokens): K split into chunks that keep the tokens' activations in L2
// while the rows stream past (partial sums accumulate in y).
//
// Everything here has internal linkage (anonymous namespace) and uses no std:: templates, so that code
// compiled for one ISA can never be linked into another ISA's path.
//
// Legend: M tokens, K input features, R rows per register tile, MT tokens per register tile, W vector lanes.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hm_types.h"

namespace hm {
namespace {

using I64 = int64_t;

inline I64 imin(I64 a, I64 b) { return a < b ? a : b; }
inline I64 imax(I64 a, I64 b) { return a > b ? a : b; }

constexpr I64 kRowBlock = 256;      // rows a GEMM pass covers per K chunk (the chunk's activations stay in L2)
constexpr I64 kGemmChunkK = 1024;   // K elements per GEMM chunk (activations of the tile's tokens stay in L2)

// Decoding of fp8 rows without subnormal codes (the common case): value * 2^-120 by bit placement, 3 operations
// a vector. WFormat::FP8 itself decodes exactly through IEEE half bits (value * 2^-8).
constexpr WFormat kFp8Normal = static_cast<WFormat>(100);
constexpr float kFp8NormalUnscale = 0x1p104f;  // folded into the activations; the other 2^16 into the output
constexpr float kFp8NormalOutput = 0x1p16f;
constexpr float kFp8ExactUnscale = 0x1p-8f;  // exact decode gives value * 2^-8; products then match 2^-16 too

template <WFormat F>
constexpr I64 bytes_per_weight() {
  return F == WFormat::F32 ? 4 : (F == WFormat::FP8 || F == kFp8Normal ? 1 : 2);
}

template <class V, WFormat F>
inline typename V::F decode(const uint8_t* p) {
  if constexpr (F == WFormat::F32) return V::load(reinterpret_cast<const float*>(p));
  else if constexpr (F == WFormat::BF16) return V::load_bf16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == WFormat::F16) return V::load_f16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == kFp8Normal) return V::load_fp8_normal(p);
  else return V::load_fp8(p);
}

// A per-thread scratch buffer of at least n floats (grows, never shrinks).
inline float* scratch_floats(I64 n) {
  static thread_local float* buf = nullptr;
  static thread_local I64 capacity = 0;
  if (n > capacity) {
    delete[] buf;
    buf = new float[static_cast<size_t>(n)];
    capacity = n;
  }
  return buf;
}

// A per-thread table of at least n pointers (grows, never shrinks).
inline const float** scratch_pointers(I64 n) {
  static thread_local const float** buf = nullptr;
  static thread_local I64 capacity = 0;
  if (n > capacity) {
    delete[] buf;
    buf = new const float*[static_cast<size_t>(n)];
    capacity = n;
  }
  return buf;
}

// ---------------------------------------------------------------------------------------------------------
// Float formats

// acc[i][j] += sum over k in [k0, k1) of W[row i][k] * x[token j][k]. kPadded: rows readable (zero) up to a
// multiple of W; else the last partial vector is copied into a zero-padded buffer (x is zero-padded always).
template <class V, WFormat F, bool kPadded, int R, int MT>
inline void accumulate(const uint8_t* const* rowp, I64 k0, I64 k1, const float* const* xr,
                       typename V::F (&acc)[R][MT]) {
  constexpr int W = V::W;
  constexpr I64 B = bytes_per_weight<F>();
  I64 k = k0;
  for (; k + W <= k1 || (kPadded && k < k1); k += W) {
    for (int i = 0; i < R; ++i) {
      const typename V::F w = decode<V, F>(rowp[i] + k * B);
      for (int j = 0; j < MT; ++j) acc[i][j] = V::fma(w, V::load(xr[j] + k), acc[i][j]);
    }
  }
  if (!kPadded && k < k1) {
    alignas(64) uint8_t tail[W * B];
    for (int i = 0; i < R; ++i) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, rowp[i] + k * B, static_cast<size_t>((k1 - k) * B));
      const typename V::F w = decode<V, F>(tail);
      for (int j = 0; j < MT; ++j) acc[i][j] = V::fma(w, V::load(xr[j] + k), acc[i][j]);
    }
  }
}

template <class V, int R, int MT>
inline void zero_and_finish(typename V::F (&acc)[R][MT], float (*out)[MT], bool finish) {
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) {
      if (finish) out[i][j] = V::hsum(acc[i][j]);
      else acc[i][j] = V::zero();
    }
}

// out[i][j] = sum over k in [0, n) of W[row i][k] * x[token j][k].
template <class V, WFormat F, bool kPadded, int R, int MT>
inline void fp_tile(const uint8_t* const* rowp, I64 n, const float* const* xr, float (&out)[R][MT]) {
  typename V::F acc[R][MT];
  zero_and_finish<V, R, MT>(acc, out, false);
  accumulate<V, F, kPadded, R, MT>(rowp, 0, n, xr, acc);
  zero_and_finish<V, R, MT>(acc, out, true);
}

// The fp8 tile of the GEMV path: per column block, the 3-operation decode against x scaled for it, or, where a
// row of the tile has a subnormal code in the block, the exact decode against x scaled for that (both give
// products * 2^-16; x_fast == nullptr: exact everywhere).
template <class V, int R, int MT>
inline void fp8_tile(const Matrix& w, const uint8_t* const* rowp, const I64* rows, const float* const* xfast,
                     const float* const* xexact, float (&out)[R][MT]) {
  typename V::F acc[R][MT];
  zero_and_finish<V, R, MT>(acc, out, false);
  uint8_t flags = 0;
  for (int i = 0; i < R; ++i) flags |= w.row_flags[rows[i]];
  if (xfast && !(flags & kRowHasSubnormal)) {  // the common case: whole rows in one loop
    accumulate<V, kFp8Normal, false, R, MT>(rowp, 0, w.cols, xfast, acc);
    zero_and_finish<V, R, MT>(acc, out, true);
    return;
  }
  for (I64 k0 = 0, kb = 0; k0 < w.cols; k0 += w.block_cols, ++kb) {
    const I64 k1 = imin(w.cols, k0 + w.block_cols);
    bool exact = xfast == nullptr;
    for (int i = 0; i < R; ++i) exact |= block_has_subnormal(w, rows[i], kb);
    if (exact) accumulate<V, WFormat::FP8, false, R, MT>(rowp, k0, k1, xexact, acc);
    else accumulate<V, kFp8Normal, false, R, MT>(rowp, k0, k1, xfast, acc);
  }
  zero_and_finish<V, R, MT>(acc, out, true);
}

// y[(m + j) * ldy + row0 + i] (+)= out[i][j] for the tile's valid rows.
template <int R, int MT>
inline void store_tile(float* y, I64 ldy, I64 m, I64 row0, I64 valid_rows, bool first, const float (&out)[R][MT],
                       float scale = 1.0f) {
  for (int i = 0; i < R && i < valid_rows; ++i)
    for (int j = 0; j < MT; ++j) {
      float& dst = y[(m + j) * ldy + row0 + i];
      dst = first ? out[i][j] * scale : dst + out[i][j] * scale;
    }
}

// All token tiles of one 4-row tile: y rows [row0, row0 + valid) (+)= W4 [k0, k0 + n) . x[m][k0, k0 + n).
template <class V, WFormat F, bool kPadded>
inline void row_tile_all_tokens(const uint8_t* const* rowp, I64 n, const float* const* xrows, I64 M, I64 k0,
                                float* y, I64 ldy, I64 row0, I64 valid, bool first, float scale = 1.0f) {
  I64 m = 0;
  for (; m + 2 <= M; m += 2) {  // 4 rows x 2 tokens: each x vector feeds 4 FMAs (x streams from L2)
    const float* xr[2] = {xrows[m] + k0, xrows[m + 1] + k0};
    float o[4][2];
    fp_tile<V, F, kPadded, 4, 2>(rowp, n, xr, o);
    store_tile<4, 2>(y, ldy, m, row0, valid, first, o, scale);
  }
  if (m < M) {
    const float* xr[1] = {xrows[m] + k0};
    float o[4][1];
    fp_tile<V, F, kPadded, 4, 1>(rowp, n, xr, o);
    store_tile<4, 1>(y, ldy, m, row0, valid, first, o, scale);
  }
}

// All token tiles of one 4-row fp8 tile (see fp8_tile); rows[i] are the tile's row indices.
template <class V>
inline void fp8_row_tile_all_tokens(const Matrix& w, const uint8_t* const* rowp, const I64* rows,
                                    const float* const* xfast, const float* const* xexact, I64 M, float* y, I64 ldy,
                                    I64 row0, I64 valid) {
  I64 m = 0;
  for (; m + 2 <= M; m += 2) {
    const float* xf[2] = {xfast ? xfast[m] : nullptr, xfast ? xfast[m + 1] : nullptr};
    const float* xe[2] = {xexact[m], xexact[m + 1]};
    float o[4][2];
    fp8_tile<V, 4, 2>(w, rowp, rows, xfast ? xf : nullptr, xe, o);
    store_tile<4, 2>(y, ldy, m, row0, valid, true, o, kFp8NormalOutput);
  }
  if (m < M) {
    const float* xf[1] = {xfast ? xfast[m] : nullptr};
    const float* xe[1] = {xexact[m]};
    float o[4][1];
    fp8_tile<V, 4, 1>(w, rowp, rows, xfast ? xf : nullptr, xe, o);
    store_tile<4, 1>(y, ldy, m, row0, valid, true, o, kFp8NormalOutput);
  }
}

// Rows holding an fp8 NaN code give NaN for every token (as dequantise-then-matmul would).
inline void set_nan_rows(const Matrix& w, I64 r0, I64 r1, I64 M, float* y, I64 ldy) {
  for (I64 r = r0; r < r1; ++r)
    if (w.row_flags[r] & kRowHasNan)
      for (I64 m = 0; m < M; ++m) y[m * ldy + r - r0] = NAN;
}

// Scales x's rows by the fp8 block scales of one row block times `unscale` into dst (M rows of ldx); false
// when a product overflowed float32.
inline bool scale_activations(const Matrix& w, const float* srow, const Activations& x, float unscale, float* dst,
                              const float** rows) {
  const I64 K = w.cols;
  bool finite = true;
  for (I64 m = 0; m < x.m; ++m) {
    float* out = dst + m * x.ldx;
    const float* src = x_row(x, m);
    for (I64 kb = 0; kb < K; kb += w.block_cols) {
      const float s = srow[kb / w.block_cols] * unscale;
      for (I64 k = kb; k < imin(K, kb + w.block_cols); ++k) {
        out[k] = src[k] * s;
        finite &= !__builtin_isinf(out[k]) || __builtin_isinf(src[k]);
      }
    }
    for (I64 k = K; k < x.ldx; ++k) out[k] = 0.0f;
    rows[m] = out;
  }
  return finite;
}

// The end of the segment of rows starting at r that share one fp8 scale row (rows of one row block).
inline I64 segment_end(const Matrix& w, I64 r, I64 re) {
  return w.fmt == WFormat::FP8 ? imin(re, (r / w.block_rows + 1) * w.block_rows) : re;
}

constexpr I64 kMaxTokensGemv = kGemmMinTokens;  // token pointers the GEMV path keeps on the stack

// GEMV path: whole rows, tiles of 4 rows. fp8 block scales are folded into a copy of the few tokens'
// activations per row block, so the inner loop is decode + FMA; column blocks without subnormal codes use the
// 3-operation decode (activations scaled by 2^104 more, outputs by 2^16), the others the exact one (their
// activation copy is made when first needed).
template <class V, WFormat F>
void matmul_fp_gemv(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  const I64 K = w.cols, M = x.m;
  const float* xrows[kMaxTokensGemv];
  const float* exact_rows[kMaxTokensGemv] = {};
  for (I64 m = 0; m < M; ++m) xrows[m] = x_row(x, m);
  if constexpr (F != WFormat::FP8) {
    for (I64 r = r0; r < r1; r += 4) {
      const uint8_t* rowp[4];
      for (int i = 0; i < 4; ++i) rowp[i] = w.data + imin(r + i, r1 - 1) * w.row_bytes;  // short tile: repeat
      row_tile_all_tokens<V, F, false>(rowp, K, xrows, M, 0, y, ldy, r - r0, imin(4, r1 - r), true);
    }
    return;
  }
  float* scaled = scratch_floats(2 * M * x.ldx);
  for (I64 s0 = r0; s0 < r1;) {
    const I64 s1 = segment_end(w, s0, r1);
    const float* srow = static_cast<const float*>(w.scales) + (s0 / w.block_rows) * w.scale_stride;
    const bool fast = scale_activations(w, srow, x, kFp8NormalUnscale, scaled, xrows);
    bool exact_ready = false;
    for (I64 r = s0; r < s1; r += 4) {
      const uint8_t* rowp[4];
      I64 rows[4];
      uint8_t flags = 0;
      for (int i = 0; i < 4; ++i) {
        rows[i] = imin(r + i, s1 - 1);  // a short tile repeats its last row (not stored)
        rowp[i] = w.data + rows[i] * w.row_bytes;
        flags |= w.row_flags[rows[i]];
      }
      const bool need_exact = !fast || (flags & kRowHasSubnormal);
      if (need_exact && !exact_ready) {
        scale_activations(w, srow, x, kFp8ExactUnscale, scaled + M * x.ldx, exact_rows);
        exact_ready = true;
      }
      fp8_row_tile_all_tokens<V>(w, rowp, rows, fast ? xrows : nullptr, exact_rows, M, y, ldy, r - r0,
                                 imin(4, s1 - r));
    }
    s0 = s1;
  }
  set_nan_rows(w, r0, r1, M, y, ldy);
}

// dst[k] = decode(src[k]) * s for k in [kb, ke) (a partial last vector through a zero-padded copy).
template <class V, WFormat F>
inline void decode_store(const uint8_t* src, float* dst, I64 kb, I64 ke, typename V::F s) {
  constexpr int W = V::W;
  constexpr I64 B = bytes_per_weight<F>();
  I64 k = kb;
  for (; k + W <= ke; k += W) V::store(dst + k, V::mul(decode<V, F>(src + k * B), s));
  if (k < ke) {
    alignas(64) uint8_t tail[W * B];
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, src + k * B, static_cast<size_t>((ke - k) * B));
    V::store(dst + k, V::mul(decode<V, F>(tail), s));
  }
}

// GEMM path: K in chunks whose activations stay in L2; each 4-row tile's chunk is decoded once (scales
// applied) into a float32 panel in L1, then every token tile runs FMA-only register tiles over it. Float32
// weights are read in place.
template <class V, WFormat F>
void matmul_fp_gemm(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  constexpr int W = V::W;
  constexpr I64 B = bytes_per_weight<F>();
  const I64 K = w.cols, M = x.m;
  const float** xrows = scratch_pointers(M);
  for (I64 m = 0; m < M; ++m) xrows[m] = x_row(x, m);
  const I64 bc = F == WFormat::FP8 ? w.block_cols : kGemmChunkK;
  const I64 kc = bc * imax(1, kGemmChunkK / bc);
  const I64 panel_ld = (kc + W - 1) / W * W;
  float* panel = scratch_floats(4 * panel_ld);
  const float* scales = static_cast<const float*>(w.scales);
  for (I64 rb = r0; rb < r1; rb += kRowBlock) {
    const I64 re = imin(rb + kRowBlock, r1);
    for (I64 k0 = 0; k0 < K; k0 += kc) {
      const I64 n = imin(kc, K - k0);
      for (I64 r = rb; r < re; r += 4) {
        const uint8_t* rowp[4];
        for (int i = 0; i < 4; ++i) {
          const I64 ri = imin(r + i, re - 1);  // a short tile repeats its last row (not stored)
          const uint8_t* src = w.data + ri * w.row_bytes + k0 * B;
          if constexpr (F == WFormat::F32) {
            rowp[i] = src;
            continue;
          }
          float* dst = panel + i * panel_ld;
          if constexpr (F == WFormat::FP8) {
            const float* srow = scales + (ri / w.block_rows) * w.scale_stride;
            for (I64 kb = 0; kb < n; kb += bc) {
              const float s = srow[(k0 + kb) / bc];
              if (block_has_subnormal(w, ri, (k0 + kb) / bc))
                decode_store<V, F>(src, dst, kb, imin(n, kb + bc), V::set1(s * 0x1p8f));
              else
                decode_store<V, kFp8Normal>(src, dst, kb, imin(n, kb + bc), V::set1(s * 0x1p120f));
            }
          } else {
            decode_store<V, F>(src, dst, 0, n, V::set1(1.0f));
          }
          for (I64 k = n; k < (n + W - 1) / W * W; ++k) dst[k] = 0.0f;
          rowp[i] = reinterpret_cast<const uint8_t*>(dst);
        }
        if constexpr (F == WFormat::F32)
          row_tile_all_tokens<V, WFormat::F32, false>(rowp, n, xrows, M, k0, y, ldy, r - r0, imin(4, re - r), k0 == 0);
        else
          row_tile_all_tokens<V, WFormat::F32, true>(rowp, n, xrows, M, k0, y, ldy, r - r0, imin(4, re - r), k0 == 0);
      }
    }
  }
  if constexpr (F == WFormat::FP8) set_nan_rows(w, r0, r1, M, y, ldy);
}

template <class V, WFormat F>
void matmul_fp(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  if (!gemm && x.m <= kMaxTokensGemv) return matmul_fp_gemv<V, F>(w, r0, r1, x, y, ldy);
  return matmul_fp_gemm<V, F>(w, r0, r1, x, y, ldy);
}

// ---------------------------------------------------------------------------------------------------------
// Int formats

// 16 bytes of int4 pairs -> 32 unsigned values 0..15 in element order (byte j: element j low, j+16 high).
inline __m256i unpack_u4(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 group scales (bf16 or f16) -> floats.
template <ScaleType ST>
inline __m256 load_scales8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (ST == ScaleType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

// out[i][j] = sum over groups [g0, g1) of ws[i][g] * xs[j][g] * (integer dot of the group), kChunks = g / 32.
// Scales are combined 8 groups at a time in vectors (weight scale x activation scale into a small table the
// group loop broadcasts from), and so is the correction for unsigned-offset dot products (offset * ws * xs *
// sum(q)).
template <class V, WFormat F, ScaleType ST, int kChunks, int R, int MT>
inline void int_tile(const uint8_t* const* rowp, const uint16_t* const* srow, I64 g0, I64 g1,
                     const int8_t* const* xq, const float* const* xs, const float* const* xsum,
                     float (&out)[R][MT]) {
  constexpr float kOffset = F == WFormat::INT4 ? 8.0f : static_cast<float>(V::kI8Offset);
  constexpr int kGroup = 32 * kChunks;
  __m256 accf[R][MT], corr[R][MT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) accf[i][j] = corr[i][j] = _mm256_setzero_ps();
  alignas(32) float combined[R][MT][8];
  for (I64 gb = g0; gb < g1; gb += 8) {
    const I64 nb = imin(8, g1 - gb);
    for (int i = 0; i < R; ++i) {
      alignas(16) uint16_t ws_tail[8] = {};
      if (nb < 8) std::memcpy(ws_tail, srow[i] + gb, static_cast<size_t>(nb) * 2);
      const __m256 ws = load_scales8<ST>(nb == 8 ? srow[i] + gb : ws_tail);
      for (int j = 0; j < MT; ++j) {
        alignas(32) float xs_tail[8] = {}, xsum_tail[8] = {};
        if (nb < 8) {
          std::memcpy(xs_tail, xs[j] + gb, static_cast<size_t>(nb) * 4);
          std::memcpy(xsum_tail, xsum[j] + gb, static_cast<size_t>(nb) * 4);
        }
        _mm256_store_ps(combined[i][j], _mm256_mul_ps(ws, _mm256_loadu_ps(nb == 8 ? xs[j] + gb : xs_tail)));
        if constexpr (kOffset != 0.0f)
          corr[i][j] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(nb == 8 ? xsum[j] + gb : xsum_tail), corr[i][j]);
      }
    }
    for (I64 gi = 0; gi < nb; ++gi) {
      const I64 e0 = (gb + gi) * kGroup;
      __m256i acci[R][MT];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < MT; ++j) acci[i][j] = _mm256_setzero_si256();
      for (int c = 0; c < kChunks; ++c) {
        const I64 e = e0 + c * 32;
        __m256i wv[R];
        for (int i = 0; i < R; ++i) {
          if constexpr (F == WFormat::INT4) wv[i] = unpack_u4(rowp[i] + e / 2);
          else wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowp[i] + e));
        }
        for (int j = 0; j < MT; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + e));
          for (int i = 0; i < R; ++i) {
            if constexpr (F == WFormat::INT4) acci[i][j] = V::dot_u4(acci[i][j], wv[i], xv);
            else acci[i][j] = V::dot_i8(acci[i][j], wv[i], xv);
          }
        }
      }
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < MT; ++j)
          accf[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acci[i][j]), _mm256_broadcast_ss(&combined[i][j][gi]),
                                       accf[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) out[i][j] = hsum256(accf[i][j]) - kOffset * hsum256(corr[i][j]);
}

template <class V, WFormat F, ScaleType ST, int kChunks>
void matmul_int(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  const I64 M = x.m, groups = w.padded_cols / w.group;
  const I64 gc = gemm ? imax(1, kGemmChunkK / w.group) : groups;
  const uint16_t* scales = static_cast<const uint16_t*>(w.scales);
  constexpr int kWideRows = kChunks == 1 ? 2 : 1;  // rows of the 4-token tile (int accumulators cost registers)
  for (I64 g0 = 0; g0 < groups; g0 += gc) {
    const I64 g1 = imin(g0 + gc, groups);
    const bool first = g0 == 0;
    for (I64 r = r0; r < r1; r += 4) {
      const uint8_t* rowp[4];
      const uint16_t* srow[4];
      for (int i = 0; i < 4; ++i) {
        const I64 ri = imin(r + i, r1 - 1);
        rowp[i] = w.data + ri * w.row_bytes;
        srow[i] = scales + ri * w.scale_stride;
      }
      const I64 valid = imin(4, r1 - r), row0 = r - r0;
      I64 m = 0;
      for (; m + 4 <= M; m += 4) {
        const int8_t* xq[4];
        const float *xs[4], *xsum[4];
        for (int j = 0; j < 4; ++j) {
          xq[j] = q_row(x, m + j);
          xs[j] = qscale_row(x, m + j);
          xsum[j] = qsum_row(x, m + j);
        }
        for (int i = 0; i < 4; i += kWideRows) {
          float o[kWideRows][4];
          int_tile<V, F, ST, kChunks, kWideRows, 4>(rowp + i, srow + i, g0, g1, xq, xs, xsum, o);
          store_tile<kWideRows, 4>(y, ldy, m, row0 + i, valid - i, first, o);
        }
      }
      for (; m + 2 <= M; m += 2) {
        const int8_t* xq[2] = {q_row(x, m), q_row(x, m + 1)};
        const float* xs[2] = {qscale_row(x, m), qscale_row(x, m + 1)};
        const float* xsum[2] = {qsum_row(x, m), qsum_row(x, m + 1)};
        for (int i = 0; i < 4; i += 2) {
          float o[2][2];
          int_tile<V, F, ST, kChunks, 2, 2>(rowp + i, srow + i, g0, g1, xq, xs, xsum, o);
          store_tile<2, 2>(y, ldy, m, row0 + i, valid - i, first, o);
        }
      }
      for (; m < M; ++m) {
        const int8_t* xq[1] = {q_row(x, m)};
        const float* xs[1] = {qscale_row(x, m)};
        const float* xsum[1] = {qsum_row(x, m)};
        float o[4][1];
        int_tile<V, F, ST, kChunks, 4, 1>(rowp, srow, g0, g1, xq, xs, xsum, o);
        store_tile<4, 1>(y, ldy, m, row0, valid, first, o);
      }
    }
  }
}

template <class V, WFormat F, ScaleType ST>
void matmul_int_group(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  if (w.group == 32) matmul_int<V, F, ST, 1>(w, r0, r1, x, y, ldy, gemm);
  else matmul_int<V, F, ST, 4>(w, r0, r1, x, y, ldy, gemm);
}

// ---------------------------------------------------------------------------------------------------------
// Table entries

template <class V>
void matmul(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, MatmulPath path) {
  const bool gemm = path == MatmulPath::Gemm || (path == MatmulPath::Auto && x.m >= kGemmMinTokens);
  const bool bf16_scales = w.scale_type == ScaleType::BF16;
  switch (w.fmt) {
    case WFormat::F32: return matmul_fp<V, WFormat::F32>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::BF16: return matmul_fp<V, WFormat::BF16>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::F16: return matmul_fp<V, WFormat::F16>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::FP8: return matmul_fp<V, WFormat::FP8>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::INT4:
      return bf16_scales ? matmul_int_group<V, WFormat::INT4, ScaleType::BF16>(w, r0, r1, x, y, ldy, gemm)
                         : matmul_int_group<V, WFormat::INT4, ScaleType::F16>(w, r0, r1, x, y, ldy, gemm);
    case WFormat::INT8:
      return bf16_scales ? matmul_int_group<V, WFormat::INT8, ScaleType::BF16>(w, r0, r1, x, y, ldy, gemm)
                         : matmul_int_group<V, WFormat::INT8, ScaleType::F16>(w, r0, r1, x, y, ldy, gemm);
  }
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

uint64_t read_sum(const uint64_t* p, I64 n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  I64 i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 4)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 12)));
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
