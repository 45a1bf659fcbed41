// CPU decode kernels, loaded by deltaserve/model/ops/cpu_kernels.py (torch.utils.cpp_extension.load).
//
// Each kernel handles ALL decode sequences of a step in one call, parallel over (sequence, head) work items
// with at::parallel_for. A work item's arithmetic is a fixed loop over its own data only, so a sequence's
// result does not depend on which other sequences share the call (batch-invariant by construction).
//
// paged_decode_attention: one query token per sequence against its K/V read in place through its page table
//   (no gather copy). Numerics follow ops/attention.py decode_attention: scores rounded to the model dtype,
//   scaled and rounded again, softmax in fp32, probabilities rounded to the model dtype, P V accumulated in
//   fp32 and rounded once.
// gdn_decode_step: one gated-delta-rule token per sequence, updating the fp32 state slots in place through
//   slot ids (any order, not necessarily consecutive). One pass over each state row: S k and S q from the old
//   row, then the row update. Same algebra as ops/gdn.py recurrent_gated_delta_rule_step.
// conv1d_step: the causal conv with its silu for one token per sequence, states updated in place through slot
//   ids: one row of the compiled prefill's (conv_prefill.cpp ds::conv_rows: the order and roundings of
//   ops/conv.py _conv_acc, one fp32 mul and one add per tap, never fused, then vec_exp.h silu_row), so the bits
//   equal the prefill's.

#include "aten_lite.h"
#include "kernels.h"
#include "vec_exp.h"
#include <torch/python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DS_AVX2 1  // the AVX2 + FMA build: 8-lane variants of the AVX-512 loops below, same roundings
#endif

// Built with -ffp-contract=off: a * b + c stays a multiply and an add unless a kernel asks for std::fma / an
// fma intrinsic (the conv must match ops/conv.py's unfused torch arithmetic bit for bit).

namespace {

using bf16_bits = uint16_t;

inline float to_f(float x) { return x; }
inline float to_f(bf16_bits x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest even, as c10::BFloat16(float)
inline bf16_bits f_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_bits(u >> 16);
}

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16_bits from_f<bf16_bits>(float f) { return f_to_bf16(f); }

// the value a tensor of dtype T holds after storing f (identity for fp32)
template <typename T> inline float round_to(float f) { return to_f(from_f<T>(f)); }

constexpr int LANES = 16;

// Calls touching fewer elements than kSerialBelow (kernels.h) run on the calling thread: waking the other threads
// costs more than the work. (A separate 2^20 kept a tiny model's batch-8 attention and GDN step on one thread.)

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_bits* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#elif defined(DS_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_bits* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// horizontal sum / max of 8 lanes in a fixed order (halves, then pairs)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// sum_i a[i] * b[i] over n, fp32: LANES partial sums then a fixed tree; the same order for every call
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
  if (n % LANES == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(DS_AVX2)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    return hsum8(acc);
  }
#endif
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(a[i + l], to_f(b[i + l]), acc[l]);
  for (int l = 0; i < n; ++i, ++l) acc[l] = std::fma(a[i], to_f(b[i]), acc[l]);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// ---- paged decode attention -------------------------------------------------------------------------------

#if defined(__AVX512F__)
// the value an fp32 vector holds after a round trip through T (bf16: round to nearest even, as f_to_bf16)
template <typename T> inline __m512 round512(__m512 x);
template <> inline __m512 round512<float>(__m512 x) { return x; }
template <> inline __m512 round512<bf16_bits>(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u)));
  return _mm512_castsi512_ps(r);  // scores and probabilities are finite: no NaN case
}
#elif defined(DS_AVX2)
template <typename T> inline __m256 round256(__m256 x);
template <> inline __m256 round256<float>(__m256 x) { return x; }
template <> inline __m256 round256<bf16_bits>(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(int(0xffff0000u)));
  return _mm256_castsi256_ps(r);
}
#endif

// softmax over s[0, L) in fp32 in place, probabilities rounded to T
template <typename T>
inline void softmax_row(float* s, int64_t L) {
#if defined(__AVX512F__)
  if (L >= LANES) {  // lanes over positions; the tail through a mask; fixed order for a given L
    const int64_t full = L - L % LANES;
    const __mmask16 tail = __mmask16((1u << (L % LANES)) - 1u);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; t += LANES) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
    if (tail) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    __m512 vs = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += LANES) {
      const __m512 e = ds::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
      _mm512_storeu_ps(s + t, e);
      vs = _mm512_add_ps(vs, e);
    }
    if (tail) {
      const __m512 e = ds::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m));
      _mm512_mask_storeu_ps(s + full, tail, e);
      vs = _mm512_add_ps(vs, _mm512_maskz_mov_ps(tail, e));
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vs));
    for (int64_t t = 0; t < full; t += LANES) _mm512_storeu_ps(s + t, round512<T>(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv)));
    if (tail) _mm512_mask_storeu_ps(s + full, tail, round512<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), inv)));
    return;
  }
