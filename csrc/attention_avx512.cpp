// The paged decode-attention kernel on AVX-512 (compiled with the avx512 table's flags; run only where the CPU has them).
#include "simd_avx512.h"
#include "attention_simd.h"

namespace hm {
namespace {

struct Avx512Attn : Avx512 {
  static F max(F a, F b) { return _mm512_max_ps(a, b); }  // b where either is NaN
  static float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static void hsum4_store(float* o, F a, F b, F c, F d) { _mm_storeu_ps(o, hsum4(a, b, c, d)); }
};

}  // namespace

void decode_attention_unit_avx512(const DecodeAttnArgs& a, const AttnUnit& u) {
  attention_unit_dispatch<Avx512Attn>(a, u);
}

}  // namespace hm
