// fp8 (e4m3fn) weights against bf16 activations, for every row count; its own extension (ops/fp8.py loads it).
//
// y [M, N] = x [M, K] @ dequant(w [N, K])^T, bf16 in and out. The weight is a Hugging Face block-FP8 tensor:
// one fp32 scale per 128 x 128 block. Packed once (pack_fp8_weight) into [ceil(N/16), ceil(K/4), 64] bytes:
// for each block of 16 output columns and each group of two k pairs, 64 bytes, permuted so that the AVX-512
// path turns them into two bf16 dot-product operands with two byte lookups and two byte unpacks (the AVX2
// build orders them k-major instead, group_offset); plus
// scales [ceil(N/16), ceil(K/128)], one fp32 per 16 columns and 128 k (the 16 rows of a column block share one
// scale: pack_fp8_weight checks it).
//
// Bits: every output y[m, n] = sum over k blocks kb ascending of (scale[n, kb] * p[m, n, kb]), each term
// rounded to fp32 then added (no fused multiply-add), where p is the fp32 dot product of the block's 128 k in
// ascending order (exact fp8 -> bf16 conversion, the products exact). One rounding to bf16 at the end (round
// to nearest even). Neither the row count, the tile a row falls into nor the thread split (columns only)
// changes that order: a row's result is the same alone or in any batch.
//
// Paths (fp8_paths() lists this build's, the default first; tests run each against the torch reference):
// "avx512" (AVX512-BF16 + AVX512-VBMI: vpermi2b looks up the bf16 bytes of 64 fp8 codes at once, vdpbf16ps
// accumulates; from kScratchFrom rows on, a panel is converted once into a bf16 scratch and every row tile
// reads it: the same pairs in the same order, so the same bits); "amx" (the same build where AMX may be used,
// asked for by name: converted pairs on AMX tiles, its own order inside a 32-k chunk, below); "avx2" (the AVX2
// build: the scalar path's order and bits, 8 columns a register, below); "scalar" (portable C++, a 256-entry
// table; another summation order inside a block, the same block structure). Decode streams half of bf16's bytes.

#include <torch/extension.h>
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if !(defined(__AVX512BF16__) && defined(__AVX512VBMI__)) && defined(__AVX2__) && defined(__FMA__)
#define DS_FP8_AVX2 1  // the AVX2 + FMA build's vector path (avx2), which packs k-major (group_offset)
#include <immintrin.h>
#include "avx2_bf16.h"
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define DS_FP8_AVX512 1
#include <immintrin.h>
#include "amx.h"
#if defined(DS_AMX)
#define DS_FP8_AMX 1
#endif
#endif

namespace {

constexpr int kCols = 16;               // output columns per column block
constexpr int64_t kBlock = 128;         // k per scale block (the checkpoint's block size)
constexpr int64_t kGroupK = 4;          // k per 64-byte group (two k pairs)
constexpr int64_t kGroupsPerBlock = kBlock / kGroupK;
constexpr int64_t kPanel = 24;          // column blocks per panel (L2 reuse across the row tiles)

// value of an e4m3fn code: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m * 2^-9);
// 0x7F / 0xFF are NaN (the format has no infinities)
float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return s ? -mag : mag;
}

