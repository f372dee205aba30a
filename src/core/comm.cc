#include "src/core/comm.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"
#include "src/core/clock.h"
#include "src/core/comm_dump.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"
#include "src/tuner/tuner.h"
#include "transports/tcp/tcp_transport.h"
#ifdef LOOM_HAVE_UCX
#include "transports/ucx/ucx_transport.h"
#endif

using namespace loom;

namespace loom {

#ifdef LOOM_HAVE_UCX
static constexpr uint32_t kAllTransports = kShmBit | kTcpBit | kUcxBit;
#else
static constexpr uint32_t kAllTransports = kShmBit | kTcpBit;
#endif

uint32_t parseTransports(const std::string& spec) {
  uint32_t bits = 0;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string t = spec.substr(pos, end - pos);
    if (t == "shm") bits |= kShmBit;
    else if (t == "tcp") bits |= kTcpBit;
#ifdef LOOM_HAVE_UCX
    else if (t == "ucx") bits |= kUcxBit;
#else
    else if (t == "ucx")
      fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: this loom was built without UCX (pkg-config found no "
           "ucx), so it has only shm and tcp", spec.c_str());
#endif
    else if (!t.empty())
      fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: unknown transport '%s' (this build has shm, %stcp)",
           spec.c_str(), t.c_str(), (kAllTransports & kUcxBit) ? "ucx, " : "");
    pos = end + 1;
  }
  if (!bits) fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s names no transport", spec.c_str());
  return bits;
}

void checkRankInfo(RankInfo* info, int r) {
  info->hostId[sizeof info->hostId - 1] = 0;
  if (info->listenLen > sizeof info->listenAddr)
    fail(loomRemoteError, "rank %d sent an address of %u bytes during init", r, info->listenLen);
  if (r != 0) return;
  // The bounds config.cc enforces on rank 0's own environment.
  if (info->slots < 2 || info->slots > 1024 || info->slotBytes < 4096 || info->slotBytes > (64u << 20) ||
      info->slotBytes % 64 || info->mailBytes > (1u << 20) || info->mailBytes % 64 ||
      info->stageBytes > (1u << 30) || info->stageBytes % 4096 || !info->transports ||
      (info->transports & ~kAllTransports))
    fail(loomRemoteError,
         "rank 0 sent settings this build cannot use (slots %u x %u B, mail %u B, stage %u B, transports %#x); "
         "do all ranks run the same loom?",
         info->slots, info->slotBytes, info->mailBytes, info->stageBytes, info->transports);
}

}  // namespace loom

std::shared_ptr<loomComm> loomComm::create(const UniqueIdData& id, int nranks, int rank) {
  std::shared_ptr<loomComm> c(new loomComm());
  c->self_ = c;
  try {
    c->init(id, nranks, rank);
  } catch (...) {
    c->self_.reset();
    throw;
  }
  dumpRegister(c.get());
  return c;
}

loomComm::~loomComm() {
  dumpUnregister(this);
  conns_.clear();
  ucx_.reset();
  for (auto& kv : acceptedFds_) close(kv.second);
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
  if (listenFd_ >= 0) close(listenFd_);
}

