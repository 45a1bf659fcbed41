// Prefill attention of one sequence's chunk: AVX512-BF16 dot products on the avx512bf16 build (which the amx set
// loads too); bf16 widened to fp32 in registers and fp32 fmas on the avx512 build and, on 8 lanes, the avx2 one;
// ops/attention.py prefill_attention is the torch path with the same contract (the generic build takes it),
// attention_reference the plain fp32 reference the tests compare both with.
//
// q [n, Hq, D] at absolute positions pos .. pos + n - 1 attends keys 0 .. its own position of k, v [>= pos + n,
// Hkv, D] (any row and head strides, contiguous last dim); query head h reads kv head h / (Hq / Hkv).
//
// Flash form: keys in blocks of 32 (avx2: 16) anchored at key 0, an online softmax per query row (fp32 running max, a
// 16-lane running sum, the output row in fp32), scores = (q . k) * scale summed over the head dim in pairs
// (vdpbf16ps, or two fmas per pair of widened values), probabilities rounded to bf16 for vdpbf16ps's P V products
// (as torch's CPU flash attention rounds them; the widened build keeps them fp32), the row divided by its sum and
// rounded to bf16 once at the end. Each build has its own bits; one model runs one build.
//
// Bits: a query row's arithmetic is a fixed sequence over its own q, the key blocks from 0 up to its own, and
// nothing else. A block past a row's position (its work item reaches further) is an exact no-op for that row:
// every probability is 0 (masked after the exp, not left to exp(-inf)), the max does not move, the rescale is
// exp(0) = 1. So a row's result does not depend on the chunk it came in (any start, not only multiples of a tile),
// on the other rows of its work item, or on the thread split: the hit == cold gates rest on the first.
//
// Layout per call: K and V of each kv head are repacked once into bf16 pairs, K as 16 keys x (d, d + 1) per
// 64-byte vector (the linear_bf16 weight layout), V as (key j, key j + 1) x 16 dims (avx2: both widened to fp32
// as they are packed, K as 16 keys per dim, V row-major); work items are 8 query rows (avx2: 6; head-minor within
// a position) of one kv head, dealt out to the threads round-robin so each thread gets short and long rows alike
// under the causal mask. The avx2 build's K and V are fp32 (twice the bytes) and its items small, so a thread takes
// its items 16 at a time through the key blocks a range of 128 KB at a time, the range read from memory once for the
// 16 (each item's running max, sum and output kept between ranges: the same operations, the same bits).

#include "aten_lite.h"
#include "kernels.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
constexpr int kKeys = 32;  // keys per block: two 16-key column vectors
constexpr int kRows = 8;   // query rows per work item (16 score and 16 output accumulators)
#else
constexpr int kKeys = 16;  // AVX2: 8 lanes and 16 registers: 16-key blocks of 6 rows
constexpr int kRows = 6;
#endif
constexpr int kCols = kKeys / 16;  // 16-key columns of packed K per block

using u16 = uint16_t;

// K of one kv head [L, D] (row stride rs elements) -> kp [ceil(L / 32) * 2][D / 2][16] words (d, d + 1) of 16 keys;
// keys from L to the block end are zero (masked, but must not be NaN)
[[maybe_unused]] void pack_keys(const u16* k, int64_t rs, int64_t L, int64_t D, uint32_t* kp, int64_t c0, int64_t c1) {
  const int64_t D2 = D / 2;
  for (int64_t c = c0; c < c1; ++c) {  // 16-key columns
    uint32_t* dst = kp + c * D2 * 16;
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t j = c * 16 + jj;
      if (j < L) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(k + j * rs);
        for (int64_t d2 = 0; d2 < D2; ++d2) dst[d2 * 16 + jj] = src[d2];
      } else {
        for (int64_t d2 = 0; d2 < D2; ++d2) dst[d2 * 16 + jj] = 0;
      }
    }
  }
}

// V of one kv head [L, D] -> vp [ceil(L / 32) * 16][D] words (v[2m][d], v[2m + 1][d]); zero past L
[[maybe_unused]] void pack_values(const u16* v, int64_t rs, int64_t L, int64_t D, uint32_t* vp, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {  // key pairs
    const int64_t j = 2 * m;
    const u16* a = j < L ? v + j * rs : nullptr;
    const u16* b = j + 1 < L ? v + (j + 1) * rs : nullptr;
    uint32_t* dst = vp + m * D;
    for (int64_t d = 0; d < D; ++d)
      dst[d] = uint32_t(a ? a[d] : 0) | (uint32_t(b ? b[d] : 0) << 16);
  }
}

