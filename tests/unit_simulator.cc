// The schedule simulator (tests/sim_transport.h) on the ring algorithms:
// exact results for every collective, datatype and op, N from 1 to 64,
// in and out of place, several channels and chunk sizes; the bytes each rank
// sends against the ring's theoretical volume; the ring's step counts; and
// the simulator itself (transport, groups, p2p, mismatch and deadlock
// detection).
#include <algorithm>
#include "loom_catch.h"
#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
#include "tests/sim_transport.h"

namespace {

using loom::Collective;
using loomsim::CollCase;

using loomsim::kOps;
using loomsim::kTypes;
const Collective kColls[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                             Collective::Broadcast, Collective::Reduce};

const loomsim::AlgorithmFn kRing = loom::ringSchedule;

// A ring's first step fills its outgoing connection with one block before
// receiving anything, so the chunk must stay below the connection capacity
// (slots x slotBytes; see the report on the executor).  Plans here keep to
// that.
loom::Plan ringPlan(int channels = 1, size_t chunkBytes = 16 << 10) {
  loom::Plan p;
  p.algo = loom::Algorithm::Ring;
  p.channels = channels;
  p.chunkBytes = chunkBytes;
  return p;
}

std::vector<size_t> countsFor(int n) {
  std::set<size_t> s = {0, 1, size_t(n > 1 ? n - 1 : 0), size_t(n + 1), 1009};
  return std::vector<size_t>(s.begin(), s.end());
}

// Runs one case, reports it on failure; returns whether it passed.
bool runCase(const CollCase& c, const loomsim::AlgorithmFn& fn = kRing) {
  loomsim::CollOutcome out = loomsim::runCollective(fn, c);
  INFO(loomsim::caseName(c) << ": " << out.describe());
  CHECK(out.ok());
  return out.ok();
}

struct TypeOp {
  loomDataType_t t;
  loomRedOp_t op;
};

// The (type, op) pairs a collective runs with: the reducing list for the
// collectives that reduce, else each moved type with a placeholder op.
std::vector<TypeOp> typesFor(Collective coll, const std::vector<TypeOp>& red,
                             const std::vector<loomDataType_t>& moves) {
  if (reduces(coll)) return red;
  std::vector<TypeOp> list;
  for (loomDataType_t t : moves) list.push_back({t, loomSum});
  return list;
}

// The cases of one N for the given (type, op) list of reducing collectives
// and type list of the others.
// bothPlaces: every case in and out of place; else alternately one of them.
int runMatrix(int n, const std::vector<TypeOp>& red, const std::vector<loomDataType_t>& moves,
              const loom::Plan& plan, const loomsim::SimOptions& sim, bool bothPlaces, int* failures) {
  int cases = 0;
  std::vector<size_t> counts = countsFor(n);
  const int roots[] = {0, n - 1, n / 2};
  for (Collective coll : kColls) {
    std::vector<TypeOp> list = typesFor(coll, red, moves);
    for (size_t ti = 0; ti < list.size(); ++ti)
      for (size_t ci = 0; ci < counts.size(); ++ci)
        for (bool inPlace : {false, true}) {
          if (!bothPlaces && inPlace != bool((ti + ci) % 2)) continue;
          CollCase c;
          c.coll = coll;
          c.dtype = list[ti].t;
          c.op = list[ti].op;
          c.nranks = n;
          c.count = counts[ci];
          c.root = rooted(coll) ? roots[(ti + ci + (inPlace ? 1 : 0)) % 3] : 0;
          c.inPlace = inPlace;
          c.plan = plan;
          c.sim = sim;
          ++cases;
          if (!runCase(c)) ++*failures;
          if (*failures > 20) return cases;  // enough to read
        }
  }
  return cases;
}

}  // namespace