#elif defined(DS_AVX2)
  if (L >= 8) {  // as the AVX-512 loop, 8 lanes; the tail through a lane mask
    const int64_t full = L - L % 8;
    const int rem = int(L % 8);
    const __m256i mi = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 mf = _mm256_castsi256_ps(mi), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vm = ninf;
    for (int64_t t = 0; t < full; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
    if (rem) vm = _mm256_max_ps(vm, _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + full, mi), mf));
    const __m256 m = _mm256_set1_ps(hmax8(vm));
    __m256 vs = _mm256_setzero_ps();
    for (int64_t t = 0; t < full; t += 8) {
      const __m256 e = ds::exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
      _mm256_storeu_ps(s + t, e);
      vs = _mm256_add_ps(vs, e);
    }
    if (rem) {
      const __m256 e = ds::exp_ps(_mm256_sub_ps(_mm256_maskload_ps(s + full, mi), m));
      _mm256_maskstore_ps(s + full, mi, e);
      vs = _mm256_add_ps(vs, _mm256_and_ps(e, mf));
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum8(vs));
    for (int64_t t = 0; t < full; t += 8) _mm256_storeu_ps(s + t, round256<T>(_mm256_mul_ps(_mm256_loadu_ps(s + t), inv)));
    if (rem) _mm256_maskstore_ps(s + full, mi, round256<T>(_mm256_mul_ps(_mm256_maskload_ps(s + full, mi), inv)));
    return;
  }
#endif
  float m = -INFINITY;
  for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < L; ++t) s[t] = round_to<T>(s[t] * inv);
}

// scalar path: any G, D. q [G, D] fp32; krows / vrows [L] row pointers; scores [G, L] scratch; out [G, D]
template <typename T>
void attend_generic(const float* q, const T* const* krows, const T* const* vrows, int64_t L, int64_t G, int64_t D,
                    float sc, float* scores, T* out) {
  // scores [G, L]: q . k in fp32, rounded to T, times scale, rounded to T (decode_attention's roundings)
  for (int64_t t = 0; t < L; ++t)
    for (int64_t g = 0; g < G; ++g) scores[g * L + t] = round_to<T>(round_to<T>(dot(q + g * D, krows[t], D)) * sc);
  for (int64_t g = 0; g < G; ++g) softmax_row<T>(scores + g * L, L);
  // out [G, D] = P V, fp32 accumulation in position order
  std::vector<float> acc(G * D, 0.f);
  for (int64_t t = 0; t < L; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] = std::fma(p, to_f(vrows[t][d]), acc[g * D + d]);
    }
  for (int64_t i = 0; i < G * D; ++i) out[i] = from_f<T>(acc[i]);
}

#if defined(__AVX512F__)
// P V for output columns [d, d + 16 NB) of G heads: G x NB accumulators in registers, positions in order (each
// column's sum the same for any NB)
template <typename T, int G, int NB>
inline void pv_avx512(const float* scores, const T* const* vrows, int64_t L, int64_t d, int64_t D, T* out) {
  __m512 a[G][NB];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NB; ++j) a[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m512 v[NB];
    for (int j = 0; j < NB; ++j) v[j] = load16(vrows[t] + d + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + t]);
      for (int j = 0; j < NB; ++j) a[g][j] = _mm512_fmadd_ps(p, v[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float buf[16 * NB];
    for (int j = 0; j < NB; ++j) _mm512_store_ps(buf + 16 * j, a[g][j]);
    for (int i = 0; i < 16 * NB; ++i) out[g * D + d + i] = from_f<T>(buf[i]);
  }
}