struct Rows {
  const uint32_t* q[kRows];  // each row's query as D / 2 words
  u16* out[kRows];
  int64_t pos[kRows];
};

// M query rows of one kv head against its packed K / V; ob: M * D floats of scratch
// key blocks a work item's rows read: up to the block of its last position
inline int64_t blocks_for(const Rows& r, int M) {
  int64_t last = 0;
  for (int i = 0; i < M; ++i) last = std::max(last, r.pos[i]);
  return last / kKeys + 1;
}

// the rows' queries widened to fp32 (exact): qf[i * D + d]
[[maybe_unused]] void widen_queries(const Rows& r, int M, int64_t D, float* qf) {
  for (int i = 0; i < M; ++i)
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      const uint32_t w = r.q[i][d2], e = w << 16, o = w & 0xffff0000u;
      std::memcpy(qf + i * D + 2 * d2, &e, 4);
      std::memcpy(qf + i * D + 2 * d2 + 1, &o, 4);
    }
}

#if defined(__AVX512F__)
// the fp32 value of a bf16 pair word's first (even) and second (odd) element, 16 words at a time
inline __m512 even_f32(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
inline __m512 odd_f32(__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int(0xffff0000u)))); }

// The avx512bf16 build multiplies bf16 pairs on vdpbf16ps; the avx512 build widens them and takes two fmas a pair.
template <int M>
void attend(const Rows& r, const uint32_t* kp, const uint32_t* vp, int64_t D, float scale, float* ob, float* qf) {
  const int64_t D2 = D / 2, blocks = blocks_for(r, M);
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx[M];
  __m512 lsum[M];
#if defined(__AVX512BF16__)
  alignas(64) uint32_t pw[M][16];  // a block's probabilities of one row as bf16 pairs (key order)
#else
  alignas(64) float pf[M][kKeys];  // the same in fp32
  widen_queries(r, M, D, qf);
#endif
  float alpha[M];
  for (int i = 0; i < M; ++i) {
    mx[i] = ninf;
    lsum[i] = _mm512_setzero_ps();
  }
  std::fill(ob, ob + M * D, 0.f);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    // scores of the block's 32 keys
    __m512 s0[M], s1[M];
    for (int i = 0; i < M; ++i) s0[i] = s1[i] = _mm512_setzero_ps();
    const uint32_t* k0 = kp + (kCols * b) * D2 * 16;
    const uint32_t* k1 = k0 + D2 * 16;
    for (int64_t d2 = 0; d2 < D2; ++d2) {
      const __m512i ka = _mm512_loadu_si512(k0 + d2 * 16), kb = _mm512_loadu_si512(k1 + d2 * 16);
#if defined(__AVX512BF16__)
      for (int i = 0; i < M; ++i) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(r.q[i][d2]));
        s0[i] = _mm512_dpbf16_ps(s0[i], qb, (__m512bh)ka);
        s1[i] = _mm512_dpbf16_ps(s1[i], qb, (__m512bh)kb);
      }
#else  // odd element, then even, as vdpbf16ps adds a pair
      const __m512 ae = even_f32(ka), ao = odd_f32(ka), be = even_f32(kb), bo = odd_f32(kb);
      for (int i = 0; i < M; ++i) {
        const __m512 qe = _mm512_set1_ps(qf[i * D + 2 * d2]), qo = _mm512_set1_ps(qf[i * D + 2 * d2 + 1]);
        s0[i] = _mm512_fmadd_ps(qe, ae, _mm512_fmadd_ps(qo, ao, s0[i]));
        s1[i] = _mm512_fmadd_ps(qe, be, _mm512_fmadd_ps(qo, bo, s1[i]));
      }
