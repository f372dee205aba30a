// How a rank waits: spin for LOOM_SPIN_US, then the caller sleeps (futex or
// poll).  When a host runs more ranks than it has cores, spinning only keeps
// the peer we wait for off the CPU, so the spin yields the core on every
// round instead of pausing.  Even with enough cores a rank can share its
// core with a peer or another job for a while: past the first 2 us of a
// spin every round yields too (measured with two ranks pinned to one core,
// 8 B all-reduce: ~50 us with pause-only spinning, ~8 us with yielding).
#pragma once
#include <sched.h>

#include <cstdint>

#include "src/core/clock.h"

namespace loom {

// The spin-wait hint of the CPU: tells it this is a wait loop, so it can
// give the core's other hardware thread the pipeline and save power.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
  // Elsewhere no hint: the caller's loop still re-reads its clock each round.
}

class Backoff {
 public:
  Backoff(int64_t spinUs, bool yield) : spinNs_(spinUs * 1000), yield_(yield) {}
  // Restart after progress.
  void reset() { start_ = 0; }
  // One round of waiting; false once the spin budget is spent (time to sleep).
  bool spin() {
    int64_t now = nowNs();
    if (start_ == 0) start_ = now;
    if (now - start_ >= spinNs_) return false;
    if (yield_ || now - start_ > kPauseOnlyNs) sched_yield();
    else cpuRelax();
    return true;
  }
  // Nanoseconds since the wait began.
  int64_t waited() const { return start_ ? nowNs() - start_ : 0; }

 private:
  static constexpr int64_t kPauseOnlyNs = 2000;
  int64_t spinNs_;
  bool yield_;
  int64_t start_ = 0;
};

}  // namespace loom
