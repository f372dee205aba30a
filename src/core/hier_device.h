// The hierarchical device path: a CUDA communicator whose ranks sit on
// several hosts, the same number on each.
//
// The staged path alone (src/device/staged_comm.h) copies a rank's whole
// buffer over PCIe to pinned host memory and all-reduces it over every rank,
// so each host moves its L GPUs' full buffers through host memory and the
// network.  The hierarchical path keeps the bulk on the GPUs' own links:
//
//   1. reduce-scatter within the host, over CUDA IPC (an internal "local"
//      communicator of the host's L ranks, the ipc path): rank i of the host
//      ends with the host's sum of shard i (1/L of the buffer);
//   2. all-reduce of that shard between hosts, staged through pinned host
//      memory (an internal "rail" communicator of the ranks with local index
//      i on every host, the staged path): 1/L of the buffer crosses PCIe and
//      the network per rank;
//   3. all-gather within the host, over CUDA IPC: every rank gets every shard.
//
// All three are stream programs on the caller's stream, in that order, so
// each starts once the one before is done and the host thread returns at
// once.  The elements past the last whole shard (count % L of them) take
// the parent's own staged path ("flat").
//
// Reduce-scatter and all-gather (recvcount / sendcount c, N = H x L ranks)
// go the same way when the ranks are numbered host by host, so that host
// h's blocks are one run of L x c elements (HierShape::hostMajor):
//
//   reduce-scatter: for each host h, a local reduce-scatter of host h's run
//     into element h of a scratch of H x c (the host's sum of the block
//     rail rank h ends with); then a rail reduce-scatter of the scratch
//     into the caller's output: c crosses PCIe and the network per host
//     and rail rank, not N x c;
//   all-gather: a rail all-gather of the caller's c into the scratch (the
//     blocks of this rail's ranks, host by host); then for each host h a
//     local all-gather of scratch element h into host h's run of the
//     output.
//
// The scratch is device memory of this rank's, grown to the largest call
// and freed with the communicator.  Calls that use it may be on different
// streams, so each waits on the device (a stream wait on a counter in its
// own device memory) until every earlier one has finished with it.
// Everything else (collectives under LOOM_DEVICE_HIER_MIN_BYTES, ranks not
// numbered host by host for reduce-scatter and all-gather, integer
// averages, every other collective, send/recv) takes the flat path.
// Every rank decides alike: the decision depends on the count, the type,
// the op and rank 0's threshold only; ranks whose calls differ are caught
// by the parent's own mismatch check (src/device/op_signature.h), which
// compares every collective between neighbouring parent ranks.
//
// The sub-communicators are made during the parent's init and live as long
// as it does.  Their failures are the parent's: a sub-communicator's own
// failure (its operation's error, its watchdog, a sub-peer's notice) fails
// the parent, with the root rank translated, and the parent tells its
// peers.  The parent's failure (an error, a peer's notice, loomCommAbort, a
// revoke) fails both sub-communicators on this rank only, releasing their
// streams: every rank hears of it through the parent's own notices, so the
// sub-communicators send none (which would race with those and name the
// wrong root).
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/device/device_comm.h"
#include "src/device/op_signature.h"

struct loomComm;

namespace loom {

// Where a rank sits among the hosts of a communicator (hostIds: one per
// rank).  Hosts are numbered in the order of their lowest rank, ranks of a
// host by rank.
struct HierShape {
  int hosts = 0;
  int perHost = 0;      // ranks per host when every host has the same number, else 0
  int hostIndex = 0;    // this rank's host
  int localIndex = 0;   // this rank's place on its host
  // Ranks numbered host by host (rank = hostIndex * perHost + localIndex
  // for every rank), as torchrun and mpirun by slot number them: what the
  // hierarchical reduce-scatter and all-gather need (their blocks are in
  // rank order, so a host's blocks are then one contiguous run).
  bool hostMajor = false;
  std::vector<int> hostOf, localOf;  // per rank
  // Whether the hierarchical path applies: several hosts, the same number
  // of ranks on each, more than one.  Else why not.
  bool usable() const { return hosts > 1 && perHost > 1; }
  std::string why;
};
HierShape hierShapeOf(const std::vector<std::string>& hostIds, int rank);

// How an all-reduce of `count` elements is split over L ranks per host:
// `shard` elements per local rank through the hierarchy, `tail` through the
// flat path.
struct HierSplit {
  size_t shard = 0, tail = 0;
};
HierSplit hierSplit(size_t count, int perHost);

// A communicator's first failure, as its failure hook reports it
// (loomComm::setFailureHook).  root: the rank where it began (-1: this
// one), and that rank's message.
struct FailureNote {
  loomResult_t code = loomSuccess;
  std::string msg;
  int root = -1;
  std::string rootMsg;
};

struct HierParts {
  std::unique_ptr<DeviceCollectives> flat;  // the parent's staged path
  std::shared_ptr<loomComm> local, rail;    // CUDA communicators: ipc, staged
  HierShape shape;
  size_t minBytes = 0;  // LOOM_DEVICE_HIER_MIN_BYTES (rank 0's)
  // This rank's device, for the reduce-scatter's and all-gather's scratch,
  // and the counter that orders its users: 8 zeroed bytes of its device
  // memory, freed with the rest (null, as on ranks not numbered host by
  // host: those collectives take the flat path).
  std::unique_ptr<DeviceDriver> driver;
  uint64_t* orderFlag = nullptr;
  // The parent's own mismatch check (src/device/op_signature.h): ranks that
  // disagree on whether an all-reduce goes through the hierarchy (counts on
  // both sides of minBytes) would otherwise wait on different
  // sub-communicators until the timeout.  sendSignatures: a batch to
  // parent rank `peer` (empty: no check); onMismatch: fail the parent.
  int rank = 0, nranks = 1;
  std::function<void(int peer, std::vector<uint8_t> bytes)> sendSignatures{};
  std::function<void(const std::string& msg)> onMismatch{};
};

class HierDeviceComm final : public DeviceCollectives {
 public:
  // onSubFailure: a sub-communicator failed first (its note, with the root
  // rank in this communicator's ranks and the message naming the part);
  // the owner fails itself.  Called on the sub-communicator's thread, never
  // after stopWatchdog().
  HierDeviceComm(HierParts parts, std::function<void(const FailureNote&)> onSubFailure);
  ~HierDeviceComm() override;

