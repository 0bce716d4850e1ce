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
// expert shapes: fp8's GEMV decodes each weight again for every 3 tokens at 3 operations a vector; the other float
// formats decode with one shift (docs/kernels.md, "Which path"). The int formats never leave the GEMV path on
// their own: it runs their tokens in blocks of kIntTokenBlock, where it measured faster than the K-chunked GEMM.
constexpr int64_t kGemmMinTokensFp8 = 13;
constexpr int64_t kGemmMinTokensFloat = 64;
constexpr int64_t kGemmMinTokensInt = INT64_MAX;
constexpr int64_t kMaxGemvTokens = kGemmMinTokensFloat - 1;  // the most tokens the float GEMV path takes

// Tokens of one int-format matmul block: the block's int8 activations (and, on AVX-512, their lane tables) stay in
// L2 while every row tile reads them; a whole 512-token prompt's did not (int4 2048 x 4096 at 512 tokens: 67
// GMAC/s in one block, 150 in blocks of 128, on an AMX Xeon; AVX2: 48 -> 94).
constexpr int64_t kIntTokenBlock = 128;

// With bf16 dot products (KernelTable::bf16_dot) bf16 and fp8 weights stay on the GEMV path up to
// kMaxGemvTokens, the bf16 dot-product tiles' range (kernels_simd_bf16.h), from bf16_dot_min_tokens tokens per
// expert; fewer take the float32 GEMV. fp8 gains from one token (the float32 GEMV is bound by its decode, and
// vdpbf16ps takes twice the codes an instruction); short bf16 rows only from 4 tokens, since at fewer the reads,
// not the arithmetic, limit them (docs/kernels.md, "Which path").
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
// auto path; fewer take the avx512 float32 GEMV, which measured faster below 8 tokens (docs/benchmarks.md).
constexpr int64_t kAmxMinTokens = 8;

// Where the GEMV path's prefetch that reaches ahead (kPrefetchAheadBytes, kernels_simd_common.h) puts short rows
// (under kPrefetchL2MinBytes) at one token (any tokens with bf16 dot products; not the float32 GEMV's 4-row tiles,
// kernels_simd_float.h): into L1 (prefetcht0) or only into L2 (prefetcht1, each line asked for twice: the Twice
// policies of NextRows, kernels_simd_common.h). Longer rows, and several tokens whose activations would be
// evicted, go to L2 either way. L2 pays on the AVX-512 CPUs measured (AMD Zen 4, an AMX Xeon), where prefetches
// into L1 hold the core's L1 miss buffers for a whole memory latency and the arithmetic and the reads take turns;
// L1 on AVX2-only CPUs (docs/kernels.md, "Prefetch").
// One setting for the process, read by the kernels at each matrix; cpu_features.h resolves it before the first
// kernel runs (short_row_prefetch: HYBRIDMOE_SHORT_ROW_PREFETCH, else this CPU's default). Unresolved until then;
// the kernels take anything but L2 as L1.
enum class PrefetchLevel : int { Unresolved = 0, L1 = 1, L2 = 2 };
inline std::atomic<PrefetchLevel> g_short_row_prefetch{PrefetchLevel::Unresolved};

// Whether the float GEMV's one-row tiles of long rows (one token, rows of kRowStreamMinBytes and more,
// kernels_simd_common.h) prefetch the next row into L2 as they read their own. The rows are back to back, so the
// matrix is one sequential stream that the hardware prefetchers follow; the software prefetch on top helps where
// they stop at each page (AMD Zen 4, with the Twice policy) and costs 5-17% of the read rate on AMD Zen 3, where
// it is off (docs/kernels.md, "Prefetch"). Resolved like g_short_row_prefetch (long_row_prefetch:
// HYBRIDMOE_LONG_ROW_PREFETCH, else this CPU's default); the kernels take anything but Off as On.
enum class Toggle : int { Unresolved = 0, Off = 1, On = 2 };
inline std::atomic<Toggle> g_long_row_prefetch{Toggle::Unresolved};

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

// Tokens per expert from which the amx table multiplies int4 and int8 weights by AMX tiles on the auto path, their
// codes times scales rounded to bf16 and the activations rounded to bf16 instead of quantised to int8 (a forced
// path keeps the int kernels). An AMX Xeon, 2 threads, int4 g32: 32 experts of 2048 x 768 at 128 tokens top-8
// (32 an expert) 29.2-31.3 -> 26.2-26.6 ms; alone, 1.4-1.7x from 16 tokens on the 768 x 2048 gate, the 2048 x 768
// down 0.6-0.9x at 16-32 and 1.2-1.3x from 64 (docs/kernels.md, "AMX tiles for int weights").
constexpr int64_t kAmxIntMinTokens = 16;

// Whether a table with AMX tiles multiplies `tokens` tokens of format f by them: bf16 and fp8 weights, wherever
// the GEMM path would run (forced, or past the float GEMV's range) and from kAmxMinTokens on the auto path; int4
// and int8 from kAmxIntMinTokens on the auto path.
static inline bool use_amx(MatmulPath path, int64_t tokens, WFormat f) {
  if (is_int_format(f)) return path == MatmulPath::Auto && tokens >= kAmxIntMinTokens;
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
  // Sum of 64-bit words of p[0, n) (a bandwidth probe; n a multiple of 64 bytes' worth of words), each line also
  // prefetched into L2 `ahead` bytes before it is read (0: no software prefetch).
  uint64_t (*read_sum)(const uint64_t* p, int64_t n, int64_t ahead);
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
  if (t.amx && (has_bf16_dot_path(f) || is_int_format(f))) return use_amx(path, tokens, f);
  if (!has_bf16_dot_path(f)) return false;
  return t.bf16_dot && !use_gemm(path, tokens, f, true) && tokens <= kMaxGemvTokens &&
         tokens >= bf16_dot_min_tokens(f, row_bytes);
}

}  // namespace hm
