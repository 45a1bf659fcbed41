// The chunked gated delta rule of one sequence's prefill (ops/gdn.py chunk_gated_delta_rule's contract, with
// use_qk_l2norm) on the x86 builds (16 lanes of AVX-512, 8 of AVX2); ops/gdn.py is the torch path (the generic
// build, and shapes this does not take), gated_delta_rule_reference the token loop the tests compare both with.
//
// The same algebra as ops/gdn.py _chunk_slice, on the same absolute 64-token grid, per value head and chunk
// (c = cumulative log decay from the chunk start, D_ij = exp(c_i - c_j) for j <= i, arguments clamped at -87):
//   A = diag(beta) (K K^T * D) strictly lower;  U = (I + A)^-1 diag(beta) V;  W = (I + A)^-1 diag(beta exp(c)) K
//   V' = U - W S^T;  O = diag(exp(c)) Q S^T + (Q K^T * D) V';  S^T = exp(c_last) S^T + (diag(exp(c_last - c)) K)^T V'
// with (I + A)^-1 applied by forward substitution (row i minus A_ij times the finished rows j < i) rather than
// as an explicit inverse, and every product an fp32 loop of fixed order: the bits are this file's own, the same
// for every call. Rows outside the call (before a chunk's first token, after the last) are zero (k = v = beta =
// g = 0), which leaves the state and the real rows untouched.
//
// Bits: a chunk's arithmetic depends only on its own rows and the state entering it, so a sequence split at any
// multiple of 64 (state carried) gives exactly what one call gives, and the state after a chunk (states_at) is
// exactly what a call stopping there returns: the hit == cold gates rest on it. Heads are independent work items
// (parallel over heads, each a fixed loop), so the thread count changes nothing.

#include "aten_lite.h"
#include "kernels.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

constexpr int C = 64;  // the chunk
constexpr float kExpMin = -87.f;  // as ops/gdn.py _EXP_MIN

