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
// budget, GCC 12 stopped inlining the fp8 column-range lambda of the bf16 dot-product tile once more tile shapes
// were instantiated, and the accumulators then went through memory on every step (0.4-0.6x measured).
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
// (short rows) or L2; or (float GEMV, long rows) R streams, each of the next rows at this tile's position, into
// L2. Measured 2026-11-30 on Zen 4 (one thread, rows from memory, old and new code in one process, GB/s of
// weights at one token): linear -> R streams, both into L1, DeepSeek-V3's 7 KB fp8 rows 12.4 -> 16.9 and 14 KB
// bf16 rows 14.7 -> 18.2, but Qwen3's 2 KB fp8 / 4 KB bf16 rows 20.3 -> 11.8 / 22.7 -> 16.7; then into L2
// rather than L1: 7 KB fp8 streams 15.2 -> 19.0, and this policy against the one before it 1.1-1.4x at one token
// and 1.3-1.85x at two for rows of 3.5-14 KB (fp8, bf16, int4, int8), while linear into L2 read 2 KB fp8 and 1 KB
// int4 rows at 0.84-0.98x and 0.68-0.75x (their next tile's lines must be in L1 when it starts).
// The Twice policies go with the L2 level of short rows' far prefetch (g_short_row_prefetch, hm_types.h; AMD Zen 4):
// LinearL2Twice (short rows' far prefetch) and StreamsL2Twice (one-row tiles of long rows) prefetch each line again
// kPrefetchAgainBytes further ahead, so that every line is asked for twice, first from about twice as far. On Zen 4
// (2026-12-04, session 35) one thread streaming 2 KB fp8 rows from memory on huge pages at one token (a standalone
// loop of the kernels' arithmetic, medians of 9 rounds) read 0.82-0.90 of a plain read with one prefetch 8 KB ahead
// (0.80-0.85 with it 12 or 16 KB ahead, 0.91-0.93 asking for each line twice at 8 KB) and 0.96-1.05 asking at 8 and
// again at 12-24 KB; two threads 0.85 against 1.00-1.01 with the plain read at 50 GB/s. The MoE (2 threads, the
// policies and the former ones alternating in one process, medians of 6-14 rounds): Qwen3-30B-A3B T = 1 fp8
// 1.04-1.08x (1.07x with the probe at 25-69 GB/s: 44.0 -> 47.1 GB/s of weights), int4 1.03-1.10x, int8 1.03-1.09x,
// bf16 1.01-1.03x, T = 4 1.00-1.06x; DeepSeek-V3 T = 1 fp8 1.07x, int4 1.04x, int8 1.02x, bf16 1.06x, T = 4
// 1.02-1.08x (0.99-1.03x with LinearL2Twice alone). One 2048 x 7168 fp8 matrix (7 KB rows) at two tokens: 1.32x on
// one thread, 1.16x on two.
enum class NextRows { LinearL1, LinearL2, StreamsL2, LinearL2Twice, StreamsL2Twice };

