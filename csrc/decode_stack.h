// A decode step's decoder layers in one call: for each layer of a grouped-query-attention MoE model (Qwen3-MoE,
// Mixtral), q / k / v, RoPE (with Qwen3's q / k norms), the cache write, paged decode attention, o, the residual add
// with the post-attention norm, the router's gate and choice, the routed experts, and the residual add with the next
// norm. Each part is the same kernel call the Python decoder makes, in the same order and dtypes, so the results are
// bit for bit the same; what goes is the Python around them (about 0.3 ms a layer on 2 vCPUs, several times its warm
// cost because the weights streamed since leave the interpreter's code and data cold).
//
// Legend: S sequences (one new token each), H hidden, N query heads, Nk KV heads, D head dim, E experts, K top-k,
// NB cache blocks, BS block size.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "attention.h"
#include "hm_types.h"
#include "moe.h"
#include "router.h"
#include "thread_pool.h"

namespace hm {

// What every layer shares.
struct DecodeStackShape {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  bool bf16 = false;  // the compute dtype (residual stream, activations): bfloat16, else float32
  float eps = 1e-6f;  // RMSNorm's
  float scale = 1.0f;  // attention's softmax scale
  int64_t window = 0;  // > 0: sliding-window attention
  bool interleaved = false;  // RoPE's pairs
};

// A cache [NB, BS, heads, dim] at strides (block, token, head) in elements, its last dim contiguous.
struct CacheView {
  void* data = nullptr;
  AttnType type = AttnType::F32;
  int64_t stride_block = 0, stride_token = 0, stride_head = 0, block_size = 0;
};

// One layer's weights and KV cache (memory owned by the caller).
struct DecodeStackLayer {
  Matrix q, k, v, o;  // [N*D, H], [Nk*D, H], [Nk*D, H], [H, N*D]
  bool qkv_grouped = false;  // q / k / v share one run_matmul_group (matmul_group_mismatch found nothing)
  const void* q_norm = nullptr;  // [D] in the compute dtype, or null (no q / k norms)
  const void* k_norm = nullptr;
  CacheView k_cache, v_cache;  // [NB, BS, Nk, D] each
  const void* post_norm = nullptr;  // [H]
  Matrix gate;  // the router's [E, H], float32
  RouteArgs route;  // the router's settings (k, scores, bias, groups, normalisation, scale); arrays set per call
  const MoELayer* experts = nullptr;
  const void* next_norm = nullptr;  // [H]: the next layer's input norm, or the final norm after the last layer
};

// One step's inputs. Arrays are contiguous.
struct DecodeStackStep {
  int64_t seqs = 0;
  void* residual = nullptr;  // [S, H] compute dtype: the residual stream, updated in place
  void* x = nullptr;  // [S, H] compute dtype: the first layer's normed input in, the final norm's output out
  const void* cos = nullptr;  // [S, D/2] compute dtype
  const void* sin = nullptr;
  const int64_t* slots = nullptr;  // [S]: each new token's cache slot
  const void* block_tables = nullptr;  // [S, max_blocks] at block_table_stride, int32 or int64
  bool block_tables_i32 = false;
  int64_t block_table_stride = 0;
  const int64_t* seq_lens = nullptr;  // [S], >= 1
};

class DecodeStack {
 public:
  DecodeStack(const DecodeStackShape& shape, std::vector<DecodeStackLayer> layers);
  const DecodeStackShape& shape() const { return shape_; }
  const std::vector<DecodeStackLayer>& layers() const { return layers_; }
  // Every layer for `step`, on `pool` (the calling thread as thread 0). Arguments are checked by the caller.
  void run(const DecodeStackStep& step, const KernelTable& kt, ThreadPool& pool);

 private:
  void run_layer(const DecodeStackLayer& layer, const DecodeStackStep& step, const KernelTable& kt, ThreadPool& pool);

  DecodeStackShape shape_;
  std::vector<DecodeStackLayer> layers_;
  std::mutex mutex_;  // one step at a time: the work buffers are the stack's
  std::vector<float> buffers_;  // a layer's intermediate arrays (q, k, v, attention, o, ...), sized for the step
};

// rows [count, heads, dim] (contiguous, bf16 or float32) into the cache at slots[count] (slot = block * BS + offset);
// into another dtype rounded to nearest even, as torch's copy_ rounds.
void write_cache_rows(const void* rows, bool rows_bf16, int64_t count, int64_t heads, int64_t dim,
                      const int64_t* slots, const CacheView& cache);

}  // namespace hm
