// int4 weights against int8-quantized activations, for every row count; built into the fp8 extension (ops/int4.py
// loads it through ops/fp8.py's builds).
//
// y [M, N] = x [M, K] @ dequant(w [N, K])^T, bf16 in and out. The weight: 4-bit codes q in 0..15 with, per output
// row n and group g of `gs` k (gs a multiple of 32), an fp32 scale s[n, g] and an integer zero z[n, g] in 0..16:
// w[n, k] = s[n, g] * (q[n, k] - z[n, g]) (GPTQ's meaning; symmetric formats have z = 8).
//
// Activations: each row of x, in sub-blocks of S = min(gs, 128) k, is quantized to int8 by that row's own values
// only: a = amax |x| over the sub-block, xs = a / 127 (one fp32 division), xq = round-half-even(x / xs) (0 where
// a = 0), xsum = sum of the sub-block's xq. So a row's codes never depend on another row. (Per 128 k, as llama.cpp's
// Q8_K activations are per 256: one scale step per 128 k keeps the fp32 epilogue a small share of the work.)
//
// Bits: per row m, column n, and sub-block b of k (ascending; group g holds gs / S of them):
//   isum = sum_k q[n, k] * xq[m, k] - z[n, g] * xsum[m, b]            (integer, exact: |isum| < 2^20)
//   u_b  = (float(isum) * xs[m, b]) * s[n, g]                          (two products, each rounded to fp32)
//   y    = u_0, then y = y + u_b                                       (each sum rounded to fp32)
// then one rounding to bf16 (nearest even). No fused multiply-add (-ffp-contract=off). Every path computes these
// same operations in this same order, so every path, the torch reference (ops/int4.py linear_int4_reference) and
// any batch or thread split give the same bits: the integer sums are exact whatever order the instructions add
// them in, and each row's float steps see only that row's values.
//
// Packing (pack_int4_weight): column blocks of 16 output rows; for each block and group, 16 zero bytes (one per
// column) then gs / 8 chunks of 64 bytes; chunk c holds k = 8c .. 8c + 7 of the group: byte 4 * col + i has k = 8c + i
// in its low nibble and k = 8c + 4 + i in its high nibble. Masking the low nibbles of a 64-byte chunk gives, per
// column, the 4 bytes of k 8c .. 8c + 3 in one 32-bit lane: the layout of a vpdpbusd (u8 x s8) operand, as does
// shifting out the high nibbles for k 8c + 4 .. 8c + 7. K is padded to whole groups (codes 0, activations 0).
// Scales: [NB, G, 16] fp32. Paths (int4_paths()): "avx512-vnni" (vpdpbusd), "amx" (from kAmxFrom rows on, AMX-INT8
// tiles: TDPBSSD takes the activations as A (signed, row-major, read in place) and a panel's unpacked codes less
// their zeros as B, whose VNNI row layout is this packing's with the nibbles split; fewer rows: the avx512-vnni tiles), "avx2"
// (vpmaddubsw + vpmaddwd: the same integer sums: a pair of products is at most 2 * 15 * 127, no int16 saturation),
// "avx-vnni" (the AVX2 build on a CPU with AVX-VNNI, its default there: the VEX vpdpbusd in place of those two, the
// same sums), "scalar". Every path makes the same integer sums and the same fp32 steps, so a path may be chosen by row count. Decode reads a
// little over half a byte a weight (4.125 bits + the scales: 4.38 bits at gs = 128, 5.5 at gs = 32).

#include <torch/extension.h>
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define DS_INT4_AVX512 1
#include <immintrin.h>
#include "amx.h"
#if defined(DS_AMX)
#define DS_INT4_AMX 1
#define DS_INT4_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define DS_INT4_AVX2 1
#include <immintrin.h>
#include "avx2_bf16.h"
#endif

