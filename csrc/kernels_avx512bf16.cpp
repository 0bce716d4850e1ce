// The AVX-512 kernel table with AVX512-BF16 (compiled with the AVX-512 flags and -mavx512bf16; chosen by itself
// on AMD CPUs with all of them, else when forced by HYBRIDMOE_ISA=avx512bf16): as kernels_avx512.cpp, with bf16
// dot products for bf16 and fp8 weights from bf16_dot_min_tokens tokens per expert.
#include "simd_avx512.h"
#include "kernels_simd.h"

namespace hm {

const KernelTable* kernels_avx512bf16() {
  static const KernelTable table = {"avx512bf16", true, false, &matmul<Avx512Bf16>, &silu_mul<Avx512>, &read_sum,
                                    &fma_peak<Avx512>, &quantize_row_simd<Avx512>};
  return &table;
}

}  // namespace hm
