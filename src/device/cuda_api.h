// The CUDA calls loom makes, as a table of function pointers filled by the
// CUDA plug-in (libloom_cuda.so, src/device/cuda/).  libloom.so never links
// a CUDA library: it loads the plug-in at run time (cuda_loader.cc) and, if
// that fails, runs host collectives only.  Everything above this table
// (cuda_stream_backend.cc) is plain C++ and unit-tested on machines without
// a GPU; the table itself only runs where CUDA does (tests/gpu/run.sh).
//
// Handles are opaque: streams are cudaStream_t, events cudaEvent_t.  Every
// call returns 0 or a CUDA error code that errorString() turns into CUDA's
// own message.
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace loom {

// Sources one launchReduce call takes; the backend chains calls for more.
constexpr int kCudaMaxReduceSources = 8;

struct CudaApi {
  int abiVersion;  // kCudaApiVersion
  // cuStreamWaitValue64(stream, addr, value, CU_STREAM_WAIT_VALUE_GEQ)
  int (*waitValue64)(void* stream, const uint64_t* addr, uint64_t value);
  // cuStreamWriteValue64(stream, addr, value, 0): after the stream's earlier work
  int (*writeValue64)(void* stream, uint64_t* addr, uint64_t value);
  // cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream)
  int (*memcpyAsync)(void* dst, const void* src, size_t bytes, void* stream);
  // The reduction kernel: dst = srcs[0] op ... op srcs[nsrcs-1], 1 <= nsrcs <= kCudaMaxReduceSources;
  // dst2, unless null, gets the same elements (since ABI 6).  dst2 may be a
  // source exactly: each element is read from every source before it is
  // written.
  int (*launchReduce)(void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, int dtype, int op,
                      void* stream);
  // dst = src / divisor (loomAvg)
  int (*launchDivide)(void* dst, const void* src, size_t count, int dtype, int divisor, void* stream);
  int (*eventRecord)(void* event, void* stream);
  int (*streamWaitEvent)(void* stream, void* event);
  const char* (*errorString)(int error);
  // cudaGetDeviceCount
  int (*deviceCount)(int* count);
  // cudaPointerGetAttributes: *device >= 0 for device (or managed) memory, -1 otherwise
  int (*pointerDevice)(const void* ptr, int* device);

  // ---- a CUDA communicator's own resources (cuda_device_driver.cc) ----
  int (*getDevice)(int* device);  // cudaGetDevice
  int (*setDevice)(int device);   // cudaSetDevice
  // cudaMalloc, then zeroed on a stream of its own that is then
  // synchronised (not the device: other streams may wait on peers): the
  // memory is zero before any peer can map it.
  int (*mallocZeroed)(void** ptr, size_t bytes);
  int (*freeMem)(void* ptr);  // cudaFree
  // cuMemGetAddressRange: the allocation that `p` points into.
  int (*addressRange)(const void* p, void** base, size_t* bytes);
  // cudaIpcGetMemHandle of an allocation's base; kCudaIpcHandleBytes into `handle`.
  int (*ipcGetHandle)(void* base, void* handle);
  // cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess) / cudaIpcCloseMemHandle.
  int (*ipcOpenHandle)(const void* handle, void** mapped);
  int (*ipcCloseHandle)(void* mapped);
  int (*streamCreate)(void** stream);  // cudaStreamCreateWithFlags(cudaStreamNonBlocking)
  int (*streamDestroy)(void* stream);
  int (*eventCreate)(void** event);  // cudaEventCreateWithFlags(cudaEventDisableTiming)
  int (*eventDestroy)(void* event);
  // *value = *addr (device memory), through `stream`, waiting for it
  // (cudaMemcpyAsync + cudaStreamSynchronize).
  int (*readValue64)(const uint64_t* addr, uint64_t* value, void* stream);
  // ---- ABI 3 ----
  // cudaMalloc alone: not zeroed, and never waits for the device (send/recv
  // staging is made while the communicator's streams may wait on peers, so
  // a synchronising call there could deadlock).
  int (*mallocRaw)(void** ptr, size_t bytes);
  // ---- ABI 4 ----
  // Pinned host memory mapped into the device's address space
  // (cudaHostAlloc, portable and mapped), at one address for host and
  // device: the staged path's buffers and flags, which copies, stream
  // memory operations and host threads all touch.  Fails (cudaErrorNotSupported)
  // when the device pointer differs from the host one (no unified addressing).
  int (*hostAllocMapped)(void** ptr, size_t bytes);
  int (*hostFree)(void* ptr);  // cudaFreeHost
  // ---- ABI 5 ----
  // Loads every kernel of the plug-in into the current device's context
  // (cudaFuncGetAttributes on each), once per device.  Under CUDA's lazy
  // loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 12.2) a
  // kernel's first launch loads it, and loading waits for the device: for
  // streams blocked in a wait on a peer's flag that, with several ranks in
  // one process, is set only by work enqueued after that launch, a
  // deadlock (seen on an H200: loom-gpu-tests, 2 ranks in one process).
  // A communicator's init calls it (loadDeviceKernels), and so does
  // loom-gpu-tests before it enqueues programs of its own.
  int (*loadKernels)();
  // (ABI 6 changed launchReduce in place: it gained dst2.)
  // ---- ABI 7: device zero-copy (CellRef, stream_program.h) ----
  // launchReduce whose source k is read through cells[k] when that is not
  // null: cells[k][0] + offsets[k] if *tags[k] >= minTags[k] (tags[k] null:
  // no tag), cells[k][0] is not 0 and the range read lies within
  // cells[k][1] bytes, else srcs[k].  The kernel reads them when it runs.
  int (*launchReduceIndirect)(void* dst, void* dst2, const void* const* srcs, const uint64_t* const* cells,
                              const size_t* offsets, const uint64_t* const* tags, const uint64_t* minTags, int nsrcs,
                              size_t count, int dtype, int op, void* stream);
  // dst = the source (src, or the cell's buffer + offset, as above), `bytes`
  // bytes, by a kernel.
  int (*launchCopyIndirect)(void* dst, const void* src, const uint64_t* cell, size_t offset, const uint64_t* tag,
                            uint64_t minTag, size_t bytes, void* stream);
  // cudaDeviceSynchronize (loomMemFree of published memory: this rank's
  // programs, which end only once the peers are done reading it, first).
  int (*deviceSynchronize)();
  // ---- ABI 8: the calling thread's context, read and restored without
  // making one.  cudaGetDevice says 0 on a thread that has no context, and
  // restoring that with cudaSetDevice(0) makes device 0's primary context
  // (hundreds of MB on GPU 0 for a rank on another GPU), so a scope on
  // such a thread (the control thread answering a peer, the watchdog, the
  // reaper, a user's fresh thread) restores "no context" instead.
  // The device of the thread's current context, -1 when it has none
  // (cuCtxGetCurrent, cuCtxGetDevice).
  int (*contextDevice)(int* device);
  // cuCtxSetCurrent(NULL): the thread has no current context again.
  int (*clearContext)();
  // *supported = CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS of the
  // device (every wait and flag of a stream program is one): checked at
  // init, so that a device without them (some virtual GPUs, old drivers)
  // fails there with the reason, not half-way through the first call.
  int (*streamMemOps)(int device, int* supported);
  // cudaStreamQuery: 0 when everything enqueued on `stream` is done, 1 while
  // it is not, else a CUDA error.
  int (*streamQuery)(void* stream);
  // *capturing = 1 while `stream` is being captured into a CUDA graph
  // (cudaStreamIsCapturing: active or invalidated), 2 for the legacy stream
  // while a blocking stream of the device is being captured (cudaError-
  // StreamCaptureImplicit: the stream itself is not captured, and work on
  // it would invalidate that capture; since ABI 10), else 0.
  int (*streamCapturing)(void* stream, int* capturing);
  // cudaThreadExchangeStreamCaptureMode(relaxed) for the calling thread:
  // loom's own threads (the watchdog, the reaper, the control thread's
  // answers) then never invalidate another thread's global-mode capture
  // (PyTorch's torch.cuda.graph default) with their CUDA calls, as NCCL's
  // threads do not.
  int (*relaxCaptureMode)();
  // ---- ABI 9: loomScale, a local multiply (the NCCL shim's PreMulSum on
  // device buffers) ----
  // dst[i] = src[i] * k for `count` elements of `dtype`, as one step of
  // loom's product (reduce_ops.h scaleElement: float16/bfloat16 in float32
  // rounded once, integers wrap); dst may be src.  k is one element of
  // dtype at `scalar`: host memory read at the launch (scalarOnDevice 0) or
  // device memory the kernel reads when it runs (1).
  int (*launchScale)(void* dst, const void* src, size_t count, int dtype, const void* scalar, int scalarOnDevice,
                     void* stream);
  // ---- ABI 11: CUDA graphs ----
  // The graph being captured on `stream` takes a user object whose destroy
  // callback runs release(arg) once, on a CUDA thread, when that graph and
  // every executable graph made from it are gone (cudaStreamGetCaptureInfo,
  // cudaUserObjectCreate, cudaGraphRetainUserObject).  release must not
  // call CUDA.  release(arg) runs exactly once in every case: at once, or
  // soon on a CUDA thread, when this fails.
  int (*retainOnCapture)(void* stream, void (*release)(void*), void* arg);
  // ---- ABI 12: captured programs on several streams (capture_streams.h) ----
  // *id = the id of the capture `stream` is in (cudaStreamGetCaptureInfo:
  // active or invalidated), 0 when it is in none.  (Since ABI 12,
  // streamCreate and eventCreate run in relaxed capture mode, so that
  // they may run while this thread, or another in global mode, captures.)
  int (*captureId)(void* stream, uint64_t* id);
  // ---- ABI 13 ----
  // *addrs[i] = value for i < n, after the stream's earlier work, as one
  // stream operation (cuStreamBatchMemOp of 64-bit writes; one node in a
  // CUDA graph; the plug-in splits batches above its limit, and falls
  // back to one cuStreamWriteValue64 each where the driver has none).
  // The writes of one batch land in no particular order.
  int (*writeValues64)(void* stream, uint64_t* const* addrs, int n, uint64_t value);
};

// 10: streamCapturing says 2 for an implicit capture; 11: retainOnCapture; 12: captureId; 13: writeValues64
constexpr int kCudaApiVersion = 13;
// sizeof(cudaIpcMemHandle_t) (CUDA_IPC_HANDLE_SIZE); the plug-in checks it.
constexpr size_t kCudaIpcHandleBytes = 64;

}  // namespace loom

// The plug-in's one exported symbol: its table for `abiVersion`, or NULL.
extern "C" typedef const loom::CudaApi* (*LoomCudaPluginFn)(int abiVersion);
#define LOOM_CUDA_PLUGIN_SYMBOL "loomCudaPluginApi"