namespace {

constexpr int kCols = 16;     // output columns per column block
constexpr int kSubMin = 32;   // the smallest activation sub-block (and group): 4 chunks of 8 k
constexpr int kSubMax = 128;  // the largest activation sub-block

inline int64_t sub_for(int64_t gs) { return std::min<int64_t>(gs, kSubMax); }
constexpr int kChunk = 64;    // bytes per 8 k of a column block
constexpr int kZeros = 16;    // zero bytes at the start of each (block, group)
constexpr int64_t kPanel = 16;  // column blocks a thread takes through every row tile before the next (L2 reuse)

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- activations ------------------------------------------------------------------------------------------

// row x [K] (bf16) -> xq [Kp] int8 (zero past K), xs [SB], xsum [SB] int32; SB = Kp / sub
void quantize_row(const at::BFloat16* x, int64_t K, int64_t Kp, int64_t sub, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t b = 0; b < Kp / sub; ++b) {
    const int64_t k0 = b * sub, k1 = std::min(K, k0 + sub);
    float amax = 0.0f;
    for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
    const float s = amax / 127.0f;
    int32_t sum = 0;
    for (int64_t k = k0; k < k0 + sub; ++k) {
      int32_t q = 0;
      if (k < k1 && amax > 0.0f) {
        q = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[k]) / s));
        q = std::max(-127, std::min(127, q));
      }
      xq[k] = static_cast<int8_t>(q);
      sum += q;
    }
    xs[b] = s;
    xsum[b] = sum;
  }
}

struct Acts {
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> sum;
  int64_t Kp, SB, sub;
};

// rows: the codes' rows, M or more (zero rows past M: the amx path reads whole 16-row tiles)
Acts quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t Kp, int64_t sub, int64_t rows = 0) {
  Acts a;
  a.Kp = Kp;
  a.sub = sub;
  a.SB = Kp / sub;
  a.q.assign(static_cast<size_t>(std::max(M, rows) * Kp), 0);
  a.s.assign(static_cast<size_t>(M * a.SB), 0.0f);
  a.sum.assign(static_cast<size_t>(M * a.SB), 0);
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * K, K, Kp, sub, a.q.data() + m * Kp, a.s.data() + m * a.SB, a.sum.data() + m * a.SB);
  });
  return a;
}

// ---- the scalar path: the definition ------------------------------------------------------------------------

void block_scalar(const Acts& a, int64_t m, const uint8_t* w, const float* s, int64_t G, int64_t gs,
                  at::BFloat16* y, int64_t ncols) {
  const int8_t* xq = a.q.data() + m * a.Kp;
  const float* xs = a.s.data() + m * a.SB;
  const int32_t* xsum = a.sum.data() + m * a.SB;
  const int64_t gbytes = kZeros + gs / 8 * kChunk, nsub = gs / a.sub, nch = a.sub / 8;
  for (int c = 0; c < kCols && c < ncols; ++c) {
    float tot = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* gp = w + g * gbytes;
      const int32_t z = gp[c];
      for (int64_t b = 0; b < nsub; ++b) {
        int32_t isum = 0;
        for (int64_t ch = b * nch; ch < (b + 1) * nch; ++ch) {
          const uint8_t* cp = gp + kZeros + ch * kChunk + 4 * c;
          const int64_t k = g * gs + ch * 8;
          for (int i = 0; i < 4; ++i) {
            isum += int32_t(cp[i] & 15) * xq[k + i];
            isum += int32_t(cp[i] >> 4) * xq[k + 4 + i];
          }
        }
        const int64_t sb = g * nsub + b;
        isum -= z * xsum[sb];
        const float u = (static_cast<float>(isum) * xs[sb]) * s[g * kCols + c];
        tot = sb == 0 ? u : tot + u;
      }
    }
    y[c] = static_cast<at::BFloat16>(tot);
  }
}

