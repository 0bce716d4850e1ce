// Shared pieces of the vectorised kernels (kernels_simd.h): fp8 decode variants, weight decoding, per-thread
// scratch buffers. Internal linkage, no std:: templates (see kernels_simd.h).
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "hm_types.h"

namespace hm {
namespace {

using I64 = int64_t;

inline I64 imin(I64 a, I64 b) { return a < b ? a : b; }
inline I64 imax(I64 a, I64 b) { return a > b ? a : b; }

// The helpers a register tile runs through (decode, accumulate, the tile and its column-range and token-tile
// lambdas) are always inlined, so that the tile's accumulator array stays in registers: left to its inlining
// budget, GCC 12 kept the accumulators in memory and the tiles ran at about half speed.
#define HM_TILE_INLINE inline __attribute__((always_inline))
#define HM_TILE_LAMBDA __attribute__((always_inline))
#define HM_UNROLL _Pragma("GCC unroll 32")  // loops over a tile's accumulators: constant indices only

constexpr I64 kGemmChunkK = 1024;  // K elements per chunk of the int GEMM path (the tokens' activations stay in L2)

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
HM_TILE_INLINE typename V::F decode(const uint8_t* p) {
  if constexpr (F == WFormat::F32) return V::load(reinterpret_cast<const float*>(p));
  else if constexpr (F == WFormat::BF16) return V::load_bf16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == WFormat::F16) return V::load_f16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == kFp8Normal) return V::load_fp8_normal(p);
  else return V::load_fp8(p);
}

// How a GEMV tile prefetches the next tile's R rows (back to back, stride bytes each) while it reads its own, by
// row length (with_next_rows): one linear stream over the R rows, R times as fast as a row is read, into L1
// (short rows, whose next tile's lines must be in L1 when it starts) or L2; or (float GEMV, long rows) R streams,
// each of the next rows at this tile's position, into L2 (long rows would otherwise restart the hardware
// prefetchers at every row). The Twice policies go with the L2 level of short rows' far prefetch
// (g_short_row_prefetch, hm_types.h; AVX-512 CPUs): LinearL2Twice (short rows' far prefetch) and StreamsL2Twice
// (one-row tiles of long rows) prefetch each line again kPrefetchAgainBytes further ahead, so that every line is
// asked for twice, first from about twice as far; with one prefetch a line one Zen 4 thread fell short of a plain
// read (docs/kernels.md, "Prefetch").
// None: no software prefetch (one-row tiles of long rows where g_long_row_prefetch is Off, hm_types.h).
enum class NextRows { LinearL1, LinearL2, StreamsL2, LinearL2Twice, StreamsL2Twice, None };

constexpr I64 kPrefetchL2MinBytes = 3 << 10;  // rows from which the next tile goes to L2 rather than L1
constexpr I64 kRowStreamMinBytes = 4 << 10;   // rows from which the float GEMV prefetches R streams
// With several tokens, short rows' next tile also goes to L2 once the tokens' activations (bytes the tiles read
// again for every row tile) and this tile's and the next tile's rows exceed this much of L1: prefetched into L1
// they evicted the activations. The AVX2 tables, with half the arithmetic per instruction, gain from it only from
// 4 tokens and not in the int GEMV, which keeps L1 there (l2_prefetch_min_tokens).
constexpr I64 kL1PrefetchMaxBytes = 16 << 10;

// The GEMV a prefetch policy is for: the float ones (float32 activations, bf16 dot products) or the int one.
enum class Gemv { Float, Int };

// Tokens from which the activations of vocabulary V's GEMV G count against kL1PrefetchMaxBytes (none: INT64_MAX).
template <class V, Gemv G>
constexpr I64 l2_prefetch_min_tokens() {
  return V::W >= 16 ? 2 : G == Gemv::Float ? 4 : INT64_MAX;
}

template <NextRows P>
struct NextRowsTag {
  static constexpr NextRows kPolicy = P;
};

