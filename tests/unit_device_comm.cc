// The device communicator (src/device/device_comm.*) on the simulated
// device: the code a CUDA communicator runs (buffer checks, the window
// exchange through IPC records, the import cache, compile, enqueue on the
// caller's stream) with only the device calls replaced.  The simulated
// "device memory" is memfd-backed, and opening a peer's handle maps the
// same memory again at another address, as cudaIpcOpenMemHandle does, so
// base + offset arithmetic is really exercised.  Checks: exact results of
// every collective the compiler serves (the exchanges included), N = 1..5,
// ranks sharing one device and on two, ops back to back with one
// synchronisation at the end, both all-reduce programs; send/recv, N =
// 1..8 (rings, every pair both ways, self-sends, uneven multi-chunk
// sizes); the host thread returning before the work runs; buffer errors; the import cache's refcounts and address reuse; a dead
// rank -> an error, not a hang; and the C API's CUDA-communicator path
// (LOOM_DEVICE=cuda with the simulated device's drivers).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include "loom_catch.h"
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/hier_device.h"
#include "src/device/device.h"
#include "src/device/device_choice.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_comm.h"
#include "src/device/device_memory.h"
#include "src/device/host_memory.h"
#include "src/device/host_reduce.h"
#include "src/device/map_board.h"
#include "src/device/op_signature.h"
#include "src/device/staged_comm.h"
#include "tests/sim_device.h"
#include "tests/sim_driver.h"

namespace {

using loom::Collective;

using loomsim::SimDriver;
using loomsim::SimMemory;
using loomsim::g_pinnedLive;

// An all-gather between threads (the bootstrap's role).
class ThreadExchange {
 public:
  explicit ThreadExchange(int n) : n_(n), slots_(size_t(n)) {}
  void allGather(int rank, const void* mine, size_t bytes, void* all) {
    std::unique_lock<std::mutex> g(mu_);
    const uint64_t gen = gen_;
    slots_[size_t(rank)].assign(static_cast<const uint8_t*>(mine), static_cast<const uint8_t*>(mine) + bytes);
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      result_.clear();
      for (auto& s : slots_) result_.insert(result_.end(), s.begin(), s.end());
      cv_.notify_all();
    } else {
      cv_.wait(g, [&] { return gen_ != gen; });
    }
    memcpy(all, result_.data(), std::min(result_.size(), bytes * size_t(n_)));
  }

 private:
  int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<uint8_t>> slots_;
  std::vector<uint8_t> result_;
  int arrived_ = 0;
  uint64_t gen_ = 0;
};

// N ranks as threads of this process, each with its DeviceComm on the
// simulated device r % gpus.  distinctProcesses: each rank poses as its own
// process, so peers' windows go through handles (mapped again here).
struct SimComms {
  SimMemory mem;
  loomsim::SimDeviceWorld world;
  std::vector<std::unique_ptr<loom::DeviceComm>> comms;
  std::vector<SimDriver*> drivers;  // owned by comms
  std::vector<std::string> initErrors;
  int gpus;

  SimComms(int n, int gpus_, loom::DeviceCommOptions opts, bool distinctProcesses = true,
           loomsim::SimDeviceOptions simOpts = {}, std::vector<size_t> slotPerRank = {})
      : world(n, gpus_, 256, simOpts), comms(size_t(n)), drivers(size_t(n)), initErrors(size_t(n)), gpus(gpus_) {
    ThreadExchange ex(n);
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        loom::DeviceCommOptions o = opts;
        if (distinctProcesses) o.process = 1000 + uint64_t(r);
        // Send/recv regions: the peer's own answer (the communicator asks
        // over its control plane).  Every rank is made before any sends.
        if (!o.fetchRegion)
          o.fetchRegion = [this, r](int peer) {
            if (!comms[size_t(peer)]) loom::fail(loomRemoteError, "rank %d has no communicator", peer);
            return comms[size_t(peer)]->p2pRegionFor(r);
          };
        if (!slotPerRank.empty()) o.slotBytes = slotPerRank[size_t(r)];
        auto driver = std::make_unique<SimDriver>(mem, &world, r, r % gpus_);
        drivers[size_t(r)] = driver.get();
        try {
          comms[size_t(r)] = std::make_unique<loom::DeviceComm>(
              r, n, std::move(driver),
              [&ex, r](const void* m, size_t b, void* all) { ex.allGather(r, m, b, all); }, o);
        } catch (const loom::Error& e) {
          initErrors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
  }
  ~SimComms() {
    for (int r = 0; r < world.nranks(); ++r) {
      std::string msg;
      world.rank(r).synchronize(&msg);
    }
    comms.clear();
    // A destroyed communicator's memory may be with the reaper, which uses
    // this test's simulated device: it must be done before that goes.
    CHECK(loom::waitDeviceRemains(30000));
    CHECK(mem.freedWhileMapped() == 0);  // never freed while a peer maps it (CUDA: undefined)
  }
  int n() const { return world.nranks(); }
};

struct Op {
  Collective coll;
  loomDataType_t type;
  loomRedOp_t op;
  size_t count;
  int root;
  bool inPlace;
};

std::string opName(const Op& o, int n) {
  return loom::strf("%s N=%d %s %s count=%zu root=%d %s", loom::collectiveName(o.coll), n, loom::dtypeName(o.type),
                    loom::redOpName(o.op), o.count, o.root, o.inPlace ? "in-place" : "out-of-place");
}

void fillRandom(uint8_t* p, size_t n, loomDataType_t t, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  const size_t esz = loom::dtypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    uint8_t* e = p + i * esz;
    float f = u(rng);
    double d = double(f) * 1.0000001;
    uint16_t h;
    uint64_t r = rng();
    switch (t) {
      case loomFloat16: h = loom::floatToHalf(f); memcpy(e, &h, 2); break;
      case loomBfloat16: h = loom::floatToBf16(f); memcpy(e, &h, 2); break;
      case loomFloat32: memcpy(e, &f, 4); break;
      case loomFloat64: memcpy(e, &d, 8); break;
      default: memcpy(e, &r, esz);
    }
  }
}

// One operation on every rank, with its buffers in simulated device memory.
struct Prepared {
  Op o;
  std::vector<uint8_t*> send, recv;
  std::vector<uint8_t*> allocs;  // per rank: the output's allocation, then the input's (nullptr: in place)
  std::vector<std::vector<uint8_t>> input, expect;
  size_t recvBytes = 0;
};

// Rank r's buffers on simulated device r % gpus of `mem`; with `reuse`
// (a Prepared of the same op), new values in its buffers, which a captured
// call keeps using.
Prepared prepare(SimMemory& mem, int N, int gpus, const Op& o, std::mt19937_64& rng,
                 const Prepared* reuse = nullptr) {
  const size_t esz = loom::dtypeSize(o.type), n = o.count;
  size_t sendElems = n, recvElems = n;
  if (o.coll == Collective::ReduceScatter || o.coll == Collective::AllToAll || o.coll == Collective::Scatter)
    sendElems *= size_t(N);
  if (o.coll == Collective::AllGather || o.coll == Collective::AllToAll || o.coll == Collective::Gather)
    recvElems *= size_t(N);
  const bool rootOnly = o.coll == Collective::Gather || o.coll == Collective::Scatter;
  Prepared p;
  p.o = o;
  p.recvBytes = recvElems * esz;
  std::vector<std::vector<uint8_t>> before(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const int dev = r % gpus;
    const size_t big = std::max(sendElems, recvElems) * esz + 8;
    uint8_t* rb = reuse ? reuse->allocs[size_t(2 * r)] : mem.alloc(dev, big);
    fillRandom(rb, big / esz, o.type, rng);  // garbage before the operation
    uint8_t *in, *out;
    // Gather and scatter are in place at the root only.
    const bool ip = o.inPlace && (!rootOnly || r == o.root);
    if (!ip) {
      in = reuse ? reuse->allocs[size_t(2 * r + 1)] : mem.alloc(dev, sendElems * esz + 8);
      out = rb;
    } else if (o.coll == Collective::Gather) {
      in = rb + size_t(r) * n * esz;
      out = rb;
    } else if (o.coll == Collective::Scatter) {
      in = rb;
      out = rb + size_t(r) * n * esz;
    } else if (o.coll == Collective::ReduceScatter) {
      in = rb;
      out = rb + size_t(r) * n * esz;
    } else if (o.coll == Collective::AllGather) {
      in = rb + size_t(r) * n * esz;
      out = rb;
    } else {
      in = out = rb;
    }
    fillRandom(in, sendElems, o.type, rng);
    p.send.push_back(in);
    p.recv.push_back(out);
    p.allocs.push_back(rb);
    p.allocs.push_back(ip ? nullptr : in);
    p.input.emplace_back(in, in + sendElems * esz);
    before[size_t(r)].assign(out, out + recvElems * esz);
  }
  // The host arithmetic, ranks combined in rank order.
  loom::Device& host = loom::hostDevice();
  auto fold = [&](size_t off, std::vector<uint8_t>* e) {
    e->assign(p.input[0].begin() + long(off), p.input[0].begin() + long(off + n * esz));
    for (int q = 1; q < N; ++q) host.reduce(e->data(), e->data(), p.input[size_t(q)].data() + off, n, o.type, o.op);
    if (o.op == loomAvg) host.divide(e->data(), e->data(), n, o.type, N);
  };
  for (int r = 0; r < N; ++r) {
    std::vector<uint8_t> e;
    switch (o.coll) {
      case Collective::AllReduce: fold(0, &e); break;
      case Collective::ReduceScatter: fold(size_t(r) * n * esz, &e); break;
      case Collective::AllGather:
        for (int q = 0; q < N; ++q) e.insert(e.end(), p.input[size_t(q)].begin(), p.input[size_t(q)].end());
        break;
      case Collective::Broadcast: e = p.input[size_t(o.root)]; break;
      case Collective::Reduce:
        if (r == o.root)
          fold(0, &e);
        else
          e = before[size_t(r)];  // untouched
        break;
      case Collective::AllToAll:  // block q: block r of rank q's input
        for (int q = 0; q < N; ++q)
          e.insert(e.end(), p.input[size_t(q)].begin() + long(size_t(r) * n * esz),
                   p.input[size_t(q)].begin() + long(size_t(r + 1) * n * esz));
        break;
      case Collective::Gather:
        if (r == o.root)
          for (int q = 0; q < N; ++q) e.insert(e.end(), p.input[size_t(q)].begin(), p.input[size_t(q)].end());
        else
          e = before[size_t(r)];  // untouched
        break;
      case Collective::Scatter:
        e.assign(p.input[size_t(o.root)].begin() + long(size_t(r) * n * esz),
                 p.input[size_t(o.root)].begin() + long(size_t(r + 1) * n * esz));
        break;
      default: break;
    }
    p.expect.push_back(e);
  }
  return p;
}

Prepared prepare(SimComms& s, const Op& o, std::mt19937_64& rng, const Prepared* reuse = nullptr) {
  return prepare(s.mem, s.n(), s.gpus, o, rng, reuse);
}

void issue(SimComms& s, const Prepared& p, int r, void* stream = nullptr) {
  loom::OpDesc d;
  d.coll = p.o.coll;
  d.sendbuf = p.send[size_t(r)];
  d.recvbuf = p.recv[size_t(r)];
  d.count = p.o.count;
  d.dtype = p.o.type;
  d.op = p.o.op;
  d.root = p.o.root;
  s.comms[size_t(r)]->run(d, stream);
}

std::string verify(const Prepared& p, int N) {
  for (int r = 0; r < N; ++r) {
    const std::vector<uint8_t>& e = p.expect[size_t(r)];
    if (!e.empty() && memcmp(p.recv[size_t(r)], e.data(), e.size()) != 0) {
      size_t i = 0;
      while (p.recv[size_t(r)][i] == e[i]) ++i;
      return loom::strf("%s: rank %d wrong at byte %zu of %zu", opName(p.o, N).c_str(), r, i, e.size());
    }
  }
  return "";
}

std::string syncAll(SimComms& s) {
  std::string problems;
  for (int r = 0; r < s.n(); ++r) {
    std::string msg;
    loomResult_t rc = s.world.rank(r).synchronize(&msg);
    if (rc != loomSuccess) problems += loom::strf("rank %d: %d %s; ", r, int(rc), msg.c_str());
  }
  return problems;
}

// Every collective the device path serves once, `c` elements, in place or not.
void addEachCollective(std::vector<Op>* ops, size_t c, bool ip, int N) {
  ops->push_back({Collective::AllReduce, loomFloat32, loomSum, c, 0, ip});
  ops->push_back({Collective::ReduceScatter, loomInt32, loomSum, c, 0, ip});
  ops->push_back({Collective::AllGather, loomFloat16, loomSum, c, 0, ip});
  ops->push_back({Collective::Broadcast, loomUint8, loomSum, c, N - 1, ip});
  ops->push_back({Collective::Reduce, loomFloat64, loomMax, c, N / 2, ip});
  ops->push_back({Collective::AllToAll, loomBfloat16, loomSum, c, 0, ip});
  ops->push_back({Collective::Gather, loomInt64, loomSum, c, N - 1, ip});
  ops->push_back({Collective::Scatter, loomFloat32, loomSum, c, N / 2, ip});
}

std::vector<Op> everyCollective(int N) {
  std::vector<Op> ops;
  const size_t counts[] = {1, 7, 1000};
  for (size_t c : counts) {
    for (bool ip : {false, true}) addEachCollective(&ops, c, ip, N);
  }
  // The exchanges in more types, and a root other than the usual ones.
  ops.push_back({Collective::AllToAll, loomInt8, loomSum, 333, 0, false});
  ops.push_back({Collective::AllToAll, loomFloat64, loomSum, 129, 0, false});
  ops.push_back({Collective::AllToAll, loomInt8, loomSum, 333, 0, true});
  ops.push_back({Collective::Gather, loomUint8, loomSum, 1500, 0, true});
  ops.push_back({Collective::Gather, loomFloat16, loomSum, 77, N / 2, false});
  ops.push_back({Collective::Scatter, loomInt32, loomSum, 1100, N - 1, true});
  ops.push_back({Collective::Scatter, loomUint64, loomSum, 65, 0, false});
  // Every reduction op and a spread of types, one-shot and rs+ag sizes.
  ops.push_back({Collective::AllReduce, loomBfloat16, loomAvg, 3000, 0, false});
  ops.push_back({Collective::AllReduce, loomInt8, loomProd, 513, 0, true});
  ops.push_back({Collective::AllReduce, loomUint64, loomMin, 90, 0, false});
  ops.push_back({Collective::AllReduce, loomFloat16, loomMax, 2048, 0, true});
  ops.push_back({Collective::ReduceScatter, loomFloat32, loomAvg, 300, 0, false});
  ops.push_back({Collective::Reduce, loomInt64, loomSum, 700, 0, false});
  ops.push_back({Collective::AllReduce, loomFloat32, loomSum, 0, 0, false});  // count 0: nothing
  return ops;
}

}  // namespace

TEST_CASE("device communicator (simulated device): every collective is exact, N = 1..5, ranks sharing a device "
          "and on two, ops back to back",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;    // many rounds per operation
  opts.oneShotBytes = 512;  // both all-reduce programs
  for (int N = 1; N <= 5; ++N)
    for (int gpus : {1, 2}) {
      if (gpus > N) continue;
      SimComms s(N, gpus, opts);
      for (int r = 0; r < N; ++r) REQUIRE(s.initErrors[size_t(r)].empty());
      std::mt19937_64 rng(uint64_t(N * 10 + gpus));
      std::vector<Prepared> ps;
      for (const Op& o : everyCollective(N)) ps.push_back(prepare(s, o, rng));
      // Every rank issues all of them, then one synchronisation.
      for (int r = 0; r < N; ++r)
        for (const Prepared& p : ps) issue(s, p, r);
      std::string bad = syncAll(s);
      INFO("N=" << N << " gpus=" << gpus << ": " << bad);
      REQUIRE(bad.empty());
      int wrong = 0;
      for (const Prepared& p : ps) {
        std::string why = verify(p, N);
        if (!why.empty() && ++wrong <= 3) FAIL_CHECK(why);
      }
      CHECK(wrong == 0);
      // The peers' blocks were opened through handles once each, not per op.
      if (N > 1) CHECK(s.comms[0]->imports().opens() == size_t(N - 1));
      CHECK(s.comms[0]->round() == s.comms[size_t(N - 1)]->round());
    }
}

TEST_CASE("device communicator (simulated device): ranks of one process use each other's windows directly, "
          "no handle is opened",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  SimComms s(3, 1, opts, /*distinctProcesses=*/false);
  std::mt19937_64 rng(5);
  Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 600, 0, false}, rng);
  for (int r = 0; r < 3; ++r) issue(s, p, r);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, 3).empty());
  CHECK(s.mem.opens() == 0);
  CHECK(s.comms[1]->imports().opens() == 0);
}

TEST_CASE("device communicator (simulated device): run() returns before the work runs, the result is there "
          "after the stream synchronises, and the caller's earlier work comes first",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.oneShotBytes = 0;  // the two-stream program: its fork must wait for the caller's work too
  SimComms s(2, 2, opts);
  std::mt19937_64 rng(9);
  Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 1000, 0, false}, rng);
  std::atomic<bool> open{false};
  struct Opener {  // a failed REQUIRE must not leave the streams blocked
    std::atomic<bool>& o;
    ~Opener() { o.store(true); }
  } opener{open};
  // The caller's own "kernel" on its stream: blocks until released, then
  // writes the input the collective must read (order: it runs first).
  std::vector<std::vector<uint8_t>> later(2);
  for (int r = 0; r < 2; ++r) {
    later[size_t(r)].resize(p.input[size_t(r)].size());
    fillRandom(later[size_t(r)].data(), 1000, loomInt32, rng);
    uint8_t* dst = p.send[size_t(r)];
    const std::vector<uint8_t>* src = &later[size_t(r)];
    s.world.rank(r).enqueueWork(0, [&open, dst, src] {
      while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      memcpy(dst, src->data(), src->size());
    });
  }
  std::vector<uint8_t> garbage(p.recv[0], p.recv[0] + p.recvBytes);
  for (int r = 0; r < 2; ++r) issue(s, p, r);  // must not block on the stream
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(memcmp(p.recv[0], garbage.data(), garbage.size()) == 0);  // nothing ran yet
  open.store(true);
  REQUIRE(syncAll(s).empty());
  // Expected from the inputs the caller's work wrote.
  std::vector<int32_t> a(1000), b(1000);
  memcpy(a.data(), later[0].data(), 4000);
  memcpy(b.data(), later[1].data(), 4000);
  std::vector<int32_t> got(1000);
  for (int r = 0; r < 2; ++r) {
    memcpy(got.data(), p.recv[size_t(r)], 4000);
    int wrong = 0;
    for (size_t i = 0; i < 1000; ++i) wrong += got[i] != int32_t(uint32_t(a[i]) + uint32_t(b[i]));
    CHECK(wrong == 0);
  }
}

TEST_CASE("device communicator (simulated device): host memory, another device's memory and collectives it does "
          "not serve are clear errors, and the communicator still works after them",
          "[devcomm]") {
  SimComms s(2, 2, {});
  std::vector<float> host(16);
  uint8_t* dev0 = s.mem.alloc(0, 64);
  uint8_t* dev1 = s.mem.alloc(1, 64);
  loom::OpDesc d;
  d.coll = Collective::AllReduce;
  d.count = 16;
  d.dtype = loomFloat32;
  auto err = [&](loom::OpDesc op, loomResult_t* code) {
    try {
      s.comms[0]->run(op, nullptr);
    } catch (const loom::Error& e) {
      *code = e.code();
      return std::string(e.what());
    }
    *code = loomSuccess;
    return std::string();
  };
  loomResult_t rc;
  d.sendbuf = host.data();
  d.recvbuf = dev0;
  std::string m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("sendbuff") != std::string::npos);
  CHECK(m.find("is host memory, but this communicator runs on sim:0") != std::string::npos);
  d.sendbuf = dev0;
  d.recvbuf = dev1;
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("recvbuff") != std::string::npos);
  CHECK(m.find("is memory of sim:1, but this communicator runs on sim:0") != std::string::npos);
  // Reductions load whole elements: a float buffer two bytes off is refused
  // (on a GPU it would fault); a byte type, or a copy, takes any address.
  uint8_t* dev0b = s.mem.alloc(0, 256);
  d.sendbuf = dev0b + 2;
  d.recvbuf = dev0b + 128;
  d.count = 8;
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("sendbuff") != std::string::npos);
  CHECK(m.find("is not aligned to its float32 elements (4 bytes)") != std::string::npos);
  d.coll = Collective::Reduce;
  d.root = 0;
  d.sendbuf = dev0b;
  d.recvbuf = dev0b + 130;
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("recvbuff") != std::string::npos);
  d.root = 1;  // this rank does not receive: its recvbuff is not read
  CHECK(loom::deviceOpShape(d, 0, 2).needRecv == false);
  d.coll = Collective::AllReduce;
  d.count = 16;
  // A receive into host memory; a tagged receive (not served).
  d.coll = Collective::P2P;
  d.peer = 1;
  d.recvbuf = host.data();
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("recvbuff") != std::string::npos);
  d.recvbuf = dev0;
  d.tagged = true;
  m = err(d, &rc);
  CHECK(rc == loomInvalidUsage);
  CHECK(m.find("tagged send/recv (loomSendTagged/loomRecvTagged) is not supported on sim communicators") !=
        std::string::npos);
  d.tagged = false;
  // The exchanges check their buffers like the rest: scatter's root needs
  // device memory to send from, gather's root to receive into.
  d.coll = Collective::Scatter;
  d.root = 0;
  d.sendbuf = host.data();
  d.recvbuf = dev0;
  d.count = 4;
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("sendbuff") != std::string::npos);
  CHECK(m.find("is host memory") != std::string::npos);
  d.coll = Collective::Gather;
  d.sendbuf = dev0;
  d.recvbuf = host.data();
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("recvbuff") != std::string::npos);
  d.coll = Collective::AllToAll;
  d.sendbuf = dev1;
  d.recvbuf = dev0;
  m = err(d, &rc);
  CHECK(rc == loomInvalidArgument);
  CHECK(m.find("is memory of sim:1, but this communicator runs on sim:0") != std::string::npos);
  CHECK(s.comms[0]->round() == 0);  // nothing was compiled
  // Still usable: a real operation on both ranks.
  std::mt19937_64 rng(3);
  Prepared p = prepare(s, {Collective::Broadcast, loomFloat32, loomSum, 40, 1, false}, rng);
  for (int r = 0; r < 2; ++r) issue(s, p, r);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, 2).empty());
}

TEST_CASE("device communicator (simulated device): a device error while enqueueing fails the communicator for "
          "good, with the device's message",
          "[devcomm]") {
  SimComms s(1, 1, {});
  std::mt19937_64 rng(8);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 64, 0, false}, rng);
  s.drivers[0]->failLaunch = true;
  try {
    issue(s, p, 0);
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
    CHECK(std::string(e.what()).find("device lost") != std::string::npos);
  }
  CHECK(s.comms[0]->failed());
  s.drivers[0]->failLaunch = false;
  try {
    issue(s, p, 0);
    FAIL("a failed communicator ran an operation");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
    CHECK(std::string(e.what()).find("the sim communicator has failed") != std::string::npos);
  }
}

TEST_CASE("device communicator (simulated device): a CUDA error in the watchdog's flag reads (a sticky device "
          "error) fails the communicator with CUDA's message instead of leaving it to time out",
          "[devcomm]") {
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.drainTimeoutMs = 200;
  opts.timeoutMs = 60000;  // a watched communicator (it reads its flags while a program is pending)
  SimComms s(2, 2, opts, true, so);
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  std::mt19937_64 rng(9);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
  s.drivers[1]->failReads = true;
  issue(s, p, 1);  // waits for rank 0, which has not called: the watchdog reads rank 1's flags
  std::string why;
  loomResult_t code = loomSuccess;
  for (int i = 0; i < 500 && code == loomSuccess; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    code = s.comms[1]->failure(&why);
  }
  CHECK(code == loomUnhandledCudaError);
  INFO(why);
  CHECK(why.find("the device failed") != std::string::npos);
  CHECK(why.find("illegal memory access") != std::string::npos);
  s.drivers[1]->failReads = false;
  issue(s, p, 0);  // rank 1's streams were released: nothing hangs
  std::string msg;
  CHECK(s.world.rank(1).synchronize(&msg) == loomSuccess);
  s.comms[0]->markFailed(loomRemoteError, "rank 1 failed (the test)");  // as its control plane would say
}

TEST_CASE("device communicator (simulated device): ranks with different slot sizes fail init on every rank",
          "[devcomm]") {
  SimComms s(2, 1, {}, true, {}, {1024, 2048});
  for (int r = 0; r < 2; ++r) {
    INFO(s.initErrors[size_t(r)]);
    CHECK(s.initErrors[size_t(r)].find("every rank must use the same slot size") != std::string::npos);
  }
  CHECK(s.mem.openMappings() == 0);  // nothing left mapped
}

TEST_CASE("device communicator (simulated device): a dead rank (its streams stopped, its control socket refusing) "
          "is found by the others' watchdogs, which release their streams: they complete, and the communicators "
          "fail naming it",
          "[devcomm][abort]") {
  // The simulated device's waits end only when their flag is written, as a
  // GPU's: nothing but the communicator's release ends them.
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;  // far beyond the 50 ms probe: a wait still pending then was never released
  so.peerShortcuts = false;
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.drainTimeoutMs = 200;
  opts.probeAfterMs = 50;
  loomsim::SimDeviceWorld* world = nullptr;
  opts.peerGone = [&world](int peer, std::string* why) {  // as the control plane answers for a dead process
    if (!world || !world->dead(peer)) return false;
    *why = "its control socket refuses";
    return true;
  };
  SimComms s(3, 1, opts, true, so);
  world = &s.world;
  std::mt19937_64 rng(4);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 100, 0, false}, rng);
  s.world.kill(2);
  for (int r = 0; r < 2; ++r) issue(s, p, r);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // released, not failed by the device
    INFO(msg);
    std::string why;
    CHECK(s.comms[size_t(r)]->failure(&why) == loomRemoteError);
    INFO(why);
    CHECK(why.find("rank 2 is gone (its control socket refuses)") != std::string::npos);
  }
}

TEST_CASE("device communicator (simulated device): destroying a rank while a peer has yet to read its window "
          "returns at once, and the window stays until the peer has read it and unmapped it",
          "[devcomm][unmap]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  SimComms s(2, 2, opts);
  std::mt19937_64 rng(6);
  // A broadcast from rank 0: rank 0's program ends without waiting for
  // rank 1, whose stream is held back by the caller's own work.  One round
  // (800 bytes): a second would wait for rank 1's done flag of the first.
  Prepared p = prepare(s, {Collective::Broadcast, loomInt32, loomSum, 200, 0, false}, rng);
  std::atomic<bool> open{false};
  struct Opener {  // a failed REQUIRE must not leave rank 1's stream blocked
    std::atomic<bool>& o;
    ~Opener() { o.store(true); }
  } opener{open};
  s.world.rank(1).enqueueWork(0, [&open] {
    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  for (int r = 0; r < 2; ++r) issue(s, p, r);
  std::string msg;
  const loomResult_t rc0 = s.world.rank(0).synchronize(&msg);
  INFO(msg);
  REQUIRE(rc0 == loomSuccess);
  const size_t frees = s.mem.frees();
  const int64_t t0 = loom::nowMs();
  s.comms[0].reset();
  CHECK(loom::nowMs() - t0 < 5000);  // not the 10 s drain: rank 1 holds rank 0's board
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(s.mem.frees() == frees);  // rank 1 has not read rank 0's window yet
  open.store(true);
  REQUIRE(s.world.rank(1).synchronize(&msg) == loomSuccess);
  CHECK(verify(p, 2).empty());  // it read the window after rank 0's destroy
  CHECK(s.mem.frees() == frees);  // and still maps it
  s.comms[1].reset();
  REQUIRE(loom::waitDeviceRemains(10000));
  CHECK(s.mem.frees() == frees + 2);
  CHECK(s.mem.freedWhileMapped() == 0);
}

TEST_CASE("device communicator (simulated device): a rank's device memory is freed only once no peer maps it, "
          "destroy returns without waiting for that, and two communicators destroyed in opposite orders on two "
          "ranks never wait for each other",
          "[devcomm][unmap]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;  // drainTimeoutMs stays at its 10 s default
  std::mt19937_64 rng(21);
  SECTION("one rank destroyed long before the other") {
    SimComms s(3, 2, opts);
    Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 600, 0, false}, rng);
    for (int r = 0; r < 3; ++r) issue(s, p, r);
    for (int r = 0; r < 3; ++r) {
      std::string msg;
      REQUIRE(s.world.rank(r).synchronize(&msg) == loomSuccess);
    }
    CHECK(verify(p, 3).empty());
    const size_t frees = s.mem.frees(), mappings = s.mem.openMappings();
    CHECK(mappings == 6);  // every rank maps both peers' blocks
    const int64_t t0 = loom::nowMs();
    s.comms[0].reset();
    CHECK(loom::nowMs() - t0 < 5000);  // not a wait for ranks 1 and 2
    CHECK(s.mem.openMappings() == mappings - 2);  // rank 0's of its peers: closed
    CHECK(loom::deviceRemainsPending() == 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(s.mem.frees() == frees);  // ranks 1 and 2 still map rank 0's block
    s.comms[1].reset();
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    CHECK(s.mem.frees() == frees);  // rank 2 still maps both
    CHECK(loom::deviceRemainsPending() == 2);
    s.comms[2].reset();  // maps nobody's now: all three go
    REQUIRE(loom::waitDeviceRemains(10000));
    CHECK(s.mem.frees() == frees + 3);
    CHECK(s.mem.openMappings() == 0);
    CHECK(s.mem.freedWhileMapped() == 0);
  }
  SECTION("opposite orders") {
    SimComms a(2, 1, opts), b(2, 1, opts);
    for (SimComms* s : {&a, &b}) {
      Prepared p = prepare(*s, {Collective::AllReduce, loomFloat32, loomSum, 300, 0, false}, rng);
      for (int r = 0; r < 2; ++r) issue(*s, p, r);
      for (int r = 0; r < 2; ++r) {
        std::string msg;
        REQUIRE(s->world.rank(r).synchronize(&msg) == loomSuccess);
      }
    }
    const size_t liveA = a.mem.live(), liveB = b.mem.live();  // the blocks and the test's buffers
    std::atomic<int64_t> longest{0};
    auto destroy = [&longest](std::unique_ptr<loom::DeviceComm>& c) {
      const int64_t t0 = loom::nowMs();
      c.reset();
      const int64_t took = loom::nowMs() - t0;
      if (took > longest.load()) longest.store(took);
    };
    std::thread r0([&] {
      destroy(a.comms[0]);
      destroy(b.comms[0]);
    });
    std::thread r1([&] {
      destroy(b.comms[1]);
      destroy(a.comms[1]);
    });
    r0.join();
    r1.join();
    CHECK(longest.load() < 5000);  // neither waited out the other's 10 s
    REQUIRE(loom::waitDeviceRemains(10000));
    CHECK(a.mem.live() == liveA - 2);
    CHECK(b.mem.live() == liveB - 2);
    CHECK(a.mem.freedWhileMapped() + b.mem.freedWhileMapped() == 0);
  }
}

TEST_CASE("device communicator (simulated device): memory a peer still maps past reapTimeoutMs is kept and "
          "still freed once the peer lets go, not given up on",
          "[devcomm][unmap]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.reapTimeoutMs = 50;
  SimComms s(2, 1, opts);
  const size_t frees = s.mem.frees();
  s.comms[0].reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // well past its deadline
  CHECK(loom::deviceRemainsPending() == 1);  // still polled, not given up on
  CHECK(s.mem.frees() == frees);
  s.comms[1].reset();
  REQUIRE(loom::waitDeviceRemains(10000));
  CHECK(s.mem.frees() == frees + 2);
  CHECK(s.mem.freedWhileMapped() == 0);
}

TEST_CASE("device communicator (simulated device): a rank that cannot map a peer's memory at init fails every "
          "rank's init, naming itself and CUDA's error, and leaves nothing allocated",
          "[devcomm][unmap]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  loomsim::g_failOpenRank.store(2);
  struct Restore {
    ~Restore() { loomsim::g_failOpenRank.store(-1); }
  } restore;
  SimComms s(3, 1, opts);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << s.initErrors[size_t(r)]);
    CHECK(!s.comms[size_t(r)]);
    const std::string& e = s.initErrors[size_t(r)];
    CHECK(e.find("cudaIpcOpenMemHandle failed") != std::string::npos);
    if (r != 2) CHECK(e.find("rank 2 could not set up its device window") != std::string::npos);
  }
  REQUIRE(loom::waitDeviceRemains(10000));
  CHECK(s.mem.live() == 0);
  CHECK(s.mem.openMappings() == 0);
  CHECK(s.mem.freedWhileMapped() == 0);
}

TEST_CASE("map board: a peer's lock says it may still map the owner's memory, until it lets go, its process is "
          "killed, or it never took it, and a board that is not there is a clear error",
          "[devcomm][unmap]") {
  const uint64_t token = loom::thisProcessToken() ^ 0x5a5a;  // not a communicator's board
  loom::MapBoard board(token);
  CHECK(board.path().find("loom-maps-") != std::string::npos);
  CHECK(!board.held(1));
  {
    loom::MapHold h(token, board.serial(), 1);
    CHECK(board.held(1));
    CHECK(!board.held(2));
    CHECK(board.holders({0, 1, 2}) == std::vector<int>{1});
  }
  CHECK(!board.held(1));  // let go
  {
    // Names left by processes killed inside init are skipped, never reused.
    std::vector<std::string> stale;
    for (uint32_t k = 1; k <= 3; ++k) {
      stale.push_back(loom::mapBoardPath(token, board.serial() + k));
      const int fd = open(stale.back().c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      REQUIRE(fd >= 0);
      close(fd);
    }
    loom::MapBoard next(token);
    CHECK(next.serial() == board.serial() + 4);
    for (const std::string& p : stale) unlink(p.c_str());
  }
  {
    // A child forked while a hold is taken shares the open file: letting go
    // here still lets go.
    auto h = std::make_unique<loom::MapHold>(token, board.serial(), 4);
    const pid_t idle = fork();
    REQUIRE(idle >= 0);
    if (idle == 0)
      for (;;) pause();
    CHECK(board.held(4));
    h.reset();
    CHECK(!board.held(4));
    kill(idle, SIGKILL);
    waitpid(idle, nullptr, 0);
  }
  // Another process's hold, and that process killed: the kernel lets go.
  const std::string path = board.path();
  int ready[2];
  REQUIRE(pipe(ready) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // open and fcntl only: this process has threads
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct flock l;
    memset(&l, 0, sizeof l);
    l.l_type = F_RDLCK;
    l.l_whence = SEEK_SET;
    l.l_start = 3;
    l.l_len = 1;
    const char ok = fd >= 0 && fcntl(fd, F_OFD_SETLK, &l) == 0 ? 'y' : 'n';
    if (write(ready[1], &ok, 1) != 1) _exit(1);
    for (;;) pause();
  }
  close(ready[1]);
  char ok = 0;
  REQUIRE(read(ready[0], &ok, 1) == 1);
  close(ready[0]);
  CHECK(ok == 'y');
  CHECK(board.held(3));
  board.unlink();  // the name goes; the locks stay
  CHECK(access(path.c_str(), F_OK) != 0);
  CHECK(board.held(3));
  kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  CHECK(!board.held(3));
  try {
    loom::MapHold gone(token, board.serial(), 1);  // unlinked: cannot be opened any more
    FAIL("a board that is not there was opened");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomSystemError);
    CHECK(std::string(e.what()).find(path) != std::string::npos);
  }
}

