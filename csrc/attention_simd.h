// The paged decode-attention kernel of one unit (a sequence's KV head and up to kAttnMaxHeadsPerUnit of its query
// heads), written once over a vector vocabulary V (attention_{scalar,avx2,avx512}.cpp). Everything here has
// internal linkage: each translation unit, compiled with its own ISA flags, keeps its own copy.
//
// Per tile of kAttnTile keys: the keys' rows are found through the block table (read in place, in the cache's
// dtype, converted in registers), scores of 4 query heads x 2 keys at a time (8 accumulators; each key row loaded
// once per 4 heads, each query vector once per 2 keys), the tile's maximum per head, p = exp(s - m) and the running
// sum / accumulator rescaled by exp(m_old - m) (online softmax, float32), then acc += p v with 4 heads' accumulators
// of two W-wide column chunks in registers over the tile's keys. The output is acc / sum in the output's dtype.
// A decode step finds the cache cold (a layer's weights streamed through since its last read), so while a tile's
// scores are computed its value rows and the next tile's key rows are prefetched into L2: at context 576-2048 in a
// Qwen3-30B-A3B-shaped decode, 1.2-1.5x faster than waiting on each row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "attention.h"
#include "fp_convert.h"

namespace hm {
namespace {

constexpr int64_t kAttnTile = 64;  // keys per online-softmax step (a multiple of every vector width)

template <class V, AttnType T>
struct KvLoad;
template <class V>
struct KvLoad<V, AttnType::F32> {
  using E = float;
  static typename V::F vec(const E* p) { return V::load(p); }
  static float one(const E* p) { return *p; }
};
template <class V>
struct KvLoad<V, AttnType::BF16> {
  using E = uint16_t;
  static typename V::F vec(const E* p) { return V::load_bf16(p); }
  static float one(const E* p) { return bf16_to_float(*p); }
};
template <class V>
struct KvLoad<V, AttnType::F16> {
  using E = uint16_t;
  static typename V::F vec(const E* p) { return V::load_f16(p); }
  static float one(const E* p) { return half_to_float(*p); }
};

inline float attn_load(AttnType t, const void* base, int64_t i) {
  switch (t) {
    case AttnType::F32: return static_cast<const float*>(base)[i];
    case AttnType::BF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return half_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

// IEEE half, round to nearest even (overflow to infinity; NaN stays NaN).
inline uint16_t attn_float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past the largest half
  if (abs < 0x38800000u) {  // subnormal half (or zero): value / 2^-24, rounded to nearest even
    const float scaled = bits_to_float(abs) * 16777216.0f;  // exact
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = abs + 0x0FFFu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

inline void attn_store(AttnType t, void* base, int64_t i, float v) {
  switch (t) {
    case AttnType::F32: static_cast<float*>(base)[i] = v; break;
    case AttnType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    default: static_cast<uint16_t*>(base)[i] = attn_float_to_half(v); break;
  }
}

template <class V, AttnType KT>
void attention_unit(const DecodeAttnArgs& a, const AttnUnit& u) {
  using F = typename V::F;
  using L = KvLoad<V, KT>;
  using E = typename L::E;
  constexpr int64_t W = V::W;
  const int64_t D = a.head_dim, Dv = a.v_head_dim, Dvec = D / W * W, Dvvec = Dv / W * W;
  const int64_t G = (u.heads + 3) / 4 * 4;  // heads rounded up to whole groups of 4 (extra ones: zero queries)

  thread_local std::vector<float> buffer;
  const size_t need = static_cast<size_t>(G * (D + Dv + kAttnTile + 2));
  if (buffer.size() < need) buffer.resize(need);
  float* q = buffer.data();  // [G, D] scaled queries
  float* acc = q + G * D;    // [G, Dv]
  float* s = acc + G * Dv;   // [G, kAttnTile] scores, then probabilities
  float* m = s + G * kAttnTile;
  float* l = m + G;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t q0 = u.seq * a.q_stride_seq + (u.head0 + g) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = g < u.heads ? attn_load(a.q_type, a.q, q0 + d) * a.scale : 0.0f;
    std::fill(acc + g * Dv, acc + (g + 1) * Dv, 0.0f);
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }

  const int64_t start = u.key_begin, ctx = u.key_end;  // this unit's keys (the window's, or one part of them)
  const E* kbase = static_cast<const E*>(a.k) + u.kv_head * a.k_stride_head;
  const E* vbase = static_cast<const E*>(a.v) + u.kv_head * a.v_stride_head;
  const int64_t bt0 = u.seq * a.block_table_stride;
  // the rows of keys [j0, j0 + n), walking the block table (one division a tile, not one a key); an odd tile's last
  // pair repeats its last key (its second score is not used)
  auto rows_of = [&](int64_t j0, int64_t n, const E** kp, const E** vp) {
    auto block_at = [&](int64_t b) -> int64_t {
      return a.block_tables_i32 ? static_cast<const int32_t*>(a.block_tables)[bt0 + b]
                                : static_cast<const int64_t*>(a.block_tables)[bt0 + b];
    };
    int64_t b = j0 / a.block_size, off = j0 - b * a.block_size, block = block_at(b);
    for (int64_t jj = 0; jj < n; ++jj, ++off) {
      if (off == a.block_size) block = block_at(++b), off = 0;
      kp[jj] = kbase + block * a.k_stride_block + off * a.k_stride_token;
      vp[jj] = vbase + block * a.v_stride_block + off * a.v_stride_token;
    }
    kp[n] = kp[n - 1];
  };
  const E* rows[4][kAttnTile + 1];
  const E** kp = rows[0];  // this tile's rows
  const E** vp = rows[1];
  const E** kn = rows[2];  // the next tile's, prefetched while this one is scored; swapped in for the next tile
  const E** vn = rows[3];
  const int64_t k_row_bytes = D * static_cast<int64_t>(sizeof(E)), v_row_bytes = Dv * static_cast<int64_t>(sizeof(E));
  auto prefetch_row = [](const E* row, int64_t bytes) {  // into L2 (prefetcht1)
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + o, 0, 2);
  };
  if (start < ctx) rows_of(start, std::min(kAttnTile, ctx - start), kn, vn);

  for (int64_t j0 = start; j0 < ctx; j0 += kAttnTile) {
    const int64_t n = std::min(kAttnTile, ctx - j0);
    std::swap(kp, kn);
    std::swap(vp, vn);
    const int64_t n_next = std::min(kAttnTile, ctx - j0 - n);
    if (n_next > 0) rows_of(j0 + n, n_next, kn, vn);

    // scores: 4 heads x 2 keys a step
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* q0 = q + g0 * D;
      const float* q1 = q0 + D;
      const float* q2 = q1 + D;
      const float* q3 = q2 + D;
      for (int64_t jj = 0; jj < n; jj += 2) {
        const E* ka = kp[jj];
        const E* kb = kp[jj + 1];
        if (g0 == 0) {  // into L2: the pair's value rows (read after the scores) and two of the next tile's key rows
          prefetch_row(vp[jj], v_row_bytes);
          if (jj + 1 < n) prefetch_row(vp[jj + 1], v_row_bytes);
          for (int64_t t = jj; t < std::min(jj + 2, n_next); ++t) prefetch_row(kn[t], k_row_bytes);
        }
        F a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
        F b0 = V::zero(), b1 = V::zero(), b2 = V::zero(), b3 = V::zero();
        for (int64_t d = 0; d < Dvec; d += W) {
          const F x = L::vec(ka + d), y = L::vec(kb + d);
          F w = V::load(q0 + d);
          a0 = V::fma(w, x, a0);
          b0 = V::fma(w, y, b0);
          w = V::load(q1 + d);
          a1 = V::fma(w, x, a1);
          b1 = V::fma(w, y, b1);
          w = V::load(q2 + d);
          a2 = V::fma(w, x, a2);
          b2 = V::fma(w, y, b2);
          w = V::load(q3 + d);
          a3 = V::fma(w, x, a3);
          b3 = V::fma(w, y, b3);
        }
        float ta[4], tb[4];
        V::hsum4_store(ta, a0, a1, a2, a3);
        V::hsum4_store(tb, b0, b1, b2, b3);
        for (int64_t d = Dvec; d < D; ++d) {
          const float x = L::one(ka + d), y = L::one(kb + d);
          for (int i = 0; i < 4; ++i) {
            ta[i] += q0[i * D + d] * x;
            tb[i] += q0[i * D + d] * y;
          }
        }
        for (int i = 0; i < 4; ++i) {
          s[(g0 + i) * kAttnTile + jj] = ta[i];
          s[(g0 + i) * kAttnTile + jj + 1] = tb[i];  // jj + 1 == n only for an odd n < kAttnTile: still in the row
        }
      }
    }

    // online softmax: the tile's probabilities against the running maximum; the maximum and the sum in vectors
    // (scalar chains of 64 dependent max and add were a large part of the tile)
    const int64_t nv = (n + W - 1) / W * W, nw = n / W * W;  // padded, whole vectors
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * kAttnTile;
      for (int64_t jj = n; jj < nv; ++jj) sg[jj] = neg_inf;  // padding: never the maximum
      F mv = V::set1(neg_inf);
      for (int64_t jj = 0; jj < nv; jj += W) mv = V::max(V::load(sg + jj), mv);  // a NaN score passed over
      const float m_new = std::max(m[g], V::hmax(mv));
      const float corr = m[g] == neg_inf ? 0.0f : std::exp(m[g] - m_new);
      const F neg_m = V::set1(-m_new);
      F sv = V::zero();
      for (int64_t jj = 0; jj < nw; jj += W) {
        const F p = V::exp(V::add(V::load(sg + jj), neg_m));
        V::store(sg + jj, p);
        sv = V::add(sv, p);
      }
      float sum = V::hsum(sv);
      if (nw < n) {  // the last partial vector: its real lanes only
        V::store(sg + nw, V::exp(V::add(V::load(sg + nw), neg_m)));
        for (int64_t jj = nw; jj < n; ++jj) sum += sg[jj];
      }
      l[g] = l[g] * corr + sum;
      m[g] = m_new;
      if (corr != 1.0f) {
        float* ag = acc + g * Dv;
        for (int64_t d = 0; d < Dv; ++d) ag[d] *= corr;
      }
    }

    // acc += p v: 4 heads' accumulators of two column chunks (then one) in registers over the tile's keys
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
      const float* p0 = s + g0 * kAttnTile;
      const float* p1 = p0 + kAttnTile;
      const float* p2 = p1 + kAttnTile;
      const float* p3 = p2 + kAttnTile;
      float* c0 = acc + g0 * Dv;
      float* c1 = c0 + Dv;
      float* c2 = c1 + Dv;
      float* c3 = c2 + Dv;
      int64_t d = 0;
      for (; d + 2 * W <= Dvvec; d += 2 * W) {  // two column chunks: 8 accumulators, each p broadcast feeds two
        F a0 = V::load(c0 + d), a1 = V::load(c1 + d), a2 = V::load(c2 + d), a3 = V::load(c3 + d);
        F b0 = V::load(c0 + d + W), b1 = V::load(c1 + d + W), b2 = V::load(c2 + d + W), b3 = V::load(c3 + d + W);
        for (int64_t jj = 0; jj < n; ++jj) {
          const F x = L::vec(vp[jj] + d), y = L::vec(vp[jj] + d + W);
          F w = V::set1(p0[jj]);
          a0 = V::fma(w, x, a0);
          b0 = V::fma(w, y, b0);
          w = V::set1(p1[jj]);
          a1 = V::fma(w, x, a1);
          b1 = V::fma(w, y, b1);
          w = V::set1(p2[jj]);
          a2 = V::fma(w, x, a2);
          b2 = V::fma(w, y, b2);
          w = V::set1(p3[jj]);
          a3 = V::fma(w, x, a3);
          b3 = V::fma(w, y, b3);
        }
        V::store(c0 + d, a0);
        V::store(c1 + d, a1);
        V::store(c2 + d, a2);
        V::store(c3 + d, a3);
        V::store(c0 + d + W, b0);
        V::store(c1 + d + W, b1);
        V::store(c2 + d + W, b2);
        V::store(c3 + d + W, b3);
      }
      for (; d < Dvvec; d += W) {
        F a0 = V::load(c0 + d), a1 = V::load(c1 + d), a2 = V::load(c2 + d), a3 = V::load(c3 + d);
        for (int64_t jj = 0; jj < n; ++jj) {
          const F x = L::vec(vp[jj] + d);
          a0 = V::fma(V::set1(p0[jj]), x, a0);
          a1 = V::fma(V::set1(p1[jj]), x, a1);
          a2 = V::fma(V::set1(p2[jj]), x, a2);
          a3 = V::fma(V::set1(p3[jj]), x, a3);
        }
        V::store(c0 + d, a0);
        V::store(c1 + d, a1);
        V::store(c2 + d, a2);
        V::store(c3 + d, a3);
      }
      for (d = Dvvec; d < Dv; ++d)
        for (int64_t jj = 0; jj < n; ++jj) {
          const float x = L::one(vp[jj] + d);
          c0[d] += p0[jj] * x;
          c1[d] += p1[jj] * x;
          c2[d] += p2[jj] * x;
          c3[d] += p3[jj] * x;
        }
    }
  }

  if (u.partial) {  // one part of a split context: [m, l, acc] per head, combined by combine_partials
    for (int64_t g = 0; g < u.heads; ++g) {
      float* p = u.partial + g * (Dv + 2);
      p[0] = m[g];
      p[1] = l[g];
      std::copy(acc + g * Dv, acc + (g + 1) * Dv, p + 2);
    }
    return;
  }
  for (int64_t g = 0; g < u.heads; ++g) {
    const float inv = 1.0f / l[g];
    const int64_t o0 = u.seq * a.out_stride_seq + (u.head0 + g) * a.out_stride_head;
    for (int64_t d = 0; d < Dv; ++d) attn_store(a.out_type, a.out, o0 + d, acc[g * Dv + d] * inv);
  }
}

template <class V>
void attention_unit_dispatch(const DecodeAttnArgs& a, const AttnUnit& u) {
  switch (a.kv_type) {
    case AttnType::F32: return attention_unit<V, AttnType::F32>(a, u);
    case AttnType::BF16: return attention_unit<V, AttnType::BF16>(a, u);
    default: return attention_unit<V, AttnType::F16>(a, u);
  }
}

}  // namespace
}  // namespace hm
