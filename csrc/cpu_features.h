// CPU feature detection (cpuid + OS register-state support) and the run-time choice of kernel ISA.
// HYBRIDMOE_ISA=scalar|avx2|avx2bf16|avx512|avx512bf16|amx forces one; otherwise the best one the CPU and the
// build support runs among amx, avx512bf16 (AMD CPUs only), avx512, avx2, scalar (avx2bf16, an emulation, only
// when forced: see isa_auto_selected).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "hm_types.h"

namespace hm {

struct CpuFeatures {
  bool avx = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512vnni = false, avx512bf16 = false, avx512vbmi = false;
  bool gfni = false;
  bool amx_tile = false, amx_bf16 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;  // the OS saves ymm / zmm / tile state
  bool amd = false;                         // vendor AuthenticAMD
  int family = 0;                           // cpuid display family (AMD: 0x19 Zen 3 / Zen 4, 0x1A Zen 5)
};

const CpuFeatures& cpu_features();
std::vector<std::pair<std::string, bool>> cpu_feature_list();

// ISAs in order of preference, each with whether this CPU can run it and this build has it.
std::vector<std::string> isa_names();  // {"amx", "avx512bf16", "avx512", "avx2", "avx2bf16", "scalar"}
bool isa_auto_selected(const std::string& name);  // false for avx2bf16; avx512bf16 on AMD CPUs only
bool isa_compiled(const std::string& name);
// Empty if `name` can run here; otherwise why not (names the missing features).
std::string isa_unavailable_reason(const std::string& name);

// The table in use. First call: HYBRIDMOE_ISA if set (throws std::invalid_argument when it names an unknown
// ISA or one this CPU/build lacks), else the best available.
const KernelTable* active_kernels();
void set_active_isa(const std::string& name);  // throws std::invalid_argument like above
const KernelTable* kernels_for(const std::string& name);  // throws if unavailable

// The level short rows' far prefetch goes to (g_short_row_prefetch, hm_types.h). First call:
// HYBRIDMOE_SHORT_ROW_PREFETCH=l1|l2 if set (std::invalid_argument for another value), else this CPU's default;
// kernels_for, through which every kernel table is reached, resolves it, so it holds before the first kernel runs.
// set_short_row_prefetch changes it for the next matrices.
PrefetchLevel short_row_prefetch();
void set_short_row_prefetch(PrefetchLevel level);
// L2 on CPUs with AVX-512, where short rows' prefetch into L1 held the L1 miss buffers (AMD Zen 4: half one
// thread's read rate; an AMX Xeon: int4 / int8 decode 1.1-1.3x slower) (hm_types.h, docs/kernels.md); L1 on
// AVX2-only CPUs.
PrefetchLevel default_short_row_prefetch();
// "l1" | "l2", else std::invalid_argument("<what> must be l1 or l2, got '<name>'")
PrefetchLevel parse_prefetch_level(const std::string& name, const std::string& what = "prefetch level");
const char* prefetch_level_name(PrefetchLevel level);

// Whether one-row tiles of long rows prefetch the next row (g_long_row_prefetch, hm_types.h), resolved like
// short_row_prefetch: HYBRIDMOE_LONG_ROW_PREFETCH=on|off if set (std::invalid_argument for another value), else
// this CPU's default: off on AMD Zen 3 (family 0x19 without AVX-512), where it slowed the read, on elsewhere.
bool long_row_prefetch();
void set_long_row_prefetch(bool on);
bool default_long_row_prefetch();
// "on" | "off", else std::invalid_argument("<what> must be on or off, got '<name>'")
bool parse_on_off(const std::string& name, const std::string& what);

}  // namespace hm
