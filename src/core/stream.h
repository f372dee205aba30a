// Host streams: a FIFO of operations run one after another.  A worker thread
// runs them in the background; loomStreamSynchronize runs queued ones itself
// when the worker has not picked them up yet, so a synchronous caller pays no
// thread hand-off for small operations.  The worker leaves an operation alone
// for its first kStealWindowUs, the time in which a caller that synchronizes
// right after issuing takes it; a hand-off between threads on every
// operation costs tens of microseconds on an oversubscribed host.
//
// A loomStream_t handle is not a pointer to the HostStream: it points into a
// static table of slots (see classifyStream), so that any other pointer a
// caller passes, such as a cudaStream_t, is recognised without being read.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "loom.h"

namespace loom {

class HostStream {
 public:
  HostStream();
  ~HostStream();  // waits for the queue, joins the worker
  void enqueue(std::function<loomResult_t()> op);
  loomResult_t synchronize();
  // Waits for everything enqueued so far, as synchronize() does, but leaves
  // the stream's error for its owner's synchronize() (a group that joins
  // this stream waits for it without taking its error).
  void drain();
  loomResult_t query();

 private:
  void workerLoop();
  // Runs the front operation; called with the lock held, returns with it held.
  void runFront(std::unique_lock<std::mutex>& lock);
  // Waits (running queued work) until the queue is empty; lock held.
  void drainLocked(std::unique_lock<std::mutex>& lock);

  std::mutex m_;
  std::condition_variable workCv_, doneCv_;
  struct Item {
    std::function<loomResult_t()> op;
    std::chrono::steady_clock::time_point issued;
  };
  std::deque<Item> queue_;
  bool running_ = false;
  int syncing_ = 0;       // threads inside synchronize(): they run queued work
  bool workerIdle_ = false;
  bool stop_ = false;
  loomResult_t error_ = loomSuccess;
  std::thread worker_;
};

// Each stream has a worker thread, so this is far above what a process runs.
constexpr size_t kMaxStreams = 16384;

// What a loomStream_t handle is.
enum class StreamKind : uint8_t {
  Null,       // NULL: the call blocks
  Host,       // a live loom host stream
  Destroyed,  // a loom handle whose stream was destroyed
  Foreign,    // anything else (e.g. a cudaStream_t): never dereferenced
};
struct StreamRef {
  StreamKind kind;
  HostStream* host;  // set for Host
};

namespace detail {
// The handle table: a handle is the address of its slot.  Zero-initialised
// static storage, never destroyed: handles work at any time in a process.
extern std::atomic<HostStream*> streamSlots[kMaxStreams];

// The slot a handle names, or kMaxStreams if it names none.  Integer
// arithmetic only: comparing unrelated pointers is unspecified.
inline size_t streamSlotOf(loomStream_t handle) {
  uintptr_t off = reinterpret_cast<uintptr_t>(handle) - reinterpret_cast<uintptr_t>(&streamSlots[0]);
  if (off >= sizeof streamSlots || off % sizeof streamSlots[0] != 0) return kMaxStreams;
  return off / sizeof streamSlots[0];
}
}  // namespace detail

// A range check and one atomic load (inline: every call on a stream asks).
inline StreamRef classifyStream(loomStream_t handle) {
  if (!handle) return {StreamKind::Null, nullptr};
  size_t i = detail::streamSlotOf(handle);
  if (i == kMaxStreams) return {StreamKind::Foreign, nullptr};
  HostStream* s = detail::streamSlots[i].load(std::memory_order_acquire);
  return {s ? StreamKind::Host : StreamKind::Destroyed, s};
}

// The handle of a new stream; throws loomSystemError when kMaxStreams live.
loomStream_t registerStream(std::unique_ptr<HostStream> stream);
// Takes the stream out of the table (its handle becomes Destroyed); nullptr
// if the handle is not a live loom stream.
std::unique_ptr<HostStream> unregisterStream(loomStream_t handle);

}  // namespace loom
