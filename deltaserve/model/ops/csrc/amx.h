// Intel AMX tiles for the bf16 linear (linear_bf16_amx.cpp) and the fp8 linear's amx path (linear_fp8.cpp): the
// process's permission to use the tile data registers and the tile configuration. Only an AVX512-BF16 build
// defines DS_AMX; the AMX instructions stay in functions marked DS_AMX_TARGET, run only after
// amx_permission_errno() said 0 (the request fails on a CPU without AMX as well).
#pragma once

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
#define DS_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "aten_lite.h"

#define DS_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace ds_amx {

constexpr long kReqXcompPerm = 0x1023;  // arch_prctl ARCH_REQ_XCOMP_PERM
constexpr long kXtileData = 18;         // XFEATURE_XTILEDATA

// 0 when the kernel lets this process use the tile data registers, else the errno of the request; asked once
// per process (the permission is the process's, every thread has it)
inline int amx_permission_errno() {
  static const int err = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? 0 : errno;
  return err;
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// the 8 tile registers, 64 bytes a row: the B tiles (6, 7) 16 rows, the A and C tiles (0-5) `rows` rows (16, or M
// where a call has fewer rows: one row tile, read in place). Per thread, and again per call: another library
// (oneDNN) may have changed it in the same threads.
DS_AMX_TARGET inline void configure_tiles(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t >= 6 ? 16 : rows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

DS_AMX_TARGET inline void release_tiles() { _tile_release(); }

// A tiles are read from x [M, K] (contiguous, 2-byte elements) in place, 16 rows at stride K; a call of more than
// 16 rows ends with a row tile read from this [16, K] copy: the last M % 16 rows, then zero rows (their outputs are
// dropped), so that every tile has 16 rows. Undefined where no copy is needed. Filled here rather than by
// at::zeros, whose fill is a parallel region of its own from 32K elements (a region waits for every thread to be
// scheduled: kSerialBelow).
inline at::Tensor padded_last_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), r = M % 16, row = K * 2;
  if (M <= 16 || r == 0) return at::Tensor();
  auto pad = at::empty({16, K}, x.options());
  auto* p = static_cast<char*>(pad.data_ptr());
  std::memcpy(p, static_cast<const char*>(x.data_ptr()) + (M - r) * row, r * row);
  std::memset(p + r * row, 0, (16 - r) * row);
  return pad;
}

}  // namespace ds_amx
#endif
