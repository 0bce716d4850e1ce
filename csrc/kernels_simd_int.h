// Int-format matmul kernels (int4 / int8 per group, int8 activations) of kernels_simd.h.
//
// Legend: M tokens, R rows per register tile, MT tokens per register tile, g group size.
#pragma once

#include "kernels_simd_common.h"

namespace hm {
namespace {
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
HM_TILE_INLINE void add_u4(__m256i& acc16, __m256i& acci, __m256i u, __m256i s) {
  if constexpr (V::kPairSums16) acc16 = V::pairs_u4(acc16, u, s);
  else acci = V::dot_u4(acci, u, s);
}

// out[i][j] = sum over groups [g0, g1) of ws[i][g] * xs[j][g] * (integer dot of the group), kChunks = g / 32.
// Scales are combined 8 groups at a time in vectors (weight scale x activation scale into a small table the
// group loop broadcasts from), and so is the correction for unsigned-offset dot products (offset * ws * xs *
// sum(q)). next (may be nullptr): the start of the R rows that follow, prefetched at the rate these are read, as
// one linear stream into L1 or L2 (P; see NextRows).
template <class V, WFormat F, ScaleType ST, int kChunks, int R, int MT, NextRows P>
HM_TILE_INLINE void int_tile(const uint8_t* const* rowp, const uint16_t* const* srow, I64 g0, I64 g1,
                             const int8_t* const* xq, const float* const* xs, const float* const* xsum,
                             float (&out)[R][MT], const uint8_t* next) {
  constexpr I64 kChunkBytes = F == WFormat::INT4 ? 16 : 32;  // bytes of one row's 32 elements
  static_assert(P != NextRows::StreamsL2 && P != NextRows::StreamsL2Twice,
                "int tiles prefetch linearly (their stride argument is 0)");
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
      constexpr bool kWideInt4 = F == WFormat::INT4;  // group 128 here; group 32 takes matmul_int4_g32
      static_assert(!kWideInt4 || kChunks % 2 == 0, "int4 groups of 32 take matmul_int4_g32");
      if constexpr (kWideInt4)  // two chunks (64 elements) a step: one 32-byte load a row, no cross-lane unpack
        for (int c = 0; c < kChunks; c += 2) {
          const I64 e = e0 + c * 32;
          if (next) prefetch_next<P, R, 2 * kChunkBytes>(next, 0, e / 32 * kChunkBytes);
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
        if (next) prefetch_next<P, R, kChunkBytes>(next, 0, e / 32 * kChunkBytes);
        __m256i wv[R];
        for (int i = 0; i < R; ++i) wv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rowp[i] + e));
        for (int j = 0; j < MT; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + e));
          for (int i = 0; i < R; ++i) acci[i][j] = V::dot_i8(acci[i][j], wv[i], xv);
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

// The 4-row tile of int rows [r, r + 4) within [.., r1): row and scale pointers (a short tile repeats its last
// row, not stored), the rows stored, and the rows of the tile the GEMV path prefetches (next_tile_rows: the next
// tile, or `ahead` rows on: prefetch_ahead_rows; nullptr: none; their group scales are prefetched here: a stream of
// their own, which prefetchers pick up late).
struct IntRowTile {
  const uint8_t* rowp[4];
  const uint16_t* srow[4];
  I64 valid;
  const uint8_t* next;
};

inline IntRowTile int_row_tile(const Matrix& w, I64 r, I64 r1, bool gemm, I64 row_read_bytes, I64 ahead) {
  const uint16_t* scales = static_cast<const uint16_t*>(w.scales);
  IntRowTile t;
  for (int i = 0; i < 4; ++i) {
    const I64 ri = imin(r + i, r1 - 1);
    t.rowp[i] = w.data + ri * w.row_bytes;
    t.srow[i] = scales + ri * w.scale_stride;
  }
  t.valid = imin(4, r1 - r);
  t.next = gemm ? nullptr : next_tile_rows(w, r, r1, 4, row_read_bytes, ahead);
  if (t.next)
    for (I64 off = 0; off < 4 * w.scale_stride * 2; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(scales + (r + ahead) * w.scale_stride) + off, _MM_HINT_T0);
  return t;
}

// ---- int4, group 32: eight groups a step ---------------------------------------------------------------------
// Each 32-byte load of a row holds two groups (lane 0: group 2p, lane 1: 2p + 1), unpacked as in the wide path,
// so that the int16 pair sums of one pair of groups' dot products form one vector (lanes 0-7 group 2p, 8-15
// group 2p + 1). Four such vectors (eight groups, an "oct") fold by three horizontal adds and one madd into the
// eight groups' int32 sums in the order [0, 2, 4, 6, 1, 3, 5, 7] (each int16 lane then sums 16 products of at
// most 15 x 127: 30,480 < 2^15; with VNNI, dpbusd int32 sums and int32 horizontal adds). The scales follow that
// order: the weights' eight are shuffled into it in registers, the tokens' and their unsigned-offset correction
// (-8 qsum) are prepared once per call (oct_activations). Per oct, row and token: 8 maddubs, 4 adds, 3 horizontal
// adds, a madd, a convert, a multiply and two FMAs (int_tile: a madd, a convert, a broadcast and an FMA per
// group, and a scale table rebuilt every 8 groups).
constexpr I64 kOctFloats = 16;  // per token and oct: its activation scales, then -8 qsum, in the order above

// The group order of an oct's sums.
constexpr int kOctOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

// The tokens' activations as the oct steps read them, prepared once per call: tables[m * octs * 16 + o * 16 +
// (0..15)] (groups past the row's are 0), and q[m * ldq ..] the int8 activations in pair order: per 64 elements
// (a pair of groups), elements 0-15 and 32-47 (the order of the weights' low nibbles), then 16-31 and 48-63
// (high nibbles), zero-padded to whole octs, so that the steps load them as they are (no per-row permutes).
struct OctActivations {
  const float* tables;
  const int8_t* q;
  I64 ldq;
};

inline OctActivations oct_activations(const Activations& x, I64 groups) {
  const I64 octs = (groups + 7) / 8, ldq = octs * 256;
  float* tables = scratch_floats(x.m * (octs * kOctFloats + ldq / 4));
  int8_t* q = reinterpret_cast<int8_t*>(tables + x.m * octs * kOctFloats);
  for (I64 m = 0; m < x.m; ++m) {
    const float* xs = qscale_row(x, m);
    const float* xsum = qsum_row(x, m);
    float* t = tables + m * octs * kOctFloats;
    for (I64 o = 0; o < octs; ++o, t += kOctFloats)
      for (int l = 0; l < 8; ++l) {
        const I64 g = 8 * o + kOctOrder[l];
        t[l] = g < groups ? xs[g] : 0.0f;
        t[8 + l] = g < groups ? -8.0f * xsum[g] : 0.0f;
      }
    const int8_t* src = q_row(x, m);
    int8_t* dst = q + m * ldq;
    const I64 full = groups / 2 * 64;  // elements in whole pairs of groups
    for (I64 e = 0; e < full; e += 64) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e + 32));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e), _mm256_permute2x128_si256(a, b, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e + 32), _mm256_permute2x128_si256(a, b, 0x31));
    }
    std::memset(dst + full, 0, static_cast<size_t>(ldq - full));
    if (groups % 2) {  // a last single group: its elements 0-15 and 16-31 beside zeros
      std::memcpy(dst + full, src + full, 16);
      std::memcpy(dst + full + 32, src + full + 16, 16);
    }
  }
  return {tables, q, ldq};
}

