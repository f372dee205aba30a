// The CUDA device path on a real GPU (run by tests/gpu/run.sh; needs a GPU,
// so it is not a ctest).  Prints one table row per check and exits non-zero
// on any wrong value, error or hang.
//
//   kernels   every type x op x source count (1..8, and 19 chained through
//             CudaStreamBackend), aligned and misaligned, sizes 0..1 Mi:
//             bit for bit against the host arithmetic (reduce_ops.h via
//             reduceHost, left to right), and the avg divide; loomScale's
//             kernel against scaleHost
//   programs  every collective x program variant x N ranks (threads of this
//             process, one stream each plus a side stream, all on one GPU,
//             windows and flags in device memory) x types x ops, in and out
//             of place: exact against the host reference in rank order
//   order     a slow kernel writes the input, the all-reduce follows on the
//             same stream, a kernel snapshots the output: no host sync
//             between them
//
// Usage: loom-gpu-tests [--ranks 1,2,4] [--max-count N]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "algorithms/stream_collectives.h"
#include "src/core/error.h"
#include "src/device/cuda_api.h"
#include "src/device/cuda_stream_backend.h"
#include "src/device/host_reduce.h"

extern "C" const loom::CudaApi* loomCudaPluginApi(int abiVersion);

namespace {

using loom::Collective;
using loom::StreamAlgorithm;

int g_failures = 0;
// LOOM_GPU_TRACE=1: a line per program case on stderr (what, how long), to
// tell a slow step from a hung one.
const bool g_trace = std::getenv("LOOM_GPU_TRACE") && *std::getenv("LOOM_GPU_TRACE") == '1';
const auto g_start = std::chrono::steady_clock::now();
// LOOM_GPU_WAIT_S: how long a program may take before it counts as hung.
const double g_waitSeconds = std::getenv("LOOM_GPU_WAIT_S") ? std::atof(std::getenv("LOOM_GPU_WAIT_S")) : 120.0;
double sinceStart() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - g_start).count();
}

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

void row(const char* what, const std::string& cases, long wrong, const std::string& note) {
  std::printf("%-10s %-64s %8ld  %s\n", what, cases.c_str(), wrong, wrong ? ("FAIL " + note).c_str() : "ok");
  std::fflush(stdout);
  if (wrong) ++g_failures;
}

// Waits for a stream with a deadline: a program that never completes is a
// failure, reported, not a hang of the test.
bool finish(cudaStream_t s, double seconds) {
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) (void)cudaGetLastError();  // not an error: leave none behind for the next call
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "stream error: %s\n", cudaGetErrorString(e));
      std::exit(2);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) return false;
  }
}

void fillRandom(std::vector<uint8_t>& v, loomDataType_t t, std::mt19937_64& rng) {
  const size_t esz = loom::dtypeSize(t);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (size_t i = 0; i + esz <= v.size(); i += esz) {
    float f = u(rng);
    double d = double(f) * 1.0000001;
    uint16_t h;
    uint64_t r = rng();
    switch (t) {
      case loomFloat16: h = loom::floatToHalf(f); std::memcpy(&v[i], &h, 2); break;
      case loomBfloat16: h = loom::floatToBf16(f); std::memcpy(&v[i], &h, 2); break;
      case loomFloat32: std::memcpy(&v[i], &f, 4); break;
      case loomFloat64: std::memcpy(&v[i], &d, 8); break;
      default: std::memcpy(&v[i], &r, esz);
    }
  }
}

const loomDataType_t kTypes[] = {loomInt8,  loomUint8,   loomInt32,   loomUint32,  loomInt64,
                                 loomUint64, loomFloat16, loomFloat32, loomFloat64, loomBfloat16};
const loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

