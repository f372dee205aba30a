// The executor's side of Connection::direct() (transports/transport.h): large
// point-to-point steps handed to the connection instead of the slots, over
// the simulator's in-memory DirectTransfer (tests/sim_transport.h).  The
// RDMA implementation of the same protocol runs in tests/vm/ (rendezvous).
#include "loom_catch.h"

#include <cstring>
#include <vector>

#include "algorithms/algorithms.h"
#include "tests/sim_transport.h"

using loom::Collective;

namespace {

constexpr size_t kGuard = 64;

loom::OpDesc p2p(bool isSend, int peer, void* buf, size_t bytes) {
  loom::OpDesc op;
  op.coll = Collective::P2P;
  op.dtype = loomUint8;
  op.count = bytes;
  op.isSend = isSend;
  op.peer = peer;
  if (isSend) op.sendbuf = buf;
  else op.recvbuf = buf;
  return op;
}

uint8_t pattern(size_t i, int from, int to) { return uint8_t((i % 251) ^ unsigned(from * 7 + to * 3)); }

loomsim::AlgorithmFn kNoCollectives = [](const loom::OpDesc&, int, int, int, const loom::Plan&, loom::Schedule*) {};

// Every rank sends `bytes` to every other rank and receives from each, in
// one group; returns the run and checks every byte and every guard.
loomsim::SimResult exchangeAll(loomsim::SimWorld& world, int n, size_t bytes, int* wrong) {
  const size_t ranks = size_t(n);
  std::vector<std::vector<std::vector<uint8_t>>> send(ranks), recv(ranks);
  std::vector<std::vector<loom::OpDesc>> ops(ranks);
  for (int r = 0; r < n; ++r) {
    send[size_t(r)].resize(size_t(n));
    recv[size_t(r)].resize(size_t(n));
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      auto& s = send[size_t(r)][size_t(p)];
      s.resize(bytes);
      for (size_t i = 0; i < bytes; ++i) s[i] = pattern(i, r, p);
      recv[size_t(r)][size_t(p)].assign(bytes + kGuard, 0x5a);
      ops[size_t(r)].push_back(p2p(true, p, s.data(), bytes));
      ops[size_t(r)].push_back(p2p(false, p, recv[size_t(r)][size_t(p)].data(), bytes));
    }
  }
  loomsim::SimResult res = world.run(kNoCollectives, ops, loom::Plan{});
  *wrong = 0;
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      const auto& got = recv[size_t(r)][size_t(p)];
      for (size_t i = 0; i < bytes; ++i) *wrong += got[i] != pattern(i, p, r);
      for (size_t i = bytes; i < bytes + kGuard; ++i) *wrong += got[i] != 0x5a;
    }
  return res;
}

}  // namespace

TEST_CASE("direct transfers: steps at or above the threshold skip the slots, smaller ones use them, all exact", "[sim][direct]") {
  const int n = 3;
  loomsim::SimOptions opts;
  opts.slotBytes = 1024;
  opts.directMinBytes = 8192;
  loomsim::SimWorld world(n, opts);
  for (size_t bytes : {size_t(8191), size_t(8192), size_t(100003)}) {
    INFO(bytes << " bytes");
    int wrong = 0;
    loomsim::SimResult res = exchangeAll(world, n, bytes, &wrong);
    INFO(res.problem);
    REQUIRE(res.ok());
    CHECK(wrong == 0);
    const bool direct = bytes >= opts.directMinBytes;
    for (int r = 0; r < n; ++r) {
      CHECK(res.bytesSent[size_t(r)] == 2 * bytes);  // execute() counts the payload either way
      // Direct: one 16-byte request slot per transfer; slots: every byte.
      CHECK(res.slotsPosted[size_t(r)] == (direct ? 2 : 2 * ((bytes + 1023) / 1024)));
      CHECK(res.bytesPosted[size_t(r)] == 2 * bytes);
    }
  }
  CHECK(world.leftovers() == "");
}

TEST_CASE("direct transfers: a rank that cannot take part (unregistrable memory) gets slots both ways, exact", "[sim][direct]") {
  const int n = 3;
  loomsim::SimOptions opts;
  opts.slotBytes = 1024;
  opts.directMinBytes = 4096;
  opts.directRefuse = 1;
  loomsim::SimWorld world(n, opts);
  int wrong = 0;
  const size_t bytes = 20000;
  loomsim::SimResult res = exchangeAll(world, n, bytes, &wrong);
  INFO(res.problem);
  REQUIRE(res.ok());
  CHECK(wrong == 0);
  const uint64_t viaSlots = 1 + (bytes + 1023) / 1024;  // the request, then the data
  CHECK(res.slotsPosted[1] == 2 * viaSlots);            // rank 1 refuses its sends and its receives
  CHECK(res.slotsPosted[0] == viaSlots + 1);            // to rank 1 through slots, to rank 2 direct
  CHECK(res.slotsPosted[2] == viaSlots + 1);
  CHECK(world.leftovers() == "");
}

TEST_CASE("direct transfers: a receive of another size fails both ranks and writes nothing", "[sim][direct]") {
  loomsim::SimOptions opts;
  opts.slotBytes = 1024;
  opts.directMinBytes = 4096;
  opts.precheck = false;  // the executor must find it, not the static check
  opts.timeoutMs = 5000;
  loomsim::SimWorld world(2, opts);
  std::vector<uint8_t> src(8192, 7), dst(16384 + kGuard, 0x5a);
  std::vector<std::vector<loom::OpDesc>> ops(2);
  ops[0].push_back(p2p(true, 1, src.data(), 8192));
  ops[1].push_back(p2p(false, 0, dst.data(), 16384));
  loomsim::SimResult res = world.run(kNoCollectives, ops, loom::Plan{});
  REQUIRE_FALSE(res.ok());
  INFO(res.errors[1]);
  CHECK(res.errors[1].find("mismatched operations") != std::string::npos);
  CHECK(res.errors[1].find("count 8192") != std::string::npos);
  CHECK_FALSE(res.errors[0].empty());  // the sender stops too (it never got a buffer)
  bool untouched = true;
  for (uint8_t b : dst) untouched &= b == 0x5a;
  CHECK(untouched);
}
