#include "src/core/comm.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "algorithms/algorithms.h"
#include "src/core/clock.h"
#include "src/core/comm_dump.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"
#include "src/core/hier_device.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_choice.h"
#include "src/device/device_memory.h"
#include "src/device/host_reduce.h"
#include "src/topology/cpu_bind.h"
#include "src/tuner/tuner.h"

using namespace loom;

namespace loom {

void checkRankInfo(RankInfo* info, int r) {
  info->hostId[sizeof info->hostId - 1] = 0;
  info->transports[sizeof info->transports - 1] = 0;
  if (info->ctlLen == 0 || info->ctlLen > sizeof info->ctlAddr ||
      (info->ctlAddr.ss_family != AF_INET && info->ctlAddr.ss_family != AF_INET6))
    fail(loomRemoteError, "rank %d sent a control address of %u bytes, family %u, during init", r, info->ctlLen,
         unsigned(info->ctlAddr.ss_family));
  if (r != 0) return;
  if (info->devicePath > 3 || info->deviceStageBytes < 4096 || info->deviceStageBytes > (1u << 30) ||
      info->deviceStageBytes % 256)
    fail(loomRemoteError, "rank 0 sent device path %u, staged pieces of %u B during init", info->devicePath,
         info->deviceStageBytes);
  if (info->deviceSlotBytes < 65536 || info->deviceSlotBytes > (1u << 28) || info->deviceSlotBytes % 4096 ||
      info->deviceOneShotBytes > (1u << 31) || info->deviceGraphSlotBytes > (1u << 28) ||
      info->deviceGraphSlotBytes % 4096 || (info->deviceGraphSlotBytes > 0 && info->deviceGraphSlotBytes < 65536))
    fail(loomRemoteError,
         "rank 0 sent device slots of %u B, graph lane slots of %u B, one-shot all-reduces up to %u B during init",
         info->deviceSlotBytes, info->deviceGraphSlotBytes, info->deviceOneShotBytes);
  // The bounds config.cc enforces on rank 0's own environment.
  if (info->slots < 2 || info->slots > 1024 || info->slotBytes < 4096 || info->slotBytes > (64u << 20) ||
      info->slotBytes % 64 || info->mailBytes > (1u << 20) || info->mailBytes % 64 ||
      info->stageBytes > (1u << 30) || info->stageBytes % 4096)
    fail(loomRemoteError,
         "rank 0 sent settings this build cannot use (slots %u x %u B, mail %u B, stage %u B); "
         "do all ranks run the same loom?",
         info->slots, info->slotBytes, info->mailBytes, info->stageBytes);
  try {
    parseTransports(info->transports);
  } catch (const Error& e) {
    fail(loomRemoteError, "rank 0 asks for transports this build cannot use (%s); do all ranks run the same loom?",
         e.what());
  }
}

namespace {
thread_local std::string tlsTestHostId;
}

void setThreadHostIdForTesting(const std::string& hostId) { tlsTestHostId = hostId; }

namespace {
std::atomic<uint32_t> gForkGeneration{0};
void onForkChild() { gForkGeneration.fetch_add(1, std::memory_order_relaxed); }
// Registered when libloom loads (a dlclose unregisters it).
const int gForkWatch = pthread_atfork(nullptr, nullptr, onForkChild);
}  // namespace

uint32_t forkGeneration() {
  (void)gForkWatch;
  return gForkGeneration.load(std::memory_order_relaxed);
}

}  // namespace loom

std::shared_ptr<loomComm> loomComm::create(const UniqueIdData& id, int nranks, int rank, BootCheck bootCheck,
                                           const DeviceRequest& device) {
  std::shared_ptr<loomComm> c(new loomComm());
  c->self_ = c;
  try {
    c->init(id, nranks, rank, bootCheck, device);
  } catch (...) {
    c->self_.reset();
    throw;
  }
  dumpRegister(c.get());
  return c;
}

loomComm::~loomComm() {
  // The device watchdog calls into this communicator: stop it first (the
  // device side still releases its streams' waits without it).
  if (device_) device_->stopWatchdog();
  // A failed communicator's notices tell the peers why it failed: deliver
  // the ones still under way before the control thread stops (a peer whose
  // connection to us breaks asks us, and we may be gone by then).
  if (asyncError() != loomSuccess) settleNotices(nowMs() + 1000);
  // Device zero-copy: the peers unmap what this rank published while both
  // control planes still run (a failed communicator's peers may still run
  // programs that read it: they unmap it when they go).
  if (device_ && !aborted_.load() && asyncError() == loomSuccess) device_->unpublishAll();
  // Its thread may call into this communicator (and read ctl_): stop it
  // before the pointer changes.
  if (ctl_) ctl_->stop();
  ctl_.reset();
  deviceForFail_.store(nullptr);
  dumpUnregister(this);
  // A failed or aborted communicator's peers may never finish their last
  // round: do not wait for them before freeing the device window.
  if (device_ && (aborted_.load() || asyncError_.load() != loomSuccess)) device_->abandon();
  device_.reset();
  registrations_.clear();  // their transport handles, before the transports
  tagged_.reset();
  conns_.clear();  // before the transports whose memory they use
  transports_.clear();
}

