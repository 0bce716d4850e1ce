// int4 / int8 weight rows as bf16, for the projections' prefill: a block of rows is dequantised into a buffer that
// torch's bf16 matmul (oneDNN, AMX tiles where present) then multiplies, several times the int kernels' speed at
// hundreds of tokens (docs/kernels.md, "Linear layers").
#pragma once

#include <cstdint>

#include "hm_types.h"
#include "thread_pool.h"

namespace hm {

// out[i, c] = code(r0 + i, c) * scale(r0 + i, c / group) rounded to bf16 (nearest even) for rows [r0, r1) and the
// logical columns [0, w.cols); out rows are ldo elements apart. Bit for bit the float64 dequantisation rounded to
// bf16: a code (at most 8 bits) times a bf16 / f16 scale is exact in float32. w: int4 or int8.
void dequantize_rows_bf16(const Matrix& w, int64_t r0, int64_t r1, uint16_t* out, int64_t ldo, ThreadPool& pool);

}  // namespace hm
