// The NCCL shim on CUDA communicators, without a GPU: the shim's objects
// linked with libloom.a, LOOM_DEVICE=cuda on loom's simulated device
// (tests/sim_device.*, tests/sim_driver.h), ranks as threads of this
// process.  Every collective the shim maps, through the NCCL API, on
// simulated device buffers with a non-NULL cudaStream_t, N = 2..4 on one
// and two devices, exact after the streams synchronise; send/recv groups;
// groups spanning every rank's communicator from one thread;
// ncclCommCuDevice; ncclCommInitAll on two devices; ncclCommRegister of
// device memory read in place (device zero-copy); PreMulSum on device
// buffers; a group naming two streams on one communicator; and the
// refusals: a CUDA stream on a host communicator, a group mixing host and
// CUDA communicators, host memory on a CUDA communicator.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include "loom_catch.h"
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "nccl_shim/shim.h"
#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_choice.h"
#include "tests/sim_device.h"
#include "tests/sim_driver.h"

namespace {

using loomsim::SimDriver;
using loomsim::SimMemory;

// A cudaStream_t the simulated device never dereferences.
cudaStream_t fakeStream(uintptr_t v = 0x7e57) { return reinterpret_cast<cudaStream_t>(v); }

// LOOM_DEVICE=cuda on `devices` simulated devices for `nranks` ranks: rank r
// on the device its init names, else on r % devices.  Undone on scope exit.
struct SimCuda {
  SimMemory mem;
  loomsim::SimDeviceWorld world;
  std::mutex mu;
  std::vector<int> asked;  // by rank: the device init asked the factory for
  SimCuda(int nranks, int devices) : world(nranks, devices, 256), asked(size_t(nranks), -100) {
    loom::setDeviceDriverFactoryForTesting(
        [this, devices](int r, int, int device) {
          {
            std::lock_guard<std::mutex> g(mu);
            asked[size_t(r)] = device;
          }
          return std::make_unique<SimDriver>(mem, &world, r, device >= 0 ? device : r % devices);
        },
        devices);
    setenv("LOOM_DEVICE", "cuda", 1);
  }
  ~SimCuda() {
    unsetenv("LOOM_DEVICE");
    loom::configReload();
    loom::setDeviceDriverFactoryForTesting(nullptr);
    CHECK(loom::waitDeviceRemains(30000));  // the reaper may hold memory of this test's device
    CHECK(mem.freedWhileMapped() == 0);     // never freed while a peer maps it (CUDA: undefined)
  }
  int32_t* alloc(int device, size_t n) { return reinterpret_cast<int32_t*>(mem.alloc(device, n * 4)); }
  // Waits for every rank's streams; false (with the message) on an error.
  bool sync(std::string* msg) {
    for (int r = 0; r < world.nranks(); ++r)
      if (world.rank(r).synchronize(msg) != loomSuccess) return false;
    return true;
  }
};

// n ranks through ncclCommInitRank, one thread each (each blocks until all
// have joined).
std::vector<ncclComm_t> initRanks(int n, std::string* err) {
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) {
    *err = ncclGetLastError(nullptr);
    return {};
  }
  std::vector<ncclComm_t> comms(size_t(n), nullptr);
  std::vector<ncclResult_t> rcs(size_t(n), ncclSuccess);
  std::vector<std::string> errs(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      rcs[size_t(r)] = ncclCommInitRank(&comms[size_t(r)], n, id, r);
      errs[size_t(r)] = ncclGetLastError(nullptr);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r)
    if (rcs[size_t(r)] != ncclSuccess) {
      *err = errs[size_t(r)];
      for (ncclComm_t c : comms) ncclCommDestroy(c);
      return {};
    }
  return comms;
}

// Runs body(r) on a thread per rank (each rank issues its own calls).
void perRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r) ts.emplace_back(body, r);
  for (auto& t : ts) t.join();
}

// Rank r's input element i of the collective with index k (small values:
// sums and products of up to 4 ranks stay exact in int32).
int32_t in(int k, int r, size_t i) { return int32_t((i * 7 + size_t(r) * 13 + size_t(k) * 5) % 101) - 50; }

}  // namespace

namespace {
// The IPC path's round counter of a shim communicator's loom device side.
uint64_t ipcRound(ncclComm_t c) {
  auto* d = dynamic_cast<loom::DeviceComm*>(c->loom->deviceComm());
  REQUIRE(d != nullptr);
  return d->round();
}
}  // namespace

