// Entry points of the algorithm library.  Each appends the lanes that `rank`
// runs for one operation (index `opIndex` of the run) to a schedule.
#pragma once
#include "algorithms/schedule.h"

namespace loom {

// Ring all-reduce / reduce-scatter / all-gather and chain broadcast / reduce.
void ringSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                  Schedule* out);

// Recursive halving-doubling (Rabenseifner) all-reduce / reduce-scatter /
// all-gather (algorithms/recursive_halving_doubling.cc).
void halvingDoublingSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                             Schedule* out);

// Double binary tree all-reduce / broadcast / reduce
// (algorithms/double_binary_tree.cc).
void doubleBinaryTreeSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                              Schedule* out);

// Hierarchical all-reduce / reduce-scatter / all-gather over ranks grouped
// by host (algorithms/hierarchical.cc).  hostOf[r] is any id naming rank r's
// host, the same on every rank; plan.inner is the inter-host all-reduce's
// flat algorithm.  Other collectives go to the ring.
void hierarchicalSchedule(const OpDesc& op, int opIndex, int rank, const std::vector<int>& hostOf,
                          const Plan& plan, Schedule* out);

// A single loomSend or loomRecv.
void p2pSchedule(const OpDesc& op, int opIndex, Schedule* out);

// Bytes of the buffers an operation reads and writes (for checks and plans).
size_t sendBytes(const OpDesc& op, int nranks);
size_t recvBytes(const OpDesc& op, int nranks);

}  // namespace loom
