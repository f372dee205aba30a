// Host streams: a FIFO of operations run one after another.  A worker thread
// runs them in the background; loomStreamSynchronize runs queued ones itself
// when the worker has not picked them up yet, so a synchronous caller pays no
// thread hand-off for small operations.  The worker leaves an operation alone
// for its first kStealWindowUs, the time in which a caller that synchronizes
// right after issuing takes it; a hand-off between threads on every
// operation costs tens of microseconds on an oversubscribed host.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "loom.h"

struct loomStream {
 public:
  loomStream();
  ~loomStream();  // waits for the queue, joins the worker
  void enqueue(std::function<loomResult_t()> op);
  loomResult_t synchronize();
  loomResult_t query();

 private:
  void workerLoop();
  // Runs the front operation; called with the lock held, returns with it held.
  void runFront(std::unique_lock<std::mutex>& lock);

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
