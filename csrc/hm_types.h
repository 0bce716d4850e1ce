// Shared types of the expert-kernel core: weight formats, matrix and activation views, the per-ISA kernel
// table. No torch, no Python: plain C++17.
//
// Legend: M tokens routed to one expert, K input features (cols), N output features (rows).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace hm {

// Storage format of one weight matrix [N, K] (row-major, rows = output features).
enum class WFormat : int {
  F32 = 0,   // float32
  BF16 = 1,  // bfloat16 bits
  F16 = 2,   // IEEE half bits
  FP8 = 3,   // float8 e4m3fn codes, float32 scale per (block_rows x block_cols) block
  INT4 = 4,  // symmetric int4 per group along K, two per byte (see formats doc), bf16/f16 scale per group
  INT8 = 5,  // symmetric int8 per group along K, bf16/f16 scale per group
};

enum class ScaleType : int { None = 0, F32 = 1, BF16 = 2, F16 = 3 };

static inline bool is_int_format(WFormat f) { return f == WFormat::INT4 || f == WFormat::INT8; }

// One weight matrix as the kernels read it. `cols` is the logical K; int formats store each row padded with
// zeros to `padded_cols` = ceil(K / group) * group, so that every group is whole.
struct Matrix {
  WFormat fmt = WFormat::F32;
  const uint8_t* data = nullptr;  // row r starts at data + r * row_bytes
  int64_t rows = 0, cols = 0, padded_cols = 0;
  int64_t row_bytes = 0;
  const void* scales = nullptr;   // fp8: float32 [ceil(N/block_rows), scale_stride]; int: [N, scale_stride]
  ScaleType scale_type = ScaleType::None;
  int64_t scale_stride = 0;       // scale elements per scale row
  int block_rows = 0, block_cols = 0;  // fp8
  int group = 0;                       // int formats: 32 or 128
  const uint8_t* row_flags = nullptr;  // fp8: per row, kRowHasNan | kRowHasSubnormal (scan_fp8_rows)
  const uint8_t* subnormal_blocks = nullptr;  // fp8: bit kb of row r: a subnormal code in column block kb
  int64_t subnormal_stride = 0;               // bytes per row of subnormal_blocks
};

static inline bool block_has_subnormal(const Matrix& w, int64_t row, int64_t kb) {
  return (w.subnormal_blocks[row * w.subnormal_stride + (kb >> 3)] >> (kb & 7)) & 1;
}

constexpr uint8_t kRowHasNan = 1;        // a 0x7F / 0xFF code
constexpr uint8_t kRowHasSubnormal = 2;  // a code with exponent 0 and mantissa != 0

// M tokens' input rows in the form a matrix needs: fp32 rows (float formats) or int8 rows quantised per group
// (int formats). Float rows are zero-padded to `ldx` >= round_up(K, 16); int rows to the matrix's padded K.
struct Activations {
  int64_t m = 0, k = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const int8_t* q = nullptr;
  int64_t ldq = 0;
  const float* qscale = nullptr;  // [m, ldg]: scale of each group (x ~ q * scale)
  const float* qsum = nullptr;    // [m, ldg]: scale * sum(q) over the group (for unsigned-offset dot products)
  int64_t ldg = 0;
  const int32_t* rows = nullptr;  // token m reads buffer row rows[m] (nullptr: row m)
};

static inline int64_t act_row(const Activations& a, int64_t m) { return a.rows ? a.rows[m] : m; }
static inline const float* x_row(const Activations& a, int64_t m) { return a.x + act_row(a, m) * a.ldx; }
static inline const int8_t* q_row(const Activations& a, int64_t m) { return a.q + act_row(a, m) * a.ldq; }
static inline const float* qscale_row(const Activations& a, int64_t m) { return a.qscale + act_row(a, m) * a.ldg; }
static inline const float* qsum_row(const Activations& a, int64_t m) { return a.qsum + act_row(a, m) * a.ldg; }

enum class MatmulPath : int { Auto = 0, Gemv = 1, Gemm = 2 };

// Tokens per expert from which the tiled GEMM path (K blocked for the caches) replaces the GEMV path (whole rows,
// the next rows prefetched), by format, where the GEMM path measured faster at DeepSeek-V3 and Qwen3-30B-A3B
// expert shapes (AVX2 on Zen 4; docs/kernels.md): fp8 from 13-16 tokens (its GEMV decodes each weight again
// for every 3 tokens, 3 operations a vector); the other float formats (decode: one shift) from 64-128; the int
// formats (int8 dot products on whole rows against K chunks of 1,024) from 128-256 or more.
constexpr int64_t kGemmMinTokensFp8 = 13;
constexpr int64_t kGemmMinTokensFloat = 64;
constexpr int64_t kGemmMinTokensInt = 192;
constexpr int64_t kMaxGemvTokens = kGemmMinTokensFloat - 1;  // the most tokens the float GEMV path takes