TEST_CASE("the tests' periodic fills equal the element-by-element definitions, across the index wrap", "[sim]") {
  // fillInput/fillExpected copy one period of the inputs instead of
  // computing every element; every result check of the simulator and of
  // mp-worker rests on them, so they are checked against the definitions.
  const size_t base = GENERATE(size_t(0), size_t(1000003) - 50000, size_t(3) * 1000003 - 7, size_t(123457));
  const size_t count = 3 * loomtest::kInputPeriod + 12345;  // several periods, and the wrap when base is near it
  for (loomDataType_t t : {loomInt8, loomUint8, loomInt32, loomUint64, loomFloat16, loomBfloat16, loomFloat32,
                           loomFloat64})
    for (loomRedOp_t op : {loomSum, loomProd, loomMax, loomMin, loomAvg}) {
      INFO("type " << loomtest::typeName(t) << ", op " << loomtest::opName(op) << ", base " << base);
      const size_t bytes = count * loomtest::typeSize(t);
      std::vector<uint8_t> fast(bytes), slow(bytes);
      // The first byte that differs (bytes when none): a vector comparison
      // would print 100 K elements on failure.
      auto firstDiff = [&] {
        return size_t(std::mismatch(fast.begin(), fast.end(), slow.begin()).first - fast.begin());
      };
      loomtest::fillInput(fast.data(), op, t, 5, count, base);
      for (size_t i = 0; i < count; ++i) loomtest::store(slow.data(), t, i, loomtest::inputValue(op, t, 5, base + i));
      CHECK(firstDiff() == bytes);
      loomtest::fillExpected(fast.data(), op, t, 7, count, base);
      for (size_t i = 0; i < count; ++i) loomtest::storeExpected(slow.data(), op, t, 7, i, base + i);
      CHECK(firstDiff() == bytes);
    }
}

TEST_CASE("sim: ring, every collective x type x op, N 1..8", "[sim]") {
  std::vector<TypeOp> all;
  for (loomDataType_t t : kTypes)
    for (loomRedOp_t op : kOps) all.push_back({t, op});
  std::vector<loomDataType_t> moves(std::begin(kTypes), std::end(kTypes));
  int failures = 0, cases = 0;
  for (int n : {1, 2, 3, 4, 5, 7, 8}) cases += runMatrix(n, all, moves, ringPlan(), {}, true, &failures);
  CHECK(cases > 10000);
}

TEST_CASE("sim: ring, N up to 64 (float32 sum, int8 max, bfloat16 avg)", "[sim]") {
  std::vector<TypeOp> red = {{loomFloat32, loomSum}, {loomInt8, loomMax}, {loomBfloat16, loomAvg}};
  std::vector<loomDataType_t> moves = {loomInt8, loomBfloat16, loomFloat32};
  int failures = 0;
  // In and out of place for every case up to 24 ranks; above, alternately.
  for (int n : {6, 9, 12, 13, 16, 17, 24, 31, 32, 33, 48, 63, 64}) {
    runMatrix(n, red, moves, ringPlan(), {}, n <= 24, &failures);
    if (failures > 20) break;
  }
}

TEST_CASE("sim: ring, large counts and many loops", "[sim]") {
  struct Big {
    Collective coll;
    loomDataType_t t;
    loomRedOp_t op;
    int n;
    size_t count;
    int root;
    bool inPlace;
    size_t chunk;
  };
  const Big bigs[] = {
      {Collective::AllReduce, loomFloat32, loomSum, 2, 1 << 20, 0, false, 16 << 10},
      {Collective::AllReduce, loomBfloat16, loomAvg, 7, (1 << 20) + 3, 0, true, 28 << 10},
      {Collective::AllReduce, loomInt32, loomProd, 3, (1 << 20) - 1, 0, false, 4 << 10},
      {Collective::AllReduce, loomFloat32, loomSum, 64, 1 << 16, 0, true, 16 << 10},
      {Collective::ReduceScatter, loomInt32, loomSum, 8, (1 << 17) + 1, 0, true, 16 << 10},
      {Collective::ReduceScatter, loomFloat64, loomMin, 3, 1 << 18, 0, false, 28 << 10},
      {Collective::AllGather, loomFloat64, loomSum, 5, (1 << 18) + 7, 0, false, 16 << 10},
      {Collective::AllGather, loomUint8, loomSum, 13, 1 << 16, 0, true, 8 << 10},
      {Collective::Broadcast, loomUint8, loomSum, 13, 1 << 20, 5, false, 16 << 10},
      {Collective::Broadcast, loomFloat32, loomSum, 4, 1 << 20, 3, true, 16 << 10},
      {Collective::Reduce, loomFloat16, loomMax, 4, 1 << 20, 3, true, 16 << 10},
      {Collective::Reduce, loomUint64, loomSum, 6, (1 << 18) + 5, 1, false, 16 << 10},
  };
  for (const Big& b : bigs) {
    CollCase c;
    c.coll = b.coll;
    c.dtype = b.t;
    c.op = b.op;
    c.nranks = b.n;
    c.count = b.count;
    c.root = b.root;
    c.inPlace = b.inPlace;
    c.plan = ringPlan(1, b.chunk);
    runCase(c);
  }
}

