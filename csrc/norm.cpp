#include "norm.h"

#include <cmath>
#include <vector>

#include "fp_convert.h"

namespace hm {
namespace {

void norm_row(const RmsNormArgs& a, int64_t r, float* v) {
  const int64_t D = a.dim;
  const size_t esize = a.bf16 ? 2 : 4;
  const void* x = static_cast<const char*>(a.x) + r * a.x_stride * esize;
  void* out = static_cast<char*>(a.out) + r * a.out_stride * esize;
  if (a.residual) {  // residual += x in the arrays' dtype (bf16: rounded, as torch's add is)
    void* res = static_cast<char*>(a.residual) + r * a.residual_stride * esize;
    for (int64_t i = 0; i < D; ++i) {
      const float sum = load_f32_or_bf16(res, i, a.bf16) + load_f32_or_bf16(x, i, a.bf16);
      store_f32_or_bf16(res, i, sum, a.bf16);
      v[i] = a.bf16 ? bf16_to_float(float_to_bf16(sum)) : sum;
    }
  } else {
    for (int64_t i = 0; i < D; ++i) v[i] = load_f32_or_bf16(x, i, a.bf16);
  }
  rms_norm_row(v, D, a.weight, a.bf16, a.eps);
  for (int64_t k = 0; k < D; ++k) store_f32_or_bf16(out, k, v[k], a.bf16);
}

}  // namespace

void rms_norm_row(float* v, int64_t dim, const void* weight, bool bf16, float eps) {
  float squares[8] = {};  // eight partial sums: vectorisable, and closer to torch's pairwise mean than one chain
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8)
    for (int j = 0; j < 8; ++j) squares[j] += v[i + j] * v[i + j];
  float total = 0.0f;
  for (; i < dim; ++i) total += v[i] * v[i];
  for (int j = 0; j < 8; ++j) total += squares[j];
  const float inv = 1.0f / std::sqrt(total / static_cast<float>(dim) + eps);
  for (int64_t k = 0; k < dim; ++k) {
    float normed = v[k] * inv;
    if (bf16) normed = bf16_to_float(float_to_bf16(normed));
    const float scaled = load_f32_or_bf16(weight, k, bf16) * normed;
    v[k] = bf16 ? bf16_to_float(float_to_bf16(scaled)) : scaled;
  }
}

void rms_norm(const RmsNormArgs& a, ThreadPool& pool) {
  for_item_blocks(pool, a.rows, a.dim, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> v;  // the row in float32 (after the residual add)
    v.resize(static_cast<size_t>(a.dim));
    for (int64_t r = begin; r < end; ++r) norm_row(a, r, v.data());
  });
}

}  // namespace hm
