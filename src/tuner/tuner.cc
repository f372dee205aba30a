#include "src/tuner/tuner.h"

#include <algorithm>
#include <atomic>

#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

// LOOM_ALGO's collective keys, per Collective value.
const char* kCollKeys[kCollectiveValues] = {"",       "allreduce", "reducescatter", "allgather", "broadcast",
                                            "reduce", "p2p",       "alltoall",      "gather",    "scatter"};

}  // namespace

Tuner::Tuner(const Config& cfg) {
  const std::string& spec = cfg.algo;
  Forced global;
  size_t pos = 0;
  while (!spec.empty() && pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    size_t colon = item.find(':');
    Forced f;
    f.name = colon == std::string::npos ? item : item.substr(colon + 1);
    if (!parseAlgorithmName(f.name, &f.choice))
      LOOM_WARN("TUNE", "LOOM_ALGO: unknown algorithm '%s' (this build has %s); ignored", f.name.c_str(),
                algorithmNames().c_str());
    else if (colon == std::string::npos)
      global = f;
    else {
      std::string coll = item.substr(0, colon);
      bool known = false;
      for (Collective c : kTunedCollectives)
        if (coll == kCollKeys[int(c)]) forced_[int(c)] = f, known = true;
      if (!known) LOOM_WARN("TUNE", "LOOM_ALGO: unknown collective '%s'; ignored", coll.c_str());
    }
    pos = end + 1;
  }
  for (Collective c : kTunedCollectives)
    if (forced_[int(c)].name.empty()) forced_[int(c)] = global;
  channels_ = int(cfg.channels);
  chunkBytes_ = cfg.chunkBytes > 0 ? size_t(cfg.chunkBytes) : kDefaultChunkBytes;
  params_ = CostParams::defaults();
  if (!cfg.tuningFile.empty()) {
    std::string why;
    CostParams loaded = params_;
    if (loaded.load(cfg.tuningFile, &why)) params_ = loaded;
    else LOOM_WARN("TUNE", "LOOM_TUNING_FILE: %s; using the built-in parameters", why.c_str());
  }
}

int Tuner::bucketOf(size_t bytes) {
  int b = 0;
  while (b < kBuckets - 1 && (size_t(1) << b) < bytes) ++b;
  return b;
}

void Tuner::setShape(const CommShape& shape) {
  shape_ = shape;
  haveShape_ = true;
  for (Collective c : kTunedCollectives)
    for (int b = 0; b < kBuckets; ++b)
      decided_[int(c)][b] = cheapest(estimateAll(c, size_t(1) << b, shape_, params_));
}

void Tuner::adopt(Collective coll, int bucket, Algorithm algo, Algorithm inner) {
  Estimate& e = decided_[int(coll)][bucket];
  if (e.algo == algo && e.inner == inner) return;
  for (const Estimate& x : estimateAll(coll, size_t(1) << bucket, shape_, params_))
    if (x.algo == algo && x.inner == inner) {
      e = x;
      return;
    }
  e = Estimate{algo, inner, 0, ""};
}

std::string Tuner::describeDecisions(Collective coll) const {
  auto name = [](const Estimate& e) { return choiceName(e.algo, e.inner); };
  auto size = [](int b) {
    if (b >= 30) return strf("%zuG", size_t(1) << (b - 30));
    if (b >= 20) return strf("%zuM", size_t(1) << (b - 20));
    if (b >= 10) return strf("%zuK", size_t(1) << (b - 10));
    return strf("%zu", size_t(1) << b);
  };
  std::string out;
  for (int b = 0; b < kBuckets; ++b) {
    const Estimate& e = decided_[int(coll)][b];
    bool last = b + 1 == kBuckets || name(decided_[int(coll)][b + 1]) != name(e);
    if (!last) continue;
    out += (out.empty() ? "" : ", ") + name(e) + (b + 1 == kBuckets ? "" : " <= " + size(b));
  }
  return out;
}

std::vector<Estimate> Tuner::estimates(Collective coll, size_t bytes) const {
  return estimateAll(coll, bytes, shape_, params_);
}

LOOM_HOT Plan Tuner::choose(const OpDesc& op, int nranks, const TunerLimits& limits) const {
  Plan plan;
  plan.channels = std::max(1, std::min(channels_ > 0 ? channels_ : 1, limits.maxChannels));
  plan.chunkBytes = chunkBytes_;
  if (limits.maxChunkBytes && plan.chunkBytes > limits.maxChunkBytes) plan.chunkBytes = limits.maxChunkBytes;
  const Forced& forced = forced_[int(op.coll) < kCollectiveValues ? int(op.coll) : 0];
  size_t block = op.count * dtypeSize(op.dtype);
  // The limits are zero unless every rank shares memory.
  const Eligibility q{op.coll, nranks, double(block), nranks > 1, limits.oneShotBytes, limits.stageBytes};
  if (!forced.name.empty()) {
    const AlgorithmEntry& a = algorithmEntry(forced.choice.algo);
    if (usable(a, q)) {
      plan.algo = forced.choice.algo;
      plan.inner = forced.choice.inner;
    } else {
      plan.algo = scheduledFallback(op.coll);
      // Once per collective and process: the reason, not a line per call.
      static std::atomic<unsigned> warned{0};
      unsigned bit = 1u << unsigned(op.coll);
      if (!(warned.fetch_or(bit) & bit))
        LOOM_WARN("TUNE", "LOOM_ALGO=%s cannot serve %s (%s); using %s", forced.name.c_str(),
                  collectiveName(op.coll), whyIneligible(a, q).c_str(), algorithmName(plan.algo));
    }
    return plan;
  }
  if (haveShape_ && nranks == shape_.nranks && op.coll != Collective::P2P) {
    // The cost model's choice for this size bucket (whole-buffer bytes, as
    // loom-perf and the model count them).
    size_t bytes = perRankCount(op.coll) ? block * size_t(nranks) : block;
    const Estimate& e = decided_[int(op.coll)][bucketOf(bytes)];
    // The decision is per bucket; a direct path's limit is checked against this block.
    if (e.us >= 0 && usable(algorithmEntry(e.algo), q)) {
      plan.algo = e.algo;
      plan.inner = e.inner;
      return plan;
    }
  }
  for (const AlgorithmEntry& a : algorithmRegistry())
    if (a.direct && usable(a, q)) {
      plan.algo = a.algo;
      return plan;
    }
  plan.algo = Algorithm::Ring;
  return plan;
}

}  // namespace loom