struct Tables {
  float value[256];
  uint8_t bf16_lo[128], bf16_hi[128];  // the two bytes of the bf16 of each magnitude code (exact: bf16 holds e4m3)
  Tables() {
    for (int b = 0; b < 256; ++b) value[b] = e4m3_value(uint8_t(b));
    for (int b = 0; b < 128; ++b) {
      uint32_t bits;
      std::memcpy(&bits, &value[b], 4);
      TORCH_CHECK((bits & 0xFFFF) == 0 || b == 0x7F, "e4m3 value not exact in bf16");
      bf16_lo[b] = uint8_t(bits >> 16);
      bf16_hi[b] = uint8_t(bits >> 24);
    }
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

// byte position inside a 64-byte group of (k pair q in 0..1, word w in 0..31), word w = 2 * column + (k & 1):
// the AVX-512 path unpacks bytes 0-7 of each 128-bit lane into the first pair's words and bytes 8-15 into the
// second's, lane L holding words 8L..8L+7. The AVX2 build packs k-major instead (its own extension packs and
// runs its weights): the group's k kk = 2q + (w & 1) holds 16 consecutive bytes, one per column, so its k of a
// column block are 16 contiguous bytes each.
#if defined(DS_FP8_AVX2)
inline int group_offset(int q, int w) { return (2 * q + (w & 1)) * 16 + w / 2; }
#else
inline int group_offset(int q, int w) { return (w / 8) * 16 + q * 8 + (w % 8); }
#endif

inline uint32_t load_pair(const at::BFloat16* row, int64_t p, int64_t K) {
  // bf16 x[2p], x[2p+1] as one 32-bit word; zero past K
  uint16_t v[2] = {0, 0};
  if (2 * p + 1 < K) {
    std::memcpy(v, row + 2 * p, 4);
  } else if (2 * p < K) {
    std::memcpy(v, row + 2 * p, 2);
  }
  uint32_t r;
  std::memcpy(&r, v, 4);
  return r;
}

#if defined(DS_FP8_AVX2)
// The avx2 path (AVX2 + FMA, no AVX-512): the scalar path's sum exactly, 8 columns a register. A code's fp32
// value is built with integer ops: the code sign-extended, shifted so that its exponent and mantissa bits land
// in the fp32 fields (s eeee mmm -> s, e in the low exponent bits, mmm at the top of the mantissa), masked, then
// multiplied by 2^120 (the bias difference, 127 - 7): exact for every finite code, subnormals included (they
// become fp32 denormals first, so the multiply needs DAZ off: each call clears it on its threads and puts it
// back). Products of a bf16 x and an e4m3 weight are exact in fp32, so an fma is the scalar path's multiply
// then add, and the k order is the scalar path's: the same bits. x is widened to fp32 once per call.
constexpr int kRowsAvx2 = 6;  // rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast <= 16 registers

struct NoDaz {  // MXCSR's denormals-are-zero bit off while in scope (the conversion multiplies denormals)
  unsigned saved = _mm_getcsr();
  NoDaz() {
    if (saved & 0x40u) _mm_setcsr(saved & ~0x40u);
  }
  ~NoDaz() {
    if (saved & 0x40u) _mm_setcsr(saved);
  }
};

inline __m256 codes8(const uint8_t* c) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

// MT rows of xf (fp32, stride K) x NB column blocks (w: the first block's groups, k's 16 codes at + 16 k; the next
// block at + wstride). Several blocks at few rows: each accumulator is a chain of fmas in k order, so one row
// needs several chains in flight (4 cycles an fma) to be bound by the conversion instead.
template <int MT, int NB>
void tile_avx2(const float* xf, int64_t K, const uint8_t* w, int64_t wstride, const float* s, int64_t KB,
               at::BFloat16* y, int64_t ys, int64_t ncols) {
  __m256 tot[MT][2 * NB];
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m256 acc[MT][2 * NB];
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < 2 * NB; ++j) acc[i][j] = _mm256_setzero_ps();
    const int64_t k1 = std::min(K, (kb + 1) * kBlock);
    for (int64_t k = kb * kBlock; k < k1; ++k) {
      __m256 wv[2 * NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        wv[2 * j] = codes8(w + j * wstride + 16 * k);
        wv[2 * j + 1] = codes8(w + j * wstride + 16 * k + 8);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m256 xb = _mm256_broadcast_ss(xf + i * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NB; ++j) acc[i][j] = _mm256_fmadd_ps(xb, wv[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 2 * NB; ++j) {
      const __m256 sc = _mm256_set1_ps(s[(j / 2) * KB + kb]);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const __m256 term = _mm256_mul_ps(acc[i][j], sc);
        tot[i][j] = kb == 0 ? term : _mm256_add_ps(tot[i][j], term);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NB; ++j) {
      const int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      ds_avx2::store_bf16x16(tot[i][2 * j], tot[i][2 * j + 1], y + i * ys + j * kCols, left);
    }
}

using Avx2Fn = void (*)(const float*, int64_t, const uint8_t*, int64_t, const float*, int64_t, at::BFloat16*, int64_t,
                        int64_t);
// [MT - 1][NB - 1]; column blocks per tile for MT rows: kAvx2NB[MT] (MT * 2 NB accumulators + 2 NB weights + 1 <= 16
// registers, the weights of one row reused as they are consumed)
constexpr int kAvx2NB[kRowsAvx2 + 1] = {0, 4, 2, 1, 1, 1, 1};
constexpr Avx2Fn kAvx2Tiles[kRowsAvx2][4] = {
    {&tile_avx2<1, 1>, &tile_avx2<1, 2>, &tile_avx2<1, 3>, &tile_avx2<1, 4>},
    {&tile_avx2<2, 1>, &tile_avx2<2, 2>, nullptr, nullptr},
    {&tile_avx2<3, 1>, nullptr, nullptr, nullptr},
    {&tile_avx2<4, 1>, nullptr, nullptr, nullptr},
    {&tile_avx2<5, 1>, nullptr, nullptr, nullptr},
    {&tile_avx2<6, 1>, nullptr, nullptr, nullptr}};
#endif  // DS_FP8_AVX2

#if defined(DS_FP8_AVX512)

struct Luts {
  __m512i lo0, lo1, hi0, hi1, sign;
};

inline void convert(const uint8_t* g, const Luts& t, __m512bh& w0, __m512bh& w1) {
  // 64 fp8 codes -> two vectors of 32 bf16 (the group's two k pairs for 16 columns)
  const __m512i c = _mm512_loadu_si512(g);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);  // index: the code's low 7 bits
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, c, t.hi1);
  hi = _mm512_ternarylogic_epi32(hi, c, t.sign, 0xF8);             // hi | (c & 0x80): the sign bit
  w0 = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
  w1 = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
}

// converts the fp8 codes of column blocks [b0, b1) (packed weight w, wstride bytes a block), groups [g0, g1), into
// pairs at out (block b at + (b - b0) * ostride vectors, group g at + 2 (g - g0))
inline void convert_range(const uint8_t* w, int64_t wstride, int64_t b0, int64_t b1, int64_t g0, int64_t g1,
                          const Luts& luts, __m512bh* out, int64_t ostride) {
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = w + b * wstride + g * 64;
      // the line one scale block ahead (past a block's end: the start of a later block), so that the amx path's
      // decode call, converting one scale block at a time, streams from memory rather than waiting for it
      _mm_prefetch(reinterpret_cast<const char*>(gp + kGroupsPerBlock * 64), _MM_HINT_T0);
      convert(gp, luts, out[(b - b0) * ostride + 2 * (g - g0)], out[(b - b0) * ostride + 2 * (g - g0) + 1]);
    }
}

inline __m512bh bcast(uint32_t v) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(v)); }

