// The memory/device seam: the host device, memory kinds the executor refuses,
// reduce_ops.h against the host kernels, and loomStream_t handles that are
// not loom streams (a cudaStream_t, garbage) failing cleanly instead of
// being dereferenced.
#include "loom_catch.h"
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
#include "loom.h"
#include "src/device/device.h"
#include "src/device/host_reduce.h"
#include "src/device/reduce_ops.h"
#include "tests/sim_transport.h"

namespace loom {
namespace detail {
void hostReduceForceGeneric(bool on);  // defined in host_reduce.cc (test hook)
}
}  // namespace loom

namespace {

const loomDataType_t kTypes[] = {loomInt8,    loomUint8,   loomInt32,   loomUint32,  loomInt64,
                                 loomUint64,  loomFloat16, loomBfloat16, loomFloat32, loomFloat64};
const loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

// reduce_ops.h, one element at a time, as a CUDA kernel would use it.
template <class Ty>
void elementwiseReduce(void* dst, const void* a, const void* b, size_t n, loomRedOp_t op) {
  using namespace loom::elementwise;
  using S = typename Ty::Store;
  for (size_t i = 0; i < n; ++i) {
    S x, y, r{};
    memcpy(&x, static_cast<const char*>(a) + i * sizeof(S), sizeof(S));
    memcpy(&y, static_cast<const char*>(b) + i * sizeof(S), sizeof(S));
    switch (op) {
      case loomSum: r = reduce<Ty, OpOf<loomSum>::type>(x, y); break;
      case loomProd: r = reduce<Ty, OpOf<loomProd>::type>(x, y); break;
      case loomMax: r = reduce<Ty, OpOf<loomMax>::type>(x, y); break;
      case loomMin: r = reduce<Ty, OpOf<loomMin>::type>(x, y); break;
      case loomAvg: r = reduce<Ty, OpOf<loomAvg>::type>(x, y); break;
      default: break;
    }
    memcpy(static_cast<char*>(dst) + i * sizeof(S), &r, sizeof(S));
  }
}
template <class Ty>
void elementwiseDivide(void* dst, const void* src, size_t n, int divisor) {
  using S = typename Ty::Store;
  for (size_t i = 0; i < n; ++i) {
    S x;
    memcpy(&x, static_cast<const char*>(src) + i * sizeof(S), sizeof(S));
    S r = loom::elementwise::divide<Ty>(x, typename Ty::Divisor(divisor));
    memcpy(static_cast<char*>(dst) + i * sizeof(S), &r, sizeof(S));
  }
}

template <int T>
using Elem = typename loom::elementwise::ElemOf<T>::type;

void elementwiseBoth(loomDataType_t t, loomRedOp_t op, int divisor, void* red, void* div, const void* a,
                     const void* b, size_t n) {
  switch (t) {
#define LOOM_CASE(T)                                 \
  case T:                                            \
    elementwiseReduce<Elem<T>>(red, a, b, n, op);    \
    elementwiseDivide<Elem<T>>(div, a, n, divisor);  \
    break;
    LOOM_CASE(loomInt8)
    LOOM_CASE(loomUint8)
    LOOM_CASE(loomInt32)
    LOOM_CASE(loomUint32)
    LOOM_CASE(loomInt64)
    LOOM_CASE(loomUint64)
    LOOM_CASE(loomFloat16)
    LOOM_CASE(loomBfloat16)
    LOOM_CASE(loomFloat32)
    LOOM_CASE(loomFloat64)
#undef LOOM_CASE
    default: break;
  }
}

TEST_CASE("reduce_ops.h one element at a time gives the bits of the host kernels, every type and op",
          "[device]") {
  std::mt19937_64 rng(13);
  const size_t n = 1000;  // not a multiple of any vector width: the tails run too
  for (bool generic : {false, true}) {
    loom::detail::hostReduceForceGeneric(generic);
    for (loomDataType_t t : kTypes) {
      size_t bytes = n * loom::dtypeSize(t);
      std::vector<uint8_t> a(bytes), b(bytes);
      for (auto& x : a) x = uint8_t(rng());
      for (auto& x : b) x = uint8_t(rng());
      // Some equal and NaN-heavy elements too (max/min NaN rules, ties).
      memcpy(b.data(), a.data(), bytes / 8);
      for (loomRedOp_t op : kOps) {
        std::vector<uint8_t> want(bytes), got(bytes), wantDiv(bytes), gotDiv(bytes);
        loom::reduceHost(want.data(), a.data(), b.data(), n, t, op);
        loom::divideHost(wantDiv.data(), a.data(), n, t, 3);
        elementwiseBoth(t, op, 3, got.data(), gotDiv.data(), a.data(), b.data(), n);
        INFO(loom::dtypeName(t) << " " << loom::redOpName(op) << (generic ? " (baseline ISA)" : ""));
        CHECK(memcmp(want.data(), got.data(), bytes) == 0);
        CHECK(memcmp(wantDiv.data(), gotDiv.data(), bytes) == 0);
      }
    }
  }
  loom::detail::hostReduceForceGeneric(false);
}

TEST_CASE("the host device allocates aligned memory, copies, reduces and divides like the host kernels",
          "[device]") {
  loom::Device& dev = loom::hostDevice();
  CHECK(std::string(dev.name()) == "host");
  CHECK(dev.memoryKind() == loom::MemoryKind::Host);
  CHECK(dev.canAccess(loom::MemoryKind::Host));
  CHECK(dev.canAccess(loom::MemoryKind::RegisteredHost));
  CHECK_FALSE(dev.canAccess(loom::MemoryKind::CudaDevice));
  CHECK(&loom::hostDevice() == &dev);

  const size_t n = 1 << 20;
  auto* a = static_cast<float*>(dev.allocate(n * 4));
  auto* b = static_cast<float*>(dev.allocate(n * 4));
  auto* c = static_cast<float*>(dev.allocate(n * 4));
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(c);
  CHECK(reinterpret_cast<uintptr_t>(a) % 4096 == 0);
  for (size_t i = 0; i < n; ++i) a[i] = float(i % 1000), b[i] = 2.0f;
  dev.reduce(c, a, b, n, loomFloat32, loomSum);
  CHECK(c[999] == 1001.0f);
  dev.divide(c, c, n, loomFloat32, 2);
  CHECK(c[999] == 500.5f);
  for (loom::CopyHint hint : {loom::CopyHint::Cached, loom::CopyHint::Streaming}) {
    memset(c, 0, n * 4);
    dev.copy(c + 1, a + 3, (n - 8) * 4, hint);  // unaligned both sides
    CHECK(c[0] == 0.0f);
    CHECK(memcmp(c + 1, a + 3, (n - 8) * 4) == 0);
    CHECK(c[n - 7] == 0.0f);
  }
  dev.copy(a + 1, a, 100 * 4, loom::CopyHint::Cached);  // cached copies may overlap
  CHECK(a[1] == 0.0f);
  CHECK(a[100] == 99.0f);
  dev.free(a);
  dev.free(b);
  dev.free(c);
  dev.free(nullptr);
}

TEST_CASE("the executor refuses a buffer in memory its device cannot access, naming the kind", "[device]") {
  std::vector<float> send[2], recv[2];
  for (int r = 0; r < 2; ++r) send[r].assign(64, 1.0f), recv[r].assign(64, 0.0f);
  loom::OpDesc op;
  op.coll = loom::Collective::AllReduce;
  op.count = 64;
  op.recvMem = loom::MemoryKind::CudaDevice;
  loomsim::SimResult res = loomsim::simulate(loom::ringSchedule, op, 2, {send[0].data(), send[1].data()},
                                             {recv[0].data(), recv[1].data()});
  REQUIRE_FALSE(res.ok());
  REQUIRE(res.errors.size() == 2);
  for (const std::string& e : res.errors)
    CHECK_THAT(e, loom_test::contains("in CUDA device memory, which the host device cannot access"));
  CHECK(recv[0][0] == 0.0f);  // nothing was touched

  op.sendMem = op.recvMem = loom::MemoryKind::RegisteredHost;
  res = loomsim::simulate(loom::ringSchedule, op, 2, {send[0].data(), send[1].data()},
                          {recv[0].data(), recv[1].data()});
  CHECK(res.ok());
  CHECK(recv[1][63] == 2.0f);
}

// A communicator of one rank: enough to reach the stream checks.
struct OneRank {
  loomComm_t comm = nullptr;
  OneRank() {
    loomUniqueId id;
    REQUIRE(loomGetUniqueId(&id) == loomSuccess);
    REQUIRE(loomCommInitRank(&comm, 1, id, 0) == loomSuccess);
  }
  ~OneRank() { loomCommDestroy(comm); }
};

const char kNotLoom[] = "is not a loom stream; a CUDA stream needs a CUDA communicator (LOOM_DEVICE=cuda)";

TEST_CASE("a stream handle that is not a loom stream fails with loomInvalidArgument, without being read",
          "[device][stream]") {
  OneRank one;
  float x[4] = {1, 2, 3, 4};
  // Garbage that a dereference would accept as a stream, and an address that
  // a dereference would fault on (as a cudaStream_t would in host code).
  alignas(64) static unsigned char garbage[256];
  memset(garbage, 0xab, sizeof garbage);
  for (loomStream_t fake : {reinterpret_cast<loomStream_t>(garbage), reinterpret_cast<loomStream_t>(uintptr_t(0x10))}) {
    CHECK(loomAllReduce(x, x, 4, loomFloat32, loomSum, one.comm, fake) == loomInvalidArgument);
    CHECK_THAT(loomGetLastError(one.comm), loom_test::contains(kNotLoom));
    CHECK_THAT(loomGetLastError(one.comm), loom_test::contains("loomAllReduce"));
    CHECK(loomBroadcast(x, x, 4, loomFloat32, 0, one.comm, fake) == loomInvalidArgument);
    CHECK(loomStreamSynchronize(fake) == loomInvalidArgument);
    CHECK_THAT(loomGetLastError(nullptr), loom_test::contains(kNotLoom));
    CHECK(loomStreamQuery(fake) == loomInvalidArgument);
    CHECK(loomStreamDestroy(fake) == loomInvalidArgument);
    CHECK_THAT(loomGetLastError(nullptr), loom_test::contains(kNotLoom));

    // In a group the bad member stops the whole group.
    REQUIRE(loomGroupStart() == loomSuccess);
    CHECK(loomAllReduce(x, x, 4, loomFloat32, loomSum, one.comm, fake) == loomInvalidArgument);
    CHECK(loomGroupEnd() == loomInvalidArgument);
    CHECK_THAT(loomGetLastError(nullptr), loom_test::contains(kNotLoom));
  }
  CHECK(memcmp(garbage, std::string(sizeof garbage, '\xab').data(), sizeof garbage) == 0);
  CHECK(x[3] == 4.0f);
  loomResult_t async = loomInternalError;
  CHECK(loomCommGetAsyncError(one.comm, &async) == loomSuccess);
  CHECK(async == loomSuccess);  // the communicator is still usable
  CHECK(loomAllReduce(x, x, 4, loomFloat32, loomSum, one.comm, nullptr) == loomSuccess);
}

TEST_CASE("loom host streams run operations, a destroyed handle is refused, not freed twice",
          "[device][stream]") {
  OneRank one;
  loomStream_t s = nullptr, t = nullptr;
  REQUIRE(loomStreamCreate(&s) == loomSuccess);
  REQUIRE(loomStreamCreate(&t) == loomSuccess);
  CHECK(s != t);
  float x[4] = {1, 2, 3, 4}, y[4] = {};
  CHECK(loomAllReduce(x, y, 4, loomFloat32, loomSum, one.comm, s) == loomSuccess);
  REQUIRE(loomGroupStart() == loomSuccess);
  CHECK(loomBroadcast(y, y, 4, loomFloat32, 0, one.comm, t) == loomSuccess);
  REQUIRE(loomGroupEnd() == loomSuccess);
  CHECK(loomStreamSynchronize(s) == loomSuccess);
  CHECK(loomStreamSynchronize(t) == loomSuccess);
  CHECK(loomStreamQuery(s) == loomSuccess);
  CHECK(y[3] == 4.0f);
  CHECK(loomStreamDestroy(s) == loomSuccess);
  CHECK(loomStreamDestroy(s) == loomInvalidArgument);
  CHECK_THAT(loomGetLastError(nullptr), loom_test::contains("was destroyed"));
  CHECK(loomAllReduce(x, y, 4, loomFloat32, loomSum, one.comm, s) == loomInvalidArgument);
  CHECK(loomStreamSynchronize(s) == loomInvalidArgument);
  CHECK(loomStreamDestroy(t) == loomSuccess);
  CHECK(loomStreamDestroy(nullptr) == loomSuccess);
}

}  // namespace
