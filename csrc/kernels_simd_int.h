// Int-format matmul kernels (int4 / int8 per group, int8 activations) of kernels_simd.h.
//
// Legend: M tokens, R rows per register tile, MT tokens per register tile, g group size.
#pragma once

#include "kernels_simd_common.h"

namespace hm {
namespace {
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

// acc (+)= the dot products of int4 codes u (0..15) and int8 activations s within one group: int16 pair sums
// (acc16, widened once per group) where the ISA has them, else int32 (acci).
template <class V>
inline void add_u4(__m256i& acc16, __m256i& acci, __m256i u, __m256i s) {
  if constexpr (V::kPairSums16) acc16 = V::pairs_u4(acc16, u, s);
  else acci = V::dot_u4(acci, u, s);
}

// out[i][j] = sum over groups [g0, g1) of ws[i][g] * xs[j][g] * (integer dot of the group), kChunks = g / 32.
// Scales are combined 8 groups at a time in vectors (weight scale x activation scale into a small table the
// group loop broadcasts from), and so is the correction for unsigned-offset dot products (offset * ws * xs *
// sum(q)). next (may be nullptr): the start of the R rows that follow, prefetched at the rate these are read
// (see accumulate in kernels_simd_float.h).
template <class V, WFormat F, ScaleType ST, int kChunks, int R, int MT>
inline void int_tile(const uint8_t* const* rowp, const uint16_t* const* srow, I64 g0, I64 g1,
                     const int8_t* const* xq, const float* const* xs, const float* const* xsum,
                     float (&out)[R][MT], const uint8_t* next) {
  constexpr I64 kChunkBytes = F == WFormat::INT4 ? 16 : 32;  // bytes of one row's 32 elements
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
      constexpr bool kPairs16 = F == WFormat::INT4 && V::kPairSums16;
      __m256i acci[R][MT], acc16[R][MT];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < MT; ++j) acci[i][j] = acc16[i][j] = _mm256_setzero_si256();
      constexpr bool kWideInt4 = F == WFormat::INT4 && kChunks % 2 == 0;
      if constexpr (kWideInt4)  // two chunks (64 elements) a step: one 32-byte load a row, no cross-lane unpack
        for (int c = 0; c < kChunks; c += 2) {
          const I64 e = e0 + c * 32;
          if (next) prefetch_bytes<R * 2 * kChunkBytes>(next + e / 32 * R * kChunkBytes);
          __m256i lo[R], hi[R];  // lo: elements 0-15 of both chunks (lanes 0, 1), hi: their elements 16-31
          for (int i = 0; i < R; ++i) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowp[i] + e / 2));
            lo[i] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
            hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
          }
          for (int j = 0; j < MT; ++j) {  // the activations in the same order (shared by the R rows)
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + e));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + e + 32));
            const __m256i xlo = _mm256_permute2x128_si256(a, b, 0x20), xhi = _mm256_permute2x128_si256(a, b, 0x31);
            for (int i = 0; i < R; ++i) {
              add_u4<V>(acc16[i][j], acci[i][j], lo[i], xlo);
              add_u4<V>(acc16[i][j], acci[i][j], hi[i], xhi);
            }
          }
        }
      for (int c = 0; c < (kWideInt4 ? 0 : kChunks); ++c) {
        const I64 e = e0 + c * 32;
        if (next) prefetch_bytes<R * kChunkBytes>(next + e / 32 * R * kChunkBytes);
        __m256i wv[R];
        for (int i = 0; i < R; ++i) {
          if constexpr (F == WFormat::INT4) wv[i] = unpack_u4(rowp[i] + e / 2);
          else wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowp[i] + e));
        }
        for (int j = 0; j < MT; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + e));
          for (int i = 0; i < R; ++i) {
            if constexpr (F == WFormat::INT4) add_u4<V>(acc16[i][j], acci[i][j], wv[i], xv);
            else acci[i][j] = V::dot_i8(acci[i][j], wv[i], xv);
          }
        }
      }
      if constexpr (kPairs16)
        for (int i = 0; i < R; ++i)
          for (int j = 0; j < MT; ++j) acci[i][j] = V::widen_pairs(acc16[i][j]);
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
      const I64 row_read = F == WFormat::INT4 ? w.padded_cols / 2 : w.padded_cols;
      const uint8_t* next = gemm ? nullptr : next_tile_rows(w, r, r1, 4, row_read);
      if (next)  // the next tile's group scales too: a stream of their own, which prefetchers pick up late
        for (I64 off = 0; off < 4 * w.scale_stride * 2; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(scales + (r + 4) * w.scale_stride) + off, _MM_HINT_T0);
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
          int_tile<V, F, ST, kChunks, kWideRows, 4>(rowp + i, srow + i, g0, g1, xq, xs, xsum, o,
                                                    m == 0 && next ? next + i * w.row_bytes : nullptr);
          store_tile<kWideRows, 4>(y, ldy, m, row0 + i, valid - i, first, o);
        }
      }
      for (; m + 2 <= M; m += 2) {
        const int8_t* xq[2] = {q_row(x, m), q_row(x, m + 1)};
        const float* xs[2] = {qscale_row(x, m), qscale_row(x, m + 1)};
        const float* xsum[2] = {qsum_row(x, m), qsum_row(x, m + 1)};
        for (int i = 0; i < 4; i += 2) {
          float o[2][2];
          int_tile<V, F, ST, kChunks, 2, 2>(rowp + i, srow + i, g0, g1, xq, xs, xsum, o,
                                            m == 0 && next ? next + i * w.row_bytes : nullptr);
          store_tile<2, 2>(y, ldy, m, row0 + i, valid - i, first, o);
        }
      }
      for (; m < M; ++m) {
        const int8_t* xq[1] = {q_row(x, m)};
        const float* xs[1] = {qscale_row(x, m)};
        const float* xsum[1] = {qsum_row(x, m)};
        float o[4][1];
        int_tile<V, F, ST, kChunks, 4, 1>(rowp, srow, g0, g1, xq, xs, xsum, o, m == 0 ? next : nullptr);
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

}  // namespace
}  // namespace hm