void testKernels(const loom::CudaApi& api) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  loom::CudaStreamBackend be(api, {st}, {});
  std::mt19937_64 rng(1);
  long cases = 0, wrong = 0;
  std::string firstBad;
  for (loomDataType_t t : kTypes)
    for (loomRedOp_t op : kOps)
      for (int nsrcs : {1, 2, 3, 8, 19})
        for (size_t n : {size_t(0), size_t(1), size_t(4097), size_t(1) << 20})
          for (size_t misalign : {size_t(0), size_t(1)})
            for (bool dual : {false, true}) {  // dual: the result also into the first source (in place;
                                               // with 19 sources read by the first launch, written by the last)
            const size_t esz = loom::dtypeSize(t), bytes = (n + misalign) * esz;
            std::vector<std::vector<uint8_t>> in(static_cast<size_t>(nsrcs), std::vector<uint8_t>(bytes));
            std::vector<void*> dev(static_cast<size_t>(nsrcs));
            std::vector<const void*> srcs(static_cast<size_t>(nsrcs));
            for (int k = 0; k < nsrcs; ++k) {
              fillRandom(in[size_t(k)], t, rng);
              CK(cudaMalloc(&dev[size_t(k)], bytes + 16));
              CK(cudaMemcpy(dev[size_t(k)], in[size_t(k)].data(), bytes, cudaMemcpyHostToDevice));
              srcs[size_t(k)] = static_cast<uint8_t*>(dev[size_t(k)]) + misalign * esz;
            }
            void* dst;
            CK(cudaMalloc(&dst, bytes + 16));
            uint8_t* d = static_cast<uint8_t*>(dst) + misalign * esz;
            void* d2 = dual ? const_cast<void*>(srcs[0]) : nullptr;
            be.reduce(0, d, d2, srcs.data(), nsrcs, n, t, op);
            if (op == loomAvg) be.divide(0, d, d, n, t, nsrcs);
            if (!finish(st, 60)) {
              row("kernels", "reduction did not finish", 1, "hang");
              std::exit(1);
            }
            std::vector<uint8_t> got(n * esz), want(n * esz), got2(n * esz), want2;
            CK(cudaMemcpy(got.data(), d, n * esz, cudaMemcpyDeviceToHost));
            if (dual) CK(cudaMemcpy(got2.data(), d2, n * esz, cudaMemcpyDeviceToHost));
            if (n) {
              std::memcpy(want.data(), in[0].data() + misalign * esz, n * esz);
              for (int k = 1; k < nsrcs; ++k)
                loom::reduceHost(want.data(), want.data(), in[size_t(k)].data() + misalign * esz, n, t, op);
              want2 = want;  // the second destination is not divided
              if (op == loomAvg) loom::divideHost(want.data(), want.data(), n, t, nsrcs);
            }
            ++cases;
            if (got != want || (dual && n && got2 != want2)) {
              ++wrong;
              if (firstBad.empty())
                firstBad = loom::strf("%s %s nsrcs=%d n=%zu misalign=%zu%s", loom::dtypeName(t),
                                      loom::redOpName(op), nsrcs, n, misalign, dual ? " dual" : "");
            }
            for (void* p : dev) CK(cudaFree(p));
            CK(cudaFree(dst));
          }
  row("kernels", loom::strf("%ld cases: 10 types x 5 ops x 1..19 sources x sizes x 1-2 destinations", cases), wrong,
      firstBad);
  CK(cudaStreamDestroy(st));
}

// loomScale's kernel (plug-in ABI 9): every type, sizes, misaligned by one
// element, in and out of place, the scalar by value and from device
// memory: bit for bit against scaleHost.
void testScale(const loom::CudaApi& api) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::mt19937_64 rng(3);
  long cases = 0, wrong = 0;
  std::string firstBad;
  for (loomDataType_t t : kTypes)
    for (size_t n : {size_t(0), size_t(1), size_t(4097), size_t(1) << 20})
      for (size_t misalign : {size_t(0), size_t(1)})
        for (bool inPlace : {false, true})
          for (int onDevice : {0, 1}) {
            const size_t esz = loom::dtypeSize(t), bytes = (n + misalign) * esz;
            std::vector<uint8_t> in(bytes), k(esz);
            fillRandom(in, t, rng);
            fillRandom(k, t, rng);
            void *src, *dst, *kDev;
            CK(cudaMalloc(&src, bytes + 16));
            CK(cudaMalloc(&dst, bytes + 16));
            CK(cudaMalloc(&kDev, 16));
            CK(cudaMemcpy(src, in.data(), bytes, cudaMemcpyHostToDevice));
            CK(cudaMemcpy(kDev, k.data(), esz, cudaMemcpyHostToDevice));
            uint8_t* s = static_cast<uint8_t*>(src) + misalign * esz;
            uint8_t* d = inPlace ? s : static_cast<uint8_t*>(dst) + misalign * esz;
            const int rc = api.launchScale(d, s, n, int(t), onDevice ? kDev : k.data(), onDevice, st);
            if (rc != 0 || !finish(st, 60)) {
              row("scale", loom::strf("launchScale failed or did not finish (%d)", rc), 1, "error");
              std::exit(1);
            }
            std::vector<uint8_t> got(n * esz), want(n * esz);
            CK(cudaMemcpy(got.data(), d, n * esz, cudaMemcpyDeviceToHost));
            if (n) loom::scaleHost(want.data(), in.data() + misalign * esz, n, t, k.data());
            ++cases;
            if (got != want) {
              ++wrong;
              if (firstBad.empty())
                firstBad = loom::strf("%s n=%zu misalign=%zu%s%s", loom::dtypeName(t), n, misalign,
                                      inPlace ? " in place" : "", onDevice ? " device scalar" : "");
            }
            CK(cudaFree(src));
            CK(cudaFree(dst));
            CK(cudaFree(kDev));
          }
  row("scale", loom::strf("%ld cases: 10 types x sizes x alignment x in place x scalar residence", cases), wrong,
      firstBad);
  CK(cudaStreamDestroy(st));
}

