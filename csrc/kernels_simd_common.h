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
inline typename V::F decode(const uint8_t* p) {
  if constexpr (F == WFormat::F32) return V::load(reinterpret_cast<const float*>(p));
  else if constexpr (F == WFormat::BF16) return V::load_bf16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == WFormat::F16) return V::load_f16(reinterpret_cast<const uint16_t*>(p));
  else if constexpr (F == kFp8Normal) return V::load_fp8_normal(p);
  else return V::load_fp8(p);
}

// Software prefetch of the `kBytes` bytes at p (whole cache lines).
template <I64 kBytes>
inline void prefetch_bytes(const uint8_t* p) {
  for (I64 off = 0; off < kBytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// Prefetch of R rows (stride bytes apart) as R streams: at byte `pos` of a tile's own rows, reading kStepBytes of
// each a step, the same position of each of the R rows at next, a line of each as the position enters a new
// cache line (every line of the step where a step spans lines).
template <int R, I64 kStepBytes>
inline void prefetch_row_streams(const uint8_t* next, I64 stride, I64 pos) {
  if constexpr (kStepBytes >= 64) {
    for (int i = 0; i < R; ++i)
      for (I64 off = 0; off < kStepBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + i * stride + pos + off), _MM_HINT_T0);
  } else if (static_cast<uint64_t>(pos) % 64 < static_cast<uint64_t>(kStepBytes)) {
    // (unsigned: GCC 12 emitted no prefetch at all for the signed `(pos & 63) < kStepBytes` in the fp8 GEMV)
    for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(next + i * stride + pos), _MM_HINT_T0);
  }
}

// The R rows after the tile starting at row r, to prefetch while the tile is read, or nullptr: only when they
// lie within the task's rows [.., r1) and are stored back to back (row_bytes == row_read_bytes, the bytes a
// tile reads per row), since the prefetches take them as R back-to-back rows.
inline const uint8_t* next_tile_rows(const Matrix& w, I64 r, I64 r1, I64 R, I64 row_read_bytes) {
  return r + 2 * R <= r1 && w.row_bytes == row_read_bytes ? w.data + (r + R) * w.row_bytes : nullptr;
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