#endif
    }
    // online softmax: mask, max, exp (masked lanes 0), running sum, P as bf16 pairs
    const __m512i j0 = _mm512_add_epi32(lane, _mm512_set1_epi32(int(b * kKeys)));
    const __m512i j1 = _mm512_add_epi32(j0, _mm512_set1_epi32(16));
    for (int i = 0; i < M; ++i) {
      const __m512i p = _mm512_set1_epi32(int(r.pos[i]));
      const __mmask16 v0 = _mm512_cmple_epi32_mask(j0, p), v1 = _mm512_cmple_epi32_mask(j1, p);
      const __m512 x0 = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), v0, s0[i], _mm512_set1_ps(scale));
      const __m512 x1 = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), v1, s1[i], _mm512_set1_ps(scale));
      const float m = std::max(mx[i], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
      const __m512 mv = _mm512_set1_ps(m);
      alpha[i] = _mm512_cvtss_f32(ds::exp_ps(_mm512_set1_ps(mx[i] - m)));  // 1 exactly where m did not move
      const __m512 p0 = _mm512_maskz_mov_ps(v0, ds::exp_ps(_mm512_sub_ps(x0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(v1, ds::exp_ps(_mm512_sub_ps(x1, mv)));
      lsum[i] = _mm512_add_ps(_mm512_mul_ps(lsum[i], _mm512_set1_ps(alpha[i])), _mm512_add_ps(p0, p1));
#if defined(__AVX512BF16__)
      _mm512_store_si512(pw[i], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
#else
      _mm512_store_ps(pf[i], p0);
      _mm512_store_ps(pf[i] + 16, p1);
#endif
      mx[i] = m;
    }
    // O = alpha O + P V, 32 dims at a time
    const uint32_t* vb = vp + b * 16 * D;
    for (int64_t c = 0; c < D; c += 32) {
      __m512 o0[M], o1[M];
      for (int i = 0; i < M; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        o0[i] = _mm512_mul_ps(_mm512_loadu_ps(ob + i * D + c), a);
        o1[i] = _mm512_mul_ps(_mm512_loadu_ps(ob + i * D + c + 16), a);
      }
      for (int m = 0; m < 16; ++m) {  // key pair (2m, 2m + 1) of the block
        const __m512i va = _mm512_loadu_si512(vb + m * D + c), vc = _mm512_loadu_si512(vb + m * D + c + 16);
#if defined(__AVX512BF16__)
        for (int i = 0; i < M; ++i) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pw[i][m]));
          o0[i] = _mm512_dpbf16_ps(o0[i], pb, (__m512bh)va);
          o1[i] = _mm512_dpbf16_ps(o1[i], pb, (__m512bh)vc);
        }
#else
        const __m512 ae = even_f32(va), ao = odd_f32(va), ce = even_f32(vc), co = odd_f32(vc);
        for (int i = 0; i < M; ++i) {
          const __m512 pe = _mm512_set1_ps(pf[i][2 * m]), po = _mm512_set1_ps(pf[i][2 * m + 1]);
          o0[i] = _mm512_fmadd_ps(pe, ae, _mm512_fmadd_ps(po, ao, o0[i]));
          o1[i] = _mm512_fmadd_ps(pe, ce, _mm512_fmadd_ps(po, co, o1[i]));
        }
#endif
      }
      for (int i = 0; i < M; ++i) {
        _mm512_storeu_ps(ob + i * D + c, o0[i]);
        _mm512_storeu_ps(ob + i * D + c + 16, o1[i]);
      }
    }
  }
  for (int i = 0; i < M; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum[i]));
    for (int64_t c = 0; c < D; c += 16) {
      const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ob + i * D + c), inv);
#if defined(__AVX512BF16__)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.out[i] + c), (__m256i)_mm512_cvtneps_pbh(o));
#else
      alignas(64) float f[16];
      _mm512_store_ps(f, o);
      for (int l = 0; l < 16; ++l) r.out[i][c + l] = static_cast<c10::BFloat16>(f[l]).x;  // nearest even
#endif
    }
  }
}

#else  // AVX2 + FMA: the widened form on 8 lanes

// K of one kv head -> kf [ceil(L / 16)][D][16] fp32 (16 keys per d; zero past L), V -> vf [ceil(L / 16) * 16][D]
// fp32: widened once per call, so the inner loops are loads and fmas only
void pack_keys_f32(const u16* k, int64_t rs, int64_t L, int64_t D, uint32_t* kp, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c)
    for (int jj = 0; jj < 16; ++jj) {
      const int64_t j = c * 16 + jj;
      for (int64_t d = 0; d < D; ++d) kp[(c * D + d) * 16 + jj] = j < L ? uint32_t(k[j * rs + d]) << 16 : 0u;
    }
}
void pack_values_f32(const u16* v, int64_t rs, int64_t L, int64_t D, uint32_t* vp, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) vp[j * D + d] = j < L ? uint32_t(v[j * rs + d]) << 16 : 0u;
}
// horizontal max / sum of 8 lanes in a fixed order (halves, then pairs)
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One work item's online softmax between calls: the running max and sum of each row (its output rows and widened
// queries live in the caller's ob and qf). Held in memory between key ranges, exactly as in registers.
struct State {
  float mx[kRows];
  alignas(32) float lsum[kRows][8];
};