TEST_CASE("device communicator (simulated device): an abandoned communicator (failed or aborted) is destroyed "
          "without waiting for peers that never finish",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;  // drainTimeoutMs stays at its 10 s default
  SimComms s(2, 1, opts);
  std::mt19937_64 rng(7);
  Prepared p = prepare(s, {Collective::Broadcast, loomInt32, loomSum, 100, 0, false}, rng);
  issue(s, p, 0);  // rank 1 never takes part
  std::string msg;
  REQUIRE(s.world.rank(0).synchronize(&msg) == loomSuccess);
  s.comms[0]->abandon();
  const int64_t t0 = loom::nowMs();
  s.comms[0].reset();
  CHECK(loom::nowMs() - t0 < 5000);  // not the 10 s wait for rank 1
}

namespace {

// What the watchdogs of a test's ranks reported (onFailure runs on their threads).
struct Reported {
  std::mutex mu;
  std::vector<loomResult_t> codes;
  std::vector<std::string> msgs;
  std::vector<int> peers;
  void add(const loom::Error& e) {
    std::lock_guard<std::mutex> g(mu);
    codes.push_back(e.code());
    msgs.push_back(e.what());
    peers.push_back(e.peer());
  }
  size_t size() {
    std::lock_guard<std::mutex> g(mu);
    return codes.size();
  }
};

// The simulated device never gives up on a wait by itself within a test:
// a stream that completes was released by the communicator.
struct ScopedEnv {  // an environment variable for a scope, the configuration read again
  const char* name;
  ScopedEnv(const char* n, const char* value) : name(n) {
    setenv(n, value, 1);
    loom::configReload();
  }
  ~ScopedEnv() {
    unsetenv(name);
    loom::configReload();
  }
};

loomsim::SimDeviceOptions patientDevice() {
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 120000;
  return so;
}

loomResult_t failureOf(loom::DeviceComm& c, std::string* msg) { return c.failure(msg); }

}  // namespace

TEST_CASE("device communicator (simulated device): a peer that never arrives and is reported gone: the others' "
          "streams are released and complete, and every later call fails with loomRemoteError naming it",
          "[devcomm][abort]") {
  Reported seen;
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;  // 4000 bytes: the all-reduce takes several rounds
  opts.timeoutMs = 100000;
  opts.probeAfterMs = 50;
  opts.peerGone = [](int peer, std::string* why) {
    if (peer != 2) return false;
    *why = "test: rank 2 was killed";
    return true;
  };
  opts.onFailure = [&seen](const loom::Error& e) { seen.add(e); };
  SimComms s(3, 1, opts, true, patientDevice());
  std::mt19937_64 rng(11);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
  for (int r = 0; r < 2; ++r) issue(s, p, r);  // rank 2 never takes part
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    INFO(msg);
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // drained: released, not given up by the device
    CHECK(s.comms[size_t(r)]->programsDone());
    CHECK(s.drivers[size_t(r)]->writes.load() > 0);
    std::string why;
    CHECK(failureOf(*s.comms[size_t(r)], &why) == loomRemoteError);
    INFO(why);
    CHECK(why.find(loom::strf("rank %d: rank 2 is gone (test: rank 2 was killed)", r)) != std::string::npos);
  }
  REQUIRE(seen.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(seen.codes[i] == loomRemoteError);
    CHECK(seen.peers[i] == 2);
  }
  CHECK(!s.comms[2]->failed());  // nothing told rank 2 (it is "dead")
  // Later calls fail at once with the cause.
  try {
    issue(s, p, 0);
    FAIL("a failed communicator enqueued an operation");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomRemoteError);
    CHECK(std::string(e.what()).find("rank 2 is gone") != std::string::npos);
  }
  // Destroying the failed ones returns at once; their streams are done, but
  // rank 2 (alive in this test) still maps their memory: it is freed once
  // rank 2's communicator is destroyed too, and rank 2's at once.
  const size_t frees = s.mem.frees();
  s.comms[0].reset();
  s.comms[1].reset();
  CHECK(loom::deviceRemainsPending() == 2);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(s.mem.frees() == frees);
  s.comms[2].reset();
  REQUIRE(loom::waitDeviceRemains(10000));
  CHECK(s.mem.frees() == frees + 3);
  CHECK(s.mem.openMappings() == 0);
  CHECK(s.mem.freedWhileMapped() == 0);
}

TEST_CASE("device communicator (simulated device): failing a communicator (loomCommAbort) while its stream waits "
          "on a peer's flag returns at once and the stream drains, the peer's own waits are not released",
          "[devcomm][abort]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;  // no watchdog timeout, no probe: only the abort releases
  SimComms s(3, 1, opts, true, patientDevice());
  std::mt19937_64 rng(12);
  Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 1000, 0, false}, rng);
  for (int r = 0; r < 2; ++r) issue(s, p, r);  // rank 2 never takes part: both wait for it
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!s.comms[0]->programsDone());
  const int64_t t0 = loom::nowMs();
  CHECK(s.comms[0]->markFailed(loomRemoteError, "rank 0: the communicator was aborted"));
  CHECK(loom::nowMs() - t0 < 1000);  // never waits for the device
  CHECK(!s.comms[0]->markFailed(loomTimeout, "later"));  // the first failure stays
  std::string msg;
  REQUIRE(s.world.rank(0).synchronize(&msg) == loomSuccess);
  CHECK(s.comms[0]->programsDone());
  std::string why;
  CHECK(failureOf(*s.comms[0], &why) == loomRemoteError);
  CHECK(why == "rank 0: the communicator was aborted");
  // Rank 1 was not aborted: it still waits (for rank 2) until it fails too.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!s.comms[1]->programsDone());
  CHECK(!s.comms[1]->failed());
  s.comms[1]->markFailed(loomRemoteError, "rank 1: the communicator failed on rank 0");
  REQUIRE(s.world.rank(1).synchronize(&msg) == loomSuccess);
}

TEST_CASE("device communicator (simulated device): the watchdog fails with loomTimeout naming the peer when no flag "
          "moves for timeoutMs, and releases the streams",
          "[devcomm][abort]") {
  Reported seen;
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.oneShotBytes = 0;  // the two-stream program: both streams are released
  opts.timeoutMs = 300;
  opts.probeAfterMs = 50;
  std::atomic<int> probes{0};
  opts.peerGone = [&probes](int, std::string*) {
    probes.fetch_add(1);
    return false;  // alive, only late
  };
  opts.onFailure = [&seen](const loom::Error& e) { seen.add(e); };
  SimComms s(2, 2, opts, true, patientDevice());
  std::mt19937_64 rng(13);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
  issue(s, p, 0);  // rank 1 never arrives
  std::string msg;
  REQUIRE(s.world.rank(0).synchronize(&msg) == loomSuccess);
  std::string why;
  CHECK(failureOf(*s.comms[0], &why) == loomTimeout);
  INFO(why);
  CHECK(why.find("rank 0: no progress on sim:0 for") != std::string::npos);
  CHECK(why.find("this rank's streams wait for rank 1") != std::string::npos);
  REQUIRE(seen.size() == 1);
  CHECK(seen.codes[0] == loomTimeout);
  CHECK(seen.peers[0] == 1);
  CHECK(probes.load() > 0);  // asked before giving up
  CHECK(!s.comms[1]->failed());  // rank 1 had nothing pending
}

TEST_CASE("device communicator (simulated device): a failed communicator destroyed while its stream has not reached "
          "the released wait yet returns at once and frees its memory only once the stream is done",
          "[devcomm][abort]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  SimComms s(2, 1, opts, true, patientDevice());
  std::mt19937_64 rng(14);
  Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 1000, 0, false}, rng);
  std::atomic<bool> open{false};
  struct Opener {  // a failed REQUIRE must not leave the stream blocked
    std::atomic<bool>& o;
    ~Opener() { o.store(true); }
  } opener{open};
  // The caller's own work ahead of the collective on its stream.
  s.world.rank(0).enqueueWork(0, [&open] {
    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  issue(s, p, 0);  // rank 1 never takes part
  s.comms[0]->markFailed(loomRemoteError, "rank 0: the communicator was aborted");
  s.comms[0]->abandon();
  const size_t frees = s.mem.frees();
  const int64_t t0 = loom::nowMs();
  s.comms[0].reset();
  CHECK(loom::nowMs() - t0 < 1000);
  CHECK(loom::deviceRemainsPending() == 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK(s.mem.frees() == frees);  // the stream will still touch it
  open.store(true);
  std::string msg;
  REQUIRE(s.world.rank(0).synchronize(&msg) == loomSuccess);  // released: it ran to its end
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  CHECK(s.mem.frees() == frees);  // and rank 1 still maps it
  CHECK(s.mem.openMappings() == 1);  // rank 0's of rank 1 closed: its streams are done
  s.comms[1].reset();
  REQUIRE(loom::waitDeviceRemains(10000));
  CHECK(s.mem.frees() == frees + 2);
  CHECK(s.mem.openMappings() == 0);
  CHECK(s.mem.freedWhileMapped() == 0);
}

TEST_CASE("IPC import cache: one open per (rank, base), offsets applied, kept while referenced, reopened when the "
          "owner reuses the address",
          "[devcomm]") {
  SimMemory mem;
  SimDriver owner(mem, nullptr, 0, 0), reader(mem, nullptr, 1, 0);
  uint8_t* a = mem.alloc(0, 4096);
  loom::IpcRecord rec = loom::exportRange(owner, a + 512, 1024, /*process=*/100);
  CHECK(rec.offset == 512);
  CHECK(rec.allocBytes == 4096);
  CHECK(rec.base == uint64_t(reinterpret_cast<uintptr_t>(a)));
  {
    loom::IpcImportCache cache(reader, /*myProcess=*/200);
    uint8_t* m1 = cache.import(0, rec);
    uint8_t* m2 = cache.import(0, rec);
    CHECK(m1 == m2);
    CHECK(m1 != a + 512);  // mapped again, elsewhere
    CHECK(cache.opens() == 1);
    m1[3] = 0x5c;  // the same memory
    CHECK(a[512 + 3] == 0x5c);
    cache.release(0, rec);
    cache.release(0, rec);
    CHECK(cache.mapped() == 1);  // kept for the next operation
    // The same base from another rank is another entry.
    cache.import(1, rec);
    CHECK(cache.opens() == 2);
    cache.release(1, rec);

    // The owner frees and reallocates; if the address comes back, the
    // handle differs and the old mapping is not reused.
    uint8_t* keep = cache.import(0, rec);  // referenced while replaced
    // What a new allocation at that address would publish: the same base,
    // another handle (here: another allocation's).
    uint8_t* b = mem.alloc(0, 4096);
    loom::IpcRecord again = rec;
    mem.handle(b, again.handle);
    uint8_t* m3 = cache.import(0, again);
    CHECK(cache.opens() == 3);
    CHECK(m3 != keep);
    CHECK(cache.mapped() == 3);  // the replaced mapping stays until released
    cache.release(0, rec);
    CHECK(cache.mapped() == 2);
    cache.release(0, again);

    // A record whose range is outside its allocation is refused.
    loom::IpcRecord bad = rec;
    bad.offset = 4000;
    try {
      cache.import(0, bad);
      FAIL("accepted a range outside its allocation");
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomRemoteError);
    }
    // This process's own memory is not opened.
    loom::IpcRecord own = loom::exportRange(owner, a, 64, 200);
    CHECK(cache.import(0, own) == a);
    CHECK(cache.opens() == 3);
    cache.release(0, own);
  }
  CHECK(mem.openMappings() == 0);  // the cache closed every mapping it opened
}

namespace {

// The IPC path's device side of a communicator (its round counter).
loom::DeviceComm& ipcOf(loomComm_t c) {
  auto* d = dynamic_cast<loom::DeviceComm*>(c->deviceComm());
  REQUIRE(d != nullptr);
  return *d;
}

struct DeviceEnv {  // LOOM_DEVICE=cuda with simulated drivers, undone on scope exit
  SimMemory& mem;
  DeviceEnv(SimMemory& m, loomsim::SimDeviceWorld& world) : mem(m) {
    loom::setDeviceDriverFactoryForTesting(
        [&m, &world](int r, int, int) { return std::make_unique<SimDriver>(m, &world, r, 0); });
    setenv("LOOM_DEVICE", "cuda", 1);
    loom::configReload();
  }
  ~DeviceEnv() {
    unsetenv("LOOM_DEVICE");
    loom::configReload();
    loom::setDeviceDriverFactoryForTesting(nullptr);
    CHECK(loom::waitDeviceRemains(30000));  // the reaper may hold memory of this test's device
    CHECK(mem.freedWhileMapped() == 0);     // never freed while a peer maps it (CUDA: undefined)
  }
};

}  // namespace

TEST_CASE("CUDA communicator through the C API (LOOM_DEVICE=cuda, simulated device): collectives are enqueued on "
          "the caller's stream and exact after it synchronises (the exchanges and groups of collectives too), host "
          "memory, loom streams, bad group members and calls the device path does not serve are clear errors",
          "[devcomm][api]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256);
  DeviceEnv env(mem, world);
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comms[2] = {nullptr, nullptr};
  loomResult_t rcs[2];
  std::string errs[2];
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        rcs[r] = loomCommInitRank(&comms[r], 2, id, r);
        errs[r] = loomGetLastError(nullptr);
      });
    for (auto& t : ts) t.join();
  }
  INFO(errs[0] << " / " << errs[1]);
  REQUIRE(rcs[0] == loomSuccess);
  REQUIRE(rcs[1] == loomSuccess);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));  // a cudaStream_t: never dereferenced

  // One-shot (small) and reduce-scatter + all-gather (large) all-reduces,
  // and an all-gather, back to back; results only after synchronising.
  const size_t counts[] = {1000, 200000};
  std::vector<int32_t*> send, recv;
  for (size_t n : counts)
    for (int r = 0; r < 2; ++r) {
      auto* s = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
      auto* d = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
      for (size_t i = 0; i < n; ++i) s[i] = int32_t(i * 7 + size_t(r) * 1000003), d[i] = -1;
      send.push_back(s);
      recv.push_back(d);
    }
  auto* agIn = reinterpret_cast<int32_t*>(mem.alloc(0, 2 * 64 * 4));
  auto* agOut = reinterpret_cast<int32_t*>(mem.alloc(0, 2 * 2 * 64 * 4));
  for (int i = 0; i < 2 * 64; ++i) agIn[i] = i;
  for (int k = 0; k < 2; ++k)
    for (int r = 0; r < 2; ++r)
      CHECK(loomAllReduce(send[size_t(2 * k + r)], recv[size_t(2 * k + r)], counts[k], loomInt32, loomSum, comms[r],
                          k ? fakeStream : nullptr) == loomSuccess);
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllGather(agIn + 64 * r, agOut + 128 * r, 64, loomInt32, comms[r], fakeStream) == loomSuccess);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  for (int k = 0; k < 2; ++k) {
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < counts[k]; ++i)
        wrong += recv[size_t(2 * k + r)][i] != int32_t(uint32_t(send[size_t(2 * k)][i]) + uint32_t(send[size_t(2 * k + 1)][i]));
    CHECK(wrong == 0);
  }
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 128; ++i) CHECK(agOut[128 * r + i] == i);

  // The exchanges through the C API: all-to-all, gather and scatter (root
  // 1, scatter in place), back to back on the caller's stream.
  const int kE = 50;
  auto* x = reinterpret_cast<int32_t*>(mem.alloc(0, 2 * 6 * kE * 4));  // per rank: a2a in, a2a out, gather/scatter
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 6 * kE; ++i) x[6 * kE * r + i] = 100000 * r + i;
  auto base = [&](int r, int part) { return x + 6 * kE * r + 2 * kE * part; };
  for (int r = 0; r < 2; ++r) {
    CHECK(loomAllToAll(base(r, 0), base(r, 1), kE, loomInt32, comms[r], fakeStream) == loomSuccess);
    CHECK(loomGather(base(r, 2) + kE * r, base(r, 2), kE, loomInt32, 1, comms[r], fakeStream) == loomSuccess);
    CHECK(loomScatter(base(r, 2), base(r, 2) + kE * r, kE, loomInt32, 1, comms[r], fakeStream) == loomSuccess);
  }
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  {
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (int q = 0; q < 2; ++q)
        for (int i = 0; i < kE; ++i) {
          // all-to-all: block q of rank r's output is block r of rank q's input
          wrong += base(r, 1)[kE * q + i] != 100000 * q + kE * r + i;
        }
    // gather at root 1 (in place: its own block already there), then
    // scatter from root 1 in place: rank 1 keeps its block, rank 0 gets
    // block 0 of the root's gathered buffer, which is rank 0's own block.
    for (int q = 0; q < 2; ++q)
      for (int i = 0; i < kE; ++i) wrong += base(1, 2)[kE * q + i] != 100000 * q + 4 * kE + kE * q + i;
    for (int i = 0; i < kE; ++i) wrong += base(0, 2)[i] != 4 * kE + i;
    CHECK(wrong == 0);
  }

  // Errors, each with its message.
  std::vector<float> host(16);
  float* dev = reinterpret_cast<float*>(mem.alloc(0, 64));
  CHECK(loomAllReduce(host.data(), dev, 16, loomFloat32, loomSum, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("sendbuff") != std::string::npos);
  CHECK(std::string(loomGetLastError(comms[0])).find("is host memory, but this communicator runs on sim:0") !=
        std::string::npos);
  loomStream_t hs;
  REQUIRE(loomStreamCreate(&hs) == loomSuccess);
  CHECK(loomAllReduce(dev, dev, 16, loomFloat32, loomSum, comms[0], hs) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("is a loom host stream, but this communicator runs on CUDA") !=
        std::string::npos);
  CHECK(loomStreamDestroy(hs) == loomSuccess);
  CHECK(loomSendTagged(dev, 16, loomFloat32, 1, 7, comms[0], fakeStream) == loomInvalidUsage);
  CHECK(std::string(loomGetLastError(comms[0])).find("tagged send/recv") != std::string::npos);
  CHECK(loomSend(host.data(), 16, loomFloat32, 1, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("is host memory") != std::string::npos);
  CHECK(loomRecv(dev, 16, loomFloat32, 2, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("peer 2 is out of range") != std::string::npos);
  // The exchanges' bad arguments: a root out of range, a count whose N
  // blocks overflow, a host buffer on the root's only side.
  CHECK(loomGather(dev, dev + 4, 1, loomFloat32, 2, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("root 2 is out of range [0, 2)") != std::string::npos);
  CHECK(loomScatter(dev, dev, 1, loomFloat32, -1, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("root -1 is out of range") != std::string::npos);
  CHECK(loomAllToAll(dev, dev + 8, SIZE_MAX / 8, loomFloat32, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("too large (byte size overflows)") != std::string::npos);
  // In place is sendbuff == recvbuff; buffers that overlap otherwise are refused.
  CHECK(loomAllToAll(dev, dev + 1, 4, loomFloat32, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("overlap outside NCCL's in-place layout") != std::string::npos);
  CHECK(loomScatter(host.data(), dev, 4, loomFloat32, 0, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(comms[0])).find("sendbuff") != std::string::npos);
  CHECK(std::string(loomGetLastError(comms[0])).find("is host memory") != std::string::npos);

  // A group with a bad member (host memory; a send) enqueues nothing: the
  // good member before it never runs (its round is not used).
  const uint64_t roundBefore = ipcOf(comms[0]).round();
  REQUIRE(loomGroupStart() == loomSuccess);
  CHECK(loomAllReduce(dev, dev, 16, loomFloat32, loomSum, comms[0], fakeStream) == loomSuccess);
  CHECK(loomAllReduce(host.data(), dev, 16, loomFloat32, loomSum, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(loomGroupEnd() == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("the group was not launched") != std::string::npos);
  CHECK(std::string(loomGetLastError(nullptr)).find("is host memory") != std::string::npos);
  REQUIRE(loomGroupStart() == loomSuccess);
  CHECK(loomSend(dev, 16, loomFloat32, 1, comms[0], fakeStream) == loomSuccess);
  CHECK(loomRecv(host.data(), 16, loomFloat32, 1, comms[0], fakeStream) == loomInvalidArgument);
  CHECK(loomGroupEnd() == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("recvbuff") != std::string::npos);
  CHECK(ipcOf(comms[0]).round() == roundBefore);

  // A group of collectives on both ranks: enqueued at loomGroupEnd, in
  // order, exact after the stream synchronises.
  {
    const int kG = 300;
    auto* g = reinterpret_cast<int32_t*>(mem.alloc(0, 2 * 5 * kG * 4));  // per rank: ar, a2a in (2), a2a out (2)
    int32_t* recvP2P[2] = {reinterpret_cast<int32_t*>(mem.alloc(0, 2 * kG * 4)),
                           reinterpret_cast<int32_t*>(mem.alloc(0, 2 * kG * 4))};
    int32_t* v[2] = {reinterpret_cast<int32_t*>(mem.alloc(0, 2 * kG * 4)),
                     reinterpret_cast<int32_t*>(mem.alloc(0, 2 * kG * 4))};
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 5 * kG; ++i) g[5 * kG * r + i] = 1000 * r + i;
    for (int r = 0; r < 2; ++r) {
      int32_t* mine = g + 5 * kG * r;
      REQUIRE(loomGroupStart() == loomSuccess);
      CHECK(loomAllReduce(mine, mine, kG, loomInt32, loomSum, comms[r], fakeStream) == loomSuccess);
      CHECK(loomAllToAll(mine + kG, mine + 3 * kG, kG, loomInt32, comms[r], fakeStream) == loomSuccess);
      CHECK(loomGroupEnd() == loomSuccess);
    }
    // Then send/recv: each rank sends its all-reduce result to the other
    // and receives the other's all-to-all input (a group, both directions),
    // and an all-to-allv of uneven blocks.
    for (int r = 0; r < 2; ++r) {
      int32_t* mine = g + 5 * kG * r;
      REQUIRE(loomGroupStart() == loomSuccess);
      CHECK(loomSend(mine + kG, 2 * kG, loomInt32, 1 - r, comms[r], fakeStream) == loomSuccess);
      CHECK(loomRecv(recvP2P[size_t(r)], 2 * kG, loomInt32, 1 - r, comms[r], fakeStream) == loomSuccess);
      CHECK(loomGroupEnd() == loomSuccess);
    }
    size_t sc[2][2] = {{3, 100}, {250, 7}}, sd[2][2] = {{0, 3}, {0, 250}};
    size_t rc[2][2] = {{3, 250}, {100, 7}}, rd[2][2] = {{0, 3}, {0, 100}};
    for (int r = 0; r < 2; ++r)
      CHECK(loomAllToAllv(g + 5 * kG * r + kG, sc[r], sd[r], v[size_t(r)], rc[r], rd[r], loomInt32, comms[r],
                          fakeStream) == loomSuccess);
    for (int r = 0; r < 2; ++r) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (int r = 0; r < 2; ++r) {
      const int32_t* mine = g + 5 * kG * r;
      for (int i = 0; i < kG; ++i) wrong += mine[i] != 1000 + 2 * i;  // 1000*0 + i + 1000*1 + i
      for (int q = 0; q < 2; ++q)
        for (int i = 0; i < kG; ++i) wrong += mine[3 * kG + q * kG + i] != 1000 * q + kG + r * kG + i;
      // the other rank's all-to-all input (unchanged by the group above)
      for (int i = 0; i < 2 * kG; ++i) wrong += recvP2P[r][i] != 1000 * (1 - r) + kG + i;
      // all-to-allv: block q of rank r's output is rank q's block r
      for (int q = 0; q < 2; ++q)
        for (size_t i = 0; i < rc[r][q]; ++i) wrong += v[r][rd[r][q] + i] != int32_t(1000 * q + kG + sd[q][r] + i);
    }
    CHECK(wrong == 0);
  }
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    CHECK(loomCommDestroy(comms[r]) == loomSuccess);
  }
}

namespace {

// N CUDA communicators through the C API, one thread each, rank r on host
// hostOf(r); the codes and messages of every init in *rcs / *errs.
std::vector<loomComm_t> initCudaCommsOn(int n, const std::function<std::string(int)>& hostOf,
                                        std::vector<loomResult_t>* rcsOut = nullptr,
                                        std::vector<std::string>* errs = nullptr) {
  loomUniqueId id;
  if (loomGetUniqueId(&id) != loomSuccess) return {};
  std::vector<loomComm_t> comms(size_t(n), nullptr);
  std::vector<loomResult_t> rcs(size_t(n), loomSuccess);
  std::vector<std::string> msgs(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      loom::setThreadHostIdForTesting(hostOf(r));
      rcs[size_t(r)] = loomCommInitRank(&comms[size_t(r)], n, id, r);
      msgs[size_t(r)] = loomGetLastError(nullptr);
      loom::setThreadHostIdForTesting("");
    });
  for (auto& t : ts) t.join();
  if (rcsOut) *rcsOut = rcs;
  if (errs) *errs = msgs;
  for (loomResult_t rc : rcs)
    if (rc != loomSuccess) return {};
  return comms;
}


// N CUDA communicators (simulated device) through the C API, one thread each, all on this host.
std::vector<loomComm_t> initCudaComms(int n) {
  return initCudaCommsOn(n, [](int) { return std::string(); });
}

}  // namespace

namespace {
// Two CUDA communicators after a refused or captured call: an all-reduce
// of buf (rank r's element i = i + r) on a stream not being captured is
// exact on both; then both are destroyed.
void checkGoesOnAndDestroy(loomsim::SimDeviceWorld& world, const std::vector<loomComm_t>& comms, int32_t* const* buf,
                           size_t n, loomStream_t plain) {
  loomResult_t rcs[2];
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) buf[r][i] = int32_t(i) + r;
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r)
    ts.emplace_back([&, r] { rcs[r] = loomAllReduce(buf[r], buf[r], n, loomInt32, loomSum, comms[size_t(r)], plain); });
  for (auto& t : ts) t.join();
  CHECK(rcs[0] == loomSuccess);
  CHECK(rcs[1] == loomSuccess);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  long wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) wrong += buf[r][i] != 2 * int32_t(i) + 1;
  CHECK(wrong == 0);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
}
}  // namespace

TEST_CASE("CUDA communicator through the C API (simulated device): collectives and a group of sends and receives "
          "on a stream being captured into a CUDA graph are captured and every replay is exact, a group joining it "
          "with a stream not captured is refused, without a graph lane both are refused with loomInvalidUsage before "
          "anything is issued, and the communicator goes on",
          "[devcomm][api][graph]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256);
  DeviceEnv env(mem, world);
  const bool lane = GENERATE(true, false);
  ScopedEnv graphSlot("LOOM_DEVICE_GRAPH_SLOT_BYTES", lane ? "65536" : "0");
  std::vector<loomComm_t> comms = initCudaComms(2);
  REQUIRE(comms.size() == 2);
  loom::setCudaCaptureProbeForTesting(loomsim::simStreamCapturing);
  struct Unset {
    ~Unset() { loom::setCudaCaptureProbeForTesting(nullptr); }
  } unset;
  char keys[2];
  for (int r = 0; r < 2; ++r) REQUIRE(world.rank(r).addCallerStream(&keys[r]) > 0);
  auto* plain = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 100000;  // 400 KB: several rounds of 64 KiB graph slots
  const size_t m = 30000;  // the exchange: 120 KB, several chunks of the 32 KiB regions
  int32_t* buf[2];
  int32_t* out[2];
  int32_t* msg[2];
  int32_t* got[2];
  for (int r = 0; r < 2; ++r) {
    buf[r] = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
    out[r] = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
    msg[r] = reinterpret_cast<int32_t*>(mem.alloc(0, m * 4));
    got[r] = reinterpret_cast<int32_t*>(mem.alloc(0, m * 4));
  }
  auto* dev0 = dynamic_cast<loom::DeviceComm*>(comms[0]->deviceComm());
  REQUIRE(dev0 != nullptr);
  const uint64_t round = dev0->round();
  std::vector<loomsim::SimGraph> graphs(2);
  for (int r = 0; r < 2; ++r) {
    auto* st = reinterpret_cast<loomStream_t>(&keys[r]);
    world.rank(r).beginCapture(&keys[r]);
    const loomResult_t rc = loomAllReduce(buf[r], out[r], n, loomInt32, loomSum, comms[r], st);
    if (lane) {
      CHECK(rc == loomSuccess);
    } else {
      CHECK(rc == loomInvalidUsage);
      CHECK(std::string(loomGetLastError(comms[r])).find("LOOM_DEVICE_GRAPH_SLOT_BYTES=0") != std::string::npos);
    }
    // The two ranks swap a message: a send and a receive in one group.
    CHECK(loomGroupStart() == loomSuccess);
    const loomResult_t sent = loomSend(msg[r], m, loomInt32, 1 - r, comms[r], st);
    const loomResult_t recvd = loomRecv(got[r], m, loomInt32, 1 - r, comms[r], st);
    const loomResult_t ended = loomGroupEnd();
    if (lane) {
      CHECK(sent == loomSuccess);
      CHECK(recvd == loomSuccess);
      CHECK(ended == loomSuccess);
    } else {
      CHECK(sent == loomInvalidUsage);
      CHECK(std::string(loomGetLastError(comms[r])).find("LOOM_DEVICE_GRAPH_SLOT_BYTES=0") != std::string::npos);
      CHECK(ended != loomSuccess);
    }
    if (r == 0) {
      // A group whose calls on one communicator name the captured stream and
      // one that is not: refused at its end, nothing launched.
      CHECK(loomGroupStart() == loomSuccess);
      CHECK(loomAllGather(buf[0], out[0], 1, loomInt32, comms[0], plain) == loomSuccess);
      CHECK(loomRecv(buf[0], 10, loomInt32, 1, comms[0], st) == (lane ? loomSuccess : loomInvalidUsage));
      CHECK(loomGroupEnd() == loomInvalidUsage);
      if (lane) CHECK(std::string(loomGetLastError(comms[0])).find("joining them would pull the other into the capture") !=
                      std::string::npos);
    }
    graphs[size_t(r)] = world.rank(r).endCapture(&keys[r]);
  }
  CHECK(dev0->round() == round);  // nothing eager compiled or enqueued
  CHECK(dev0->captured() == (lane ? 2u : 0u));
  if (lane)
    for (int rep = 1; rep <= 3; ++rep) {
      for (int r = 0; r < 2; ++r) {
        for (size_t i = 0; i < n; ++i) buf[r][i] = int32_t(i) * rep + r;
        for (size_t i = 0; i < m; ++i) msg[r][i] = int32_t(i) * rep - 7 * r, got[r][i] = -1;
      }
      for (int r = 0; r < 2; ++r) world.rank(r).launchGraph(&keys[r], graphs[size_t(r)]);
      for (int r = 0; r < 2; ++r) {
        std::string why;
        CHECK(world.rank(r).synchronize(&why) == loomSuccess);
      }
      long wrong = 0;
      for (int r = 0; r < 2; ++r) {
        for (size_t i = 0; i < n; ++i) wrong += out[r][i] != 2 * int32_t(i) * rep + 1;
        for (size_t i = 0; i < m; ++i) wrong += got[r][i] != int32_t(i) * rep - 7 * (1 - r);
      }
      CHECK(wrong == 0);
    }
  // The communicator goes on: an all-reduce on a stream not being captured.
  checkGoesOnAndDestroy(world, comms, buf, n, plain);
}

namespace {
const uintptr_t kImplicitStream = 0xcafe;  // the probe below: the legacy stream during a capture
int implicitProbe(void* stream) {
  return reinterpret_cast<uintptr_t>(stream) == kImplicitStream ? 2 : loomsim::simStreamCapturing(stream);
}
}  // namespace

TEST_CASE("CUDA communicator through the C API (simulated device): the legacy stream during a capture "
          "(cudaErrorStreamCaptureImplicit) is refused by a collective, loomScale and a send, and a group joining a "
          "captured and an uncaptured stream on one communicator is refused before anything is enqueued",
          "[devcomm][api][graph]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256);
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaComms(2);
  REQUIRE(comms.size() == 2);
  loom::setCudaCaptureProbeForTesting(implicitProbe);
  struct Unset {
    ~Unset() { loom::setCudaCaptureProbeForTesting(nullptr); }
  } unset;
  char keys[2];
  for (int r = 0; r < 2; ++r) REQUIRE(world.rank(r).addCallerStream(&keys[r]) > 0);
  auto* implicit = reinterpret_cast<loomStream_t>(kImplicitStream);
  auto* plain = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 1000;
  int32_t* buf[2];
  for (int r = 0; r < 2; ++r) {
    buf[r] = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
    for (size_t i = 0; i < n; ++i) buf[r][i] = int32_t(i) + r;
  }
  auto* dev0 = dynamic_cast<loom::DeviceComm*>(comms[0]->deviceComm());
  REQUIRE(dev0 != nullptr);
  const uint64_t round = dev0->round();
  CHECK(loomAllReduce(buf[0], buf[0], n, loomInt32, loomSum, comms[0], implicit) == loomInvalidUsage);
  CHECK(std::string(loomGetLastError(comms[0])).find("legacy default stream") != std::string::npos);
  const int32_t two = 2;
  CHECK(loomScale(buf[0], buf[0], n, loomInt32, &two, 0, comms[0], implicit) == loomInvalidUsage);
  CHECK(loomSend(buf[0], 1, loomInt32, 1, comms[0], implicit) == loomInvalidUsage);
  int capturing = -1;
  CHECK(loomCudaStreamCapturing(implicit, &capturing) == loomSuccess);
  CHECK(capturing == 0);
  // A group on one communicator naming a captured and an uncaptured stream.
  world.rank(0).beginCapture(&keys[0]);
  CHECK(loomCudaStreamCapturing(&keys[0], &capturing) == loomSuccess);
  CHECK(capturing == 1);
  CHECK(loomGroupStart() == loomSuccess);
  CHECK(loomAllReduce(buf[0], buf[0], n, loomInt32, loomSum, comms[0], reinterpret_cast<loomStream_t>(&keys[0])) ==
        loomSuccess);
  CHECK(loomAllReduce(buf[0], buf[0], n, loomInt32, loomSum, comms[0], plain) == loomSuccess);
  CHECK(loomGroupEnd() == loomInvalidUsage);
  const std::string why = loomGetLastError(comms[0]);
  INFO(why);
  CHECK(why.find("joining them would pull the other into the capture") != std::string::npos);
  const loomsim::SimGraph g = world.rank(0).endCapture(&keys[0]);
  CHECK(g->empty());  // nothing was captured
  CHECK(dev0->round() == round);
  CHECK(dev0->captured() == 0);
  // The communicators go on.
  checkGoesOnAndDestroy(world, comms, buf, n, plain);
}

TEST_CASE("CUDA communicators through the C API (simulated device): one thread's group over 4 ranks enqueues "
          "their programs round-robin, so large all-reduces and a ring of sends complete where each stream's queue "
          "holds 64 operations (a rank's program enqueued whole would fill it with waits on the next rank)",
          "[devcomm][api][group]") {
  SimMemory mem;
  loomsim::SimDeviceOptions so;
  so.queueDepth = 64;
  so.deadlineMs = 20000;
  loomsim::SimDeviceWorld world(4, 1, 256, so);
  DeviceEnv env(mem, world);
  // 64 KiB slots: a 1 MiB all-reduce is 16 rounds, hundreds of operations.
  ScopedEnv slotBytes("LOOM_DEVICE_SLOT_BYTES", "65536");
  std::vector<loomComm_t> comms = initCudaComms(4);
  REQUIRE(comms.size() == 4);
  const size_t n = size_t(1) << 18;  // float32: 1 MiB
  std::vector<float*> buf(4), sendb(4), recvb(4);
  std::vector<loomStream_t> streams(4);
  for (int r = 0; r < 4; ++r) {
    streams[size_t(r)] = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57 + r));
    buf[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
    sendb[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
    recvb[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
    for (size_t i = 0; i < n; ++i)
      buf[size_t(r)][i] = float(r + 1), sendb[size_t(r)][i] = float(r * 1000 + int(i % 1000)),
      recvb[size_t(r)][i] = -1;
  }
  // The way NCCL's one-thread groups drive several GPUs: every rank's
  // all-reduce, then a ring (to the next rank, from the previous).
  REQUIRE(loomGroupStart() == loomSuccess);
  for (int r = 0; r < 4; ++r)
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomFloat32, loomSum, comms[size_t(r)],
                        streams[size_t(r)]) == loomSuccess);
  for (int r = 0; r < 4; ++r) {
    CHECK(loomSend(sendb[size_t(r)], n, loomFloat32, (r + 1) % 4, comms[size_t(r)], streams[size_t(r)]) ==
          loomSuccess);
    CHECK(loomRecv(recvb[size_t(r)], n, loomFloat32, (r + 3) % 4, comms[size_t(r)], streams[size_t(r)]) ==
          loomSuccess);
  }
  const loomResult_t ended = loomGroupEnd();
  INFO(loomGetLastError(nullptr));
  CHECK(ended == loomSuccess);
  if (ended != loomSuccess) {  // the streams may still run: abort, then let go
    for (loomComm_t c : comms) loomCommAbort(c);
    for (int r = 0; r < 4; ++r) world.kill(r);
    return;
  }
  for (int r = 0; r < 4; ++r) {
    std::string msg;
    INFO(msg);
    REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  long wrong = 0;
  for (int r = 0; r < 4; ++r) {
    const int from = (r + 3) % 4;
    for (size_t i = 0; i < n; ++i)
      wrong += (buf[size_t(r)][i] != 10.0f) + (recvb[size_t(r)][i] != float(from * 1000 + int(i % 1000)));
  }
  CHECK(wrong == 0);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
}

TEST_CASE("CUDA communicator through the C API (simulated device): a rank's loomCommAbort reaches the others, "
          "their streams waiting on it drain, loomCommGetAsyncError names it, later calls fail at once, destroy is "
          "clean",
          "[devcomm][api][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaComms(3);
  REQUIRE(comms.size() == 3);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 100000;  // reduce-scatter + all-gather: two streams wait
  std::vector<int32_t*> buf;
  for (int r = 0; r < 2; ++r) buf.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, n * 4)));
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) ==
          loomSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const int64_t t0 = loom::nowMs();
  CHECK(loomCommAbort(comms[2]) == loomSuccess);  // rank 2 never took part
  CHECK(loom::nowMs() - t0 < 5000);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);  // released (the device itself never gives up)
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomRemoteError);
    std::string last = loomGetLastError(comms[size_t(r)]);
    INFO(last);
    CHECK(last.find(loom::strf("rank %d: the communicator failed on rank 2: the communicator was aborted", r)) !=
          std::string::npos);
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) ==
          loomRemoteError);
  }
  for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
  CHECK(loom::waitDeviceRemains(10000));
}

