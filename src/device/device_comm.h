// A communicator's device side: collectives on device memory, compiled to
// stream programs (algorithms/stream_collectives.h) and enqueued on the
// caller's stream; the host thread returns once they are enqueued, as with
// NCCL.  Everything here is plain C++: the device itself is behind
// DeviceDriver, which the CUDA communicator fills from the plug-in
// (cuda_device_driver.cc) and the tests from the simulated device
// (tests/sim_device.*), so the whole path (buffer checks, window exchange,
// peer memory import cache, compile, enqueue) runs on the host in ctest.
//
// Peer memory (the cuda_ipc kind): every rank allocates one device block at
// init, kFlagBlockBytes of flags then its window, zeroed before anyone maps
// it.  It publishes the block as an IpcRecord (the handle of the
// allocation's base, the offset of the block in it, its size, its process)
// through the communicator's init all-gather; every rank imports every
// other's through an IpcImportCache, so the windows and flags of all ranks
// are addressable here, and stream waits/writes (cuStreamWaitValue64 /
// cuStreamWriteValue64) act on the flags directly in device memory.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "algorithms/stream_collectives.h"
#include "src/device/stream_program.h"

namespace loom {

constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t
// Flags first in a rank's block, padded so the window starts 256-byte aligned.
constexpr size_t kFlagBlockBytes = 256;
static_assert(kFlagCount * sizeof(uint64_t) <= kFlagBlockBytes, "flags do not fit their block");
// Default slot of a CUDA communicator's window (the window is two slots).
constexpr size_t kDeviceSlotBytes = size_t(4) << 20;
// All-reduces up to this size use the one-shot program, larger ones
// reduce-scatter + all-gather.
constexpr size_t kDeviceOneShotBytes = size_t(256) << 10;

// A range of device memory as its owner describes it to the other ranks:
// bytes from the network (checked by IpcImportCache::import).
struct IpcRecord {
  uint8_t handle[kIpcHandleBytes];  // of the allocation's base
  uint64_t base = 0;                // the allocation's base as the owner sees it (cache key)
  uint64_t allocBytes = 0;          // the allocation's size
  uint64_t offset = 0;              // the range's start inside the allocation
  uint64_t bytes = 0;               // the range's size
  uint64_t process = 0;             // owner's process token (equal: this process, no handle is opened)
  int32_t device = 0;               // owner's device ordinal
  int32_t pad = 0;
};

// This process, as IpcRecord::process says it: random per process and mixed
// with the pid, so that a forked child or a process of another pid
// namespace is never taken for this one.
uint64_t thisProcessToken();

// The device calls a DeviceComm makes.  Every call throws loom::Error
// (loomUnhandledCudaError with CUDA's message for the CUDA driver).
class DeviceDriver {
 public:
  virtual ~DeviceDriver() = default;
  virtual int device() const = 0;       // ordinal, for messages and checks
  virtual const char* name() const = 0; // "cuda", "sim"
  // -1: host memory; otherwise the device whose memory `p` is.
  virtual int pointerDevice(const void* p) const = 0;
  // Zeroed device memory; released with release().
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  // The allocation `p` points into (cuMemGetAddressRange).
  virtual void addressRange(const void* p, void** base, size_t* bytes) const = 0;
  // IPC handle of an allocation's base; opening maps a peer's allocation
  // here (its base), closing unmaps it.
  virtual void exportHandle(void* base, uint8_t handle[kIpcHandleBytes]) const = 0;
  virtual void* openHandle(const uint8_t handle[kIpcHandleBytes]) = 0;
  virtual void closeHandle(void* mapped) = 0;
  // The backend that enqueues one program on `callerStream` (program
  // stream 0) and the driver's side streams and events (streams 1..,
  // events 0..): at least `streams` streams and `events` events.
  virtual StreamBackend& backend(void* callerStream, int streams, int events) = 0;
  // A flag's value now (device memory of any rank, as mapped here), read
  // from the host.
  virtual uint64_t readFlag(const uint64_t* flag) = 0;
  // Makes this device the calling thread's current one for the calls that
  // follow and returns what to give leave() to restore the caller's (CUDA:
  // the current device, as NCCL switches and restores it).
  virtual int enter() { return 0; }
  virtual void leave(int previous) { (void)previous; }
};

// Peers' device allocations mapped here, keyed by (rank, the owner's base
// address).  Opening a handle costs about a millisecond, so a mapping is
// kept while anything refers to it; a record with the same key but another
// handle means the owner freed and reused the address: the old mapping is
// closed once unreferenced and the new one opened.  A record of this
// process is its own address (CUDA cannot open its own process's handles).
class IpcImportCache {
 public:
  IpcImportCache(DeviceDriver& driver, uint64_t myProcess) : driver_(driver), process_(myProcess) {}
  ~IpcImportCache();
  // The start of rank r's range as mapped here, taking a reference.
  // loomRemoteError for a record that cannot be right (a range outside its
  // allocation, another device's memory when devices differ is fine).
  uint8_t* import(int r, const IpcRecord& rec);
  // Drops the reference import() took for this record.
  void release(int r, const IpcRecord& rec);
  size_t mapped() const;  // mappings open now (tests)
  size_t opens() const { return opens_; }  // handles opened so far (tests)