void loomComm::init(const UniqueIdData& id, int nranks, int rank, const BootCheck& bootCheck,
                    const DeviceRequest& device) {
  const Config& cfg = config();
  rank_ = rank;
  nranks_ = nranks;
  part_ = device.part;
  if (device.registrations) publishFrom_ = device.registrations;
  if (!part_) logSetRank(rank);  // a sub-communicator's rank is not the process's
  timeoutMs_ = device.timeoutMs > 0 ? device.timeoutMs : cfg.timeoutMs;
  spinUs_ = cfg.spinUs;
  checkMode_ = cfg.checkMode;
  int64_t deadline = nowMs() + timeoutMs_;
  sendSeq_.assign(size_t(nranks), 0);
  recvSeq_.assign(size_t(nranks), 0);
  if (cfg.transports.size() >= sizeof RankInfo::transports)
    fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: longer than %zu characters", cfg.transports.c_str(),
         sizeof RankInfo::transports - 1);
  parseTransports(cfg.transports);  // a bad list fails here, before any peer waits for us

  Bootstrap boot(id, rank, nranks, deadline, bootCheck);

  // This rank's network address: the interface LOOM_SOCKET_IFNAME names,
  // else the one the bootstrap root sees us on.
  SockAddr advertise = cfg.socketIfname.empty() ? boot.localAddress() : interfaceAddr(cfg.socketIfname);
  // Nor a loopback address: a rank that shares the root's loopback domain
  // reaches it on 127.0.0.1 (a unique id from loomGetUniqueId, or the one
  // loomCommShrink makes), but ranks of other hosts cannot reach it there.
  // Ranks of its own domain use 127.0.0.1 whatever it advertises.
  if (cfg.socketIfname.empty() && isLocalOnly(advertise))
    advertise = defaultInterfaceAddr();
  advertise.setPort(0);

  const DeviceChoice deviceChoice = checkDeviceChoice(device);
  if (deviceChoice.cuda) loadDeviceKernels(deviceChoice);  // before the all-gather below (device_choice.h)
  RankInfo mine{};
  mine.deviceKind = deviceChoice.cuda ? 1 : 0;
  std::string host = !tlsTestHostId.empty() ? tlsTestHostId : cfg.hostId.empty() ? machineHostId() : cfg.hostId;
  mine.devicePath = device.path > 0                ? uint32_t(device.path)
                    : cfg.devicePath == "ipc"      ? 1
                    : cfg.devicePath == "staged"   ? 2
                    : cfg.devicePath == "hier"     ? 3
                                                   : 0;
  mine.deviceStageBytes = uint32_t(cfg.deviceStageBytes);
  mine.deviceHierMinBytes = uint32_t(cfg.deviceHierMinBytes);
  mine.deviceSlotBytes = uint32_t(cfg.deviceSlotBytes);
  mine.deviceGraphSlotBytes = uint32_t(cfg.deviceGraphSlotBytes);
  mine.deviceOneShotBytes = uint32_t(cfg.deviceOneShotBytes);
  mine.deviceZeroCopy = cfg.deviceZeroCopy ? 1 : 0;
  snprintf(mine.hostId, sizeof mine.hostId, "%s", host.c_str());
  mine.localKey = localKey();
  mine.pid = int32_t(getpid());
  mine.slotBytes = uint32_t(cfg.slotBytes);
  mine.slots = uint32_t(cfg.slots);
  mine.mailBytes = uint32_t(cfg.shmSmallBytes);
  mine.stageBytes = uint32_t(cfg.shmStageBytes);
  snprintf(mine.transports, sizeof mine.transports, "%s", cfg.transports.c_str());
  if (const RankInfo* p = device.parentRoot) {
    // A sub-communicator: its parent's rank 0 settings, whatever the
    // environment of its own root says.
    mine.slotBytes = p->slotBytes;
    mine.slots = p->slots;
    mine.mailBytes = p->mailBytes;
    mine.stageBytes = p->stageBytes;
    memcpy(mine.transports, p->transports, sizeof mine.transports);
    mine.deviceStageBytes = p->deviceStageBytes;
    mine.deviceHierMinBytes = p->deviceHierMinBytes;
    mine.deviceSlotBytes = p->deviceSlotBytes;
    mine.deviceGraphSlotBytes = p->deviceGraphSlotBytes;
    mine.deviceOneShotBytes = p->deviceOneShotBytes;
    mine.deviceZeroCopy = p->deviceZeroCopy;
  }
  fillRandom(&mine.commTag, sizeof mine.commTag);
  mine.topo = localRankTopo(advertise.ss);
  const std::vector<int> cpus = allowedCpus();
  mine.cpuSet = cpuSetHash(cpus);
  mine.checkMode = cfg.checkMode ? 1 : 0;
  if (const RankInfo* p = device.parentRoot) mine.checkMode = p->checkMode;
  // The control socket listens where the tcp transport would.
  ctl_ = std::make_unique<Control>(rank, nranks, id.secret,
                                   cfg.socketIfname.empty() ? resolveAddr(advertise.ss.ss_family == AF_INET6 ? "::" : "0.0.0.0", 0)
                                                            : advertise,
                                   advertise);
  memcpy(&mine.ctlAddr, &ctl_->address().ss, sizeof mine.ctlAddr);
  mine.ctlLen = ctl_->address().len;

  std::vector<uint8_t> all = boot.allGather(&mine, sizeof mine);
  peers_.resize(size_t(nranks));
  memcpy(peers_.data(), all.data(), all.size());
  for (int r = 0; r < nranks; ++r) checkRankInfo(&peers_[size_t(r)], r);
  for (int r = 0; r < nranks; ++r)
    if (peers_[size_t(r)].deviceKind != mine.deviceKind)
      fail(loomInvalidUsage, "rank %d runs on %s, this rank on %s: LOOM_DEVICE must be the same on every rank", r,
           peers_[size_t(r)].deviceKind ? "cuda" : "the host", mine.deviceKind ? "cuda" : "the host");
  // Communicator-wide settings come from rank 0 so every pair agrees.
  const RankInfo& root = peers_[0];
  transportSpec_ = root.transports;
  {
    std::vector<SockAddr> ctlAddrs;
    for (const RankInfo& p : peers_) {
      SockAddr a;
      memcpy(&a.ss, &p.ctlAddr, sizeof a.ss);
      a.len = socklen_t(p.ctlLen);
      if (p.localKey == mine.localKey) a = resolveAddr(a.ss.ss_family == AF_INET6 ? "::1" : "127.0.0.1", a.port());
      ctlAddrs.push_back(a);
    }
    ctl_->setRegionAnswer([this](int from, const std::vector<uint8_t>& question) {
      relaxCudaCaptureModeOnThisThread();  // the control thread maps and unmaps peers' memory
      return deviceRegionAnswer(from, question);
    });
    ctl_->start(root.commTag, ctlAddrs, [this](const CtlMsg& m) { onNotice(m); }, [this] { return cause(); });
  }
  // Which ranks share a host, and where each sits (the tuner reads it).
  std::vector<std::string> hostIds;
  std::vector<RankTopo> rankTopos;
  for (const RankInfo& p : peers_) {
    hostIds.emplace_back(p.hostId, strnlen(p.hostId, sizeof p.hostId));
    rankTopos.push_back(p.topo);
  }
  topology_ = CommTopology(hostIds, rankTopos);
  if (!device.part) bindToCpus(cpus);  // the parent bound the process already
  tuner_ = std::make_unique<Tuner>(cfg);

  TransportEnv env;
  env.rank = rank;
  env.nranks = nranks;
  memcpy(env.secret, id.secret, 16);
  env.commTag = root.commTag;
  env.slotBytes = root.slotBytes;
  env.slots = root.slots;
  // Check mode changes what one-shot collectives send (headers), so every
  // rank takes rank 0's.
  checkMode_ = root.checkMode != 0;
  env.maxChannels = maxChannels_ + 1;  // and the tagged channel (p2p_tagged.h)
  directLayout_ = DirectLayout{nranks, root.mailBytes, root.stageBytes};
  env.windowBytes = directLayout_.bytes();
  env.timeoutMs = timeoutMs_;
  env.netAddr = advertise;
  env.bindAny = cfg.socketIfname.empty();
  env.hostId = hostIds;
  for (const RankInfo& p : peers_) {
    env.localKey.push_back(p.localKey);
    env.pid.push_back(p.pid);
  }
  initTransports(boot, env);

  int local = 0;
  for (int r = 0; r < nranks; ++r) local += r != rank && env.sameHost(r);
  // More ranks on this host than the CPUs they may use (taskset, a cgroup's
  // cpuset: not just the machine's online CPUs; before any LOOM_CPU_BIND).
  oversubscribed_ = size_t(local + 1) > (cpus.empty() ? size_t(sysconf(_SC_NPROCESSORS_ONLN)) : cpus.size());
  limits_.maxChannels = maxChannels_;
  limits_.oneShotBytes = peerMem_ ? directLayout_.mailBytes : 0;
  limits_.stageBytes = peerMem_ ? directLayout_.stageBytes : 0;
  limits_.maxChunkBytes = size_t(root.slots - 1) * root.slotBytes;
  initTuner(boot);
  TaggedLimits tl;
  tl.eagerBytes = size_t(cfg.p2pEagerBytes);
  tl.stashBytes = size_t(cfg.p2pStashBytes);
  tagged_ = std::make_unique<TaggedP2P>(rank, nranks, tl);
  taggedRetryMs_.assign(size_t(nranks), 0);
  if (!cfg.trace.empty() && !device.part) tracer_ = std::make_unique<Tracer>(cfg.trace, rank, nranks);
  if (deviceChoice.cuda) {
    // CUDA IPC maps device memory within a host only: ranks on several
    // hosts stage through pinned host memory and the host transports, and
    // with several ranks on each host all-reduce goes the hierarchical way
    // (src/core/hier_device.h).
    int away = -1;
    for (int r = 0; r < nranks && away < 0; ++r)
      if (!env.sameHost(r)) away = r;
    if (root.devicePath == 1 && away >= 0)
      fail(loomInvalidUsage,
           "LOOM_DEVICE_PATH=ipc: rank %d is on host %s, this rank on %s, and CUDA IPC works within a host only "
           "(auto or staged stage device buffers through pinned host memory between hosts)",
           away, env.hostId[size_t(away)].c_str(), env.hostId[size_t(rank)].c_str());
    const HierShape shape = hierShapeOf(hostIds, rank);
    if (root.devicePath == 3 && !shape.usable() && !device.derived)
      fail(loomInvalidUsage, "LOOM_DEVICE_PATH=hier: %s (auto picks the path that applies)", shape.why.c_str());
    const bool hier = shape.usable() && (root.devicePath == 3 || root.devicePath == 0);
    const bool staged = !hier && (root.devicePath == 2 || away >= 0);
    const int driverRank = device.driverRank >= 0 ? device.driverRank : rank;
    if (hier) {
      device_ = makeHierDevice(boot, deviceChoice, device, hostIds, advertise);
    } else if (staged) {
      StagedCommOptions o = stagedOptions();
      o.pieceBytes = root.deviceStageBytes;
      device_ = std::make_unique<StagedDeviceComm>(rank, nranks, deviceDriverFor(deviceChoice, driverRank, nranks), o);
    } else {
      DeviceCommOptions o = deviceOptions(root);
      // The hierarchical path's sub-communicators are never given a
      // captured stream (the hierarchical path refuses captures).
      if (device.part) o.graphSlotBytes = 0;
      device_ = std::make_unique<DeviceComm>(
          rank, nranks, deviceDriverFor(deviceChoice, driverRank, nranks),
          [&boot](const void* m, size_t bytes, void* all) {
            std::vector<uint8_t> v = boot.allGather(m, bytes);
            memcpy(all, v.data(), v.size());
          },
          o);
    }
    {
      std::lock_guard<std::mutex> g(earlySigsMutex_);
      deviceForFail_.store(device_.get());
      for (const auto& [from, bytes] : earlySigs_) device_->onPeerSignatures(from, bytes);
      earlySigs_.clear();
    }
    // A notice that failed the communicator while device_ was being made.
    if (asyncError() != loomSuccess) device_->markFailed(asyncError(), lastError());
    const char* part = device.part ? device.part : "";
    if (hier)
      LOOM_INFO("INIT", "rank %d: device communicator on %s:%d, hierarchical: %d hosts x %d ranks (CUDA IPC within a "
                "host, staged between hosts for all-reduces of %u B or more)",
                rank, device_->deviceName(), device_->device(), shape.hosts, shape.perHost, root.deviceHierMinBytes);
    else if (staged)
      LOOM_INFO("INIT", "rank %d%s%s: device communicator on %s:%d, staged through pinned host memory (%s)", rank,
                *part ? " of the hierarchical path's " : "", part, device_->deviceName(), device_->device(),
                *part ? "its rail" : away >= 0 ? "ranks on several hosts" : "LOOM_DEVICE_PATH=staged");
    else
      LOOM_INFO("INIT", "rank %d%s%s: device communicator on %s:%d, CUDA IPC windows of 2 x %u B", rank,
                *part ? " of the hierarchical path's " : "", part, device_->deviceName(), device_->device(),
                root.deviceSlotBytes);
  }
  LOOM_INFO("INIT", "rank %d of %d%s%s ready: host %s, %d local peers, slots %u x %u B, transports %s", rank, nranks,
            part_ ? " of a hierarchical path's " : "", part_ ? part_ : "", mine.hostId, local, root.slots,
            root.slotBytes, transportSpec_.c_str());
}

