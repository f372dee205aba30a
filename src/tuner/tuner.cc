#include "src/tuner/tuner.h"

#include <algorithm>

#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

// Default ring chunk: a ring loop then covers nranks x 128 KiB, small enough
// to stay in L2 while a slot is reduced and forwarded.  (From loom-perf
// all_reduce sweeps of LOOM_CHUNK_SIZE 32K..1M on the 2-core dev machine.)
constexpr size_t kDefaultChunkBytes = 128 << 10;

const char* kCollKeys[] = {"", "allreduce", "reducescatter", "allgather", "broadcast", "reduce", "p2p"};

}  // namespace

Tuner::Tuner(const Config& cfg) {
  const std::string& spec = cfg.algo;
  std::string global;
  size_t pos = 0;
  while (!spec.empty() && pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    size_t colon = item.find(':');
    std::string algo = colon == std::string::npos ? item : item.substr(colon + 1);
    if (algo != "ring" && algo != "oneshot" && algo != "staged")
      LOOM_WARN("TUNE", "LOOM_ALGO: unknown algorithm '%s' (this build has ring, oneshot, staged); ignored",
                algo.c_str());
    else if (colon == std::string::npos)
      global = algo;
    else {
      std::string coll = item.substr(0, colon);
      bool known = false;
      for (int c = 1; c <= 5; ++c)
        if (coll == kCollKeys[c]) forced_[c] = algo, known = true;
      if (!known) LOOM_WARN("TUNE", "LOOM_ALGO: unknown collective '%s'; ignored", coll.c_str());
    }
    pos = end + 1;
  }
  for (int c = 1; c <= 5; ++c)
    if (forced_[c].empty()) forced_[c] = global;
  channels_ = int(cfg.channels);
  chunkBytes_ = cfg.chunkBytes > 0 ? size_t(cfg.chunkBytes) : kDefaultChunkBytes;
}

Plan Tuner::choose(const OpDesc& op, int nranks, const TunerLimits& limits) const {
  Plan plan;
  plan.channels = std::max(1, std::min(channels_ > 0 ? channels_ : 1, limits.maxChannels));
  plan.chunkBytes = chunkBytes_;
  const std::string& forced = forced_[int(op.coll) < 7 ? int(op.coll) : 0];
  size_t block = op.count * dtypeSize(op.dtype);
  bool oneShotOk = op.coll != Collective::P2P && nranks > 1 && limits.oneShotBytes > 0 &&
                   block <= limits.oneShotBytes;
  bool stagedOk = op.coll == Collective::AllReduce && nranks > 1 && limits.stageBytes > 0;
  if (forced == "ring") plan.algo = Algorithm::Ring;
  else if (forced == "oneshot" && oneShotOk) plan.algo = Algorithm::OneShot;
  else if (forced == "staged" && stagedOk) plan.algo = Algorithm::Staged;
  else if (!forced.empty() && forced != "ring" && !oneShotOk && !stagedOk) {
    plan.algo = Algorithm::Ring;
    LOOM_INFO("TUNE", "%s cannot serve %s of %zu B here; using ring", forced.c_str(), collectiveName(op.coll), block);
  } else if (oneShotOk) plan.algo = Algorithm::OneShot;
  else if (stagedOk) plan.algo = Algorithm::Staged;
  else plan.algo = Algorithm::Ring;
  return plan;
}

}  // namespace loom