// Device zero-copy's kernels: sources read through cells (CellRef) and
// the copy kernel.  Each source's real data is where its cell says, and its
// fallback holds other data, so a wrong choice shows: "published" reads
// through the cell (also misaligned by one element, which the vector
// kernel must notice), "empty" (cell 0), "short" (the cell's length does
// not hold the range) and "stale" (its tag is below the round's) read the
// fallback instead.  dst is the first
// source exactly in one of the cases (one pass: allowed up to 8 sources).
void testIndirect(const loom::CudaApi& api) {
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  loom::CudaStreamBackend be(api, {st}, {});
  std::mt19937_64 rng(2);
  long cases = 0, wrong = 0;
  std::string firstBad;
  enum Mode { Published, Empty, Short, Stale };
  for (loomDataType_t t : {loomFloat32, loomBfloat16, loomInt32, loomFloat64})
    for (int nsrcs : {1, 2, 8, 19})
      for (size_t n : {size_t(0), size_t(1), size_t(4097), size_t(1) << 20})
        for (size_t misalign : {size_t(0), size_t(1)})
          for (Mode mode : {Published, Empty, Short, Stale})
            for (bool intoFirst : {false, true}) {
              if (intoFirst && nsrcs > int(loom::kOnePassSources)) continue;
              const size_t esz = loom::dtypeSize(t), bytes = n * esz, off = 256 + misalign * esz;
              // Per source: a "peer buffer" (data at off), a fallback, and its cell.
              const std::vector<uint8_t> zeros(bytes);
              std::vector<std::vector<uint8_t>> truth(static_cast<size_t>(nsrcs), zeros),
                  decoy(static_cast<size_t>(nsrcs), zeros);
              std::vector<void*> owned;
              std::vector<const void*> fallback(static_cast<size_t>(nsrcs));
              std::vector<loom::CellRef> cells(static_cast<size_t>(nsrcs));
              uint64_t* cellMem = nullptr;
              CK(cudaMalloc(&cellMem, size_t(nsrcs) * 16 + 8));
              owned.push_back(cellMem);
              std::vector<uint64_t> cellHost(static_cast<size_t>(nsrcs) * 2 + 1);
              cellHost.back() = 5;  // the tag
              for (int k = 0; k < nsrcs; ++k) {
                fillRandom(truth[size_t(k)], t, rng);
                fillRandom(decoy[size_t(k)], t, rng);
                uint8_t *peer = nullptr, *fb = nullptr;
                CK(cudaMalloc(&peer, off + bytes + 16));
                CK(cudaMalloc(&fb, bytes + 16));
                owned.push_back(peer);
                owned.push_back(fb);
                const bool viaCell = mode == Published;  // the others read the fallback
                CK(cudaMemcpy(peer + off, (viaCell ? truth : decoy)[size_t(k)].data(), bytes, cudaMemcpyHostToDevice));
                CK(cudaMemcpy(fb, (viaCell ? decoy : truth)[size_t(k)].data(), bytes, cudaMemcpyHostToDevice));
                fallback[size_t(k)] = fb;
                cellHost[size_t(k) * 2] = mode == Empty ? 0 : uint64_t(uintptr_t(peer));
                cellHost[size_t(k) * 2 + 1] = mode == Short ? off + bytes - 1 : off + bytes;
                // Tags: cellMem's last word holds 5; "stale" needs 6.
                cells[size_t(k)] = loom::CellRef{cellMem + size_t(k) * 2, off, cellMem + size_t(nsrcs) * 2,
                                                 mode == Stale ? 6u : 5u};
              }
              if ((mode == Short || mode == Stale) && n == 0) continue;  // nothing read
              CK(cudaMemcpy(cellMem, cellHost.data(), cellHost.size() * 8, cudaMemcpyHostToDevice));
              void* dst = nullptr;
              if (intoFirst) {
                // One pass over a direct first source that is also dst.
                CK(cudaMalloc(&dst, bytes + 16));
                CK(cudaMemcpy(dst, truth[0].data(), bytes, cudaMemcpyHostToDevice));
                fallback[0] = dst;
                cells[0] = loom::CellRef{};
              } else {
                CK(cudaMalloc(&dst, bytes + 16));
              }
              owned.push_back(dst);
              be.reduceIndirect(0, dst, nullptr, fallback.data(), cells.data(), nsrcs, n, t, loomSum);
              // The copy kernel, from source 1 (or 0) through its cell.
              const int c = nsrcs > 1 ? 1 : 0;
              void* copied = nullptr;
              CK(cudaMalloc(&copied, bytes + 16));
              owned.push_back(copied);
              if (!(intoFirst && c == 0)) be.copyIndirect(0, copied, fallback[size_t(c)], cells[size_t(c)], bytes);
              if (!finish(st, 60)) {
                row("indirect", "a kernel did not finish", 1, "hang");
                std::exit(1);
              }
              std::vector<uint8_t> got(bytes), want(bytes), gotCopy(bytes);
              CK(cudaMemcpy(got.data(), dst, bytes, cudaMemcpyDeviceToHost));
              CK(cudaMemcpy(gotCopy.data(), copied, bytes, cudaMemcpyDeviceToHost));
              if (n) {
                want = truth[0];
                for (int k = 1; k < nsrcs; ++k) loom::reduceHost(want.data(), want.data(), truth[size_t(k)].data(), n, t, loomSum);
              }
              ++cases;
              const bool copyOk = (intoFirst && c == 0) || gotCopy == truth[size_t(c)];
              if (got != want || !copyOk) {
                ++wrong;
                if (firstBad.empty())
                  firstBad = loom::strf("%s nsrcs=%d n=%zu misalign=%zu mode=%d%s%s", loom::dtypeName(t), nsrcs, n,
                                        misalign, int(mode), intoFirst ? " into-first" : "", copyOk ? "" : " copy");
              }
              for (void* p : owned) CK(cudaFree(p));
            }
  row("indirect", loom::strf("%ld cases: published/empty/short/stale cells x 1..19 sources x sizes x alignment", cases),
      wrong, firstBad);
  CK(cudaStreamDestroy(st));
}