// AVX-512 path for G query heads per kv head (compile-time), D a multiple of 32. Same roundings and the same
// per-position order as attend_generic; only the order of the fp32 sums inside one dot product differs.
// A dot product is a chain of D / 16 dependent fmas and P V a chain of L per column: NT positions' dot products
// and NB column blocks run side by side so that the chains' latencies overlap (each sum keeps its order).
template <typename T, int G>
void attend_avx512(const float* q, const T* const* krows, const T* const* vrows, int64_t L, int64_t D, float sc,
                   float* scores, T* out) {
  constexpr int NT = G <= 2 ? 4 : G == 4 ? 2 : 1;   // positions per pass: NT x G accumulators
  constexpr int NB = G <= 2 ? 8 : G == 4 ? 4 : 2;   // 16-column blocks per P V pass: G x NB accumulators
  auto dots = [&](int64_t t, auto nt) {  // scores of positions t .. t + nt - 1
    constexpr int N = decltype(nt)::value;
    __m512 acc[N][G];
    for (int i = 0; i < N; ++i)
      for (int g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      for (int i = 0; i < N; ++i) {
        const __m512 k0 = load16(krows[t + i] + d), k1 = load16(krows[t + i] + d + 16);
        for (int g = 0; g < G; ++g) {
          acc[i][g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), k0, acc[i][g]);
          acc[i][g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d + 16), k1, acc[i][g]);
        }
      }
    }
    for (int i = 0; i < N; ++i)
      for (int g = 0; g < G; ++g)
        scores[g * L + t + i] = round_to<T>(round_to<T>(_mm512_reduce_add_ps(acc[i][g])) * sc);
  };
  int64_t t = 0;
  for (; t + NT <= L; t += NT) dots(t, std::integral_constant<int, NT>{});
  for (; t < L; ++t) dots(t, std::integral_constant<int, 1>{});
  for (int g = 0; g < G; ++g) softmax_row<T>(scores + g * L, L);
  int64_t d = 0;
  for (; d + 16 * NB <= D; d += 16 * NB) pv_avx512<T, G, NB>(scores, vrows, L, d, D, out);
  for (; d < D; d += 32) pv_avx512<T, G, 2>(scores, vrows, L, d, D, out);
}
#elif defined(DS_AVX2)
// P V for output columns [d, d + 8 NV) of G heads, as pv_avx512 on 8 lanes
template <typename T, int G, int NV>
inline void pv_avx2(const float* scores, const T* const* vrows, int64_t L, int64_t d, int64_t D, T* out) {
  __m256 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m256 vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = load8(vrows[t] + d + 8 * v);
    for (int g = 0; g < G; ++g) {
      const __m256 p = _mm256_set1_ps(scores[g * L + t]);
      for (int v = 0; v < NV; ++v) a[g][v] = _mm256_fmadd_ps(p, vv[v], a[g][v]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float buf[8 * NV];
    for (int v = 0; v < NV; ++v) _mm256_store_ps(buf + 8 * v, a[g][v]);
    for (int i = 0; i < 8 * NV; ++i) out[g * D + d + i] = from_f<T>(buf[i]);
  }
}

// AVX2 path for G query heads per kv head, D a multiple of 16: attend_avx512 on 8 lanes (16 ymm registers:
// fewer positions and columns side by side)
template <typename T, int G>
void attend_avx2(const float* q, const T* const* krows, const T* const* vrows, int64_t L, int64_t D, float sc,
                 float* scores, T* out) {
  constexpr int NT = G <= 2 ? 4 / G : 1;         // positions per pass: NT x G accumulators
  constexpr int NV = G <= 2 ? 4 : G == 4 ? 2 : 1;  // 8-column blocks per P V pass
  auto dots = [&](int64_t t, auto nt) {
    constexpr int N = decltype(nt)::value;
    __m256 acc[N][G];
    for (int i = 0; i < N; ++i)
      for (int g = 0; g < G; ++g) acc[i][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      for (int i = 0; i < N; ++i) {
        const __m256 k0 = load8(krows[t + i] + d), k1 = load8(krows[t + i] + d + 8);
        for (int g = 0; g < G; ++g) {
          acc[i][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), k0, acc[i][g]);
          acc[i][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d + 8), k1, acc[i][g]);
        }
      }
    }
    for (int i = 0; i < N; ++i)
      for (int g = 0; g < G; ++g) scores[g * L + t + i] = round_to<T>(round_to<T>(hsum8(acc[i][g])) * sc);
  };
  int64_t t = 0;
  for (; t + NT <= L; t += NT) dots(t, std::integral_constant<int, NT>{});
  for (; t < L; ++t) dots(t, std::integral_constant<int, 1>{});
  for (int g = 0; g < G; ++g) softmax_row<T>(scores + g * L, L);
  int64_t d = 0;
  for (; d + 8 * NV <= D; d += 8 * NV) pv_avx2<T, G, NV>(scores, vrows, L, d, D, out);
  for (; d < D; d += 8) pv_avx2<T, G, 1>(scores, vrows, L, d, D, out);
}
#endif

template <typename T>
void attend_one(const float* q, const T* const* krows, const T* const* vrows, int64_t L, int64_t G, int64_t D,
                float sc, float* scores, T* out) {
#if defined(__AVX512F__)
  if (D % 32 == 0) {
    switch (G) {
      case 1: return attend_avx512<T, 1>(q, krows, vrows, L, D, sc, scores, out);
      case 2: return attend_avx512<T, 2>(q, krows, vrows, L, D, sc, scores, out);
      case 4: return attend_avx512<T, 4>(q, krows, vrows, L, D, sc, scores, out);
      case 8: return attend_avx512<T, 8>(q, krows, vrows, L, D, sc, scores, out);
      default: break;
    }
  }
#elif defined(DS_AVX2)
  if (D % 16 == 0) {
    switch (G) {
      case 1: return attend_avx2<T, 1>(q, krows, vrows, L, D, sc, scores, out);
      case 2: return attend_avx2<T, 2>(q, krows, vrows, L, D, sc, scores, out);
      case 4: return attend_avx2<T, 4>(q, krows, vrows, L, D, sc, scores, out);
      case 8: return attend_avx2<T, 8>(q, krows, vrows, L, D, sc, scores, out);
      default: break;
    }
  }
#endif
  attend_generic<T>(q, krows, vrows, L, G, D, sc, scores, out);
}