TEST_CASE(
    "NCCL shim on CUDA communicators (simulated device): every collective with a non-NULL cudaStream_t on "
    "device buffers, N = 2..4 ranks on one and on two devices, exact after the streams synchronise, "
    "send/recv in a group, groups spanning every rank's communicator from one thread, ncclCommCuDevice",
    "[nccl][devcomm]") {
  for (int devices = 1; devices <= 2; ++devices)
    for (int n = 2; n <= 4; ++n) {
      CAPTURE(devices, n);
      SimCuda sim(n, devices);
      std::string err;
      std::vector<ncclComm_t> comms = initRanks(n, &err);
      INFO(err);
      REQUIRE(comms.size() == size_t(n));
      std::vector<int> dev(static_cast<size_t>(n));
      for (int r = 0; r < n; ++r) {
        CHECK(ncclCommCuDevice(comms[size_t(r)], &dev[size_t(r)]) == ncclSuccess);
        CHECK(dev[size_t(r)] == r % devices);  // the factory's current device
        CHECK(sim.asked[size_t(r)] == -1);     // ncclCommInitRank names none
      }

      // Buffers per rank (on its device): one block of c elements per use.
      const size_t c = 600, big = 40000;  // big: the reduce-scatter + all-gather all-reduce
      enum {
        kArIn,
        kArOut,
        kArBig,
        kMax,
        kAvg,
        kRed,
        kRsIn,
        kRsOut,
        kBc,
        kBcast,
        kAgIn,
        kAgOut,
        kA2aIn,
        kA2aOut,
        kA2aIp,
        kGaIn,
        kGaOut,
        kScIn,
        kScOut,
        kSend,
        kRecv,
        kUses
      };
      std::vector<size_t> len(kUses, c);
      for (int u : {kRsIn, kAgOut, kA2aIn, kA2aOut, kA2aIp, kGaOut, kScIn}) len[size_t(u)] = c * size_t(n);
      len[kArBig] = big;
      std::vector<std::vector<int32_t*>> b(static_cast<size_t>(n), std::vector<int32_t*>(kUses));
      for (int r = 0; r < n; ++r)
        for (int u = 0; u < kUses; ++u) {
          int32_t* p = sim.alloc(dev[size_t(r)], len[size_t(u)]);
          for (size_t i = 0; i < len[size_t(u)]; ++i) p[i] = in(u, r, i);
          b[size_t(r)][size_t(u)] = p;
        }
      const int root = n - 1;
      std::vector<ncclResult_t> rc(size_t(n) * 32, ncclSuccess);
      perRank(n, [&](int r) {
        ncclComm_t comm = comms[size_t(r)];
        cudaStream_t s = fakeStream();
        auto* x = b[size_t(r)].data();
        ncclResult_t* out = &rc[size_t(r) * 32];
        int k = 0;
        out[k++] = ncclAllReduce(x[kArIn], x[kArOut], c, ncclInt32, ncclSum, comm, s);
        out[k++] = ncclAllReduce(x[kArBig], x[kArBig], big, ncclInt32, ncclSum, comm, s);  // in place
        out[k++] = ncclAllReduce(x[kMax], x[kMax], c, ncclInt32, ncclMax, comm, s);
        out[k++] = ncclAllReduce(x[kAvg], x[kAvg], c, ncclInt32, ncclAvg, comm, s);
        out[k++] = ncclReduce(x[kRed], x[kRed], c, ncclInt32, ncclProd, root, comm, s);
        out[k++] = ncclReduceScatter(x[kRsIn], x[kRsOut], c, ncclInt32, ncclSum, comm, s);
        out[k++] = ncclBroadcast(x[kBc], x[kBc], c, ncclInt32, 0, comm, s);
        out[k++] = ncclBcast(x[kBcast], c, ncclInt32, root, comm, s);
        out[k++] = ncclAllGather(x[kAgIn], x[kAgOut], c, ncclInt32, comm, s);
        out[k++] = ncclAlltoAll(x[kA2aIn], x[kA2aOut], c, ncclInt32, comm, s);
        out[k++] = ncclAlltoAll(x[kA2aIp], x[kA2aIp], c, ncclInt32, comm, s);  // in place
        out[k++] = ncclGather(x[kGaIn], x[kGaOut], c, ncclInt32, 0, comm, s);
        out[k++] = ncclScatter(x[kScIn], x[kScOut], c, ncclInt32, root, comm, s);
        // A ring of sends and receives in one group, on another stream.
        out[k++] = ncclGroupStart();
        out[k++] = ncclSend(x[kSend], c, ncclInt32, (r + 1) % n, comm, fakeStream(0x5eed));
        out[k++] = ncclRecv(x[kRecv], c, ncclInt32, (r + n - 1) % n, comm, fakeStream(0x5eed));
        out[k++] = ncclGroupEnd();
      });
      for (size_t i = 0; i < rc.size(); ++i) {
        CAPTURE(i);
        CHECK(rc[i] == ncclSuccess);
      }
      std::string msg;
      bool synced = sim.sync(&msg);
      INFO(msg);
      REQUIRE(synced);

      long wrong = 0;
      for (int r = 0; r < n; ++r) {
        auto* x = b[size_t(r)].data();
        for (size_t i = 0; i < c; ++i) {
          int32_t sum = 0, mx = INT32_MIN, prod = 1, rs = 0;
          for (int q = 0; q < n; ++q) {
            sum += in(kArIn, q, i);
            mx = std::max(mx, in(kMax, q, i));
            prod *= in(kRed, q, i);
            rs += in(kRsIn, q, size_t(r) * c + i);
          }
          int32_t avgSum = 0;
          for (int q = 0; q < n; ++q) avgSum += in(kAvg, q, i);
          wrong += x[kArOut][i] != sum;
          wrong += x[kMax][i] != mx;
          wrong += x[kAvg][i] != avgSum / n;
          if (r == root) wrong += x[kRed][i] != prod;
          wrong += x[kRsOut][i] != rs;
          wrong += x[kBc][i] != in(kBc, 0, i);
          wrong += x[kBcast][i] != in(kBcast, root, i);
          wrong += x[kScOut][i] != in(kScIn, root, size_t(r) * c + i);
          wrong += x[kRecv][i] != in(kSend, (r + n - 1) % n, i);
          for (int q = 0; q < n; ++q) {
            wrong += x[kAgOut][size_t(q) * c + i] != in(kAgIn, q, i);
            wrong += x[kA2aOut][size_t(q) * c + i] != in(kA2aIn, q, size_t(r) * c + i);
            wrong += x[kA2aIp][size_t(q) * c + i] != in(kA2aIp, q, size_t(r) * c + i);
            if (r == 0) wrong += x[kGaOut][size_t(q) * c + i] != in(kGaIn, q, i);
          }
        }
        for (size_t i = 0; i < big; ++i) {
          int32_t sum = 0;
          for (int q = 0; q < n; ++q) sum += in(kArBig, q, i);
          wrong += x[kArBig][i] != sum;
        }
      }
      CHECK(wrong == 0);

      // One thread issues every rank's part as one group (as a process
      // driving several GPUs does): an all-reduce and a ring of
      // sends/receives on every communicator, each on its own stream.
      for (int r = 0; r < n; ++r)
        for (int u : {kArIn, kSend}) {
          int32_t* p = b[size_t(r)][size_t(u)];
          for (size_t i = 0; i < c; ++i) p[i] = in(u + 40, r, i);
        }
      REQUIRE(ncclGroupStart() == ncclSuccess);
      for (int r = 0; r < n; ++r) {
        auto* x = b[size_t(r)].data();
        cudaStream_t s = fakeStream(0x1000 + uintptr_t(r) * 16);
        CHECK(ncclAllReduce(x[kArIn], x[kArOut], c, ncclInt32, ncclSum, comms[size_t(r)], s) == ncclSuccess);
        CHECK(ncclSend(x[kSend], c, ncclInt32, (r + 1) % n, comms[size_t(r)], s) == ncclSuccess);
        CHECK(ncclRecv(x[kRecv], c, ncclInt32, (r + n - 1) % n, comms[size_t(r)], s) == ncclSuccess);
      }
      CHECK(ncclGroupEnd() == ncclSuccess);
      INFO(ncclGetLastError(nullptr));
      synced = sim.sync(&msg);
      INFO(msg);
      REQUIRE(synced);
      wrong = 0;
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < c; ++i) {
          int32_t sum = 0;
          for (int q = 0; q < n; ++q) sum += in(kArIn + 40, q, i);
          wrong += b[size_t(r)][kArOut][i] != sum;
          wrong += b[size_t(r)][kRecv][i] != in(kSend + 40, (r + n - 1) % n, i);
        }
      CHECK(wrong == 0);
      for (ncclComm_t comm : comms) CHECK(ncclCommDestroy(comm) == ncclSuccess);
    }
}

