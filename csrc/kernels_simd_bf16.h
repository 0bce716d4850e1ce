// The BF16 dot-product GEMV of kernels_simd.h, for bf16 and fp8 weights in the tables whose vocabulary has
// kBf16Dot (avx512bf16: vdpbf16ps; avx2bf16: the same arithmetic emulated by two FMAs, to test this code on
// CPUs without AVX512-BF16). The activations are rounded to bf16 once per call (bf16 hidden states are
// unchanged by it); the weights are decoded to bf16 in registers, 2W at a time (fp8 codes exactly: by bit
// placement, value * 2^-120, for column blocks free of subnormal codes; through IEEE half bits otherwise),
// and each instruction sums the products of W pairs into W float32 lanes: twice the multiply-adds of an FMA
// for each vector of decoded weights. fp8 block scales are folded into the activations' bf16 copy per row
// block, as in the float32 GEMV (kernels_simd_float.h).
//
// Legend: M tokens, K input features, R rows per register tile, MT tokens per register tile, W float lanes,
// L = 2W bf16 lanes.
#pragma once

#include "kernels_simd_float.h"

namespace hm {
namespace {

// The bf16 lanes of one vector, a multiple of which every bf16 activation row holds past its last column
// (a step that starts at a column block's first column may read up to L - 1 columns beyond K).
template <class V>
constexpr I64 bf16_row_length(I64 K) {
  constexpr I64 L = 2 * V::W;
  return (K + 2 * L - 1) / L * L;
}

template <class V, WFormat F>
HM_TILE_INLINE typename V::B decode_b(const uint8_t* p) {
  if constexpr (F == WFormat::BF16) return V::load_b(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == kFp8Normal) return V::fp8_normal_b(p);
  else return V::fp8_exact_b(p);
}

// Whether a finite x[k] * s[column block] * unscale of the row rounds to an infinite bf16 (see scale_activations).
inline bool bf16_row_overflows(const float* src, I64 K, I64 bc, const float* srow, float unscale) {
  for (I64 k = 0; k < K; ++k) {
    const float s = (srow ? srow[k / bc] : 1.0f) * unscale;
    if (std::fabs(src[k]) <= FLT_MAX && (bf16_bits(src[k] * s) & 0x7FFF) == 0x7F80) return true;
  }
  return false;
}

// scale_activations (kernels_simd_float.h) into bf16, by the vocabulary's own rounding where it has one
// (V::scale_row_to_bf16; the exact overflow test then runs only when an output came out infinite).
template <class V>
inline bool scale_activations_bf16(const Matrix& w, const float* srow, const Activations& x, float unscale,
                                   uint16_t* dst, I64 ld, const uint16_t** rows) {
  if constexpr (!V::kNativeBf16Round) {
    return scale_activations(w, srow, x, unscale, dst, ld, rows);
  } else {
    const I64 bc = srow ? w.block_cols : w.cols;
    // a call per row (fewer calls than one per 128-column block); blocks that end within a vector: a call per block.
    const bool infinite = scale_rows(x, w.cols, dst, ld, rows, [&](const float* src, uint16_t* out) {
      if (srow && bc % 32)
        return scale_blocks(w, srow, unscale, src, out, [](const float* in, float s, uint16_t* to, I64 n) {
          return V::scale_row_to_bf16(in, nullptr, 0, s, to, n);
        });
      return V::scale_row_to_bf16(src, srow, bc, unscale, out, w.cols);
    });
    for (I64 m = 0; infinite && m < x.m; ++m)
      if (bf16_row_overflows(x_row(x, m), w.cols, bc, srow, unscale)) return false;
    return true;
  }
}

// The start of a segment of rows at s0 (segment_end: bf16 all rows, fp8 the rows of one scale row block): srow =
// its fp8 scale row (nullptr for bf16), and the tokens' activations (fp8: scaled by srow for the fast decode)
// rounded to bf16 into dst (rows[m]). False where an fp8 row block must take the exact decode everywhere.
template <class V, WFormat F>
inline bool segment_activations_bf16(const Matrix& w, I64 s0, const Activations& x, uint16_t* dst, I64 ld,
                                     const uint16_t** rows, const float*& srow) {
  if constexpr (F == WFormat::FP8) {
    srow = static_cast<const float*>(w.scales) + (s0 / w.block_rows) * w.scale_stride;
    return scale_activations_bf16<V>(w, srow, x, kFp8NormalUnscale, dst, ld, rows);
  } else {
    srow = nullptr;
    return scale_activations_bf16<V>(w, srow, x, 1.0f, dst, ld, rows);
  }
}

// One step of the bf16 dot-product GEMV: L = 2W weights of format F decoded to bf16, multiplied by bf16
// activations into W float32 lanes (V::dot_b).
template <class V, WFormat F>
struct DotStep : FloatAccumulators<V> {
  using typename FloatAccumulators<V>::Acc;
  static constexpr int kLanes = 2 * V::W;
  static constexpr I64 kBytes = bytes_per_weight<F>();
  using X = uint16_t;
  using Weights = typename V::B;
  static HM_TILE_INLINE Weights weights(const uint8_t* p) { return decode_b<V, F>(p); }
  static HM_TILE_INLINE Acc multiply_add(Acc acc, Weights w, const uint16_t* x) {
    return V::dot_b(acc, w, V::load_b(x));
  }
};

// acc[i][j] += sum over k in [k0, k1) of W[row i][k] * xb[token j][k] (accumulate_steps, kernels_simd_float.h).
template <class V, WFormat F, int R, int MT, NextRows P>
HM_TILE_INLINE void accumulate_b(const uint8_t* const* rowp, I64 k0, I64 k1, const uint16_t* const* xr,
                                 typename V::F (&acc)[R][MT], const uint8_t* next, I64 stride) {
  accumulate_steps<DotStep<V, F>, R, MT, P>(rowp, k0, k1, xr, acc, next, stride);
}

// out[i][j] = W[row i] . x[token j] for one tile (R rows x MT tokens). bf16 weights: one pass over the rows.
// fp8: per column range (for_each_fp8_range), the bit-placement decode against xfast or the exact decode against
// xexact (both products * 2^-16); xfast == nullptr: exact everywhere.
template <class V, WFormat F, int R, int MT, NextRows P>
HM_TILE_INLINE void bf16_dot_tile(const Matrix& w, const uint8_t* const* rowp, const I64* rows,
                                  const uint16_t* const* xfast, const uint16_t* const* xexact, float (&out)[R][MT],
                                  const uint8_t* next) {
  typename V::F acc[R][MT];
  zero_and_finish<V, R, MT>(acc, out, false);
  if constexpr (F == WFormat::BF16) {
    accumulate_b<V, WFormat::BF16, R, MT, P>(rowp, 0, w.cols, xfast, acc, next, w.row_bytes);
  } else {
    for_each_fp8_range<R>(w, rows, xfast != nullptr, [&](bool exact, I64 k0, I64 k1) HM_TILE_LAMBDA {
      if (exact) accumulate_b<V, WFormat::FP8, R, MT, P>(rowp, k0, k1, xexact, acc, next, w.row_bytes);
      else accumulate_b<V, kFp8Normal, R, MT, P>(rowp, k0, k1, xfast, acc, next, w.row_bytes);
    });
  }
  zero_and_finish<V, R, MT>(acc, out, true);
}

// out = W[row] . x for one token against a row in one range (bf16, or fp8 without subnormal codes: the
// bit-placement decode throughout), as a one-row tile computes it, without the token tiles' and fp8 column ranges'
// work per row: with 2 KB fp8 rows in L2 that work had been a third of the profile.
template <class V, WFormat F, NextRows P>
HM_TILE_INLINE float one_token_row(const Matrix& w, const uint8_t* row, const uint16_t* x, const uint8_t* next) {
  const uint8_t* const rowp[1] = {row};
  const uint16_t* const xr[1] = {x};
  typename V::F acc[1][1] = {{V::zero()}};
  accumulate_b<V, F == WFormat::FP8 ? kFp8Normal : F, 1, 1, P>(rowp, 0, w.cols, xr, acc, next, w.row_bytes);
  return V::hsum(acc[0][0]);
}

// The GEMV path with bf16 dot products: whole rows, tiles of R rows x up to V::kBf16Tokens tokens, each
// prefetching the next as P says (NextRows). One token in one-row tiles takes one_token_row for rows without a
// subnormal code (bit for bit the same, without the tile's per-row column-range work).
template <class V, WFormat F, int R, NextRows P>
void matmul_bf16_dot_gemv_tiles(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  constexpr I64 B = bytes_per_weight<F>();
  const I64 K = w.cols, M = x.m, ld = bf16_row_length<V>(K);
  const uint16_t* fast_rows[kMaxGemvTokens];
  const uint16_t* exact_rows[kMaxGemvTokens] = {};
  uint16_t* buf = reinterpret_cast<uint16_t*>(scratch_floats(M * ld));  // two bf16 copies: fast, exact
  const float output_scale = F == WFormat::FP8 ? kFp8NormalOutput : 1.0f;
  const I64 ahead = prefetch_ahead_rows(w, R, true);
  for (I64 s0 = r0; s0 < r1;) {
    const I64 s1 = segment_end(w, s0, r1);  // bf16: all rows; fp8: the rows of one scale row block
    const float* srow;
    const bool fast = segment_activations_bf16<V, F>(w, s0, x, buf, ld, fast_rows, srow);
    bool exact_ready = false;
    for (I64 r = s0; r < s1; r += R) {
      const uint8_t* rowp[R];
      I64 rows[R];
      uint8_t flags = 0;
      for (int i = 0; i < R; ++i) {
        rows[i] = imin(r + i, s1 - 1);  // a short tile repeats its last row (not stored)
        rowp[i] = w.data + rows[i] * w.row_bytes;
        if constexpr (F == WFormat::FP8) flags |= w.row_flags[rows[i]];
      }
      if (F == WFormat::FP8 && (!fast || (flags & kRowHasSubnormal)) && !exact_ready) {
        scale_activations_bf16<V>(w, srow, x, kFp8ExactUnscale, buf + M * ld, ld, exact_rows);
        exact_ready = true;
      }
      const uint8_t* next = next_tile_rows(w, r, r1, R, K * B, ahead);
      if (R == 1 && M == 1 && fast && !(flags & kRowHasSubnormal)) {
        y[r - r0] = one_token_row<V, F, P>(w, rowp[0], fast_rows[0], next) * output_scale;
        continue;
      }
      for_each_token_tile_upto<V::kBf16Tokens>(M, [&](auto tile, I64 m, bool first) HM_TILE_LAMBDA {
        constexpr int MT = decltype(tile)::kTokens;
        float o[R][MT];
        bf16_dot_tile<V, F, R, MT, P>(w, rowp, rows, fast ? fast_rows + m : nullptr, exact_rows + m, o,
                                   first ? next : nullptr);
        store_tile<R, MT>(y, ldy, m, r - r0, imin(R, s1 - r), true, o, output_scale);
      }, serpentine_reverse<R>(r - s0));
    }
    s0 = s1;
  }
  if constexpr (F == WFormat::FP8) set_nan_rows(w, r0, r1, M, y, ldy);
}

template <class V, WFormat F>
void matmul_bf16_dot_gemv(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  const I64 activation_bytes = x.m * w.cols * I64{sizeof(uint16_t)};
  if (one_row_tiles<V, F>(x.m, w.row_bytes, true)) {
    return with_next_rows<V, Gemv::Float, 1>(w.row_bytes, x.m, activation_bytes, true, [&](auto tag) {
      matmul_bf16_dot_gemv_tiles<V, F, 1, decltype(tag)::kPolicy>(w, r0, r1, x, y, ldy);
    });
  }
  with_next_rows<V, Gemv::Float, 4>(w.row_bytes, x.m, activation_bytes, true, [&](auto tag) {
    matmul_bf16_dot_gemv_tiles<V, F, 4, decltype(tag)::kPolicy>(w, r0, r1, x, y, ldy);
  });
}

}  // namespace
}  // namespace hm