// both tiles' k-block epilogue: tot += scale[column block, kb] * acc, each term rounded to fp32 (no fma)
template <int MT, int NB>
inline void add_block(const __m512 (&acc)[MT][NB], const float* s, int64_t KB, int64_t kb, __m512 (&tot)[MT][NB]) {
#pragma GCC unroll 64
  for (int j = 0; j < NB; ++j) {
    const __m512 sc = _mm512_set1_ps(s[j * KB + kb]);
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i) {
      const __m512 term = _mm512_mul_ps(acc[i][j], sc);
      tot[i][j] = kb == 0 ? term : _mm512_add_ps(tot[i][j], term);
    }
  }
}

// both tiles' store: each row's sums rounded once to bf16 (nearest even), columns past ncols masked off
template <int MT, int NB>
inline void store_tile(const __m512 (&tot)[MT][NB], at::BFloat16* y, int64_t ys, int64_t ncols) {
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      const int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      const __mmask16 keep = left >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      _mm256_mask_storeu_epi16(y + i * ys + j * kCols, keep, (__m256i)_mm512_cvtneps_pbh(tot[i][j]));
    }
}

template <int MT, int NB>
void tile_avx512(const at::BFloat16* x, int64_t K, const uint8_t* w, int64_t ngroups, const float* s, int64_t KB,
                 at::BFloat16* y, int64_t ys, int64_t ncols, const Luts& t) {
  // x: MT rows (stride K); w: NB column blocks of ngroups * 64 bytes; s: their scales (stride KB)
  __m512 tot[MT][NB];
  const int64_t g_fast = (K / 2) / 2;  // groups whose two k pairs lie inside K
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t g0 = kb * kGroupsPerBlock, g1 = std::min(ngroups, g0 + kGroupsPerBlock);
    __m512 acc[MT][NB];
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t gf = std::max(g0, std::min(g1, g_fast));
    for (int64_t g = g0; g < gf; ++g) {
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) {
        const uint8_t* gp = w + (j * ngroups + g) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(gp + 8 * 64), _MM_HINT_T0);
        __m512bh w0, w1;
        convert(gp, t, w0, w1);
#pragma GCC unroll 64
        for (int i = 0; i < MT; ++i) {
          uint32_t x01, x23;
          std::memcpy(&x01, x + i * K + 4 * g, 4);
          std::memcpy(&x23, x + i * K + 4 * g + 2, 4);
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bcast(x01), w0);
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bcast(x23), w1);
        }
      }
    }
    for (int64_t g = gf; g < g1; ++g) {  // the tail of K: x read only inside K (the packed weight is zero past K)
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) {
        __m512bh w0, w1;
        convert(w + (j * ngroups + g) * 64, t, w0, w1);
#pragma GCC unroll 64
        for (int i = 0; i < MT; ++i) {
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bcast(load_pair(x + i * K, 2 * g, K)), w0);
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], bcast(load_pair(x + i * K, 2 * g + 1, K)), w1);
        }
      }
    }
    add_block<MT, NB>(acc, s, KB, kb, tot);
  }
  store_tile<MT, NB>(tot, y, ys, ncols);
}

