// AMX tiles for bf16, fp8, int4 and int8 weights (table "amx", kernels_amx.cpp; use_amx in hm_types.h says when):
// y[m, r] = sum_k x[m, k] * W[r, k] by tdpbf16ps, 16 weight rows x N tokens x 32 columns an instruction
// (N = M below 16 tokens, else 16).
//
// - A tiles (16 rows x 32 bf16): the weights, decoded to bf16 into a staging buffer (bf16: copied; fp8: value *
//   2^-120 by bit placement for column steps where no row of the tile has a subnormal code, else value * 2^-8
//   exactly, as in the bf16 dot-product GEMV; int4 / int8: code x group scale rounded to bf16, a step being one
//   group of 32 or a quarter of one of 128).
// - B tiles (16 column pairs x N tokens x 2 bf16): the tokens' activations, times the fp8 block scales of the
//   row block (and 2^104, or 2^-8 for the exact decode), rounded to bf16 and transposed pairwise once per row
//   block (segment_activations_bf16, then amx_pack_tokens). Their products are * 2^-16 either way, so both
//   decodes accumulate into one C tile; where x * s is too large for the 2^104 scaling the row block runs the
//   exact decode everywhere.
// - C tiles (16 rows x N tokens, float32): 4 row tiles x 1 token tile (up to 16 tokens: each B tile load serves
//   4 tdpbf16ps) or 2 x 2 at once; past 2 token tiles they are kept in memory between chunks of columns.
// Tokens past M are zero columns of B, rows past the row range repeat its last row; neither is stored.
//
// Legend: M tokens, K input features, N tokens per token tile, tt token tile, ks column step of 32, rt row tile.
#pragma once

#ifdef __AMX_BF16__
#include <immintrin.h>

#include <cstdlib>
#include <new>

#include "fp_convert.h"
#include "kernels_simd_bf16.h"

namespace hm {
namespace {

constexpr I64 kAmxTile = 16;        // rows of a row tile, most tokens of a token tile, column pairs of a step
constexpr I64 kAmxStep = 32;        // columns per tdpbf16ps
constexpr I64 kAmxChunkSteps = 16;  // steps decoded per chunk past 2 token tiles (512 columns; 2 row tiles: 32 KB)
constexpr I64 kAmxTileBytes = 1024;
constexpr int kAmxMaxRowTiles = 4;

struct alignas(64) AmxTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 rows x n float32), 4-5: A (16 x 32 bf16), 6-7: B (16 x n pairs of bf16).
inline void amx_configure(I64 n) {
  AmxTileConfig c = {};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = static_cast<uint16_t>(t == 4 || t == 5 ? 64 : 4 * n);
    c.rows[t] = kAmxTile;
  }
  _tile_loadconfig(&c);
}

// A per-thread 64-byte aligned buffer of at least `bytes` bytes (grows, never shrinks).
inline uint8_t* amx_scratch(I64 bytes) {
  static thread_local uint8_t* buf = nullptr;
  static thread_local I64 capacity = 0;
  if (bytes > capacity) {
    std::free(buf);
    capacity = (bytes + 4095) / 4096 * 4096;
    buf = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(capacity)));
    if (!buf) {
      capacity = 0;
      throw std::bad_alloc();
    }
  }
  return buf;
}

// r[i] = column i of the 16 x 16 matrix of 32-bit lanes whose row j was r[j].
HM_TILE_INLINE void transpose_16x16_epi32(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved (lanes 0-1, 2-3 of each 128 bits)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit part L: column 4L + c of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit parts across u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// The B tiles of M tokens' bf16 rows xr[m] (zero past K up to steps * 32 columns), n tokens a tile: tile
// (tt, ks) at pack + (tt * steps + ks) * 16 n lanes of 32 bits, lane [p][j] = columns 32 ks + 2p, 32 ks + 2p + 1
// of token n tt + j (zero for tokens past M).
inline void amx_pack_tokens(const uint16_t* const* xr, I64 M, I64 steps, I64 n, uint32_t* pack) {
  const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
  for (I64 tt = 0; tt * n < M; ++tt) {
    const I64 tokens = imin(n, M - tt * n);
    for (I64 ks = 0; ks < steps; ++ks) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j < tokens ? _mm512_loadu_si512(xr[tt * n + j] + ks * kAmxStep) : _mm512_setzero_si512();
      transpose_16x16_epi32(r);
      uint32_t* out = pack + (tt * steps + ks) * kAmxTile * n;
      for (int p = 0; p < 16; ++p) _mm512_mask_storeu_epi32(out + p * n, lanes, r[p]);
    }
  }
}