TEST_CASE("CUDA communicator through the C API (simulated device): a rank that goes away mid all-reduce is found "
          "gone by the others' device watchdogs (its control socket refuses): loomRemoteError naming it, streams "
          "drained",
          "[devcomm][api][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaComms(3);
  REQUIRE(comms.size() == 3);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 1000;  // one-shot
  std::vector<int32_t*> buf;
  for (int r = 0; r < 2; ++r) buf.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, n * 4)));
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) ==
          loomSuccess);
  // Rank 2 leaves without a word (as a killed process would: no notice).
  CHECK(loomCommDestroy(comms[2]) == loomSuccess);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomRemoteError);
    std::string last = loomGetLastError(comms[size_t(r)]);
    INFO(last);
    CHECK(last.find("rank 2 is gone (") != std::string::npos);
  }
  for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
  CHECK(loom::waitDeviceRemains(10000));
}

namespace {

// One send or receive of a rank in a send/recv test: its buffer and, for a
// receive, what must arrive.
struct P2POp {
  bool send;
  int peer;
  size_t count;
  loomDataType_t type;
  uint8_t* buf;
  std::vector<uint8_t> expect;  // receives
};

loom::OpDesc p2pDesc(const P2POp& o) {
  loom::OpDesc d;
  d.coll = Collective::P2P;
  d.isSend = o.send;
  d.peer = o.peer;
  d.count = o.count;
  d.dtype = o.type;
  if (o.send)
    d.sendbuf = o.buf;
  else
    d.recvbuf = o.buf;
  return d;
}

// The message from `from` to `to` number k of a test: its count and type.
size_t messageCount(int from, int to, int k, int variant) {
  // 0 .. several chunks of 512 bytes (slot 1024), uneven per pair.
  const size_t counts[] = {0, 1, 33, 128, 129, 700, 1501};
  return counts[size_t(from * 3 + to * 5 + k + variant) % 7];
}

}  // namespace

TEST_CASE("device communicator (simulated device): send/recv are exact, N = 1..8, ranks sharing a device and on "
          "several: a ring, every pair both ways with uneven sizes and self-sends in one program, back to back",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;  // chunks of 512 bytes: most messages take several, slots are reused
  const loomDataType_t types[] = {loomInt8, loomFloat16, loomInt32, loomFloat64};
  for (int N = 1; N <= 8; ++N)
    for (int gpus : {1, 2, 3}) {
      if (gpus > N) continue;
      SimComms s(N, gpus, opts);
      for (int r = 0; r < N; ++r) REQUIRE(s.initErrors[size_t(r)].empty());
      std::mt19937_64 rng(uint64_t(N * 100 + gpus));
      // programs[r]: the programs rank r issues, in order (each a list of ops).
      std::vector<std::vector<std::vector<P2POp>>> programs(static_cast<size_t>(N));
      auto message = [&](int from, int to, size_t count, loomDataType_t t, std::vector<P2POp>* fromProg,
                         std::vector<P2POp>* toProg) {
        const size_t esz = loom::dtypeSize(t);
        uint8_t* in = s.mem.alloc(from % gpus, count * esz + 8);
        uint8_t* out = s.mem.alloc(to % gpus, count * esz + 8);
        fillRandom(in, count, t, rng);
        fillRandom(out, count, t, rng);  // garbage before
        fromProg->push_back({true, to, count, t, in, {}});
        toProg->push_back({false, from, count, t, out, std::vector<uint8_t>(in, in + count * esz)});
      };
      for (int k = 0; k < 4; ++k) {
        const loomDataType_t t = types[size_t(k)];
        // A ring in one program per rank: send to the next, receive from the previous.
        std::vector<std::vector<P2POp>> ring(static_cast<size_t>(N));
        for (int r = 0; r < N; ++r)
          message(r, (r + 1) % N, messageCount(r, (r + 1) % N, k, 0), t, &ring[size_t(r)],
                  &ring[size_t((r + 1) % N)]);
        // Every pair both ways (self included), one program per rank:
        // receives are posted in another order than the peers' sends.
        std::vector<std::vector<P2POp>> pairs(static_cast<size_t>(N));
        for (int from = 0; from < N; ++from)
          for (int to = 0; to < N; ++to) message(from, to, messageCount(from, to, k, 1), t, &pairs[size_t(from)],
                                                 &pairs[size_t(to)]);
        for (int r = 0; r < N; ++r) {
          programs[size_t(r)].push_back(ring[size_t(r)]);
          programs[size_t(r)].push_back(pairs[size_t(r)]);
        }
        // Alone (not grouped), small enough not to wait for the receiver:
        // every rank sends to the next, then receives from the previous.
        std::vector<std::vector<P2POp>> alone(static_cast<size_t>(N));
        for (int r = 0; r < N; ++r) message(r, (r + 1) % N, 1024 / loom::dtypeSize(t), t, &alone[size_t(r)],
                                            &alone[size_t((r + 1) % N)]);
        for (int r = 0; r < N; ++r)
          for (P2POp& o : alone[size_t(r)]) programs[size_t(r)].push_back({o});
      }
      // Every rank issues all its programs from its own thread, then one synchronisation.
      std::vector<std::string> errors(static_cast<size_t>(N));
      std::vector<std::thread> ts;
      for (int r = 0; r < N; ++r)
        ts.emplace_back([&, r] {
          try {
            for (const auto& prog : programs[size_t(r)]) {
              std::vector<loom::OpDesc> ds;
              for (const P2POp& o : prog) ds.push_back(p2pDesc(o));
              s.comms[size_t(r)]->runP2P(ds, nullptr);
            }
          } catch (const loom::Error& e) {
            errors[size_t(r)] = e.what();
          }
        });
      for (auto& t : ts) t.join();
      for (int r = 0; r < N; ++r) REQUIRE(errors[size_t(r)].empty());
      std::string bad = syncAll(s);
      INFO("N=" << N << " gpus=" << gpus << ": " << bad);
      REQUIRE(bad.empty());
      long wrong = 0, messages = 0;
      for (int r = 0; r < N; ++r)
        for (const auto& prog : programs[size_t(r)])
          for (const P2POp& o : prog) {
            if (o.send) continue;
            ++messages;
            if (!o.expect.empty() && memcmp(o.buf, o.expect.data(), o.expect.size()) != 0 && ++wrong <= 3)
              FAIL_CHECK("rank " << r << ": message from " << o.peer << " (" << o.count << " x "
                                 << loom::dtypeName(o.type) << ") wrong");
          }
      CHECK(wrong == 0);
      CHECK(messages == long(4 * (2 * N + N * N)));
      CHECK(s.comms[0]->round() == 0);  // no collective round was used
    }
}

TEST_CASE("device communicator (simulated device): a send whose receiver never comes fails with loomTimeout naming "
          "it, and the sender's stream is released",
          "[devcomm][abort]") {
  Reported seen;
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  opts.timeoutMs = 300;
  opts.onFailure = [&seen](const loom::Error& e) { seen.add(e); };
  SimComms s(3, 1, opts, true, patientDevice());
  uint8_t* buf = s.mem.alloc(0, 4096);
  P2POp send{true, 2, 4096, loomUint8, buf, {}};  // 8 chunks: the third waits for rank 2's acks
  s.comms[0]->runP2P({p2pDesc(send)}, nullptr);
  std::string msg;
  REQUIRE(s.world.rank(0).synchronize(&msg) == loomSuccess);
  std::string why;
  CHECK(failureOf(*s.comms[0], &why) == loomTimeout);
  INFO(why);
  CHECK(why.find("this rank's streams wait for rank 2") != std::string::npos);
  REQUIRE(seen.size() == 1);
  CHECK(seen.peers[0] == 2);
  CHECK(!s.comms[1]->failed());
  CHECK(!s.comms[2]->failed());
}

namespace {

// A send/recv pattern where only some pairs communicate: 0 -> 1, 2 -> 0,
// 3 -> 3 (a self-send), N-1 -> 1 (rank 1 hears from two senders), as far
// as N has those ranks.  Message m of the pattern has 1300 + 7 m bytes (3
// chunks of 512: the sender waits for acks).
std::vector<std::pair<int, int>> somePairs(int N) {
  std::vector<std::pair<int, int>> v{{0, 1}};
  if (N >= 3) v.emplace_back(2, 0);
  if (N >= 4) v.emplace_back(3, 3);
  if (N >= 5) v.emplace_back(N - 1, 1);
  return v;
}

}  // namespace

TEST_CASE("device communicator (simulated device): send/recv staging is made on a pair's first use: none at init "
          "or for collectives, one region per pair that communicates (N = 2..8, some pairs only, a receive posted "
          "before the sender's first send), exact, reused after",
          "[devcomm]") {
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;
  for (int N = 2; N <= 8; ++N) {
    SimComms s(N, 1, opts);
    for (int r = 0; r < N; ++r) REQUIRE(s.initErrors[size_t(r)].empty());
    INFO("N=" << N);
    // Init allocates one block per rank: flags and the collectives' two
    // slots, the graph lane's, nothing for send/recv.
    CHECK(s.mem.live() == size_t(N));
    for (int r = 0; r < N; ++r) {
      const loom::DeviceMemoryStats m = s.comms[size_t(r)]->memoryStats();
      CHECK(m.blockBytes == loom::flagAreaBytes(N) + loom::streamWindowBytes(1024) +
                                loom::graphLaneBytes(N, loom::kDeviceGraphSlotBytes));
      CHECK(m.regionsOut == 0);
      CHECK(m.regionsIn == 0);
    }
    // Collectives do not make any either.
    std::vector<int32_t*> ar;
    for (int r = 0; r < N; ++r) {
      ar.push_back(reinterpret_cast<int32_t*>(s.mem.alloc(0, 4000)));
      for (int i = 0; i < 1000; ++i) ar[size_t(r)][i] = r + i;
    }
    for (int r = 0; r < N; ++r) {
      loom::OpDesc op;
      op.sendbuf = op.recvbuf = ar[size_t(r)];
      op.count = 1000;
      op.dtype = loomInt32;
      s.comms[size_t(r)]->run(op, nullptr);
    }
    REQUIRE(syncAll(s).empty());
    long wrong = 0;
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < 1000; ++i) wrong += ar[size_t(r)][i] != N * (N - 1) / 2 + N * i;
    CHECK(wrong == 0);
    for (int r = 0; r < N; ++r) CHECK(s.comms[size_t(r)]->memoryStats().regionsOut == 0);

    const std::vector<std::pair<int, int>> pairs = somePairs(N);
    std::vector<uint8_t*> in, out;
    std::mt19937_64 rng{uint64_t(N)};
    for (size_t m = 0; m < pairs.size(); ++m) {
      const size_t bytes = 1300 + 7 * m;
      in.push_back(s.mem.alloc(0, bytes));
      out.push_back(s.mem.alloc(0, bytes));
      for (size_t i = 0; i < bytes; ++i) in[m][i] = uint8_t(rng());
      memset(out[m], 0xee, bytes);
    }
    const size_t before = s.mem.live();
    const int opensBefore = s.mem.opens();
    auto desc = [&](size_t m, bool send) {
      P2POp o{send, send ? pairs[m].second : pairs[m].first, 1300 + 7 * m, loomUint8, send ? in[m] : out[m], {}};
      return p2pDesc(o);
    };
    // Rank 1 receives from rank 0 before rank 0 has sent anything: asking
    // for rank 0's region makes it.
    s.comms[1]->runP2P({desc(0, false)}, nullptr);
    CHECK(s.comms[0]->memoryStats().regionsOut == 1);
    CHECK(s.comms[1]->memoryStats().regionsIn == 1);
    s.comms[0]->runP2P({desc(0, true)}, nullptr);
    // The others: sender, then receiver (a self-send: one program).
    auto issue = [&](size_t m) {
      const int from = pairs[m].first, to = pairs[m].second;
      if (from == to) return s.comms[size_t(from)]->runP2P({desc(m, true), desc(m, false)}, nullptr);
      s.comms[size_t(from)]->runP2P({desc(m, true)}, nullptr);
      s.comms[size_t(to)]->runP2P({desc(m, false)}, nullptr);
    };
    for (size_t m = 1; m < pairs.size(); ++m) issue(m);
    REQUIRE(syncAll(s).empty());
    for (size_t m = 0; m < pairs.size(); ++m)
      CHECK(memcmp(in[m], out[m], 1300 + 7 * m) == 0);
    // One region per (sender, receiver) that communicated, at the sender;
    // the receiver maps it (its own as is), opening a handle for each peer.
    size_t regions = 0, remote = 0;
    for (int r = 0; r < N; ++r) {
      std::set<int> to, from;
      for (const auto& [a, b] : pairs) {
        if (a == r) to.insert(b);
        if (b == r && a != r) from.insert(a);  // a self-send maps nothing
      }
      regions += to.size();
      const loom::DeviceMemoryStats st = s.comms[size_t(r)]->memoryStats();
      CHECK(st.regionsOut == to.size());
      CHECK(st.regionBytesOut == to.size() * loom::p2pRegionBytes(1024));
      CHECK(st.regionsIn == from.size());
    }
    for (const auto& [a, b] : pairs) remote += a != b;
    CHECK(s.mem.live() - before == regions);
    CHECK(size_t(s.mem.opens() - opensBefore) == remote);
    // The same traffic again: no new region, no new handle opened.
    for (size_t m = 0; m < pairs.size(); ++m) memset(out[m], 0xee, 1300 + 7 * m);
    for (size_t m = 0; m < pairs.size(); ++m) issue(m);
    REQUIRE(syncAll(s).empty());
    for (size_t m = 0; m < pairs.size(); ++m) CHECK(memcmp(in[m], out[m], 1300 + 7 * m) == 0);
    CHECK(s.mem.live() - before == regions);
    CHECK(size_t(s.mem.opens() - opensBefore) == remote);
  }
}

TEST_CASE("device communicator: a send/recv region answer round-trips, a peer's error keeps its code and text, "
          "garbage is loomRemoteError",
          "[devcomm]") {
  loom::IpcRecord rec;
  memset(rec.handle, 0x5a, sizeof rec.handle);
  rec.base = 0x1000;
  rec.allocBytes = rec.bytes = 4096;
  rec.process = 77;
  loom::IpcRecord got;
  CHECK(loom::decodeRegionAnswer(3, loom::encodeRegionAnswer(loomSuccess, &rec, ""), &got));
  CHECK(memcmp(&got, &rec, sizeof rec) == 0);
  CHECK_FALSE(loom::decodeRegionAnswer(3, loom::encodeRegionAnswer(loomInProgress, nullptr, "not ready"), &got));
  try {
    loom::decodeRegionAnswer(3, loom::encodeRegionAnswer(loomUnhandledCudaError, nullptr, "cudaMalloc failed"), &got);
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
    CHECK(std::string(e.what()) == "rank 3 could not give its send/recv region: cudaMalloc failed");
  }
  for (std::vector<uint8_t> bad : {std::vector<uint8_t>{}, std::vector<uint8_t>{1, 2}, std::vector<uint8_t>(8, 0xff),
                                   std::vector<uint8_t>(4 + sizeof rec - 1, 0)}) {
    try {
      loom::decodeRegionAnswer(3, bad, &got);
      FAIL("no error for " << bad.size() << " bytes");
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomRemoteError);
    }
  }
}

namespace {

std::string dumpOf(loomComm_t c) {
  char buf[4096];
  if (loomCommDump(c, buf, sizeof buf) != loomSuccess) return "(dump failed)";
  return buf;
}

}  // namespace

TEST_CASE("CUDA communicator through the C API (simulated device): send/recv staging on first use through the "
          "control plane (a receive before the sender's send, only the pair allocates, loomCommDump shows it), a "
          "peer that is gone is loomRemoteError and the communicator still works",
          "[devcomm][api]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256);
  DeviceEnv env(mem, world);
  // 4 MiB slots (the default is 32 MiB): the send below then takes several
  // chunks, and the sender waits for the receiver's acks between them.
  ScopedEnv slotBytes("LOOM_DEVICE_SLOT_BYTES", "4194304");
  std::vector<loomComm_t> comms = initCudaComms(3);
  REQUIRE(comms.size() == 3);
  const size_t slot = ipcOf(comms[0]).slotBytes();
  REQUIRE(slot == size_t(4) << 20);
  const std::string oneRegion = loom::strf("send/recv staging: 1 region allocated here (%zu B), 0 of peers",
                                           loom::p2pRegionBytes(slot));
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  for (int r = 0; r < 3; ++r) {
    std::string d = dumpOf(comms[size_t(r)]);
    INFO(d);
    CHECK(d.find(loom::strf("device sim:0, ipc path: %zu B allocated at init",
                            loom::flagAreaBytes(3) + loom::cellAreaBytes(3) + loom::streamWindowBytes(slot) +
                                loom::graphLaneBytes(3, size_t(8) << 20))) !=
          std::string::npos);
    CHECK(d.find("send/recv staging: 0 regions allocated here (0 B), 0 of peers mapped here") != std::string::npos);
  }
  const size_t n = 3 << 20;  // 12 MiB: six chunks of half a slot, so the sender waits for acks
  auto* src = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
  auto* dst = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
  for (size_t i = 0; i < n; ++i) src[i] = int32_t(i * 7 + 1), dst[i] = -1;
  // Rank 2 receives from rank 0 first: rank 0's control thread makes the region.
  REQUIRE(loomRecv(dst, n, loomInt32, 0, comms[2], fakeStream) == loomSuccess);
  CHECK(dumpOf(comms[0]).find(oneRegion) !=
        std::string::npos);
  REQUIRE(loomSend(src, n, loomInt32, 2, comms[0], fakeStream) == loomSuccess);
  // Ranks 0 and 2 finish their streams; dst then holds the first `count` of src.
  auto wrongAfterSync = [&](size_t count) {
    for (int r : {0, 2}) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (size_t i = 0; i < count; ++i) wrong += dst[i] != int32_t(i * 7 + 1);
    return wrong;
  };
  CHECK(wrongAfterSync(n) == 0);
  CHECK(dumpOf(comms[0]).find(oneRegion + " mapped here") !=
        std::string::npos);
  CHECK(dumpOf(comms[1]).find("send/recv staging: 0 regions allocated here (0 B), 0 of peers mapped here") !=
        std::string::npos);
  CHECK(dumpOf(comms[2]).find("send/recv staging: 0 regions allocated here (0 B), 1 of peers mapped here") !=
        std::string::npos);

  // Rank 1 goes away: rank 2's first receive from it cannot be set up.
  CHECK(loomCommDestroy(comms[1]) == loomSuccess);
  CHECK(loomRecv(dst, 16, loomInt32, 1, comms[2], fakeStream) == loomRemoteError);
  std::string why = loomGetLastError(comms[2]);
  INFO(why);
  CHECK(why.find("rank 1 is gone (its control socket refuses)") != std::string::npos);
  // Nothing was enqueued and the communicator did not fail: 0 -> 2 still works.
  loomResult_t ae = loomInternalError;
  CHECK(loomCommGetAsyncError(comms[2], &ae) == loomSuccess);
  CHECK(ae == loomSuccess);
  for (size_t i = 0; i < 64; ++i) dst[i] = -1;
  REQUIRE(loomSend(src, 64, loomInt32, 2, comms[0], fakeStream) == loomSuccess);
  REQUIRE(loomRecv(dst, 64, loomInt32, 0, comms[2], fakeStream) == loomSuccess);
  CHECK(wrongAfterSync(64) == 0);
  for (int r : {0, 2}) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
}

TEST_CASE("CUDA communicators through the C API (simulated device): one group spanning several communicators (one "
          "thread issues both ranks' parts: collectives and send/recv), tagged send/recv is loomInvalidUsage and "
          "launches nothing of its group, host communicators refuse a group spanning several",
          "[devcomm][api]") {
  {
    SimMemory mem;
    loomsim::SimDeviceWorld world(2, 1, 256);
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaComms(2);
    REQUIRE(comms.size() == 2);
    loomStream_t streams[2] = {reinterpret_cast<loomStream_t>(uintptr_t(0x7e57)),
                               reinterpret_cast<loomStream_t>(uintptr_t(0x7e58))};
    const int kN = 5000;
    int32_t *ar[2], *sendb[2], *recvb[2];
    for (int r = 0; r < 2; ++r) {
      ar[r] = reinterpret_cast<int32_t*>(mem.alloc(0, kN * 4));
      sendb[r] = reinterpret_cast<int32_t*>(mem.alloc(0, kN * 4));
      recvb[r] = reinterpret_cast<int32_t*>(mem.alloc(0, kN * 4));
      for (int i = 0; i < kN; ++i) ar[r][i] = r * 100 + i, sendb[r][i] = r * 1000000 + i, recvb[r][i] = -1;
    }
    // Rank 0's receive waits for rank 1's send, issued after it in the
    // group: one group, both communicators.
    REQUIRE(loomGroupStart() == loomSuccess);
    for (int r = 0; r < 2; ++r)
      CHECK(loomAllReduce(ar[r], ar[r], kN, loomInt32, loomSum, comms[size_t(r)], streams[r]) == loomSuccess);
    CHECK(loomRecv(recvb[0], kN, loomInt32, 1, comms[0], streams[0]) == loomSuccess);
    CHECK(loomSend(sendb[0], kN, loomInt32, 1, comms[0], streams[0]) == loomSuccess);
    CHECK(loomRecv(recvb[1], kN, loomInt32, 0, comms[1], streams[1]) == loomSuccess);
    CHECK(loomSend(sendb[1], kN, loomInt32, 0, comms[1], streams[1]) == loomSuccess);
    REQUIRE(loomGroupEnd() == loomSuccess);
    for (int r = 0; r < 2; ++r) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < kN; ++i)
        wrong += (ar[r][i] != 100 + 2 * i) + (recvb[r][i] != (1 - r) * 1000000 + i);
    CHECK(wrong == 0);

    const uint64_t round0 = ipcOf(comms[0]).round();

    // Tagged send/recv: refused with its reason, alone and in a group
    // (which then launches nothing, its good members included).
    CHECK(loomSendTagged(sendb[0], 16, loomInt32, 1, 3, comms[0], streams[0]) == loomInvalidUsage);
    std::string why = loomGetLastError(comms[0]);
    CHECK(why.find("tagged send/recv (loomSendTagged/loomRecvTagged) is not supported on sim communicators: a "
                   "receive is enqueued on the stream before the sender's tags are known") !=
          std::string::npos);
    CHECK(loomRecvTagged(recvb[0], 16, loomInt32, LOOM_ANY_SOURCE, LOOM_ANY_TAG, comms[0], streams[0], nullptr) ==
          loomInvalidUsage);
    CHECK(std::string(loomGetLastError(comms[0])).find("tagged send/recv") != std::string::npos);
    REQUIRE(loomGroupStart() == loomSuccess);
    CHECK(loomAllReduce(ar[0], ar[0], kN, loomInt32, loomSum, comms[0], streams[0]) == loomSuccess);
    CHECK(loomAllReduce(ar[1], ar[1], kN, loomInt32, loomSum, comms[1], streams[1]) == loomSuccess);
    CHECK(loomRecvTagged(recvb[1], 16, loomInt32, 0, 3, comms[1], streams[1], nullptr) == loomInvalidUsage);
    CHECK(loomGroupEnd() == loomInvalidUsage);
    CHECK(std::string(loomGetLastError(nullptr)).find("the group was not launched") != std::string::npos);
    CHECK(ipcOf(comms[0]).round() == round0);
    CHECK(ipcOf(comms[1]).round() == round0);
    for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
  }
  // Host communicators (one rank each): a group spanning two is refused
  // when the second joins, and nothing of it runs.
  loomComm_t host[2] = {nullptr, nullptr};
  for (auto& h : host) {
    loomUniqueId id;
    REQUIRE(loomGetUniqueId(&id) == loomSuccess);
    REQUIRE(loomCommInitRank(&h, 1, id, 0) == loomSuccess);
  }
  std::vector<float> a(64, 1.0f), b(64, -1.0f);
  REQUIRE(loomGroupStart() == loomSuccess);
  CHECK(loomAllReduce(a.data(), b.data(), 64, loomFloat32, loomSum, host[0], nullptr) == loomSuccess);
  CHECK(loomAllReduce(a.data(), b.data(), 64, loomFloat32, loomSum, host[1], nullptr) == loomInvalidUsage);
  CHECK(std::string(loomGetLastError(host[1])).find("a group spanning several communicators needs CUDA "
                                                    "communicators") != std::string::npos);
  CHECK(loomGroupEnd() == loomInvalidUsage);
  CHECK(b[0] == -1.0f);
  for (auto& h : host) CHECK(loomCommDestroy(h) == loomSuccess);
}

TEST_CASE("a host communicator's group whose calls name two loom streams (or a loom stream and NULL) runs after "
          "both streams' earlier work, and later work on either waits for it",
          "[api][streams][group]") {
  loomComm_t h = nullptr;
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  REQUIRE(loomCommInitRank(&h, 1, id, 0) == loomSuccess);
  loomStream_t sa = nullptr, sb = nullptr;
  REQUIRE(loomStreamCreate(&sa) == loomSuccess);
  REQUIRE(loomStreamCreate(&sb) == loomSuccess);
  const size_t big = size_t(16) << 20, n = 1000;
  std::vector<float> slow(big, 1.0f), x(n), y(n), z(n), w(n);
  for (bool blocking : {false, true}) {
    INFO((blocking ? "the group's first stream is NULL" : "two loom streams"));
    for (size_t i = 0; i < n; ++i) x[i] = float(i % 10), y[i] = -1, z[i] = float(i % 3), w[i] = -1;
    const float two = 2, three = 3, one = 1;
    // Stream B: slow work, then x *= 2; the group must read x after it.
    for (int k = 0; k < 4; ++k)
      REQUIRE(loomScale(slow.data(), slow.data(), big, loomFloat32, &one, 0, h, sb) == loomSuccess);
    REQUIRE(loomScale(x.data(), x.data(), n, loomFloat32, &two, 0, h, sb) == loomSuccess);
    REQUIRE(loomGroupStart() == loomSuccess);
    CHECK(loomAllReduce(x.data(), y.data(), n, loomFloat32, loomSum, h, blocking ? nullptr : sa) == loomSuccess);
    CHECK(loomAllReduce(z.data(), w.data(), n, loomFloat32, loomSum, h, sb) == loomSuccess);
    REQUIRE(loomGroupEnd() == loomSuccess);
    INFO(loomGetLastError(h));
    // Later work on B reads what the group wrote (on A, or here).
    REQUIRE(loomScale(y.data(), y.data(), n, loomFloat32, &three, 0, h, sb) == loomSuccess);
    CHECK(loomStreamSynchronize(sa) == loomSuccess);
    CHECK(loomStreamSynchronize(sb) == loomSuccess);
    int wrong = 0;
    for (size_t i = 0; i < n; ++i) wrong += y[i] != float(i % 10) * 6, wrong += w[i] != float(i % 3);
    CHECK(wrong == 0);
  }
  CHECK(loomStreamDestroy(sa) == loomSuccess);
  CHECK(loomStreamDestroy(sb) == loomSuccess);
  CHECK(loomCommDestroy(h) == loomSuccess);
}

TEST_CASE("host communicators: threads ending groups joined over the same loom streams in opposite orders, and a "
          "thread issuing on one of those streams meanwhile, never deadlock and stay exact",
          "[api][streams][group]") {
  loomComm_t c[2] = {nullptr, nullptr};
  for (auto& h : c) {
    loomUniqueId id;
    REQUIRE(loomGetUniqueId(&id) == loomSuccess);
    REQUIRE(loomCommInitRank(&h, 1, id, 0) == loomSuccess);
  }
  loomStream_t sa = nullptr, sb = nullptr;
  REQUIRE(loomStreamCreate(&sa) == loomSuccess);
  REQUIRE(loomStreamCreate(&sb) == loomSuccess);
  const int iters = 300;
  const size_t n = 64;
  std::atomic<int> bad{0};
  auto joined = [&](int k) {
    std::vector<float> x(n, float(k + 1)), y(n), z(n, 2.0f), w(n);
    loomStream_t first = k == 0 ? sa : sb, second = k == 0 ? sb : sa;
    for (int i = 0; i < iters; ++i) {
      if (loomGroupStart() != loomSuccess) ++bad;
      if (loomAllReduce(x.data(), y.data(), n, loomFloat32, loomSum, c[k], first) != loomSuccess) ++bad;
      if (loomAllReduce(z.data(), w.data(), n, loomFloat32, loomSum, c[k], second) != loomSuccess) ++bad;
      if (loomGroupEnd() != loomSuccess) ++bad;
    }
    // Both streams' work of this thread is done once each stream is drained.
    if (loomStreamSynchronize(first) != loomSuccess || loomStreamSynchronize(second) != loomSuccess) ++bad;
    for (size_t e = 0; e < n; ++e) bad += y[e] != float(k + 1) || w[e] != 2.0f;
  };
  auto plain = [&] {  // the first communicator's operations on sb, meanwhile
    std::vector<float> a(n, 3.0f), b(n);
    for (int i = 0; i < iters; ++i)
      if (loomAllReduce(a.data(), b.data(), n, loomFloat32, loomSum, c[0], sb) != loomSuccess) ++bad;
    if (loomStreamSynchronize(sb) != loomSuccess) ++bad;
    for (size_t e = 0; e < n; ++e) bad += b[e] != 3.0f;
  };
  std::thread t0(joined, 0), t1(joined, 1), t2(plain);
  t0.join();
  t1.join();
  t2.join();
  CHECK(bad.load() == 0);
  CHECK(loomStreamDestroy(sa) == loomSuccess);
  CHECK(loomStreamDestroy(sb) == loomSuccess);
  for (auto& h : c) CHECK(loomCommDestroy(h) == loomSuccess);
}

