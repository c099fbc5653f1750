// The AMX tiles' state, shared by the native kernels of the AMX build (decode.cpp, prefill.cpp): Linux's grant
// of it to this process, and one tile configuration (every tile 16 rows of 64 bytes) set per thread for a scope.
#pragma once

#if defined(CHUNKATTN_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace chunkattn {

// Whether Linux gave this process the AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA;
// asked once, as torch does for its own AMX kernels): without it the first tile instruction kills the process.
inline bool tiles_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

// The tiles configured on this thread for a scope (all eight: 16 rows of 64 bytes), released when it ends, an
// exception included.
struct TileScope {
  TileScope() {
    struct alignas(64) {
      uint8_t palette = 1;
      uint8_t start_row = 0;
      uint8_t reserved[14] = {};
      uint16_t colsb[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

}  // namespace chunkattn
#endif  // CHUNKATTN_AMX
