// A transport that lives only in tests/: "mem", ranks as threads of this
// process joined by the simulator's in-memory rings (tests/sim_transport.h),
// registered as a real plug-in (loom::registerTransport) and chosen with
// LOOM_TRANSPORTS=mem.  Communicators made through the C API run every
// collective over it, on the executor's path (its Connections) and on the
// direct paths (its PeerMemory), with no edit outside tests/.
#include <unistd.h>

#include "loom_catch.h"
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/core/comm.h"
#include "src/core/config.h"
#include "tests/mp_common.h"
#include "tests/sim_transport.h"

namespace {

using loomsim::detail::SimBell;
using loomsim::detail::SimRing;

// Everything the ranks of one communicator share, found by its tag.
struct MemFabric {
  explicit MemFabric(int n) : failed(-1) {
    for (int r = 0; r < n; ++r) bells.push_back(std::make_unique<SimBell>());
  }
  SimRing* ring(int from, int to, int ch, size_t slots, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    auto& p = rings[std::make_tuple(from, to, ch)];
    if (!p) p = std::make_unique<SimRing>(slots, bytes);
    return p.get();
  }
  loomsim::detail::SimPeerMemory* windows(int n, size_t bytes) {
    std::lock_guard<std::mutex> g(mu);
    if (!mem) mem = std::make_unique<loomsim::detail::SimPeerMemory>(n, bytes, &bells, &failed);
    return mem.get();
  }
  std::mutex mu;
  std::map<std::tuple<int, int, int>, std::unique_ptr<SimRing>> rings;
  std::vector<std::unique_ptr<SimBell>> bells;
  std::atomic<int> failed;
  std::unique_ptr<loomsim::detail::SimPeerMemory> mem;
};

std::shared_ptr<MemFabric> fabricFor(uint64_t tag, int n) {
  static std::mutex mu;
  static std::map<uint64_t, std::weak_ptr<MemFabric>> all;
  std::lock_guard<std::mutex> g(mu);
  std::shared_ptr<MemFabric> f = all[tag].lock();
  if (!f) all[tag] = f = std::make_shared<MemFabric>(n);
  return f;
}

struct MemRecord {
  int64_t pid;
};

class MemTransport : public loom::Transport, public loom::Doorbell {
 public:
  const char* name() const override { return "mem"; }
  bool mayReach(const loom::TransportEnv&, int) const override { return true; }
  size_t recordBytes() const override { return sizeof(MemRecord); }
  void publish(const loom::TransportEnv& env, const std::vector<bool>&, void* record) override {
    env_ = env;
    fabric_ = fabricFor(env.commTag, env.nranks);
    MemRecord rec{int64_t(getpid())};
    memcpy(record, &rec, sizeof rec);
  }
  bool accept(int r, const void* record, std::string* why) override {
    MemRecord rec;
    memcpy(&rec, record, sizeof rec);
    if (rec.pid == int64_t(getpid())) return true;
    *why = loom::strf("rank %d is in another process", r);
    return false;
  }
  std::unique_ptr<loom::Connection> connect(int peer, int ch, int64_t, loom::ConnectHost&) override {
    SimRing* out = fabric_->ring(env_.rank, peer, ch, env_.slots, env_.slotBytes);
    SimRing* in = fabric_->ring(peer, env_.rank, ch, env_.slots, env_.slotBytes);
    return std::make_unique<loomsim::detail::SimConnection>(env_.rank, peer, ch, out, in,
                                                            fabric_->bells[size_t(peer)].get(), &counters_, true);
  }
  void abort() override {
    int none = -1;
    fabric_->failed.compare_exchange_strong(none, env_.rank);
    for (auto& b : fabric_->bells) b->ring();
  }
  Doorbell* doorbell() override { return this; }
  loom::PeerMemory* peerMemory() override {
    return env_.windowBytes ? fabric_->windows(env_.nranks, env_.windowBytes) : nullptr;
  }
  loom::CostLink costAs() const override { return loom::CostLink::Shm; }

  uint32_t begin(bool) override {
    SimBell& b = bell();
    b.sleeping.store(1);
    return b.seq.load();
  }
  void sleep(uint32_t token, std::vector<pollfd>&, int64_t timeoutUs) override {
    SimBell& b = bell();
    std::unique_lock<std::mutex> lk(b.mu);
    b.cv.wait_for(lk, std::chrono::microseconds(std::max<int64_t>(1, timeoutUs)),
                  [&] { return b.seq.load() != token; });
  }
  void end() override { bell().sleeping.store(0); }

 private:
  SimBell& bell() { return *fabric_->bells[size_t(env_.rank)]; }
  loom::TransportEnv env_;
  std::shared_ptr<MemFabric> fabric_;
  loomsim::detail::SimCounters counters_;
};

void registerMem() {
  loom::registerTransport({"mem", "tests: ranks as threads over in-memory rings",
                           [] { return std::make_unique<MemTransport>(); }});
}

struct EnvGuard {
  explicit EnvGuard(std::vector<std::pair<const char*, const char*>> vars) : vars_(std::move(vars)) {
    for (auto& v : vars_) setenv(v.first, v.second, 1);
    loom::configReload();
  }
  ~EnvGuard() {
    for (auto& v : vars_) unsetenv(v.first);
    loom::configReload();
  }
  std::vector<std::pair<const char*, const char*>> vars_;
};

// Makes n communicators (ranks as threads) and runs body(rank, comm) on
// each thread; returns what each body returned ("" = fine).  Catch2's
// assertions stay on this thread.
template <class Body>
std::vector<std::string> withComms(int n, Body body) {
  std::vector<std::string> out(static_cast<size_t>(n));
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  std::vector<loomComm_t> comms(size_t(n), nullptr);
  std::vector<loomResult_t> res(size_t(n), loomInternalError);
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r) th.emplace_back([&, r] { res[size_t(r)] = loomCommInitRank(&comms[size_t(r)], n, id, r); });
  for (auto& t : th) t.join();
  for (int r = 0; r < n; ++r) REQUIRE(res[size_t(r)] == loomSuccess);
  th.clear();
  for (int r = 0; r < n; ++r) th.emplace_back([&, r] { out[size_t(r)] = body(r, comms[size_t(r)]); });
  for (auto& t : th) t.join();
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  return out;
}