TEST_CASE("loomCommMemAlloc: device memory of a CUDA communicator's own device whatever device is current (two "
          "simulated devices), host memory on a host communicator, freed by loomMemFree",
          "[devcomm][api]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 2, 256);
  {
    struct TwoDevices {  // LOOM_DEVICE=cuda, rank r on device r; undone on scope exit
      TwoDevices(SimMemory& m, loomsim::SimDeviceWorld& w) {
        loom::setDeviceDriverFactoryForTesting(
            [&m, &w](int r, int, int device) { return std::make_unique<SimDriver>(m, &w, r, device >= 0 ? device : r); },
            2);
        setenv("LOOM_DEVICE", "cuda", 1);
        loom::configReload();
      }
      ~TwoDevices() {
        loom::setThreadDeviceForTesting(-1);
        unsetenv("LOOM_DEVICE");
        loom::configReload();
        loom::setDeviceDriverFactoryForTesting(nullptr);
        CHECK(loom::waitDeviceRemains(30000));
      }
    } env(mem, world);
    std::vector<loomComm_t> comms = initCudaComms(2);
    REQUIRE(comms.size() == 2);
    loom::setThreadDeviceForTesting(0);
    for (int r = 0; r < 2; ++r) {
      void* p = nullptr;
      REQUIRE(loomCommMemAlloc(comms[size_t(r)], &p, 4096) == loomSuccess);
      CHECK(mem.deviceOf(p) == r);
      CHECK(loomMemFree(p) == loomSuccess);
    }
    void* q = nullptr;
    REQUIRE(loomMemAlloc(&q, 4096) == loomSuccess);  // the current device's
    CHECK(mem.deviceOf(q) == 0);
    CHECK(loomMemFree(q) == loomSuccess);
    CHECK(loomCommMemAlloc(comms[0], nullptr, 16) == loomInvalidArgument);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  }
  loomComm_t h = nullptr;
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  REQUIRE(loomCommInitRank(&h, 1, id, 0) == loomSuccess);
  void* p = nullptr;
  REQUIRE(loomCommMemAlloc(h, &p, 4096) == loomSuccess);
  CHECK(mem.deviceOf(p) == -1);
  static_cast<char*>(p)[4095] = 1;  // host memory
  CHECK(loomMemFree(p) == loomSuccess);
  CHECK(loomCommDestroy(h) == loomSuccess);
}

TEST_CASE("loomMemAlloc on a CUDA process (LOOM_DEVICE=cuda, simulated device): device memory of the current "
          "device, exportable through cuda_ipc at any offset, usable by CUDA communicators, freed by loomMemFree, "
          "host memory otherwise, without a usable device the reason",
          "[devcomm][api]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256);
  {
    DeviceEnv env(mem, world);
    const size_t before = mem.live(), freesBefore = mem.frees();
    void* p = nullptr;
    REQUIRE(loomMemAlloc(&p, 1000) == loomSuccess);
    REQUIRE(p != nullptr);
    CHECK(mem.live() == before + 1);
    CHECK(mem.deviceOf(p) == 0);
    CHECK(loom::deviceMemLive() == 1);
    void* none = nullptr;
    CHECK(loomMemAlloc(&none, 0) == loomInvalidArgument);
    CHECK(std::string(loomGetLastError(nullptr)).find("size is 0") != std::string::npos);
    {
      // A buffer inside it, as a peer process maps it: the same bytes.
      SimDriver drv(mem, &world, 0, 0);
      auto* u = static_cast<uint8_t*>(p);
      memset(u, 0, 1000);
      u[100] = 42;
      u[299] = 43;
      const loom::IpcRecord rec = loom::exportRange(drv, u + 100, 200, 1);
      CHECK(rec.offset == 100);
      loom::IpcImportCache peer(drv, 2);
      const uint8_t* q = peer.import(0, rec);
      CHECK(q != u + 100);  // mapped again, at another address
      CHECK(q[0] == 42);
      CHECK(q[199] == 43);
      peer.release(0, rec);
    }
    // CUDA communicators take it: an all-reduce on loomMemAlloc buffers.
    std::vector<loomComm_t> comms = initCudaComms(2);
    REQUIRE(comms.size() == 2);
    int32_t* buf[2];
    for (auto& b : buf) {
      void* v = nullptr;
      REQUIRE(loomMemAlloc(&v, 4000) == loomSuccess);
      b = static_cast<int32_t*>(v);
    }
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 1000; ++i) buf[r][i] = r * 10 + i;
    auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
    for (int r = 0; r < 2; ++r)
      CHECK(loomAllReduce(buf[r], buf[r], 1000, loomInt32, loomSum, comms[size_t(r)], fakeStream) == loomSuccess);
    for (int r = 0; r < 2; ++r) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (int i = 0; i < 1000; ++i) wrong += buf[r][i] != 10 + 2 * i;
    CHECK(wrong == 0);
    for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
    for (auto* b : buf) CHECK(loomMemFree(b) == loomSuccess);
    CHECK(loomMemFree(p) == loomSuccess);
    CHECK(mem.frees() >= freesBefore + 3);
    CHECK(loom::deviceMemLive() == 0);
    CHECK(loomMemFree(p) == loomInvalidArgument);  // freed already
  }
  // LOOM_DEVICE unset: host memory, as before.
  void* h = nullptr;
  REQUIRE(loomMemAlloc(&h, 4096) == loomSuccess);
  CHECK(mem.deviceOf(h) == -1);
  void* base = nullptr;
  size_t bytes = 0;
  CHECK(loom::hostMemFind(h, &base, &bytes));
  CHECK(loom::deviceMemLive() == 0);
  CHECK(loomMemFree(h) == loomSuccess);
  // LOOM_DEVICE=cuda with CUDA itself: no GPU here gives the reason.
  setenv("LOOM_DEVICE", "cuda", 1);
  loom::configReload();
  std::string why;
  void* c = nullptr;
  const loomResult_t rc = loomMemAlloc(&c, 4096);
  const std::string err = loomGetLastError(nullptr);
  unsetenv("LOOM_DEVICE");
  loom::configReload();
  if (loom::cudaDeviceCount(&why) == 0) {
    CHECK(rc == loomInvalidUsage);
    CHECK(err.find("LOOM_DEVICE=cuda, but this process has no usable CUDA device") != std::string::npos);
  } else {  // the GPU machine: device memory of the current device
    CHECK(rc == loomSuccess);
    CHECK(loom::cudaPointerDevice(c) >= 0);
    CHECK(loomMemFree(c) == loomSuccess);
  }
}

namespace {

// An all-reduce of n int32 over two CUDA communicators (simulated device)
// out of send into recv, checked exact; the published reads it made.
uint64_t twoRankAllReduce(loomsim::SimDeviceWorld& world, const std::vector<loomComm_t>& comms,
                          int32_t* const* send, int32_t* const* recv, size_t n, int salt) {
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const uint64_t before = world.rank(0).publishedReads() + world.rank(1).publishedReads();
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) send[r][i] = int32_t(r * 7 + salt + int(i % 1000));
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllReduce(send[r], recv[r], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) == loomSuccess);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  long wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) wrong += recv[r][i] != int32_t(7 + 2 * salt + 2 * int(i % 1000));
  CHECK(wrong == 0);
  return world.rank(0).publishedReads() + world.rank(1).publishedReads() - before;
}

}  // namespace

TEST_CASE("CUDA communicator, device zero-copy (simulated device): all-reduces on loomMemAlloc buffers are read in "
          "place through the control plane's publish, loomMemFree has the peers unmap first, LOOM_DEVICE_ZERO_COPY=0 "
          "stages everything",
          "[devcomm][api]") {
  for (const char* zc : {"1", "0"}) {
    ScopedEnv z("LOOM_DEVICE_ZERO_COPY", zc);
    ScopedEnv slot("LOOM_DEVICE_SLOT_BYTES", "65536");
    SimMemory mem;
    loomsim::SimDeviceWorld world(2, 1, 256);
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaComms(2);
    REQUIRE(comms.size() == 2);
    INFO("LOOM_DEVICE_ZERO_COPY=" << zc);
    CHECK(ipcOf(comms[0]).zeroCopy() == (zc[0] == '1'));
    const size_t n = 300000;  // 1.2 MB: reduce-scatter + all-gather, several rounds
    auto allReduce = [&](int32_t* const* send, int32_t* const* recv, int salt) {
      twoRankAllReduce(world, comms, send, recv, n, salt);
    };
    int32_t *send[2], *recv[2];
    for (int r = 0; r < 2; ++r) {
      void *a = nullptr, *b = nullptr;
      REQUIRE(loomMemAlloc(&a, n * 4) == loomSuccess);
      REQUIRE(loomMemAlloc(&b, n * 4) == loomSuccess);
      send[r] = static_cast<int32_t*>(a);
      recv[r] = static_cast<int32_t*>(b);
    }
    const uint64_t before = world.rank(0).publishedReads() + world.rank(1).publishedReads();
    allReduce(send, recv, 1);
    allReduce(send, send, 2);  // in place
    const uint64_t reads = world.rank(0).publishedReads() + world.rank(1).publishedReads() - before;
    if (zc[0] == '1') {
      // A small all-gather (under LOOM_DEVICE_ONESHOT_BYTES) touches no
      // cell: nothing read through one, published or not.
      auto cellReads = [&] {
        return world.rank(0).publishedReads() + world.rank(1).publishedReads() + world.rank(0).fallbackReads() +
               world.rank(1).fallbackReads();
      };
      const uint64_t cellsBefore = cellReads();
      auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < 100; ++i) send[r][i] = r * 1000 + i;
      for (int r = 0; r < 2; ++r)
        CHECK(loomAllGather(send[r], recv[r], 100, loomInt32, comms[size_t(r)], fakeStream) == loomSuccess);
      for (int r = 0; r < 2; ++r) {
        std::string msg;
        REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
      }
      CHECK(cellReads() == cellsBefore);
      long wrong = 0;
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < 200; ++i) wrong += recv[r][i] != (i / 100) * 1000 + i % 100;
      CHECK(wrong == 0);
      CHECK(reads > 0);
      CHECK(ipcOf(comms[0]).memoryStats().published == 2);
      CHECK(ipcOf(comms[1]).memoryStats().publishedIn == 2);
      CHECK(dumpOf(comms[0]).find("zero-copy: 2 allocations published, 2 of peers mapped here") != std::string::npos);
    } else {
      CHECK(reads == 0);
      CHECK(ipcOf(comms[0]).memoryStats().published == 0);
    }
    // Plain device memory (not loomMemAlloc's) is staged, and still exact.
    int32_t *plainSend[2], *plainRecv[2];
    for (int r = 0; r < 2; ++r) {
      plainSend[r] = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
      plainRecv[r] = reinterpret_cast<int32_t*>(mem.alloc(0, n * 4));
    }
    allReduce(plainSend, plainRecv, 3);
    // A free while the communicators live: the peer forgets it first.
    CHECK(loomMemFree(recv[1]) == loomSuccess);
    if (zc[0] == '1') CHECK(ipcOf(comms[0]).memoryStats().publishedIn == 1);
    void* again = nullptr;
    REQUIRE(loomMemAlloc(&again, n * 4) == loomSuccess);
    recv[1] = static_cast<int32_t*>(again);
    allReduce(send, recv, 4);
    for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
    for (int r = 0; r < 2; ++r) {
      CHECK(loomMemFree(send[r]) == loomSuccess);
      CHECK(loomMemFree(recv[r]) == loomSuccess);
    }
    CHECK(loom::deviceMemLive() == 0);
  }
}

TEST_CASE("CUDA communicator, device zero-copy (simulated device): device memory registered with loomCommRegister "
          "is published as loomMemAlloc's is, its deregistration has the peers unmap it, then it is staged, and another "
          "device's memory is refused",
          "[devcomm][api]") {
  ScopedEnv slot("LOOM_DEVICE_SLOT_BYTES", "65536");
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256);
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaComms(2);
  REQUIRE(comms.size() == 2);
  const size_t n = 300000;  // reduce-scatter + all-gather, several rounds
  // One plain device allocation per rank (as a framework's allocator
  // segment) holding the send and the recv buffer.
  uint8_t* segment[2];
  int32_t *send[2], *recv[2];
  for (int r = 0; r < 2; ++r) {
    segment[r] = mem.alloc(0, 2 * n * 4 + 4096);
    send[r] = reinterpret_cast<int32_t*>(segment[r] + 4096);
    recv[r] = send[r] + n;
  }
  // How many published reads one all-reduce made; its result is exact.
  auto allReduce = [&](int salt) { return twoRankAllReduce(world, comms, send, recv, n, salt); };
  CHECK(allReduce(1) == 0);  // not registered: staged
  // Rank 0 registers its send buffer only: its recv buffer is not covered,
  // so it publishes nothing; rank 1 registers its whole segment and
  // publishes.  Exact either way.
  void *whole[2], *part = nullptr;
  REQUIRE(loomCommRegister(comms[0], send[0], n * 4, &part) == loomSuccess);
  REQUIRE(loomCommRegister(comms[1], segment[1], 2 * n * 4 + 4096, &whole[1]) == loomSuccess);
  CHECK(allReduce(2) > 0);
  CHECK(ipcOf(comms[0]).memoryStats().published == 0);
  CHECK(ipcOf(comms[1]).memoryStats().published == 1);
  // Then rank 0's whole segment too: both publish one allocation each,
  // for both buffers.
  REQUIRE(loomCommRegister(comms[0], segment[0], 2 * n * 4 + 4096, &whole[0]) == loomSuccess);
  CHECK(allReduce(3) > 0);
  for (int r = 0; r < 2; ++r) {
    CHECK(ipcOf(comms[size_t(r)]).memoryStats().published == 1);
    CHECK(ipcOf(comms[size_t(r)]).memoryStats().publishedIn == 1);
  }
  CHECK(dumpOf(comms[0]).find("zero-copy: 1 allocation published, 1 of peers mapped here") != std::string::npos);
  // Deregistering the whole segment keeps it published while the part is
  // registered; the last deregistration has the peer unmap it.
  CHECK(loomCommDeregister(comms[0], whole[0]) == loomSuccess);
  CHECK(ipcOf(comms[0]).memoryStats().published == 1);
  CHECK(loomCommDeregister(comms[0], part) == loomSuccess);
  CHECK(ipcOf(comms[0]).memoryStats().published == 0);
  CHECK(ipcOf(comms[1]).memoryStats().publishedIn == 0);
  CHECK(loomCommDeregister(comms[1], whole[1]) == loomSuccess);
  CHECK(ipcOf(comms[1]).memoryStats().published == 0);
  CHECK(ipcOf(comms[0]).memoryStats().publishedIn == 0);
  CHECK(loomCommDeregister(comms[1], whole[1]) == loomInvalidArgument);  // twice
  CHECK(allReduce(4) == 0);  // staged again, still exact
  // Freed while the communicators live: nobody maps it (DeviceEnv checks).
  for (int r = 0; r < 2; ++r) mem.free(segment[r]);
  // loomMemAlloc memory registered too: its deregistration leaves it
  // published (loomMemFree withdraws it).
  void *la[2], *lh[2];
  for (int r = 0; r < 2; ++r) {
    REQUIRE(loomMemAlloc(&la[r], 2 * n * 4) == loomSuccess);
    REQUIRE(loomCommRegister(comms[size_t(r)], la[r], 2 * n * 4, &lh[r]) == loomSuccess);
    send[r] = static_cast<int32_t*>(la[r]);
    recv[r] = send[r] + n;
  }
  CHECK(allReduce(5) > 0);
  for (int r = 0; r < 2; ++r) CHECK(loomCommDeregister(comms[size_t(r)], lh[r]) == loomSuccess);
  CHECK(ipcOf(comms[0]).memoryStats().published == 1);
  CHECK(allReduce(6) > 0);
  for (int r = 0; r < 2; ++r) CHECK(loomMemFree(la[r]) == loomSuccess);
  CHECK(ipcOf(comms[0]).memoryStats().published == 0);
  CHECK(ipcOf(comms[1]).memoryStats().publishedIn == 0);
  // A registration whose record went without a deregistration (as when
  // the caller frees registered memory and gets new memory at the same
  // address): registering it again has the peers unmap the old mapping
  // first, then the next call publishes it anew.
  uint8_t* seg2[2];
  void* h2[2];
  for (int r = 0; r < 2; ++r) {
    seg2[r] = mem.alloc(0, 2 * n * 4);
    send[r] = reinterpret_cast<int32_t*>(seg2[r]);
    recv[r] = send[r] + n;
    REQUIRE(loomCommRegister(comms[size_t(r)], seg2[r], 2 * n * 4, &h2[r]) == loomSuccess);
  }
  CHECK(allReduce(7) > 0);
  comms[0]->registrations().remove(h2[0]);  // the record only, as if it were never deregistered
  CHECK(ipcOf(comms[1]).memoryStats().publishedIn == 1);
  REQUIRE(loomCommRegister(comms[0], seg2[0], 2 * n * 4, &h2[0]) == loomSuccess);
  CHECK(ipcOf(comms[0]).memoryStats().published == 0);
  CHECK(ipcOf(comms[1]).memoryStats().publishedIn == 0);
  CHECK(allReduce(8) > 0);
  CHECK(ipcOf(comms[0]).memoryStats().published == 1);
  for (int r = 0; r < 2; ++r) {
    CHECK(loomCommDeregister(comms[size_t(r)], h2[r]) == loomSuccess);
    mem.free(seg2[r]);
  }
  // Bad arguments on a CUDA communicator.
  void* h = nullptr;
  CHECK(loomCommRegister(comms[0], nullptr, 4096, &h) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("buff is NULL") != std::string::npos);
  uint8_t* some = mem.alloc(0, 4096);
  CHECK(loomCommRegister(comms[0], some, 0, &h) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("size is 0") != std::string::npos);
  CHECK(loomCommRegister(comms[0], some, 4096, nullptr) == loomInvalidArgument);
  mem.free(some);
  // Another device's memory: a clear error, nothing registered.
  uint8_t* other = mem.alloc(1, 4096);
  CHECK(loomCommRegister(comms[0], other, 4096, &h) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("is memory of cuda:1, but this communicator runs on sim:0") !=
        std::string::npos);
  CHECK(comms[0]->registrations().size() == 0);
  mem.free(other);
  for (int r = 0; r < 2; ++r) CHECK(loomCommDestroy(comms[size_t(r)]) == loomSuccess);
}

// ---- The staged path: device buffers between hosts ----------------------

namespace {

std::string twoHosts(int r) { return r % 2 ? "staged-test-host-b" : "staged-test-host-a"; }

// One prepared collective through the C API on rank r.
loomResult_t issueApi(loomComm_t c, const Prepared& p, int r, loomStream_t s) {
  const void* in = p.send[size_t(r)];
  void* out = p.recv[size_t(r)];
  const Op& o = p.o;
  switch (o.coll) {
    case Collective::AllReduce: return loomAllReduce(in, out, o.count, o.type, o.op, c, s);
    case Collective::ReduceScatter: return loomReduceScatter(in, out, o.count, o.type, o.op, c, s);
    case Collective::AllGather: return loomAllGather(in, out, o.count, o.type, c, s);
    case Collective::Broadcast: return loomBroadcast(in, out, o.count, o.type, o.root, c, s);
    case Collective::Reduce: return loomReduce(in, out, o.count, o.type, o.op, o.root, c, s);
    case Collective::AllToAll: return loomAllToAll(in, out, o.count, o.type, c, s);
    case Collective::Gather: return loomGather(in, out, o.count, o.type, o.root, c, s);
    case Collective::Scatter: return loomScatter(in, out, o.count, o.type, o.root, c, s);
    default: return loomInternalError;
  }
}

// verify() for results the host path computed: its algorithms combine the
// ranks in their own order, so floating-point values may differ from the
// rank-order fold in the last bits (within a relative tolerance of the
// type); integers and moved bytes are exact.
std::string verifyNear(const Prepared& p, int N) {
  const loomDataType_t t = p.o.type;
  const bool fp = t == loomFloat16 || t == loomBfloat16 || t == loomFloat32 || t == loomFloat64;
  const bool reduces = p.o.coll == Collective::AllReduce || p.o.coll == Collective::ReduceScatter ||
                       p.o.coll == Collective::Reduce;
  if (!fp || !reduces) return verify(p, N);
  const size_t esz = loom::dtypeSize(t);
  // Inputs are in [-4, 4): each of the N - 1 roundings is off by at most
  // half an ulp of a value up to 4N.
  const double ulp = t == loomFloat64 ? 0x1p-52 : t == loomFloat32 ? 0x1p-23 : t == loomFloat16 ? 0x1p-10 : 0x1p-7;
  const double tol = ulp * 4 * N * N;
  auto value = [&](const uint8_t* e) -> double {
    uint16_t h;
    float f;
    double d;
    switch (t) {
      case loomFloat16: memcpy(&h, e, 2); return loom::halfToFloat(h);
      case loomBfloat16: memcpy(&h, e, 2); return loom::bf16ToFloat(h);
      case loomFloat32: memcpy(&f, e, 4); return f;
      default: memcpy(&d, e, 8); return d;
    }
  };
  for (int r = 0; r < N; ++r) {
    const std::vector<uint8_t>& e = p.expect[size_t(r)];
    for (size_t i = 0; i + esz <= e.size(); i += esz) {
      const double want = value(e.data() + i), got = value(p.recv[size_t(r)] + i);
      if (std::fabs(got - want) > tol)
        return loom::strf("%s: rank %d element %zu is %g, want %g", opName(p.o, N).c_str(), r, i / esz, got, want);
    }
  }
  return "";
}

loom::StagedDeviceComm* stagedOf(loomComm_t c) { return dynamic_cast<loom::StagedDeviceComm*>(c->deviceComm()); }

}  // namespace

namespace {

// Send/recv in a ring, each rank's send and receive in one group (one
// thread drives every communicator), n int32 each: how many elements
// arrived wrong once every stream is done.
long ringSendRecvWrong(SimMemory& mem, loomsim::SimDeviceWorld& world, const std::vector<loomComm_t>& comms,
                       size_t n) {
  const int N = int(comms.size());
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  std::vector<int32_t*> out, in;
  for (int r = 0; r < N; ++r) {
    out.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, n * 4)));
    in.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, n * 4)));
    for (size_t i = 0; i < n; ++i) out[size_t(r)][i] = int32_t(r * 1000003 + int(i)), in[size_t(r)][i] = -1;
  }
  REQUIRE(loomGroupStart() == loomSuccess);
  for (int r = 0; r < N; ++r) {
    CHECK(loomSend(out[size_t(r)], n, loomInt32, (r + 1) % N, comms[size_t(r)], fakeStream) == loomSuccess);
    CHECK(loomRecv(in[size_t(r)], n, loomInt32, (r + N - 1) % N, comms[size_t(r)], fakeStream) == loomSuccess);
  }
  REQUIRE(loomGroupEnd() == loomSuccess);
  for (int r = 0; r < N; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    INFO(msg);
  }
  long wrong = 0;
  for (int r = 0; r < N; ++r)
    for (size_t i = 0; i < n; ++i) wrong += in[size_t(r)][i] != int32_t(((r + N - 1) % N) * 1000003 + int(i));
  return wrong;
}

}  // namespace

TEST_CASE("CUDA communicator across hosts (simulated device, ranks as threads posing as two hosts): the staged "
          "path, every collective exact for N = 2 and 3 through the C API, back to back on the stream, pieces that "
          "reuse every slot, send/recv groups and all-to-allv",
          "[devcomm][staged]") {
  ScopedEnv piece("LOOM_DEVICE_STAGE_BYTES", "4096");  // many pieces from small buffers
  for (int N : {2, 3}) {
    SimMemory mem;
    loomsim::SimDeviceWorld world(N, 1, 256, patientDevice());
    DeviceEnv env(mem, world);
    std::vector<loomResult_t> rcs;
    std::vector<std::string> errs;
    std::vector<loomComm_t> comms = initCudaCommsOn(N, twoHosts, &rcs, &errs);
    INFO("N=" << N << ": " << (errs.empty() ? "" : errs[0]));
    REQUIRE(comms.size() == size_t(N));
    for (int r = 0; r < N; ++r) {
      REQUIRE(stagedOf(comms[size_t(r)]) != nullptr);
      CHECK(dumpOf(comms[size_t(r)]).find("staged path") != std::string::npos);
    }
    if (N == 2) {  // a stream being captured into a CUDA graph: host threads drive this path, so it refuses
      loom::setCudaCaptureProbeForTesting([](void* st) { return int(reinterpret_cast<uintptr_t>(st) == 0xbeef); });
      auto* b = reinterpret_cast<int32_t*>(mem.alloc(0, 64));
      CHECK(loomAllReduce(b, b, 4, loomInt32, loomSum, comms[0], reinterpret_cast<loomStream_t>(uintptr_t(0xbeef))) ==
            loomInvalidUsage);
      CHECK(std::string(loomGetLastError(comms[0])).find("the staged path cannot capture") != std::string::npos);
      loom::setCudaCaptureProbeForTesting(nullptr);
    }
    auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
    std::mt19937_64 rng(uint64_t(N) * 77);
    std::vector<Op> ops = everyCollective(N);
    // Many pieces each (4 KiB per side): more pieces than slots.
    ops.push_back({Collective::AllReduce, loomFloat32, loomSum, 10000, 0, false});
    ops.push_back({Collective::AllReduce, loomInt32, loomAvg, 3001, 0, true});
    ops.push_back({Collective::AllGather, loomInt32, loomSum, 3000, 0, true});
    ops.push_back({Collective::ReduceScatter, loomBfloat16, loomSum, 2999, 0, false});
    ops.push_back({Collective::AllToAll, loomInt64, loomSum, 1500, 0, false});
    ops.push_back({Collective::AllToAll, loomInt64, loomSum, 1500, 0, true});
    ops.push_back({Collective::Broadcast, loomUint8, loomSum, 20000, N - 1, false});
    ops.push_back({Collective::Gather, loomFloat32, loomSum, 2500, 1, false});
    ops.push_back({Collective::Scatter, loomFloat32, loomSum, 2500, 0, true});
    std::vector<Prepared> prepared;
    for (const Op& o : ops) prepared.push_back(prepare(mem, N, 1, o, rng));
    size_t pieces = 0;
    for (const Prepared& p : prepared) {
      for (int r = 0; r < N; ++r) CHECK(issueApi(comms[size_t(r)], p, r, fakeStream) == loomSuccess);
      loom::OpDesc d;
      d.coll = p.o.coll, d.count = p.o.count, d.dtype = p.o.type;
      pieces += stagedOf(comms[0])->pieces(d);
    }
    CHECK(pieces >= ops.size() + 9 * 4);  // the last nine: four pieces or more each
    for (int r = 0; r < N; ++r) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
      INFO(msg);
    }
    for (const Prepared& p : prepared) CHECK(verifyNear(p, N) == "");
    for (int r = 0; r < N; ++r) CHECK(stagedOf(comms[size_t(r)])->hostStepsRun() == pieces);

    // Send/recv: a ring in one group per rank (one thread drives every
    // communicator), then all-to-allv with a different count per pair.
    CHECK(ringSendRecvWrong(mem, world, comms, 5000) == 0);  // 20 KB: staged whole, in one host group
    // all-to-allv: rank r sends r + q + 1 elements to rank q.
    const size_t NN = static_cast<size_t>(N);
    std::vector<std::vector<size_t>> sc(NN), sd(NN), rc(NN), rd(NN);
    std::vector<int32_t*> vs, vr;
    for (int r = 0; r < N; ++r) {
      size_t so = 0, ro = 0;
      for (int q = 0; q < N; ++q) {
        sc[size_t(r)].push_back(size_t(r + q + 1)), sd[size_t(r)].push_back(so), so += size_t(r + q + 1);
        rc[size_t(r)].push_back(size_t(q + r + 1)), rd[size_t(r)].push_back(ro), ro += size_t(q + r + 1);
      }
      vs.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, so * 4)));
      vr.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, ro * 4)));
      for (int q = 0; q < N; ++q)
        for (size_t i = 0; i < sc[size_t(r)][size_t(q)]; ++i) vs[size_t(r)][sd[size_t(r)][size_t(q)] + i] = r * 100 + q * 10000 + int(i);
    }
    for (int r = 0; r < N; ++r)
      CHECK(loomAllToAllv(vs[size_t(r)], sc[size_t(r)].data(), sd[size_t(r)].data(), vr[size_t(r)],
                          rc[size_t(r)].data(), rd[size_t(r)].data(), loomInt32, comms[size_t(r)],
                          fakeStream) == loomSuccess);
    for (int r = 0; r < N; ++r) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
      INFO(msg);
    }
    long wrong = 0;
    for (int r = 0; r < N; ++r) {
      for (int q = 0; q < N; ++q)  // block from rank q: q's block for r
        for (size_t i = 0; i < rc[size_t(r)][size_t(q)]; ++i)
          wrong += vr[size_t(r)][rd[size_t(r)][size_t(q)] + i] != q * 100 + r * 10000 + int(i);
    }
    CHECK(wrong == 0);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
    CHECK(loom::waitDeviceRemains(10000));
    CHECK(g_pinnedLive.load() == 0);
  }
}

TEST_CASE("CUDA communicators and hosts: LOOM_DEVICE_PATH=ipc across hosts fails init on every rank saying why, "
          "LOOM_DEVICE_PATH=staged stages on one host too, and the pinned memory is freed at destroy",
          "[devcomm][staged]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 1, 256, patientDevice());
  std::vector<SimDriver*> drivers;
  std::mutex dmu;
  loom::setDeviceDriverFactoryForTesting([&](int r, int, int) {
    auto d = std::make_unique<SimDriver>(mem, &world, r, 0);
    std::lock_guard<std::mutex> g(dmu);
    drivers.push_back(d.get());
    return d;
  });
  ScopedEnv device("LOOM_DEVICE", "cuda");
  {
    ScopedEnv path("LOOM_DEVICE_PATH", "ipc");
    std::vector<loomResult_t> rcs;
    std::vector<std::string> errs;
    CHECK(initCudaCommsOn(2, twoHosts, &rcs, &errs).empty());
    for (int r = 0; r < 2; ++r) {
      CHECK(rcs[size_t(r)] == loomInvalidUsage);
      INFO(errs[size_t(r)]);
      CHECK(errs[size_t(r)].find("LOOM_DEVICE_PATH=ipc") != std::string::npos);
      CHECK(errs[size_t(r)].find("CUDA IPC works within a host only") != std::string::npos);
    }
  }
  {
    ScopedEnv path("LOOM_DEVICE_PATH", "staged");
    drivers.clear();
    std::vector<loomComm_t> comms = initCudaCommsOn(2, [](int) { return std::string(); });
    REQUIRE(comms.size() == 2);
    auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
    const size_t n = 3 << 20;  // 12 MiB: six pieces of 2 MiB (the default)
    std::vector<float*> buf;
    for (int r = 0; r < 2; ++r) {
      REQUIRE(stagedOf(comms[size_t(r)]) != nullptr);
      CHECK(stagedOf(comms[size_t(r)])->pieces([&] {
        loom::OpDesc d;
        d.count = n;
        return d;
      }()) == 6);
      buf.push_back(reinterpret_cast<float*>(mem.alloc(0, n * 4)));
      for (size_t i = 0; i < n; ++i) buf[size_t(r)][i] = float(i % 1000) + float(r);
    }
    for (int r = 0; r < 2; ++r)
      CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomFloat32, loomSum, comms[size_t(r)], fakeStream) ==
            loomSuccess);
    for (int r = 0; r < 2; ++r) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < n; ++i) wrong += buf[size_t(r)][i] != 2 * float(i % 1000) + 1;
    CHECK(wrong == 0);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
    CHECK(loom::waitDeviceRemains(10000));
    REQUIRE(drivers.size() == 2);
    CHECK(g_pinnedLive.load() == 0);
  }
  loom::setDeviceDriverFactoryForTesting(nullptr);
}


namespace {

// loomCommGetAsyncError on c until it reports a failure (or 5 s pass): the
// code, and loomGetLastError's text in *last.
loomResult_t awaitAsyncError(loomComm_t c, std::string* last) {
  loomResult_t ae = loomSuccess;
  for (int i = 0; i < 500 && ae == loomSuccess; ++i) {
    CHECK(loomCommGetAsyncError(c, &ae) == loomSuccess);
    if (ae == loomSuccess) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  *last = loomGetLastError(c);
  return ae;
}

// Destroys every communicator of `comms` promptly (a failed one never
// waits for its peers), then every pinned buffer and device remains are gone.
void destroyPromptly(const std::vector<loomComm_t>& comms) {
  const int64_t t0 = loom::nowMs();
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  CHECK(loom::nowMs() - t0 < 5000);
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(g_pinnedLive.load() == 0);
}

}  // namespace

namespace {

// The last of `comms` aborts while the others' `coll` (in place) of n int32
// waits for it (it never took part): they fail with its reason at once,
// their streams are released and run to the end, later calls fail at once,
// and destroy is prompt and frees the pinned and the device memory.
void checkAbortReleasesOthers(SimMemory& mem, loomsim::SimDeviceWorld& world, const std::vector<loomComm_t>& comms,
                              size_t n, Collective coll = Collective::AllReduce) {
  const int N = int(comms.size()), waiting = N - 1;
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t elems = coll == Collective::AllReduce ? n : n * size_t(N);
  std::vector<int32_t*> buf;
  for (int r = 0; r < waiting; ++r) buf.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, elems * 4)));
  auto issue = [&](int r) {  // in place
    int32_t* b = buf[size_t(r)];
    loomComm_t c = comms[size_t(r)];
    switch (coll) {
      case Collective::ReduceScatter:
        return loomReduceScatter(b, b + size_t(r) * n, n, loomInt32, loomSum, c, fakeStream);
      case Collective::AllGather:
        return loomAllGather(b + size_t(r) * n, b, n, loomInt32, c, fakeStream);
      default:
        return loomAllReduce(b, b, n, loomInt32, loomSum, c, fakeStream);
    }
  };
  for (int r = 0; r < waiting; ++r) CHECK(issue(r) == loomSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const int64_t t0 = loom::nowMs();
  CHECK(loomCommAbort(comms.back()) == loomSuccess);
  CHECK(loom::nowMs() - t0 < 5000);
  for (int r = 0; r < waiting; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);  // released: the streams ran to the end
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomRemoteError);
    std::string last = loomGetLastError(comms[size_t(r)]);
    INFO(last);
    CHECK(last.find("aborted") != std::string::npos);
    CHECK(issue(r) == loomRemoteError);
  }
  destroyPromptly(std::vector<loomComm_t>(comms.begin(), comms.end() - 1));
  CHECK(mem.live() == buf.size());  // only the test's own buffers
}

}  // namespace

