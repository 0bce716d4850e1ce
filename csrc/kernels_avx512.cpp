// The AVX-512 kernel table (F/BW/VL/DQ + VNNI; compiled with those flags, selected only on CPUs with them).
#include "simd_avx512.h"
#include "kernels_simd.h"

namespace hm {

const KernelTable* kernels_avx512() {
  static const KernelTable table = {"avx512", false, false, &matmul<Avx512>, &silu_mul<Avx512>, &read_sum,
                                    &fma_peak<Avx512>, &quantize_row_simd<Avx512>};
  return &table;
}

}  // namespace hm