// q [B, Hq, D]; kv [P, 2, bs, Hkv, D]; page_table [B, maxp] int64; lengths [B] int64; out [B, Hq, D]
template <typename T>
void attention_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                    const at::Tensor& lengths, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = kv.size(2), Hkv = kv.size(3), G = Hq / Hkv;
  const int64_t row_stride = Hkv * D;            // one position inside a page
  const int64_t half_stride = bs * row_stride;    // keys -> values
  const int64_t page_stride = 2 * half_stride;
  const int64_t maxp = page_table.size(1);
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kvp = reinterpret_cast<const T*>(kv.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  const float sc = float(scale);

  // one (sequence, kv head) item reads ~2 L D elements: split items across threads only when there is work
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += lens[b];
  const int64_t grain = total * Hkv * D < kSerialBelow ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    ds::LineBuffer qf(G * D), scores;  // on 64-byte lines (kernels.h)
    std::vector<const T*> krows, vrows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = lens[b];
      const int64_t* pages = pt + b * maxp;
      scores.ensure(G * L);
      krows.resize(L);
      vrows.resize(L);
      for (int64_t t = 0; t < L; ++t) {  // position t: page pages[t / bs], row t % bs, kv head h
        krows[t] = kvp + pages[t / bs] * page_stride + (t % bs) * row_stride + h * D;
        vrows[t] = krows[t] + half_stride;
      }
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qp[(b * Hq + h * G) * D + i]);  // heads h*G .. h*G+G-1
      attend_one<T>(qf.data(), krows.data(), vrows.data(), L, G, D, sc, scores.data(), op + (b * Hq + h * G) * D);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv, at::Tensor page_table,
                                     at::Tensor lengths, double scale) {
  auto out = at::empty_like(q);
  ds::paged_attention_into(q, kv, page_table, lengths, scale, out);
  return out;
}

// ---- gated delta rule, one decode token -------------------------------------------------------------------

// One (row, value head) of the gated delta rule's decode step: qr, kr [dk] (the head's key head), vr [dv], the
// gate g (its log) and beta, the head's state S [dv, dk] fp32 read and the next state written to D (S itself, in
// place, or another block), o [dv]; qn, kn: dk floats of scratch
template <typename T>
inline void gdn_item(const T* qr, const T* kr, const T* vr, float g, float bt, const float* S, float* D, T* o,
                     int64_t dv, int64_t dk, float qscale, float* qn, float* kn) {
  // l2norm (x * rsqrt(sum x^2 + 1e-6)) in fp32, then q * dk^-0.5
  float sq = 0.f, sk = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float a = to_f(qr[i]), c = to_f(kr[i]);
    qn[i] = a; kn[i] = c;
    sq += a * a; sk += c * c;
  }
  const float rq = 1.f / std::sqrt(sq + 1e-6f), rk = 1.f / std::sqrt(sk + 1e-6f);
  for (int64_t i = 0; i < dk; ++i) { qn[i] = (qn[i] * rq) * qscale; kn[i] = kn[i] * rk; }
  const float kq = dot(kn, qn, dk);
  const float e = std::exp(g);
  for (int64_t r = 0; r < dv; ++r) {
    const float* row = S + r * dk;
    float* next = D + r * dk;
#if defined(__AVX512F__)
    if (dk % LANES == 0) {  // S k and S q in one pass over the row, then the row update
      __m512 ak = _mm512_setzero_ps(), aq = _mm512_setzero_ps();
      for (int64_t j = 0; j < dk; j += LANES) {
        const __m512 x = _mm512_loadu_ps(row + j);
        ak = _mm512_fmadd_ps(_mm512_loadu_ps(kn + j), x, ak);
        aq = _mm512_fmadd_ps(_mm512_loadu_ps(qn + j), x, aq);
      }
      const float delta = (to_f(vr[r]) - _mm512_reduce_add_ps(ak) * e) * bt;
      o[r] = from_f<T>(_mm512_reduce_add_ps(aq) * e + delta * kq);
      const __m512 ve = _mm512_set1_ps(e), vd = _mm512_set1_ps(delta);
      for (int64_t j = 0; j < dk; j += LANES)
        _mm512_storeu_ps(next + j, _mm512_fmadd_ps(vd, _mm512_loadu_ps(kn + j),
                                                   _mm512_mul_ps(_mm512_loadu_ps(row + j), ve)));
      continue;
    }
#elif defined(DS_AVX2)
    if (dk % 8 == 0) {  // as the AVX-512 branch, 8 lanes
      __m256 ak = _mm256_setzero_ps(), aq = _mm256_setzero_ps();
      for (int64_t j = 0; j < dk; j += 8) {
        const __m256 x = _mm256_loadu_ps(row + j);
        ak = _mm256_fmadd_ps(_mm256_loadu_ps(kn + j), x, ak);
        aq = _mm256_fmadd_ps(_mm256_loadu_ps(qn + j), x, aq);
      }
      const float delta = (to_f(vr[r]) - hsum8(ak) * e) * bt;
      o[r] = from_f<T>(hsum8(aq) * e + delta * kq);
      const __m256 ve = _mm256_set1_ps(e), vd = _mm256_set1_ps(delta);
      for (int64_t j = 0; j < dk; j += 8)
        _mm256_storeu_ps(next + j, _mm256_fmadd_ps(vd, _mm256_loadu_ps(kn + j),
                                                   _mm256_mul_ps(_mm256_loadu_ps(row + j), ve)));
      continue;
    }
#endif
    const float s_k = dot(kn, row, dk), s_q = dot(qn, row, dk);
    const float delta = (to_f(vr[r]) - s_k * e) * bt;
    o[r] = from_f<T>(s_q * e + delta * kq);
    for (int64_t j = 0; j < dk; ++j) next[j] = std::fma(delta, kn[j], row[j] * e);
  }
}