TEST_CASE(
    "NCCL shim on CUDA communicators (simulated device): ncclCommInitAll makes ndev ranks on the devices "
    "devlist names (or 0..ndev-1), ncclCommCuDevice reports them, a one-thread group over them is exact, a "
    "device that does not exist is refused at once",
    "[nccl][devcomm]") {
  for (bool named : {true, false}) {
    CAPTURE(named);
    SimCuda sim(2, 2);
    const int devlist[2] = {1, 0};
    ncclComm_t comms[2] = {nullptr, nullptr};
    REQUIRE(ncclCommInitAll(comms, 2, named ? devlist : nullptr) == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
      const int want = named ? devlist[r] : r;
      int d = -5, rank = -1, count = 0;
      CHECK(ncclCommCuDevice(comms[r], &d) == ncclSuccess);
      CHECK(d == want);
      CHECK(sim.asked[size_t(r)] == want);  // the config's device reached the driver
      CHECK(ncclCommUserRank(comms[r], &rank) == ncclSuccess);
      CHECK(rank == r);
      CHECK(ncclCommCount(comms[r], &count) == ncclSuccess);
      CHECK(count == 2);
    }
    const size_t c = 5000;
    int32_t* in0[2];
    int32_t* out0[2];
    int32_t* ag[2];
    for (int r = 0; r < 2; ++r) {
      const int d = named ? devlist[r] : r;
      in0[r] = sim.alloc(d, c);
      out0[r] = sim.alloc(d, c);
      ag[r] = sim.alloc(d, 2 * c);
      for (size_t i = 0; i < c; ++i) in0[r][i] = int32_t(i) + 100000 * r;
    }
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
      CHECK(ncclAllReduce(in0[r], out0[r], c, ncclInt32, ncclSum, comms[r], fakeStream()) == ncclSuccess);
      CHECK(ncclAllGather(in0[r], ag[r], c, ncclInt32, comms[r], fakeStream()) == ncclSuccess);
    }
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    std::string msg;
    const bool synced = sim.sync(&msg);
    INFO(msg);
    REQUIRE(synced);
    long wrong = 0;
    for (int r = 0; r < 2; ++r)
      for (size_t i = 0; i < c; ++i) {
        wrong += out0[r][i] != 2 * int32_t(i) + 100000;
        wrong += ag[r][i] != int32_t(i);
        wrong += ag[r][c + i] != int32_t(i) + 100000;
      }
    CHECK(wrong == 0);
    for (ncclComm_t comm : comms) CHECK(ncclCommDestroy(comm) == ncclSuccess);
  }
  SimCuda sim(2, 2);
  ncclComm_t comms[2] = {reinterpret_cast<ncclComm_t>(1), reinterpret_cast<ncclComm_t>(1)};
  const int bad[2] = {0, 2};
  CHECK(ncclCommInitAll(comms, 2, bad) == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr)).find("devlist[1] = 2 is not a CUDA device of this process") !=
        std::string::npos);
  CHECK(comms[0] == nullptr);
  CHECK(ncclCommInitAll(comms, 3, nullptr) == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr))
            .find("ndev 3 with devlist NULL puts rank i on device i, but this "
                  "process has 2 CUDA devices") != std::string::npos);
  CHECK(ncclCommInitAll(comms, 0, nullptr) == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr)).find("ndev 0") != std::string::npos);
  CHECK(ncclCommInitAll(nullptr, 2, nullptr) == ncclInvalidArgument);
}

TEST_CASE(
    "NCCL shim: a CUDA stream on a host communicator is refused naming the host communicator and "
    "LOOM_DEVICE, as is ncclCommCuDevice, and on a CUDA communicator a group mixing it with a host one, "
    "host memory is refused and launches nothing, a PreMulSum's scalar must be device memory, and a group using two streams on one communicator runs",
    "[nccl][devcomm]") {
  // Two host communicators (LOOM_DEVICE=host) ...
  setenv("LOOM_DEVICE", "host", 1);
  std::string err;
  std::vector<ncclComm_t> host = initRanks(2, &err);
  INFO(err);
  REQUIRE(host.size() == 2);
  float x[4] = {1, 2, 3, 4}, y[4];
  CHECK(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, host[0], fakeStream()) == ncclInvalidUsage);
  std::string last = ncclGetLastError(nullptr);
  INFO(last);
  CHECK(last.find("ncclAllReduce: stream 0x7e57 is a CUDA stream, but this communicator runs on the host "
                  "(LOOM_DEVICE=host when it was made)") != std::string::npos);
  CHECK(last.find("stream 0 (NULL)") != std::string::npos);
  CHECK(ncclSend(x, 4, ncclFloat32, 1, host[0], fakeStream()) == ncclInvalidUsage);
  int dev = -5;
  CHECK(ncclCommCuDevice(host[0], &dev) == ncclInvalidUsage);
  CHECK(std::string(ncclGetLastError(nullptr)).find("runs on the host (LOOM_DEVICE=host when it was made)") !=
        std::string::npos);
  CHECK(ncclCommCuDevice(host[0], nullptr) == ncclInvalidArgument);

  // ... and two CUDA ones on a simulated device.
  SimCuda sim(2, 1);
  // Stream 0x20 is a stream of its own on each rank (0x10 and the others
  // are stream 0), so the two-stream group below really joins two streams.
  for (int r = 0; r < 2; ++r) REQUIRE(sim.world.rank(r).addCallerStream(fakeStream(0x20)) > 0);
  std::vector<ncclComm_t> cuda = initRanks(2, &err);
  REQUIRE(cuda.size() == 2);
  REQUIRE(cuda[0]->loom->deviceComm() != nullptr);
  const uint64_t before = ipcRound(cuda[0]);
  int32_t* d = sim.alloc(0, 64);
  REQUIRE(ncclGroupStart() == ncclSuccess);
  CHECK(ncclAllReduce(d, d, 16, ncclInt32, ncclSum, cuda[0], fakeStream()) == ncclSuccess);
  CHECK(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, host[0], nullptr) == ncclSuccess);
  CHECK(ncclGroupEnd() == ncclInvalidUsage);
  last = ncclGetLastError(nullptr);
  CHECK(last.find(
            "ncclGroupEnd: the group mixes a host communicator (rank 0 of 2) and a CUDA communicator (rank "
            "0 of 2, CUDA device 0)") != std::string::npos);
  CHECK(last.find("the group was not launched") != std::string::npos);
  CHECK(ipcRound(cuda[0]) == before);

  // Two streams on one CUDA communicator in one group: allowed, as in
  // NCCL (loom joins them); both ranks' groups from this thread.
  int32_t* e[2] = {sim.alloc(0, 64), sim.alloc(0, 64)};
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 16; ++i) e[r][i] = r + 1;
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    CHECK(ncclAllReduce(e[r], e[r], 8, ncclInt32, ncclSum, cuda[size_t(r)], fakeStream(0x10)) == ncclSuccess);
    CHECK(ncclAllReduce(e[r] + 8, e[r] + 8, 8, ncclInt32, ncclSum, cuda[size_t(r)], fakeStream(0x20)) ==
          ncclSuccess);
  }
  CHECK(ncclGroupEnd() == ncclSuccess);
  INFO(ncclGetLastError(nullptr));
  std::string syncMsg;
  CHECK(sim.sync(&syncMsg));
  INFO(syncMsg);
  int wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 16; ++i) wrong += e[r][i] != 3;
  CHECK(wrong == 0);
  CHECK(ipcRound(cuda[0]) == before + 2);

  // A PreMulSum made on a CUDA communicator with a host scalar in device
  // memory is refused at its first use (the scalar must be device memory).
  int32_t scalar = 3;
  ncclRedOp_t op;
  REQUIRE(ncclRedOpCreatePreMulSum(&op, &scalar, ncclInt32, ncclScalarDevice, cuda[0]) == ncclSuccess);
  CHECK(ncclAllReduce(d, d, 16, ncclInt32, op, cuda[0], fakeStream()) == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr)).find("scalar (on the device)") != std::string::npos);
  CHECK(ncclRedOpDestroy(op, cuda[0]) == ncclSuccess);
  CHECK(ipcRound(cuda[0]) == before + 2);
  // A host communicator has it too.
  CHECK(ncclRedOpCreatePreMulSum(&op, &scalar, ncclInt32, ncclScalarHostImmediate, host[0]) == ncclSuccess);
  CHECK(ncclRedOpDestroy(op, host[0]) == ncclSuccess);

  // Host memory on a CUDA communicator: loom's message, nothing enqueued.
  CHECK(ncclAllReduce(x, d, 4, ncclFloat32, ncclSum, cuda[0], fakeStream()) == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr)).find("is host memory") != std::string::npos);
  CHECK(ipcRound(cuda[0]) == before + 2);

  for (ncclComm_t c : cuda) CHECK(ncclCommDestroy(c) == ncclSuccess);
  for (ncclComm_t c : host) CHECK(ncclCommDestroy(c) == ncclSuccess);
}

