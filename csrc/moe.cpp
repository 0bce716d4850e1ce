// Fused MoE driver, matmul entry point, activation quantisation and machine probes (see moe.h).
#include "moe.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fp_convert.h"

namespace hm {

namespace {

using I64 = int64_t;

I64 round_up(I64 v, I64 m) { return (v + m - 1) / m * m; }
I64 ceil_div(I64 a, I64 b) { return (a + b - 1) / b; }

// Activation rows of one matrix format, owned; the storage (on one OS node, or unbound) is reused by later
// init calls.
struct ActBuffer {
  I64 rows = 0, k = 0;
  NodeBuffer<float> x;  // [rows, ldx], zero-padded
  I64 ldx = 0;
  NodeBuffer<int8_t> q;  // [rows, ldq]
  I64 ldq = 0, ldg = 0, group = 0;
  NodeBuffer<float> qscale, qsum;  // [rows, ldg]

  // Sized for `rows` inputs of length k feeding matrices like `w` (float rows, or int8 rows per group). Only
  // each row's padding beyond k is zeroed: the caller writes [0, k) of every row it uses, and quantize()
  // writes whole groups.
  void init(I64 n_rows, const Matrix& w, int node = -1) {
    rows = n_rows;
    k = w.cols;
    ldx = round_up(k + 1, 16);  // + 1 keeps rows from aliasing cache sets when k is a power of two
    x.grow(rows * ldx, node);
    for (I64 r = 0; r < rows; ++r) std::fill(row(r) + k, row(r) + ldx, 0.0f);
    group = 0;
    if (is_int_format(w.fmt)) {
      group = w.group;
      ldq = w.padded_cols;
      ldg = w.padded_cols / w.group;
      q.grow(rows * ldq, node);
      qscale.grow(rows * ldg, node);
      qsum.grow(rows * ldg, node);
    }
  }
  size_t bytes() const { return x.bytes() + q.bytes() + qscale.bytes() + qsum.bytes(); }
  bool bound() const { return x.bound() && (!group || (q.bound() && qscale.bound() && qsum.bound())); }
  float* row(I64 r) { return x.data() + r * ldx; }
  void quantize(I64 r, const KernelTable& kt) {
    if (group)
      kt.quantize_row(row(r), k, ldq, static_cast<int>(group), q.data() + r * ldq, qscale.data() + r * ldg,
                      qsum.data() + r * ldg);
  }
  Activations view(I64 m, const int32_t* row_index, I64 first_row) const {
    Activations a;
    a.m = m;
    a.k = k;
    a.x = x.data() + first_row * ldx;
    a.ldx = ldx;
    if (group) {
      a.q = q.data() + first_row * ldq;
      a.ldq = ldq;
      a.qscale = qscale.data() + first_row * ldg;
      a.qsum = qsum.data() + first_row * ldg;
      a.ldg = ldg;
    }
    a.rows = row_index;
    return a;
  }
};

// Rows per task: blocks of 128 rows (1024 for the float GEMM path: it transposes the tokens' activations once
// per task), doubled while a task would read less than kTaskMinBytes of weights (row_bytes: of all the matrices
// the task reads), then halved (down to 16) until there are >= 8 tasks per thread. A task starts cold (its first
// tile is not prefetched), so short rows (Qwen3-30B-A3B's down projection) need long tasks (docs/kernels.md).
constexpr I64 kTaskMinBytes = 512 << 10;

// Whether `tokens` tokens of format f take the float GEMM panels, which transpose the tokens' activations once per
// task (the int formats and AMX tiles work per row block).
bool transposes_per_task(MatmulPath path, I64 tokens, WFormat f, const KernelTable& kt) {
  return use_gemm(path, tokens, f, kt.bf16_dot) && !is_int_format(f) && !(kt.amx && use_amx(path, tokens, f));
}

I64 task_rows(I64 rows, I64 num_slots, int threads, I64 row_bytes, bool gemm = false) {
  I64 blk = gemm ? 1024 : 128;
  while (blk * row_bytes < kTaskMinBytes && blk < rows) blk *= 2;
  while (blk > 16 && num_slots * ceil_div(rows, blk) < 8 * static_cast<I64>(threads)) blk /= 2;
  return blk;
}

// Buffers of one thread's MoE calls, reused (a T = 256 call of DeepSeek-V3 shapes needs ~80 MB; fresh pages
// would cost a fault each on every call). Each node's intermediate activations and partial outputs live in
// its own memory (when the layer's topology binds memory), since that node's threads write and read them.
struct Workspace {
  ActBuffer xin;                              // shared by the nodes
  std::vector<ActBuffer> inter;               // per node
  NodeBuffer<float> scratch;                  // per thread slices of gate/up outputs (cache-sized)
  std::vector<NodeBuffer<float>> y;           // per node
  int nodes = 0;                              // nodes of the last call
};

Workspace& workspace() {
  static thread_local Workspace ws;
  return ws;
}

}  // namespace

std::vector<WorkBufferInfo> work_buffers() {
  const Workspace& ws = workspace();
  std::vector<WorkBufferInfo> info;
  info.push_back({-1, ws.xin.x.node(), ws.xin.bytes(), ws.xin.bound()});
  for (size_t n = 0; n < static_cast<size_t>(ws.nodes); ++n)
    info.push_back({static_cast<int>(n), ws.inter[n].x.node(), ws.inter[n].bytes() + ws.y[n].bytes(),
                    ws.inter[n].bound() && ws.y[n].bound()});
  return info;
}

MoELayer::MoELayer(std::vector<ExpertMatrices> experts, I64 hidden, I64 intermediate, const NumaTopology& topology,
                   const std::vector<ShardBuffer>& buffers)
    : experts_(std::move(experts)), hidden_(hidden), intermediate_(intermediate) {
  if (experts_.empty()) throw std::invalid_argument("MoE layer needs at least one expert");
  fmt_ = experts_[0].gate.fmt;
  for (size_t e = 0; e < experts_.size(); ++e) {
    const ExpertMatrices& x = experts_[e];
    for (const Matrix* m : {&x.gate, &x.up, &x.down})
      if (m->fmt != fmt_) throw std::invalid_argument("expert " + std::to_string(e) + ": all matrices must share one format");
    if (x.gate.rows != intermediate || x.gate.cols != hidden || x.up.rows != intermediate || x.up.cols != hidden ||
        x.down.rows != hidden || x.down.cols != intermediate)
      throw std::invalid_argument("expert " + std::to_string(e) + ": gate/up must be [I, H] and down [H, I] with H=" +
                                  std::to_string(hidden) + ", I=" + std::to_string(intermediate));
    if (is_int_format(fmt_) && x.gate.group != x.up.group)
      throw std::invalid_argument("expert " + std::to_string(e) + ": gate and up must share a group size");
  }
  shards_ = shard_experts(experts_, intermediate_, topology, buffers);
  const int N = static_cast<int>(shards_.nodes.size());
  memory_nodes_.assign(static_cast<size_t>(N), -1);
  if (N > 1) memory_nodes_ = topology.memory_node;
  owns_weights_ = true;  // every node computes from its copy (several nodes, or one with HYBRIDMOE_COPY_EXPERTS=1)
  for (const NodeShard& shard : shards_.nodes) owns_weights_ &= shard.experts.empty() || shard.copied_bytes > 0;
  if (owns_weights_)  // only shapes and formats are read from here on: no pointer into the originals is kept
    for (ExpertMatrices& e : experts_)
      for (Matrix* m : {&e.gate, &e.up, &e.down}) {
        m->data = nullptr;
        m->scales = nullptr;
        m->row_flags = nullptr;
        m->subnormal_blocks = nullptr;
      }
}

void MoELayer::compute(const MoEInput& in, const KernelTable& kt, ThreadPool& pool) const {
  const I64 T = in.tokens, K = in.top_k, H = hidden_, I = intermediate_, E = num_experts();
  if (T == 0) return;
  const int threads = pool.size();

  // Routing: the (token, k) pairs of each expert, experts with more tokens first.
  std::vector<I64> count(static_cast<size_t>(E), 0);
  for (I64 a = 0; a < T * K; ++a) ++count[static_cast<size_t>(in.ids[a])];
  std::vector<I64> slots;  // active experts, by descending token count
  for (I64 e = 0; e < E; ++e)
    if (count[static_cast<size_t>(e)]) slots.push_back(e);
  std::stable_sort(slots.begin(), slots.end(), [&](I64 a, I64 b) { return count[a] > count[b]; });
  const I64 S = static_cast<I64>(slots.size());
  std::vector<I64> slot_begin(static_cast<size_t>(S + 1), 0), slot_of(static_cast<size_t>(E), -1);
  for (I64 s = 0; s < S; ++s) {
    slot_begin[s + 1] = slot_begin[s] + count[slots[s]];
    slot_of[slots[s]] = s;
  }
  // A task's (slot, block of rows) among S x blocks. Experts with more tokens go first (slot-major), so that the last
  // tasks are the light ones. Where every active expert has as many tokens (T = 1, among others) consecutive tasks
  // go to different experts (block-major), so that the threads read different experts' matrices at once rather
  // than neighbouring blocks of one.
  const bool equal_loads = count[slots.front()] == count[slots.back()];
  auto slot_block = [&](I64 task, I64 blocks) {
    return equal_loads ? std::pair<I64, I64>(task % S, task / S) : std::pair<I64, I64>(task / blocks, task % blocks);
  };
  std::vector<int32_t> pair_token(static_cast<size_t>(T * K));  // pair row (grouped by slot) -> token
  std::vector<I64> pair_row(static_cast<size_t>(T * K));        // (t, k) -> pair row
  {
    std::vector<I64> fill(slot_begin.begin(), slot_begin.end() - 1);
    for (I64 t = 0; t < T; ++t)
      for (I64 k = 0; k < K; ++k) {
        const I64 row = fill[slot_of[in.ids[t * K + k]]]++;
        pair_token[row] = static_cast<int32_t>(t);
        pair_row[t * K + k] = row;
      }
  }

  // Nodes: each computes its intermediate range [begin, end) into its own buffers (one node: all of I).
  const std::vector<NodeShard>& nodes = shards_.nodes;
  const int N = static_cast<int>(nodes.size());
  if (N > 1 && pool.num_nodes() != N)
    throw std::invalid_argument("this MoE layer was split over " + std::to_string(N) +
                                " NUMA nodes but the thread pool has " + std::to_string(pool.num_nodes()) +
                                "; build the layer after configuring the NUMA nodes");
  auto node_threads = [&](int n) { return N > 1 ? pool.node_threads(n) : threads; };
  auto active = [&](int n) { return nodes[n].begin < nodes[n].end; };

  Workspace& ws = workspace();
  ws.nodes = 0;  // set again once every node's buffers are sized

  // prepare: hidden -> activations for gate/up (shared by the nodes)
  const I64 first_expert = slots[0];
  ActBuffer& xin = ws.xin;
  xin.init(T, experts_[first_expert].gate);
  pool.parallel_for(T, [&](I64 t, int) {
    float* dst = xin.row(t);
    if (in.hidden_bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(in.hidden) + t * H;
      for (I64 h = 0; h < H; ++h) dst[h] = bf16_to_float(src[h]);
    } else {
      std::memcpy(dst, static_cast<const float*>(in.hidden) + t * H, static_cast<size_t>(H) * sizeof(float));
    }
    xin.quantize(t, kt);
  });

  // gate/up: per node (slot x block of its I rows) -> inter[n][pair row, i - begin] = silu(gate) * up
  if (static_cast<int>(ws.inter.size()) < N) ws.inter.resize(static_cast<size_t>(N));
  std::vector<ActBuffer>& inter = ws.inter;
  std::vector<I64> blk_i(static_cast<size_t>(N), 1), blocks_i(static_cast<size_t>(N), 0), tasks(static_cast<size_t>(N));
  I64 max_tokens = 0, max_blk = 1;
  for (I64 s = 0; s < S; ++s) max_tokens = std::max(max_tokens, slot_begin[s + 1] - slot_begin[s]);
  const bool gemm = transposes_per_task(in.path, max_tokens, fmt_, kt);
  for (int n = 0; n < N; ++n) {
    if (!active(n)) continue;
    const I64 rows = nodes[n].end - nodes[n].begin;
    inter[n].init(T * K, nodes[n].experts[first_expert].down, memory_nodes_[n]);
    const ExpertMatrices& first = nodes[n].experts[first_expert];
    blk_i[n] = task_rows(rows, S, node_threads(n), first.gate.row_bytes + first.up.row_bytes, gemm);
    blocks_i[n] = ceil_div(rows, blk_i[n]);
    max_blk = std::max(max_blk, blk_i[n]);
  }
  for (int n = 0; n < N; ++n) tasks[n] = S * blocks_i[n];
  float* scratch = ws.scratch.grow(static_cast<I64>(threads) * 2 * max_tokens * max_blk, -1);
  pool.parallel_for_nodes(tasks, [&](int n, I64 task, int thread) {
    const I64 bi = blk_i[n], rows = nodes[n].end - nodes[n].begin;
    const auto [s, block] = slot_block(task, blocks_i[n]);
    const I64 r0 = block * bi, r1 = std::min(rows, r0 + bi);
    const ExpertMatrices& ex = nodes[n].experts[slots[s]];
    const I64 m = slot_begin[s + 1] - slot_begin[s];
    const Activations acts = xin.view(m, pair_token.data() + slot_begin[s], 0);
    float* g = scratch + static_cast<size_t>(thread) * 2 * max_tokens * max_blk;
    float* u = g + max_tokens * bi;
    kt.matmul(ex.gate, r0, r1, acts, g, bi, in.path);
    kt.matmul(ex.up, r0, r1, acts, u, bi, in.path);
    for (I64 j = 0; j < m; ++j) kt.silu_mul(g + j * bi, u + j * bi, inter[n].row(slot_begin[s] + j) + r0, r1 - r0);
  });
  if (is_int_format(fmt_)) {
    for (int n = 0; n < N; ++n) tasks[n] = active(n) ? T * K : 0;
    pool.parallel_for_nodes(tasks, [&](int n, I64 row, int) { inter[n].quantize(row, kt); });
  }

  // down: per node (slot x block of H rows) -> y[n][pair row, h], the node's partial over its I columns
  if (static_cast<int>(ws.y.size()) < N) ws.y.resize(static_cast<size_t>(N));
  std::vector<NodeBuffer<float>>& y = ws.y;
  std::vector<I64> blk_h(static_cast<size_t>(N), 1), blocks_h(static_cast<size_t>(N), 0);
  for (int n = 0; n < N; ++n) {
    if (!active(n)) continue;
    y[n].grow(T * K * H, memory_nodes_[n]);  // every element is written by the down phase
    blk_h[n] = task_rows(H, S, node_threads(n), nodes[n].experts[first_expert].down.row_bytes, gemm);
    blocks_h[n] = ceil_div(H, blk_h[n]);
  }
  ws.nodes = N;
  for (int n = 0; n < N; ++n) tasks[n] = S * blocks_h[n];
  pool.parallel_for_nodes(tasks, [&](int n, I64 task, int) {
    const auto [s, block] = slot_block(task, blocks_h[n]);
    const I64 r0 = block * blk_h[n], r1 = std::min(H, r0 + blk_h[n]);
    const I64 m = slot_begin[s + 1] - slot_begin[s];
    const Activations acts = inter[n].view(m, nullptr, slot_begin[s]);
    kt.matmul(nodes[n].experts[slots[s]].down, r0, r1, acts, y[n].data() + slot_begin[s] * H + r0, H, in.path);
  });

  // combine: out[t, h] = sum_k w[t, k] * sum_n y[n][pair(t, k), h]
  std::vector<const float*> partials;
  for (int n = 0; n < N; ++n)
    if (active(n)) partials.push_back(y[n].data());
  const I64 blk_c = 512, blocks_c = ceil_div(H, blk_c);
  pool.parallel_for(T * blocks_c, [&](I64 task, int) {
    const I64 t = task / blocks_c, h0 = (task % blocks_c) * blk_c, h1 = std::min(H, h0 + blk_c);
    float acc[512];
    std::fill(acc, acc + (h1 - h0), 0.0f);
    for (I64 k = 0; k < K; ++k) {
      const float wk = in.weights[t * K + k];
      for (const float* part : partials) {
        const float* src = part + pair_row[t * K + k] * H;
        for (I64 h = h0; h < h1; ++h) acc[h - h0] += wk * src[h];
      }
    }
    if (in.hidden_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(in.out) + t * H;
      for (I64 h = h0; h < h1; ++h) dst[h] = float_to_bf16(acc[h - h0]);
    } else {
      std::memcpy(static_cast<float*>(in.out) + t * H + h0, acc, static_cast<size_t>(h1 - h0) * sizeof(float));
    }
  });
}

// Rows per task of a plain matmul (the model's projections): every task reads at least kMatmulTaskBytes of
// weights, so a small matrix is one task that runs on the caller (a pool hand-off costs more than it reads),
// and a large one is cut into about 4 tasks per thread (whole 8-row panels) to balance them; one per thread on
// the float GEMM path (`gemm`), whose every task transposes all the tokens' activations (at 512 tokens of
// Qwen3-30B-A3B's k projection, a task of a quarter of its rows would transpose as many floats as it multiplies
// per 64 rows of weights).
constexpr I64 kMatmulTaskBytes = 64 << 10;
I64 matmul_task_rows(I64 rows, int threads, I64 row_bytes, bool gemm) {
  const I64 least = std::max<I64>(1, ceil_div(kMatmulTaskBytes, std::max<I64>(1, row_bytes)));
  const I64 balanced = round_up(ceil_div(rows, (gemm ? 1 : 4) * static_cast<I64>(threads)), 8);
  return std::min(rows, std::max(least, balanced));
}

namespace {

// dst[i] = src[i] rounded to bf16, nearest even as torch does (branch-free, so that it vectorises; NaN stays NaN).
inline void round_to_bf16(const float* src, uint16_t* dst, I64 n) {
  for (I64 i = 0; i < n; ++i) {
    const uint32_t u = float_to_bits(src[i]);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
  }
}

// Activation row r of `acts` from src [k] (fp32 or bf16 bits), quantised where the format wants it.
inline void load_act_row(ActBuffer& acts, I64 r, const void* src, bool bf16, const KernelTable& kt) {
  float* row = acts.row(r);
  if (bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (I64 k = 0; k < acts.k; ++k) row[k] = bits_to_float(static_cast<uint32_t>(s[k]) << 16);
  } else {
    std::memcpy(row, src, static_cast<size_t>(acts.k) * sizeof(float));
  }
  acts.quantize(r, kt);
}

}  // namespace

void run_matmul(const Matrix& w, const void* x, bool x_bf16, I64 m, I64 ldx, void* y, bool y_bf16, MatmulPath path,
                const KernelTable& kt, ThreadPool& pool) {
  run_matmul_group(&w, 1, x, x_bf16, m, ldx, &y, y_bf16, path, kt, pool);
}

const char* matmul_group_mismatch(const Matrix* w, int n) {
  for (int i = 1; i < n; ++i) {
    if (w[i].cols != w[0].cols) return "input features";
    if (is_int_format(w[i].fmt) != is_int_format(w[0].fmt)) return "activation form (int8 groups or float)";
    if (is_int_format(w[0].fmt) && (w[i].group != w[0].group || w[i].padded_cols != w[0].padded_cols))
      return "quantisation group";
  }
  return nullptr;
}

// Tokens from which the activations are prepared (converted, quantised) by the pool: a 512-token prompt's at 4096
// features took 1.8 ms on the caller alone; a decode step's row stays there.
constexpr I64 kParallelPrepareRows = 16;

void run_matmul_group(const Matrix* w, int n, const void* x, bool x_bf16, I64 m, I64 ldx, void* const* y, bool y_bf16,
                      MatmulPath path, const KernelTable& kt, ThreadPool& pool) {
  thread_local ActBuffer acts;  // reused: a decode step calls this for every projection
  thread_local std::vector<float> y_f32;  // bf16 output: each task's float rows, rounded into y by that task
  thread_local std::vector<I64> first_task, blk, y_off;  // per matrix: its first task, rows a task, y_f32 offset
  acts.init(m, w[0]);
  const I64 x_elem = x_bf16 ? 2 : 4;
  ActBuffer& buf = acts;  // a lambda naming `acts` would reach each pool thread's own thread_local
  auto prepare = [&](I64 r, int) { load_act_row(buf, r, static_cast<const char*>(x) + r * ldx * x_elem, x_bf16, kt); };
  if (m >= kParallelPrepareRows) pool.parallel_for(m, prepare);
  else for (I64 r = 0; r < m; ++r) prepare(r, 0);
  first_task.assign(static_cast<size_t>(n) + 1, 0);
  blk.resize(static_cast<size_t>(n));
  y_off.assign(static_cast<size_t>(n) + 1, 0);
  for (int i = 0; i < n; ++i) {
    blk[i] = matmul_task_rows(w[i].rows, pool.size(), w[i].row_bytes, transposes_per_task(path, m, w[i].fmt, kt));
    first_task[i + 1] = first_task[i] + ceil_div(w[i].rows, blk[i]);
    y_off[i + 1] = y_off[i] + m * w[i].rows;
  }
  if (y_bf16 && y_f32.size() < static_cast<size_t>(y_off[n])) y_f32.resize(static_cast<size_t>(y_off[n]));
  const Activations view = acts.view(m, nullptr, 0);
  // the pool's threads see their own thread_locals: hand them this thread's buffers
  const I64 *tasks0 = first_task.data(), *rows_per_task = blk.data(), *offset = y_off.data();
  float* y_tmp = y_f32.data();
  pool.parallel_for(tasks0[n], [&](I64 task, int) {
    const int i = static_cast<int>(std::upper_bound(tasks0, tasks0 + n + 1, task) - tasks0) - 1;
    const Matrix& wi = w[i];
    const I64 r0 = (task - tasks0[i]) * rows_per_task[i], r1 = std::min(wi.rows, r0 + rows_per_task[i]);
    float* yf = y_bf16 ? y_tmp + offset[i] : static_cast<float*>(y[i]);
    kt.matmul(wi, r0, r1, view, yf + r0, wi.rows, path);  // rows [r0, r1) straight into y's columns
    if (y_bf16) {
      uint16_t* yb = static_cast<uint16_t*>(y[i]);
      for (I64 t = 0; t < m; ++t) round_to_bf16(yf + t * wi.rows + r0, yb + t * wi.rows + r0, r1 - r0);
    }
  });
}

HeadTasks matmul_heads_tasks(I64 heads, I64 rows, int threads, I64 row_bytes) {
  // as matmul_task_rows, over the rows of every head: at least kMatmulTaskBytes of weights a task, about four
  // tasks a thread
  const I64 least = std::max<I64>(1, ceil_div(kMatmulTaskBytes, std::max<I64>(1, row_bytes)));
  const I64 balanced = round_up(ceil_div(heads * rows, 4 * static_cast<I64>(threads)), 8);
  const I64 want = std::max(least, balanced);
  HeadTasks t;
  if (want >= rows) {  // whole heads: a head's activations are prepared once
    t.heads_per_task = std::min(heads, want / rows);
    t.block_rows = rows;
    t.count = ceil_div(heads, t.heads_per_task);
  } else {  // each head cut into equal blocks of whole 8-row panels
    t.block_rows = std::min(rows, round_up(ceil_div(rows, ceil_div(rows, want)), 8));
    t.blocks_per_head = ceil_div(rows, t.block_rows);
    t.count = heads * t.blocks_per_head;
  }
  return t;
}

void run_matmul_heads(const Matrix* w, I64 heads, const void* x, bool x_bf16, I64 m, I64 x_stride_token,
                      I64 x_stride_head, void* y, bool y_bf16, I64 y_stride_token, I64 y_stride_head, MatmulPath path,
                      const KernelTable& kt, ThreadPool& pool) {
  if (heads <= 0 || m <= 0) return;
  const I64 M = w[0].rows, x_elem = x_bf16 ? 2 : 4, y_elem = y_bf16 ? 2 : 4;
  const HeadTasks split = matmul_heads_tasks(heads, M, pool.size(), w[0].row_bytes);
  pool.parallel_for(split.count, [&](I64 task, int) {
    thread_local ActBuffer acts;            // this thread's heads' activations, reused across calls
    thread_local std::vector<float> y_f32;  // bf16 output: the block's float rows before rounding
    I64 n0 = task * split.heads_per_task, n1 = std::min(heads, n0 + split.heads_per_task), r0 = 0, r1 = M;
    if (split.blocks_per_head > 1) {
      n0 = task / split.blocks_per_head;
      n1 = n0 + 1;
      r0 = (task % split.blocks_per_head) * split.block_rows;
      r1 = std::min(M, r0 + split.block_rows);
    }
    acts.init(m, w[n0]);
    if (y_bf16 && y_f32.size() < static_cast<size_t>(m * (r1 - r0))) y_f32.resize(static_cast<size_t>(m * (r1 - r0)));
    const Activations view = acts.view(m, nullptr, 0);
    for (I64 n = n0; n < n1; ++n) {
      for (I64 t = 0; t < m; ++t)
        load_act_row(acts, t, static_cast<const char*>(x) + (t * x_stride_token + n * x_stride_head) * x_elem, x_bf16,
                     kt);
      char* yn = static_cast<char*>(y) + (n * y_stride_head + r0) * y_elem;
      if (!y_bf16) {  // straight into y: token t's rows [r0, r1) at yn + t * y_stride_token
        kt.matmul(w[n], r0, r1, view, reinterpret_cast<float*>(yn), m > 1 ? y_stride_token : M, path);
        continue;
      }
      kt.matmul(w[n], r0, r1, view, y_f32.data(), r1 - r0, path);
      for (I64 t = 0; t < m; ++t)
        round_to_bf16(y_f32.data() + t * (r1 - r0), reinterpret_cast<uint16_t*>(yn) + t * y_stride_token, r1 - r0);
    }
  });
}

void scan_fp8_rows(const Matrix& w, uint8_t* flags, uint8_t* blocks, I64 block_stride, ThreadPool& pool) {
  constexpr I64 kRowsPerTask = 64;
  pool.parallel_for(ceil_div(w.rows, kRowsPerTask), [&](I64 task, int) {
    for (I64 r = task * kRowsPerTask; r < std::min(w.rows, (task + 1) * kRowsPerTask); ++r) {
      const uint8_t* row = w.data + r * w.row_bytes;
      uint8_t* bits = blocks + r * block_stride;
      std::memset(bits, 0, static_cast<size_t>(block_stride));
      uint8_t nan = 0;
      for (I64 k0 = 0, kb = 0; k0 < w.cols; k0 += w.block_cols, ++kb) {
        uint8_t subnormal = 0;
        for (I64 k = k0; k < std::min(w.cols, k0 + w.block_cols); ++k) {
          const uint8_t magnitude = row[k] & 0x7F;
          nan |= magnitude == 0x7F;
          subnormal |= magnitude != 0 && magnitude < 0x08;
        }
        bits[kb >> 3] |= static_cast<uint8_t>(subnormal << (kb & 7));
      }
      bool any_subnormal = false;
      for (I64 i = 0; i < block_stride; ++i) any_subnormal |= bits[i] != 0;
      flags[r] = static_cast<uint8_t>((nan ? kRowHasNan : 0) | (any_subnormal ? kRowHasSubnormal : 0));
    }
  });
}

constexpr I64 kProbePrefetchAhead[] = {0, 2 << 10, 8 << 10};  // no software prefetch, then two distances

double measure_read_bandwidth(const uint64_t* p, I64 words, int repeats, const KernelTable& kt, ThreadPool& pool) {
  const int threads = pool.size();
  const I64 per = (words / threads) & ~static_cast<I64>(15);
  double best = 0.0;
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  uint64_t first_total = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    for (const I64 ahead : kProbePrefetchAhead) {
      std::fill(sums.begin(), sums.end(), uint64_t{0});
      const auto t0 = std::chrono::steady_clock::now();
      pool.parallel_for(threads, [&](I64 task, int) { sums[task] = kt.read_sum(p + task * per, per, ahead); });
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, static_cast<double>(per) * threads * 8.0 / sec);
      // every variant reads the same words: a differing sum is a loop that skipped or repeated some
      const uint64_t total = std::accumulate(sums.begin(), sums.end(), uint64_t{0});
      if (rep == 0 && ahead == 0) first_total = total;
      else if (total != first_total) throw std::logic_error("read probe: its reads disagree on the buffer's sum");
    }
  }
  return best;
}

double measure_fma_peak(double seconds, const KernelTable& kt, ThreadPool& pool) {
  const int threads = pool.size();
  I64 iters = 1 << 16;
  for (;;) {  // grow the run until it lasts long enough to time
    std::vector<double> flops(static_cast<size_t>(threads));
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(threads, [&](I64 task, int) { flops[task] = kt.fma_peak(iters); });
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sec >= seconds || iters > (I64{1} << 40)) return std::accumulate(flops.begin(), flops.end(), 0.0) / sec;
    iters *= 2;
  }
}

}  // namespace hm
