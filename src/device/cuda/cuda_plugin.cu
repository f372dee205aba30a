// libloom_cuda.so: the CUDA plug-in.  Fills the CudaApi table
// (src/device/cuda_api.h) from the CUDA runtime (linked statically, so the
// plug-in needs only the driver, libcuda.so.1, at run time) and the
// kernels.  Driver calls (stream memory operations) are found through
// cudaGetDriverEntryPointByVersion, so nothing links libcuda directly.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <set>

#include "src/device/cuda/kernels.h"
#include "src/device/cuda_api.h"

namespace loom {
namespace cuda {
namespace {

// Driver errors are reported as kDriverBase + CUresult, runtime errors as
// the cudaError_t itself, so errorString can tell them apart.
constexpr int kDriverBase = 100000;

using StreamValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);
using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using CtxGetDeviceFn = CUresult (*)(CUdevice*);
using CtxSetCurrentFn = CUresult (*)(CUcontext);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

struct Driver {
  StreamValue64Fn waitValue64 = nullptr;
  StreamValue64Fn writeValue64 = nullptr;
  GetErrorStringFn getErrorString = nullptr;
  AddressRangeFn addressRange = nullptr;
  CtxGetCurrentFn ctxGetCurrent = nullptr;
  CtxGetDeviceFn ctxGetDevice = nullptr;
  CtxSetCurrentFn ctxSetCurrent = nullptr;
  DeviceGetFn deviceGet = nullptr;
  DeviceGetAttributeFn deviceGetAttribute = nullptr;
  BatchMemOpFn batchMemOp = nullptr;  // optional: writeValues64 writes one at a time without it
  cudaError_t status = cudaErrorNotReady;  // of the lookup
};

template <class Fn>
cudaError_t lookup(const char* name, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
  if (rc == cudaSuccess && (q != cudaDriverEntryPointSuccess || !p)) rc = cudaErrorSymbolNotFound;
  *fn = reinterpret_cast<Fn>(p);
  return rc;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver x;
    x.status = lookup("cuStreamWaitValue64", &x.waitValue64);
    if (x.status == cudaSuccess) x.status = lookup("cuStreamWriteValue64", &x.writeValue64);
    if (x.status == cudaSuccess) x.status = lookup("cuGetErrorString", &x.getErrorString);
    if (x.status == cudaSuccess) x.status = lookup("cuMemGetAddressRange", &x.addressRange);
    if (x.status == cudaSuccess) x.status = lookup("cuCtxGetCurrent", &x.ctxGetCurrent);
    if (x.status == cudaSuccess) x.status = lookup("cuCtxGetDevice", &x.ctxGetDevice);
    if (x.status == cudaSuccess) x.status = lookup("cuCtxSetCurrent", &x.ctxSetCurrent);
    if (x.status == cudaSuccess) x.status = lookup("cuDeviceGet", &x.deviceGet);
    if (x.status == cudaSuccess) x.status = lookup("cuDeviceGetAttribute", &x.deviceGetAttribute);
    if (x.status == cudaSuccess) {  // optional: looked up apart, so that its absence fails nothing
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q;
      if (cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &p, 12000, cudaEnableDefault, &q) != cudaSuccess)
        cudaGetLastError();  // the runtime's own error: not one for the next call to report
      else if (q == cudaDriverEntryPointSuccess)
        x.batchMemOp = reinterpret_cast<BatchMemOpFn>(p);
    }
    return x;
  }();
  return d;
}

int waitValue64(void* stream, const uint64_t* addr, uint64_t value) {
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUresult r = d.waitValue64(static_cast<CUstream>(stream), CUdeviceptr(reinterpret_cast<uintptr_t>(addr)), value,
                             CU_STREAM_WAIT_VALUE_GEQ);
  return r == CUDA_SUCCESS ? 0 : kDriverBase + int(r);
}

int writeValue64(void* stream, uint64_t* addr, uint64_t value) {
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUresult r = d.writeValue64(static_cast<CUstream>(stream), CUdeviceptr(reinterpret_cast<uintptr_t>(addr)), value,
                              CU_STREAM_WRITE_VALUE_DEFAULT);
  return r == CUDA_SUCCESS ? 0 : kDriverBase + int(r);
}

