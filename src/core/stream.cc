#include "src/core/stream.h"

#include "src/core/error.h"

namespace loom {

namespace {
constexpr auto kStealWindow = std::chrono::microseconds(50);

std::mutex g_slotsMutex;
size_t g_slotsUsed = 0;  // slots [0, used) have been handed out once

// Destroyed handles' slots, reused oldest first and only once every slot has
// been used, so a stale handle stays Destroyed as long as possible.  Never
// freed, like the table, so that streams may be destroyed during exit.
std::deque<size_t>& freeSlots() {
  static auto* const slots = new std::deque<size_t>();
  return *slots;
}

}  // namespace

std::atomic<HostStream*> detail::streamSlots[kMaxStreams];

HostStream::HostStream() { worker_ = std::thread([this] { workerLoop(); }); }

HostStream::~HostStream() {
  synchronize();
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  workCv_.notify_all();
  worker_.join();
}

void HostStream::enqueue(std::function<loomResult_t()> op) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(m_);
    queue_.push_back(Item{std::move(op), std::chrono::steady_clock::now()});
    // A thread in synchronize() runs it; otherwise the worker must, now.
    wake = workerIdle_ && syncing_ == 0;
  }
  if (wake) workCv_.notify_one();
  else doneCv_.notify_all();
}

void HostStream::runFront(std::unique_lock<std::mutex>& lock) {
  std::function<loomResult_t()> op = std::move(queue_.front().op);
  queue_.pop_front();
  running_ = true;
  lock.unlock();
  loomResult_t r = op();
  lock.lock();
  running_ = false;
  if (r != loomSuccess && error_ == loomSuccess) error_ = r;
  doneCv_.notify_all();
  if (!queue_.empty() && syncing_ == 0) workCv_.notify_one();
}

void HostStream::workerLoop() {
  std::unique_lock<std::mutex> lock(m_);
  for (;;) {
    workerIdle_ = true;
    workCv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !running_ && syncing_ == 0); });
    workerIdle_ = false;
    if (stop_ && queue_.empty()) return;
    if (queue_.empty() || running_) continue;
    auto ripe = queue_.front().issued + kStealWindow;
    if (!stop_ && std::chrono::steady_clock::now() < ripe) {
      workCv_.wait_until(lock, ripe);
      continue;
    }
    runFront(lock);
  }
}

loomResult_t HostStream::synchronize() {
  // The error is taken in the same hold of the lock that saw the queue
  // empty: the thread that ran the failing operation gets it before another
  // synchronizing thread can (loom_torch's queue attributes it that way).
  std::unique_lock<std::mutex> lock(m_);
  drainLocked(lock);
  loomResult_t r = error_;
  error_ = loomSuccess;
  return r;
}

void HostStream::drain() {
  std::unique_lock<std::mutex> lock(m_);
  drainLocked(lock);
}

void HostStream::drainLocked(std::unique_lock<std::mutex>& lock) {
  ++syncing_;
  while (!queue_.empty() || running_) {
    if (!running_) runFront(lock);
    else doneCv_.wait(lock);
  }
  --syncing_;
  if (syncing_ == 0 && !queue_.empty()) workCv_.notify_one();
}

loomResult_t HostStream::query() {
  std::lock_guard<std::mutex> lock(m_);
  if (error_ != loomSuccess) return error_;
  return (queue_.empty() && !running_) ? loomSuccess : loomInProgress;
}

loomStream_t registerStream(std::unique_ptr<HostStream> stream) {
  std::lock_guard<std::mutex> lock(g_slotsMutex);
  size_t i;
  if (g_slotsUsed < kMaxStreams) {
    i = g_slotsUsed++;
  } else if (!freeSlots().empty()) {
    i = freeSlots().front();
    freeSlots().pop_front();
  } else {
    fail(loomSystemError, "too many loom streams (%zu live)", kMaxStreams);
  }
  detail::streamSlots[i].store(stream.release(), std::memory_order_release);
  return reinterpret_cast<loomStream_t>(&detail::streamSlots[i]);
}

std::unique_ptr<HostStream> unregisterStream(loomStream_t handle) {
  size_t i = detail::streamSlotOf(handle);
  if (i == kMaxStreams) return nullptr;
  std::lock_guard<std::mutex> lock(g_slotsMutex);
  std::unique_ptr<HostStream> s(detail::streamSlots[i].exchange(nullptr, std::memory_order_acq_rel));
  if (s) freeSlots().push_back(i);
  return s;
}

}  // namespace loom