// q, k [B, Hk, dk], v [B, H, dv] (inner two dims contiguous, any row stride); g [B, H] fp32; beta [B, H];
// state [S, H, dv, dk] fp32 contiguous; slots [B] int64; out [B, H, dv] in q's dtype.
// spans (gdn_span_into): rows are the tokens of spans, span s the rows span_rows[span_at[s] .. span_at[s + 1]) in
// token order, its state the slot span_slot[s]; slots unused. Each (span, head) steps its tokens one after the
// other on its state block (which stays in cache), so each token's arithmetic is gdn_item's, as a decode step of
// that token alone computes it. first_only: the second token steps the slot's block into a scratch block and the
// later tokens step that, so the slot keeps the first token's state and nothing else is written (a verify step
// whose drafts are all rejected writes the states a plain decode step writes).
template <typename T>
void gdn_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
              const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, at::Tensor& out,
              const ds::GdnSpans* spans = nullptr) {
  const int64_t B = v.size(0), H = v.size(1), dv = v.size(2), Hk = q.size(1), dk = q.size(2);
  const int64_t rep = H / Hk;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const T* bp = reinterpret_cast<const T*>(beta.data_ptr());
  const float* gp = g.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t qs0 = q.stride(0), ks0 = k.stride(0), vs0 = v.stride(0), bs0 = beta.stride(0), gs0 = g.stride(0);
  const int64_t qs1 = q.stride(1), ks1 = k.stride(1), vs1 = v.stride(1);
  const float qscale = 1.f / std::sqrt(float(dk));  // python's dk ** -0.5 rounded to fp32
  auto token = [&](int64_t b, int64_t h, const float* S, float* D, float* qn, float* kn) {
    gdn_item<T>(qp + b * qs0 + (h / rep) * qs1, kp + b * ks0 + (h / rep) * ks1, vp + b * vs0 + h * vs1,
                gp[b * gs0 + h], to_f(bp[b * bs0 + h]), S, D, op + (b * H + h) * dv, dv, dk, qscale, qn, kn);
  };

  const int64_t grain = B * H * dv * dk < kSerialBelow ? B * H : 1;
  if (spans == nullptr) {
    const int64_t* sl = slots.data_ptr<int64_t>();
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      ds::LineBuffer qn(dk), kn(dk);  // on 64-byte lines (kernels.h)
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / H, h = item % H;
        float* S = sp + (sl[b] * H + h) * dv * dk;
        token(b, h, S, S, qn.data(), kn.data());
      }
    });
    return;
  }
  const std::vector<int64_t>&at = spans->at, &rows = spans->rows, &slot = spans->slot;
  const int64_t n = int64_t(slot.size()), block = dv * dk;
  const bool first_only = spans->first_only;
  at::parallel_for(0, n * H, n * H * block < kSerialBelow ? n * H : 1, [&](int64_t begin, int64_t end) {
    ds::LineBuffer qn(dk), kn(dk), scratch(first_only ? block : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / H, h = item % H;
      float* S = sp + (slot[s] * H + h) * block;
      token(rows[at[s]], h, S, S, qn.data(), kn.data());
      float* D = first_only ? scratch.data() : S;  // first_only: the second token reads the slot, writes the scratch
      for (int64_t t = at[s] + 1; t < at[s + 1]; ++t) {
        token(rows[t], h, S, D, qn.data(), kn.data());
        S = D;
      }
    }
  });
}

// one slot's state stepped through the rows of q, k, v, g, beta in order (a rollback's replay of the accepted tokens
// of a verify span from their logged inputs): each token's bits gdn_decode_step's for that token alone
at::Tensor gdn_replay(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta, at::Tensor state,
                      int64_t slot);

at::Tensor gdn_decode_step(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                              at::Tensor state, at::Tensor slots) {
  TORCH_CHECK(v.dim() == 3, "q, k [B, Hk, dk] and v [B, H, dv] expected");
  auto out = at::empty(v.sizes(), q.options());
  ds::gdn_step_into(q, k, v, g, beta, state, slots, out);
  return out;
}

// ---- causal conv1d, one decode token ----------------------------------------------------------------------

