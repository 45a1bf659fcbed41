// bf16 linear layers for every row count, loaded with decode_kernels.cpp (one extension per instruction set,
// cpu_kernels.py).
//
// y [M, N] = x [M, K] @ w [N, K]^T, bf16 in and out, fp32 accumulation. The weight is packed once
// (pack_bf16_weight) into [ceil(N/16), K/2, 16, 2]: for each block of 16 output columns and each pair of k, one
// 64-byte vector. A register tile holds MT rows x NB column blocks of fp32 accumulators; each k pair loads NB
// weight vectors and broadcasts each row's (x[2p], x[2p+1]). Three builds of this file, one per instruction set:
// - avx512bf16: one vdpbf16ps per (row, column block, k pair);
// - avx512: the weight vector widened to fp32 in registers (mask and shift), two fmas;
// - avx2 (+ FMA): the same on 32-byte halves, four rows per tile.
//
// Bits: every output y[m, n] is the fp32 sum over k pairs in ascending order, in its own accumulator, rounded
// once to bf16 (round to nearest even). Neither the row count, the tile a row falls into, nor the thread
// split (columns only) changes that order, so a row's result is the same alone or in any batch, in a
// prefill or a decode step. The widened paths add each pair as vdpbf16ps is specified to (odd product, then
// even; bf16 products are exact in fp32), so on normal numbers every path gives the same bits (vdpbf16ps
// also flushes denormals; tests/test_linear.py compares the paths).
//
// Speed (2 Xeon cores, AVX512-BF16, no AMX): at the vdpbf16ps peak (~175 GFLOP/s) for large M, like oneDNN;
// at decode sizes it streams weights at the memory bandwidth where oneDNN's prepacked path reaches ~2/3 of it
// (docs/benchmarks.md); the widened paths do twice the arithmetic per weight, which decode sizes hide.

#include "aten_lite.h"
#include "kernels.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#if defined(__AVX512BF16__) || defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define DS_LINEAR 1
#include <immintrin.h>

namespace {

constexpr int kCols = 16;        // output columns per packed column block (one 64-byte vector per k pair)
constexpr int64_t kPanel = 24;   // column blocks per panel: a panel's weights stay in L2 across the row tiles
constexpr int64_t kAhead = 8;    // k pairs prefetched ahead, per column block, in one-row tiles (avx512bf16: with
                                 // more rows the hardware prefetcher alone streams faster: on Zen 4 a verify step's
                                 // 4-row linears were slower with both than its 1-row ones, and are not without)
constexpr int64_t kKeptWide = int64_t(1) << 16;  // floats of widened x kept between calls (256 KB)

inline float bits_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// the widened paths' x: [M, K] bf16 as pairs -> [M, K / 2, 2] fp32, (odd, even) of each pair, exact; once per call,
// so that a tile's broadcast is a load rather than two moves through a general register, which on the avx512
// set took port 5 from the fmas (docs/benchmarks.md, "widened x")
[[maybe_unused]] void widen_pairs(const uint32_t* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[2 * i] = bits_f(x[i] & 0xffff0000u);
    out[2 * i + 1] = bits_f(x[i] << 16);
  }
}

#if defined(__AVX512BF16__)
constexpr const char* kIsa = "avx512bf16";
constexpr int kRows = 8;  // rows per register tile
// column blocks per tile for MT rows: MT*NB accumulators + NB weight vectors + 1 broadcast <= 32 registers
constexpr int kNB[9] = {0, 8, 8, 6, 5, 4, 4, 3, 3};

template <int MT, int NB>
void tile(const uint32_t* __restrict x, int64_t kp_n, const uint16_t* __restrict wb, at::BFloat16* __restrict y,
          int64_t ys, int64_t ncols) {
  // x: MT rows of kp_n bf16 pairs (row stride kp_n); wb: NB column blocks of kp_n vectors each
  const __m512bh* w = reinterpret_cast<const __m512bh*>(wb);
  __m512 acc[MT][NB];
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp_n; ++p) {
    __m512bh wv[NB];
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      wv[j] = w[j * kp_n + p];
      if (MT == 1) _mm_prefetch(reinterpret_cast<const char*>(w + j * kp_n + p + kAhead), _MM_HINT_T0);
    }
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i) {
      __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * kp_n + p]));
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
    }
  }
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      __mmask16 keep = left >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      _mm256_mask_storeu_epi16(y + i * ys + j * kCols, keep, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    }
}

#elif defined(__AVX512F__)
// AVX-512 without BF16: each 64-byte weight vector (16 columns x one k pair) is widened to fp32 in registers,
// the odd element by masking and the even one by a shift, and each pair is added as vdpbf16ps adds it: the
// odd product first, then the even one (bf16 x bf16 products are exact in fp32, so each step is one rounding)
#define DS_WIDE_X 1  // x comes widened (widen_pairs)
constexpr const char* kIsa = "avx512";
constexpr int kRows = 8;
// MT*NB accumulators + 2*NB widened weights + 2 broadcasts <= 32 registers
constexpr int kNB[9] = {0, 8, 6, 5, 4, 4, 3, 3, 3};

