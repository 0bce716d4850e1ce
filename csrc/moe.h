// The fused routed-expert MLP of one MoE layer, and a plain matmul entry point (tests, benchmarks).
//
// compute(): hidden [T, H] (fp32 or bf16), topk ids/weights [T, K] -> out[t] = sum_k w[t,k] * expert(x[t])
// with expert(x) = down(silu(gate x) * up x). Phases, each a parallel_for over dynamically taken tasks:
//   prepare   tokens -> fp32 rows (float formats) or int8 rows quantised per group (int formats)
//   gate/up   (expert x block of I rows): both projections for the expert's tokens, silu(g) * u
//   quantise  int formats: the intermediate rows -> int8 per group
//   down      (expert x block of H rows) -> one output row per (token, expert) pair
//   combine   (token x block of H): weighted sum over the token's experts, stored in hidden's dtype
// Experts with more tokens are scheduled first so that uneven loads balance (equal loads: one block of each expert
// in turn). With several NUMA nodes, each node's threads run gate/up/quantise/down on the node's shard of the
// intermediate dimension only (see moe_shards.h), giving a partial down output per node, and combine sums the
// partials.
//
// Legend: T tokens, H hidden, K top-k, I expert intermediate, E experts, A = T*K (token, expert) pairs.
#pragma once

#include <cstdint>
#include <vector>

#include "activation_quant.h"
#include "hm_types.h"
#include "moe_shards.h"
#include "thread_pool.h"

namespace hm {

struct MoEInput {
  const void* hidden = nullptr;  // [T, H]
  bool hidden_bf16 = false;      // else float32
  int64_t tokens = 0, top_k = 0;
  const int64_t* ids = nullptr;  // [T, K], each in [0, E)
  const float* weights = nullptr;  // [T, K]
  void* out = nullptr;           // [T, H], hidden's dtype
  MatmulPath path = MatmulPath::Auto;
};

class MoELayer {
 public:
  // The experts are cut over `topology`'s nodes (one node: used as they are); copies go into `buffers` when
  // given (shard_experts).
  MoELayer(std::vector<ExpertMatrices> experts, int64_t hidden, int64_t intermediate, const NumaTopology& topology,
           const std::vector<ShardBuffer>& buffers = {});
  int64_t num_experts() const { return static_cast<int64_t>(experts_.size()); }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  const std::vector<NodeShard>& shards() const { return shards_.nodes; }
  // Every shard is a copy in node memory: the weights the layer was built from are no longer read (their
  // owners may free them). The layer keeps only their shapes and formats.
  bool owns_weights() const { return owns_weights_; }
  // Runs on `pool` (the calling thread joins as thread 0), whose NUMA nodes must be the layer's (or the layer
  // has one node: then all threads share the work).
  void compute(const MoEInput& in, const KernelTable& kt, ThreadPool& pool) const;

 private:
  std::vector<ExpertMatrices> experts_;
  int64_t hidden_, intermediate_;
  ShardedExperts shards_;
  std::vector<int> memory_nodes_;  // per shard node: the OS node its work buffers are bound to (-1: unbound)
  bool owns_weights_ = false;
  WFormat fmt_;
};

// The calling thread's MoE work buffers (the executor's, when run as one of its jobs): the shared input
// activations (node -1), then per NUMA node of the last call its intermediate activations and partial
// outputs: the OS node they are bound to (-1: unbound), their bytes, whether the binding took.
struct WorkBufferInfo {
  int node, memory_node;
  size_t bytes;
  bool bound;
};
std::vector<WorkBufferInfo> work_buffers();

// y [M, N] (contiguous) = x [M, K] (row stride ldx) @ W^T, on `pool`; x and y in fp32, or bf16 where x_bf16 /
// y_bf16 (y rounded to nearest even from the fp32 result).
void run_matmul(const Matrix& w, const void* x, bool x_bf16, int64_t m, int64_t ldx, void* y, bool y_bf16,
                MatmulPath path, const KernelTable& kt, ThreadPool& pool);

// Several matrices of one input (GQA's q / k / v projections) as run_matmul does each: y[i] [M, N_i] (contiguous)
// = x @ W_i^T, the activations prepared once and every matrix's row blocks in one parallel_for (one pool wake-up
// instead of n). The matrices must share what the activations depend on (matmul_group_mismatch).
void run_matmul_group(const Matrix* w, int n, const void* x, bool x_bf16, int64_t m, int64_t ldx, void* const* y,
                      bool y_bf16, MatmulPath path, const KernelTable& kt, ThreadPool& pool);

// What differs among w[0, n) that one preparation of the activations cannot serve (input features, int8 or float
// activations, quantisation group), or nullptr when nothing does.
const char* matmul_group_mismatch(const Matrix* w, int n);

// Per-head ("batched") matmuls, one weight matrix per head (MLA's absorbed kv_b_proj): for every head n < heads and
// token t < m, y[t, n, :] [M] = x[t, n, :] [K] @ W_n^T, W_n = w[n] [M, K]. The heads share one format and shape.
// x and y are strided over (token, head), in elements (rows contiguous; any layout whose rows do not overlap, e.g.
// a view of q's no-rope half, or [N, T, M] seen as [T, N, M]); fp32, or bf16 where x_bf16 / y_bf16 (y rounded to
// nearest even). One parallel_for on `pool` over (heads, row block) tasks sized like run_matmul's (whole heads per
// task while a head is smaller than that), each task preparing its heads' activations in its thread's buffer.
void run_matmul_heads(const Matrix* w, int64_t heads, const void* x, bool x_bf16, int64_t m, int64_t x_stride_token,
                      int64_t x_stride_head, void* y, bool y_bf16, int64_t y_stride_token, int64_t y_stride_head,
                      MatmulPath path, const KernelTable& kt, ThreadPool& pool);

// The task split of run_matmul_heads: tasks of heads_per_task whole heads, or (blocks_per_head > 1) one block of
// block_rows rows of one head.
struct HeadTasks {
  int64_t heads_per_task = 1, blocks_per_head = 1, block_rows = 0, count = 0;
};
HeadTasks matmul_heads_tasks(int64_t heads, int64_t rows, int threads, int64_t row_bytes);

// For the fp8 codes of each row r: flags[r] = kRowHasNan | kRowHasSubnormal as they occur, and bit kb of
// blocks[r * block_stride ...] set when column block kb holds a subnormal code. Runs on `pool`.
void scan_fp8_rows(const Matrix& w, uint8_t* flags, uint8_t* blocks, int64_t block_stride, ThreadPool& pool);

// Bytes per second of reading `words` 64-bit words from p, split over the pool's threads: the best of `repeats`
// rounds of a plain read and reads that prefetch each line kProbePrefetchAhead bytes ahead into L2. On 2 threads of
// an AMX Xeon a plain read took up to 1.3x as long as the prefetched ones, and the kernels' GEMV, which prefetches,
// read faster than it: a ceiling the kernels pass is no ceiling.
double measure_read_bandwidth(const uint64_t* p, int64_t words, int repeats, const KernelTable& kt, ThreadPool& pool);
// Float ops per second of register-only FMA chains on every thread of the pool.
double measure_fma_peak(double seconds, const KernelTable& kt, ThreadPool& pool);

}  // namespace hm
