// The paged decode-attention kernel in plain loops (one float a "vector"): the fallback and a check.
#include <cmath>

#include "attention_simd.h"

namespace hm {
namespace {

struct ScalarAttn {
  static constexpr int W = 1;
  using F = float;
  static F zero() { return 0.0f; }
  static F set1(float v) { return v; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F fma(F a, F b, F c) { return a * b + c; }
  static F exp(F x) { return std::exp(x); }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static F load_f16(const uint16_t* p) { return half_to_float(*p); }
  static F max(F a, F b) { return a > b ? a : b; }  // b where either is NaN, as the vector max instructions
  static float hmax(F v) { return v; }
  static float hsum(F v) { return v; }
  static void hsum4_store(float* o, F a, F b, F c, F d) {
    o[0] = a;
    o[1] = b;
    o[2] = c;
    o[3] = d;
  }
};

}  // namespace

void decode_attention_unit_scalar(const DecodeAttnArgs& a, const AttnUnit& u) {
  attention_unit_dispatch<ScalarAttn>(a, u);
}

}  // namespace hm
