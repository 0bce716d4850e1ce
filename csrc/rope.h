// Rotary position embedding of query / key rows in one call (torch: about seven ops a tensor, each a dispatch that
// costs more than its arithmetic at one token).
//
// Legend: T tokens, N heads, R rotary dims.
#pragma once

#include <cstdint>

#include "thread_pool.h"

namespace hm {

struct RopeArgs {
  const void* x = nullptr;  // [T, N, R] at strides (x_token, x_head), rows contiguous
  int64_t x_token = 0, x_head = 0;
  void* out = nullptr;      // [T, N, R] at strides (out_token, out_head); may be x itself
  int64_t out_token = 0, out_head = 0;
  const void* cos = nullptr;  // [T, R/2] contiguous, in x's dtype
  const void* sin = nullptr;
  int64_t tokens = 0, heads = 0, dim = 0;
  bool bf16 = false;         // every array bfloat16, else float32
  bool interleaved = false;  // pairs (x0, x1), (x2, x3), ... (DeepSeek) rather than (x_i, x_{i+R/2})
  const void* norm_weight = nullptr;  // [R] or null: each row RMS-normalised first (Qwen3's q_norm / k_norm)
  float eps = 1e-6f;
};

// out[t, n] = (x1 * c - x2 * s, x2 * c + x1 * s) with c, s = cos[t], sin[t] and (x1, x2) the pairs of the row (or of
// its rms_norm_row by norm_weight, the same values rms_norm would store); the
// result is in half-split layout either way (as layers/rope.py's torch version). In bf16 every product and sum is
// rounded as torch's ops round them. Tokens are split over the pool from 64K values (for_item_blocks).
void rope(const RopeArgs& a, ThreadPool& pool);

}  // namespace hm