loom::DeviceCommOptions loomComm::deviceOptions(const RankInfo& root) {
  DeviceCommOptions o{root.deviceSlotBytes, root.deviceGraphSlotBytes, root.deviceOneShotBytes, thisProcessToken()};
  // The watchdog: loomTimeout after LOOM_TIMEOUT_MS without progress, a
  // peer the control plane finds gone after a second without progress; its
  // failures go the way of a host operation's (the peers are told, and
  // asked for the root cause).
  o.timeoutMs = timeoutMs_.load();
  o.probeAfterMs = std::min<int64_t>(1000, o.timeoutMs);
  o.peerGone = [this](int peer, std::string* why) { return devicePeerGone(peer, why); };
  o.onFailure = [this](const Error& e) { failOperation(e); };
  o.fetchRegion = [this](int peer) { return fetchDeviceRegion(peer); };
  // Device zero-copy: loomMemAlloc's memory is published (its free has the
  // peers unmap it first).
  o.zeroCopy = root.deviceZeroCopy != 0;
  o.publishable = [this](const void* p, size_t bytes, void** base) {
    return deviceMemFind(p, bytes, base) || publishFrom_->findAllocation(p, bytes, base);
  };
  o.publishTo = [this](int peer, const IpcRecord& rec) { return askDevicePublish(peer, 1, rec); };
  o.unpublishTo = [this](int peer, const IpcRecord& rec) { askDevicePublish(peer, 2, rec); };
  o.freeHook = true;
  // The IPC path's mismatch check: batches of signatures to the next rank
  // (the watchdog stops before ctl_ goes, see ~loomComm).
  o.sendSignatures = [this](int peer, std::vector<uint8_t> bytes) { sendSignatures(peer, std::move(bytes)); };
  return o;
}

void* loomComm::registerBuffer(void* buff, size_t bytes) {
  void* allocation = nullptr;
  if (buff && device_ && device_->deviceMemory(buff, bytes, &allocation)) {
    void* base = nullptr;
    // Published while no registration holds it: the caller freed it without
    // deregistering, and this is new memory at the same address (the
    // peers' mappings are of the old): have them unmap those first.
    if (allocation && !registrations_.holdsAllocation(allocation) && !deviceMemFind(allocation, 1, &base))
      device_->withdraw(allocation, nullptr);
    return registrations_.add(buff, bytes, transportList(), MemoryKind::CudaDevice, allocation);
  }
  if (buff && !device_)
    if (const int dev = cudaPointerDevice(buff); dev >= 0)
      fail(loomInvalidArgument,
           "buff %p is CUDA device memory (cuda:%d), but this communicator runs on the host: register host "
           "memory, or create the communicator with LOOM_DEVICE=cuda",
           buff, dev);
  return registrations_.add(buff, bytes, transportList());
}

void loomComm::deregisterBuffer(void* handle) {
  std::unique_ptr<Registration> gone = registrations_.remove(handle);
  void* base = nullptr;
  // Still published while another registration, or loomMemAlloc (whose free
  // withdraws it), holds the allocation.
  auto held = [&] {
    return registrations_.holdsAllocation(gone->allocation) || deviceMemFind(gone->allocation, 1, &base);
  };
  if (gone->allocation && device_ && !held()) device_->withdraw(gone->allocation, held);
}

void loomComm::sendSignatures(int peer, std::vector<uint8_t> bytes) {
  if (!ctl_) return;
  CtlMsg m;
  m.type = CtlType::Sigs;
  m.from = rank_;
  m.extra = std::move(bytes);
  std::vector<bool> to(size_t(nranks_), false);
  to[size_t(peer)] = true;
  ctl_->broadcastAsync(m, to, nowMs() + 2000, nullptr);
}

loom::StagedCommOptions loomComm::stagedOptions() {
  StagedCommOptions o;
  o.timeoutMs = timeoutMs_.load();
  // A host operation's turn is taken now, on the API thread, in call
  // order; the staging thread runs it once the stream has staged its input.
  o.issueHost = [this](const std::vector<OpDesc>& ops) -> std::function<void()> {
    auto tags = std::make_shared<std::vector<SlotTag>>();
    const uint64_t ticket = issue(ops, tags.get());
    return [this, ops, tags, ticket] {
      waitTurn(ticket);
      const loomResult_t r = runOps(ops, *tags);
      endTurn();
      if (r != loomSuccess) fail(r, "%s", lastError().c_str());
    };
  };
  o.onFailure = [this](const Error& e) { failOperation(e); };
  return o;
}

std::vector<uint8_t> loomComm::deviceRegionAnswer(int from, const std::vector<uint8_t>& question) {
  // The control thread stops before device_ goes (~loomComm); until the
  // DeviceComm is made, the asker is told to ask again.
  DeviceCollectives* d = deviceForFail_.load();
  if (!d) return encodeRegionAnswer(loomInProgress, nullptr, "not ready");
  try {
    if (question.empty()) {
      IpcRecord rec = d->p2pRegionFor(from);
      return encodeRegionAnswer(loomSuccess, &rec, "");
    }
    IpcRecord rec;
    if (question.size() != 1 + sizeof rec || (question[0] != 1 && question[0] != 2))
      fail(loomRemoteError, "rank %d asked a device question of %zu bytes that this rank does not know", from,
           question.size());
    memcpy(&rec, question.data() + 1, sizeof rec);
    // The answer: a record whose base says where (publish), or nothing (unpublish).
    IpcRecord at{};
    if (question[0] == 1)
      at.base = d->importPublished(from, rec);
    else
      d->forgetPublished(from, rec);
    return encodeRegionAnswer(loomSuccess, &at, "");
  } catch (const Error& e) {
    return encodeRegionAnswer(e.code(), nullptr, e.what());
  }
}

