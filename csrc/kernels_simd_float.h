// Float-format matmul kernels (f32, bf16, f16, fp8 block-scaled) of kernels_simd.h: register tiles, the GEMV
// path over whole rows and the tiled GEMM path over decoded panels.
//
// Legend: M tokens, K input features, R rows per register tile, MT tokens per register tile, W vector lanes.
#pragma once

#include "kernels_simd_common.h"

namespace hm {
namespace {
// acc[i][j] += sum over k in [k0, k1) of W[row i][k] * x[token j][k], S::kLanes weights a step (S: how a step
// decodes the weights and multiplies them, FmaStep or the bf16 dot products' DotStep); the rows' last partial step
// is read through a zero-padded copy (x is zero-padded always), copied first so that acc is indexed by constants
// only (it stays in registers).
// next (may be nullptr): the start of the R rows that follow (stride bytes apart, back to back), prefetched at
// the rate this tile's rows are read (prefetch_next, policy P), so that the next tile's lines do not wait on memory
// (hardware prefetchers restart at every row and page). Small tiles keep more sets of accumulators
// (kAccumulatorSets) so that enough multiply-add chains are in flight.
template <int R, int MT>
constexpr int kAccumulatorSets = R * MT == 1 ? 4 : R * MT <= 4 ? 2 : 1;

// The sets of accumulators of an R x MT tile: one multiply-add (FMA, or vdpbf16ps: several cycles of latency, two
// a cycle) per step and accumulator leaves R * MT * sets chains in flight; a one-row tile at one token needs four
// sets not to be bound by those chains.
template <class S, int R, int MT, NextRows P>
HM_TILE_INLINE void accumulate_steps(const uint8_t* const* rowp, I64 k0, I64 k1, const typename S::X* const* xr,
                                     typename S::Acc (&acc)[R][MT], const uint8_t* next, I64 stride) {
  constexpr int L = S::kLanes;
  constexpr I64 B = S::kBytes;
  constexpr int C = kAccumulatorSets<R, MT>;
  I64 k = k0;
  if constexpr (C > 1) {
    typename S::Acc more[C - 1][R][MT];  // sets 1..C-1 (set 0 is acc)
    HM_UNROLL for (int c = 0; c < C - 1; ++c)
      HM_UNROLL for (int i = 0; i < R; ++i)
        HM_UNROLL for (int j = 0; j < MT; ++j) more[c][i][j] = S::zero();
    for (; k + C * L <= k1; k += C * L) {
      HM_UNROLL for (int i = 0; i < R; ++i) {
        typename S::Weights w[C];
        HM_UNROLL for (int c = 0; c < C; ++c) {
          w[c] = S::weights(rowp[i] + (k + c * L) * B);
          // each load followed by its share of the next tile's prefetches, not all of them ahead of the step's
          // loads: a one-row tile of 4 KB bf16 rows read 14% faster so on the AMX Xeon (docs/kernels.md)
          if (i == 0 && next) prefetch_next<P, R, L * B>(next, stride, (k + c * L) * B);
        }
        HM_UNROLL for (int j = 0; j < MT; ++j) {
          acc[i][j] = S::multiply_add(acc[i][j], w[0], xr[j] + k);
          HM_UNROLL for (int c = 1; c < C; ++c)
            more[c - 1][i][j] = S::multiply_add(more[c - 1][i][j], w[c], xr[j] + k + c * L);
        }
      }
    }
    HM_UNROLL for (int c = 0; c < C - 1; ++c)
      HM_UNROLL for (int i = 0; i < R; ++i)
        HM_UNROLL for (int j = 0; j < MT; ++j) acc[i][j] = S::add(acc[i][j], more[c][i][j]);
  }
  for (; k + L <= k1; k += L) {
    if (next) prefetch_next<P, R, L * B>(next, stride, k * B);
    HM_UNROLL for (int i = 0; i < R; ++i) {
      const typename S::Weights w = S::weights(rowp[i] + k * B);
      HM_UNROLL for (int j = 0; j < MT; ++j) acc[i][j] = S::multiply_add(acc[i][j], w, xr[j] + k);
    }
  }
  if (k < k1) {
    alignas(64) uint8_t tail[R][L * B] = {};
    for (int i = 0; i < R; ++i) std::memcpy(tail[i], rowp[i] + k * B, static_cast<size_t>((k1 - k) * B));
    HM_UNROLL for (int i = 0; i < R; ++i) {
      const typename S::Weights w = S::weights(tail[i]);
      HM_UNROLL for (int j = 0; j < MT; ++j) acc[i][j] = S::multiply_add(acc[i][j], w, xr[j] + k);
    }
  }
}

// The float32 accumulators of a GEMV step (FmaStep, DotStep): W lanes, zeroed and summed as V's vectors.
template <class V>
struct FloatAccumulators {
  using Acc = typename V::F;
  static HM_TILE_INLINE Acc zero() { return V::zero(); }
  static HM_TILE_INLINE Acc add(Acc a, Acc b) { return V::add(a, b); }
};

// One step of the float32 GEMV: W weights of format F decoded to float32, FMA'd against float32 activations.
template <class V, WFormat F>
struct FmaStep : FloatAccumulators<V> {
  using typename FloatAccumulators<V>::Acc;
  static constexpr int kLanes = V::W;
  static constexpr I64 kBytes = bytes_per_weight<F>();
  using X = float;
  using Weights = typename V::F;
  static HM_TILE_INLINE Weights weights(const uint8_t* p) { return decode<V, F>(p); }
  static HM_TILE_INLINE Acc multiply_add(Acc acc, Weights w, const float* x) { return V::fma(w, V::load(x), acc); }
};

template <class V, WFormat F, int R, int MT, NextRows P>
HM_TILE_INLINE void accumulate(const uint8_t* const* rowp, I64 k0, I64 k1, const float* const* xr,
                               typename V::F (&acc)[R][MT], const uint8_t* next, I64 stride) {
  accumulate_steps<FmaStep<V, F>, R, MT, P>(rowp, k0, k1, xr, acc, next, stride);
}

// Zeroes a tile's accumulators, or (finish) writes their horizontal sums to out: the rows of a 3- or 4-row tile
// together (V::hsum4; a 3-row tile's fourth sum is of zeros).
template <class V, int R, int MT>
HM_TILE_INLINE void zero_and_finish(typename V::F (&acc)[R][MT], float (*out)[MT], bool finish) {
  if (!finish) {
    HM_UNROLL for (int i = 0; i < R; ++i)
      HM_UNROLL for (int j = 0; j < MT; ++j) acc[i][j] = V::zero();
  } else if constexpr (R == 3 || R == 4) {
    HM_UNROLL for (int j = 0; j < MT; ++j) {
      alignas(16) float sums[4];
      _mm_store_ps(sums, V::hsum4(acc[0][j], acc[1][j], acc[2][j], R == 4 ? acc[R - 1][j] : V::zero()));
      HM_UNROLL for (int i = 0; i < R; ++i) out[i][j] = sums[i];
    }
  } else {
    HM_UNROLL for (int i = 0; i < R; ++i)
      HM_UNROLL for (int j = 0; j < MT; ++j) out[i][j] = V::hsum(acc[i][j]);
  }
}

// out[i][j] = sum over k in [0, n) of W[row i][k] * x[token j][k].
template <class V, WFormat F, int R, int MT, NextRows P>
HM_TILE_INLINE void fp_tile(const uint8_t* const* rowp, I64 n, const float* const* xr, float (&out)[R][MT],
                            const uint8_t* next) {
  typename V::F acc[R][MT];
  zero_and_finish<V, R, MT>(acc, out, false);
  accumulate<V, F, R, MT, P>(rowp, 0, n, xr, acc, next, n * bytes_per_weight<F>());
  zero_and_finish<V, R, MT>(acc, out, true);
}

// fn(exact, k0, k1) over the columns of an fp8 tile (rows[i], i < R) in as few ranges as cover them: when !fast,
// or when no row of the tile has a subnormal code (the common case), one range of whole rows; otherwise maximal
// runs of column blocks alike, exact where a row of the tile has a subnormal code in the block. Real weights hold
// about one subnormal code in 5000, so most long rows have one: a range per block would cost a call per block.
template <int R, class Fn>
HM_TILE_INLINE void for_each_fp8_range(const Matrix& w, const I64* rows, bool fast, Fn&& fn) {
  uint8_t flags = 0;
  for (int i = 0; i < R; ++i) flags |= w.row_flags[rows[i]];
  const bool one_range = !fast || !(flags & kRowHasSubnormal);
  const I64 bc = w.block_cols, blocks = (w.cols + bc - 1) / bc, stride = w.subnormal_stride;
  auto exact_bits = [&](I64 word) {  // bit b: the tile's block 64 * word + b is exact
    uint64_t bits = 0;
    const I64 at = 8 * word;
    const I64 n = imin(8, stride - at);
    for (int i = 0; i < R; ++i) {
      const uint8_t* row_bits = w.subnormal_blocks + rows[i] * stride + at;
      if (n == 8) {
        uint64_t word_bits;
        std::memcpy(&word_bits, row_bits, 8);
        bits |= word_bits;
      } else {
        for (I64 b = 0; b < n; ++b) bits |= static_cast<uint64_t>(row_bits[b]) << (8 * b);
      }
    }
    return bits;
  };
  bool exact = one_range ? !fast : (exact_bits(0) & 1);
  for (I64 kb = 0; kb < blocks; exact = !exact) {  // one call site, so that fn is inlined once
    I64 end = blocks;  // the run [kb, end) of blocks alike
    if (!one_range)
      for (end = kb; end < blocks;) {
        const I64 word_end = imin(blocks, (end / 64 + 1) * 64);
        uint64_t differ = exact_bits(end / 64) >> (end % 64);  // bit b: block end + b
        if (exact) differ = ~differ;
        end = differ ? imin(word_end, end + __builtin_ctzll(differ)) : word_end;
        if (end < word_end) break;
      }
    fn(exact, kb * bc, imin(w.cols, end * bc));
    kb = end;
  }
}

// One step of the float32 GEMV over fp8 column blocks with subnormal codes, against the activations scaled for
// the 3-operation decode (x * s * 2^104): the exact decode (value * 2^-8) and the activations each times 2^-56,
// so that the products are value * x * s * 2^-16 as in the rest of the row, and no float32 denormal arises (the
// smallest subnormal code becomes 2^-73). Bit for bit the products of a second activation copy scaled for the
// exact decode, without making that copy.
template <class V>
struct Fp8ExactStep : FmaStep<V, WFormat::FP8> {
  using typename FmaStep<V, WFormat::FP8>::Acc;
  using Weights = typename V::F;
  static HM_TILE_INLINE Weights weights(const uint8_t* p) { return V::mul(decode<V, WFormat::FP8>(p), rescale()); }
  static HM_TILE_INLINE Acc multiply_add(Acc acc, Weights w, const float* x) {
    return V::fma(w, V::mul(V::load(x), rescale()), acc);
  }
  static HM_TILE_INLINE typename V::F rescale() { return V::set1(0x1p-56f); }
};

// The fp8 tile of the GEMV path: per column range (for_each_fp8_range), the 3-operation decode or the exact one
// (Fp8ExactStep) against x scaled for the former (xfast); xfast == nullptr (x * s too large for it): the exact
// decode everywhere against x scaled for that (xexact). All products are * 2^-16.
template <class V, int R, int MT, NextRows P>
HM_TILE_INLINE void fp8_tile(const Matrix& w, const uint8_t* const* rowp, const I64* rows, const float* const* xfast,
                             const float* const* xexact, float (&out)[R][MT], const uint8_t* next) {
  typename V::F acc[R][MT];
  zero_and_finish<V, R, MT>(acc, out, false);
  for_each_fp8_range<R>(w, rows, xfast != nullptr, [&](bool exact, I64 k0, I64 k1) HM_TILE_LAMBDA {
    if (!xfast) accumulate<V, WFormat::FP8, R, MT, P>(rowp, k0, k1, xexact, acc, next, w.row_bytes);
    else if (exact) accumulate_steps<Fp8ExactStep<V>, R, MT, P>(rowp, k0, k1, xfast, acc, next, w.row_bytes);
    else accumulate<V, kFp8Normal, R, MT, P>(rowp, k0, k1, xfast, acc, next, w.row_bytes);
  });
  zero_and_finish<V, R, MT>(acc, out, true);
}

// y[(m + j) * ldy + row0 + i] (+)= out[i][j] * scale for the tile's valid rows (first: =).
template <int R, int MT>
HM_TILE_INLINE void store_tile(float* y, I64 ldy, I64 m, I64 row0, I64 valid_rows, bool first,
                               const float (&out)[R][MT], float scale = 1.0f) {
  for (int i = 0; i < R && i < valid_rows; ++i)
    for (int j = 0; j < MT; ++j) {
      float& dst = y[(m + j) * ldy + row0 + i];
      dst = first ? out[i][j] * scale : dst + out[i][j] * scale;
    }
}

// The token tiles of an R-row GEMV tile: fn(TokenTile<MT>{}, m) for tiles of MT tokens from token m. Each weight
// vector is decoded once per token tile, so wider tiles decode less; a tile keeps R x MT accumulators (12 FMA
// chains at most). 4-row tiles take tokens three at a time, two where three would leave a single token behind;
// 3-row tiles four at a time, then 3 + 2 for five left, else what is left; one-row tiles (one_row_tiles) one.
template <int R, class Fn>
HM_TILE_INLINE void for_each_token_tile(I64 M, Fn&& fn) {
  static_assert(R == 1 || R == 3 || R == 4, "GEMV tiles have 1, 3 or 4 rows");
  for (I64 m = 0; m < M;) {
    const I64 left = M - m;
    if constexpr (R == 1) {  // one_row_tiles: one token
      fn(TokenTile<1>{}, m), m += 1;
    } else if constexpr (R == 3) {
      if (left >= 4 && left != 5) fn(TokenTile<4>{}, m), m += 4;
      else if (left >= 3) fn(TokenTile<3>{}, m), m += 3;
      else if (left == 2) fn(TokenTile<2>{}, m), m += 2;
      else fn(TokenTile<1>{}, m), m += 1;
    } else {
      if (left == 4 || left == 2) fn(TokenTile<2>{}, m), m += 2;
      else if (left >= 3) fn(TokenTile<3>{}, m), m += 3;
      else fn(TokenTile<1>{}, m), m += 1;
    }
  }
}

// Rows per GEMV tile of vocabulary V for M tokens of format F (rows of row_bytes): 4, except on AVX2 (16 vector
// registers) for decoded formats at 4 tokens and more that do not split into 3-token tiles evenly (M % 3 != 0,
// M != 5), which take 3-row x 4-token tiles: the same 12 accumulators, each weight decoded once per 4 tokens
// instead of per 3 or 2. fp8 rows under kRowStreamMinBytes keep 4-row tiles from 8 tokens, and float32 weights
// (no decode to save) always: there the 3-row tiles measured slower.
template <class V>
constexpr bool kThreeRowGemvTiles = V::W == 8;  // the AVX2 vocabularies
template <class V, WFormat F>
constexpr int gemv_tile_rows(I64 M, I64 row_bytes) {
  if (!kThreeRowGemvTiles<V> || F == WFormat::F32 || M < 4 || M % 3 == 0 || M == 5) return 4;
  return F == WFormat::FP8 && M > 7 && row_bytes < kRowStreamMinBytes ? 4 : 3;
}

// All token tiles of one R-row tile over whole rows: y rows [row0, row0 + valid) = W_R . x[m].
// next: the following tile's rows, prefetched while the first token tile reads this one (may be nullptr).
template <class V, WFormat F, int R, NextRows P>
HM_TILE_INLINE void row_tile_all_tokens(const uint8_t* const* rowp, I64 n, const float* const* xrows, I64 M, float* y,
                                        I64 ldy, I64 row0, I64 valid, const uint8_t* next) {
  for_each_token_tile<R>(M, [&](auto tile, I64 m) HM_TILE_LAMBDA {
    constexpr int MT = decltype(tile)::kTokens;
    float o[R][MT];
    fp_tile<V, F, R, MT, P>(rowp, n, xrows + m, o, m == 0 ? next : nullptr);
    store_tile<R, MT>(y, ldy, m, row0, valid, true, o);
  });
}

// All token tiles of one R-row fp8 tile (see fp8_tile); rows[i] are the tile's row indices.
template <class V, int R, NextRows P>
HM_TILE_INLINE void fp8_row_tile_all_tokens(const Matrix& w, const uint8_t* const* rowp, const I64* rows,
                                            const float* const* xfast, const float* const* xexact, I64 M, float* y,
                                            I64 ldy, I64 row0, I64 valid, const uint8_t* next) {
  for_each_token_tile<R>(M, [&](auto tile, I64 m) HM_TILE_LAMBDA {
    constexpr int MT = decltype(tile)::kTokens;
    float o[R][MT];
    fp8_tile<V, R, MT, P>(w, rowp, rows, xfast ? xfast + m : nullptr, xexact + m, o, m == 0 ? next : nullptr);
    store_tile<R, MT>(y, ldy, m, row0, valid, true, o, kFp8NormalOutput);
  });
}

// Rows holding an fp8 NaN code give NaN for every token (as dequantise-then-matmul would).
inline void set_nan_rows(const Matrix& w, I64 r0, I64 r1, I64 M, float* y, I64 ldy) {
  for (I64 r = r0; r < r1; ++r)
    if (w.row_flags[r] & kRowHasNan)
      for (I64 m = 0; m < M; ++m) y[m * ldy + r - r0] = NAN;
}

// f rounded to bf16 (nearest even; NaN stays a quiet NaN), branch-free so that loops over it vectorise.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

// For each token m: row(src, out) for its activations src and its copy out (M rows of ld from dst), then out
// zeroed past K and rows[m] = out. Returns whether any row returned true.
template <class T, class Row>
inline bool scale_rows(const Activations& x, I64 K, T* dst, I64 ld, const T** rows, Row&& row) {
  bool any = false;
  for (I64 m = 0; m < x.m; ++m) {
    T* out = dst + m * ld;
    any |= row(x_row(x, m), out);
    for (I64 k = K; k < ld; ++k) out[k] = T{0};
    rows[m] = out;
  }
  return any;
}

// block(src, s, out, n) over the column blocks of one row of w's width (src and out at the block's first column,
// n its columns, s its fp8 block scale * unscale; srow == nullptr: one block, scale unscale). Returns whether any
// block returned true.
template <class T, class Block>
inline bool scale_blocks(const Matrix& w, const float* srow, float unscale, const float* src, T* out,
                         Block&& block) {
  const I64 K = w.cols, bc = srow ? w.block_cols : K;
  bool any = false;
  for (I64 kb = 0, b = 0; kb < K; kb += bc, ++b)
    any |= block(src + kb, (srow ? srow[b] : 1.0f) * unscale, out + kb, imin(K, kb + bc) - kb);
  return any;
}

// Rows x[m] * s[column block] * unscale into dst (see scale_rows, scale_blocks), as float32 (T = float) or rounded
// to bf16 (T = uint16_t); srow: one row block's fp8 block scales, nullptr for 1 everywhere. False when a finite
// product became infinite (overflowed the output type's range).
template <class T>
inline bool scale_activations(const Matrix& w, const float* srow, const Activations& x, float unscale, T* dst,
                              I64 ld, const T** rows) {
  auto block = [](const float* src, float s, T* out, I64 n) {
    int overflow = 0;  // branch-free, so that the loop vectorises
    for (I64 k = 0; k < n; ++k) {
      int infinite;
      if constexpr (sizeof(T) == 2) {
        const uint16_t b = bf16_bits(src[k] * s);
        out[k] = b;
        infinite = (b & 0x7FFF) == 0x7F80;
      } else {
        const float v = src[k] * s;
        out[k] = v;
        infinite = std::fabs(v) > FLT_MAX;
      }
      overflow |= infinite & static_cast<int>(std::fabs(src[k]) <= FLT_MAX);
    }
    return overflow != 0;
  };
  return !scale_rows(x, w.cols, dst, ld, rows, [&](const float* src, T* out) {
    return scale_blocks(w, srow, unscale, src, out, block);
  });
}

// The end of the segment of rows starting at r that share one fp8 scale row (rows of one row block).
inline I64 segment_end(const Matrix& w, I64 r, I64 re) {
  return w.fmt == WFormat::FP8 ? imin(re, (r / w.block_rows + 1) * w.block_rows) : re;
}


// GEMV path: whole rows, tiles of R rows (gemv_tile_rows). fp8 block scales are folded into a copy of the few
// tokens' activations per row block, so the inner loop is decode + FMA; column blocks without subnormal codes use
// the 3-operation decode (activations scaled by 2^104 more, outputs by 2^16), the others the exact one against
// the same copy (Fp8ExactStep). Where x * s is too large for that scaling (|x * s| >= 2^24), the row block runs
// the exact decode everywhere against a copy scaled for it. P: how each tile prefetches the next (NextRows).
template <class V, WFormat F, int R, NextRows P>
void matmul_fp_gemv_tiles(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  const I64 K = w.cols, M = x.m;
  const float* xrows[kMaxGemvTokens];
  const float* exact_rows[kMaxGemvTokens] = {};
  for (I64 m = 0; m < M; ++m) xrows[m] = x_row(x, m);
  const I64 ahead = prefetch_ahead_rows(w, R, M == 1);
  if constexpr (F != WFormat::FP8) {
    for (I64 r = r0; r < r1; r += R) {
      const uint8_t* rowp[R];
      for (int i = 0; i < R; ++i) rowp[i] = w.data + imin(r + i, r1 - 1) * w.row_bytes;  // short tile: repeat
      const uint8_t* next = next_tile_rows(w, r, r1, R, K * bytes_per_weight<F>(), ahead);
      row_tile_all_tokens<V, F, R, P>(rowp, K, xrows, M, y, ldy, r - r0, imin(R, r1 - r), next);
    }
    return;
  }
  float* scaled = scratch_floats(M * x.ldx);
  for (I64 s0 = r0; s0 < r1;) {
    const I64 s1 = segment_end(w, s0, r1);
    const float* srow = static_cast<const float*>(w.scales) + (s0 / w.block_rows) * w.scale_stride;
    const bool fast = scale_activations(w, srow, x, kFp8NormalUnscale, scaled, x.ldx, xrows);
    if (!fast) scale_activations(w, srow, x, kFp8ExactUnscale, scaled, x.ldx, exact_rows);
    for (I64 r = s0; r < s1; r += R) {
      const uint8_t* rowp[R];
      I64 rows[R];
      for (int i = 0; i < R; ++i) {
        rows[i] = imin(r + i, s1 - 1);  // a short tile repeats its last row (not stored)
        rowp[i] = w.data + rows[i] * w.row_bytes;
      }
      const uint8_t* next = next_tile_rows(w, r, r1, R, K, ahead);
      fp8_row_tile_all_tokens<V, R, P>(w, rowp, rows, fast ? xrows : nullptr, exact_rows, M, y, ldy, r - r0,
                                       imin(R, s1 - r), next);
    }
    s0 = s1;
  }
  set_nan_rows(w, r0, r1, M, y, ldy);
}

// One-row tiles at one token take g_short_row_prefetch's level for their far prefetch; 4-row tiles keep L1, where
// L2 measured slower on Zen 4.
template <class V, WFormat F, int R>
void matmul_fp_gemv_rows(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  const bool far_level = x.m == 1 && R == 1;
  with_next_rows<V, Gemv::Float, R>(w.row_bytes, x.m, x.m * w.cols * I64{sizeof(float)}, far_level, [&](auto tag) {
    matmul_fp_gemv_tiles<V, F, R, decltype(tag)::kPolicy>(w, r0, r1, x, y, ldy);
  });
}

template <class V, WFormat F>
void matmul_fp_gemv(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  if (one_row_tiles<V, F>(x.m, w.row_bytes, false)) return matmul_fp_gemv_rows<V, F, 1>(w, r0, r1, x, y, ldy);
  if constexpr (kThreeRowGemvTiles<V>)  // not instantiated where never taken
    if (gemv_tile_rows<V, F>(x.m, w.row_bytes) == 3) return matmul_fp_gemv_rows<V, F, 3>(w, r0, r1, x, y, ldy);
  matmul_fp_gemv_rows<V, F, 4>(w, r0, r1, x, y, ldy);
}

// dst[k] = decode(src[k]) * s for k in [kb, ke) (a partial last vector through a zero-padded copy).
template <class V, WFormat F>
inline void decode_store(const uint8_t* src, float* dst, I64 kb, I64 ke, typename V::F s) {
  constexpr int W = V::W;
  constexpr I64 B = bytes_per_weight<F>();
  I64 k = kb;
  for (; k + 4 * W <= ke; k += 4 * W) {  // 4 vectors a step: measured 1.4-1.9 cycles a vector, 2.2-3.1 one at a time
    const typename V::F v0 = decode<V, F>(src + k * B), v1 = decode<V, F>(src + (k + W) * B);
    const typename V::F v2 = decode<V, F>(src + (k + 2 * W) * B), v3 = decode<V, F>(src + (k + 3 * W) * B);
    V::store(dst + k, V::mul(v0, s));
    V::store(dst + k + W, V::mul(v1, s));
    V::store(dst + k + 2 * W, V::mul(v2, s));
    V::store(dst + k + 3 * W, V::mul(v3, s));
  }
  for (; k + W <= ke; k += W) V::store(dst + k, V::mul(decode<V, F>(src + k * B), s));
  if (k < ke) {
    alignas(64) uint8_t tail[W * B];
    std::memset(tail, 0, sizeof(tail));
    std::memcpy(tail, src + k * B, static_cast<size_t>((ke - k) * B));
    V::store(dst + k, V::mul(decode<V, F>(tail), s));
  }
}

// dst[i * ld + j] = src[j][k + i] for i, j < 8: one 8 x 8 block of x^T in AVX registers (every vector table has
// them).
inline void transpose8x8(const float* const* src, I64 k, float* dst, I64 ld) {
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src[j] + k);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);  // per 128-bit lane: (a0 b0 a1 b1)
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);  // (a2 b2 a3 b3)
  }
  for (int j = 0; j < 8; j += 4) {
    r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);  // (a0 b0 c0 d0)
    r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);  // (a1 b1 c1 d1)
    r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // lanes: low halves are k + i, high halves k + 4 + i
    _mm256_storeu_ps(dst + i * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ld, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// x^T in blocks of bw tokens: xt[(b * K + k) * bw + j] = x[token b * bw + j][k] for k < K, zero for tokens past
// M. A block's steps lie one after another, so that an outer-product tile streams its x^T (bw floats a step)
// rather than striding by the whole M (which mapped every step of a chunk onto the same few L1 sets: at 512
// tokens the GEMM ran at a third of the FMA peak). By 8 x 8 blocks in registers: element by element it took a
// tenth of a 512-row task's time at 512 tokens.
inline void transpose_tokens(const float* const* xrows, I64 M, I64 K, float* xt, I64 bw) {
  for (I64 b = 0; b * bw < M; ++b) {
    float* block = xt + b * K * bw;
    const I64 m0 = b * bw, tokens = imin(bw, M - m0), whole = tokens / 8 * 8, k8 = K / 8 * 8;
    for (I64 j = 0; j < whole; j += 8) {
      for (I64 k = 0; k < k8; k += 8) transpose8x8(xrows + m0 + j, k, block + k * bw + j, bw);
      for (I64 k = k8; k < K; ++k)
        for (I64 i = j; i < j + 8; ++i) block[k * bw + i] = xrows[m0 + i][k];
    }
    for (I64 k = 0; k < K; ++k) {
      for (I64 j = whole; j < tokens; ++j) block[k * bw + j] = xrows[m0 + j][k];
      for (I64 j = tokens; j < bw; ++j) block[k * bw + j] = 0.0f;
    }
  }
}

// Outer-product register tile: out[i][j] = sum over k < n of panel[i][k] * xt[k][j] for MR rows and NV * W
// tokens (carry: added to what out holds, the earlier chunks' sums); each step broadcasts MR weights and loads NV
// token vectors for MR * NV FMAs (no horizontal sums).
// Not inlined: its 12 accumulators need every vector register, which the caller's live values would take.
template <class V, int MR, int NV>
__attribute__((noinline)) void outer_tile(const float* panel, I64 panel_ld, const float* xt, I64 xt_ld, I64 n,
                       float (&out)[MR][NV * V::W], bool carry) {
  constexpr int W = V::W;
  typename V::F acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = carry ? V::load(out[i] + v * W) : V::zero();
  for (I64 k = 0; k < n; ++k) {
    typename V::F xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = V::load(xt + k * xt_ld + v * W);
    for (int i = 0; i < MR; ++i) {
      const typename V::F b = V::set1(panel[i * panel_ld + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(b, xv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) V::store(out[i] + v * W, acc[i][v]);
}

// y[(m0 + j) * ldy + row0 + i] = out[i][j] for the tile's valid rows and tokens.
template <int MR, int NT>
inline void store_outer(float* y, I64 ldy, I64 m0, I64 tokens, I64 row0, I64 valid_rows, const float (&out)[MR][NT]) {
  for (I64 j = 0; j < tokens; ++j) {
    float* dst = y + (m0 + j) * ldy + row0;
    for (int i = 0; i < MR && i < valid_rows; ++i) dst[i] = out[i][j];
  }
}

// Where a panel tile's outer-product sums go: kept in sums (8 rows x ld floats, the tile's own) from chunk to
// chunk (first: the tile's first chunk), in registers within one, and stored into y once, after the last chunk
// (last): y is written once per tile rather than read and written for every 256 columns.
struct OuterSums {
  float* sums;
  bool first, last;
};

// x^T of one K chunk as transpose_chunk lays it out: the chunk's first step of token block 0 at `at`, block b at
// at + b * stride, bw tokens a step.
struct XtBlocks {
  const float* at;
  I64 bw, stride;
  const float* block(I64 m0) const { return at + m0 / bw * stride; }
};

// One block of up to NV * W tokens of an outer-product tile (rows from row0, tokens from m0: a block of xt), per
// `to`.
template <class V, int MR, int NV>
inline void outer_block(const float* tile, I64 tile_ld, XtBlocks xt, I64 n, float* y, I64 ldy,
                        I64 m0, I64 tokens, I64 row0, I64 valid, OuterSums to, float* sums_at) {
  using Out = float[MR][NV * V::W];
  Out& out = *reinterpret_cast<Out*>(sums_at);
  outer_tile<V, MR, NV>(tile, tile_ld, xt.block(m0), xt.bw, n, out, !to.first);
  if (to.last) store_outer<MR, NV * V::W>(y, ldy, m0, tokens, row0, valid, out);
}

// Tokens of a GEMM panel's M that go through dot_block rather than the outer-product blocks of up to 3 vectors
// of W tokens: the last block's tokens where they are at most kMaxDotTokens (they would fill a one-vector
// block alone), or 1-3 past two vectors (the 3-vector block becomes a 2-vector one); never so that a one-vector
// block is left (each measured slower than the padded block it would replace).
constexpr I64 kMaxDotTokens = 5;
inline I64 dot_block_tokens(I64 M, I64 W) {
  if (M <= W) return 0;
  const I64 rest = M % (3 * W);
  if (rest <= kMaxDotTokens) return rest;
  return rest > 2 * W && rest - 2 * W <= 3 ? rest - 2 * W : 0;
}

// The last few tokens (dot_block_tokens) of a GEMM panel's 4-row half, [m0, m0 + tokens), by the GEMV's
// dot-product tile over the decoded rows (vectors along K; xrows: the tokens' activations), stored into y (first)
// or added: in an outer-product tile they would fill a whole vector of tokens, mostly padding.
template <class V>
inline void dot_block(const float* half, I64 tile_ld, const float* const* xrows, I64 k0, I64 n, I64 m0, I64 tokens,
                      float* y, I64 ldy, I64 row0, I64 valid, bool first) {
  const uint8_t* rowp[4];
  for (int i = 0; i < 4; ++i) rowp[i] = reinterpret_cast<const uint8_t*>(half + i * tile_ld);
  const float* xr[kMaxDotTokens];
  for (I64 j = 0; j < tokens; ++j) xr[j] = xrows[m0 + j] + k0;
  for_each_token_tile<4>(tokens, [&](auto tile, I64 m) HM_TILE_LAMBDA {
    constexpr int MT = decltype(tile)::kTokens;
    float out[4][MT];
    fp_tile<V, WFormat::F32, 4, MT, NextRows::LinearL1>(rowp, n, xr + m, out, nullptr);
    store_tile<4, MT>(y, ldy, m0 + m, row0, valid, first, out);
  });
}

constexpr int kOuterRows = 4;        // rows per outer-product tile (4 rows x 3 vectors of tokens = 12 accumulators)
constexpr int kPanelRows = 8;        // rows decoded per panel: one 8 x 1-vector tile, or two 4-row halves
constexpr I64 kOuterChunkK = 256;    // K per chunk: the tile's panel stays in L1
constexpr I64 kXtBytes = 2 << 20;     // x^T of a block of tokens over the whole K (within L3)

// One panel tile of the GEMM path: rows [r, r + valid) of W over K chunk [k0, k0 + n), decoded once (scales
// applied) into a float32 panel (float32 weights are read in place), times x^T of the chunk (xt) as outer
// products, into y or the tile's running sums (OuterSums: m_ld floats a row). prefetch: the chunk to fetch
// meanwhile (nullptr: none), `prefetch_rows` rows of w.row_bytes stride, n * B bytes each.
template <class V, WFormat F>
inline void panel_tile(const Matrix& w, I64 r, I64 valid, I64 k0, I64 n, float* panel, I64 panel_ld, XtBlocks xt,
                       I64 m_ld, const float* const* xrows, I64 M, float* y, I64 ldy, I64 row0, OuterSums to,
                       const uint8_t* prefetch, I64 prefetch_rows) {
  constexpr int W = V::W, MR = kPanelRows;
  constexpr I64 B = bytes_per_weight<F>();
  for (I64 i = 0; prefetch && i < prefetch_rows; ++i)
    for (I64 off = 0; off < n * B; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * w.row_bytes + off), _MM_HINT_T0);
  const float* tile = panel;
  I64 tile_ld = panel_ld;
  if constexpr (F == WFormat::F32) {
    tile = reinterpret_cast<const float*>(w.data + r * w.row_bytes) + k0;
    tile_ld = w.row_bytes / 4;
    if (valid < MR) {  // a short tile: its rows copied, the last repeated, so that no row past r1 is read
      for (int i = 0; i < MR; ++i)
        std::memcpy(panel + i * panel_ld, tile + imin(i, valid - 1) * tile_ld, static_cast<size_t>(n) * 4);
      tile = panel;
      tile_ld = panel_ld;
    }
  } else {
    // fp8: the scale row block and column block of the chunk, tracked without divisions in the loop
    I64 row_block = 0, next_block_row = 0, first_col_block = 0;
    if constexpr (F == WFormat::FP8) {
      row_block = r / w.block_rows;
      next_block_row = (row_block + 1) * w.block_rows;
      first_col_block = k0 / w.block_cols;
    }
    for (int i = 0; i < MR; ++i) {
      const I64 ri = r + imin(i, valid - 1);  // a short tile repeats its last row (not stored)
      const uint8_t* src = w.data + ri * w.row_bytes + k0 * B;
      float* dst = panel + i * panel_ld;
      if constexpr (F == WFormat::FP8) {
        for (; ri >= next_block_row; next_block_row += w.block_rows) ++row_block;
        const float* srow = static_cast<const float*>(w.scales) + row_block * w.scale_stride;
        for (I64 kb = 0, cb = first_col_block; kb < n; kb += w.block_cols, ++cb) {
          if (block_has_subnormal(w, ri, cb))
            decode_store<V, F>(src, dst, kb, imin(n, kb + w.block_cols), V::set1(srow[cb] * 0x1p8f));
          else
            decode_store<V, kFp8Normal>(src, dst, kb, imin(n, kb + w.block_cols), V::set1(srow[cb] * 0x1p120f));
        }
      } else {
        decode_store<V, F>(src, dst, 0, n, V::set1(1.0f));
      }
    }
  }
  if (M <= W) {  // one vector of tokens: all 8 rows in one tile, so that 8 FMA chains are in flight
    outer_block<V, MR, 1>(tile, tile_ld, xt, n, y, ldy, 0, M, row0, valid, to, to.sums);
    return;
  }
  // the last few tokens past whole vectors by dot products (dot_block_tokens), the others in blocks of 3 vectors
  // (the last one as few vectors as it needs)
  const I64 dot_tokens = dot_block_tokens(M, W), outer_tokens = M - dot_tokens;
  for (int h = 0; h < MR && h < valid; h += kOuterRows) {  // two 4-row halves
    const float* half = tile + h * tile_ld;
    const I64 hvalid = imin(kOuterRows, valid - h);
    if (dot_tokens)
      dot_block<V>(half, tile_ld, xrows, k0, n, outer_tokens, dot_tokens, y, ldy, row0 + h, hvalid, to.first);
    for (I64 m0 = 0; m0 < outer_tokens; m0 += 3 * W) {
      const I64 tokens = imin(3 * W, outer_tokens - m0);
      float* sums_at = to.sums + h * m_ld + m0 * kOuterRows;  // the block's [4][<= 3W]
      if (tokens > 2 * W)
        outer_block<V, kOuterRows, 3>(half, tile_ld, xt, n, y, ldy, m0, tokens, row0 + h, hvalid, to, sums_at);
      else if (tokens > W)
        outer_block<V, kOuterRows, 2>(half, tile_ld, xt, n, y, ldy, m0, tokens, row0 + h, hvalid, to, sums_at);
      else
        outer_block<V, kOuterRows, 1>(half, tile_ld, xt, n, y, ldy, m0, tokens, row0 + h, hvalid, to, sums_at);
    }
  }
}

// GEMM path: the tokens in blocks whose x^T over the whole K fits kXtBytes (whole outer-product blocks of 3W
// tokens), each transposed once; per token block, tiles of 8 rows run over all their K chunks before the next
// tile (the weights stream row after row, the chunk after next prefetched), the tile's sums carried across
// chunks in a buffer and written to y once.
template <class V, WFormat F>
void matmul_fp_gemm(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  constexpr int W = V::W, MR = kPanelRows;
  constexpr I64 B = bytes_per_weight<F>();
  const I64 K = w.cols, M = x.m;
  const I64 bc = F == WFormat::FP8 ? w.block_cols : kOuterChunkK;
  const I64 kc = bc * imax(1, kOuterChunkK / bc);
  const I64 panel_ld = (kc + W - 1) / W * W;
    const I64 block_tokens = imax(1, kXtBytes / (K * 4 * 3 * W)) * 3 * W;
  const I64 mb = imin(M, block_tokens);
  // per block: m_ld its tokens padded to whole vectors, bw x^T's blocks (one outer-product tile's tokens, up to 3W),
  // xt_ld its tokens padded to whole x^T blocks
  const I64 mb_ld = (mb + W - 1) / W * W, bw = imin(3 * W, mb_ld), xt_ld = (mb + bw - 1) / bw * bw;
  float* panel = scratch_floats(MR * panel_ld + K * xt_ld + MR * mb_ld);
  float* xt = panel + MR * panel_ld;
  float* sums = xt + K * xt_ld;  // a tile's outer-product sums across its chunks
  const float** xrows = scratch_pointers(M);
  for (I64 m = 0; m < M; ++m) xrows[m] = x_row(x, m);
  const bool prefetch = F != WFormat::F32;
  for (I64 b0 = 0; b0 < M; b0 += mb) {
    const I64 mn = imin(mb, M - b0), m_ld = (mn + W - 1) / W * W;
    transpose_tokens(xrows + b0, mn, K, xt, bw);
    for (I64 r = r0; r < r1; r += MR) {
      const I64 valid = imin(MR, r1 - r);
      for (I64 k0 = 0; k0 < K; k0 += kc) {
        // the chunk after next (whole chunks only): of these rows, or of the next tile's
        I64 pr = r, pk = k0 + 2 * kc;
        if (pk >= K) pr += MR, pk -= (K + kc - 1) / kc * kc;
        const bool ahead = prefetch && pr < r1 && pk + kc <= K;
        panel_tile<V, F>(w, r, valid, k0, imin(kc, K - k0), panel, panel_ld, XtBlocks{xt + k0 * bw, bw, K * bw}, m_ld,
                         xrows + b0, mn, y + b0 * ldy, ldy, r - r0, OuterSums{sums, k0 == 0, k0 + kc >= K},
                         ahead ? w.data + pr * w.row_bytes + pk * B : nullptr, imin(MR, r1 - pr));
      }
    }
  }
  if constexpr (F == WFormat::FP8) set_nan_rows(w, r0, r1, M, y, ldy);
}

}  // namespace
}  // namespace hm
