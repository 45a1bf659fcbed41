// Rounding fp32 sums to bf16 in the AVX2 builds' vector paths (linear_fp8.cpp, linear_int4.cpp): 16 output columns
// as two registers of 8, stored with c10::BFloat16's rounding (nearest even, NaN -> 0x7FC0).
#pragma once
#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace ds_avx2 {

// fp32 -> bf16 bits, 8 lanes
inline __m256i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// columns 0-7 (lo) and 8-15 (hi) rounded to bf16 and stored at out (16-bit words), the first ncols of them
inline void store_bf16x16(__m256 lo, __m256 hi, void* out, int64_t ncols) {
  // packus interleaves 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> columns 0-15 after the permute
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(to_bf16(lo), to_bf16(hi)), 0xD8);
  if (ncols >= 16) {
    _mm256_storeu_si256(static_cast<__m256i*>(out), words);
  } else {
    alignas(32) uint16_t tmp[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), words);
    std::memcpy(out, tmp, ncols * sizeof(uint16_t));
  }
}

}  // namespace ds_avx2
#endif
