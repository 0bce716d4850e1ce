// The portable scalar kernel table: plain loops with the same semantics as the vector kernels (exact fp8
// decode through a 256-entry table, exact integer group sums). Runs anywhere; the fallback and a check.
#include <cmath>
#include <cstring>

#include "activation_quant.h"
#include "fp_convert.h"
#include "hm_types.h"

namespace hm {
namespace {

using I64 = int64_t;

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = fp8_e4m3_to_float(static_cast<uint8_t>(b));
  }
};

const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

float weight_at(const Matrix& w, I64 r, I64 k) {
  const uint8_t* row = w.data + r * w.row_bytes;
  switch (w.fmt) {
    case WFormat::F32: {
      float v;
      std::memcpy(&v, row + 4 * k, 4);
      return v;
    }
    case WFormat::BF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * k, 2);
      return bf16_to_float(h);
    }
    case WFormat::F16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * k, 2);
      return half_to_float(h);
    }
    case WFormat::FP8: {
      const float* scales = static_cast<const float*>(w.scales);
      return fp8_table().value[row[k]] * scales[(r / w.block_rows) * w.scale_stride + k / w.block_cols];
    }
    default:
      return 0.0f;  // int formats go through matmul_int
  }
}

int int_weight_at(const Matrix& w, I64 r, I64 k) {
  const uint8_t* row = w.data + r * w.row_bytes;
  if (w.fmt == WFormat::INT8) return static_cast<int8_t>(row[k]);
  const I64 chunk = k / 32, lane = k % 32;
  const uint8_t byte = row[chunk * 16 + lane % 16];
  return (lane < 16 ? (byte & 0xF) : (byte >> 4)) - 8;
}

void matmul(const Matrix& w, I64 r0, I64 r1, const Activations& x, float* y, I64 ldy, MatmulPath) {
  for (I64 m = 0; m < x.m; ++m) {
    for (I64 r = r0; r < r1; ++r) {
      float acc = 0.0f;
      if (is_int_format(w.fmt)) {
        const int8_t* q = q_row(x, m);
        for (I64 g = 0; g < w.padded_cols / w.group; ++g) {
          int32_t dot = 0;
          for (I64 k = g * w.group; k < (g + 1) * w.group; ++k) dot += int_weight_at(w, r, k) * q[k];
          acc += static_cast<float>(dot) * (int_group_scale(w, r, g) * qscale_row(x, m)[g]);
        }
      } else {
        const float* xr = x_row(x, m);
        for (I64 k = 0; k < w.cols; ++k) acc += weight_at(w, r, k) * xr[k];
      }
      y[m * ldy + (r - r0)] = acc;
    }
  }
}

void silu_mul(const float* gate, const float* up, float* out, I64 n) {
  for (I64 i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

uint64_t read_sum(const uint64_t* p, I64 n, I64 ahead) {
  uint64_t sum = 0;
  for (I64 i = 0; i < n; ++i) {
    if (ahead && i % 8 == 0) __builtin_prefetch(reinterpret_cast<const char*>(p + i) + ahead, 0, 2);
    sum += p[i];
  }
  return sum;
}

double fma_peak(I64 iters) {
  float acc[8] = {1.0f, 1.001f, 1.002f, 1.003f, 1.004f, 1.005f, 1.006f, 1.007f};
  for (I64 it = 0; it < iters; ++it)
    for (float& a : acc) a = std::fma(a, 0.999999f, 1e-7f);
  volatile float sink = acc[0] + acc[7];
  (void)sink;
  return 2.0 * 8 * static_cast<double>(iters);
}

}  // namespace

const KernelTable* kernels_scalar() {
  static const KernelTable table = {"scalar", false, false, &matmul, &silu_mul, &read_sum, &fma_peak,
                                    &quantize_row};
  return &table;
}

}  // namespace hm