// the vector of the build: 16 lanes of AVX-512 or 8 of AVX2, and the few operations this file needs
#if defined(__AVX512F__)
using V = __m512;
constexpr int W = 16;
inline V ld(const float* p) { return _mm512_loadu_ps(p); }
inline void put(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V lanes() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
// v where lane index l < bound (strict) or l <= bound, else 0
inline V keep_below(V v, V l, V bound) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(l, bound, _CMP_LT_OQ), v); }
inline V keep_upto(V v, V l, V bound) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(l, bound, _CMP_LE_OQ), v); }
constexpr int kTileV = 4;  // gemm tiles of 4 rows x 64 columns
#else
using V = __m256;
constexpr int W = 8;
inline V ld(const float* p) { return _mm256_loadu_ps(p); }
inline void put(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
inline float hsum(V v) {  // halves, then pairs: a fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V lanes() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V keep_below(V v, V l, V bound) { return _mm256_and_ps(_mm256_cmp_ps(l, bound, _CMP_LT_OQ), v); }
inline V keep_upto(V v, V l, V bound) { return _mm256_and_ps(_mm256_cmp_ps(l, bound, _CMP_LE_OQ), v); }
constexpr int kTileV = 2;  // 16 registers: tiles of 4 rows x 16 columns
#endif
constexpr int kTileN = kTileV * W;

inline float bf(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Cm[i][n] (+/-)= sum_k A[i][k] B[k][n], for M % 4 == 0 rows and N % 64 == 0 columns, k ascending; a tile of 4 rows
// x kTileN columns of accumulators at a time
template <bool kNeg>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, float* Cm, int64_t ldc, int M, int K, int N) {
  for (int n0 = 0; n0 < N; n0 += kTileN) {
    for (int i0 = 0; i0 < M; i0 += 4) {
      V acc[4][kTileV];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < kTileV; ++v) acc[r][v] = ld(Cm + (i0 + r) * ldc + n0 + W * v);
      for (int k = 0; k < K; ++k) {
        V b[kTileV];
        for (int v = 0; v < kTileV; ++v) {
          b[v] = ld(B + k * ldb + n0 + W * v);
          // held in a register: folded into each fma as a memory operand (gcc's choice), b was loaded once per row,
          // 20 loads for 16 fmas, and the loads, not the fmas, set the pace
          asm("" : "+v"(b[v]));
        }
        for (int r = 0; r < 4; ++r) {
          const V a = set1(A[(i0 + r) * lda + k]);
          for (int v = 0; v < kTileV; ++v) acc[r][v] = kNeg ? fnma(a, b[v], acc[r][v]) : fma(a, b[v], acc[r][v]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < kTileV; ++v) put(Cm + (i0 + r) * ldc + n0 + W * v, acc[r][v]);
    }
  }
}

// X[i] -= sum_{j < i} A[i][j] X[j] for i ascending (X: C rows of N floats, N % 64 == 0): (I + A)^-1 applied in
// place. Blocks of kDiag rows: first the rows before the block, as one gemm (register tiles: the row-by-row form
// waited on each fma's latency), then the block's own rows one by one. Each element still takes its terms j
// ascending, one fma each, so the bits are the row-by-row form's.
constexpr int kDiag = 16;
void substitute(const float* A, float* X, int64_t N) {
  constexpr int NV = 64 / W;
  for (int i0 = 0; i0 < C; i0 += kDiag) {
    if (i0 > 0) gemm<true>(A + i0 * C, C, X, N, X + i0 * N, N, kDiag, i0, int(N));
    for (int64_t c0 = 0; c0 < N; c0 += 64) {
      for (int i = i0 + 1; i < i0 + kDiag; ++i) {
        V x[NV];
        for (int v = 0; v < NV; ++v) x[v] = ld(X + i * N + c0 + W * v);
        for (int j = i0; j < i; ++j) {
          const V a = set1(A[i * C + j]);
          for (int v = 0; v < NV; ++v) x[v] = fnma(a, ld(X + j * N + c0 + W * v), x[v]);
        }
        for (int v = 0; v < NV; ++v) put(X + i * N + c0 + W * v, x[v]);
      }
    }
  }
}

// sum of x[i]^2 over n (n % 16 == 0), W lanes then their fixed-order reduction
inline float sumsq(const float* x, int64_t n) {
  V s = set1(0.f);
  for (int64_t i = 0; i < n; i += W) {
    const V v = ld(x + i);
    s = fma(v, v, s);
  }
  return hsum(s);
}

struct Args {
  const uint16_t *q, *k, *v;  // bf16
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // row and head strides
  const float *g, *beta;  // [L, H] contiguous
  float* state;  // [H, dv, dk]
  uint16_t* out;
  int64_t os0, os1;
  int64_t L, H, rep, dk, dv, start;
  const std::vector<int64_t>* at;  // absolute chunk ends whose state is wanted
  std::vector<float*>* grabs;  // one [H, dv, dk] per entry of at
};

void head(const Args& a, int64_t h) {
  const int64_t dk = a.dk, dv = a.dv, hk = h / a.rep;
  // on 64-byte lines: every row of these buffers is read as whole vectors, and a vector straddling two lines costs
  // two loads (malloc aligns to 16 bytes only: the same call ran 24 or 38 ms by where the heap placed it); one per
  // thread, kept between calls: allocated per head, glibc could hand back fresh pages (page faults) each time
  static thread_local ds::LineBuffer buf;
  buf.ensure(size_t(C * dk * 5 + C * dv * 3 + 2 * C * C + dk * dv + 3 * C));
  float* qn = buf.data();        // [C][dk] l2-normalised, times dk^-0.5, then times exp(c)
  float* kn = qn + C * dk;       // [C][dk] l2-normalised
  float* kt = kn + C * dk;       // [dk][C] kn transposed
  float* w = kt + C * dk;        // [C][dk] W
  float* kdt = w + C * dk;       // [dk][C] (diag(exp(c_last - c)) K)^T
  float* u = kdt + C * dk;       // [C][dv] U, then V'
  float* o = u + C * dv;         // [C][dv] O
  float* vv = o + C * dv;        // [C][dv] V (U starts as diag(beta) V)
  float* A = vv + C * dv;        // [C][C]
  float* P = A + C * C;          // [C][C]
  float* st = P + C * C;         // [dk][dv] S^T
  float* cum = st + dk * dv;     // [C]
  float* cexp = cum + C;         // [C]
  float* bet = cexp + C;         // [C]
  float* S = a.state + h * dv * dk;
  for (int64_t x = 0; x < dk; ++x)
    for (int64_t y = 0; y < dv; ++y) st[x * dv + y] = S[y * dk + x];
  const float qscale = 1.f / std::sqrt(float(dk));
  const int64_t first = a.start / C, last = (a.start + a.L - 1) / C;
  for (int64_t ci = first; ci <= last; ++ci) {
    // the chunk's rows, zero outside the call
    float g[C];
    for (int r = 0; r < C; ++r) {
      const int64_t t = ci * C + r - a.start;
      float* qr = qn + r * dk;
      float* kr = kn + r * dk;
      float* vr = vv + r * dv;
      if (t < 0 || t >= a.L) {
        std::fill(qr, qr + dk, 0.f);
        std::fill(kr, kr + dk, 0.f);
        std::fill(vr, vr + dv, 0.f);
        g[r] = bet[r] = 0.f;
        continue;
      }
      const uint16_t* qs = a.q + t * a.qs0 + hk * a.qs1;
      const uint16_t* ks = a.k + t * a.ks0 + hk * a.ks1;
      const uint16_t* vs = a.v + t * a.vs0 + h * a.vs1;
      for (int64_t d = 0; d < dk; ++d) qr[d] = bf(qs[d]), kr[d] = bf(ks[d]);
      for (int64_t d = 0; d < dv; ++d) vr[d] = bf(vs[d]);
      const float fq = qscale / std::sqrt(sumsq(qr, dk) + 1e-6f), fk = 1.f / std::sqrt(sumsq(kr, dk) + 1e-6f);
      for (int64_t d = 0; d < dk; ++d) qr[d] *= fq, kr[d] *= fk;
      g[r] = a.g[t * a.H + h];
      bet[r] = a.beta[t * a.H + h];
    }
    // the next chunk's rows into L2 while this one computes: they are strided (a row of the conv output per token)
    // and, without it, their loads were the largest stall here
    for (int r = 0; r < C; ++r) {
      const int64_t t = (ci + 1) * C + r - a.start;
      if (t >= a.L) break;
      for (int64_t d = 0; d < dk; d += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(a.q + t * a.qs0 + hk * a.qs1 + d), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(a.k + t * a.ks0 + hk * a.ks1 + d), _MM_HINT_T1);
      }
      for (int64_t d = 0; d < dv; d += 32)
        _mm_prefetch(reinterpret_cast<const char*>(a.v + t * a.vs0 + h * a.vs1 + d), _MM_HINT_T1);
    }
    float c = 0.f;
    for (int r = 0; r < C; ++r) cum[r] = c += g[r];
    for (int r = 0; r < C; ++r) cexp[r] = std::exp(std::max(cum[r], kExpMin));
    for (int r = 0; r < C; ++r)
      for (int64_t d = 0; d < dk; ++d) kt[d * C + r] = kn[r * dk + d];
    // K K^T and Q K^T, then the decay and the causal masks
    std::fill(A, A + 2 * C * C, 0.f);
    gemm<false>(kn, dk, kt, C, A, C, C, int(dk), C);
    gemm<false>(qn, dk, kt, C, P, C, C, int(dk), C);
    for (int i = 0; i < C; ++i) {
      const V row = set1(float(i));
      for (int j0 = 0; j0 < C; j0 += W) {
        const V j = lanes() + set1(float(j0));
        // exp(c_i - c_j), the argument clamped to [-87, 0] (above the diagonal it is masked off below)
        const V dec = ds::exp_ps(vmin(vmax(set1(cum[i]) - ld(cum + j0), set1(kExpMin)), set1(0.f)));
        put(A + i * C + j0, keep_below(ld(A + i * C + j0) * dec * set1(bet[i]), j, row));
        put(P + i * C + j0, keep_upto(ld(P + i * C + j0) * dec, j, row));
      }
    }
    // U = (I + A)^-1 diag(beta) V, W = (I + A)^-1 diag(beta exp(c)) K
    for (int r = 0; r < C; ++r) {
      for (int64_t d = 0; d < dv; ++d) u[r * dv + d] = bet[r] * vv[r * dv + d];
      const float f = bet[r] * cexp[r];
      for (int64_t d = 0; d < dk; ++d) w[r * dk + d] = f * kn[r * dk + d];
    }
    substitute(A, u, dv);
    substitute(A, w, dk);
    // V' = U - W S^T;  O = diag(exp(c)) Q S^T + P V'
    gemm<true>(w, dk, st, dv, u, dv, C, int(dk), int(dv));
    for (int r = 0; r < C; ++r)
      for (int64_t d = 0; d < dk; ++d) qn[r * dk + d] *= cexp[r];
    std::fill(o, o + C * dv, 0.f);
    gemm<false>(qn, dk, st, dv, o, dv, C, int(dk), int(dv));
    gemm<false>(P, C, u, dv, o, dv, C, C, int(dv));
    for (int r = 0; r < C; ++r) {
      const int64_t t = ci * C + r - a.start;
      if (t < 0 || t >= a.L) continue;
      uint16_t* dst = a.out + t * a.os0 + h * a.os1;
      for (int64_t d = 0; d < dv; ++d) dst[d] = static_cast<c10::BFloat16>(o[r * dv + d]).x;
    }
    // S^T = exp(c_last) S^T + K'^T V'
    for (int r = 0; r < C; ++r) {
      const float f = std::exp(std::max(cum[C - 1] - cum[r], kExpMin));
      for (int64_t d = 0; d < dk; ++d) kdt[d * C + r] = f * kn[r * dk + d];
    }
    const float cl = cexp[C - 1];
    for (int64_t x = 0; x < dk * dv; ++x) st[x] *= cl;
    gemm<false>(kdt, C, u, dv, st, dv, int(dk), C, int(dv));
    for (size_t s = 0; s < a.at->size(); ++s)
      if ((*a.at)[s] == (ci + 1) * C) {
        float* G = (*a.grabs)[s] + h * dv * dk;
        for (int64_t x = 0; x < dk; ++x)
          for (int64_t y = 0; y < dv; ++y) G[y * dk + x] = st[x * dv + y];
      }
  }
  for (int64_t x = 0; x < dk; ++x)
    for (int64_t y = 0; y < dv; ++y) S[y * dk + x] = st[x * dv + y];
}

}  // namespace

bool gdn_prefill_available() { return true; }

std::vector<at::Tensor> gdn_chunk_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                          int64_t start_pos, at::Tensor& out, const std::vector<int64_t>& states_at) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "gdn_chunk_prefill: q, k, v, out are [L, heads, dim]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "gdn_chunk_prefill: bfloat16 q, k, v, out only");
  const int64_t L = q.size(0), hk = q.size(1), dk = q.size(2), H = v.size(1), dv = v.size(2);
  TORCH_CHECK(L > 0 && k.size(0) == L && v.size(0) == L && out.size(0) == L && k.size(1) == hk && k.size(2) == dk &&
                  out.size(1) == H && out.size(2) == dv && H % hk == 0, "gdn_chunk_prefill: shapes do not match");
  TORCH_CHECK(dk % 64 == 0 && dv % 64 == 0 && dk <= 256 && dv <= 256, "gdn_chunk_prefill: head dims must be 64, 128, 192 or 256");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "gdn_chunk_prefill: the last dim must be contiguous");
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat && g.is_contiguous() && beta.is_contiguous() &&
                  g.numel() == L * H && beta.numel() == L * H, "gdn_chunk_prefill: g, beta must be contiguous fp32 [L, H]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.numel() == H * dv * dk,
              "gdn_chunk_prefill: state must be a contiguous fp32 [H, dv, dk]");
  std::vector<at::Tensor> grabs;
  std::vector<float*> gp;
  for (int64_t p : states_at) {
    TORCH_CHECK(p % C == 0 && p > start_pos && p <= start_pos + L, "gdn_chunk_prefill: states_at ", p,
                " is not a chunk boundary inside the call");
    grabs.push_back(at::empty({H, dv, dk}, state.options()));
    gp.push_back(grabs.back().data_ptr<float>());
  }
  Args a{reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
         reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
         reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()),
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         g.data_ptr<float>(), beta.data_ptr<float>(), state.data_ptr<float>(),
         reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0), out.stride(1),
         L, H, H / hk, dk, dv, start_pos, &states_at, &gp};
  at::parallel_for(0, H, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) head(a, h);
  });
  return grabs;
}

#else

bool gdn_prefill_available() { return false; }

std::vector<at::Tensor> gdn_chunk_prefill(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, at::Tensor&, int64_t, at::Tensor&, const std::vector<int64_t>&) {
  TORCH_CHECK(false, "gdn_chunk_prefill: this build has neither AVX-512 nor AVX2 + FMA (ops/gdn.py chunk_gated_delta_rule "
              "is the path)");
}

#endif