TEST_CASE(
    "NCCL shim on CUDA communicators (simulated device): ncclCommInitRank inside a group (nccl-tests' way to "
    "make several ranks from one thread) returns the handles at once, makes the communicators at ncclGroupEnd "
    "on the device current at each call, refuses calls on them inside the group, and they work after it",
    "[nccl][devcomm]") {
  SimCuda sim(2, 2);
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  ncclComm_t comms[2] = {nullptr, nullptr};
  const int current[2] = {1, 0};  // as cudaSetDevice before each init
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    loom::setThreadDeviceForTesting(current[r]);
    CHECK(ncclCommInitRank(&comms[r], 2, id, r) == ncclSuccess);
    CHECK(comms[r] != nullptr);
  }
  loom::setThreadDeviceForTesting(-1);
  int32_t* early = sim.alloc(1, 16);
  CHECK(ncclAllReduce(early, early, 16, ncclInt32, ncclSum, comms[0], fakeStream()) == ncclInvalidUsage);
  CHECK(std::string(ncclGetLastError(nullptr)).find("completes at its ncclGroupEnd") != std::string::npos);
  // That refusal cancels the group, as any refused call does: nothing is made.
  CHECK(ncclGroupEnd() == ncclInvalidUsage);
  for (ncclComm_t c : comms) CHECK(ncclCommDestroy(c) == ncclSuccess);

  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    loom::setThreadDeviceForTesting(current[r]);
    CHECK(ncclCommInitRank(&comms[r], 2, id, r) == ncclSuccess);
  }
  loom::setThreadDeviceForTesting(-1);
  const int64_t t0 = loom::nowMs();
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  CHECK(loom::nowMs() - t0 < 20000);  // both made together, not one waiting for the other's timeout
  for (int r = 0; r < 2; ++r) {
    int d = -5;
    CHECK(ncclCommCuDevice(comms[r], &d) == ncclSuccess);
    CHECK(d == current[r]);
    CHECK(sim.asked[size_t(r)] == current[r]);
  }
  const size_t c = 3000;
  int32_t* buf[2];
  for (int r = 0; r < 2; ++r) {
    buf[r] = sim.alloc(current[r], c);
    for (size_t i = 0; i < c; ++i) buf[r][i] = int32_t(i) * (r + 1);
  }
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < 2; ++r)
    CHECK(ncclAllReduce(buf[r], buf[r], c, ncclInt32, ncclSum, comms[r], fakeStream()) == ncclSuccess);
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  std::string msg;
  const bool synced = sim.sync(&msg);
  INFO(msg);
  REQUIRE(synced);
  long wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < c; ++i) wrong += buf[r][i] != 3 * int32_t(i);
  CHECK(wrong == 0);
  for (ncclComm_t comm : comms) CHECK(ncclCommDestroy(comm) == ncclSuccess);
}