struct Ranks {
  int n;
  size_t slot;
  std::vector<cudaStream_t> streams;  // 2 per rank
  std::vector<cudaEvent_t> events;    // 2 per rank
  std::vector<uint8_t*> windows;
  uint64_t* flags = nullptr;  // n * kFlagCount, device memory
  uint64_t* cells = nullptr;  // n cell areas of n rows (device zero-copy), device memory
  std::vector<uint64_t> rounds;
  Ranks(int n_, size_t slot_) : n(n_), slot(slot_), rounds(size_t(n_), 0) {
    for (int i = 0; i < 2 * n; ++i) {
      cudaStream_t s;
      cudaEvent_t e;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      streams.push_back(s);
      events.push_back(e);
    }
    for (int r = 0; r < n; ++r) {
      void* w;
      CK(cudaMalloc(&w, loom::streamWindowBytes(slot)));
      windows.push_back(static_cast<uint8_t*>(w));
    }
    CK(cudaMalloc(&flags, size_t(n) * loom::kFlagCount * 8));
    CK(cudaMemset(flags, 0, size_t(n) * loom::kFlagCount * 8));
    CK(cudaMalloc(&cells, cellWords() * 8));
    CK(cudaMemset(cells, 0, cellWords() * 8));
  }
  size_t rowWords() const { return loom::kCellRowWords; }
  size_t cellWords() const { return size_t(n) * size_t(n) * rowWords(); }
  ~Ranks() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    for (uint8_t* w : windows) cudaFree(w);
    cudaFree(flags);
    cudaFree(cells);
  }
  loom::ProgramBuffers buffers(const void* send, size_t sb, void* recv, size_t rb) {
    loom::ProgramBuffers b;
    b.send = send;
    b.sendBytes = sb;
    b.recv = recv;
    b.recvBytes = rb;
    b.windowBytes = loom::streamWindowBytes(slot);
    for (int q = 0; q < n; ++q) {
      b.windows.push_back(windows[size_t(q)]);
      b.flags.push_back(flags + size_t(q) * loom::kFlagCount);
    }
    return b;
  }
  // Device zero-copy for rank r: its cell area and its rows in the
  // others'; with `publish`, its buffers (one process: as they are).
  void addCells(int r, loom::ProgramBuffers& b, bool publish) {
    b.published.assign(size_t(n), {});
    for (int q = 0; q < n; ++q) {
      b.cells.push_back(cells + (size_t(r) * size_t(n) + size_t(q)) * rowWords());
      b.peerCells.push_back(cells + (size_t(q) * size_t(n) + size_t(r)) * rowWords());
      if (!publish || q == r) continue;
      auto& c = b.published[size_t(q)];
      c[loom::kCellSend0] = c[loom::kCellSend1] = {uint64_t(uintptr_t(b.send)), b.sendBytes};
      c[loom::kCellRecv0] = c[loom::kCellRecv1] = {uint64_t(uintptr_t(b.recv)), b.recvBytes};
    }
  }
  // After a hang: each rank's program, which streams are stuck, and every
  // flag (read on a stream of its own, with a deadline).
  void report(const std::vector<std::string>& programs) {
    for (size_t r = 0; r < programs.size(); ++r) std::printf("rank %zu program:\n%s\n", r, programs[r].c_str());
    for (size_t i = 0; i < streams.size(); ++i)
      std::printf("stream %zu (rank %zu, %s): %s\n", i, i / 2, i % 2 ? "side" : "caller",
                  cudaGetErrorString(cudaStreamQuery(streams[i])));
    (void)cudaGetLastError();
    std::fflush(stdout);
    // Pinned, so that the copy is asynchronous and the deadline holds.
    const size_t count = size_t(n) * loom::kFlagCount;
    uint64_t* host = nullptr;
    CK(cudaMallocHost(&host, count * 8));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaMemcpyAsync(host, flags, count * 8, cudaMemcpyDeviceToHost, s));
    if (!finish(s, 5)) {
      std::printf("flags: the read did not finish in 5 s\n");
    } else {
      for (int r = 0; r < n; ++r) {
        std::printf("rank %d flags:", r);
        for (int f = 0; f < loom::kFlagCount; ++f) std::printf(" %llu", (unsigned long long)host[size_t(r) * loom::kFlagCount + size_t(f)]);
        std::printf("\n");
      }
    }
    std::fflush(stdout);
  }
  bool finishAll(double seconds) {
    for (cudaStream_t s : streams)
      if (!finish(s, seconds)) return false;
    return true;
  }
};

