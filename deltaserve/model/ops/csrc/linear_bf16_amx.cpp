// The bf16 linear on Intel AMX tiles (TDPBF16PS), for every row count: the `amx` instruction set of
// cpu_kernels.py, which is the avx512bf16 build plus this entry point (linear_bf16_amx). Only that build
// compiles it (__AVX512BF16__); the AMX instructions are confined to the functions marked DS_AMX_TARGET, so
// the rest of the build still runs on a CPU without AMX, and these are called only after cpu_kernels.py
// checked the CPU's flags and the kernel's permission (amx_linear_status).
//
// y [M, N] = x [M, K] @ w [N, K]^T with the weight packed by pack_bf16_weight ([ceil(N/16), K/2, 16, 2]):
// 16 consecutive k-pair vectors of one column block are one B tile (16 rows x 64 bytes, contiguous 1 KB); an A
// tile is 16 rows x 32 bf16 of x, read in place (row stride K * 2 bytes), except the last M % 16 rows of a call
// of more than 16, read from a copy padded with zero rows. A call of fewer than 16 rows (a decode step) has
// A and C tiles of M rows instead, read in place: a product then costs its rows, not 16 (`bench linear`: 1.25x and
// 1.6x the vdpbf16ps linear at 4 and 8 rows on tiny). One tile configuration serves the whole call. A block of
// C tiles (2 row tiles x 2 column blocks, or 1 row tile x up
// to 5 blocks where 16 rows or fewer are left, as in a decode step) keeps its fp32 sums in tile registers over
// the K / 32 chunks, is stored to a scratch buffer, gets the K % 32 tail and is rounded. Threads split the
// column blocks; a panel of them is reused from L2 by every row tile. On this 2-core Xeon (model 207) it runs
// at about oneDNN's AMX speed from 16 rows on (~1 TFLOP/s a core at 512 rows) and streams the weights at one
// row at ~0.9x the vdpbf16ps path's speed (docs/cpu.md).
//
// Bits: TDPBF16PS's sum within one 32-wide k chunk is the hardware's own (not vdpbf16ps's sequential pairs:
// its bits differ from the avx512bf16 path in the last place), but each output's value depends only on its
// row of x, its column of w and the fp32 sum so far. Every output is summed the same way: chunk 0, 1, ...,
// K/32 - 1 on tiles, then the K % 32 tail as vdpbf16ps pairs in ascending order, then one rounding to bf16
// (round to nearest even). That order depends only on K: never on M, the tile a row falls into, the padding
// rows beside it or the thread split (column blocks only), so a row's result is the same alone or in any
// batch, in a prefill or a decode step. Which is why the amx set runs AMX at every row count, one row too:
// a decode step through vdpbf16ps would give other bits than the prefill of the same token.

#include "aten_lite.h"
#include "kernels.h"
#include <ATen/Parallel.h>