#if defined(DS_INT4_AVX512)
// MT rows x NB column blocks (w: the first block, wstride bytes a block; s: its scales, sstride floats a block).
// The high nibbles are masked in place (v & 0xF0: 16 q) rather than shifted down: vpdpbusd then sums 16 q x, and
// the sub-block's total is acc_lo + (acc_hi >> 4), exact (acc_hi is a multiple of 16); one op less per 64 bytes
// than a shift and a mask, and the shift ran on the port vpdpbusd needs. Two accumulators per output vector also
// halve the dependency chains' length.
template <int MT, int NB>
void tile_avx512(const Acts& a, int64_t m0, const uint8_t* w, int64_t wstride, const float* s, int64_t sstride,
                 int64_t G, int64_t gs, at::BFloat16* y, int64_t ys, int64_t ncols) {
  const int64_t gbytes = kZeros + gs / 8 * kChunk, nsub = gs / a.sub, nch = a.sub / 8;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 tot[MT][NB];
  for (int64_t g = 0; g < G; ++g) {
    __m512i z[NB];
    __m512 sc[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      z[j] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * wstride + g * gbytes)));
      sc[j] = _mm512_loadu_ps(s + j * sstride + g * kCols);
    }
    for (int64_t b = 0; b < nsub; ++b) {
      __m512i lo_acc[MT][NB], hi_acc[MT][NB];
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) lo_acc[i][j] = hi_acc[i][j] = _mm512_setzero_si512();
      const int64_t k0 = g * gs + b * a.sub;
#pragma GCC unroll 4
      for (int64_t ch = 0; ch < nch; ++ch) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
          const uint8_t* cp = w + j * wstride + g * gbytes + kZeros + (b * nch + ch) * kChunk;
          _mm_prefetch(reinterpret_cast<const char*>(cp + 16 * kChunk), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(cp);
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(v, high);
#pragma GCC unroll 8
          for (int i = 0; i < MT; ++i) {
            const int8_t* xr = a.q.data() + (m0 + i) * a.Kp + k0 + ch * 8;
            int32_t x0, x1;
            std::memcpy(&x0, xr, 4);
            std::memcpy(&x1, xr + 4, 4);
            lo_acc[i][j] = _mm512_dpbusd_epi32(lo_acc[i][j], lo, _mm512_set1_epi32(x0));
            hi_acc[i][j] = _mm512_dpbusd_epi32(hi_acc[i][j], hi, _mm512_set1_epi32(x1));
          }
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int64_t sb = (m0 + i) * a.SB + g * nsub + b;
        const __m512i corr = _mm512_set1_epi32(a.sum[sb]);
        const __m512 xs = _mm512_set1_ps(a.s[sb]);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
          const __m512i dot = _mm512_add_epi32(lo_acc[i][j], _mm512_srai_epi32(hi_acc[i][j], 4));
          const __m512i isum = _mm512_sub_epi32(dot, _mm512_mullo_epi32(z[j], corr));
          const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), xs), sc[j]);
          tot[i][j] = g == 0 && b == 0 ? u : _mm512_add_ps(tot[i][j], u);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      const __mmask16 keep = left >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      _mm256_mask_storeu_epi16(y + i * ys + j * kCols, keep, (__m256i)_mm512_cvtneps_pbh(tot[i][j]));
    }
}

using Tile = void (*)(const Acts&, int64_t, const uint8_t*, int64_t, const float*, int64_t, int64_t, int64_t,
                      at::BFloat16*, int64_t, int64_t);
constexpr int kRows = 8;  // rows per tile
// column blocks per tile: 3 MT NB accumulators + 2 NB (zeros, scales) + 4 (nibbles, masks) <= 32 registers
constexpr int kNB[kRows + 1] = {0, 4, 3, 2, 1, 1, 1, 1, 1};
constexpr Tile kTiles[kRows][4] = {
    {&tile_avx512<1, 1>, &tile_avx512<1, 2>, &tile_avx512<1, 3>, &tile_avx512<1, 4>},
    {&tile_avx512<2, 1>, &tile_avx512<2, 2>, &tile_avx512<2, 3>, nullptr},
    {&tile_avx512<3, 1>, &tile_avx512<3, 2>, nullptr, nullptr},
    {&tile_avx512<4, 1>, nullptr, nullptr, nullptr},
    {&tile_avx512<5, 1>, nullptr, nullptr, nullptr},
    {&tile_avx512<6, 1>, nullptr, nullptr, nullptr},
    {&tile_avx512<7, 1>, nullptr, nullptr, nullptr},
    {&tile_avx512<8, 1>, nullptr, nullptr, nullptr}};
