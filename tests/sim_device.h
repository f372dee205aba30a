// A simulated device that executes stream programs (src/device/stream_program.h)
// on host memory, so that the device path's logic is tested without a GPU.
//
// - Every stream is a thread running its queue in order; enqueueing never
//   waits (as with CUDA, the host returns at once), unless the queue is
//   bounded (SimDeviceOptions::queueDepth, as a GPU's is) and full.
// - A SimGpu is one device.  Ranks may share one: copies, reductions and the
//   caller's own work ("kernels") of all its streams run one at a time under
//   the device's lock, paused at random while holding it (time-slicing), but
//   waits hold nothing, as stream waits hold no SMs.  A program that spun on
//   a peer inside a "kernel" would deadlock here as it would on a GPU.
// - Flags are std::atomic<uint64_t> in memory every rank reads; setFlag is a
//   release store after the stream's earlier work, waitFlag an acquire load.
// - Events follow CUDA: a wait waits for the last record enqueued before it.
// - Reductions use the host device's arithmetic (reduce_ops.h), pairwise in
//   source order, which is what the CUDA kernels compute too.
// - kill(r) stops rank r's streams.  A wait ends when its flag is written,
//   as a GPU's does, so a failure test proves that the communicator's own
//   release ended it; a wait still pending after the deadline fails with
//   loomTimeout, so a test that would hang fails instead.  With
//   peerShortcuts (the stream-program tests, which have no communicator) a
//   wait on a flag of a dead or failed rank fails at once with
//   loomRemoteError.  A failed stream skips the rest of its rank's work.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "src/device/stream_program.h"

namespace loomsim {

struct SimDeviceOptions {
  int64_t deadlineMs = 20000;  // a stream wait fails with loomTimeout after this
  // A wait on a flag of a dead or failed rank fails at once (loomRemoteError).
  // Off by default: a GPU's stream wait ends only when the flag is written.
  bool peerShortcuts = false;
  // Operations a stream holds pending before an enqueue blocks, as a GPU's
  // host thread blocks in the enqueue once a stream's queue is full (0:
  // never blocks).  An enqueue still blocked after deadlineMs fails with
  // loomInternalError, so a test that would hang on a GPU fails instead.
  size_t queueDepth = 0;
  // Called on a stream's thread before each flag write it runs, with the
  // flag's value then and the value written: a test that stalls some
  // writes (a rank descheduled at the worst moment).  Empty: none.
  std::function<void(uint64_t old, uint64_t value)> beforeSetFlag{};
  int pausePermille = 50;      // chance per op of a pause while holding the device
  int maxPauseUs = 200;
  uint64_t seed = 1;
};

class SimGpu {
 public:
  explicit SimGpu(int id) : id_(id) {}
  int id() const { return id_; }
  std::mutex& busy() { return busy_; }

 private:
  int id_;
  std::mutex busy_;
};

class SimDeviceWorld;
class SimRank;

// What a stream holds: work to run in order (usesGpu: a kernel or a copy,
// which holds the device; else a wait).
using SimTask = std::pair<std::function<void()>, bool>;
// What one launch of a captured graph runs with: per event record the
// capture saw (a node of the graph), whether this launch has run it.
struct SimLaunch {
  explicit SimLaunch(size_t nodes) : done(new std::atomic<bool>[nodes ? nodes : 1]) {
    for (size_t i = 0; i < (nodes ? nodes : 1); ++i) done[i].store(false);
  }
  std::unique_ptr<std::atomic<bool>[]> done;
};
// A task of a captured graph: run with the launch it is part of.
struct SimGraphTask {
  std::function<void(SimLaunch&)> fn;
  bool usesGpu = false;
};
// A captured CUDA graph.  Lane 0 holds the tasks enqueued on the stream
// that began the capture, lane i > 0 those of the i-th stream that joined
// it (a stream joins by waiting for an event recorded in the capture, as
// CUDA's fork does), each with every value it was given then (a replay
// repeats them).  Event records and waits between lanes are graph nodes
// and edges (SimLaunch).  `holds`: what the capture asked the graph to
// keep (CUDA's user objects), released when the last reference goes.
struct SimGraphData {
  std::vector<std::vector<SimGraphTask>> lanes;
  size_t nodes = 0;
  std::vector<std::function<void()>> holds;
  SimGraphData() = default;
  SimGraphData(const SimGraphData&) = delete;
  SimGraphData& operator=(const SimGraphData&) = delete;
  ~SimGraphData() {
    for (auto& h : holds) h();
  }
  bool empty() const {
    for (const auto& l : lanes)
      if (!l.empty()) return false;
    return true;
  }
};
using SimGraph = std::shared_ptr<const SimGraphData>;
class SimCapture;  // sim_device.cc: a capture in progress

class SimStream {
 public:
  SimStream(SimRank& rank, SimGpu& gpu, uint64_t seed);
  ~SimStream();
  // fn runs in stream order; a loom::Error it throws fails the rank.  With
  // usesGpu it holds the device (a kernel or a copy), else it is a wait.
  // While the stream is in a capture, fn becomes a task of its lane there
  // instead (run by launches).
  void enqueue(std::function<void()> fn, bool usesGpu);
  // The capture the stream is in (null: none) and its lane there.
  std::shared_ptr<SimCapture> capture(int* lane) const;
  void setCapture(std::shared_ptr<SimCapture> c, int lane);
  // Joins capture c in a lane of its own unless in a capture already:
  // the lane (-1: in another capture).
  int join(const std::shared_ptr<SimCapture>& c);
  // Returns once everything enqueued so far has run or been skipped.
  void drain();
  bool idle() const;  // nothing enqueued is left to run
  // Runs one task on this stream's thread as its queue does (nothing for a
  // dead or failed rank; the device held with usesGpu; an Error fails the
  // rank): a graph launch's tasks, which are one entry of the queue.
  void run(const std::function<void()>& fn, bool usesGpu);