template <int MT, int NB>
void tile_scratch(const at::BFloat16* x, int64_t K, const __m512bh* w, int64_t npairs, const float* s, int64_t KB,
                  at::BFloat16* y, int64_t ys, int64_t ncols) {
  // the same sums as tile_avx512 from weights already converted (w: NB column blocks of npairs bf16 vectors,
  // npairs = 2 * groups): per accumulator the same pairs in the same order, so the same bits
  __m512 tot[MT][NB];
  const int64_t p_fast = K / 2;  // pairs lying inside K
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t p0 = kb * 2 * kGroupsPerBlock, p1 = std::min(npairs, p0 + 2 * kGroupsPerBlock);
    __m512 acc[MT][NB];
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t pf = std::max(p0, std::min(p1, p_fast));
    for (int64_t p = p0; p < pf; ++p) {
      __m512bh wv[NB];
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) wv[j] = w[j * npairs + p];
#pragma GCC unroll 64
      for (int i = 0; i < MT; ++i) {
        uint32_t xv;
        std::memcpy(&xv, x + i * K + 2 * p, 4);
        const __m512bh xb = bcast(xv);
#pragma GCC unroll 64
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
      }
    }
    for (int64_t p = pf; p < p1; ++p) {
#pragma GCC unroll 64
      for (int i = 0; i < MT; ++i) {
        const __m512bh xb = bcast(load_pair(x + i * K, p, K));
#pragma GCC unroll 64
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, w[j * npairs + p]);
      }
    }
    add_block<MT, NB>(acc, s, KB, kb, tot);
  }
  store_tile<MT, NB>(tot, y, ys, ncols);
}

using TileFn = void (*)(const at::BFloat16*, int64_t, const uint8_t*, int64_t, const float*, int64_t, at::BFloat16*,
                        int64_t, int64_t, const Luts&);
using ScratchFn = void (*)(const at::BFloat16*, int64_t, const __m512bh*, int64_t, const float*, int64_t,
                           at::BFloat16*, int64_t, int64_t);
// the scratch tiles: MT*NB accumulators + NB weight vectors + 1 broadcast <= 32 registers (linear_bf16's table)
constexpr int kScratchNB[9] = {0, 8, 8, 6, 5, 4, 4, 3, 3};
// rows from which a panel is converted once and reused by every row tile: up to 8 rows (one row tile) the
// conversion in registers is cheaper than writing and re-reading the converted panel
constexpr int64_t kScratchFrom = 9;
constexpr int64_t kScratchPanel = 8;   // column blocks per converted panel (K * 256 bytes: in L2)
// column blocks per tile for MT rows: MT*NB accumulators + 2 weight vectors + 5 tables + temporaries <= 32 registers
constexpr int kNB[9] = {0, 8, 8, 6, 5, 4, 3, 3, 2};

template <int MT, int... NB>
constexpr std::array<TileFn, sizeof...(NB)> tile_row(std::integer_sequence<int, NB...>) {
  return {&tile_avx512<MT, NB + 1>...};
}
template <int... MT>
constexpr std::array<std::array<TileFn, 8>, sizeof...(MT)> tile_table(std::integer_sequence<int, MT...>) {
  return {tile_row<MT + 1>(std::make_integer_sequence<int, 8>{})...};
}
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, 8>{});

template <int MT, int... NB>
constexpr std::array<ScratchFn, sizeof...(NB)> scratch_row(std::integer_sequence<int, NB...>) {
  return {&tile_scratch<MT, NB + 1>...};
}
template <int... MT>
constexpr std::array<std::array<ScratchFn, 8>, sizeof...(MT)> scratch_table(std::integer_sequence<int, MT...>) {
  return {scratch_row<MT + 1>(std::make_integer_sequence<int, 8>{})...};
}
constexpr auto kScratchTiles = scratch_table(std::make_integer_sequence<int, 8>{});

Luts make_luts() {
  const Tables& t = tables();
  Luts l;
  l.lo0 = _mm512_loadu_si512(t.bf16_lo);
  l.lo1 = _mm512_loadu_si512(t.bf16_lo + 64);
  l.hi0 = _mm512_loadu_si512(t.bf16_hi);
  l.hi1 = _mm512_loadu_si512(t.bf16_hi + 64);
  l.sign = _mm512_set1_epi8(static_cast<char>(0x80));
  return l;
}

#endif  // DS_FP8_AVX512

#if defined(DS_FP8_AMX)
// The amx path: each panel of column blocks converted once into bf16 pairs (convert(), exact), then multiplied
// on AMX tiles (TDPBF16PS) as linear_bf16_amx.cpp does, one 128-k scale block at a time: C tiles summed over the
// block's 32-k chunks from zero, stored, the K % 32 tail added as vdpbf16ps pairs in ascending order (it lies in
// the last block), scaled and added to the running fp32 total; one rounding to bf16 at the end. The order
// depends only on K, never on M, the tile a row falls into or the thread split (column blocks only), so a
// row's bits are the same alone or in any batch; they are this path's own (TDPBF16PS sums a chunk its own
// way), within fp32 rounding of the avx512 path's. A call of fewer than 16 rows has A and C tiles of M rows.
using ds_amx::amx_permission_errno;
using ds_amx::configure_tiles;
using ds_amx::release_tiles;