TEST_CASE("sim: ring, several channels, small chunks and slots", "[sim]") {
  struct Cfg {
    int channels;
    size_t chunk, slotBytes, slots;
  };
  // Chunks of 256 B cut into 64 B slots: several slots per step, many loops.
  const Cfg cfgs[] = {{2, 256, 64, 8}, {3, 256, 4096, 2}, {2, 1024, 256, 5}, {3, 192, 64, 4}};
  std::vector<TypeOp> red = {{loomFloat32, loomSum},
                             {loomInt8, loomMax},
                             {loomFloat16, loomProd},
                             {loomBfloat16, loomAvg},
                             {loomUint64, loomMin}};
  std::vector<loomDataType_t> moves = {loomInt8, loomFloat64};
  int failures = 0;
  int k = 0;
  for (int n : {2, 3, 4, 5, 8, 13}) {
    std::vector<size_t> counts = countsFor(n);
    counts.push_back(10007);
    for (Collective coll : kColls) {
      std::vector<TypeOp> list = typesFor(coll, red, moves);
      for (const TypeOp& to : list)
        for (size_t count : counts)
          for (bool inPlace : {false, true}) {
            const Cfg& g = cfgs[k++ % 4];
            CollCase c;
            c.coll = coll;
            c.dtype = to.t;
            c.op = to.op;
            c.nranks = n;
            c.count = count;
            c.root = rooted(coll) ? (k % n) : 0;
            c.inPlace = inPlace;
            c.plan = ringPlan(g.channels, g.chunk);
            c.sim.slotBytes = g.slotBytes;
            c.sim.slots = g.slots;
            if (!runCase(c)) ++failures;
            if (failures > 20) return;
          }
    }
  }
}

TEST_CASE("sim: ring volume per rank", "[sim]") {
  for (int n : {1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 33, 64}) {
    INFO("n = " << n);
    const size_t esz = 4;
    const uint64_t N = uint64_t(n);
    for (size_t count : {size_t(n) * 100, size_t(1009), size_t(n) * 37 + 5}) {
      INFO("count = " << count);
      CollCase c;
      c.nranks = n;
      c.count = count;
      c.plan = ringPlan(1, 1 << 20);  // one loop (blocks stay below 8 slots of 4 KiB)
      const uint64_t S = count * esz;

      // All-reduce: 2(N-1) x S in total; per rank 2(N-1) blocks of about
      // S/N: all of them but its own (reduce-scatter) and but its
      // successor's (all-gather).
      c.coll = Collective::AllReduce;
      auto ar = loomsim::runCollective(kRing, c);
      REQUIRE(ar.ok());
      CHECK(ar.sim.totalSent() == 2 * (N - 1) * S);
      for (int r = 0; r < n; ++r) {
        auto len = [&](int b) {
          size_t m = size_t(((b % n) + n) % n);
          size_t base = count / size_t(n), rem = count % size_t(n);
          return uint64_t(base + (m < rem ? 1 : 0)) * esz;
        };
        uint64_t want = n == 1 ? 0 : 2 * S - len(r) - len(r + 1);
        CHECK(ar.sim.bytesSent[size_t(r)] == want);
        // Within one block of rounding of 2(N-1)/N x S either way.
        int64_t diff = int64_t(N * ar.sim.bytesSent[size_t(r)]) - int64_t(2 * (N - 1) * S);
        CHECK(std::llabs(diff) <= int64_t(2 * N * esz));
        if (count % size_t(n) == 0) CHECK(N * ar.sim.bytesSent[size_t(r)] == 2 * (N - 1) * S);
      }

      // The other collectives send the same whatever the chunking; chunks
      // of 16 KiB stay below the connection capacity.
      c.plan = ringPlan(1, 16 << 10);

      // Reduce-scatter and all-gather: (N-1) blocks of count elements each.
      for (Collective coll : {Collective::ReduceScatter, Collective::AllGather}) {
        c.coll = coll;
        auto o = loomsim::runCollective(kRing, c);
        REQUIRE(o.ok());
        for (int r = 0; r < n; ++r) CHECK(o.sim.bytesSent[size_t(r)] == (N - 1) * S);
      }

      // Broadcast and reduce chains: every rank but one sends S (for the
      // broadcast the last of the chain, the root's predecessor; for the
      // reduce the root).
      for (Collective coll : {Collective::Broadcast, Collective::Reduce}) {
        c.coll = coll;
        c.root = n / 2;
        auto o = loomsim::runCollective(kRing, c);
        REQUIRE(o.ok());
        int silent = coll == Collective::Broadcast ? (c.root + n - 1) % n : c.root;
        for (int r = 0; r < n; ++r)
          CHECK(o.sim.bytesSent[size_t(r)] == (n == 1 || r == silent ? 0 : S));
      }
      c.root = 0;
    }
  }
}

