// The tuner's cost model (src/tuner/cost_model.cc) on synthetic shapes and
// link parameters: the choice flips where the model says it should, the
// tuning file is read strictly, and forced algorithms still win.
#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <string>

#include <unistd.h>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/tuner/tuner.h"

namespace {

using loom::Algorithm;
using loom::Collective;

loom::CommShape shape(int hosts, int perHost, loom::CostLink net = loom::CostLink::Tcp) {
  loom::CommShape s;
  s.nranks = hosts * perHost;
  for (int h = 0; h < hosts; ++h)
    for (int r = 0; r < perHost; ++r) s.hostOf.push_back(h);
  s.cores.assign(size_t(hosts), 64);
  s.network = net;
  return s;
}

loom::Estimate pick(Collective c, size_t bytes, const loom::CommShape& s, const loom::CostParams& p) {
  return loom::cheapest(loom::estimateAll(c, bytes, s, p));
}

std::string table(Collective c, const loom::CommShape& s, const loom::CostParams& p) {
  std::string out;
  for (size_t b = 8; b <= (size_t(1) << 28); b *= 16) {
    out += loom::strf("%10zu:", b);
    for (const loom::Estimate& e : loom::estimateAll(c, b, s, p))
      if (e.us >= 0) out += loom::strf(" %s%s%s=%.1f", loom::algorithmName(e.algo), e.algo == Algorithm::Hierarchical ? "-" : "",
                                       e.algo == Algorithm::Hierarchical ? loom::algorithmName(e.inner) : "", e.us);
    out += "\n";
  }
  return out;
}

}  // namespace

TEST_CASE("tuner: latency-optimal for small messages, bandwidth-optimal for large ones", "[tuner]") {
  // 16 hosts of one rank over a fast-latency, slow-bandwidth network: the
  // ring's 2(N-1) steps lose at 8 B to log-step algorithms, and win (with
  // rhd, which moves the same bytes) at 256 MiB over the tree.
  loom::CostParams p = loom::CostParams::defaults();
  p.link[int(loom::CostLink::Tcp)] = {10.0, 1.0};
  loom::CommShape s = shape(16, 1);
  INFO(table(Collective::AllReduce, s, p));
  INFO("8 B: " << loom::algorithmName(pick(Collective::AllReduce, 8, s, p).algo) << ", 256 MiB: "
               << loom::algorithmName(pick(Collective::AllReduce, size_t(256) << 20, s, p).algo));
  loom::Estimate small = pick(Collective::AllReduce, 8, s, p);
  CHECK((small.algo == Algorithm::HalvingDoubling || small.algo == Algorithm::Tree));
  loom::Estimate large = pick(Collective::AllReduce, size_t(256) << 20, s, p);
  CHECK((large.algo == Algorithm::Ring || large.algo == Algorithm::HalvingDoubling ||
         (large.algo == Algorithm::Hierarchical && large.inner == Algorithm::Ring)));
  CHECK(large.algo != Algorithm::Tree);
  // Where rhd has no power of two it folds (an extra whole-buffer exchange):
  // at 15 ranks the ring takes over for large messages.
  loom::CommShape s15 = shape(15, 1);
  INFO(table(Collective::AllReduce, s15, p));
  CHECK(pick(Collective::AllReduce, size_t(256) << 20, s15, p).algo == Algorithm::Ring);
}

TEST_CASE("tuner: slow links between hosts make the hierarchical algorithm win for large messages", "[tuner]") {
  loom::CostParams p = loom::CostParams::defaults();
  p.link[int(loom::CostLink::Tcp)] = {50.0, 0.125};  // 1 Gbit/s
  loom::CommShape s = shape(2, 2);
  INFO(table(Collective::AllReduce, s, p));
  CHECK(pick(Collective::AllReduce, size_t(64) << 20, s, p).algo == Algorithm::Hierarchical);
  CHECK(pick(Collective::ReduceScatter, size_t(64) << 20, s, p).algo == Algorithm::Hierarchical);
  CHECK(pick(Collective::AllGather, size_t(64) << 20, s, p).algo == Algorithm::Hierarchical);
  // With a network as fast as shared memory there is nothing to save.
  p.link[int(loom::CostLink::Tcp)] = p.link[int(loom::CostLink::Shm)];
  CHECK(pick(Collective::AllReduce, size_t(64) << 20, s, p).algo != Algorithm::Hierarchical);
}

