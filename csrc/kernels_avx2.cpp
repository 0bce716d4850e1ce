// The AVX2 + FMA + F16C kernel table (compiled with -mavx2 -mfma -mf16c; run only where the CPU has them).
#include "simd_avx2.h"
#include "kernels_simd.h"

namespace hm {

const KernelTable* kernels_avx2() {
  static const KernelTable table = {"avx2", false, false, &matmul<Avx2>, &silu_mul<Avx2>, &read_sum, &fma_peak<Avx2>,
                                    &quantize_row_simd<Avx2>};
  return &table;
}

// The bf16 dot-product kernels emulated on AVX2, to test them where AVX512-BF16 is absent; never auto-selected.
const KernelTable* kernels_avx2bf16() {
  static const KernelTable table = {"avx2bf16", true, false, &matmul<Avx2Bf16Emulated>, &silu_mul<Avx2>, &read_sum,
                                    &fma_peak<Avx2>, &quantize_row_simd<Avx2>};
  return &table;
}

}  // namespace hm
