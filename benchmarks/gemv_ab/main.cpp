// A/B harness for the GEMV kernels on one thread (or several, HM_AB_THREADS): the kernel headers of a base tree
// and of the working tree are compiled into one program (side.cpp, twice) and timed alternately on the same
// matrices, so that the host's drifting bandwidth hits both alike. Run through benchmarks/gemv_ab.sh.
//
// usage: gemv_ab FORMAT ROWS COLS TOKENS...   (FORMAT fp8 | bf16 | int4 | int8; COLS a multiple of 128)
// Prints per token count: GB/s of weights of base and work (median of 7 rounds), work / base, a plain
// sequential read of the same memory in GB/s, and the largest relative difference between the two outputs. A round
// calls each side at least 64 MB's worth (pools that fit a cache are timed over many calls), the sides taking turns
// going first. With the rows in L2, two builds of identical code read up to 1.18x apart on the Zen 5 VM (where each
// side's code and buffers lie): compare L2-resident changes over several shapes, and from memory.
// The matrices rotate over ~400 MB (HM_AB_POOL_BYTES overrides), so rows come from memory; fp8 codes are
// normal (no subnormal, no NaN), block scales 128 x 128; int scales bf16 per group of 128 (int4 and int8;
// HM_AB_INT_GROUP=32 for groups of 32).
// HM_AB_THREADS=n (default 1) runs each side, and the plain read, on n threads at once, each over its own share of the
// matrices (thread t takes every n-th call), so that the kernels meet the memory contention of the MoE's threads.
// HM_AB_HUGE_PAGES=1 puts the matrices on transparent huge pages (2 MB-aligned, madvise), as the kernels' own
// copies of the experts are. HM_AB_SUBNORMALS=1 (fp8) puts a subnormal code at about 1 in 5000 positions (the same
// in every matrix, flagged as the loader's scan flags them), as real checkpoints and the bench's experts have.
// HM_AB_SHORT_ROW_PREFETCH=l1|l2 (default l1) sets hm::g_short_row_prefetch for both sides (hm_types.h), and
// HM_AB_LONG_ROW_PREFETCH=on|off (default on) hm::g_long_row_prefetch (a side whose headers predate it: always on).
#include <sys/mman.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "activation_quant.h"
#include "hm_types.h"

