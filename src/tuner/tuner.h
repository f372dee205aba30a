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
  Plan choose(const OpDesc& op, int nranks, const TunerLimits& limits) const;

 private:
  std::string forced_[7];  // per Collective value, "" = not forced
  int channels_;
  size_t chunkBytes_;
};

}  // namespace loom
