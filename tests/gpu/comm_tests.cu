// CUDA communicators through the public API on a real GPU (run by
// tests/gpu/run.sh; needs a GPU, so it is not a ctest).  For each N it forks
// N processes that all use device 0 (several ranks per GPU: the case NCCL
// refuses), each creates a communicator with LOOM_DEVICE=cuda and runs, on
// device buffers and its own cudaStream_t:
//   comm    every collective the device path serves x types x ops, in and
//           out of place, counts 0, 1, odd, and up to --max-count: exact
//           against the host arithmetic in rank order (every rank derives
//           every rank's input from a seed, so it computes the reference);
//           many operations back to back, one cudaStreamSynchronize
//   order   a slow kernel, then loomAllReduce on the same stream: the call
//           returns while the kernel still runs (cudaStreamQuery says not
//           ready), and after cudaStreamSynchronize the result includes
//           what the kernel wrote
//   p2p     loomSend/loomRecv in a group (a ring, 1 element to 3 Mi) and
//           loomAllToAllv of uneven blocks: exact
//   streams a group whose calls on one communicator use two streams: it
//           runs after a slow kernel on the second, and a copy on the
//           second after the group sees the first's result
//   capture collectives and a send/recv ring captured into a CUDA graph
//           (global mode): a one-shot and a two-round all-reduce, an
//           all-gather and a 12 MiB ring exchange in a group, five replays
//           with new inputs each, an eager call between two: exact; the
//           capture survives loom's watchdog reading flags meanwhile
//   pipeline a chain of sends as pipeline stages make it (rank 0 sends and
//           receives in one group, the others receive in one call and send
//           in the next), 12 MiB, eager and then captured into a CUDA graph
//           and replayed three times: exact
//   errors  a host pointer and a loom host stream on a CUDA communicator:
//           loomInvalidArgument with a message
//   lazy    send/recv staging is made on first use (loomCommDump): none
//           after init and the collectives, one region after the ring (to
//           the next rank), one per rank after the all-to-allv
//   groups  one group spanning two communicators (a second one made from
//           another unique id): an all-reduce on each and a send/recv ring
//           on the second, exact; tagged send/recv is loomInvalidUsage
//   memalloc loomMemAlloc with LOOM_DEVICE=cuda: device memory of device 0
//           (cudaPointerGetAttributes), cudaIpcGetMemHandle takes it, an
//           all-reduce on it is exact, loomMemFree frees it
//   register cudaMalloc memory registered with loomCommRegister (one
//           allocation holding the send and the recv buffer, as a
//           framework's allocator segment): an all-reduce on it is exact
//           and, with 2 or more ranks, publishes it (loomCommDump: 1
//           allocation); after loomCommDeregister nothing is published and
//           the next all-reduce is exact; then cudaFree
//   mixed   zero-copy with many calls in flight (LOOM_DEVICE_ONESHOT_BYTES=0):
//           batches of 16 random calls of every collective, roots, types,
//           ops, sizes and layouts, each rank's buffers published, staged or
//           half and half, 0-3 elements past a 256-byte boundary, one
//           synchronisation per batch: exact
// Prints one row per N and check; exits non-zero on any wrong value, error
// or crash (run.sh bounds the run with timeout(1)).
//
// Usage: loom-gpu-comm-tests [--ranks 1,2,4] [--max-count N]
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "tests/gpu/gpu_check.h"
#include "src/device/host_reduce.h"

