// The direct algorithms (one-shot and staged, algorithms/direct.h) in the
// simulator: N ranks as threads over an in-memory PeerMemory, exact results
// for every collective the one-shot path serves and the staged all-reduce,
// every datatype and op, in and out of place, N from 1 to 8, many chunks;
// operations back to back on one world (mailbox parity and
// acknowledgements); and ranks that call different operations.
#include "loom_catch.h"
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/direct.h"
#include "tests/sim_transport.h"

namespace {

using loom::Collective;
using loomsim::CollCase;
using loomsim::kOps;
using loomsim::kTypes;

const loomsim::DirectFn kOneShot = loom::oneShotRun;
const loomsim::DirectFn kStaged = loom::stagedRun;

bool reducing(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

bool runCase(const loomsim::DirectFn& fn, const CollCase& c, loomsim::SimWorld* world = nullptr) {
  loomsim::CollOutcome out = loomsim::runDirectCollective(fn, c, world);
  INFO(loomsim::caseName(c) << ": " << out.describe());
  CHECK(out.ok());
  return out.ok();
}

}  // namespace

TEST_CASE("one-shot is exact for every collective, datatype and op, N = 1..8", "[direct][oneshot]") {
  const Collective colls[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                              Collective::Broadcast, Collective::Reduce};
  for (int n : {1, 2, 3, 5, 8}) {
    loomsim::SimWorld world(n);  // one world per N: operations follow each other as on a communicator
    for (Collective coll : colls)
      for (loomDataType_t t : kTypes)
        for (loomRedOp_t op : kOps) {
          if (!reducing(coll) && op != loomSum) continue;
          if (n > 3 && t != loomFloat32 && t != loomBfloat16) continue;  // the same code as N <= 3
          for (size_t count : {size_t(0), size_t(1027)})
            for (bool inPlace : {false, true}) {
              CollCase c;
              c.coll = coll;
              c.dtype = t;
              c.op = op;
              c.nranks = n;
              c.count = count;
              c.root = n - 1;
              c.inPlace = inPlace;
              if (!runCase(kOneShot, c, &world)) return;
            }
        }
  }
}

TEST_CASE("staged all-reduce is exact for every datatype and op across many chunks, N = 1..8", "[direct][staged]") {
  for (int n : {1, 2, 3, 5, 8}) {
    loomsim::SimOptions opts;
    opts.stageBytes = 4096;  // many chunks, both staging buffers in turn
    loomsim::SimWorld world(n, opts);
    for (loomDataType_t t : kTypes) {
      if (n > 3 && t != loomFloat32 && t != loomBfloat16) continue;  // the same code as N <= 3
      for (loomRedOp_t op : kOps)
        for (size_t count : {size_t(n + 1), size_t(70001)})
          for (bool inPlace : {false, true}) {
            CollCase c;
            c.dtype = t;
            c.op = op;
            c.nranks = n;
            c.count = count;
            c.inPlace = inPlace;
            c.sim = opts;
            if (!runCase(kStaged, c, &world)) return;
          }
    }
  }
}

TEST_CASE("direct operations run back to back on one world (mailbox parity, acknowledgements)", "[direct]") {
  for (int n : {2, 3, 4}) {
    loomsim::SimOptions opts;
    opts.stageBytes = 4096;
    loomsim::SimWorld world(n, opts);
    for (int i = 0; i < 12; ++i) {
      CollCase c;
      c.nranks = n;
      c.sim = opts;
      c.count = size_t(1 + 97 * i);
      bool staged = i % 4 == 3;  // the staged path serves all-reduce only
      c.coll = i % 3 == 2 && !staged ? Collective::AllGather : Collective::AllReduce;
      c.op = i % 2 ? loomMax : loomSum;
      if (!runCase(staged ? kStaged : kOneShot, c, &world)) return;
    }
  }
}

TEST_CASE("direct algorithms: ranks that call different operations get an error naming both", "[direct]") {
  const int n = 3;
  loomsim::SimOptions opts;
  opts.timeoutMs = 10000;
  loomsim::SimWorld world(n, opts);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(64, 1.0f));
  std::vector<std::vector<loom::OpDesc>> ops(n);
  for (int r = 0; r < n; ++r) {
    loom::OpDesc op;
    op.coll = Collective::AllReduce;
    op.sendbuf = op.recvbuf = bufs[size_t(r)].data();
    op.count = r == 1 ? 32 : 64;  // rank 1 passes another count
    ops[size_t(r)].push_back(op);
  }
  loomsim::SimResult res = world.runDirect(kOneShot, ops);
  REQUIRE_FALSE(res.ok());
  INFO(res.problem);
  CHECK(res.problem.find("mismatched operations") != std::string::npos);
  CHECK(res.problem.find("count 32") != std::string::npos);
}