void loomComm::askDevice(int peer, const std::vector<uint8_t>& question, const char* what,
                         const std::function<bool(const std::vector<uint8_t>&)>& answered, int64_t maxMs) {
  const int64_t start = nowMs(), timeout = maxMs > 0 ? std::min<int64_t>(maxMs, timeoutMs_.load()) : timeoutMs_.load();
  for (;;) {
    loomResult_t prior = asyncError();
    if (prior != loomSuccess) fail(prior, "the communicator has failed: %s", failure().c_str());
    const int64_t now = nowMs();
    std::vector<uint8_t> answer;
    Reach reach = ctl_ ? ctl_->askRegion(peer, &answer,
                                         now + std::min<int64_t>(1000, std::max<int64_t>(1, timeout)), question)
                       : Reach::Refused;
    if (reach == Reach::Refused)
      fail(loomRemoteError, "rank %d: rank %d is gone (its control socket refuses): no %s", rank_, peer, what);
    if (reach == Reach::Acked && answered(answer)) return;  // else: not ready yet
    if (timeout > 0 && nowMs() - start >= timeout)
      fail(loomTimeout, "rank %d: rank %d did not answer for its %s within %lld ms (LOOM_TIMEOUT_MS)", rank_, peer,
           what, (long long)timeout);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

IpcRecord loomComm::fetchDeviceRegion(int peer) {
  IpcRecord rec;
  askDevice(peer, {}, "send/recv region",
            [&](const std::vector<uint8_t>& a) { return decodeRegionAnswer(peer, a, &rec); });
  return rec;
}

uint64_t loomComm::askDevicePublish(int peer, uint8_t kind, const IpcRecord& rec) {
  std::vector<uint8_t> q(1 + sizeof rec);
  q[0] = kind;
  memcpy(q.data() + 1, &rec, sizeof rec);
  const char* what = kind == 1 ? "mapping of this rank's published device memory" : "unmapping of it";
  IpcRecord at;
  // An unmapping is asked of a live control thread that answers at once:
  // a peer that does not answer within seconds is stopped or gone.
  askDevice(peer, q, what, [&](const std::vector<uint8_t>& a) { return decodeRegionAnswer(peer, a, &at, what); },
            kind == 2 ? 3000 : 0);
  return at.base;
}

bool loomComm::devicePeerGone(int peer, std::string* why) {
  if (peer < 0 || peer >= nranks_ || peer == rank_) return false;
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    if (dead_.count(peer)) {
      *why = "the control plane found it dead";
      return true;
    }
  }
  if (!ctl_) return false;
  int fd;
  try {
    fd = ctl_->dial(peer, nowMs() + 200);
  } catch (const Error&) {
    return false;  // no answer: maybe slow, maybe cut off; the timeout decides
  }
  if (fd >= 0) {
    close(fd);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    dead_.insert(peer);
    unreachable_.erase(peer);
  }
  *why = "its control socket refuses";
  return true;
}

void loomComm::bindToCpus(const std::vector<int>& allowed) {
  const Config& cfg = config();
  bool bad = false;
  const CpuBindMode mode = parseCpuBindMode(cfg.cpuBind, &bad);
  if (bad) LOOM_WARN("INIT", "ignoring LOOM_CPU_BIND=%s: expected auto, on or off", cfg.cpuBind.c_str());
  const RankInfo& me = peers_[size_t(rank_)];
  int index = 0, count = 0;
  bool sameSet = true;
  for (int r = 0; r < nranks_; ++r) {
    const RankInfo& p = peers_[size_t(r)];
    if (strncmp(p.hostId, me.hostId, sizeof p.hostId) != 0) continue;
    index += r < rank_;
    ++count;
    sameSet = sameSet && p.cpuSet == me.cpuSet;
  }
  CpuBindPlan plan = planCpuBind(mode, index, count, allowed, sameSet);
  if (!plan.cpus.empty()) {
    std::string err = bindProcessToCpus(plan.cpus);
    if (!err.empty()) {
      LOOM_WARN("INIT", "rank %d: LOOM_CPU_BIND: %s (%s); running unbound", rank_, err.c_str(), plan.why.c_str());
      return;
    }
  }
  LOOM_INFO("INIT", "rank %d: %s", rank_, plan.why.c_str());
}

void loomComm::initTransports(Bootstrap& boot, const TransportEnv& env) {
  const int N = nranks_;
  via_.assign(size_t(N), nullptr);
  std::vector<std::string> why(static_cast<size_t>(N));  // per peer: why each transport could not reach it
  std::vector<TransportEntry> registry = transportRegistry();
  for (const std::string& name : parseTransports(transportSpec_)) {
    auto entry = std::find_if(registry.begin(), registry.end(), [&](const TransportEntry& e) { return e.name == name; });
    std::unique_ptr<Transport> t = entry->make();
    std::vector<bool> want(size_t(N), false);
    for (int r = 0; r < N; ++r) want[size_t(r)] = r != rank_ && !via_[size_t(r)] && t->mayReach(env, r);
    // Every rank takes part in both exchanges, whatever it wants.
    std::vector<uint8_t> rec(t->recordBytes());
    t->publish(env, want, rec.data());
    std::vector<uint8_t> recs = boot.allGather(rec.data(), rec.size());
    std::vector<uint8_t> ok(size_t(N), 0);
    for (int r = 0; r < N; ++r) {
      std::string reason;
      if (want[size_t(r)]) ok[size_t(r)] = t->accept(r, recs.data() + size_t(r) * rec.size(), &reason);
      else if (r != rank_ && !via_[size_t(r)]) reason = t->unavailable().empty() ? "not on this host" : t->unavailable();
      if (!ok[size_t(r)] && r != rank_ && !via_[size_t(r)])
        why[size_t(r)] += strf("%s%s: %s", why[size_t(r)].empty() ? "" : "; ", name.c_str(), reason.c_str());
    }
    std::vector<uint8_t> agreed = boot.allGather(ok.data(), ok.size());
    std::vector<bool> chosen(size_t(N), false);
    bool used = false;
    for (int r = 0; r < N; ++r) {
      chosen[size_t(r)] = ok[size_t(r)] && agreed[size_t(r) * size_t(N) + size_t(rank_)];
      if (chosen[size_t(r)]) via_[size_t(r)] = t.get();
      else if (ok[size_t(r)])
        why[size_t(r)] += strf("%s%s: rank %d could not reach this rank", why[size_t(r)].empty() ? "" : "; ",
                               name.c_str(), r);
      used |= chosen[size_t(r)];
    }
    t->serve(chosen);
    if (used) transports_.push_back(std::move(t));
  }
  for (int r = 0; r < N; ++r)
    if (r != rank_ && !via_[size_t(r)])
      fail(loomInvalidUsage, "rank %d cannot reach rank %d with LOOM_TRANSPORTS=%s (%s)", rank_, r,
           transportSpec_.c_str(), why[size_t(r)].c_str());
  for (const auto& t : transports_)
    if (!doorbell_) doorbell_ = t->doorbell();
  // The direct algorithms need every rank in one PeerMemory with room for their layout.
  PeerMemory* mem = nullptr;
  bool shared = N > 1 && directLayout_.bytes() > 0;
  for (int r = 0; r < N && shared; ++r) {
    if (r == rank_) continue;
    PeerMemory* m = via_[size_t(r)]->peerMemory();
    shared = m && (!mem || m == mem) && m->windowBytes() >= directLayout_.bytes();
    mem = m;
  }
  if (shared) peerMem_ = mem;
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
  // Between hosts: how the transport that carries such pairs is costed.
  shape.network = CostLink::Tcp;
  for (int r = 0; r < nranks_; ++r)
    if (r != rank_ && via_[size_t(r)]->costAs() != CostLink::Shm) shape.network = via_[size_t(r)]->costAs();
  shape.shmWithinHost = false;
  std::vector<TransportEntry> registry = transportRegistry();
  for (const std::string& name : parseTransports(transportSpec_))
    for (const TransportEntry& e : registry)
      if (e.name == name) shape.shmWithinHost |= e.make()->costAs() == CostLink::Shm;
  shape.oneShotBytes = limits_.oneShotBytes;
  shape.stageBytes = limits_.stageBytes;
  tuner_->setShape(shape);
  // Rank 0's decisions, as (algorithm, inner) bytes per collective and bucket.
  std::vector<uint8_t> mine;
  for (Collective c : kTunedCollectives)
    for (int b = 0; b < Tuner::kBuckets; ++b) {
      Estimate e = tuner_->decided(c, b);
      mine.push_back(uint8_t(e.algo));
      mine.push_back(uint8_t(e.inner));
    }
  all = boot.allGather(mine.data(), mine.size());
  size_t k = 0;
  for (Collective c : kTunedCollectives)
    for (int b = 0; b < Tuner::kBuckets; ++b, k += 2) tuner_->adopt(c, b, Algorithm(all[k]), Algorithm(all[k + 1]));
  if (rank_ == 0)
    for (Collective c : kTunedCollectives)
      LOOM_INFO("TUNE", "%s: %s (cost model, %s)", collectiveName(c), tuner_->describeDecisions(c).c_str(),
                tuner_->params().source.c_str());
}

const char* loomComm::transportTo(int peer) const {
  if (peer == rank_) return "self";
  return via_[size_t(peer)]->name();
}

Transport* loomComm::transportNamed(const std::string& name) const {
  for (const auto& t : transports_)
    if (name == t->name()) return t.get();
  return nullptr;
}

// Tickets are atomics so that the uncontended case (one thread issuing and
// running) takes no lock; the mutex and condition variable are only used by
// threads that must wait for their turn.
LOOM_HOT uint64_t loomComm::takeTicket() { return nextTicket_.fetch_add(1); }

LOOM_HOT void loomComm::waitTurn(uint64_t ticket) {
  if (serving_.load() == ticket) return;
  std::unique_lock<std::mutex> lock(turnMutex_);
  ++turnWaiters_;
  turnCv_.wait(lock, [&] { return serving_.load() == ticket; });
  --turnWaiters_;
}

LOOM_HOT void loomComm::endTurn() {
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

void loomComm::warnUnreceived() {
  if (asyncError() != loomSuccess || aborted_.load()) return;
  std::string what;
  int seen = 0;
  for (int peer = 0; peer < nranks_; ++peer) {
    if (peer == rank_ || !via_[size_t(peer)]) continue;
    for (int ch = 0; ch < maxChannels_; ++ch) {
      SlotTag t;
      // shm shows slots even where this rank never opened the connection.
      bool unread = via_[size_t(peer)]->peekIncoming(peer, ch, &t);
      auto it = conns_.find(std::make_pair(peer, ch));
      if (!unread && it != conns_.end()) {
        try {
          it->second->progress();  // sockets: what already arrived
          unread = it->second->recvPeek(&t) != nullptr;
        } catch (const Error&) {
          // a peer that closed first: what it sent was read or is gone
        }
      }
      if (unread && seen++ < 3)
        what += strf("%s%s from rank %d", what.empty() ? "" : "; ", describeTag(t).c_str(), peer);
    }
  }
  if (seen > 3) what += strf("; and %d more", seen - 3);
  const size_t stashed = tagged_ ? tagged_->stashedMessages() : 0;
  if (stashed) what += strf("%s%zu tagged message(s) no loomRecvTagged matched", what.empty() ? "" : "; ", stashed);
  if (what.empty()) return;
  LOOM_WARN("COLL",
            "rank %d: destroyed with data peers sent that no call of this rank received (a send without its "
            "receive, or operations a peer called beyond this rank's): %s",
            rank_, what.c_str());
}

LOOM_HOT SlotTag loomComm::tagFor(const OpDesc& op) {
  // Tagged messages carry their own numbers (p2p_tagged.h): they take none
  // of the per-pair order of plain sends and receives.
  if (op.tagged) {
    SlotTag t = operationTag(op, 0);
    t.flags |= kTagTagged;
    t.root = op.tag;
    return t;
  }
  if (op.coll == Collective::P2P)
    return operationTag(op, op.isSend ? sendSeq_[size_t(op.peer)]++ : recvSeq_[size_t(op.peer)]++);
  return operationTag(op, collSeq_++);
}

LOOM_HOT uint64_t loomComm::issueOne(const OpDesc& op, SlotTag* tag) {
  std::lock_guard<SeqLock> lock(seqMutex_);
  *tag = tagFor(op);
  return takeTicket();
}

LOOM_HOT Algorithm loomComm::choose(const OpDesc& op) const { return tuner_->choose(op, nranks_, limits_).algo; }

LOOM_HOT DirectContext loomComm::directContext() {
  // A host communicator: its peer memory is host memory, copied and reduced by the host device.
  return DirectContext{*this, *peerMem_, hostDevice(), directLayout_, directState_, rank_, nranks_, checkMode_};
}

LOOM_HOT void loomComm::runDirect(Algorithm algo, const OpDesc& op, const SlotTag& tag) {
  DirectContext ctx = directContext();
  algorithmEntry(algo).runDirect(ctx, op, tag);
}

// An all-to-all with sendbuff == recvbuff (validate() refuses any other
// overlap).  Pairwise (also what a group runs for one-shot's choices)
// receives block q from rank q before its own block q has gone there, and
// zero-copy's peers read the input while this rank writes its output;
// one-shot and Bruck happen to read all of their input first.  So that no
// path's order matters, such a call always runs out of place from a copy
// of its input (runOps).
static bool inPlaceAllToAll(const OpDesc& op) {
  return op.coll == Collective::AllToAll && op.count > 0 && op.sendbuf == op.recvbuf;
}

const std::vector<OpDesc>& loomComm::withInPlaceInputsCopied(const std::vector<OpDesc>& ops,
                                                             std::vector<OpDesc>* copied) {
  size_t total = 0;
  for (const OpDesc& op : ops)
    if (inPlaceAllToAll(op)) total += (size_t(nranks_) * op.count * dtypeSize(op.dtype) + 63) & ~size_t(63);
  if (!total) return ops;
  // Copied here, in this rank's turn, so it reads what the caller's stream
  // left in the buffer; the algorithm chosen is the one an out-of-place call
  // gets, so ranks in place and ranks not agree on it.
  uint8_t* at = nullptr;
  try {
    at = inPlaceInputs_.get(total);
  } catch (const Error& e) {
    // loomMemAlloc's memory refused (it faults every page in, and checks
    // the room for that first): plain memory still gives the right result,
    // only not read in place by the peers.
    if (!inPlaceWarned_)
      LOOM_WARN("COLL", "rank %d: in-place all-to-alls copy their input into plain memory: %s", rank_, e.what());
    inPlaceWarned_ = true;
    at = inPlaceFallback_.get(total, hostDevice(), rank_);
  }
  *copied = ops;
  for (OpDesc& op : *copied) {
    if (!inPlaceAllToAll(op)) continue;
    const size_t bytes = size_t(nranks_) * op.count * dtypeSize(op.dtype);
    hostDevice().copy(at, op.sendbuf, bytes, CopyHint::Cached);  // read again at once: sent
    op.sendbuf = at;
    op.sendMem = MemoryKind::Host;
    at += (bytes + 63) & ~size_t(63);
  }
  return *copied;
}

LOOM_HOT loomResult_t loomComm::runOne(const OpDesc& op, const SlotTag& tag) {
  if (op.tagged || inPlaceAllToAll(op)) return runOps({op}, {tag});
  const size_t block = op.count * dtypeSize(op.dtype);
  if (lastChoice_.block != block || lastChoice_.coll != op.coll) {
    const AlgorithmEntry& e = algorithmEntry(choose(op));
    lastChoice_ = {op.coll, block, e.algo, e.direct ? e.runDirect : nullptr};
  }
  const Algorithm algo = lastChoice_.algo;
  if (!lastChoice_.runDirect) return runOps({op}, {tag});
  loomResult_t prior = asyncError();
  if (prior != loomSuccess) {
    setLastError(strf("rank %d: the communicator failed earlier: %s", rank_, lastError().c_str()));
    return prior;
  }
  noteRunning(tag, 1);
  try {
    double t0 = tracer_ ? Tracer::nowUs() : 0;
    DirectContext ctx = directContext();
    lastChoice_.runDirect(ctx, op, tag);
    if (tracer_) traceRun(t0, {op}, {tag}, algo);
    noteIdle();
    return loomSuccess;
  } catch (const Error& e) {
    noteIdle();
    return failOperation(e);
  }
}

uint64_t loomComm::issue(const std::vector<OpDesc>& ops, std::vector<SlotTag>* tags) {
  std::lock_guard<SeqLock> lock(seqMutex_);
  for (const OpDesc& op : ops) tags->push_back(tagFor(op));
  return takeTicket();
}

loomResult_t loomComm::runOps(const std::vector<OpDesc>& issued, const std::vector<SlotTag>& tags) {
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
    std::vector<OpDesc> copied;
    const std::vector<OpDesc>& ops = withInPlaceInputsCopied(issued, &copied);
    // A pull all-reduce leaves its `done` for the next operation to store
    // (algorithms/direct.h); the direct paths store it themselves.
    if (directState_.pullUnpublished && !(ops.size() == 1 && !ops[0].tagged && isDirect(choose(ops[0])))) {
      DirectContext ctx = directContext();
      directPublishPullDone(ctx);
    }
    size_t nTagged = 0;
    for (const OpDesc& op : ops) nTagged += op.tagged;
    if (nTagged) {
      if (nTagged != ops.size()) {
        setLastError(strf("rank %d: a group mixes tagged sends/receives (loomSendTagged, loomRecvTagged) with other "
                          "operations; issue them in separate groups",
                          rank_));
        return loomInvalidUsage;
      }
      double t0 = tracer_ ? Tracer::nowUs() : 0;
      std::string usage;
      loomResult_t r = tagged_->run(*this, *this, ops, &usage);
      if (tracer_) traceRun(t0, ops, tags, Algorithm::Ring);
      if (r != loomSuccess) setLastError(usage);
      return r;
    }
    double t0 = tracer_ ? Tracer::nowUs() : 0;
    std::vector<ExecOp> eops;
    Schedule sched;
    Schedule checks;  // check mode: rooted collectives' tag handshakes (addRootCheck)
    std::vector<size_t> selfSends, selfRecvs;
    Algorithm alone = ops.size() == 1 ? choose(ops[0]) : Algorithm::Ring;
    // Zero-copy: a collective whose buffers every rank can map runs
    // straight out of them (all ranks vote in their windows, alike).
    if (ops.size() == 1 && !isDirect(alone) && peerMem_ && !tuner_->forced(ops[0].coll)) {
      DirectContext ctx = directContext();
      if (directZeroCopy(ctx, ops[0], tags[0])) {
        if (tracer_) traceRun(t0, ops, tags, Algorithm::Staged, "zero-copy");
        return loomSuccess;
      }
    }
    if (isDirect(alone)) {
      runDirect(alone, ops[0], tags[0]);
      if (tracer_) traceRun(t0, ops, tags, alone);
      return loomSuccess;
    }
    // Lanes that share a connection run in the order they are built, and
    // both ends must agree on it: point-to-point lanes first (a pair's sends
    // and receives match in their order, wherever the group's collectives
    // sit between them), then the collectives, in the order every rank
    // calls them.
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
    }
    for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < ops.size(); ++i) {
      const OpDesc& op = ops[i];
      if ((op.coll == Collective::P2P) != (pass == 0)) continue;
      if (op.coll == Collective::P2P) {
        if (op.peer == rank_) (op.isSend ? selfSends : selfRecvs).push_back(i);
        else p2pSchedule(op, int(i), &sched);
      } else {
        Plan plan = tuner_->choose(op, nranks_, limits_);
        if (checkMode_ && rooted(op.coll)) addRootCheck(int(i), rank_, nranks_, &checks);
        // The direct paths run alone; inside a group the ring serves.
        buildSchedule(op, int(i), rank_, nranks_, topology_.hostOfRanks(), plan, &sched);
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
    if (!checks.lanes.empty()) {
      // With every connection open, the handshakes lead the schedule's own
      // lanes (first on every connection they share).  With some still to
      // open they run alone first: opening waits for the peer (tcp's
      // accepting side), and a peer that names another root may never open
      // what this rank's schedule needs, so the ranks would wait there for
      // the timeout instead of finding out from their neighbours.  Either
      // way a connection carries the handshake before the data.
      bool open = true;
      for (const Lane& l : sched.lanes)
        for (const Step& st : l.steps)
          for (int peer : {st.recvPeer, st.sendPeer})
            open &= peer < 0 || conns_.count(std::make_pair(peer, l.channel)) != 0;
      if (open) prependLanes(&sched, std::move(checks.lanes));
      else execute(*this, eops, checks);
    }
    execute(*this, eops, sched);
    if (tracer_) traceRun(t0, ops, tags, alone);
    return loomSuccess;
  } catch (const Error& e) {
    return failOperation(e);
  } catch (const std::exception& e) {
    setFailed(loomInternalError, strf("rank %d: internal error: %s", rank_, e.what()));
    return loomInternalError;
  }
}

void loomComm::traceRun(double beginUs, const std::vector<OpDesc>& ops, const std::vector<SlotTag>& tags,
                        Algorithm algo, const char* algoName) {
  double end = Tracer::nowUs();
  if (ops.empty()) return;
  const OpDesc& op = ops[0];
  size_t bytes = op.count * dtypeSize(op.dtype);
  if (ops.size() > 1) {
    std::string list;
    for (size_t i = 0; i < ops.size() && i < 8; ++i) list += (i ? ", " : "") + describeTag(tags[i]);
    if (ops.size() > 8) list += strf(", ... (%zu in all)", ops.size());
    tracer_->op(beginUs, end, strf("Group of %zu", ops.size()), "\"ops\": " + jsonString(list));
    return;
  }
  std::string name = collectiveName(op.coll);
  std::string args = strf("\"op\": %s, \"bytes\": %zu, \"seq\": %llu", jsonString(describeTag(tags[0])).c_str(),
                          bytes, (unsigned long long)tags[0].seq);
  if (op.coll == Collective::P2P) args += strf(", \"%s\": %d", op.isSend ? "to" : "from", op.peer);
  else args += strf(", \"algorithm\": %s", jsonString(algoName ? algoName : algorithmName(algo)).c_str());
  tracer_->op(beginUs, end, name, args);
}

void loomComm::setFailed(loomResult_t code, const std::string& msg, CtlType notice) {
  if (!failFirst(code, msg, notice)) setLastError(msg);
}

// A failure a peer caused (it inherits the peer's cause): ranks that disagree
// stay loomInvalidUsage everywhere; anything else is remote to this rank.
static loomResult_t inheritedCode(int code) { return code == loomInvalidUsage ? loomInvalidUsage : loomRemoteError; }

// "rank 1: the communicator failed on rank 2: <rank 2's message>", without
// rank 2's message repeating "rank 2: ".
static std::string inheritedMessage(int rank, const CtlCause& c) {
  std::string prefix = strf("rank %d: ", c.root);
  std::string msg = c.msg.compare(0, prefix.size(), prefix) == 0 ? c.msg.substr(prefix.size()) : c.msg;
  return strf("rank %d: the communicator failed on rank %d: %s", rank, c.root, msg.c_str());
}

loomResult_t loomComm::failOperation(const Error& e) {
  loomResult_t code = e.code();
  std::string msg = e.what();
  CtlCause from;
  int peer = e.peer();
  // A broken connection or a peer's abort is rarely the cause: ask that peer
  // why it failed, so that every rank reports the root cause (say, the
  // mismatched call rank 2 found) rather than "rank 1 aborted".
  if (code == loomRemoteError && peer >= 0 && peer < nranks_ && peer != rank_ && ctl_ &&
      asyncError() == loomSuccess) {
    Reach reach = ctl_->askWhy(peer, &from, nowMs() + 1000);
    std::vector<bool> asked(size_t(nranks_), false);
    asked[size_t(peer)] = true;
    std::vector<Reach> reached(size_t(nranks_), reach);
    markDead(asked, reached);
    if (reach == Reach::Acked && from.code != loomSuccess && from.root >= 0) {
      code = inheritedCode(from.code);
      msg = inheritedMessage(rank_, from);
    } else {
      from = CtlCause{};
    }
    // No cause from the peer (it failed and exited, say: its Fail notice
    // reached us before it exited, and may be with the control thread right
    // now; or it has not failed): let what has arrived land, so that a
    // notice's cause wins over this broken connection.
    if (from.root < 0) ctl_->settleIncoming(nowMs() + 1000);
  }
  if (!failFirst(code, msg, CtlType::Fail, from.root, from.msg)) {
    // The communicator had failed already (a peer's notice, a revoke, another
    // thread): that failure is this operation's error too.
    loomResult_t first = asyncError();
    if (first != loomSuccess) code = first;
  }
  // The notices' answers say which peers are gone (for the message).
  settleNotices(nowMs() + 500);
  return code;
}

CtlCause loomComm::cause() {
  std::lock_guard<std::mutex> lock(errMutex_);
  CtlCause c;
  c.code = asyncError_.load();
  if (c.code == loomSuccess) return c;
  c.root = causeRoot_;
  c.msg = causeMsg_;
  return c;
}

bool loomComm::failFirst(loomResult_t code, const std::string& msg, CtlType notice, int root,
                         const std::string& rootMsg) {
  bool first;
  {
    // The cause is recorded with the code, so that a Why question never sees one without the other.
    std::lock_guard<std::mutex> lock(errMutex_);
    int expected = loomSuccess;
    first = asyncError_.compare_exchange_strong(expected, code);
    if (first) {
      causeRoot_ = root >= 0 ? root : rank_;
      causeMsg_ = root >= 0 ? rootMsg : msg;
      lastError_ = failMsg_ = msg;
    }
  }
  if (first) {
    // A hierarchical path's sub-communicator: its parent warns, naming it.
    if (part_)
      LOOM_INFO("COLL", "%s communicator: %s", part_, msg.c_str());
    else
      LOOM_WARN("COLL", "%s", msg.c_str());
    // A CUDA communicator's streams may wait on peers' flags: release them
    // (never waiting for the device).
    if (DeviceCollectives* d = deviceForFail_.load()) d->markFailed(code, msg);
    // Tell the peers at once rather than letting them wait for a timeout,
    // then on the control sockets, which also finds out who is dead.  A
    // revoke travels on the control sockets alone, so that every rank's
    // error says "revoked" rather than whichever broken connection it saw first.
    if (notice != CtlType::Revoke)
      for (const auto& t : transports_) t->abort();
    notifyPeers(notice);
    FailureNote note;
    note.code = code;
    note.msg = msg;
    note.root = root;
    note.rootMsg = rootMsg;
    callFailureHook(note);
    return true;
  }
  return false;
}

void loomComm::failFromParent(loomResult_t code, const std::string& msg) {
  bool first;
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    int expected = loomSuccess;
    first = asyncError_.compare_exchange_strong(expected, code);
    if (first) {
      causeRoot_ = rank_;
      causeMsg_ = msg;
      lastError_ = failMsg_ = msg;
    }
  }
  if (!first) return;
  LOOM_INFO("COLL", "%s communicator: its parent failed: %s", part_ ? part_ : "a", msg.c_str());
  if (DeviceCollectives* d = deviceForFail_.load()) d->markFailed(code, msg);
}

