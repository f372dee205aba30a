// The host side of the CUDA device path, on machines with or without a GPU:
// how CudaStreamBackend maps stream-program ops onto CUDA calls (through a
// recording CudaApi table: this checks loom's mapping, not CUDA, which only
// tests/gpu/run.sh exercises), the CUDA plug-in loading and counting zero
// devices where there is no GPU, LOOM_DEVICE at init, and device pointers
// given to a host communicator.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>
#include <vector>

#include "algorithms/stream_collectives.h"
#include "loom.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/device/cuda_loader.h"
#include "src/device/cuda_stream_backend.h"

namespace {

// Every call the backend makes, as text, in order.
std::vector<std::string> g_calls;
int g_failMemcpy = 0;

std::string ptr(const void* p) { return loom::strf("%p", p); }

const loom::CudaApi kRecording = {
    loom::kCudaApiVersion,
    [](void* s, const uint64_t* a, uint64_t v) {
      g_calls.push_back("wait " + ptr(s) + " " + ptr(a) + " >= " + std::to_string(v));
      return 0;
    },
    [](void* s, uint64_t* a, uint64_t v) {
      g_calls.push_back("write " + ptr(s) + " " + ptr(a) + " = " + std::to_string(v));
      return 0;
    },
    [](void* d, const void* src, size_t n, void* s) {
      g_calls.push_back("memcpy " + ptr(s) + " " + ptr(d) + " <- " + ptr(src) + " " + std::to_string(n));
      return g_failMemcpy;
    },
    [](void* d, const void* const* srcs, int ns, size_t n, int t, int op, void* s) {
      std::string c = "reduce " + ptr(s) + " " + ptr(d) + " <-";
      for (int i = 0; i < ns; ++i) c += " " + ptr(srcs[i]);
      g_calls.push_back(c + loom::strf(" n=%zu t=%d op=%d", n, t, op));
      return 0;
    },
    [](void* d, const void* src, size_t n, int t, int div, void* s) {
      g_calls.push_back(loom::strf("divide %p %p <- %p n=%zu t=%d /%d", s, d, src, n, t, div));
      return 0;
    },
    [](void* e, void* s) {
      g_calls.push_back("record " + ptr(e) + " on " + ptr(s));
      return 0;
    },
    [](void* s, void* e) {
      g_calls.push_back("waitevent " + ptr(s) + " on " + ptr(e));
      return 0;
    },
    [](int e) { return e == 700 ? "an illegal memory access was encountered" : "?"; },
    [](int* n) {
      *n = 0;
      return 0;
    },
    [](const void*, int* d) {
      *d = -1;
      return 0;
    },
    // The communicator's resources: the backend never calls them.
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
    nullptr,
};

void* handle(uintptr_t v) { return reinterpret_cast<void*>(v); }

}  // namespace

