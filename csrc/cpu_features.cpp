// CPU feature detection and kernel-ISA selection (see cpu_features.h).
#include "cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define HM_X86 1
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hm {

namespace {

#ifdef HM_X86
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef HM_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  f.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;  // "Auth" "enti" "cAMD"
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const unsigned base_family = (a >> 8) & 0xF;
  f.family = static_cast<int>(base_family == 0xF ? base_family + ((a >> 20) & 0xFF) : base_family);
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.avx = c & (1u << 28);
  f.f16c = c & (1u << 29);
  if (osxsave) {
    const uint64_t xcr0 = xgetbv0();
    f.os_avx = (xcr0 & 0x6) == 0x6;
    f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;
    f.os_amx = (xcr0 & 0x60000) == 0x60000;  // XTILECFG, XTILEDATA
  }
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512vbmi = c & (1u << 1);
    f.gfni = c & (1u << 8);
    f.avx512vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512bf16 = a & (1u << 5);
  }
#endif
  return f;
}

std::atomic<const KernelTable*> g_active{nullptr};

// Linux hands out the AMX tile data state only to processes that ask for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once, for all threads); a tile instruction before that faults. Asked the first time the
// amx ISA is considered.
bool amx_permitted() {
  static const bool permitted = [] {
#if defined(__linux__) && defined(HM_X86)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return permitted;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

std::vector<std::pair<std::string, bool>> cpu_feature_list() {
  const CpuFeatures& f = cpu_features();
  return {{"avx", f.avx && f.os_avx}, {"avx2", f.avx2}, {"fma", f.fma}, {"f16c", f.f16c},
          {"avx512f", f.avx512f && f.os_avx512}, {"avx512bw", f.avx512bw}, {"avx512vl", f.avx512vl},
          {"avx512dq", f.avx512dq}, {"avx512_vnni", f.avx512vnni}, {"avx512_bf16", f.avx512bf16},
          {"avx512_vbmi", f.avx512vbmi}, {"gfni", f.gfni}, {"amx_tile", f.amx_tile && f.os_amx},
          {"amx_bf16", f.amx_bf16},
          {"amd", f.amd}};
}

std::vector<std::string> isa_names() { return {"amx", "avx512bf16", "avx512", "avx2", "avx2bf16", "scalar"}; }

// avx2bf16 (an emulation) runs only when forced. avx512bf16 is chosen by itself on AMD CPUs only: on Zen 4 its bf16
// dot products ran the MoE well ahead of avx512, on an Emerald Rapids Xeon no faster (docs/kernels.md).
bool isa_auto_selected(const std::string& name) {
  if (name == "avx2bf16") return false;
  return name != "avx512bf16" || cpu_features().amd;
}

bool isa_compiled(const std::string& name) {
  if (name == "scalar") return true;
  if (name == "avx2") return kernels_avx2() != nullptr;
  if (name == "avx2bf16") return kernels_avx2bf16() != nullptr;
  if (name == "avx512") return kernels_avx512() != nullptr;
  if (name == "avx512bf16") return kernels_avx512bf16() != nullptr;
  if (name == "amx") return kernels_amx() != nullptr;
  return false;
}

std::string isa_unavailable_reason(const std::string& name) {
  const CpuFeatures& f = cpu_features();
  std::string missing;
  auto need = [&](bool have, const char* what) {
    if (!have) missing += std::string(missing.empty() ? "" : ", ") + what;
  };
  if (name == "scalar") return "";
  if (name == "avx2" || name == "avx2bf16") {
    need(f.avx && f.os_avx, "avx (with OS support)");
    need(f.avx2, "avx2");
    need(f.fma, "fma");
    need(f.f16c, "f16c");
  } else if (name == "avx512" || name == "avx512bf16" || name == "amx") {
    need(f.avx2 && f.fma && f.f16c && f.os_avx, "avx2+fma+f16c");
    need(f.avx512f && f.os_avx512, "avx512f (with OS support)");
    need(f.avx512bw, "avx512bw");
    need(f.avx512vl, "avx512vl");
    need(f.avx512dq, "avx512dq");
    need(f.avx512vnni, "avx512_vnni");
    if (name != "avx512") need(f.avx512bf16, "avx512_bf16");
    if (name == "amx") {
      need(f.amx_tile && f.os_amx, "amx_tile (with OS support)");
      need(f.amx_bf16, "amx_bf16");
      need(f.gfni, "gfni");  // every AMX CPU has it; the table's int4 GEMV uses it
    }
  } else {
    return "unknown ISA '" + name + "' (known: amx, avx512bf16, avx512, avx2, avx2bf16, scalar)";
  }
  if (!missing.empty()) return "this CPU lacks " + missing;
  if (!isa_compiled(name)) return "this build has no " + name + " kernels (compiler or platform without it)";
  if (name == "amx" && !amx_permitted()) return "the OS refused this process the AMX tile state (arch_prctl)";
  return "";
}

PrefetchLevel parse_prefetch_level(const std::string& name, const std::string& what) {
  if (name == "l1") return PrefetchLevel::L1;
  if (name == "l2") return PrefetchLevel::L2;
  throw std::invalid_argument(what + " must be l1 or l2, got '" + name + "'");
}

const char* prefetch_level_name(PrefetchLevel level) { return level == PrefetchLevel::L2 ? "l2" : "l1"; }

PrefetchLevel default_short_row_prefetch() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f ? PrefetchLevel::L2 : PrefetchLevel::L1;
}

PrefetchLevel short_row_prefetch() {
  PrefetchLevel level = g_short_row_prefetch.load(std::memory_order_relaxed);
  if (level != PrefetchLevel::Unresolved) return level;
  const char* env = std::getenv("HYBRIDMOE_SHORT_ROW_PREFETCH");
  level = env && *env ? parse_prefetch_level(env, "HYBRIDMOE_SHORT_ROW_PREFETCH") : default_short_row_prefetch();
  PrefetchLevel unresolved = PrefetchLevel::Unresolved;  // a set_short_row_prefetch meanwhile wins
  g_short_row_prefetch.compare_exchange_strong(unresolved, level, std::memory_order_relaxed);
  return g_short_row_prefetch.load(std::memory_order_relaxed);
}

void set_short_row_prefetch(PrefetchLevel level) { g_short_row_prefetch.store(level, std::memory_order_relaxed); }

bool parse_on_off(const std::string& name, const std::string& what) {
  if (name == "on") return true;
  if (name == "off") return false;
  throw std::invalid_argument(what + " must be on or off, got '" + name + "'");
}

bool default_long_row_prefetch() {
  const CpuFeatures& f = cpu_features();
  return !(f.amd && f.family == 0x19 && !f.avx512f);
}

bool long_row_prefetch() {
  Toggle state = g_long_row_prefetch.load(std::memory_order_relaxed);
  if (state == Toggle::Unresolved) {
    const char* env = std::getenv("HYBRIDMOE_LONG_ROW_PREFETCH");
    const bool on = env && *env ? parse_on_off(env, "HYBRIDMOE_LONG_ROW_PREFETCH") : default_long_row_prefetch();
    Toggle unresolved = Toggle::Unresolved;  // a set_long_row_prefetch meanwhile wins
    g_long_row_prefetch.compare_exchange_strong(unresolved, on ? Toggle::On : Toggle::Off, std::memory_order_relaxed);
    state = g_long_row_prefetch.load(std::memory_order_relaxed);
  }
  return state != Toggle::Off;
}

void set_long_row_prefetch(bool on) {
  g_long_row_prefetch.store(on ? Toggle::On : Toggle::Off, std::memory_order_relaxed);
}

const KernelTable* kernels_for(const std::string& name) {
  short_row_prefetch();
  long_row_prefetch();
  const std::string why = isa_unavailable_reason(name);
  if (!why.empty()) throw std::invalid_argument("ISA '" + name + "' cannot run: " + why);
  if (name == "amx") return kernels_amx();
  if (name == "avx512bf16") return kernels_avx512bf16();
  if (name == "avx512") return kernels_avx512();
  if (name == "avx2") return kernels_avx2();
  if (name == "avx2bf16") return kernels_avx2bf16();
  return kernels_scalar();
}

const KernelTable* active_kernels() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t) return t;
  const char* env = std::getenv("HYBRIDMOE_ISA");
  if (env && *env) {
    const std::string forced(env);
    const std::string why = isa_unavailable_reason(forced);
    if (!why.empty()) throw std::invalid_argument("HYBRIDMOE_ISA=" + forced + " cannot run: " + why);
    t = kernels_for(forced);
  } else {
    for (const std::string& name : isa_names()) {
      if (isa_auto_selected(name) && isa_unavailable_reason(name).empty()) {
        t = kernels_for(name);
        break;
      }
    }
  }
  const KernelTable* expected = nullptr;
  g_active.compare_exchange_strong(expected, t, std::memory_order_acq_rel);
  return g_active.load(std::memory_order_acquire);
}

void set_active_isa(const std::string& name) { g_active.store(kernels_for(name), std::memory_order_release); }

}  // namespace hm
