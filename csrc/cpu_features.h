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
  bool amx_tile = false, amx_bf16 = false;
  bool os_avx = false, os_avx512 = false, os_amx = false;  // the OS saves ymm / zmm / tile state
  bool amd = false;                         // vendor AuthenticAMD
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

}  // namespace hm
