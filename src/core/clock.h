// Monotonic time helpers used for deadlines and timeouts.
#pragma once
#include <time.h>

#include <cstdint>

namespace loom {

inline int64_t nowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
inline int64_t nowMs() { return nowNs() / 1000000; }

}  // namespace loom