void loomComm::init(const UniqueIdData& id, int nranks, int rank) {
  const Config& cfg = config();
  rank_ = rank;
  nranks_ = nranks;
  logSetRank(rank);
  memcpy(secret_, id.secret, 16);
  timeoutMs_ = cfg.timeoutMs;
  spinUs_ = cfg.spinUs;
  checkMode_ = cfg.checkMode;
  int64_t deadline = nowMs() + timeoutMs_;
  sendSeq_.assign(size_t(nranks), 0);
  recvSeq_.assign(size_t(nranks), 0);

  // This rank's listener for data connections.
  SockAddr bindAddr = cfg.socketIfname.empty() ? resolveAddr("0.0.0.0", 0) : interfaceAddr(cfg.socketIfname);
  bindAddr.setPort(0);
  listenFd_ = listenOn(bindAddr);
  uint16_t listenPort = localAddr(listenFd_).port();

  Bootstrap boot(id, rank, nranks, deadline);

  RankInfo mine{};
  std::string host = cfg.hostId.empty() ? machineHostId() : cfg.hostId;
  snprintf(mine.hostId, sizeof mine.hostId, "%s", host.c_str());
  mine.localKey = localKey();
  SockAddr advertise = cfg.socketIfname.empty() ? boot.localAddress() : bindAddr;
  if (advertise.ss.ss_family == AF_INET &&
      reinterpret_cast<sockaddr_in*>(&advertise.ss)->sin_addr.s_addr == 0)
    advertise = defaultInterfaceAddr();
  advertise.setPort(listenPort);
  memcpy(&mine.listenAddr, &advertise.ss, sizeof advertise.ss);
  mine.listenLen = advertise.len;
  mine.pid = int32_t(getpid());
  mine.inboxFd = -1;
  mine.slotBytes = uint32_t(cfg.slotBytes);
  mine.slots = uint32_t(cfg.slots);
  mine.transports = parseTransports(cfg.transports);
  mine.mailBytes = uint32_t(cfg.shmSmallBytes);
  mine.stageBytes = uint32_t(cfg.shmStageBytes);
  fillRandom(&mine.commTag, sizeof mine.commTag);
  mine.topo = localRankTopo(advertise.ss);

  std::vector<uint8_t> all = boot.allGather(&mine, sizeof mine);
  peers_.resize(size_t(nranks));
  memcpy(peers_.data(), all.data(), all.size());
  for (int r = 0; r < nranks; ++r) checkRankInfo(&peers_[size_t(r)], r);
  // Communicator-wide settings come from rank 0 so every pair agrees.
  slotBytes_ = peers_[0].slotBytes;
  slots_ = peers_[0].slots;
  transports_ = peers_[0].transports;
  commTag_ = peers_[0].commTag;
  mailBytes_ = peers_[0].mailBytes;
  stageBytes_ = peers_[0].stageBytes;
  // Which ranks share a host, and where each sits (the tuner reads it).
  std::vector<std::string> hostIds;
  std::vector<RankTopo> rankTopos;
  for (const RankInfo& p : peers_) {
    hostIds.emplace_back(p.hostId, strnlen(p.hostId, sizeof p.hostId));
    rankTopos.push_back(p.topo);
  }
  topology_ = CommTopology(hostIds, rankTopos);
  tuner_ = std::make_unique<Tuner>(cfg);
  lastMail_.assign(size_t(nranks), {0, 0});


  // Shared memory with the ranks that share this host.
  shmPeer_.assign(size_t(nranks), false);
  peerInbox_.resize(size_t(nranks));
  pidfds_.assign(size_t(nranks), -1);
  std::vector<int> local;
  for (int r = 0; r < nranks; ++r)
    if (r != rank && strncmp(peers_[size_t(r)].hostId, mine.hostId, sizeof mine.hostId) == 0)
      local.push_back(r);
  bool wantShm = (transports_ & kShmBit) && !local.empty();
  ShmLayout layout{uint32_t(nranks), uint32_t(maxChannels_), slots_, slotBytes_, mailBytes_, stageBytes_};
  auto wakeName = [&](int r) { return strf("loom/%016llx/%d", (unsigned long long)commTag_, r); };
  int32_t inboxFd = -1;
  if (wantShm) {
    inbox_ = ShmInbox::create(layout, wakeName(rank));
    inboxFd = inbox_->fd();
  }
  all = boot.allGather(&inboxFd, sizeof inboxFd);
  std::vector<uint8_t> ok(size_t(nranks), 0);
  for (int r : local) {
    int32_t fd;
    memcpy(&fd, all.data() + size_t(r) * sizeof fd, sizeof fd);
    if (!wantShm || fd < 0) continue;
    std::string why;
    peerInbox_[size_t(r)] = ShmInbox::map(peers_[size_t(r)].pid, fd, wakeName(r), layout, &why);
    if (!peerInbox_[size_t(r)]) {
      LOOM_WARN("SHM", "rank %d: no shared memory with rank %d (%s); using tcp", rank, r, why.c_str());
      continue;
    }
    pidfds_[size_t(r)] = int(syscall(SYS_pidfd_open, peers_[size_t(r)].pid, 0));
    ok[size_t(r)] = 1;
  }
  all = boot.allGather(ok.data(), ok.size());
  for (int r = 0; r < nranks; ++r)
    shmPeer_[size_t(r)] = ok[size_t(r)] && all[size_t(r) * size_t(nranks) + size_t(rank)];
  initUcx(boot);
  for (int r = 0; r < nranks; ++r) {
    if (r != rank && !shmPeer_[size_t(r)] && !ucxPeer_[size_t(r)] && !(transports_ & kTcpBit))
      fail(loomInvalidUsage, "rank %d cannot reach rank %d: LOOM_TRANSPORTS=%s allows no tcp and they %s%s",
           rank, r, cfg.transports.c_str(),
           !(transports_ & kShmBit) ? "may not use shm"
           : ok[size_t(r)]          ? "could not map shared memory"
                                    : "are on different hosts",
           (transports_ & kUcxBit) ? (ucxWhy_.empty() ? "; UCX is not available on one of them (see its log)"
                                                     : ("; UCX is not available here: " + ucxWhy_).c_str())
                                   : "");
  }
  oversubscribed_ = long(local.size() + 1) > sysconf(_SC_NPROCESSORS_ONLN);
  allShm_ = nranks > 1;
  for (int r = 0; r < nranks; ++r)
    if (r != rank && !shmPeer_[size_t(r)]) allShm_ = false;
  limits_.maxChannels = maxChannels_;
  limits_.oneShotBytes = allShm_ ? mailBytes_ : 0;
  limits_.stageBytes = allShm_ ? stageBytes_ : 0;
  limits_.maxChunkBytes = size_t(slots_ - 1) * slotBytes_;
  initTuner(boot);
  LOOM_INFO("INIT", "rank %d of %d ready: host %s, %zu local peers, slots %u x %u B", rank, nranks,
            mine.hostId, local.size(), slots_, slotBytes_);
}

