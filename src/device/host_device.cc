// The host CPU as a Device: aligned_alloc for memory, memmove and
// copyStreaming for copies, the SIMD kernels of host_reduce.cc for reduce
// and divide.
#include <cstdlib>
#include <cstring>

#include "src/core/hot.h"
#include "src/device/device.h"
#include "src/device/host_copy.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

class HostDevice final : public Device {
 public:
  constexpr HostDevice() : Device(bit(MemoryKind::Host) | bit(MemoryKind::RegisteredHost)) {}
  const char* name() const override { return "host"; }
  MemoryKind memoryKind() const override { return MemoryKind::Host; }
  void* allocate(size_t bytes) override {
    size_t size = (bytes + 4095) & ~size_t(4095);
    return aligned_alloc(4096, size ? size : 4096);
  }
  void free(void* p) override { ::free(p); }
  LOOM_HOT void copy(void* dst, const void* src, size_t bytes, CopyHint hint) override {
    if (hint == CopyHint::Streaming) copyStreaming(dst, src, bytes);
    else memmove(dst, src, bytes);
  }
  LOOM_HOT void reduce(void* dst, const void* a, const void* b, size_t n, loomDataType_t type,
              loomRedOp_t op) override {
    reduceHost(dst, a, b, n, type, op);
  }
  LOOM_HOT void divide(void* dst, const void* src, size_t n, loomDataType_t type, int divisor) override {
    divideHost(dst, src, n, type, divisor);
  }
};

// constexpr construction and a trivial destructor: no static-initialisation
// order to get wrong and nothing torn down at exit.
HostDevice g_hostDevice;

}  // namespace

Device* const detail::kHostDevice = &g_hostDevice;

}  // namespace loom
