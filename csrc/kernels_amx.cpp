// The AMX kernel table (compiled with the AVX-512 flags, -mavx512bf16, -mamx-tile and -mamx-bf16; selected on CPUs
// with AMX-BF16 whose OS lets the process use the tile registers): kernels_avx512.cpp's float32 GEMV and int
// kernels for few tokens per expert, AMX tiles for bf16 and fp8 weights from kAmxMinTokens tokens and for int4 and
// int8 from kAmxIntMinTokens (kernels_amx.h).
#include "simd_avx512.h"
#include "kernels_simd.h"

namespace hm {

const KernelTable* kernels_amx() {
  static const KernelTable table = {"amx", false, true, &matmul<Avx512Amx>, &silu_mul<Avx512>, &read_sum,
                                    &fma_peak<Avx512>, &quantize_row_simd<Avx512>};
  return &table;
}

}  // namespace hm
