// Paged decode attention: one query token per sequence against its context in a paged KV cache, read in place
// through the block table (no gather), grouped-query heads sharing their KV head (no repeat), online softmax in
// float32. MLA's absorbed decode is the same computation with one shared "KV head" (the latent + rope key as K,
// the latent as V: a view of the same cache with a shorter last dim).
#pragma once

#include <cstdint>
#include <vector>

#include "hm_types.h"
#include "thread_pool.h"

namespace hm {

enum class AttnType { F32, BF16, F16 };

// Strides are in elements of the array they index; every last dim is contiguous.
struct DecodeAttnArgs {
  // q [S, N, D]
  const void* q = nullptr;
  AttnType q_type = AttnType::F32;
  int64_t q_stride_seq = 0, q_stride_head = 0;
  // k [num_blocks, block_size, Nk, D], v [num_blocks, block_size, Nk, Dv], one dtype
  const void* k = nullptr;
  const void* v = nullptr;
  AttnType kv_type = AttnType::F32;
  int64_t k_stride_block = 0, k_stride_token = 0, k_stride_head = 0;
  int64_t v_stride_block = 0, v_stride_token = 0, v_stride_head = 0;
  // block_tables [S, max_blocks] (int32 or int64); seq_lens [S] (checked, >= 1)
  const void* block_tables = nullptr;
  bool block_tables_i32 = false;
  int64_t block_table_stride = 0;
  const int64_t* seq_lens = nullptr;
  // out [S, N, Dv]
  void* out = nullptr;
  AttnType out_type = AttnType::F32;
  int64_t out_stride_seq = 0, out_stride_head = 0;
  int64_t num_seqs = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, v_head_dim = 0, block_size = 0;
  float scale = 1.0f;
  int64_t window = 0;  // > 0: a query at position p attends keys p - window < j <= p (sliding window)
};

// One unit of work: sequence `seq`, KV head `kv_head`, its query heads [head0, head0 + heads), over keys
// [key_begin, key_end) of the sequence. `partial` null: the unit has the whole context (the window's keys) and
// writes the output; otherwise one part of a split context, whose running max, sum and unnormalised accumulator
// ([heads, 2 + Dv]: m, l, acc) go to `partial` for combine_partials.
struct AttnUnit {
  int64_t seq, kv_head, head0, heads, key_begin, key_end;
  float* partial = nullptr;
};

// Parts of one split context: units [first, first + parts) cover one (sequence, KV head, heads) in key order.
struct AttnSplit {
  int64_t first, parts;
};

// Query heads one unit computes at most (its accumulators stay in L1/L2 for head dims up to 576).
constexpr int64_t kAttnMaxHeadsPerUnit = 8;
// A task does at least this many multiply-adds (keys x heads x (D + Dv)), about 10 us, so that tiny steps run on
// the calling thread and short sequences share a task instead of paying a hand-off each.
constexpr int64_t kAttnMinTaskMacs = 1 << 18;

// Keys a part of a split context has at least: contexts are split only when there are fewer units than threads
// (one sequence with few KV heads on a many-core machine), into parts of at least this many keys.
constexpr int64_t kAttnMinSplitKeys = 256;

// The units of a call, and their split into tasks: task t runs units [task_begin[t], task_begin[t + 1]). Split
// contexts' parts are listed in `splits`, their partial results in `partials` (sized here; units point into it).
void plan_decode_attention(const DecodeAttnArgs& a, int threads, std::vector<AttnUnit>& units,
                           std::vector<int64_t>& task_begin, std::vector<AttnSplit>& splits,
                           std::vector<float>& partials);

// The output of every split context from its parts' partial results (online softmax's merge).
void combine_partials(const DecodeAttnArgs& a, const std::vector<AttnUnit>& units, const std::vector<AttnSplit>& splits);

// Per-ISA kernels of one unit (attention_simd.h instantiated for each vector vocabulary).
using AttnUnitFn = void (*)(const DecodeAttnArgs& a, const AttnUnit& u);
void decode_attention_unit_scalar(const DecodeAttnArgs& a, const AttnUnit& u);
void decode_attention_unit_avx2(const DecodeAttnArgs& a, const AttnUnit& u);    // x86 builds only
void decode_attention_unit_avx512(const DecodeAttnArgs& a, const AttnUnit& u);  // with HM_HAVE_AVX512 only

// The unit kernel for a kernel table (its ISA's vector width: scalar, avx2 or avx512).
AttnUnitFn attention_unit_for(const KernelTable& kt);

// out = softmax(q k^T * scale) v per sequence and head, over the pool (arguments checked by the caller).
void decode_attention(const DecodeAttnArgs& a, const KernelTable& kt, ThreadPool& pool);

}  // namespace hm