namespace {
struct StepCounts {
  size_t steps = 0, sends = 0, recvs = 0;
};
StepCounts countSteps(const loom::Lane& lane) {
  StepCounts c;
  c.steps = lane.steps.size();
  for (const loom::Step& s : lane.steps) {
    c.sends += s.sendPeer >= 0;
    c.recvs += s.recvPeer >= 0;
  }
  return c;
}
}  // namespace

TEST_CASE("sim: ring step counts", "[sim]") {
  // All-reduce: 2(N-1) sequential communication steps per loop: each rank
  // sends 2(N-1) times and receives 2(N-1) times, in 2N-1 lane steps (the
  // first only sends, the last only receives, the rest do both).
  // Reduce-scatter and all-gather: N-1 sends and receives per chunk in N
  // lane steps (+1 local copy for an out-of-place all-gather); chains: one
  // step.
  for (int n = 2; n <= 64; ++n) {
    INFO("n = " << n);
    const size_t N = size_t(n);
    for (size_t loops : {size_t(1), size_t(3)}) {
      const size_t chunkElems = 16;
      loom::OpDesc op;
      op.dtype = loomFloat32;
      std::vector<float> buf(chunkElems * N * loops * N + 1);
      op.sendbuf = buf.data();
      op.recvbuf = buf.data() + 1;
      loom::Plan plan = ringPlan(1, chunkElems * 4);
      for (int r : {0, n / 2, n - 1}) {
        op.coll = Collective::AllReduce;
        op.count = chunkElems * N * loops;  // exactly `loops` loops
        loom::Schedule s;
        loom::ringSchedule(op, 0, r, n, plan, &s);
        REQUIRE(s.lanes.size() == 1);
        StepCounts k = countSteps(s.lanes[0]);
        CHECK(k.sends == 2 * (N - 1) * loops);
        CHECK(k.recvs == 2 * (N - 1) * loops);
        CHECK(k.steps == (2 * N - 1) * loops);

        op.coll = Collective::ReduceScatter;
        op.count = chunkElems * loops;
        s = loom::Schedule{};
        loom::ringSchedule(op, 0, r, n, plan, &s);
        REQUIRE(s.lanes.size() == 1);
        k = countSteps(s.lanes[0]);
        CHECK(k.sends == (N - 1) * loops);
        CHECK(k.recvs == (N - 1) * loops);
        CHECK(k.steps == N * loops);

        op.coll = Collective::AllGather;
        s = loom::Schedule{};
        loom::ringSchedule(op, 0, r, n, plan, &s);
        REQUIRE(s.lanes.size() == 1);
        k = countSteps(s.lanes[0]);
        CHECK(k.sends == (N - 1) * loops);
        CHECK(k.recvs == (N - 1) * loops);
        CHECK(k.steps == N * loops + 1);

        for (Collective coll : {Collective::Broadcast, Collective::Reduce}) {
          op.coll = coll;
          op.root = n - 1;
          s = loom::Schedule{};
          loom::ringSchedule(op, 0, r, n, plan, &s);
          REQUIRE(s.lanes.size() == 1);
          bool rootCopies = coll == Collective::Broadcast && r == op.root;  // out of place
          CHECK(s.lanes[0].steps.size() == (rootCopies ? 2u : 1u));
          op.root = 0;
        }
      }
    }
  }
  // The schedules the simulator ran (four loops of 64-element chunks).
  CollCase c;
  c.nranks = 6;
  c.count = 6 * 64 * 4;
  c.plan = ringPlan(1, 64 * 4);
  auto o = loomsim::runCollective(kRing, c);
  REQUIRE(o.ok());
  for (const loom::Schedule& s : o.sim.schedules) {
    REQUIRE(s.lanes.size() == 1);
    CHECK(countSteps(s.lanes[0]).sends == 2 * 5 * 4);
    CHECK(countSteps(s.lanes[0]).steps == 11 * 4);
  }
}

