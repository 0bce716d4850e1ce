// The AVX2+FMA+F16C vector vocabulary the templated kernels (kernels_simd.h) are written in.
// Included only by translation units compiled with -mavx2 -mfma -mf16c.
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cstdint>

namespace hm {

struct Avx2 {
  static constexpr int W = 8;  // floats per vector
  using F = __m256;
  static constexpr bool kBf16Dot = false;  // float32 activations for the float formats (see Avx2Bf16Emulated)
  static constexpr bool kAmx = false;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // [hsum(a), hsum(b), hsum(c), hsum(d)]: the four reduced together (11 operations rather than 4 x 6), each
  // 128-bit lane first summed into [a, b, c, d] by unpacks and shuffles.
  static __m128 hsum4(F a, F b, F c, F d) {
    const F ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // a02 b02 a13 b13 per lane
    const F cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const F abcd = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }

  // W weights -> floats.
  static F load_bf16(const uint16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static F load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // e4m3fn codes -> value * 2^-8, exact: the code's bits placed into an IEEE half (exponent bias 15 vs 7),
  // converted by F16C, so fp8 subnormals become normal floats (no float32 denormals). NaN codes are not
  // mapped to NaN here; the kernels detect them per row (fp8_has_nan).
  static F load_fp8(const uint8_t* p) {
    __m128i h = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    h = _mm_and_si128(_mm_slli_epi16(h, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    return _mm256_cvtph_ps(h);
  }

  // e4m3fn codes known to hold no subnormals -> value * 2^-120, by bit placement into float32 (exponent bias 127
  // vs 7; a subnormal code would become a float32 denormal, hence the exact variant above for rows with them).
  static F load_fp8_normal(const uint8_t* p) {
    __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    v = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
    return _mm256_castsi256_ps(v);
  }

  // e^x, relative error ~2e-7 (Cephes polynomial); NaN propagates.
  static F exp(F x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x);
    F n = _mm256_floor_ps(fma(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    F y = _mm256_set1_ps(1.9875691500e-4f);
    y = fma(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = fma(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = fma(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = fma(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = fma(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = fma(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }

  // Integer dot products over 32 bytes, accumulated into 8 int32 lanes (lane l holds bytes 4l..4l+3).
  // u: unsigned weights 0..15 (int4 + 8); s: int8 activations in [-127, 127].
  static __m256i dot_u4(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  // int4 in 16-bit lanes: pair sums of u x s added to acc16 (|pair sum| <= 2 * 15 * 127, so the four chunks of a
  // 128-group fit int16), widened to int32 once per group: two instructions a chunk instead of three.
  static constexpr bool kPairSums16 = true;
  static __m256i pairs_u4(__m256i acc16, __m256i u, __m256i s) {
    return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(u, s));
  }
  static __m256i widen_pairs(__m256i acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
  // w: int8 weights in [-127, 127]; result offset kI8Offset * sum(s) (none here: sign trick).
  static constexpr int kI8Offset = 0;
  static __m256i dot_i8(__m256i acc, __m256i w, __m256i s) {
    const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(w, s));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
  }

  // Activation quantisation (quantize_row_simd, kernels_simd.h), n a multiple of 32:
  // max |x[i]|, and whether every x[i] is finite;
  static float abs_max(const float* x, int n, bool& finite) {
    const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(FLT_MAX);
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
      const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // NaN or infinite
      amax = _mm256_max_ps(amax, a);
    }
    finite = !_mm256_movemask_ps(bad);
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  // q[i] = clamp(x[i] * inv rounded to nearest even (cvtps2dq), -127, 127); returns the sum of q.
  static int32_t quantize_i8(const float* x, int n, float inv, int8_t* q) {
    const __m256 s = _mm256_set1_ps(inv);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i sum = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 32) {  // 4 vectors -> 32 int8 in order
      __m256i r[4];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), s));
        r[j] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, v));
        sum = _mm256_add_epi32(sum, r[j]);
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
  }
};

// The bf16 dot-product vocabulary of kernels_simd_bf16.h emulated on AVX2 (table "avx2bf16"): the same
// arithmetic as AVX512-BF16's vdpbf16ps on bf16 vectors B of 2W lanes (lane i of the float32 result sums
// lanes 2i and 2i + 1), by two FMAs on the even and odd lanes, except that bf16 denormals are kept rather than
// flushed. It exists to run that code on CPUs without AVX512-BF16 (tests); it is slower than Avx2.
struct Avx2Bf16Emulated : Avx2 {
  static constexpr bool kBf16Dot = true;
  static constexpr int kBf16Tokens = 3;  // tokens per register tile (4 x 3 accumulators, as Avx2)
  static constexpr bool kNativeBf16Round = false;  // activations rounded to bf16 by the portable loop
  using B = __m256i;

  static B load_b(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // 2W e4m3fn codes without subnormals -> bf16 bits of value * 2^-120 (sign to bit 15, exponent and mantissa
  // to the low bits of bf16's), in order.
  static B fp8_normal_b(const uint8_t* p) {
    const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(static_cast<short>(0x87F0)));
  }
  // 2W e4m3fn codes -> bf16 of value * 2^-8, exact (through IEEE half bits and float32, as load_fp8).
  static B fp8_exact_b(const uint8_t* p) {
    __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtph_ps(_mm256_castsi256_si128(h))), 16);
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1))), 16);
    // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> in order
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  }
  static F dot_b(F acc, B a, B b) {
    const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    acc = fma(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
    return fma(_mm256_castsi256_ps(_mm256_and_si256(a, odd)), _mm256_castsi256_ps(_mm256_and_si256(b, odd)), acc);
  }
};

}  // namespace hm