// UCX worker addresses travel in a separate allGather of fixed-size records
// (every rank takes part when rank 0's LOOM_TRANSPORTS names ucx; a rank
// that needs no UCX, or cannot start it, sends an empty record).  A pair
// that shares no memory uses UCX when both ends have a worker.
void loomComm::initUcx(Bootstrap& boot) {
  ucxPeer_.assign(size_t(nranks_), false);
  if (!(transports_ & kUcxBit)) return;
#ifdef LOOM_HAVE_UCX
  bool need = false;
  for (int r = 0; r < nranks_; ++r) need |= r != rank_ && !shmPeer_[size_t(r)];
  UcxAddrRecord mine{};
  if (need) {
    ucx_ = ucxCreateWorker(rank_, config().ucxTls, &ucxWhy_);
    if (ucx_) mine = ucxAddress(*ucx_, &ucxWhy_);
    if (!mine.len) {
      ucx_.reset();
      LOOM_WARN("NET", "rank %d: no UCX (%s)%s", rank_, ucxWhy_.c_str(),
                (transports_ & kTcpBit) ? "; using tcp" : "");
    }
  }
  std::vector<uint8_t> all = boot.allGather(&mine, sizeof mine);
  if (!ucx_) return;
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || shmPeer_[size_t(r)]) continue;
    UcxAddrRecord rec;
    memcpy(&rec, all.data() + size_t(r) * sizeof rec, sizeof rec);
    if (!rec.len || rec.len > kUcxAddrMax) continue;
    ucxSetPeerAddress(*ucx_, r, rec);
    ucxPeer_[size_t(r)] = true;
  }
  LOOM_INFO("INIT", "rank %d: ucx worker address %u bytes (UCX_TLS %s)", rank_, mine.len,
            !config().ucxTls.empty() ? config().ucxTls.c_str() : getenv("UCX_TLS") ? getenv("UCX_TLS") : "default");
#else
  (void)boot;  // parseTransports refuses ucx in builds without UCX
#endif
}