void loomComm::setFailureHook(std::function<void(const FailureNote&)> hook) {
  {
    std::unique_lock<std::mutex> g(hookMutex_);
    failureHook_ = std::move(hook);
    // The old hook's calls under way end before its owner may go.
    hookCv_.wait(g, [this] { return hookCalls_ == 0; });
  }
  // Failed before the hook was set: tell it now (a failure racing with
  // this may tell it twice; failing the owner twice is harmless).
  FailureNote note;
  note.code = asyncError();
  if (note.code == loomSuccess) return;
  note.msg = lastError();
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    if (causeRoot_ != rank_) note.root = causeRoot_, note.rootMsg = causeMsg_;
  }
  callFailureHook(note);
}

void loomComm::callFailureHook(const FailureNote& note) {
  // Called without the mutex held: the hook fails the parent, which fails
  // the other sub-communicator, whose hook runs meanwhile.
  std::function<void(const FailureNote&)> h;
  {
    std::lock_guard<std::mutex> g(hookMutex_);
    if (!failureHook_) return;
    h = failureHook_;
    ++hookCalls_;
  }
  h(note);
  {
    std::lock_guard<std::mutex> g(hookMutex_);
    --hookCalls_;
  }
  hookCv_.notify_all();
}

std::unique_ptr<DeviceCollectives> loomComm::makeHierDevice(Bootstrap& boot, const DeviceChoice& choice,
                                                            const DeviceRequest& device,
                                                            const std::vector<std::string>& hostIds,
                                                            const SockAddr& advertise) {
  const RankInfo& root = peers_[0];
  HierParts parts;
  parts.shape = hierShapeOf(hostIds, rank_);
  parts.minBytes = root.deviceHierMinBytes;
  const HierShape& sh = parts.shape;
  const int driverRank = device.driverRank >= 0 ? device.driverRank : rank_;
  StagedCommOptions o = stagedOptions();
  o.pieceBytes = root.deviceStageBytes;
  parts.flat = std::make_unique<StagedDeviceComm>(rank_, nranks_, deviceDriverFor(choice, driverRank, nranks_), o);
  // The first rank of each host makes its local communicator's id, each
  // rank of the first host its rail's; every rank learns them all through
  // the bootstrap, then joins its host's and its rail's (every rank in the
  // same order: local, then rail; the groups of each are disjoint).
  struct Ids {
    loomUniqueId local, rail;
  } mineIds;
  memset(&mineIds, 0, sizeof mineIds);
  // Advertised where this communicator's own peers reach this rank.
  if (sh.localIndex == 0) makeUniqueId(&mineIds.local, &advertise);
  if (sh.hostIndex == 0) makeUniqueId(&mineIds.rail, &advertise);
  std::vector<uint8_t> all = boot.allGather(&mineIds, sizeof mineIds);
  std::vector<Ids> ids(static_cast<size_t>(nranks_));
  memcpy(ids.data(), all.data(), all.size());
  int localRoot = -1, railRoot = -1;
  for (int r = 0; r < nranks_; ++r) {
    if (localRoot < 0 && sh.hostOf[size_t(r)] == sh.hostIndex) localRoot = r;
    if (railRoot < 0 && sh.hostOf[size_t(r)] == 0 && sh.localOf[size_t(r)] == sh.localIndex) railRoot = r;
  }
  DeviceRequest sub;
  sub.kind = DeviceRequest::Kind::Cuda;
  sub.device = choice.device;
  sub.driverRank = driverRank;
  sub.parentRoot = &root;
  sub.timeoutMs = timeoutMs_.load();
  sub.path = 1;
  sub.part = "local";
  sub.registrations = &registrations_;  // the parent's buffers are the ones it reads
  try {
    parts.local =
        loomComm::create(decodeUniqueId(ids[size_t(localRoot)].local), sh.perHost, sh.localIndex, nullptr, sub);
    sub.path = 2;
    sub.part = "rail";
    sub.registrations = nullptr;
    parts.rail = loomComm::create(decodeUniqueId(ids[size_t(railRoot)].rail), sh.hosts, sh.hostIndex, nullptr, sub);
    if (sh.hostMajor) {
      // The hierarchical reduce-scatter's and all-gather's device memory
      // (every rank decides alike: hostMajor comes from the shared host
      // ids), made last so that nothing after it can fail.
      parts.driver = deviceDriverFor(choice, driverRank, nranks_);
      DeviceScope current(*parts.driver);
      parts.orderFlag = static_cast<uint64_t*>(parts.driver->allocate(256));  // zeroed
    }
  } catch (...) {
    // A communicator keeps itself (its handle's reference) until released.
    for (std::shared_ptr<loomComm>* c : {&parts.local, &parts.rail})
      if (*c) {
        (*c)->abort();
        (*c)->releaseHandle();
      }
    throw;
  }
  logSetRank(rank_);
  parts.rank = rank_;
  parts.nranks = nranks_;
  parts.sendSignatures = [this](int peer, std::vector<uint8_t> bytes) { sendSignatures(peer, std::move(bytes)); };
  parts.onMismatch = [this](const std::string& msg) { failFirst(loomInvalidUsage, msg); };
  // Their first failure fails this communicator (which tells its peers);
  // this one's failure fails them (HierDeviceComm::markFailed).
  return std::make_unique<HierDeviceComm>(std::move(parts), [this](const FailureNote& n) {
    failFirst(n.code, strf("rank %d: %s", rank_, n.msg.c_str()), CtlType::Fail, n.root, n.rootMsg);
  });
}

