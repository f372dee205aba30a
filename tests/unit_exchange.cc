// All-to-all, gather and scatter (algorithms/pairwise_exchange.cc,
// algorithms/bruck.cc, and the one-shot direct path) and all-to-allv (a group
// of sends and receives) in the schedule simulator: exact results and the
// bytes each rank sends, for N = 1..64.  All-to-allv's sends to self are
// copied by the communicator, so the test takes them out of each rank's
// group and copies them itself, as comm.cc does.
#include "loom_catch.h"
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/direct.h"
#include "tests/sim_transport.h"

namespace {

const std::vector<int> kSizes = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 33, 48, 64};

// A value that names (sending rank, element of its send buffer).
int32_t valueOf(int rank, size_t i) { return int32_t(rank * 1000003 + int(i) * 7 + 1); }

void noCollectives(const loom::OpDesc&, int, int, int, const loom::Plan&, loom::Schedule*) {}

// Runs rank r's ops[r] in the simulator, self sends and receives copied here.
// Returns the simulator's result; bytes sent exclude the local copies.
loomsim::SimResult runExchange(int n, std::vector<std::vector<loom::OpDesc>> ops) {
  for (int r = 0; r < n; ++r) {
    std::vector<loom::OpDesc> rest, selfSends, selfRecvs;
    for (const loom::OpDesc& op : ops[size_t(r)]) {
      if (op.peer != r)
        rest.push_back(op);
      else
        (op.isSend ? selfSends : selfRecvs).push_back(op);
    }
    REQUIRE(selfSends.size() == selfRecvs.size());
    for (size_t k = 0; k < selfSends.size(); ++k) {
      REQUIRE(selfSends[k].count == selfRecvs[k].count);
      memcpy(selfRecvs[k].recvbuf, selfSends[k].sendbuf, selfSends[k].count * sizeof(int32_t));
    }
    ops[size_t(r)] = rest;
  }
  loomsim::SimOptions opts;
  opts.slotBytes = 1024;  // several slots per block at the larger counts
  loomsim::SimWorld world(n, opts);
  return world.run(noCollectives, ops, loom::Plan{});
}

std::string context(const char* what, int n, size_t count, const loomsim::SimResult& res) {
  return std::string(what) + " N=" + std::to_string(n) + " count=" + std::to_string(count) + ": " +
         res.problem;
}

loom::OpDesc exchangeOp(loom::Collective coll, const void* send, void* recv, size_t count, int root) {
  loom::OpDesc d;
  d.coll = coll;
  d.sendbuf = send;
  d.recvbuf = recv;
  d.count = count;
  d.dtype = loomInt32;
  d.root = root;
  return d;
}

// One collective per rank: built by `fn` and run by the executor, or (fn
// empty) run by the one-shot direct path over the simulator's PeerMemory.
loomsim::SimResult runOne(int n, const loomsim::AlgorithmFn& fn, const std::vector<loom::OpDesc>& perRank) {
  std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) ops[size_t(r)].push_back(perRank[size_t(r)]);
  loomsim::SimOptions opts;
  opts.slotBytes = 1024;  // several slots per message at the larger counts
  loomsim::SimWorld world(n, opts);
  if (!fn) return world.runDirect(loom::oneShotRun, ops);
  return world.run(fn, ops, loom::Plan{});
}

// Bytes rank r sends in Bruck's all-to-all: per round, the blocks whose
// index has that round's bit set.
uint64_t bruckBytes(int n, size_t block) {
  uint64_t blocks = 0;
  for (int k = 0; (1 << k) < n; ++k)
    for (int i = 0; i < n; ++i) blocks += (i >> k) & 1;
  return blocks * block;
}

struct Algo {
  const char* name;
  loomsim::AlgorithmFn fn;  // empty: one-shot
};
const Algo kPairwise{"pairwise", loom::pairwiseSchedule};
const Algo kBruck{"bruck", loom::bruckSchedule};
const Algo kOneShot{"oneshot", nullptr};

}  // namespace