 private:
  struct Entry {
    uint8_t handle[kIpcHandleBytes];
    uint8_t* mapped = nullptr;  // base as mapped here
    bool opened = false;        // through openHandle (else: this process's own memory)
    int refs = 0;
  };
  void close(Entry& e);
  DeviceDriver& driver_;
  uint64_t process_;
  mutable std::mutex mu_;
  std::map<std::pair<int, uint64_t>, Entry> entries_;
  std::vector<Entry> retired_;  // replaced while still referenced
  size_t opens_ = 0;
};

// Describes [p, p + bytes) of this process's device memory for the peers.
IpcRecord exportRange(const DeviceDriver& driver, const void* p, size_t bytes, uint64_t process);

struct DeviceCommOptions {
  size_t slotBytes = kDeviceSlotBytes;        // every rank must use the same
  size_t oneShotBytes = kDeviceOneShotBytes;  // all-reduce: one-shot up to this size
  uint64_t process = 0;                       // this process (IpcRecord::process; thisProcessToken())
  // At destruction, how long to wait for the peers to finish reading this
  // rank's window before freeing it (a dead peer never does).
  int64_t drainTimeoutMs = 10000;
};

class DeviceComm {
 public:
  // All-gathers `bytes` of every rank into `all` (nranks * bytes), in rank
  // order: the communicator's bootstrap, or the test's.
  using AllGather = std::function<void(const void* mine, size_t bytes, void* all)>;

  // Allocates this rank's block, exchanges records, imports every peer's.
  DeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver, const AllGather& allGather,
             const DeviceCommOptions& options = {});
  ~DeviceComm();
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  int device() const { return driver_->device(); }
  const char* deviceName() const { return driver_->name(); }
  size_t slotBytes() const { return slotBytes_; }

  // Whether the device path runs `coll` (the others: loomInvalidUsage from run()).
  static bool serves(Collective coll);
  // Checks op's buffers (device memory of this device, not host memory:
  // loomInvalidArgument naming the buffer), compiles this rank's program
  // and enqueues it on callerStream.  Returns once enqueued.  An error
  // while enqueueing leaves the communicator failed (its rounds can no
  // longer agree with the peers'): every later call fails with it.
  void run(const OpDesc& op, void* callerStream);

  // Which all-reduce program `bytes` gets.
  StreamAlgorithm allReduceAlgorithm(size_t bytes) const {
    return bytes <= oneShotBytes_ ? StreamAlgorithm::OneShot : StreamAlgorithm::ReduceScatterAllGather;
  }
  uint64_t round() const;  // the round counter (tests)
  // Whether an enqueue failed (every later run() then fails).
  bool failed() const;
  // Destruction will not wait for the peers (the communicator failed or
  // was aborted: loomCommAbort never blocks).
  void abandon() { drainTimeoutMs_ = 0; }
  const IpcImportCache& imports() const { return *imports_; }

 private:
  void checkBuffer(const char* what, const void* p) const;
  // Waits until every peer's done flag shows it finished the last round
  // (so none reads this rank's window any more); false at the deadline.
  bool drain();

  int rank_, nranks_;
  size_t slotBytes_, oneShotBytes_;
  int64_t drainTimeoutMs_;
  std::unique_ptr<DeviceDriver> driver_;
  std::unique_ptr<IpcImportCache> imports_;
  void* block_ = nullptr;
  std::vector<IpcRecord> records_;  // every rank's block
  std::vector<uint8_t*> windows_;
  std::vector<uint64_t*> flags_;
  mutable std::mutex mu_;  // one program enqueued at a time, in round order
  uint64_t round_ = 0;
  std::string failed_;  // set once an enqueue failed
  loomResult_t failCode_ = loomSuccess;
};

}  // namespace loom
