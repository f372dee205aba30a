// A communicator's device side: collectives on device memory, compiled to
// stream programs (algorithms/stream_collectives.h) and enqueued on the
// caller's stream; the host thread returns once they are enqueued, as with
// NCCL.  Everything here is plain C++: the device itself is behind
// DeviceDriver, which the CUDA communicator fills from the plug-in
// (cuda_device_driver.cc) and the tests from the simulated device
// (tests/sim_device.*), so the whole path (buffer checks, window exchange,
// peer memory import cache, compile, enqueue, failure release) runs on the
// host in ctest.
//
// Peer memory (the cuda_ipc kind): every rank allocates one device block at
// init, flagAreaBytes(nranks) of flags then its window, zeroed before anyone
// maps it.  It publishes the block as an IpcRecord (the handle of the
// allocation's base, the offset of the block in it, its size, its process)
// through the communicator's init all-gather; every rank imports every
// other's through an IpcImportCache, so the windows and flags of all ranks
// are addressable here, and stream waits/writes (cuStreamWaitValue64 /
// cuStreamWriteValue64) act on the flags directly in device memory.  A
// rank's memory is freed only once no peer maps it (map_board.h: each peer
// holds a lock on the owner's board while it maps the owner's memory); a
// destroy that finds a peer still holding leaves it to the reaper below.
//
// Flags are kept where they are read: row r of a rank's flag area holds
// rank r's kFlagCount flags as this rank sees them, and a rank's SetFlag
// writes its value into its row of every rank's area (its own last).  So
// every stream wait of a rank is on its own memory, and a rank can release
// its own waits without touching (or releasing) any peer's.
//
// Send/recv (runP2P) stages its chunks in a region of the sender's device
// memory per receiver, and synchronises on the per-pair flags
// (kFlagP2PSent/kFlagP2PAcked, written into one reader's row only): every
// wait is still on this rank's own memory.  The regions are made on the
// pair's first use, not at init (prepareP2P): a sender allocates its region
// for a receiver at its first send to it; a receiver asks the sender for
// it at its first receive from it (options.fetchRegion: the communicator's
// control plane, whose thread answers through p2pRegionFor and allocates
// the region then if the sender has not yet), so the receiver never waits
// for the sender's own calls, only for its control thread.
//
// Failure (DeviceComm::markFailed: a peer's Fail notice, loomCommAbort, an
// enqueue error, or the watchdog below): the communicator fails for good,
// and a watchdog thread writes kReleasedFlag into every peer row of this
// rank's flag area from the host (DeviceDriver::writeFlags: a write on a
// stream of the driver's own, never waiting for the device), which
// satisfies every wait this rank's streams have pending or will reach.  A
// live peer's program may still write a lower value there afterwards, so
// the release is repeated until this rank's own programs have finished
// (its own done flag reaches the last round enqueued).  The streams then
// run the rest of their programs on whatever the windows hold: the output
// buffers of every operation not complete when the communicator failed are
// undefined.  The watchdog also finds failures by itself while a program is
// pending: a peer the owner's probe reports gone (loomRemoteError naming
// it), or no flag moving for timeoutMs (loomTimeout naming the peers the
// streams wait for).
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/schedule.h"
#include "src/core/error.h"
#include "algorithms/stream_collectives.h"
#include "src/device/map_board.h"
#include "src/device/op_signature.h"
#include "src/device/stream_program.h"

namespace loom {

constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t
// Flags first in a rank's block (a row of kFlagCount per rank), padded so
// the window starts 256-byte aligned.  The window: the collectives' two
// slots (streamWindowBytes); send/recv staging is allocated apart, per pair
// on first use (p2pRegionBytes).
inline size_t flagAreaBytes(int nranks) {
  return (size_t(nranks) * kFlagCount * sizeof(uint64_t) + 255) / 256 * 256;
}
// The graph lane's part of a rank's block, after the collectives' window:
// a flag area and a window of two graph slots (none without a lane).
inline size_t graphLaneBytes(int nranks, size_t graphSlotBytes) {
  return graphSlotBytes ? flagAreaBytes(nranks) + 2 * graphSlotBytes : 0;
}
// Device zero-copy's cell area (CellIndex), after the flags when the
// communicator has it (DeviceCommOptions::zeroCopy), padded the same way.
inline size_t cellAreaBytes(int nranks) {
  return (size_t(nranks) * kCellRowWords * sizeof(uint64_t) + 255) / 256 * 256;
}
// What a release writes into the flags this rank waits on: above any value
// a round counter reaches, so it satisfies every wait ("flag >= value").
constexpr uint64_t kReleasedFlag = uint64_t(1) << 62;
// The slot DeviceCommOptions defaults to, which the unit tests use (small,
// so that their buffers take several rounds).  Communicators made through
// the C API take LOOM_DEVICE_SLOT_BYTES (Config::deviceSlotBytes, 32 MiB
// by default: each round costs tens of microseconds on a GPU whatever its
// size, docs/testing.md).
constexpr size_t kDeviceSlotBytes = size_t(4) << 20;
// The graph lane's slot DeviceCommOptions defaults to (the unit tests':
// small, so that captured calls take several rounds).  Communicators made
// through the C API take LOOM_DEVICE_GRAPH_SLOT_BYTES (8 MiB by default).
constexpr size_t kDeviceGraphSlotBytes = size_t(256) << 10;
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
  uint32_t board = 0;               // a block's: the serial of the owner's map board (map_board.h); 0: none
};