// The item's key blocks [b0, b1) (clipped to its own last block): the first range (b0 == 0) starts the item, the
// range that reaches its last block finishes it. Every row runs the same operations on the same blocks in the same
// order whatever the ranges, so the ranges leave the bits as one call over every block would.
template <int M>
void attend(const Rows& r, const uint32_t* kp, const uint32_t* vp, int64_t D, float scale, float* ob, float* qf,
            State& st, int64_t b0, int64_t b1) {
  const int64_t blocks = blocks_for(r, M), bend = std::min(b1, blocks);
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx[M], alpha[M];
  __m256 lsum[M];
  alignas(32) float pf[M][kKeys];
  const float* kf = reinterpret_cast<const float*>(kp);  // fp32 here: pack_keys_f32, pack_values_f32
  const float* vf = reinterpret_cast<const float*>(vp);
  if (b0 == 0) {
    for (int i = 0; i < M; ++i) {
      mx[i] = ninf;
      lsum[i] = _mm256_setzero_ps();
    }
    widen_queries(r, M, D, qf);
    std::fill(ob, ob + M * D, 0.f);
  } else {
    for (int i = 0; i < M; ++i) {
      mx[i] = st.mx[i];
      lsum[i] = _mm256_load_ps(st.lsum[i]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = b0; b < bend; ++b) {
    __m256 s0[M], s1[M];
    for (int i = 0; i < M; ++i) s0[i] = s1[i] = _mm256_setzero_ps();
    const float* kc = kf + b * D * 16;
    for (int64_t d = 0; d < D; ++d) {
      const __m256 ka = _mm256_loadu_ps(kc + d * 16), kb = _mm256_loadu_ps(kc + d * 16 + 8);
      for (int i = 0; i < M; ++i) {
        const __m256 qv = _mm256_set1_ps(qf[i * D + d]);
        s0[i] = _mm256_fmadd_ps(qv, ka, s0[i]);
        s1[i] = _mm256_fmadd_ps(qv, kb, s1[i]);
      }
    }
    const __m256i j0 = _mm256_add_epi32(lane, _mm256_set1_epi32(int(b * kKeys)));
    const __m256i j1 = _mm256_add_epi32(j0, _mm256_set1_epi32(8));
    for (int i = 0; i < M; ++i) {
      const __m256i p = _mm256_set1_epi32(int(r.pos[i]));
      const __m256 out0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(j0, p));  // keys past the row's position
      const __m256 out1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(j1, p));
      const __m256 x0 = _mm256_blendv_ps(_mm256_mul_ps(s0[i], _mm256_set1_ps(scale)), _mm256_set1_ps(ninf), out0);
      const __m256 x1 = _mm256_blendv_ps(_mm256_mul_ps(s1[i], _mm256_set1_ps(scale)), _mm256_set1_ps(ninf), out1);
      const float m = std::max(mx[i], hmax8(_mm256_max_ps(x0, x1)));
      const __m256 mv = _mm256_set1_ps(m);
      alpha[i] = _mm256_cvtss_f32(ds::exp_ps(_mm256_set1_ps(mx[i] - m)));  // 1 exactly where m did not move
      const __m256 p0 = _mm256_andnot_ps(out0, ds::exp_ps(_mm256_sub_ps(x0, mv)));
      const __m256 p1 = _mm256_andnot_ps(out1, ds::exp_ps(_mm256_sub_ps(x1, mv)));
      lsum[i] = _mm256_add_ps(_mm256_mul_ps(lsum[i], _mm256_set1_ps(alpha[i])), _mm256_add_ps(p0, p1));
      _mm256_store_ps(pf[i], p0);
      _mm256_store_ps(pf[i] + 8, p1);
      mx[i] = m;
    }
    const float* vb = vf + b * kKeys * D;
    for (int64_t c = 0; c < D; c += 16) {
      __m256 o0[M], o1[M];
      for (int i = 0; i < M; ++i) {
        const __m256 a = _mm256_set1_ps(alpha[i]);
        o0[i] = _mm256_mul_ps(_mm256_loadu_ps(ob + i * D + c), a);
        o1[i] = _mm256_mul_ps(_mm256_loadu_ps(ob + i * D + c + 8), a);
      }
      for (int j = 0; j < kKeys; ++j) {
        const __m256 va = _mm256_loadu_ps(vb + j * D + c), vc = _mm256_loadu_ps(vb + j * D + c + 8);
        for (int i = 0; i < M; ++i) {
          const __m256 pv = _mm256_set1_ps(pf[i][j]);
          o0[i] = _mm256_fmadd_ps(pv, va, o0[i]);
          o1[i] = _mm256_fmadd_ps(pv, vc, o1[i]);
        }
      }
      for (int i = 0; i < M; ++i) {
        _mm256_storeu_ps(ob + i * D + c, o0[i]);
        _mm256_storeu_ps(ob + i * D + c + 8, o1[i]);
      }
    }
  }
  if (bend < blocks) {  // more ranges to come
    for (int i = 0; i < M; ++i) {
      st.mx[i] = mx[i];
      _mm256_store_ps(st.lsum[i], lsum[i]);
    }
    return;
  }
  for (int i = 0; i < M; ++i) {
    const float inv = 1.f / hsum8(lsum[i]);
    for (int64_t d = 0; d < D; ++d) r.out[i][d] = static_cast<c10::BFloat16>(ob[i * D + d] * inv).x;
  }
}

