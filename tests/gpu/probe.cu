// loom-gpu-probe: what loom's CUDA path takes for granted, checked on the
// GPU machine in seconds before anything bigger runs (tests/gpu/run.sh
// probe).  One line per check, "ok", "FAIL" or "info"; exits 1 if any
// check fails, and every wait has a deadline, so nothing hangs.
//   ipc      a stream of another process waits on a flag in its own device
//            memory; this process writes it through cudaIpcOpenMemHandle and
//            cuStreamWriteValue64 (the ipc path's flags)
//   pinned   a stream waits on a flag in mapped pinned host memory, at the
//            host pointer; a host store releases it, and its write after the
//            wait lands only then (the staged path's flags)
//   release  a stream blocked in a wait is released by a write from another
//            stream (the watchdog's release)
//   queues   which of 40 streams a wait blocked in one holds back
//            (CUDA_DEVICE_MAX_CONNECTIONS; info, not a failure)
//   attrs    the device's stream memory operation attributes (info)
//   query    whether cudaStreamQuery's cudaErrorNotReady stays behind as
//            the thread's last error (info: loom's launches no longer read it)
// A CUDA call that fails outright ends it with exit 3 (CK, CU).
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/gpu/gpu_check.h"  // CK: a failed CUDA runtime call ends the probe (exit 3)

namespace {

int g_failed = 0;

void report(bool ok, const char* what, const std::string& detail = "") {
  std::printf("%-5s %s%s%s\n", ok ? "ok" : "FAIL", what, detail.empty() ? "" : ": ", detail.c_str());
  std::fflush(stdout);
  if (!ok) ++g_failed;
}

#define CU(x)                                                                                        \
  do {                                                                                               \
    CUresult r_ = (x);                                                                               \
    if (r_ != CUDA_SUCCESS) {                                                                        \
      const char* s_ = "?";                                                                          \
      cuGetErrorString(r_, &s_);                                                                     \
      std::printf("FAIL  %s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);                               \
      std::exit(3);                                                                                  \
    }                                                                                                \
  } while (0)

__global__ void spin(long long cycles) {
  long long t = clock64();
  while (clock64() - t < cycles) {
  }
}

// Whether the stream finishes within `seconds` (a wait that is never
// released is a failure, not a hang).
bool finishes(cudaStream_t s, double seconds) {
  auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) return false;
    (void)cudaGetLastError();
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

// The child of the ipc check: waits on a flag in its own device memory,
// which the parent writes through the handle it sends.  Exit 0 if released.
int ipcChild(int toParent, int fromParent) {
  CK(cudaSetDevice(0));
  uint64_t* flag;
  CK(cudaMalloc(&flag, 4096));
  CK(cudaMemset(flag, 0, 4096));
  CK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, flag));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CU(cuStreamWaitValue64(s, CUdeviceptr(flag), 7, CU_STREAM_WAIT_VALUE_GEQ));
  if (write(toParent, &h, sizeof h) != ssize_t(sizeof h)) return 4;
  const bool released = finishes(s, 20);
  char c = released;
  if (write(toParent, &c, 1) != 1) return 4;
  if (read(fromParent, &c, 1) != 1) return 4;  // the parent has closed its mapping
  CK(cudaFree(flag));
  return released ? 0 : 1;
}

}  // namespace

int main() {
  // ipc first: the child forks before this process touches CUDA.
  int up[2], down[2];
  if (pipe(up) || pipe(down)) return 2;
  pid_t pid = fork();
  if (pid == 0) _exit(ipcChild(up[1], down[0]));
  cudaIpcMemHandle_t h;
  if (read(up[0], &h, sizeof h) != ssize_t(sizeof h)) {
    report(false, "ipc", "no handle from the child process");
    return 1;
  }
  CK(cudaSetDevice(0));
  void* peer = nullptr;
  CK(cudaIpcOpenMemHandle(&peer, h, cudaIpcMemLazyEnablePeerAccess));
  cudaStream_t w;
  CK(cudaStreamCreateWithFlags(&w, cudaStreamNonBlocking));
  CU(cuStreamWriteValue64(w, CUdeviceptr(peer), 9, CU_STREAM_WRITE_VALUE_DEFAULT));
  CK(cudaStreamSynchronize(w));
  char released = 0;
  if (read(up[0], &released, 1) != 1) released = 0;
  CK(cudaIpcCloseMemHandle(peer));
  char c = 1;
  if (write(down[1], &c, 1) != 1) return 2;
  int st = 0;
  waitpid(pid, &st, 0);
  report(released && WIFEXITED(st) && WEXITSTATUS(st) == 0, "ipc",
         "another process's stream wait on its own device memory, released by cuStreamWriteValue64 through "
         "cudaIpcOpenMemHandle (child exit " + std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ")");

  int drv = 0;
  CK(cudaDriverGetVersion(&drv));
  CUdevice dev;
  CU(cuDeviceGet(&dev, 0));
  int a64 = -1, uva = -1, hostPtr = -1, flush = -1;
  CU(cuDeviceGetAttribute(&a64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev));
  CU(cuDeviceGetAttribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, dev));
  CU(cuDeviceGetAttribute(&hostPtr, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev));
  // Whether CU_STREAM_WAIT_VALUE_FLUSH is available (remote writes, e.g. a
  // NIC's, made visible before what waits on a flag): loom does not use it.
  CU(cuDeviceGetAttribute(&flush, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev));
  std::printf("info  attrs: driver %d, 64-bit stream memory operations %d, unified addressing %d, host pointer for "
              "registered memory %d, flush remote writes %d\n", drv, a64, uva, hostPtr, flush);

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  (void)cudaGetLastError();
  spin<<<1, 1, 0, s>>>(200000000LL);
  const cudaError_t q = cudaStreamQuery(s);
  const cudaError_t last = cudaGetLastError();
  CK(cudaStreamSynchronize(s));
  std::printf("info  query: cudaStreamQuery said %s, then cudaGetLastError %s\n", cudaGetErrorName(q),
              cudaGetErrorName(last));