// With bf16 dot products (KernelTable::bf16_dot) bf16 and fp8 weights stay on the GEMV path up to
// kMaxGemvTokens, the bf16 dot-product tiles' range (kernels_simd_bf16.h), from bf16_dot_min_tokens tokens per
// expert; fewer take the float32 GEMV. Measured on Zen 4 (benchmarks/bf16_dot.py, one DeepSeek-V3 gate matrix,
// bf16 dot / float32, 1 and 2 threads, rows in cache and from memory), once the tiles' accumulators stayed in
// registers (session 14): fp8 1.09-1.43x at 2 tokens, 1.15-1.42x at 3, 1.34-2.06x at 4, but at 1 token 0.94x
// with both threads from memory (1.23-1.32x otherwise); bf16 0.92-1.23x at 1, 1.01-1.17x at 2, 0.98-1.08x at 3,
// 1.15-1.31x at 4. (Session 13, before: fp8 0.91-1.0x at 1-2 tokens, 1.17x at 3.)
// Session 15 (Zen 4, benchmarks/gemv_ab.sh, one thread, bf16 dot / float32 at one token): with their weights in
// cache the float32 GEMV reads fp8 at 21-23 GB/s, bound by its decode (16 codes per widening load, shift, and and
// FMA), the bf16 dot products at 39-47 (32 codes); from memory fp8 rows of 0.75-7 KB 1.00-1.10x once the
// single-token tile kept two sets of accumulators (with one set, 0.59-0.79x for 0.75 KB rows), so fp8 takes them
// from one token. bf16 rows of kBf16DotLongRowBytes and more too (4-14 KB rows from memory 1.08-1.25x); shorter
// bf16 rows lost (1.5 KB: 0.85-0.98x from memory, 1.45x in cache).
constexpr int64_t kBf16DotMinTokensFp8 = 1;
constexpr int64_t kBf16DotMinTokensBf16 = 4;
constexpr int64_t kBf16DotLongRowBytes = 4 << 10;

// The weight formats that a bf16 dot-product table multiplies with bf16 dot products.
constexpr bool has_bf16_dot_path(WFormat f) { return f == WFormat::FP8 || f == WFormat::BF16; }

// Tokens per expert from which a bf16 dot-product table multiplies format f's rows of row_bytes bytes with bf16
// dot products.
static inline int64_t bf16_dot_min_tokens(WFormat f, int64_t row_bytes) {
  if (f == WFormat::FP8) return kBf16DotMinTokensFp8;
  return row_bytes >= kBf16DotLongRowBytes ? 1 : kBf16DotMinTokensBf16;
}

// Tokens per expert from which the amx table multiplies bf16 and fp8 weights by AMX tiles (kernels_amx.h) on the
// auto path; fewer take the avx512 float32 GEMV. On a lent 16-core Emerald Rapids (2026-12-04, one 2048 x 7168
// matrix, 1 and 16 threads, rows in cache and from memory) the tiles ran at 0.80-1.06x the avx512 auto path at 4
// tokens, 0.89-1.08x at 6, 0.81-1.46x at 8 (ahead in 5 of 8 cases) and 1.11-2.68x from 16
// (docs/kernels-measured.md).
constexpr int64_t kAmxMinTokens = 8;

// Where the GEMV path's prefetch that reaches ahead (kPrefetchAheadBytes, kernels_simd_common.h) puts short rows
// (under kPrefetchL2MinBytes) at one token (any tokens with bf16 dot products; not the float32 GEMV's 4-row tiles,
// kernels_simd_float.h), which went to L1 before: into L1 (prefetcht0) or only into L2 (prefetcht1; since 2026-12-04
// each line asked for twice, and the one-row tiles of long rows ask twice too: the Twice policies of NextRows,
// kernels_simd_common.h). Longer rows, and several tokens whose activations would be evicted, go to L2 either way.
// One setting for the process, read by the kernels at each matrix; cpu_features.h resolves it before the first
// kernel runs (short_row_prefetch: HYBRIDMOE_SHORT_ROW_PREFETCH, else this CPU's default). On Zen 4 (2026-12-04,
// benchmarks/gemv_ab.sh, rows from memory on huge pages, L2 against L1): fp8 768 x 2048 at one token 1.43-1.73x on
// one thread (16 -> 24-28.5 GB/s against a plain read's 29-33: with L1 the GEMV had read at about 1 / (1 / its
// in-cache rate + 1 / the read's), its arithmetic and its reads taking turns), 1.26x on two; bf16 2048 x 768
// 1.22-1.51x; int4 1.05-1.40x; int8 0.92-1.17x. The MoE (2 threads, in-process A/B): Qwen3-30B-A3B fp8 T = 1 1.45x
// with the probe at 60-67 GB/s (1.16x at 27-36), T = 4 1.18-1.38x; int4, int8, bf16 1.02-1.09x; DeepSeek-V3 fp8
// 1.08-1.12x, int4 0.97-0.99x, int8 and bf16 0.99-1.01x. Zen 3 had read 0.97-1.01x with T1 hints on the next tile
// (before the far prefetch); a lent 16-core Xeon (Emerald Rapids, 2026-12-04, the MoE on 16 threads, in-process A/B)
// 0.97-1.03x in every case, and keeps L1; Zen 5 is not measured with it and keeps L1. Unresolved until
// cpu_features.h resolves it; the kernels take anything but L2 as L1.
enum class PrefetchLevel : int { Unresolved = 0, L1 = 1, L2 = 2 };
inline std::atomic<PrefetchLevel> g_short_row_prefetch{PrefetchLevel::Unresolved};