constexpr int kChunk = 32;            // k per tile step: an A tile row is 32 bf16, a B tile 16 k pairs
constexpr int kCLd = 2 * kCols;       // fp32 per row of the C scratch: two column blocks

// MI row tiles (A tiles 4, 5) x NJ column blocks (B tiles 6, 7) of C (tile i * NJ + j), summed over n chunks
// from zero; a0, a1: the row tiles' first rows at the first chunk (lda bytes between rows); b: the first block's
// converted pairs at that chunk (chunk ch at + 16 ch vectors, the next block at + bstride); stored fp32 to
// c [32][kCLd]
template <int MI, int NJ>
DS_AMX_TARGET void amx_block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const __m512bh* b, int64_t bstride,
                             int64_t n, float* c) {
  _tile_zero(0);
  if constexpr (MI * NJ >= 2) _tile_zero(1);
  if constexpr (MI * NJ >= 3) _tile_zero(2);
  if constexpr (MI * NJ >= 4) _tile_zero(3);
  for (int64_t ch = 0; ch < n; ++ch) {
    const __m512bh* bk = b + ch * 16;
    _tile_loadd(4, a0 + ch * kChunk, lda);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ == 2) {
      _tile_loadd(7, bk + bstride, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MI == 2) {  // the tile macros take literal register numbers
      _tile_loadd(5, a1 + ch * kChunk, lda);
      if constexpr (NJ == 1) {
        _tile_dpbf16ps(1, 5, 6);
      } else {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  constexpr int64_t ld = kCLd * 4;
  _tile_stored(0, c, ld);
  if constexpr (NJ == 2) _tile_stored(1, c + kCols, ld);
  if constexpr (MI == 2 && NJ == 1) _tile_stored(1, c + 16 * kCLd, ld);
  if constexpr (MI == 2 && NJ == 2) {
    _tile_stored(2, c + 16 * kCLd, ld);
    _tile_stored(3, c + 16 * kCLd + kCols, ld);
  }
}

using AmxBlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const __m512bh*, int64_t, int64_t, float*);
constexpr AmxBlockFn kAmxBlocks[2][2] = {{&amx_block<1, 1>, &amx_block<1, 2>}, {&amx_block<2, 1>, &amx_block<2, 2>}};
constexpr int64_t kPairsPerBlock = kBlock / 2;
constexpr int64_t kStreamRows = 8;  // up to this many rows a call converts one scale block at a time

// column blocks [t0, t1) for every row: one thread's share. pad: ds_amx::padded_last_rows (null up to 16 rows). A call of kStreamRows or fewer converts each pair of column
// blocks one scale block at a time (8 KB: it stays in L1 between the conversion and the tile loads); a larger one a
// panel of column blocks over all of K, which every row tile then reads.
DS_AMX_TARGET void columns_amx(const at::BFloat16* x, const at::BFloat16* pad, int64_t M, int64_t K, const uint8_t* wp,
                               int64_t ngroups, const float* sp, int64_t KB, at::BFloat16* y, int64_t N, int64_t t0,
                               int64_t t1, const Luts& luts) {
  const int64_t npairs = 2 * ngroups, chunks = K / kChunk, wstride = ngroups * 64, rtiles = (M + 15) / 16;
  const int64_t tail0 = chunks * (kChunk / 2);  // the first pair past the last whole chunk (in the last block)
  const bool stream = M <= kStreamRows;
  const int64_t panel = stream ? 2 : kScratchPanel;
  static thread_local std::vector<__m512bh> scratch;  // kept between calls, as the avx512 path's
  const size_t need = static_cast<size_t>(panel * (stream ? kPairsPerBlock : npairs));
  if (scratch.size() < need) scratch.resize(need);
  const auto* xb = reinterpret_cast<const uint16_t*>(x);
  auto rows_of = [&](int64_t r) {
    return r * 16 + 16 <= M || M < 16 ? xb + r * 16 * K : reinterpret_cast<const uint16_t*>(pad);
  };
  alignas(64) float c[32 * kCLd];
  alignas(64) float tot[32 * kCLd];
  if (chunks > 0) configure_tiles(static_cast<int>(std::min<int64_t>(M, 16)));
  for (int64_t p0 = t0; p0 < t1; p0 += panel) {
    const int64_t p1 = std::min(t1, p0 + panel);
    if (!stream) convert_range(wp, wstride, p0, p1, 0, ngroups, luts, scratch.data(), npairs);
    for (int64_t r = 0; r < rtiles; r += 2) {
      const int mi = static_cast<int>(std::min<int64_t>(2, rtiles - r));
      const int rows = static_cast<int>(std::min<int64_t>(32, M - r * 16));
      for (int64_t b = p0; b < p1; b += 2) {
        const int nj = static_cast<int>(std::min<int64_t>(2, p1 - b));
        for (int64_t kb = 0; kb < KB; ++kb) {
          // this block's pairs of column block b (the next at + bstride)
          const __m512bh* pb = scratch.data() + (b - p0) * npairs + kb * kPairsPerBlock;
          int64_t bstride = npairs;
          if (stream) {
            const int64_t g0 = kb * kGroupsPerBlock;
            convert_range(wp, wstride, b, b + nj, g0, std::min(ngroups, g0 + kGroupsPerBlock), luts, scratch.data(),
                          kPairsPerBlock);
            pb = scratch.data();
            bstride = kPairsPerBlock;
          }
          const int64_t c0 = std::min(chunks, kb * (kBlock / kChunk)), c1 = std::min(chunks, (kb + 1) * (kBlock / kChunk));
          if (c1 > c0)
            kAmxBlocks[mi - 1][nj - 1](rows_of(r) + c0 * kChunk, rows_of(r + mi - 1) + c0 * kChunk, K * 2, pb, bstride,
                                       c1 - c0, c);
          else
            std::memset(c, 0, sizeof c);
          const bool last = kb == KB - 1;
          for (int i = 0; i < rows; ++i) {
            const at::BFloat16* xr = x + (r * 16 + i) * K;
            for (int j = 0; j < nj; ++j) {
              __m512 acc = _mm512_load_ps(c + i * kCLd + j * kCols);
              if (last)
                for (int64_t p = tail0; p < npairs; ++p)
                  acc = _mm512_dpbf16_ps(acc, bcast(load_pair(xr, p, K)), pb[j * bstride + p - kb * kPairsPerBlock]);
              const __m512 term = _mm512_mul_ps(acc, _mm512_set1_ps(sp[(b + j) * KB + kb]));
              float* t = tot + i * kCLd + j * kCols;
              _mm512_store_ps(t, kb == 0 ? term : _mm512_add_ps(_mm512_load_ps(t), term));
            }
          }
        }
        for (int i = 0; i < rows; ++i)
          for (int j = 0; j < nj; ++j) {
            const int64_t left = N - (b + j) * kCols;
            const __mmask16 keep = left >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
            _mm256_mask_storeu_epi16(y + (r * 16 + i) * N + (b + j) * kCols, keep,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(tot + i * kCLd + j * kCols)));
          }
      }
    }
  }
  if (chunks > 0) release_tiles();
}
#endif  // DS_FP8_AMX

void block_scalar(const at::BFloat16* x, int64_t K, const uint8_t* w, int64_t ngroups, const float* s, int64_t KB,
                  at::BFloat16* y, int64_t ncols) {
  // one row, one column block: fp32 products, k ascending inside a block, blocks ascending
  const Tables& t = tables();
  static const std::array<int, 64> where = [] {  // offset of (k in group, column) in a group
    std::array<int, 64> a{};
    for (int kk = 0; kk < 4; ++kk)
      for (int c = 0; c < kCols; ++c) a[kk * kCols + c] = group_offset(kk / 2, 2 * c + (kk & 1));
    return a;
  }();
  float tot[kCols] = {0}, part[kCols];
  for (int64_t kb = 0; kb < KB; ++kb) {
    std::fill(part, part + kCols, 0.0f);
    const int64_t k1 = std::min(K, (kb + 1) * kBlock);
    for (int64_t k = kb * kBlock; k < k1; ++k) {
      const float xv = static_cast<float>(x[k]);
      const uint8_t* g = w + (k / kGroupK) * 64;
      const int* at = where.data() + (k % kGroupK) * kCols;
      for (int c = 0; c < kCols; ++c) part[c] = part[c] + xv * t.value[g[at[c]]];
    }
    const float sc = s[kb];
    for (int c = 0; c < kCols; ++c) {
      const float term = part[c] * sc;
      tot[c] = kb == 0 ? term : tot[c] + term;
    }
  }
  for (int c = 0; c < std::min<int64_t>(ncols, kCols); ++c) y[c] = at::BFloat16(tot[c]);
}

enum class Path { kAmx, kAvx512, kAvx2, kScalar };

Path parse_path(const std::string& name) {
  if (name.empty()) {
#if defined(DS_FP8_AVX512)
    return Path::kAvx512;
#elif defined(DS_FP8_AVX2)
    return Path::kAvx2;
#else
    return Path::kScalar;
#endif
  }
  if (name == "scalar") return Path::kScalar;
#if defined(DS_FP8_AMX)
  if (name == "amx") {
    TORCH_CHECK(amx_permission_errno() == 0, "linear_fp8: path amx cannot run in this process (no AMX, or the Linux "
                "kernel refused the tile data permission)");
    return Path::kAmx;
  }
#endif
#if defined(DS_FP8_AVX512)
  if (name == "avx512") return Path::kAvx512;
#endif
#if defined(DS_FP8_AVX2)
  if (name == "avx2") return Path::kAvx2;
#endif
  TORCH_CHECK(false, "linear_fp8: path ", name, " is not in this build (fp8_paths() lists them)");
  return Path::kScalar;
}

}  // namespace