// This process, as IpcRecord::process says it: random per process and mixed
// with the pid, so that a forked child or a process of another pid
// namespace is never taken for this one.
uint64_t thisProcessToken();

// DeviceDriver::enter's answer for a thread that had no current device
// context (CUDA: cuCtxGetCurrent gave none).
constexpr int kNoContext = -2;

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
  // Device memory that need not be zeroed, allocated without waiting for
  // the device (CUDA: cudaMalloc alone; allocate's memset and synchronise
  // would wait for streams that may wait on peers): send/recv staging,
  // made while the communicator runs.  Released with release().
  virtual void* allocateStaging(size_t bytes) { return allocate(bytes); }
  virtual void release(void* p) = 0;
  // Waits until everything enqueued on the device is done (CUDA:
  // cudaDeviceSynchronize, which cudaFree does anyway).  loomMemFree of
  // memory a peer may read in place calls it first: a rank's programs on
  // published buffers end only once the peers are done reading them.
  virtual void synchronize() {}
  // Pinned host memory the device reads and writes at the same address
  // (CUDA: cudaHostAlloc, mapped and portable), not zeroed: the staged
  // path's buffers and flags (staged_comm.h).  Released with releaseHost().
  virtual void* allocateHost(size_t bytes) = 0;
  virtual void releaseHost(void* p) = 0;
  // Writes a flag in pinned host memory (allocateHost) from the host, as a
  // release store (the simulated device also wakes its waiting streams).
  virtual void storeHostFlag(uint64_t* flag, uint64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }
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
  // backend() for a program captured into the graph being captured on
  // `callerStream` (a replayable one): its side streams are never the
  // eager ones, nor streams another capture holds (capture_streams.h).
  // This default serves programs on one stream only.
  virtual StreamBackend& captureBackend(void* callerStream, int streams, int events) {
    if (streams > 1)
      fail(loomInternalError, "the %s driver cannot capture a program on %d streams", name(), streams);
    return backend(callerStream, streams, events);
  }
  // Makes `waiter` wait for everything enqueued on `waited` so far (CUDA:
  // an event recorded on `waited`, then cudaStreamWaitEvent on `waiter`),
  // as a group whose calls on one communicator use several streams joins
  // them (DeviceCollectives::joinStreams).  Callers serialise (their
  // communicator's lock) and have the device current.
  virtual void streamWaitStream(void* waiter, void* waited) = 0;
  // dst = src * k on `stream` (loomScale; CudaApi::launchScale): k is the
  // one element of `type` at `scalar`, host memory read now, or with
  // scalarOnDevice device memory read when the work runs.  With the
  // device current.
  virtual void scale(void* stream, void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
                     bool scalarOnDevice) = 0;
  // The graph being captured on `stream` holds `release` until that graph
  // and every executable graph made from it are gone, then calls it once
  // (CUDA: a user object the graph retains; on a thread of CUDA's, so it
  // must not call CUDA).  It runs exactly once in every case: when this
  // throws, it has run or runs soon.  This default keeps nothing:
  // release() at once.
  virtual void retainOnCapture(void* stream, std::function<void()> release) {
    (void)stream;
    release();
  }
  // A flag's value now (device memory of any rank, as mapped here), read
  // from the host.
  virtual uint64_t readFlag(const uint64_t* flag) = 0;
  // Writes `value` into `n` flags of this rank's own device memory from the
  // host, on a stream of the driver's own that waits for nothing else, and
  // returns without waiting for the device (it is how a failed
  // communicator releases its pending stream waits; see above).
  virtual void writeFlags(uint64_t* const* flags, size_t n, uint64_t value) = 0;
  // Readies reads of up to `n` flags at once (CUDA: pinned memory for them
  // to land in): called once at init, next to the block's allocation and
  // with the same risk, so that no read allocates (the watchdog reads while
  // streams wait on peers and must never block in an allocation; freeing
  // pinned memory synchronises the device and happens only when the driver
  // goes, as cudaFree of the block does).  Larger reads, or reads without
  // it, still work (CUDA: into pageable memory).
  virtual void prepareFlagReads(size_t n) { (void)n; }
  // n consecutive flags from `first` (this rank's own device memory) into
  // out, read from the host.
  virtual void readFlags(const uint64_t* first, size_t n, uint64_t* out) {
    for (size_t i = 0; i < n; ++i) out[i] = readFlag(first + i);
  }
  // Makes this device the calling thread's current one for the calls that
  // follow and returns what to give leave() to restore the caller's (CUDA:
  // the current device, as NCCL switches and restores it; kNoContext for a
  // thread that had no CUDA context, which leave() gives none again; -1:
  // nothing to restore).
  virtual int enter() { return 0; }
  virtual void leave(int previous) { (void)previous; }
};

