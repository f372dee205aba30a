// CUDA's DeviceDriver (cuda_device_driver.h): one CUDA call per method.
#include "src/device/cuda_device_driver.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "src/core/error.h"
#include "src/device/capture_streams.h"
#include "src/device/cuda_stream_backend.h"

namespace loom {

namespace {

class CudaDeviceDriver final : public DeviceDriver {
 public:
  CudaDeviceDriver(const CudaApi& api, int device) : api_(api), device_(device) {}
  ~CudaDeviceDriver() override {
    // On its own device, and the thread's context restored after (the
    // reaper destroys drivers after leaving their scope: a runtime call on
    // a thread without a context would make device 0's).
    int previous = -1;
    try {
      previous = enter();
    } catch (const Error&) {  // destroyed anyway, best effort
    }
    if (readStream_) api_.streamDestroy(readStream_);
    if (readBuf_) api_.hostFree(readBuf_);
    if (releaseStream_) api_.streamDestroy(releaseStream_);
    for (void* e : events_) api_.eventDestroy(e);
    if (joinEvent_) api_.eventDestroy(joinEvent_);
    for (void* s : streams_) api_.streamDestroy(s);
    for (const std::vector<void*>& pool : capturePools_)
      for (void* s : pool) api_.streamDestroy(s);
    leave(previous);
  }

  int device() const override { return device_; }
  const char* name() const override { return "cuda"; }

  int pointerDevice(const void* p) const override {
    // cudaPointerGetAttributes answers for host memory too (not an error):
    // an error is the device's own (a sticky one), not "host memory".
    int d = -1;
    check(api_.pointerDevice(p, &d), "cudaPointerGetAttributes");
    return d;
  }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    check(api_.mallocZeroed(&p, bytes), "cudaMalloc");
    return p;
  }
  void* allocateStaging(size_t bytes) override {
    void* p = nullptr;
    check(api_.mallocRaw(&p, bytes), "cudaMalloc");
    return p;
  }
  void release(void* p) override { check(api_.freeMem(p), "cudaFree"); }
  void synchronize() override { check(api_.deviceSynchronize(), "cudaDeviceSynchronize"); }
  void* allocateHost(size_t bytes) override {
    void* p = nullptr;
    check(api_.hostAllocMapped(&p, bytes), "cudaHostAlloc (mapped, at one address for host and device)");
    return p;
  }
  void releaseHost(void* p) override { check(api_.hostFree(p), "cudaFreeHost"); }
  void addressRange(const void* p, void** base, size_t* bytes) const override {
    check(api_.addressRange(p, base, bytes), "cuMemGetAddressRange");
  }
  void exportHandle(void* base, uint8_t handle[kIpcHandleBytes]) const override {
    check(api_.ipcGetHandle(base, handle), "cudaIpcGetMemHandle");
  }
  void* openHandle(const uint8_t handle[kIpcHandleBytes]) override {
    void* p = nullptr;
    check(api_.ipcOpenHandle(handle, &p), "cudaIpcOpenMemHandle");
    return p;
  }
  void closeHandle(void* mapped) override { check(api_.ipcCloseHandle(mapped), "cudaIpcCloseMemHandle"); }

