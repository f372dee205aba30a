// Hierarchical schedules (algorithms/hierarchical.cc) run on the simulated
// transport with the real executor: exact results for all-reduce,
// reduce-scatter and all-gather over many host layouts (even, uneven,
// interleaved rank numbering, one host, one rank per host) with each flat
// algorithm inside the rails, and the volume that crosses hosts.
#include <algorithm>
#include "loom_catch.h"
#include <vector>

#include "tests/sim_transport.h"

namespace {

using loom::Algorithm;
using loom::Collective;

using loomsim::kOps;
using loomsim::kTypes;
const Collective kColls[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather};
const Algorithm kInner[] = {Algorithm::Ring, Algorithm::HalvingDoubling, Algorithm::Tree};

loomsim::AlgorithmFn hier(const std::vector<int>& hostOf) {
  return [hostOf](const loom::OpDesc& op, int i, int rank, int n, const loom::Plan& plan, loom::Schedule* s) {
    REQUIRE(n == int(hostOf.size()));
    loom::hierarchicalSchedule(op, i, rank, hostOf, plan, s);
  };
}

// Host ids of `sizes[h]` ranks per host, ranks numbered host by host
// (contiguous) or round-robin over the hosts (interleaved).
std::vector<int> layout(const std::vector<int>& sizes, bool interleaved) {
  std::vector<int> hostOf;
  if (!interleaved) {
    for (size_t h = 0; h < sizes.size(); ++h) hostOf.insert(hostOf.end(), size_t(sizes[h]), 100 + int(h));
    return hostOf;
  }
  std::vector<int> left(sizes);
  for (bool any = true; any;) {
    any = false;
    for (size_t h = 0; h < sizes.size(); ++h)
      if (left[h]-- > 0) hostOf.push_back(100 + int(h)), any = true;
  }
  return hostOf;
}

std::string layoutName(const std::vector<int>& hostOf) {
  std::string s = "hosts";
  for (int h : hostOf) s += " " + std::to_string(h - 100);
  return s;
}

// Rings of three 64-byte slots under 128-byte chunks: the ring phases start
// with a pure send, which must fit the slot ring (see sim_transport.h's
// caveat; the tuner caps chunks the same way), and the inner tree and rhd
// steps overflow their rings many times.
loomsim::CollCase tightCase(Collective coll, int n, size_t count) {
  loomsim::CollCase c;
  c.coll = coll;
  c.nranks = n;
  c.count = count;
  c.plan.chunkBytes = 128;
  c.plan.channels = 2;
  c.sim.slotBytes = 64;
  c.sim.slots = 3;
  return c;
}

loomsim::CollOutcome expectExact(const std::vector<int>& hostOf, const loomsim::CollCase& c) {
  loomsim::CollOutcome out = loomsim::runCollective(hier(hostOf), c);
  INFO(layoutName(hostOf) << " inner " << loom::algorithmName(c.plan.inner) << ": " << loomsim::caseName(c)
                          << ": " << out.describe());
  CHECK(out.ok());
  return out;
}

std::vector<std::vector<int>> layouts() {
  std::vector<std::vector<int>> v;
  const std::vector<std::vector<int>> sizes = {
      {1},    {2},       {1, 1},    {2, 2},       {3, 1},       {1, 3},          {2, 2, 1},
      {1, 2, 3}, {4, 4}, {3, 3, 3}, {5, 2, 1},    {1, 1, 1, 1, 1}, {4, 1, 2, 1},
  };
  for (const auto& s : sizes)
    for (bool inter : {false, true}) {
      std::vector<int> l = layout(s, inter);
      if (std::find(v.begin(), v.end(), l) == v.end()) v.push_back(l);
    }
  return v;
}

}  // namespace

TEST_CASE("Hierarchical collectives are exact over even, uneven and interleaved hosts", "[sim][hier]") {
  size_t k = 0;
  for (const std::vector<int>& hostOf : layouts()) {
    int n = int(hostOf.size());
    for (Collective coll : kColls)
      for (size_t count : {size_t(0), size_t(1), size_t(n > 1 ? n - 1 : 2), size_t(n + 1), size_t(1009)})
        for (bool inPlace : {false, true}) {
          loomsim::CollCase c = tightCase(coll, n, count);
          c.inPlace = inPlace;
          c.dtype = kTypes[k % 10];
          c.op = kOps[(k / 10 + k) % 5];
          c.plan.inner = kInner[k % 3];
          ++k;
          expectExact(hostOf, c);
        }
  }
}

TEST_CASE("Hierarchical collectives are exact for every datatype and op", "[sim][hier]") {
  for (const std::vector<int>& hostOf : {layout({3, 1}, false), layout({2, 2, 2}, true)})
    for (Collective coll : kColls)
      for (loomDataType_t t : kTypes)
        for (loomRedOp_t op : kOps) {
          if (coll == Collective::AllGather && op != loomSum) continue;
          loomsim::CollCase c = tightCase(coll, int(hostOf.size()), 301);
          c.dtype = t;
          c.op = op;
          c.plan.inner = coll == Collective::AllReduce ? kInner[size_t(t) % 3] : Algorithm::Ring;
          expectExact(hostOf, c);
        }
}