std::vector<std::string> fp8_paths() {
  // the one linear_fp8 runs by default ("") first
  std::vector<std::string> p;
#if defined(DS_FP8_AVX512)
  p.push_back("avx512");
#endif
#if defined(DS_FP8_AMX)
  if (amx_permission_errno() == 0) p.push_back("amx");  // asked for by name (the engine's amx set)
#endif
#if defined(DS_FP8_AVX2)
  p.push_back("avx2");
#endif
  p.push_back("scalar");
  return p;
}

std::vector<torch::Tensor> pack_fp8_weight(const torch::Tensor& w, const torch::Tensor& row_scale) {
  // w [N, K] e4m3 codes (uint8 view); row_scale [N, ceil(K/128)] fp32 -> packed [ceil(N/16), ceil(K/4), 64] uint8
  // (zero past N and K) and scales [ceil(N/16), ceil(K/128)] fp32
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte, "pack_fp8_weight: w must be [N, K] uint8 (e4m3 codes)");
  const int64_t N = w.size(0), K = w.size(1), KB = (K + kBlock - 1) / kBlock;
  TORCH_CHECK(row_scale.dim() == 2 && row_scale.scalar_type() == at::kFloat && row_scale.size(0) == N &&
                  row_scale.size(1) == KB,
              "pack_fp8_weight: row_scale must be [", N, ", ", KB, "] fp32");
  const int64_t nblk = (N + kCols - 1) / kCols, ngroups = (K + kGroupK - 1) / kGroupK;
  auto wc = w.contiguous();
  auto rs = row_scale.contiguous();
  auto packed = torch::zeros({nblk, ngroups, 64}, w.options());
  auto scales = torch::empty({nblk, KB}, rs.options());
  const uint8_t* src = wc.data_ptr<uint8_t>();
  const float* rsp = rs.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t n0 = b * kCols, n1 = std::min(N, n0 + kCols);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const float s0 = rsp[n0 * KB + kb];
      for (int64_t n = n0 + 1; n < n1; ++n)
        TORCH_CHECK(std::memcmp(&rsp[n * KB + kb], &s0, 4) == 0, "pack_fp8_weight: rows ", n0, "..", n1 - 1,
                    " (one column block) have different scales in k block ", kb);
      sp[b * KB + kb] = s0;
    }
    for (int64_t n = n0; n < n1; ++n) {
      const int c = static_cast<int>(n - n0);
      for (int64_t k = 0; k < K; ++k) {
        // the loader refuses NaN weights; the avx2 path's conversion has no NaN
        TORCH_CHECK((src[n * K + k] & 0x7F) != 0x7F, "pack_fp8_weight: a NaN code at row ", n, ", column ", k);
        const int64_t g = k / kGroupK;
        const int kk = static_cast<int>(k % kGroupK);
        dst[(b * ngroups + g) * 64 + group_offset(kk / 2, 2 * c + (kk & 1))] = src[n * K + k];
      }
    }
  }
  return {packed, scales};
}