  StreamBackend& backend(void* callerStream, int streams, int events) override {
    while (int(streams_.size()) + 1 < streams) streams_.push_back(makeStream());
    std::vector<void*> all{callerStream};
    all.insert(all.end(), streams_.begin(), streams_.end());
    return makeBackend(std::move(all), events);
  }
  StreamBackend& captureBackend(void* callerStream, int streams, int events) override {
    if (streams <= 1) return backend(callerStream, streams, events);
    if (!api_.captureId) fail(loomInternalError, "cuda:%d: the plug-in cannot tell captures apart", device_);
    auto captureOf = [this](void* s) {
      uint64_t id = 0;
      check(api_.captureId(s, &id), "cudaStreamGetCaptureInfo");
      return id;
    };
    const uint64_t capture = captureOf(callerStream);
    std::vector<void*> all{callerStream};
    if (int(capturePools_.size()) < streams - 1) capturePools_.resize(size_t(streams - 1));
    for (int s = 1; s < streams; ++s)
      all.push_back(pickCaptureStream(capturePools_[size_t(s - 1)], capture, captureOf, [this] { return makeStream(); }));
    return makeBackend(std::move(all), events);
  }
  void streamWaitStream(void* waiter, void* waited) override {
    // One event serves every join: cudaStreamWaitEvent waits for the
    // record enqueued before it, and a later record does not change that.
    if (!joinEvent_) check(api_.eventCreate(&joinEvent_), "cudaEventCreateWithFlags");
    check(api_.eventRecord(joinEvent_, waited), "cudaEventRecord");
    check(api_.streamWaitEvent(waiter, joinEvent_), "cudaStreamWaitEvent");
  }
  void retainOnCapture(void* stream, std::function<void()> release) override {
    if (!api_.retainOnCapture) {  // a table without it (the tests' recording ones): nothing held
      release();
      return;
    }
    auto* held = new std::function<void()>(std::move(release));
    const int rc = api_.retainOnCapture(
        stream,
        [](void* p) {
          auto* f = static_cast<std::function<void()>*>(p);
          (*f)();
          delete f;
        },
        held);
    // held has run (or will) and is gone.
    check(rc, "holding memory for the graph being captured (cudaStreamGetCaptureInfo, cudaUserObjectCreate, "
              "cudaGraphRetainUserObject)");
  }
  void scale(void* stream, void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
             bool scalarOnDevice) override {
    check(api_.launchScale(dst, src, count, int(type), scalar, scalarOnDevice ? 1 : 0, stream),
          "the scale kernel's launch");
  }
  int enter() override {
    int current = -1;
    check(api_.contextDevice(&current), "cuCtxGetCurrent");
    if (current != device_) check(api_.setDevice(device_), "cudaSetDevice");
    return current < 0 ? kNoContext : current;
  }
  void leave(int previous) override {
    // Best effort: the work is enqueued.
    if (previous == kNoContext)
      api_.clearContext();  // not cudaSetDevice(0): that would make device 0's context
    else if (previous >= 0 && previous != device_)
      api_.setDevice(previous);
  }
  uint64_t readFlag(const uint64_t* flag) override {
    uint64_t v = 0;
    readFlags(flag, 1, &v);
    return v;
  }
  void prepareFlagReads(size_t n) override {
    std::lock_guard<std::mutex> lock(readMu_);
    if (!readStream_) check(api_.streamCreate(&readStream_), "cudaStreamCreateWithFlags");
    if (readPrepared_ || n == 0) return;
    readPrepared_ = true;
    // Once, at init: never retried or grown by a read, which the watchdog
    // makes while streams may wait on peers.
    void* p = nullptr;
    if (api_.hostAllocMapped(&p, n * sizeof(uint64_t)) != 0) return;  // reads go to pageable memory
    readBuf_ = static_cast<uint64_t*>(p);
    readCap_ = n;
  }
  void readFlags(const uint64_t* first, size_t n, uint64_t* out) override {
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(readMu_);  // the watchdog, destroy's drain and the reaper may all read
    if (!readStream_) check(api_.streamCreate(&readStream_), "cudaStreamCreateWithFlags");
    // Into pinned memory when prepared and large enough: one DMA the device
    // does, rather than a copy the driver stages through a bounce buffer
    // (pageable memory: the copy is done when the call returns).  Then a
    // synchronising read of the first flag on the same stream, which
    // orders after the copy.
    uint64_t* into = n <= readCap_ ? readBuf_ : out;
    if (n > 1) check(api_.memcpyAsync(into + 1, first + 1, (n - 1) * sizeof(uint64_t), readStream_), "cudaMemcpyAsync (flags)");
    check(api_.readValue64(first, into, readStream_), "cudaMemcpyAsync (flag)");
    if (into != out) memcpy(out, into, n * sizeof(uint64_t));
  }
  void writeFlags(uint64_t* const* flags, size_t n, uint64_t value) override {
    // A non-blocking stream of its own: the writes wait for nothing the
    // communicator's or the caller's streams hold (a stream blocked in
    // cuStreamWaitValue64 included), and nothing here waits for them.
    if (!releaseStream_) check(api_.streamCreate(&releaseStream_), "cudaStreamCreateWithFlags");
    // The watchdog repeats the same writes every millisecond until the
    // streams are done.  While the last batch has not run (its stream may
    // sit behind a blocked wait on a shared hardware queue), a new one
    // would only pile up until cuStreamWriteValue64 blocks the watchdog:
    // the pending batch writes the same values when it runs.
    if (value == lastValue_ && std::equal(flags, flags + n, lastBatch_.begin(), lastBatch_.end())) {
      const int q = api_.streamQuery(releaseStream_);
      if (q == 1) return;
      check(q, "cudaStreamQuery");
    }
    for (size_t i = 0; i < n; ++i) check(api_.writeValue64(releaseStream_, flags[i], value), "cuStreamWriteValue64");
    lastBatch_.assign(flags, flags + n);
    lastValue_ = value;
  }

 private:
  void* makeStream() {
    void* s = nullptr;
    check(api_.streamCreate(&s), "cudaStreamCreateWithFlags");
    return s;
  }
  // The backend of one program on `streams` (program stream i: streams[i])
  // and the driver's first `events` events, made as needed.
  StreamBackend& makeBackend(std::vector<void*> streams, int events) {
    while (int(events_.size()) < events) {
      void* e = nullptr;
      check(api_.eventCreate(&e), "cudaEventCreateWithFlags");
      events_.push_back(e);
    }
    backend_ = std::make_unique<CudaStreamBackend>(api_, std::move(streams), events_);
    return *backend_;
  }
  void check(int rc, const char* call) const {
    if (rc != 0)
      fail(loomUnhandledCudaError, "cuda:%d: %s failed: %s (CUDA error %d)", device_, call, api_.errorString(rc), rc);
  }

  const CudaApi& api_;
  int device_;
  std::mutex readMu_;
  void* readStream_ = nullptr;     // readFlags'
  uint64_t* readBuf_ = nullptr;    // readFlags' pinned landing place (prepareFlagReads), readCap_ flags
  size_t readCap_ = 0;
  bool readPrepared_ = false;
  void* releaseStream_ = nullptr;  // writeFlags'
  std::vector<uint64_t*> lastBatch_;  // writeFlags' last batch, and its value
  uint64_t lastValue_ = 0;
  std::vector<void*> streams_;  // side streams (program streams 1..)
  std::vector<std::vector<void*>> capturePools_;  // per program stream 1..: captured programs' (captureBackend)
  std::vector<void*> events_;
  void* joinEvent_ = nullptr;  // streamWaitStream's
  std::unique_ptr<CudaStreamBackend> backend_;
};

}  // namespace

std::unique_ptr<DeviceDriver> makeCudaDeviceDriver(const CudaApi& api, int device) {
  return std::make_unique<CudaDeviceDriver>(api, device);
}

}  // namespace loom