// x: the rows' pairs widened by widen_pairs (row stride 2 kp_n floats), as 32-bit words
template <int MT, int NB>
void tile(const uint32_t* __restrict x, int64_t kp_n, const uint16_t* __restrict wb, at::BFloat16* __restrict y,
          int64_t ys, int64_t ncols) {
  const float* xf = reinterpret_cast<const float*>(x);
  const __m512i* w = reinterpret_cast<const __m512i*>(wb);
  const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
  __m512 acc[MT][NB];
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp_n; ++p) {
    __m512 wo[NB], we[NB];
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      const __m512i v = _mm512_loadu_si512(w + j * kp_n + p);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * kp_n + p + kAhead), _MM_HINT_T0);
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i) {
      const float* xi = xf + 2 * (i * kp_n + p);
      const __m512 xo = _mm512_set1_ps(xi[0]), xe = _mm512_set1_ps(xi[1]);  // broadcasts from memory
#pragma GCC unroll 64
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xe, we[j], _mm512_fmadd_ps(xo, wo[j], acc[i][j]));
    }
  }
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      alignas(64) float buf[kCols];
      _mm512_store_ps(buf, acc[i][j]);
      for (int c = 0; c < std::min<int64_t>(left, kCols); ++c) y[i * ys + j * kCols + c] = at::BFloat16(buf[c]);
    }
}

#else
// AVX2 + FMA: a column block is two 32-byte halves (8 columns x one k pair each), widened like the AVX-512
// path and added in the same order (odd product, then even), 16 ymm registers; x comes widened (widen_pairs)
#define DS_WIDE_X 1
constexpr const char* kIsa = "avx2";
constexpr int kRows = 4;
// MT*2*NB accumulators + 4*NB widened weights + 2 broadcasts <= 16 registers
constexpr int kNB[5] = {0, 2, 1, 1, 1};

// x: the rows' pairs widened by widen_pairs (row stride 2 kp_n floats), as 32-bit words
template <int MT, int NB>
void tile(const uint32_t* __restrict x, int64_t kp_n, const uint16_t* __restrict wb, at::BFloat16* __restrict y,
          int64_t ys, int64_t ncols) {
  const float* xf = reinterpret_cast<const float*>(x);
  const __m256i* w = reinterpret_cast<const __m256i*>(wb);  // block j, pair p: halves w[2 (j kp_n + p) + 0/1]
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  constexpr int NH = 2 * NB;
  __m256 acc[MT][NH];
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int h = 0; h < NH; ++h) acc[i][h] = _mm256_setzero_ps();
  for (int64_t p = 0; p < kp_n; ++p) {
    __m256 wo[NH], we[NH];
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      const __m256i* blk = w + 2 * (j * kp_n + p);
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * kAhead), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int s = 0; s < 2; ++s) {
        const __m256i v = _mm256_loadu_si256(blk + s);
        wo[2 * j + s] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        we[2 * j + s] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      }
    }
#pragma GCC unroll 64
    for (int i = 0; i < MT; ++i) {
      const float* xi = xf + 2 * (i * kp_n + p);
      const __m256 xo = _mm256_broadcast_ss(xi), xe = _mm256_broadcast_ss(xi + 1);
#pragma GCC unroll 64
      for (int h = 0; h < NH; ++h) acc[i][h] = _mm256_fmadd_ps(xe, we[h], _mm256_fmadd_ps(xo, wo[h], acc[i][h]));
    }
  }
#pragma GCC unroll 64
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 64
    for (int j = 0; j < NB; ++j) {
      int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      alignas(32) float buf[kCols];
      _mm256_store_ps(buf, acc[i][2 * j]);
      _mm256_store_ps(buf + 8, acc[i][2 * j + 1]);
      for (int c = 0; c < std::min<int64_t>(left, kCols); ++c) y[i * ys + j * kCols + c] = at::BFloat16(buf[c]);
    }
}
#endif

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, at::BFloat16*, int64_t, int64_t);
constexpr int kMaxNB = kNB[1];

template <int MT, int... NB>
constexpr std::array<TileFn, sizeof...(NB)> tile_row(std::integer_sequence<int, NB...>) {
  return {&tile<MT, NB + 1>...};
}
template <int... MT>
constexpr std::array<std::array<TileFn, kMaxNB>, sizeof...(MT)> tile_table(std::integer_sequence<int, MT...>) {
  return {tile_row<MT + 1>(std::make_integer_sequence<int, kMaxNB>{})...};
}
// kTiles[MT - 1][NB - 1]
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, kRows>{});

}  // namespace
#endif

