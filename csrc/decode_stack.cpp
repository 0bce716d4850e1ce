#include "decode_stack.h"

#include <cstring>
#include <tuple>
#include <utility>

#include "fp_convert.h"
#include "norm.h"
#include "rope.h"

namespace hm {
namespace {

// Per-step buffers carved from one arena, 64-byte aligned.
class Arena {
 public:
  explicit Arena(std::vector<float>& storage) : storage_(storage) {}
  void plan(size_t floats) { need_ += (floats + 15) / 16 * 16; }
  void allocate() {
    if (storage_.size() < need_ + 16) storage_.resize(need_ + 16);
    const auto base = reinterpret_cast<uintptr_t>(storage_.data());
    next_ = reinterpret_cast<float*>((base + 63) / 64 * 64);
  }
  float* take(size_t floats) {
    float* p = next_;
    next_ += (floats + 15) / 16 * 16;
    return p;
  }

 private:
  std::vector<float>& storage_;
  size_t need_ = 0;
  float* next_ = nullptr;
};

}  // namespace

void write_cache_rows(const void* rows, bool rows_bf16, int64_t count, int64_t heads, int64_t dim,
                      const int64_t* slots, const CacheView& cache) {
  const size_t cache_size = cache.type == AttnType::F32 ? 4 : 2;
  const bool same = (cache.type == AttnType::F32 && !rows_bf16) || (cache.type == AttnType::BF16 && rows_bf16);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t slot = slots[t];
    char* token = static_cast<char*>(cache.data) +
                  ((slot / cache.block_size) * cache.stride_block + (slot % cache.block_size) * cache.stride_token) *
                      static_cast<int64_t>(cache_size);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = (t * heads + h) * dim;
      void* dst = token + h * cache.stride_head * static_cast<int64_t>(cache_size);
      if (same) {
        std::memcpy(dst, static_cast<const char*>(rows) + row * (rows_bf16 ? 2 : 4), dim * cache_size);
        continue;
      }
      for (int64_t i = 0; i < dim; ++i) {
        const float value = load_f32_or_bf16(rows, row + i, rows_bf16);
        if (cache.type == AttnType::F32) static_cast<float*>(dst)[i] = value;
        else if (cache.type == AttnType::BF16) static_cast<uint16_t*>(dst)[i] = float_to_bf16(value);
        else static_cast<uint16_t*>(dst)[i] = float_to_half(value);
      }
    }
  }
}

DecodeStack::DecodeStack(const DecodeStackShape& shape, std::vector<DecodeStackLayer> layers)
    : shape_(shape), layers_(std::move(layers)) {}

void DecodeStack::run(const DecodeStackStep& step, const KernelTable& kt, ThreadPool& pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const DecodeStackLayer& layer : layers_) run_layer(layer, step, kt, pool);
}