int writeValues64(void* stream, uint64_t* const* addrs, int n, uint64_t value) {
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  constexpr int kBatch = 255;  // the driver takes fewer than 256 operations per batch
  for (int at = 0; at < n; at += kBatch) {
    const int k = n - at < kBatch ? n - at : kBatch;
    if (!d.batchMemOp) {
      for (int i = 0; i < k; ++i) {
        const int rc = writeValue64(stream, addrs[at + i], value);
        if (rc != 0) return rc;
      }
      continue;
    }
    CUstreamBatchMemOpParams ops[kBatch];
    memset(ops, 0, sizeof ops);
    for (int i = 0; i < k; ++i) {
      ops[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[i].writeValue.address = CUdeviceptr(reinterpret_cast<uintptr_t>(addrs[at + i]));
      ops[i].writeValue.value64 = value;
      ops[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    }
    CUresult r = d.batchMemOp(static_cast<CUstream>(stream), unsigned(k), ops, 0);
    if (r != CUDA_SUCCESS) return kDriverBase + int(r);
  }
  return 0;
}

int memcpyAsync(void* dst, const void* src, size_t bytes, void* stream) {
  return int(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
}

int eventRecord(void* event, void* stream) {
  return int(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

int streamWaitEvent(void* stream, void* event) {
  return int(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

const char* errorString(int e) {
  if (e >= kDriverBase) {
    const char* s = nullptr;
    const Driver& d = driver();
    if (d.getErrorString && d.getErrorString(CUresult(e - kDriverBase), &s) == CUDA_SUCCESS && s) return s;
    return "unknown CUDA driver error";
  }
  return cudaGetErrorString(cudaError_t(e));
}

int deviceCount(int* count) {
  *count = 0;
  cudaError_t rc = cudaGetDeviceCount(count);
  if (rc != cudaSuccess) {
    *count = 0;
    cudaGetLastError();  // not sticky: clear it for the caller's next call
  }
  return int(rc);
}

int pointerDevice(const void* ptr, int* device) {
  *device = -1;
  cudaPointerAttributes a;
  cudaError_t rc = cudaPointerGetAttributes(&a, ptr);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    return int(rc);
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) *device = a.device;
  return 0;
}

int getDevice(int* device) { return int(cudaGetDevice(device)); }
int setDevice(int device) { return int(cudaSetDevice(device)); }

int contextDevice(int* device) {
  *device = -1;
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUcontext ctx = nullptr;
  CUresult r = d.ctxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS) return kDriverBase + int(r);
  if (!ctx) return 0;
  CUdevice dev = 0;
  r = d.ctxGetDevice(&dev);
  if (r != CUDA_SUCCESS) return kDriverBase + int(r);
  *device = int(dev);
  return 0;
}

int streamMemOps(int device, int* supported) {
  *supported = 0;
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUdevice dev = 0;
  CUresult r = d.deviceGet(&dev, device);
  if (r == CUDA_SUCCESS) r = d.deviceGetAttribute(supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev);
  return r == CUDA_SUCCESS ? 0 : kDriverBase + int(r);
}

int streamQuery(void* stream) {
  cudaError_t rc = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (rc == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: nothing left for the next call to report
    return 1;
  }
  return int(rc);
}

int streamCapturing(void* stream, int* capturing) {
  *capturing = 0;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t rc = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st);
  if (rc == cudaErrorStreamCaptureImplicit) {  // the legacy stream while a global-mode capture runs
    cudaGetLastError();
    *capturing = 2;
    return 0;
  }
  if (rc != cudaSuccess) return int(rc);
  *capturing = st != cudaStreamCaptureStatusNone;
  return 0;
}

int retainOnCapture(void* stream, void (*release)(void*), void* arg) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  cudaError_t rc = cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &st, nullptr, &graph);
  if (rc == cudaSuccess && (st != cudaStreamCaptureStatusActive || !graph)) rc = cudaErrorStreamCaptureInvalidated;
  cudaUserObject_t obj = nullptr;
  if (rc == cudaSuccess) rc = cudaUserObjectCreate(&obj, arg, release, 1, cudaUserObjectNoDestructorSync);
  if (rc != cudaSuccess) {
    release(arg);
    return int(rc);
  }
  // The graph takes over the one reference (Move): it is released with the
  // graph and the executable graphs made from it.
  rc = cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove);
  if (rc != cudaSuccess) {
    cudaUserObjectRelease(obj, 1);  // runs release(arg) now: the caller is told of the error and forgets arg
    return int(rc);
  }
  return 0;
}

int captureId(void* stream, uint64_t* id) {
  *id = 0;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  unsigned long long cid = 0;
  cudaError_t rc = cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &st, &cid);
  if (rc != cudaSuccess) return int(rc);
  // Ids are unique per process; one of 0 still reads as "captured".
  if (st != cudaStreamCaptureStatusNone) *id = cid ? uint64_t(cid) : ~uint64_t(0);
  return 0;
}

int relaxCaptureMode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  return int(cudaThreadExchangeStreamCaptureMode(&mode));
}

int clearContext() {
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUresult r = d.ctxSetCurrent(nullptr);
  return r == CUDA_SUCCESS ? 0 : kDriverBase + int(r);
}

int mallocZeroed(void** ptr, size_t bytes) {
  *ptr = nullptr;
  cudaError_t rc = cudaMalloc(ptr, bytes);
  // Zeroed on a stream of its own that waits for nothing else, and only it
  // is waited for: cudaMemset on the legacy stream and cudaDeviceSynchronize
  // would also wait for every stream of the process, including the
  // caller's and other communicators' streams that may be waiting on peers
  // (which may be waiting for this rank's init).
  cudaStream_t s = nullptr;
  if (rc == cudaSuccess) rc = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (rc == cudaSuccess) rc = cudaMemsetAsync(*ptr, 0, bytes, s);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(s);
  if (s) cudaStreamDestroy(s);
  if (rc != cudaSuccess && *ptr) {
    cudaFree(*ptr);
    *ptr = nullptr;
  }
  return int(rc);
}