// fn(NextRowsTag<P>{}) with the policy P for GEMV G's tiles of R rows of row_bytes, read by vocabulary V against
// `tokens` tokens whose activations take activation_bytes (R streams: float GEMVs only). far: the tiles prefetch rows
// that far ahead (prefetch_ahead_rows), and short ones then go to g_short_row_prefetch's level (hm_types.h).
template <class V, Gemv G, int R, class Fn>
inline void with_next_rows(I64 row_bytes, I64 tokens, I64 activation_bytes, bool far, Fn&& fn) {
  const bool l2 = g_short_row_prefetch.load(std::memory_order_relaxed) == PrefetchLevel::L2;
  if constexpr (G == Gemv::Float) {
    if (row_bytes >= kRowStreamMinBytes) {
      if constexpr (R == 1) {
        if (g_long_row_prefetch.load(std::memory_order_relaxed) == Toggle::Off)
          return fn(NextRowsTag<NextRows::None>{});
        if (l2) return fn(NextRowsTag<NextRows::StreamsL2Twice>{});
      }
      return fn(NextRowsTag<NextRows::StreamsL2>{});
    }
  }
  const bool evicts =
      tokens >= l2_prefetch_min_tokens<V, G>() && activation_bytes + 2 * R * row_bytes > kL1PrefetchMaxBytes;
  if (far && l2 && row_bytes < kPrefetchL2MinBytes) return fn(NextRowsTag<NextRows::LinearL2Twice>{});
  if (row_bytes >= kPrefetchL2MinBytes || evicts) return fn(NextRowsTag<NextRows::LinearL2>{});
  fn(NextRowsTag<NextRows::LinearL1>{});
}

constexpr I64 kPrefetchAgainBytes = 8 << 10;  // the Twice policies' first prefetch, beyond their second

// The next tile's prefetch at byte `pos` of this tile's rows, which it reads kStepBytes a step (see NextRows).
template <NextRows P, int R, I64 kStepBytes>
HM_TILE_INLINE void prefetch_next(const uint8_t* next, I64 stride, I64 pos) {
  constexpr _mm_hint kHint = P == NextRows::LinearL1 ? _MM_HINT_T0 : _MM_HINT_T1;
  constexpr bool kTwice = P == NextRows::LinearL2Twice || P == NextRows::StreamsL2Twice;
  const auto line = [](const uint8_t* p) HM_TILE_LAMBDA {
    _mm_prefetch(reinterpret_cast<const char*>(p), kHint);
    if constexpr (kTwice) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAgainBytes), kHint);
  };
  if constexpr (P == NextRows::None) {
    return;
  } else if constexpr (P != NextRows::StreamsL2 && P != NextRows::StreamsL2Twice) {
    if constexpr (R * kStepBytes >= 64) {
      for (I64 off = 0; off < R * kStepBytes; off += 64) line(next + R * pos + off);
    } else if (static_cast<uint64_t>(R * pos) % 64 < static_cast<uint64_t>(R * kStepBytes)) {  // a new line
      line(next + R * pos);
    }
  } else if constexpr (kStepBytes >= 64) {
    for (int i = 0; i < R; ++i)
      for (I64 off = 0; off < kStepBytes; off += 64) line(next + i * stride + pos + off);
  } else if (static_cast<uint64_t>(pos) % 64 < static_cast<uint64_t>(kStepBytes)) {  // a new line of each row
    // (unsigned: GCC 12 emitted no prefetch at all for the signed `(pos & 63) < kStepBytes` in the fp8 GEMV)
    for (int i = 0; i < R; ++i) line(next + i * stride + pos);
  }
}

// Bytes of rows between a GEMV tile and the tile it prefetches, for rows under kPrefetchL2MinBytes where the prefetch
// reaches ahead (`far`: one token in every GEMV, one token tile in the AVX-512 int lane tiles, any tokens in the bf16
// dot-product GEMV): the tile that starts this many bytes of rows later (at least the next one). Short rows' next tile
// is too near for its lines to arrive in time: 4 rows of 384-768 bytes are read in 50-100 ns, about one memory latency.
// Where the tile's arithmetic, not memory, is the limit (the int GEMV at several tokens), reaching ahead does not pay.
constexpr I64 kPrefetchAheadBytes = 8 << 10;

// Rows from a tile of R rows to the first row of the tile it prefetches (see kPrefetchAheadBytes).
inline I64 prefetch_ahead_rows(const Matrix& w, I64 R, bool far) {
  return far && w.row_bytes < kPrefetchL2MinBytes ? imax(1, kPrefetchAheadBytes / (R * w.row_bytes)) * R : R;
}