TEST_CASE("sim: a group of collectives and a sequence on one world", "[sim]") {
  for (int n : {1, 2, 3, 5, 8}) {
    INFO("n = " << n);
    std::vector<CollCase> group;
    CollCase c;
    c.nranks = n;
    c.plan = ringPlan(2, 512);
    c.sim.slotBytes = 128;
    c.coll = Collective::AllReduce, c.count = 1009, c.dtype = loomInt32, c.op = loomSum;
    group.push_back(c);
    c.coll = Collective::AllGather, c.count = 333, c.dtype = loomFloat16, c.inPlace = true;
    group.push_back(c);
    c.coll = Collective::Broadcast, c.count = 700, c.dtype = loomInt8, c.root = n - 1, c.inPlace = false;
    group.push_back(c);
    c.coll = Collective::Reduce, c.count = 513, c.dtype = loomFloat64, c.op = loomMax, c.root = n / 2;
    group.push_back(c);
    c.coll = Collective::ReduceScatter, c.count = 77, c.dtype = loomUint8, c.op = loomMin, c.inPlace = true;
    group.push_back(c);
    loomsim::SimWorld world(n, c.sim);
    for (int rep = 0; rep < 3; ++rep) {  // sequence numbers go on across runs
      auto outs = loomsim::runGroup(kRing, group, &world);
      for (size_t i = 0; i < outs.size(); ++i) {
        INFO(loomsim::caseName(group[i]) << ": " << outs[i].describe());
        CHECK(outs[i].ok());
      }
      CHECK(world.leftovers() == "");
    }
  }
}

TEST_CASE("sim: send/recv between virtual ranks", "[sim]") {
  // Every rank sends to rank+1 and rank+2 and receives from rank-1 and
  // rank-2 in one group (p2p schedules, per-pair sequence numbers).
  const int n = 5;
  const size_t count = 3000;
  loomsim::SimOptions opts;
  opts.slotBytes = 256;
  loomsim::SimWorld world(n, opts);
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<std::vector<int32_t>> send(n, std::vector<int32_t>(count)), recv1(n, std::vector<int32_t>(count)),
        recv2(n, std::vector<int32_t>(count));
    std::vector<std::vector<loom::OpDesc>> ops(n);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < count; ++i) send[size_t(r)][i] = int32_t(r * 100000 + rep * 10000 + int(i));
      loom::OpDesc op;
      op.coll = Collective::P2P;
      op.dtype = loomInt32;
      op.count = count;
      op.isSend = true;
      op.sendbuf = send[size_t(r)].data();
      for (int d : {1, 2}) {
        op.peer = (r + d) % n;
        ops[size_t(r)].push_back(op);
      }
      op.isSend = false;
      op.sendbuf = nullptr;
      op.peer = (r + n - 2) % n;
      op.recvbuf = recv2[size_t(r)].data();
      ops[size_t(r)].push_back(op);
      op.peer = (r + n - 1) % n;
      op.recvbuf = recv1[size_t(r)].data();
      ops[size_t(r)].push_back(op);
    }
    auto res = world.run(kRing, ops, ringPlan());
    INFO(res.problem);
    REQUIRE(res.ok());
    for (int r = 0; r < n; ++r) {
      CHECK(recv1[size_t(r)] == send[size_t((r + n - 1) % n)]);
      CHECK(recv2[size_t(r)] == send[size_t((r + n - 2) % n)]);
      CHECK(res.bytesSent[size_t(r)] == 2 * count * 4);
    }
  }
}

