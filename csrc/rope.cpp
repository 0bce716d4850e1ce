#include "rope.h"

#include <algorithm>
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

inline float round_as(float v, bool bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

void rope_token(const RopeArgs& a, int64_t t, std::vector<float>& row) {
  const int64_t half = a.dim / 2;
  const size_t esize = a.bf16 ? 2 : 4;
  const void* c = static_cast<const char*>(a.cos) + t * half * esize;
  const void* s = static_cast<const char*>(a.sin) + t * half * esize;
  for (int64_t n = 0; n < a.heads; ++n) {
    const void* x = static_cast<const char*>(a.x) + (t * a.x_token + n * a.x_head) * esize;
    void* out = static_cast<char*>(a.out) + (t * a.out_token + n * a.out_head) * esize;
    for (int64_t i = 0; i < a.dim; ++i) row[i] = load(x, i, a.bf16);  // read first: out may be x
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = a.interleaved ? row[2 * i] : row[i], x2 = a.interleaved ? row[2 * i + 1] : row[i + half];
      const float ci = load(c, i, a.bf16), si = load(s, i, a.bf16);
      store(out, i, round_as(x1 * ci, a.bf16) - round_as(x2 * si, a.bf16), a.bf16);
      store(out, i + half, round_as(x2 * ci, a.bf16) + round_as(x1 * si, a.bf16), a.bf16);
    }
  }
}

}  // namespace

void rope(const RopeArgs& a, ThreadPool& pool) {
  const int64_t per_token = std::max<int64_t>(1, a.heads * a.dim);
  const int64_t per_task = std::max<int64_t>(1, kParallelElements / per_token);
  const int64_t tasks = (a.tokens + per_task - 1) / per_task;
  auto run = [&](int64_t task, int) {
    thread_local std::vector<float> row;  // one head's row in float32
    row.resize(static_cast<size_t>(a.dim));
    for (int64_t t = task * per_task, end = std::min(a.tokens, t + per_task); t < end; ++t) rope_token(a, t, row);
  };
  if (tasks <= 1) run(0, 0);
  else pool.parallel_for(tasks, run);
}

}  // namespace hm
