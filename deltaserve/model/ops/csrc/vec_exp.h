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

}  // namespace ds
