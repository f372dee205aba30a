// The communicator: who the ranks are, how to reach each one, and the order
// in which its operations run.  It is the executor's environment (ExecEnv).
#pragma once
#include <array>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "loom.h"
#include "src/core/bootstrap.h"
#include "src/core/executor.h"
#include "src/topology/comm_topology.h"
#include "src/tuner/tuner.h"
#include "transports/shm/shm_transport.h"

namespace loom {

// What every rank tells the others during init.
struct RankInfo {
  char hostId[120];
  uint64_t localKey;
  sockaddr_storage listenAddr;
  uint32_t listenLen;
  int32_t pid;
  int32_t inboxFd;
  uint32_t slotBytes;  // rank 0's value is used by all
  uint32_t slots;      // rank 0's value is used by all
  uint32_t transports; // rank 0's value is used by all (bit 0 shm, bit 1 tcp)
  uint32_t mailBytes;  // rank 0's value is used by all
  uint32_t stageBytes; // rank 0's value is used by all
  uint64_t commTag;    // rank 0's value is used by all
  RankTopo topo;       // this rank's machine and placement (topology())
};

enum TransportBits : uint32_t { kShmBit = 1, kTcpBit = 2, kUcxBit = 4 };
class UcxWorker;  // transports/ucx (only in builds with UCX)
uint32_t parseTransports(const std::string& spec);
// Checks the record rank `r` sent during init (bytes from the network):
// throws loomRemoteError for values this build could not use; terminates
// hostId.  Rank 0's communicator-wide settings are checked when r == 0.
void checkRankInfo(RankInfo* info, int r);

}  // namespace loom

struct loomComm : public loom::ExecEnv, public std::enable_shared_from_this<loomComm> {
 public:
  // Creates and joins; throws loom::Error.
  static std::shared_ptr<loomComm> create(const loom::UniqueIdData& id, int nranks, int rank);
  ~loomComm() override;

  int nranks() const { return nranks_; }
  int rank() const override { return rank_; }

  // ---- ordering: operations run one at a time, in issue order ----
  uint64_t takeTicket();
  void waitTurn(uint64_t ticket);
  void endTurn();
  void waitIdle();  // until every issued operation has run

  // Issues a batch: assigns sequence numbers / tags and takes a ticket, as
  // one atomic step so that tag order and execution order agree.
  uint64_t issue(const std::vector<loom::OpDesc>& ops, std::vector<loom::SlotTag>* tags);

  // The same for one operation without allocating (the latency path).
  uint64_t issueOne(const loom::OpDesc& op, loom::SlotTag* tag);
  // The tuner's algorithm for op run on its own.
  loom::Algorithm choose(const loom::OpDesc& op) const;
  // The shared-memory direct paths run without the executor.
  static bool isDirect(loom::Algorithm a) { return a == loom::Algorithm::OneShot || a == loom::Algorithm::Staged; }
  // Runs one operation inside its turn.
  loomResult_t runOne(const loom::OpDesc& op, const loom::SlotTag& tag);

  // Runs a batch (one call, or one group) inside its turn.
  loomResult_t runOps(const std::vector<loom::OpDesc>& ops, const std::vector<loom::SlotTag>& tags);

  // ---- errors ----
  void setFailed(loomResult_t code, const std::string& msg);
  loomResult_t asyncError() const { return loomResult_t(asyncError_.load()); }
  void setLastError(const std::string& msg);
  std::string lastError();

  void abort();
  void releaseHandle() { self_.reset(); }
  bool isAborted() const { return aborted_.load(); }
  const std::vector<loom::RankInfo>& peers() const { return peers_; }
  // Which ranks share a host, each rank's NUMA node, GPU and NIC.
  const loom::CommTopology& topology() const { return topology_; }
  const loom::Tuner& tuner() const { return *tuner_; }
  // Transport used to reach a peer ("shm", "tcp", "self").
  const char* transportTo(int peer) const;