TEST_CASE("CUDA communicator across hosts (simulated device): a rank's loomCommAbort while the others' staged "
          "all-reduce waits for it fails them with its reason, releases their streams, later calls fail at once, and "
          "destroy frees the pinned memory",
          "[devcomm][staged][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  ScopedEnv piece("LOOM_DEVICE_STAGE_BYTES", "4096");
  std::vector<loomComm_t> comms = initCudaCommsOn(3, twoHosts);
  REQUIRE(comms.size() == 3);
  checkAbortReleasesOthers(mem, world, comms, 20000);  // 20 pieces
}

TEST_CASE("CUDA communicator across hosts (simulated device): a caller's stream that never reaches the staging copy "
          "fails the communicator with loomTimeout saying so (the peer with loomRemoteError), nothing hangs, and once "
          "the stream moves again it runs to the end",
          "[devcomm][staged][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(2, 2, 256, patientDevice());  // a GPU each: rank 0's blocked kernel holds its own
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaCommsOn(2, twoHosts);
  REQUIRE(comms.size() == 2);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  std::atomic<bool> go{false};
  world.rank(0).enqueueWork(0, [&] {  // the caller's own kernel, which does not finish for now
    while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  const size_t n = 1000;
  std::vector<float*> buf;
  for (int r = 0; r < 2; ++r) {
    buf.push_back(reinterpret_cast<float*>(mem.alloc(0, n * 4)));
    CHECK(loomCommSetTimeout(comms[size_t(r)], 400) == loomSuccess);
  }
  const int64_t t0 = loom::nowMs();
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomFloat32, loomSum, comms[size_t(r)], fakeStream) ==
          loomSuccess);
  // Rank 1's stream is released once the failure reaches it.
  std::string msg;
  CHECK(world.rank(1).synchronize(&msg) == loomSuccess);
  CHECK(loom::nowMs() - t0 < 10000);
  loomResult_t ae = loomSuccess;
  for (int i = 0; i < 500 && ae == loomSuccess; ++i) {
    CHECK(loomCommGetAsyncError(comms[0], &ae) == loomSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(ae == loomTimeout);
  std::string last = loomGetLastError(comms[0]);
  INFO(last);
  CHECK(last.find("did not reach the staging copy of AllReduce") != std::string::npos);
  CHECK(loomCommGetAsyncError(comms[1], &ae) == loomSuccess);
  CHECK(ae == loomRemoteError);
  go.store(true);
  CHECK(world.rank(0).synchronize(&msg) == loomSuccess);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(g_pinnedLive.load() == 0);
}

TEST_CASE("staged path: a failed communicator destroyed while its stream has yet to run keeps its pinned memory "
          "until the stream is done with it",
          "[devcomm][staged]") {
  // The failure releases the stream's waits; it must not make the pinned
  // buffers look used up (their `free` flags), or destroy frees memory the
  // stream will still copy through and write flags into (on a GPU: a
  // sticky fault, or a free that waits for the whole device).
  const long pinnedBefore = g_pinnedLive.load();
  SimMemory mem;
  loomsim::SimDeviceWorld world(1, 1, 256);
  loom::StagedCommOptions o;
  o.pieceBytes = 4096;
  o.issueHost = [](const std::vector<loom::OpDesc>&) { return std::function<void()>([] {}); };
  auto c = std::make_unique<loom::StagedDeviceComm>(0, 1, std::make_unique<SimDriver>(mem, &world, 0, 0), o);
  uint8_t* buf = mem.alloc(0, 4000 * sizeof(float));
  std::atomic<bool> open{false};
  struct Opener {  // a failed REQUIRE must not leave the stream blocked
    std::atomic<bool>& o;
    ~Opener() { o.store(true); }
  } opener{open};
  world.rank(0).enqueueWork(0, [&open] {  // the caller's own work, ahead of the collective
    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  loom::OpDesc d;
  d.coll = Collective::AllReduce;
  d.dtype = loomFloat32;
  d.count = 4000;
  d.sendbuf = d.recvbuf = buf;
  c->run(d, nullptr);
  c->markFailed(loomRemoteError, "aborted (the test)");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  c.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(g_pinnedLive.load() > pinnedBefore);  // the stream has not run: nothing of its memory is freed
  open.store(true);
  std::string msg;
  CHECK(world.rank(0).synchronize(&msg) == loomSuccess);  // released: it runs to the end
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(g_pinnedLive.load() == pinnedBefore);  // and then all of it is
}

TEST_CASE("device remains: the reaper frees nothing, and tells the others' steps to unmap nothing, while another "
          "remains' streams may still need its releases (a free synchronises the device and would wait for them)",
          "[devcomm][unmap]") {
  struct Fake final : loom::DeviceRemains {
    std::atomic<bool>* done = nullptr;
    std::atomic<bool>* freed = nullptr;
    std::atomic<bool>* lastDefer = nullptr;  // deferBlocking at its last step
    std::atomic<int> steps{0};
    bool needsReleases = false;
    bool honoursDefer = false;  // as IpcRemains: not done while its unmapping must wait
    bool step() override {
      if (lastDefer) lastDefer->store(deferBlocking);
      if (honoursDefer && deferBlocking) return false;
      return ++steps > 1 && done->load();  // the destroying thread's step: not yet
    }
    void free() override { freed->store(true); }
    bool releasing() const override { return needsReleases && !done->load(); }
  };
  std::atomic<bool> aDone{false}, bDone{true}, aFreed{false}, bFreed{false}, cFreed{false}, cDefer{false};
  auto a = std::make_unique<Fake>();  // a failed communicator's: its streams still wait for releases
  a->done = &aDone, a->freed = &aFreed, a->needsReleases = true, a->deadline = loom::nowMs() + 60000;
  auto b = std::make_unique<Fake>();  // one whose streams are done: ready to free
  b->done = &bDone, b->freed = &bFreed, b->deadline = loom::nowMs() + 60000;
  Fake* bp = b.get();
  auto c = std::make_unique<Fake>();  // one whose streams are done, still to unmap its peers' memory
  c->done = &bDone, c->freed = &cFreed, c->lastDefer = &cDefer, c->honoursDefer = true;
  c->deadline = loom::nowMs() + 60000;
  loom::reapDeviceRemains(std::move(a));
  loom::reapDeviceRemains(std::move(b));
  loom::reapDeviceRemains(std::move(c));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(bp->steps.load() > 1);  // the reaper found b ready
  CHECK_FALSE(bFreed.load());    // and freed nothing while a still releases
  CHECK(cDefer.load());          // c was told to put off what may synchronise (IpcRemains: unmapping)
  CHECK_FALSE(cFreed.load());
  aDone.store(true);
  CHECK(loom::waitDeviceRemains(5000));
  CHECK(aFreed.load());
  CHECK(bFreed.load());
  CHECK(cFreed.load());
  CHECK_FALSE(cDefer.load());  // its last step, which let it go, was told nothing releases
}

TEST_CASE("staged path: pieces hold the same elements of every rank's block and fit their slot, for every "
          "collective, N and type",
          "[devcomm][staged]") {
  for (int N : {1, 2, 3, 8, 64}) {
    SimMemory mem;
    loomsim::SimDeviceWorld world(1, 1, 256);
    loom::StagedCommOptions o;
    o.pieceBytes = 4096;
    o.issueHost = [](const std::vector<loom::OpDesc>&) { return std::function<void()>([] {}); };
    loom::StagedDeviceComm c(0, N, std::make_unique<SimDriver>(mem, &world, 0, 0), o);
    for (Collective coll : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                            Collective::Broadcast, Collective::Reduce, Collective::AllToAll, Collective::Gather,
                            Collective::Scatter})
      for (loomDataType_t t : {loomInt8, loomFloat16, loomFloat32, loomFloat64}) {
        loom::OpDesc d;
        d.coll = coll, d.dtype = t, d.count = 100000;
        const size_t e = c.pieceElements(d), esz = loom::dtypeSize(t);
        const bool perRank = coll != Collective::AllReduce && coll != Collective::Broadcast &&
                             coll != Collective::Reduce;
        INFO(loom::collectiveName(coll) << " N=" << N << " " << loom::dtypeName(t));
        CHECK(e >= 1);
        CHECK(e * esz * (perRank ? size_t(N) : 1) <= std::max<size_t>(4096, size_t(N) * 16));
        CHECK(c.pieces(d) == (d.count + e - 1) / e);
        d.count = 0;
        CHECK(c.pieces(d) == 0);
      }
  }
}

// ---- The hierarchical path: several ranks on each of several hosts --------

namespace {

loom::HierDeviceComm* hierOf(loomComm_t c) { return dynamic_cast<loom::HierDeviceComm*>(c->deviceComm()); }

struct HierLayout {
  int N;
  std::function<std::string(int)> hostOf;
  int hosts, perHost;
  bool hostMajor;  // ranks numbered host by host: reduce-scatter and all-gather go through the hierarchy too
  const char* what;
};

std::vector<HierLayout> hierLayouts() {
  return {
      {4, [](int r) { return "hier-host-" + std::to_string(r / 2); }, 2, 2, true, "2 hosts x 2, ranks in host order"},
      {4, [](int r) { return "hier-host-" + std::to_string(r % 2); }, 2, 2, false, "2 hosts x 2, ranks interleaved"},
      {6, [](int r) { return "hier-host-" + std::to_string(r % 3); }, 3, 2, false, "3 hosts x 2, interleaved"},
      {6, [](int r) { return "hier-host-" + std::to_string(r / 3); }, 2, 3, true, "2 hosts x 3, in host order"},
  };
}

}  // namespace

TEST_CASE("hierarchical device path: where each rank sits, and how an all-reduce is split", "[devcomm][hierdev]") {
  const std::vector<std::string> ids = {"b", "a", "b", "a", "c", "c"};
  loom::HierShape s = loom::hierShapeOf(ids, 3);
  CHECK(s.usable());
  CHECK(s.hosts == 3);
  CHECK(s.perHost == 2);
  CHECK(s.hostOf == std::vector<int>{0, 1, 0, 1, 2, 2});  // hosts in the order of their lowest rank
  CHECK(s.localOf == std::vector<int>{0, 0, 1, 1, 0, 1});
  CHECK(s.hostIndex == 1);
  CHECK(s.localIndex == 1);
  CHECK_FALSE(s.hostMajor);
  CHECK(loom::hierShapeOf({"b", "b", "a", "a", "c", "c"}, 0).hostMajor);
  CHECK(loom::hierShapeOf({"b", "b", "b", "a", "a", "a"}, 4).hostMajor);
  CHECK_FALSE(loom::hierShapeOf({"b", "b", "a", "b", "a", "a"}, 4).hostMajor);
  s = loom::hierShapeOf({"a", "a", "b"}, 0);
  CHECK_FALSE(s.usable());
  CHECK(s.why.find("host a has 2 ranks, host b has 1") != std::string::npos);
  s = loom::hierShapeOf({"a", "a"}, 0);
  CHECK_FALSE(s.usable());
  CHECK(s.why.find("one host") != std::string::npos);
  s = loom::hierShapeOf({"a", "b", "c"}, 2);
  CHECK_FALSE(s.usable());
  CHECK(s.why.find("each host has one rank") != std::string::npos);
  for (size_t count : {size_t(0), size_t(1), size_t(2), size_t(3), size_t(7), size_t(1000), size_t(1001)})
    for (int L : {1, 2, 3, 8}) {
      const loom::HierSplit sp = loom::hierSplit(count, L);
      CHECK(sp.shard * size_t(L) + sp.tail == count);
      CHECK(sp.tail < size_t(L));
    }
}

TEST_CASE("CUDA communicator on several hosts with several ranks each (simulated device, ranks as threads posing as "
          "hosts): the hierarchical path, all-reduces (and reduce-scatters and all-gathers where ranks are numbered "
          "host by host) through the local and rail communicators exact (tails, every op, in and out of place), "
          "every other collective and send/recv on the flat path",
          "[devcomm][hierdev]") {
  ScopedEnv piece("LOOM_DEVICE_STAGE_BYTES", "4096");  // the rail's and the flat path's pieces: many
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "64");
  for (const HierLayout& lay : hierLayouts()) {
    const int N = lay.N;
    INFO(lay.what);
    SimMemory mem;
    loomsim::SimDeviceWorld world(N, 1, 256, patientDevice());
    DeviceEnv env(mem, world);
    std::vector<loomResult_t> rcs;
    std::vector<std::string> errs;
    std::vector<loomComm_t> comms = initCudaCommsOn(N, lay.hostOf, &rcs, &errs);
    INFO("init: " << (errs.empty() ? "" : errs[0]));
    REQUIRE(comms.size() == size_t(N));
    for (int r = 0; r < N; ++r) {
      loom::HierDeviceComm* h = hierOf(comms[size_t(r)]);
      REQUIRE(h != nullptr);
      CHECK(h->shape().hosts == lay.hosts);
      CHECK(h->shape().perHost == lay.perHost);
      CHECK(h->localComm()->nranks() == lay.perHost);
      CHECK(h->localComm()->rank() == h->shape().localIndex);
      CHECK(std::string(h->localComm()->deviceComm()->pathName()) == "ipc");
      CHECK(h->railComm()->nranks() == lay.hosts);
      CHECK(h->railComm()->rank() == h->shape().hostIndex);
      CHECK(std::string(h->railComm()->deviceComm()->pathName()) == "staged");
      CHECK(std::string(h->flat()->pathName()) == "staged");
      CHECK(dumpOf(comms[size_t(r)]).find("hierarchical path") != std::string::npos);
    }
    auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
    std::mt19937_64 rng(uint64_t(N) * 31 + uint64_t(lay.perHost));
    std::vector<Op> ops = everyCollective(N);
    ops.push_back({Collective::AllReduce, loomFloat32, loomSum, 10000, 0, false});  // shards in many rail pieces
    ops.push_back({Collective::AllReduce, loomInt32, loomSum, 3001, 0, true});      // a tail (3001 % L != 0 for L=2)
    ops.push_back({Collective::AllReduce, loomInt64, loomSum, 3002, 0, false});     // and for L=3
    ops.push_back({Collective::AllReduce, loomBfloat16, loomAvg, 2999, 0, true});   // average: by L, then by hosts
    ops.push_back({Collective::AllReduce, loomInt32, loomAvg, 3000, 0, false});     // integers average flat
    ops.push_back({Collective::AllReduce, loomFloat16, loomMax, 1001, 0, false});
    ops.push_back({Collective::AllReduce, loomUint8, loomMin, 4099, 0, true});
    ops.push_back({Collective::AllReduce, loomInt64, loomProd, 77, 0, false});
    ops.push_back({Collective::AllReduce, loomInt32, loomSum, 10, 0, true});  // 40 B: under the threshold, flat
    // Reduce-scatter and all-gather: blocks in many rail pieces, the
    // scratch grown between calls (kept while earlier calls may use it).
    ops.push_back({Collective::ReduceScatter, loomFloat32, loomSum, 3000, 0, false});
    ops.push_back({Collective::AllGather, loomInt64, loomSum, 2500, 0, true});
    ops.push_back({Collective::ReduceScatter, loomBfloat16, loomAvg, 9001, 0, true});  // average: by L, then by hosts
    ops.push_back({Collective::ReduceScatter, loomInt32, loomAvg, 1000, 0, false});    // integers average flat
    ops.push_back({Collective::ReduceScatter, loomUint8, loomMax, 40001, 0, false});
    ops.push_back({Collective::AllGather, loomFloat16, loomSum, 70000, 0, false});
    ops.push_back({Collective::ReduceScatter, loomInt64, loomProd, 33, 0, true});
    ops.push_back({Collective::AllGather, loomUint8, loomSum, 2, 0, true});  // 2 B per rank: under the threshold
    std::vector<Prepared> prepared;
    for (const Op& o : ops) prepared.push_back(prepare(mem, N, 1, o, rng));
    uint64_t hierWanted = 0;
    for (const Prepared& p : prepared) {
      for (int r = 0; r < N; ++r) CHECK(issueApi(comms[size_t(r)], p, r, fakeStream) == loomSuccess);
      loom::OpDesc d;
      d.coll = p.o.coll, d.count = p.o.count, d.dtype = p.o.type, d.op = p.o.op;
      const bool hier = hierOf(comms[0])->hierarchical(d);
      hierWanted += hier;
      if ((d.coll == Collective::ReduceScatter || d.coll == Collective::AllGather) && d.count >= 1000 &&
          !(d.op == loomAvg && d.dtype == loomInt32))
        CHECK(hier == lay.hostMajor);
    }
    CHECK(hierWanted >= 12);
    for (int r = 0; r < N; ++r) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
      INFO(msg);
    }
    for (const Prepared& p : prepared) CHECK(verifyNear(p, N) == "");
    for (int r = 0; r < N; ++r) {
      CHECK(hierOf(comms[size_t(r)])->hierRuns() == hierWanted);
      // The largest scratch: H blocks of the 70000 x float16 all-gather.
      if (lay.hostMajor) CHECK(hierOf(comms[size_t(r)])->scratchBytes() >= size_t(lay.hosts) * 70000 * 2);
      if (!lay.hostMajor) CHECK(hierOf(comms[size_t(r)])->scratchBytes() == 0);
    }

    CHECK(ringSendRecvWrong(mem, world, comms, 5000) == 0);  // the flat path
    destroyPromptly(comms);
  }
}

TEST_CASE("CUDA communicator on the hierarchical path (simulated device): registered device memory is published "
          "by the local sub-communicator, and its deregistration has the host's peers unmap it",
          "[devcomm][hierdev]") {
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "64");
  ScopedEnv slot("LOOM_DEVICE_SLOT_BYTES", "65536");
  const int N = 4;
  SimMemory mem;
  loomsim::SimDeviceWorld world(N, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaCommsOn(N, [](int r) { return "hier-reg-host-" + std::to_string(r / 2); });
  REQUIRE(comms.size() == size_t(N));
  auto localOf = [&](int r) -> loom::DeviceComm& {
    return *dynamic_cast<loom::DeviceComm*>(hierOf(comms[size_t(r)])->localComm()->deviceComm());
  };
  const size_t n = 200000;
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  std::vector<uint8_t*> segment(N);
  std::vector<int32_t*> send(N), recv(N);
  std::vector<void*> handle(N);
  for (int r = 0; r < N; ++r) {
    segment[size_t(r)] = mem.alloc(0, 2 * n * 4);
    send[size_t(r)] = reinterpret_cast<int32_t*>(segment[size_t(r)]);
    recv[size_t(r)] = send[size_t(r)] + n;
    REQUIRE(loomCommRegister(comms[size_t(r)], segment[size_t(r)], 2 * n * 4, &handle[size_t(r)]) == loomSuccess);
  }
  auto reads = [&] {
    uint64_t s = 0;
    for (int r = 0; r < N; ++r) s += world.rank(r).publishedReads();
    return s;
  };
  auto allReduce = [&](int salt) {
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i) send[size_t(r)][i] = int32_t(r + salt + int(i % 977));
    for (int r = 0; r < N; ++r)
      CHECK(loomAllReduce(send[size_t(r)], recv[size_t(r)], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) ==
            loomSuccess);
    for (int r = 0; r < N; ++r) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
    }
    long wrong = 0;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i) wrong += recv[size_t(r)][i] != int32_t(6 + N * salt + N * int(i % 977));
    CHECK(wrong == 0);
  };
  uint64_t before = reads();
  allReduce(1);
  CHECK(reads() > before);
  for (int r = 0; r < N; ++r) {
    CHECK(hierOf(comms[size_t(r)])->hierRuns() == 1);
    CHECK(localOf(r).memoryStats().published == 1);
    CHECK(localOf(r).memoryStats().publishedIn == 1);
  }
  for (int r = 0; r < N; ++r) CHECK(loomCommDeregister(comms[size_t(r)], handle[size_t(r)]) == loomSuccess);
  for (int r = 0; r < N; ++r) {
    CHECK(localOf(r).memoryStats().published == 0);
    CHECK(localOf(r).memoryStats().publishedIn == 0);
  }
  before = reads();
  allReduce(2);
  CHECK(reads() == before);  // staged now, still exact
  for (int r = 0; r < N; ++r) mem.free(segment[size_t(r)]);
  destroyPromptly(comms);
}

TEST_CASE("CUDA communicators and the hierarchical path: auto takes it where it applies and stages otherwise, "
          "LOOM_DEVICE_PATH=hier where it does not apply fails init on every rank saying why, staged forces staging",
          "[devcomm][hierdev]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  auto pairs = [](int r) { return "hier-host-" + std::to_string(r / 2); };
  auto uneven = [](int r) { return r < 2 ? std::string("hier-host-a") : std::string("hier-host-b"); };
  {
    std::vector<loomComm_t> comms = initCudaCommsOn(4, pairs);  // auto, 2 x 2
    REQUIRE(comms.size() == 4);
    for (loomComm_t c : comms) CHECK(hierOf(c) != nullptr);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  }
  {
    std::vector<loomComm_t> comms = initCudaCommsOn(3, uneven);  // auto, 2 + 1: staged
    REQUIRE(comms.size() == 3);
    for (loomComm_t c : comms) CHECK(stagedOf(c) != nullptr);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  }
  {
    ScopedEnv path("LOOM_DEVICE_PATH", "staged");
    std::vector<loomComm_t> comms = initCudaCommsOn(4, pairs);
    REQUIRE(comms.size() == 4);
    for (loomComm_t c : comms) CHECK(stagedOf(c) != nullptr);
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  }
  {
    ScopedEnv path("LOOM_DEVICE_PATH", "hier");
    struct Case {
      int n;
      std::function<std::string(int)> hostOf;
      const char* why;
    };
    for (const Case& k : {Case{3, uneven, "host hier-host-a has 2 ranks, host hier-host-b has 1"},
                          Case{2, [](int) { return std::string(); }, "every rank is on one host"},
                          Case{2, twoHosts, "each host has one rank"}}) {
      std::vector<loomResult_t> rcs;
      std::vector<std::string> errs;
      CHECK(initCudaCommsOn(k.n, k.hostOf, &rcs, &errs).empty());
      for (int r = 0; r < k.n; ++r) {
        CHECK(rcs[size_t(r)] == loomInvalidUsage);
        INFO(errs[size_t(r)]);
        CHECK(errs[size_t(r)].find("LOOM_DEVICE_PATH=hier") != std::string::npos);
        CHECK(errs[size_t(r)].find(k.why) != std::string::npos);
      }
    }
  }
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(g_pinnedLive.load() == 0);
}

TEST_CASE("CUDA communicator on the hierarchical path (simulated device): a rank's loomCommAbort while the others' "
          "all-reduce, reduce-scatter or all-gather waits for it fails them with its reason, releases their streams, "
          "later calls fail at once, destroy frees everything (the scratch included)",
          "[devcomm][hierdev][abort]") {
  for (Collective coll : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather}) {
    INFO(loom::collectiveName(coll));
    SimMemory mem;
    loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
    DeviceEnv env(mem, world);
    ScopedEnv piece("LOOM_DEVICE_STAGE_BYTES", "4096");
    ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "0");
    std::vector<loomComm_t> comms = initCudaCommsOn(4, [](int r) { return "hier-host-" + std::to_string(r / 2); });
    REQUIRE(comms.size() == 4);
    REQUIRE(hierOf(comms[0]) != nullptr);
    loom::OpDesc d;
    d.coll = coll, d.count = 20001, d.dtype = loomInt32;
    CHECK(hierOf(comms[0])->hierarchical(d));
    // All-reduce: shards of 10000 (10 rail pieces) and a tail; the others:
    // blocks of 20001 (the rail's pieces: 2 x 20001 x 4 B over 4 KiB).
    checkAbortReleasesOthers(mem, world, comms, 20001, coll);
  }
}

TEST_CASE("CUDA communicator on the hierarchical path (simulated device): a failure of one rank's internal rail "
          "communicator fails the communicator on every rank, naming the rail and its members",
          "[devcomm][hierdev][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaCommsOn(4, [](int r) { return "hier-host-" + std::to_string(r / 2); });
  REQUIRE(comms.size() == 4);
  hierOf(comms[1])->railComm()->abort();  // rank 1's rail: ranks 1 and 3
  for (int r = 0; r < 4; ++r) {
    std::string last;
    CHECK(awaitAsyncError(comms[size_t(r)], &last) == loomRemoteError);
    INFO("rank " << r << ": " << last);
    CHECK(last.find("rail communicator") != std::string::npos);
    CHECK(last.find("ranks 1 3") != std::string::npos);
    // Where it began, in this communicator's ranks: rank 1 (rank 3's rail
    // heard of it from rank 1's and names it in its own message; ranks 0
    // and 2 hear of it from rank 1 and rank 3, both naming rank 1).
    if (r == 0 || r == 2) CHECK(last.find("failed on rank 1") != std::string::npos);
    // The communicator publishes its error, then fails its device side
    // (failFirst): that follows within moments.
    const int64_t until = loom::nowMs() + 10000;
    while (!hierOf(comms[size_t(r)])->failed() && loom::nowMs() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    CHECK(hierOf(comms[size_t(r)])->failed());
  }
  destroyPromptly(comms);
}

TEST_CASE("CUDA communicator on the hierarchical path (simulated device): loomCommRevoke while the others' all-reduce "
          "waits releases every rank's streams and every rank's error says revoked, not a sub-communicator's failure",
          "[devcomm][hierdev][abort]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "0");
  std::vector<loomComm_t> comms = initCudaCommsOn(4, [](int r) { return "hier-host-" + std::to_string(r / 2); });
  REQUIRE(comms.size() == 4);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 20001;
  std::vector<int32_t*> buf;
  for (int r = 0; r < 3; ++r) buf.push_back(reinterpret_cast<int32_t*>(mem.alloc(0, n * 4)));
  for (int r = 0; r < 3; ++r)  // rank 3 never takes part
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomInt32, loomSum, comms[size_t(r)], fakeStream) ==
          loomSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(loomCommRevoke(comms[0]) == loomSuccess);
  for (int r = 0; r < 4; ++r) {
    if (r < 3) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);  // released
    }
    std::string last;
    CHECK(awaitAsyncError(comms[size_t(r)], &last) == loomRemoteError);
    INFO("rank " << r << ": " << last);
    CHECK(last.find("revoked") != std::string::npos);
    CHECK(last.find("communicator (its ranks") == std::string::npos);  // no sub-communicator's story
  }
  destroyPromptly(comms);
}

TEST_CASE("CUDA communicators split from a hierarchical one with LOOM_DEVICE_PATH=hier: a shape it does not apply to "
          "takes the path auto picks instead of failing",
          "[devcomm][hierdev]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  ScopedEnv path("LOOM_DEVICE_PATH", "hier");
  std::vector<loomComm_t> comms = initCudaCommsOn(4, [](int r) { return "hier-host-" + std::to_string(r / 2); });
  REQUIRE(comms.size() == 4);
  for (loomComm_t c : comms) CHECK(hierOf(c) != nullptr);
  std::vector<loomComm_t> parts(4, nullptr);
  std::vector<loomResult_t> rcs(4, loomSuccess);
  std::vector<std::thread> ts;
  for (int r = 0; r < 4; ++r)  // {0, 1, 2}: hosts of 2 and 1 ranks (staged); {3}: one rank (ipc)
    ts.emplace_back([&, r] {
      loom::setThreadHostIdForTesting("hier-host-" + std::to_string(r / 2));
      rcs[size_t(r)] = loomCommSplit(comms[size_t(r)], r == 3, r, &parts[size_t(r)]);
      loom::setThreadHostIdForTesting("");
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 4; ++r) {
    CHECK(rcs[size_t(r)] == loomSuccess);
    REQUIRE(parts[size_t(r)] != nullptr);
    CHECK(std::string(parts[size_t(r)]->deviceComm()->pathName()) == (r == 3 ? "ipc" : "staged"));
  }
  for (loomComm_t c : parts) CHECK(loomCommDestroy(c) == loomSuccess);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(g_pinnedLive.load() == 0);
}

// ---- The IPC path's mismatch check ----------------------------------------

TEST_CASE("IPC path mismatch check: signatures compared across batches in any order, ahead and behind, mismatches "
          "named with both operations, garbage batches ignored",
          "[devcomm][mismatch]") {
  auto desc = [](Collective c, size_t count, loomDataType_t t, loomRedOp_t op, int root) {
    loom::OpDesc d;
    d.coll = c, d.count = count, d.dtype = t, d.op = op, d.root = root;
    return d;
  };
  // Equal sequences, 200 operations (several batches), the sender ahead.
  loom::SignatureCheck a(0, 2), b(1, 0);
  std::vector<std::vector<uint8_t>> batches;
  for (int i = 0; i < 200; ++i) {
    const loom::OpDesc d = desc(i % 3 ? Collective::AllReduce : Collective::Broadcast, size_t(i), loomFloat32,
                                loomRedOp_t(i % 5), i % 4);
    a.recordMine(d);
    for (std::vector<uint8_t> x = a.takeBatch(); !x.empty(); x = a.takeBatch()) batches.push_back(x);
    if (i < 150) b.recordMine(d);
  }
  CHECK(batches.size() >= 4);
  CHECK_FALSE(a.pending());
  std::reverse(batches.begin(), batches.end());  // out of order
  for (const auto& x : batches) b.receive(x);
  for (const auto& x : batches) b.receive(x);  // repeated
  CHECK(b.mismatch() == "");
  // The rest arrives after b enqueues it: compared then.  A broadcast's op
  // and an all-reduce's root do not matter.
  for (int i = 150; i < 200; ++i)
    b.recordMine(desc(i % 3 ? Collective::AllReduce : Collective::Broadcast, size_t(i), loomFloat32,
                      i % 3 ? loomRedOp_t(i % 5) : loomMax, i % 3 ? 7 : i % 4));
  CHECK(b.mismatch() == "");
  // One different count, behind (b enqueued it first).
  b.recordMine(desc(Collective::AllReduce, 1000, loomFloat32, loomSum, 0));
  a.recordMine(desc(Collective::AllReduce, 1001, loomFloat32, loomSum, 0));
  b.receive(a.takeBatch());
  const std::string m = b.mismatch();
  INFO(m);
  CHECK(m.find("mismatched operations") != std::string::npos);
  CHECK(m.find("#200") != std::string::npos);
  CHECK(m.find("AllReduce of 1001 x float32, sum on rank 0") != std::string::npos);
  CHECK(m.find("AllReduce of 1000 x float32, sum on rank 1") != std::string::npos);
  // A different root, ahead (the sender's arrives first).
  loom::SignatureCheck c(1, 0);
  loom::SignatureCheck d0(0, 1);
  d0.recordMine(desc(Collective::Gather, 5, loomInt8, loomSum, 1));
  c.receive(d0.takeBatch());
  CHECK(c.mismatch() == "");
  c.recordMine(desc(Collective::Gather, 5, loomInt8, loomSum, 0));
  CHECK(c.mismatch().find("Gather of 5 x int8, root 1 on rank 0 but Gather of 5 x int8, root 0 on rank 1") !=
        std::string::npos);
  // Pacing: a partial batch at most every 10 ms, a full one at once, all
  // of them on a flush.
  loom::SignatureCheck p(0, 1);
  int64_t next = 0;
  CHECK(p.due(1000, false, &next).empty());
  CHECK(next == 100);  // nothing pending
  p.recordMine(desc(Collective::AllReduce, 1, loomFloat32, loomSum, 0));
  CHECK(p.due(1000, false, &next).size() == 1);
  p.recordMine(desc(Collective::AllReduce, 2, loomFloat32, loomSum, 0));
  CHECK(p.due(1004, false, &next).empty());
  CHECK(next == 6);
  CHECK(p.due(1004, true, &next).size() == 1);
  for (size_t i = 0; i < 2 * loom::kSignatureBatch + 1; ++i)
    p.recordMine(desc(Collective::AllReduce, 3, loomFloat32, loomSum, 0));
  CHECK(p.due(1005, false, &next).size() == 1);  // a full batch at once
  CHECK(next == 1);                              // and another full one waits
  CHECK(p.due(1005, true, &next).size() == 2);   // the rest on a flush
  CHECK(p.pending() == 0);
  // Garbage: wrong sizes, reserved bits, too many entries.
  std::vector<loom::OpSignature> out;
  CHECK_FALSE(loom::decodeSignatures(std::vector<uint8_t>(23), &out));
  std::vector<uint8_t> bad = loom::encodeSignatures({loom::OpSignature{}});
  bad[19] = 1;
  CHECK_FALSE(loom::decodeSignatures(bad, &out));
  CHECK_FALSE(loom::decodeSignatures(std::vector<uint8_t>(24 * (loom::kSignatureBatch + 1)), &out));
  loom::SignatureCheck e(1, 0);
  e.recordMine(desc(Collective::AllReduce, 1, loomFloat32, loomSum, 0));
  e.receive(bad);
  CHECK(e.mismatch() == "");
}

TEST_CASE("send/recv mismatch check: sizes compared per pair across batches in any order, ahead and behind, a "
          "mismatch named with the message and both sizes, batches paced per receiver, collectives' entries kept "
          "apart",
          "[devcomm][mismatch]") {
  // Rank 0 sends to ranks 1 and 2; rank 1 receives from 0 (and 2, which
  // sends nothing here).
  loom::P2PCheck s0(0, 3), r1(1, 3);
  std::vector<std::pair<int, std::vector<uint8_t>>> batches;
  int64_t next = 0;
  int64_t now = 1000;
  for (int i = 0; i < 1500; ++i) {  // more than two full batches to rank 1
    s0.recordSend(1, uint64_t(i % 7 + 1) * 100);
    s0.recordSend(2, 5);
    s0.recordSend(0, 1);  // to itself: not this check's (checkBatch's)
    if (i < 1000) r1.recordRecv(0, uint64_t(i % 7 + 1) * 100);
    for (auto& b : s0.due(now += 3, false, &next)) batches.push_back(std::move(b));
  }
  for (auto& b : s0.due(now, true, &next)) batches.push_back(std::move(b));
  CHECK(s0.due(now + 1, false, &next).empty());
  CHECK(next == 100);  // all sent
  size_t to1 = 0, to2 = 0;
  for (const auto& [peer, bytes] : batches) {
    REQUIRE((peer == 1 || peer == 2));
    (peer == 1 ? to1 : to2) += 1;
    CHECK(loom::P2PCheck::isP2PBatch(bytes));
  }
  CHECK(to1 >= 3);
  CHECK(to1 == to2);
  std::reverse(batches.begin(), batches.end());  // out of order
  for (const auto& [peer, bytes] : batches)
    if (peer == 1) r1.receive(0, bytes), r1.receive(0, bytes);  // repeated
  CHECK(r1.mismatch() == "");
  CHECK(r1.unchecked() == 0);
  // Rank 2's batches name rank 2 as the receiver: rank 1 compares nothing of them.
  for (const auto& [peer, bytes] : batches)
    if (peer == 2) r1.receive(0, bytes);
  CHECK(r1.mismatch() == "");
  // The rest is compared when rank 1 enqueues it (the sends came first).
  for (int i = 1000; i < 1500; ++i) r1.recordRecv(0, uint64_t(i % 7 + 1) * 100);
  CHECK(r1.mismatch() == "");
  CHECK(r1.unchecked() == 0);
  // Message #1500 differs, the receive enqueued first.
  r1.recordRecv(0, 4096);
  CHECK(r1.unchecked() == 1);
  s0.recordSend(1, 4000);
  for (auto& [peer, bytes] : s0.due(now += 20, false, &next))
    if (peer == 1) r1.receive(0, bytes);
  const std::string m = r1.mismatch();
  INFO(m);
  CHECK(m.find("rank 1: mismatched send/recv: message #1500 from rank 0 to rank 1 on this communicator is a send of "
               "4000 bytes on rank 0 but a receive of 4096 bytes on rank 1") != std::string::npos);
  // A pair's own numbering: rank 2's first receive from rank 1 is its #0.
  loom::P2PCheck s1(1, 3), r2(2, 3);
  s1.recordSend(2, 64);
  for (auto& [peer, bytes] : s1.due(now, true, &next)) r2.receive(1, bytes);  // ahead of the receive
  CHECK(r2.unchecked() == 0);
  r2.recordRecv(0, 64);  // another pair: nothing to compare yet
  r2.recordRecv(1, 32);
  CHECK(r2.mismatch().find("message #0 from rank 1 to rank 2 on this communicator is a send of 64 bytes on rank 1 "
                           "but a receive of 32 bytes on rank 2") != std::string::npos);
  // Pacing: a partial batch per receiver at most every 10 ms, a full one at once.
  loom::P2PCheck p(0, 3);
  CHECK(p.due(5000, false, &next).empty());
  CHECK(next == 100);
  p.recordSend(1, 8);
  p.recordSend(2, 8);
  CHECK(p.due(5000, false, &next).size() == 2);  // one to each
  p.recordSend(2, 8);
  CHECK(p.due(5004, false, &next).empty());
  CHECK(next == 6);
  for (size_t i = 0; i < loom::kSignatureBatch; ++i) p.recordSend(1, 8);
  auto full = p.due(5005, false, &next);
  CHECK(full.size() == 2);  // rank 1's full batch at once, rank 2's one with it
  CHECK(next == 10);
  // The collectives' check and this one keep their entries apart.
  loom::SignatureCheck coll(1, 0);
  loom::OpDesc ar;
  ar.coll = Collective::AllReduce, ar.count = 1, ar.dtype = loomFloat32;
  coll.recordMine(ar);
  coll.receive(full[0].second);  // sends' sizes: not collectives
  CHECK(coll.mismatch() == "");
  CHECK(coll.unchecked() == 1);
  std::vector<uint8_t> collBatch = coll.takeBatch();
  CHECK_FALSE(loom::P2PCheck::isP2PBatch(collBatch));
  CHECK_FALSE(loom::P2PCheck::isP2PBatch({}));
  CHECK_FALSE(loom::P2PCheck::isP2PBatch(std::vector<uint8_t>(23)));
  loom::P2PCheck g(1, 3);
  g.recordRecv(0, 8);
  g.receive(0, collBatch);
  g.receive(0, std::vector<uint8_t>(23));
  g.receive(7, full[0].second);  // no such rank
  CHECK(g.mismatch() == "");
  CHECK(g.unchecked() == 1);
}

TEST_CASE("CUDA communicators on the IPC path (simulated device, through the C API): ranks whose collectives differ "
          "only in count all fail with loomInvalidUsage naming both operations, their streams are released, and "
          "matching calls never trip the check",
          "[devcomm][mismatch]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  std::vector<loomComm_t> comms = initCudaComms(3);
  REQUIRE(comms.size() == 3);
  REQUIRE(std::string(comms[0]->deviceComm()->pathName()) == "ipc");
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t n = 1000;
  std::vector<float*> buf;
  for (int r = 0; r < 3; ++r) buf.push_back(reinterpret_cast<float*>(mem.alloc(0, (n + 1) * 4)));
  // 300 matching calls: several batches each way, no failure.
  for (int i = 0; i < 300; ++i)
    for (int r = 0; r < 3; ++r)
      CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], size_t(i % 7 + 1), loomFloat32, loomSum, comms[size_t(r)],
                          fakeStream) == loomSuccess);
  for (int r = 0; r < 3; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every batch delivered
  for (int r = 0; r < 3; ++r) {
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomSuccess);
  }
  // Rank 1 reduces one element more: the same rounds, so nothing waits.
  for (int r = 0; r < 3; ++r) {  // a rank that calls after the mismatch was found is refused at once
    const loomResult_t rc = loomAllReduce(buf[size_t(r)], buf[size_t(r)], r == 1 ? n + 1 : n, loomFloat32, loomSum,
                                          comms[size_t(r)], fakeStream);
    CHECK((rc == loomSuccess || rc == loomInvalidUsage));
  }
  for (int r = 0; r < 3; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    std::string last;
    CHECK(awaitAsyncError(comms[size_t(r)], &last) == loomInvalidUsage);
    INFO("rank " << r << ": " << last);
    CHECK(last.find("mismatched operations") != std::string::npos);
    CHECK(last.find("AllReduce of 1001 x float32, sum on rank 1") != std::string::npos);
    CHECK(last.find("AllReduce of 1000 x float32, sum on rank") != std::string::npos);
    CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], n, loomFloat32, loomSum, comms[size_t(r)], fakeStream) ==
          loomInvalidUsage);
  }
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  CHECK(loom::waitDeviceRemains(10000));
}