// Zero-copy (issue 18): when every rank's buffers come from loomMemAlloc,
// the ranks vote so in their windows and each reduces its part straight out
// of all inputs into all outputs; when only some do, those publish where
// their input is instead of staging it, and the others map it (through
// /proc/<pid>/fd, as between processes) and reduce straight out of it.
// Every mix of such ranks and ordinary ones must give exact results; the
// number of imports shows which path ran.
TEST_CASE("staged all-reduce reads loomMemAlloc buffers in place: exact for all, mixed and no such ranks, at offsets",
          "[direct][staged][registered]") {
  for (int n : {2, 3, 5}) {
    loomsim::SimOptions opts;
    opts.stageBytes = 4096;  // many chunks
    loomsim::SimWorld world(n, opts);
    const uint64_t all = (uint64_t(1) << n) - 1;
    // Only all-reduces of 1 MiB and more vote (4 MiB with more ranks than cores).
    const bool oversubscribed = unsigned(n) > std::thread::hardware_concurrency();
    for (uint64_t mask : {all, uint64_t(1), all & 0x5, uint64_t(0)})
      for (size_t offset : {size_t(0), size_t(4160), size_t(24)})
        for (loomDataType_t t : {loomFloat32, loomBfloat16, loomInt64})
          for (bool inPlace : {false, true}) {
            CollCase c;
            c.dtype = t;
            c.op = t == loomInt64 ? loomMax : loomSum;
            c.nranks = n;
            c.count = oversubscribed || t != loomInt64 ? 70001 : 140001;  // int64 on 2 ranks: 1.1 MB, votes
            c.inPlace = inPlace;
            c.sim = opts;
            c.sharedRanks = mask;
            c.sharedOffset = offset;
            size_t before = world.peerMemory() ? world.peerMemory()->imports() : 0;
            if (!runCase(kStaged, c, &world)) return;
            // Every rank's buffers mappable: the zero-copy all-reduce, where
            // every rank maps every other's input and output.  Some: the
            // staged path, where every rank maps each other exporting
            // rank's input once.
            size_t exporters = size_t(__builtin_popcountll(mask));
            size_t want = 0;
            const bool votes = c.count * loom::dtypeSize(t) >= loom::directZeroCopyMinBytes(opts.stageBytes, oversubscribed);
            if (mask == all && votes)
              want = size_t(n) * size_t(n - 1) * 2;
            else
              for (int r = 0; r < n; ++r) want += exporters - ((mask >> r) & 1);
            INFO(loomsim::caseName(c));
            CHECK(world.peerMemory()->imports() - before == want);
          }
    // From 4 MiB every shape votes: the zero-copy all-reduce.
    for (bool inPlace : {false, true}) {
      CollCase c;
      c.nranks = n;
      c.count = (size_t(4) << 20) / 4 + 1001;
      c.inPlace = inPlace;
      c.sim = opts;
      c.sharedRanks = all;
      c.sharedOffset = 192;
      size_t before = world.peerMemory()->imports();
      if (!runCase(kStaged, c, &world)) return;
      INFO(loomsim::caseName(c));
      CHECK(world.peerMemory()->imports() - before == size_t(n) * size_t(n - 1) * 2);
    }
    // The buffers of each case were freed before the next was allocated:
    // the free epoch made the importers drop stale mappings, so at most the
    // last case's are left (in place: one per importer and exporting rank).
    CHECK(world.peerMemory()->mappings() <= size_t(n) * size_t(n - 1));
  }
}

