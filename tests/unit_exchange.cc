// All-to-all, all-to-allv, gather and scatter (algorithms/pairwise_exchange.cc)
// in the schedule simulator: exact results and the bytes each rank sends, for
// N = 1..16 and up to 64. The simulator runs no sends to self (the
// communicator copies those locally): the test takes them out of each rank's
// group and copies them itself, as comm.cc does.
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
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

}  // namespace

TEST_CASE("sim: all-to-all is exact and each rank sends (N-1) blocks, N 1..64", "[sim][exchange]") {
  for (int n : kSizes) {
    for (size_t count : {size_t(1), size_t(300)}) {
      if (n > 16 && count > 1) continue;  // keep N = 64 quick
      std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
      std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        send[size_t(r)].resize(size_t(n) * count);
        for (size_t i = 0; i < send[size_t(r)].size(); ++i) send[size_t(r)][i] = valueOf(r, i);
        recv[size_t(r)].assign(size_t(n) * count, -1);
        ops[size_t(r)] =
            loom::allToAllOps(send[size_t(r)].data(), recv[size_t(r)].data(), count, loomInt32, r, n);
      }
      loomsim::SimResult res = runExchange(n, ops);
      INFO(context("all-to-all", n, count, res));
      REQUIRE(res.ok());
      size_t wrong = 0;
      for (int r = 0; r < n; ++r) {
        CHECK(res.bytesSent[size_t(r)] == uint64_t(n - 1) * count * sizeof(int32_t));
        for (int from = 0; from < n; ++from)
          for (size_t i = 0; i < count; ++i)
            wrong += recv[size_t(r)][size_t(from) * count + i] != valueOf(from, size_t(r) * count + i);
      }
      CHECK(wrong == 0);
    }
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

TEST_CASE("sim: gather and scatter are exact in and out of place, only the root moves N-1 blocks, N 1..64",
          "[sim][exchange]") {
  for (int n : kSizes) {
    for (int inPlace = 0; inPlace < 2; ++inPlace) {
      size_t count = n > 16 ? 3 : 257;
      int root = (n * 7 + inPlace) % n;
      // Gather: rank r's block lands at root's recv + r*count.
      std::vector<std::vector<int32_t>> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
      std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        send[size_t(r)].resize(count);
        recv[size_t(r)].assign(size_t(n) * count, -1);
        int32_t* src = send[size_t(r)].data();
        if (inPlace && r == root) src = recv[size_t(r)].data() + size_t(root) * count;
        for (size_t i = 0; i < count; ++i) src[i] = valueOf(r, i);
        ops[size_t(r)] = loom::gatherOps(src, recv[size_t(r)].data(), count, loomInt32, root, r, n);
      }
      loomsim::SimResult res = runExchange(n, ops);
      INFO(context(inPlace ? "gather in place" : "gather", n, count, res) << " root " << root);
      REQUIRE(res.ok());
      size_t wrong = 0;
      for (int r = 0; r < n; ++r) {
        CHECK(res.bytesSent[size_t(r)] == (r == root ? 0 : count * sizeof(int32_t)));
        for (size_t i = 0; i < size_t(n) * count; ++i)
          wrong += recv[size_t(r)][i] != (r == root ? valueOf(int(i / count), i % count) : -1);
      }
      CHECK(wrong == 0);

      // Scatter: root's send + r*count lands in rank r's recv.
      for (int r = 0; r < n; ++r) {
        send[size_t(r)].assign(size_t(n) * count, -2);
        if (r == root)
          for (size_t i = 0; i < send[size_t(r)].size(); ++i) send[size_t(r)][i] = valueOf(r, i);
        recv[size_t(r)].assign(count, -1);
        int32_t* dst = recv[size_t(r)].data();
        if (inPlace && r == root) dst = send[size_t(r)].data() + size_t(root) * count;
        ops[size_t(r)] = loom::scatterOps(send[size_t(r)].data(), dst, count, loomInt32, root, r, n);
      }
      res = runExchange(n, ops);
      INFO(context(inPlace ? "scatter in place" : "scatter", n, count, res));
      REQUIRE(res.ok());
      wrong = 0;
      for (int r = 0; r < n; ++r) {
        CHECK(res.bytesSent[size_t(r)] == (r == root ? uint64_t(n - 1) * count * sizeof(int32_t) : 0));
        const int32_t* got =
            (inPlace && r == root) ? send[size_t(r)].data() + size_t(root) * count : recv[size_t(r)].data();
        for (size_t i = 0; i < count; ++i) wrong += got[i] != valueOf(root, size_t(r) * count + i);
      }
      CHECK(wrong == 0);
    }
  }
}
