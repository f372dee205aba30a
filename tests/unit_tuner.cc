// The tuner's cost model (src/tuner/cost_model.cc) on synthetic shapes and
// link parameters: the choice flips where the model says it should, the
// tuning file is read strictly, and forced algorithms still win.
#include "loom_catch.h"
#include <cstdio>
#include <fstream>
#include <string>

#include <unistd.h>

#include "src/core/config.h"
#include "src/core/error.h"
#include "algorithms/registry.h"
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

TEST_CASE("registry: every LOOM_ALGO name parses to its entry and back", "[tuner][registry]") {
  CHECK(loom::algorithmNames() == "oneshot, staged, ring, rhd, tree, hier, pairwise, bruck, hier-ring, hier-rhd, hier-tree");
  for (const loom::AlgorithmEntry& e : loom::algorithmRegistry()) {
    loom::AlgorithmChoice c;
    REQUIRE(loom::parseAlgorithmName(e.name, &c));
    CHECK(c.algo == e.algo);
    CHECK(&loom::algorithmEntry(e.algo) == &e);
    CHECK(std::string(loom::algorithmName(e.algo)) == e.name);
    // A direct path has no schedule; every other algorithm builds one.
    CHECK(e.direct == (e.build == nullptr));
    CHECK(e.estimate != nullptr);
  }
  loom::AlgorithmChoice c;
  REQUIRE(loom::parseAlgorithmName("hier-rhd", &c));
  CHECK((c.algo == Algorithm::Hierarchical && c.inner == Algorithm::HalvingDoubling));
  REQUIRE(loom::parseAlgorithmName("hier", &c));
  CHECK((c.algo == Algorithm::Hierarchical && c.inner == Algorithm::Ring));
  CHECK(loom::choiceName(c.algo, c.inner) == "hier-ring");
  CHECK_FALSE(loom::parseAlgorithmName("hier-oneshot", &c));
  CHECK_FALSE(loom::parseAlgorithmName("bogus", &c));
  CHECK(loom::collectiveList(loom::algorithmEntry(Algorithm::Tree).serves) == "all-reduce, broadcast and reduce");
}

TEST_CASE("registry: a forced algorithm that cannot serve falls back to the ring, as before", "[tuner][registry]") {
  loom::Config cfg = loom::config();
  cfg.algo = "broadcast:rhd,allgather:staged,reduce:oneshot,allreduce:oneshot";
  loom::Tuner t(cfg);
  loom::TunerLimits lim;
  lim.maxChannels = 4;
  lim.oneShotBytes = 16 << 10;
  loom::OpDesc op;
  op.coll = Collective::Broadcast;
  op.count = 10;
  CHECK(t.choose(op, 4, lim).algo == Algorithm::Ring);  // rhd does not serve broadcast
  op.coll = Collective::AllGather;
  CHECK(t.choose(op, 4, lim).algo == Algorithm::Ring);  // staged serves all-reduce only
  op.coll = Collective::Reduce;
  CHECK(t.choose(op, 4, lim).algo == Algorithm::OneShot);
  op.count = 1 << 20;  // 4 MiB blocks: above the one-shot limit
  CHECK(t.choose(op, 4, lim).algo == Algorithm::Ring);
  op.coll = Collective::AllReduce;
  op.count = 10;
  CHECK(t.choose(op, 1, lim).algo == Algorithm::Ring);  // one rank: nothing to share
  loom::Eligibility q{Collective::AllGather, 4, 64, true, 16 << 10, 256 << 10};
  CHECK(loom::whyIneligible(loom::algorithmEntry(Algorithm::Staged), q) == "it serves all-reduce");
  q.coll = Collective::AllReduce;
  q.allShm = false;
  CHECK(loom::whyIneligible(loom::algorithmEntry(Algorithm::OneShot), q) == "it needs every rank to share memory");
  CHECK(loom::whyIneligible(loom::algorithmEntry(Algorithm::Ring), q).empty());
}

// Printed by the cost model before the registry (commit 08671b6).
#define PINNED_DECISIONS "oneshot=0.202291 staged=7.00887 staged=1563.87 hier-ring=18.805 hier-rhd=673.173 hier-rhd=167742 hier-ring=9.40269 hier-ring=371.801 hier-ring=95181.1 hier-ring=9.40229 hier-ring=319.372 hier-ring=81759.3 ring=36.0042 ring=650.882 ring=159741 ring=36.0046 ring=703.311 ring=173163 "
#define PINNED_HIER_TREE_US 0x1.3b438e3aac395p+10
#define PINNED_RHD_RS_US 0x1.b9bdf25511449p+10