#endif  // DS_INT4_AVX512

#if defined(DS_INT4_AMX)
constexpr int64_t kAmxFrom = 16;  // rows from which the amx path runs on tiles (a full A tile)

// tiles: C 0, A 1-2, B 3-4; A and C rows 16, 64 bytes (A: 64 k; C: 16 int32); B 16 rows (64 k) of 64 bytes
DS_INT4_AMX_TARGET inline void configure_int8_tiles() {
  ds_amx::TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC 12 drops the stores above as dead (it does not see ldtilecfg read them): the tiles were left unconfigured
  // and the first tile instruction faulted. The barrier makes them happen.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// a panel's codes less their zeros (q - z, -16..15, signed bytes) as B tiles: block b's k-row r (k 4r .. 4r + 3 of
// every column) at out + (b * Kp / 4 + r) * 64. With the zero taken out here TDPBSSD's sums are isum itself (the
// vector paths subtract z * xsum after), once per panel rather than once per row and sub-block.
inline void unpack_panel(const uint8_t* w, int64_t wstride, int64_t b0, int64_t b1, int64_t G, int64_t gs,
                         int8_t* out, int64_t Kp) {
  const int64_t gbytes = kZeros + gs / 8 * kChunk;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; ++b) {
    int8_t* o = out + (b - b0) * (Kp / 4) * 64;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* gp = w + b * wstride + g * gbytes;
      // each column's zero in all four bytes of its lane
      const __m512i z = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp))),
                                           _mm512_set1_epi32(0x01010101));
      for (int64_t c = 0; c < gs / 8; ++c) {
        const __m512i v = _mm512_loadu_si512(gp + kZeros + c * kChunk);
        const int64_t r = (g * gs + c * 8) / 4;
        _mm512_storeu_si512(o + r * 64, _mm512_sub_epi8(_mm512_and_si512(v, low), z));
        _mm512_storeu_si512(o + (r + 1) * 64, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), z));
      }
    }
  }
}

// rows [m0, m0 + 16) (q: the padded activation codes) x column block b (bt: its B rows) -> y rows < M
DS_INT4_AMX_TARGET void tile_amx(const Acts& a, int64_t m0, int64_t M, const float* s, const int8_t* bt, int64_t G,
                                 int64_t gs, at::BFloat16* y, int64_t ys, int64_t ncols) {
  alignas(64) int32_t c[16][16];
  const int64_t nsub = gs / a.sub, rows = std::min<int64_t>(16, M - m0);
  __m512 tot[16];
  for (int64_t g = 0; g < G; ++g) {
    const __m512 sc = _mm512_loadu_ps(s + g * kCols);
    for (int64_t b = 0; b < nsub; ++b) {
      const int64_t k0 = g * gs + b * a.sub;
      _tile_zero(0);
      for (int64_t k = k0; k < k0 + a.sub; k += 64) {
        _tile_loadd(1, a.q.data() + m0 * a.Kp + k, a.Kp);
        _tile_loadd(3, bt + (k / 4) * 64, 64);
        _tile_dpbssd(0, 1, 3);
      }
      _tile_stored(0, c, 64);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t sb = (m0 + i) * a.SB + g * nsub + b;
        const __m512i isum = _mm512_load_si512(c[i]);  // the zero is in the codes already
        const __m512 u = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(a.s[sb])), sc);
        tot[i] = g == 0 && b == 0 ? u : _mm512_add_ps(tot[i], u);
      }
    }
  }
  const __mmask16 keep = ncols >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1);
  for (int64_t i = 0; i < rows; ++i)
    _mm256_mask_storeu_epi16(y + i * ys, keep, (__m256i)_mm512_cvtneps_pbh(tot[i]));
}

