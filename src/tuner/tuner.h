// The tuner: (operation, communicator shape) -> Plan.  The decision lives
// here in one place, as data that LOOM_ALGO / LOOM_CHUNK_SIZE /
// LOOM_NCHANNELS override and that tools can print.
//
// Today's table:
//   one-shot  all ranks share memory and each rank's block is at most
//             LOOM_SHM_SMALL_BYTES: one round through shared-memory
//             mailboxes (latency ~ one cache-line transfer)
//   staged    all-reduce when all ranks share memory and the block is larger:
//             every rank copies a chunk into its staging buffer, reduces its
//             1/N of all staging buffers, then gathers the other parts; two
//             synchronisations per chunk whatever N is (the ring has 2(N-1)),
//             which matters most when ranks outnumber cores
//   ring      everything else (bandwidth-optimal over point-to-point links)
#pragma once
#include <string>

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
  // Without a shape the fixed table above decides.
  void setShape(const CommShape& shape);
  Plan choose(const OpDesc& op, int nranks, const TunerLimits& limits) const;
  // The model's estimates for one (collective, bytes) on the shape.
  std::vector<Estimate> estimates(Collective coll, size_t bytes) const;
  const CostParams& params() const { return params_; }
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
  std::string forced_[7];  // per Collective value, "" = not forced
  int channels_;
  size_t chunkBytes_;
  CostParams params_;
  CommShape shape_;
  bool haveShape_ = false;
  Estimate decided_[7][kBuckets];  // per Collective value and size bucket
};

}  // namespace loom