TEST_CASE(
    "CUDA backend: every stream-program op becomes its one CUDA call, on the right stream and addresses",
    "[cuda]") {
  // Rank 1 of 3, reduce-scatter + all-gather all-reduce: two streams, both
  // events, waits, writes, copies, reductions and the avg divide.
  const int N = 3, me = 1;
  std::vector<float> send(600), recv(600);
  std::vector<std::vector<uint8_t>> win(N, std::vector<uint8_t>(4096));
  std::vector<std::vector<uint64_t>> flags(N, std::vector<uint64_t>(loom::kFlagCount));
  loom::OpDesc op;
  op.sendbuf = send.data();
  op.recvbuf = recv.data();
  op.count = 600;
  op.op = loomAvg;
  uint64_t round = 0;
  loom::StreamProgram p =
      loom::compileStreamProgram(op, me, N, loom::StreamAlgorithm::ReduceScatterAllGather, 2048, &round);
  loom::ProgramBuffers b;
  b.send = send.data();
  b.sendBytes = b.recvBytes = 2400;
  b.recv = recv.data();
  b.windowBytes = 4096;
  for (int r = 0; r < N; ++r) {
    b.windows.push_back(win[size_t(r)].data());
    b.flags.push_back(flags[size_t(r)].data());
  }
  void *s0 = handle(0x5000), *s1 = handle(0x5100), *e0 = handle(0xe000), *e1 = handle(0xe100);
  loom::CudaStreamBackend be(kRecording, {s0, s1}, {e0, e1});
  g_calls.clear();
  loom::enqueueProgram(be, p, b);
  INFO(p.describe());
  REQUIRE(g_calls.size() == p.ops.size());  // one call per op (no reduce has more than 8 sources)
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const loom::StreamOp& o = p.ops[i];
    const std::string& c = g_calls[i];
    void* s = o.stream ? s1 : s0;
    INFO("op " << i << ": " << c);
    switch (o.kind) {
      case loom::StreamOpKind::WaitFlag:
        CHECK(c == "wait " + ptr(s) + " " + ptr(&flags[size_t(o.flagRank)][o.flag]) +
                       " >= " + std::to_string(o.value));
        break;
      case loom::StreamOpKind::SetFlag:
        CHECK(c == "write " + ptr(s) + " " + ptr(&flags[me][o.flag]) + " = " + std::to_string(o.value));
        break;
      case loom::StreamOpKind::Copy:
        CHECK(c.rfind("memcpy " + ptr(s), 0) == 0);
        break;
      case loom::StreamOpKind::Reduce:
        CHECK(c.rfind("reduce " + ptr(s), 0) == 0);
        CHECK(c.find(loom::strf("n=%zu t=%d op=%d", o.count, int(loomFloat32), int(loomAvg))) !=
              std::string::npos);
        break;
      case loom::StreamOpKind::Divide:
        CHECK(c.find(loom::strf("/%d", N)) != std::string::npos);
        break;
      case loom::StreamOpKind::RecordEvent:
        CHECK(c == "record " + ptr(o.event ? e1 : e0) + " on " + ptr(s));
        break;
      case loom::StreamOpKind::WaitEvent:
        CHECK(c == "waitevent " + ptr(s) + " on " + ptr(o.event ? e1 : e0));
        break;
    }
  }
}

TEST_CASE("CUDA backend: a reduction of more sources than one launch takes is chained in source order",
          "[cuda]") {
  std::vector<const void*> srcs;
  for (uintptr_t i = 0; i < 19; ++i) srcs.push_back(handle(0x10000 + i * 0x100));
  void* dst = handle(0x90000);
  loom::CudaStreamBackend be(kRecording, {handle(0x5000)}, {});
  g_calls.clear();
  be.reduce(0, dst, srcs.data(), 19, 1000, loomBfloat16, loomSum);
  // 8, then dst + 7, then dst + 4: 19 sources, left to right.
  REQUIRE(g_calls.size() == 3);
  auto expect = [&](std::vector<const void*> in) {
    std::string c = "reduce " + ptr(handle(0x5000)) + " " + ptr(dst) + " <-";
    for (const void* p : in) c += " " + ptr(p);
    return c + loom::strf(" n=1000 t=%d op=%d", int(loomBfloat16), int(loomSum));
  };
  CHECK(g_calls[0] == expect({srcs.begin(), srcs.begin() + 8}));
  std::vector<const void*> second{dst};
  second.insert(second.end(), srcs.begin() + 8, srcs.begin() + 15);
  CHECK(g_calls[1] == expect(second));
  std::vector<const void*> third{dst};
  third.insert(third.end(), srcs.begin() + 15, srcs.end());
  CHECK(g_calls[2] == expect(third));
}

TEST_CASE("CUDA backend: a failing CUDA call is loomUnhandledCudaError with CUDA's own message", "[cuda]") {
  loom::CudaStreamBackend be(kRecording, {handle(0x5000)}, {});
  g_failMemcpy = 700;
  int x = 0, y = 0;
  try {
    be.copy(0, &x, &y, 4);
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
    CHECK(std::string(e.what()) ==
          "cudaMemcpyAsync failed: an illegal memory access was encountered (CUDA error 700)");
  }
  g_failMemcpy = 0;
}

