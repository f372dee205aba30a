#include "algorithms/registry.h"

#include <cmath>

#include "algorithms/algorithms.h"
#include "algorithms/direct.h"
#include "src/core/error.h"
#include "src/core/hot.h"

namespace loom {

namespace {

constexpr CollectiveSet kTuned = collectiveBit(Collective::AllReduce) | collectiveBit(Collective::ReduceScatter) |
                                 collectiveBit(Collective::AllGather) | collectiveBit(Collective::Broadcast) |
                                 collectiveBit(Collective::Reduce);
constexpr CollectiveSet kExchanges = collectiveBit(Collective::AllToAll) | collectiveBit(Collective::Gather) |
                                     collectiveBit(Collective::Scatter);
constexpr CollectiveSet kAllReduceOnly = collectiveBit(Collective::AllReduce);
constexpr CollectiveSet kReduceScatterGather = collectiveBit(Collective::AllReduce) |
                                               collectiveBit(Collective::ReduceScatter) |
                                               collectiveBit(Collective::AllGather);
constexpr CollectiveSet kRootedAndAllReduce = collectiveBit(Collective::AllReduce) |
                                              collectiveBit(Collective::Broadcast) |
                                              collectiveBit(Collective::Reduce);

// The flat builders ignore hostOf.
void buildRing(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>&, const Plan& plan,
               Schedule* out) {
  ringSchedule(op, opIndex, rank, nranks, plan, out);
}
void buildHalvingDoubling(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>&,
                          const Plan& plan, Schedule* out) {
  halvingDoublingSchedule(op, opIndex, rank, nranks, plan, out);
}
void buildTree(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>&, const Plan& plan,
               Schedule* out) {
  doubleBinaryTreeSchedule(op, opIndex, rank, nranks, plan, out);
}
void buildPairwise(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>&, const Plan& plan,
                   Schedule* out) {
  pairwiseSchedule(op, opIndex, rank, nranks, plan, out);
}
void buildBruck(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>&, const Plan& plan,
                Schedule* out) {
  bruckSchedule(op, opIndex, rank, nranks, plan, out);
}
void buildHierarchical(const OpDesc& op, int opIndex, int rank, int, const std::vector<int>& hostOf,
                       const Plan& plan, Schedule* out) {
  hierarchicalSchedule(op, opIndex, rank, hostOf, plan, out);
}

std::vector<AlgorithmEntry> makeRegistry() {
  std::vector<AlgorithmEntry> t(8);
  AlgorithmEntry* e = t.data();
  *e++ = {"oneshot", Algorithm::OneShot, kTuned | kExchanges, oneShotEligible, oneShotEstimate, nullptr, nullptr,
          true, oneShotRun,
          "every collective (all-to-all, gather and scatter too), when every rank shares memory and a rank's block "
          "is at most `LOOM_SHM_SMALL_BYTES` (16 KiB)",
          "each rank writes its block into a mailbox in each reader's peer-memory window and reads the blocks addressed "
          "to it; no lock, no system call unless a rank sleeps",
          "1 round"};
  *e++ = {"staged", Algorithm::Staged, kAllReduceOnly, stagedEligible, stagedEstimate, nullptr, nullptr, true,
          stagedRun, "all-reduce when every rank shares memory",
          "chunks of `LOOM_SHM_STAGE_BYTES`: copy into my staging buffer, reduce my 1/N of all staging buffers, "
          "copy the other parts out",
          "2 synchronisations per chunk whatever N is"};
  *e++ = {"ring", Algorithm::Ring, kTuned, nullptr, ringEstimate, ringRailCost, buildRing, false, nullptr,
          "all-reduce, reduce-scatter, all-gather; broadcast and reduce as a chain; everything inside groups",
          "schedules of send / recv / recvReduceSend / recvCopySend steps per lane, run by the executor slot by "
          "slot over any connection",
          "2(N-1) steps, 2(N-1)/N x S (AR)"};
  *e++ = {"rhd", Algorithm::HalvingDoubling, kReduceScatterGather, nullptr, halvingDoublingEstimate,
          halvingDoublingRailCost, buildHalvingDoubling, false, nullptr, "all-reduce, reduce-scatter, all-gather",
          "recursive halving-doubling (Rabenseifner); non-powers of two fold the extra ranks in and out; "
          "reduce-scatter keeps partial sums in scratch",
          "2 log2 N steps, 2(N-1)/N x S (AR, N a power of 2)"};
  *e++ = {"tree", Algorithm::Tree, kRootedAndAllReduce, nullptr, doubleBinaryTreeEstimate, doubleBinaryTreeRailCost,
          buildTree, false, nullptr, "all-reduce, broadcast, reduce",
          "double binary tree: two complementary trees on two channels, each carrying half of the data, pipelined "
          "in chunks; reduce keeps partial sums in scratch",
          "2 log2 N steps, <= 2S (AR)"};
  *e++ = {"hier", Algorithm::Hierarchical, kReduceScatterGather, nullptr, hierarchicalEstimate, nullptr,
          buildHierarchical, false, nullptr,
          "all-reduce, reduce-scatter, all-gather over ranks grouped by host (any sizes, e.g. 3+1)",
          "intra-host ring reduce-scatter, per-rail inter-host all-reduce with the named flat algorithm, "
          "intra-host ring all-gather; RS/AG use the rails directly",
          "each host sends 2(H-1)/H x S across hosts (flat ring over contiguous hosts: 2(N-1)/N x S from each "
          "host)"};
  *e++ = {"pairwise", Algorithm::Pairwise, kExchanges, nullptr, pairwiseEstimate, nullptr, buildPairwise, false,
          nullptr, "all-to-all, gather, scatter",
          "every pair at once: a send lane to r+k and a receive lane from r-k for each k; gather and scatter: the "
          "root's N-1 lanes",
          "1 step, (N-1)/N x S (all-to-all; the root of gather/scatter likewise, other ranks S/N)"};
  *e++ = {"bruck", Algorithm::Bruck, collectiveBit(Collective::AllToAll), nullptr, bruckEstimate, nullptr,
          buildBruck, false, nullptr, "all-to-all (small blocks)",
          "Bruck: rotate, then in round k send the blocks whose index has bit k set to r+2^k (packed in scratch), "
          "then put the blocks in place",
          "ceil(log2 N) steps, about log2 N / 2 x S"};
  return t;
}

// Index by Algorithm value, for the per-operation lookup.
constexpr size_t kAlgorithmValues = 8;
struct Registry {
  std::vector<AlgorithmEntry> entries = makeRegistry();
  const AlgorithmEntry* byAlgo[kAlgorithmValues] = {};
  Registry() {
    for (const AlgorithmEntry& e : entries) {
      if (size_t(e.algo) >= kAlgorithmValues || byAlgo[size_t(e.algo)])
        fail(loomInternalError, "algorithm registry: %s: value out of range or registered twice", e.name);
      byAlgo[size_t(e.algo)] = &e;
    }
  }
};

const Registry& registry() {
  static const Registry r;
  return r;
}

const char kHierPrefix[] = "hier-";

}  // namespace

const std::vector<AlgorithmEntry>& algorithmRegistry() { return registry().entries; }

namespace {
const AlgorithmEntry* findEntry(Algorithm a) { return size_t(a) < kAlgorithmValues ? registry().byAlgo[size_t(a)] : nullptr; }
}  // namespace

LOOM_HOT const AlgorithmEntry& algorithmEntry(Algorithm a) {
  const AlgorithmEntry* e = findEntry(a);
  if (!e) fail(loomInternalError, "algorithm %d is not in the registry", int(a));
  return *e;
}

const char* algorithmName(Algorithm a) {
  const AlgorithmEntry* e = findEntry(a);
  return e ? e->name : "?";
}

bool parseAlgorithmName(const std::string& name, AlgorithmChoice* out) {
  for (const AlgorithmEntry& e : algorithmRegistry())
    if (name == e.name) {
      *out = AlgorithmChoice{e.algo, Algorithm::Ring};
      return true;
    }
  if (name.rfind(kHierPrefix, 0) != 0) return false;
  std::string inner = name.substr(sizeof kHierPrefix - 1);
  for (const AlgorithmEntry& e : algorithmRegistry())
    if (e.railCost && inner == e.name) {
      *out = AlgorithmChoice{Algorithm::Hierarchical, e.algo};
      return true;
    }
  return false;
}

std::string choiceName(Algorithm algo, Algorithm inner) {
  std::string n = algorithmName(algo);
  if (algo == Algorithm::Hierarchical) n += std::string("-") + algorithmName(inner);
  return n;
}

namespace {
std::vector<std::string> hierNames() {
  std::vector<std::string> v;
  for (const AlgorithmEntry& e : algorithmRegistry())
    if (e.railCost) v.push_back(kHierPrefix + std::string(e.name));
  return v;
}
}  // namespace

std::string algorithmNames() {
  std::string s;
  for (const AlgorithmEntry& e : algorithmRegistry()) s += (s.empty() ? "" : ", ") + std::string(e.name);
  for (const std::string& h : hierNames()) s += ", " + h;
  return s;
}

std::string collectiveList(CollectiveSet set) {
  static const char* kNames[kCollectiveValues] = {"",          "all-reduce", "reduce-scatter", "all-gather",
                                                  "broadcast", "reduce",     "send/recv",      "all-to-all",
                                                  "gather",    "scatter"};
  std::vector<std::string> v;
  for (int c = 1; c < kCollectiveValues; ++c)
    if (set & collectiveBit(Collective(c))) v.push_back(kNames[c]);
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? " and " : ", ") + v[i];
  return s;
}