#endif

#if defined(__AVX512F__)
using AttendFn = void (*)(const Rows&, const uint32_t*, const uint32_t*, int64_t, float, float*, float*);
constexpr AttendFn kAttend[kRows + 1] = {nullptr, attend<1>, attend<2>, attend<3>, attend<4>,
                                         attend<5>, attend<6>, attend<7>, attend<8>};
// per 16-key column: packed K and V words
constexpr int64_t k_words(int64_t D) { return D / 2 * 16; }
constexpr int64_t v_words(int64_t D) { return 8 * D; }
void pack(const u16* k, int64_t ks, const u16* v, int64_t vs, int64_t L, int64_t D, uint32_t* kp, uint32_t* vp,
          int64_t c) {
  pack_keys(k, ks, L, D, kp, c, c + 1);
  pack_values(v, vs, L, D, vp, c * 8, c * 8 + 8);
}
#else
using AttendFn = void (*)(const Rows&, const uint32_t*, const uint32_t*, int64_t, float, float*, float*, State&,
                          int64_t, int64_t);
constexpr AttendFn kAttend[kRows + 1] = {nullptr, attend<1>, attend<2>, attend<3>, attend<4>, attend<5>, attend<6>};
constexpr int kGroup = 16;                  // work items of a thread that take each range of key blocks in turn
constexpr int64_t kRangeBytes = 128 << 10;  // K and V of a range (fp32): in L2 while the group's items read it
constexpr int64_t k_words(int64_t D) { return D * 16; }
constexpr int64_t v_words(int64_t D) { return 16 * D; }
void pack(const u16* k, int64_t ks, const u16* v, int64_t vs, int64_t L, int64_t D, uint32_t* kp, uint32_t* vp,
          int64_t c) {
  pack_keys_f32(k, ks, L, D, kp, c, c + 1);
  pack_values_f32(v, vs, L, D, vp, c * 16, c * 16 + 16);
}
#endif

}  // namespace

bool prefill_attention_available() { return true; }

