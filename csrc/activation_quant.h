// Per-group int8 quantisation of activation rows, as the int4 / int8 kernels take them (Activations::q,
// qscale, qsum in hm_types.h). No dependencies beyond the standard library, so that benchmarks/gemv_ab links it.
#pragma once

#include <cstdint>

namespace hm {

// Quantises one row x[0, k) (zero beyond k, up to padded) to int8 per group: q = rint(x * 127 / amax),
// scale = amax / 127, qsum = scale * sum(q). A group holding a NaN/Inf gets q = 0 and scale = NaN.
void quantize_row(const float* x, int64_t k, int64_t padded, int group, int8_t* q, float* scale, float* qsum);

}  // namespace hm
