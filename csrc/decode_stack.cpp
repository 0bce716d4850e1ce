#include "decode_stack.h"

#include <cstring>
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

namespace {

// RMSNorm of rows [S, dim] (at x_stride) into out (at out_stride), after residual += x where residual is given.
void norm_rows(const void* x, int64_t x_stride, void* residual, const void* weight, void* out, int64_t out_stride,
               int64_t rows, int64_t dim, bool bf16, float eps, ThreadPool& pool) {
  // in RmsNormArgs' order: x, x_stride, residual, residual_stride, weight, out, out_stride, rows, dim, bf16, eps
  rms_norm(RmsNormArgs{x, x_stride, residual, dim, weight, out, out_stride, rows, dim, bf16, eps}, pool);
}

// RoPE of x [S, heads, dim] (strides in elements) into out, after an RMSNorm of each row by norm (null: none).
void rotate(const void* x, int64_t x_token, int64_t x_head, void* out, int64_t out_token, int64_t out_head,
            int64_t heads, int64_t dim, const void* norm, const DecodeStackShape& sh, const DecodeStackStep& step,
            ThreadPool& pool) {
  RopeArgs r;
  r.x = x;
  r.x_token = x_token;
  r.x_head = x_head;
  r.out = out;
  r.out_token = out_token;
  r.out_head = out_head;
  r.cos = step.cos;
  r.sin = step.sin;
  r.tokens = step.seqs;
  r.heads = heads;
  r.dim = dim;
  r.bf16 = sh.bf16;
  r.interleaved = sh.interleaved;
  r.norm_weight = norm;
  r.eps = sh.eps;
  rope(r, pool);
}

// Projections of one input x [S, K] into ys: one run_matmul_group where they share their activations, else a call each.
void project(const Matrix* mats, int n, bool grouped, const void* x, int64_t S, void* const* ys, bool x_bf16,
             bool y_bf16, const KernelTable& kt, ThreadPool& pool) {
  if (grouped) {
    run_matmul_group(mats, n, x, x_bf16, S, mats[0].cols, ys, y_bf16, MatmulPath::Auto, kt, pool);
    return;
  }
  for (int i = 0; i < n; ++i)
    run_matmul(mats[i], x, x_bf16, S, mats[i].cols, ys[i], y_bf16, MatmulPath::Auto, kt, pool);
}

// down(silu(gate x) * up x) of x [S, H] into out [S, H] (layers/mlp.py's kernel path).
void gated_mlp(const GatedMlpWeights& w, const void* x, void* out, int64_t S, bool bf16, Arena& arena,
               const KernelTable& kt, ThreadPool& pool) {
  const int64_t I = w.gate.rows;
  float* g = arena.take(S * I);
  float* u = arena.take(S * I);
  float* h = arena.take(S * I);
  const Matrix mats[2] = {w.gate, w.up};
  void* const ys[2] = {g, u};
  project(mats, 2, w.grouped, x, S, ys, bf16, false, kt, pool);
  kt.silu_mul(g, u, h, S * I);
  if (bf16) {
    auto* hb = reinterpret_cast<uint16_t*>(g);  // g is spent: its room holds h rounded to bf16
    for (int64_t i = 0; i < S * I; ++i) hb[i] = float_to_bf16(h[i]);
    run_matmul(w.down, hb, true, S, I, out, true, MatmulPath::Auto, kt, pool);
  } else {
    run_matmul(w.down, h, false, S, I, out, false, MatmulPath::Auto, kt, pool);
  }
}

// Elements of the arrays a layer needs (float32 room each; gated_mlp's three [S, I] arrays included).
size_t layer_floats(const DecodeStackShape& sh, const DecodeStackLayer& l, int64_t S) {
  const int64_t H = sh.hidden, N = sh.heads;
  int64_t n = 0;
  auto add = [&](int64_t count) { n += (count + 15) / 16 * 16 + 16; };
  if (sh.mla) {
    const int64_t P = sh.nope_dim, R = sh.rope_dim, L = sh.lora;
    for (int64_t c : {S * l.q_first.rows, S * N * (P + R), S * (L + R), S * (L + R), S * N * (L + R), S * N * L,
                      S * N * sh.v_dim})
      add(c);
  } else {
    for (int64_t c : {S * l.q.rows, S * l.k.rows, S * l.v.rows, S * N * sh.head_dim}) add(c);
  }
  const int64_t E = l.experts ? l.gate.rows : 0, K = l.experts ? l.route.k : 0, I = l.mlp.gate.rows;
  for (int64_t c : {S * H, S * H, S * H, S * E, S * K, 2 * S * K, S * H, S * H, 3 * S * I}) add(c);
  return static_cast<size_t>(n);
}

}  // namespace