// The driver's device for the calls of a scope (DeviceDriver::enter), the
// caller's current device again when it ends.
struct DeviceScope {
  DeviceDriver& d;
  int previous;
  explicit DeviceScope(DeviceDriver& driver) : d(driver), previous(driver.enter()) {}
  ~DeviceScope() { d.leave(previous); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
};

// DeviceScope for a destroyed communicator's frees (the reaper thread may
// have any device current, or none): a device that cannot be selected is
// said, and the calls go ahead (memory freed from the wrong device beats
// memory kept for ever).  End it before the driver goes.
struct QuietDeviceScope {
  DeviceDriver& d;
  int previous = -1;
  QuietDeviceScope(DeviceDriver& driver, int rank, const char* what);
  ~QuietDeviceScope() { d.leave(previous); }
  QuietDeviceScope(const QuietDeviceScope&) = delete;
  QuietDeviceScope& operator=(const QuietDeviceScope&) = delete;
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
  // Unmaps rank r's allocation at `base` now, whatever refers to it (the
  // owner is about to free it: device zero-copy).  False if none is mapped.
  bool forget(int r, uint64_t base);
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

// DeviceCollectives::joinStreams on `driver` (whose communicator's lock the
// caller holds), in its device's scope.
void joinStreamsOn(DeviceDriver& driver, void* main, const std::vector<void*>& others, bool before);
// DeviceCollectives::scale on `driver` (the caller holds its
// communicator's lock).
void scaleOn(DeviceDriver& driver, void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
             bool scalarOnDevice, void* stream);

// Describes [p, p + bytes) of this process's device memory for the peers.
IpcRecord exportRange(const DeviceDriver& driver, const void* p, size_t bytes, uint64_t process);

// The answer to a peer's question for a send/recv region, as bytes (the
// control plane carries them): a result code, then the record (loomSuccess)
// or the error's text.  loomInProgress: not ready yet, ask again.
std::vector<uint8_t> encodeRegionAnswer(loomResult_t code, const IpcRecord* rec, const std::string& msg);
// Rank `peer`'s answer: true with *rec filled, false for loomInProgress;
// throws its error (the code it sent, the text naming it), or
// loomRemoteError for bytes that are no answer.
// `what`: what was asked for, for the error.
bool decodeRegionAnswer(int peer, const std::vector<uint8_t>& bytes, IpcRecord* rec,
                        const char* what = "its send/recv region");

struct DeviceCommOptions {
  size_t slotBytes = kDeviceSlotBytes;        // every rank must use the same
  // The graph lane: calls on a stream being captured into a CUDA graph run
  // replayable programs (makeReplayable) in a window of two slots of this
  // size and a flag area of their own, after the collectives' window in
  // the block (0: no graph lane, such calls are loomInvalidUsage).  Every
  // rank must use the same.
  size_t graphSlotBytes = kDeviceGraphSlotBytes;
  size_t oneShotBytes = kDeviceOneShotBytes;  // all-reduce: one-shot up to this size
  uint64_t process = 0;                       // this process (IpcRecord::process; thisProcessToken())
  // At destruction, how long to wait for the peers to finish reading this
  // rank's window before freeing it (a dead peer never does).
  int64_t drainTimeoutMs = 10000;
  // The watchdog: loomTimeout when a program is pending and no flag this
  // rank sees moves for this long (0: never; the communicator passes
  // LOOM_TIMEOUT_MS).
  int64_t timeoutMs = 0;
  // After this long without progress, and as often, the watchdog asks
  // peerGone about each peer the streams wait for.
  int64_t probeAfterMs = 1000;
  // Whether `peer` is known to be gone (why in *why): the communicator asks
  // its control plane.  Called on the watchdog thread.  Empty: never asked.
  std::function<bool(int peer, std::string* why)> peerGone{};
  // Told of a failure the watchdog found (the Error names the peer when
  // one is at fault), after the DeviceComm has failed and started
  // releasing; called on the watchdog thread, never for markFailed's own
  // callers.  The communicator propagates it to the peers from here.
  std::function<void(const Error&)> onFailure{};
  // A failed communicator destroyed while its streams still run (a wait was
  // released but the caller's stream has not reached it) hands its device
  // memory to a reaper thread that keeps releasing and frees it once the
  // streams are done; a communicator destroyed while a peer still maps its
  // memory (the peer's communicator is not destroyed yet; map_board.h)
  // hands it over too, to be freed once no peer maps it.  After this long
  // it is left allocated (never freed under a running stream, nor while a
  // peer maps it).
  int64_t reapTimeoutMs = 60000;
  // Send/recv: asks rank `peer` for its staging region for this rank (the
  // peer's p2pRegionFor(this rank)) and waits for the answer; throws Error
  // (the peer gone, no answer by the deadline, its allocation failed).  The
  // communicator asks over its control plane; tests call the peer.  Empty:
  // a receive from another rank is loomInvalidUsage.
  std::function<IpcRecord(int peer)> fetchRegion{};
  // The mismatch checks (src/device/op_signature.h): sends a batch of this
  // rank's collective signatures, or of its sends' sizes, to rank `peer`
  // without waiting (the communicator's control plane; called on the
  // watchdog thread).  Empty: no check.
  std::function<void(int peer, std::vector<uint8_t> bytes)> sendSignatures{};
  // Device zero-copy (StreamPublish in algorithms/stream_collectives.h):
  // the communicator has cell areas, so a rank may publish the buffers of
  // its reduce-scatter + all-gather all-reduces instead of staging them.
  // Every rank must use the same value (the block layout differs; init
  // refuses a mix).
  bool zeroCopy = false;
  // Whether [p, p + bytes) may be published, and its allocation's base:
  // memory whose free has the peers unmap it first (loomMemAlloc's,
  // device_memory.h; CUDA: freeing memory an importer still has open is
  // undefined).  Empty: this rank publishes nothing (it still reads the
  // peers' cells).
  std::function<bool(const void* p, size_t bytes, void** base)> publishable{};
  // Asks rank `peer` to map the allocation `rec` describes (its
  // importPublished(this rank, rec)) and returns its start there; throws
  // Error.  Empty: this rank publishes nothing.
  std::function<uint64_t(int peer, const IpcRecord& rec)> publishTo{};
  // Asks rank `peer` to unmap it (its forgetPublished); throws Error.
  std::function<void(int peer, const IpcRecord& rec)> unpublishTo{};
  // Registers unpublish() as a hook of deviceMemFree (device_memory.h), so
  // a loomMemFree of published memory has the peers unmap it first.
  bool freeHook = false;
};

// What a DeviceComm has allocated and mapped (memoryStats(), loomCommDump).
struct DeviceMemoryStats {
  size_t blockBytes = 0;      // allocated at init: the flags and the collectives' window
  size_t regionsOut = 0;      // send/recv staging allocated here (one per receiver)
  size_t regionBytesOut = 0;  // their bytes
  size_t regionsIn = 0;       // peers' staging for this rank mapped here (one per sender but itself)
  size_t published = 0;       // allocations of this rank's that the peers map (device zero-copy)
  size_t publishedIn = 0;     // peers' allocations mapped here for them
};

// A call being enqueued in steps (DeviceCollectives::beginRun): step(n)
// enqueues up to n more stream operations and says whether all are.  It
// holds the communicator (no other call enqueues meanwhile) until it is
// destroyed; one destroyed before its last step, or whose step threw,
// leaves the communicator failed.
class SteppedRun {
 public:
  virtual ~SteppedRun() = default;
  virtual bool step(size_t maxOps) = 0;
};

// A communicator's device side as the API and the communicator use it,
// whichever way it moves the bytes: DeviceComm (below: every rank's device
// memory mapped through CUDA IPC; one host) or StagedDeviceComm
// (staged_comm.h: through pinned host memory and the host path's
// transports; ranks on any hosts).  Both enqueue on the caller's stream and
// return; both fail for good at their first error.
class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual int device() const = 0;
  virtual const char* deviceName() const = 0;
  // "ipc" or "staged" (loomCommDump, the init log line).
  virtual const char* pathName() const = 0;
  // Whether run()/runP2P() would take `op` (see DeviceComm::check).
  virtual void check(const OpDesc& op) const = 0;
  // `stream` is being captured into a CUDA graph: throws loomInvalidUsage
  // with the reason unless this path can capture a collective (p2p: sends
  // and receives) on it.  Only DeviceComm's graph lane captures
  // collectives; this default refuses everything.
  virtual void checkCapture(void* stream, bool p2p) const;
  virtual void run(const OpDesc& op, void* callerStream) = 0;
  virtual void runP2P(const std::vector<OpDesc>& ops, void* callerStream) = 0;
  // run()/runP2P() in steps, for one thread that drives several
  // communicators and interleaves their calls (loomGroupEnd; see
  // ProgramEnqueuer).  nullptr: this path enqueues nothing that waits on a
  // peer's later work (the staged path's host thread drives its waits), so
  // run()/runP2P() at once is as good.
  virtual std::unique_ptr<SteppedRun> beginRun(const OpDesc& /*op*/, void* /*callerStream*/) { return nullptr; }
  virtual std::unique_ptr<SteppedRun> beginRunP2P(const std::vector<OpDesc>& /*ops*/, void* /*callerStream*/) {
    return nullptr;
  }
  // A group whose calls on this communicator used several streams runs
  // them all on the first (`main`), joined to the others as NCCL joins a
  // group's streams: with `before`, main waits for everything enqueued on
  // each of `others` so far (called before anything of the group is
  // enqueued); else each of `others` waits for everything enqueued on main
  // so far (called once the group's calls are).  Enqueues only.
  virtual void joinStreams(void* main, const std::vector<void*>& others, bool before) = 0;
  // loomScale on this communicator's device and callerStream (count > 0,
  // no NULL, no overlap: the API checked): checks the buffers (device memory
  // of this device, whole elements) and enqueues dst = src * k
  // (DeviceDriver::scale).
  virtual void scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
                     bool scalarOnDevice, void* callerStream) = 0;
  // What runP2P needs made before anything of a group is enqueued (nothing
  // on the staged path).
  virtual void prepareP2P(const std::vector<OpDesc>& ops) = 0;
  // A peer's question for this rank's send/recv region (the IPC path only;
  // the staged path has none and says so).
  virtual IpcRecord p2pRegionFor(int reader);
  // Device zero-copy's questions from a peer (the IPC path only; the others
  // say they have none): DeviceComm::importPublished / forgetPublished.
  virtual uint64_t importPublished(int owner, const IpcRecord& rec);
  virtual void forgetPublished(int owner, const IpcRecord& rec);
  // Has the peers unmap everything this rank published (a healthy
  // communicator's destroy, while its control plane still runs, after
  // stopWatchdog; it waits for this rank's programs first).
  virtual void unpublishAll() {}
  // loomCommRegister: whether [p, p + bytes) is device memory (false: host
  // memory; loomInvalidArgument: another device's) and the base of the
  // CUDA allocation holding it whole, which device zero-copy may then
  // publish (*allocation nullptr: none, or a path that publishes nothing).
  virtual bool deviceMemory(const void* p, size_t bytes, void** allocation);
  // Its deregistration (no registration holds it any more): once this
  // process's work on the device is done, as loomMemFree waits, the peers
  // unmap the allocation if this rank published it, unless `held` (checked
  // under the lock publishing takes) says it was registered again
  // meanwhile.  A failed communicator asks no peer (one may still read it;
  // as its destroy) and only forgets it.  Never throws.
  virtual void withdraw(void* /*allocation*/, const std::function<bool()>& /*held*/) {}
  // A peer's batch of collective signatures (the IPC path's mismatch
  // check, src/device/op_signature.h; on the control thread).
  virtual void onPeerSignatures(int /*from*/, const std::vector<uint8_t>& /*bytes*/) {}
  virtual bool failed() const = 0;
  virtual bool markFailed(loomResult_t code, const std::string& msg) = 0;
  virtual void setTimeoutMs(int64_t ms) = 0;
  // The owner stops the threads that call back into it before it goes.
  virtual void stopWatchdog() = 0;
  // Destruction will not wait for the peers (failed or aborted).
  virtual void abandon() = 0;
  // loomCommDump's lines about the device side.
  virtual std::string describe() const = 0;
};

