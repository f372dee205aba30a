// Shared by the fuzz targets: quiet logging, a fixed secret.
#pragma once
#include <cstdint>
#include <cstdlib>

namespace loomfuzz {

// Warnings about dropped input are expected by the thousand; printing them
// would slow the fuzzer down (log.cc reads LOOM_DEBUG once).
inline void quiet() { setenv("LOOM_DEBUG", "NONE", 1); }

constexpr uint8_t kSecret[16] = {0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
                                 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x01};

}  // namespace loomfuzz
