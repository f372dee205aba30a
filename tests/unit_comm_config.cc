// The config form of init (loomCommInitRankConfig, loomConfig_t) and the
// device queries (loomCommCuDevice, loomCudaDeviceCount): host
// communicators, CUDA ones on the simulated device named by the config
// (not by LOOM_DEVICE or the current device), the device reaching the
// driver and surviving a split, and every bad field refused with a message
// that names it, before anything waits for a peer.
#include <atomic>
#include "loom_catch.h"
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/device/device_choice.h"
#include "tests/sim_device.h"
#include "tests/sim_driver.h"

namespace {

using loomsim::SimDriver;
using loomsim::SimMemory;

// `devices` simulated devices for CUDA communicators, LOOM_DEVICE unset (the
// config alone asks for CUDA).  The factory records the device each rank's
// init asked for; -1 (none named) puts rank r on device r % devices.
struct SimDevices {
  SimMemory mem;
  loomsim::SimDeviceWorld world;
  std::mutex mu;
  std::vector<int> asked;  // by rank: the device init passed to the factory
  SimDevices(int nranks, int devices) : world(nranks, devices, 256), asked(size_t(nranks), -100) {
    unsetenv("LOOM_DEVICE");
    loom::configReload();
    loom::setDeviceDriverFactoryForTesting(
        [this, devices](int r, int, int device) {
          {
            std::lock_guard<std::mutex> g(mu);
            asked[size_t(r)] = device;
          }
          return std::make_unique<SimDriver>(mem, &world, r, device >= 0 ? device : r % devices);
        },
        devices);
  }
  ~SimDevices() {
    loom::setDeviceDriverFactoryForTesting(nullptr);
    CHECK(loom::waitDeviceRemains(30000));  // the reaper may hold memory of this test's device
    CHECK(mem.freedWhileMapped() == 0);
  }
};

// n ranks as threads, each with its own config (nullptr: loomCommInitRank).
std::vector<loomComm_t> initAll(int n, const std::vector<const loomConfig_t*>& configs, std::string* err) {
  loomUniqueId id;
  if (loomGetUniqueId(&id) != loomSuccess) return {};
  std::vector<loomComm_t> comms(size_t(n), nullptr);
  std::vector<loomResult_t> rcs(size_t(n), loomSuccess);
  std::vector<std::string> errs(static_cast<size_t>(n));
  std::vector<std::thread> ts;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      rcs[size_t(r)] = loomCommInitRankConfig(&comms[size_t(r)], n, id, r, configs[size_t(r)]);
      errs[size_t(r)] = loomGetLastError(nullptr);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < n; ++r)
    if (rcs[size_t(r)] != loomSuccess) {
      *err = errs[size_t(r)];
      for (loomComm_t c : comms) loomCommDestroy(c);
      return {};
    }
  return comms;
}

// The call's result and message for a config that is refused before init
// waits for anyone (one rank of two: a hang if it were not refused).
loomResult_t refused(const loomConfig_t& config, std::string* msg) {
  static loomUniqueId id;
  static bool made = loomGetUniqueId(&id) == loomSuccess;
  REQUIRE(made);
  loomComm_t comm = reinterpret_cast<loomComm_t>(uintptr_t(1));
  loomResult_t r = loomCommInitRankConfig(&comm, 2, id, 1, &config);
  *msg = loomGetLastError(nullptr);
  CHECK(comm == nullptr);
  return r;
}

}  // namespace