// The buffers one rank's part of `op` reads and writes (a root-only side
// is not used elsewhere) and their sizes.
struct DeviceOpShape {
  bool needSend = true, needRecv = true;
  size_t sendBytes = 0, recvBytes = 0;
};
DeviceOpShape deviceOpShape(const OpDesc& op, int rank, int nranks);
// The checks both paths make before taking `op`: a collective the device
// side serves (else loomInvalidUsage), no tags, buffers of the driver's
// device (else loomInvalidArgument naming the buffer).
void checkDeviceOp(const DeviceDriver& driver, const OpDesc& op, int rank, int nranks);

// What a destroyed communicator leaves while its streams may still use it
// (it failed) or a peer may still map it: a reaper thread calls step()
// (release the waits once more; true once the streams are done and no peer
// maps the memory) every millisecond, then free(); at `deadline` it gives
// up and leaves the memory allocated (never freed under a running stream,
// nor while a peer maps it).
struct DeviceRemains {
  virtual ~DeviceRemains() = default;
  virtual bool step() = 0;
  virtual void free() = 0;
  // What it still waits for, for the warning when the reaper gives up.
  virtual std::string waitingFor() const { return "its streams to finish"; }
  // Past the deadline it is kept and polled (slowly) instead of given up
  // on: nothing of this rank's still runs on it, it waits for peers only.
  virtual bool patient() const { return false; }
  // Kept for good (given up on, or the process exits): names it owns in
  // the file system go.
  virtual void forget() {}
  // Its streams may still need the reaper's releases (step() writes them):
  // while any listed remains does, the reaper frees nothing, since a free
  // synchronises the device (cudaFree, cudaFreeHost) and would wait for a
  // stream only its next release lets go.
  virtual bool releasing() const { return false; }
  // Set by the reaper before each step: some listed remains is releasing,
  // so step() must make no call that may synchronise the device either
  // (CUDA documents none for cudaIpcCloseMemHandle, but unmapping memory
  // the device may still address is the kind of call that waits; it
  // costs one more millisecond to put it off) and says not done yet.
  bool deferBlocking = false;
  int rank = 0;
  int64_t deadline = 0;
  bool warned = false;    // the reaper's: told that it is overdue
  int64_t nextPollMs = 0;  // the reaper's: an overdue one's next step
};
// Frees `r` now if its streams are done, else hands it to the reaper (or,
// with a deadline already past, leaves it allocated with a warning).
void reapDeviceRemains(std::unique_ptr<DeviceRemains> r);

