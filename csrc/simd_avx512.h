// The AVX-512 vector vocabulary for the templated kernels (kernels_simd.h): 16-float vectors for the float
// formats, and AVX512-VNNI (vpdpbusd on 256-bit vectors) for the int4/int8 dot products of the shared int kernels
// (the 512-bit lane steps of kernels_simd_int.h call the zmm intrinsics themselves).
// Included only by the translation unit compiled with the AVX-512 flags.
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cstdint>

namespace hm {

struct Avx512 {
  static constexpr int W = 16;
  using F = __m512;
  static constexpr bool kBf16Dot = false;  // float32 activations for the float formats (see Avx512Bf16)
  static constexpr bool kAmx = false;      // no AMX tiles (see Avx512Amx)

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  // [hsum(a), hsum(b), hsum(c), hsum(d)] (13 operations rather than 4 x 8; see Avx2::hsum4).
  static __m128 hsum4(F a, F b, F c, F d) {
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const F abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  }

  static F load_bf16(const uint16_t* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  static F load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // e4m3fn codes -> value * 2^-8 through IEEE half bits (see simd_avx2.h).
  static F load_fp8(const uint8_t* p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    return _mm512_cvtph_ps(h);
  }

  static F load_fp8_normal(const uint8_t* p) {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
    return _mm512_castsi512_ps(v);
  }

  static F exp(F x) {
    x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x);
    x = _mm512_max_ps(_mm512_set1_ps(-88.3762626647949f), x);
    F n = _mm512_roundscale_ps(fma(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    F y = _mm512_set1_ps(1.9875691500e-4f);
    y = fma(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = fma(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = fma(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = fma(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = fma(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = fma(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  }

  static __m256i dot_u4(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static constexpr bool kPairSums16 = false;  // vpdpbusd sums into int32 in one instruction
  static constexpr bool kGfni = false;  // vgf2p8affineqb (the amx table): an int4 byte's high nibble in one instruction
  // vpdpbusd wants unsigned x signed: weights + 128 (xor 0x80), corrected by -128 * sum(s) afterwards.
  static constexpr int kI8Offset = 128;
  static __m256i dot_i8(__m256i acc, __m256i w, __m256i s) {
    return _mm256_dpbusd_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))), s);
  }

  // Activation quantisation (quantize_row_simd, kernels_simd.h), n a multiple of 32:
  // max |x[i]|, and whether every x[i] is finite;
  static float abs_max(const float* x, int n, bool& finite) {
    const __m512 sign = _mm512_set1_ps(-0.0f), largest = _mm512_set1_ps(FLT_MAX);
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int i = 0; i < n; i += 16) {
      const __m512 a = _mm512_andnot_ps(sign, _mm512_loadu_ps(x + i));
      bad |= _mm512_cmp_ps_mask(a, largest, _CMP_NLE_UQ);  // NaN or infinite
      amax = _mm512_max_ps(amax, a);
    }
    finite = !bad;
    return _mm512_reduce_max_ps(amax);
  }
  // q[i] = clamp(x[i] * inv rounded to nearest even (cvtps2dq), -127, 127); returns the sum of q.
  static int32_t quantize_i8(const float* x, int n, float inv, int8_t* q) {
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), s));
      const __m512i r = _mm512_min_epi32(hi, _mm512_max_epi32(lo, v));
      sum = _mm512_add_epi32(sum, r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(r));
    }
    return _mm512_reduce_add_epi32(sum);
  }
};

#ifdef __AVX512BF16__
// AVX512-BF16 (table "avx512bf16", compiled with -mavx512bf16): bf16 and fp8 weights decoded to bf16 vectors B
// of 2W lanes and multiplied by bf16 activations with vdpbf16ps (lane i of the float32 result sums the
// products of lanes 2i and 2i + 1; bf16 denormal inputs count as zero, which the decodes never produce).
struct Avx512Bf16 : Avx512 {
  static constexpr bool kBf16Dot = true;
  // tokens per register tile: 4 x 6 accumulators, the weight vector and the tokens' loads fit 32 registers
  static constexpr int kBf16Tokens = 6;
  using B = __m512i;