TEST_CASE("sim: all-to-all is exact with pairwise, bruck and one-shot, bytes sent as each algorithm says, N 1..64",
          "[sim][exchange]") {
  for (const Algo& a : {kPairwise, kBruck, kOneShot}) {
    for (int n : kSizes) {
      for (size_t count : {size_t(1), size_t(7), size_t(300)}) {
        if (n > 16 && count > 7) continue;                 // keep N = 64 quick
        if (!a.fn && count * 4 > 16384) continue;           // one-shot: blocks up to the mailbox
        std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
        std::vector<loom::OpDesc> ops;
        for (int r = 0; r < n; ++r) {
          send[size_t(r)].resize(size_t(n) * count);
          for (size_t i = 0; i < send[size_t(r)].size(); ++i) send[size_t(r)][i] = valueOf(r, i);
          recv[size_t(r)].assign(size_t(n) * count, -1);
          ops.push_back(exchangeOp(loom::Collective::AllToAll, send[size_t(r)].data(), recv[size_t(r)].data(),
                                   count, 0));
        }
        loomsim::SimResult res = runOne(n, a.fn, ops);
        INFO(a.name << " " << context("all-to-all", n, count, res));
        REQUIRE(res.ok());
        size_t wrong = 0;
        const size_t block = count * sizeof(int32_t);
        for (int r = 0; r < n; ++r) {
          if (a.fn == nullptr) {
            // no slots: the one-shot path writes each other rank's mailbox directly
          } else if (std::string(a.name) == "bruck") {
            CHECK(res.bytesSent[size_t(r)] == bruckBytes(n, block));
          } else {
            CHECK(res.bytesSent[size_t(r)] == uint64_t(n - 1) * block);
          }
          for (int from = 0; from < n; ++from)
            for (size_t i = 0; i < count; ++i)
              wrong += recv[size_t(r)][size_t(from) * count + i] != valueOf(from, size_t(r) * count + i);
        }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("sim: bruck's rounds: ceil(log2 N) sends of the blocks with that bit set, lanes ordered by after",
          "[sim][exchange]") {
  for (int n : {2, 3, 5, 8, 13}) {
    std::vector<int32_t> send(size_t(n) * 4), recv(size_t(n) * 4);
    loom::Schedule s;
    int rank = n - 1;
    loom::bruckSchedule(exchangeOp(loom::Collective::AllToAll, send.data(), recv.data(), 4, 0), 0, rank, n,
                        loom::Plan{}, &s);
    int sends = 0, k = 0;
    for (const loom::Lane& l : s.lanes)
      for (const loom::Step& st : l.steps)
        if (st.kind == loom::StepKind::Send) {
          INFO("N=" << n << " round " << k << "\n" << loom::describe(s));
          CHECK(st.sendPeer == (rank + (1 << k)) % n);
          size_t blocks = 0;
          for (int i = 0; i < n; ++i) blocks += (i >> k) & 1;
          CHECK(st.bytes == blocks * 16);
          ++sends, ++k;
        }
    int rounds = 0;
    while ((1 << rounds) < n) ++rounds;
    CHECK(sends == rounds);
    CHECK(s.scratchOf(0) >= size_t(n) * 16);
  }
}

TEST_CASE("sim: all-to-allv with unequal and empty blocks is exact, N 1..64", "[sim][exchange]") {
  for (int n : kSizes) {
    // Rank i sends (i + 2j) % 5 elements to rank j (0 for some pairs); blocks packed in rank order.
    auto cnt = [](int from, int to) { return size_t((from + 2 * to) % 5); };
    std::vector<std::vector<size_t>> sc(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rc(static_cast<size_t>(n)), rd(static_cast<size_t>(n));
    std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
    std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
    std::vector<uint64_t> wantSent(size_t(n), 0);
    for (int r = 0; r < n; ++r) {
      size_t s = 0, t = 0;
      for (int j = 0; j < n; ++j) {
        sc[size_t(r)].push_back(cnt(r, j)), sd[size_t(r)].push_back(s), s += cnt(r, j);
        rc[size_t(r)].push_back(cnt(j, r)), rd[size_t(r)].push_back(t), t += cnt(j, r);
        if (j != r) wantSent[size_t(r)] += cnt(r, j) * sizeof(int32_t);
      }
      send[size_t(r)].resize(s + 1);
      for (size_t i = 0; i < send[size_t(r)].size(); ++i) send[size_t(r)][i] = valueOf(r, i);
      recv[size_t(r)].assign(t + 1, -1);
    }
    for (int r = 0; r < n; ++r)
      ops[size_t(r)] = loom::allToAllvOps(send[size_t(r)].data(), sc[size_t(r)].data(), sd[size_t(r)].data(),
                                          recv[size_t(r)].data(), rc[size_t(r)].data(), rd[size_t(r)].data(),
                                          loomInt32, r, n);
    loomsim::SimResult res = runExchange(n, ops);
    INFO(context("all-to-allv", n, 0, res));
    REQUIRE(res.ok());
    size_t wrong = 0;
    for (int r = 0; r < n; ++r) {
      CHECK(res.bytesSent[size_t(r)] == wantSent[size_t(r)]);
      for (int from = 0; from < n; ++from)
        for (size_t i = 0; i < rc[size_t(r)][size_t(from)]; ++i)
          wrong += recv[size_t(r)][rd[size_t(r)][size_t(from)] + i] !=
                   valueOf(from, sd[size_t(from)][size_t(r)] + i);
      CHECK(recv[size_t(r)].back() == -1);  // nothing past the last block
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("sim: gather and scatter are exact in and out of place with pairwise and one-shot, only the root moves "
          "N-1 blocks, N 1..64",
          "[sim][exchange]") {
  for (const Algo& a : {kPairwise, kOneShot}) {
    for (int n : kSizes) {
      for (int inPlace = 0; inPlace < 2; ++inPlace) {
        size_t count = n > 16 ? 3 : 257;
        int root = (n * 7 + inPlace) % n;
        // Gather: rank r's block lands at root's recv + r*count.
        std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
        std::vector<loom::OpDesc> ops;
        for (int r = 0; r < n; ++r) {
          send[size_t(r)].resize(count);
          recv[size_t(r)].assign(size_t(n) * count, -1);
          int32_t* src = send[size_t(r)].data();
          if (inPlace && r == root) src = recv[size_t(r)].data() + size_t(root) * count;
          for (size_t i = 0; i < count; ++i) src[i] = valueOf(r, i);
          ops.push_back(exchangeOp(loom::Collective::Gather, src, recv[size_t(r)].data(), count, root));
        }
        loomsim::SimResult res = runOne(n, a.fn, ops);
        INFO(a.name << " " << context(inPlace ? "gather in place" : "gather", n, count, res) << " root " << root);
        REQUIRE(res.ok());
        size_t wrong = 0;
        for (int r = 0; r < n; ++r) {
          if (a.fn) CHECK(res.bytesSent[size_t(r)] == (r == root ? 0 : count * sizeof(int32_t)));
          for (size_t i = 0; i < size_t(n) * count; ++i)
            wrong += recv[size_t(r)][i] != (r == root ? valueOf(int(i / count), i % count) : -1);
        }
        CHECK(wrong == 0);

        // Scatter: root's send + r*count lands in rank r's recv.
        ops.clear();
        for (int r = 0; r < n; ++r) {
          send[size_t(r)].assign(size_t(n) * count, -2);
          if (r == root)
            for (size_t i = 0; i < send[size_t(r)].size(); ++i) send[size_t(r)][i] = valueOf(r, i);
          recv[size_t(r)].assign(count, -1);
          int32_t* dst = recv[size_t(r)].data();
          if (inPlace && r == root) dst = send[size_t(r)].data() + size_t(root) * count;
          ops.push_back(exchangeOp(loom::Collective::Scatter, send[size_t(r)].data(), dst, count, root));
        }
        res = runOne(n, a.fn, ops);
        INFO(a.name << " " << context(inPlace ? "scatter in place" : "scatter", n, count, res));
        REQUIRE(res.ok());
        wrong = 0;
        for (int r = 0; r < n; ++r) {
          if (a.fn) CHECK(res.bytesSent[size_t(r)] == (r == root ? uint64_t(n - 1) * count * sizeof(int32_t) : 0));
          const int32_t* got =
              (inPlace && r == root) ? send[size_t(r)].data() + size_t(root) * count : recv[size_t(r)].data();
          for (size_t i = 0; i < count; ++i) wrong += got[i] != valueOf(root, size_t(r) * count + i);
        }
        CHECK(wrong == 0);
      }
    }
  }
}
