// pickCaptureStream (capture_streams.h).
#include "src/device/capture_streams.h"

#include "src/core/error.h"

namespace loom {

void* pickCaptureStream(std::vector<void*>& pool, uint64_t capture, const std::function<uint64_t(void*)>& captureOf,
                        const std::function<void*()>& create) {
  if (capture == 0) fail(loomInternalError, "a side stream for a capture asked for a stream that is not captured");
  void* idle = nullptr;
  for (void* s : pool) {
    const uint64_t c = captureOf(s);
    if (c == capture) return s;
    if (c == 0 && !idle) idle = s;
  }
  if (idle) return idle;
  void* s = create();
  pool.push_back(s);
  return s;
}

}  // namespace loom