void DecodeStack::run_layer(const DecodeStackLayer& layer, const DecodeStackStep& step, const KernelTable& kt,
                            ThreadPool& pool) {
  const DecodeStackShape& sh = shape_;
  const int64_t S = step.seqs, H = sh.hidden, N = sh.heads;
  const bool bf16 = sh.bf16;
  Arena arena(buffers_);
  arena.plan(layer_floats(sh, layer, S));
  arena.allocate();
  float* attn;  // [S, N * head's value dims] in the compute dtype: the attention's output before o
  DecodeAttnArgs a;
  if (sh.mla) {
    const int64_t P = sh.nope_dim, R = sh.rope_dim, L = sh.lora, V = sh.v_dim;
    float* first = arena.take(S * layer.q_first.rows);
    float* q = arena.take(S * N * (P + R));
    float* kv = arena.take(S * (L + R));
    float* row = arena.take(S * (L + R));  // [latent, k_pe] as the cache stores them
    float* q_full = arena.take(S * N * (L + R));  // [q_lat, q_pe] per head
    float* lat = arena.take(S * N * L);
    attn = arena.take(S * N * V);
    const Matrix mats[2] = {layer.q_first, layer.kv_a};
    void* const ys[2] = {sh.q_lora ? first : q, kv};
    project(mats, 2, layer.first_grouped, step.x, S, ys, bf16, bf16, kt, pool);
    if (sh.q_lora) {  // q = q_b(q_a_norm(q_a x)), the norm in place
      norm_rows(first, sh.q_lora, nullptr, layer.q_a_norm, first, sh.q_lora, S, sh.q_lora, bf16, sh.eps, pool);
      run_matmul(layer.q_b, first, bf16, S, sh.q_lora, q, bf16, MatmulPath::Auto, kt, pool);
    }
    const int64_t es = bf16 ? 2 : 4;  // an array's element `elements` in: the rope halves of q, kv and the rows
    auto at = [es](float* base, int64_t elements) {
      return static_cast<void*>(reinterpret_cast<char*>(base) + elements * es);
    };
    norm_rows(kv, L + R, nullptr, layer.kv_a_norm, row, L + R, S, L, bf16, sh.eps, pool);
    rotate(at(q, P), N * (P + R), P + R, at(q_full, L), N * (L + R), L + R, N, R, nullptr, sh, step, pool);
    rotate(at(kv, L), L + R, R, at(row, L), L + R, R, 1, R, nullptr, sh, step, pool);
    write_cache_rows(row, bf16, S, 1, L + R, step.slots, layer.k_cache);
    run_matmul_heads(layer.uk.data(), N, q, bf16, S, N * (P + R), P + R, q_full, bf16, N * (L + R), L + R,
                     MatmulPath::Auto, kt, pool);
    a.q = q_full;
    a.q_stride_seq = N * (L + R);
    a.q_stride_head = L + R;
    a.out = lat;
    a.out_stride_seq = N * L;
    a.out_stride_head = L;
    a.num_kv_heads = 1;
    a.head_dim = L + R;
    a.v_head_dim = L;
  } else {
    const int64_t D = sh.head_dim, Nk = sh.kv_heads;
    float* q = arena.take(S * layer.q.rows);
    float* k = arena.take(S * layer.k.rows);
    float* v = arena.take(S * layer.v.rows);
    attn = arena.take(S * N * D);
    const Matrix mats[3] = {layer.q, layer.k, layer.v};
    void* const ys[3] = {q, k, v};
    project(mats, 3, layer.qkv_grouped, step.x, S, ys, bf16, bf16, kt, pool);
    // RoPE of q and k in place (after their norms where the model has them)
    rotate(q, N * D, D, q, N * D, D, N, D, layer.q_norm, sh, step, pool);
    rotate(k, Nk * D, D, k, Nk * D, D, Nk, D, layer.k_norm, sh, step, pool);
    write_cache_rows(k, bf16, S, Nk, D, step.slots, layer.k_cache);
    write_cache_rows(v, bf16, S, Nk, D, step.slots, layer.v_cache);
    a.q = q;
    a.q_stride_seq = N * D;
    a.q_stride_head = D;
    a.out = attn;
    a.out_stride_seq = N * D;
    a.out_stride_head = D;
    a.num_kv_heads = Nk;
    a.head_dim = a.v_head_dim = D;
  }
  // attention over each sequence's paged context
  a.q_type = a.out_type = bf16 ? AttnType::BF16 : AttnType::F32;
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
  a.num_seqs = S;
  a.num_heads = N;
  a.block_size = layer.k_cache.block_size;
  a.scale = sh.scale;
  a.window = sh.window;
  decode_attention(a, kt, pool);
  if (sh.mla)  // the latent outputs through W_uv, head by head
    run_matmul_heads(layer.uv.data(), N, a.out, bf16, S, N * sh.lora, sh.lora, attn, bf16, N * sh.v_dim, sh.v_dim,
                     MatmulPath::Auto, kt, pool);
  float* o = arena.take(S * H);
  float* x2 = arena.take(S * H);
  run_matmul(layer.o, attn, bf16, S, layer.o.cols, o, bf16, MatmulPath::Auto, kt, pool);
  // residual += o; x2 = post_norm(residual)
  norm_rows(o, H, step.residual, layer.post_norm, x2, H, S, H, bf16, sh.eps, pool);
  float* mlp_out = arena.take(S * H);
  if (layer.experts) {
    // the router: gate logits in float32 (x2 widened exactly, as x.float()), then its choice
    const int64_t E = layer.gate.rows, K = layer.route.k;
    float* xf = arena.take(S * H);
    float* logits = arena.take(S * E);
    float* weights = arena.take(S * K);
    auto* ids = reinterpret_cast<int64_t*>(arena.take(2 * S * K));
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
    MoEInput in;
    in.hidden = x2;
    in.hidden_bf16 = bf16;
    in.tokens = S;
    in.top_k = K;
    in.ids = ids;
    in.weights = weights;
    in.out = mlp_out;
    layer.experts->compute(in, kt, pool);
    if (layer.has_shared) {  // routed + shared, rounded as torch's add
      float* shared = arena.take(S * H);
      gated_mlp(layer.mlp, x2, shared, S, bf16, arena, kt, pool);
      for (int64_t i = 0; i < S * H; ++i)
        store_f32_or_bf16(mlp_out, i, load_f32_or_bf16(mlp_out, i, bf16) + load_f32_or_bf16(shared, i, bf16), bf16);
    }
  } else {
    gated_mlp(layer.mlp, x2, mlp_out, S, bf16, arena, kt, pool);
  }
  // residual += mlp; x = next_norm(residual)
  norm_rows(mlp_out, H, step.residual, layer.next_norm, step.x, H, S, H, bf16, sh.eps, pool);
}

}  // namespace hm