// Every collective on one communicator, results checked against mp_common's expectations.
std::string runAll(int rank, loomComm_t comm, int n, size_t count, loomDataType_t t, loomRedOp_t op) {
  const size_t esz = loom::dtypeSize(t);
  std::vector<uint8_t> send(count * size_t(n) * esz), recv(count * size_t(n) * esz), want(count * size_t(n) * esz);
  std::string err;
  auto expect = [&](const char* what, size_t elems) {
    if (memcmp(recv.data(), want.data(), elems * esz) != 0 && err.empty())
      err = loom::strf("rank %d: %s of %zu x %s differs", rank, what, count, loom::dtypeName(t));
  };
  // all-reduce
  loomtest::fillInput(send.data(), op, t, rank, count);
  if (loomAllReduce(send.data(), recv.data(), count, t, op, comm, nullptr) != loomSuccess) return loomGetLastError(comm);
  loomtest::fillExpected(want.data(), op, t, n, count);
  expect("all-reduce", count);
  // reduce-scatter: block `rank` of the reduced n x count buffer
  loomtest::fillInput(send.data(), op, t, rank, count * size_t(n));
  if (loomReduceScatter(send.data(), recv.data(), count, t, op, comm, nullptr) != loomSuccess)
    return loomGetLastError(comm);
  loomtest::fillExpected(want.data(), op, t, n, count, size_t(rank) * count);
  expect("reduce-scatter", count);
  // all-gather: each rank's block is its sum-pattern input
  loomtest::fillInput(send.data(), loomSum, t, rank, count);
  if (loomAllGather(send.data(), recv.data(), count, t, comm, nullptr) != loomSuccess) return loomGetLastError(comm);
  for (int q = 0; q < n; ++q) loomtest::fillInput(want.data() + size_t(q) * count * esz, loomSum, t, q, count);
  expect("all-gather", count * size_t(n));
  // broadcast from the last rank
  loomtest::fillInput(send.data(), loomSum, t, rank, count);
  if (loomBroadcast(send.data(), recv.data(), count, t, n - 1, comm, nullptr) != loomSuccess)
    return loomGetLastError(comm);
  loomtest::fillInput(want.data(), loomSum, t, n - 1, count);
  expect("broadcast", count);
  // reduce to rank 0
  loomtest::fillInput(send.data(), op, t, rank, count);
  if (loomReduce(send.data(), recv.data(), count, t, op, 0, comm, nullptr) != loomSuccess) return loomGetLastError(comm);
  if (rank == 0) {
    loomtest::fillExpected(want.data(), op, t, n, count);
    expect("reduce", count);
  }
  return err;
}

}  // namespace

TEST_CASE("a transport registered from tests/ carries every collective (LOOM_TRANSPORTS=mem)", "[plugin]") {
  registerMem();
  // Default algorithms (one-shot and staged over its PeerMemory, the tuner's
  // choice otherwise), then the executor's path forced for every size.
  const char* algo = GENERATE("", "ring", "rhd", "tree");
  EnvGuard env({{"LOOM_TRANSPORTS", "mem"}, {"LOOM_ALGO", algo}, {"LOOM_TIMEOUT_MS", "20000"},
                {"LOOM_SHM_STAGE_BYTES", "8192"}});
  for (int n : {2, 3, 4}) {
    std::vector<std::string> errs = withComms(n, [&](int rank, loomComm_t comm) -> std::string {
      for (int p = 0; p < n; ++p)
        if (std::string(comm->transportTo(p)) != (p == rank ? "self" : "mem"))
          return loom::strf("rank %d reaches rank %d with %s", rank, p, comm->transportTo(p));
      for (loomDataType_t t : {loomFloat32, loomBfloat16, loomInt64})
        for (loomRedOp_t op : {loomSum, loomMax, loomAvg})
          for (size_t count : {size_t(1), size_t(1027), size_t(70001)}) {
            std::string err = runAll(rank, comm, n, count, t, op);
            if (!err.empty())
              return loom::strf("%s %s: %s", loom::dtypeName(t), loom::redOpName(op), err.c_str());
          }
      return "";
    });
    for (int r = 0; r < n; ++r) {
      INFO("LOOM_ALGO=" << algo << " N=" << n << " rank " << r << ": " << errs[size_t(r)]);
      CHECK(errs[size_t(r)].empty());
    }
  }
}

TEST_CASE("LOOM_TRANSPORTS naming a transport nobody registered fails init with the list of those that exist", "[plugin]") {
  EnvGuard env(std::vector<std::pair<const char*, const char*>>{{"LOOM_TRANSPORTS", "carrier-pigeon"}});
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  CHECK(loomCommInitRank(&comm, 1, id, 0) == loomInvalidArgument);
  std::string why = loomGetLastError(nullptr);
  INFO(why);
  CHECK(why.find("unknown transport 'carrier-pigeon'") != std::string::npos);
  CHECK(why.find("shm") != std::string::npos);
  CHECK(why.find("tcp") != std::string::npos);
}