// x [T, C] (rows picked by `rows`, inner dim contiguous); wt [K, C] fp32 contiguous (tap-major weight);
// state [S, K-1, C] in x's dtype, the last K-1 inputs oldest first, updated in place at `slots`; out [B, C]
// contiguous: silu(sum_j wt[j] * xpad[j]) with xpad = (state rows, x), ds::conv_rows' one row
template <typename T>  // float or c10::BFloat16
void conv_impl(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& wt, at::Tensor& state,
               const at::Tensor& slots, at::Tensor& out) {
  const int64_t B = rows.size(0), C = wt.size(1), K = wt.size(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const int64_t xs0 = x.stride(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* w = wt.data_ptr<float>();
  T* sp = reinterpret_cast<T*>(state.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t grain = B * C * K < kSerialBelow ? B : 1;
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    thread_local ds::LineBuffer acc;  // C floats, kept: one call per GDN layer and step
    acc.ensure(C);
    for (int64_t b = begin; b < end; ++b) {
      const T* xr = xp + rp[b] * xs0;
      T* st = sp + sl[b] * (K - 1) * C;
      ds::conv_rows(xr, xs0, st, w, K, C, 0, 1, op + b * C, C, acc.data());
      std::memmove(st, st + C, (K - 2) * C * sizeof(T));  // drop the oldest input, append x
      std::memcpy(st + (K - 2) * C, xr, C * sizeof(T));
    }
  });
}

at::Tensor conv1d_step(at::Tensor x, at::Tensor rows, at::Tensor wt, at::Tensor state, at::Tensor slots) {
  TORCH_CHECK(x.dim() == 2 && rows.dim() == 1, "x must be [T, C] with a contiguous inner dim");
  auto out = at::empty({rows.size(0), x.size(1)}, x.options());
  ds::conv_step_into(x, rows, wt, state, slots, out);
  return out;
}

}  // namespace

// the decode kernels' entry points (kernels.h), writing the caller's tensors: decode_layers.cpp calls them on its
// buffers, the allocating forms above (the module's bindings) on new ones
namespace ds {
void paged_attention_into(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                          const at::Tensor& lengths, double scale, at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, Hq, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be a contiguous [B, Hq, D] in q's dtype");
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous() && kv.size(1) == 2, "kv must be a contiguous [P, 2, bs, Hkv, D]");
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "q and kv dtypes differ");
  TORCH_CHECK(kv.size(4) == q.size(2) && q.size(1) % kv.size(3) == 0, "head shapes do not match");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) && page_table.is_contiguous() &&
              page_table.scalar_type() == at::kLong, "page_table must be a contiguous int64 [B, maxp]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == q.size(0) && lengths.scalar_type() == at::kLong &&
              lengths.is_contiguous(), "lengths must be int64 [B]");
  {
    const int64_t* lens = lengths.data_ptr<int64_t>();
    const int64_t* pt = page_table.data_ptr<int64_t>();
    const int64_t bs = kv.size(2), P = kv.size(0), maxp = page_table.size(1);
    for (int64_t b = 0; b < q.size(0); ++b) {
      TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= maxp, "sequence length outside its page table");
      for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
        TORCH_CHECK(pt[b * maxp + i] >= 0 && pt[b * maxp + i] < P, "page id out of range");
    }
  }
  if (q.scalar_type() == at::kFloat) {
    attention_impl<float>(q, kv, page_table, lengths, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_impl<bf16_bits>(q, kv, page_table, lengths, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only");
  }
}

namespace {
void gdn_checked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, at::Tensor& out,
                 const GdnSpans* spans) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "q, k [B, Hk, dk] and v [B, H, dv] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v: last dim must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
              beta.scalar_type() == q.scalar_type(), "q, k, v, beta must share a dtype");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 2 && g.stride(1) == 1, "g must be fp32 [B, H]");
  TORCH_CHECK(beta.dim() == 2 && beta.stride(1) == 1, "beta must be [B, H]");
  const int64_t B = v.size(0), H = v.size(1), dv = v.size(2), dk = q.size(2);
  TORCH_CHECK(H % q.size(1) == 0, "value heads not a multiple of key heads");
  TORCH_CHECK(g.size(0) == B && g.size(1) == H && beta.size(0) == B && beta.size(1) == H, "g, beta shapes");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 4 &&
              state.size(1) == H && state.size(2) == dv && state.size(3) == dk, "state must be fp32 [S, H, dv, dk]");
  if (spans == nullptr) {
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong && slots.is_contiguous(),
                "slots must be int64 [B]");
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sl[b] >= 0 && sl[b] < state.size(0), "slot out of range");
  } else {  // every row once, each span a slot of its own
    const int64_t n = int64_t(spans->slot.size());
    TORCH_CHECK(int64_t(spans->at.size()) == n + 1 && spans->at[0] == 0 && spans->at[n] == B &&
                int64_t(spans->rows.size()) == B, "gdn spans: ", n, " spans over ", B, " rows");
    std::vector<char> row_seen(B, 0), slot_seen(state.size(0), 0);
    for (int64_t s = 0; s < n; ++s) {
      TORCH_CHECK(spans->slot[s] >= 0 && spans->slot[s] < state.size(0) && !slot_seen[spans->slot[s]],
                  "gdn spans: slot out of range or twice");
      slot_seen[spans->slot[s]] = 1;
      TORCH_CHECK(spans->at[s] < spans->at[s + 1], "gdn spans: an empty span");
    }
    for (int64_t r : spans->rows) {
      TORCH_CHECK(r >= 0 && r < B && !row_seen[r], "gdn spans: rows are not a permutation");
      row_seen[r] = 1;
    }
  }
  TORCH_CHECK(out.dim() == 3 && out.size(0) == B && out.size(1) == H && out.size(2) == dv && out.is_contiguous() &&
              out.scalar_type() == q.scalar_type(), "out must be a contiguous [B, H, dv] in q's dtype");
  if (q.scalar_type() == at::kFloat) {
    gdn_impl<float>(q, k, v, g, beta, state, slots, out, spans);
  } else if (q.scalar_type() == at::kBFloat16) {
    gdn_impl<bf16_bits>(q, k, v, g, beta, state, slots, out, spans);
  } else {
    TORCH_CHECK(false, "gdn_decode_step: float32 or bfloat16 only");
  }
}
}  // namespace