// A row's eight group scales at p -> floats in the oct order.
template <ScaleType ST>
inline __m256 oct_weight_scales(const uint16_t* p) {
  const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                     _mm_set_epi8(15, 14, 11, 10, 7, 6, 3, 2, 13, 12, 9, 8, 5, 4, 1, 0));
  if constexpr (ST == ScaleType::BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

// The dot products of one pair of groups (lo / hi: the row's unpacked 32 bytes; xlo / xhi: the token's 64
// activations in the same order): int16 pair sums, or int32 with VNNI.
template <class V>
HM_TILE_INLINE __m256i pair_dot(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi) {
  __m256i acc16 = _mm256_setzero_si256(), acci = _mm256_setzero_si256();
  add_u4<V>(acc16, acci, lo, xlo);
  add_u4<V>(acc16, acci, hi, xhi);
  return V::kPairSums16 ? acc16 : acci;
}

template <class V>
HM_TILE_INLINE __m256i fold_pairs(__m256i a, __m256i b) {
  return V::kPairSums16 ? _mm256_hadd_epi16(a, b) : _mm256_hadd_epi32(a, b);
}

// acc[i][j] += one oct of R rows (128 bytes at wrow[i], eight scales at srow[i]) times MT tokens (256 int8
// activations in pair order at xq[j], their oct table at t[j]). Row by row, pair by pair, so that few vectors are
// live at once (the whole tile's pair sums at once would outgrow AVX2's 16 registers), the activations loaded as
// they are.
template <class V, ScaleType ST, int R, int MT>
HM_TILE_INLINE void int4_oct_step(const uint8_t* const* wrow, const uint16_t* const* srow, const int8_t* const* xq,
                                  const float* const* t, __m256 (&acc)[R][MT]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  HM_UNROLL for (int i = 0; i < R; ++i) {
    __m256i first[MT], half[2][MT];  // the pair sums of pairs 0 / 2, then the folded pairs 0-1 and 2-3
    HM_UNROLL for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[i] + 32 * p));
      const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      HM_UNROLL for (int j = 0; j < MT; ++j) {
        const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + 64 * p));
        const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[j] + 64 * p + 32));
        const __m256i d = pair_dot<V>(lo, hi, xlo, xhi);
        if (p % 2 == 0) first[j] = d;
        else half[p / 2][j] = fold_pairs<V>(first[j], d);
      }
    }
    const __m256 ws = oct_weight_scales<ST>(srow[i]);
    HM_UNROLL for (int j = 0; j < MT; ++j) {
      __m256i sums = fold_pairs<V>(half[0][j], half[1][j]);
      if constexpr (V::kPairSums16) sums = V::widen_pairs(sums);
      const __m256 c = _mm256_mul_ps(ws, _mm256_loadu_ps(t[j]));
      acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), c, acc[i][j]);
      acc[i][j] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(t[j] + 8), acc[i][j]);
    }
  }
}

