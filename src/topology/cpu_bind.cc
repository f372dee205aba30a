#include "src/topology/cpu_bind.h"

#include <dirent.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "src/core/error.h"

namespace loom {

CpuBindMode parseCpuBindMode(const std::string& s, bool* bad) {
  *bad = false;
  if (s.empty() || s == "auto") return CpuBindMode::Auto;
  if (s == "on" || s == "1") return CpuBindMode::On;
  if (s == "off" || s == "0") return CpuBindMode::Off;
  *bad = true;
  return CpuBindMode::Auto;
}

std::vector<int> allowedCpus() {
  std::vector<int> out;
  // Large enough for any machine: the kernel refuses a mask shorter than
  // its own (EINVAL), so grow until it fits.
  for (size_t n = 1024; n <= (size_t(1) << 20); n *= 4) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (!set) break;
    size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      for (size_t c = 0; c < n; ++c)
        if (CPU_ISSET_S(c, bytes, set)) out.push_back(int(c));
      CPU_FREE(set);
      return out;
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;
  }
  return out;
}

uint64_t cpuSetHash(const std::vector<int>& cpus) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the list
  for (int c : cpus) {
    for (int i = 0; i < 4; ++i) {
      h ^= uint64_t((unsigned(c) >> (8 * i)) & 0xff);
      h *= 1099511628211ull;
    }
  }
  return h ^ cpus.size();
}

std::string formatCpuList(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(cpus[i]);
    if (j > i) s += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return s.empty() ? "(none)" : s;
}

CpuBindPlan planCpuBind(CpuBindMode mode, int localIndex, int localCount, const std::vector<int>& allowed,
                        bool sameSetOnHost) {
  CpuBindPlan p;
  const int ncpu = int(allowed.size());
  if (mode == CpuBindMode::Off) {
    p.why = "not bound (LOOM_CPU_BIND=off)";
    return p;
  }
  if (ncpu == 0 || localCount < 1 || localIndex < 0 || localIndex >= localCount) {
    p.why = "not bound (CPU set unknown)";
    return p;
  }
  if (!sameSetOnHost) {
    p.why = "not bound: the ranks of this host run on different CPU sets (bound by their launcher), kept";
    return p;
  }
  if (mode == CpuBindMode::Auto && localCount <= ncpu) {
    p.why = strf("not bound: %d ranks on this host, %d CPUs (LOOM_CPU_BIND=on binds anyway)", localCount, ncpu);
    return p;
  }
  // Contiguous blocks: rank i takes CPUs [i*ncpu/n, (i+1)*ncpu/n), or, with
  // more ranks than CPUs, CPU i*ncpu/n (ranks i..i+n/ncpu-1 share it).
  const int64_t lo = int64_t(localIndex) * ncpu / localCount;
  int64_t hi = int64_t(localIndex + 1) * ncpu / localCount;
  if (hi <= lo) hi = lo + 1;
  for (int64_t c = lo; c < hi; ++c) p.cpus.push_back(allowed[size_t(c)]);
  p.why = strf("bound to CPU %s: rank %d of %d on this host, %d CPUs%s", formatCpuList(p.cpus).c_str(),
               localIndex, localCount, ncpu, localCount > ncpu ? " (oversubscribed)" : "");
  return p;
}

std::string bindProcessToCpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return "no CPUs to bind to";
  const size_t n = size_t(cpus.back()) + 1;
  cpu_set_t* set = CPU_ALLOC(n);
  if (!set) return "out of memory";
  const size_t bytes = CPU_ALLOC_SIZE(n);
  CPU_ZERO_S(bytes, set);
  for (int c : cpus) CPU_SET_S(size_t(c), bytes, set);
  std::string failed;
  // Every thread: the caller's, loom's stream workers and the application's
  // own (a thread created later inherits its creator's set).
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      char* end = nullptr;
      long tid = strtol(e->d_name, &end, 10);
      if (!end || *end || tid <= 0) continue;
      if (sched_setaffinity(pid_t(tid), bytes, set) != 0 && errno != ESRCH && failed.empty())
        failed = strf("sched_setaffinity(thread %ld): %s", tid, strerror(errno));
    }
    closedir(d);
  } else if (sched_setaffinity(0, bytes, set) != 0) {
    failed = strf("sched_setaffinity: %s", strerror(errno));
  }
  CPU_FREE(set);
  return failed;
}

}  // namespace loom
