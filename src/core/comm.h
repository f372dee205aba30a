// The communicator: who the ranks are, how to reach each one, and the order
// in which its operations run.  It is the executor's environment (ExecEnv).
#pragma once
#include <sched.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "algorithms/direct.h"
#include "algorithms/registry.h"
#include "algorithms/schedule.h"
#include "loom.h"
#include "src/core/bootstrap.h"
#include "src/core/control.h"
#include "src/core/executor.h"
#include "src/core/hier_device.h"
#include "src/core/p2p_tagged.h"
#include "src/core/registration.h"
#include "src/core/trace.h"
#include "src/device/device_choice.h"
#include "src/device/device_comm.h"
#include "src/device/host_memory.h"
#include "src/device/staged_comm.h"
#include "src/topology/comm_topology.h"
#include "src/tuner/tuner.h"
#include "transports/transport.h"

namespace loom {

// What every rank tells the others first during init.  Transports then
// exchange records of their own (Transport::publish / accept).
struct RankInfo {
  char hostId[120];
  uint64_t localKey;
  int32_t pid;
  uint32_t slotBytes;  // rank 0's value is used by all
  uint32_t slots;      // rank 0's value is used by all
  uint32_t mailBytes;  // rank 0's value is used by all
  uint32_t stageBytes; // rank 0's value is used by all
  uint32_t deviceKind; // 0: host, 1: CUDA (LOOM_DEVICE); every rank's must agree
  uint64_t commTag;    // rank 0's value is used by all
  char transports[64]; // rank 0's LOOM_TRANSPORTS is used by all
  RankTopo topo;       // this rank's machine and placement (topology())
  sockaddr_storage ctlAddr;  // this rank's control socket (src/core/control.h)
  uint32_t ctlLen;
  uint32_t devicePath; // LOOM_DEVICE_PATH: 0 auto, 1 ipc, 2 staged, 3 hier; rank 0's value is used by all
  uint32_t deviceStageBytes; // LOOM_DEVICE_STAGE_BYTES (the staged path's piece); rank 0's value is used by all
  uint32_t deviceHierMinBytes; // LOOM_DEVICE_HIER_MIN_BYTES; rank 0's value is used by all
  uint64_t cpuSet;     // cpuSetHash of the CPUs it may run on (src/topology/cpu_bind.h)
  uint32_t checkMode;  // LOOM_CHECK_MODE (1 on); rank 0's value is used by all
  uint32_t deviceSlotBytes;     // LOOM_DEVICE_SLOT_BYTES; rank 0's value is used by all
  uint32_t deviceOneShotBytes;  // LOOM_DEVICE_ONESHOT_BYTES; rank 0's value is used by all
  uint32_t deviceZeroCopy;      // LOOM_DEVICE_ZERO_COPY (1 on); rank 0's value is used by all
  uint32_t deviceGraphSlotBytes;  // LOOM_DEVICE_GRAPH_SLOT_BYTES (0: none); rank 0's value is used by all
};

// Checks the record rank `r` sent during init (bytes from the network):
// throws loomRemoteError for values this build could not use; terminates
// the strings.  Rank 0's communicator-wide settings are checked when r == 0.
void checkRankInfo(RankInfo* info, int r);

// Tests only: the host identity of the communicators the calling thread
// creates from now on (empty: LOOM_HOST_ID, else the machine's), so that
// ranks as threads of one process pose as several hosts.
void setThreadHostIdForTesting(const std::string& hostId);

// How many times this process's ancestors forked on the way to it (since
// libloom loaded): a communicator made before a fork belongs to the parent,
// whose connections and windows a child shares, and must not run there.
uint32_t forkGeneration();

}  // namespace loom