#include "amx.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(DS_AMX)
namespace {

constexpr int kCols = 16;           // output columns per packed column block
constexpr int kChunk = 32;          // k per tile step: an A tile row is 32 bf16, a B tile 16 k pairs
constexpr int kTileElems = 16 * kChunk;  // bf16 per A or B tile (1 KB)
constexpr int kLdc = 80;            // fp32 per scratch row: up to 5 column blocks
constexpr int64_t kPanelBytes = int64_t(1) << 20;   // a panel's weights stay in L2 across the row tiles

using ds_amx::amx_permission_errno;
using ds_amx::configure_tiles;
using ds_amx::release_tiles;

// Two row tiles x NJ <= 2 column blocks of C (C tile i * NJ + j; A tiles 4 and 5; B tiles 6 and 7), summed
// over `chunks` k chunks and stored fp32 to c [32, kLdc]. a0, a1: the first row of each row tile, lda bytes
// between rows, chunk ch at + ch * kChunk; b: the first column block's packed vectors (chunk ch at
// + ch * kTileElems; the next block at + b_next). 2x2: four products per four tile loads.
template <int NJ>
DS_AMX_TARGET void tile_pair(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b, int64_t b_next,
                             int64_t chunks, float* c) {
  static_assert(NJ == 1 || NJ == 2, "8 tile registers");
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NJ == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint16_t* bk = b + ch * kTileElems;
    _tile_loadd(4, a0 + ch * kChunk, lda);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1 + ch * kChunk, lda);
    if constexpr (NJ == 1) {
      _tile_dpbf16ps(1, 5, 6);
    } else {
      _tile_loadd(7, bk + b_next, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ld = kLdc * 4;  // bytes per scratch row
  _tile_stored(0, c, ld);
  if constexpr (NJ == 1) {
    _tile_stored(1, c + 16 * kLdc, ld);
  } else {
    _tile_stored(1, c + 16, ld);
    _tile_stored(2, c + 16 * kLdc, ld);
    _tile_stored(3, c + 16 * kLdc + 16, ld);
  }
}

// One row tile x NJ <= 5 column blocks (what a decode step runs): C tiles 0, 1, 2, 3, 5; A tile 4; the B tiles
// alternate 6 and 7 (a load into one waits only for the product that read it two steps before). With few rows
// the weights stream from memory once: five streams, and the next chunk's lines asked for ahead of its tile
// loads (with the row read at stride 0: ~0.9x the vdpbf16ps path's speed at one row on two threads, ~0.96x on
// one, where 1x3 blocks without prefetch from a padded copy ran at ~0.8x).
template <int NJ>
DS_AMX_TARGET void tile_row(const uint16_t* a0, const uint16_t*, int64_t lda, const uint16_t* b, int64_t b_next,
                            int64_t chunks, float* c) {
  static_assert(NJ >= 1 && NJ <= 5, "5 C tiles");
  _tile_zero(0);
  if constexpr (NJ >= 2) _tile_zero(1);
  if constexpr (NJ >= 3) _tile_zero(2);
  if constexpr (NJ >= 4) _tile_zero(3);
  if constexpr (NJ >= 5) _tile_zero(5);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const uint16_t* bk = b + ch * kTileElems;
    if (ch + 1 < chunks) {
      const char* next = reinterpret_cast<const char*>(bk + kTileElems);
#pragma GCC unroll 5
      for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 16
        for (int l = 0; l < 16; ++l) _mm_prefetch(next + j * b_next * 2 + l * 64, _MM_HINT_T0);
    }
    _tile_loadd(4, a0 + ch * kChunk, lda);
    _tile_loadd(6, bk, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NJ >= 2) {
      _tile_loadd(7, bk + b_next, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NJ >= 3) {
      _tile_loadd(6, bk + 2 * b_next, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NJ >= 4) {
      _tile_loadd(7, bk + 3 * b_next, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
    if constexpr (NJ >= 5) {
      _tile_loadd(6, bk + 4 * b_next, 64);
      _tile_dpbf16ps(5, 4, 6);
    }
  }
  constexpr int64_t ld = kLdc * 4;
  _tile_stored(0, c, ld);
  if constexpr (NJ >= 2) _tile_stored(1, c + 16, ld);
  if constexpr (NJ >= 3) _tile_stored(2, c + 32, ld);
  if constexpr (NJ >= 4) _tile_stored(3, c + 48, ld);
  if constexpr (NJ >= 5) _tile_stored(5, c + 64, ld);
}

using BlockFn = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*);
// kBlocks[MI - 1][NJ - 1]: 1x1 .. 1x5 rows, 2x1 and 2x2 blocks (2x3 does not fit the 8 tile registers)
constexpr BlockFn kBlocks[2][5] = {{&tile_row<1>, &tile_row<2>, &tile_row<3>, &tile_row<4>, &tile_row<5>},
                                   {&tile_pair<1>, &tile_pair<2>, nullptr, nullptr, nullptr}};
constexpr int kMaxNJ[3] = {0, 5, 2};

// The K tail (the last K % 32 inputs, tail_pairs pairs from pair p0) added to the stored sums in ascending pair
// order with vdpbf16ps, then each output rounded to bf16. c: rows x (nj column blocks) fp32 at stride kLdc;
// x: the rows' inputs as bf16 pairs (row stride kp_n); w: the first column block (next at + b_next vectors).
void finish(const float* c, int rows, int nj, const uint32_t* x, int64_t kp_n, int64_t p0, int64_t tail_pairs,
            const uint16_t* w, int64_t b_next, at::BFloat16* y, int64_t ys, int64_t ncols) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nj; ++j) {
      const int64_t left = ncols - int64_t(j) * kCols;
      if (left <= 0) break;
      __m512 acc = _mm512_load_ps(c + r * kLdc + j * kCols);
      const __m512bh* wv = reinterpret_cast<const __m512bh*>(w + j * b_next) + p0;
      for (int64_t p = 0; p < tail_pairs; ++p)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * kp_n + p0 + p])), wv[p]);
      const __mmask16 keep = left >= kCols ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      _mm256_mask_storeu_epi16(y + r * ys + j * kCols, keep, (__m256i)_mm512_cvtneps_pbh(acc));
    }
}

