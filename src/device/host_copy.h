// Copies for the host data path.
#pragma once
#include <cstddef>

namespace loom {

// memcpy with non-temporal stores: for output that will not be read again
// soon and is larger than the caches.  Skipping the read-for-ownership of
// every destination line cuts a large copy's memory traffic by a third.
void copyStreaming(void* dst, const void* src, size_t n);

// Buffers at least this large are written with copyStreaming by the
// shared-memory paths.  (Half the 32 MiB L3 of the dev machine: below it the
// output is still in cache when the caller reads it.)
constexpr size_t kStreamingCopyBytes = 16u << 20;

}  // namespace loom