DS_INT4_AMX_TARGET void release_int8_tiles() { _tile_release(); }
#endif  // DS_INT4_AMX

#if defined(DS_INT4_AVX2)
// u8 x s8 dot products of 4 k, added to acc: vpmaddubsw (pairs, int16, never saturating here) then vpmaddwd by ones
struct Dot4Avx2 {
  static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
  }
};

// the same sums in one instruction where the CPU has AVX-VNNI (the VEX vpdpbusd: Alder Lake and later, Zen 5):
// exact integer sums either way, so the avx-vnni path has the avx2 path's bits
#define DS_AVX_VNNI_TARGET __attribute__((target("avxvnni")))
struct Dot4AvxVnni {
  DS_AVX_VNNI_TARGET static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, w, x);
  }
};

// MT rows x one column block, as two halves of 8 columns; D: the dot product. Compiled with AVX-VNNI allowed so
// that Dot4AvxVnni inlines; Dot4Avx2's instantiation holds no AVX-VNNI instruction (the compiler makes vpdpbusd
// only from its intrinsic), and the avx-vnni path runs only where the CPU has it (has_avx_vnni)
template <int MT, class D>
DS_AVX_VNNI_TARGET void tile_avx2(const Acts& a, int64_t m0, const uint8_t* w, const float* s, int64_t G, int64_t gs,
                                  at::BFloat16* y, int64_t ys, int64_t ncols) {
  const int64_t gbytes = kZeros + gs / 8 * kChunk, nsub = gs / a.sub, nch = a.sub / 8;
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 tot[MT][2];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* gp = w + g * gbytes;
    const __m256i z0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp)));
    const __m256i z1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gp + 8)));
    const __m256 s0 = _mm256_loadu_ps(s + g * kCols), s1 = _mm256_loadu_ps(s + g * kCols + 8);
    for (int64_t b = 0; b < nsub; ++b) {
      __m256i acc[MT][2];
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
      const int64_t k0 = g * gs + b * a.sub;
#pragma GCC unroll 4
      for (int64_t ch = 0; ch < nch; ++ch) {
        const uint8_t* cp = gp + kZeros + (b * nch + ch) * kChunk;
        _mm_prefetch(reinterpret_cast<const char*>(cp + 16 * kChunk), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const int8_t* xr = a.q.data() + (m0 + i) * a.Kp + k0 + ch * 8;
          int32_t x0, x1;
          std::memcpy(&x0, xr, 4);
          std::memcpy(&x1, xr + 4, 4);
          const __m256i xb0 = _mm256_set1_epi32(x0), xb1 = _mm256_set1_epi32(x1);
          acc[i][0] = D::dot4(D::dot4(acc[i][0], lo0, xb0), hi0, xb1);
          acc[i][1] = D::dot4(D::dot4(acc[i][1], lo1, xb0), hi1, xb1);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int64_t sb = (m0 + i) * a.SB + g * nsub + b;
        const __m256i corr = _mm256_set1_epi32(a.sum[sb]);
        const __m256 xs = _mm256_set1_ps(a.s[sb]);
        const __m256 t0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][0], _mm256_mullo_epi32(z0, corr))), xs);
        const __m256 t1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][1], _mm256_mullo_epi32(z1, corr))), xs);
        const __m256 u0 = _mm256_mul_ps(t0, s0), u1 = _mm256_mul_ps(t1, s1);
        tot[i][0] = g == 0 && b == 0 ? u0 : _mm256_add_ps(tot[i][0], u0);
        tot[i][1] = g == 0 && b == 0 ? u1 : _mm256_add_ps(tot[i][1], u1);
      }
    }
  }
  for (int i = 0; i < MT; ++i) ds_avx2::store_bf16x16(tot[i][0], tot[i][1], y + i * ys, ncols);
}