void run_base(const hm::Matrix&, const hm::Activations&, float*);
void run_work(const hm::Matrix&, const hm::Activations&, float*);

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s fp8|bf16|int4|int8 ROWS COLS TOKENS...\n", argv[0]);
    return 2;
  }
  const std::string fmt = argv[1];
  const long N = std::atol(argv[2]), K = std::atol(argv[3]);
  const bool is_int = fmt == "int4" || fmt == "int8";
  if ((fmt != "fp8" && fmt != "bf16" && !is_int) || N < 1 || K < 128 || K % 128) {
    std::fprintf(stderr, "FORMAT must be fp8, bf16, int4 or int8, ROWS >= 1 and COLS a multiple of 128\n");
    return 2;
  }
  std::vector<long> token_counts;
  for (int i = 4; i < argc; ++i) token_counts.push_back(std::atol(argv[i]));
  const long max_tokens = *std::max_element(token_counts.begin(), token_counts.end());
  if (*std::min_element(token_counts.begin(), token_counts.end()) < 1 || max_tokens > hm::kMaxGemvTokens) {
    std::fprintf(stderr, "TOKENS must be 1..%ld\n", static_cast<long>(hm::kMaxGemvTokens));
    return 2;
  }
  const char* pool_env = std::getenv("HM_AB_POOL_BYTES");
  const long pool = pool_env ? std::atol(pool_env) : 400L << 20;
  const char* group_env = std::getenv("HM_AB_INT_GROUP");
  const long group = group_env ? std::atol(group_env) : 128;
  if (group != 32 && group != 128) {
    std::fprintf(stderr, "HM_AB_INT_GROUP must be 32 or 128\n");
    return 2;
  }
  const char* threads_env = std::getenv("HM_AB_THREADS");
  const long threads = threads_env ? std::atol(threads_env) : 1;
  if (threads < 1 || threads > 64) {
    std::fprintf(stderr, "HM_AB_THREADS must be 1..64\n");
    return 2;
  }
  const char* prefetch_env = std::getenv("HM_AB_SHORT_ROW_PREFETCH");
  const std::string prefetch = prefetch_env ? prefetch_env : "l1";
  if (prefetch != "l1" && prefetch != "l2") {
    std::fprintf(stderr, "HM_AB_SHORT_ROW_PREFETCH must be l1 or l2\n");
    return 2;
  }
  hm::g_short_row_prefetch.store(prefetch == "l2" ? hm::PrefetchLevel::L2 : hm::PrefetchLevel::L1);
  const char* long_env = std::getenv("HM_AB_LONG_ROW_PREFETCH");
  const std::string long_rows = long_env ? long_env : "on";
  if (long_rows != "on" && long_rows != "off") {
    std::fprintf(stderr, "HM_AB_LONG_ROW_PREFETCH must be on or off\n");
    return 2;
  }
  hm::g_long_row_prefetch.store(long_rows == "off" ? hm::Toggle::Off : hm::Toggle::On);
  const long row_bytes = fmt == "bf16" ? 2 * K : fmt == "int4" ? K / 2 : K;
  const long copies = std::max(2 * threads, pool / (N * row_bytes));
  const char* huge_env = std::getenv("HM_AB_HUGE_PAGES");
  const bool huge = huge_env && std::string(huge_env) == "1";
  const long matrix_bytes = (N * row_bytes + 63) / 64 * 64, huge_bytes = (copies * matrix_bytes + (2L << 20)) >> 21 << 21;
  uint8_t* huge_pool = nullptr;
  void* huge_map = nullptr;
  if (huge) {  // one 2 MB-aligned region for all matrices, advised before the first touch
    huge_map = mmap(nullptr, huge_bytes + (2L << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (huge_map == MAP_FAILED) {
      std::perror("mmap");
      return 1;
    }
    huge_pool = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(huge_map) + (2L << 20) - 1) >> 21 << 21);
    madvise(huge_pool, huge_bytes, MADV_HUGEPAGE);
  }
  std::mt19937 gen(1);

  // weights: `copies` matrices of N x K in the format, sharing one set of scales and (zero) fp8 flags
  std::vector<float> fp8_scales((N / 128 + 1) * (K / 128), 1e-3f);
  std::vector<uint16_t> int_scales(N * (K / group));
  for (auto& s : int_scales) s = static_cast<uint16_t>(0x3C00 + gen() % 256);  // bf16 0.0078-0.0156
  const long block_stride = (K / 128 + 7) / 8;  // bytes of subnormal block bits a row
  std::vector<uint8_t> row_flags(N, 0), subnormal_blocks(N * block_stride, 0);
  const char* subnormal_env = std::getenv("HM_AB_SUBNORMALS");
  std::vector<long> subnormal_at;  // positions r * K + k of subnormal codes, flagged per row and column block
  if (fmt == "fp8" && subnormal_env && std::string(subnormal_env) == "1")
    for (long i = 0; i < N * K; ++i)
      if (gen() % 5000 == 0) {
        const long r = i / K, kb = i % K / 128;
        subnormal_at.push_back(i);
        row_flags[r] |= hm::kRowHasSubnormal;
        subnormal_blocks[r * block_stride + kb / 8] |= static_cast<uint8_t>(1 << (kb % 8));
      }
  std::vector<hm::Matrix> mats(copies);
  std::vector<uint8_t*> storage;
  for (long c = 0; c < copies; ++c) {
    hm::Matrix& w = mats[c];
    uint8_t* d = huge ? huge_pool + c * matrix_bytes : static_cast<uint8_t*>(std::aligned_alloc(64, matrix_bytes));
    if (!huge) storage.push_back(d);
    for (long i = 0; i < N * row_bytes; ++i) {
      uint8_t b = static_cast<uint8_t>(gen());
      if (fmt == "fp8") b = static_cast<uint8_t>((gen() & 0x80) | ((1 + b % 14) << 3) | (gen() & 7));  // normal
      if (fmt == "bf16" && (i & 1)) b = static_cast<uint8_t>(0x3C | (b & 0x80));  // |w| ~ 2^-7..2^-6
      if (fmt == "int8" && b == 0x80) b = 0x81;  // int8 weights avoid -128
      d[i] = b;
    }
    for (long i : subnormal_at) d[i] = static_cast<uint8_t>((gen() & 0x80) | (1 + gen() % 7));
    w.data = d;
    w.rows = N;
    w.cols = K;
    w.padded_cols = K;
    w.row_bytes = row_bytes;
    if (fmt == "fp8") {
      w.fmt = hm::WFormat::FP8;
      w.scales = fp8_scales.data();
      w.scale_type = hm::ScaleType::F32;
      w.scale_stride = K / 128;
      w.block_rows = w.block_cols = 128;
      w.row_flags = row_flags.data();
      w.subnormal_blocks = subnormal_blocks.data();
      w.subnormal_stride = block_stride;
    } else if (fmt == "bf16") {
      w.fmt = hm::WFormat::BF16;
    } else {
      w.fmt = fmt == "int8" ? hm::WFormat::INT8 : hm::WFormat::INT4;
      w.scales = int_scales.data();
      w.scale_type = hm::ScaleType::BF16;
      w.scale_stride = K / group;
      w.group = group;
    }
  }

  // activations in [-1, 1], and (int formats) their int8 copy per group, quantised as the MoE driver does
  // float rows padded as the MoE driver pads them (ActBuffer: round_up(K + 1, 16)), so that rows a multiple of 4 KB
  // long do not share L1 sets column for column
  const long ldx = (K + 1 + 15) / 16 * 16;
  std::vector<float> x(max_tokens * ldx, 0.0f), qscale(max_tokens * (K / group)), qsum(max_tokens * (K / group));
  std::vector<int8_t> q(max_tokens * K);
  for (long m = 0; m < max_tokens; ++m) {
    for (long k = 0; k < K; ++k) x[m * ldx + k] = static_cast<float>(static_cast<int>(gen() % 2001) - 1000) * 1e-3f;
    hm::quantize_row(x.data() + m * ldx, K, K, static_cast<int>(group), q.data() + m * K,
                     qscale.data() + m * (K / group), qsum.data() + m * (K / group));
  }

  std::printf("%-5s %6s %6s %6s %12s %12s %7s %12s %10s\n", "fmt", "rows", "cols", "tokens", "base GB/s",
              "work GB/s", "work/b", "read GB/s", "max diff");
  std::vector<float> y_base(threads * max_tokens * N), y_work(threads * max_tokens * N);
  for (long M : token_counts) {
    hm::Activations a;
    a.m = M;
    a.k = K;
    a.x = x.data();
    a.ldx = ldx;
    if (is_int) {
      a.q = q.data();
      a.ldq = K;
      a.qscale = qscale.data();
      a.qsum = qsum.data();
      a.ldg = K / group;
    }
    std::vector<double> base, work, read;
    // each side's part of a round reads at least 64 MB a thread, so that a pool held in L2 is timed over many calls
    const long calls = 2 * copies * std::max(1L, (64L << 20) * threads / (2 * copies * N * row_bytes));
    const double bytes = static_cast<double>(calls) * N * row_bytes;
    // a step's work on thread t: the calls c = t, t + threads, ... of one side, or of the plain read
    auto run_side = [&](void (*run)(const hm::Matrix&, const hm::Activations&, float*), float* y, long t) {
      for (long c = t; c < calls; c += threads) run(mats[c % copies], a, y + t * max_tokens * N);
    };
    std::vector<long long> sinks(threads);
    auto plain_read = [&](long t) {
      __m256i acc = _mm256_setzero_si256();  // the same bytes by a plain sequential read
      for (long c = t; c < calls; c += threads) {
        const __m256i* p = reinterpret_cast<const __m256i*>(mats[c % copies].data);
        for (long i = 0; i + 1 < N * row_bytes / 32; i += 2)
          acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_loadu_si256(p + i), _mm256_loadu_si256(p + i + 1)));
      }
      sinks[t] = _mm256_extract_epi64(acc, 0);
    };
    // a round's three steps (the sides take turns going first, so that neither always follows the plain read), each
    // on all threads at once between two spin barriers; thread 0 times them
    for (int round = 0; round < 7; ++round) {
      std::atomic<long> arrived{0};
      auto barrier = [&](long& generation) {  // the generation-th barrier of this round
        ++generation;
        arrived.fetch_add(1);
        while (arrived.load() < generation * threads) _mm_pause();
      };
      enum Step { kBase, kWork, kRead };
      const Step order[3] = {round % 2 ? kWork : kBase, round % 2 ? kBase : kWork, kRead};
      double seconds[3] = {};  // by Step
      auto worker = [&](long t) {
        long generation = 0;
        for (const Step step : order) {
          barrier(generation);
          const double start = now();
          if (step == kBase) run_side(run_base, y_base.data(), t);
          else if (step == kWork) run_side(run_work, y_work.data(), t);
          else plain_read(t);
          barrier(generation);
          if (t == 0) seconds[step] = now() - start;
        }
      };
      std::vector<std::thread> others;
      for (long t = 1; t < threads; ++t) others.emplace_back(worker, t);
      worker(0);
      for (std::thread& th : others) th.join();
      base.push_back(bytes / seconds[kBase] / 1e9);
      work.push_back(bytes / seconds[kWork] / 1e9);
      read.push_back(bytes / seconds[kRead] / 1e9);
    }
    volatile long long sink = sinks[0];
    (void)sink;
    double diff = 0.0;
    for (long i = 0; i < M * N; ++i)
      diff = std::max(diff, std::fabs(static_cast<double>(y_base[i]) - y_work[i]) / (1e-6 + std::fabs(y_base[i])));
    std::printf("%-5s %6ld %6ld %6ld %12.2f %12.2f %6.2fx %12.2f %10.1e\n", fmt.c_str(), N, K, M, median(base),
                median(work), median(work) / median(base), median(read), diff);
    std::fflush(stdout);
  }
  for (uint8_t* d : storage) std::free(d);
  if (huge_map) munmap(huge_map, huge_bytes + (2L << 20));
  return 0;
}