TEST_CASE(
    "loomCommInitRankConfig on the host: deviceKind host, FromEnv (LOOM_DEVICE unset) and a NULL config "
    "make host communicators (loomCommCuDevice -1) that run collectives",
    "[devcomm][config]") {
  unsetenv("LOOM_DEVICE");
  loom::configReload();
  loomConfig_t host = LOOM_CONFIG_INITIALIZER;
  host.deviceKind = loomDeviceHost;
  loomConfig_t fromEnv = LOOM_CONFIG_INITIALIZER;
  CHECK(fromEnv.size == sizeof(loomConfig_t));
  CHECK(fromEnv.magic == LOOM_CONFIG_MAGIC);
  CHECK(fromEnv.version == LOOM_CONFIG_VERSION);
  CHECK(fromEnv.deviceKind == loomDeviceFromEnv);
  CHECK(fromEnv.cudaDevice == -1);
  std::string err;
  std::vector<loomComm_t> comms = initAll(3, {&host, &fromEnv, nullptr}, &err);
  INFO(err);
  REQUIRE(comms.size() == 3);
  for (loomComm_t c : comms) {
    int dev = 7;
    CHECK(loomCommCuDevice(c, &dev) == loomSuccess);
    CHECK(dev == -1);
    CHECK(c->deviceComm() == nullptr);
  }
  std::vector<int64_t> out(3);
  std::vector<std::thread> ts;
  for (int r = 0; r < 3; ++r)
    ts.emplace_back([&, r] {
      int64_t v = r + 1;
      loomAllReduce(&v, &out[size_t(r)], 1, loomInt64, loomSum, comms[size_t(r)], nullptr);
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < 3; ++r) CHECK(out[size_t(r)] == 6);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
  CHECK(loomCommCuDevice(nullptr, nullptr) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("comm is NULL") != std::string::npos);
}

TEST_CASE(
    "loomCommInitRankConfig on simulated CUDA devices: the config's cudaDevice reaches the driver (rank 0 on "
    "device 1, rank 1 on device 0, whatever the current device), loomCommCuDevice reports it, a split keeps "
    "it, and an all-reduce on those devices is exact",
    "[devcomm][config]") {
  SimDevices sim(2, 2);
  int count = -1;
  CHECK(loomCudaDeviceCount(&count) == loomSuccess);
  CHECK(count == 2);
  loomConfig_t c0 = LOOM_CONFIG_INITIALIZER, c1 = LOOM_CONFIG_INITIALIZER;
  c0.deviceKind = loomDeviceCuda, c0.cudaDevice = 1;
  c1.deviceKind = loomDeviceAuto, c1.cudaDevice = 0;  // auto: the (simulated) devices are there
  std::string err;
  std::vector<loomComm_t> comms = initAll(2, {&c0, &c1}, &err);
  INFO(err);
  REQUIRE(comms.size() == 2);
  CHECK(sim.asked[0] == 1);
  CHECK(sim.asked[1] == 0);
  int dev[2] = {-5, -5};
  for (int r = 0; r < 2; ++r) {
    CHECK(loomCommCuDevice(comms[size_t(r)], &dev[r]) == loomSuccess);
    REQUIRE(comms[size_t(r)]->deviceComm() != nullptr);
  }
  CHECK(dev[0] == 1);
  CHECK(dev[1] == 0);

  // Buffers on each rank's own device; the stream is a cudaStream_t (never
  // dereferenced by the simulated device).
  const size_t n = 3000;
  auto* stream = reinterpret_cast<loomStream_t>(uintptr_t(0x7e57));
  int32_t* buf[2];
  for (int r = 0; r < 2; ++r) {
    buf[r] = reinterpret_cast<int32_t*>(sim.mem.alloc(dev[r], n * 4));
    for (size_t i = 0; i < n; ++i) buf[r][i] = int32_t(i) * (r + 1);
  }
  for (int r = 0; r < 2; ++r)
    CHECK(loomAllReduce(buf[r], buf[r], n, loomInt32, loomSum, comms[size_t(r)], stream) == loomSuccess);
  for (int r = 0; r < 2; ++r) {
    std::string msg;
    CHECK(sim.world.rank(r).synchronize(&msg) == loomSuccess);
  }
  long wrong = 0;
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) wrong += buf[r][i] != int32_t(i) * 3;
  CHECK(wrong == 0);

  // A split's communicators run where their parents do (not on the current
  // device): the factory is asked for the parent's device.
  std::vector<loomComm_t> sub(2, nullptr);
  std::vector<loomResult_t> rcs(2);
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < 2; ++r)
      ts.emplace_back([&, r] { rcs[size_t(r)] = loomCommSplit(comms[size_t(r)], 0, r, &sub[size_t(r)]); });
    for (auto& t : ts) t.join();
  }
  for (int r = 0; r < 2; ++r) {
    REQUIRE(rcs[size_t(r)] == loomSuccess);
    int d = -5;
    CHECK(loomCommCuDevice(sub[size_t(r)], &d) == loomSuccess);
    CHECK(d == dev[r]);
  }
  for (loomComm_t c : sub) CHECK(loomCommDestroy(c) == loomSuccess);
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);

  // No device named: the factory is asked for the current device (-1).
  loomConfig_t cur = LOOM_CONFIG_INITIALIZER;
  cur.deviceKind = loomDeviceCuda;
  comms = initAll(2, {&cur, &cur}, &err);
  REQUIRE(comms.size() == 2);
  CHECK(sim.asked[0] == -1);
  CHECK(sim.asked[1] == -1);
  for (int r = 0; r < 2; ++r) {
    int d = -5;
    CHECK(loomCommCuDevice(comms[size_t(r)], &d) == loomSuccess);
    CHECK(d == r % 2);  // the factory's choice for the current device
  }
  for (loomComm_t c : comms) CHECK(loomCommDestroy(c) == loomSuccess);
}

