// Where a buffer lives.  Every buffer an operation touches has a kind; the
// device of that kind copies and reduces it.
#pragma once
#include <cstdint>

namespace loom {

enum class MemoryKind : uint8_t {
  Host = 0,  // ordinary host memory
  Cuda = 1,  // memory of a CUDA device
};

}  // namespace loom