int mallocRaw(void** ptr, size_t bytes) {
  *ptr = nullptr;
  return int(cudaMalloc(ptr, bytes));
}

int freeMem(void* ptr) { return int(cudaFree(ptr)); }

int hostAllocMapped(void** ptr, size_t bytes) {
  *ptr = nullptr;
  cudaError_t rc = cudaHostAlloc(ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  if (rc != cudaSuccess) return int(rc);
  void* onDevice = nullptr;
  rc = cudaHostGetDevicePointer(&onDevice, *ptr, 0);
  if (rc == cudaSuccess && onDevice != *ptr) rc = cudaErrorNotSupported;  // one address for both, or nothing
  if (rc != cudaSuccess) {
    cudaFreeHost(*ptr);
    *ptr = nullptr;
  }
  return int(rc);
}

int hostFree(void* ptr) { return int(cudaFreeHost(ptr)); }

int addressRange(const void* p, void** base, size_t* bytes) {
  const Driver& d = driver();
  if (d.status != cudaSuccess) return int(d.status);
  CUdeviceptr b = 0;
  CUresult r = d.addressRange(&b, bytes, CUdeviceptr(reinterpret_cast<uintptr_t>(p)));
  *base = reinterpret_cast<void*>(uintptr_t(b));
  return r == CUDA_SUCCESS ? 0 : kDriverBase + int(r);
}

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes, "CUDA IPC handles changed size");

int ipcGetHandle(void* base, void* handle) {
  cudaIpcMemHandle_t h;
  cudaError_t rc = cudaIpcGetMemHandle(&h, base);
  if (rc == cudaSuccess) memcpy(handle, &h, sizeof h);
  return int(rc);
}

int ipcOpenHandle(const void* handle, void** mapped) {
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  return int(cudaIpcOpenMemHandle(mapped, h, cudaIpcMemLazyEnablePeerAccess));
}

int ipcCloseHandle(void* mapped) { return int(cudaIpcCloseMemHandle(mapped)); }

// Runs make() in relaxed capture mode, then restores the thread's: a
// captured call's first side stream or event is made while the caller's
// capture (global mode, PyTorch's default) runs.
template <class Make>
cudaError_t relaxed(Make make) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaError_t rc = cudaThreadExchangeStreamCaptureMode(&mode);
  if (rc != cudaSuccess) return rc;
  rc = make();
  cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode again
  return rc;
}

int streamCreate(void** stream) {
  cudaStream_t s = nullptr;
  cudaError_t rc = relaxed([&] { return cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); });
  *stream = s;
  return int(rc);
}

int streamDestroy(void* stream) { return int(cudaStreamDestroy(static_cast<cudaStream_t>(stream))); }

int eventCreate(void** event) {
  cudaEvent_t e = nullptr;
  cudaError_t rc = relaxed([&] { return cudaEventCreateWithFlags(&e, cudaEventDisableTiming); });
  *event = e;
  return int(rc);
}

int eventDestroy(void* event) { return int(cudaEventDestroy(static_cast<cudaEvent_t>(event))); }

int readValue64(const uint64_t* addr, uint64_t* value, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t rc = cudaMemcpyAsync(value, addr, sizeof *value, cudaMemcpyDefault, s);
  if (rc == cudaSuccess) rc = cudaStreamSynchronize(s);
  return int(rc);
}

int deviceSynchronize() { return int(cudaDeviceSynchronize()); }

// Once per device: the kernels are loaded into each device's context.
int loadKernelsOnce() {
  static std::mutex mu;
  static std::set<int> loaded;
  int dev = 0;
  cudaError_t rc = cudaGetDevice(&dev);
  if (rc != cudaSuccess) return int(rc);
  std::lock_guard<std::mutex> lock(mu);
  if (loaded.count(dev)) return 0;
  int r = loadKernels();
  if (r == 0) loaded.insert(dev);
  return r;
}

const CudaApi kApi = {kCudaApiVersion, waitValue64,     writeValue64,   memcpyAsync,    launchReduce,  launchDivide,
                      eventRecord,     streamWaitEvent, errorString,    deviceCount,    pointerDevice, getDevice,
                      setDevice,       mallocZeroed,    freeMem,        addressRange,   ipcGetHandle,  ipcOpenHandle,
                      ipcCloseHandle,  streamCreate,    streamDestroy,  eventCreate,    eventDestroy,
                      readValue64,     mallocRaw,       hostAllocMapped, hostFree,     loadKernelsOnce,
                      launchReduceIndirect, launchCopyIndirect, deviceSynchronize, contextDevice,
                      clearContext,    streamMemOps,   streamQuery,    streamCapturing, relaxCaptureMode,
                      launchScale,     retainOnCapture, captureId,      writeValues64};

}  // namespace
}  // namespace cuda
}  // namespace loom

extern "C" __attribute__((visibility("default"))) const loom::CudaApi* loomCudaPluginApi(int abiVersion) {
  return abiVersion == loom::kCudaApiVersion ? &loom::cuda::kApi : nullptr;
}
