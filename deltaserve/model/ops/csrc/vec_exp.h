// exp over blocks of 16 floats for the activations (pointwise.cpp, norm.cpp): one code path per build for every
// element, so an activation's bits never depend on where the element sits in a tensor (ATen's fp32 sigmoid and
// silu take a vector path for most elements and a scalar one for each run's tail; see ops/pointwise.py).
//
// Cephes' expf polynomial on r = x - n ln2 (two-step Cody-Waite), scaled by 2^n; within ~2 ulp of expf. The
// argument is clamped to [-87, 88] so 2^n stays a normal float on every build (AVX2 builds 2^n in the exponent
// bits): exp(-87) ~ 1.6e-38 and exp(88) ~ 1.7e38 are where sigmoid and silu are 0 or 1 (or x) to fp32 precision.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ds {

// fp32 <-> the model dtype (c10::BFloat16(float) rounds to nearest even, as torch's casts do)
inline float ld(float v) { return v; }
inline float ld(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T st(float v) { return static_cast<T>(v); }

constexpr int kExpBlock = 16;
constexpr float kExpLo = -87.f, kExpHi = 88.f;

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 floats stored as fp32, or rounded to bf16 as st<c10::BFloat16> rounds (to nearest even, NaN -> 0x7FC0)
inline void st8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void st8(c10::BFloat16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                                    _mm256_extracti128_si256(r, 1)));
}
#endif

// v[0, 16) = exp(v) in place
inline void exp_block(float* v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(v, exp_ps(_mm512_loadu_ps(v)));
#elif defined(__AVX2__) && defined(__FMA__)
  _mm256_storeu_ps(v, exp_ps(_mm256_loadu_ps(v)));
  _mm256_storeu_ps(v + 8, exp_ps(_mm256_loadu_ps(v + 8)));
#else
  for (int i = 0; i < kExpBlock; ++i) v[i] = std::exp(std::fmin(std::fmax(v[i], kExpLo), kExpHi));
#endif
}

// For i in [0, n) in blocks of 16: buf = arg(i); exp_block(buf); put(i, exp(arg(i))). A short last block is
// padded with zeros, so every element goes through the same vector code wherever it sits.
template <class Arg, class Put>
inline void exp_map(int64_t n, Arg arg, Put put) {
  alignas(64) float buf[kExpBlock];
  int64_t i0 = 0;
  for (; i0 + kExpBlock <= n; i0 += kExpBlock) {  // whole blocks: branch-free loops the compiler vectorises
    for (int l = 0; l < kExpBlock; ++l) buf[l] = arg(i0 + l);
    exp_block(buf);
    for (int l = 0; l < kExpBlock; ++l) put(i0 + l, buf[l]);
  }
  if (i0 < n) {  // the short last block, zero-padded: the same exp_block
    const int m = static_cast<int>(n - i0);
    for (int l = 0; l < kExpBlock; ++l) buf[l] = l < m ? arg(i0 + l) : 0.f;
    exp_block(buf);
    for (int l = 0; l < m; ++l) put(i0 + l, buf[l]);
  }
}

#if defined(__AVX512F__)
// 16 lanes of an activation at once, for the AVX-512 builds' kernels: loads widen bf16 (or take fp32), stores
// round to bf16 as st<c10::BFloat16> does (to nearest even, NaN -> 0x7FC0) or store fp32, each under a lane
// mask (the last block of a row: masked-off lanes load 0, as exp_map's zero padding, and are not stored). The
// arithmetic between them is the scalar kernels' IEEE ops, so the bits are theirs.
inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u); }
inline __m512 ld16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld16(const c10::BFloat16* p, __mmask16 m) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512i bf16_bits16(__m512 v) {  // in the low 16 bits of each lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}
inline __m512 neg16(__m512 v) { return _mm512_xor_ps(v, _mm512_set1_ps(-0.f)); }  // -v, as the scalar minus
inline void st16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void st16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
// ld(st<T>(v)): v rounded to T's precision, as fp32
inline __m512 round16(__m512 v, float*) { return v; }
inline __m512 round16(__m512 v, c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
template <typename T>
inline __m512 round16(__m512 v) { return round16(v, static_cast<T*>(nullptr)); }
inline __m512 one_plus_exp_neg(__m512 v) { return _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(neg16(v))); }
// f(i, mask) for each block of 16 of [0, n), the last one masked
template <class F>
inline void blocks16(int64_t n, F f) {
  for (int64_t i = 0; i < n; i += kExpBlock) f(i, lanes(n - i));
}
#endif

// o[0, n) = a / (1 + exp(-a)) in T, for fp32 sums a: the GDN conv's activation, one code path for every element
// (conv_prefill.cpp's rows, which the compiled prefill and decode step both run, and pointwise.cpp silu_into, the
// torch form's compiled silu: one set of bits for a token through any of them)
template <typename T>
inline void silu_row(const float* a, T* o, int64_t n) {
#if defined(__AVX512F__)
  blocks16(n, [&](int64_t i, __mmask16 m) {
    const __m512 v = ld16(a + i, m);
    st16(o + i, _mm512_div_ps(v, one_plus_exp_neg(v)), m);
  });
#else
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // 8 lanes at a time: exp_map's very operations (its exp_block is this exp_ps on each half, the negation a sign
  // flip, then one add and one divide) without its buffer and scalar divides, so the bits are the same
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(a + i);
    st8(o + i, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_xor_ps(v, _mm256_set1_ps(-0.f))))));
  }
#endif
  exp_map(n - i, [&](int64_t j) { return -a[i + j]; },
          [&](int64_t j, float e) { o[i + j] = st<T>(a[i + j] / (1.f + e)); });
#endif
}

}  // namespace ds
