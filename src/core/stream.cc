#include "src/core/stream.h"

namespace {
constexpr auto kStealWindow = std::chrono::microseconds(50);
}

loomStream::loomStream() { worker_ = std::thread([this] { workerLoop(); }); }

loomStream::~loomStream() {
  synchronize();
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  workCv_.notify_all();
  worker_.join();
}

void loomStream::enqueue(std::function<loomResult_t()> op) {
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

void loomStream::runFront(std::unique_lock<std::mutex>& lock) {
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

void loomStream::workerLoop() {
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

loomResult_t loomStream::synchronize() {
  std::unique_lock<std::mutex> lock(m_);
  ++syncing_;
  while (!queue_.empty() || running_) {
    if (!running_) runFront(lock);
    else doneCv_.wait(lock);
  }
  --syncing_;
  if (syncing_ == 0 && !queue_.empty()) workCv_.notify_one();
  loomResult_t r = error_;
  error_ = loomSuccess;
  return r;
}

loomResult_t loomStream::query() {
  std::lock_guard<std::mutex> lock(m_);
  if (error_ != loomSuccess) return error_;
  return (queue_.empty() && !running_) ? loomSuccess : loomInProgress;
}
