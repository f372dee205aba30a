// Entry points of the algorithm library.  Each schedule builder appends the
// lanes that `rank` runs for one operation (index `opIndex` of the run) to a
// schedule; each *Estimate is the algorithm's alpha-beta cost for the tuner
// and each *RailCost its cost as the hierarchical algorithm's inter-host
// all-reduce.  algorithms/registry.cc lists them.
#pragma once
#include "algorithms/registry.h"
#include "algorithms/schedule.h"

namespace loom {

// Ring all-reduce / reduce-scatter / all-gather and chain broadcast / reduce.
void ringSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                  Schedule* out);
void ringEstimate(const CostInput& in, std::vector<Estimate>* out);
StepsAndBytesUs ringRailCost(const CostInput& in, const RailCost& r);

// Recursive halving-doubling (Rabenseifner) all-reduce / reduce-scatter /
// all-gather (algorithms/recursive_halving_doubling.cc).
void halvingDoublingSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                             Schedule* out);
void halvingDoublingEstimate(const CostInput& in, std::vector<Estimate>* out);
StepsAndBytesUs halvingDoublingRailCost(const CostInput& in, const RailCost& r);

// Double binary tree all-reduce / broadcast / reduce
// (algorithms/double_binary_tree.cc).
void doubleBinaryTreeSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                              Schedule* out);
void doubleBinaryTreeEstimate(const CostInput& in, std::vector<Estimate>* out);
StepsAndBytesUs doubleBinaryTreeRailCost(const CostInput& in, const RailCost& r);

// Hierarchical all-reduce / reduce-scatter / all-gather over ranks grouped
// by host (algorithms/hierarchical.cc).  hostOf[r] is any id naming rank r's
// host, the same on every rank; plan.inner is the inter-host all-reduce's
// flat algorithm (any registry entry with a rail cost).  Other collectives go
// to the ring.
void hierarchicalSchedule(const OpDesc& op, int opIndex, int rank, const std::vector<int>& hostOf,
                          const Plan& plan, Schedule* out);
void hierarchicalEstimate(const CostInput& in, std::vector<Estimate>* out);

// All-to-all, gather and scatter as pairwise exchange: every pair at once,
// one block each way (algorithms/pairwise_exchange.cc).
void pairwiseSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan, Schedule* out);
void pairwiseEstimate(const CostInput& in, std::vector<Estimate>* out);

// Bruck's all-to-all in ceil(log2 N) rounds, for small blocks
// (algorithms/bruck.cc).
void bruckSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan, Schedule* out);
void bruckEstimate(const CostInput& in, std::vector<Estimate>* out);

// All-to-allv as one group of sends and receives for `rank` of `nranks`
// (pairwise order), arguments already checked by the caller, buffers in host
// memory (the caller sets sendMem/recvMem).  Empty when nothing moves.
std::vector<OpDesc> allToAllvOps(const void* sendbuf, const size_t* sendcounts, const size_t* sdispls, void* recvbuf,
                                 const size_t* recvcounts, const size_t* rdispls, loomDataType_t dtype, int rank,
                                 int nranks);

// A single loomSend or loomRecv.
void p2pSchedule(const OpDesc& op, int opIndex, Schedule* out);

// Bytes of the buffers an operation reads and writes (for checks and plans).
size_t sendBytes(const OpDesc& op, int nranks);
size_t recvBytes(const OpDesc& op, int nranks);

}  // namespace loom