TEST_CASE("registered inputs then ordinary ones on one world, back to back (stage parity, free epoch)",
          "[direct][staged][registered]") {
  loomsim::SimOptions opts;
  opts.stageBytes = 4096;
  loomsim::SimWorld world(3, opts);
  for (int i = 0; i < 10; ++i) {
    CollCase c;
    c.nranks = 3;
    c.sim = opts;
    const bool oneShot = i % 4 == 3;
    c.count = oneShot ? size_t(1 + 97 * i) : size_t(1 + 977 * i);  // the one-shot path's blocks fit a mailbox
    c.op = i % 2 ? loomMax : loomSum;
    c.inPlace = i % 3 == 0;
    c.sharedRanks = uint64_t(i % 8);  // none, some, all ranks in turn
    c.sharedOffset = size_t(64 * i);
    if (!runCase(oneShot ? kOneShot : kStaged, c, &world)) return;
  }
}

namespace {

// Runs directZeroCopy alone: a rank whose vote comes out "no" records it
// instead of running another path.
struct ZeroCopyOnly {
  std::vector<int>* declined;  // per rank
  void operator()(loom::DirectContext& ctx, const loom::OpDesc& op, const loom::SlotTag& tag) const {
    if (!loom::directZeroCopy(ctx, op, tag)) ++(*declined)[size_t(ctx.rank)];
  }
};

}  // namespace

// Zero-copy all-gather, reduce-scatter, broadcast, all-to-all, gather and
// scatter (algorithms/zero_copy.cc): with the buffers peers read from
// loomMemAlloc each rank pulls its share straight out of the others'
// buffers, exact for every datatype, in and out of place, at odd offsets;
// with one of those ordinary, every rank declines alike (the caller then runs
// a schedule) and nothing is mapped.
TEST_CASE("zero-copy collectives other than all-reduce are exact when the buffers peers read map, declined alike "
          "otherwise",
          "[direct][registered][zerocopy]") {
  const Collective colls[] = {Collective::AllGather, Collective::ReduceScatter, Collective::Broadcast,
                              Collective::AllToAll,  Collective::Gather,        Collective::Scatter};
  for (int n : {2, 3, 4}) {
    loomsim::SimOptions opts;
    opts.stageBytes = 4096;
    loomsim::SimWorld world(n, opts);
    const uint64_t all = (uint64_t(1) << n) - 1;
    // Above the 4 MiB every rank votes at, oversubscribed or not.
    const size_t bytes = (size_t(4) << 20) + 4096;
    for (Collective coll : colls)
      for (loomDataType_t t : {loomFloat32, loomBfloat16, loomInt64})
        for (bool inPlace : {false, true})
          for (uint64_t mask : {all, all & ~uint64_t(2)}) {
            // An in-place all-to-all never reaches zero-copy (the
            // communicator runs it from a copy of its input), gather's and
            // scatter's in-place forms are the root's alone (out of place
            // only here).
            if (inPlace && (coll == Collective::AllToAll || coll == Collective::Gather || coll == Collective::Scatter))
              continue;
            CollCase c;
            c.coll = coll;
            c.dtype = t;
            c.op = t == loomInt64 ? loomMax : t == loomFloat32 ? loomAvg : loomSum;
            c.nranks = n;
            // all-gather: count per rank; reduce-scatter: per rank's part.
            c.count = (bytes / loom::dtypeSize(t) + 7) / (coll == Collective::Broadcast ? 1 : size_t(n));
            c.root = n - 1;
            c.inPlace = inPlace;
            c.sim = opts;
            c.sharedRanks = mask;
            c.sharedOffset = 4160 + 24 * size_t(n);
            INFO(loomsim::caseName(c) << ", shared ranks mask " << mask);
            std::vector<int> declined(size_t(n), 0);
            const size_t before = world.peerMemory() ? world.peerMemory()->imports() : 0;
            // Whose input the others read: the root's (broadcast, scatter),
            // every other rank's (gather), everyone's.
            const bool rootOnly = coll == Collective::Broadcast || coll == Collective::Scatter;
            uint64_t read = rootOnly ? uint64_t(1) << c.root : all;
            if (coll == Collective::Gather) read &= ~(uint64_t(1) << c.root);
            if ((mask & read) == read) {
              if (!runCase(ZeroCopyOnly{&declined}, c, &world)) return;
              CHECK(declined == std::vector<int>(size_t(n), 0));
              // Each rank maps what it reads: every other input (the
              // root's alone for broadcast and scatter; the root all the
              // others' for gather).
              const size_t want = rootOnly || coll == Collective::Gather ? size_t(n - 1) : size_t(n) * size_t(n - 1);
              CHECK(world.peerMemory()->imports() - before == want);
            } else {
              loomsim::detail::CollBuffers buf(c);
              std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
              for (int r = 0; r < n; ++r) ops[size_t(r)].push_back(buf.op(r));
              loomsim::SimResult res = world.runDirect(ZeroCopyOnly{&declined}, ops);
              INFO(res.problem);
              REQUIRE(res.ok());
              CHECK(declined == std::vector<int>(size_t(n), 1));
              CHECK(world.peerMemory()->imports() == before);
            }
          }
  }
}

