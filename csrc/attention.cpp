// Paged decode attention: the work split (units of a sequence's KV head and up to 8 of its query heads, grouped
// into tasks of at least kAttnMinTaskMacs) and the choice of the unit kernel by the active ISA's vector width.
#include "attention.h"

#include <algorithm>
#include <cstring>

namespace hm {

#ifndef HM_HAVE_AVX2
void decode_attention_unit_avx2(const DecodeAttnArgs& a, const AttnUnit& u) { decode_attention_unit_scalar(a, u); }
#endif
#ifndef HM_HAVE_AVX512
void decode_attention_unit_avx512(const DecodeAttnArgs& a, const AttnUnit& u) { decode_attention_unit_avx2(a, u); }
#endif

AttnUnitFn attention_unit_for(const KernelTable& kt) {
  if (std::strcmp(kt.name, "scalar") == 0) return &decode_attention_unit_scalar;
  if (std::strncmp(kt.name, "avx2", 4) == 0) return &decode_attention_unit_avx2;
  return &decode_attention_unit_avx512;  // avx512, avx512bf16, amx
}

void plan_decode_attention(const DecodeAttnArgs& a, int threads, std::vector<AttnUnit>& units,
                           std::vector<int64_t>& task_begin) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t chunks = (group + kAttnMaxHeadsPerUnit - 1) / kAttnMaxHeadsPerUnit;
  const int64_t per_chunk = (group + chunks - 1) / chunks;
  units.clear();
  std::vector<int64_t> cost;
  int64_t total = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t ctx = a.window > 0 ? std::min(a.seq_lens[s], a.window) : a.seq_lens[s];
    for (int64_t kv = 0; kv < a.num_kv_heads; ++kv)
      for (int64_t h = 0; h < group; h += per_chunk) {
        const int64_t heads = std::min(per_chunk, group - h);
        units.push_back({s, kv, kv * group + h, heads});
        cost.push_back(ctx * heads * (a.head_dim + a.v_head_dim));
        total += cost.back();
      }
  }
  // Tasks of at least kAttnMinTaskMacs, about four a thread when there is more work than that.
  const int64_t target = std::max(kAttnMinTaskMacs, total / (4 * std::max(threads, 1)));
  task_begin.assign(1, 0);
  int64_t acc = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    acc += cost[i];
    if (acc >= target && i + 1 < units.size()) {
      task_begin.push_back(static_cast<int64_t>(i + 1));
      acc = 0;
    }
  }
  task_begin.push_back(static_cast<int64_t>(units.size()));
}

void decode_attention(const DecodeAttnArgs& a, const KernelTable& kt, ThreadPool& pool) {
  thread_local std::vector<AttnUnit> units;
  thread_local std::vector<int64_t> task_begin;
  plan_decode_attention(a, pool.size(), units, task_begin);
  const AttnUnitFn fn = attention_unit_for(kt);
  const std::vector<AttnUnit>& us = units;
  const std::vector<int64_t>& tb = task_begin;
  pool.parallel_for(static_cast<int64_t>(tb.size()) - 1, [&](int64_t task, int) {
    for (int64_t i = tb[task]; i < tb[task + 1]; ++i) fn(a, us[i]);
  });
}

}  // namespace hm