  // pinned: the staged path's flags, at the host pointer.
  uint64_t* hf;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&hf), 4096, cudaHostAllocPortable | cudaHostAllocMapped));
  std::memset(hf, 0, 4096);
  void* dp = nullptr;
  CK(cudaHostGetDevicePointer(&dp, hf, 0));
  CU(cuStreamWaitValue64(s, CUdeviceptr(hf), 1, CU_STREAM_WAIT_VALUE_GEQ));
  CU(cuStreamWriteValue64(s, CUdeviceptr(hf + 1), 5, CU_STREAM_WRITE_VALUE_DEFAULT));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const bool early = load(hf + 1) != 0;
  __atomic_store_n(hf, 1, __ATOMIC_RELEASE);
  const bool done = finishes(s, 5) && load(hf + 1) == 5;
  report(dp == hf && !early && done, "pinned",
         std::string("device pointer ") + (dp == hf ? "is" : "IS NOT") + " the host pointer; the write after the wait " +
             (early ? "ran BEFORE the host released it" : "waited for the host's store") +
             (done ? "" : "; the stream did not finish"));

  // release: a wait on device memory, released from another stream.
  uint64_t* df;
  CK(cudaMalloc(&df, 4096));
  CK(cudaMemsetAsync(df, 0, 4096, s));
  CK(cudaStreamSynchronize(s));
  CU(cuStreamWaitValue64(s, CUdeviceptr(df), uint64_t(1) << 62, CU_STREAM_WAIT_VALUE_GEQ));
  CU(cuStreamWriteValue64(w, CUdeviceptr(df), uint64_t(1) << 62, CU_STREAM_WRITE_VALUE_DEFAULT));
  report(finishes(s, 5), "release", "a stream's wait on device memory released by another stream's write of 2^62");

  // queues: a blocked wait in stream 0 against writes in 39 later streams.
  const int kStreams = 40;
  std::vector<cudaStream_t> ss(kStreams);
  for (auto& x : ss) CK(cudaStreamCreateWithFlags(&x, cudaStreamNonBlocking));
  std::memset(hf, 0, 4096);
  CU(cuStreamWaitValue64(ss[0], CUdeviceptr(hf), 1, CU_STREAM_WAIT_VALUE_GEQ));
  for (int i = 1; i < kStreams; ++i)
    CU(cuStreamWriteValue64(ss[size_t(i)], CUdeviceptr(hf + 8 + i), 1, CU_STREAM_WRITE_VALUE_DEFAULT));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::string held;
  for (int i = 1; i < kStreams; ++i)
    if (!load(hf + 8 + i)) held += " " + std::to_string(i);
  __atomic_store_n(hf, 1, __ATOMIC_RELEASE);
  bool all = true;
  for (auto& x : ss) all = finishes(x, 5) && all;
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  std::printf("info  queues: streams held back by one blocked wait:%s (CUDA_DEVICE_MAX_CONNECTIONS=%s)\n",
              held.empty() ? " none" : held.c_str(), conn ? conn : "unset");
  report(all, "queues", "every stream finished once the wait was released");
  std::printf("%s\n", g_failed ? "probe: FAILED" : "probe: all checks passed");
  return g_failed ? 1 : 0;
}