constexpr I64 kPrefetchL2MinBytes = 3 << 10;  // rows from which the next tile goes to L2 rather than L1
constexpr I64 kRowStreamMinBytes = 4 << 10;   // rows from which the float GEMV prefetches R streams
// With several tokens, short rows' next tile also goes to L2 once the tokens' activations (bytes the tiles read
// again for every row tile) and this tile's and the next tile's rows exceed this much of L1: prefetched into L1
// they evicted the activations. Measured 2026-11-30 (Zen 4, one thread, rows from memory, benchmarks/gemv_ab.sh,
// into L2 / into L1): fp8 2 KB rows 1.07-1.57x at 2-16 tokens with bf16 dot products (bf16 activations), 1.08-1.25x
// at 2-12 tokens in the float32 GEMV; bf16 1.5 KB rows 1.05-2.01x at 2-16 tokens; below the bound L1 stayed
// ahead (fp8 0.75 KB rows: 0.66-0.89x at 2-6 tokens with bf16 dot products, 0.68x at 2 in the float32 GEMV; at
// one token, where the policy above was measured, fp8 2 KB rows 0.95x). The AVX2 tables, with half the
// arithmetic per instruction, lost at 2-3 tokens (bf16 1.5 KB rows 0.91-0.97x, int8 2 KB rows 0.92-0.94x) and
// gained from 4 in the float GEMVs (bf16 1.23-1.43x, fp8 2 KB rows 1.14-1.16x), not in the int GEMV (int8
// 0.91-1.00x at 4-8 tokens): there the rule starts at 4 tokens, and the int GEMV keeps L1.
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
      if constexpr (R == 1)
        if (l2) return fn(NextRowsTag<NextRows::StreamsL2Twice>{});
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
  if constexpr (P != NextRows::StreamsL2 && P != NextRows::StreamsL2Twice) {
    for (I64 off = 0; off < R * kStepBytes; off += 64) line(next + R * pos + off);
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
// Measured 2026-12-03 on Zen 5 (benchmarks/gemv_ab.sh, one thread, rows from memory, against the next tile; one token
// unless said): int4 2048 x 768 (groups of 32, 384 B rows) 1.36-1.49x, groups of 128 1.16x; int4 768 x 2048 (1 KB rows)
// 1.10x; int8 768 B rows 1.13-1.18x; fp8 768 B rows with bf16 dot products 1.09-1.22x, 1.06-1.24x at 2-8 tokens; 4 KB
// ahead gave int4 384 B rows 1.18x, 16 KB 1.43x, fp8 768 B rows 1.15x, 32 KB less. Where the tile's arithmetic limits
// it, reaching ahead did not pay (int at 4-8 tokens 0.91-0.96x, fp8 at 4 tokens in the AVX2 float32 GEMV 0.85x), but
// the AVX-512 int lane tiles reach ahead whenever one token tile covers the tokens (2-3 tokens int4, 2-4 int8;
// 2026-12-03, from memory: int4 g32 2048 x 768 1.33-1.35x, 768 x 2048 1.12-1.16x, g128 2048 x 768 1.37x; int8 g32
// 1.02-1.16x; in L2 0.93-0.99x; the MoE at T = 4 and 32, where most experts have 1-2 tokens, 0.98-1.08x); one-row tiles
// of 4 KB rows read 0.95x with the row after next. The MoE at Qwen3-30B-A3B shapes (2 threads, both ways alternating in
// one process, medians of 6 rounds): fp8 1.04x at T = 1, 1.05x at T = 4; int4 1.06x / 1.04x; int8 1.06x at T = 1; bf16
// (1.5 KB down rows, float32 GEMV) 0.99-1.02x.
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
// as one sequential stream, about as fast as a plain read; four rows read at once (four streams, even with the
// next tile prefetched) do not keep up on Zen 5 (one thread, 400 MB read-only: 4 rows 0.63-0.79 of the plain
// read), and with so few tokens the tile's arithmetic is not what limits it. Where it is, the one-row tile loses:
// shorter rows (its fixed cost per row: horizontal sums, stores, the fp8 column-range setup), bf16 at two tokens,
// fp8 in the float32 GEMV at two tokens or under 3 KB (its decode costs 3 operations a vector) and on AVX2 (half
// the arithmetic per instruction). Rows under 3 KB need the prefetch that reaches ahead (kPrefetchAheadBytes): with
// the next row only, one-row tiles of 2 KB fp8 rows read 0.93-0.96x. Measured 2026-12-03 on Zen 5: "One-row GEMV
// tiles, measured" in docs/kernels-measured.md.
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
// decoded weight vector serves a whole tile). Against MaxMT-token tiles and a remainder (6 + 2, 6 + 6 + 1),
// one thread, 7-16 tokens: 1.00-1.10x (measured 0.88-0.96x before the tile helpers were forced inline).
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
// Measured on Zen 5 (session 27): one thread, fp8 128 x 2048 at 16 tokens with bf16 dot products 1.10x in L2,
// 1.27x from memory; the MoE at T = 256 (2 threads, medians of 5-6 rounds): Qwen3 fp8 1.09x, bf16 1.04x, int8
// 1.15x (rounds 0.68-1.45), int4 1.02x; DeepSeek-V3 (8 tokens an expert, 4 + 4) fp8 1.04x, int8 1.05x, int4 1.01x,
// bf16 0.98x.
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
