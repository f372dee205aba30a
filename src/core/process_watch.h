// Whether another process of this host is still alive, through one pidfd
// per watched process for the whole of this process.
//
// Every communicator used to open a pidfd per peer (the shm transport per
// peer, UCX per connection), so descriptors grew with communicators x local
// peers: at the usual limit of 1024 a process ran out after about 70
// four-rank communicators.  Watches of one pid now share one descriptor,
// closed with the last watch.
#pragma once
#include <memory>

namespace loom {

class ProcessWatch {
 public:
  // The watch of process `pid` (> 0), shared with every other watch of it
  // made while it lives.  A cached watch whose process has died is not
  // handed out again (its pid may have been reused): the caller gets a new
  // one.  Never null; without pidfds (old kernels, or out of descriptors)
  // it falls back to kill(pid, 0).
  static std::shared_ptr<const ProcessWatch> of(int pid);

  ~ProcessWatch();
  ProcessWatch(const ProcessWatch&) = delete;
  ProcessWatch& operator=(const ProcessWatch&) = delete;

  int pid() const { return pid_; }
  // True once the process has exited (a zombie counts as exited).
  bool dead() const;
  // Whether the answer comes from a pidfd (reliable) rather than kill(),
  // which a reused pid would fool.
  bool exact() const { return fd_ >= 0; }

 private:
  explicit ProcessWatch(int pid);
  int pid_;
  int fd_;
};

// How many watches the process holds now (one descriptor each, at most):
// for tests.
size_t processWatchCount();

}  // namespace loom