LOOM_HOT bool usable(const AlgorithmEntry& a, const Eligibility& q) {
  return (a.serves & collectiveBit(q.coll)) && (!a.eligible || !a.eligible(q));
}

std::string whyIneligible(const AlgorithmEntry& a, const Eligibility& q) {
  if (!(a.serves & collectiveBit(q.coll))) return "it serves " + collectiveList(a.serves);
  const char* why = a.eligible ? a.eligible(q) : nullptr;
  return why ? why : "";
}

Algorithm scheduledFallback(Collective c) {
  for (const AlgorithmEntry& e : algorithmRegistry())
    if (e.build && (e.serves & collectiveBit(c)) && !e.eligible) return e.algo;
  fail(loomInternalError, "no scheduled algorithm serves %s", collectiveName(c));
}

void buildSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const std::vector<int>& hostOf,
                   const Plan& plan, Schedule* out) {
  const AlgorithmEntry& e = algorithmEntry(plan.algo);
  BuildFn build = e.build && (e.serves & collectiveBit(op.coll)) ? e.build
                                                                 : algorithmEntry(scheduledFallback(op.coll)).build;
  build(op, opIndex, rank, nranks, hostOf, plan, out);
}

std::string algorithmTableMarkdown() {
  std::string s = "| algorithm (`LOOM_ALGO`) | serves | how | steps / bytes sent per rank (S = buffer) |\n"
                  "|---|---|---|---|\n";
  for (const AlgorithmEntry& e : algorithmRegistry()) {
    std::string name = strf("`%s`", e.name);
    if (e.algo == Algorithm::Hierarchical) {
      std::string inner;
      for (const std::string& h : hierNames()) inner += (inner.empty() ? "" : ", ") + ("`" + h + "`");
      name += " (" + inner + ")";
    }
    s += strf("| %s | %s | %s | %s |\n", name.c_str(), e.servesText, e.how, e.volume);
  }
  return s;
}

}  // namespace loom