// A broadcast's root can finish on a schedule (its buffer could not be
// mapped) and vote for its next operation before a receiver has read its
// vote for the first: the receiver must take that as "no", neither waiting
// for a vote that will not come (a hang, then loomTimeout) nor running
// zero-copy alone.  Staged here: the receiver's vote for the first
// broadcast is stored by hand, and the receiver reads the root's only once
// the root has voted for the second.
TEST_CASE("zero-copy vote: a root that already voted for its next broadcast means no for this one",
          "[direct][registered][zerocopy]") {
  loomsim::SimOptions opts;
  opts.stageBytes = 4096;
  opts.timeoutMs = 5000;
  const int n = 2;
  loomsim::SimWorld world(n, opts);
  CollCase first, second;
  for (CollCase* c : {&first, &second}) {
    c->coll = Collective::Broadcast;
    c->nranks = n;
    c->count = (size_t(4) << 20) / 4 + 1;
    c->root = 0;
    c->sim = opts;
    c->sharedOffset = 64;
  }
  first.sharedRanks = 2;   // the root's buffer is ordinary: no zero-copy
  second.sharedRanks = 3;  // every buffer maps: zero-copy
  loomsim::detail::CollBuffers a(first), b(second);
  std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) ops[size_t(r)] = {a.op(r), b.op(r)};
  std::vector<int> declined(size_t(n), 0);
  std::atomic<bool> staged{false};
  auto fn = [&](loom::DirectContext& ctx, const loom::OpDesc& op, const loom::SlotTag& tag) {
    if (ctx.rank == 1 && !staged.exchange(true)) {
      const uint64_t stamp = (tag.seq + 1) << 1, next = (tag.seq + 2) << 1;
      ctx.win(1).publishVoteTag(tag);  // as directZeroCopy votes
      ctx.win(1).zeroCopyVote()->store(stamp | 1, std::memory_order_release);
      ctx.mem.wake(0);
      std::atomic<uint64_t>* rootVote = ctx.win(0).zeroCopyVote();
      for (int i = 0; i < 5000 && (rootVote->load(std::memory_order_acquire) | 1) < (next | 1); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if ((rootVote->load() | 1) < (next | 1)) loom::fail(loomInternalError, "the root never voted again");
    }
    ZeroCopyOnly{&declined}(ctx, op, tag);
  };
  loomsim::SimResult res = world.runDirect(fn, ops);
  INFO(res.problem);
  REQUIRE(res.ok());
  CHECK(declined == std::vector<int>{1, 1});  // the first broadcast, on both ranks
  size_t wrong = 0;
  std::string detail;
  b.check(&wrong, &detail);
  INFO(detail);
  CHECK(wrong == 0);
}