// out[i][j] = the R rows' dot products with MT tokens over octs [o0, o1) (`groups` in the whole row: a last
// partial oct goes through zero-padded copies of the weights and scales). xq, tables: the MT tokens' activations
// in pair order and oct tables (oct_activations).
template <class V, ScaleType ST, int R, int MT, NextRows P>
HM_TILE_INLINE void int4_oct_tile(const uint8_t* const* rowp, const uint16_t* const* srow, I64 o0, I64 o1, I64 groups,
                                  const int8_t* const* xq, const float* const* tables, float (&out)[R][MT],
                                  const uint8_t* next) {
  __m256 acc[R][MT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  const I64 full = imin(o1, groups / 8);
  const uint8_t* w[R];
  const uint16_t* s[R];
  const int8_t* xp[MT];
  const float* t[MT];
  for (I64 o = o0; o < full; ++o) {
    if (next) prefetch_next<P, R, 128>(next, 0, o * 128);
    for (int i = 0; i < R; ++i) w[i] = rowp[i] + 128 * o, s[i] = srow[i] + 8 * o;
    for (int j = 0; j < MT; ++j) xp[j] = xq[j] + 256 * o, t[j] = tables[j] + o * kOctFloats;
    int4_oct_step<V, ST, R, MT>(w, s, xp, t, acc);
  }
  if (full < o1) {  // a last partial oct: its groups beside zeros (the activations are zero-padded already)
    const I64 left = groups - 8 * full;
    alignas(32) uint8_t wpad[R][128] = {};
    alignas(16) uint16_t spad[R][8] = {};
    for (int i = 0; i < R; ++i) {
      std::memcpy(wpad[i], rowp[i] + 128 * full, static_cast<size_t>(16 * left));
      std::memcpy(spad[i], srow[i] + 8 * full, static_cast<size_t>(2 * left));
      w[i] = wpad[i], s[i] = spad[i];
    }
    for (int j = 0; j < MT; ++j) xp[j] = xq[j] + 256 * full, t[j] = tables[j] + full * kOctFloats;
    int4_oct_step<V, ST, R, MT>(w, s, xp, t, acc);
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) out[i][j] = hsum256(acc[i][j]);
}

#ifdef __AVX512VNNI__
// ---- int4 / int8, 512-bit vectors (AVX-512 VNNI): lane-scaled steps ------------------------------------------
// A step of a row holds 128 elements, four 32-element chunks: int4 in 64 bytes (128-bit lane l: chunk 4s + l, byte
// b of it elements b and b + 16), int8 in 128 bytes as stored (chunk after chunk), put in the same order by two
// 128-bit lane shuffles (elements 0-15 of the four chunks, then 16-31) and offset by 128. Two vpdpbusd against the
// tokens' activations in that order (elements 0-15 of the four chunks, then 16-31) leave int32 partial sums of each
// chunk in its own four lanes. With groups of 32 each chunk is a group, four a step; with groups of 128 (int4) a
// step is one group. Either way the scales apply lane by lane, with no horizontal adds: t = sums * xs + c (xs: the
// token's group scales, c: its unsigned-offset correction -offset qsum / lanes, each in its group's lanes),
// acc += t * ws (ws: the row's group scales in their lanes, one permute or broadcast per row and step). Per step,
// row and token: 2 vpdpbusd, a convert and two FMAs (int8 had a convert and two FMAs after each vpdpbusd of a
// 64-element step: a quarter fewer instructions a weight now; the 256-bit steps: int4 g32 8 vpdpbusd, 3 horizontal
// adds, a convert, a multiply and two FMAs per 256 weights; int8 g32 per group a vpdpbusd, a convert, a broadcast
// and an FMA; groups of 128 a vpdpbusd per 32 weights, then per group a convert, a broadcast and an FMA).
template <WFormat F, int G>
struct LaneSteps {
  static constexpr I64 kElems = 128;                                // elements per step
  static_assert(G == 32 || G == kElems, "a step holds whole groups");
  static constexpr I64 kGroups = kElems / G;                        // groups per step
  static constexpr I64 kLanes = 16 / kGroups;                       // int32 lanes per group
  static constexpr I64 kWeightBytes = F == WFormat::INT4 ? 64 : 128;  // a row's bytes per step
  static constexpr I64 kActBytes = 128;                             // activation bytes per step and token
  static constexpr float kOffset = F == WFormat::INT4 ? 8.0f : 128.0f;
  static constexpr I64 kFloats = 32;  // table floats per step and token: 16 lanes' xs, then their c
  // the first group of step st, and its weight scales' offset in a row's scales
  static constexpr I64 first_group(I64 st) { return st * kGroups; }
  // lane l of a step -> its group within the step (as 32-bit lane indices)
  static HM_TILE_INLINE __m512i lane_groups() {
    if constexpr (kGroups == 4) return _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    else if constexpr (kGroups == 2) return _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    else return _mm512_setzero_si512();
  }
};

// The tokens' activations as the steps read them, prepared once per call (a task's rows x a block of up to 128
// tokens): tables[m * ldt + s * 32 ..] (xs and c of step s; groups past the row's are 0) and q[m * ldq + s *
// kActBytes ..] the int8 activations of step s (per chunk elements 0-15, for the four chunks, then their elements
// 16-31), zero-padded to whole steps. Built in vectors: the matmul is called per block of 128 rows, and a scalar
// loop here was visible in the MoE's time at T = 32-256.
struct LaneActivations {
  const float* tables;
  const int8_t* q;
  I64 ldt, ldq;
};

template <WFormat F, int G>
inline LaneActivations lane_activations(const Activations& x, I64 groups) {
  using S = LaneSteps<F, G>;
  const I64 chunks = groups * (G / 32), chunks_per_step = S::kElems / 32;
  const I64 steps = (chunks + chunks_per_step - 1) / chunks_per_step, ldt = steps * S::kFloats;
  const I64 ldq = steps * S::kActBytes;
  float* tables = scratch_floats(x.m * (ldt + ldq / 4));
  int8_t* q = reinterpret_cast<int8_t*>(tables + x.m * ldt);
  const __m512i lane_group = S::lane_groups();
  const __m512 correction = _mm512_set1_ps(-S::kOffset / S::kLanes);
  for (I64 m = 0; m < x.m; ++m) {
    const float* xs = qscale_row(x, m);
    const float* xsum = qsum_row(x, m);
    const int8_t* src = q_row(x, m);
    float* t = tables + m * ldt;
    int8_t* dst = q + m * ldq;
    for (I64 st = 0; st < steps; ++st) {
      const I64 g0 = S::first_group(st), n = imin(S::kGroups, groups - g0);  // the step's groups within the row
      const __mmask16 real = static_cast<__mmask16>((1u << n) - 1);
      const __m512 scales = _mm512_maskz_loadu_ps(real, xs + g0), sums = _mm512_maskz_loadu_ps(real, xsum + g0);
      _mm512_storeu_ps(t + st * S::kFloats, _mm512_permutexvar_ps(lane_group, scales));
      _mm512_storeu_ps(t + st * S::kFloats + 16, _mm512_mul_ps(_mm512_permutexvar_ps(lane_group, sums), correction));
      // the step's activations: c chunks of 32 bytes, zero past them
      const I64 c0 = st * chunks_per_step, c = imin(chunks_per_step, chunks - c0);
      const __mmask64 lo_bytes = c >= 2 ? ~__mmask64{0} : (__mmask64{1} << (32 * c)) - 1;
      const __m512i a = _mm512_maskz_loadu_epi8(lo_bytes, src + 32 * c0);
      // chunks 0-1 in a, 2-3 in b: elements 0-15 of each, then 16-31
      const __mmask64 hi_bytes = c == 4 ? ~__mmask64{0} : c <= 2 ? 0 : (__mmask64{1} << (32 * (c - 2))) - 1;
      const __m512i b = _mm512_maskz_loadu_epi8(hi_bytes, src + 32 * c0 + 64);
      _mm512_storeu_si512(dst + st * 128, _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
      _mm512_storeu_si512(dst + st * 128 + 64, _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    }
  }
  return {tables, q, ldt, ldq};
}

// A row's group scales of one step at p (groups of 32: four; of 128: one) -> 16 floats, each in its group's lanes.
template <WFormat F, int G, ScaleType ST>
HM_TILE_INLINE __m512 lane_weight_scales(const uint16_t* p) {
  using S = LaneSteps<F, G>;
  if constexpr (S::kGroups == 1) {
    if constexpr (ST == ScaleType::BF16)  // the bf16 bits in the high half of each lane: the float itself
      return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(uint32_t{*p} << 16)));
    else
      return _mm512_set1_ps(_cvtsh_ss(*p));
  }
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));  // the step's four scales
  if constexpr (ST == ScaleType::BF16) {  // bf16 bits to the high half of each lane: the float itself
    const __m512i idx = _mm512_set_epi16(3, 0, 3, 0, 3, 0, 3, 0, 2, 0, 2, 0, 2, 0, 2, 0,
                                         1, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, _mm512_castsi128_si512(v)));
  } else {
    return _mm512_permutexvar_ps(S::lane_groups(), _mm512_castps128_ps512(_mm_cvtph_ps(v)));
  }
}

