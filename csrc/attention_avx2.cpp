// The paged decode-attention kernel on AVX2 + FMA + F16C (compiled with those flags; run only where the CPU has them).
#include "simd_avx2.h"
#include "attention_simd.h"

namespace hm {
namespace {

struct Avx2Attn : Avx2 {
  static F max(F a, F b) { return _mm256_max_ps(a, b); }  // b where either is NaN
  static float hmax(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static void hsum4_store(float* o, F a, F b, F c, F d) { _mm_storeu_ps(o, hsum4(a, b, c, d)); }
};

}  // namespace

void decode_attention_unit_avx2(const DecodeAttnArgs& a, const AttnUnit& u) { attention_unit_dispatch<Avx2Attn>(a, u); }

}  // namespace hm