TEST_CASE("CUDA communicators on the IPC path (simulated device, through the C API): matching send/recv groups "
          "never trip the send/recv mismatch check, a receive of another size (or all-to-allv counts that differ) "
          "fails every rank with loomInvalidUsage naming the message and both sizes, long before LOOM_TIMEOUT_MS",
          "[devcomm][mismatch]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(3, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  ScopedEnv slotBytes("LOOM_DEVICE_SLOT_BYTES", "65536");  // 32 KiB chunks
  ScopedEnv timeout("LOOM_TIMEOUT_MS", "120000");         // the check must find it, not the timeout
  // Whether the receive differs in bytes within as many chunks (it used to
  // copy garbage; rank 0 -> 1, whose ring messages came before), or in
  // chunks (it then waits for one that never comes; rank 0 -> 2, not
  // neighbours, while rank 1 -> 2 matches), or the counts of an all-to-allv
  // differ (its sends and receives are these; rank 0 -> 2 again).
  const int mode = GENERATE(0, 1, 2);
  const bool moreChunks = mode == 1, allToAllv = mode == 2;
  const int receiver = mode == 0 ? 1 : 2;
  INFO("receive with more chunks: " << moreChunks << ", all-to-allv: " << allToAllv);
  std::vector<loomComm_t> comms = initCudaComms(3);
  REQUIRE(comms.size() == 3);
  REQUIRE(std::string(comms[0]->deviceComm()->pathName()) == "ipc");
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  const size_t most = 100000;
  std::vector<uint8_t*> src, dst;
  for (int r = 0; r < 3; ++r) {
    src.push_back(mem.alloc(0, 2 * most));
    dst.push_back(mem.alloc(0, 2 * most));
    for (size_t i = 0; i < 2 * most; ++i) src[size_t(r)][i] = uint8_t(i * 13 + size_t(r) * 7 + 1);
  }
  // 40 ring exchanges, two messages per pair of uneven sizes (one or several
  // chunks, an empty one now and then): every rank to the next, as one group
  // issued by this thread for all three.
  uint64_t messages = 0;  // from rank 0 to rank 1 so far (empty ones count too)
  for (int i = 0; i < 40; ++i) {
    const size_t a = size_t(i * 2311) % most, b = i % 5 ? size_t(i * 977 + 1) % most : 0;
    messages += 2;
    for (int r = 0; r < 3; ++r) memset(dst[size_t(r)], 0, 2 * most);
    REQUIRE(loomGroupStart() == loomSuccess);
    for (int r = 0; r < 3; ++r) {
      const int next = (r + 1) % 3, prev = (r + 2) % 3;
      REQUIRE(loomSend(src[size_t(r)], a, loomUint8, next, comms[size_t(r)], fakeStream) == loomSuccess);
      REQUIRE(loomSend(src[size_t(r)] + most, b, loomUint8, next, comms[size_t(r)], fakeStream) == loomSuccess);
      REQUIRE(loomRecv(dst[size_t(r)], a, loomUint8, prev, comms[size_t(r)], fakeStream) == loomSuccess);
      REQUIRE(loomRecv(dst[size_t(r)] + most, b, loomUint8, prev, comms[size_t(r)], fakeStream) == loomSuccess);
    }
    REQUIRE(loomGroupEnd() == loomSuccess);
    long wrong = 0;
    for (int r = 0; r < 3; ++r) {
      std::string msg;
      REQUIRE(world.rank(r).synchronize(&msg) == loomSuccess);
      const int prev = (r + 2) % 3;
      for (size_t k = 0; k < a; ++k) wrong += dst[size_t(r)][k] != src[size_t(prev)][k];
      for (size_t k = 0; k < b; ++k) wrong += dst[size_t(r)][most + k] != src[size_t(prev)][most + k];
    }
    CHECK(wrong == 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // every batch delivered
  for (int r = 0; r < 3; ++r) {
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomSuccess);
  }
  // Rank 0 sends 1000 bytes to rank 1, which receives 1100 (one chunk
  // either way) or 40000 (two chunks).
  const size_t sent = 1000, received = moreChunks ? 40000 : 1100;
  const int64_t t0 = loom::nowMs();
  if (allToAllv) {  // 1000 bytes each way between every pair, but rank 1 expects 1100 from rank 0
    for (int r = 0; r < 3; ++r) {
      size_t sendcounts[3] = {sent, sent, sent}, recvcounts[3] = {sent, sent, sent};
      const size_t displs[3] = {0, 2000, 4000};
      if (r == receiver) recvcounts[0] = received;
      REQUIRE(loomAllToAllv(src[size_t(r)], sendcounts, displs, dst[size_t(r)], recvcounts, displs, loomUint8,
                            comms[size_t(r)], fakeStream) == loomSuccess);
    }
  } else {
    REQUIRE(loomSend(src[0], sent, loomUint8, receiver, comms[0], fakeStream) == loomSuccess);
    if (receiver == 2) REQUIRE(loomSend(src[1], 500, loomUint8, 2, comms[1], fakeStream) == loomSuccess);
    REQUIRE(loomGroupStart() == loomSuccess);
    REQUIRE(loomRecv(dst[size_t(receiver)], received, loomUint8, 0, comms[size_t(receiver)], fakeStream) ==
            loomSuccess);
    if (receiver == 2) REQUIRE(loomRecv(dst[2] + most, 500, loomUint8, 1, comms[2], fakeStream) == loomSuccess);
    REQUIRE(loomGroupEnd() == loomSuccess);
  }
  const std::string named =
      loom::strf("message #%llu from rank 0 to rank %d on this communicator is a send of %zu bytes on rank 0 but a "
                 "receive of %zu bytes on rank %d",
                 (unsigned long long)(receiver == 1 ? messages : 0), receiver, sent, received, receiver);
  for (int r = 0; r < 3; ++r) {
    std::string last;
    CHECK(awaitAsyncError(comms[size_t(r)], &last) == loomInvalidUsage);
    INFO("rank " << r << ": " << last);
    CHECK(last.find("mismatched send/recv") != std::string::npos);
    CHECK(last.find(named) != std::string::npos);
  }
  for (int r : {0, receiver}) {  // released
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
  }
  CHECK(loom::nowMs() - t0 < 10000);
  CHECK(loomSend(src[0], 8, loomUint8, 1, comms[0], fakeStream) == loomInvalidUsage);
  destroyPromptly(comms);
}

TEST_CASE("CUDA communicator on the hierarchical path (simulated device): ranks whose all-reduce counts fall on both "
          "sides of LOOM_DEVICE_HIER_MIN_BYTES (one hierarchical, the others flat) all fail with loomInvalidUsage "
          "naming both calls, promptly, instead of waiting for the timeout",
          "[devcomm][hierdev][mismatch]") {
  SimMemory mem;
  loomsim::SimDeviceWorld world(4, 1, 256, patientDevice());
  DeviceEnv env(mem, world);
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "1000");
  std::vector<loomComm_t> comms = initCudaCommsOn(4, [](int r) { return "hier-host-" + std::to_string(r / 2); });
  REQUIRE(comms.size() == 4);
  auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  std::vector<float*> buf;
  for (int r = 0; r < 4; ++r) buf.push_back(reinterpret_cast<float*>(mem.alloc(0, 4000)));
  // Matching calls first, through both paths: nothing trips.
  for (int i = 0; i < 20; ++i)
    for (int r = 0; r < 4; ++r)
      CHECK(loomAllReduce(buf[size_t(r)], buf[size_t(r)], i % 2 ? 1000 : 100, loomFloat32, loomSum, comms[size_t(r)],
                          fakeStream) == loomSuccess);
  for (int r = 0; r < 4; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
    loomResult_t ae = loomSuccess;
    CHECK(loomCommGetAsyncError(comms[size_t(r)], &ae) == loomSuccess);
    CHECK(ae == loomSuccess);
  }
  const int64_t t0 = loom::nowMs();
  for (int r = 0; r < 4; ++r) {  // rank 0: 4000 B, hierarchical; the others 400 B, flat
    // A rank that calls after the mismatch was found is refused at once.
    const loomResult_t rc = loomAllReduce(buf[size_t(r)], buf[size_t(r)], r == 0 ? 1000 : 100, loomFloat32, loomSum,
                                          comms[size_t(r)], fakeStream);
    CHECK((rc == loomSuccess || rc == loomInvalidUsage));
  }
  for (int r = 0; r < 4; ++r) {
    std::string msg;
    CHECK(world.rank(r).synchronize(&msg) == loomSuccess);  // released
    std::string last;
    CHECK(awaitAsyncError(comms[size_t(r)], &last) == loomInvalidUsage);
    INFO("rank " << r << ": " << last);
    CHECK(last.find("mismatched operations") != std::string::npos);
    CHECK(last.find("AllReduce of 1000 x float32, sum on rank 0") != std::string::npos);
  }
  CHECK(loom::nowMs() - t0 < 10000);
  destroyPromptly(comms);
}

// ---- One communicator, two streams ------------------------------------------

// The ipc, staged and hierarchical paths, as ranks and the host each rank
// poses on (with LOOM_DEVICE_HIER_MIN_BYTES=0 the hier one takes every
// all-reduce through the hierarchy).
struct DevicePath {
  const char* name;
  int n;
  std::function<std::string(int)> hostOf;
};
std::vector<DevicePath> threeDevicePaths() {
  return {DevicePath{"ipc", 2, [](int) { return std::string(); }},
          DevicePath{"staged", 2, [](int r) { return "two-hosts-" + std::to_string(r); }},
          DevicePath{"hier", 4, [](int r) { return "hier-host-" + std::to_string(r / 2); }}};
}

TEST_CASE("CUDA communicator (simulated device): collectives and send/recv issued on two streams run in the order "
          "they were issued on each rank, when the first stream is held up by the caller's own work (on the ipc, "
          "staged and hierarchical paths)",
          "[devcomm][streams]") {
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "0");
  for (const DevicePath& path : threeDevicePaths()) {
    INFO(path.name);
    const int N = path.n;
    SimMemory mem;
    // A device per rank: rank 0's held kernel holds only its own, so the
    // others' streams run on while it is held.
    loomsim::SimDeviceWorld world(N, N, 256, patientDevice());
    auto* streamA = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));  // stream 0 of every rank
    auto* streamB = reinterpret_cast<loomStream_t>(uintptr_t(0xb0b));
    for (int r = 0; r < N; ++r) REQUIRE(world.rank(r).addCallerStream(streamB) > 0);
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaCommsOn(N, path.hostOf);
    REQUIRE(comms.size() == size_t(N));
    CHECK(std::string(comms[0]->deviceComm()->pathName()) == path.name);
    // Rank 0's stream A is held by its own kernel until `go`; every rank
    // issues an all-reduce on A, one on B, then more on A.
    std::atomic<bool> go{false};
    world.rank(0).enqueueWork(0, [&] {
      while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    const size_t n = 3000;
    auto fill = [&](float* p, size_t count, int r, int salt) {
      for (size_t i = 0; i < count; ++i) p[i] = float((r + 1) * salt + int(i % 7));
    };
    const size_t ranks = size_t(N);
    std::vector<float*> a(ranks), b(ranks), rsIn(ranks), rsOut(ranks), c(ranks);
    for (int r = 0; r < N; ++r) {
      a[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      b[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      c[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      rsIn[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * size_t(N) * 4));
      rsOut[size_t(r)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      fill(a[size_t(r)], n, r, 1);
      fill(b[size_t(r)], n, r, 10);
      fill(c[size_t(r)], n, r, 100);
      fill(rsIn[size_t(r)], n * size_t(N), r, 1000);
    }
    for (int r = 0; r < N; ++r) {
      loomComm_t cm = comms[size_t(r)];
      // a's round uses slot 0 and b's slot 1, so nothing but the ordering
      // wait keeps b from running while a is held on rank 0; a ran-ahead b
      // would set rank 0's input flag to b's value, and rank 1 would read
      // rank 0's slot 0 for a before a was staged there.
      CHECK(loomAllReduce(a[size_t(r)], a[size_t(r)], n, loomFloat32, loomSum, cm, streamA) == loomSuccess);
      CHECK(loomAllReduce(b[size_t(r)], b[size_t(r)], n, loomFloat32, loomSum, cm, streamB) == loomSuccess);
      CHECK(loomReduceScatter(rsIn[size_t(r)], rsOut[size_t(r)], n, loomFloat32, loomSum, cm, streamA) ==
            loomSuccess);
      CHECK(loomAllReduce(c[size_t(r)], c[size_t(r)], n, loomFloat32, loomSum, cm, streamA) == loomSuccess);
    }
    // Send/recv: rank 0 sends to rank 1 on A (held), then on B; rank 1
    // receives them in that order, on A then B.
    std::vector<float*> msg(2), got(2);
    for (int k = 0; k < 2; ++k) {
      msg[size_t(k)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      got[size_t(k)] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      fill(msg[size_t(k)], n, k, 7);
    }
    CHECK(loomSend(msg[0], n, loomFloat32, 1, comms[0], streamA) == loomSuccess);
    CHECK(loomSend(msg[1], n, loomFloat32, 1, comms[0], streamB) == loomSuccess);
    CHECK(loomRecv(got[0], n, loomFloat32, 0, comms[1], streamA) == loomSuccess);
    CHECK(loomRecv(got[1], n, loomFloat32, 0, comms[1], streamB) == loomSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // time for the others to run ahead, if they could
    go.store(true);
    for (int r = 0; r < N; ++r) {
      std::string m;
      CHECK(world.rank(r).synchronize(&m) == loomSuccess);
      INFO(m);
    }
    auto sum = [&](size_t i, int salt, size_t block) {
      float s = 0;
      for (int q = 0; q < N; ++q) s += float((q + 1) * salt + int((block + i) % 7));
      return s;
    };
    int wrong = 0;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i) {
        wrong += a[size_t(r)][i] != sum(i, 1, 0);
        wrong += b[size_t(r)][i] != sum(i, 10, 0);
        wrong += c[size_t(r)][i] != sum(i, 100, 0);
        wrong += rsOut[size_t(r)][i] != sum(i, 1000, size_t(r) * n);
      }
    for (int k = 0; k < 2; ++k)
      for (size_t i = 0; i < n; ++i) wrong += got[size_t(k)][i] != msg[size_t(k)][i];
    CHECK(wrong == 0);
    destroyPromptly(comms);
  }
}

TEST_CASE("CUDA communicator (simulated device): a group whose calls on one communicator use two streams runs after "
          "both streams' earlier work, and later work on either stream waits for the whole group, as NCCL joins "
          "a group's streams (on the ipc, staged and hierarchical paths)",
          "[devcomm][streams][group]") {
  ScopedEnv minBytes("LOOM_DEVICE_HIER_MIN_BYTES", "0");
  for (const DevicePath& path : threeDevicePaths()) {
    INFO(path.name);
    const int N = path.n;
    const size_t ranks = size_t(N);
    SimMemory mem;
    loomsim::SimDeviceWorld world(N, N, 256, patientDevice());
    auto* streamA = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));  // stream 0 of every rank
    auto* streamB = reinterpret_cast<loomStream_t>(uintptr_t(0xb0b));
    std::vector<int> indexB(ranks);
    for (int r = 0; r < N; ++r) indexB[size_t(r)] = world.rank(r).addCallerStream(streamB);
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaCommsOn(N, path.hostOf);
    REQUIRE(comms.size() == ranks);
    CHECK(std::string(comms[0]->deviceComm()->pathName()) == path.name);
    const size_t n = 20000;
    std::vector<float *> x(ranks), y(ranks), yCopy(ranks), sendb(ranks), recvb(ranks);
    for (size_t r = 0; r < ranks; ++r) {
      for (auto* v : {&x, &y, &yCopy, &sendb, &recvb}) (*v)[r] = reinterpret_cast<float*>(mem.alloc(0, n * 4));
      for (size_t i = 0; i < n; ++i) {
        x[r][i] = -1000.0f;  // until stream B's kernel writes it
        y[r][i] = float(r + 1) + float(i % 5);
        yCopy[r][i] = -1.0f;
        sendb[r][i] = float(r * 1000) + float(i % 11);
        recvb[r][i] = -1.0f;
      }
    }
    // Every rank's stream B writes x in a kernel of its own; rank 0's B
    // first waits for `go` (a wait: it holds stream B, not the device).
    std::atomic<bool> go{false};
    world.rank(0).enqueueWait(indexB[0], [&go] {
      while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    for (int r = 0; r < N; ++r) {
      float* xr = x[size_t(r)];
      world.rank(r).enqueueWork(indexB[size_t(r)], [xr, r, n] {
        for (size_t i = 0; i < n; ++i) xr[i] = float(10 * (r + 1)) + float(i % 3);
      });
    }
    // One group per rank: y's all-reduce on A (the group's first stream),
    // x's on B, a ring of sends on B and receives on A.
    for (int r = 0; r < N; ++r) {
      loomComm_t cm = comms[size_t(r)];
      const size_t u = size_t(r);
      REQUIRE(loomGroupStart() == loomSuccess);
      CHECK(loomAllReduce(y[u], y[u], n, loomFloat32, loomSum, cm, streamA) == loomSuccess);
      CHECK(loomAllReduce(x[u], x[u], n, loomFloat32, loomSum, cm, streamB) == loomSuccess);
      CHECK(loomSend(sendb[u], n, loomFloat32, (r + 1) % N, cm, streamB) == loomSuccess);
      CHECK(loomRecv(recvb[u], n, loomFloat32, (r + N - 1) % N, cm, streamA) == loomSuccess);
      REQUIRE(loomGroupEnd() == loomSuccess);
      INFO(loomGetLastError(cm));
      // Later work on B reads what the group wrote on A.
      float *yr = y[u], *cr = yCopy[u];
      world.rank(r).enqueueWork(indexB[u], [yr, cr, n] { memcpy(cr, yr, n * 4); });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // time for a group that did not wait to run
    go.store(true);
    for (int r = 0; r < N; ++r) {
      std::string m;
      CHECK(world.rank(r).synchronize(&m) == loomSuccess);
      INFO(m);
    }
    long wrongX = 0, wrongY = 0, wrongCopy = 0, wrongRecv = 0;
    for (size_t r = 0; r < ranks; ++r)
      for (size_t i = 0; i < n; ++i) {
        float sx = 0, sy = 0;
        for (int q = 0; q < N; ++q) {
          sx += float(10 * (q + 1)) + float(i % 3);
          sy += float(q + 1) + float(i % 5);
        }
        const size_t from = (r + ranks - 1) % ranks;
        wrongX += x[r][i] != sx;
        wrongY += y[r][i] != sy;
        wrongCopy += yCopy[r][i] != sy;
        wrongRecv += recvb[r][i] != float(from * 1000) + float(i % 11);
      }
    CHECK(wrongX == 0);     // the group waited for B's kernel
    CHECK(wrongY == 0);
    CHECK(wrongCopy == 0);  // B's later kernel waited for the group
    CHECK(wrongRecv == 0);
    destroyPromptly(comms);
  }
}

TEST_CASE("CUDA communicator (simulated device): LOOM_DEVICE_SLOT_BYTES sizes the IPC windows and "
          "LOOM_DEVICE_ONESHOT_BYTES picks the all-reduce program, every collective exact in rounds of small slots",
          "[devcomm][api]") {
  ScopedEnv slot("LOOM_DEVICE_SLOT_BYTES", "65536");
  std::vector<uint64_t> dual;
  for (const char* oneShot : {"0", "1048576"}) {  // reduce-scatter + all-gather always / one-shot always
    ScopedEnv os("LOOM_DEVICE_ONESHOT_BYTES", oneShot);
    const int N = 3;
    SimMemory mem;
    loomsim::SimDeviceWorld world(N, 1, 256, patientDevice());
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaComms(N);
    INFO("LOOM_DEVICE_ONESHOT_BYTES=" << oneShot);
    REQUIRE(comms.size() == size_t(N));
    for (loomComm_t c : comms) {
      CHECK(ipcOf(c).slotBytes() == 65536);
      CHECK(ipcOf(c).oneShotBytes() == std::stoul(oneShot));
      CHECK(dumpOf(c).find(loom::strf("%zu B allocated at init",
                                      loom::flagAreaBytes(N) + loom::cellAreaBytes(N) + loom::streamWindowBytes(65536) +
                                          loom::graphLaneBytes(N, size_t(8) << 20))) !=
            std::string::npos);
    }
    auto* fakeStream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
    std::mt19937_64 rng(11);
    std::vector<Op> ops = everyCollective(N);
    // Many rounds of 64 KiB.
    ops.push_back({Collective::AllReduce, loomFloat32, loomSum, 100000, 0, false});
    ops.push_back({Collective::AllReduce, loomInt32, loomAvg, 60001, 0, true});
    ops.push_back({Collective::ReduceScatter, loomInt32, loomSum, 30000, 0, false});
    ops.push_back({Collective::AllGather, loomFloat64, loomSum, 20000, 0, true});
    ops.push_back({Collective::AllToAll, loomInt32, loomSum, 20000, 0, false});
    ops.push_back({Collective::AllToAll, loomInt32, loomSum, 20000, 0, true});
    ops.push_back({Collective::Broadcast, loomUint8, loomSum, 300000, 1, false});
    ops.push_back({Collective::Reduce, loomInt64, loomMax, 40000, 2, false});
    std::vector<Prepared> prepared;
    for (const Op& o : ops) prepared.push_back(prepare(mem, N, 1, o, rng));
    const uint64_t round0 = ipcOf(comms[0]).round();
    for (const Prepared& p : prepared)
      for (int r = 0; r < N; ++r) CHECK(issueApi(comms[size_t(r)], p, r, fakeStream) == loomSuccess);
    for (int r = 0; r < N; ++r) {
      std::string msg;
      CHECK(world.rank(r).synchronize(&msg) == loomSuccess);
      INFO(msg);
    }
    for (const Prepared& p : prepared) CHECK(verifyNear(p, N) == "");
    // 400 KB alone is 7 rounds of a 64 KiB slot.
    CHECK(ipcOf(comms[0]).round() - round0 >= ops.size() + 10);
    // Only reduce-scatter + all-gather reduces into two destinations.
    dual.push_back(world.rank(0).dualReductions());
    for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  }
  CHECK(dual[0] > 0);
  CHECK(dual[1] == 0);
}

namespace {
// Device zero-copy's options for SimComms: allocations the test marks play
// loomMemAlloc's memory, and publish/unpublish questions go straight to
// the peer's communicator (the control plane's role).
struct Publishable {
  std::mutex mu;
  std::set<const void*> bases;
  SimMemory* mem = nullptr;
  void add(const void* base) {
    std::lock_guard<std::mutex> g(mu);
    bases.insert(base);
  }
};

loom::DeviceCommOptions zeroCopyOptions(Publishable& pub, SimComms** self, std::atomic<int>* unpublishes) {
  loom::DeviceCommOptions o;
  o.slotBytes = 4096;
  o.oneShotBytes = 0;  // every all-reduce reduce-scatter + all-gather
  o.zeroCopy = true;
  o.publishable = [&pub](const void* p, size_t bytes, void** base) {
    void* b = nullptr;
    size_t n = 0;
    try {
      pub.mem->range(p, &b, &n);
    } catch (const loom::Error&) {
      return false;
    }
    std::lock_guard<std::mutex> g(pub.mu);
    *base = b;
    return pub.bases.count(b) && bytes <= n - size_t(static_cast<const uint8_t*>(p) - static_cast<uint8_t*>(b));
  };
  // Which rank asks is the record's process (SimComms: 1000 + rank).
  o.publishTo = [self](int peer, const loom::IpcRecord& rec) {
    loom::DeviceComm* c = (*self)->comms[size_t(peer)].get();
    if (!c) loom::fail(loomRemoteError, "rank %d has no communicator", peer);
    return c->importPublished(int(rec.process - 1000), rec);
  };
  o.unpublishTo = [self, unpublishes](int peer, const loom::IpcRecord& rec) {
    loom::DeviceComm* c = (*self)->comms[size_t(peer)].get();
    if (!c) loom::fail(loomRemoteError, "rank %d has no communicator", peer);
    c->forgetPublished(int(rec.process - 1000), rec);
    ++*unpublishes;
  };
  return o;
}
}  // namespace

TEST_CASE("device communicator (simulated device), zero-copy: published collectives (all-reduce, reduce-scatter, "
          "all-gather, all-to-all, rooted) are exact, each allocation is mapped once per peer, and unpublish unmaps "
          "it before it is freed",
          "[devcomm]") {
  Publishable pub;
  SimComms* self = nullptr;
  std::atomic<int> unpublishes{0};
  const int N = 3;
  loom::DeviceCommOptions opts = zeroCopyOptions(pub, &self, &unpublishes);
  SimComms s(N, 1, opts, true, patientDevice());
  self = &s;
  pub.mem = &s.mem;
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  std::mt19937_64 rng(77);
  // The ranks (all, or odd ones) whose buffers of p may be published.
  auto mayPublish = [&](const Prepared& p, bool publishOdd) {
    for (int r = 0; r < N; ++r)
      if (!publishOdd || r % 2) {
        void* b = nullptr;
        size_t n = 0;
        s.mem.range(p.send[size_t(r)], &b, &n);
        pub.add(b);
        s.mem.range(p.recv[size_t(r)], &b, &n);
        pub.add(b);
      }
  };
  auto round = [&](bool inPlace, bool publishOdd, size_t count, loomRedOp_t op,
                   Collective coll = Collective::AllReduce) {
    Prepared p = prepare(s, Op{coll, loomFloat32, op, count, 0, inPlace}, rng);
    mayPublish(p, publishOdd);
    for (int r = 0; r < N; ++r) issue(s, p, r);
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    CHECK(verify(p, N) == "");
    return p;
  };
  uint64_t readsBefore = 0;
  for (int r = 0; r < N; ++r) readsBefore += s.world.rank(r).publishedReads();
  Prepared p = round(false, false, 5000, loomSum);  // everyone publishes, several rounds
  uint64_t reads = 0;
  for (int r = 0; r < N; ++r) reads += s.world.rank(r).publishedReads();
  CHECK(reads > readsBefore);
  for (int r = 0; r < N; ++r) {
    const loom::DeviceMemoryStats m = s.comms[size_t(r)]->memoryStats();
    CHECK(m.published == 2);               // its send and recv allocations
    CHECK(m.publishedIn == size_t(2 * (N - 1)));  // both of every peer's
  }
  // The same buffers again: nothing new is mapped.
  const int opens = s.mem.opens();
  for (int r = 0; r < N; ++r) issue(s, p, r);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, N) == "");  // the input is unchanged, so is the result (out of place)
  CHECK(s.mem.opens() == opens);
  // In place, odd ranks publishing, avg and max, a count of one round.
  round(true, true, 5000, loomAvg);
  round(true, true, 700, loomMax);
  round(false, true, 3, loomSum);
  // Reduce-scatter reads the peers' send buffers in place too.
  reads = 0;
  for (int r = 0; r < N; ++r) reads += s.world.rank(r).publishedReads();
  round(false, false, 3000, loomSum, Collective::ReduceScatter);
  round(true, true, 3000, loomAvg, Collective::ReduceScatter);
  round(false, false, 3000, loomSum, Collective::AllGather);
  round(true, true, 3000, loomSum, Collective::AllGather);
  round(false, false, 3000, loomSum, Collective::AllToAll);
  round(false, true, 3000, loomSum, Collective::AllToAll);
  round(true, false, 3000, loomSum, Collective::AllToAll);  // in place: nobody publishes, exact
  // Rooted: the side the others read publishes its send buffer only.
  for (Collective rc : {Collective::Broadcast, Collective::Reduce, Collective::Gather, Collective::Scatter}) {
    INFO(loom::collectiveName(rc));
    uint64_t before = 0, after = 0;
    for (int r = 0; r < N; ++r) before += s.world.rank(r).publishedReads();
    round(false, false, 3000, loomSum, rc);
    round(true, false, 3000, loomAvg, rc);
    for (int r = 0; r < N; ++r) after += s.world.rank(r).publishedReads();
    CHECK(after > before);
  }
  uint64_t rsReads = 0;
  for (int r = 0; r < N; ++r) rsReads += s.world.rank(r).publishedReads();
  CHECK(rsReads > reads);
  // Withdrawn while the peers may still be reading it (no synchronisation
  // first, as a deregistration right after the call): withdraw waits for
  // this rank's work, which ends only once the peers are done with its
  // buffers; then they unmap it.  Exact.
  {
    Prepared q = prepare(s, Op{Collective::AllReduce, loomFloat32, loomSum, 40000, 0, false}, rng);
    mayPublish(q, false);
    for (int r = 0; r < N; ++r) issue(s, q, r);
    void* base = nullptr;
    size_t bytes = 0;
    s.mem.range(q.send[0], &base, &bytes);
    const size_t mapped = s.mem.openMappings();
    s.comms[0]->withdraw(base, nullptr);
    CHECK(s.mem.openMappings() == mapped - size_t(N - 1));
    REQUIRE(syncAll(s).empty());
    CHECK(verify(q, N) == "");
  }
  // Unpublish before the free: every peer unmaps it, and it is freed with
  // no mapping left (the fixture checks freedWhileMapped at the end).
  const size_t mappedBefore = s.mem.openMappings();
  void* b = nullptr;
  size_t n = 0;
  s.mem.range(p.send[0], &b, &n);
  unpublishes = 0;
  const size_t publishedBefore = s.comms[0]->memoryStats().published;
  s.comms[0]->unpublish(b);
  CHECK(unpublishes == N - 1);
  CHECK(s.mem.openMappings() == mappedBefore - size_t(N - 1));
  CHECK(s.comms[0]->memoryStats().published == publishedBefore - 1);  // the others are still published
  s.mem.free(b);
  // Destroying the communicators unmaps the rest before the memory goes.
  for (int r = 0; r < N; ++r) s.comms[size_t(r)].reset();
  CHECK(s.mem.openMappings() == 0);
}

TEST_CASE("device communicator (simulated device), zero-copy: a first publish asks every peer at once, a peer "
          "that cannot map it leaves the call staged and exact, and the others unmap it when it goes",
          "[devcomm]") {
  Publishable pub;
  SimComms* self = nullptr;
  std::atomic<int> unpublishes{0};
  const int N = 5;
  loom::DeviceCommOptions opts = zeroCopyOptions(pub, &self, &unpublishes);
  // Each question waits (up to 5 s) until all of its record's questions
  // have arrived: asked at once, they all have, and none waits long.
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    std::map<uint64_t, int> arrived;  // per published record (its base)
    int inFlight = 0, most = 0, late = 0;
    int refuseFromOwner = -1, refusingPeer = -1;
  } gate;
  auto inner = opts.publishTo;
  opts.publishTo = [inner, &gate, N](int peer, const loom::IpcRecord& rec) {
    {
      std::unique_lock<std::mutex> l(gate.mu);
      ++gate.inFlight;
      gate.most = std::max(gate.most, gate.inFlight);
      ++gate.arrived[rec.base];
      gate.cv.notify_all();
      if (!gate.cv.wait_for(l, std::chrono::seconds(5), [&] { return gate.arrived[rec.base] >= N - 1; })) ++gate.late;
      --gate.inFlight;
      if (peer == gate.refusingPeer && int(rec.process - 1000) == gate.refuseFromOwner)
        loom::fail(loomRemoteError, "rank %d cannot map it (the test refuses)", peer);
    }
    return inner(peer, rec);
  };
  SimComms s(N, 1, opts, true, patientDevice());
  self = &s;
  pub.mem = &s.mem;
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  std::mt19937_64 rng(91);
  auto publishAll = [&](const Prepared& p, int only) {
    for (int r = 0; r < N; ++r)
      if (only < 0 || r == only)
        for (const void* q : {static_cast<const void*>(p.send[size_t(r)]), static_cast<const void*>(p.recv[size_t(r)])}) {
          void* b = nullptr;
          size_t n = 0;
          s.mem.range(q, &b, &n);
          pub.add(b);
        }
  };
  // Everyone publishes: every allocation's N - 1 questions were in flight together.
  Prepared p = prepare(s, Op{Collective::AllReduce, loomFloat32, loomSum, 6000, 0, false}, rng);
  publishAll(p, -1);
  for (int r = 0; r < N; ++r) issue(s, p, r);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, N) == "");
  {
    std::lock_guard<std::mutex> l(gate.mu);
    CHECK(gate.most >= N - 1);
    CHECK(gate.late == 0);
    CHECK(gate.arrived.size() == size_t(2 * N));  // send and recv allocations of every rank
  }
  for (int r = 0; r < N; ++r) CHECK(s.comms[size_t(r)]->memoryStats().published == 2);
  // Rank 0's new buffers; rank 3 refuses to map them.  The call is staged
  // for rank 0 and exact; ranks 1, 2 and 4 mapped them all the same.
  {
    std::lock_guard<std::mutex> l(gate.mu);
    gate.refuseFromOwner = 0;
    gate.refusingPeer = 3;
  }
  const size_t mappedBefore = s.mem.openMappings();
  Prepared q = prepare(s, Op{Collective::AllReduce, loomFloat32, loomSum, 6000, 0, false}, rng);
  publishAll(q, 0);
  for (int r = 0; r < N; ++r) issue(s, q, r);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(q, N) == "");
  // The new send allocation is not published (rank 3 has no mapping), so
  // its recv allocation was not even asked for.
  CHECK(s.comms[0]->memoryStats().published == 2);
  CHECK(s.mem.openMappings() == mappedBefore + size_t(N - 2));
  // Unpublishing it asks just the peers that mapped it.
  void* b = nullptr;
  size_t n = 0;
  s.mem.range(q.send[0], &b, &n);
  unpublishes = 0;
  s.comms[0]->unpublish(b);
  CHECK(unpublishes == N - 2);
  CHECK(s.mem.openMappings() == mappedBefore);
  for (int r = 0; r < N; ++r) s.comms[size_t(r)].reset();
  CHECK(s.mem.openMappings() == 0);
}