TEST_CASE("Hierarchical collectives are exact for large counts and many hosts", "[sim][hier]") {
  // Default slots and plan: many chunks per phase.
  for (const std::vector<int>& hostOf : {layout({4, 4}, false), layout({3, 2, 3}, true)})
    for (Collective coll : kColls)
      for (Algorithm inner : kInner) {
        if (coll != Collective::AllReduce && inner != Algorithm::Ring) continue;
        loomsim::CollCase c;
        c.coll = coll;
        c.nranks = int(hostOf.size());
        c.count = coll == Collective::AllReduce ? (size_t(1) << 19) + 7 : (size_t(1) << 16) + 5;
        c.plan.inner = inner;
        c.plan.chunkBytes = 16 << 10;
        c.inPlace = inner == Algorithm::Tree;
        expectExact(hostOf, c);
      }
  // 16 hosts x 4 ranks and 64 hosts of one.
  for (const std::vector<int>& hostOf : {layout(std::vector<int>(16, 4), true), layout(std::vector<int>(64, 1), false)})
    for (Collective coll : kColls) {
      loomsim::CollCase c = tightCase(coll, int(hostOf.size()), 203);
      c.plan.inner = Algorithm::HalvingDoubling;
      expectExact(hostOf, c);
    }
}

TEST_CASE("Hierarchical operations of one group run back to back", "[sim][hier]") {
  std::vector<int> hostOf = layout({2, 1, 3}, true);
  std::vector<loomsim::CollCase> cases;
  for (Collective coll : kColls) cases.push_back(tightCase(coll, int(hostOf.size()), 509 + cases.size()));
  cases.push_back(tightCase(Collective::AllReduce, int(hostOf.size()), 77));
  std::vector<loomsim::CollOutcome> outs = loomsim::runGroup(hier(hostOf), cases);
  for (size_t i = 0; i < outs.size(); ++i) {
    INFO(loomsim::caseName(cases[i]) << ": " << outs[i].describe());
    CHECK(outs[i].ok());
  }
}

namespace {

// Payload bytes rank r's schedule sends to ranks on other hosts and on its own.
std::pair<uint64_t, uint64_t> crossAndLocal(const loom::Schedule& s, const std::vector<int>& hostOf, int r) {
  uint64_t cross = 0, local = 0;
  for (const loom::Lane& l : s.lanes)
    for (const loom::Step& st : l.steps)
      if (st.sendPeer >= 0) (hostOf[size_t(st.sendPeer)] == hostOf[size_t(r)] ? local : cross) += st.bytes;
  return {cross, local};
}

}  // namespace

TEST_CASE("Hierarchical collectives send the two-level volume", "[sim][hier]") {
  // H hosts of L ranks, ring inside the rails: per rank, all-reduce sends
  // 2(L-1)/L x S inside its host and 2(H-1)/H x S/L to other hosts;
  // reduce-scatter (H-1) blocks across and (L-1) x H blocks inside;
  // all-gather the same, mirrored.
  for (int H : {2, 3, 4})
    for (int L : {1, 2, 3, 4})
      for (bool inter : {false, true}) {
        std::vector<int> hostOf = layout(std::vector<int>(size_t(H), L), inter);
        const uint64_t n = uint64_t(H * L), esz = 4;
        for (Collective coll : kColls) {
          // Every part (shard, rail block, chunk) the same size.
          size_t count = coll == Collective::AllReduce ? 1024 * n * uint64_t(H) : 1024;
          loomsim::CollCase c;
          c.coll = coll;
          c.nranks = int(n);
          c.count = count;
          c.plan.chunkBytes = 1024;
          loomsim::CollOutcome out = expectExact(hostOf, c);
          uint64_t wantCross, wantLocal;
          if (coll == Collective::AllReduce) {
            uint64_t S = count * esz;
            wantLocal = 2 * uint64_t(L - 1) * S / uint64_t(L);
            wantCross = 2 * uint64_t(H - 1) * S / uint64_t(H) / uint64_t(L);
          } else {
            uint64_t B = count * esz;
            wantCross = uint64_t(H - 1) * B;
            wantLocal = uint64_t(L - 1) * uint64_t(H) * B;
          }
          for (int r = 0; r < int(n); ++r) {
            INFO(layoutName(hostOf) << " " << loomsim::caseName(c) << " rank " << r);
            auto got = crossAndLocal(out.sim.schedules[size_t(r)], hostOf, r);
            CHECK(got.first == wantCross);
            CHECK(got.second == wantLocal);
            CHECK(out.sim.bytesSent[size_t(r)] == wantCross + wantLocal);
          }
        }
      }
}

TEST_CASE("Hierarchical all-reduce takes 2(L-1) local and the inner algorithm's rail steps", "[hier]") {
  // One chunk per phase: phase 1 is L steps (a send, L-2 forwards, a final
  // receive), the ring over H hosts 2H-1 steps, phase 3 L steps; the flat
  // ring over all N ranks takes 2N-1.
  for (int H : {2, 3, 4})
    for (int L : {2, 3, 4}) {
      std::vector<int> hostOf = layout(std::vector<int>(size_t(H), L), false);
      int n = H * L;
      loom::OpDesc op;
      op.count = 64 * size_t(n);
      op.sendbuf = op.recvbuf = &op;  // only compared, never read
      loom::Plan plan;
      plan.chunkBytes = size_t(1) << 30;
      plan.channels = 1;
      for (int r = 0; r < n; ++r) {
        loom::Schedule s;
        loom::hierarchicalSchedule(op, 0, r, hostOf, plan, &s);
        INFO("H=" << H << " L=" << L << " rank " << r << "\n" << loom::describe(s));
        REQUIRE(s.lanes.size() == 3);
        CHECK(s.lanes[0].steps.size() == size_t(L));
        CHECK(s.lanes[1].steps.size() == size_t(2 * H - 1));
        CHECK(s.lanes[2].steps.size() == size_t(L));
        CHECK(s.lanes[1].after == std::vector<int>{0});
        CHECK(s.lanes[2].after == std::vector<int>{1});
        for (const loom::Step& st : s.lanes[1].steps)
          for (int p : {st.sendPeer, st.recvPeer})
            if (p >= 0) CHECK(hostOf[size_t(p)] != hostOf[size_t(r)]);
      }
    }
}
