// Binding ranks to CPUs when a host runs more ranks than it has CPUs.
//
// A rank that waits for a peer yields its CPU (src/core/backoff.h), so an
// oversubscribed host's small collectives cost one context switch per rank
// per operation on each CPU.  Left to itself, the scheduler of a virtual
// machine may keep all of them on one CPU (measured on the 2-vCPU dev VMs:
// 8 ranks of an 8 B all-reduce all on one vCPU, 13-25 us; bound 4 + 4,
// about 10 us).  So when a host is oversubscribed and nobody bound its
// ranks (every local rank has the same CPU set), each rank binds all of its
// threads to an even share of that set, local ranks in contiguous blocks
// (neighbours of a ring mostly share a CPU: a hand-off there needs no
// inter-processor wake-up).  LOOM_CPU_BIND=on binds without
// oversubscription too, off never; a launcher's binding (mpirun, taskset
// per rank) is always kept.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

enum class CpuBindMode { Auto, On, Off };

// LOOM_CPU_BIND's value: "auto", "on" or "off" (also 1/0); anything else is
// Auto with *bad set (the caller warns).
CpuBindMode parseCpuBindMode(const std::string& s, bool* bad);

// The CPUs this thread may run on (sched_getaffinity), in increasing order.
std::vector<int> allowedCpus();
// A hash of a CPU list (equal lists, equal hashes): what ranks exchange at
// init to see whether a launcher bound them.
uint64_t cpuSetHash(const std::vector<int>& cpus);

struct CpuBindPlan {
  std::vector<int> cpus;  // the rank's CPUs; empty: leave the process as it is
  std::string why;        // what was decided and why, for the log
};

// Rank `localIndex` of `localCount` ranks on its host, allowed `allowed`;
// sameSetOnHost: every local rank reported the same CPU set.
CpuBindPlan planCpuBind(CpuBindMode mode, int localIndex, int localCount, const std::vector<int>& allowed,
                        bool sameSetOnHost);

// Binds every thread of this process to `cpus`.  Returns "" or what failed
// (a thread that exited meanwhile is not a failure).
std::string bindProcessToCpus(const std::vector<int>& cpus);

// "0-3,6" for a log line.
std::string formatCpuList(const std::vector<int>& cpus);

}  // namespace loom
