// Device buffers between hosts: the staged path of a CUDA communicator.
//
// CUDA IPC maps device memory only within a host, so a communicator whose
// ranks span hosts (or one told to, LOOM_DEVICE_PATH=staged) moves its
// bytes through pinned host memory and the communicator's host path (its
// algorithms and transports: shm within a host, tcp/UCX/verbs between):
//
//   caller's stream:  [wait slot free] copy device -> pinned "in"; set in = u
//   staging thread:   wait in >= u; run the host collective on the pinned
//                     piece in its turn; set out = u
//   caller's stream:  wait out >= u; copy pinned "out" -> device; set free = u
//
// A collective is cut into pieces of at most pieceBytes per side, each in
// one of `slots` pinned slots, and the program stages up to slots - 1
// pieces ahead of the one the host is working on, so the copy engine
// overlaps the network.  Flags live in the pinned memory next to each slot:
// the stream writes and waits on them with stream memory operations
// (cuStreamWriteValue64 / cuStreamWaitValue64 on the mapped address), the
// staging thread reads and writes them as ordinary memory.  Nothing on the
// device spins, and the API thread returns once the program is enqueued.
//
// Send/recv (a call or a group, loomAllToAllv included) is staged whole, in
// one pinned buffer that grows to the largest group seen, and runs as one
// host group, so its matching and deadlock freedom are the host path's.
//
// Order: host operations are issued (their turn taken) on the API thread
// in call order, the same on every rank, and run one at a time by the
// staging thread.  Failure: the first error (a host operation's, a stream
// that never reaches its staging copy within the timeout, loomCommAbort,
// a peer's notice) fails the communicator for good; every flag a stream may
// wait on is then released (kReleasedFlag), so the streams run to the end
// of their programs and the outputs of unfinished operations are
// undefined, as on the IPC path.  Pinned memory is freed only once this
// rank's streams are done with it (the reaper of device_comm.h otherwise).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/device/device_comm.h"

namespace loom {

// Default bytes a piece stages per side, and pinned slots per communicator
// (2 x 2 MiB each: 16 MiB of pinned memory per communicator).
constexpr size_t kStagePieceBytes = size_t(2) << 20;
constexpr int kStageSlots = 4;

struct StagedCommOptions {
  size_t pieceBytes = kStagePieceBytes;  // every rank must use the same
  int slots = kStageSlots;               // at least 2
  // The caller's stream must reach an operation's staging copy within this
  // once the staging thread waits for it, or the communicator fails with
  // loomTimeout (0: never).  The communicator passes LOOM_TIMEOUT_MS.
  int64_t timeoutMs = 0;
  // Destruction of a healthy communicator waits this long for operations
  // still pending and for this rank's streams to finish with the pinned
  // memory; a failed one hands the memory to the reaper, which frees it
  // once the streams are done or leaves it allocated after reapTimeoutMs.
  int64_t drainTimeoutMs = 10000;
  int64_t reapTimeoutMs = 60000;
  // The host path.  Called on the API thread, in the order every rank
  // issues operations: takes the host path's turn for `ops` (host buffers:
  // one collective, or a group of sends and receives) and returns what runs
  // them in that turn.  The staging thread calls that once, whatever
  // happened before (a turn taken must be served), and it throws
  // loom::Error for the host operation's error.
  std::function<std::function<void()>(const std::vector<OpDesc>& ops)> issueHost{};
  // Told of a failure the staging thread found itself (a stream that never
  // reached its staging copy), after the device side failed; the
  // communicator tells the peers.  Not called for the host path's errors,
  // which the host path reports.
  std::function<void(const Error&)> onFailure{};
};

class StagedDeviceComm final : public DeviceCollectives {
 public:
  // Allocates the pinned slots; nothing is exchanged with the peers.
  StagedDeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver, StagedCommOptions options);
  ~StagedDeviceComm() override;
  StagedDeviceComm(const StagedDeviceComm&) = delete;
  StagedDeviceComm& operator=(const StagedDeviceComm&) = delete;

