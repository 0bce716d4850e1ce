// Scalar conversions between float32 and bf16 / IEEE half bit patterns, the exact e4m3fn decode, and an int
// matrix's group scale as float32.
// Internal linkage on purpose: translation units compiled with different ISA flags each keep their own copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "hm_types.h"

namespace hm {
namespace {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Element i of a float32 or bf16 array as float32, and v stored into one (bf16 rounded to nearest even).
inline float load_f32_or_bf16(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_f32_or_bf16(void* p, int64_t i, float v, bool bf16) {
  if (bf16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
  else static_cast<float*>(p)[i] = v;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1F;
  const int mant = h & 0x3FF;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
  }
  return sign ? -v : v;
}

// float32 -> IEEE half, rounded to nearest even (overflow to infinity, subnormals kept), NaN -> a quiet NaN.
inline uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // |f| >= 65520 rounds to infinity
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent (127 -> 15), round the 13 dropped bits
    const uint32_t r = a - 0x38000000u;
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (a < 0x33000000u) return sign;  // below 2^-25 (half the smallest subnormal): zero
  const uint32_t exponent = a >> 23, mantissa = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // units of 2^-24, the half subnormal step: 14..24
  uint32_t h = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1), halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// float8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are NaN.
inline float fp8_e4m3_to_float(uint8_t b) {
  const int exp = (b >> 3) & 0xF;
  const int mant = b & 0x7;
  float v;
  if ((b & 0x7F) == 0x7F) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x8), exp - 10);
  }
  return (b & 0x80) ? -v : v;
}

// Row r's scale of group g of an int4 / int8 matrix (bf16 or f16 scales).
inline float int_group_scale(const Matrix& w, int64_t r, int64_t g) {
  const uint16_t s = static_cast<const uint16_t*>(w.scales)[r * w.scale_stride + g];
  return w.scale_type == ScaleType::BF16 ? bf16_to_float(s) : half_to_float(s);
}

}  // namespace
}  // namespace hm
