// Simulated device memory and the DeviceDriver of a rank on a simulated
// device (tests/sim_device.h runs its stream programs), shared by the tests
// that drive CUDA communicators without a GPU: tests/unit_device_comm.cc
// and the NCCL shim's tests (nccl_shim/tests/shim_sim_test.cc).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "loom.h"
#include "src/core/error.h"
#include "src/device/capture_streams.h"
#include "src/device/device_comm.h"
#include "src/device/host_reduce.h"
#include "tests/sim_device.h"

namespace loomsim {

// A failed check inside the simulated driver, which runs on the ranks'
// threads: Catch2's REQUIRE is not thread-safe (TSan found it), so the
// driver throws like a CUDA call would, and the test sees the error.
inline void simCheck(bool ok, const char* what) {
  if (!ok) loom::fail(loomSystemError, "sim driver: %s failed", what);
}

// Device memory of simulated devices, shared by every rank of a test (all
// threads of this process).  Each allocation is a memfd; "opening" its
// handle maps the memfd again, at another address.
class SimMemory {
 public:
  ~SimMemory() {
    // A destroyed communicator's memory may still be with the reaper
    // (device_comm.h), which frees it here: before this goes.
    loom::waitDeviceRemains(30000);
    for (auto& [base, a] : allocs_) {
      munmap(base, a.bytes);
      close(a.fd);
    }
    for (auto& [base, bytes] : freed_) munmap(base, bytes);
  }
  uint8_t* alloc(int device, size_t bytes) {
    int fd = memfd_create("loom-sim-device", MFD_CLOEXEC);
    simCheck(fd >= 0, "memfd_create");
    simCheck(ftruncate(fd, off_t(bytes)) == 0, "ftruncate");
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    simCheck(p != MAP_FAILED, "mmap");
    std::lock_guard<std::mutex> g(mu_);
    allocs_[static_cast<uint8_t*>(p)] = Alloc{device, bytes, fd, ++serial_};
    return static_cast<uint8_t*>(p);
  }
  void free(void* p) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = allocs_.find(static_cast<uint8_t*>(p));
    if (it == allocs_.end()) loom::fail(loomInvalidArgument, "sim free of %p: not an allocation base", p);
    // CUDA: freeing exported memory before every importer closed its
    // handle is undefined behaviour; counted here, and every test's
    // fixture checks that it never happens.  The memory itself stays
    // mapped (not reused) until the SimMemory goes.
    for (auto& [m, target] : mappings_)
      if (target.first == it->first) ++freedWhileMapped_;
    freed_.emplace_back(it->first, it->second.bytes);
    close(it->second.fd);
    allocs_.erase(it);
  }
  size_t frees() const {
    std::lock_guard<std::mutex> g(mu_);
    return freed_.size();
  }
  // -1 unless p is inside an allocation (or a mapping of one).
  int deviceOf(const void* p) const {
    std::lock_guard<std::mutex> g(mu_);
    const Alloc* a = find(p, nullptr);
    return a ? a->device : -1;
  }
  void range(const void* p, void** base, size_t* bytes) const {
    std::lock_guard<std::mutex> g(mu_);
    uint8_t* b = nullptr;
    const Alloc* a = find(p, &b);
    if (!a) loom::fail(loomInvalidArgument, "sim: %p is not device memory", p);
    *base = b;
    *bytes = a->bytes;
  }
  void handle(void* base, uint8_t out[loom::kIpcHandleBytes]) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = allocs_.find(static_cast<uint8_t*>(base));
    if (it == allocs_.end()) loom::fail(loomInvalidArgument, "sim: no allocation at %p", base);
    memset(out, 0, loom::kIpcHandleBytes);
    memcpy(out, &it->second.serial, sizeof(uint64_t));
  }
  void* open(const uint8_t h[loom::kIpcHandleBytes]) {
    uint64_t serial;
    memcpy(&serial, h, sizeof serial);
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [base, a] : allocs_)
      if (a.serial == serial) {
        void* p = mmap(nullptr, a.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a.fd, 0);
        simCheck(p != MAP_FAILED, "mmap of an opened handle");
        mappings_[static_cast<uint8_t*>(p)] = {base, a.bytes};
        ++opens_;
        return p;
      }
    loom::fail(loomUnhandledCudaError, "sim: invalid IPC handle (serial %llu)", (unsigned long long)serial);
  }
  void closeMapping(void* p) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = mappings_.find(static_cast<uint8_t*>(p));
    if (it == mappings_.end()) loom::fail(loomUnhandledCudaError, "sim: close of %p: not a mapping", p);
    munmap(p, it->second.second);
    mappings_.erase(it);
    ++closes_;
  }
  size_t openMappings() const {
    std::lock_guard<std::mutex> g(mu_);
    return mappings_.size();
  }
  // Frees of memory that a mapping of it still outlived (see free()).
  size_t freedWhileMapped() const {
    std::lock_guard<std::mutex> g(mu_);
    return freedWhileMapped_;
  }
  int opens() const { return opens_; }
  int closes() const { return closes_; }
  size_t live() const {  // allocations not freed
    std::lock_guard<std::mutex> g(mu_);
    return allocs_.size();
  }

 private:
  struct Alloc {
    int device;
    size_t bytes;
    int fd;
    uint64_t serial;
  };
  // The allocation p lies in, directly or through a mapping (*base: the
  // start of whichever it is in).
  const Alloc* find(const void* p, uint8_t** base) const {
    auto q = static_cast<const uint8_t*>(p);
    for (auto& [b, a] : allocs_)
      if (q >= b && q < b + a.bytes) {
        if (base) *base = b;
        return &a;
      }
    for (auto& [m, bb] : mappings_) {
      auto it = allocs_.find(bb.first);
      if (it != allocs_.end() && q >= m && q < m + it->second.bytes) {
        if (base) *base = m;
        return &it->second;
      }
    }
    return nullptr;
  }
  mutable std::mutex mu_;
  std::map<uint8_t*, Alloc> allocs_;
  std::map<uint8_t*, std::pair<uint8_t*, size_t>> mappings_;  // mapping -> (allocation base, bytes)
  std::vector<std::pair<uint8_t*, size_t>> freed_;
  uint64_t serial_ = 0;
  int opens_ = 0, closes_ = 0;
  size_t freedWhileMapped_ = 0;
};

