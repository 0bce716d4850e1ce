// One side of the A/B harness (main.cpp): the kernel headers of one source tree (-I picks the tree), compiled
// with that side's name (-DSIDE=run_base / run_work) and vector vocabulary (-DVOCAB=hm::Avx2, ...). Anonymous
// namespaces keep the two trees' kernels apart in one program.
#include "simd_avx2.h"
#ifdef HM_AB_AVX512
#include "simd_avx512.h"
#endif
#include "kernels_simd.h"

void SIDE(const hm::Matrix& w, const hm::Activations& a, float* y) {
  hm::matmul<VOCAB>(w, 0, w.rows, a, y, w.rows, hm::MatmulPath::Auto);
}
