// How a rank waits: spin for LOOM_SPIN_US, then the caller sleeps (futex or
// poll).  When a host runs more ranks than it has cores, spinning only keeps
// the peer we wait for off the CPU, so the spin yields the core on every
// round instead of pausing.  Even with enough cores a rank can share its
// core with a peer or another job for a while: past the first 2 us of a
// spin every round yields too (measured with two ranks pinned to one core,
// 8 B all-reduce: ~50 us with pause-only spinning, ~8 us with yielding).
//
// Other work can take the peer's core too (another job, a compute thread, a
// VM): then the first 2 us of pausing only delay the peer we wait for.  A
// yield that took long says exactly that (something else ran on this CPU
// meanwhile), so the communicator keeps a count of such evidence that its
// waits share: while it is non-zero they yield from the start, and each
// yield that comes back at once (nothing else wanted this CPU) halves it:
// nine quick yields in a row forget the mark.  (Lowered by one, it took 256
// operations: the dev VM's scheduler starts two ranks on one vCPU and moves
// one away soon, and a program's first few hundred 8 B all-reduces then
// took 0.7 us instead of 0.2.)
// Measured with 2 ranks sharing one vCPU of the dev VM (taskset), 8 B
// all-reduce: 8.1 us pausing first, 4.1 us yielding (perf/oversub_limit.c's
// floor there: 3.0 us).
#pragma once
#include <sched.h>

#include <atomic>
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
  // contention: the communicator's shared count (ExecEnv::cpuContention),
  // or nullptr.
  Backoff(int64_t spinUs, bool yield, std::atomic<uint32_t>* contention = nullptr)
      : spinNs_(spinUs * 1000), yield_(yield), contention_(contention) {}
  // Restart after progress.
  void reset() { start_ = 0, freeYields_ = 0; }
  // One round of waiting; false once the spin budget is spent (time to sleep).
  bool spin() {
    // Yielding from the start (more ranks than cores), a round costs a
    // system call and usually a switch: the first few read no clock, and
    // most waits end within them (8 ranks on 2 cores, 8 B all-reduce).
    if (yield_ && spinNs_ > 0 && freeYields_ < kFreeYields) {
      ++freeYields_;
      sched_yield();
      return true;
    }
    int64_t now = nowNs();
    last_ = now;
    if (start_ == 0) start_ = now;
    if (now - start_ >= spinNs_) return false;
    if (yield_) {
      sched_yield();
    } else if (now - start_ > kPauseOnlyNs ||
               (contention_ && contention_->load(std::memory_order_relaxed) != 0)) {
      sched_yield();
      if (contention_) noteYield(*contention_, nowNs() - now);
    } else {
      cpuRelax();
    }
    return true;
  }
  // Nanoseconds from the wait's start to the last spin() (every caller
  // asks right after a spin(): its clock read serves, rather than another).
  int64_t waited() const { return start_ ? last_ - start_ : 0; }
  // The clock as the last spin() read it.
  int64_t lastNs() const { return last_; }

  // A yield longer than this ran something else on the CPU (a yield that
  // switches nothing costs a system call: 0.1-1.5 us).
  static constexpr int64_t kSharedYieldNs = 3000;
  // Each long yield sets the count to this; each quick one halves it.
  static constexpr uint32_t kContentionMemory = 256;
  // What a yield of `ns` nanoseconds says about the CPU (tested on its own).
  static void noteYield(std::atomic<uint32_t>& contention, int64_t ns) {
    if (ns > kSharedYieldNs) {
      contention.store(kContentionMemory, std::memory_order_relaxed);
    } else {
      uint32_t c = contention.load(std::memory_order_relaxed);
      if (c) contention.store(c / 2, std::memory_order_relaxed);  // racy: a hint
    }
  }

 private:
  static constexpr int64_t kPauseOnlyNs = 2000;
  static constexpr int kFreeYields = 4;
  int64_t spinNs_;
  bool yield_;
  std::atomic<uint32_t>* contention_;
  int64_t start_ = 0;
  int64_t last_ = 0;
  int freeYields_ = 0;
};

}  // namespace loom