// The cost model decides from the communicator's shape; every rank must
// decide alike, so each rank's core count is exchanged and rank 0's
// decisions (which also reflect its LOOM_TUNING_FILE) are used by all.
void loomComm::initTuner(Bootstrap& boot) {
  CommShape shape;
  shape.nranks = nranks_;
  const std::vector<int>& hostOf = topology_.hostOfRanks();
  shape.hostOf = hostOf;
  int32_t cores = int32_t(sysconf(_SC_NPROCESSORS_ONLN));
  std::vector<uint8_t> all = boot.allGather(&cores, sizeof cores);
  std::vector<int> perHost(size_t(topology_.nhosts()), 0);
  for (int r = 0; r < nranks_; ++r) {
    int32_t c;
    memcpy(&c, all.data() + size_t(r) * sizeof c, sizeof c);
    int& slot = perHost[size_t(hostOf[size_t(r)])];
    slot = slot ? std::min(slot, int(c)) : int(c);
  }
  shape.cores = perHost;
  // NUMA node per rank when every rank knows its own (else treat as one node).
  bool numaKnown = true;
  for (int r = 0; r < nranks_; ++r) numaKnown &= topology_.numaOf(r) >= 0;
  if (numaKnown)
    for (int r = 0; r < nranks_; ++r) shape.numaOf.push_back(topology_.numaOf(r));
  bool ucxBetween = false;
  for (int r = 0; r < nranks_; ++r) ucxBetween |= r != rank_ && ucxPeer_[size_t(r)];
  shape.network = ucxBetween ? CostLink::Ucx : CostLink::Tcp;
  shape.shmWithinHost = (transports_ & kShmBit) != 0;
  shape.oneShotBytes = limits_.oneShotBytes;
  shape.stageBytes = limits_.stageBytes;
  tuner_->setShape(shape);
  // Rank 0's decisions, as (algorithm, inner) bytes per collective and bucket.
  std::vector<uint8_t> mine;
  for (int c = 1; c <= 5; ++c)
    for (int b = 0; b < Tuner::kBuckets; ++b) {
      Estimate e = tuner_->decided(Collective(c), b);
      mine.push_back(uint8_t(e.algo));
      mine.push_back(uint8_t(e.inner));
    }
  all = boot.allGather(mine.data(), mine.size());
  size_t k = 0;
  for (int c = 1; c <= 5; ++c)
    for (int b = 0; b < Tuner::kBuckets; ++b, k += 2) tuner_->adopt(Collective(c), b, Algorithm(all[k]), Algorithm(all[k + 1]));
  if (rank_ == 0)
    for (int c = 1; c <= 5; ++c)
      LOOM_INFO("TUNE", "%s: %s (cost model, %s)", collectiveName(Collective(c)),
                tuner_->describeDecisions(Collective(c)).c_str(), tuner_->params().source.c_str());
}

const char* loomComm::transportTo(int peer) const {
  if (peer == rank_) return "self";
  if (shmPeer_[size_t(peer)]) return "shm";
  return ucxPeer_[size_t(peer)] ? "ucx" : "tcp";
}

// Tickets are atomics so that the uncontended case (one thread issuing and
// running) takes no lock; the mutex and condition variable are only used by
// threads that must wait for their turn.
uint64_t loomComm::takeTicket() { return nextTicket_.fetch_add(1); }

void loomComm::waitTurn(uint64_t ticket) {
  if (serving_.load() == ticket) return;
  std::unique_lock<std::mutex> lock(turnMutex_);
  ++turnWaiters_;
  turnCv_.wait(lock, [&] { return serving_.load() == ticket; });
  --turnWaiters_;
}

void loomComm::endTurn() {
  serving_.fetch_add(1);
  if (turnWaiters_.load() > 0) {
    std::lock_guard<std::mutex> lock(turnMutex_);
    turnCv_.notify_all();
  }
}

void loomComm::waitIdle() {
  std::unique_lock<std::mutex> lock(turnMutex_);
  ++turnWaiters_;
  turnCv_.wait(lock, [&] { return serving_.load() == nextTicket_.load(); });
  --turnWaiters_;
}

SlotTag loomComm::tagFor(const OpDesc& op) {
  if (op.coll == Collective::P2P)
    return operationTag(op, op.isSend ? sendSeq_[size_t(op.peer)]++ : recvSeq_[size_t(op.peer)]++);
  return operationTag(op, collSeq_++);
}

