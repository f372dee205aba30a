// NUMA placement of memory that several ranks share, through hwloc.
#pragma once
#include <cstddef>
#include <string>

namespace loom {

// Binds [addr, addr + len) to the NUMA node(s) of the CPUs this thread may
// run on, when the machine has more than one node (a receiver's slot memory
// then sits next to the receiver, whoever touches it first).  Returns what
// it did, for the log; never fails (placement is an optimisation).
std::string bindToLocalNumaNode(void* addr, size_t len);

// NUMA nodes of the machine as hwloc sees it (1 when it has none).
int numaNodeCount();

}  // namespace loom