// bits[s / 64] bit s % 64: step s (columns [32 s, 32 s + 32)) covers a column block in which one of the row
// tile's rows has a subnormal fp8 code; `blocks`: subnormal_stride bytes of room for the rows' block bits ORed.
inline void amx_exact_steps(const Matrix& w, const I64* rows, I64 steps, uint8_t* blocks, uint64_t* bits) {
  const I64 stride = w.subnormal_stride, bc = w.block_cols;
  for (I64 b = 0; b < stride; ++b) blocks[b] = 0;
  for (I64 i = 0; i < kAmxTile; ++i)
    if (w.row_flags[rows[i]] & kRowHasSubnormal)
      for (I64 b = 0; b < stride; ++b) blocks[b] |= w.subnormal_blocks[rows[i] * stride + b];
  for (I64 s = 0; s < steps; s += 64) bits[s / 64] = 0;
  I64 kb = 0, block_end = bc;  // the block holding the step's first column, and that block's end
  for (I64 s = 0; s < steps; ++s) {
    const I64 k0 = s * kAmxStep, k1 = imin(w.cols, k0 + kAmxStep);
    while (block_end <= k0) ++kb, block_end += bc;
    for (I64 b = kb, end = block_end; end - bc < k1; ++b, end += bc)  // the blocks [k0, k1) touches
      if ((blocks[b >> 3] >> (b & 7)) & 1) bits[s / 64] |= uint64_t{1} << (s % 64);
  }
}

// A step of an int4 / int8 row at p (32 columns: int4 16 bytes, column j in the low nibble of byte j and j + 16
// in its high one, as q + 8) times its group scale s, rounded to bf16 (nearest even): the float64 dequantisation
// rounded, since a code of at most 8 bits times a bf16 / f16 scale is exact in float32. Columns past n are zero.
template <WFormat F>
HM_TILE_INLINE __m512i amx_int_step(const uint8_t* p, float s, I64 n) {
  __m512i lo, hi;  // columns 0-15 and 16-31 as int32
  if constexpr (F == WFormat::INT4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));  // rows are padded to whole groups
    const __m512i bytes = _mm512_cvtepu8_epi32(b), eight = _mm512_set1_epi32(8);
    lo = _mm512_sub_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), eight);
    hi = _mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), eight);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(b));
    hi = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1));
  }
  const __m512 scale = _mm512_set1_ps(s);
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), scale),
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(lo), scale));
  const __mmask32 mask = n == kAmxStep ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
  return _mm512_maskz_mov_epi16(mask, reinterpret_cast<const __m512i&>(v));
}

// Bytes of a row's first k columns in format F.
template <WFormat F>
constexpr I64 amx_col_bytes(I64 k) {
  return F == WFormat::BF16 ? 2 * k : F == WFormat::INT4 ? k / 2 : k;
}

// stage[(s * 16 + i) * 32 + c] = bf16 of W[rows[i]][32 (c0 + s) + c] for s < steps (fp8: the bit-placement
// decode, or the exact one where bit s of `exact` is set; int4 / int8: code x scale); zero past K.
// The same columns of the next chunk are prefetched (one cache line of each row a step for bf16, every other
// step for fp8 and int8 (the pipelined single steps: every step for fp8), every fourth for int4).
template <class V, WFormat F>
HM_TILE_INLINE void amx_stage(const Matrix& w, const I64* rows, I64 c0, I64 steps, uint32_t exact, uint16_t* stage) {
  constexpr I64 ahead = amx_col_bytes<F>(kAmxChunkSteps * kAmxStep);
  const I64 prefetch_end = amx_col_bytes<F>(w.cols) - ahead;  // row offsets with a next chunk
  for (I64 s = 0; s < steps; ++s) {
    const I64 k = (c0 + s) * kAmxStep, n = imin(kAmxStep, w.cols - k);
    const __mmask32 mask = n == kAmxStep ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
    const bool ex = (exact >> s) & 1;
    // a step that starts a new line of the row (fp8: every other step of this call's)
    const bool line = F == WFormat::FP8 ? (s & 1) == 0 : amx_col_bytes<F>(k) % 64 == 0;
    const bool prefetch = amx_col_bytes<F>(k) < prefetch_end && line;
    for (I64 i = 0; i < kAmxTile; ++i) {
      const uint8_t* p = w.data + rows[i] * w.row_bytes + amx_col_bytes<F>(k);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      __m512i v;
      if constexpr (F == WFormat::BF16) {
        v = _mm512_maskz_loadu_epi16(mask, p);
      } else if constexpr (F == WFormat::FP8) {
        const __m256i codes = _mm256_maskz_loadu_epi8(mask, p);
        v = ex ? V::fp8_exact_codes(codes) : V::fp8_normal_codes(codes);
      } else {
        v = amx_int_step<F>(p, int_group_scale(w, rows[i], k / w.group), n);
      }
      _mm512_store_si512(stage + (s * kAmxTile + i) * kAmxStep, v);
    }
  }
}