namespace {

enum Coll { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, AllToAll, Gather, Scatter };
const char* kCollNames[] = {"all-reduce", "reduce-scatter", "all-gather", "broadcast",
                            "reduce",     "all-to-all",     "gather",     "scatter"};

// Rank q's input, the same on every rank that asks.
void inputOf(int q, size_t seed, std::vector<uint8_t>* v, loomDataType_t t) {
  std::mt19937_64 rng(seed * 1000003u + size_t(q));
  const size_t esz = loom::dtypeSize(t);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (size_t i = 0; i + esz <= v->size(); i += esz) {
    float f = u(rng);
    double d = double(f) * 1.0000001;
    uint16_t h;
    uint64_t r = rng();
    switch (t) {
      case loomFloat16: h = loom::floatToHalf(f); std::memcpy(&(*v)[i], &h, 2); break;
      case loomBfloat16: h = loom::floatToBf16(f); std::memcpy(&(*v)[i], &h, 2); break;
      case loomFloat32: std::memcpy(&(*v)[i], &f, 4); break;
      case loomFloat64: std::memcpy(&(*v)[i], &d, 8); break;
      default: std::memcpy(&(*v)[i], &r, esz);
    }
  }
}

struct Case {
  Coll coll;
  loomDataType_t t;
  loomRedOp_t op;
  size_t n;
  bool inPlace;
  size_t seed;
  int root = -1;  // -1: rank N-1
};

// Where a case's buffers come from: cudaMalloc'd per case (null), or carved
// from the pools below (the send buffer, then the recv buffer).
using Carve = void* (*)(void* ctx, size_t bytes, bool send);

struct Live {  // one issued case: its buffers and what rank `me` must get
  Case c;
  void* sendDev = nullptr;
  void* recvDev = nullptr;
  const uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  std::vector<uint8_t> want;
  bool owned = true;  // cudaMalloc'd for this case: check() frees them
};

Live issue(const Case& c, int me, int N, loomComm_t comm, cudaStream_t st, Carve carve = nullptr,
           void* ctx = nullptr) {
  Live L;
  L.c = c;
  const size_t esz = loom::dtypeSize(c.t), n = c.n;
  const size_t sendElems = c.coll == ReduceScatter || c.coll == AllToAll || c.coll == Scatter ? size_t(N) * n : n;
  const size_t recvElems = c.coll == AllGather || c.coll == AllToAll || c.coll == Gather ? size_t(N) * n : n;
  const size_t big = std::max(sendElems, recvElems) * esz;
  const int root = c.root < 0 ? N - 1 : c.root;
  std::vector<std::vector<uint8_t>> in(static_cast<size_t>(N), std::vector<uint8_t>(sendElems * esz));
  for (int q = 0; q < N; ++q) inputOf(q, c.seed, &in[size_t(q)], c.t);
  std::vector<uint8_t> garbage(big + 1, 0x5a);
  // Copies on the rank's stream: ordered before the collective.  (Pageable
  // sources are staged before cudaMemcpyAsync returns.)
  L.owned = carve == nullptr;
  if (carve)
    L.recvDev = carve(ctx, big + 1, false);
  else
    CK(cudaMalloc(&L.recvDev, big + 1));
  CK(cudaMemcpyAsync(L.recvDev, garbage.data(), big + 1, cudaMemcpyHostToDevice, st));
  uint8_t* rb = static_cast<uint8_t*>(L.recvDev);
  if (c.inPlace) {
    uint8_t* s = rb;
    L.recv = rb;
    // NCCL's in-place layouts (gather's and scatter's matter at the root;
    // the other ranks' buffers merely overlap, which they may).
    if (c.coll == ReduceScatter || c.coll == Scatter) L.recv = rb + size_t(me) * n * esz;
    if (c.coll == AllGather || c.coll == Gather) s = rb + size_t(me) * n * esz;
    L.send = s;
  } else {
    if (carve)
      L.sendDev = carve(ctx, sendElems * esz + 1, true);
    else
      CK(cudaMalloc(&L.sendDev, sendElems * esz + 1));
    L.send = static_cast<uint8_t*>(L.sendDev);
    L.recv = rb;
  }
  CK(cudaMemcpyAsync(const_cast<uint8_t*>(L.send), in[size_t(me)].data(), sendElems * esz, cudaMemcpyHostToDevice,
                     st));
  auto fold = [&](size_t off) {
    std::vector<uint8_t> out(in[0].begin() + long(off), in[0].begin() + long(off + n * esz));
    for (int q = 1; q < N; ++q) loom::reduceHost(out.data(), out.data(), in[size_t(q)].data() + off, n, c.t, c.op);
    if (c.op == loomAvg) loom::divideHost(out.data(), out.data(), n, c.t, N);
    return out;
  };
  switch (c.coll) {
    case AllReduce:
      L.want = fold(0);
      LK(loomAllReduce(L.send, L.recv, n, c.t, c.op, comm, loomStream_t(st)));
      break;
    case ReduceScatter:
      L.want = fold(size_t(me) * n * esz);
      LK(loomReduceScatter(L.send, L.recv, n, c.t, c.op, comm, loomStream_t(st)));
      break;
    case AllGather:
      for (int q = 0; q < N; ++q) L.want.insert(L.want.end(), in[size_t(q)].begin(), in[size_t(q)].end());
      LK(loomAllGather(L.send, L.recv, n, c.t, comm, loomStream_t(st)));
      break;
    case Broadcast:
      L.want = in[size_t(root)];
      LK(loomBroadcast(L.send, L.recv, n, c.t, root, comm, loomStream_t(st)));
      break;
    case Reduce:
      if (me == root)
        L.want = fold(0);
      else if (c.inPlace)
        L.want = in[size_t(me)];
      else
        L.want.assign(recvElems * esz, 0x5a);
      LK(loomReduce(L.send, L.recv, n, c.t, c.op, root, comm, loomStream_t(st)));
      break;
    case AllToAll:  // block q: block `me` of rank q's input
      for (int q = 0; q < N; ++q)
        L.want.insert(L.want.end(), in[size_t(q)].begin() + long(size_t(me) * n * esz),
                      in[size_t(q)].begin() + long(size_t(me + 1) * n * esz));
      LK(loomAllToAll(L.send, L.recv, n, c.t, comm, loomStream_t(st)));
      break;
    case Gather:
      if (me == root) {
        for (int q = 0; q < N; ++q) L.want.insert(L.want.end(), in[size_t(q)].begin(), in[size_t(q)].end());
      } else {  // untouched: the garbage, with this rank's input in its block when in place
        L.want.assign(recvElems * esz, 0x5a);
        if (c.inPlace) std::copy(in[size_t(me)].begin(), in[size_t(me)].end(), L.want.begin() + long(size_t(me) * n * esz));
      }
      LK(loomGather(L.send, L.recv, n, c.t, root, comm, loomStream_t(st)));
      break;
    case Scatter:
      L.want.assign(in[size_t(root)].begin() + long(size_t(me) * n * esz),
                    in[size_t(root)].begin() + long(size_t(me + 1) * n * esz));
      LK(loomScatter(L.send, L.recv, n, c.t, root, comm, loomStream_t(st)));
      break;
  }
  return L;
}

bool check(Live& L) {
  std::vector<uint8_t> got(L.want.size());
  if (!got.empty()) CK(cudaMemcpy(got.data(), L.recv, got.size(), cudaMemcpyDeviceToHost));
  if (L.owned) {
    if (L.sendDev) CK(cudaFree(L.sendDev));
    CK(cudaFree(L.recvDev));
  }
  return got == L.want;
}

const loomDataType_t kTypes[] = {loomInt8,  loomUint8,   loomInt32,   loomUint32,  loomInt64,
                                 loomUint64, loomFloat16, loomFloat32, loomFloat64, loomBfloat16};
const loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

__global__ void slowFill(float* p, size_t n, float value, long long spinCycles) {
  long long t0 = clock64();
  while (clock64() - t0 < spinCycles) {
  }
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

// One rank (a process).  Prints "RESULT <check> <cases> <wrong>" lines.
// Send/recv staging regions this rank allocated, as loomCommDump says (-1: not found).
long regionsOut(loomComm_t comm) {
  char buf[8192];
  if (loomCommDump(comm, buf, sizeof buf) != loomSuccess) return -1;
  const char* at = std::strstr(buf, "send/recv staging: ");
  return at ? std::strtol(at + std::strlen("send/recv staging: "), nullptr, 10) : -1;
}

// Allocations this rank publishes (device zero-copy) and peers'
// allocations mapped here for them (*in), as loomCommDump says (-1: no
// zero-copy here: the staged path, or LOOM_DEVICE_ZERO_COPY=0).
long publishedAllocs(loomComm_t comm, long* in = nullptr) {
  char buf[8192];
  if (loomCommDump(comm, buf, sizeof buf) != loomSuccess) return -1;
  const char* at = std::strstr(buf, "zero-copy: ");
  if (!at || std::strncmp(at, "zero-copy: off", 14) == 0) return -1;
  char* end = nullptr;
  const long out = std::strtol(at + std::strlen("zero-copy: "), &end, 10);
  const char* comma = std::strchr(end, ',');
  if (in) *in = comma ? std::strtol(comma + 1, nullptr, 10) : -1;
  return out;
}

// One lazy-staging check: 1 when the count differs from want (and says so).
// Then an all-reduce, waited for, before anything else: it completes only
// once every rank has issued it, so no rank counts after a faster peer's
// next receive asked this one for a region (a receive's first use of a pair
// makes the sender allocate it: the count's "after the collectives" was 1
// on the H200 with 2 processes once, for that reason).
long lazyCheck(loomComm_t comm, cudaStream_t st, int me, long want, const char* when) {
  // The staged path (LOOM_DEVICE_PATH=staged) moves send/recv through its
  // own pinned buffer and has no per-pair regions to count.
  const char* path = std::getenv("LOOM_DEVICE_PATH");
  const bool counted = !(path && std::strcmp(path, "staged") == 0);
  const long got = counted ? regionsOut(comm) : want;
  static float* one = nullptr;
  if (!one) CK(cudaMalloc(&one, sizeof(float)));
  LK(loomAllReduce(one, one, 1, loomFloat32, loomSum, comm, loomStream_t(st)));
  CK(cudaStreamSynchronize(st));
  if (got == want) return 0;
  std::fprintf(stderr, "rank %d: %ld send/recv staging regions %s, expected %ld\n", me, got, when, want);
  return 1;
}

int rankMain(int me, int N, loomUniqueId id, loomUniqueId id2, loomUniqueId id3, size_t maxCount) {
  CK(cudaSetDevice(0));
  setenv("LOOM_DEVICE", "cuda", 1);
  loomComm_t comm;
  LK(loomCommInitRank(&comm, N, id, me));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  long lazyBad = 0;
  lazyBad += lazyCheck(comm, st, me, 0, "at init");  // none at init

  // comm: every collective x type x op, in and out of place, issued back to
  // back in batches, one synchronisation per batch.
  long cases = 0, wrong = 0;
  size_t seed = 1;
  std::vector<Live> batch;
  auto flush = [&] {
    CK(cudaStreamSynchronize(st));
    for (Live& L : batch) {
      ++cases;
      if (!check(L)) {
        ++wrong;
        if (wrong <= 5)
          std::fprintf(stderr, "rank %d of %d: %s type %d op %d n=%zu %s: wrong result\n", me, N,
                       kCollNames[L.c.coll], int(L.c.t), int(L.c.op), L.c.n,
                       L.c.inPlace ? "in-place" : "out-of-place");
      }
    }
    batch.clear();
  };
  for (Coll c : {AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, AllToAll, Gather, Scatter})
    for (loomDataType_t t : kTypes)
      for (loomRedOp_t op : kOps) {
        const bool reducing = c == AllReduce || c == ReduceScatter || c == Reduce;
        if (!reducing && op != loomSum) continue;
        // All-to-all's and scatter's buffers are N blocks on every rank:
        // their largest case is maxCount elements in all.
        const size_t top = c == AllToAll || c == Scatter ? maxCount / size_t(N) : maxCount;
        for (size_t n : {size_t(0), size_t(1), size_t(1031), size_t(300000), top}) {
          if (n > top) continue;
          if (n == top && n > 300000 && (t != loomFloat32 || op != loomSum)) continue;
          for (bool ip : {false, true}) {
            batch.push_back(issue({c, t, op, n, ip, seed++}, me, N, comm, st));
            if (batch.size() >= 16 || n == top) flush();
          }
        }
      }
  flush();
  std::printf("RESULT comm %ld %ld\n", cases, wrong);
  lazyBad += lazyCheck(comm, st, me, 0, "after the collectives");  // nor for collectives

  // p2p: send/recv in a group (a ring: to the next rank, from the
  // previous, sizes from one element to many chunks), and an all-to-allv
  // of uneven blocks; every rank derives every input from the seed.
  {
    long p2pCases = 0, p2pWrong = 0;
    const int next = (me + 1) % N, prev = (me + N - 1) % N;
    for (size_t n : {size_t(1), size_t(1031), size_t(3) << 20}) {
      if (n > maxCount) continue;
      std::vector<uint8_t> mine(n * 4), theirs(n * 4);
      inputOf(me, seed + n, &mine, loomFloat32);
      inputOf(prev, seed + n, &theirs, loomFloat32);
      void *s, *r;
      CK(cudaMalloc(&s, n * 4));
      CK(cudaMalloc(&r, n * 4));
      CK(cudaMemcpyAsync(s, mine.data(), n * 4, cudaMemcpyHostToDevice, st));
      LK(loomGroupStart());
      LK(loomSend(s, n, loomFloat32, next, comm, loomStream_t(st)));
      LK(loomRecv(r, n, loomFloat32, prev, comm, loomStream_t(st)));
      LK(loomGroupEnd());
      CK(cudaStreamSynchronize(st));
      std::vector<uint8_t> got(n * 4);
      CK(cudaMemcpy(got.data(), r, n * 4, cudaMemcpyDeviceToHost));
      ++p2pCases;
      p2pWrong += got != theirs;
      CK(cudaFree(s));
      CK(cudaFree(r));
    }
    lazyBad += lazyCheck(comm, st, me, 1, "after the send/recv ring");  // the ring: one receiver (the next rank, or itself)
    // all-to-allv: rank q sends (q + j) % 3 * 777 + 1 elements to rank j.
    auto cnt = [](int q, int j) { return size_t((q + j) % 3) * 777 + 1; };
    const size_t nr = static_cast<size_t>(N);
    std::vector<size_t> sc(nr), sd(nr), rc(nr), rd(nr);
    size_t sAll = 0, rAll = 0;
    for (int j = 0; j < N; ++j) {
      sc[size_t(j)] = cnt(me, j), sd[size_t(j)] = sAll, sAll += sc[size_t(j)];
      rc[size_t(j)] = cnt(j, me), rd[size_t(j)] = rAll, rAll += rc[size_t(j)];
    }
    std::vector<uint8_t> in(sAll * 4);
    inputOf(me, seed + 99, &in, loomFloat32);
    void *s, *r;
    CK(cudaMalloc(&s, sAll * 4));
    CK(cudaMalloc(&r, rAll * 4));
    CK(cudaMemcpyAsync(s, in.data(), sAll * 4, cudaMemcpyHostToDevice, st));
    LK(loomAllToAllv(s, sc.data(), sd.data(), r, rc.data(), rd.data(), loomFloat32, comm, loomStream_t(st)));
    CK(cudaStreamSynchronize(st));
    std::vector<uint8_t> got(rAll * 4);
    CK(cudaMemcpy(got.data(), r, rAll * 4, cudaMemcpyDeviceToHost));
    for (int q = 0; q < N; ++q) {  // rank q's buffer, its block for me
      size_t qAll = 0, qOff = 0;
      for (int j = 0; j < N; ++j) {
        if (j == me) qOff = qAll;
        qAll += cnt(q, j);
      }
      std::vector<uint8_t> qin(qAll * 4);
      inputOf(q, seed + 99, &qin, loomFloat32);
      ++p2pCases;
      p2pWrong += std::memcmp(got.data() + rd[size_t(q)] * 4, qin.data() + qOff * 4, rc[size_t(q)] * 4) != 0;
    }
    CK(cudaFree(s));
    CK(cudaFree(r));
    std::printf("RESULT p2p %ld %ld\n", p2pCases, p2pWrong);
    lazyBad += lazyCheck(comm, st, me, N, "after the all-to-allv");  // every rank received from this one
    std::printf("RESULT lazy 4 %ld\n", lazyBad);
  }

  // groups: one group over two communicators; tagged send/recv refused.
  {
    loomComm_t comm2;
    LK(loomCommInitRank(&comm2, N, id2, me));
    const size_t n = 300000;
    float *a, *b, *s, *r;
    CK(cudaMalloc(&a, n * 4));
    CK(cudaMalloc(&b, n * 4));
    CK(cudaMalloc(&s, n * 4));
    CK(cudaMalloc(&r, n * 4));
    std::vector<float> ones(n, float(me + 1)), twos(n, float(2 * (me + 1))), mine(n, float(100 + me));
    CK(cudaMemcpyAsync(a, ones.data(), n * 4, cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(b, twos.data(), n * 4, cudaMemcpyHostToDevice, st));
    CK(cudaMemcpyAsync(s, mine.data(), n * 4, cudaMemcpyHostToDevice, st));
    const int next = (me + 1) % N, prev = (me + N - 1) % N;
    LK(loomGroupStart());
    LK(loomAllReduce(a, a, n, loomFloat32, loomSum, comm, loomStream_t(st)));
    LK(loomAllReduce(b, b, n, loomFloat32, loomSum, comm2, loomStream_t(st)));
    LK(loomRecv(r, n, loomFloat32, prev, comm2, loomStream_t(st)));
    LK(loomSend(s, n, loomFloat32, next, comm2, loomStream_t(st)));
    LK(loomGroupEnd());
    CK(cudaStreamSynchronize(st));
    std::vector<float> ga(n), gb(n), gr(n);
    CK(cudaMemcpy(ga.data(), a, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gb.data(), b, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gr.data(), r, n * 4, cudaMemcpyDeviceToHost));
    const float sum = float(N * (N + 1) / 2);
    long bad = 0;
    for (size_t i = 0; i < n; ++i) bad += ga[i] != sum || gb[i] != 2 * sum || gr[i] != float(100 + prev);
    long groupBad = bad != 0;
    loomResult_t rc = loomSendTagged(s, 16, loomFloat32, next, 1, comm2, loomStream_t(st));
    groupBad += rc != loomInvalidUsage || std::string(loomGetLastError(comm2)).find("tagged") == std::string::npos;
    CK(cudaStreamSynchronize(st));
    LK(loomCommDestroy(comm2));
    for (float* p : {a, b, s, r}) CK(cudaFree(p));
    std::printf("RESULT groups 2 %ld\n", groupBad);
  }

  // memalloc: loomMemAlloc gives device memory on a CUDA process.
  {
    long bad = 0;
    const size_t n = 1 << 18;
    void* p = nullptr;
    LK(loomMemAlloc(&p, n * 4));
    cudaPointerAttributes at;
    CK(cudaPointerGetAttributes(&at, p));
    bad += at.type != cudaMemoryTypeDevice || at.device != 0;
    cudaIpcMemHandle_t h;
    bad += cudaIpcGetMemHandle(&h, p) != cudaSuccess;
    std::vector<float> v(n, float(me + 1)), got(n);
    CK(cudaMemcpy(p, v.data(), n * 4, cudaMemcpyHostToDevice));
    LK(loomAllReduce(p, p, n, loomFloat32, loomSum, comm, loomStream_t(st)));
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(got.data(), p, n * 4, cudaMemcpyDeviceToHost));
    long wrongVals = 0;
    for (float x : got) wrongVals += x != float(N * (N + 1) / 2);
    bad += wrongVals != 0;
    bad += loomMemFree(p) != loomSuccess;
    std::printf("RESULT memalloc 4 %ld\n", bad);
  }

  // register: plain cudaMalloc memory registered with the communicator is
  // published (2 or more ranks), and no more once deregistered.
  {
    long bad = 0;
    const size_t n = size_t(1) << 22;  // 16 MiB each: the reduce-scatter + all-gather all-reduce
    float* seg = nullptr;
    CK(cudaMalloc(&seg, 2 * n * 4 + 4096));
    float* s = seg + 1024;
    float* r = s + n;
    std::vector<float> v(n), got(n);
    auto allReduce = [&](int salt) {
      for (size_t i = 0; i < n; ++i) v[i] = float((me + salt) % 7 + int(i % 5));
      CK(cudaMemcpy(s, v.data(), n * 4, cudaMemcpyHostToDevice));
      LK(loomAllReduce(s, r, n, loomFloat32, loomSum, comm, loomStream_t(st)));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(got.data(), r, n * 4, cudaMemcpyDeviceToHost));
      long wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q = 0; q < N; ++q) want += float((q + salt) % 7 + int(i % 5));
        wrong += got[i] != want;
      }
      if (wrong) std::fprintf(stderr, "rank %d: register: %ld elements wrong (salt %d)\n", me, wrong, salt);
      return wrong != 0;
    };
    void* h = nullptr;
    LK(loomCommRegister(comm, seg, 2 * n * 4 + 4096, &h));
    bad += allReduce(1);
    const long before = publishedAllocs(comm);  // -1: a path without zero-copy (only exactness is checked)
    if (before >= 0 && before != (N > 1 ? 1 : 0)) {
      std::fprintf(stderr, "rank %d: register: %ld allocations published, want %d\n", me, before, N > 1);
      ++bad;
    }
    LK(loomCommDeregister(comm, h));  // returns once the peers unmapped it
    const long after = publishedAllocs(comm);
    if (before >= 0 && after != 0) {
      std::fprintf(stderr, "rank %d: register: %ld allocations published after deregister\n", me, after);
      ++bad;
    }
    bad += allReduce(2);
    // Every rank's deregistration returned before its second all-reduce,
    // which ended only once every rank had issued it: nothing of a peer's
    // is mapped here any more.
    long in = -1;
    if (publishedAllocs(comm, &in) >= 0 && in != 0) {
      std::fprintf(stderr, "rank %d: register: %ld peer allocations still mapped here\n", me, in);
      ++bad;
    }
    CK(cudaFree(seg));
    std::printf("RESULT register 4 %ld\n", bad);
  }

  // mixed: device zero-copy with many calls in flight.  On a communicator
  // made with LOOM_DEVICE_ONESHOT_BYTES=0 (cells at every size), batches of
  // 16 random calls (every collective, random roots, types, ops, sizes, in
  // and out of place), each rank's buffers from a loomMemAlloc pool (it
  // publishes them), from a cudaMalloc pool (it stages), or the send buffer
  // published and the recv buffer not; one synchronisation per batch, and
  // the pools reused by the next batch.  Catches cells written before their
  // guard, a wrong record of what a rank's cells hold, and a batch reusing
  // memory a peer still reads: what a synchronisation after every call hides.
  {
    const char* prev = std::getenv("LOOM_DEVICE_ONESHOT_BYTES");
    const std::string saved = prev ? prev : "";
    setenv("LOOM_DEVICE_ONESHOT_BYTES", "0", 1);
    loomComm_t zc;
    LK(loomCommInitRank(&zc, N, id3, me));
    if (prev)
      setenv("LOOM_DEVICE_ONESHOT_BYTES", saved.c_str(), 1);
    else
      unsetenv("LOOM_DEVICE_ONESHOT_BYTES");
    struct Pools {
      uint8_t* base[2];  // [0] cudaMalloc (staged), [1] loomMemAlloc (published)
      size_t used[2], cap;
      int choice;  // 0: both buffers staged, 1: both published, 2: send published, recv staged
      size_t skew;  // bytes past a 256-byte boundary (whole elements): unaligned vectors, copy heads and tails
    } pools{};
    pools.cap = size_t(72) << 20;
    void* pub = nullptr;
    CK(cudaMalloc(reinterpret_cast<void**>(&pools.base[0]), pools.cap));
    LK(loomMemAlloc(&pub, pools.cap));
    pools.base[1] = static_cast<uint8_t*>(pub);
    Carve carve = [](void* ctx, size_t bytes, bool send) -> void* {
      Pools* p = static_cast<Pools*>(ctx);
      const int k = p->choice == 1 || (p->choice == 2 && send) ? 1 : 0;
      const size_t at = ((p->used[k] + 255) & ~size_t(255)) + p->skew;
      if (at + bytes > p->cap) {
        std::fprintf(stderr, "mixed: pool %d too small (%zu + %zu bytes)\n", k, at, bytes);
        std::abort();
      }
      p->used[k] = at + bytes;
      return p->base[k] + at;
    };
    const loomDataType_t types[] = {loomFloat32, loomInt32, loomBfloat16, loomFloat64, loomInt8};
    const size_t cap = std::min(size_t(65536), std::max(size_t(1), maxCount / size_t(N)));
    long mixedCases = 0, mixedWrong = 0;
    for (int trial = 0; trial < 12; ++trial) {
      std::mt19937_64 rng(size_t(trial) * 7919u + 17u);  // the same calls on every rank
      std::vector<Live> inFlight;
      pools.used[0] = pools.used[1] = 0;
      for (int k = 0; k < 16; ++k) {
        Case c{};
        c.coll = Coll(rng() % 8);
        c.t = types[rng() % 5];
        const bool reducing = c.coll == AllReduce || c.coll == ReduceScatter || c.coll == Reduce;
        c.op = reducing ? kOps[rng() % 5] : loomSum;
        const size_t span = std::min(cap, size_t(1) << (rng() % 17));  // sizes spread over 1 .. 64 Ki
        c.n = 1 + size_t(rng() % span);
        c.inPlace = rng() % 2;
        c.root = int(rng() % size_t(N));
        c.seed = 100000 + size_t(trial) * 16 + size_t(k);
        for (int q = 0; q < N; ++q) {
          const int choice = int(rng() % 3);
          const size_t skew = loom::dtypeSize(c.t) * size_t(rng() % 4);
          if (q == me) pools.choice = choice, pools.skew = skew;
        }
        inFlight.push_back(issue(c, me, N, zc, st, carve, &pools));
      }
      CK(cudaStreamSynchronize(st));
      for (Live& L : inFlight) {
        ++mixedCases;
        if (!check(L)) {
          ++mixedWrong;
          if (mixedWrong <= 5)
            std::fprintf(stderr, "rank %d of %d: mixed trial %d: %s type %d op %d n=%zu root %d %s: wrong result\n",
                         me, N, trial, kCollNames[L.c.coll], int(L.c.t), int(L.c.op), L.c.n, L.c.root,
                         L.c.inPlace ? "in-place" : "out-of-place");
        }
      }
    }
    // Its one loomMemAlloc pool is what this rank published (-1: no
    // zero-copy on this path).
    const long published = publishedAllocs(zc);
    if (published >= 0 && published != (N > 1 ? 1 : 0)) {
      std::fprintf(stderr, "rank %d: mixed: %ld allocations published, want %d\n", me, published, N > 1);
      ++mixedWrong;
    }
    CK(cudaStreamSynchronize(st));
    mixedWrong += loomMemFree(pub) != loomSuccess;
    CK(cudaFree(pools.base[0]));
    LK(loomCommDestroy(zc));
    std::printf("RESULT mixed %ld %ld\n", mixedCases, mixedWrong);
  }

  // order: the call returns while earlier work on the stream still runs.
  {
    const size_t n = size_t(1) << 20;
    float* buf;
    CK(cudaMalloc(&buf, n * 4));
    CK(cudaMemset(buf, 0, n * 4));
    slowFill<<<64, 256, 0, st>>>(buf, n, float(me + 1), 2000000000LL);  // about a second
    auto t0 = std::chrono::steady_clock::now();
    LK(loomAllReduce(buf, buf, n, loomFloat32, loomSum, comm, loomStream_t(st)));
    double callMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const bool pending = cudaStreamQuery(st) == cudaErrorNotReady;
    CK(cudaStreamSynchronize(st));
    std::vector<float> got(n);
    CK(cudaMemcpy(got.data(), buf, n * 4, cudaMemcpyDeviceToHost));
    long bad = 0;
    const float want = float(N * (N + 1) / 2);
    for (float x : got) bad += x != want;
    if (!pending) std::fprintf(stderr, "rank %d: the stream was idle right after loomAllReduce returned\n", me);
    if (bad) std::fprintf(stderr, "rank %d: %ld elements wrong after the slow kernel\n", me, bad);
    std::printf("RESULT order 1 %d\n", int(!pending || bad));
    std::printf("NOTE rank %d: loomAllReduce returned in %.3f ms while the stream was %s\n", me, callMs,
                pending ? "busy" : "idle");
    CK(cudaFree(buf));
  }

  // streams: a group whose two all-reduces use two streams (NCCL allows
  // it): it waits for a slow kernel on the second stream, and a copy
  // enqueued on that stream after the group sees the first stream's result.
  {
    long bad = 0;
    const size_t n = size_t(1) << 18;
    float *a, *b, *c;
    CK(cudaMalloc(&a, n * 4));
    CK(cudaMalloc(&b, n * 4));
    CK(cudaMalloc(&c, n * 4));
    CK(cudaMemset(c, 0, n * 4));
    slowFill<<<64, 256, 0, st>>>(a, n, float(me + 1), 0);
    cudaStream_t s2;
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CK(cudaStreamSynchronize(st));
    slowFill<<<64, 256, 0, s2>>>(b, n, float(10 * (me + 1)), 500000000LL);  // about 0.3 s
    LK(loomGroupStart());
    LK(loomAllReduce(a, a, n, loomFloat32, loomSum, comm, loomStream_t(st)));
    LK(loomAllReduce(b, b, n, loomFloat32, loomSum, comm, loomStream_t(s2)));
    LK(loomGroupEnd());
    CK(cudaMemcpyAsync(c, a, n * 4, cudaMemcpyDeviceToDevice, s2));
    CK(cudaStreamSynchronize(s2));  // s2 alone: its copy must have waited for the group on st
    std::vector<float> got(n);
    const float sumA = float(N * (N + 1) / 2), sumB = 10.0f * sumA;
    CK(cudaMemcpy(got.data(), c, n * 4, cudaMemcpyDeviceToHost));
    long wrongCopy = 0, wrongB = 0;
    for (float v : got) wrongCopy += v != sumA;
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(got.data(), b, n * 4, cudaMemcpyDeviceToHost));
    for (float v : got) wrongB += v != sumB;
    if (wrongB) std::fprintf(stderr, "rank %d: streams: %ld elements of the second stream's all-reduce wrong\n", me, wrongB);
    if (wrongCopy)
      std::fprintf(stderr, "rank %d: streams: the copy after the group saw %ld elements unreduced\n", me, wrongCopy);
    bad += (wrongB != 0) + (wrongCopy != 0);
    CK(cudaStreamDestroy(s2));
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(c));
    std::printf("RESULT streams 2 %ld\n", bad);
  }

  // capture: collectives captured into a CUDA graph (global mode,
  // torch.cuda.graph's default) while an eager all-reduce waits behind a
  // slow kernel (loom's watchdog reads flags meanwhile): a one-shot and a
  // multi-round reduce-scatter + all-gather all-reduce, an all-gather and
  // a ring of sends and receives in a group (several chunks of the graph
  // window's regions), after a copy of inputs the host rewrites before
  // each replay; five replays, an eager all-reduce between two of them:
  // exact every time.
  {
    long bad = 0, cases = 0;
    const size_t n = size_t(1) << 16, small = 256, big = size_t(3) << 20;  // big: 12 MiB, two graph-lane rounds
    float *buf, *src, *x, *y, *sx, *sy, *z, *w;
    CK(cudaMalloc(&buf, n * 4));
    CK(cudaMalloc(&src, big * 4));
    CK(cudaMalloc(&x, big * 4));
    CK(cudaMalloc(&y, big * 4));
    CK(cudaMalloc(&sx, small * 4));
    CK(cudaMalloc(&sy, small * 4));
    CK(cudaMalloc(&z, small * 4 * size_t(N)));
    CK(cudaMalloc(&w, big * 4));
    CK(cudaMemset(buf, 0, n * 4));
    slowFill<<<64, 256, 0, st>>>(buf, n, float(me + 1), 200000000LL);  // about 0.1 s
    LK(loomAllReduce(buf, buf, n, loomFloat32, loomSum, comm, loomStream_t(st)));
    cudaStream_t cs;
    CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
    CK(cudaMemcpyAsync(x, src, big * 4, cudaMemcpyDeviceToDevice, cs));
    CK(cudaMemcpyAsync(sx, src, small * 4, cudaMemcpyDeviceToDevice, cs));
    const loomResult_t r1 = loomAllReduce(sx, sy, small, loomFloat32, loomSum, comm, loomStream_t(cs));
    const loomResult_t r2 = loomAllReduce(x, y, big, loomFloat32, loomSum, comm, loomStream_t(cs));
    const loomResult_t r3 = loomAllGather(sx, z, small, loomFloat32, comm, loomStream_t(cs));
    if (r1 != loomSuccess || r2 != loomSuccess || r3 != loomSuccess) {
      std::fprintf(stderr, "rank %d: capture: the captured calls gave %d %d %d: %s\n", me, int(r1), int(r2), int(r3),
                   loomGetLastError(comm));
      ++bad;
    }
    // x to the next rank, into w from the previous.
    LK(loomGroupStart());
    const loomResult_t rs = loomSend(x, big, loomFloat32, (me + 1) % N, comm, loomStream_t(cs));
    const loomResult_t rr = loomRecv(w, big, loomFloat32, (me + N - 1) % N, comm, loomStream_t(cs));
    const loomResult_t rg = loomGroupEnd();
    if (rs != loomSuccess || rr != loomSuccess || rg != loomSuccess) {
      std::fprintf(stderr, "rank %d: capture: the captured send/recv gave %d %d %d: %s\n", me, int(rs), int(rr),
                   int(rg), loomGetLastError(comm));
      ++bad;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the watchdog reads meanwhile
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaStreamEndCapture(cs, &g);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "rank %d: capture: cudaStreamEndCapture: %s (invalidated)\n", me, cudaGetErrorString(e));
      ++bad;
      (void)cudaGetLastError();
    }
    if (g && cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) {
      std::fprintf(stderr, "rank %d: capture: cudaGraphInstantiate: %s\n", me, cudaGetErrorString(cudaGetLastError()));
      ++bad;
      exec = nullptr;
    }
    CK(cudaStreamSynchronize(st));
    std::vector<float> got(n);
    CK(cudaMemcpy(got.data(), buf, n * 4, cudaMemcpyDeviceToHost));
    long wrongVals = 0;
    for (float v : got) wrongVals += v != float(N * (N + 1) / 2);
    bad += wrongVals != 0;
    std::vector<float> in(big), out(big), gathered(small * size_t(N));
    for (int rep = 1; exec && rep <= 5; ++rep) {
      // Rank q's input: (q + 1) * rep + i % 7; the sum over the ranks is exact.
      for (size_t i = 0; i < big; ++i) in[i] = float((me + 1) * rep) + float(i % 7);
      CK(cudaMemcpy(src, in.data(), big * 4, cudaMemcpyHostToDevice));
      CK(cudaGraphLaunch(exec, cs));
      if (rep == 3) {  // an eager call on another stream while the replay may run
        LK(loomAllReduce(buf, buf, n, loomFloat32, loomSum, comm, loomStream_t(st)));
      }
      CK(cudaStreamSynchronize(cs));
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(out.data(), y, big * 4, cudaMemcpyDeviceToHost));
      long wrongBig = 0, wrongSmall = 0, wrongGather = 0, wrongRing = 0;
      const float base = float(rep * N * (N + 1) / 2);
      for (size_t i = 0; i < big; ++i) wrongBig += out[i] != base + float(N) * float(i % 7);
      CK(cudaMemcpy(out.data(), sy, small * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < small; ++i) wrongSmall += out[i] != base + float(N) * float(i % 7);
      CK(cudaMemcpy(gathered.data(), z, small * 4 * size_t(N), cudaMemcpyDeviceToHost));
      for (int q = 0; q < N; ++q)
        for (size_t i = 0; i < small; ++i)
          wrongGather += gathered[size_t(q) * small + i] != float((q + 1) * rep) + float(i % 7);
      CK(cudaMemcpy(out.data(), w, big * 4, cudaMemcpyDeviceToHost));
      const int prev = (me + N - 1) % N;
      for (size_t i = 0; i < big; ++i) wrongRing += out[i] != float((prev + 1) * rep) + float(i % 7);
      if (wrongBig || wrongSmall || wrongGather || wrongRing)
        std::fprintf(stderr, "rank %d: capture: replay %d wrong: %ld of the large all-reduce, %ld of the small, %ld "
                     "of the all-gather, %ld of the ring exchange\n", me, rep, wrongBig, wrongSmall, wrongGather,
                     wrongRing);
      bad += (wrongBig != 0) + (wrongSmall != 0) + (wrongGather != 0) + (wrongRing != 0);
      cases += 4;
    }
    if (exec) CK(cudaGraphExecDestroy(exec));
    if (g) CK(cudaGraphDestroy(g));
    CK(cudaStreamDestroy(cs));
    for (float* p : {buf, src, x, y, sx, sy, z, w}) CK(cudaFree(p));
    std::printf("RESULT capture %ld %ld\n", cases + 3, bad);
  }

  // pipeline: a chain of sends around the ring as pipeline stages make it:
  // rank 0 sends 12 MiB to rank 1 and receives from rank N-1 in one group;
  // every other rank receives from the previous one in one call and sends
  // to the next in its next call.  Eager, then captured into a CUDA graph
  // (global mode) and replayed three times with new inputs: exact.  On
  // one stream rank 0's send would wait behind its receive: the receives
  // run on a side stream of their own, in the graph one that joins the
  // capture.
  {
    long bad = 0, cases = 0;
    const size_t big = size_t(3) << 20;
    const int next = (me + 1) % N, prev = (me + N - 1) % N;
    float *in = nullptr, *out = nullptr;
    std::vector<float> h(big);
    auto fill = [&](int rep) {
      for (size_t i = 0; i < big; ++i) h[i] = float((me + 1) * rep) + float(i % 7);
      CK(cudaMemcpy(in, h.data(), big * 4, cudaMemcpyHostToDevice));
    };
    auto check = [&](int rep, const char* what) {
      CK(cudaMemcpy(h.data(), out, big * 4, cudaMemcpyDeviceToHost));
      long w = 0;
      for (size_t i = 0; i < big; ++i) w += h[i] != float((prev + 1) * rep) + float(i % 7);
      if (w) std::fprintf(stderr, "rank %d: pipeline: %s %d: %ld values wrong\n", me, what, rep, w);
      bad += w != 0;
      ++cases;
    };
    auto issue = [&](cudaStream_t s) {
      loomResult_t a = loomSuccess, b = loomSuccess, c = loomSuccess;
      if (me == 0) {
        a = loomGroupStart();
        b = loomSend(in, big, loomFloat32, next, comm, loomStream_t(s));
        c = loomRecv(out, big, loomFloat32, prev, comm, loomStream_t(s));
        if (a == loomSuccess) a = loomGroupEnd();
      } else {
        b = loomRecv(out, big, loomFloat32, prev, comm, loomStream_t(s));
        c = loomSend(in, big, loomFloat32, next, comm, loomStream_t(s));
      }
      if (a == loomSuccess && b == loomSuccess && c == loomSuccess) return true;
      std::fprintf(stderr, "rank %d: pipeline: the calls gave %d %d %d: %s\n", me, int(a), int(b), int(c),
                   loomGetLastError(comm));
      return false;
    };
    if (N > 1) {
      CK(cudaMalloc(&in, big * 4));
      CK(cudaMalloc(&out, big * 4));
      fill(1);
      if (issue(st)) {
        CK(cudaStreamSynchronize(st));
        check(1, "eager");
      } else {
        ++bad;
      }
      cudaStream_t cs;
      CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
      CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
      const bool issued = issue(cs);
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      const cudaError_t e = cudaStreamEndCapture(cs, &g);
      if (!issued || e != cudaSuccess) {
        std::fprintf(stderr, "rank %d: pipeline: capture: cudaStreamEndCapture: %s\n", me, cudaGetErrorString(e));
        ++bad;
        (void)cudaGetLastError();
      }
      if (g && cudaGraphInstantiate(&exec, g, 0) != cudaSuccess) {
        std::fprintf(stderr, "rank %d: pipeline: cudaGraphInstantiate: %s\n", me,
                     cudaGetErrorString(cudaGetLastError()));
        ++bad;
        exec = nullptr;
      }
      for (int rep = 2; exec && rep <= 4; ++rep) {
        fill(rep);
        CK(cudaGraphLaunch(exec, cs));
        CK(cudaStreamSynchronize(cs));
        check(rep, "replay");
      }
      if (exec) CK(cudaGraphExecDestroy(exec));
      if (g) CK(cudaGraphDestroy(g));
      CK(cudaStreamDestroy(cs));
      CK(cudaFree(in));
      CK(cudaFree(out));
    }
    std::printf("RESULT pipeline %ld %ld\n", cases, bad);
  }

  // errors: host pointer, loom host stream.
  {
    long bad = 0;
    std::vector<float> host(16);
    float* dev;
    CK(cudaMalloc(&dev, 64));
    loomResult_t r = loomAllReduce(host.data(), dev, 16, loomFloat32, loomSum, comm, loomStream_t(st));
    std::string msg = loomGetLastError(comm);
    bad += r != loomInvalidArgument || msg.find("is host memory") == std::string::npos;
    loomStream_t hs;
    LK(loomStreamCreate(&hs));
    r = loomAllReduce(dev, dev, 16, loomFloat32, loomSum, comm, hs);
    msg = loomGetLastError(comm);
    bad += r != loomInvalidArgument || msg.find("loom host stream") == std::string::npos;
    LK(loomStreamDestroy(hs));
    // The exchanges: a host pointer for all-to-all, a root out of range.
    r = loomAllToAll(host.data(), dev, 16 / N, loomFloat32, comm, loomStream_t(st));
    msg = loomGetLastError(comm);
    bad += r != loomInvalidArgument || msg.find("is host memory") == std::string::npos;
    r = loomGather(dev, dev, 1, loomFloat32, N, comm, loomStream_t(st));
    msg = loomGetLastError(comm);
    bad += r != loomInvalidArgument || msg.find("root") == std::string::npos;
    CK(cudaFree(dev));
    std::printf("RESULT errors 4 %ld\n", bad);
  }
  CK(cudaStreamSynchronize(st));
  LK(loomCommDestroy(comm));
  CK(cudaStreamDestroy(st));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> rankCounts = {1, 2, 4};
  size_t maxCount = size_t(64) << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--ranks")) {
      rankCounts.clear();
      for (char* s = argv[i + 1]; *s;) {
        rankCounts.push_back(int(std::strtol(s, &s, 10)));
        if (*s == ',') ++s;
      }
    } else if (!std::strcmp(argv[i], "--max-count")) {
      maxCount = std::strtoull(argv[i + 1], nullptr, 10);
    }
  }
  // No CUDA call in this process before fork: each rank initialises its own.
  int failures = 0;
  std::printf("%-8s %-64s %8s  %s\n", "check", "cases", "wrong", "result");
  for (int N : rankCounts) {
    loomUniqueId id, id2, id3;
    LK(loomGetUniqueId(&id));
    LK(loomGetUniqueId(&id2));
    LK(loomGetUniqueId(&id3));
    std::vector<pid_t> pids;
    std::vector<int> pipes;
    for (int r = 0; r < N; ++r) {
      int fds[2];
      if (pipe(fds) != 0) return 3;
      pid_t p = fork();
      if (p == 0) {
        close(fds[0]);
        dup2(fds[1], 1);
        _exit(rankMain(r, N, id, id2, id3, maxCount));
      }
      close(fds[1]);
      pids.push_back(p);
      pipes.push_back(fds[0]);
    }
    // Collect each rank's output, then its exit status (with a deadline).
    std::vector<std::string> out(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      char buf[4096];
      ssize_t k;
      while ((k = read(pipes[size_t(r)], buf, sizeof buf)) > 0) out[size_t(r)].append(buf, size_t(k));
      close(pipes[size_t(r)]);
    }
    bool crashed = false;
    for (int r = 0; r < N; ++r) {
      int st = 0;
      waitpid(pids[size_t(r)], &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        crashed = true;
        std::printf("rank %d of %d exited abnormally (status %d)\n", r, N, st);
      }
    }
    for (const char* check : {"comm", "p2p", "lazy", "groups", "memalloc", "register", "mixed", "order", "streams", "capture", "pipeline", "errors"}) {
      long cases = 0, wrong = 0;
      bool seen = false;
      for (int r = 0; r < N; ++r) {
        const std::string& o = out[size_t(r)];
        std::string key = std::string("RESULT ") + check + " ";
        size_t at = o.find(key);
        if (at == std::string::npos) continue;
        long c = 0, w = 0;
        std::sscanf(o.c_str() + at + key.size(), "%ld %ld", &c, &w);
        cases += c, wrong += w;
        seen = true;
      }
      const bool ok = seen && !wrong && !crashed;
      std::printf("%-8s %-64s %8ld  %s\n", check,
                  (std::to_string(N) + " processes on GPU 0, LOOM_DEVICE=cuda: " + std::to_string(cases) + " cases")
                      .c_str(),
                  wrong, ok ? "ok" : (seen ? "FAIL" : "FAIL (no result: a rank failed; see stderr)"));
      failures += !ok;
    }
    for (int r = 0; r < N; ++r) {
      const std::string& o = out[size_t(r)];
      size_t at = o.find("NOTE ");
      if (at != std::string::npos) std::printf("  %s\n", o.substr(at + 5, o.find('\n', at) - at - 5).c_str());
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "all passed");
  return failures ? 1 : 0;
}