at::Tensor prefill_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t pos,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v must be [rows, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16, "prefill_attention: bfloat16 q, k, v only");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), end = pos + n;
  TORCH_CHECK(D % 32 == 0, "prefill_attention: head dim must be a multiple of 32, got ", D);
  TORCH_CHECK(k.size(2) == D && v.size(2) == D && v.size(1) == Hkv && Hkv > 0 && Hq % Hkv == 0,
              "prefill_attention: k, v must be [L, Hkv, D] with Hkv dividing Hq");
  TORCH_CHECK(pos >= 0 && k.size(0) >= end && v.size(0) >= end, "prefill_attention: k, v hold fewer than pos + n rows");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: the last dim must be contiguous");
  auto out = at::empty({n, Hq, D}, q.options());
  if (n == 0) return out;
  const int64_t G = Hq / Hkv;
  const int64_t cols = (end + kKeys - 1) / kKeys * kCols;  // 16-key columns of the packed K, per kv head
  const int64_t kw = cols * k_words(D), vw = cols * v_words(D);  // words per kv head
  auto kp = at::empty({Hkv, kw}, at::TensorOptions().dtype(at::kInt));
  auto vp = at::empty({Hkv, vw}, at::TensorOptions().dtype(at::kInt));
  const u16* qd = reinterpret_cast<const u16*>(q.data_ptr<at::BFloat16>());
  const u16* kd = reinterpret_cast<const u16*>(k.data_ptr<at::BFloat16>());
  const u16* vd = reinterpret_cast<const u16*>(v.data_ptr<at::BFloat16>());
  u16* od = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  uint32_t* kpd = reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>());
  uint32_t* vpd = reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>());
  const int64_t work = n * Hq * end * D;  // multiply-adds of QK^T, about
  const int64_t grain = work < kSerialBelow ? Hkv * cols : 1;
  at::parallel_for(0, Hkv * cols, grain, [&](int64_t a, int64_t e) {
    for (int64_t t = a; t < e; ++t) {
      const int64_t h = t / cols, c = t % cols;
      pack(kd + h * k.stride(1), k.stride(0), vd + h * v.stride(1), v.stride(0), end, D, kpd + h * kw, vpd + h * vw, c);
    }
  });
  const int64_t per_head = (n * G + kRows - 1) / kRows;  // work items of one kv head
  const int64_t items = Hkv * per_head;
  const int64_t threads = work < kSerialBelow ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  const float sc = float(scale);
  // a work item: kRows query rows of one kv head
  auto rows_of = [&](int64_t it, Rows& rows) -> int {
    const int64_t h = it / per_head, r0 = (it % per_head) * kRows;
    const int M = int(std::min<int64_t>(kRows, n * G - r0));
    for (int i = 0; i < M; ++i) {
      const int64_t row = r0 + i, p = row / G, head = h * G + row % G;
      rows.q[i] = reinterpret_cast<const uint32_t*>(qd + p * q.stride(0) + head * q.stride(1));
      rows.out[i] = od + (p * Hq + head) * D;
      rows.pos[i] = pos + p;
    }
    return M;
  };
#if defined(__AVX512F__)
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t e) {
    ds::LineBuffer ob(size_t(kRows * D)), qf(size_t(kRows * D));  // on 64-byte lines (kernels.h)
    for (int64_t t = a; t < e; ++t) {
      for (int64_t it = t; it < items; it += threads) {  // round-robin: early and late rows on every thread
        Rows rows;
        const int M = rows_of(it, rows);
        kAttend[M](rows, kpd + (it / per_head) * kw, vpd + (it / per_head) * vw, D, sc, ob.data(), qf.data());
      }
    }
  });
#else
  // a thread's round-robin items kGroup at a time, through the key blocks a range at a time (the header says why)
  const int64_t range = std::max<int64_t>(1, kRangeBytes / (kKeys * D * 8));  // key blocks a range
  at::parallel_for(0, threads, 1, [&](int64_t a, int64_t e) {
    ds::LineBuffer ob(size_t(kGroup * kRows * D)), qf(size_t(kGroup * kRows * D));  // on 64-byte lines (kernels.h)
    State st[kGroup];
    Rows rows[kGroup];
    int Ms[kGroup];
    int64_t heads[kGroup], blocks[kGroup];
    for (int64_t t = a; t < e; ++t) {
      for (int64_t g0 = t; g0 < items; g0 += threads * kGroup) {
        int m = 0;
        int64_t most = 0;
        for (int64_t it = g0; it < items && m < kGroup; it += threads, ++m) {
          Ms[m] = rows_of(it, rows[m]);
          heads[m] = it / per_head;
          blocks[m] = blocks_for(rows[m], Ms[m]);
          most = std::max(most, blocks[m]);
        }
        for (int64_t b0 = 0; b0 < most; b0 += range)
          for (int j = 0; j < m; ++j)
            if (b0 < blocks[j])
              kAttend[Ms[j]](rows[j], kpd + heads[j] * kw, vpd + heads[j] * vw, D, sc, ob.data() + j * kRows * D,
                             qf.data() + j * kRows * D, st[j], b0, b0 + range);
      }
    }
  });
#endif
  return out;
}

#else

bool prefill_attention_available() { return false; }

at::Tensor prefill_attention_bf16(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "prefill_attention: this build has neither AVX-512 nor AVX2 + FMA (ops/attention.py "
              "prefill_attention is the path)");
}

#endif