class DeviceComm final : public DeviceCollectives {
 public:
  // All-gathers `bytes` of every rank into `all` (nranks * bytes), in rank
  // order: the communicator's bootstrap, or the test's.
  using AllGather = std::function<void(const void* mine, size_t bytes, void* all)>;

  // Allocates this rank's block, exchanges records, imports every peer's.
  DeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver, const AllGather& allGather,
             const DeviceCommOptions& options = {});
  ~DeviceComm() override;
  DeviceComm(const DeviceComm&) = delete;
  DeviceComm& operator=(const DeviceComm&) = delete;

  int device() const override { return driver_->device(); }
  const char* deviceName() const override { return driver_->name(); }
  const char* pathName() const override { return "ipc"; }
  std::string describe() const override;
  size_t slotBytes() const { return slotBytes_; }
  size_t oneShotBytes() const { return oneShotBytes_; }

  // Whether the device path runs `coll` (the others: loomInvalidUsage from run()).
  static bool serves(Collective coll);
  // Whether run() would take `op`: a collective it serves (else
  // loomInvalidUsage) on buffers of this device (else loomInvalidArgument
  // naming the buffer).  Changes nothing (a group checks every member
  // before it runs any).
  void check(const OpDesc& op) const override;
  // Collectives are captured when the communicator has a graph lane;
  // sends and receives are not yet.
  void checkCapture(void* stream, bool p2p) const override;
  // Checks op (check()), compiles this rank's program
  // and enqueues it on callerStream.  Returns once enqueued.  An error
  // while enqueueing leaves the communicator failed (its rounds can no
  // longer agree with the peers'): every later call fails with it.
  // On a stream being captured into a CUDA graph (cudaStreamCapturing),
  // the call takes the graph lane instead (makeReplayable): it moves no
  // round counter and an enqueue error leaves the communicator healthy
  // (the capture is what is spoiled; nothing ran).  Replays of captured
  // calls must follow each other on a rank (one stream, or ordered), in
  // the same order on every rank, as eager calls do.
  void run(const OpDesc& op, void* callerStream) override;
  // Sends and receives (P2P ops: one call, or a group's members in order)
  // as one stream program on callerStream (compileP2PProgram: chunk by
  // chunk across the members, so a group's sends and receives never wait
  // on each other in a cycle).  Checks and failure as run().
  void runP2P(const std::vector<OpDesc>& ops, void* callerStream) override;
  // The same in steps (run() and runP2P() are these run to the end).
  std::unique_ptr<SteppedRun> beginRun(const OpDesc& op, void* callerStream) override;
  std::unique_ptr<SteppedRun> beginRunP2P(const std::vector<OpDesc>& ops, void* callerStream) override;
  // Makes the send/recv regions `ops` need (a send: this rank's region for
  // the receiver; a receive: the sender's, asked for through
  // options.fetchRegion and mapped here), once per pair; runP2P calls it.
  // Enqueues nothing and moves no counter, so an error here (loomRemoteError
  // or loomTimeout: the peer did not answer; a device error allocating)
  // leaves the communicator as it was, and the call may be repeated.
  void prepareP2P(const std::vector<OpDesc>& ops) override;
  void joinStreams(void* main, const std::vector<void*>& others, bool before) override;
  void scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar, bool scalarOnDevice,
             void* callerStream) override;
  // This rank's region for `reader`, allocated now if it has none yet (the
  // answer to a peer's fetchRegion; any thread).
  IpcRecord p2pRegionFor(int reader) override;
  void onPeerSignatures(int from, const std::vector<uint8_t>& bytes) override;
  DeviceMemoryStats memoryStats() const;
  // Device zero-copy.  A peer's question: map its allocation `rec` here for
  // it and say where (the start of the allocation; any thread).  Throws
  // Error (the record cannot be right, the handle does not open, no
  // zero-copy here).
  uint64_t importPublished(int owner, const IpcRecord& rec) override;
  // A peer's notice that it frees that allocation: unmap it now.
  void forgetPublished(int owner, const IpcRecord& rec) override;
  // The owner's side: the allocation at `base` is about to be freed; every
  // peer that maps it is asked to unmap it (a peer that does not answer is
  // warned about), and it is published no more until mapped again.
  // At destroy (`destroying`), a peer that does not answer is only noted:
  // its own destroy unmaps everything.
  void unpublish(void* base, bool destroying = false);
  // unpublish() with askMu_ held.
  void unpublishHeld(void* base, bool destroying);
  void unpublishAll() override;
  bool deviceMemory(const void* p, size_t bytes, void** allocation) override;
  void withdraw(void* allocation, const std::function<bool()>& held) override;
  bool zeroCopy() const { return zeroCopy_; }

  // Which all-reduce program `bytes` gets.
  StreamAlgorithm allReduceAlgorithm(size_t bytes) const {
    return bytes <= oneShotBytes_ ? StreamAlgorithm::OneShot : StreamAlgorithm::ReduceScatterAllGather;
  }
  uint64_t round() const;  // the round counter (tests)
  uint64_t captured() const { return captured_.load(); }  // calls captured into graphs so far
  size_t graphSlotBytes() const { return graphSlotBytes_; }
  // Whether a replay of a captured call runs on this rank now (its own busy
  // flag, read now; false without a graph lane).
  bool replaying();
  // The graph lane's flag area as read now (row r: rank r's kFlagCount
  // flags as this rank sees them; empty without a graph lane).  Between
  // replays every flag is 0 but this rank's own `reset` (the tests'
  // check that a replay left nothing behind).
  std::vector<uint64_t> graphFlags();
  // Whether the communicator failed (every later run() then fails).
  bool failed() const override;
  // The failure (loomSuccess if none) and its message.
  loomResult_t failure(std::string* msg) const;
  // Fails the communicator (the first failure's code and message stay) and
  // has the watchdog release every stream wait this rank has pending.
  // Never waits for the device.  True for the first failure.
  bool markFailed(loomResult_t code, const std::string& msg) override;
  // Whether every program enqueued so far has finished on the device (its
  // own done flag reached the last round), as read now.  The watchdog's
  // (and tests'): the CUDA driver's reads are not meant for two threads.
  bool programsDone();
  // loomCommSetTimeout: the watchdog's timeout from now on (0: none).
  void setTimeoutMs(int64_t ms) override { timeoutMs_.store(ms); }
  // Stops the watchdog thread (the owner, before it tears down what the
  // callbacks use); destruction still releases and frees safely.
  void stopWatchdog() override;
  // Destruction will not wait for the peers (the communicator failed or
  // was aborted: loomCommAbort never blocks).
  void abandon() override { drainTimeoutMs_ = 0; }
  const IpcImportCache& imports() const { return *imports_; }

 private:
  class Run;  // a call being enqueued (device_comm.cc)
  enum class Lane : uint8_t { Collective, P2P, Graph };
  // beginRun on a stream being captured (the graph lane).
  std::unique_ptr<SteppedRun> beginGraphRun(const OpDesc& op, void* callerStream);
  // beginRunP2P on a stream being captured (compileGraphP2PProgram).
  std::unique_ptr<SteppedRun> beginGraphRunP2P(const std::vector<OpDesc>& ops, void* callerStream);
  // A captured call's run (mu_ held in it): the capture's graph takes a
  // hold on this rank's memory, and the program is checked to be enqueued.
  std::unique_ptr<SteppedRun> startGraphRun(std::unique_ptr<Run> run, void* callerStream);
  // This rank's graph busy flag is set (a replay runs here), read now on
  // the calling thread's device (the caller's scope).
  bool graphBusyNow();
  // The watchdog's look at the graph lane while healthy: how long to sleep next.
  int64_t checkGraphProgress(int64_t now);

  // A call's enqueue failed (or was abandoned) half-way: the communicator
  // fails for good, and the watchdog releases whatever waits on it.  Under mu_.
  void failEnqueue(loomResult_t code, const std::string& what, Lane lane);
  // A call is enqueued whole: the watchdog may look at it.  Under mu_.
  void noteEnqueued(Lane lane);
  // Hands this rank's memory, the peers' mappings, the holds and the
  // driver to the reaper (device_comm.cc's IpcRemains), which frees them at
  // once if it can: once this rank's streams are done (streamsMayRun: it
  // failed, they may still run), and its memory once no peer maps it.
  void leaveMemory(bool streamsMayRun);
  // Waits until the done flag of every peer that holds no lock on this
  // rank's board (map_board.h) shows it finished the last round (so none
  // reads this rank's window any more); false at the deadline.  Peers that
  // hold one keep the memory allocated until they unmap it.
  bool drain();
  void watch();  // the watchdog thread
  void enterDevice();  // the driver's device, on the watchdog thread, from its first device call on
  // One watchdog step while healthy: how long to sleep next.
  int64_t checkProgress(int64_t now);
  // Writes kReleasedFlag into every peer row of this rank's flags.
  void release();
  // The watchdog's own failure: markFailed, then onFailure.
  void failFromWatchdog(loomResult_t code, const std::string& msg, int peer);
  // The mismatch check's step on the watchdog thread: fails on a mismatch
  // found, sends this rank's next batch; how long to sleep next.
  int64_t checkSignatures();
  // This rank's region for `peer`, allocated if needed (p2pMu_ held).
  const IpcRecord& outRegionLocked(int peer);
  // Device zero-copy: whether this rank publishes op's buffers, and what
  // (fills b.published, already sized for every reader, only when it does).  Asks the peers to map an allocation
  // the first time (not under mu_: they answer from their control threads).
  bool publishFor(const OpDesc& op, size_t sendBytes, size_t recvBytes, ProgramBuffers* b);
  // The allocation at `base` as mapped in every peer (at[r]); ok false:
  // some peer could not map it, it is not published.
  struct Published {
    IpcRecord rec;
    std::vector<uint64_t> at;
    bool ok = false;
  };
  const Published* publishedAlloc(void* base);

  int rank_, nranks_;
  size_t slotBytes_, oneShotBytes_;
  bool zeroCopy_ = false;
  std::atomic<bool> warnedUnpublishable_{false};
  void noteUnpublishable(const void* p, const char* why);
  std::function<bool(const void*, size_t, void**)> publishable_;
  std::function<uint64_t(int, const IpcRecord&)> publishTo_;
  std::function<void(int, const IpcRecord&)> unpublishTo_;
  int freeHook_ = 0;  // addDeviceMemFreeHook's id (0: none)
  std::vector<const uint64_t*> cells_;  // row q of this rank's cell area
  std::vector<uint64_t*> peerCells_;    // per rank r: this rank's row in r's cell area
  // What this rank's cells of each slot hold now, per reader (mu_): a
  // program writes a slot's cells only when its values differ.
  std::vector<std::array<ProgramBuffers::Cell, kCellCount>> cellsHeld_[2];
  mutable std::mutex pubMu_;  // pubs_ and publishedIn_ (never held while a peer is asked)
  std::map<uint64_t, Published> pubs_;                       // by allocation base
  std::vector<std::pair<int, IpcRecord>> publishedIn_;       // peers' allocations mapped here
  std::mutex askMu_;  // one publish/unpublish exchange with the peers at a time
  uint64_t process_;
  size_t blockBytes_ = 0;
  int64_t drainTimeoutMs_;
  std::unique_ptr<DeviceDriver> driver_;
  std::unique_ptr<IpcImportCache> imports_;
  // Who maps this rank's memory (null: no board could be made, and the
  // memory is freed once the peers are done reading, as before boards);
  // the peers whose holds it tracks; this rank's holds on the peers'
  // boards, dropped once their memory is unmapped here (map_board.h).
  std::unique_ptr<MapBoard> board_;
  std::vector<int> tracked_;
  std::vector<std::unique_ptr<MapHold>> holds_;
  void* block_ = nullptr;
  std::vector<IpcRecord> records_;  // every rank's block
  std::vector<uint8_t*> windows_;
  std::vector<uint64_t*> flags_;       // row r of this rank's flag area: rank r's flags as seen here
  std::vector<uint64_t*> flagCopies_;  // where this rank's flag writes go (its row of every area, its own last)
  std::vector<uint64_t*> released_;    // the flags a release writes (every peer row here)
  std::vector<uint64_t*> peerFlags_;   // per rank r: this rank's row in r's area (per-pair flag writes)
  // The graph lane (graphSlotBytes_ > 0), laid out as the collectives':
  // every rank's graph window as mapped here, row r of this rank's graph
  // flag area, this rank's row of every graph area (its own last), and
  // the flags a release writes (every peer row's, but the busy flag).
  size_t graphSlotBytes_ = 0;
  std::vector<uint8_t*> gwindows_;
  std::vector<uint64_t*> gflags_, gflagCopies_, greleased_;
  std::vector<uint64_t*> gpeerFlags_;  // per rank r: this rank's row in r's graph area (the signature gate)
  // What each signature this rank captured is (mu_; the watchdog reads it
  // under mu_ to name a mismatch).
  std::map<uint64_t, std::string> graphSigs_;
  // Captured send/recv calls by busy mark (kGraphP2PBusy + their number,
  // mu_): what they are and their partners, to name them in a timeout.
  struct GraphP2PCall {
    std::string what;
    std::vector<int> partners;
    // Per peer: this rank's receives from it (their sizes), and their
    // size gate value (graphP2PMessages; 0: none), and its sends' values.
    std::vector<std::vector<uint64_t>> recvSizes;
    std::vector<uint64_t> recvMessages, sendMessages;
  };
  std::map<uint64_t, GraphP2PCall> graphP2P_;
  std::vector<uint64_t*> allReleased_;  // released_ and greleased_ as one batch
  std::atomic<uint64_t> captured_{0};
  // Holds CUDA graphs with this rank's captured calls keep (each call's
  // graph one, dropped when it is destroyed: DeviceDriver::retainOnCapture);
  // shared with the memory's remains after a destroy.
  std::shared_ptr<std::atomic<int64_t>> graphHolds_ = std::make_shared<std::atomic<int64_t>>(0);
  // The graph lane's flags still for this long with a peer's signature
  // differing from this rank's: mismatched captured calls.
  static constexpr int64_t kGraphMismatchMs = 50;
  uint64_t gSeenSum_ = 0;  // the watchdog's: the graph flags' sum as last seen, and when it moved
  int64_t gMovedMs_ = 0, gProbedMs_ = 0;
  P2PCounters p2p_;                    // send/recv: chunks per peer, programs (under mu_)
  std::function<IpcRecord(int)> fetchRegion_;
  // Send/recv staging, per peer.  Out: this rank's allocations (p2pMu_,
  // which p2pRegionFor takes on the control thread too); in: the peers'
  // regions for this rank as mapped here (inMu_, API threads only: it is
  // held while a peer is asked, which is safe because peers answer from
  // their control threads, which take p2pMu_ alone).
  mutable std::mutex p2pMu_, inMu_;
  bool closing_ = false;  // p2pMu_: destruction began, p2pRegionFor refuses
  std::vector<void*> out_;
  std::vector<IpcRecord> outRecords_;
  std::vector<uint8_t*> in_;
  std::vector<IpcRecord> inRecords_;  // the imports to release (rank != this one)
  mutable std::mutex mu_;  // one program enqueued at a time, in round order
  uint64_t round_ = 0;
  // The stream of the last collective program and of the last send/recv
  // program (mu_).  A rank's programs must run in the order they were
  // issued: flags only grow, and a program that ran ahead of an earlier one
  // on another stream would set its flags past the earlier one's values,
  // so peers would read this rank's window before the earlier round was
  // in it.  On one stream the stream keeps that order; a program on
  // another one first waits (a stream wait) until this rank's own done
  // flag shows every earlier program finished, as NCCL serialises a
  // communicator's kernels across streams.  cudaStreamPerThread counts as
  // another stream every time (its handle names a different stream on
  // each thread).
  void* collStream_ = nullptr;
  void* p2pStream_ = nullptr;
  std::string failed_;  // set once the communicator failed
  loomResult_t failCode_ = loomSuccess;

  // The watchdog.
  std::atomic<int64_t> timeoutMs_;
  int64_t probeAfterMs_, reapTimeoutMs_;
  std::function<bool(int, std::string*)> peerGone_;
  std::function<void(const Error&)> onFailure_;
  std::unique_ptr<SignatureCheck> sigs_;  // null: no mismatch check (one rank, or no sender)
  std::unique_ptr<P2PCheck> p2pCheck_;    // send/recv's (null as sigs_)
  std::function<void(int, std::vector<uint8_t>)> sendSignatures_;
  size_t sigSkippedWarned_ = 0, p2pSkippedWarned_ = 0;  // watchdog thread only
  // At destruction of a healthy communicator: sends what is left and waits
  // up to SignatureCheck::kFinishMs for the previous rank's last batches.
  void finishSignatures();
  std::atomic<uint64_t> enqueued_{0};  // rounds enqueued (the done value the last one sets)
  std::atomic<uint64_t> p2pEnqueued_{0};  // send/recv programs enqueued (kFlagP2PDone's last value)
  std::atomic<bool> failedFlag_{false};
  std::mutex wmu_;
  std::condition_variable wcv_;
  bool wake_ = false, stop_ = false;
  bool entered_ = false;  // watchdog thread only
  int previousDevice_ = -1;
  std::thread watchdog_;
  // Progress as last seen: the sum of every flag here, and when it moved.
  uint64_t seenSum_ = 0;
  int64_t movedMs_ = 0, probedMs_ = 0;
};

// The reaper of destroyed communicators' device memory (options.reapTimeoutMs):
// how many are waiting for their streams or their peers' unmapping now, and
// a wait until none is (tests: their simulated devices must outlive it).
// True when none is left.
size_t deviceRemainsPending();
bool waitDeviceRemains(int64_t timeoutMs);

}  // namespace loom
