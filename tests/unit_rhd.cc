// Recursive halving-doubling schedules (algorithms/recursive_halving_doubling.cc)
// run on the simulated transport with the real executor: exact results for
// all-reduce, reduce-scatter and all-gather at N = 1..64 with steps far larger
// than the slot rings, the bandwidth-optimal volume, and log2 N exchanges.
#include "loom_catch.h"
#include <vector>

#include "tests/sim_transport.h"

namespace {

using loom::Collective;

using loomsim::kOps;
using loomsim::kTypes;
const Collective kColls[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather};

// Rings of two 64-byte slots under 64 KiB chunks: every exchange overflows
// its ring many times, so the two sides of an exchange must drain each other.
loomsim::CollCase tightCase(Collective coll, int n, size_t count) {
  loomsim::CollCase c;
  c.coll = coll;
  c.nranks = n;
  c.count = count;
  c.plan.chunkBytes = 64 << 10;
  c.sim.slotBytes = 64;
  c.sim.slots = 2;
  return c;
}

loomsim::CollOutcome expectExact(const loomsim::CollCase& c) {
  loomsim::CollOutcome out = loomsim::runCollective(loom::halvingDoublingSchedule, c);
  INFO(loomsim::caseName(c) << ": " << out.describe());
  CHECK(out.ok());
  return out;
}

}  // namespace

TEST_CASE("Halving-doubling collectives are exact for N = 1..64, odd counts, in and out of place",
          "[sim][rhd]") {
  std::vector<int> ns;
  for (int n = 1; n <= 17; ++n) ns.push_back(n);
  for (int n : {23, 31, 32, 33, 48, 63, 64}) ns.push_back(n);
  size_t k = 0;
  for (int n : ns)
    for (Collective coll : kColls)
      for (size_t count : {size_t(0), size_t(1), size_t(n > 1 ? n - 1 : 2), size_t(n + 1), size_t(1009)})
        for (bool inPlace : {false, true}) {
          loomsim::CollCase c = tightCase(coll, n, count);
          c.inPlace = inPlace;
          c.dtype = kTypes[k % 10];
          c.op = kOps[(k / 10 + k) % 5];
          c.plan.channels = k % 3 ? 1 : 4;
          ++k;
          expectExact(c);
        }
}

TEST_CASE("Halving-doubling is exact for every datatype and op, and for large counts", "[sim][rhd]") {
  for (int n : {3, 8})
    for (Collective coll : {Collective::AllReduce, Collective::ReduceScatter})
      for (loomDataType_t t : kTypes)
        for (loomRedOp_t op : kOps) {
          loomsim::CollCase c = tightCase(coll, n, 1009);
          c.dtype = t;
          c.op = op;
          c.inPlace = n == 8;
          expectExact(c);
        }
  // Default slots and plan: many chunk loops per lane, 4 lanes.
  for (int n : {6, 16})
    for (Collective coll : kColls)
      for (bool inPlace : {false, true}) {
        loomsim::CollCase c;
        c.coll = coll;
        c.nranks = n;
        c.count = coll == Collective::AllReduce ? (size_t(1) << 20) + 3 : (size_t(1) << 16) + 5;
        c.inPlace = inPlace;
        c.plan.channels = 4;
        expectExact(c);
      }
}

TEST_CASE("Halving-doubling operations of one group run back to back", "[sim][rhd]") {
  for (int n : {5, 8}) {
    std::vector<loomsim::CollCase> cases;
    for (Collective coll : kColls) cases.push_back(tightCase(coll, n, 1009 + cases.size()));
    std::vector<loomsim::CollOutcome> outs = loomsim::runGroup(loom::halvingDoublingSchedule, cases);
    for (size_t i = 0; i < outs.size(); ++i) {
      INFO(loomsim::caseName(cases[i]) << ": " << outs[i].describe());
      CHECK(outs[i].ok());
    }
  }
}