  static B load_b(const uint16_t* p) { return _mm512_loadu_si512(p); }
  // 2W e4m3fn codes without subnormals -> bf16 bits of value * 2^-120, in order (see Avx2Bf16Emulated).
  static B fp8_normal_b(const uint8_t* p) { return fp8_normal_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static B fp8_normal_codes(__m256i codes) {
    const __m512i v = _mm512_cvtepi8_epi16(codes);
    return _mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(static_cast<short>(0x87F0)));
  }
  // 2W e4m3fn codes -> bf16 of value * 2^-8, exact (through IEEE half bits and float32).
  static B fp8_exact_b(const uint8_t* p) { return fp8_exact_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static B fp8_exact_codes(__m256i codes) {
    __m512i h = _mm512_cvtepi8_epi16(codes);
    h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16(static_cast<short>(0xBF80)));
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15 from lo, 16-31 from hi
  }
  static F dot_b(F acc, B a, B b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  static constexpr bool kNativeBf16Round = true;
  // One row: dst[k] = bf16(src[k] * scales[k / bc] * unscale) for k < n (scales == nullptr: * unscale everywhere,
  // bc unused; else bc a multiple of 32), rounded to nearest even by vcvtne2ps2bf16 (which, like vdpbf16ps, takes
  // float32 denormals as zero); true when an output is infinite. 32 lanes a step, the scale set per block, the
  // tail masked.
  static bool scale_row_to_bf16(const float* src, const float* scales, int64_t bc, float unscale, uint16_t* dst,
                                int64_t n) {
    const __m512i magnitude = _mm512_set1_epi16(0x7FFF), inf = _mm512_set1_epi16(0x7F80);
    __mmask32 infinite = 0;
    const int64_t whole = n / 32 * 32;
    int64_t k = 0;
    for (int64_t b = 0; k < whole; ++b) {
      const __m512 sv = _mm512_set1_ps((scales ? scales[b] : 1.0f) * unscale);
      for (const int64_t end = scales && k + bc < whole ? k + bc : whole; k < end; k += 32) {
        const __m512 lo = _mm512_loadu_ps(src + k), hi = _mm512_loadu_ps(src + k + 16);
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sv), _mm512_mul_ps(lo, sv));
        _mm512_storeu_si512(dst + k, v);
        infinite |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, magnitude), inf);
      }
    }
    if (k < n) {
      const __m512 sv = _mm512_set1_ps((scales ? scales[k / bc] : 1.0f) * unscale);
      const __mmask32 m = (__mmask32{1} << (n - k)) - 1;
      const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m), src + k);
      const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(m >> 16), src + k + 16);
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, sv), _mm512_mul_ps(lo, sv));
      _mm512_mask_storeu_epi16(dst + k, m, v);
      infinite |= _mm512_mask_cmpeq_epi16_mask(m, _mm512_and_si512(v, magnitude), inf);
    }
    return infinite != 0;
  }
};
#endif

#ifdef __AMX_BF16__
// AVX-512 with AMX tiles (table "amx", compiled with -mavx512bf16 -mamx-tile -mamx-bf16): bf16 and fp8 weights
// from kAmxMinTokens tokens per expert (int4 and int8 from kAmxIntMinTokens) through tdpbf16ps tiles
// (kernels_amx.h), with the bf16 decodes and rounding of Avx512Bf16; fewer tokens take the float32 GEMV and int
// kernels of Avx512 (no bf16 dot products on the GEMV path).
struct Avx512Amx : Avx512Bf16 {
  static constexpr bool kBf16Dot = false;
  static constexpr bool kAmx = true;
  static constexpr bool kGfni = true;  // compiled with -mgfni; the ISA needs the CPU's gfni
};
#endif

}  // namespace hm
