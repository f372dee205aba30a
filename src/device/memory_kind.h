// Where a buffer lives.  Every buffer an operation touches has one, so that
// transports and devices can tell host memory from CUDA device memory (and,
// next, from memory registered with the communicator).
#pragma once
#include <cstdint>

namespace loom {

enum class MemoryKind : uint8_t {
  Host = 0,            // ordinary host memory (malloc, the stack, ...)
  RegisteredHost = 1,  // host memory registered with loom (peers map it once)
  CudaDevice = 2,      // CUDA device memory
};

// "host", "registered host", "CUDA device"; "?" if unknown.
inline const char* memoryKindName(MemoryKind k) {
  switch (k) {
    case MemoryKind::Host: return "host";
    case MemoryKind::RegisteredHost: return "registered host";
    case MemoryKind::CudaDevice: return "CUDA device";
  }
  return "?";
}

}  // namespace loom