// One step of a row's weights at p as two vectors of unsigned bytes in the activations' order: elements 0-15 of the
// four chunks (lo), then 16-31 (hi). int4: the low and high nibbles; int8: the two 64-byte halves' 128-bit lanes
// interleaved (chunks 0-1, then 2-3) and offset by 128. With GFNI an affine map per byte (bits 4-7 to 0-3, zero
// above) takes the high nibbles in one instruction rather than a shift and a mask: one token's int4 GEMV is bound by
// its instructions a byte.
template <WFormat F, bool Gfni = false>
HM_TILE_INLINE void lane_step_weights(const uint8_t* p, __m512i& lo, __m512i& hi) {
  if constexpr (F == WFormat::INT4) {
    const __m512i v = _mm512_loadu_si512(p);
    lo = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
#ifdef __GFNI__
    if constexpr (Gfni) {
      hi = _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
      return;
    }
#endif
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  } else {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64), offset = _mm512_set1_epi8(-128);
    lo = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(2, 0, 2, 0)), offset);
    hi = _mm512_xor_si512(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 1, 3, 1)), offset);
  }
}

// acc[i][j] += one step of R rows (kWeightBytes at w[i] + wo, their scales at s[i] + so) times MT tokens (kActBytes
// int8 activations at xq[j] + qo, 32 table floats at t[j] + to). Offsets from the tile's own pointers rather than
// per-step pointer tables: GCC 12 built those in vectors, extracted each pointer and spilled them every step.
template <WFormat F, int G, ScaleType ST, int R, int MT, bool Gfni>
HM_TILE_INLINE void int_lane_step(const uint8_t* const* w, I64 wo, const uint16_t* const* s, I64 so,
                                  const int8_t* const* xq, I64 qo, const float* const* t, I64 to,
                                  __m512 (&acc)[R][MT]) {
  __m512i lo[R], hi[R];  // elements 0-15 and 16-31 of the step's four chunks, unsigned
  __m512 ws[R];
  HM_UNROLL for (int i = 0; i < R; ++i) {
    lane_step_weights<F, Gfni>(w[i] + wo, lo[i], hi[i]);
    ws[i] = lane_weight_scales<F, G, ST>(s[i] + so);
  }
  HM_UNROLL for (int j = 0; j < MT; ++j) {
    const __m512i xlo = _mm512_loadu_si512(xq[j] + qo), xhi = _mm512_loadu_si512(xq[j] + qo + 64);
    const __m512 xs = _mm512_loadu_ps(t[j] + to), c = _mm512_loadu_ps(t[j] + to + 16);
    HM_UNROLL for (int i = 0; i < R; ++i) {
      const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], xlo), hi[i], xhi);
      acc[i][j] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs, c), ws[i], acc[i][j]);
    }
  }
}

