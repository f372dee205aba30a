// pickCaptureStreams (capture_streams.h).
#include "src/device/capture_streams.h"

#include <algorithm>

#include "src/core/error.h"

namespace loom {

std::vector<void*> pickCaptureStreams(std::vector<void*>& pool, uint64_t capture, int need,
                                      const std::function<uint64_t(void*)>& captureOf,
                                      const std::function<void*()>& create) {
  if (capture == 0) fail(loomInternalError, "side streams for a capture asked for a stream that is not captured");
  std::vector<void*> same, idle;
  for (void* s : pool) {
    const uint64_t c = captureOf(s);
    if (c == capture)
      same.push_back(s);
    else if (c == 0)
      idle.push_back(s);
  }
  std::vector<void*> out;
  for (const std::vector<void*>* v : {&same, &idle})
    for (void* s : *v)
      if (int(out.size()) < need) out.push_back(s);
  while (int(out.size()) < need) {
    void* s = create();
    pool.push_back(s);
    out.push_back(s);
  }
  return out;
}

}  // namespace loom