struct Variant {
  Collective coll;
  StreamAlgorithm algo;
};
const Variant kVariants[] = {
    {Collective::AllReduce, StreamAlgorithm::OneShot},     {Collective::AllReduce, StreamAlgorithm::ReduceScatterAllGather},
    {Collective::ReduceScatter, StreamAlgorithm::OneShot}, {Collective::AllGather, StreamAlgorithm::OneShot},
    {Collective::Broadcast, StreamAlgorithm::OneShot},     {Collective::Reduce, StreamAlgorithm::OneShot},
};

bool reducing(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

// One collective on every rank; returns "" or what was wrong.
// One rank's program to enqueue (enqueueRoundRobin).
struct RankEnqueue {
  std::unique_ptr<loom::CudaStreamBackend> be;
  loom::StreamProgram p;
  loom::ProgramBuffers b;
  std::unique_ptr<loom::ProgramEnqueuer> e;
};

// Enqueues every rank's program from this one thread round-robin, a few
// operations of each in turn (ProgramEnqueuer), as loomGroupEnd does.  A
// rank's program enqueued whole can fill its stream's queue with waits for
// flags that only later ranks' programs set, and the host then blocks in
// the enqueue for ever (the order test hung so with 4 ranks, 12 MiB
// through 1 MiB slots, on the H200).
void enqueueRoundRobin(std::vector<RankEnqueue>& ranks) {
  for (RankEnqueue& r : ranks) r.e = std::make_unique<loom::ProgramEnqueuer>(*r.be, r.p, r.b);
  for (bool busy = true; busy;) {
    busy = false;
    for (RankEnqueue& r : ranks) busy = !r.e->step(4) || busy;
  }
}

// publish (where readsPublished says): 0 no cells,
// 1 cells but nobody publishes, 2 every rank publishes, 3 odd ranks do.
std::string runProgram(const loom::CudaApi& api, Ranks& R, const Variant& v, loomDataType_t t, loomRedOp_t op,
                       size_t n, bool inPlace, std::mt19937_64& rng, int publish = 0) {
  const int N = R.n;
  const size_t esz = loom::dtypeSize(t);
  const bool a2a = v.coll == Collective::AllToAll;
  const size_t sendElems = v.coll == Collective::ReduceScatter || v.coll == Collective::Scatter || a2a ? size_t(N) * n : n;
  const size_t recvElems = v.coll == Collective::AllGather || v.coll == Collective::Gather || a2a ? size_t(N) * n : n;
  const size_t bufElems = std::max(sendElems, recvElems);
  const int root = N - 1;
  std::vector<std::vector<uint8_t>> input(static_cast<size_t>(N), std::vector<uint8_t>(sendElems * esz)),
      recvInit(static_cast<size_t>(N), std::vector<uint8_t>(bufElems * esz));
  std::vector<void*> sendDev(static_cast<size_t>(N), nullptr), recvDev(static_cast<size_t>(N), nullptr);
  std::vector<const uint8_t*> send(static_cast<size_t>(N));
  std::vector<uint8_t*> recv(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    fillRandom(input[size_t(r)], t, rng);
    fillRandom(recvInit[size_t(r)], t, rng);
    CK(cudaMalloc(&recvDev[size_t(r)], bufElems * esz + 1));
    uint8_t* rb = static_cast<uint8_t*>(recvDev[size_t(r)]);
    CK(cudaMemcpy(rb, recvInit[size_t(r)].data(), bufElems * esz, cudaMemcpyHostToDevice));
    if (inPlace) {
      uint8_t* in = rb;
      recv[size_t(r)] = rb;
      if (v.coll == Collective::ReduceScatter) recv[size_t(r)] = rb + size_t(r) * n * esz;
      if (v.coll == Collective::AllGather) in = rb + size_t(r) * n * esz;
      send[size_t(r)] = in;
      CK(cudaMemcpy(in, input[size_t(r)].data(), sendElems * esz, cudaMemcpyHostToDevice));
    } else {
      CK(cudaMalloc(&sendDev[size_t(r)], sendElems * esz + 1));
      CK(cudaMemcpy(sendDev[size_t(r)], input[size_t(r)].data(), sendElems * esz, cudaMemcpyHostToDevice));
      send[size_t(r)] = static_cast<uint8_t*>(sendDev[size_t(r)]);
      recv[size_t(r)] = rb;
    }
  }
  std::vector<std::string> programs;  // described, for a hang report
  std::vector<RankEnqueue> progs(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    loom::OpDesc o;
    o.coll = v.coll;
    o.sendbuf = send[size_t(r)];
    o.recvbuf = recv[size_t(r)];
    o.count = n;
    o.dtype = t;
    o.op = op;
    o.root = root;
    RankEnqueue& e = progs[size_t(r)];
    loom::StreamPublish pub;
    pub.cells = publish > 0;
    pub.mine = (publish == 2 || (publish == 3 && r % 2 == 1)) && loom::mayPublish(o, r, N, v.algo);
    e.p = loom::compileStreamProgram(o, r, N, v.algo, R.slot, &R.rounds[size_t(r)], pub);
    programs.push_back(e.p.describe());
    e.be = std::make_unique<loom::CudaStreamBackend>(
        api, std::vector<void*>{R.streams[size_t(2 * r)], R.streams[size_t(2 * r + 1)]},
        std::vector<void*>{R.events[size_t(2 * r)], R.events[size_t(2 * r + 1)]});
    e.b = R.buffers(send[size_t(r)], sendElems * esz, recv[size_t(r)], recvElems * esz);
    if (pub.cells) R.addCells(r, e.b, pub.mine);
  }
  enqueueRoundRobin(progs);
  std::string bad;
  if (!R.finishAll(g_waitSeconds)) {
    std::printf("HANG: %s N=%d: streams did not finish in %.0f s\n", loom::collectiveName(v.coll), N, g_waitSeconds);
    std::fflush(stdout);
    R.report(programs);
    std::exit(1);
  }
  auto fold = [&](size_t off, std::vector<uint8_t>* out) {
    out->assign(input[0].begin() + long(off), input[0].begin() + long(off + n * esz));
    for (int q = 1; q < N; ++q) loom::reduceHost(out->data(), out->data(), input[size_t(q)].data() + off, n, t, op);
    if (op == loomAvg) loom::divideHost(out->data(), out->data(), n, t, N);
  };
  for (int r = 0; r < N && bad.empty(); ++r) {
    std::vector<uint8_t> want, got(recvElems * esz);
    switch (v.coll) {
      case Collective::AllReduce: fold(0, &want); break;
      case Collective::ReduceScatter: fold(size_t(r) * n * esz, &want); break;
      case Collective::AllGather:
        for (int q = 0; q < N; ++q) want.insert(want.end(), input[size_t(q)].begin(), input[size_t(q)].end());
        break;
      case Collective::Broadcast: want = input[size_t(root)]; break;
      case Collective::Reduce:
        if (r == root) fold(0, &want);
        else if (inPlace) want = input[size_t(r)];
        else want.assign(recvInit[size_t(r)].begin(), recvInit[size_t(r)].begin() + long(recvElems * esz));
        break;
      case Collective::AllToAll:  // block q: block r of rank q's input
        for (int q = 0; q < N; ++q)
          want.insert(want.end(), input[size_t(q)].begin() + long(size_t(r) * n * esz),
                      input[size_t(q)].begin() + long(size_t(r + 1) * n * esz));
        break;
      case Collective::Gather:  // out of place only here
        if (r == root)
          for (int q = 0; q < N; ++q) want.insert(want.end(), input[size_t(q)].begin(), input[size_t(q)].end());
        else
          want.assign(recvInit[size_t(r)].begin(), recvInit[size_t(r)].begin() + long(recvElems * esz));
        break;
      case Collective::Scatter:  // out of place only here
        want.assign(input[size_t(root)].begin() + long(size_t(r) * n * esz),
                    input[size_t(root)].begin() + long(size_t(r + 1) * n * esz));
        break;
      case Collective::P2P: break;  // not run here
    }
    CK(cudaMemcpy(got.data(), recv[size_t(r)], got.size(), cudaMemcpyDeviceToHost));
    if (got != want) bad = loom::strf("rank %d wrong", r);
  }
  for (int r = 0; r < N; ++r) {
    if (sendDev[size_t(r)]) CK(cudaFree(sendDev[size_t(r)]));
    CK(cudaFree(recvDev[size_t(r)]));
  }
  return bad;
}

void testPrograms(const loom::CudaApi& api, const std::vector<int>& rankCounts, size_t maxCount) {
  std::mt19937_64 rng(2);
  for (int N : rankCounts) {
    Ranks R(N, size_t(4) << 20);
    for (const Variant& v : kVariants) {
      long cases = 0, wrong = 0;
      std::string firstBad;
      for (loomDataType_t t : kTypes)
        for (loomRedOp_t op : kOps) {
          if (!reducing(v.coll) && op != loomSum) continue;
          for (size_t n : {size_t(0), size_t(1), size_t(1031), size_t(1) << 20, maxCount}) {
            if (n > maxCount) continue;
            if (n == maxCount && n > (size_t(1) << 20) && (t != loomFloat32 || op != loomSum)) continue;
            for (bool inPlace : {false, true}) {
              if (g_trace)
                std::fprintf(stderr, "%8.2f s  %s/%s N=%d %s %s n=%zu %s\n", sinceStart(),
                             loom::collectiveName(v.coll), loom::streamAlgorithmName(v.algo), N, loom::dtypeName(t),
                             loom::redOpName(op), n, inPlace ? "in-place" : "out-of-place");
              std::string bad = runProgram(api, R, v, t, op, n, inPlace, rng);
              ++cases;
              if (!bad.empty()) {
                ++wrong;
                if (firstBad.empty())
                  firstBad = loom::strf("%s %s n=%zu %s: %s", loom::dtypeName(t), loom::redOpName(op), n,
                                        inPlace ? "in-place" : "out-of-place", bad.c_str());
              }
            }
          }
        }
      row("programs",
          loom::strf("%s/%s N=%d: %ld cases", loom::collectiveName(v.coll), loom::streamAlgorithmName(v.algo), N, cases),
          wrong, firstBad);
    }
    // Device zero-copy: the reduce-scatter + all-gather all-reduce, the
    // reduce-scatter, the all-gather and the all-to-all with nobody,
    // everyone and odd ranks publishing (cells written by stream
    // writes, sources resolved by the kernels), modes in an order that
    // changes every cell between calls.
    if (N > 1) {
      long cases = 0, wrong = 0;
      std::string firstBad;
      for (int mode : {2, 1, 3, 2, 0, 3})
        for (const Variant& zv : {Variant{Collective::AllReduce, StreamAlgorithm::ReduceScatterAllGather},
                                  Variant{Collective::ReduceScatter, StreamAlgorithm::OneShot},
                                  Variant{Collective::AllGather, StreamAlgorithm::OneShot},
                                  Variant{Collective::AllToAll, StreamAlgorithm::OneShot},
                                  Variant{Collective::Broadcast, StreamAlgorithm::OneShot},
                                  Variant{Collective::Reduce, StreamAlgorithm::OneShot},
                                  Variant{Collective::Gather, StreamAlgorithm::OneShot},
                                  Variant{Collective::Scatter, StreamAlgorithm::OneShot}})
        for (loomRedOp_t op : {loomSum, loomAvg})
          for (size_t n : {size_t(1), size_t(1031), size_t(1) << 20, maxCount})
            for (bool inPlace : {false, true}) {
              if (n > maxCount) continue;
              if (inPlace && (zv.coll == Collective::Gather || zv.coll == Collective::Scatter)) continue;
              if (op != loomSum && !loom::reduces(zv.coll)) continue;
              std::string bad = runProgram(api, R, zv, loomFloat32, op, n, inPlace, rng, mode);
              ++cases;
              if (!bad.empty()) {
                ++wrong;
                if (firstBad.empty())
                  firstBad = loom::strf("%s publish=%d %s n=%zu %s: %s", loom::collectiveName(zv.coll), mode,
                                        loom::redOpName(op), n,
                                        inPlace ? "in-place" : "out-of-place", bad.c_str());
              }
            }
      row("zero-copy",
          loom::strf("every collective with published buffers, N=%d: %ld cases", N, cases),
          wrong, firstBad);
    }
  }
}

__global__ void slowFill(float* p, size_t n, float value, long long spinCycles) {
  long long t0 = clock64();
  while (clock64() - t0 < spinCycles) {
  }
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

__global__ void snapshot(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

void testOrder(const loom::CudaApi& api, int N) {
  const size_t n = size_t(3) << 20;
  long wrong = 0;
  for (StreamAlgorithm a : {StreamAlgorithm::OneShot, StreamAlgorithm::ReduceScatterAllGather}) {
    Ranks R(N, size_t(1) << 20);
    std::vector<float*> buf(static_cast<size_t>(N)), snap(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      CK(cudaMalloc(&buf[size_t(r)], n * 4));
      CK(cudaMalloc(&snap[size_t(r)], n * 4));
      CK(cudaMemset(buf[size_t(r)], 0, n * 4));
    }
    std::vector<RankEnqueue> progs(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      cudaStream_t s = R.streams[size_t(2 * r)];
      slowFill<<<256, 256, 0, s>>>(buf[size_t(r)], n, float(r + 1), 50000000LL);
      loom::OpDesc o;
      o.sendbuf = o.recvbuf = buf[size_t(r)];
      o.count = n;
      RankEnqueue& e = progs[size_t(r)];
      e.p = loom::compileStreamProgram(o, r, N, a, R.slot, &R.rounds[size_t(r)]);
      e.be = std::make_unique<loom::CudaStreamBackend>(
          api, std::vector<void*>{s, R.streams[size_t(2 * r + 1)]},
          std::vector<void*>{R.events[size_t(2 * r)], R.events[size_t(2 * r + 1)]});
      e.b = R.buffers(buf[size_t(r)], n * 4, buf[size_t(r)], n * 4);
    }
    enqueueRoundRobin(progs);
    for (int r = 0; r < N; ++r)
      snapshot<<<256, 256, 0, R.streams[size_t(2 * r)]>>>(snap[size_t(r)], buf[size_t(r)], n);
    if (!R.finishAll(120)) {
      std::printf("HANG: order test\n");
      std::exit(1);
    }
    const float want = float(N * (N + 1) / 2);
    for (int r = 0; r < N; ++r) {
      std::vector<float> got(n);
      CK(cudaMemcpy(got.data(), snap[size_t(r)], n * 4, cudaMemcpyDeviceToHost));
      for (float x : got)
        if (x != want) {
          ++wrong;
          break;
        }
      CK(cudaFree(buf[size_t(r)]));
      CK(cudaFree(snap[size_t(r)]));
    }
  }
  row("order", loom::strf("slow kernel -> all-reduce -> snapshot kernel, one stream, N=%d", N), wrong,
      "a snapshot saw input or partial results");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ranks = {1, 2, 4};
  size_t maxCount = size_t(64) << 20;  // 256 MiB of float32
  bool kernels = true;
  for (int i = 1; i < argc; i += 2) {
    if (!std::strcmp(argv[i], "--skip-kernels")) {
      kernels = false;
      --i;
    } else if (i + 1 >= argc) {
      break;
    } else if (!std::strcmp(argv[i], "--ranks")) {
      ranks.clear();
      for (char* s = argv[i + 1]; *s;) {
        ranks.push_back(int(std::strtol(s, &s, 10)));
        if (*s == ',') ++s;
      }
    } else if (!std::strcmp(argv[i], "--max-count")) {
      maxCount = std::strtoull(argv[i + 1], nullptr, 10);
    }
  }
  int devices = 0;
  CK(cudaGetDeviceCount(&devices));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device 0: %s (sm_%d%d), %d device(s)\n", prop.name, prop.major, prop.minor, devices);
  const loom::CudaApi* api = loomCudaPluginApi(loom::kCudaApiVersion);
  // As a communicator's init does: under lazy loading, a kernel's first
  // launch behind a stream waiting on another rank would never return.
  if (int rc = api->loadKernels()) {
    std::printf("ERROR loading the kernels: %s\n", api->errorString(rc));
    return 1;
  }
  std::printf("%-10s %-64s %8s  %s\n", "check", "cases", "wrong", "result");
  try {
    if (kernels) testKernels(*api);
    if (kernels) testIndirect(*api);
    if (kernels) testScale(*api);
    testPrograms(*api, ranks, maxCount);
    for (int N : ranks) testOrder(*api, N);
  } catch (const loom::Error& e) {  // a CUDA call failed (CudaStreamBackend says which, with CUDA's message)
    std::printf("ERROR %s: %s\n", loomGetErrorString(e.code()), e.what());
    return 1;
  }
  std::printf("%s\n", g_failures ? "FAILED" : "all passed");
  return g_failures ? 1 : 0;
}