// out[i][j] = the R rows' dot products with MT tokens over steps [s0, s1) (`groups` in the whole row: a last
// partial step, groups of 32 only, goes through zero-padded copies of the weights and scales).
template <class V, WFormat F, int G, ScaleType ST, int R, int MT, NextRows P>
HM_TILE_INLINE void int_lane_tile(const uint8_t* const* rowp, const uint16_t* const* srow, I64 s0, I64 s1,
                                  I64 groups, const LaneActivations& acts, I64 m, float (&out)[R][MT],
                                  const uint8_t* next) {
  using S = LaneSteps<F, G>;
  __m512 acc[R][MT];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  const I64 full = imin(s1, groups / S::kGroups);  // whole steps
  const int8_t* xp[MT];
  const float* t[MT];
  for (int j = 0; j < MT; ++j) {
    xp[j] = acts.q + (m + j) * acts.ldq;
    t[j] = acts.tables + (m + j) * acts.ldt;
  }
  for (I64 st = s0; st < full; ++st) {
    if (next) prefetch_next<P, R, S::kWeightBytes>(next, 0, st * S::kWeightBytes);
    int_lane_step<F, G, ST, R, MT, V::kGfni>(rowp, S::kWeightBytes * st, srow, S::first_group(st), xp, st * S::kActBytes, t,
                                   st * S::kFloats, acc);
  }
  if (full < s1) {
    const I64 left = groups - S::first_group(full);
    alignas(64) uint8_t wpad[R][S::kWeightBytes] = {};
    alignas(16) uint16_t spad[R][8] = {};
    const uint8_t* w[R];
    const uint16_t* s[R];
    for (int i = 0; i < R; ++i) {
      std::memcpy(wpad[i], rowp[i] + S::kWeightBytes * full, static_cast<size_t>(S::kWeightBytes / S::kGroups * left));
      std::memcpy(spad[i], srow[i] + S::first_group(full), static_cast<size_t>(2 * left));
      w[i] = wpad[i], s[i] = spad[i];
    }
    int_lane_step<F, G, ST, R, MT, V::kGfni>(w, 0, s, 0, xp, full * S::kActBytes, t, full * S::kFloats, acc);
  }
  static_assert(R == 4, "the rows' sums are taken together");
  for (int j = 0; j < MT; ++j) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, V::hsum4(acc[0][j], acc[1][j], acc[2][j], acc[3][j]));
    for (int i = 0; i < R; ++i) out[i][j] = sums[i];
  }
}