TEST_CASE("tuner: one host uses the shared-memory direct paths where they apply", "[tuner]") {
  loom::CostParams p = loom::CostParams::defaults();
  loom::CommShape s = shape(1, 4);
  s.oneShotBytes = 16 << 10;
  s.stageBytes = 256 << 10;
  CHECK(pick(Collective::AllReduce, 8, s, p).algo == Algorithm::OneShot);
  // More ranks than cores: every ring step waits for a wake-up, and the
  // staged path's two synchronisations per stage beat the ring's 2(N-1).
  auto us = [&](Algorithm a, size_t bytes) {
    for (const loom::Estimate& e : loom::estimateAll(Collective::AllReduce, bytes, s, p))
      if (e.algo == a) return e.us;
    return -1.0;
  };
  double ringFree = us(Algorithm::Ring, 1 << 20), stagedFree = us(Algorithm::Staged, 1 << 20);
  s.cores = {2};
  CHECK(us(Algorithm::Staged, 1 << 20) < us(Algorithm::Ring, 1 << 20));
  CHECK(us(Algorithm::Ring, 1 << 20) - ringFree > us(Algorithm::Staged, 1 << 20) - stagedFree);
  CHECK(pick(Collective::AllReduce, size_t(1) << 20, s, p).algo != Algorithm::Ring);
  CHECK(pick(Collective::AllReduce, 8, s, p).algo == Algorithm::OneShot);
  // Hierarchical needs two hosts; staged needs all-reduce.
  for (const loom::Estimate& e : loom::estimateAll(Collective::AllGather, 1 << 20, s, p)) {
    if (e.algo == Algorithm::Hierarchical || e.algo == Algorithm::Staged) CHECK(e.us < 0);
  }
  s.shmWithinHost = false;  // LOOM_TRANSPORTS=tcp
  CHECK(pick(Collective::AllReduce, 8, s, p).algo != Algorithm::OneShot);
}

TEST_CASE("tuner: the tuning file replaces parameters and rejects nonsense", "[tuner]") {
  std::string path = "/tmp/loom-tuner-test-" + std::to_string(getpid()) + ".txt";
  {
    std::ofstream f(path);
    f << "# measured\nshm.alpha_us = 2.5\ntcp.beta_GBps=0.125  # 1 Gbit/s\n\nreduce.GBps = 7\n";
  }
  loom::CostParams p = loom::CostParams::defaults();
  std::string why;
  REQUIRE(p.load(path, &why));
  CHECK(p.link[int(loom::CostLink::Shm)].alphaUs == 2.5);
  CHECK(p.link[int(loom::CostLink::Tcp)].betaGBps == 0.125);
  CHECK(p.reduceGBps == 7);
  CHECK(p.source == path);
  for (const char* bad : {"shm.alpha_us = -1\n", "nonsense = 3\n", "tcp.beta_GBps\n", "tcp.beta_GBps = 1x\n"}) {
    std::ofstream(path) << bad;
    loom::CostParams q = loom::CostParams::defaults();
    INFO(bad);
    CHECK_FALSE(q.load(path, &why));
    CHECK(why.find(path) != std::string::npos);
  }
  CHECK_FALSE(p.load("/nonexistent/tuning", &why));
  unlink(path.c_str());
}

TEST_CASE("tuner: LOOM_ALGO wins over the model and decisions are per size bucket", "[tuner]") {
  CHECK(loom::Tuner::bucketOf(1) == 0);
  CHECK(loom::Tuner::bucketOf(8) == 3);
  CHECK(loom::Tuner::bucketOf(9) == 4);
  CHECK(loom::Tuner::bucketOf(size_t(1) << 20) == 20);
  loom::Config cfg = loom::config();
  cfg.algo = "allreduce:hier-tree";
  loom::Tuner t(cfg);
  loom::CommShape s = shape(2, 2);
  t.setShape(s);
  loom::OpDesc op;
  op.count = 1 << 20;
  loom::TunerLimits lim;
  lim.maxChannels = 4;
  loom::Plan plan = t.choose(op, 4, lim);
  CHECK(plan.algo == Algorithm::Hierarchical);
  CHECK(plan.inner == Algorithm::Tree);
  // Unforced: the model's decision for the bucket.
  op.coll = Collective::AllGather;
  op.count = 1 << 18;  // x 4 ranks x 4 bytes = 4 MiB
  plan = t.choose(op, 4, lim);
  CHECK(plan.algo == t.decided(Collective::AllGather, 22).algo);
}