using Avx2Tile = void (*)(const Acts&, int64_t, const uint8_t*, const float*, int64_t, int64_t, at::BFloat16*,
                          int64_t, int64_t);
constexpr int kRowsAvx2 = 2;
constexpr Avx2Tile kAvx2Tiles[kRowsAvx2] = {&tile_avx2<1, Dot4Avx2>, &tile_avx2<2, Dot4Avx2>};
constexpr Avx2Tile kAvxVnniTiles[kRowsAvx2] = {&tile_avx2<1, Dot4AvxVnni>, &tile_avx2<2, Dot4AvxVnni>};

bool has_avx_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}
#endif  // DS_INT4_AVX2

enum class Path { kScalar, kAvx512, kAmx, kAvx2, kAvxVnni };

Path path_named(const std::string& name) {
  if (name.empty() || name == "int4") {
#if defined(DS_INT4_AVX512)
    return Path::kAvx512;
#elif defined(DS_INT4_AVX2)
    return has_avx_vnni() ? Path::kAvxVnni : Path::kAvx2;
#else
    return Path::kScalar;
#endif
  }
  if (name == "int4:scalar") return Path::kScalar;
#if defined(DS_INT4_AVX512)
  if (name == "int4:avx512-vnni") return Path::kAvx512;
#endif
#if defined(DS_INT4_AMX)
  if (name == "int4:amx") {
    TORCH_CHECK(ds_amx::amx_permission_errno() == 0, "linear_int4: path int4:amx cannot run in this process (no AMX, "
                "or the Linux kernel refused the tile data permission)");
    return Path::kAmx;
  }
#endif
#if defined(DS_INT4_AVX2)
  if (name == "int4:avx2") return Path::kAvx2;
  if (name == "int4:avx-vnni") {
    TORCH_CHECK(has_avx_vnni(), "linear_int4: path int4:avx-vnni needs a CPU with AVX-VNNI");
    return Path::kAvxVnni;
  }
#endif
  TORCH_CHECK(false, "linear_int4: path ", name, " is not in this build (int4_paths() lists them)");
}

}  // namespace

std::vector<std::string> int4_paths() {
  std::vector<std::string> p;
#if defined(DS_INT4_AVX512)
  p.push_back("int4:avx512-vnni");
#endif
#if defined(DS_INT4_AMX)
  if (ds_amx::amx_permission_errno() == 0) p.push_back("int4:amx");  // asked for by name (the engine's amx set)
#endif
#if defined(DS_INT4_AVX2)
  if (has_avx_vnni()) p.push_back("int4:avx-vnni");  // the build's default where the CPU has it
  p.push_back("int4:avx2");
#endif
  p.push_back("int4:scalar");
  return p;
}

