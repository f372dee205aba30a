// All-reduce speed of CUDA communicators on one GPU (run by tests/gpu/run.sh;
// needs a GPU).  Forks N processes on device 0 (LOOM_DEVICE=cuda), each
// times `iters` all-reduces per size enqueued back to back on its stream
// (cudaEvent timing), and rank 0 prints per size: time per operation, algbw
// (bytes / time) and busbw (algbw * 2(N-1)/N, NCCL's convention), next to
// the device's own cudaMemcpy device-to-device bandwidth measured in the
// same run (bytes copied / time).  Issue 15's goals on one H200 with 2
// ranks: busbw at 256 MiB >= 60% of that copy bandwidth; 8 B <= 30 us.
// With --graph 1, each size's all-reduce is captured once into a CUDA
// graph and the graph is replayed instead (the graph lane's replayable
// programs: two more flag barriers per call than an eager one).
// A measurement, not a test: exits non-zero only if something fails.
//
// Usage: loom-gpu-comm-perf [--ranks 2] [--iters 20] [--max-bytes 268435456] [--graph 0|1]
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "loom.h"
#include "tests/gpu/gpu_check.h"

namespace {

// Milliseconds per operation of `fn` run `iters` times on `st`.
template <class Fn>
double timeOn(cudaStream_t st, int iters, Fn fn) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, st));
  for (int i = 0; i < iters; ++i) fn();
  CK(cudaEventRecord(b, st));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return double(ms) / iters;
}

int rankMain(int me, int N, loomUniqueId id, int iters, size_t maxBytes, bool graph) {
  CK(cudaSetDevice(0));
  setenv("LOOM_DEVICE", "cuda", 1);
  loomComm_t comm;
  LK(loomCommInitRank(&comm, N, id, me));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  float* buf;
  CK(cudaMalloc(&buf, maxBytes));
  CK(cudaMemset(buf, 0, maxBytes));
  if (me == 0) {
    float* other;
    CK(cudaMalloc(&other, maxBytes));
    double ms = timeOn(st, 10, [&] { CK(cudaMemcpyAsync(other, buf, maxBytes, cudaMemcpyDeviceToDevice, st)); });
    std::printf("cudaMemcpy device-to-device, %zu B: %.1f GB/s (bytes copied / time; ranks idle)\n", maxBytes,
                double(maxBytes) / ms / 1e6);
    CK(cudaFree(other));
    std::printf("%-12s %12s %12s %12s\n", "bytes", "us/op", "algbw GB/s", "busbw GB/s");
  }
  for (size_t bytes = 8; bytes <= maxBytes; bytes = bytes < 65536 ? bytes * 8 : bytes * 4) {
    const size_t n = bytes / 4;
    auto eager = [&] { LK(loomAllReduce(buf, buf, n, loomFloat32, loomSum, comm, loomStream_t(st))); };
    cudaGraphExec_t exec = nullptr;
    if (graph) {
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      eager();
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&exec, g, 0));
      CK(cudaGraphDestroy(g));
    }
    auto op = [&] {
      if (exec)
        CK(cudaGraphLaunch(exec, st));
      else
        eager();
    };
    for (int i = 0; i < 3; ++i) op();  // warm up, and line the ranks up
    CK(cudaStreamSynchronize(st));
    const int it = bytes <= 65536 ? iters * 50 : iters;
    const double ms = timeOn(st, it, op);
    if (exec) CK(cudaGraphExecDestroy(exec));
    if (me == 0) {
      const double algbw = double(bytes) / ms / 1e6;
      std::printf("%-12zu %12.2f %12.2f %12.2f\n", bytes, ms * 1000, algbw, algbw * 2.0 * (N - 1) / N);
      std::fflush(stdout);
    }
  }
  CK(cudaStreamSynchronize(st));
  LK(loomCommDestroy(comm));
  CK(cudaFree(buf));
  CK(cudaStreamDestroy(st));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int N = 2, iters = 20;
  bool graph = false;
  size_t maxBytes = size_t(256) << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--ranks")) N = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--max-bytes")) maxBytes = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--graph")) graph = std::atoi(argv[i + 1]) != 0;
  }
  if (N < 1 || iters < 1 || maxBytes < 8) return 2;
  std::printf("all-reduce float32 sum, in place, %d processes on GPU 0 (LOOM_DEVICE=cuda), %d iterations%s\n", N,
              iters, graph ? ", each a replay of a CUDA graph holding one captured all-reduce" : "");
  std::fflush(stdout);
  loomUniqueId id;
  LK(loomGetUniqueId(&id));  // no CUDA call in this process before fork
  std::vector<pid_t> pids;
  for (int r = 0; r < N; ++r) {
    pid_t p = fork();
    if (p == 0) _exit(rankMain(r, N, id, iters, maxBytes, graph));
    pids.push_back(p);
  }
  int bad = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    bad += !WIFEXITED(st) || WEXITSTATUS(st) != 0;
  }
  if (bad) std::printf("%d rank(s) failed\n", bad);
  return bad ? 1 : 0;
}