 private:
  void loop();
  SimRank& rank_;
  SimGpu& gpu_;
  uint64_t rng_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<SimTask> queue_;
  std::shared_ptr<SimCapture> capture_;
  int lane_ = 0;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

// One rank's device side: its streams and events, and the StreamBackend
// that enqueueProgram drives.  Stream 0 is the caller's stream.
class SimRank final : public loom::StreamBackend {
 public:
  SimRank(SimDeviceWorld& world, int rank, SimGpu& gpu, int streams, uint64_t seed);
  ~SimRank() override;
  int rank() const { return rank_; }
  // Reductions enqueued with a second destination (the reduce-scatter +
  // all-gather all-reduce's), so tests can tell which program ran.
  uint64_t dualReductions() const { return dualReductions_.load(); }
  SimGpu& gpu() { return gpu_; }

  // The caller's own work on one of its streams (a "kernel").
  void enqueueWork(int stream, std::function<void()> fn);
  // A wait of the caller's on one of its streams (a cudaStreamWaitEvent on
  // its own event, say): holds that stream only, not the device.
  void enqueueWait(int stream, std::function<void()> fn);
  // Another caller stream, as a second cudaStream_t: `key` is the stream
  // handle the test passes to the API, the result its stream index here
  // (SimDriver runs a program given that handle on that stream; any other
  // handle is stream 0).  Add them before anything is enqueued.
  int addCallerStream(const void* key);
  int callerStream(const void* key) const;
  // Stream `waiter` waits for everything enqueued on stream `waited` so far
  // (an event recorded there and waited for here: cudaStreamWaitEvent).
  void joinStream(int waiter, int waited);
  // CUDA graphs on the added caller stream `key`: begin and end a capture
  // (while it lasts, setCudaCaptureProbeForTesting(simStreamCapturing)
  // says the handle is being captured, so loom's calls on it take the
  // graph lane), and enqueue a captured graph's tasks on it, as
  // cudaGraphLaunch does: lane 0 on that stream, the other lanes on
  // replay streams of their own (idle ones, or new), each lane one entry
  // of its stream's queue, each launch with events of its own.  As CUDA: a stream joins a capture when it waits
  // for an event recorded in it (recordEvent/waitEvent, joinStream), stays
  // in it until the capture ends, and can be in one only; a wait that
  // crosses a capture's boundary, and an end while a joined stream's last
  // work is not joined back into lane 0, fail (loomInternalError, naming
  // CUDA's error).
  void beginCapture(const void* key);
  SimGraph endCapture(const void* key);
  void launchGraph(const void* key, const SimGraph& graph);
  // Streams for captured programs' side streams, none of them a caller's
  // or an eager program's: index i (0 <= i < kCaptureSideStreams) of them
  // is stream captureSideStream(i).  captureOf(s): an id of the capture
  // stream s is in, 0 for none.
  static constexpr int kCaptureSideStreams = 6;
  int captureSideStream(int i) const { return baseStreams_ + i; }
  uint64_t captureOf(int s);
  // cudaGraphRetainUserObject on the graph being captured on the caller
  // stream `key`: `release` runs when that graph goes (false, nothing
  // held: the stream is not being captured).
  bool holdInCapture(const void* key, std::function<void()> release);
  // Waits for every stream; loomSuccess or the first error (message in *msg).
  loomResult_t synchronize(std::string* msg);

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string failure() const;
  void failWith(loomResult_t code, const std::string& msg);

