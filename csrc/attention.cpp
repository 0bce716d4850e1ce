// Paged decode attention: the work split (units of a sequence's KV head and up to 8 of its query heads, long contexts
// split into parts when there are fewer units than threads, units grouped into tasks of at least kAttnMinTaskMacs),
// the merge of split parts, and the choice of the unit kernel by the active ISA's vector width.
#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention_simd.h"  // kAttnTile, attn_store (internal linkage: this file's own copies)

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
                           std::vector<int64_t>& task_begin, std::vector<AttnSplit>& splits,
                           std::vector<float>& partials) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t chunks = (group + kAttnMaxHeadsPerUnit - 1) / kAttnMaxHeadsPerUnit;
  const int64_t per_chunk = (group + chunks - 1) / chunks;
  units.clear();
  splits.clear();
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t ctx = a.seq_lens[s];
    const int64_t start = a.window > 0 ? std::max<int64_t>(0, ctx - a.window) : 0;
    for (int64_t kv = 0; kv < a.num_kv_heads; ++kv)
      for (int64_t h = 0; h < group; h += per_chunk)
        units.push_back({s, kv, kv * group + h, std::min(per_chunk, group - h), start, ctx});
  }
  // Fewer units than threads (one sequence with few KV heads on many cores): long contexts split into parts of at
  // least kAttnMinSplitKeys keys (whole tiles), about two units a thread in all, merged by combine_partials.
  const int64_t whole = static_cast<int64_t>(units.size());
  if (threads > 1 && whole < threads) {
    const int64_t want = (2 * static_cast<int64_t>(threads) + whole - 1) / whole;
    std::vector<AttnUnit> split_units;
    size_t floats = 0;
    for (const AttnUnit& u : units) {
      const int64_t keys = u.key_end - u.key_begin;
      const int64_t parts = std::min(want, keys / kAttnMinSplitKeys);
      if (parts < 2) {
        split_units.push_back(u);
        continue;
      }
      splits.push_back({static_cast<int64_t>(split_units.size()), parts});
      const int64_t tiles = (keys + kAttnTile - 1) / kAttnTile;
      for (int64_t p = 0; p < parts; ++p) {
        AttnUnit part = u;
        part.key_begin = u.key_begin + std::min(keys, tiles * p / parts * kAttnTile);
        part.key_end = u.key_begin + std::min(keys, tiles * (p + 1) / parts * kAttnTile);
        split_units.push_back(part);
        floats += static_cast<size_t>(u.heads * (a.v_head_dim + 2));
      }
    }
    units.swap(split_units);
    if (partials.size() < floats) partials.resize(floats);
    size_t offset = 0;
    for (const AttnSplit& sp : splits)
      for (int64_t i = sp.first; i < sp.first + sp.parts; ++i) {
        units[i].partial = partials.data() + offset;
        offset += static_cast<size_t>(units[i].heads * (a.v_head_dim + 2));
      }
  }
  // Tasks of at least kAttnMinTaskMacs, about four a thread when there is more work than that.
  std::vector<int64_t> cost(units.size());
  int64_t total = 0;
  for (size_t i = 0; i < units.size(); ++i) {
    cost[i] = (units[i].key_end - units[i].key_begin) * units[i].heads * (a.head_dim + a.v_head_dim);
    total += cost[i];
  }
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

void combine_partials(const DecodeAttnArgs& a, const std::vector<AttnUnit>& units, const std::vector<AttnSplit>& splits) {
  const int64_t Dv = a.v_head_dim;
  std::vector<float> out(static_cast<size_t>(Dv));
  for (const AttnSplit& sp : splits) {
    const AttnUnit& u0 = units[sp.first];
    for (int64_t g = 0; g < u0.heads; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = sp.first; i < sp.first + sp.parts; ++i) m = std::max(m, units[i].partial[g * (Dv + 2)]);
      float l = 0.0f;
      std::fill(out.begin(), out.end(), 0.0f);
      for (int64_t i = sp.first; i < sp.first + sp.parts; ++i) {
        const float* p = units[i].partial + g * (Dv + 2);
        const float w = std::exp(p[0] - m);
        l += p[1] * w;
        for (int64_t d = 0; d < Dv; ++d) out[d] += p[2 + d] * w;
      }
      const float inv = 1.0f / l;
      const int64_t o0 = u0.seq * a.out_stride_seq + (u0.head0 + g) * a.out_stride_head;
      for (int64_t d = 0; d < Dv; ++d) attn_store(a.out_type, a.out, o0 + d, out[d] * inv);
    }
  }
}

void decode_attention(const DecodeAttnArgs& a, const KernelTable& kt, ThreadPool& pool) {
  thread_local std::vector<AttnUnit> units;
  thread_local std::vector<int64_t> task_begin;
  thread_local std::vector<AttnSplit> splits;
  thread_local std::vector<float> partials;
  plan_decode_attention(a, pool.size(), units, task_begin, splits, partials);
  const AttnUnitFn fn = attention_unit_for(kt);
  const std::vector<AttnUnit>& us = units;
  const std::vector<int64_t>& tb = task_begin;
  pool.parallel_for(static_cast<int64_t>(tb.size()) - 1, [&](int64_t task, int) {
    for (int64_t i = tb[task]; i < tb[task + 1]; ++i) fn(a, us[i]);
  });
  if (!splits.empty()) combine_partials(a, units, splits);
}

}  // namespace hm