// Tokens per expert from which path Auto leaves the GEMV path (for the amx table's bf16 and fp8 weights: for AMX
// tiles).
static inline int64_t gemm_min_tokens(WFormat f, bool bf16_dot = false, bool amx = false) {
  if (amx && has_bf16_dot_path(f)) return kAmxMinTokens;
  if (bf16_dot && has_bf16_dot_path(f)) return kGemmMinTokensFloat;
  return f == WFormat::FP8 ? kGemmMinTokensFp8 : is_int_format(f) ? kGemmMinTokensInt : kGemmMinTokensFloat;
}

// Whether `tokens` tokens of one expert take the GEMM path for weights in format f.
static inline bool use_gemm(MatmulPath path, int64_t tokens, WFormat f, bool bf16_dot = false, bool amx = false) {
  return path == MatmulPath::Gemm || (path == MatmulPath::Auto && tokens >= gemm_min_tokens(f, bf16_dot, amx));
}

// Whether a table with AMX tiles multiplies `tokens` tokens of format f by them: bf16 and fp8 weights, wherever
// the GEMM path would run (forced, or past the float GEMV's range) and from kAmxMinTokens on the auto path.
static inline bool use_amx(MatmulPath path, int64_t tokens, WFormat f) {
  return has_bf16_dot_path(f) && (tokens > kMaxGemvTokens || use_gemm(path, tokens, f, false, true));
}

// The kernels one ISA provides. All pointers are non-null in a table that exists.
struct KernelTable {
  const char* name;
  // bf16 and fp8 weights: activations rounded to bf16, bf16 dot products on the GEMV path (kernels_simd_bf16.h)
  bool bf16_dot;
  // bf16 and fp8 weights: activations rounded to bf16, AMX tiles where use_amx says (kernels_amx.h)
  bool amx;
  // y[m * ldy + (r - r0)] = sum_k x[m][k] * W[r][k] for r in [r0, r1), m < x.m.
  void (*matmul)(const Matrix& w, int64_t r0, int64_t r1, const Activations& x, float* y, int64_t ldy,
                 MatmulPath path);
  // out[i] = silu(gate[i]) * up[i]
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // Sum of 64-bit words of p[0, n) (a bandwidth probe; n a multiple of 64 bytes' worth of words).
  uint64_t (*read_sum)(const uint64_t* p, int64_t n);
  // Runs `iters` iterations of independent FMA chains in registers; returns the float ops done.
  double (*fma_peak)(int64_t iters);
  // quantize_row (activation_quant.h), bit for bit.
  void (*quantize_row)(const float* x, int64_t k, int64_t padded, int group, int8_t* q, float* scale, float* qsum);
};

const KernelTable* kernels_scalar();
const KernelTable* kernels_avx2();    // nullptr where not compiled in
const KernelTable* kernels_avx512();  // nullptr where not compiled in
const KernelTable* kernels_avx512bf16();  // nullptr where not compiled in
const KernelTable* kernels_avx2bf16();    // nullptr where not compiled in
const KernelTable* kernels_amx();         // nullptr where not compiled in

// Whether table t rounds the activations of a matmul of `tokens` tokens on `path` to bf16 (bf16 dot products or
// AMX tiles) for a matrix of format f with rows of row_bytes bytes.
static inline bool rounds_activations_to_bf16(const KernelTable& t, WFormat f, int64_t row_bytes, int64_t tokens,
                                              MatmulPath path) {
  if (!has_bf16_dot_path(f)) return false;
  if (t.amx) return use_amx(path, tokens, f);
  return t.bf16_dot && !use_gemm(path, tokens, f, true) && tokens <= kMaxGemvTokens &&
         tokens >= bf16_dot_min_tokens(f, row_bytes);
}

}  // namespace hm