bool bf16_linear_available() {
#if defined(DS_LINEAR)
  return true;
#else
  return false;
#endif
}

// the instruction set this translation unit was compiled for (cpu_kernels.py checks it against its request)
std::string kernel_isa() {
#if defined(DS_LINEAR)
  return kIsa;
#else
  return "none";
#endif
}

at::Tensor pack_bf16_weight(const at::Tensor& w) {
  // [N, K] bf16 -> [ceil(N/16), K/2, 16, 2], rows past N zero
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_weight: a 2-D bf16 weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16_weight: the input dim must be even, not ", w.size(1));
  // one pass, in parallel over column blocks: each (row, k pair) is 4 bytes moved to its place, the rows past N
  // zero (ATen's zeros + copy + transposed contiguous took three passes, single-threaded in the strided one)
  const at::Tensor src = w.contiguous();
  const int64_t N = src.size(0), K = src.size(1), nblk = (N + 15) / 16, P = K / 2;
  auto out = at::empty({nblk, P, 16, 2}, src.options());
  const char* in = reinterpret_cast<const char*>(src.data_ptr<at::BFloat16>());
  char* o = reinterpret_cast<char*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      char* blk = o + b * P * 16 * 4;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t n = b * 16 + c;
        if (n >= N) {
          for (int64_t p = 0; p < P; ++p) std::memset(blk + (p * 16 + c) * 4, 0, 4);
          continue;
        }
        const char* row = in + n * K * 2;
        for (int64_t p = 0; p < P; ++p) std::memcpy(blk + (p * 16 + c) * 4, row + p * 4, 4);
      }
    }
  });
  return out;
}

void check_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  // x [M, K] bf16 against a weight of N outputs packed by pack_bf16_weight (every set's linear_bf16 checks it)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "linear_bf16: weight not packed by pack_bf16_weight");
  const int64_t K = x.size(1), nblk = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) == K / 2, "linear_bf16: x has ", K, " inputs, the weight ",
              2 * packed.size(1));
  TORCH_CHECK((N + 15) / 16 == nblk, "linear_bf16: ", N, " outputs do not fit ", nblk, " column blocks");
}

void linear_bf16_into(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::Tensor& y) {
  // y [M, N] = x [M, K] @ the packed weight^T, written into y: bf16 with a contiguous last dim and any row stride
  // (the decode program writes a projection's parts into their columns of one buffer)
#if defined(DS_LINEAR)
  check_packed_linear(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1), kp_n = K / 2, nblk = packed.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.stride(1) == 1 &&
                  y.scalar_type() == at::kBFloat16, "linear_bf16: out must be bf16 [", M, ", ", N,
              "] with a contiguous last dim");
  if (M == 0 || N == 0) return;
  auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
#if defined(DS_WIDE_X)
  // [M, K / 2, 2] fp32 (widen_pairs): a decode-sized one kept per thread (a decode step makes ~40 calls), a
  // prefill-sized one (up to tens of MB) freed with the call
  thread_local ds::LineBuffer kept;
  ds::LineBuffer big;
  ds::LineBuffer& wide = M * K <= kKeptWide ? kept : big;
  wide.ensure(M * K);
  widen_pairs(xp, M * kp_n, wide.data());
  xp = reinterpret_cast<const uint32_t*>(wide.data());
  const int64_t xrow = 2 * kp_n;  // 32-bit words per row of x as the tiles read it
#else
  const int64_t xrow = kp_n;
#endif
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t ys = y.stride(0);
  // threads take pieces of the column blocks, never of k: a column's sum order is the same for any thread count
  // and split; a call of fewer than kSerialBelow multiply-adds stays on the calling thread (kernels.h)
  const int64_t chunk = ds::chunk_blocks(nblk, kNB[std::min<int64_t>(M, kRows)], kPanel, M <= kRows);
  ds::parallel_chunks(nblk, chunk, M * N * K < kSerialBelow, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {
      const int64_t b1 = std::min(t1, b0 + kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int mt = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        for (int64_t b = b0; b < b1; b += kNB[mt]) {
          const int nb = static_cast<int>(std::min<int64_t>(kNB[mt], b1 - b));
          kTiles[mt - 1][nb - 1](xp + m0 * xrow, kp_n, wp + b * kp_n * 2 * kCols, yp + m0 * ys + b * kCols, ys,
                                 N - b * kCols);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "linear_bf16: built without AVX2 + FMA or AVX-512");
#endif
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  // x [M, K] bf16 -> [M, N] bf16 with the packed weight of pack_bf16_weight
  TORCH_CHECK(x.dim() == 2, "linear_bf16: x must be [M, K] bf16");
  auto y = at::empty({x.size(0), N}, x.options());
  linear_bf16_into(x, packed, N, y);
  return y;
}