// column blocks [t0, t1) for every row: one thread's share.
// x: [M, K] bf16; pad: ds_amx::padded_last_rows (null up to 16 rows)
DS_AMX_TARGET void columns(const uint16_t* x, const uint16_t* pad, const uint16_t* wp, at::BFloat16* yp, int64_t M,
                           int64_t N, int64_t kp_n, int64_t chunks, int64_t t0, int64_t t1) {
  const int64_t rtiles = (M + 15) / 16, K = 2 * kp_n, b_next = kp_n * 2 * kCols;
  const auto* xp = reinterpret_cast<const uint32_t*>(x);
  // fewer than 16 rows: one row tile of M rows, read in place (configure_tiles)
  auto rows_of = [&](int64_t r) { return r * 16 + 16 <= M || M < 16 ? x + r * 16 * K : pad; };
  const int64_t tail_p0 = chunks * (kChunk / 2), tail_pairs = kp_n - tail_p0;
  // a panel of column blocks (a multiple of 10, for the 2x2 and 1x5 blocks) is reused by every row tile from L2
  const int64_t panel = std::max<int64_t>(10, kPanelBytes / (b_next * 2) / 10 * 10);
  alignas(64) float c[32 * kLdc];
  if (chunks > 0) configure_tiles(static_cast<int>(std::min<int64_t>(M, 16)));
  for (int64_t b0 = t0; b0 < t1; b0 += panel) {
    const int64_t b1 = std::min(t1, b0 + panel);
    for (int64_t r = 0; r < rtiles; r += 2) {
      const int mi = static_cast<int>(std::min<int64_t>(2, rtiles - r));
      const int rows = static_cast<int>(std::min<int64_t>(32, M - r * 16));
      for (int64_t b = b0; b < b1;) {
        const int nj = static_cast<int>(std::min<int64_t>(kMaxNJ[mi], b1 - b));
        const uint16_t* wb = wp + b * b_next;
        if (chunks > 0)
          kBlocks[mi - 1][nj - 1](rows_of(r), rows_of(r + mi - 1), K * 2, wb, b_next, chunks, c);
        else
          std::memset(c, 0, sizeof c);
        finish(c, rows, nj, xp + r * 16 * kp_n, kp_n, tail_p0, tail_pairs, wb, b_next, yp + r * 16 * N + b * kCols,
               N, N - b * kCols);
        b += nj;
      }
    }
  }
  if (chunks > 0) release_tiles();
}

}  // namespace
#endif

// "" when linear_bf16_amx can run in this process, else why not (cpu_kernels.py asks before choosing amx)
std::string amx_linear_status() {
#if defined(DS_AMX)
  const int err = amx_permission_errno();
  if (err != 0)
    return std::string("the Linux kernel refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
           std::strerror(err) + ")";
  return "";
#else
  return "this build has no AMX linear (only the avx512bf16 build holds it)";
#endif
}

at::Tensor linear_bf16_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  // x [M, K] bf16 -> [M, N] bf16 with the packed weight of pack_bf16_weight
#if defined(DS_AMX)
  check_packed_linear(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1), kp_n = K / 2, nblk = packed.size(0);
  const std::string why = amx_linear_status();
  TORCH_CHECK(why.empty(), "linear_bf16_amx: ", why);
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t chunks = K / kChunk;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // as linear_bf16: threads take pieces of the column blocks, never of k, and a small call stays on the calling thread
  const bool serial = M * N * K < kSerialBelow;
  const at::Tensor pad = chunks > 0 ? ds_amx::padded_last_rows(xc) : at::Tensor();
  const auto* padp = pad.defined() ? reinterpret_cast<const uint16_t*>(pad.data_ptr()) : nullptr;
  ds::parallel_chunks(nblk, ds::chunk_blocks(nblk, 10, 40, M <= 16), serial,
                      [&](int64_t t0, int64_t t1) { columns(xp, padp, wp, yp, M, N, kp_n, chunks, t0, t1); });
  return y;
#else
  TORCH_CHECK(false, "linear_bf16_amx: ", amx_linear_status());
  return x;
#endif
}