  // ---- ExecEnv ----
  void prepare(const std::vector<std::pair<int, int>>& needed) override;
  loom::Connection* connection(int peer, int channel) override;
  uint32_t sleepBegin(bool withFds) override;
  void sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell, int64_t timeoutUs) override;
  void sleepEnd() override;
  void checkAborted() override;
  int64_t timeoutMs() const override { return timeoutMs_; }
  int64_t spinUs() const override { return spinUs_; }
  bool oversubscribed() const override { return oversubscribed_; }
  bool checkMode() const override { return checkMode_; }
  void checkStalled(const loom::SlotTag& mine, int peer) override;

  // ---- debugging (comm_dump.cc) ----
  // What this rank runs and waits for, as loomCommDump and LOOM_DUMP_SIGNAL
  // print it.  The note* calls are a few relaxed stores (hot path).
  void noteRunning(const loom::SlotTag& tag, size_t nops);
  void noteWaiting(int peer);
  void noteIdle();
  std::string dump();
  std::string runningOp() const;  // "AllReduce #3 (...)", or "an operation"

 private:
  loomComm() = default;
  void init(const loom::UniqueIdData& id, int nranks, int rank);
  loom::SlotTag tagFor(const loom::OpDesc& op);  // under seqMutex_
  // One round through the shared-memory mailboxes (comm_oneshot.cc).
  void runOneShot(const loom::OpDesc& op, const loom::SlotTag& tag);
  // Chunked reduce-scatter + all-gather through staging buffers (comm_staged.cc).
  void runStaged(const loom::OpDesc& op, const loom::SlotTag& tag);
  void initTuner(loom::Bootstrap& boot);
  void runDirect(loom::Algorithm algo, const loom::OpDesc& op, const loom::SlotTag& tag);
  template <class Ready>
  void waitFor(Ready ready, int peer, const loom::SlotTag& tag, const char* what);
  // Throws if peer visibly runs another operation than `tag` on the other path.
  void crossPathCheck(int peer, const loom::SlotTag& tag);
  void initUcx(loom::Bootstrap& boot);  // address exchange; sets ucxPeer_
  int acceptData(int64_t deadline, std::map<std::pair<int, int>, int>& stash);

  int rank_ = 0, nranks_ = 0;
  uint8_t secret_[16] = {};
  uint64_t commTag_ = 0;
  int64_t timeoutMs_ = 0, spinUs_ = 0;
  bool checkMode_ = true;
  uint32_t slotBytes_ = 0, slots_ = 0, transports_ = 0;
  int maxChannels_ = 4;
  uint32_t mailBytes_ = 0;
  uint32_t stageBytes_ = 0;
  uint64_t stageChunk_ = 0;  // chunks staged so far (stamps of the staging buffers)
  bool allShm_ = false;
  bool oversubscribed_ = false;
  std::unique_ptr<loom::Tuner> tuner_;
  loom::TunerLimits limits_;
  std::vector<std::array<uint64_t, 2>> lastMail_;  // per peer: seq+1 last written per parity
  std::vector<loom::RankInfo> peers_;
  loom::CommTopology topology_;
  std::vector<bool> shmPeer_;
  std::vector<bool> ucxPeer_;                // pairs that talk through UCX
  std::shared_ptr<loom::UcxWorker> ucx_;     // set when some peer uses UCX
  std::string ucxWhy_;                       // why this rank has no UCX worker
  int listenFd_ = -1;
  std::unique_ptr<loom::ShmInbox> inbox_;
  std::vector<std::unique_ptr<loom::ShmInbox>> peerInbox_;
  std::vector<int> pidfds_;
  std::map<std::pair<int, int>, std::unique_ptr<loom::Connection>> conns_;
  std::map<std::pair<int, int>, int> acceptedFds_;
  std::mutex fdMutex_;
  std::vector<int> tcpFds_;  // to shut down on abort (under fdMutex_)

  std::mutex turnMutex_;
  std::condition_variable turnCv_;
  std::atomic<uint64_t> nextTicket_{0}, serving_{0};
  std::atomic<int> turnWaiters_{0};

  std::mutex seqMutex_;
  uint64_t collSeq_ = 0;
  std::vector<uint64_t> sendSeq_, recvSeq_;

  std::atomic<int> asyncError_{loomSuccess};
  std::atomic<bool> aborted_{false};
  std::mutex errMutex_;
  std::string lastError_;
  std::shared_ptr<loomComm> self_;  // the handle's reference
  // The operation running now (comm_dump.cc); actStartNs_ == 0: none.
  std::atomic<int64_t> actStartNs_{0}, actWaitNs_{0}, actNoteNs_{0};
  std::atomic<uint64_t> actSeq_{0}, actCount_{0};
  std::atomic<uint32_t> actSig_{0};  // coll | dtype << 8 | op << 16
  std::atomic<int32_t> actRoot_{0}, actOps_{0}, actPeer_{-1};
};