// codes [N, K] uint8 (0..15), zeros [N, G] uint8 (0..16), scales [N, G] fp32, gs (a multiple of 32, G = ceil(K / gs))
// -> (packed [NB, G, 16 + gs * 8] uint8, scales [NB, G, 16] fp32); columns past N: codes, zeros and scales 0
std::tuple<torch::Tensor, torch::Tensor> pack_int4_weight(const torch::Tensor& codes, const torch::Tensor& zeros,
                                                          const torch::Tensor& scales, int64_t gs) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "pack_int4_weight: codes must be [N, K] uint8");
  TORCH_CHECK(gs > 0 && gs % kSubMin == 0 && (gs <= kSubMax || gs % kSubMax == 0),
              "pack_int4_weight: the group size must be a multiple of 32 (and of 128 above 128), not ", gs);
  const int64_t N = codes.size(0), K = codes.size(1), G = cdiv(K, gs), NB = cdiv(N, kCols);
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.dim() == 2 && zeros.size(0) == N && zeros.size(1) == G,
              "pack_int4_weight: zeros must be [N, ceil(K / gs)] uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G,
              "pack_int4_weight: scales must be [N, ceil(K / gs)] fp32");
  const auto c = codes.contiguous();
  const auto zc = zeros.contiguous();
  const auto sc = scales.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint8_t* zp = zc.data_ptr<uint8_t>();
  const float* sp = sc.data_ptr<float>();
  TORCH_CHECK(c.max().item<int>() <= 15, "pack_int4_weight: a code above 15");
  TORCH_CHECK(zc.numel() == 0 || zc.max().item<int>() <= 16, "pack_int4_weight: a zero above 16");
  const int64_t gbytes = kZeros + gs / 8 * kChunk;
  auto packed = torch::zeros({NB, G, gbytes}, torch::kByte);
  auto ps = torch::zeros({NB, G, kCols}, torch::kFloat);
  uint8_t* pp = packed.data_ptr<uint8_t>();
  float* psp = ps.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int col = 0; col < kCols; ++col) {
        const int64_t n = b * kCols + col;
        if (n >= N) break;
        for (int64_t g = 0; g < G; ++g) {
          uint8_t* gp = pp + (b * G + g) * gbytes;
          gp[col] = zp[n * G + g];
          psp[(b * G + g) * kCols + col] = sp[n * G + g];
          for (int64_t kk = 0; kk < gs && g * gs + kk < K; ++kk) {
            const int64_t k = g * gs + kk, ch = kk / 8, i = kk % 8;
            const uint8_t q = cp[n * K + k];
            uint8_t& byte = gp[kZeros + ch * kChunk + 4 * col + (i % 4)];
            byte = static_cast<uint8_t>(i < 4 ? (byte & 0xF0) | q : (byte & 0x0F) | (q << 4));
          }
        }
      }
  });
  return {packed, ps};
}

torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t N,
                          const std::string& path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_int4: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "linear_int4: packed must come from pack_int4_weight");
  const int64_t NB = packed.size(0), G = packed.size(1), gbytes = packed.size(2);
  TORCH_CHECK((gbytes - kZeros) % kChunk == 0 && gbytes > kZeros, "linear_int4: packed has a bad group size");
  const int64_t gs = (gbytes - kZeros) / kChunk * 8;
  const int64_t M = x.size(0), K = x.size(1), Kp = G * gs;
  TORCH_CHECK(cdiv(K, gs) == G, "linear_int4: x has ", K, " columns; the weight was packed for ", G, " groups of ", gs);
  TORCH_CHECK(NB == cdiv(N, kCols), "linear_int4: n = ", N, " does not match the packed weight's ", NB, " blocks");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == NB && scales.size(1) == G && scales.size(2) == kCols,
              "linear_int4: scales must come from pack_int4_weight");
  Path which = path_named(path);
  const int64_t sub = sub_for(gs);
#if defined(DS_INT4_AMX)
  if (which == Path::kAmx && (M < kAmxFrom || sub % 64)) which = Path::kAvx512;  // the same bits, as vectors
#endif
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Acts a = quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, Kp, sub, which == Path::kAmx ? cdiv(M, 16) * 16 : M);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t wstride = G * gbytes, sstride = G * kCols;
  const bool serial = M * N * K < kSerialBelow;
  const int64_t chunk = ds::chunk_blocks(NB, 4, 16, M <= 8);
  ds::parallel_chunks(NB, chunk, serial, [&](int64_t t0, int64_t t1) {
    if (which == Path::kScalar) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t b = t0; b < t1; ++b)
          block_scalar(a, m, wp + b * wstride, sp + b * sstride, G, gs, yp + m * N + b * kCols, N - b * kCols);
      return;
    }
