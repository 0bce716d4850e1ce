#include "norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fp_convert.h"

namespace hm {
namespace {

constexpr int64_t kParallelElements = 1 << 16;  // below this a pool hand-off costs more than the rows

inline float load(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store(void* p, int64_t i, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

void norm_row(const RmsNormArgs& a, int64_t r, float* v) {
  const int64_t D = a.dim;
  const size_t esize = a.bf16 ? 2 : 4;
  const void* x = static_cast<const char*>(a.x) + r * a.x_stride * esize;
  void* out = static_cast<char*>(a.out) + r * a.out_stride * esize;
  if (a.residual) {  // residual += x in the arrays' dtype (bf16: rounded, as torch's add is)
    void* res = static_cast<char*>(a.residual) + r * a.residual_stride * esize;
    for (int64_t i = 0; i < D; ++i) {
      const float sum = load(res, i, a.bf16) + load(x, i, a.bf16);
      store(res, i, sum, a.bf16);
      v[i] = a.bf16 ? bf16_to_float(float_to_bf16(sum)) : sum;
    }
  } else {
    for (int64_t i = 0; i < D; ++i) v[i] = load(x, i, a.bf16);
  }
  float squares[8] = {};  // eight partial sums: vectorisable, and closer to torch's pairwise mean than one chain
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    for (int j = 0; j < 8; ++j) squares[j] += v[i + j] * v[i + j];
  float total = 0.0f;
  for (; i < D; ++i) total += v[i] * v[i];
  for (int j = 0; j < 8; ++j) total += squares[j];
  const float inv = 1.0f / std::sqrt(total / static_cast<float>(D) + a.eps);
  for (int64_t k = 0; k < D; ++k) {
    float normed = v[k] * inv;
    if (a.bf16) normed = bf16_to_float(float_to_bf16(normed));
    store(out, k, load(a.weight, k, a.bf16) * normed, a.bf16);
  }
}

}  // namespace

void rms_norm(const RmsNormArgs& a, ThreadPool& pool) {
  const int64_t per_task = std::max<int64_t>(1, kParallelElements / std::max<int64_t>(1, a.dim));
  const int64_t tasks = (a.rows + per_task - 1) / per_task;
  auto run = [&](int64_t task, int) {
    thread_local std::vector<float> v;  // the row in float32 (after the residual add)
    v.resize(static_cast<size_t>(a.dim));
    for (int64_t r = task * per_task, end = std::min(a.rows, r + per_task); r < end; ++r) norm_row(a, r, v.data());
  };
  if (tasks <= 1) run(0, 0);
  else pool.parallel_for(tasks, run);
}

}  // namespace hm
