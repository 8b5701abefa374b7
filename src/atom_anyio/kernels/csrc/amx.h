// What the AMX kernels share (attention_amx.h's attention, gemm.cpp's linears): the
// permission to use the tile registers, the tile configuration, and a scope that hands the tiles
// back as it found them.
#pragma once

#include "vec.h"

#ifdef ATOM_AMX_BF16
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace atom {

// whether this process may use the tile registers (Linux hands them out on request, once)
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles for one kernel call on this thread: whoever used them before (oneDNN, the other
// kernel) finds its configuration back, or the tiles released when there was none.
class TileScope {
 public:
  TileScope() { _tile_storeconfig(saved_); }
  ~TileScope() {
    if (saved_[0] == 0)
      _tile_release();
    else
      _tile_loadconfig(saved_);
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  alignas(64) uint8_t saved_[64];
};

}  // namespace atom
#endif