  void waitFlag(int stream, const uint64_t* flag, uint64_t value, int ownerRank) override;
  void setFlag(int stream, uint64_t* flag, uint64_t value) override;
  // One task, as CUDA's batch is one operation.
  void setFlags(int stream, uint64_t* const* flags, size_t n, uint64_t value) override;
  void copy(int stream, void* dst, const void* src, size_t bytes) override;
  void reduce(int stream, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, loomDataType_t type,
              loomRedOp_t op) override;
  void divide(int stream, void* dst, const void* src, size_t count, loomDataType_t type,
              int divisor) override;
  void recordEvent(int stream, int event) override;
  void waitEvent(int stream, int event) override;
  void copyIndirect(int stream, void* dst, const void* src, loom::CellRef cell, size_t bytes) override;
  void reduceIndirect(int stream, void* dst, void* dst2, const void* const* srcs, const loom::CellRef* cells,
                      int nsrcs, size_t count, loomDataType_t type, loomRedOp_t op) override;
  // Sources read through a published cell so far (zero-copy reads), and
  // those that fell back to the window.
  uint64_t publishedReads() const { return publishedReads_.load(); }
  uint64_t fallbackReads() const { return fallbackReads_.load(); }

 private:
  friend class SimStream;
  struct Event {
    uint64_t recorded = 0;  // records enqueued (host side)
    std::atomic<uint64_t> completed{0};
    // Its last record was node `node` of a capture (still running): a wait
    // for it joins that capture.
    std::shared_ptr<SimCapture> capture;
    size_t node = 0;
  };
  // Lane `lane` of a launch of `graph`, as one task of stream `on`.
  std::function<void()> laneTask(SimStream& on, const SimGraph& graph, const std::shared_ptr<SimLaunch>& launch,
                                 size_t lane);
  // Stream s waits for node `node` of capture c (joining it when in none).
  void waitNode(int s, const std::shared_ptr<SimCapture>& c, size_t node, const char* what);
  SimStream& stream(int s);
  Event& event(int e);
  // Polls ready() until true, failing on a dead/failed peer or the deadline.
  template <class Ready>
  void await(Ready ready, int peer, const char* what);