uint64_t loomComm::issueOne(const OpDesc& op, SlotTag* tag) {
  std::lock_guard<std::mutex> lock(seqMutex_);
  *tag = tagFor(op);
  return takeTicket();
}

Algorithm loomComm::choose(const OpDesc& op) const { return tuner_->choose(op, nranks_, limits_).algo; }

void loomComm::runDirect(Algorithm algo, const OpDesc& op, const SlotTag& tag) {
  if (algo == Algorithm::OneShot) runOneShot(op, tag);
  else runStaged(op, tag);
}

loomResult_t loomComm::runOne(const OpDesc& op, const SlotTag& tag) {
  Algorithm algo = choose(op);
  if (!isDirect(algo)) return runOps({op}, {tag});
  loomResult_t prior = asyncError();
  if (prior != loomSuccess) {
    setLastError(strf("rank %d: the communicator failed earlier: %s", rank_, lastError().c_str()));
    return prior;
  }
  noteRunning(tag, 1);
  try {
    runDirect(algo, op, tag);
    noteIdle();
    return loomSuccess;
  } catch (const Error& e) {
    noteIdle();
    setFailed(e.code(), e.what());
    return e.code();
  }
}

uint64_t loomComm::issue(const std::vector<OpDesc>& ops, std::vector<SlotTag>* tags) {
  std::lock_guard<std::mutex> lock(seqMutex_);
  for (const OpDesc& op : ops) tags->push_back(tagFor(op));
  return takeTicket();
}

loomResult_t loomComm::runOps(const std::vector<OpDesc>& ops, const std::vector<SlotTag>& tags) {
  loomResult_t prior = asyncError();
  if (prior != loomSuccess) {
    setLastError(strf("rank %d: the communicator failed earlier: %s", rank_, lastError().c_str()));
    return prior;
  }
  if (!tags.empty()) noteRunning(tags[0], tags.size());
  struct Idle {
    loomComm* c;
    ~Idle() { c->noteIdle(); }
  } idle{this};
  try {
    std::vector<ExecOp> eops;
    Schedule sched;
    std::vector<size_t> selfSends, selfRecvs;
    if (ops.size() == 1 && isDirect(choose(ops[0]))) {
      runDirect(choose(ops[0]), ops[0], tags[0]);
      return loomSuccess;
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpDesc& op = ops[i];
      ExecOp e;
      e.tag = tags[i];
      e.send = static_cast<const uint8_t*>(op.sendbuf);
      e.recv = static_cast<uint8_t*>(op.recvbuf);
      e.dtype = op.dtype;
      e.op = op.op;
      e.sendMem = op.sendMem;
      e.recvMem = op.recvMem;
      e.divisor = op.op == loomAvg ? nranks_ : 1;
      e.device = &hostDevice();  // a host communicator; CUDA ones will carry their device
      eops.push_back(e);
      if (op.coll == Collective::P2P) {
        if (op.peer == rank_) (op.isSend ? selfSends : selfRecvs).push_back(i);
        else p2pSchedule(op, int(i), &sched);
      } else {
        Plan plan = tuner_->choose(op, nranks_, limits_);
        if (plan.algo == Algorithm::HalvingDoubling)
          halvingDoublingSchedule(op, int(i), rank_, nranks_, plan, &sched);
        else if (plan.algo == Algorithm::Tree)
          doubleBinaryTreeSchedule(op, int(i), rank_, nranks_, plan, &sched);
        else if (plan.algo == Algorithm::Hierarchical)
          hierarchicalSchedule(op, int(i), rank_, topology_.hostOfRanks(), plan, &sched);
        else  // the direct paths run alone; inside a group the ring serves
          ringSchedule(op, int(i), rank_, nranks_, plan, &sched);
      }
    }
    if (selfSends.size() != selfRecvs.size())
      fail(loomInvalidUsage, "rank %d: a group has %zu sends to itself but %zu receives from itself",
           rank_, selfSends.size(), selfRecvs.size());
    for (size_t k = 0; k < selfSends.size(); ++k) {
      const OpDesc& s = ops[selfSends[k]];
      const OpDesc& r = ops[selfRecvs[k]];
      size_t bytes = s.count * dtypeSize(s.dtype);
      if (bytes != r.count * dtypeSize(r.dtype))
        fail(loomInvalidUsage, "rank %d: send to self of %zu bytes matched with a receive of %zu", rank_,
             bytes, r.count * dtypeSize(r.dtype));
      if (!bytes) continue;
      ExecOp e = eops[selfSends[k]];
      e.recv = static_cast<uint8_t*>(r.recvbuf);
      e.recvMem = r.recvMem;
      eops.push_back(e);
      Lane lane;
      lane.op = int(eops.size() - 1);
      Step st;
      st.kind = StepKind::Copy;
      st.src = BufRef{Buf::Send, 0};
      st.dst = BufRef{Buf::Recv, 0};
      st.bytes = bytes;
      lane.steps.push_back(st);
      sched.lanes.push_back(lane);
    }
    execute(*this, eops, sched);
    return loomSuccess;
  } catch (const Error& e) {
    setFailed(e.code(), e.what());
    return e.code();
  } catch (const std::exception& e) {
    setFailed(loomInternalError, strf("rank %d: internal error: %s", rank_, e.what()));
    return loomInternalError;
  }
}

