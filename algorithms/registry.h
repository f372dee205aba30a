// The algorithm registry: one table of every algorithm loom has.  Each entry
// says what LOOM_ALGO calls it, which collectives it serves, when else it can
// run, what the cost model predicts for it, and how it builds a schedule (or,
// for the direct shared-memory paths, that it runs without one).  The tuner,
// LOOM_ALGO's parsing and messages, loom-topo (--algorithms prints the table
// as the README shows it) and the dispatch in the communicator and in the
// hierarchical algorithm all read this table; adding an algorithm is a file
// under algorithms/ and one entry in registry.cc.
#pragma once
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "src/tuner/cost_model.h"

namespace loom {

struct SlotTag;
// What a direct path needs to run (filled in with the peer-memory interface).
struct DirectContext;

// What decides whether an algorithm can run, beyond the collectives it serves:
// the operation and what the communicator offers.
struct Eligibility {
  Collective coll;
  int nranks;
  double block;         // bytes of one rank's argument
  bool allShm;          // every rank reaches every other through shared memory
  size_t oneShotBytes;  // the one-shot path's largest block (0: unavailable)
  size_t stageBytes;    // the staged path's buffer per rank (0: unavailable)
};

// The inter-host all-reduce of the hierarchical algorithm as the cost model
// sees it, for the algorithm that runs it: H hosts of (at most) L ranks, each
// rail carrying S/L bytes, the L rails of a host sharing its network link.
struct RailCost {
  double l, h;      // L and H as doubles
  double S;         // the whole buffer
  double rail;      // S / L: one rail's bytes
  double netBytes;  // 2(H-1)/H x S: what a host's link carries with a ring
  double na, nb;    // the network's alpha (with oversubscription) and beta
};
// Steps and transfer time, kept apart so the hierarchical total adds them in
// the order the model always has.
struct StepsAndBytesUs {
  double stepsUs;
  double bytesUs;
};

using EligibleFn = const char* (*)(const Eligibility& q);
using EstimateFn = void (*)(const CostInput& in, std::vector<Estimate>* out);
using RailCostFn = StepsAndBytesUs (*)(const CostInput& in, const RailCost& r);
// Appends the lanes `rank` of `nranks` runs for operation `opIndex`.
// hostOf[r] names rank r's host (only the hierarchical algorithm reads it;
// it may be empty for the others).
using BuildFn = void (*)(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>& hostOf,
                         const Plan& plan, Schedule* out);
using RunDirectFn = void (*)(DirectContext& ctx, const OpDesc& op, const SlotTag& tag);

struct AlgorithmEntry {
  const char* name;  // as LOOM_ALGO spells it
  Algorithm algo;
  CollectiveSet serves;
  // Beyond `serves`: nullptr when the algorithm can run, else why not.
  // nullptr: only `serves` matters.
  EligibleFn eligible = nullptr;
  // The cost model's estimate(s) when eligible: one Estimate, or several
  // (the hierarchical algorithm: one per inner algorithm), each < 0 with a
  // reason when the model rules it out (one host, one rank).
  EstimateFn estimate = nullptr;
  // Non-null: this algorithm can be the hierarchical algorithm's inter-host
  // all-reduce ("hier-<name>"), at this cost.
  RailCostFn railCost = nullptr;
  // The schedule builder; nullptr for the direct paths.
  BuildFn build = nullptr;
  // A direct path: runs alone (never inside a group, where the ring serves
  // instead) through runDirect, without a schedule.
  bool direct = false;
  RunDirectFn runDirect = nullptr;
  // The README's table: which collectives and when, how it works, its cost.
  const char* servesText;
  const char* how;
  const char* volume;
};

// Every algorithm, in the cost model's order (ties go to the earlier entry).
const std::vector<AlgorithmEntry>& algorithmRegistry();
// The entry of `a` (every Algorithm value has one).
const AlgorithmEntry& algorithmEntry(Algorithm a);

// What a LOOM_ALGO name selects.
struct AlgorithmChoice {
  Algorithm algo = Algorithm::Ring;
  Algorithm inner = Algorithm::Ring;  // hierarchical: the inter-host algorithm
};
// "ring", "hier", "hier-rhd", ...: false for a name the registry does not have.
bool parseAlgorithmName(const std::string& name, AlgorithmChoice* out);
// The name of a choice as LOOM_ALGO spells it ("hier-ring" for hierarchical).
std::string choiceName(Algorithm algo, Algorithm inner);
// Every name LOOM_ALGO accepts, comma-separated.
std::string algorithmNames();
// "all-reduce, reduce-scatter and all-gather".
std::string collectiveList(CollectiveSet set);

// Whether `a` can run for q: it serves q.coll and its eligibility rule agrees.
bool usable(const AlgorithmEntry& a, const Eligibility& q);
// Why not ("" when usable): "it serves ..." or the eligibility rule's reason.
std::string whyIneligible(const AlgorithmEntry& a, const Eligibility& q);

// The first algorithm with a schedule that serves c whatever the shape (the
// ring; pairwise for all-to-all, gather and scatter): what serves a
// collective inside a group, or when LOOM_ALGO names one that cannot.
Algorithm scheduledFallback(Collective c);

// The plan's schedule: its algorithm's builder, or scheduledFallback's for a
// direct path (which runs alone) or an algorithm that does not serve op.
void buildSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>& hostOf,
                   const Plan& plan, Schedule* out);

// The registry as the README's markdown table (loom-topo --algorithms).
std::string algorithmTableMarkdown();

}  // namespace loom