void gdn_step_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, at::Tensor& out) {
  gdn_checked(q, k, v, g, beta, state, slots, out, nullptr);
}

void gdn_span_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, at::Tensor& state, const GdnSpans& spans, at::Tensor& out) {
  gdn_checked(q, k, v, g, beta, state, at::Tensor(), out, &spans);
}
}  // namespace ds

namespace {
at::Tensor gdn_replay(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta, at::Tensor state,
                      int64_t slot) {
  TORCH_CHECK(v.dim() == 3 && v.size(0) >= 1, "q, k [n, Hk, dk] and v [n, H, dv] expected, n >= 1");
  auto out = at::empty(v.sizes(), q.options());
  ds::GdnSpans spans;
  spans.at = {0, v.size(0)};
  spans.slot = {slot};
  for (int64_t i = 0; i < v.size(0); ++i) spans.rows.push_back(i);
  ds::gdn_span_into(q, k, v, g, beta, state, spans, out);
  return out;
}
}  // namespace

namespace ds {

// out [B, C] in x's dtype, contiguous
void conv_step_into(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& wt, at::Tensor& state,
                    const at::Tensor& slots, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, C] with a contiguous inner dim");
  TORCH_CHECK(wt.dim() == 2 && wt.is_contiguous() && wt.scalar_type() == at::kFloat && wt.size(1) == x.size(1) &&
              wt.size(0) >= 2, "wt must be fp32 contiguous [K >= 2, C]");
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous() && state.scalar_type() == x.scalar_type() &&
              state.size(1) == wt.size(0) - 1 && state.size(2) == x.size(1), "state must be [S, K-1, C] in x's dtype");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
              slots.size(0) == rows.size(0), "rows and slots must be int64 [B]");
  {
    const int64_t* rp = rows.data_ptr<int64_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows.size(0); ++b)
      TORCH_CHECK(rp[b] >= 0 && rp[b] < x.size(0) && sl[b] >= 0 && sl[b] < state.size(0), "row or slot out of range");
  }
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows.size(0) && out.size(1) == x.size(1) && out.is_contiguous() &&
              out.scalar_type() == x.scalar_type(), "out must be a contiguous [B, C] in x's dtype");
  if (x.scalar_type() == at::kFloat) {
    conv_impl<float>(x, rows, wt, state, slots, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    conv_impl<c10::BFloat16>(x, rows, wt, state, slots, out);
  } else {
    TORCH_CHECK(false, "conv1d_step: float32 or bfloat16 only");
  }
}
}  // namespace ds