TEST_CASE(
    "NCCL shim on CUDA communicators (simulated device): ncclCommRevoke then ncclCommShrink without a rank that "
    "does not call, and NCCL_SHRINK_ABORT, give CUDA communicators on the parents' devices that reduce exactly",
    "[nccl][devcomm]") {
  const int n = 3, devices = 2, gone = 1;  // rank 1 is excluded and never calls shrink
  SimCuda sim(n, devices);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(n, &err);
  INFO(err);
  REQUIRE(comms.size() == size_t(n));
  const size_t c = 1000;
  std::vector<int32_t*> buf(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) buf[size_t(r)] = sim.alloc(r % devices, c);

  std::vector<ncclComm_t> shrunk(size_t(n), nullptr);
  std::vector<ncclResult_t> rc(size_t(n) * 4, ncclInternalError);
  perRank(n, [&](int r) {
    ncclResult_t* out = &rc[size_t(r) * 4];
    out[0] = ncclCommRevoke(comms[size_t(r)], NCCL_REVOKE_DEFAULT);
    ncclResult_t async = ncclInternalError;
    out[1] = ncclCommGetAsyncError(comms[size_t(r)], &async);
    out[2] = async;
    int excluded = gone;
    out[3] = r == gone ? ncclSuccess : ncclCommShrink(comms[size_t(r)], &excluded, 1, &shrunk[size_t(r)], nullptr,
                                                         NCCL_SHRINK_DEFAULT);
  });
  for (size_t i = 0; i < rc.size(); ++i) {
    INFO("rank " << i / 4 << " result " << i % 4 << ": " << ncclGetLastError(nullptr));
    CHECK(rc[i] == ncclSuccess);
  }
  REQUIRE(shrunk[0] != nullptr);
  REQUIRE(shrunk[2] != nullptr);
  int count = 0, dev = -1;
  CHECK(ncclCommCount(shrunk[2], &count) == ncclSuccess);
  CHECK(count == 2);
  CHECK(ncclCommCuDevice(shrunk[2], &dev) == ncclSuccess);
  CHECK(dev == 0);  // rank 2 of the parent was on device 2 % 2

  // The survivors reduce on device buffers, on a stream; then shrink again
  // with NCCL_SHRINK_ABORT (revoke and shrink in one call), nobody excluded.
  const int survivors[2] = {0, 2};
  for (int round = 0; round < 2; ++round) {
    for (int s = 0; s < 2; ++s)
      for (size_t i = 0; i < c; ++i) buf[size_t(survivors[s])][i] = in(round, survivors[s], i);
    std::vector<ncclResult_t> arc(2, ncclInternalError);
    perRank(2, [&](int s) {
      int32_t* p = buf[size_t(survivors[s])];
      arc[size_t(s)] = ncclAllReduce(p, p, c, ncclInt32, ncclSum, shrunk[size_t(survivors[s])], fakeStream());
    });
    CHECK(arc[0] == ncclSuccess);
    CHECK(arc[1] == ncclSuccess);
    CHECK(sim.sync(&err));
    INFO(err);
    for (int s = 0; s < 2; ++s)
      for (size_t i = 0; i < c; i += 37)
        REQUIRE(buf[size_t(survivors[s])][i] == in(round, 0, i) + in(round, 2, i));
    if (round == 1) break;
    std::vector<ncclComm_t> next(2, nullptr);
    perRank(2, [&](int s) {
      arc[size_t(s)] = ncclCommShrink(shrunk[size_t(survivors[s])], nullptr, 0, &next[size_t(s)], nullptr,
                                      NCCL_SHRINK_ABORT);
    });
    for (int s = 0; s < 2; ++s) {
      CHECK(arc[size_t(s)] == ncclSuccess);
      REQUIRE(next[size_t(s)] != nullptr);
      CHECK(ncclAllReduce(buf[0], buf[0], c, ncclInt32, ncclSum, shrunk[size_t(survivors[s])], fakeStream()) ==
            ncclInvalidUsage);  // revoked by NCCL_SHRINK_ABORT
      CHECK(std::string(ncclGetLastError(nullptr)).find("revoked") != std::string::npos);
      CHECK(ncclCommDestroy(shrunk[size_t(survivors[s])]) == ncclSuccess);
      shrunk[size_t(survivors[s])] = next[size_t(s)];
    }
  }
  for (ncclComm_t c2 : shrunk)
    if (c2) CHECK(ncclCommDestroy(c2) == ncclSuccess);
  for (ncclComm_t c2 : comms) CHECK(ncclCommDestroy(c2) == ncclSuccess);
}

TEST_CASE(
    "NCCL shim on CUDA communicators (simulated device): device memory given to ncclCommRegister (as PyTorch's "
    "allocator hook gives its segments) is read in place by large all-reduces, and ncclCommDeregister has the peer "
    "unmap it",
    "[nccl][devcomm]") {
  setenv("LOOM_DEVICE_SLOT_BYTES", "65536", 1);  // several rounds of the reduce-scatter + all-gather
  const int n = 2;
  SimCuda sim(n, 1);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(n, &err);
  unsetenv("LOOM_DEVICE_SLOT_BYTES");
  INFO(err);
  REQUIRE(comms.size() == size_t(n));
  auto ipc = [&](int r) -> loom::DeviceComm& {
    return *dynamic_cast<loom::DeviceComm*>(comms[size_t(r)]->loom->deviceComm());
  };
  const size_t c = 300000;
  std::vector<int32_t*> seg(static_cast<size_t>(n));
  std::vector<void*> handle(static_cast<size_t>(n), nullptr);
  for (int r = 0; r < n; ++r) {
    seg[size_t(r)] = sim.alloc(0, c + 1024);  // the segment; the bucket at an offset in it
    REQUIRE(ncclCommRegister(comms[size_t(r)], seg[size_t(r)], (c + 1024) * 4, &handle[size_t(r)]) == ncclSuccess);
  }
  auto allReduce = [&](int k) {
    const uint64_t before = sim.world.rank(0).publishedReads() + sim.world.rank(1).publishedReads();
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < c; ++i) seg[size_t(r)][256 + i] = in(k, r, i);
    std::vector<ncclResult_t> rc(size_t(n), ncclInternalError);
    perRank(n, [&](int r) {
      int32_t* p = seg[size_t(r)] + 256;
      rc[size_t(r)] = ncclAllReduce(p, p, c, ncclInt32, ncclSum, comms[size_t(r)], fakeStream());
    });
    for (ncclResult_t x : rc) CHECK(x == ncclSuccess);
    CHECK(sim.sync(&err));
    long wrong = 0;
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < c; ++i) wrong += seg[size_t(r)][256 + i] != in(k, 0, i) + in(k, 1, i);
    CHECK(wrong == 0);
    return sim.world.rank(0).publishedReads() + sim.world.rank(1).publishedReads() - before;
  };
  CHECK(allReduce(1) > 0);
  for (int r = 0; r < n; ++r) {
    CHECK(ipc(r).memoryStats().published == 1);
    CHECK(ipc(r).memoryStats().publishedIn == 1);
  }
  for (int r = 0; r < n; ++r) CHECK(ncclCommDeregister(comms[size_t(r)], handle[size_t(r)]) == ncclSuccess);
  for (int r = 0; r < n; ++r) {
    CHECK(ipc(r).memoryStats().published == 0);
    CHECK(ipc(r).memoryStats().publishedIn == 0);
  }
  CHECK(ncclCommDeregister(comms[0], handle[0]) == ncclInvalidArgument);  // twice
  CHECK(allReduce(2) == 0);  // staged now, still exact
  for (int r = 0; r < n; ++r) sim.mem.free(seg[size_t(r)]);
  for (ncclComm_t c2 : comms) CHECK(ncclCommDestroy(c2) == ncclSuccess);
}