// y[0..4) = the dot products of one token with 4 rows from `row` (row_bytes apart; their scales from srow,
// scale_stride apart) over `steps` whole steps (xq, t: the token's activations and tables, lane_activations), as
// int_lane_tile computes them but addressed from one row pointer, without its per-step pointer tables (GCC 12 built
// them in vectors, extracted each pointer and spilled them every step: a quarter of the loop's instructions), and
// with the 4 sums taken together (V::hsum4) and stored as one vector (a profile of int4 2048 x 768 in L2 had a
// third of the samples outside the step loop, most in the four horizontal sums). See one_token_lanes.
template <class V, WFormat F, int G, ScaleType ST, NextRows P>
HM_TILE_INLINE void one_token_int_lanes(const uint8_t* row, I64 row_bytes, const uint16_t* srow, I64 scale_stride,
                                        I64 steps, const int8_t* xq, const float* t, float* y,
                                        const uint8_t* next) {
  using S = LaneSteps<F, G>;
  constexpr int R = 4;
  __m512 acc[R];
  HM_UNROLL for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  static_assert(P != NextRows::StreamsL2 && P != NextRows::StreamsL2Twice, "the next tile's rows lie back to back");
  for (I64 st = 0; st < steps; ++st) {
    const __m512i xlo = _mm512_loadu_si512(xq + st * S::kActBytes), xhi = _mm512_loadu_si512(xq + st * S::kActBytes + 64);
    const __m512 xs = _mm512_loadu_ps(t + st * S::kFloats), c = _mm512_loadu_ps(t + st * S::kFloats + 16);
    HM_UNROLL for (int i = 0; i < R; ++i) {
      __m512i lo, hi;
      lane_step_weights<F, V::kGfni>(row + i * row_bytes + S::kWeightBytes * st, lo, hi);
      // each row's load followed by a quarter of the next tile's lines for this step (its R rows back to back), as
      // the float GEMV spreads its prefetches (accumulate_steps)
      if (next) prefetch_next<P, 1, S::kWeightBytes>(next, 0, (R * st + i) * S::kWeightBytes);
      const __m512 ws = lane_weight_scales<F, G, ST>(srow + i * scale_stride + S::first_group(st));
      const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
      acc[i] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs, c), ws, acc[i]);
    }
  }
  _mm_storeu_ps(y, V::hsum4(acc[0], acc[1], acc[2], acc[3]));
}

// The most tokens of a lane-step register tile of 4 rows: a row keeps two weight vectors live, and 4 x 4 tiles (16
// accumulators, 12 row vectors) run out of registers.
template <WFormat F>
constexpr int kLaneTileTokens = 3;

// Tokens from which int4 / int8 with groups of G take the lane steps on AVX-512, where they measured faster than
// the 256-bit kernels: int4 with groups of 32 from one token (with the prefetch that reaches ahead), int8 with
// groups of 32 and int4 with groups of 128 from two. int8 with groups of 128 never: its 256-bit kernel sums a
// whole group in int32 before one convert.
template <WFormat F, int G>
constexpr I64 kLaneMinTokens = F == WFormat::INT4 && G == 32 ? 1 : 2;

// Whether one token against w (int4 / int8 with groups of G) takes one_token_int_lanes tiles of 4 rows: rows under
// kPrefetchL2MinBytes of whole steps, on AVX-512 also where the lane steps do not start at one token
// (kLaneMinTokens: int8 with groups of 32, int4 with groups of 128). Their four sums are taken together, which lets
// short rows read as fast as a plain read of the same bytes; longer rows keep the tiles they had (two-row tiles
// for int8), which read them faster.
template <WFormat F, int G>
inline bool one_token_lanes(const Matrix& w, I64 tokens, bool gemm) {
  return tokens == 1 && !gemm && w.row_bytes < kPrefetchL2MinBytes &&
         (w.padded_cols / G) % LaneSteps<F, G>::kGroups == 0;
}