struct loomComm : public loom::ExecEnv,
                  public loom::ConnectHost,
                  public loom::TaggedHost,
                  public std::enable_shared_from_this<loomComm> {
 public:
  // Creates and joins; throws loom::Error.  bootCheck: see Bootstrap.
  // device: where it runs (loomCommInitRankConfig; default LOOM_DEVICE).
  static std::shared_ptr<loomComm> create(const loom::UniqueIdData& id, int nranks, int rank,
                                          loom::BootCheck bootCheck = nullptr,
                                          const loom::DeviceRequest& device = loom::DeviceRequest());
  ~loomComm() override;

  int nranks() const { return nranks_; }
  // The process that made it (forkGeneration() then) and its pid.
  bool madeInThisProcess() const { return forkGen_ == loom::forkGeneration(); }
  int creatorPid() const { return creatorPid_; }
  int rank() const override { return rank_; }

  // ---- ordering: operations run one at a time, in issue order ----
  uint64_t takeTicket();
  void waitTurn(uint64_t ticket);
  void endTurn();
  void waitIdle();  // until every issued operation has run
  // Destroy, once idle: warns (LOOM_WARN) about data peers sent that no
  // call of this rank received, which goes with the connections.
  void warnUnreceived();

  // Issues a batch: assigns sequence numbers / tags and takes a ticket, as
  // one atomic step so that tag order and execution order agree.
  uint64_t issue(const std::vector<loom::OpDesc>& ops, std::vector<loom::SlotTag>* tags);

  // The same for one operation without allocating (the latency path).
  uint64_t issueOne(const loom::OpDesc& op, loom::SlotTag* tag);
  // The tuner's algorithm for op run on its own.
  loom::Algorithm choose(const loom::OpDesc& op) const;
  // The direct paths (algorithms/direct.h) run without the executor.
  static bool isDirect(loom::Algorithm a) { return loom::algorithmEntry(a).direct; }
  // Runs one operation inside its turn.
  loomResult_t runOne(const loom::OpDesc& op, const loom::SlotTag& tag);

  // Runs a batch (one call, or one group) inside its turn.
  loomResult_t runOps(const std::vector<loom::OpDesc>& ops, const std::vector<loom::SlotTag>& tags);
  // `ops` with each in-place all-to-all's input copied aside (into
  // inPlaceInputs_) and its sendbuf pointing at the copy; `ops` itself when
  // there is none.  Inside the turn.
  const std::vector<loom::OpDesc>& withInPlaceInputsCopied(const std::vector<loom::OpDesc>& ops,
                                                           std::vector<loom::OpDesc>* copied);

  // ---- errors ----
  // The first failure tells every peer (transports' abort, then a notice on
  // the control socket that names the ranks this rank knows to be dead).
  void setFailed(loomResult_t code, const std::string& msg, loom::CtlType notice = loom::CtlType::Fail);
  loomResult_t asyncError() const { return loomResult_t(asyncError_.load()); }
  void setLastError(const std::string& msg);
  std::string lastError();
  // The message this rank recorded when the communicator failed (what later
  // calls repeat, once, whatever errors came in between).
  std::string failure();

  void abort();
  // loomCommRevoke: fails this rank's pending and later operations and tells
  // every reachable peer to do the same; never blocks.
  void revoke();
  bool isRevoked() const { return revoked_.load(); }
  // Ranks known to be dead: their control socket refused us (the kernel
  // closed a dead process's listener).
  std::set<int> deadRanks();
  // Ranks whose control socket neither answered nor refused when last asked
  // (a failure notice, a Why question): a network cut, or a host that is
  // gone without a trace.  A rank that answers later leaves the set.
  std::set<int> unreachableRanks();
  // "; dead ranks: 1 3; unreachable ranks: 2" (either part only when known).
  std::string deadSuffix();
  // Waits (at most until deadlineMs) for this rank's failure notices to be
  // answered, so that deadRanks() includes what they found.
  void settleNotices(int64_t deadlineMs);
  // loomCommShrink (src/core/shrink.cc): the survivors without `exclude`
  // and without the dead agree on who is left and build a new communicator;
  // nullptr for a rank left out.
  std::shared_ptr<loomComm> shrink(const std::vector<int>& exclude);
  // Drops the handle's reference (destroy, abort); two threads may race
  // here (destroy and a watchdog's abort): only the first lets go.
  void releaseHandle() {
    std::shared_ptr<loomComm> self;
    {
      std::lock_guard<std::mutex> lock(selfMutex_);
      self.swap(self_);
    }
  }
  // Called (once, on whichever thread fails it) with this communicator's
  // first failure: a hierarchical parent's sub-communicators tell their
  // parent this way (src/core/hier_device.h).  nullptr clears it; calls
  // under way are waited for (so never clear it from the hook itself).
  void setFailureHook(std::function<void(const loom::FailureNote&)> hook);
  // A hierarchical path's sub-communicator whose parent failed: fails it on
  // this rank only (its streams released, its waits stopped), telling no
  // peer and calling no hook: every rank hears of the parent's failure
  // from the parent's own notices.
  void failFromParent(loomResult_t code, const std::string& msg);
  bool isAborted() const { return aborted_.load(); }
  const std::vector<loom::RankInfo>& peers() const { return peers_; }
  // Which ranks share a host, each rank's NUMA node, GPU and NIC.
  const loom::CommTopology& topology() const { return topology_; }
  const loom::Tuner& tuner() const { return *tuner_; }
  // Transport used to reach a peer ("shm", "tcp", ..., "self").
  const char* transportTo(int peer) const;
  // The transport of that name this communicator uses (nullptr: none).
  loom::Transport* transportNamed(const std::string& name) const;
  // loomCommRegister's records (src/core/registration.h), and the
  // transports a registration is offered to.
  loom::RegistrationTable& registrations() { return registrations_; }
  // loomCommRegister / loomCommDeregister.  CUDA device memory registers
  // only on a CUDA communicator of its device (loomInvalidArgument
  // otherwise), and device zero-copy may publish it; its deregistration has
  // the peers unmap it (DeviceCollectives::withdraw).
  void* registerBuffer(void* buff, size_t bytes);
  void deregisterBuffer(void* handle);
  // The device side of a CUDA communicator (LOOM_DEVICE=cuda), nullptr on
  // the host: its collectives are stream programs on the caller's stream.
  loom::DeviceCollectives* deviceComm() const { return device_.get(); }
  // This communicator's device, as a request (split and shrink make their
  // communicators on it).
  loom::DeviceRequest deviceRequest() const {
    loom::DeviceRequest r;
    r.derived = true;
    r.kind = device_ ? loom::DeviceRequest::Kind::Cuda : loom::DeviceRequest::Kind::Host;
    r.device = device_ ? device_->device() : -1;
    r.timeoutMs = timeoutMs_.load();
    return r;
  }
  std::vector<loom::Transport*> transportList() const {
    std::vector<loom::Transport*> v;
    for (const auto& t : transports_) v.push_back(t.get());
    return v;
  }

  // ---- TaggedHost (src/core/p2p_tagged.h) ----
  int taggedRanks() const override { return nranks_; }
  // Channel maxChannels_ of each peer; the higher rank of a pair opens it
  // (waiting briefly), the lower one takes it once it has arrived.
  loom::Connection* taggedConnection(int peer) override;
  size_t taggedStashBytes() const { return tagged_ ? tagged_->stashedBytes() : 0; }

  // ---- ExecEnv ----
  void prepare(const std::vector<std::pair<int, int>>& needed) override;
  loom::Connection* connection(int peer, int channel) override;
  uint32_t sleepBegin(bool withFds) override;
  void sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell, int64_t timeoutUs) override;
  void sleepEnd() override;
  void checkAborted() override;  // also ConnectHost's
  int64_t timeoutMs() const override { return timeoutMs_.load(std::memory_order_relaxed); }
  // loomCommSetTimeout: read by operations while they wait, so atomic.
  void setTimeoutMs(int64_t ms) {
    timeoutMs_.store(ms, std::memory_order_relaxed);
    if (device_) device_->setTimeoutMs(ms);
  }
  int64_t spinUs() const override { return spinUs_; }
  bool oversubscribed() const override { return oversubscribed_; }
  std::atomic<uint32_t>* cpuContention() override { return &cpuContention_; }
  bool checkMode() const override { return checkMode_; }
  void checkStalled(const loom::SlotTag& mine, int peer) override;
  void checkOtherPath(const loom::SlotTag& mine, int peer) override;
  loom::Tracer* tracer() override { return tracer_.get(); }

  // ---- debugging (comm_dump.cc) ----
  // What this rank runs and waits for, as loomCommDump and LOOM_DUMP_SIGNAL
  // print it.  The note* calls are a few relaxed stores (hot path).
  void noteRunning(const loom::SlotTag& tag, size_t nops);
  void noteWaiting(int peer) override;
  void checkPeerAlive(int peer) override;
  void noteIdle();
  std::string dump();
  std::string runningOp() const override;  // "AllReduce #3 (...)", or "an operation"

 private:
  loomComm() = default;
  void init(const loom::UniqueIdData& id, int nranks, int rank, const loom::BootCheck& bootCheck,
            const loom::DeviceRequest& device);
  // Fails the communicator if it has not failed yet (true) and tells the peers.
  // root/rootMsg: where the failure began when it is inherited from a peer.
  bool failFirst(loomResult_t code, const std::string& msg, loom::CtlType notice = loom::CtlType::Fail,
                 int root = -1, const std::string& rootMsg = "");
  // An operation's error: fails the communicator (asking the peer a broken
  // connection leads to for the root cause) and returns the code to report.
  loomResult_t failOperation(const loom::Error& e);
  loom::CtlCause cause();  // for Why questions and Fail notices
  void onNotice(const loom::CtlMsg& m);  // on the control thread
  // Records what a notice broadcast to the ranks in `asked` found: refused (dead), no answer (unreachable).
  void markDead(const std::vector<bool>& asked, const std::vector<loom::Reach>& reach);
  void notifyPeers(loom::CtlType type);
  loom::SlotTag tagFor(const loom::OpDesc& op);  // under seqMutex_
  // A batch of tagged sends and receives (runOps' part for them).
  void runTagged(const std::vector<loom::OpDesc>& ops);
  // Sets up the transports in rank 0's LOOM_TRANSPORTS order: each takes
  // the peers it reaches that no earlier one took.
  void initTransports(loom::Bootstrap& boot, const loom::TransportEnv& env);
  void initTuner(loom::Bootstrap& boot);
  // LOOM_CPU_BIND (src/topology/cpu_bind.h): binds this process when its
  // host is oversubscribed and no launcher bound the ranks; `allowed` is
  // what it reported in its RankInfo.
  void bindToCpus(const std::vector<int>& allowed);
  void runDirect(loom::Algorithm algo, const loom::OpDesc& op, const loom::SlotTag& tag);
  loom::DirectContext directContext();
  // LOOM_TRACE: one event for a run of ops that started at beginUs.
  void traceRun(double beginUs, const std::vector<loom::OpDesc>& ops, const std::vector<loom::SlotTag>& tags,
                loom::Algorithm algo, const char* algoName = nullptr);

  int rank_ = 0, nranks_ = 0;
  const char* part_ = nullptr;  // "local" or "rail": a hierarchical path's sub-communicator
  std::atomic<int64_t> timeoutMs_{0};
  int64_t spinUs_ = 0;
  bool checkMode_ = true;
  int maxChannels_ = 4;
  bool oversubscribed_ = false;
  std::atomic<uint32_t> cpuContention_{0};
  std::unique_ptr<loom::Tuner> tuner_;
  loom::TunerLimits limits_;
  std::vector<loom::RankInfo> peers_;
  loom::CommTopology topology_;
  std::string transportSpec_;                          // rank 0's LOOM_TRANSPORTS
  std::vector<std::unique_ptr<loom::Transport>> transports_;  // in preference order
  std::vector<loom::Transport*> via_;                  // per peer (nullptr: self)
  loom::Doorbell* doorbell_ = nullptr;                 // how this rank sleeps and is woken
  loom::PeerMemory* peerMem_ = nullptr;                // set when every rank shares it: direct paths
  loom::DirectLayout directLayout_;
  loom::DirectState directState_;
  // runOne's last choice: a blocking caller repeats one small operation,
  // and the tuner's answer depends only on the collective and the block's
  // bytes (the shape and the limits are fixed at init).  Used under the
  // turn (waitTurn), so one thread at a time.
  struct LastChoice {
    loom::Collective coll;
    size_t block = SIZE_MAX;
    loom::Algorithm algo;
    loom::RunDirectFn runDirect;  // the algorithm's, when it is a direct path
  } lastChoice_;
  // In-place all-to-alls' inputs, copied aside for the run (loomMemAlloc's
  // memory, so that the peers can still read them in place; kept, grown and
  // shrunk with the batches; used under the turn; its size is in the dump).
  loom::SharedScratch inPlaceInputs_;
  loom::ScratchBuffer inPlaceFallback_;  // where loomMemAlloc's memory is refused
  bool inPlaceWarned_ = false;           // ...which is logged once
  std::map<std::pair<int, int>, std::unique_ptr<loom::Connection>> conns_;
  std::unique_ptr<loom::TaggedP2P> tagged_;  // loomSendTagged / loomRecvTagged
  std::vector<int64_t> taggedRetryMs_;       // per peer: when to look for its tagged connection again
  loom::RegistrationTable registrations_;  // released before the transports
  // The records device zero-copy publishes from: registrations_, or the
  // parent's for the hierarchical path's local sub-communicator.
  const loom::RegistrationTable* publishFrom_ = &registrations_;
  std::unique_ptr<loom::DeviceCollectives> device_;  // CUDA communicators only
  // Mismatch-check batches (CtlType::Sigs) that came before device_.
  std::mutex earlySigsMutex_;
  std::vector<std::pair<int, std::vector<uint8_t>>> earlySigs_;
  std::mutex hookMutex_;
  std::condition_variable hookCv_;
  std::function<void(const loom::FailureNote&)> failureHook_;  // under hookMutex_
  int hookCalls_ = 0;  // under hookMutex_: calls of the hook under way
  void callFailureHook(const loom::FailureNote& note);
  // The hierarchical device path (several hosts, the same number of ranks
  // on each): its internal local and rail communicators and the flat path.
  std::unique_ptr<loom::DeviceCollectives> makeHierDevice(loom::Bootstrap& boot, const loom::DeviceChoice& choice,
                                                          const loom::DeviceRequest& device,
                                                          const std::vector<std::string>& hostIds,
                                                          const loom::SockAddr& advertise);
  // device_ for failFirst, which the control thread may run while init
  // still builds device_ (and after the control thread stops: nullptr).
  std::atomic<loom::DeviceCollectives*> deviceForFail_{nullptr};
  // The device watchdog's probe: whether the control plane knows `peer` is
  // gone, or its control socket refuses (*why says which).
  bool devicePeerGone(int peer, std::string* why);
  // CUDA send/recv staging through the control plane: asks `peer` for its
  // region for this rank (DeviceCommOptions::fetchRegion), and answers a
  // peer's question on the control thread.
  loom::IpcRecord fetchDeviceRegion(int peer);
  std::vector<uint8_t> deviceRegionAnswer(int from, const std::vector<uint8_t>& question);
  // Device zero-copy through the same questions (a first byte of 1:
  // publish, 2: unpublish, then the record): DeviceCommOptions::publishTo
  // and unpublishTo.
  uint64_t askDevicePublish(int peer, uint8_t kind, const loom::IpcRecord& rec);
  // A Region question to `peer` until it answers (it may not have made its
  // device side yet), the communicator fails, or LOOM_TIMEOUT_MS.
  // `answered` decodes an answer: false for "not ready, ask again".
  // maxMs > 0: gives up sooner than LOOM_TIMEOUT_MS.
  void askDevice(int peer, const std::vector<uint8_t>& question, const char* what,
                 const std::function<bool(const std::vector<uint8_t>&)>& answered, int64_t maxMs = 0);
  // Rank 0's slot and one-shot sizes, the watchdog wired to this communicator.
  loom::DeviceCommOptions deviceOptions(const loom::RankInfo& root);
  // A mismatch-check batch to `peer` over the control plane, not waiting.
  void sendSignatures(int peer, std::vector<uint8_t> bytes);
  loom::StagedCommOptions stagedOptions();  // the staged path wired to the host path

  std::mutex turnMutex_;
  std::condition_variable turnCv_;
  std::atomic<uint64_t> nextTicket_{0}, serving_{0};
  std::atomic<int> turnWaiters_{0};

  // Held for a few instructions (a tag and a ticket), by the issuing
  // thread: uncontended it is one exchange and one store, no libc calls
  // (the blocking latency path takes it once per operation).
  class SeqLock {
   public:
    void lock() {
      while (held_.exchange(true, std::memory_order_acquire)) sched_yield();
    }
    void unlock() { held_.store(false, std::memory_order_release); }

   private:
    std::atomic<bool> held_{false};
  };
  SeqLock seqMutex_;
  uint64_t collSeq_ = 0;
  std::vector<uint64_t> sendSeq_, recvSeq_;

  std::atomic<int> asyncError_{loomSuccess};
  std::atomic<bool> aborted_{false};
  std::atomic<bool> revoked_{false};
  std::mutex errMutex_;
  std::string lastError_;
  std::string failMsg_;  // under errMutex_
  std::set<int> dead_;                   // under errMutex_
  std::set<int> unreachable_;            // under errMutex_; never holds a dead rank
  std::atomic<int64_t> aliveCheckedMs_{0};  // checkPeerAlive's last look
  int causeRoot_ = -1;                   // under errMutex_: where the failure began
  std::string causeMsg_;                 // under errMutex_: the message of the rank where it began
  std::unique_ptr<loom::Control> ctl_;   // destroyed first: its thread calls onNotice
  std::shared_ptr<loomComm> self_;  // the handle's reference
  std::mutex selfMutex_;            // guards self_ (releaseHandle)
  const uint32_t forkGen_ = loom::forkGeneration();
  const int creatorPid_ = int(getpid());
  std::atomic<uint32_t> shrinkRounds_{0};  // loomCommShrink calls on this communicator (shrink.cc)
  // The latest shrink a coordinator said it did without this rank: its
  // number there, and how many collectives the coordinator had issued.
  struct SatOut {
    uint32_t round = 0;
    uint64_t collSeq = 0;
  };
  std::mutex satOutMutex_;
  SatOut satOut_;
  std::unique_ptr<loom::Tracer> tracer_;  // LOOM_TRACE
  // The operation running now (comm_dump.cc); actStartNs_ == 0: none.
  std::atomic<int64_t> actStartNs_{0}, actWaitNs_{0}, actNoteNs_{0};
  std::atomic<uint64_t> actSeq_{0}, actCount_{0};
  std::atomic<uint32_t> actSig_{0};  // coll | dtype << 8 | op << 16
  std::atomic<int32_t> actRoot_{0}, actOps_{0}, actPeer_{-1};
};
