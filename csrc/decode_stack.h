// A decode step's decoder layers in one call: per layer the attention (grouped-query: Qwen3-MoE, Mixtral; or
// multi-head latent: DeepSeek-V3, Kimi-K2), the residual add with the post-attention norm, the MLP (routed experts
// with the router's gate and choice, and shared experts where the model has them; or a dense gated MLP), and the
// residual add with the next norm. Each part is the same kernel call the Python decoder makes, in the same order and
// dtypes, so the results are bit for bit the same; what goes is the Python around them (about 0.3 ms a layer on
// 2 vCPUs, several times its warm cost because the weights streamed since leave the interpreter's code and data cold).
//
// Legend: S sequences (one new token each), H hidden, N query heads, Nk KV heads, D head dim (GQA), P / R / V the
// no-rope, rope and value dims of an MLA head, L the latent (kv_lora_rank), Lq the query's latent (q_lora_rank),
// I an MLP's intermediate, E experts, K top-k, NB cache blocks, BS block size.
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
  int64_t hidden = 0, heads = 0;
  bool mla = false;
  int64_t kv_heads = 0, head_dim = 0;  // GQA
  int64_t nope_dim = 0, rope_dim = 0, v_dim = 0, lora = 0, q_lora = 0;  // MLA (q_lora 0: no query latent)
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

// down(silu(gate x) * up x): gate and up into float32 (one run_matmul_group where they share their activations),
// silu(g) * u by the kernel table's silu_mul, rounded to the compute dtype, then down.
struct GatedMlpWeights {
  Matrix gate, up, down;  // [I, H], [I, H], [H, I]
  bool grouped = false;
};

// One layer's weights and KV cache (memory owned by the caller).
struct DecodeStackLayer {
  // GQA
  Matrix q, k, v;  // [N*D, H], [Nk*D, H], [Nk*D, H]
  bool qkv_grouped = false;  // q / k / v share one run_matmul_group (matmul_group_mismatch found nothing)
  const void* q_norm = nullptr;  // [D] in the compute dtype, or null (no q / k norms)
  const void* k_norm = nullptr;
  // MLA: q = q_proj x, or q_b(q_a_norm(q_a x)) (q_lora); [latent, k_pe] = kv_a x; the absorbed products per head
  Matrix q_first, q_b, kv_a;  // [N*(P+R), H] or [Lq, H]; [N*(P+R), Lq]; [L+R, H]
  bool first_grouped = false;  // q_first and kv_a in one run_matmul_group
  const void* q_a_norm = nullptr;  // [Lq]
  const void* kv_a_norm = nullptr;  // [L]
  std::vector<Matrix> uk, uv;  // N each: W_uk^T [L, P], W_uv [V, L]
  Matrix o;  // [H, N*D] or [H, N*V]
  CacheView k_cache, v_cache;  // GQA: [NB, BS, Nk, D] each; MLA: the latents [NB, BS, 1, L+R], V their first L
  const void* post_norm = nullptr;  // [H]
  // the MLP: routed experts (experts != null: the router's float32 gate [E, H], its settings, the shared experts'
  // weights when has_shared), else the dense gated MLP
  const MoELayer* experts = nullptr;
  Matrix gate;
  RouteArgs route;  // k, scores, bias, groups, normalisation, scale; arrays set per call
  bool has_shared = false;
  GatedMlpWeights mlp;  // the shared experts, or the dense MLP
  const void* next_norm = nullptr;  // [H]: the next layer's input norm, or the final norm after the last layer
};

// One step's inputs. Arrays are contiguous.
struct DecodeStackStep {
  int64_t seqs = 0;
  void* residual = nullptr;  // [S, H] compute dtype: the residual stream, updated in place
  void* x = nullptr;  // [S, H] compute dtype: the first layer's normed input in, the final norm's output out
  const void* cos = nullptr;  // [S, rotary dims / 2] compute dtype
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