// int4 / int8 with groups of G from kLaneMinTokens tokens on AVX-512 (or one_token_lanes): register tiles of 4 rows
// x up to kLaneTileTokens tokens (for_each_token_tile_upto), at one token one_token_int_lanes for the whole tiles;
// the GEMM path runs the same tiles over chunks of kGemmChunkK elements.
template <class V, WFormat F, int G, ScaleType ST, NextRows P>
void matmul_int_lanes(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  using S = LaneSteps<F, G>;
  static_assert(kGemmChunkK % S::kElems == 0, "GEMM chunks hold whole steps");
  const I64 M = x.m, groups = w.padded_cols / G, steps = (w.padded_cols + S::kElems - 1) / S::kElems;
  const I64 sc = gemm ? kGemmChunkK / S::kElems : steps;
  const LaneActivations acts = lane_activations<F, G>(x, groups);
  const I64 ahead = prefetch_ahead_rows(w, 4, M <= kLaneTileTokens<F>);  // one token tile: reach ahead
  const I64 row_read_bytes = F == WFormat::INT4 ? w.padded_cols / 2 : w.padded_cols;
  I64 r_rest = r0;  // rows from which the general tiles take over
  if (one_token_lanes<F, G>(w, M, gemm))
    for (; r_rest + 4 <= r1; r_rest += 4) {  // whole tiles: their rows and scales lie back to back
      const IntRowTile tile = int_row_tile(w, r_rest, r1, false, row_read_bytes, ahead);
      one_token_int_lanes<V, F, G, ST, P>(tile.rowp[0], w.row_bytes, tile.srow[0], w.scale_stride, steps, acts.q,
                                          acts.tables, y + (r_rest - r0), tile.next);
    }
  for (I64 s0 = 0; s0 < steps; s0 += sc) {
    const I64 s1 = imin(s0 + sc, steps);
    const bool first = s0 == 0;
    for (I64 r = r_rest; r < r1; r += 4) {
      const IntRowTile tile = int_row_tile(w, r, r1, gemm, row_read_bytes, ahead);
      for_each_token_tile_upto<kLaneTileTokens<F>>(M, [&](auto mt, I64 m, bool first_tile) HM_TILE_LAMBDA {
        constexpr int MT = decltype(mt)::kTokens;
        float o[4][MT];
        int_lane_tile<V, F, G, ST, 4, MT, P>(tile.rowp, tile.srow, s0, s1, groups, acts, m, o,
                                             first_tile ? tile.next : nullptr);
        store_tile<4, MT>(y, ldy, m, r - r0, tile.valid, first, o);
      }, serpentine_reverse<4>(r - r0));
    }
  }
}
#endif

// int4 with groups of 32 (see int4_oct_step): tiles of 4 rows, tokens two at a time (2 x 2 register tiles), a
// last single token over all 4 rows; the GEMM path runs the same tiles over chunks of kGemmChunkK elements.
template <class V, ScaleType ST, NextRows P>
void matmul_int4_g32(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  const I64 M = x.m, groups = w.padded_cols / 32, octs = (groups + 7) / 8;
  const I64 oc = gemm ? kGemmChunkK / 256 : octs;
  const OctActivations acts = oct_activations(x, groups);
  const I64 ahead = prefetch_ahead_rows(w, 4, M == 1);
  auto table = [&](I64 m) { return acts.tables + m * octs * kOctFloats; };
  auto q_pairs = [&](I64 m) { return acts.q + m * acts.ldq; };
  for (I64 o0 = 0; o0 < octs; o0 += oc) {
    const I64 o1 = imin(o0 + oc, octs);
    const bool first = o0 == 0;
    for (I64 r = r0; r < r1; r += 4) {
      const IntRowTile tile = int_row_tile(w, r, r1, gemm, w.padded_cols / 2, ahead);
      const I64 row0 = r - r0;
      I64 m = 0;
      for (; m + 2 <= M; m += 2) {
        const int8_t* xq[2] = {q_pairs(m), q_pairs(m + 1)};
        const float* t[2] = {table(m), table(m + 1)};
        for (int i = 0; i < 4; i += 2) {
          float o[2][2];
          int4_oct_tile<V, ST, 2, 2, P>(tile.rowp + i, tile.srow + i, o0, o1, groups, xq, t, o,
                                     m == 0 && tile.next ? tile.next + i * w.row_bytes : nullptr);
          store_tile<2, 2>(y, ldy, m, row0 + i, tile.valid - i, first, o);
        }
      }
      if (m < M) {
        const int8_t* xq[1] = {q_pairs(m)};
        const float* t[1] = {table(m)};
        float o[4][1];
        int4_oct_tile<V, ST, 4, 1, P>(tile.rowp, tile.srow, o0, o1, groups, xq, t, o, m == 0 ? tile.next : nullptr);
        store_tile<4, 1>(y, ldy, m, row0, tile.valid, first, o);
      }
    }
  }
}

// One token against int8 rows of this many bytes and more: two tiles of 2 rows rather than one of 4 (their rows
// stream from memory faster; see one_row_tiles in kernels_simd_common.h). int4 rows and one-row int8 tiles
// measured no faster.
constexpr I64 kInt8TwoRowTileMinBytes = 3 << 10;