TEST_CASE("CUDA plug-in: loaded where it was built, and no GPU counts as zero devices with CUDA's reason",
          "[cuda]") {
  std::string why;
  const loom::CudaApi* api = loom::cudaPlugin(&why);
#ifdef LOOM_HAVE_CUDA_PLUGIN
  // Built with nvcc: libloom finds libloom_cuda.so and loads it even on a
  // machine without a GPU or driver (the runtime is linked statically).
  INFO(why);
  REQUIRE(api != nullptr);
  CHECK(api->abiVersion == loom::kCudaApiVersion);
#endif
  std::string devWhy;
  int n = loom::cudaDeviceCount(&devWhy);
  CHECK(n >= 0);
  if (n == 0) {
    INFO(devWhy);
    CHECK(!devWhy.empty());
    if (api) CHECK(devWhy.find("cudaGetDeviceCount") != std::string::npos);
    // Nothing is device memory then: CUDA is not even asked.
    int x = 0;
    CHECK(loom::cudaPointerDevice(&x) == -1);
  } else {
    CHECK(api != nullptr);
  }
}

namespace {

struct EnvVar {
  const char* name;
  explicit EnvVar(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~EnvVar() {
    unsetenv(name);
    loom::configReload();
  }
};

std::string initError(loomResult_t* rc) {
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  *rc = loomCommInitRank(&comm, 1, id, 0);
  std::string msg = loomGetLastError(nullptr);
  if (comm) loomCommDestroy(comm);
  return msg;
}

}  // namespace

TEST_CASE("LOOM_DEVICE: cuda without a usable GPU, or any other value but host, fails init with the reason",
          "[cuda]") {
  loomResult_t rc;
  {
    EnvVar v("LOOM_DEVICE", "cuda");
    std::string msg = initError(&rc);
    INFO(msg);
    std::string why;
    if (loom::cudaDeviceCount(&why) == 0) {
      CHECK(rc == loomInvalidUsage);
      CHECK(msg.find("LOOM_DEVICE=cuda, but this process has no usable CUDA device: " + why) !=
            std::string::npos);
      CHECK(!why.empty());  // names what is missing: the plug-in, the driver, or cudaGetDeviceCount's error
    } else {
      CHECK(rc == loomSuccess);  // a CUDA communicator on the current device
    }
  }
  {
    EnvVar v("LOOM_DEVICE", "tpu");
    std::string msg = initError(&rc);
    CHECK(rc == loomInvalidUsage);
    CHECK(msg.find("LOOM_DEVICE=tpu: expected host or cuda") != std::string::npos);
  }
  {
    EnvVar v("LOOM_DEVICE", "host");
    initError(&rc);
    CHECK(rc == loomSuccess);
  }
}

namespace {
float g_deviceBuf[16];  // what the classifier below calls CUDA memory of device 3
int classify(const void* p) {
  const char* c = static_cast<const char*>(p);
  const char* b = reinterpret_cast<const char*>(g_deviceBuf);
  return c >= b && c < b + sizeof g_deviceBuf ? 3 : -1;
}
}  // namespace

TEST_CASE("a CUDA device pointer given to a host communicator is loomInvalidArgument, naming the buffer",
          "[cuda]") {
  // The classifier stands in for cudaPointerGetAttributes, which needs a GPU;
  // what is tested is the API's answer to device memory.
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  REQUIRE(loomCommInitRank(&comm, 1, id, 0) == loomSuccess);
  loom::setCudaPointerClassifierForTesting(classify);
  float host[16] = {};
  CHECK(loomAllReduce(g_deviceBuf, host, 16, loomFloat32, loomSum, comm, nullptr) == loomInvalidArgument);
  std::string msg = loomGetLastError(comm);
  CHECK(msg.find("sendbuff " + ptr(g_deviceBuf) +
                 " is CUDA device memory (cuda:3), but this communicator runs on the host") !=
        std::string::npos);
  CHECK(loomBroadcast(host, g_deviceBuf + 4, 4, loomFloat32, 0, comm, nullptr) == loomInvalidArgument);
  msg = loomGetLastError(comm);
  CHECK(msg.find("recvbuff " + ptr(g_deviceBuf + 4) + " is CUDA device memory") != std::string::npos);
  // Host memory still works on the same communicator.
  float other[16] = {};
  for (int i = 0; i < 16; ++i) host[i] = float(i);
  CHECK(loomAllReduce(host, other, 16, loomFloat32, loomSum, comm, nullptr) == loomSuccess);
  CHECK(other[15] == 15.0f);
  loom::setCudaPointerClassifierForTesting(nullptr);
  loomCommDestroy(comm);
}
