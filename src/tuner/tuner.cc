#include "src/tuner/tuner.h"

#include <algorithm>
#include <atomic>

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

const char* whatItServes(const std::string& algo) {
  if (algo == "oneshot") return "it needs every rank to share memory and blocks of at most LOOM_SHM_SMALL_BYTES";
  if (algo == "staged") return "it serves all-reduce when every rank shares memory";
  if (algo == "rhd") return "it serves all-reduce, reduce-scatter and all-gather";
  if (algo == "tree") return "it serves all-reduce, broadcast and reduce";
  if (algo.rfind("hier", 0) == 0) return "it serves all-reduce, reduce-scatter and all-gather";
  return "unknown algorithm";
}

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
    static const char* known[] = {"ring", "oneshot", "staged", "rhd", "tree", "hier", "hier-ring", "hier-rhd", "hier-tree"};
    if (std::find(std::begin(known), std::end(known), algo) == std::end(known))
      LOOM_WARN("TUNE",
                "LOOM_ALGO: unknown algorithm '%s' (this build has ring, oneshot, staged, rhd, tree, hier, "
                "hier-ring, hier-rhd, hier-tree); ignored",
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
  for (int c = 1; c <= 5; ++c)
    for (int b = 0; b < kBuckets; ++b)
      decided_[c][b] = cheapest(estimateAll(Collective(c), size_t(1) << b, shape_, params_));
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
  auto name = [](const Estimate& e) {
    std::string n = algorithmName(e.algo);
    if (e.algo == Algorithm::Hierarchical) n += std::string("-") + algorithmName(e.inner);
    return n;
  };
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

Plan Tuner::choose(const OpDesc& op, int nranks, const TunerLimits& limits) const {
  Plan plan;
  plan.channels = std::max(1, std::min(channels_ > 0 ? channels_ : 1, limits.maxChannels));
  plan.chunkBytes = chunkBytes_;
  if (limits.maxChunkBytes && plan.chunkBytes > limits.maxChunkBytes) plan.chunkBytes = limits.maxChunkBytes;
  const std::string& forced = forced_[int(op.coll) < 7 ? int(op.coll) : 0];
  size_t block = op.count * dtypeSize(op.dtype);
  bool oneShotOk = op.coll != Collective::P2P && nranks > 1 && limits.oneShotBytes > 0 &&
                   block <= limits.oneShotBytes;
  bool stagedOk = op.coll == Collective::AllReduce && nranks > 1 && limits.stageBytes > 0;
  bool rhdOk = op.coll == Collective::AllReduce || op.coll == Collective::ReduceScatter ||
               op.coll == Collective::AllGather;
  bool treeOk = op.coll == Collective::AllReduce || op.coll == Collective::Broadcast || op.coll == Collective::Reduce;
  if (!forced.empty()) {
    if (forced == "ring") plan.algo = Algorithm::Ring;
    else if (forced == "oneshot" && oneShotOk) plan.algo = Algorithm::OneShot;
    else if (forced == "staged" && stagedOk) plan.algo = Algorithm::Staged;
    else if (forced == "rhd" && rhdOk) plan.algo = Algorithm::HalvingDoubling;
    else if (forced == "tree" && treeOk) plan.algo = Algorithm::Tree;
    else if (forced.rfind("hier", 0) == 0 && rhdOk) {
      plan.algo = Algorithm::Hierarchical;
      plan.inner = forced == "hier-rhd" ? Algorithm::HalvingDoubling
                   : forced == "hier-tree" ? Algorithm::Tree
                                           : Algorithm::Ring;
    }
    else {
      plan.algo = Algorithm::Ring;
      // Once per collective and process: the reason, not a line per call.
      static std::atomic<unsigned> warned{0};
      unsigned bit = 1u << unsigned(op.coll);
      if (!(warned.fetch_or(bit) & bit))
        LOOM_WARN("TUNE", "LOOM_ALGO=%s cannot serve %s (%s); using ring", forced.c_str(),
                  collectiveName(op.coll), whatItServes(forced));
    }
    return plan;
  }
  if (haveShape_ && nranks == shape_.nranks && op.coll != Collective::P2P) {
    // The cost model's choice for this size bucket (whole-buffer bytes, as
    // loom-perf and the model count them).
    size_t bytes = rhdOk && op.coll != Collective::AllReduce ? block * size_t(nranks) : block;
    const Estimate& e = decided_[int(op.coll)][bucketOf(bytes)];
    bool ok = e.us >= 0 && (e.algo != Algorithm::OneShot || oneShotOk) && (e.algo != Algorithm::Staged || stagedOk);
    if (ok) {
      plan.algo = e.algo;
      plan.inner = e.inner;
      return plan;
    }
  }
  if (oneShotOk) plan.algo = Algorithm::OneShot;
  else if (stagedOk) plan.algo = Algorithm::Staged;
  else plan.algo = Algorithm::Ring;
  return plan;
}

}  // namespace loom