TEST_CASE(
    "loomCommInitRankConfig refuses each bad field with loomInvalidArgument naming it (magic, version older "
    "and newer, size, deviceKind, cudaDevice, host with a device, a device beyond the process's), and CUDA "
    "without a device as LOOM_DEVICE=cuda does, before waiting for any peer",
    "[devcomm][config]") {
  unsetenv("LOOM_DEVICE");
  loom::configReload();
  std::string msg;
  auto expect = [&](loomConfig_t c, loomResult_t code, const std::string& text) {
    CHECK(refused(c, &msg) == code);
    INFO(msg);
    CHECK(msg.find("loomCommInitRankConfig: ") == 0);
    CHECK(msg.find(text) != std::string::npos);
  };
  loomConfig_t c = LOOM_CONFIG_INITIALIZER;
  c.magic = 0;
  expect(c, loomInvalidArgument, "not initialised with LOOM_CONFIG_INITIALIZER (magic 0x0");
  c = LOOM_CONFIG_INITIALIZER;
  c.version = LOOM_CONFIG_VERSION + 1;  // a newer loom.h than this library
  expect(c, loomInvalidArgument, "config version 3: this library");
  CHECK(msg.find("knows loomConfig_t versions 1 to 2") != std::string::npos);
  c.version = 0;
  expect(c, loomInvalidArgument, "config version 0");
  c = LOOM_CONFIG_INITIALIZER;
  c.size = sizeof(loomConfig_t) + 8;  // version 2 with a size it never had
  expect(c, loomInvalidArgument, "config size");
  CHECK(msg.find("a version 2 loomConfig_t has " + std::to_string(sizeof(loomConfig_t)) + " bytes") !=
        std::string::npos);
  c = LOOM_CONFIG_INITIALIZER;
  c.timeoutMs = -5;
  expect(c, loomInvalidArgument, "config timeoutMs -5");
  c = LOOM_CONFIG_INITIALIZER;
  c.deviceKind = 7;
  expect(c, loomInvalidArgument, "config deviceKind 7 is not a loomDeviceKind_t");
  c.deviceKind = -1;
  expect(c, loomInvalidArgument, "config deviceKind -1");
  c = LOOM_CONFIG_INITIALIZER;
  c.cudaDevice = -2;
  expect(c, loomInvalidArgument, "config cudaDevice -2: expected a CUDA device ordinal");
  c = LOOM_CONFIG_INITIALIZER;
  c.deviceKind = loomDeviceHost;
  c.cudaDevice = 0;
  expect(c, loomInvalidArgument, "config cudaDevice 0 names a CUDA device, but deviceKind is loomDeviceHost");
  CHECK(loomCommInitRankConfig(nullptr, 2, loomUniqueId{}, 0, &c) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("comm is NULL") != std::string::npos);

  // CUDA asked for by the config on this process's real devices.
  int devices = -1;
  REQUIRE(loomCudaDeviceCount(&devices) == loomSuccess);
  c = LOOM_CONFIG_INITIALIZER;
  c.deviceKind = loomDeviceCuda;
  if (devices == 0) {  // no GPU (CI): the error LOOM_DEVICE=cuda gives
    expect(c, loomInvalidUsage,
           "config deviceKind loomDeviceCuda, but this process has no usable CUDA device");
    c.cudaDevice = 3;
    expect(c, loomInvalidUsage, "no usable CUDA device");
  } else {
    c.cudaDevice = devices;
    expect(c, loomInvalidArgument, "config cudaDevice " + std::to_string(devices) + ": this process has");
  }
  int* none = nullptr;
  CHECK(loomCudaDeviceCount(none) == loomInvalidArgument);

  // A device beyond the simulated ones.
  {
    SimDevices sim(2, 2);
    c = LOOM_CONFIG_INITIALIZER;
    c.deviceKind = loomDeviceCuda;
    c.cudaDevice = 2;
    expect(c, loomInvalidArgument, "config cudaDevice 2: this process has 2 CUDA devices (0 to 1)");
    c.deviceKind = loomDeviceFromEnv;  // LOOM_DEVICE unset: the host, which ignores cudaDevice
    loomUniqueId id;
    REQUIRE(loomGetUniqueId(&id) == loomSuccess);
    loomComm_t comm = nullptr;
    CHECK(loomCommInitRankConfig(&comm, 1, id, 0, &c) == loomSuccess);
    int d = 0;
    CHECK(loomCommCuDevice(comm, &d) == loomSuccess);
    CHECK(d == -1);
    CHECK(loomCommDestroy(comm) == loomSuccess);
  }
}