TEST_CASE("NCCL shim: a failure ncclCommGetAsyncError reports is also the process's last error, for "
          "ncclGetLastError(NULL) on any thread (NCCL keeps one string, and PyTorch's watchdog asks that way)",
          "[nccl][devcomm]") {
  const int n = 2;
  SimCuda sim(n, 1);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(n, &err);
  INFO(err);
  REQUIRE(comms.size() == size_t(n));
  REQUIRE(ncclCommAbort(comms[1]) == ncclSuccess);  // rank 0's communicator fails through the notice
  ncclResult_t async = ncclSuccess;
  std::thread watchdog([&] {
    for (int i = 0; i < 500 && async == ncclSuccess; ++i) {
      if (ncclCommGetAsyncError(comms[0], &async) != ncclSuccess) break;
      if (async == ncclSuccess) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  watchdog.join();
  CHECK(async != ncclSuccess);
  std::string seen;
  std::thread other([&] { seen = ncclGetLastError(nullptr); });  // a thread that made no call of its own
  other.join();
  INFO(seen);
  CHECK(seen.find("ncclCommGetAsyncError") != std::string::npos);
  CHECK(seen.find("abort") != std::string::npos);
  CHECK(ncclCommAbort(comms[0]) == ncclSuccess);
}

TEST_CASE("NCCL shim on CUDA communicators (simulated device): PreMulSum (ncclRedOpCreatePreMulSum, as FSDP2's "
          "reduce-scatter with a gradient divide factor uses it) scales each rank's input into device scratch on the "
          "caller's stream and sums: all-reduce, reduce-scatter and reduce, in and out of place, a host-immediate "
          "and a device scalar, several in one group, the input untouched",
          "[nccl][devcomm][premul]") {
  const int N = 2;
  SimCuda sim(N, 1);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(N, &err);
  INFO(err);
  REQUIRE(comms.size() == size_t(N));
  const size_t n = 3000;
  // Per rank: float inputs (k = 0.5: every product and sum exact), an int32
  // input with a device scalar of 3, recv buffers.
  std::vector<float*> x(N), y(N), rsIn(N), rsOut(N), red(N);
  std::vector<int32_t*> xi(N), yi(N), kDev(N);
  ncclRedOp_t half[N], three[N];
  for (int r = 0; r < N; ++r) {
    x[r] = reinterpret_cast<float*>(sim.alloc(0, n));
    y[r] = reinterpret_cast<float*>(sim.alloc(0, n));
    red[r] = reinterpret_cast<float*>(sim.alloc(0, n));
    rsIn[r] = reinterpret_cast<float*>(sim.alloc(0, n * N));
    rsOut[r] = reinterpret_cast<float*>(sim.alloc(0, n));
    xi[r] = sim.alloc(0, n);
    yi[r] = sim.alloc(0, n);
    kDev[r] = sim.alloc(0, 16);
    *kDev[r] = 3;
    for (size_t i = 0; i < n; ++i) {
      x[r][i] = float(r + 1) * float(i % 13);
      y[r][i] = -1.0f;
      red[r][i] = -1.0f;
      rsOut[r][i] = -1.0f;
      xi[r][i] = int32_t(i % 7) - 3 + r;
      yi[r][i] = -1;
    }
    for (size_t i = 0; i < n * N; ++i) rsIn[r][i] = float(r + 2) * float(i % 11);
    const float k = 0.5f;
    REQUIRE(ncclRedOpCreatePreMulSum(&half[r], const_cast<float*>(&k), ncclFloat32, ncclScalarHostImmediate,
                                     comms[size_t(r)]) == ncclSuccess);
    REQUIRE(ncclRedOpCreatePreMulSum(&three[r], kDev[r], ncclInt32, ncclScalarDevice, comms[size_t(r)]) ==
            ncclSuccess);
  }
  // One group from this thread: every rank's out-of-place all-reduce of x,
  // in-place all-reduce of xi (device scalar), reduce-scatter and reduce,
  // all on one stream (four scaled copies in one launch).
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < N; ++r) {
    ncclComm_t c = comms[size_t(r)];
    CHECK(ncclAllReduce(x[r], y[r], n, ncclFloat32, half[r], c, fakeStream()) == ncclSuccess);
    CHECK(ncclAllReduce(xi[r], xi[r], n, ncclInt32, three[r], c, fakeStream()) == ncclSuccess);
    CHECK(ncclReduceScatter(rsIn[r], rsOut[r], n, ncclFloat32, half[r], c, fakeStream()) == ncclSuccess);
    CHECK(ncclReduce(x[r], red[r], n, ncclFloat32, half[r], 1, c, fakeStream()) == ncclSuccess);
  }
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  INFO(ncclGetLastError(nullptr));
  std::string msg;
  REQUIRE(sim.sync(&msg));
  long wrong = 0;
  for (int r = 0; r < N; ++r)
    for (size_t i = 0; i < n; ++i) {
      float sx = 0, srs = 0;
      int32_t si = 0;
      for (int q = 0; q < N; ++q) {
        sx += 0.5f * float(q + 1) * float(i % 13);
        srs += 0.5f * float(q + 2) * float((size_t(r) * n + i) % 11);
        si += 3 * (int32_t(i % 7) - 3 + q);
      }
      wrong += y[r][i] != sx;
      wrong += xi[r][i] != si;
      wrong += rsOut[r][i] != srs;
      wrong += (r == 1 ? red[r][i] != sx : red[r][i] != -1.0f);
      wrong += x[r][i] != float(r + 1) * float(i % 13);  // the input itself is never scaled
    }
  CHECK(wrong == 0);
  // Again outside a group, one call at a time, reusing the scratch: each
  // round's input differs (x + rep), and every result is kept apart, so a
  // scaled copy overwritten before its sum read it shows.
  std::atomic<int> failedCalls{0};
  const int reps = 4;
  std::vector<std::vector<float*>> out(reps, std::vector<float*>(N));
  std::vector<std::vector<float*>> inRep(reps, std::vector<float*>(N));
  for (int rep = 0; rep < reps; ++rep)
    for (int r = 0; r < N; ++r) {
      out[rep][r] = reinterpret_cast<float*>(sim.alloc(0, n));
      inRep[rep][r] = reinterpret_cast<float*>(sim.alloc(0, n));
      for (size_t i = 0; i < n; ++i) inRep[rep][r][i] = float(r + 1) * float(i % 13) + float(rep);
    }
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < N; ++r)
      ts.emplace_back([&, r] {
        for (int rep = 0; rep < reps; ++rep)
          if (ncclAllReduce(inRep[rep][r], out[rep][r], n, ncclFloat32, half[r], comms[size_t(r)], fakeStream()) !=
              ncclSuccess)
            ++failedCalls;
      });
    for (auto& t : ts) t.join();
  }
  CHECK(failedCalls.load() == 0);
  REQUIRE(sim.sync(&msg));
  for (int rep = 0; rep < reps; ++rep)
    for (int r = 0; r < N; ++r)
      for (size_t i = 0; i < n; ++i)
        wrong += out[rep][r][i] != 0.5f * (3.0f * float(i % 13) + 2.0f * float(rep));
  CHECK(wrong == 0);
  // A PreMulSum that fails in a group (a device scalar that is not device
  // memory) cancels the group: no rank launches anything.
  int32_t hostScalar = 2;
  ncclRedOp_t bad[N];
  for (int r = 0; r < N; ++r)
    REQUIRE(ncclRedOpCreatePreMulSum(&bad[r], &hostScalar, ncclInt32, ncclScalarDevice, comms[size_t(r)]) ==
            ncclSuccess);
  std::vector<uint64_t> rounds;
  for (ncclComm_t c : comms) rounds.push_back(ipcRound(c));
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < N; ++r) {
    CHECK(ncclAllReduce(xi[r], xi[r], n, ncclInt32, ncclSum, comms[size_t(r)], fakeStream()) == ncclSuccess);
    CHECK(ncclAllReduce(xi[r], yi[r], n, ncclInt32, bad[r], comms[size_t(r)], fakeStream()) == ncclSuccess);
  }
  CHECK(ncclGroupEnd() == ncclInvalidArgument);
  CHECK(std::string(ncclGetLastError(nullptr)).find("scalar (on the device)") != std::string::npos);
  for (int r = 0; r < N; ++r) {
    CHECK(ipcRound(comms[size_t(r)]) == rounds[size_t(r)]);
    CHECK(ncclRedOpDestroy(bad[r], comms[size_t(r)]) == ncclSuccess);
  }
  for (int r = 0; r < N; ++r) {
    CHECK(ncclRedOpDestroy(half[r], comms[size_t(r)]) == ncclSuccess);
    CHECK(ncclRedOpDestroy(three[r], comms[size_t(r)]) == ncclSuccess);
  }
  for (ncclComm_t c : comms) CHECK(ncclCommDestroy(c) == ncclSuccess);
}