void loomComm::notifyPeers(CtlType type) {
  if (!ctl_) return;
  CtlMsg m;
  m.type = type;
  m.from = rank_;
  if (type == CtlType::Fail) m.extra = encodeCause(cause());
  std::vector<bool> to(size_t(nranks_), true);
  to[size_t(rank_)] = false;
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    for (int r : dead_) {
      m.ranks.push_back(r);
      to[size_t(r)] = false;
    }
  }
  // A peer whose control socket refuses is gone; one that does not answer
  // in time is not called dead here (it may only be slow, or cut off): it
  // is reported unreachable.
  ctl_->broadcastAsync(m, to, nowMs() + 1000, [this, to](const std::vector<Reach>& reach) { markDead(to, reach); });
}

void loomComm::markDead(const std::vector<bool>& asked, const std::vector<Reach>& reach) {
  std::lock_guard<std::mutex> lock(errMutex_);
  for (int r = 0; r < nranks_; ++r) {
    if (!asked[size_t(r)]) continue;
    if (reach[size_t(r)] == Reach::Refused) {
      dead_.insert(r);
      unreachable_.erase(r);
    } else if (reach[size_t(r)] == Reach::Timeout) {
      if (!dead_.count(r)) unreachable_.insert(r);
    } else {
      unreachable_.erase(r);
    }
  }
}

