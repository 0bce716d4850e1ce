#include "dequantize.h"

#include <algorithm>

#include "fp_convert.h"

namespace hm {

namespace {

// One row: codes of a group times its scale. int4 stores each run of 32 columns in 16 bytes, column j in the low
// nibble of byte j and column j + 16 in its high nibble, as q + 8. Built for AVX-512 and AVX2 too, picked at load
// (the translation unit's own flags are the baseline's): the loops vectorise there, twice as fast.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void dequantize_row(const Matrix& w, int64_t r, uint16_t* out) {
  const uint8_t* row = w.data + r * w.row_bytes;
  float codes[32];
  for (int64_t c0 = 0; c0 < w.cols; c0 += 32) {
    if (w.fmt == WFormat::INT4) {
      const uint8_t* run = row + c0 / 2;
      for (int j = 0; j < 16; ++j) {
        codes[j] = static_cast<float>((run[j] & 0x0F) - 8);
        codes[j + 16] = static_cast<float>((run[j] >> 4) - 8);
      }
    } else {
      const int8_t* run = reinterpret_cast<const int8_t*>(row) + c0;
      for (int j = 0; j < 32; ++j) codes[j] = static_cast<float>(run[j]);
    }
    const float s = int_group_scale(w, r, c0 / w.group);  // groups are 32 or 128 columns: a run lies in one
    const int64_t n = std::min<int64_t>(32, w.cols - c0);
    for (int64_t j = 0; j < n; ++j) out[c0 + j] = float_to_bf16(codes[j] * s);
  }
}

constexpr int64_t kRowsPerTask = 32;

}  // namespace

void dequantize_rows_bf16(const Matrix& w, int64_t r0, int64_t r1, uint16_t* out, int64_t ldo, ThreadPool& pool) {
  const int64_t rows = r1 - r0;
  pool.parallel_for((rows + kRowsPerTask - 1) / kRowsPerTask, [&](int64_t task, int) {
    const int64_t a = r0 + task * kRowsPerTask, b = std::min(r1, a + kRowsPerTask);
    for (int64_t r = a; r < b; ++r) dequantize_row(w, r, out + (r - r0) * ldo);
  });
}

}  // namespace hm
