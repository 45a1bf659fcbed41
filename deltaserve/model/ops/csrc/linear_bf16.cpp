// bf16 linear layers for every row count, loaded with decode_kernels.cpp (one extension, cpu_kernels.py).
//
// y [M, N] = x [M, K] @ w [N, K]^T, bf16 in and out, fp32 accumulation with AVX512-BF16 (vdpbf16ps).
// The weight is packed once (pack_bf16_weight) into [ceil(N/16), K/2, 16, 2]: for each block of 16 output
// columns and each pair of k, one 64-byte vector. A register tile holds MT rows x NB column blocks of fp32
// accumulators; each k pair loads NB weight vectors, broadcasts each row's (x[2p], x[2p+1]) and issues MT*NB
// dot-product instructions.
//
// Bits: every output y[m, n] is the fp32 sum over k pairs in ascending order, in its own accumulator, rounded
// once to bf16 (round to nearest even). Neither the row count, the tile a row falls into, nor the thread
// split (columns only) changes that order, so a row's result is the same alone or in any batch, in a
// prefill or a decode step.
//
// Speed (2 Xeon cores, AVX512-BF16, no AMX): at the vdpbf16ps peak (~175 GFLOP/s) for large M, like oneDNN;
// at decode sizes it streams weights at the memory bandwidth where oneDNN's prepacked path reaches ~2/3 of it
// (docs/benchmarks.md).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kCols = 16;        // output columns per accumulator vector
constexpr int64_t kPanel = 24;   // column blocks per panel: a panel's weights stay in L2 across the row tiles
constexpr int64_t kSerialBelow = int64_t(1) << 20;  // multiply-adds a thread takes on at least
constexpr int64_t kAhead = 8;    // weight vectors prefetched ahead along k, per column block

template <int MT, int NB>
void tile(const uint32_t* __restrict x, int64_t kp_n, const __m512bh* __restrict w, at::BFloat16* __restrict y,
          int64_t ys, int64_t ncols) {
  // x: MT rows of kp_n bf16 pairs (row stride kp_n); w: NB column blocks of kp_n vectors each
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
      _mm_prefetch(reinterpret_cast<const char*>(w + j * kp_n + p + kAhead), _MM_HINT_T0);
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

using TileFn = void (*)(const uint32_t*, int64_t, const __m512bh*, at::BFloat16*, int64_t, int64_t);
// column blocks per tile for MT rows: MT*NB accumulators + NB weight vectors + 1 broadcast <= 32 registers
constexpr int kNB[9] = {0, 8, 8, 6, 5, 4, 4, 3, 3};

template <int MT, int... NB>
constexpr std::array<TileFn, sizeof...(NB)> tile_row(std::integer_sequence<int, NB...>) {
  return {&tile<MT, NB + 1>...};
}
template <int... MT>
constexpr std::array<std::array<TileFn, 8>, sizeof...(MT)> tile_table(std::integer_sequence<int, MT...>) {
  return {tile_row<MT + 1>(std::make_integer_sequence<int, 8>{})...};
}
// kTiles[MT - 1][NB - 1]
constexpr auto kTiles = tile_table(std::make_integer_sequence<int, 8>{});

}  // namespace
#endif

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_bf16_weight(const torch::Tensor& w) {
  // [N, K] bf16 -> [ceil(N/16), K/2, 16, 2], rows past N zero
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_bf16_weight: a 2-D bf16 weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "pack_bf16_weight: the input dim must be even, not ", w.size(1));
  const int64_t N = w.size(0), K = w.size(1), nblk = (N + 15) / 16;
  auto padded = torch::zeros({nblk * 16, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({nblk, 16, K / 2, 2}).transpose(1, 2).contiguous();
}

torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  // x [M, K] bf16 -> [M, N] bf16 with the packed weight of pack_bf16_weight
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 2,
              "linear_bf16: weight not packed by pack_bf16_weight");
  const int64_t M = x.size(0), K = x.size(1), kp_n = K / 2, nblk = packed.size(0);
  TORCH_CHECK(K % 2 == 0 && packed.size(1) == kp_n, "linear_bf16: x has ", K, " inputs, the weight ",
              2 * packed.size(1));
  TORCH_CHECK((N + 15) / 16 == nblk, "linear_bf16: ", N, " outputs do not fit ", nblk, " column blocks");
  auto xc = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const __m512bh*>(packed.data_ptr());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // threads split the column blocks, never k: a column's sum order is the same for any thread count. A chunk
  // covers at least ~1M multiply-adds (kSerialBelow): a small call (a small model's decode) runs on the calling
  // thread, because waking the other threads costs more than the work, and far more on a loaded host, where the
  // parallel region waits for every thread to be scheduled (a tiny decode step took 277 ms instead of ~3 ms)
  const int64_t grain = std::max<int64_t>(1, kSerialBelow / std::max<int64_t>(1, 16 * K * M));
  at::parallel_for(0, nblk, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t b0 = t0; b0 < t1; b0 += kPanel) {
      const int64_t b1 = std::min(t1, b0 + kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int mt = static_cast<int>(std::min<int64_t>(8, M - m0));
        for (int64_t b = b0; b < b1; b += kNB[mt]) {
          const int nb = static_cast<int>(std::min<int64_t>(kNB[mt], b1 - b));
          kTiles[mt - 1][nb - 1](xp + m0 * kp_n, kp_n, wp + b * kp_n, yp + m0 * N + b * kCols, N, N - b * kCols);
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16: built without AVX512-BF16");
  return x;
#endif
}
