// Stand-ins for ISAs this build does not compile (non-x86 targets or compilers without the flags).
#include "hm_types.h"

namespace hm {
#ifndef HM_HAVE_AVX2
const KernelTable* kernels_avx2() { return nullptr; }
const KernelTable* kernels_avx2bf16() { return nullptr; }
#endif
#ifndef HM_HAVE_AVX512
const KernelTable* kernels_avx512() { return nullptr; }
#endif
#ifndef HM_HAVE_AVX512BF16
const KernelTable* kernels_avx512bf16() { return nullptr; }
#endif
#ifndef HM_HAVE_AMX
const KernelTable* kernels_amx() { return nullptr; }
#endif
}  // namespace hm
