// The tuner: (operation, communicator shape) -> Plan.  The decision lives
// here in one place, as data that LOOM_ALGO / LOOM_CHUNK_SIZE /
// LOOM_NCHANNELS override and that tools can print.
//
// The candidates are the algorithm registry's entries (algorithms/registry.h):
// each says which collectives it serves, when it can run and what it costs.
// Given the communicator's shape, the alpha-beta cost model
// (src/tuner/cost_model.h) estimates every eligible entry for each collective
// and power-of-two size bucket once, and the cheapest is the decision; rank
// 0's decisions are adopted by every rank.  Per operation the tuner only
// looks up the bucket's decision and checks the direct paths' limits against
// the real block size.  LOOM_ALGO, globally or per collective, replaces the
// model's choice by any registry name ("hier-<inner>" for the hierarchical
// algorithm over an inner one); a name that cannot serve an operation falls
// back to the ring with a one-time warning that says why.  Without a shape
// (the communicator has not given one) the first direct path that can run
// serves, else the ring.
#pragma once
#include <string>

#include "algorithms/registry.h"
#include "algorithms/schedule.h"
#include "src/core/config.h"
#include "src/tuner/cost_model.h"

namespace loom {

struct TunerLimits {
  int maxChannels = 1;
  size_t oneShotBytes = 0;  // 0: the one-shot path is unavailable
  size_t stageBytes = 0;    // 0: the staged path is unavailable
  // A ring chunk that fills a connection's whole slot ring deadlocks: every
  // rank's first step of a loop is a pure send.  Chunks stay below this.
  size_t maxChunkBytes = 0; // 0: no cap
};

class Tuner {
 public:
  explicit Tuner(const Config& cfg);
  // Gives the cost model the communicator's shape (hosts, NUMA, transports,
  // direct-path limits) and decides every (collective, size bucket) once.
  // Without a shape the fallback above decides.
  void setShape(const CommShape& shape);
  Plan choose(const OpDesc& op, int nranks, const TunerLimits& limits) const;
  // The model's estimates for one (collective, bytes) on the shape.
  std::vector<Estimate> estimates(Collective coll, size_t bytes) const;
  const CostParams& params() const { return params_; }
  // Whether LOOM_ALGO names the algorithm of `coll`.
  bool forced(Collective coll) const { return !forced_[int(coll)].name.empty(); }
  const CommShape& shape() const { return shape_; }
  bool modelled() const { return haveShape_; }
  // The decision for one bucket, and replacing it (with another rank's, so
  // that all ranks of a communicator agree).
  const Estimate& decided(Collective coll, int bucket) const { return decided_[int(coll)][bucket]; }
  void adopt(Collective coll, int bucket, Algorithm algo, Algorithm inner);
  // "oneshot <= 16K, staged <= 64M, ..." for one collective (bytes as the
  // model counts them), for logs and loom-topo.
  std::string describeDecisions(Collective coll) const;

  static constexpr int kBuckets = 48;  // sizes 2^0 .. 2^47 bytes
  // Size bucket: the smallest b with bytes <= 2^b.
  static int bucketOf(size_t bytes);

 private:
  struct Forced {
    std::string name;  // as LOOM_ALGO spells it; "" = not forced
    AlgorithmChoice choice;
  };
  Forced forced_[kCollectiveValues];
  int channels_;
  size_t chunkBytes_;
  CostParams params_;
  CommShape shape_;
  bool haveShape_ = false;
  Estimate decided_[kCollectiveValues][kBuckets];  // per Collective value and size bucket
};

}  // namespace loom