  int device() const override { return driver_->device(); }
  const char* deviceName() const override { return driver_->name(); }
  const char* pathName() const override { return "staged"; }
  void check(const OpDesc& op) const override;
  // Checks op, issues its pieces' host operations and enqueues its program
  // on callerStream; returns once enqueued.
  void run(const OpDesc& op, void* callerStream) override;
  void runP2P(const std::vector<OpDesc>& ops, void* callerStream) override;
  void prepareP2P(const std::vector<OpDesc>&) override {}
  void joinStreams(void* main, const std::vector<void*>& others, bool before) override;
  void scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar, bool scalarOnDevice,
             void* callerStream) override;
  bool failed() const override { return failedFlag_.load(std::memory_order_acquire); }
  bool markFailed(loomResult_t code, const std::string& msg) override;
  void setTimeoutMs(int64_t ms) override { timeoutMs_.store(ms); }
  // Stops the staging thread once it has served every operation issued
  // (fast when the communicator failed: their host parts fail at once).
  void stopWatchdog() override;
  void abandon() override { abandoned_ = true; }
  std::string describe() const override;

  // Elements per piece of `op` (a rank's block for the collectives with one
  // block per rank), and how many pieces it takes.
  size_t pieceElements(const OpDesc& op) const;
  size_t pieces(const OpDesc& op) const;
  uint64_t hostStepsRun() const { return stepsRun_.load(); }  // tests
  size_t pinnedBytes() const;                                 // tests, describe()

 private:
  // Pinned host memory: three flags (in, out, free; a cache line each),
  // then `bytes` of data.  `uses` counts the uses enqueued so far.
  struct Buffer {
    uint8_t* mem = nullptr;
    size_t bytes = 0;
    uint64_t uses = 0;
    uint64_t* flag(int i) const { return reinterpret_cast<uint64_t*>(mem + 64 * i); }
    uint64_t* in() const { return flag(0); }
    uint64_t* out() const { return flag(1); }
    uint64_t* free() const { return flag(2); }
    uint8_t* data() const { return mem + kHeader; }
  };
  static constexpr size_t kHeader = 256;
  struct Step {
    Buffer* buf = nullptr;
    uint64_t use = 0;
    std::function<void()> host;
    const char* what = "";  // for messages: the collective, its piece of how many
    size_t piece = 0, pieces = 0;
  };
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  // One use of `b` on stream 0 of `be`: its first half (wait until the last
  // use is copied out, then the copies in) and its second (wait for the
  // host, then the copies out).
  void enqueueIn(StreamBackend& be, Buffer& b, uint64_t use, const std::vector<Copy>& copies);
  void enqueueOut(StreamBackend& be, Buffer& b, uint64_t use, const std::vector<Copy>& copies);
  std::unique_ptr<Buffer> allocateBuffer(size_t bytes);
  void failIfFailed() const;  // throws the failure, if any
  // An enqueue that failed half-way: the steps issued so far still run
  // (their turns were taken), the communicator fails.
  void failEnqueue(const Error& e, std::vector<Step>& steps);
  void push(std::vector<Step>& steps);
  void work();  // the staging thread
  // Waits until b.in() >= use; false on failure, timeout or a stop that
  // gave up.
  bool waitIn(const Step& s);
  // Writes kReleasedFlag into every flag a stream of this rank may wait on.
  void releaseAll();

  int rank_, nranks_;
  std::unique_ptr<DeviceDriver> driver_;
  size_t pieceBytes_;
  int64_t drainTimeoutMs_, reapTimeoutMs_;
  std::function<std::function<void()>(const std::vector<OpDesc>&)> issueHost_;
  std::function<void(const Error&)> onFailure_;
  std::atomic<int64_t> timeoutMs_;
  std::atomic<bool> failedFlag_{false};
  std::atomic<bool> abandoned_{false};

  mutable std::mutex mu_;  // the buffers and their use counts: one enqueue at a time
  std::vector<std::unique_ptr<Buffer>> slots_;
  uint64_t nextSlot_ = 0;
  std::unique_ptr<Buffer> bulk_;                  // send/recv staging (grows)
  std::vector<std::unique_ptr<Buffer>> retired_;  // outgrown bulk buffers: freed with the rest
  mutable std::mutex failMu_;
  loomResult_t failCode_ = loomSuccess;
  std::string failMsg_;

  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<Step> queue_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};
  int64_t stopAtMs_ = 0;  // when stopping began (qmu_ written, read after stopping_)
  std::atomic<uint64_t> stepsRun_{0};
  std::thread worker_;
};

}  // namespace loom