  SimDeviceWorld& world_;
  int rank_;
  SimGpu& gpu_;
  std::vector<std::unique_ptr<SimStream>> streams_;
  std::vector<std::pair<const void*, int>> callers_;  // addCallerStream's
  uint64_t seed_;
  std::atomic<uint64_t> dualReductions_{0};
  std::atomic<uint64_t> publishedReads_{0}, fallbackReads_{0};
  // A source as the op runs: the cell's buffer when it is published and
  // holds `bytes`, else the fallback.
  const void* resolve(const void* fallback, loom::CellRef c, size_t bytes);
  void runReduce(void* dst, void* dst2, const std::vector<const void*>& in, size_t count, loomDataType_t type,
                 loomRedOp_t op);
  std::vector<std::unique_ptr<Event>> events_;
  std::mutex eventMu_;  // events' capture fields
  int baseStreams_ = 0;
  std::mutex replayMu_;
  std::vector<std::unique_ptr<SimStream>> replay_;  // launches' streams for lanes 1..
  std::atomic<bool> failed_{false};
  mutable std::mutex failMu_;
  loomResult_t failCode_ = loomSuccess;
  std::string failMsg_;
};

// A rank's backend for programs on one of its added caller streams:
// program stream 0 is that stream, the side streams are the rank's own
// (or those the map names).
class SimCallerBackend final : public loom::StreamBackend {
 public:
  SimCallerBackend(SimRank& r, int caller) : r_(r), map_{caller} {}
  // Program stream s is the rank's stream map[s] (s < map.size()).
  SimCallerBackend(SimRank& r, std::vector<int> map) : r_(r), map_(std::move(map)) {}
  void waitFlag(int s, const uint64_t* flag, uint64_t value, int owner) override {
    r_.waitFlag(map(s), flag, value, owner);
  }
  void setFlag(int s, uint64_t* flag, uint64_t value) override { r_.setFlag(map(s), flag, value); }
  void setFlags(int s, uint64_t* const* flags, size_t n, uint64_t value) override {
    r_.setFlags(map(s), flags, n, value);
  }
  void copy(int s, void* dst, const void* src, size_t bytes) override { r_.copy(map(s), dst, src, bytes); }
  void reduce(int s, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, loomDataType_t type,
              loomRedOp_t op) override {
    r_.reduce(map(s), dst, dst2, srcs, nsrcs, count, type, op);
  }
  void divide(int s, void* dst, const void* src, size_t count, loomDataType_t type, int divisor) override {
    r_.divide(map(s), dst, src, count, type, divisor);
  }
  void recordEvent(int s, int e) override { r_.recordEvent(map(s), e); }
  void waitEvent(int s, int e) override { r_.waitEvent(map(s), e); }
  void copyIndirect(int s, void* dst, const void* src, loom::CellRef cell, size_t bytes) override {
    r_.copyIndirect(map(s), dst, src, cell, bytes);
  }
  void reduceIndirect(int s, void* dst, void* dst2, const void* const* srcs, const loom::CellRef* cells, int nsrcs,
                      size_t count, loomDataType_t type, loomRedOp_t op) override {
    r_.reduceIndirect(map(s), dst, dst2, srcs, cells, nsrcs, count, type, op);
  }

 private:
  int map(int s) const { return size_t(s) < map_.size() ? map_[size_t(s)] : s; }
  SimRank& r_;
  std::vector<int> map_;
};

// N ranks, their windows and flags, spread over `gpus` simulated devices
// (rank r on device r % gpus; gpus = 1: all ranks share one device).
class SimDeviceWorld {
 public:
  SimDeviceWorld(int nranks, int gpus, size_t windowBytes, SimDeviceOptions opts = {});
  ~SimDeviceWorld();
  int nranks() const { return nranks_; }
  const SimDeviceOptions& options() const { return opts_; }
  SimRank& rank(int r) { return *ranks_[size_t(r)]; }
  // The communicator's round counter as rank r keeps it.
  uint64_t& round(int r) { return rounds_[size_t(r)]; }
  loom::ProgramBuffers buffers(int r, const void* send, size_t sendBytes, void* recv, size_t recvBytes);
  // Gives b (rank r's) the cell areas of device zero-copy; with `publish`,
  // rank r publishes its send and recv buffers of b to every peer (one
  // address space: as they are).
  void addCells(int r, loom::ProgramBuffers& b, bool publish);
  uint64_t flag(int r, int f) const { return flags_[size_t(r)][size_t(f)].load(); }

  // Rank r dies: its streams run nothing more; waits on its flags fail.
  void kill(int r) {
    dead_[size_t(r)].store(true, std::memory_order_release);
    notify();
  }
  bool dead(int r) const { return dead_[size_t(r)].load(std::memory_order_acquire); }

  // Waiting streams sleep here until something they may wait for changed
  // (a flag set, an event completed, a rank failed) or 2 ms passed.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  void notify();
  void sleepUnless(uint64_t generation);

 private:
  int nranks_;
  size_t windowBytes_;
  SimDeviceOptions opts_;
  std::vector<std::unique_ptr<SimGpu>> gpus_;
  std::vector<std::vector<uint8_t>> windows_;
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> flags_;
  std::vector<std::unique_ptr<std::atomic<uint64_t>[]>> cells_;  // per rank: nranks rows of kCellCount cells
  std::unique_ptr<std::atomic<bool>[]> dead_;
  std::vector<uint64_t> rounds_;
  std::atomic<uint64_t> generation_{0};
  std::mutex wakeMu_;
  std::condition_variable wakeCv_;
  std::vector<std::unique_ptr<SimRank>> ranks_;
};

// The capture probe of the simulated device (cudaStreamCapturing's, through
// setCudaCaptureProbeForTesting): whether some SimRank captures the caller
// stream with this handle now.  Capturing handles must be unique in the
// process (ranks as threads: one per rank).
int simStreamCapturing(void* key);

}  // namespace loomsim
