// RMSNorm over rows, optionally after adding a residual in place: the decode step's norms in one call each instead
// of torch's five ops (each a dispatch costing more than the arithmetic at one token).
//
// Legend: R rows, D row length.
#pragma once

#include <cstdint>

#include "thread_pool.h"

namespace hm {

struct RmsNormArgs {
  const void* x = nullptr;   // [R, D] rows at x_stride elements
  int64_t x_stride = 0;
  void* residual = nullptr;  // [R, D] at residual_stride, or null: residual += x first, then normalise residual
  int64_t residual_stride = 0;
  const void* weight = nullptr;  // [D]
  void* out = nullptr;           // [R, D] at out_stride (may be x when there is no residual)
  int64_t out_stride = 0;
  int64_t rows = 0, dim = 0;
  bool bf16 = false;  // every array bfloat16, else float32
  float eps = 1e-6f;
};

// out[r] = weight * (v[r] / sqrt(mean(v[r]^2) + eps)) with v = x (or residual after residual += x), computed in
// float32 and rounded to bf16 as torch's reference does: the normalised row to bf16, then times the weight.
// Rows are split over the pool from 64K values (for_item_blocks).
void rms_norm(const RmsNormArgs& a, ThreadPool& pool);

// One row v [D] (float32, values of the arrays' dtype) normalised in place as rms_norm does, weight [D] in that
// dtype, the result rounded to it (bf16) so that it equals what rms_norm stores.
void rms_norm_row(float* v, int64_t dim, const void* weight, bool bf16, float eps);

}  // namespace hm