// acc[rt] += A[rt] . B for rt < row_tiles, one step: the row tiles' A tiles alternate between tiles 4 and 5
// (rt's C is tile rt), each against B6 (fast) or B7 (exact) as bit rt of `exact` says.
HM_TILE_INLINE void amx_step_4x1(const uint16_t* a, I64 a_stride, const uint32_t* b_fast, const uint32_t* b_exact,
                                 I64 b_stride, int row_tiles, unsigned exact) {
  const unsigned all = (1u << row_tiles) - 1;
  if ((exact & all) != all) _tile_loadd(6, b_fast, b_stride);
  if (exact & all) _tile_loadd(7, b_exact, b_stride);
  _tile_loadd(4, a, 64);
  if (exact & 1) _tile_dpbf16ps(0, 4, 7);
  else _tile_dpbf16ps(0, 4, 6);
  if (row_tiles < 2) return;
  _tile_loadd(5, a + a_stride, 64);
  if (exact & 2) _tile_dpbf16ps(1, 5, 7);
  else _tile_dpbf16ps(1, 5, 6);
  if (row_tiles < 3) return;
  _tile_loadd(4, a + 2 * a_stride, 64);
  if (exact & 4) _tile_dpbf16ps(2, 4, 7);
  else _tile_dpbf16ps(2, 4, 6);
  if (row_tiles < 4) return;
  _tile_loadd(5, a + 3 * a_stride, 64);
  if (exact & 8) _tile_dpbf16ps(3, 5, 7);
  else _tile_dpbf16ps(3, 5, 6);
}

// acc[rt][j] += A[rt] . B[j] for rt < row_tiles, j < 1 + two, one step: C[rt][j] is tile 2 rt + j, A[rt] tile
// 4 + rt, B[j] tile 6 + j; b(exact, j) gives token tile j's B tile, fast or exact as bit rt of `exact` says.
template <class BTile>
HM_TILE_INLINE void amx_step_2x2(const uint16_t* a, I64 a_stride, BTile&& b, I64 b_stride, int row_tiles, bool two,
                                 unsigned exact) {
  const bool e0 = exact & 1, e1 = (exact >> 1) & 1;
  _tile_loadd(4, a, 64);
  _tile_loadd(6, b(e0, 0), b_stride);
  if (two) _tile_loadd(7, b(e0, 1), b_stride);
  _tile_dpbf16ps(0, 4, 6);
  if (two) _tile_dpbf16ps(1, 4, 7);
  if (row_tiles < 2) return;
  _tile_loadd(5, a + a_stride, 64);
  if (e1 != e0) {
    _tile_loadd(6, b(e1, 0), b_stride);
    if (two) _tile_loadd(7, b(e1, 1), b_stride);
  }
  _tile_dpbf16ps(2, 5, 6);
  if (two) _tile_dpbf16ps(3, 5, 7);
}

