// Double binary tree schedules (algorithms/double_binary_tree.cc) run on the
// simulated transport with the real executor: exact results, no deadlock with
// chunks several times larger than a connection's slot ring, the two-tree
// volume, and the shape of the trees.
#include <algorithm>
#include "loom_catch.h"
#include <cmath>
#include <vector>

#include "tests/sim_transport.h"

namespace {

using loom::Collective;

using loomsim::kOps;
using loomsim::kTypes;

// 256-byte chunks through rings of two 64-byte slots: every chunk wraps its
// rings twice, so the up and down phases must drain each other.
loomsim::CollCase tightCase(Collective coll, int n, size_t count) {
  loomsim::CollCase c;
  c.coll = coll;
  c.nranks = n;
  c.count = count;
  c.plan.chunkBytes = 256;
  c.sim.slotBytes = 64;
  c.sim.slots = 2;
  return c;
}

void expectExact(const loomsim::CollCase& c) {
  loomsim::CollOutcome out = loomsim::runCollective(loom::doubleBinaryTreeSchedule, c);
  INFO(loomsim::caseName(c) << ": " << out.describe());
  CHECK(out.ok());
}

std::vector<size_t> countsFor(int n, bool large) {
  std::vector<size_t> v = {0, 1, size_t(n - 1), size_t(n + 1), 1009};
  if (large) v.push_back((size_t(1) << 17) + 3);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// A large count runs with the default plan and slots; the rest with tight ones.
loomsim::CollCase caseFor(Collective coll, int n, size_t count) {
  if (count < 100000) return tightCase(coll, n, count);
  loomsim::CollCase c;
  c.coll = coll;
  c.nranks = n;
  c.count = count;
  return c;
}

std::vector<int> rootsFor(int n) {
  std::vector<int> v;
  if (n <= 9)
    for (int r = 0; r < n; ++r) v.push_back(r);
  else
    v = {0, 1, n / 2, n - 1};
  return v;
}

}  // namespace

TEST_CASE("Double binary tree all-reduce is exact for every N to 64, odd counts, in and out of place",
          "[sim][tree]") {
  size_t k = 0;
  for (int n = 1; n <= 64; ++n)
    for (size_t count : countsFor(n, n == 7 || n == 16 || n == 33))
      for (bool inPlace : {false, true}) {
        loomsim::CollCase c = caseFor(Collective::AllReduce, n, count);
        c.inPlace = inPlace;
        c.dtype = kTypes[k % 10];
        c.op = kOps[(k / 10 + k) % 5];
        if (c.op == loomAvg && n > 8 && (c.dtype == loomInt8 || c.dtype == loomUint8)) c.op = loomSum;
        ++k;
        expectExact(c);
      }
}

TEST_CASE("Double binary tree all-reduce is exact for every datatype and op", "[sim][tree]") {
  for (int n : {3, 8})
    for (loomDataType_t t : kTypes)
      for (loomRedOp_t op : kOps) {
        loomsim::CollCase c = tightCase(Collective::AllReduce, n, 1009);
        c.dtype = t;
        c.op = op;
        c.inPlace = n == 8;
        expectExact(c);
      }
}

TEST_CASE("Double binary tree broadcast and reduce are exact from every root", "[sim][tree]") {
  size_t k = 0;
  for (Collective coll : {Collective::Broadcast, Collective::Reduce})
    for (int n : {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64})
      for (int root : rootsFor(n))
        for (size_t count : countsFor(n, n == 6 && root == 5))
          for (bool inPlace : {false, true}) {
            if (n > 9 && count != 1009 && count != size_t(n + 1)) continue;
            loomsim::CollCase c = caseFor(coll, n, count);
            c.root = root;
            c.inPlace = inPlace;
            c.dtype = kTypes[k % 10];
            c.op = kOps[k % 4];  // no avg: keeps int8 exact for every N
            ++k;
            expectExact(c);
          }
}

TEST_CASE("Double binary tree operations of one group run back to back", "[sim][tree]") {
  for (int n : {5, 8, 13}) {
    std::vector<loomsim::CollCase> cases;
    for (Collective coll : {Collective::AllReduce, Collective::Broadcast, Collective::Reduce, Collective::AllReduce}) {
      cases.push_back(tightCase(coll, n, 1009 + cases.size()));
      cases.back().root = n - 1;
    }
    std::vector<loomsim::CollOutcome> outs = loomsim::runGroup(loom::doubleBinaryTreeSchedule, cases);
    for (size_t i = 0; i < outs.size(); ++i) {
      INFO(loomsim::caseName(cases[i]) << ": " << outs[i].describe());
      CHECK(outs[i].ok());
    }
  }
}

TEST_CASE("Double binary tree all-reduce, broadcast and reduce send the two-tree volume", "[sim][tree]") {
  for (int n : {2, 3, 5, 8, 13, 64})
    for (Collective coll : {Collective::AllReduce, Collective::Broadcast, Collective::Reduce}) {
      loomsim::CollCase c = tightCase(coll, n, 4096);
      c.root = n / 3;
      loomsim::CollOutcome out = loomsim::runCollective(loom::doubleBinaryTreeSchedule, c);
      INFO(loomsim::caseName(c) << ": " << out.describe());
      REQUIRE(out.ok());
      // Each tree moves its half up (all-reduce, reduce) and down (all-reduce,
      // broadcast) once per edge.
      const uint64_t S = 4096 * 4, edges = uint64_t(n - 1);
      const uint64_t perRank = coll == Collective::AllReduce ? 2 * S : S;
      CHECK(out.sim.totalSent() == (coll == Collective::AllReduce ? 2 : 1) * edges * S);
      for (uint64_t b : out.sim.bytesSent) CHECK(b <= perRank);
    }
}

TEST_CASE("Double binary trees are logarithmic and forward down at most one tree per rank", "[tree]") {
  for (int n = 2; n <= 64; ++n)
    for (int root : {0, n / 2, n - 1}) {
      loom::OpDesc op;
      op.coll = Collective::Broadcast;
      op.count = 64;
      op.root = root;
      op.sendbuf = op.recvbuf = &op;  // only compared, never read
      std::vector<std::vector<int>> parent(2, std::vector<int>(size_t(n), -1));
      for (int r = 0; r < n; ++r) {
        loom::Schedule s;
        loom::doubleBinaryTreeSchedule(op, 0, r, n, loom::Plan{}, &s);
        int forwarding = 0;
        for (const loom::Lane& l : s.lanes) {
          REQUIRE((l.channel == 0 || l.channel == 1));
          parent[size_t(l.channel)][size_t(r)] = l.steps[0].recvPeer;
          forwarding += l.steps[0].kind == loom::StepKind::RecvCopySend;
        }
        INFO("n=" << n << " root=" << root << " rank=" << r);
        CHECK(forwarding <= 1);
      }
      const int maxDepth = int(std::ceil(std::log2(n))) + 1;
      for (int t = 0; t < 2; ++t)
        for (int r = 0; r < n; ++r) {
          int depth = 0, x = r;
          while (x >= 0 && x != root && depth <= n) x = parent[size_t(t)][size_t(x)], ++depth;
          INFO("n=" << n << " root=" << root << " tree " << t << " rank " << r);
          CHECK(x == root);
          CHECK(depth <= maxDepth);
        }
    }
}