TEST_CASE("NCCL shim on CUDA communicators (simulated device): one thread's group of PreMulSum calls on two "
          "communicators of two devices scales each on its communicator's device, whatever device is current",
          "[nccl][devcomm][premul]") {
  SimCuda sim(2, 2);
  ncclComm_t comms[2] = {nullptr, nullptr};
  const int devs[2] = {0, 1};
  REQUIRE(ncclCommInitAll(comms, 2, devs) == ncclSuccess);
  const size_t n = 1000;
  float* buf[2];
  ncclRedOp_t op[2];
  const float k = 2.0f;
  for (int r = 0; r < 2; ++r) {
    buf[r] = reinterpret_cast<float*>(sim.alloc(r, n));
    for (size_t i = 0; i < n; ++i) buf[r][i] = float(r + 1) * float(i % 9);
    REQUIRE(ncclRedOpCreatePreMulSum(&op[r], const_cast<float*>(&k), ncclFloat32, ncclScalarHostImmediate,
                                     comms[r]) == ncclSuccess);
  }
  loom::setThreadDeviceForTesting(0);  // device 0 current for both calls
  REQUIRE(ncclGroupStart() == ncclSuccess);
  for (int r = 0; r < 2; ++r)
    CHECK(ncclAllReduce(buf[r], buf[r], n, ncclFloat32, op[r], comms[r], fakeStream()) == ncclSuccess);
  CHECK(ncclGroupEnd() == ncclSuccess);
  INFO(ncclGetLastError(nullptr));
  loom::setThreadDeviceForTesting(-1);
  std::string msg;
  REQUIRE(sim.sync(&msg));
  int wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) wrong += buf[r][i] != 2.0f * 3.0f * float(i % 9);
  CHECK(wrong == 0);
  for (int r = 0; r < 2; ++r) CHECK(ncclRedOpDestroy(op[r], comms[r]) == ncclSuccess);
  for (ncclComm_t c : comms) CHECK(ncclCommDestroy(c) == ncclSuccess);
}

TEST_CASE("NCCL shim on CUDA communicators (simulated device): without a graph lane a PreMulSum all-reduce on a "
          "capturing stream is ncclInvalidUsage before anything is captured (its scaled copy included), alone and "
          "in a group",
          "[nccl][devcomm][graph]") {
  setenv("LOOM_DEVICE_GRAPH_SLOT_BYTES", "0", 1);
  SimCuda sim(1, 1);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(1, &err);
  unsetenv("LOOM_DEVICE_GRAPH_SLOT_BYTES");
  INFO(err);
  REQUIRE(comms.size() == 1);
  int capturable = -1;
  CHECK(loomCommCanCapture(comms[0]->loom, &capturable) == loomSuccess);
  CHECK(capturable == 0);
  loom::setCudaCaptureProbeForTesting(loomsim::simStreamCapturing);
  struct Unset {
    ~Unset() { loom::setCudaCaptureProbeForTesting(nullptr); }
  } unset;
  char key;
  REQUIRE(sim.world.rank(0).addCallerStream(&key) > 0);
  auto st = reinterpret_cast<cudaStream_t>(&key);
  int32_t* x = sim.alloc(0, 100);
  int32_t* y = sim.alloc(0, 100);
  const int32_t k = 3;
  ncclRedOp_t thrice;
  REQUIRE(ncclRedOpCreatePreMulSum(&thrice, const_cast<int32_t*>(&k), ncclInt32, ncclScalarHostImmediate, comms[0]) ==
          ncclSuccess);
  sim.world.rank(0).beginCapture(&key);
  CHECK(ncclAllReduce(x, y, 100, ncclInt32, thrice, comms[0], st) == ncclInvalidUsage);
  CHECK(std::string(ncclGetLastError(comms[0])).find("cannot capture calls") != std::string::npos);
  CHECK(ncclGroupStart() == ncclSuccess);
  CHECK(ncclAllReduce(x, y, 100, ncclInt32, thrice, comms[0], st) == ncclInvalidUsage);
  CHECK(ncclGroupEnd() != ncclSuccess);
  const loomsim::SimGraph graph = sim.world.rank(0).endCapture(&key);
  REQUIRE(graph);
  CHECK(graph->empty());  // nothing scaled or summed was captured
  CHECK(ncclRedOpDestroy(thrice, comms[0]) == ncclSuccess);
  for (ncclComm_t c : comms) CHECK(ncclCommDestroy(c) == ncclSuccess);
}