TEST_CASE("device communicator (simulated device), zero-copy: collectives of every kind, roots, layouts and "
          "publishers mixed back to back with one synchronisation are exact (cells rewritten while slower peers "
          "may still be on the previous program)",
          "[devcomm]") {
  // Every other zero-copy test synchronises after each program; here 16
  // random calls per trial are in flight at once, with and without cells
  // (the threshold), so a cell written before its slot's guard, or a
  // record of what a rank's cells hold that does not match them, shows.
  Publishable pub;
  SimComms* self = nullptr;
  std::atomic<int> unpublishes{0};
  const int N = GENERATE(2, 3, 5);
  const int gpus = GENERATE(1, 2);
  const size_t oneShot = GENERATE(size_t(0), size_t(8192));
  INFO("N=" << N << " gpus=" << gpus << " oneShot=" << oneShot);
  loom::DeviceCommOptions opts = zeroCopyOptions(pub, &self, &unpublishes);
  opts.oneShotBytes = oneShot;
  SimComms s(N, gpus, opts, true, patientDevice());
  self = &s;
  pub.mem = &s.mem;
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  std::mt19937_64 rng(1234 + uint64_t(N) * 10 + uint64_t(gpus) + oneShot);
  const Collective colls[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                              Collective::AllToAll,  Collective::Broadcast,     Collective::Reduce,
                              Collective::Gather,    Collective::Scatter};
  const size_t counts[] = {700, 1500, 3000};
  int wrong = 0;
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<Prepared> ps;
    for (int i = 0; i < 16; ++i) {
      Op o{colls[rng() % 8], loomInt32, loomSum, counts[rng() % 3], int(rng() % uint64_t(N)), bool(rng() % 2)};
      Prepared p = prepare(s, o, rng);
      for (int r = 0; r < N; ++r)
        if (rng() % 3) {  // this rank may publish this call's buffers
          void* b = nullptr;
          size_t n = 0;
          s.mem.range(p.send[size_t(r)], &b, &n);
          pub.add(b);
          s.mem.range(p.recv[size_t(r)], &b, &n);
          pub.add(b);
        }
      ps.push_back(std::move(p));
    }
    for (int r = 0; r < N; ++r)
      for (const Prepared& p : ps) issue(s, p, r);
    const std::string bad = syncAll(s);
    INFO(bad);
    REQUIRE(bad.empty());
    for (const Prepared& p : ps) {
      const std::string why = verify(p, N);
      if (!why.empty() && ++wrong <= 3) FAIL_CHECK(why);
    }
  }
  CHECK(wrong == 0);
  uint64_t reads = 0;
  for (int r = 0; r < N; ++r) reads += s.world.rank(r).publishedReads();
  CHECK(reads > 0);
  for (int r = 0; r < N; ++r) s.comms[size_t(r)].reset();
}

TEST_CASE("loomScale: dst = src * k on the communicator's memory and stream (a CUDA communicator on the simulated "
          "device: enqueued after the stream's earlier work, a device scalar read when it runs, a host one: at the "
          "call or on a loom stream), and bad buffers are clear errors",
          "[devcomm][api][scale]") {
  {
    SimMemory mem;
    loomsim::SimDeviceWorld world(2, 1, 256, patientDevice());
    auto* streamB = reinterpret_cast<loomStream_t>(uintptr_t(0xb0b));
    const int indexB = world.rank(0).addCallerStream(streamB);
    DeviceEnv env(mem, world);
    std::vector<loomComm_t> comms = initCudaComms(2);
    REQUIRE(comms.size() == 2);
    const size_t n = 5000;
    auto* x = reinterpret_cast<float*>(mem.alloc(0, n * 4));
    auto* y = reinterpret_cast<float*>(mem.alloc(0, n * 4));
    auto* kDev = reinterpret_cast<float*>(mem.alloc(0, 64));
    for (size_t i = 0; i < n; ++i) x[i] = -1.0f, y[i] = -1.0f;
    *kDev = 2.0f;
    // Stream B: held, then its kernel writes x; the scale must come after.
    std::atomic<bool> go{false};
    world.rank(0).enqueueWait(indexB, [&go] {
      while (!go.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
    world.rank(0).enqueueWork(indexB, [x, n] {
      for (size_t i = 0; i < n; ++i) x[i] = float(i % 100);
    });
    const float k = 0.25f;
    CHECK(loomScale(y, x, n, loomFloat32, &k, 0, comms[0], streamB) == loomSuccess);
    INFO(loomGetLastError(comms[0]));
    CHECK(loomScale(x, x, n, loomFloat32, kDev, 1, comms[0], streamB) == loomSuccess);  // in place, device scalar
    *kDev = 4.0f;  // read when the work runs: after this
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    go.store(true);
    std::string msg;
    CHECK(world.rank(0).synchronize(&msg) == loomSuccess);
    long wrongY = 0, wrongX = 0;
    for (size_t i = 0; i < n; ++i) {
      wrongY += y[i] != float(i % 100) * 0.25f;
      wrongX += x[i] != float(i % 100) * 4.0f;
    }
    CHECK(wrongY == 0);
    CHECK(wrongX == 0);
    // Errors: host memory, misaligned, overlapping, a host scalar named as
    // on the device, NULLs.
    std::vector<float> host(16);
    CHECK(loomScale(host.data(), x, 16, loomFloat32, &k, 0, comms[0], streamB) == loomInvalidArgument);
    CHECK(std::string(loomGetLastError(comms[0])).find("dst") != std::string::npos);
    CHECK(std::string(loomGetLastError(comms[0])).find("is host memory") != std::string::npos);
    CHECK(loomScale(reinterpret_cast<char*>(y) + 2, x, 16, loomFloat32, &k, 0, comms[0], streamB) ==
          loomInvalidArgument);
    CHECK(std::string(loomGetLastError(comms[0])).find("not aligned") != std::string::npos);
    CHECK(loomScale(x + 1, x, 16, loomFloat32, &k, 0, comms[0], streamB) == loomInvalidArgument);
    CHECK(std::string(loomGetLastError(comms[0])).find("overlap") != std::string::npos);
    CHECK(loomScale(y, x, 16, loomFloat32, &k, 1, comms[0], streamB) == loomInvalidArgument);
    CHECK(std::string(loomGetLastError(comms[0])).find("scalar (on the device)") != std::string::npos);
    CHECK(loomScale(y, x, 16, loomFloat32, nullptr, 0, comms[0], streamB) == loomInvalidArgument);
    CHECK(loomScale(y, x, 16, loomDataType_t(99), &k, 0, comms[0], streamB) == loomInvalidArgument);
    CHECK(loomScale(y, x, 0, loomFloat32, &k, 0, comms[0], streamB) == loomSuccess);
    CHECK(loomScale(y, x, 16, loomFloat32, reinterpret_cast<char*>(kDev) + 2, 1, comms[0], streamB) ==
          loomInvalidArgument);
    CHECK(std::string(loomGetLastError(comms[0])).find("not aligned") != std::string::npos);
    // Inside a group a failed loomScale cancels the group: nothing launched.
    const uint64_t round0 = ipcOf(comms[0]).round();
    REQUIRE(loomGroupStart() == loomSuccess);
    CHECK(loomAllReduce(y, y, 16, loomFloat32, loomSum, comms[0], streamB) == loomSuccess);
    CHECK(loomScale(host.data(), x, 16, loomFloat32, &k, 0, comms[0], streamB) == loomInvalidArgument);
    CHECK(loomGroupEnd() == loomInvalidArgument);
    CHECK(std::string(loomGetLastError(nullptr)).find("loomScale") != std::string::npos);
    CHECK(ipcOf(comms[0]).round() == round0);
    destroyPromptly(comms);
  }
  // A host communicator (one rank).
  loomComm_t h = nullptr;
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  REQUIRE(loomCommInitRank(&h, 1, id, 0) == loomSuccess);
  std::vector<int32_t> a(100), b(100, -1);
  for (int i = 0; i < 100; ++i) a[size_t(i)] = i - 50;
  int32_t k = 3;
  REQUIRE(loomScale(b.data(), a.data(), 100, loomInt32, &k, 0, h, nullptr) == loomSuccess);
  for (int i = 0; i < 100; ++i) CHECK(b[size_t(i)] == (i - 50) * 3);
  loomStream_t s = nullptr;
  REQUIRE(loomStreamCreate(&s) == loomSuccess);
  k = 2;
  REQUIRE(loomScale(a.data(), a.data(), 100, loomInt32, &k, 0, h, s) == loomSuccess);  // k read at the call
  k = 1000;
  REQUIRE(loomStreamSynchronize(s) == loomSuccess);
  // (A scalar read when the work runs, scalarOnDevice, is shown on the
  // simulated device above: on a host stream the test could not change it
  // between the call and the run without racing the stream's thread.)
  int32_t k2 = 5;
  REQUIRE(loomScale(b.data(), b.data(), 100, loomInt32, &k2, 1, h, s) == loomSuccess);
  REQUIRE(loomStreamSynchronize(s) == loomSuccess);
  int wrongA = 0, wrongB = 0;
  for (int i = 0; i < 100; ++i) wrongA += a[size_t(i)] != (i - 50) * 2, wrongB += b[size_t(i)] != (i - 50) * 15;
  CHECK(wrongA == 0);
  CHECK(wrongB == 0);
  CHECK(loomScale(b.data() + 1, b.data(), 10, loomInt32, &k, 0, h, nullptr) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(h)).find("overlap") != std::string::npos);
  CHECK(loomScale(b.data(), a.data(), 10, loomInt32, nullptr, 0, h, nullptr) == loomInvalidArgument);
  CHECK(loomStreamDestroy(s) == loomSuccess);
  CHECK(loomCommDestroy(h) == loomSuccess);
}

namespace {

// The simulated device's capture probe (cudaStreamCapturing) for a test.
struct SimCaptureProbe {
  SimCaptureProbe() { loom::setCudaCaptureProbeForTesting(loomsim::simStreamCapturing); }
  ~SimCaptureProbe() { loom::setCudaCaptureProbeForTesting(nullptr); }
  SimCaptureProbe(const SimCaptureProbe&) = delete;
  SimCaptureProbe& operator=(const SimCaptureProbe&) = delete;
};

// A stream handle per rank to capture on (unique in the process).
struct CaptureStreams {
  std::vector<char> keys;
  explicit CaptureStreams(loomsim::SimDeviceWorld& w) : keys(size_t(w.nranks())) {
    for (int r = 0; r < w.nranks(); ++r) REQUIRE(w.rank(r).addCallerStream(&keys[size_t(r)]) > 0);
  }
  void* operator[](int r) { return &keys[size_t(r)]; }
};

// Every rank's graph of what issue(r, its capture stream) enqueues while
// that stream is captured (one thread: a capture runs nothing).
std::vector<loomsim::SimGraph> captureAll(loomsim::SimDeviceWorld& w, CaptureStreams& cs,
                                          const std::function<void(int, void*)>& issue) {
  std::vector<loomsim::SimGraph> graphs;
  for (int r = 0; r < w.nranks(); ++r) {
    w.rank(r).beginCapture(cs[r]);
    try {
      issue(r, cs[r]);
    } catch (...) {
      w.rank(r).endCapture(cs[r]);
      throw;
    }
    graphs.push_back(w.rank(r).endCapture(cs[r]));
  }
  return graphs;
}

// Rank r's in-place int32 sum all-reduce of x (n elements) on `stream`.
void sumInPlace(SimComms& s, int r, int32_t* x, size_t n, void* stream) {
  loom::OpDesc d;
  d.coll = Collective::AllReduce;
  d.sendbuf = d.recvbuf = x;
  d.count = n;
  d.dtype = loomInt32;
  d.op = loomSum;
  s.comms[size_t(r)]->run(d, stream);
}

void launchAll(loomsim::SimDeviceWorld& w, CaptureStreams& cs, const std::vector<loomsim::SimGraph>& graphs,
               int skip = -1) {
  for (int r = 0; r < w.nranks(); ++r)
    if (r != skip) w.rank(r).launchGraph(cs[r], graphs[size_t(r)]);
}

std::vector<Op> graphOps(int N) {
  std::vector<Op> ops;
  for (size_t c : {size_t(7), size_t(1000)})
    for (bool ip : {false, true}) addEachCollective(&ops, c, ip, N);
  ops.push_back({Collective::AllReduce, loomBfloat16, loomAvg, 3000, 0, false});
  ops.push_back({Collective::AllReduce, loomInt8, loomProd, 513, 0, true});
  ops.push_back({Collective::AllReduce, loomFloat32, loomSum, 0, 0, false});  // count 0: nothing
  return ops;
}

}  // namespace

TEST_CASE("graph lane (simulated device): a captured collective runs nothing at capture, and each replay is exact "
          "with the inputs of its time, N = 1..4, ranks sharing a device and on two, eager calls on another stream "
          "in between",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  std::mt19937_64 rng(31);
  for (int N : {1, 2, 3, 4})
    for (int gpus : {1, 2}) {
      if (gpus > N) continue;
      loom::DeviceCommOptions opts;
      opts.graphSlotBytes = 1024;  // several rounds per call
      opts.oneShotBytes = 512;     // both all-reduce programs
      SimComms s(N, gpus, opts);
      for (const std::string& e : s.initErrors) REQUIRE(e.empty());
      CaptureStreams cs(s.world);
      const std::vector<Op> ops = graphOps(N);
      Prepared eager = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 300, 0, false}, rng);
      uint64_t eagerRounds = 0;
      for (const Op& o : ops) {
        INFO(opName(o, N) << " gpus=" << gpus);
        Prepared p = prepare(s, o, rng);
        std::vector<std::vector<uint8_t>> atCapture;
        for (int r = 0; r < N; ++r) atCapture.emplace_back(p.recv[size_t(r)], p.recv[size_t(r)] + p.recvBytes);
        const std::vector<loomsim::SimGraph> g = captureAll(s.world, cs, [&](int r, void* st) { issue(s, p, r, st); });
        REQUIRE(syncAll(s).empty());
        for (int r = 0; r < N && p.recvBytes > 0; ++r)
          CHECK(memcmp(p.recv[size_t(r)], atCapture[size_t(r)].data(), p.recvBytes) == 0);
        for (int rep = 0; rep < 3; ++rep) {
          Prepared q = rep == 0 ? p : prepare(s, o, rng, &p);  // new values in the captured buffers
          launchAll(s.world, cs, g);
          if (rep == 1) {  // an eager call on the NULL stream, while the replay may run
            for (int r = 0; r < N; ++r) issue(s, eager, r);
            ++eagerRounds;
          }
          const std::string problems = syncAll(s);
          INFO("replay " << rep << ": " << problems);
          REQUIRE(problems.empty());
          CHECK(verify(q, N) == "");
        }
      }
      CHECK(verify(eager, N) == "");  // the same inputs each time, out of place
      for (int r = 0; r < N; ++r) {
        CHECK_FALSE(s.comms[size_t(r)]->failed());
        CHECK(s.comms[size_t(r)]->captured() == ops.size());
        CHECK_FALSE(s.comms[size_t(r)]->replaying());
        if (N > 1) CHECK(s.comms[size_t(r)]->round() > 0);  // the eager calls' rounds alone
      }
      (void)eagerRounds;
    }
}

TEST_CASE("graph lane (simulated device): several calls in one graph and two graphs, launched back to back "
          "without synchronising, every replay counted, also with every zeroing of a signature stalled 120 ms (no "
          "false mismatch while a peer starts its next call)",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  std::mt19937_64 rng(32);
  const int N = 3;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  opts.oneShotBytes = 512;
  loomsim::SimDeviceOptions so;
  if (GENERATE(false, true)) {
    // A rank descheduled just as it zeroes a signature (its busy flag at
    // the end of a call, a peer's at its reset): longer than the
    // watchdog's 50 ms mismatch check, while the peers start their next,
    // different call.
    so.beforeSetFlag = [](uint64_t old, uint64_t value) {
      if (value == 0 && old > (uint64_t(1) << 32) && old < (uint64_t(1) << 61))
        std::this_thread::sleep_for(std::chrono::milliseconds(120));
    };
  }
  SimComms s(N, 1, opts, true, so);
  CaptureStreams cs(s.world);
  Prepared a = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 2000, 0, false}, rng);
  Prepared b = prepare(s, {Collective::AllGather, loomInt32, loomSum, 300, 0, false}, rng);
  Prepared c = prepare(s, {Collective::Broadcast, loomUint8, loomSum, 5000, 1, false}, rng);
  // In place: each replay sums again, so the result counts the replays.
  const size_t n = 700;
  std::vector<int32_t*> x(N);
  for (int r = 0; r < N; ++r) {
    x[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(0, n * 4));
    for (size_t i = 0; i < n; ++i) x[size_t(r)][i] = int32_t(i) + r;
  }
  const auto g1 = captureAll(s.world, cs, [&](int r, void* st) {
    issue(s, a, r, st);
    issue(s, b, r, st);
    issue(s, c, r, st);
  });
  const auto g2 = captureAll(s.world, cs, [&](int r, void* st) { sumInPlace(s, r, x[size_t(r)], n, st); });
  for (int k = 0; k < 3; ++k) {
    launchAll(s.world, cs, g1);
    launchAll(s.world, cs, g2);
  }
  REQUIRE(syncAll(s).empty());
  CHECK(verify(a, N) == "");
  CHECK(verify(b, N) == "");
  CHECK(verify(c, N) == "");
  // After one all-reduce every rank holds S(i) = 3i + 3; each next one
  // multiplies by N.
  long wrong = 0;
  for (int r = 0; r < N; ++r)
    for (size_t i = 0; i < n; ++i) wrong += x[size_t(r)][i] != (3 * int32_t(i) + 3) * N * N;
  CHECK(wrong == 0);
  for (int r = 0; r < N; ++r) CHECK(s.comms[size_t(r)]->round() == 0);  // no eager round was used
}

TEST_CASE("graph lane (simulated device): a dead rank during a replay fails the others naming it and their "
          "replays end, and a rank that does not launch its graph is a timeout, and later launches end too",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;  // a wait still pending then was never released
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  opts.drainTimeoutMs = 200;
  opts.probeAfterMs = 50;
  loomsim::SimDeviceWorld* world = nullptr;
  bool dead = GENERATE(true, false);
  INFO((dead ? "rank 2 dies" : "rank 2 does not launch"));
  if (dead) {
    opts.peerGone = [&world](int peer, std::string* why) {
      if (!world || !world->dead(peer)) return false;
      *why = "its control socket refuses";
      return true;
    };
  } else {
    opts.timeoutMs = 300;
  }
  SimComms s(3, 1, opts, true, so);
  world = &s.world;
  CaptureStreams cs(s.world);
  std::mt19937_64 rng(33);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
  const auto g = captureAll(s.world, cs, [&](int r, void* st) { issue(s, p, r, st); });
  launchAll(s.world, cs, g);
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, 3) == "");
  if (dead) s.world.kill(2);
  launchAll(s.world, cs, g, 2);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // released, not failed by the device
    INFO(msg);
    std::string why;
    CHECK(s.comms[size_t(r)]->failure(&why) == (dead ? loomRemoteError : loomTimeout));
    INFO(why);
    CHECK(why.find(dead ? "rank 2 is gone (its control socket refuses)" : "replay of a captured call") !=
          std::string::npos);
    if (!dead) CHECK(why.find("wait for rank 2") != std::string::npos);
  }
  // The communicator is failed for good, but a graph launched now still
  // ends (released while it runs), and eager calls are refused.
  launchAll(s.world, cs, g, 2);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);
    CHECK_FALSE(s.comms[size_t(r)]->replaying());
    loom::OpDesc d;
    d.coll = Collective::AllReduce;
    d.sendbuf = p.send[size_t(r)];
    d.recvbuf = p.recv[size_t(r)];
    d.count = 10;
    d.dtype = loomFloat32;
    CHECK_THROWS_AS(s.comms[size_t(r)]->run(d, nullptr), loom::Error);
    CHECK_THROWS_AS(s.comms[size_t(r)]->run(d, cs[r]), loom::Error);
  }
  if (!dead) s.comms[2]->markFailed(loomRemoteError, "the test's");  // its peers failed: it would too
}

TEST_CASE("graph lane (simulated device): a communicator without a graph lane refuses a capture, one whose graph "
          "window cannot hold a send/recv region per rank refuses captured sends, and an error while capturing "
          "leaves the communicator healthy",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  std::mt19937_64 rng(34);
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  SimComms s(2, 1, opts);
  CaptureStreams cs(s.world);
  Prepared p = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 500, 0, false}, rng);
  loom::OpDesc send;
  send.coll = Collective::P2P;
  send.isSend = true;
  send.peer = 1;
  send.sendbuf = p.send[0];
  send.count = 10;
  send.dtype = loomInt32;
  s.world.rank(0).beginCapture(cs[0]);
  // A launch that fails while capturing: the call fails, the communicator does not.
  s.drivers[0]->failLaunch.store(true);
  CHECK_THROWS_AS(issue(s, p, 0, cs[0]), loom::Error);
  CHECK_THROWS_AS(s.comms[0]->runP2P({send}, cs[0]), loom::Error);
  s.drivers[0]->failLaunch.store(false);
  s.world.rank(0).endCapture(cs[0]);
  CHECK_FALSE(s.comms[0]->failed());
  CHECK(s.comms[0]->captured() == 0);
  for (int r = 0; r < 2; ++r) issue(s, p, r);  // eager, on the NULL stream
  REQUIRE(syncAll(s).empty());
  CHECK(verify(p, 2) == "");

  loom::DeviceCommOptions none;
  none.graphSlotBytes = 0;
  SimComms t(1, 1, none);
  CaptureStreams ct(t.world);
  Prepared q = prepare(t, {Collective::AllReduce, loomInt32, loomSum, 5, 0, false}, rng);
  t.world.rank(0).beginCapture(ct[0]);
  try {
    issue(t, q, 0, ct[0]);
    FAIL("a capture without a graph lane was taken");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomInvalidUsage);
    CHECK(std::string(e.what()).find("LOOM_DEVICE_GRAPH_SLOT_BYTES=0") != std::string::npos);
  }
  t.world.rank(0).endCapture(ct[0]);
  CHECK(t.comms[0]->memoryStats().blockBytes < s.comms[0]->memoryStats().blockBytes);

  // Graph slots of 256 B and 3 ranks: 512 B of window, no 256 B region each.
  loom::DeviceCommOptions tiny;
  tiny.graphSlotBytes = 256;
  SimComms u(3, 1, tiny);
  CaptureStreams cu(u.world);
  send.sendbuf = u.mem.alloc(0, 64);
  u.world.rank(0).beginCapture(cu[0]);
  try {
    u.comms[0]->runP2P({send}, cu[0]);
    FAIL("a send without room for its region was taken");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomInvalidUsage);
    CHECK(std::string(e.what()).find("too small to give each of its 3 ranks a send/recv region") !=
          std::string::npos);
  }
  u.world.rank(0).endCapture(cu[0]);
  CHECK_FALSE(u.comms[0]->failed());
  CHECK(u.comms[0]->captured() == 0);
}

TEST_CASE("graph lane (simulated device): graphs of one-round calls whose ranks wait for nobody (a broadcast root, "
          "a scatter root, gather senders) launched 40 times back to back without synchronising, N = 2..8",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  std::mt19937_64 rng(35);
  for (int N = 2; N <= 8; ++N) {
    INFO("N=" << N);
    loom::DeviceCommOptions opts;
    opts.graphSlotBytes = 4096;  // each call one round
    SimComms s(N, N % 2 + 1, opts);
    CaptureStreams cs(s.world);
    Prepared b = prepare(s, {Collective::Broadcast, loomInt32, loomSum, 100, 0, false}, rng);
    Prepared sc = prepare(s, {Collective::Scatter, loomUint8, loomSum, 30, N - 1, false}, rng);
    Prepared ga = prepare(s, {Collective::Gather, loomFloat16, loomSum, 50, N / 2, false}, rng);
    // In place, so that the count of replays shows in the result.
    std::vector<int32_t*> x(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      x[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(r % s.gpus, 64));
      for (int i = 0; i < 16; ++i) x[size_t(r)][i] = r == 0 ? 1 : 0;
    }
    const auto g = captureAll(s.world, cs, [&](int r, void* st) {
      issue(s, b, r, st);
      issue(s, sc, r, st);
      issue(s, ga, r, st);
      sumInPlace(s, r, x[size_t(r)], 16, st);
    });
    const int launches = 40;
    for (int k = 0; k < launches; ++k) launchAll(s.world, cs, g);
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    CHECK(verify(b, N) == "");
    CHECK(verify(sc, N) == "");
    CHECK(verify(ga, N) == "");
    // 1 on rank 0 and 0 elsewhere, summed 40 times: N^39 (int32 wraps alike everywhere).
    uint32_t want = 1;
    for (int k = 1; k < launches; ++k) want *= uint32_t(N);
    long wrong = 0;
    for (int r = 0; r < N; ++r)
      for (int i = 0; i < 16; ++i) wrong += uint32_t(x[size_t(r)][i]) != want;
    CHECK(wrong == 0);
  }
}

TEST_CASE("graph lane (simulated device): destroying ranks whose replay waits for a rank that never launched its "
          "graph releases the replay, and the memory stays while the graphs exist (a replay after every destroy is "
          "released too), freed once they are destroyed",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  opts.drainTimeoutMs = 200;
  SimComms s(3, 1, opts, true, so);
  CaptureStreams cs(s.world);
  std::mt19937_64 rng(36);
  Prepared p = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
  auto g = captureAll(s.world, cs, [&](int r, void* st) { issue(s, p, r, st); });
  launchAll(s.world, cs, g, 2);  // rank 2 never launches
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(s.comms[0]->replaying());
  CHECK(s.comms[1]->replaying());
  const size_t frees = s.mem.frees();
  s.comms[0].reset();  // healthy, no timeout: the drain gives up after 200 ms, the replay is released
  s.comms[1].reset();
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // released, not a sim timeout
    INFO(msg);
  }
  s.comms[2].reset();  // the last mapper of ranks 0 and 1's memory
  // The graphs that captured the calls still hold every rank's memory: a
  // replay launched now (after every destroy) is released, not run on
  // freed memory, and nothing is freed until the graphs go.
  CHECK_FALSE(loom::waitDeviceRemains(300));
  CHECK(s.mem.frees() == frees);
  launchAll(s.world, cs, g);
  for (int r = 0; r < 3; ++r) {
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);
    INFO(msg);
  }
  // One rank alone: nothing but the remains' release can end its waits.
  s.world.rank(0).launchGraph(cs[0], g[0]);
  std::string msg0;
  CHECK(s.world.rank(0).synchronize(&msg0) == loomSuccess);
  INFO(msg0);
  CHECK(s.mem.frees() == frees);
  g.clear();  // the graphs (and their user objects) are destroyed
  CHECK(loom::waitDeviceRemains(10000));
  CHECK(s.mem.frees() >= frees + 3);  // every rank's block
}