#if defined(DS_INT4_AMX)
    if (which == Path::kAmx) {
      static thread_local std::vector<int8_t> panel;  // kept between calls: a fresh one would be page faults
      const size_t need = static_cast<size_t>(kPanel * Kp * 16);
      if (panel.size() < need) panel.resize(need);
      configure_int8_tiles();
      for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {
        const int64_t b1 = std::min(t1, b0 + kPanel);
        unpack_panel(wp, wstride, b0, b1, G, gs, panel.data(), Kp);
        for (int64_t m0 = 0; m0 < M; m0 += 16)
          for (int64_t b = b0; b < b1; ++b)
            tile_amx(a, m0, M, sp + b * sstride, panel.data() + (b - b0) * Kp * 16, G, gs, yp + m0 * N + b * kCols,
                     N, N - b * kCols);
      }
      release_int8_tiles();
      return;
    }
#endif
#if defined(DS_INT4_AVX512)
    if (which == Path::kAvx512) {
      for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {  // a panel of blocks from memory once, then from L2
        const int64_t b1 = std::min(t1, b0 + kPanel);
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int mt = static_cast<int>(std::min<int64_t>(kRows, M - m0));
          for (int64_t b = b0; b < b1; b += kNB[mt]) {
            const int nb = static_cast<int>(std::min<int64_t>(kNB[mt], b1 - b));
            kTiles[mt - 1][nb - 1](a, m0, wp + b * wstride, wstride, sp + b * sstride, sstride, G, gs,
                                   yp + m0 * N + b * kCols, N, N - b * kCols);
          }
        }
      }
      return;
    }
#endif
#if defined(DS_INT4_AVX2)
    if (which == Path::kAvx2 || which == Path::kAvxVnni) {
      const Avx2Tile* tiles = which == Path::kAvxVnni ? kAvxVnniTiles : kAvx2Tiles;
      for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {
        const int64_t b1 = std::min(t1, b0 + kPanel);
        for (int64_t m0 = 0; m0 < M; m0 += kRowsAvx2) {
          const int mt = static_cast<int>(std::min<int64_t>(kRowsAvx2, M - m0));
          for (int64_t b = b0; b < b1; ++b)
            tiles[mt - 1](a, m0, wp + b * wstride, sp + b * sstride, G, gs, yp + m0 * N + b * kCols, N,
                          N - b * kCols);
        }
      }
      return;
    }
#endif
  });
  return y;
}

// the activations' int8 codes as the kernel makes them (the tests compare them with ops/int4.py's)
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_int8_rows(const torch::Tensor& x, int64_t Kp,
                                                                           int64_t sub) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "quantize_int8_rows: x must be [M, K] bf16");
  TORCH_CHECK(sub > 0 && Kp % sub == 0 && Kp >= x.size(1), "quantize_int8_rows: Kp must be a multiple of sub, >= K");
  auto xc = x.contiguous();
  const int64_t M = x.size(0);
  const Acts a = quantize_rows(xc.data_ptr<at::BFloat16>(), M, x.size(1), Kp, sub);
  auto q = torch::from_blob(const_cast<int8_t*>(a.q.data()), {M, Kp}, torch::kChar).clone();
  auto s = torch::from_blob(const_cast<float*>(a.s.data()), {M, a.SB}, torch::kFloat).clone();
  auto sum = torch::from_blob(const_cast<int32_t*>(a.sum.data()), {M, a.SB}, torch::kInt).clone();
  return {q, s, sum};
}

void register_int4(pybind11::module& m) {
  m.def("int4_paths", &int4_paths, "the compiled paths of linear_int4, best first");
  m.def("pack_int4_weight", &pack_int4_weight, "pack int4 codes [N, K], zeros and scales [N, G] for linear_int4",
        py::arg("codes"), py::arg("zeros"), py::arg("scales"), py::arg("group_size"));
  m.def("linear_int4", &linear_int4, "y = x @ dequant(w)^T, bf16 x (int8 per 128 k inside), packed int4 weight",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("path") = "");
  m.def("quantize_int8_rows", &quantize_int8_rows, "the int8 activation codes linear_int4 makes", py::arg("x"),
        py::arg("kp"), py::arg("sub"));
}