// Rows [r, r + 16 * row_tiles) of one row block (rows past `last` repeat it) against the packed tokens (n a token
// tile), all K: out[(rt * token_tiles + tt) * 256 + i * 16 + j] = the sum for row 16 rt + i and token n tt + j.
// One token tile: 4 row tiles; more: 2. Up to 2 token tiles (C in tiles throughout): one step at a time, the next
// step decoded into the other half of `stage` before this one is multiplied, so that the decode's loads overlap
// the tile instructions (and a tile load never waits for the stores just made). More: chunks of kAmxChunkSteps,
// each decoded once for all token tiles, C kept in `out` between chunks. step_bits: room for amx_exact_steps'
// bits and blocks of 4 row tiles.
template <class V, WFormat F>
void amx_row_group(const Matrix& w, I64 r, I64 last, int row_tiles, I64 token_tiles, I64 n, const uint32_t* pack_fast,
                   const uint32_t* pack_exact, bool fast, uint16_t* stage, float* out, uint64_t* step_bits) {
  const I64 steps = (w.cols + kAmxStep - 1) / kAmxStep, words = (steps + 63) / 64;
  I64 rows[kAmxMaxRowTiles][kAmxTile];
  bool subnormal[kAmxMaxRowTiles] = {};
  for (int rt = 0; rt < row_tiles; ++rt)
    for (I64 i = 0; i < kAmxTile; ++i) {
      rows[rt][i] = imin(r + rt * kAmxTile + i, last);
      if constexpr (F == WFormat::FP8) subnormal[rt] |= (w.row_flags[rows[rt][i]] & kRowHasSubnormal) != 0;
    }
  uint8_t* blocks = reinterpret_cast<uint8_t*>(step_bits + kAmxMaxRowTiles * words);
  for (int rt = 0; rt < row_tiles; ++rt)
    if (F == WFormat::FP8 && fast && subnormal[rt]) amx_exact_steps(w, rows[rt], steps, blocks, step_bits + rt * words);
  // bit s: step c0 + s of row tile rt takes the exact decode (against pack_exact)
  auto exact_bits = [&](int rt, I64 c0) -> uint32_t {
    if (F != WFormat::FP8) return 0u;
    if (!fast) return ~0u;
    return subnormal[rt] ? static_cast<uint32_t>((step_bits[rt * words + c0 / 64] >> (c0 % 64)) & 0xFFFF) : 0u;
  };
  const bool pipelined = token_tiles <= 2;
  const I64 chunk = pipelined ? 1 : kAmxChunkSteps, a_stride = chunk * kAmxTile * kAmxStep;  // one row tile's A
  const I64 half = row_tiles * a_stride, b_stride = 4 * n, b_tile = kAmxTile * n;
  auto stage_chunk = [&](I64 c0, uint16_t* dst) {
    const I64 cs = imin(chunk, steps - c0);
    for (int rt = 0; rt < row_tiles; ++rt) amx_stage<V, F>(w, rows[rt], c0, cs, exact_bits(rt, c0), dst + rt * a_stride);
  };
  if (pipelined) stage_chunk(0, stage);
  for (I64 c0 = 0; c0 < steps; c0 += chunk) {
    const I64 cs = imin(chunk, steps - c0);
    const uint16_t* a = stage + (pipelined ? (c0 & 1) * half : 0);
    if (!pipelined) stage_chunk(c0, stage);
    else if (c0 + 1 < steps) stage_chunk(c0 + 1, stage + ((c0 + 1) & 1) * half);
    uint32_t exact[kAmxMaxRowTiles];
    for (int rt = 0; rt < row_tiles; ++rt) exact[rt] = exact_bits(rt, c0);
    for (I64 tt = 0; tt < token_tiles; tt += 2) {
      const bool two = tt + 1 < token_tiles;
      float* c = out + tt * 256;  // C[rt][tt + j] at c + (rt * token_tiles + j) * 256
      const I64 rt_stride = token_tiles * 256;
      if (c0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else if (!pipelined) {
        _tile_loadd(0, c, 64);
        if (two) _tile_loadd(1, c + 256, 64);
        if (row_tiles == 2) _tile_loadd(2, c + rt_stride, 64);
        if (row_tiles == 2 && two) _tile_loadd(3, c + rt_stride + 256, 64);
      }
      for (I64 s = 0; s < cs; ++s) {
        const uint16_t* as = a + s * kAmxTile * kAmxStep;
        if (token_tiles == 1) {
          unsigned ex = 0;
          for (int rt = 0; rt < row_tiles; ++rt) ex |= ((exact[rt] >> s) & 1u) << rt;
          amx_step_4x1(as, a_stride, pack_fast + (c0 + s) * b_tile, pack_exact + (c0 + s) * b_tile, b_stride,
                       row_tiles, ex);
        } else {
          auto b = [&](bool ex, I64 j) { return (ex ? pack_exact : pack_fast) + ((tt + j) * steps + c0 + s) * b_tile; };
          amx_step_2x2(as, a_stride, b, b_stride, row_tiles, two, ((exact[0] >> s) & 1u) | (((exact[1] >> s) & 1u) << 1));
        }
      }
      if (c0 + cs >= steps || !pipelined) {
        if (token_tiles == 1) {
          for (int rt = 0; rt < row_tiles; ++rt) {  // C[rt] is tile rt
            float* dst = out + rt * 256;
            if (rt == 0) _tile_stored(0, dst, 64);
            if (rt == 1) _tile_stored(1, dst, 64);
            if (rt == 2) _tile_stored(2, dst, 64);
            if (rt == 3) _tile_stored(3, dst, 64);
          }
        } else {
          _tile_stored(0, c, 64);
          if (two) _tile_stored(1, c + 256, 64);
          if (row_tiles == 2) _tile_stored(2, c + rt_stride, 64);
          if (row_tiles == 2 && two) _tile_stored(3, c + rt_stride + 256, 64);
        }
      }
    }
  }
}

// The AMX path: per row block (fp8: the rows of one scale row; bf16: all rows), the tokens' activations scaled,
// rounded to bf16 and packed into B tiles (the exact decode's copy only when a row tile needs it), then groups
// of 4 row tiles (one token tile) or 2 over all K.
template <class V, WFormat F>
void matmul_amx(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy) {
  const I64 K = w.cols, M = x.m, steps = (K + kAmxStep - 1) / kAmxStep, ld = bf16_row_length<V>(K);
  const I64 n = imin(M, kAmxTile), token_tiles = (M + n - 1) / n;
  const I64 group_rows = (token_tiles == 1 ? kAmxMaxRowTiles : 2) * kAmxTile;
  const I64 pack_bytes = token_tiles * steps * kAmxTile * n * 4;
  const I64 stage_bytes = 2 * kAmxChunkSteps * kAmxTileBytes;  // chunks of 2 row tiles, or 2 steps of 4
  const I64 out_bytes = kAmxMaxRowTiles * token_tiles * kAmxTileBytes;
  const I64 rows_bytes = (M * ld * 2 + 63) / 64 * 64;
  const I64 bits_bytes = F == WFormat::FP8 ? kAmxMaxRowTiles * ((steps + 63) / 64) * 8 + w.subnormal_stride : 0;
  uint8_t* buf = amx_scratch(2 * pack_bytes + stage_bytes + out_bytes + rows_bytes + bits_bytes);
  uint32_t* pack_fast = reinterpret_cast<uint32_t*>(buf);
  uint32_t* pack_exact = reinterpret_cast<uint32_t*>(buf + pack_bytes);
  uint16_t* stage = reinterpret_cast<uint16_t*>(buf + 2 * pack_bytes);
  float* out = reinterpret_cast<float*>(buf + 2 * pack_bytes + stage_bytes);
  uint16_t* xbuf = reinterpret_cast<uint16_t*>(buf + 2 * pack_bytes + stage_bytes + out_bytes);
  uint64_t* step_bits = reinterpret_cast<uint64_t*>(buf + 2 * pack_bytes + stage_bytes + out_bytes + rows_bytes);
  const uint16_t** xrows = reinterpret_cast<const uint16_t**>(scratch_pointers(M));
  const float output_scale = F == WFormat::FP8 ? kFp8NormalOutput : 1.0f;
  amx_configure(n);
  for (I64 s0 = r0; s0 < r1;) {
    const I64 s1 = segment_end(w, s0, r1);
    const float* srow;
    const bool fast = segment_activations_bf16<V, F>(w, s0, x, xbuf, ld, xrows, srow);
    bool exact_ready = false;
    if (fast) amx_pack_tokens(xrows, M, steps, n, pack_fast);
    for (I64 r = s0; r < s1; r += group_rows) {
      const int row_tiles = static_cast<int>((imin(s1 - r, group_rows) + kAmxTile - 1) / kAmxTile);
      if constexpr (F == WFormat::FP8) {
        bool subnormal = false;
        for (I64 i = r; i < imin(s1, r + group_rows); ++i) subnormal |= (w.row_flags[i] & kRowHasSubnormal) != 0;
        if ((!fast || subnormal) && !exact_ready) {
          scale_activations_bf16<V>(w, srow, x, kFp8ExactUnscale, xbuf, ld, xrows);
          amx_pack_tokens(xrows, M, steps, n, pack_exact);
          exact_ready = true;
        }
      }
      amx_row_group<V, F>(w, r, s1 - 1, row_tiles, token_tiles, n, pack_fast, pack_exact, fast, stage, out,
                          step_bits);
      // C's rows to y's columns, token tile by token tile (no division per element: an idiv each cost 20% of int4
      // experts at 32 tokens where the compiler kept it)
      for (int rt = 0; rt < row_tiles; ++rt)
        for (I64 i = 0; i < kAmxTile && r + rt * kAmxTile + i < s1; ++i) {
          float* yc = y + r + rt * kAmxTile + i - r0;
          for (I64 tt = 0, m = 0; tt < token_tiles; ++tt) {
            const float* c = out + (rt * token_tiles + tt) * 256 + i * kAmxTile;
            for (I64 j = 0; j < n && m < M; ++j, ++m) yc[m * ldy] = c[j] * output_scale;
          }
        }
    }
    s0 = s1;
  }
  _tile_release();
  if constexpr (F == WFormat::FP8) set_nan_rows(w, r0, r1, M, y, ldy);
}

}  // namespace
}  // namespace hm
#endif
