// The paged decode-attention kernel on AVX2 + FMA + F16C (compiled with those flags; run only where the CPU has them).
#include "simd_avx2.h"
#include "attention_simd.h"

namespace hm {
namespace {

struct Avx2Attn : Avx2 {
  static void hsum4_store(float* o, F a, F b, F c, F d) { _mm_storeu_ps(o, hsum4(a, b, c, d)); }
};

}  // namespace

void decode_attention_unit_avx2(const DecodeAttnArgs& a, const AttnUnit& u) { attention_unit_dispatch<Avx2Attn>(a, u); }

}  // namespace hm
