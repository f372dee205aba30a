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
// The same clock read at the kernel's tick (1-10 ms steps), for times only
// shown in milliseconds: it reads no counter (a few ns where nowNs() costs
// 20-25 on a VM, which a small blocking operation pays per call).
inline int64_t nowCoarseNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace loom
