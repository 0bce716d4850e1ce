#include "rope.h"

#include <vector>

#include "fp_convert.h"
#include "norm.h"

namespace hm {
namespace {

inline float round_as(float v, bool bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

void rope_token(const RopeArgs& a, int64_t t, std::vector<float>& row) {
  const int64_t half = a.dim / 2;
  const size_t esize = a.bf16 ? 2 : 4;
  const void* c = static_cast<const char*>(a.cos) + t * half * esize;
  const void* s = static_cast<const char*>(a.sin) + t * half * esize;
  for (int64_t n = 0; n < a.heads; ++n) {
    const void* x = static_cast<const char*>(a.x) + (t * a.x_token + n * a.x_head) * esize;
    void* out = static_cast<char*>(a.out) + (t * a.out_token + n * a.out_head) * esize;
    for (int64_t i = 0; i < a.dim; ++i) row[i] = load_f32_or_bf16(x, i, a.bf16);  // read first: out may be x
    if (a.norm_weight) rms_norm_row(row.data(), a.dim, a.norm_weight, a.bf16, a.eps);
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = a.interleaved ? row[2 * i] : row[i], x2 = a.interleaved ? row[2 * i + 1] : row[i + half];
      const float ci = load_f32_or_bf16(c, i, a.bf16), si = load_f32_or_bf16(s, i, a.bf16);
      store_f32_or_bf16(out, i, round_as(x1 * ci, a.bf16) - round_as(x2 * si, a.bf16), a.bf16);
      store_f32_or_bf16(out, i + half, round_as(x2 * ci, a.bf16) + round_as(x1 * si, a.bf16), a.bf16);
    }
  }
}

}  // namespace

void rope(const RopeArgs& a, ThreadPool& pool) {
  for_item_blocks(pool, a.tokens, a.heads * a.dim, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> row;  // one head's row in float32
    row.resize(static_cast<size_t>(a.dim));
    for (int64_t t = begin; t < end; ++t) rope_token(a, t, row);
  });
}

}  // namespace hm
