#include "src/core/process_watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>

namespace loom {

namespace {

struct Cache {
  std::mutex mu;
  std::map<int, std::weak_ptr<const ProcessWatch>> watches;
};

// Never destroyed: watches may outlive static destruction (a communicator
// leaked until exit).
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

}  // namespace

ProcessWatch::ProcessWatch(int pid) : pid_(pid), fd_(int(syscall(SYS_pidfd_open, pid, 0))) {}

ProcessWatch::~ProcessWatch() {
  if (fd_ >= 0) close(fd_);
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.watches.find(pid_);
  // Only this watch's own entry: a newer watch of the pid may have replaced it.
  if (it != c.watches.end() && it->second.expired()) c.watches.erase(it);
}

bool ProcessWatch::dead() const {
  if (fd_ >= 0) {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
  }
  return kill(pid_, 0) != 0 && errno == ESRCH;
}

std::shared_ptr<const ProcessWatch> ProcessWatch::of(int pid) {
  // `cached` is declared before the lock: if it holds the last reference
  // to a dead watch, that watch's destructor (which takes the lock) runs
  // after the lock is released.
  std::shared_ptr<const ProcessWatch> cached;
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  auto& slot = c.watches[pid];
  cached = slot.lock();
  // Reuse only a watch with a pidfd whose process lives: a dead one's pid
  // may belong to another process now, and one without a pidfd may find
  // descriptors again.
  if (cached && cached->exact() && !cached->dead()) return cached;
  std::shared_ptr<const ProcessWatch> w(new ProcessWatch(pid));
  slot = w;
  return w;
}

size_t processWatchCount() {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  size_t n = 0;
  for (const auto& e : c.watches) n += !e.second.expired();
  return n;
}

}  // namespace loom