// The R rows of the tile `ahead` rows after the tile starting at row r (prefetch_ahead_rows, taken once per call),
// to prefetch while the tile is read, or nullptr: only when they lie within the task's rows [.., r1) and are
// stored back to back (row_bytes == row_read_bytes, the bytes a tile reads per row), since the prefetches take
// them as R back-to-back rows.
inline const uint8_t* next_tile_rows(const Matrix& w, I64 r, I64 r1, I64 R, I64 row_read_bytes, I64 ahead) {
  return r + ahead + R <= r1 && w.row_bytes == row_read_bytes ? w.data + (r + ahead) * w.row_bytes : nullptr;
}

// GEMV tiles of one row rather than 4 (or 3) for one token against rows of kOneRowTileMinBytes and more (float
// formats: the float32 GEMV and the bf16 dot-product GEMV); fp8 with bf16 dot products from twice that, at one or
// two tokens; fp8 in the float32 GEMV from three times that, on AVX-512 only. One row at a time reads the matrix
// as one sequential stream, about as fast as a plain read, where four rows read at once do not keep up; where the
// tile's arithmetic is the limit (shorter rows, fp8's float32 decode, AVX2) 4-row tiles stay ahead. Rows under
// 3 KB need the prefetch that reaches ahead (kPrefetchAheadBytes). docs/kernels.md, "GEMV path".
constexpr I64 kOneRowTileMinBytes = 1 << 10;

// Whether vocabulary V's GEMV (bf16_dot: the bf16 dot-product GEMV, else the float32 one) of `tokens` tokens
// over rows of row_bytes in format F takes one-row tiles.
template <class V, WFormat F>
inline bool one_row_tiles(I64 tokens, I64 row_bytes, bool bf16_dot) {
  if (F != WFormat::FP8) return tokens == 1 && row_bytes >= kOneRowTileMinBytes;
  if (bf16_dot) return tokens <= 2 && row_bytes >= 2 * kOneRowTileMinBytes;
  return tokens == 1 && V::W >= 16 && row_bytes >= 3 * kOneRowTileMinBytes;
}

// A register tile's token count, as a type (the token-tile helpers pass it to their callbacks).
template <int MT>
struct TokenTile {
  static constexpr int kTokens = MT;
};

// fn(TokenTile<n>{}, m) for n = the first of MT, MT - 1, ..., 1 that equals `tokens`.
template <int MT, class Fn>
HM_TILE_INLINE void token_tile_of(I64 tokens, I64 m, Fn& fn) {
  if constexpr (MT == 1) {
    fn(TokenTile<1>{}, m);
  } else {
    if (tokens == MT) fn(TokenTile<MT>{}, m);
    else token_tile_of<MT - 1>(tokens, m, fn);
  }
}

// As few token tiles of up to MaxMT tokens as cover M tokens, of balanced sizes (8 = 4 + 4, 13 = 5 + 4 + 4; each
// decoded weight vector serves a whole tile, and no tile is left nearly empty).
// reverse: the same tiles last to first. Row tiles alternate the order (serpentine_reverse), so that the token tile
// a row tile ends with, whose activations are freshest in L1, is the one the next row tile starts with.
// fn(TokenTile<n>{}, m, first): first for the tile visited first (the one that prefetches the next row tile).
template <int MaxMT, class Fn>
HM_TILE_INLINE void for_each_token_tile_upto(I64 M, Fn&& fn, bool reverse) {
  const I64 tiles = (M + MaxMT - 1) / MaxMT, base = M / tiles, extra = M % tiles;
  for (I64 i = 0; i < tiles; ++i) {
    const I64 t = reverse ? tiles - 1 - i : i;
    auto visit = [&](auto tile, I64 m) HM_TILE_LAMBDA { fn(tile, m, i == 0); };
    token_tile_of<MaxMT>(base + (t < extra), t * base + imin(t, extra), visit);
  }
}

// Whether the row tile starting `tile_row` rows into a run of row tiles of R rows walks its token tiles in reverse
// (for_each_token_tile_upto): every other one. With several token tiles the activations of all of them do not
// stay in L1 from one row tile to the next (Qwen3-30B-A3B gate/up rows, 16 tokens: 6 + 5 + 5 tiles of 4 KB bf16
// rows, 64 KB against a 48 KB L1), so walking them the same way each time read every tile's activations from L2.
template <int R>
inline bool serpentine_reverse(I64 tile_row) {
  return (tile_row / R) % 2 != 0;
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

}  // namespace
}  // namespace hm