TEST_CASE("loomConfig_t timeoutMs bounds init (a rank that never joins fails it within that time) and is the "
          "communicator's timeout after it, and a version 1 config (without the field) is still read as one",
          "[config]") {
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomConfig_t c = LOOM_CONFIG_INITIALIZER;
  c.deviceKind = loomDeviceHost;
  c.timeoutMs = 400;
  loomComm_t comm = nullptr;
  const int64_t t0 = loom::nowMs();
  CHECK(loomCommInitRankConfig(&comm, 2, id, 0, &c) == loomTimeout);  // rank 1 never comes
  const int64_t waited = loom::nowMs() - t0;
  const std::string msg = loomGetLastError(nullptr);
  INFO(msg);
  CHECK(msg.find("missing: 1") != std::string::npos);
  CHECK(waited >= 350);
  CHECK(waited < 5000);  // LOOM_TIMEOUT_MS is 10 minutes unless set
  CHECK(comm == nullptr);

  // Version 1: 24 bytes, no timeoutMs; whatever follows is not read.
  struct {
    loomConfig_t c;
  } v1{};
  v1.c = LOOM_CONFIG_INITIALIZER;
  v1.c.version = 1;
  v1.c.size = offsetof(loomConfig_t, timeoutMs);
  v1.c.deviceKind = loomDeviceHost;
  v1.c.timeoutMs = -77;  // past a version 1 struct's end: ignored
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  CHECK(loomCommInitRankConfig(&comm, 1, id, 0, &v1.c) == loomSuccess);
  REQUIRE(comm != nullptr);
  float x = 2;
  CHECK(loomAllReduce(&x, &x, 1, loomFloat32, loomSum, comm, nullptr) == loomSuccess);
  CHECK(x == 2);
  CHECK(loomCommDestroy(comm) == loomSuccess);
}
