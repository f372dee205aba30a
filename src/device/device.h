// A device is where an operation's data is copied and reduced: the host CPU
// today (hostDevice(): the SIMD kernels of host_reduce.cc), a CUDA device
// next.  The executor calls it once per slot or per step, never per element,
// so a virtual call is cheap next to the bytes it moves.
//
// To add a device: implement this class in src/device/<name>_device.*, give
// its memory a MemoryKind, and have the communicator put it in each ExecOp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "loom.h"
#include "src/device/memory_kind.h"

namespace loom {

enum class CopyHint : uint8_t {
  Cached,     // the result is read again soon (slots, partial results)
  Streaming,  // large output not read again soon: bypass the caches if possible
};

// Devices live as long as the process (the host device is a constant-
// initialised static; CUDA devices will be owned by their backend), so
// nothing deletes one through this class.
class Device {
 public:
  virtual const char* name() const = 0;  // "host", "cuda:0", ...
  // The kind of memory allocate() returns.
  virtual MemoryKind memoryKind() const = 0;
  // True if copy/reduce/divide may read and write memory of kind k.  Not
  // virtual: the executor asks for every buffer of every run.
  bool canAccess(MemoryKind k) const { return (accessible_ >> unsigned(k)) & 1u; }

  // At least `bytes` of this device's memory, aligned to 4096 bytes, or
  // nullptr if there is none to be had.  free(nullptr) does nothing.
  virtual void* allocate(size_t bytes) = 0;
  virtual void free(void* p) = 0;

  // dst = src for `bytes` bytes.  Cached copies may overlap (memmove);
  // streaming ones may not.
  virtual void copy(void* dst, const void* src, size_t bytes, CopyHint hint) = 0;
  // dst[i] = a[i] op b[i] for i < n elements (reduce_ops.h says how each
  // type and op combines; loomAvg combines as sum).  dst may equal a or b,
  // not partially overlap them.  An unknown type or op does nothing.
  virtual void reduce(void* dst, const void* a, const void* b, size_t n, loomDataType_t type,
                      loomRedOp_t op) = 0;
  // dst[i] = src[i] / divisor for i < n (loomAvg's last step).  dst may
  // equal src.  divisor <= 1 copies.
  virtual void divide(void* dst, const void* src, size_t n, loomDataType_t type, int divisor) = 0;

 protected:
  // accessible: bit k set for each MemoryKind k the device can reach.
  constexpr explicit Device(uint32_t accessible) : accessible_(accessible) {}
  ~Device() = default;
  static constexpr uint32_t bit(MemoryKind k) { return 1u << unsigned(k); }

 private:
  uint32_t accessible_;
};

namespace detail {
extern Device* const kHostDevice;  // host_device.cc
}

// The host CPU.  Constant-initialised and never destroyed, so it works from
// static constructors and from threads still running at exit; inline,
// because every ExecOp starts with it.
inline Device& hostDevice() { return *detail::kHostDevice; }

}  // namespace loom