void loomComm::onNotice(const CtlMsg& m) {
  if (m.type == CtlType::ShrankWithout) {  // a shrink done without this rank (shrink.cc)
    SatOut s;
    if (m.extra.size() != sizeof s.round + sizeof s.collSeq) return;
    memcpy(&s.round, m.extra.data(), sizeof s.round);
    memcpy(&s.collSeq, m.extra.data() + sizeof s.round, sizeof s.collSeq);
    LOOM_INFO("SHRINK", "rank %d: rank %d shrank the communicator without this rank (its shrink %u, after %llu "
                        "collectives)", rank_, m.from, s.round, (unsigned long long)s.collSeq);
    std::lock_guard<std::mutex> lock(satOutMutex_);
    satOut_ = s;
    return;
  }
  if (m.type == CtlType::Sigs) {  // the IPC path's mismatch check: not a failure
    // A faster peer may send before this rank's device side exists: kept
    // for it (init replays them under the same lock).
    std::lock_guard<std::mutex> g(earlySigsMutex_);
    if (DeviceCollectives* d = deviceForFail_.load())
      d->onPeerSignatures(m.from, m.extra);
    else if (earlySigs_.size() < 64)
      earlySigs_.emplace_back(m.from, m.extra);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    for (int r : m.ranks)
      if (r >= 0 && r < nranks_ && r != rank_) dead_.insert(r), unreachable_.erase(r);
    unreachable_.erase(m.from);  // it reached us
  }
  // A communicator that failed already keeps the message of its own failure.
  if (m.type == CtlType::Revoke) {
    if (!revoked_.exchange(true))
      if (!failFirst(loomRemoteError, strf("rank %d: rank %d revoked the communicator", rank_, m.from), CtlType::Revoke))
        notifyPeers(CtlType::Revoke);  // failed before: still pass the revoke on
  } else {
    CtlCause c;
    if (decodeCause(m.extra, nranks_, &c) && c.code != loomSuccess && c.root >= 0)
      failFirst(inheritedCode(c.code), inheritedMessage(rank_, c), CtlType::Fail, c.root, c.msg);
    else
      failFirst(loomRemoteError, strf("rank %d: the communicator failed on rank %d", rank_, m.from));
  }
}