TEST_CASE("sim: mismatched operations fail fast with a clear error", "[sim]") {
  const int n = 4;
  std::vector<std::vector<float>> bufs(n, std::vector<float>(2000, 1.0f));
  std::vector<std::vector<loom::OpDesc>> ops(n);
  for (int r = 0; r < n; ++r) {
    loom::OpDesc op;
    op.coll = Collective::AllReduce;
    op.count = r == 2 ? 1001 : 1000;  // rank 2 disagrees
    op.sendbuf = op.recvbuf = bufs[size_t(r)].data();
    ops[size_t(r)].push_back(op);
  }
  SECTION("the static check names the pair") {
    loomsim::SimWorld world(n);
    auto res = world.run(kRing, ops, ringPlan());
    CHECK_FALSE(res.ok());
    CHECK(res.problem.find("schedule match") != std::string::npos);
  }
  SECTION("the executor's tag check fires, and the others stop") {
    loomsim::SimOptions opts;
    opts.precheck = false;
    loomsim::SimWorld world(n, opts);
    auto res = world.run(kRing, ops, ringPlan());
    INFO(res.problem);
    CHECK_FALSE(res.ok());
    CHECK(res.problem.find("mismatched operations") != std::string::npos);
    CHECK(res.seconds < 10);  // well before the 20 s timeout
  }
}

TEST_CASE("sim: schedule checks reject bad schedules", "[sim]") {
  const int n = 3;
  std::vector<std::vector<float>> bufs(n, std::vector<float>(64));
  std::vector<std::vector<loom::OpDesc>> ops(n);
  for (int r = 0; r < n; ++r) {
    loom::OpDesc op;
    op.count = 64;
    op.sendbuf = op.recvbuf = bufs[size_t(r)].data();
    ops[size_t(r)].push_back(op);
  }
  auto bad = [](int what) {
    return [what](const loom::OpDesc& op, int opIndex, int rank, int nranks, const loom::Plan& plan,
                  loom::Schedule* out) {
      loom::ringSchedule(op, opIndex, rank, nranks, plan, out);
      loom::Step& s = out->lanes[0].steps[0];
      if (rank != 1) return;
      if (what == 0) s.src.offset = op.count * 4;  // past the end of the buffer
      if (what == 1) s.src.offset += 2;            // not element-aligned
      if (what == 2) s.sendPeer = rank;            // to itself
      if (what == 3) s.recvPeer = 0;               // a send that also receives
      if (what == 4) s.bytes -= 4;                 // the receiver expects more
    };
  };
  for (int what = 0; what < 5; ++what) {
    INFO("variant " << what);
    loomsim::SimWorld world(n);
    auto res = world.run(bad(what), ops, ringPlan());
    INFO(res.problem);
    CHECK(res.problem.find(what == 4 ? "schedule match" : "schedule check") != std::string::npos);
  }
}

TEST_CASE("sim: a deadlocked schedule times out instead of hanging", "[sim]") {
  // Every rank first receives from its predecessor, then sends: a cycle.
  auto deadlock = [](const loom::OpDesc& op, int opIndex, int rank, int nranks, const loom::Plan&,
                     loom::Schedule* out) {
    loom::Lane lane;
    lane.op = opIndex;
    size_t bytes = op.count * loom::dtypeSize(op.dtype);
    loom::Step recv;
    recv.kind = loom::StepKind::Recv;
    recv.recvPeer = (rank + nranks - 1) % nranks;
    recv.dst = {loom::Buf::Recv, 0};
    recv.bytes = bytes;
    loom::Step send;
    send.kind = loom::StepKind::Send;
    send.sendPeer = (rank + 1) % nranks;
    send.src = {loom::Buf::Send, 0};
    send.bytes = bytes;
    lane.steps = {recv, send};
    out->lanes.push_back(lane);
  };
  const int n = 3;
  std::vector<std::vector<float>> in(n, std::vector<float>(100)), out(n, std::vector<float>(100));
  std::vector<const void*> send;
  std::vector<void*> recv;
  for (int r = 0; r < n; ++r) send.push_back(in[size_t(r)].data()), recv.push_back(out[size_t(r)].data());
  loom::OpDesc tmpl;
  tmpl.count = 100;
  loomsim::SimOptions opts;
  opts.timeoutMs = 300;
  auto res = loomsim::simulate(deadlock, tmpl, n, send, recv, ringPlan(), opts);
  INFO(res.problem);
  CHECK_FALSE(res.ok());
  CHECK(res.problem.find("made no progress") != std::string::npos);
  CHECK(res.seconds < 10);
}