template <class V, WFormat F, ScaleType ST, int kChunks, NextRows P>
void matmul_int(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  const I64 M = x.m, groups = w.padded_cols / w.group;
  const I64 gc = gemm ? imax(1, kGemmChunkK / w.group) : groups;
  constexpr int kWideRows = kChunks == 1 ? 2 : 1;  // rows of the 4-token tile (int accumulators cost registers)
  const I64 ahead = prefetch_ahead_rows(w, 4, M == 1);
  const bool two_row_tiles = F == WFormat::INT8 && M == 1 && !gemm && w.row_bytes >= kInt8TwoRowTileMinBytes;
  for (I64 g0 = 0; g0 < groups; g0 += gc) {
    const I64 g1 = imin(g0 + gc, groups);
    const bool first = g0 == 0;
    for (I64 r = r0; r < r1; r += 4) {
      const IntRowTile tile =
          int_row_tile(w, r, r1, gemm, F == WFormat::INT4 ? w.padded_cols / 2 : w.padded_cols, ahead);
      const I64 row0 = r - r0;
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
          int_tile<V, F, ST, kChunks, kWideRows, 4, P>(tile.rowp + i, tile.srow + i, g0, g1, xq, xs, xsum, o,
                                                    m == 0 && tile.next ? tile.next + i * w.row_bytes : nullptr);
          store_tile<kWideRows, 4>(y, ldy, m, row0 + i, tile.valid - i, first, o);
        }
      }
      for (; m + 2 <= M; m += 2) {
        const int8_t* xq[2] = {q_row(x, m), q_row(x, m + 1)};
        const float* xs[2] = {qscale_row(x, m), qscale_row(x, m + 1)};
        const float* xsum[2] = {qsum_row(x, m), qsum_row(x, m + 1)};
        for (int i = 0; i < 4; i += 2) {
          float o[2][2];
          int_tile<V, F, ST, kChunks, 2, 2, P>(tile.rowp + i, tile.srow + i, g0, g1, xq, xs, xsum, o,
                                            m == 0 && tile.next ? tile.next + i * w.row_bytes : nullptr);
          store_tile<2, 2>(y, ldy, m, row0 + i, tile.valid - i, first, o);
        }
      }
      for (; m < M; ++m) {
        const int8_t* xq[1] = {q_row(x, m)};
        const float* xs[1] = {qscale_row(x, m)};
        const float* xsum[1] = {qsum_row(x, m)};
        if (two_row_tiles) {
          for (int i = 0; i < 4; i += 2) {
            float o[2][1];
            // the next 2 rows: this row tile's last two, then the prefetched row tile's first two (rows this long: the
            // next row tile)
            const uint8_t* next = tile.next ? (i == 0 ? tile.rowp[2] : tile.next) : nullptr;
            int_tile<V, F, ST, kChunks, 2, 1, P>(tile.rowp + i, tile.srow + i, g0, g1, xq, xs, xsum, o, next);
            store_tile<2, 1>(y, ldy, m, row0 + i, tile.valid - i, first, o);
          }
          continue;
        }
        float o[4][1];
        int_tile<V, F, ST, kChunks, 4, 1, P>(tile.rowp, tile.srow, g0, g1, xq, xs, xsum, o,
                                             m == 0 ? tile.next : nullptr);
        store_tile<4, 1>(y, ldy, m, row0, tile.valid, first, o);
      }
    }
  }
}

// An int format's kernels with next-tile prefetch P.
template <class V, WFormat F, ScaleType ST, NextRows P>
void matmul_int_prefetching(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
#ifdef __AVX512VNNI__
  if (V::W >= 16 && w.group == 32 && (x.m >= kLaneMinTokens<F, 32> || one_token_lanes<F, 32>(w, x.m, gemm)))
    return matmul_int_lanes<V, F, 32, ST, P>(w, r0, r1, x, y, ldy, gemm);
  if constexpr (F == WFormat::INT4)
    if (V::W >= 16 && w.group == 128 && (x.m >= kLaneMinTokens<F, 128> || one_token_lanes<F, 128>(w, x.m, gemm)))
      return matmul_int_lanes<V, F, 128, ST, P>(w, r0, r1, x, y, ldy, gemm);
#endif
  if (w.group != 32) matmul_int<V, F, ST, 4, P>(w, r0, r1, x, y, ldy, gemm);
  else if constexpr (F == WFormat::INT4) matmul_int4_g32<V, ST, P>(w, r0, r1, x, y, ldy, gemm);
  else matmul_int<V, F, ST, 1, P>(w, r0, r1, x, y, ldy, gemm);
}

template <class V, WFormat F, ScaleType ST>
void matmul_int_group(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, bool gemm) {
  with_next_rows<V, Gemv::Int, 4>(w.row_bytes, x.m, x.m * w.padded_cols, x.m == 1 && !gemm, [&](auto tag) {
    matmul_int_prefetching<V, F, ST, decltype(tag)::kPolicy>(w, r0, r1, x, y, ldy, gemm);
  });
}

}  // namespace
}  // namespace hm