void loomComm::revoke() {
  if (revoked_.exchange(true)) return;
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    int expected = loomSuccess;
    if (asyncError_.compare_exchange_strong(expected, loomRemoteError)) {
      lastError_ = failMsg_ = strf("rank %d: the communicator was revoked on this rank", rank_);
      causeRoot_ = rank_;
      causeMsg_ = lastError_;
      first = true;
    }
  }
  // A CUDA communicator's streams may wait on what the peers will not do
  // now: release them, as a failure does.
  if (first)
    if (DeviceCollectives* d = deviceForFail_.load()) d->markFailed(loomRemoteError, lastError());
  // Even when the communicator had failed already: peers learn it is revoked.
  notifyPeers(CtlType::Revoke);
}

std::set<int> loomComm::deadRanks() {
  std::lock_guard<std::mutex> lock(errMutex_);
  return dead_;
}

std::set<int> loomComm::unreachableRanks() {
  std::lock_guard<std::mutex> lock(errMutex_);
  return unreachable_;
}

std::string loomComm::deadSuffix() {
  std::string s;
  std::set<int> d = deadRanks(), u = unreachableRanks();
  if (!d.empty()) {
    s += "; dead ranks:";
    for (int r : d) s += strf(" %d", r);
  }
  if (!u.empty()) {
    s += "; unreachable ranks:";
    for (int r : u) s += strf(" %d", r);
  }
  return s;
}

void loomComm::settleNotices(int64_t deadlineMs) {
  if (ctl_) ctl_->waitQuiet(deadlineMs);
}

void loomComm::setLastError(const std::string& msg) {
  std::lock_guard<std::mutex> lock(errMutex_);
  lastError_ = msg;
}

std::string loomComm::failure() {
  std::lock_guard<std::mutex> lock(errMutex_);
  return failMsg_;
}

std::string loomComm::lastError() {
  std::lock_guard<std::mutex> lock(errMutex_);
  return lastError_;
}

void loomComm::abort() {
  aborted_.store(true);
  setFailed(loomRemoteError, strf("rank %d: the communicator was aborted", rank_));
}

void loomComm::checkPeerAlive(int peer) {
  if (!ctl_ || peer < 0 || peer >= nranks_ || peer == rank_) return;
  int64_t now = nowMs();
  if (now - aliveCheckedMs_.load(std::memory_order_relaxed) < 250) return;
  aliveCheckedMs_.store(now, std::memory_order_relaxed);
  int fd;
  try {
    fd = ctl_->dial(peer, now + 200);
  } catch (const Error&) {
    return;  // no answer: maybe slow, maybe cut off; the timeout decides
  }
  if (fd >= 0) {
    close(fd);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(errMutex_);
    dead_.insert(peer);
    unreachable_.erase(peer);
  }
  failPeer(peer, loomRemoteError, "rank %d: rank %d is gone (its control socket refuses) while %s waited for it to connect",
           rank_, peer, runningOp().c_str());
}

void loomComm::checkAborted() {
  if (aborted_.load()) fail(loomRemoteError, "rank %d: the communicator was aborted", rank_);
  if (revoked_.load()) fail(loomRemoteError, "rank %d: the communicator was revoked", rank_);
  // Failed on a peer's notice (or on another thread): stop waiting at once;
  // a connection still being opened may never be answered.
  int code = asyncError_.load();
  if (code != loomSuccess) fail(loomResult_t(code), "%s", lastError().c_str());
}

void loomComm::prepare(const std::vector<std::pair<int, int>>& needed) {
  int64_t deadline = nowMs() + timeoutMs_;
  // In (peer, channel) order: a transport whose connect waits for the peer
  // (tcp's accepting side) waits only for higher ranks, which never wait.
  for (const auto& key : needed) {
    if (conns_.count(key)) continue;
    int peer = key.first, ch = key.second;
    if (ch >= maxChannels_) fail(loomInternalError, "channel %d out of range", ch);
    if (peer < 0 || peer >= nranks_ || peer == rank_) fail(loomInternalError, "no connection to rank %d", peer);
    conns_[key] = via_[size_t(peer)]->connect(peer, ch, deadline, *this);
  }
}

Connection* loomComm::taggedConnection(int peer) {
  auto key = std::make_pair(peer, maxChannels_);
  auto it = conns_.find(key);
  if (it != conns_.end()) return it->second.get();
  if (peer == rank_ || peer < 0 || peer >= nranks_) return nullptr;
  int64_t now = nowMs();
  if (peer < rank_) {
    conns_[key] = via_[size_t(peer)]->connect(peer, maxChannels_, now + timeoutMs_, *this);
    return conns_[key].get();
  }
  // The higher rank opens it when it runs its first tagged operation; until
  // then look (without waiting) at most once per millisecond.
  if (now < taggedRetryMs_[size_t(peer)]) return nullptr;
  taggedRetryMs_[size_t(peer)] = now + 1;
  try {
    conns_[key] = via_[size_t(peer)]->connect(peer, maxChannels_, now, *this);
  } catch (const Error& e) {
    if (e.code() == loomTimeout) return nullptr;
    throw;
  }
  return conns_[key].get();
}

Connection* loomComm::connection(int peer, int channel) {
  auto it = conns_.find(std::make_pair(peer, channel));
  if (it == conns_.end()) fail(loomInternalError, "no connection to rank %d channel %d", peer, channel);
  return it->second.get();
}

uint32_t loomComm::sleepBegin(bool withFds) { return doorbell_ ? doorbell_->begin(withFds) : 0; }

void loomComm::sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell, int64_t timeoutUs) {
  if (doorbell && doorbell_) {
    doorbell_->sleep(token, fds, timeoutUs);
    return;
  }
  timespec ts{time_t(timeoutUs / 1000000), long(timeoutUs % 1000000) * 1000};
  ppoll(fds.data(), fds.size(), &ts, nullptr);
}

void loomComm::sleepEnd() {
  if (doorbell_) doorbell_->end();
}

void loomComm::checkStalled(const SlotTag& mine, int peer) {
  noteWaiting(peer);
  if (!peerMem_ || mine.coll == uint8_t(Collective::P2P)) return;
  directCheckStalled(directContext(), peer, mine);
}

void loomComm::checkOtherPath(const SlotTag& mine, int peer) {
  noteWaiting(peer);
  if (mine.coll == uint8_t(Collective::P2P) || peer == rank_) return;
  // A slot the peer posted for this sequence number means it runs this
  // operation on the executor path while we wait on a direct path.
  for (int ch = 0; ch < maxChannels_; ++ch) {
    SlotTag t;
    bool seen = via_[size_t(peer)]->peekIncoming(peer, ch, &t);
    if (!seen) {
      auto it = conns_.find(std::make_pair(peer, ch));
      seen = it != conns_.end() && it->second->recvPeek(&t);
    }
    if (seen && t.coll != uint8_t(Collective::P2P) && t.seq == mine.seq) failMismatch(rank_, peer, t, mine);
  }
}