  int device() const override { return flat_->device(); }
  const char* deviceName() const override { return flat_->deviceName(); }
  const char* pathName() const override { return "hier"; }
  void check(const OpDesc& op) const override { flat_->check(op); }
  void run(const OpDesc& op, void* callerStream) override;
  void runP2P(const std::vector<OpDesc>& ops, void* callerStream) override;
  void prepareP2P(const std::vector<OpDesc>& ops) override { flat_->prepareP2P(ops); }
  // On the flat communicator's driver (the same device, and every part of
  // a call runs on the caller's stream).
  void joinStreams(void* main, const std::vector<void*>& others, bool before) override {
    flat_->joinStreams(main, others, before);
  }
  void scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar, bool scalarOnDevice,
             void* callerStream) override {
    flat_->scale(dst, src, count, type, scalar, scalarOnDevice, callerStream);
  }
  void onPeerSignatures(int from, const std::vector<uint8_t>& bytes) override;
  bool failed() const override;
  bool markFailed(loomResult_t code, const std::string& msg) override;
  void setTimeoutMs(int64_t ms) override;
  void stopWatchdog() override;
  void abandon() override { flat_->abandon(); }
  // Registered device memory is published by the local sub-communicator
  // (its IPC path reads the parent's buffers; it publishes from the
  // parent's records, DeviceRequest::registrations).
  bool deviceMemory(const void* p, size_t bytes, void** allocation) override;
  void withdraw(void* allocation, const std::function<bool()>& held) override;
  std::string describe() const override;

  // Whether run() takes `op` through the hierarchy.
  bool hierarchical(const OpDesc& op) const;
  size_t scratchBytes() const;  // tests
  const HierShape& shape() const { return shape_; }
  loomComm* localComm() const { return local_.get(); }  // tests
  loomComm* railComm() const { return rail_.get(); }    // tests
  DeviceCollectives* flat() const { return flat_.get(); }
  uint64_t hierRuns() const { return hierRuns_.load(); }  // tests: all-reduces through the hierarchy

 private:
  std::unique_ptr<DeviceCollectives> flat_;
  std::shared_ptr<loomComm> local_, rail_;
  HierShape shape_;
  size_t minBytes_;
  std::atomic<bool> failed_{false};
  std::atomic<uint64_t> hierRuns_{0};
  // One operation's parts go to the sub-communicators together, so that
  // calls from several threads keep one order on all three.
  mutable std::mutex runMu_;
  void runAllReduce(const OpDesc& op, void* callerStream);
  void runExchange(const OpDesc& op, void* callerStream);  // reduce-scatter, all-gather
  void runExchangeParts(const OpDesc& op, void* callerStream, uint8_t* scratch, size_t block);

  // The reduce-scatter's and all-gather's scratch (runMu_): its users so
  // far, each of which sets orderFlag_ to its number when done; outgrown
  // scratch is kept until destruction (a call in flight may still use it).
  std::unique_ptr<DeviceDriver> driver_;
  uint64_t* orderFlag_;  // in device memory of driver_'s (null: not used)
  uint64_t scratchUses_ = 0;
  uint8_t* scratch_ = nullptr;
  size_t scratchBytes_ = 0;
  std::vector<void*> retired_;
  uint8_t* scratchFor(size_t bytes);

  // The parent-level mismatch check: every collective's signature, sent to
  // the next parent rank by a thread of its own (as the ipc path's
  // watchdog does), compared with the previous rank's.
  int rank_ = 0, nranks_ = 1;
  std::unique_ptr<SignatureCheck> sigs_;
  std::function<void(int, std::vector<uint8_t>)> sendSigs_;
  std::function<void(const std::string&)> onMismatch_;
  std::atomic<bool> mismatchReported_{false};
  std::mutex sigMu_;
  std::condition_variable sigCv_;
  bool sigStop_ = false, sigWake_ = false;  // sigMu_
  std::thread sigThread_;
  void signatureLoop();
  // Reports a mismatch found, sends a batch when one is due (all of them
  // when flush); how long to sleep next.
  int64_t signatureStep(bool flush);
  void wakeSignatures();
};

}  // namespace loom