void DecodeStack::run_layer(const DecodeStackLayer& layer, const DecodeStackStep& step, const KernelTable& kt,
                            ThreadPool& pool) {
  const DecodeStackShape& sh = shape_;
  const int64_t S = step.seqs, H = sh.hidden, N = sh.heads, Nk = sh.kv_heads, D = sh.head_dim;
  const int64_t E = layer.gate.rows, K = layer.route.k;
  const bool bf16 = sh.bf16;
  // Every buffer holds float32 elements' room; bf16 ones use the first half.
  Arena arena(buffers_);
  for (int64_t n : {S * N * D, S * Nk * D, S * Nk * D, S * N * D, S * H, S * H, S * H, S * E, S * K, S * H})
    arena.plan(static_cast<size_t>(n));
  arena.plan(static_cast<size_t>(S * K) * 2);  // ids (int64)
  arena.allocate();
  float* q = arena.take(S * N * D);
  float* k = arena.take(S * Nk * D);
  float* v = arena.take(S * Nk * D);
  float* attn = arena.take(S * N * D);
  float* o = arena.take(S * H);
  float* x2 = arena.take(S * H);
  float* xf = arena.take(S * H);
  float* logits = arena.take(S * E);
  float* weights = arena.take(S * K);
  float* moe = arena.take(S * H);
  auto* ids = reinterpret_cast<int64_t*>(arena.take(S * K * 2));

  // q, k, v = x W^T
  if (layer.qkv_grouped) {
    const Matrix mats[3] = {layer.q, layer.k, layer.v};
    void* const ys[3] = {q, k, v};
    run_matmul_group(mats, 3, step.x, bf16, S, H, ys, bf16, MatmulPath::Auto, kt, pool);
  } else {
    run_matmul(layer.q, step.x, bf16, S, H, q, bf16, MatmulPath::Auto, kt, pool);
    run_matmul(layer.k, step.x, bf16, S, H, k, bf16, MatmulPath::Auto, kt, pool);
    run_matmul(layer.v, step.x, bf16, S, H, v, bf16, MatmulPath::Auto, kt, pool);
  }
  // RoPE of q and k in place (after their norms where the model has them)
  for (const auto& [rows, heads, norm] : {std::tuple<float*, int64_t, const void*>{q, N, layer.q_norm},
                                          {k, Nk, layer.k_norm}}) {
    RopeArgs r;
    r.x = r.out = rows;
    r.x_token = r.out_token = heads * D;
    r.x_head = r.out_head = D;
    r.cos = step.cos;
    r.sin = step.sin;
    r.tokens = S;
    r.heads = heads;
    r.dim = D;
    r.bf16 = bf16;
    r.interleaved = sh.interleaved;
    r.norm_weight = norm;
    r.eps = sh.eps;
    rope(r, pool);
  }
  write_cache_rows(k, bf16, S, Nk, D, step.slots, layer.k_cache);
  write_cache_rows(v, bf16, S, Nk, D, step.slots, layer.v_cache);
  // attention over each sequence's paged context
  DecodeAttnArgs a;
  a.q = q;
  a.q_type = bf16 ? AttnType::BF16 : AttnType::F32;
  a.q_stride_seq = N * D;
  a.q_stride_head = D;
  a.k = layer.k_cache.data;
  a.v = layer.v_cache.data;
  a.kv_type = layer.k_cache.type;
  a.k_stride_block = layer.k_cache.stride_block;
  a.k_stride_token = layer.k_cache.stride_token;
  a.k_stride_head = layer.k_cache.stride_head;
  a.v_stride_block = layer.v_cache.stride_block;
  a.v_stride_token = layer.v_cache.stride_token;
  a.v_stride_head = layer.v_cache.stride_head;
  a.block_tables = step.block_tables;
  a.block_tables_i32 = step.block_tables_i32;
  a.block_table_stride = step.block_table_stride;
  a.seq_lens = step.seq_lens;
  a.out = attn;
  a.out_type = a.q_type;
  a.out_stride_seq = N * D;
  a.out_stride_head = D;
  a.num_seqs = S;
  a.num_heads = N;
  a.num_kv_heads = Nk;
  a.head_dim = a.v_head_dim = D;
  a.block_size = layer.k_cache.block_size;
  a.scale = sh.scale;
  a.window = sh.window;
  decode_attention(a, kt, pool);
  run_matmul(layer.o, attn, bf16, S, N * D, o, bf16, MatmulPath::Auto, kt, pool);
  // residual += o; x2 = post_norm(residual)
  RmsNormArgs n;
  n.x = o;
  n.x_stride = n.residual_stride = n.out_stride = H;
  n.residual = step.residual;
  n.weight = layer.post_norm;
  n.out = x2;
  n.rows = S;
  n.dim = H;
  n.bf16 = bf16;
  n.eps = sh.eps;
  rms_norm(n, pool);
  // the router: gate logits in float32 (x2 widened exactly, as x.float()), then its choice
  const float* gate_in = x2;
  if (bf16) {
    for (int64_t i = 0; i < S * H; ++i) xf[i] = bf16_to_float(reinterpret_cast<const uint16_t*>(x2)[i]);
    gate_in = xf;
  }
  run_matmul(layer.gate, gate_in, false, S, H, logits, false, MatmulPath::Auto, kt, pool);
  RouteArgs r = layer.route;
  r.logits = logits;
  r.logits_stride = E;
  r.tokens = S;
  r.experts = E;
  r.ids = ids;
  r.weights = weights;
  route(r);
  // the routed experts, then residual += experts; x = next_norm(residual)
  MoEInput in;
  in.hidden = x2;
  in.hidden_bf16 = bf16;
  in.tokens = S;
  in.top_k = K;
  in.ids = ids;
  in.weights = weights;
  in.out = moe;
  layer.experts->compute(in, kt, pool);
  n.x = moe;
  n.weight = layer.next_norm;
  n.out = step.x;
  rms_norm(n, pool);
}

}  // namespace hm