torch::Tensor linear_fp8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t N,
                         const std::string& path) {
  // x [M, K] bf16 -> [M, N] bf16 with the packed weight and scales of pack_fp8_weight; path "" = the best
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_fp8: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == 64,
              "linear_fp8: weight not packed by pack_fp8_weight");
  const int64_t M = x.size(0), K = x.size(1), nblk = packed.size(0), ngroups = packed.size(1);
  const int64_t KB = (K + kBlock - 1) / kBlock;
  TORCH_CHECK(ngroups == (K + kGroupK - 1) / kGroupK, "linear_fp8: x has ", K, " inputs, the weight ",
              kGroupK * ngroups, " (rounded up to ", kGroupK, ")");
  TORCH_CHECK((N + kCols - 1) / kCols == nblk, "linear_fp8: ", N, " outputs do not fit ", nblk, " column blocks");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == nblk && scales.size(1) == KB,
              "linear_fp8: scales must be [", nblk, ", ", KB, "] fp32");
  const Path which = parse_path(path);
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const at::BFloat16* xp = xc.data_ptr<at::BFloat16>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t wstride = ngroups * 64;
  // threads take pieces of the column blocks (kernels.h parallel_chunks), never of k; a small call (a small
  // model's decode) stays on the calling thread
  const bool serial = M * N * K < kSerialBelow;
  const int64_t chunk = ds::chunk_blocks(nblk, 8, kPanel, M <= 8);
#if defined(DS_FP8_AVX512)
  const Luts luts = make_luts();