void loomComm::setFailed(loomResult_t code, const std::string& msg) {
  int expected = loomSuccess;
  if (asyncError_.compare_exchange_strong(expected, code)) {
    setLastError(msg);
    LOOM_WARN("COLL", "%s", msg.c_str());
    // Tell the peers at once rather than letting them wait for a timeout.
    if (inbox_) inbox_->header()->aborted.store(1);
    std::lock_guard<std::mutex> lock(fdMutex_);
    for (int fd : tcpFds_) shutdown(fd, SHUT_RDWR);
  } else {
    setLastError(msg);
  }
}

void loomComm::setLastError(const std::string& msg) {
  std::lock_guard<std::mutex> lock(errMutex_);
  lastError_ = msg;
}

std::string loomComm::lastError() {
  std::lock_guard<std::mutex> lock(errMutex_);
  return lastError_;
}

void loomComm::abort() {
  aborted_.store(true);
  setFailed(loomRemoteError, strf("rank %d: the communicator was aborted", rank_));
}

void loomComm::checkAborted() {
  if (aborted_.load()) fail(loomRemoteError, "rank %d: the communicator was aborted", rank_);
}

int loomComm::acceptData(int64_t deadline, std::map<std::pair<int, int>, int>& stash) {
  int fd = acceptUntil(listenFd_, deadline);
  if (fd < 0) return -1;
  TcpHello h{};
  try {
    recvAll(fd, &h, sizeof h, std::min(deadline, nowMs() + 2000));
  } catch (const Error& e) {
    LOOM_WARN("NET", "rank %d: dropped a data connection without a valid hello (%s)", rank_, e.what());
    close(fd);
    return 0;
  }
  std::string why;
  if (!checkTcpHello(&h, sizeof h, secret_, commTag_, nranks_, maxChannels_, &h, &why)) {
    LOOM_WARN("NET", "rank %d: dropped a data connection with a bad hello (%s)", rank_, why.c_str());
    close(fd);
    return 0;
  }
  auto key = std::make_pair(int(h.rank), int(h.channel));
  if (stash.count(key) || conns_.count(key)) {
    LOOM_WARN("NET", "rank %d: dropped a duplicate data connection from rank %d", rank_, h.rank);
    close(fd);
    return 0;
  }
  stash[key] = fd;
  return 1;
}