// Pinned host allocations of every SimDriver not yet released.
inline std::atomic<long> g_pinnedLive{0};
// The rank whose SimDriver fails every openHandle, as a failing
// cudaIpcOpenMemHandle would (-1: none).
inline std::atomic<int> g_failOpenRank{-1};

// The calling thread's current simulated device, as CUDA's per-thread
// current device: 0 on a thread that never chose one.
inline thread_local int t_simCurrentDevice = 0;

// The DeviceDriver of one rank on a simulated device: memory from
// SimMemory, the stream backend of the rank in a SimDeviceWorld.  As with
// CUDA, the calls that act on "the current device" (allocating, mapping a
// peer's handle, creating streams, synchronising) must run with this
// rank's device current (DeviceScope); here they fail otherwise, which a
// real GPU would not say but do on the wrong device.
class SimDriver final : public loom::DeviceDriver {
 public:
  SimDriver(SimMemory& mem, loomsim::SimDeviceWorld* world, int rank, int device)
      : mem_(mem), world_(world), rank_(rank), device_(device) {}
  int device() const override { return device_; }
  const char* name() const override { return "sim"; }
  int enter() override {
    const int previous = t_simCurrentDevice;
    t_simCurrentDevice = device_;
    return previous;
  }
  void leave(int previous) override {
    if (previous >= 0) t_simCurrentDevice = previous;
  }
  void onDevice(const char* what) const {
    if (t_simCurrentDevice != device_)
      loom::fail(loomSystemError, "sim driver: %s for device %d while the thread's current device is %d (a call "
                 "outside a DeviceScope)", what, device_, t_simCurrentDevice);
  }
  int pointerDevice(const void* p) const override { return mem_.deviceOf(p); }
  void* allocate(size_t bytes) override {
    onDevice("allocate");
    return mem_.alloc(device_, bytes);
  }
  void release(void* p) override { mem_.free(p); }
  void addressRange(const void* p, void** base, size_t* bytes) const override { mem_.range(p, base, bytes); }
  // cudaDeviceSynchronize: this rank's streams (its error is the streams'
  // own, reported where they are synchronised).
  void synchronize() override {
    onDevice("synchronize");
    std::string msg;
    if (world_) world_->rank(rank_).synchronize(&msg);
  }
  void exportHandle(void* base, uint8_t h[loom::kIpcHandleBytes]) const override { mem_.handle(base, h); }
  void* openHandle(const uint8_t h[loom::kIpcHandleBytes]) override {
    onDevice("openHandle");
    if (g_failOpenRank.load() == rank_)
      loom::fail(loomUnhandledCudaError, "sim:%d: cudaIpcOpenMemHandle failed: peer access is not supported between "
                 "these devices (CUDA error 217)", device_);
    return mem_.open(h);
  }
  void closeHandle(void* mapped) override {
    onDevice("closeHandle");
    mem_.closeMapping(mapped);
  }
  // Pinned host memory is host memory here (pointerDevice says -1).
  void* allocateHost(size_t bytes) override {
    g_pinnedLive.fetch_add(1);
    return aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  }
  void releaseHost(void* p) override {
    g_pinnedLive.fetch_sub(1);
    ::free(p);
  }
  void storeHostFlag(uint64_t* flag, uint64_t value) override {
    reinterpret_cast<std::atomic<uint64_t>*>(flag)->store(value, std::memory_order_release);
    if (world_) world_->notify();
  }
  std::atomic<bool> failLaunch{false};  // backend() fails as a CUDA launch would
  // What backend() and captureBackend() check first.
  void checkLaunch(int streams, int events) {
    onDevice("backend (stream creation)");
    if (failLaunch.load()) loom::fail(loomUnhandledCudaError, "sim: cuStreamWaitValue64 failed: device lost");
    simCheck(streams <= 3, "at most 2 side streams");
    simCheck(events <= 8, "at most 8 events");
  }
  loom::StreamBackend& backend(void* callerStream, int streams, int events) override {
    checkLaunch(streams, events);
    loomsim::SimRank& r = world_->rank(rank_);
    const int caller = r.callerStream(callerStream);
    if (caller == 0) return r;
    caller_ = std::make_unique<loomsim::SimCallerBackend>(r, caller);  // as CUDA's: valid until the next call
    return *caller_;
  }
  // As CUDA's driver: the side streams come from pools (one per program
  // stream) of the rank's capture streams (SimRank::captureSideStream),
  // through the same choice.
  loom::StreamBackend& captureBackend(void* callerStream, int streams, int events) override {
    if (streams <= 1) return backend(callerStream, streams, events);
    checkLaunch(streams, events);
    loomsim::SimRank& r = world_->rank(rank_);
    const int caller = r.callerStream(callerStream);
    simCheck(caller != 0, "a capture on an added caller stream");
    auto captureOf = [&r](void* s) { return r.captureOf(int(reinterpret_cast<uintptr_t>(s))); };
    std::vector<int> map{caller};
    if (int(capturePools_.size()) < streams - 1) capturePools_.resize(size_t(streams - 1));
    for (int s = 1; s < streams; ++s)
      map.push_back(int(reinterpret_cast<uintptr_t>(
          loom::pickCaptureStream(capturePools_[size_t(s - 1)], r.captureOf(caller), captureOf, [&] {
            simCheck(madeCapture_ < loomsim::SimRank::kCaptureSideStreams, "a free capture side stream");
            return reinterpret_cast<void*>(uintptr_t(r.captureSideStream(madeCapture_++)));
          }))));
    caller_ = std::make_unique<loomsim::SimCallerBackend>(r, std::move(map));
    return *caller_;
  }
  void streamWaitStream(void* waiter, void* waited) override {
    onDevice("streamWaitStream");
    if (failLaunch.load()) loom::fail(loomUnhandledCudaError, "sim: cudaEventRecord failed: device lost");
    loomsim::SimRank& r = world_->rank(rank_);
    r.joinStream(r.callerStream(waiter), r.callerStream(waited));
    joins.fetch_add(1);
  }
  std::atomic<size_t> joins{0};  // streamWaitStream calls (tests)
  // A user object of the graph being captured on `stream`.
  void retainOnCapture(void* stream, std::function<void()> release) override {
    if (!world_->rank(rank_).holdInCapture(stream, release)) {
      release();
      loom::fail(loomUnhandledCudaError, "sim: cudaStreamGetCaptureInfo: stream %p is not being captured", stream);
    }
  }
  // The host's arithmetic, as the device kernel's (reduce_ops.h), on the
  // caller's stream; a scalar "on the device" is read when the work runs.
  void scale(void* stream, void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
             bool scalarOnDevice) override {
    onDevice("scale");
    if (failLaunch.load()) loom::fail(loomUnhandledCudaError, "sim: the scale kernel's launch failed: device lost");
    loomsim::SimRank& r = world_->rank(rank_);
    uint64_t k = 0;
    if (!scalarOnDevice) memcpy(&k, scalar, loom::dtypeSize(type));
    r.enqueueWork(r.callerStream(stream), [=] {
      uint64_t by = k;
      if (scalarOnDevice) memcpy(&by, scalar, loom::dtypeSize(type));
      loom::scaleHost(dst, src, count, type, &by);
    });
  }
  std::atomic<bool> failReads{false};  // flag reads fail as after a sticky CUDA error
  uint64_t readFlag(const uint64_t* flag) override {
    if (failReads.load())
      loom::fail(loomUnhandledCudaError, "sim: cudaMemcpyAsync failed: an illegal memory access was encountered "
                 "(CUDA error 700)");
    return reinterpret_cast<const std::atomic<uint64_t>*>(flag)->load(std::memory_order_acquire);
  }
  // As a write on a stream of its own: at once, waking the streams that wait.
  void writeFlags(uint64_t* const* flags, size_t n, uint64_t value) override {
    for (size_t i = 0; i < n; ++i)
      reinterpret_cast<std::atomic<uint64_t>*>(flags[i])->store(value, std::memory_order_release);
    writes.fetch_add(n);
    if (world_) world_->notify();
  }
  std::atomic<size_t> writes{0};  // flags written by writeFlags (tests)

 private:
  SimMemory& mem_;
  loomsim::SimDeviceWorld* world_;
  int rank_, device_;
  std::unique_ptr<loomsim::SimCallerBackend> caller_;
  std::vector<std::vector<void*>> capturePools_;  // captureBackend's, per program stream 1..
  int madeCapture_ = 0;                            // the rank's capture streams handed out so far
};

}  // namespace loomsim