TEST_CASE("NCCL shim on CUDA communicators (simulated device): collectives and a grouped all-to-all of sends and "
          "receives with uneven sizes (torch's all_to_all with splits) issued on a stream being captured into a CUDA "
          "graph are captured, and each replay is exact with the inputs of its time, and so is a PreMulSum all-reduce "
          "(in and out of place), and a PreMulSum reduce-scatter there is refused with a reason",
          "[nccl][devcomm][graph]") {
  const int N = 3;
  SimCuda sim(N, 1);
  std::string err;
  std::vector<ncclComm_t> comms = initRanks(N, &err);
  INFO(err);
  REQUIRE(comms.size() == size_t(N));
  loom::setCudaCaptureProbeForTesting(loomsim::simStreamCapturing);
  struct Unset {
    ~Unset() { loom::setCudaCaptureProbeForTesting(nullptr); }
  } unset;
  char keys[N];
  for (int r = 0; r < N; ++r) REQUIRE(sim.world.rank(r).addCallerStream(&keys[r]) > 0);
  const size_t n = 50000;
  std::vector<int32_t*> x(N), y(N), g(N);
  for (int r = 0; r < N; ++r) {
    x[r] = sim.alloc(0, n);
    y[r] = sim.alloc(0, n);
    g[r] = sim.alloc(0, size_t(N) * 10);
  }
  // The all-to-all: rank r sends block(r, q) elements to rank q, packed in
  // q order in a2aIn[r]; receives them packed in source order in a2aOut[r].
  auto block = [](int from, int to) { return size_t(from * 2 + to + 1) * 1500; };
  auto offset = [&](int r, int upto, bool sending) {
    size_t o = 0;
    for (int q = 0; q < upto; ++q) o += sending ? block(r, q) : block(q, r);
    return o;
  };
  std::vector<int32_t*> a2aIn(N), a2aOut(N), pm(N), pmIn(N);
  for (int r = 0; r < N; ++r) {
    a2aIn[r] = sim.alloc(0, offset(r, N, true));
    a2aOut[r] = sim.alloc(0, offset(r, N, false));
    pm[r] = sim.alloc(0, n);
    pmIn[r] = sim.alloc(0, 100);
  }
  std::vector<loomsim::SimGraph> graphs(N);
  const uint64_t round = ipcRound(comms[0]);
  int capturable = -1;
  CHECK(loomCommCanCapture(comms[0]->loom, &capturable) == loomSuccess);
  CHECK(capturable == 1);
  CHECK(loomCommCanCapture(comms[0]->loom, nullptr) == loomInvalidArgument);
  for (int r = 0; r < N; ++r) {
    auto st = reinterpret_cast<cudaStream_t>(&keys[r]);
    sim.world.rank(r).beginCapture(&keys[r]);
    CHECK(ncclAllReduce(x[r], y[r], n, ncclInt32, ncclSum, comms[size_t(r)], st) == ncclSuccess);
    CHECK(ncclGroupStart() == ncclSuccess);
    CHECK(ncclAllGather(x[r], g[r], 10, ncclInt32, comms[size_t(r)], st) == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclSuccess);
    CHECK(ncclGroupStart() == ncclSuccess);
    for (int q = 0; q < N; ++q) {
      CHECK(ncclSend(a2aIn[r] + offset(r, q, true), block(r, q), ncclInt32, q, comms[size_t(r)], st) == ncclSuccess);
      CHECK(ncclRecv(a2aOut[r] + offset(r, q, false), block(q, r), ncclInt32, q, comms[size_t(r)], st) ==
            ncclSuccess);
    }
    CHECK(ncclGroupEnd() == ncclSuccess);
    // A PreMulSum all-reduce is captured (scaled into its output, summed
    // in place there), out of place and in place; a reduce-scatter's is
    // refused before anything is issued.
    const int32_t k = 2;
    ncclRedOp_t twice;
    REQUIRE(ncclRedOpCreatePreMulSum(&twice, const_cast<int32_t*>(&k), ncclInt32, ncclScalarHostImmediate,
                                     comms[size_t(r)]) == ncclSuccess);
    CHECK(ncclAllReduce(x[r], pm[r], n, ncclInt32, twice, comms[size_t(r)], st) == ncclSuccess);
    CHECK(ncclAllReduce(pmIn[r], pmIn[r], 100, ncclInt32, twice, comms[size_t(r)], st) == ncclSuccess);
    if (r == 0) {
      CHECK(ncclReduceScatter(x[0], y[0], 10, ncclInt32, twice, comms[0], st) == ncclInvalidUsage);
      CHECK(std::string(ncclGetLastError(comms[0])).find("supported for ncclAllReduce only") != std::string::npos);
    }
    CHECK(ncclRedOpDestroy(twice, comms[size_t(r)]) == ncclSuccess);
    graphs[size_t(r)] = sim.world.rank(r).endCapture(&keys[r]);
  }
  CHECK(ipcRound(comms[0]) == round);
  for (int rep = 0; rep < 3; ++rep) {
    for (int r = 0; r < N; ++r) {
      for (size_t i = 0; i < n; ++i) x[r][i] = in(rep, r, i);
      for (size_t i = 0; i < offset(r, N, true); ++i) a2aIn[r][i] = in(rep, r, i) * 3 + 1;
      for (size_t i = 0; i < offset(r, N, false); ++i) a2aOut[r][i] = -1;
      for (size_t i = 0; i < 100; ++i) pmIn[r][i] = in(rep, r, i + 7);
    }
    for (int r = 0; r < N; ++r) sim.world.rank(r).launchGraph(&keys[r], graphs[size_t(r)]);
    REQUIRE(sim.sync(&err));
    long wrong = 0;
    for (int r = 0; r < N; ++r) {
      for (size_t i = 0; i < n; ++i) wrong += y[r][i] != in(rep, 0, i) + in(rep, 1, i) + in(rep, 2, i);
      for (int q = 0; q < N; ++q)
        for (size_t i = 0; i < 10; ++i) wrong += g[r][size_t(q) * 10 + i] != in(rep, q, i);
    }
    for (int r = 0; r < N; ++r) {
      for (size_t i = 0; i < n; ++i) wrong += pm[r][i] != 2 * (in(rep, 0, i) + in(rep, 1, i) + in(rep, 2, i));
      for (size_t i = 0; i < 100; ++i)
        wrong += pmIn[r][i] != 2 * (in(rep, 0, i + 7) + in(rep, 1, i + 7) + in(rep, 2, i + 7));
    }
    for (int r = 0; r < N; ++r)
      for (int q = 0; q < N; ++q)
        for (size_t i = 0; i < block(q, r); ++i)
          wrong += a2aOut[r][offset(r, q, false) + i] != in(rep, q, offset(q, r, true) + i) * 3 + 1;
    CHECK(wrong == 0);
  }
  for (ncclComm_t c : comms) CHECK(ncclCommDestroy(c) == ncclSuccess);
}