TEST_CASE("Halving-doubling sends the bandwidth-optimal volume", "[sim][rhd]") {
  for (int n : {2, 3, 4, 5, 8, 12, 16, 32, 64})
    for (Collective coll : kColls) {
      const bool pow2 = (n & (n - 1)) == 0;
      if (!pow2) continue;  // folding costs extra
      // Two lanes of two loops each, every part the same size.
      const size_t elems = 4 * 1024 * size_t(n), esz = 4;
      loomsim::CollCase c = tightCase(coll, n, coll == Collective::AllReduce ? elems : elems / size_t(n));
      c.plan.chunkBytes = 4096;
      c.sim = loomsim::SimOptions{};
      loomsim::CollOutcome out = expectExact(c);
      const uint64_t S = elems * esz, N = uint64_t(n);
      const uint64_t want = coll == Collective::AllReduce ? 2 * (N - 1) * S / N : (N - 1) * S / N;
      for (uint64_t b : out.sim.bytesSent) CHECK(b == want);
    }
}

TEST_CASE("Halving-doubling all-reduce takes log2 N exchanges each way on distinct channels", "[rhd]") {
  for (int n : {2, 4, 8, 16, 32, 64}) {
    int logN = 0;
    while ((1 << logN) < n) ++logN;
    loom::OpDesc op;
    op.count = 1024 * size_t(n);
    op.sendbuf = op.recvbuf = &op;  // only compared, never read
    loom::Plan plan;
    plan.chunkBytes = size_t(1) << 30;
    for (int r = 0; r < n; ++r) {
      loom::Schedule s;
      loom::halvingDoublingSchedule(op, 0, r, n, plan, &s);
      REQUIRE(s.lanes.size() == 2);
      CHECK(s.lanes[0].channel != s.lanes[1].channel);
      for (const loom::Lane& l : s.lanes) {
        INFO("n=" << n << " rank=" << r << "\n" << loom::describe(s));
        REQUIRE(l.steps.size() == size_t(4 * logN));  // a send and a receive per exchange
        for (size_t i = 0; i < l.steps.size(); ++i) {
          int m = i < size_t(2 * logN) ? n >> (i / 2 + 1) : 1 << (i / 2 - logN);
          const loom::Step& st = l.steps[i];
          CHECK((st.sendPeer >= 0 ? st.sendPeer : st.recvPeer) == (r ^ m));
        }
      }
    }
  }
}

TEST_CASE("Halving-doubling reduce-scatter takes log2 N exchanges with partial sums in scratch", "[rhd]") {
  for (int n : {2, 4, 8, 16, 32, 64}) {
    int logN = 0;
    while ((1 << logN) < n) ++logN;
    std::vector<char> buf(size_t(n) * 64 * 4);
    loom::OpDesc op;
    op.coll = Collective::ReduceScatter;
    op.count = 64;
    op.sendbuf = buf.data();
    op.recvbuf = buf.data() + buf.size() / 2;  // only compared, never read
    loom::Plan plan;
    plan.chunkBytes = size_t(1) << 30;
    for (int r = 0; r < n; ++r) {
      loom::Schedule s;
      loom::halvingDoublingSchedule(op, 0, r, n, plan, &s);
      INFO("n=" << n << " rank=" << r << "\n" << loom::describe(s));
      REQUIRE(s.lanes.size() == 2);
      CHECK(s.scratchOf(0) >= size_t(n) * 64 * 4);
      for (const loom::Lane& l : s.lanes) {
        // Exchanges with r ^ N/2, r ^ N/4, ..., r ^ 1 in that order (the first
        // one a step per block: the lane holds part of each block's columns).
        std::vector<int> peers;
        bool toRecv = false;
        for (const loom::Step& st : l.steps) {
          int peer = st.sendPeer >= 0 ? st.sendPeer : st.recvPeer;
          if (peers.empty() || peers.back() != peer) peers.push_back(peer);
          toRecv |= st.dst.buf == loom::Buf::Recv && st.finalize;
        }
        REQUIRE(peers.size() == size_t(logN));
        for (int k = 0; k < logN; ++k) CHECK(peers[size_t(k)] == (r ^ (n >> (k + 1))));
        CHECK(toRecv);
        CHECK(l.steps.size() <= size_t(n + 2 * logN));
      }
    }
  }
}