namespace {
// a projection part from Python: (packed, fp8 scales or None, N, fp8 path) (model/fused.py _parts)
using PartArg = std::tuple<at::Tensor, std::optional<at::Tensor>, int64_t, std::string>;

std::vector<DecodeModel::Proj> projections(const std::vector<std::vector<PartArg>>& args) {
  std::vector<DecodeModel::Proj> out;
  for (const auto& parts : args) {
    DecodeModel::Proj p;
    for (const auto& [packed, scales, n, path] : parts) p.push_back({packed, scales.value_or(at::Tensor()), n, path});
    out.push_back(std::move(p));
  }
  return out;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_fused", &rms_norm_fused, "zero-centred RMSNorm, one pass per row (x [R,D] or [R,H,D], w [D], eps)");
  m.def("add_rms_norm_fused", &add_rms_norm_fused, "(x + h, rms_norm(x + h)) for x, h [R, D]");
  m.def("gated_rms_norm", &gated_rms_norm, "GDN output norm: x [R,H,D], z [R,H*D], w [D], eps -> [R,H*D]");
  m.def("qk_norm_rope", &qk_norm_rope, "rotary(rms_norm(x)) for q or k: x [R,H,D], w [D], eps, cos, sin [R,P]");
  m.def("gdn_gates", &gdn_gates, "(g, beta) = (neg_decay * softplus(a + dt_bias), sigmoid(b)) for b, a [T,H]");
  m.def("silu_mul", &silu_mul, "silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I]");
  m.def("gate_output", &gate_output, "o * sigmoid(gate) for o, gate [T, N]");
  py::class_<DecodeModel>(m, "DecodeModel", py::module_local(),
                          "a model's decode-only step in one call (decode_layers.cpp)")
      .def(py::init([](at::Tensor embed, at::Tensor norm, double eps, bool amx, py::object fp8, int64_t vocab) {
             Fp8Linear f = nullptr;
             if (!fp8.is_none()) {  // the fp8 extension's linear_fp8_capsule()
               f = reinterpret_cast<Fp8Linear>(PyCapsule_GetPointer(fp8.ptr(), kFp8LinearCapsule));
               if (f == nullptr) throw py::error_already_set();
             }
             return DecodeModel(std::move(embed), std::move(norm), eps, amx, f, vocab);
           }),
           py::arg("embed"), py::arg("norm"), py::arg("eps"), py::arg("amx"), py::arg("fp8") = py::none(),
           py::arg("vocab") = 0)
      .def("add_gdn",
           [](DecodeModel& d, std::vector<at::Tensor> w, const std::vector<std::vector<PartArg>>& proj,
              std::vector<int64_t> dims, double eps) { d.add_gdn(std::move(w), projections(proj), std::move(dims), eps); },
           py::arg("weights"), py::arg("projections"), py::arg("dims"), py::arg("eps"))
      .def("add_attention",
           [](DecodeModel& d, std::vector<at::Tensor> w, const std::vector<std::vector<PartArg>>& proj,
              std::vector<int64_t> dims, double eps, double scale) {
             d.add_attention(std::move(w), projections(proj), std::move(dims), eps, scale);
           },
           py::arg("weights"), py::arg("projections"), py::arg("dims"), py::arg("eps"), py::arg("scale"))
      .def("run", &DecodeModel::run, py::arg("ids"), py::arg("conv"), py::arg("ssm"), py::arg("kv"), py::arg("slots"),
           py::arg("cos"), py::arg("sin"), py::arg("page_table"), py::arg("lengths"),
           py::call_guard<py::gil_scoped_release>())
      .def("run_verify", &DecodeModel::run_verify, py::arg("ids"), py::arg("conv"), py::arg("ssm"), py::arg("kv"),
           py::arg("slots"), py::arg("cos"), py::arg("sin"), py::arg("page_table"), py::arg("lengths"),
           py::arg("waves"), py::arg("order"), py::arg("log_conv"), py::arg("log_x"), py::arg("log_g"),
           py::arg("log_beta"),
           py::call_guard<py::gil_scoped_release>());
  m.def("bf16_linear_available", &bf16_linear_available, "linear_bf16 usable (built with AVX2 + FMA or AVX-512)");
  m.def("kernel_isa", &kernel_isa, "the instruction set this build targets: avx512bf16, avx512, avx2 or none");
  m.def("pack_bf16_weight", &pack_bf16_weight, "[N, K] bf16 weight -> [ceil(N/16), K/2, 16, 2] for linear_bf16");
  m.def("linear_bf16", &linear_bf16, "x [M, K] bf16 @ packed weight^T -> [M, N] bf16 (batch-invariant)");
  m.def("amx_linear_status", &amx_linear_status, "'' when linear_bf16_amx can run in this process, else why not");
  m.def("linear_bf16_amx", &linear_bf16_amx,
        "linear_bf16 on AMX tiles (its own bits, batch-invariant; the avx512bf16 build only)");
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, all sequences of a step (q [B,Hq,D], kv pool, page_table [B,maxp], lengths [B], scale)");
  m.def("gdn_decode_step", &gdn_decode_step,
        "gated delta rule decode step, state slots updated in place (q, k, v, g, beta, state [S,H,dv,dk], slots [B])");
  m.def("gdn_replay", &gdn_replay,
        "one slot's GDN state stepped through q, k, v, g, beta rows in order (a rollback's replay), state [S,H,dv,dk]");
  m.def("conv1d_step", &conv1d_step,
        "causal conv1d decode step with its silu, states updated in place (x [T,C], rows [B], wt [K,C], state, slots)");
  m.def("conv1d_prefill", &conv1d_prefill,
        "causal conv1d with its silu over one sequence's prefill chunk (x [L,C], wt [K,C] fp32, state [K-1,C]) -> "
        "[L,C] (conv_prefill.cpp)", py::arg("x"), py::arg("wt"), py::arg("state"),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_available", &prefill_attention_available,
        "prefill_attention in this build (the x86 ones; prefill_attention.cpp)");
  m.def("prefill_attention", &prefill_attention_bf16,
        "one sequence's prefill chunk: q [n,Hq,D] at positions pos.. over k, v [>=pos+n,Hkv,D] -> [n,Hq,D] (bf16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("pos"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("gdn_prefill_available", &gdn_prefill_available, "gdn_chunk_prefill in this build (the x86 ones)");
  m.def("gdn_chunk_prefill", &gdn_chunk_prefill,
        "chunked gated delta rule of one sequence (q, k [L,Hk,dk], v [L,H,dv] bf16, g, beta [L,H] fp32, state [H,dv,dk] "
        "fp32 in place, start_pos, out [L,H,dv] bf16, states_at) -> the states at states_at",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("state"), py::arg("start_pos"),
        py::arg("out"), py::arg("states_at"), py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) for fp32 x [N, V] (greedy sampling; argmax.cpp)");
  m.def("silu_into", &silu_into, "out = silu(acc) in out's dtype, for acc [T, C] fp32 (the GDN conv's activation)");
}