#endif
#if defined(DS_FP8_AMX)
  if (which == Path::kAmx) {
    const at::Tensor pad = ds_amx::padded_last_rows(xc);
    const at::BFloat16* padp = pad.defined() ? pad.data_ptr<at::BFloat16>() : nullptr;
    ds::parallel_chunks(nblk, chunk, serial, [&](int64_t t0, int64_t t1) {
      columns_amx(xp, padp, M, K, wp, ngroups, sp, KB, yp, N, t0, t1, luts);
    });
    return y;
  }
#endif
#if defined(DS_FP8_AVX2)
  if (which == Path::kAvx2) {
    auto xf = xc.to(at::kFloat);  // [M, K] fp32: each x value widened once, not once per column block
    const float* xfp = xf.data_ptr<float>();
    ds::parallel_chunks(nblk, chunk, serial, [&](int64_t t0, int64_t t1) {
      const NoDaz keep_denormals;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAvx2) {
        const int mt = static_cast<int>(std::min<int64_t>(kRowsAvx2, M - m0));
        for (int64_t b = t0; b < t1; b += kAvx2NB[mt]) {
          const int nb = static_cast<int>(std::min<int64_t>(kAvx2NB[mt], t1 - b));
          kAvx2Tiles[mt - 1][nb - 1](xfp + m0 * K, K, wp + b * wstride, wstride, sp + b * KB, KB,
                                     yp + m0 * N + b * kCols, N, N - b * kCols);
        }
      }
    });
    return y;
  }
#endif
  ds::parallel_chunks(nblk, chunk, serial, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {
      const int64_t b1 = std::min(t1, b0 + kPanel);
      if (which == Path::kScalar) {
        for (int64_t m = 0; m < M; ++m)
          for (int64_t b = b0; b < b1; ++b)
            block_scalar(xp + m * K, K, wp + b * wstride, ngroups, sp + b * KB, KB, yp + m * N + b * kCols,
                         N - b * kCols);
        continue;
      }
#if defined(DS_FP8_AVX512)
      if (M >= kScratchFrom) {  // convert each small panel once, then every row tile reads bf16
        const int64_t npairs = 2 * ngroups;
        // one buffer per thread, kept between calls: a fresh allocation of this size is an mmap, and its page
        // faults would cost more than the conversion
        static thread_local std::vector<__m512bh> scratch;
        const size_t need = static_cast<size_t>(kScratchPanel * npairs);
        if (scratch.size() < need) scratch.resize(need);
        for (int64_t c0 = b0; c0 < b1; c0 += kScratchPanel) {
          const int64_t c1 = std::min(b1, c0 + kScratchPanel);
          convert_range(wp, wstride, c0, c1, 0, ngroups, luts, scratch.data(), npairs);
          for (int64_t m0 = 0; m0 < M; m0 += 8) {
            const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
            for (int64_t b = c0; b < c1; b += kScratchNB[mt]) {
              const int nb = static_cast<int>(std::min<int64_t>(kScratchNB[mt], c1 - b));
              kScratchTiles[mt - 1][nb - 1](xp + m0 * K, K, scratch.data() + (b - c0) * npairs, npairs, sp + b * KB,
                                            KB, yp + m0 * N + b * kCols, N, N - b * kCols);
            }
          }
        }
        continue;
      }
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        for (int64_t b = b0; b < b1; b += kNB[mt]) {
          const int nb = static_cast<int>(std::min<int64_t>(kNB[mt], b1 - b));
          kTiles[mt - 1][nb - 1](xp + m0 * K, K, wp + b * wstride, ngroups, sp + b * KB, KB, yp + m0 * N + b * kCols,
                                 N, N - b * kCols, luts);
        }
      }
#endif
    }
  });
  return y;
}

// linear_int4.cpp, built into this extension
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales, int64_t N,
                          const std::string& path);
void register_int4(pybind11::module& m);

namespace {
// the decode program's quantized projection: an int4 part names an "int4" path (ops/int4.py), any other is fp8
at::Tensor linear_quantized(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t N,
                            const std::string& path) {
  if (path.rfind("int4", 0) == 0) return linear_int4(x, packed, scales, N, path);
  return linear_fp8(x, packed, scales, N, path);
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp8_paths", &fp8_paths, "the compiled paths of linear_fp8, best first");
  m.def("pack_fp8_weight", &pack_fp8_weight, "pack an e4m3 [N, K] weight and its row scales for linear_fp8");
  m.def("linear_fp8", &linear_fp8, "y = x @ dequant(w)^T, bf16 x, packed fp8 weight", py::arg("x"),
        py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("path") = "");
  // the decode kernels' whole-model call (decode_layers.cpp) runs fp8 projections through this pointer
  m.def("linear_fp8_capsule", [] {
    const Fp8Linear f = &linear_quantized;
    return py::capsule(reinterpret_cast<void*>(f), kFp8LinearCapsule);
  }, "linear_fp8 and linear_int4 (an \"int4\" path) as one C function pointer (a PyCapsule) for DecodeModel");
  register_int4(m);
}