void loomComm::prepare(const std::vector<std::pair<int, int>>& needed) {
  int64_t deadline = nowMs() + timeoutMs_;
  // Connect first (never waits on the peer), then accept.
  for (const auto& key : needed) {
    if (conns_.count(key)) continue;
    int peer = key.first, ch = key.second;
    if (ch >= maxChannels_) fail(loomInternalError, "channel %d out of range", ch);
    if (shmPeer_[size_t(peer)]) {
      conns_[key] = makeShmConnection(inbox_.get(), peerInbox_[size_t(peer)].get(), rank_, peer, ch,
                                      peers_[size_t(peer)].pid, pidfds_[size_t(peer)]);
#ifdef LOOM_HAVE_UCX
    } else if (ucxPeer_[size_t(peer)]) {
      const RankInfo& info = peers_[size_t(peer)];
      // Same loopback domain: the peer's pid means something here.
      conns_[key] = makeUcxConnection(ucx_, rank_, peer, ch, slotBytes_, int(slots_),
                                      info.localKey == localKey() ? info.pid : 0);
#endif
    } else if (rank_ > peer) {
      const RankInfo& info = peers_[size_t(peer)];
      SockAddr addr;
      memcpy(&addr.ss, &info.listenAddr, sizeof addr.ss);
      addr.len = info.listenLen;
      if (info.localKey == localKey()) {
        uint16_t port = addr.port();
        addr = resolveAddr("127.0.0.1", port);
      }
      int fd;
      try {
        fd = connectTo(addr, deadline);
      } catch (const Error& e) {
        fail(loomRemoteError, "rank %d cannot connect to rank %d at %s: %s", rank_, peer, addr.str().c_str(),
             e.what());
      }
      TcpHello h{kTcpHelloMagic, kTcpVersion, {}, commTag_, rank_, ch};
      memcpy(h.secret, secret_, 16);
      sendAll(fd, &h, sizeof h, deadline);
      {
        std::lock_guard<std::mutex> lock(fdMutex_);
        tcpFds_.push_back(fd);
      }
      conns_[key] = makeTcpConnection(fd, peer, slotBytes_, int(slots_));
    }
  }
  for (const auto& key : needed) {
    if (conns_.count(key)) continue;
    for (;;) {
      auto it = acceptedFds_.find(key);
      if (it != acceptedFds_.end()) {
        {
          std::lock_guard<std::mutex> lock(fdMutex_);
          tcpFds_.push_back(it->second);
        }
        conns_[key] = makeTcpConnection(it->second, key.first, slotBytes_, int(slots_));
        acceptedFds_.erase(it);
        break;
      }
      checkAborted();
      // A peer that failed (say, on a mismatched call) never opens this
      // connection; it shut the ones it had with us, so look at those.
      for (auto& kv : conns_)
        if (kv.first.first == key.first) {
          kv.second->progress();
          kv.second->checkPeer();
        }
      for (auto& kv : acceptedFds_) {  // opened for a later operation, not used yet
        char c;
        if (kv.first.first == key.first && recv(kv.second, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
          fail(loomRemoteError, "rank %d: rank %d closed its tcp connection (channel %d) while %s waited for it",
               rank_, key.first, kv.first.second, runningOp().c_str());
      }
      noteWaiting(key.first);
      if (acceptData(std::min(deadline, nowMs() + 100), acceptedFds_) < 0 && nowMs() >= deadline)
        fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (to open its tcp connection, channel %d)",
             rank_, runningOp().c_str(), (long long)timeoutMs_, key.first, key.second);
    }
  }
}

Connection* loomComm::connection(int peer, int channel) {
  auto it = conns_.find(std::make_pair(peer, channel));
  if (it == conns_.end()) fail(loomInternalError, "no connection to rank %d channel %d", peer, channel);
  return it->second.get();
}

uint32_t loomComm::sleepBegin(bool withFds) {
  if (!inbox_) return 0;
  ShmInboxHeader* h = inbox_->header();
  h->sleeping.store(withFds ? kSleepPoll : kSleepFutex, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return h->bell.load(std::memory_order_relaxed);
}

void loomComm::sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell, int64_t timeoutUs) {
  if (doorbell && fds.empty()) {
    inbox_->sleep(token, timeoutUs);
    return;
  }
  timespec ts{time_t(timeoutUs / 1000000), long(timeoutUs % 1000000) * 1000};
  if (doorbell) fds.push_back(pollfd{inbox_->wakeFd(), POLLIN, 0});
  ppoll(fds.data(), fds.size(), &ts, nullptr);
  if (doorbell) inbox_->drainWakeFd();
}

void loomComm::sleepEnd() {
  if (inbox_) inbox_->header()->sleeping.store(0, std::memory_order_relaxed);
}