TEST_CASE("sim: the in-memory connection", "[sim]") {
  loomsim::detail::SimRing ab(3, 64), ba(3, 64);
  loomsim::detail::SimBell bellA, bellB;
  loomsim::detail::SimCounters ca, cb;
  loomsim::detail::SimConnection a(0, 1, 0, &ab, &ba, &bellB, &ca, true);
  loomsim::detail::SimConnection b(1, 0, 0, &ba, &ab, &bellA, &cb, true);
  loom::SlotTag tag{};
  CHECK(b.recvPeek(&tag) == nullptr);
  for (int round = 0; round < 5; ++round) {
    // Fill all three slots, the fourth must wait.
    for (int i = 0; i < 3; ++i) {
      void* p = a.sendAcquire();
      REQUIRE(p != nullptr);
      CHECK(a.sendAcquire() == p);  // idempotent until posted
      memset(p, round * 3 + i, 64);
      loom::SlotTag t{};
      t.seq = uint64_t(round * 3 + i);
      t.bytes = uint32_t(10 + i);
      a.sendPost(t);
    }
    CHECK(a.sendAcquire() == nullptr);
    CHECK(bellB.seq.load() == uint32_t((round + 1) * 3));
    for (int i = 0; i < 3; ++i) {
      const void* p = b.recvPeek(&tag);
      REQUIRE(p != nullptr);
      CHECK(b.recvPeek(&tag) == p);
      CHECK(tag.seq == uint64_t(round * 3 + i));
      CHECK(tag.bytes == uint32_t(10 + i));
      CHECK(static_cast<const uint8_t*>(p)[63] == uint8_t(round * 3 + i));
      b.recvRelease();
      CHECK(static_cast<const uint8_t*>(p)[0] == 0xCD);  // poisoned once released
    }
    CHECK(b.recvPeek(&tag) == nullptr);
  }
  CHECK(ca.bytes == 5 * (10 + 11 + 12));
  CHECK(ca.slots == 15);
  // Misuse is reported.
  loom::SlotTag t{};
  t.bytes = 8;
  CHECK_THROWS(a.sendPost(t));  // no acquire
  CHECK_THROWS(b.recvRelease());  // no peek
  REQUIRE(a.sendAcquire() != nullptr);
  t.bytes = 65;
  CHECK_THROWS(a.sendPost(t));  // larger than a slot
}

// Known issue, hidden until the executor or the ring handles it (run with
// "[.sim-capacity]"): a ring step sends a whole chunk before the lane moves
// on to receiving, and every rank of the ring starts with such a send, so
// once a chunk fills the connection (ceil(chunk / slotBytes) >= slots) all
// rings are full and every rank waits for a free slot: the all-reduce,
// reduce-scatter and all-gather rings deadlock (loomTimeout).  With the
// defaults (8 slots of 64 KiB, 128 KiB chunks) this needs LOOM_SLOTS=2,
// LOOM_SLOT_BYTES<=16384 or LOOM_CHUNK_SIZE>=512K on a transport without
// extra buffering (shm).
TEST_CASE("sim: ring chunks as large as the connection (known deadlock)", "[.sim-capacity]") {
  for (Collective coll : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather}) {
    CollCase c;
    c.coll = coll;
    c.nranks = 3;
    c.count = coll == Collective::AllReduce ? 3 * 8192 : 8192;  // blocks of 32 KiB
    c.plan = ringPlan(1, 32 << 10);                              // chunk = 8 slots x 4 KiB
    c.sim.timeoutMs = 2000;
    runCase(c);
  }
}