TEST_CASE("registry: the model's decisions and numbers are pinned", "[tuner][registry]") {
  // Values from the cost model before the registry (default parameters);
  // the registry moved the formulas, it must not change them.
  loom::CostParams p = loom::CostParams::defaults();
  loom::CommShape one = shape(1, 4);
  one.oneShotBytes = 16 << 10;
  one.stageBytes = 256 << 10;
  auto usOf = [&](Collective c, size_t bytes, const loom::CommShape& s, Algorithm a, Algorithm inner) {
    for (const loom::Estimate& e : loom::estimateAll(c, bytes, s, p))
      if (e.algo == a && e.inner == inner) return e.us;
    return -2.0;
  };
  std::string got;
  for (size_t bytes : {size_t(8), size_t(64) << 10, size_t(16) << 20}) {
    loom::Estimate e = pick(Collective::AllReduce, bytes, one, p);
    got += loom::strf("%s=%.6g ", loom::choiceName(e.algo, e.inner).c_str(), e.us);
  }
  loom::CommShape two = shape(2, 2);
  // The collectives the model had then (all-to-all, gather and scatter came later).
  for (Collective c : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather, Collective::Broadcast,
                       Collective::Reduce})
    for (size_t bytes : {size_t(8), size_t(1) << 20, size_t(256) << 20}) {
      loom::Estimate e = pick(c, bytes, two, p);
      got += loom::strf("%s=%.6g ", loom::choiceName(e.algo, e.inner).c_str(), e.us);
    }
  INFO(got);
  CHECK(got == PINNED_DECISIONS);
  CHECK(usOf(Collective::AllReduce, size_t(1) << 20, two, Algorithm::Hierarchical, Algorithm::Tree) == PINNED_HIER_TREE_US);
  CHECK(usOf(Collective::ReduceScatter, size_t(1) << 20, two, Algorithm::HalvingDoubling, Algorithm::Ring) ==
        PINNED_RHD_RS_US);
}

TEST_CASE("tuner: all-to-all goes one-shot, pairwise or Bruck as the model says, gather and scatter never Bruck",
          "[tuner][exchange]") {
  loom::CostParams p = loom::CostParams::defaults();
  loom::CommShape one = shape(1, 8);
  one.oneShotBytes = 16 << 10;
  one.stageBytes = 256 << 10;
  // One host: small blocks through the mailboxes, large ones pairwise.
  CHECK(pick(Collective::AllToAll, 8 * 64, one, p).algo == Algorithm::OneShot);
  CHECK(pick(Collective::AllToAll, size_t(64) << 20, one, p).algo == Algorithm::Pairwise);
  // 32 hosts over tcp: 31 messages cost more than 5 rounds for small blocks;
  // for large ones Bruck's extra bytes (about log2 N / 2 x S) lose.
  loom::CommShape wide = shape(32, 1);
  CHECK(pick(Collective::AllToAll, 32 * 8, wide, p).algo == Algorithm::Bruck);
  CHECK(pick(Collective::AllToAll, size_t(32) << 20, wide, p).algo == Algorithm::Pairwise);
  // 4 hosts: few messages, pairwise at every size.
  loom::CommShape four = shape(4, 1);
  for (size_t bytes : {size_t(32), size_t(1) << 20})
    CHECK(pick(Collective::AllToAll, bytes, four, p).algo == Algorithm::Pairwise);
  for (Collective c : {Collective::Gather, Collective::Scatter}) {
    CHECK(pick(c, 32 * 8, wide, p).algo == Algorithm::Pairwise);
    CHECK(pick(c, 8 * 64, one, p).algo == Algorithm::OneShot);
    CHECK(loom::whyIneligible(loom::algorithmEntry(Algorithm::Bruck), loom::Eligibility{c, 8, 8, true, 0, 0}) ==
          "it serves all-to-all");
  }
  // Inside a group, and where LOOM_ALGO names something that cannot serve
  // them, the schedule comes from pairwise.
  CHECK(loom::scheduledFallback(Collective::AllToAll) == Algorithm::Pairwise);
  CHECK(loom::scheduledFallback(Collective::Gather) == Algorithm::Pairwise);
  CHECK(loom::scheduledFallback(Collective::AllReduce) == Algorithm::Ring);
}