TEST_CASE("graph lane (simulated device): ranks whose captured calls differ (count, type, op, collective, an empty "
          "call) fail "
          "with loomInvalidUsage naming the mismatch, and their replays are released (the outputs are then undefined, "
          "as after any failure)",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;  // a wait still pending then was never released
  struct Variant {
    const char* what;
    Op other;  // rank 1's call; rank 0 and 2 capture an all-reduce of 1000 float32
  };
  const Variant variants[] = {
      {"count", {Collective::AllReduce, loomFloat32, loomSum, 1001, 0, false}},
      {"type", {Collective::AllReduce, loomInt32, loomSum, 1000, 0, false}},
      {"op", {Collective::AllReduce, loomFloat32, loomMax, 1000, 0, false}},
      {"collective", {Collective::Broadcast, loomFloat32, loomSum, 1000, 0, false}},
      {"count 0", {Collective::AllReduce, loomFloat32, loomSum, 0, 0, false}},
  };
  for (const Variant& v : variants) {
    INFO(v.what);
    loom::DeviceCommOptions opts;
    opts.graphSlotBytes = 1024;
    opts.drainTimeoutMs = 200;
    // A failure is passed on to the other ranks, as the communicator's
    // control plane does (a Fail notice): the released ranks' programs
    // write flags that let a rank that passed the gate run on, and it
    // must not finish as if nothing happened.
    std::atomic<SimComms*> peers{nullptr};
    opts.onFailure = [&peers](const loom::Error& e) {
      if (SimComms* sc = peers.load())
        for (auto& c : sc->comms)
          if (c) c->markFailed(e.code(), loom::strf("a peer failed: %s", e.what()));
    };
    SimComms s(3, 1, opts, true, so);
    peers.store(&s);
    struct Unhook {
      std::atomic<SimComms*>& p;
      ~Unhook() { p.store(nullptr); }
    } unhook{peers};
    CaptureStreams cs(s.world);
    std::mt19937_64 rng(37);
    Prepared mine = prepare(s, {Collective::AllReduce, loomFloat32, loomSum, 1000, 0, false}, rng);
    Prepared other = prepare(s, v.other, rng);
    const auto g = captureAll(s.world, cs, [&](int r, void* st) { issue(s, r == 1 ? other : mine, r, st); });
    launchAll(s.world, cs, g);
    for (int r = 0; r < 3; ++r) {
      std::string msg;
      CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // released by the failure, not hung
      INFO(msg);
    }
    int named = 0;
    for (int r = 0; r < 3; ++r) {
      std::string why;
      const loomResult_t code = s.comms[size_t(r)]->failure(&why);
      INFO("rank " << r << ": " << why);
      // Without a control plane here a rank's failure is not passed on:
      // each rank that saw a differing signature fails by itself.
      if (code == loomSuccess) continue;
      CHECK(code == loomInvalidUsage);
      CHECK(why.find("mismatched captured calls") != std::string::npos);
      ++named;
    }
    CHECK(named == 3);  // each by itself or told by a peer
  }
}

namespace {

// A message of a send/recv test: `in` on the sender's device, `out` on
// the receiver's; the receive is right when out holds in's bytes.
struct Message {
  int from, to;
  size_t count;
  loomDataType_t type;
  uint8_t* in;
  uint8_t* out;
  size_t bytes() const { return count * loom::dtypeSize(type); }
};

// Adds message from -> to to both ranks' group (the sender's send, the
// receiver's receive) and to *all.
void addMessage(SimComms& s, std::mt19937_64& rng, int from, int to, size_t count, loomDataType_t t,
                std::vector<std::vector<P2POp>>* groups, std::vector<Message>* all) {
  const size_t esz = loom::dtypeSize(t);
  Message m{from, to, count, t, s.mem.alloc(from % s.gpus, count * esz + 8), s.mem.alloc(to % s.gpus, count * esz + 8)};
  fillRandom(m.in, count, t, rng);
  fillRandom(m.out, count, t, rng);
  (*groups)[size_t(from)].push_back({true, to, count, t, m.in, {}});
  (*groups)[size_t(to)].push_back({false, from, count, t, m.out, {}});
  all->push_back(m);
}

void runGroup(SimComms& s, int r, const std::vector<P2POp>& group, void* stream) {
  std::vector<loom::OpDesc> ds;
  for (const P2POp& o : group) ds.push_back(p2pDesc(o));
  s.comms[size_t(r)]->runP2P(ds, stream);
}

// Flags a replay left behind on any rank: every graph flag must be 0
// between replays, but a rank's own `reset` (set by its last collective).
std::string graphFlagsLeft(SimComms& s) {
  std::string left;
  for (int r = 0; r < int(s.comms.size()); ++r) {
    const std::vector<uint64_t> f = s.comms[size_t(r)]->graphFlags();
    for (size_t i = 0; i < f.size(); ++i) {
      const int row = int(i / loom::kFlagCount), flag = int(i % loom::kFlagCount);
      if (f[i] != 0 && !(row == r && flag == loom::kFlagGraphReset))
        left += loom::strf("rank %d: row %d flag %d = %llu; ", r, row, flag, (unsigned long long)f[i]);
    }
  }
  return left;
}

// Each rank runs its group eagerly (the NULL stream) from a thread of its
// own, as ranks of separate processes would; every rank's error, if any.
std::vector<std::string> runGroupsEagerly(SimComms& s, const std::vector<std::vector<P2POp>>& groups) {
  std::vector<std::string> errors(groups.size());
  std::vector<std::thread> ts;
  for (size_t r = 0; r < groups.size(); ++r)
    ts.emplace_back([&, r] {
      try {
        runGroup(s, int(r), groups[r], nullptr);
      } catch (const loom::Error& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : ts) t.join();
  return errors;
}

long wrongMessages(const std::vector<Message>& ms) {
  long wrong = 0;
  for (const Message& m : ms)
    if (m.bytes() && memcmp(m.out, m.in, m.bytes()) != 0 && ++wrong <= 3)
      FAIL_CHECK("message " << m.from << " -> " << m.to << " (" << m.count << " x " << loom::dtypeName(m.type)
                            << ") wrong");
  return wrong;
}

}  // namespace

TEST_CASE("graph lane (simulated device): captured sends and receives (a ring, every pair both ways with uneven "
          "sizes and self-sends, a send alone) run nothing at capture and are exact in every replay with new inputs, "
          "N = 1..5, ranks sharing a device and on two, beside a captured collective, with eager send/recv between "
          "the same ranks during a replay",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  for (int N = 1; N <= 5; ++N)
    for (int gpus : {1, 2}) {
      if (gpus > N) continue;
      INFO("N=" << N << " gpus=" << gpus);
      loom::DeviceCommOptions opts;
      opts.slotBytes = 1024;
      opts.graphSlotBytes = 2048;  // regions of 4096 / N bytes (256-byte multiples): most messages take several
      opts.oneShotBytes = 512;
      SimComms s(N, gpus, opts);
      for (const std::string& e : s.initErrors) REQUIRE(e.empty());
      CaptureStreams cs(s.world);
      std::mt19937_64 rng(uint64_t(400 + N * 10 + gpus));
      std::vector<Message> captured, eager;
      std::vector<std::vector<P2POp>> ring(static_cast<size_t>(N)), pairs(static_cast<size_t>(N)),
          alone(static_cast<size_t>(N)), eagerRing(static_cast<size_t>(N));
      for (int r = 0; r < N; ++r)
        addMessage(s, rng, r, (r + 1) % N, messageCount(r, (r + 1) % N, 3, 0) * 3, loomFloat16, &ring, &captured);
      for (int from = 0; from < N; ++from)
        for (int to = 0; to < N; ++to)
          addMessage(s, rng, from, to, messageCount(from, to, 1, 1), loomInt32, &pairs, &captured);
      if (N > 1) addMessage(s, rng, N - 1, 0, 3000, loomUint8, &alone, &captured);  // the others have no part
      for (int r = 0; r < N; ++r)
        addMessage(s, rng, r, (r + N - 1) % N, 900, loomFloat64, &eagerRing, &eager);
      Prepared coll = prepare(s, {Collective::AllReduce, loomInt32, loomSum, 1500, 0, false}, rng);
      std::vector<std::vector<uint8_t>> before;
      for (const Message& m : captured) before.emplace_back(m.out, m.out + m.bytes());
      const auto g = captureAll(s.world, cs, [&](int r, void* st) {
        runGroup(s, r, ring[size_t(r)], st);
        issue(s, coll, r, st);
        runGroup(s, r, pairs[size_t(r)], st);
        runGroup(s, r, alone[size_t(r)], st);
      });
      REQUIRE(syncAll(s).empty());
      long ranAtCapture = 0;
      for (size_t i = 0; i < captured.size(); ++i)
        ranAtCapture += !before[i].empty() && memcmp(captured[i].out, before[i].data(), before[i].size()) != 0;
      CHECK(ranAtCapture == 0);
      for (int rep = 0; rep < 3; ++rep) {
        INFO("replay " << rep);
        Prepared q = rep == 0 ? coll : prepare(s, {Collective::AllReduce, loomInt32, loomSum, 1500, 0, false}, rng,
                                               &coll);
        for (const Message& m : captured) fillRandom(m.in, m.count, m.type, rng);
        launchAll(s.world, cs, g);
        if (rep == 1)  // eager sends and receives on the NULL stream, while the replay may run
          for (const std::string& e : runGroupsEagerly(s, eagerRing)) CHECK(e.empty());
        const std::string problems = syncAll(s);
        INFO(problems);
        REQUIRE(problems.empty());
        CHECK(wrongMessages(captured) == 0);
        CHECK(verify(q, N) == "");
        CHECK(graphFlagsLeft(s) == "");
      }
      CHECK(wrongMessages(eager) == 0);
      for (int r = 0; r < N; ++r) {
        CHECK_FALSE(s.comms[size_t(r)]->failed());
        CHECK(s.comms[size_t(r)]->captured() == 4);
        CHECK_FALSE(s.comms[size_t(r)]->replaying());
        CHECK(s.comms[size_t(r)]->round() == 0);  // no eager collective
      }
    }
}

TEST_CASE("graph lane (simulated device): a graph of an in-place all-reduce, captured sends (a ring twice in a "
          "row, and one pair alone while the other ranks go on to the next collective) and an all-gather launched 16 times back to "
          "back without synchronising, N = 2..6, also with the zeroing of the send/recv flags stalled now and then",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  const bool stall = GENERATE(false, true);
  INFO((stall ? "stalled zeroing" : "no stalls"));
  for (int N = 2; N <= 6; ++N) {
    INFO("N=" << N);
    loom::DeviceCommOptions opts;
    opts.graphSlotBytes = 1024;
    loomsim::SimDeviceOptions so;
    if (stall) {
      // A rank descheduled as it zeroes a per-pair count (a value below
      // 2^32 set to 0), one zeroing in three, while its peers go on.
      auto count = std::make_shared<std::atomic<int>>(0);
      so.beforeSetFlag = [count](uint64_t old, uint64_t value) {
        if (value == 0 && old > 0 && old < (uint64_t(1) << 32) && count->fetch_add(1) % 3 == 0)
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
      };
    }
    SimComms s(N, N % 2 + 1, opts, true, so);
    CaptureStreams cs(s.world);
    const size_t n = 300;  // 1200 bytes: several chunks of the 2048 / N byte regions
    std::vector<int32_t*> x(static_cast<size_t>(N)), y(static_cast<size_t>(N)), z(static_cast<size_t>(N)),
        w(static_cast<size_t>(N)), all(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      const int dev = r % s.gpus;
      x[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(dev, n * 4));
      y[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(dev, n * 4));
      z[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(dev, n * 4));
      w[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(dev, n * 4));
      all[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(dev, size_t(N) * n * 4));
      for (size_t i = 0; i < n; ++i) x[size_t(r)][i] = r == 0 ? int32_t(i) + 1 : 0, y[size_t(r)][i] = -1;
      for (size_t i = 0; i < n; ++i) z[size_t(r)][i] = -1;
    }
    const auto g = captureAll(s.world, cs, [&](int r, void* st) {
      sumInPlace(s, r, x[size_t(r)], n, st);
      // x to the next rank, into y from the previous.
      runGroup(s, r, {{true, (r + 1) % N, n, loomInt32, reinterpret_cast<uint8_t*>(x[size_t(r)]), {}},
                      {false, (r + N - 1) % N, n, loomInt32, reinterpret_cast<uint8_t*>(y[size_t(r)]), {}}},
               st);
      // Again at once, y into w: each sender's next call to the same receiver.
      runGroup(s, r, {{true, (r + 1) % N, n, loomInt32, reinterpret_cast<uint8_t*>(y[size_t(r)]), {}},
                      {false, (r + N - 1) % N, n, loomInt32, reinterpret_cast<uint8_t*>(w[size_t(r)]), {}}},
               st);
      // Rank 0's y to the last rank's z; the others have no part and run on.
      if (r == 0) runGroup(s, r, {{true, N - 1, n, loomInt32, reinterpret_cast<uint8_t*>(y[0]), {}}}, st);
      if (r == N - 1) runGroup(s, r, {{false, 0, n, loomInt32, reinterpret_cast<uint8_t*>(z[size_t(r)]), {}}}, st);
      loom::OpDesc d;
      d.coll = Collective::AllGather;
      d.sendbuf = y[size_t(r)];
      d.recvbuf = all[size_t(r)];
      d.count = n;
      d.dtype = loomInt32;
      s.comms[size_t(r)]->run(d, st);
    });
    const int launches = 16;
    for (int k = 0; k < launches; ++k) launchAll(s.world, cs, g);
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    // The first all-reduce gives every rank i + 1, each next one multiplies
    // by N: (i + 1) N^15 (int32 wraps alike everywhere, and not to 0 for
    // N <= 6); y, w, z and every block of the all-gather got that too.
    uint32_t scale = 1;
    for (int k = 1; k < launches; ++k) scale *= uint32_t(N);
    long wrong = 0;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i) {
        const uint32_t want = uint32_t(i + 1) * scale;
        wrong += uint32_t(x[size_t(r)][i]) != want;
        wrong += uint32_t(y[size_t(r)][i]) != want;
        wrong += uint32_t(w[size_t(r)][i]) != want;
        if (r == N - 1) wrong += uint32_t(z[size_t(r)][i]) != want;
        for (int q = 0; q < N; ++q) wrong += uint32_t(all[size_t(r)][size_t(q) * n + i]) != want;
      }
    CHECK(wrong == 0);
    CHECK(graphFlagsLeft(s) == "");
    for (int r = 0; r < N; ++r) {
      CHECK_FALSE(s.comms[size_t(r)]->failed());
      CHECK_FALSE(s.comms[size_t(r)]->replaying());
    }
  }
}

TEST_CASE("send/recv groups with several members per pair (3 and 5 both ways, one of them empty, a ring of 3 per "
          "neighbour, 3 self-sends) finish and are exact, eager and captured, and captured ones back to back leave "
          "no flag behind",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  const bool graph = GENERATE(false, true);
  INFO((graph ? "captured" : "eager"));
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 10000;  // a wait on a cycle fails the test instead of hanging it
  for (int pattern = 0; pattern < 4; ++pattern) {
    INFO("pattern " << pattern);
    const int N = pattern == 2 ? 3 : pattern == 3 ? 1 : 2;
    loom::DeviceCommOptions opts;
    opts.slotBytes = 1024;
    opts.graphSlotBytes = 1024;
    SimComms s(N, 1, opts, true, so);
    CaptureStreams cs(s.world);
    std::mt19937_64 rng(uint64_t(500 + pattern));
    std::vector<Message> all;
    std::vector<std::vector<P2POp>> groups(static_cast<size_t>(N));
    auto add = [&](int from, int to, size_t count) { addMessage(s, rng, from, to, count, loomInt32, &groups, &all); };
    if (pattern <= 1)
      for (int k = 0; k < (pattern == 0 ? 3 : 5); ++k) {
        add(0, 1, k == 1 ? 0 : 100 + 90 * size_t(k));  // one chunk of 512 B, then several
        add(1, 0, 300 - 50 * size_t(k));
      }
    if (pattern == 2)
      for (int r = 0; r < N; ++r)
        for (int k = 0; k < 3; ++k) add(r, (r + 1) % N, 10 + 100 * size_t(k));
    if (pattern == 3)
      for (int k = 0; k < 3; ++k) add(0, 0, 100 + 200 * size_t(k));
    const int launches = graph ? 4 : 1;
    if (graph) {
      const auto g = captureAll(s.world, cs, [&](int r, void* st) { runGroup(s, r, groups[size_t(r)], st); });
      for (int k = 0; k < launches; ++k) {
        for (const Message& m : all) fillRandom(m.in, m.count, m.type, rng);
        launchAll(s.world, cs, g);
        const std::string problems = syncAll(s);
        INFO("launch " << k << ": " << problems);
        REQUIRE(problems.empty());
        CHECK(wrongMessages(all) == 0);
        CHECK(graphFlagsLeft(s) == "");
      }
    } else {
      for (const std::string& e : runGroupsEagerly(s, groups)) CHECK(e.empty());
      const std::string problems = syncAll(s);
      INFO(problems);
      REQUIRE(problems.empty());
      CHECK(wrongMessages(all) == 0);
    }
    for (int r = 0; r < N; ++r) CHECK_FALSE(s.comms[size_t(r)]->failed());
  }
}

TEST_CASE("graph lane (simulated device): captured groups with two messages per pair (and an empty one between) "
          "after an in-place all-reduce, there and back, launched 12 times back to back, N = 2..4",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  for (int N = 2; N <= 4; ++N) {
    INFO("N=" << N);
    loom::DeviceCommOptions opts;
    opts.graphSlotBytes = 1024;
    SimComms s(N, 1, opts, true);
    CaptureStreams cs(s.world);
    const size_t n = 300, a = 110;  // parts of 440 and 760 bytes: one and several chunks
    std::vector<int32_t*> x(static_cast<size_t>(N)), y(static_cast<size_t>(N)), z(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      x[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(0, n * 4));
      y[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(0, n * 4));
      z[size_t(r)] = reinterpret_cast<int32_t*>(s.mem.alloc(0, n * 4));
      for (size_t i = 0; i < n; ++i) x[size_t(r)][i] = r == 0 ? int32_t(i) + 1 : 0, y[size_t(r)][i] = z[size_t(r)][i] = -1;
    }
    auto bytes = [](int32_t* p) { return reinterpret_cast<uint8_t*>(p); };
    const auto g = captureAll(s.world, cs, [&](int r, void* st) {
      sumInPlace(s, r, x[size_t(r)], n, st);
      const int next = (r + 1) % N, prev = (r + N - 1) % N;
      int32_t *xr = x[size_t(r)], *yr = y[size_t(r)], *zr = z[size_t(r)];
      // x to the next rank in two parts, an empty message between.
      runGroup(s, r, {{true, next, a, loomInt32, bytes(xr), {}}, {true, next, 0, loomInt32, bytes(xr), {}},
                      {true, next, n - a, loomInt32, bytes(xr + a), {}}, {false, prev, a, loomInt32, bytes(yr), {}},
                      {false, prev, 0, loomInt32, bytes(yr), {}}, {false, prev, n - a, loomInt32, bytes(yr + a), {}}},
               st);
      // And back: y to the previous rank, into z.
      runGroup(s, r, {{true, prev, a, loomInt32, bytes(yr), {}}, {true, prev, n - a, loomInt32, bytes(yr + a), {}},
                      {false, next, a, loomInt32, bytes(zr), {}}, {false, next, n - a, loomInt32, bytes(zr + a), {}}},
               st);
    });
    const int launches = 12;
    for (int k = 0; k < launches; ++k) launchAll(s.world, cs, g);
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    uint32_t scale = 1;
    for (int k = 1; k < launches; ++k) scale *= uint32_t(N);
    long wrong = 0;
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i) {
        const uint32_t want = uint32_t(i + 1) * scale;
        wrong += uint32_t(y[size_t(r)][i]) != want;
        wrong += uint32_t(z[size_t(r)][i]) != want;
      }
    CHECK(wrong == 0);
    CHECK(graphFlagsLeft(s) == "");
    for (int r = 0; r < N; ++r) CHECK_FALSE(s.comms[size_t(r)]->failed());
  }
}

TEST_CASE("graph lane (simulated device): a captured send whose receiver never launches is loomTimeout naming the "
          "partner, and the replays end (released)",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  opts.timeoutMs = 300;
  opts.drainTimeoutMs = 200;
  SimComms s(3, 1, opts, true, so);
  CaptureStreams cs(s.world);
  const size_t n = 2000;  // 2 KB through regions of 512 B: the sender waits for acks
  uint8_t* a = s.mem.alloc(0, n);
  uint8_t* b = s.mem.alloc(0, n);
  const auto g = captureAll(s.world, cs, [&](int r, void* st) {
    if (r == 0) runGroup(s, r, {{true, 1, n, loomUint8, a, {}}}, st);
    if (r == 1) runGroup(s, r, {{false, 0, n, loomUint8, b, {}}}, st);
  });
  launchAll(s.world, cs, g, 1);
  std::string msg;
  CHECK(s.world.rank(0).synchronize(&msg) == loomSuccess);  // released, not failed by the device
  INFO(msg);
  std::string why;
  CHECK(s.comms[0]->failure(&why) == loomTimeout);
  INFO(why);
  CHECK(why.find("replays a send/recv group (sends to 1)") != std::string::npos);
  CHECK(why.find("wait for one of its partners (rank 1)") != std::string::npos);
  CHECK_FALSE(s.comms[0]->replaying());
  CHECK_FALSE(s.comms[2]->failed());  // no part in it
  s.comms[1]->markFailed(loomRemoteError, "the test's");  // its peer failed: it would too
}

TEST_CASE("graph lane (simulated device): a captured receive of another size than its send (fewer chunks, as many "
          "chunks, the same bytes in other messages) stops at the receiver's size gate, which fails with "
          "loomInvalidUsage naming both sides long before LOOM_TIMEOUT_MS, and the replays end (released)",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;  // regions of 512 B
  opts.timeoutMs = 20000;      // the gate must find it, not the timeout
  opts.drainTimeoutMs = 200;
  SimComms s(3, 1, opts, true, so);
  CaptureStreams cs(s.world);
  struct Case {
    const char* name;
    std::vector<size_t> sends, recvs;
    const char* theirs;
    const char* mine;
  };
  const Case c = GENERATE(Case{"fewer chunks", {2000}, {1400}, "2000 bytes in all", "one message of 1400 bytes"},
                          Case{"as many chunks", {100}, {200}, "100 bytes in all", "one message of 200 bytes"},
                          Case{"other messages", {100, 200}, {200, 100}, "other messages of the same 300 bytes in all",
                               "2 messages, 300 bytes in all"});
  INFO(c.name);
  std::vector<P2POp> send, recv;
  for (size_t n : c.sends) send.push_back({true, 1, n, loomUint8, s.mem.alloc(0, n), {}});
  for (size_t n : c.recvs) recv.push_back({false, 0, n, loomUint8, s.mem.alloc(0, n), {}});
  const auto g = captureAll(s.world, cs, [&](int r, void* st) {
    if (r == 0) runGroup(s, r, send, st);
    if (r == 1) runGroup(s, r, recv, st);
  });
  const int64_t t0 = loom::nowMs();
  launchAll(s.world, cs, g);
  std::string msg;
  CHECK(s.world.rank(1).synchronize(&msg) == loomSuccess);  // released, not failed by the device
  std::string why;
  CHECK(s.comms[1]->failure(&why) == loomInvalidUsage);
  INFO(why);
  CHECK(why.find(loom::strf("rank 1: mismatched captured send/recv (CUDA graph replays): rank 0's sends to this rank "
                            "in the call it replays are %s, but this rank replays a send/recv group (receives from 0) "
                            "whose receives from it are %s",
                            c.theirs, c.mine)) != std::string::npos);
  CHECK(loom::nowMs() - t0 < 10000);
  CHECK_FALSE(s.comms[1]->replaying());
  CHECK_FALSE(s.comms[0]->failed());  // rank 1's failure reaches it through its communicator (not here)
  CHECK_FALSE(s.comms[2]->failed());
  s.comms[0]->markFailed(loomRemoteError, "the test's");  // as its communicator would hear it
  CHECK(s.world.rank(0).synchronize(&msg) == loomSuccess);
}

TEST_CASE("graph lane (simulated device): the size gate never trips on matching replays: two captured calls of one "
          "pair with other sizes in turn, one of the senders launching late, exact every time",
          "[devcomm][graph]") {
  const int late = GENERATE(0, 2);
  INFO("rank " << late << " launches late");
  SimCaptureProbe probe;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;  // regions of 512 B: 3000 B take several chunks
  opts.timeoutMs = 20000;
  SimComms s(3, 1, opts);
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  CaptureStreams cs(s.world);
  std::mt19937_64 rng(77);
  // Call 1: ranks 0 and 2 send 100 B each to rank 1.  Call 2: rank 0 sends
  // 3000 B to rank 1 (rank 2 captures nothing).
  std::vector<std::vector<P2POp>> one(3), two(3);
  std::vector<Message> first, second;
  addMessage(s, rng, 0, 1, 100, loomUint8, &one, &first);
  addMessage(s, rng, 2, 1, 100, loomUint8, &one, &first);
  addMessage(s, rng, 0, 1, 750, loomFloat32, &two, &second);
  const auto g1 = captureAll(s.world, cs, [&](int r, void* st) { runGroup(s, r, one[size_t(r)], st); });
  const auto g2 = captureAll(s.world, cs, [&](int r, void* st) {
    if (!two[size_t(r)].empty()) runGroup(s, r, two[size_t(r)], st);
  });
  for (int rep = 0; rep < 4; ++rep) {
    INFO("replay " << rep);
    for (const Message& m : first) fillRandom(m.in, m.count, m.type, rng);
    for (const Message& m : second) fillRandom(m.in, m.count, m.type, rng);
    // Every rank launches both at once but the late one, after longer than
    // the gate's check waits: rank 1 waits at a gate meanwhile (rank 0's,
    // with rank 2's value there; or rank 2's, and rank 0 must not get to
    // call 2's values before it).
    for (int r : {0, 1, 2})
      if (r != late) {
        s.world.rank(r).launchGraph(cs[r], g1[size_t(r)]);
        s.world.rank(r).launchGraph(cs[r], g2[size_t(r)]);
      }
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    s.world.rank(late).launchGraph(cs[late], g1[size_t(late)]);
    s.world.rank(late).launchGraph(cs[late], g2[size_t(late)]);
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    CHECK(wrongMessages(first) == 0);
    CHECK(wrongMessages(second) == 0);
    CHECK(graphFlagsLeft(s) == "");
    for (int r = 0; r < 3; ++r) CHECK_FALSE(s.comms[size_t(r)]->failed());
  }
}

TEST_CASE("send/recv that need a partner's later call (simulated device): rank 0 sends and receives in one group "
          "while rank 1 receives in one call and sends in the next, or a chain of three such, eager and captured, "
          "with messages of several chunks, exact every time",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  const bool chain = GENERATE(false, true);
  const bool captured = GENERATE(false, true);
  INFO((chain ? "a chain of three" : "two ranks") << (captured ? ", captured" : ", eager"));
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;       // eager chunks of 512 B
  opts.graphSlotBytes = 1024;  // captured regions of 512 B, chunks of 256 B
  opts.timeoutMs = 20000;
  SimComms s(3, 1, opts);
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  CaptureStreams cs(s.world);
  std::mt19937_64 rng(91);
  // calls[r][c]: rank r's call c.  A message from -> to: the sender's op in
  // its call sc, the receiver's in its call rc.
  std::vector<std::vector<std::vector<P2POp>>> calls(3, std::vector<std::vector<P2POp>>(2));
  std::vector<Message> all;
  auto message = [&](int from, int sc, int to, int rc, size_t n) {
    std::vector<std::vector<P2POp>> g(3);
    addMessage(s, rng, from, to, n, loomUint8, &g, &all);
    calls[size_t(from)][size_t(sc)].push_back(g[size_t(from)][0]);
    calls[size_t(to)][size_t(rc)].push_back(g[size_t(to)][0]);
  };
  // Several chunks each (eager chunks of 512 B, captured ones of 256 B):
  // on one stream, rank 0's send would wait behind its group's receive.
  const size_t big = 1500, mid = 700;
  message(0, 0, 1, 0, big);  // rank 0: {send to 1, receive from 1 (or 2)}
  if (!chain) {
    message(1, 1, 0, 0, 100);  // rank 1: {receive from 0}, then {send to 0}
  } else {
    message(1, 1, 2, 0, mid);  // rank 1: {receive from 0}, then {send to 2}
    message(2, 1, 0, 0, 100);  // rank 2: {receive from 1}, then {send to 0}
  }
  auto issueAll = [&](int r, void* st) {
    for (const std::vector<P2POp>& call : calls[size_t(r)])
      if (!call.empty()) runGroup(s, r, call, st);
  };
  std::vector<loomsim::SimGraph> g;
  if (captured) g = captureAll(s.world, cs, issueAll);
  for (int rep = 0; rep < 4; ++rep) {
    INFO("run " << rep);
    for (const Message& m : all) fillRandom(m.in, m.count, m.type, rng);
    if (captured) {
      launchAll(s.world, cs, g);
    } else {  // each rank from its own thread, its calls one after the other (each blocks)
      std::vector<std::string> errors(3);
      std::vector<std::thread> ts;
      for (int r = 0; r < 3; ++r)
        ts.emplace_back([&, r] {
          try {
            issueAll(r, nullptr);
          } catch (const loom::Error& e) {
            errors[size_t(r)] = e.what();
          }
        });
      for (auto& t : ts) t.join();
      for (const std::string& e : errors) CHECK(e.empty());
    }
    const std::string problems = syncAll(s);
    INFO(problems);
    REQUIRE(problems.empty());
    CHECK(wrongMessages(all) == 0);
    CHECK(graphFlagsLeft(s) == "");
    for (int r = 0; r < 3; ++r) CHECK_FALSE(s.comms[size_t(r)]->failed());
  }
}

TEST_CASE("graph lane (simulated device): captured send/recv groups fork side streams of their own: eager "
          "exchanges on another stream while the capture is open, and two captures open at once, are exact",
          "[devcomm][graph]") {
  SimCaptureProbe probe;
  const bool twoCaptures = GENERATE(false, true);
  INFO((twoCaptures ? "two captures open at once" : "eager exchanges while a capture is open"));
  loom::DeviceCommOptions opts;
  opts.slotBytes = 1024;       // eager chunks of 512 B
  opts.graphSlotBytes = 1024;  // captured chunks of 256 B
  opts.timeoutMs = 20000;
  SimComms s(2, 1, opts);
  for (const std::string& e : s.initErrors) REQUIRE(e.empty());
  CaptureStreams a(s.world), b(s.world);
  std::mt19937_64 rng(57);
  // An exchange: each rank sends to the other and receives from it in one
  // group, several chunks each way (so both of its streams are used).
  auto exchange = [&](std::vector<Message>* all) {
    std::vector<std::vector<P2POp>> g(2);
    addMessage(s, rng, 0, 1, 1500, loomUint8, &g, all);
    addMessage(s, rng, 1, 0, 1300, loomUint8, &g, all);
    return g;
  };
  std::vector<Message> inA, inB, eager;
  const auto ga = exchange(&inA);
  const auto gb = exchange(&inB);
  const auto ge = exchange(&eager);
  auto runEager = [&] {  // each rank from its own thread, as separate processes
    std::vector<std::string> errors(2);
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] {
        try {
          runGroup(s, r, ge[size_t(r)], nullptr);
        } catch (const loom::Error& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (const std::string& e : errors) CHECK(e.empty());
  };
  std::vector<loomsim::SimGraph> graphsA, graphsB;
  for (int rep = 0; rep < 3; ++rep) {
    INFO("capture " << rep);
    for (int r = 0; r < 2; ++r) {
      s.world.rank(r).beginCapture(a[r]);
      runGroup(s, r, ga[size_t(r)], a[r]);
      if (twoCaptures) {  // b's capture begins while a's is open
        s.world.rank(r).beginCapture(b[r]);
        runGroup(s, r, gb[size_t(r)], b[r]);
      }
    }
    if (!twoCaptures) {  // eager calls while the captures are open
      for (const Message& m : eager) fillRandom(m.in, m.count, m.type, rng);
      runEager();
      const std::string problems = syncAll(s);
      INFO(problems);
      REQUIRE(problems.empty());
      CHECK(wrongMessages(eager) == 0);
    }
    graphsA.clear();
    graphsB.clear();
    for (int r = 0; r < 2; ++r) {
      graphsA.push_back(s.world.rank(r).endCapture(a[r]));
      if (twoCaptures) graphsB.push_back(s.world.rank(r).endCapture(b[r]));
    }
    for (int launch = 0; launch < 2; ++launch) {
      INFO("launch " << launch);
      for (const std::vector<Message>* ms : {&inA, &inB})
        for (const Message& m : *ms) fillRandom(m.in, m.count, m.type, rng);
      for (int r = 0; r < 2; ++r) {
        s.world.rank(r).launchGraph(a[r], graphsA[size_t(r)]);
        if (twoCaptures) {  // b's replay after a's, as replays on one communicator must
          s.world.rank(r).joinStream(s.world.rank(r).callerStream(b[r]), s.world.rank(r).callerStream(a[r]));
          s.world.rank(r).launchGraph(b[r], graphsB[size_t(r)]);
        }
      }
      if (!twoCaptures) runEager();  // and eager ones while the replays run
      const std::string problems = syncAll(s);
      INFO(problems);
      REQUIRE(problems.empty());
      CHECK(wrongMessages(inA) == 0);
      if (twoCaptures) CHECK(wrongMessages(inB) == 0);
      CHECK(graphFlagsLeft(s) == "");
    }
  }
  for (int r = 0; r < 2; ++r) CHECK_FALSE(s.comms[size_t(r)]->failed());
}

TEST_CASE("graph lane (simulated device): a rank replaying a captured send while its peers replay an all-reduce "
          "(mismatched captures): every rank fails with loomTimeout and every replay ends",
          "[devcomm][graph][abort]") {
  SimCaptureProbe probe;
  loomsim::SimDeviceOptions so;
  so.deadlineMs = 15000;
  loom::DeviceCommOptions opts;
  opts.graphSlotBytes = 1024;
  opts.timeoutMs = 300;
  opts.drainTimeoutMs = 200;
  SimComms s(3, 1, opts, true, so);
  CaptureStreams cs(s.world);
  const size_t n = 2000;
  uint8_t* a = s.mem.alloc(0, n);
  std::vector<uint8_t*> b(3);
  for (auto& p : b) p = s.mem.alloc(0, n);
  const auto g = captureAll(s.world, cs, [&](int r, void* st) {
    if (r == 0) {
      runGroup(s, r, {{true, 1, n, loomUint8, a, {}}}, st);
      return;
    }
    loom::OpDesc d;
    d.coll = Collective::AllReduce;
    d.sendbuf = d.recvbuf = b[size_t(r)];
    d.count = n;
    d.dtype = loomUint8;
    d.op = loomSum;
    s.comms[size_t(r)]->run(d, st);
  });
  launchAll(s.world, cs, g);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r);
    std::string msg;
    CHECK(s.world.rank(r).synchronize(&msg) == loomSuccess);  // released, not hung
    std::string why;
    CHECK(s.comms[size_t(r)]->failure(&why) == loomTimeout);
    INFO(why);
    CHECK(why.find("a replay of a captured call") != std::string::npos);
    CHECK_FALSE(s.comms[size_t(r)]->replaying());
  }
}
