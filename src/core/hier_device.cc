#include "src/core/hier_device.h"

#include <algorithm>
#include <map>

#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"

namespace loom {

HierShape hierShapeOf(const std::vector<std::string>& hostIds, int rank) {
  HierShape s;
  const int n = int(hostIds.size());
  std::map<std::string, int> index;  // host id -> host number
  std::vector<int> count;
  for (int r = 0; r < n; ++r) {
    auto it = index.find(hostIds[size_t(r)]);
    if (it == index.end()) {
      it = index.emplace(hostIds[size_t(r)], int(count.size())).first;
      count.push_back(0);
    }
    s.hostOf.push_back(it->second);
    s.localOf.push_back(count[size_t(it->second)]++);
  }
  s.hosts = int(count.size());
  s.perHost = count.empty() ? 0 : count[0];
  for (size_t h = 1; h < count.size(); ++h)
    if (count[h] != count[0]) {
      s.why = strf("host %s has %d ranks, host %s has %d: the hierarchical path needs the same number on every host",
                   hostIds[0].c_str(), count[0], [&] {
                     for (int r = 0; r < n; ++r)
                       if (s.hostOf[size_t(r)] == int(h)) return hostIds[size_t(r)];
                     return std::string();
                   }().c_str(), count[h]);
      s.perHost = 0;
      break;
    }
  s.hostMajor = s.perHost > 0;
  for (int r = 0; r < n && s.hostMajor; ++r)
    s.hostMajor = s.hostOf[size_t(r)] * s.perHost + s.localOf[size_t(r)] == r;
  if (rank >= 0 && rank < n) {
    s.hostIndex = s.hostOf[size_t(rank)];
    s.localIndex = s.localOf[size_t(rank)];
  }
  if (s.why.empty() && s.hosts < 2) s.why = "every rank is on one host (CUDA IPC serves it whole)";
  if (s.why.empty() && s.perHost < 2)
    s.why = "each host has one rank (there is nothing to reduce within a host: the staged path serves it)";
  return s;
}

HierSplit hierSplit(size_t count, int perHost) {
  HierSplit s;
  if (perHost < 1) return {0, count};
  s.shard = count / size_t(perHost);
  s.tail = count - s.shard * size_t(perHost);
  return s;
}

namespace {

// The reduce-scatter's and all-gather's scratch and order counter, freed
// once the device has finished the last call that used them.
struct ScratchRemains final : DeviceRemains {
  std::unique_ptr<DeviceDriver> driver;
  uint64_t* flag = nullptr;
  uint64_t uses = 0;
  std::vector<void*> blocks;

  bool step() override {
    try {
      DeviceScope current(*driver);
      return uses == 0 || driver->readFlag(flag) >= uses;
    } catch (const Error& e) {
      LOOM_WARN("DEVICE", "rank %d: reading the hierarchical path's scratch counter: %s", rank, e.what());
      return false;
    }
  }
  void free() override {
    try {
      DeviceScope current(*driver);
      for (void* p : blocks) driver->release(p);
      driver->release(flag);
    } catch (const Error&) {  // nothing to tell from here
    }
    driver.reset();
  }
};

}  // namespace

HierDeviceComm::HierDeviceComm(HierParts parts, std::function<void(const FailureNote&)> onSubFailure)
    : flat_(std::move(parts.flat)),
      local_(std::move(parts.local)),
      rail_(std::move(parts.rail)),
      shape_(std::move(parts.shape)),
      minBytes_(parts.minBytes),
      driver_(std::move(parts.driver)),
      orderFlag_(parts.orderFlag) {
  // This communicator's ranks of the sub-communicators' members, in their
  // rank order.
  std::vector<int> localRanks, railRanks;
  for (size_t r = 0; r < shape_.hostOf.size(); ++r) {
    if (shape_.hostOf[r] == shape_.hostIndex) localRanks.push_back(int(r));
    if (shape_.localOf[r] == shape_.localIndex) railRanks.push_back(int(r));
  }
  auto hook = [onSubFailure](const char* part, const std::vector<int>& members) {
    std::string list;
    for (int r : members) list += strf(" %d", r);
    const std::string what =
        strf("the hierarchical path's %s communicator (its ranks 0.. are this communicator's ranks%s)", part,
             list.c_str());
    return [onSubFailure, what, members](const FailureNote& sub) {
      FailureNote n = sub;
      n.msg = what + " failed: " + sub.msg;
      if (sub.root >= 0 && sub.root < int(members.size())) {
        n.root = members[size_t(sub.root)];
        n.rootMsg = what + " failed on its rank " + std::to_string(sub.root) + ": " + sub.rootMsg;
      } else {
        n.root = -1;
        n.rootMsg.clear();
      }
      onSubFailure(n);
    };
  };
  local_->setFailureHook(hook("local", localRanks));
  rail_->setFailureHook(hook("rail", railRanks));
  rank_ = parts.rank;
  nranks_ = parts.nranks;
  if (parts.sendSignatures && parts.onMismatch && nranks_ > 1) {
    sigs_ = std::make_unique<SignatureCheck>(rank_, (rank_ + nranks_ - 1) % nranks_);
    sendSigs_ = std::move(parts.sendSignatures);
    onMismatch_ = std::move(parts.onMismatch);
    sigThread_ = std::thread([this] { signatureLoop(); });
  }
}

void HierDeviceComm::signatureLoop() {
  std::unique_lock<std::mutex> lk(sigMu_);
  while (!sigStop_) {
    sigWake_ = false;
    lk.unlock();
    const int64_t sleepMs = signatureStep(false);
    lk.lock();
    if (!sigStop_ && !sigWake_)
      sigCv_.wait_for(lk, std::chrono::milliseconds(sleepMs), [&] { return sigStop_ || sigWake_; });
  }
}

int64_t HierDeviceComm::signatureStep(bool flush) {
  const std::string mismatch = sigs_->mismatch();
  if (!mismatch.empty()) {
    if (!mismatchReported_.exchange(true)) onMismatch_(mismatch);
    return 100;
  }
  int64_t next;
  for (std::vector<uint8_t>& b : sigs_->due(nowMs(), flush, &next)) sendSigs_((rank_ + 1) % nranks_, std::move(b));
  return next;
}

void HierDeviceComm::wakeSignatures() {
  {
    std::lock_guard<std::mutex> g(sigMu_);
    sigWake_ = true;
  }
  sigCv_.notify_all();
}

void HierDeviceComm::onPeerSignatures(int from, const std::vector<uint8_t>& bytes) {
  if (!sigs_ || from != (rank_ + nranks_ - 1) % nranks_) return;
  sigs_->receive(bytes);
  if (!sigs_->mismatch().empty()) wakeSignatures();
}

HierDeviceComm::~HierDeviceComm() {
  // As loomCommDestroy: every operation issued has run, then the handle's
  // reference goes (an aborted or failed one releases its streams first).
  for (std::shared_ptr<loomComm>* sub : {&local_, &rail_}) {
    if (!*sub) continue;
    (*sub)->setFailureHook(nullptr);
    (*sub)->waitIdle();
    (*sub)->releaseHandle();
    sub->reset();
  }
  flat_.reset();
  if (orderFlag_) {
    // The scratch goes once the last call that used it is done on the
    // device: at once after a healthy run (the caller synchronised its
    // streams, as NCCL requires before destroy), else by the reaper once
    // the released streams get there.
    auto rest = std::make_unique<ScratchRemains>();
    rest->rank = rank_;
    rest->driver = std::move(driver_);
    rest->flag = orderFlag_;
    rest->uses = scratchUses_;
    rest->blocks = std::move(retired_);
    if (scratch_) rest->blocks.push_back(scratch_);
    rest->deadline = nowMs() + DeviceCommOptions().reapTimeoutMs;
    reapDeviceRemains(std::move(rest));
  }
}

bool HierDeviceComm::hierarchical(const OpDesc& op) const {
  // Average divides on each level (by L, then by the hosts): within the
  // rounding for floating point, but truncating twice is not truncating the
  // sum once, so integers average on the flat path.
  const bool fp = op.dtype == loomFloat16 || op.dtype == loomBfloat16 || op.dtype == loomFloat32 ||
                  op.dtype == loomFloat64;
  if (op.op == loomAvg && !fp && op.coll != Collective::AllGather) return false;
  const size_t esz = dtypeSize(op.dtype);
  switch (op.coll) {
    case Collective::AllReduce:
      return hierSplit(op.count, shape_.perHost).shard > 0 && op.count * esz >= minBytes_;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      // The whole buffer (N blocks) against the threshold, as nccl-tests
      // counts these collectives' size.
      return orderFlag_ && op.count > 0 &&
             op.count * size_t(shape_.hosts) * size_t(shape_.perHost) * esz >= minBytes_;
    default:
      return false;
  }
}

void HierDeviceComm::runP2P(const std::vector<OpDesc>& ops, void* callerStream) {
  std::lock_guard<std::mutex> g(runMu_);
  flat_->runP2P(ops, callerStream);
}

void HierDeviceComm::run(const OpDesc& op, void* callerStream) {
  std::lock_guard<std::mutex> g(runMu_);
  if (!hierarchical(op)) {
    flat_->run(op, callerStream);
    if (sigs_) sigs_->recordMine(op), wakeSignatures();  // once it counts (check() throws before)
    return;
  }
  flat_->check(op);  // this device's buffers, a collective served: before anything is enqueued
  if (failed_.load() || flat_->failed()) fail(loomRemoteError, "the hierarchical device path has failed");
  for (loomComm* sub : {local_.get(), rail_.get()})
    if (sub->asyncError() != loomSuccess)
      fail(sub->asyncError(), "the hierarchical path's %s communicator has failed: %s",
           sub == local_.get() ? "local" : "rail", sub->lastError().c_str());
  try {
    if (op.coll == Collective::AllReduce)
      runAllReduce(op, callerStream);
    else
      runExchange(op, callerStream);
  } catch (const Error& e) {
    // Part of it may be enqueued, or this rank's part is missing: the
    // peers' programs no longer agree with this rank's, so every part fails
    // (the caller fails the communicator, which tells the peers).
    markFailed(e.code(), e.what());
    throw;
  }
  hierRuns_.fetch_add(1, std::memory_order_relaxed);
  if (sigs_) sigs_->recordMine(op), wakeSignatures();
}

bool HierDeviceComm::deviceMemory(const void* p, size_t bytes, void** allocation) {
  return local_->deviceComm()->deviceMemory(p, bytes, allocation);
}

void HierDeviceComm::withdraw(void* allocation, const std::function<bool()>& held) {
  local_->deviceComm()->withdraw(allocation, held);
}

void HierDeviceComm::runAllReduce(const OpDesc& op, void* callerStream) {
  const HierSplit s = hierSplit(op.count, shape_.perHost);
  const size_t esz = dtypeSize(op.dtype);
  auto at = [esz](const void* p, size_t elems) {
    return static_cast<uint8_t*>(const_cast<void*>(p)) + elems * esz;
  };
  uint8_t* mine = at(op.recvbuf, size_t(shape_.localIndex) * s.shard);
  OpDesc rs = op, ar = op, ag = op;
  rs.coll = Collective::ReduceScatter;  // in place when the all-reduce is (NCCL's rule)
  rs.recvbuf = mine;
  rs.count = s.shard;
  ar.sendbuf = mine;
  ar.recvbuf = mine;
  ar.count = s.shard;
  ar.sendMem = ar.recvMem = op.recvMem;
  ag.coll = Collective::AllGather;  // in place: the shard is at this rank's block
  ag.sendbuf = mine;
  ag.sendMem = op.recvMem;
  ag.count = s.shard;
  local_->deviceComm()->run(rs, callerStream);
  rail_->deviceComm()->run(ar, callerStream);
  local_->deviceComm()->run(ag, callerStream);
  if (s.tail > 0) {
    OpDesc tail = op;
    tail.sendbuf = at(op.sendbuf, s.shard * size_t(shape_.perHost));
    tail.recvbuf = at(op.recvbuf, s.shard * size_t(shape_.perHost));
    tail.count = s.tail;
    flat_->run(tail, callerStream);
  }
}

uint8_t* HierDeviceComm::scratchFor(size_t bytes) {
  if (bytes <= scratchBytes_) return scratch_;
  // Grown at least twofold, so a run of growing calls keeps few retired.
  size_t want = std::max<size_t>(bytes, std::max<size_t>(scratchBytes_ * 2, size_t(1) << 20));
  want = (want + 4095) / 4096 * 4096;
  DeviceScope current(*driver_);
  // Not zeroed, and without waiting for the device: streams of this
  // process may be waiting on peers (device_comm.h, allocateStaging).
  auto* p = static_cast<uint8_t*>(driver_->allocateStaging(want));
  if (scratch_) retired_.push_back(scratch_);
  scratch_ = p;
  scratchBytes_ = want;
  return p;
}

void HierDeviceComm::runExchange(const OpDesc& op, void* callerStream) {
  const size_t block = op.count * dtypeSize(op.dtype);  // one rank's block
  uint8_t* scratch = scratchFor(size_t(shape_.hosts) * block);
  const uint64_t use = scratchUses_;
  {
    // Every earlier call that used the scratch, on whatever stream, is done.
    DeviceScope current(*driver_);
    if (use > 0) driver_->backend(callerStream, 1, 0).waitFlag(0, orderFlag_, use, rank_);
  }
  // Counted before any part is enqueued: the scratch is freed only once the
  // counter reaches this call's number, so a part enqueued before a later
  // one failed keeps the scratch until the stream has run it.
  scratchUses_ = use + 1;
  auto done = [&] {
    DeviceScope current(*driver_);
    driver_->backend(callerStream, 1, 0).setFlag(0, orderFlag_, use + 1);
  };
  try {
    runExchangeParts(op, callerStream, scratch, block);
  } catch (...) {
    // The parts enqueued run to the end once the failure releases their
    // waits; the counter follows them.  If even this fails, the counter
    // never gets there and the reaper leaves the scratch allocated.
    try {
      done();
    } catch (const Error&) {
    }
    throw;
  }
  done();
}

void HierDeviceComm::runExchangeParts(const OpDesc& op, void* callerStream, uint8_t* scratch, size_t block) {
  const int H = shape_.hosts, L = shape_.perHost;
  auto run = [callerStream](loomComm* sub, OpDesc part) { sub->deviceComm()->run(part, callerStream); };
  auto runOf = [](const void* p, size_t bytes) {
    return static_cast<uint8_t*>(const_cast<void*>(p)) + bytes;
  };
  if (op.coll == Collective::ReduceScatter) {
    // Host h's run of L blocks, reduced over this host, into scratch
    // element h (this rank's local index picks the block); then the rail's
    // reduce-scatter of the H elements: element h goes to rail rank h.
    for (int h = 0; h < H; ++h) {
      OpDesc part = op;
      part.sendbuf = runOf(op.sendbuf, size_t(h) * size_t(L) * block);
      part.recvbuf = scratch + size_t(h) * block;
      part.recvMem = MemoryKind::CudaDevice;
      run(local_.get(), part);
    }
    OpDesc rail = op;
    rail.sendbuf = scratch;
    rail.sendMem = MemoryKind::CudaDevice;
    run(rail_.get(), rail);
  } else {
    // The rail's blocks, host by host, into the scratch; then host h's
    // element to every rank of this host, into host h's run.
    OpDesc rail = op;
    rail.recvbuf = scratch;
    rail.recvMem = MemoryKind::CudaDevice;
    run(rail_.get(), rail);
    for (int h = 0; h < H; ++h) {
      OpDesc part = op;
      part.sendbuf = scratch + size_t(h) * block;
      part.sendMem = MemoryKind::CudaDevice;
      part.recvbuf = runOf(op.recvbuf, size_t(h) * size_t(L) * block);
      run(local_.get(), part);
    }
  }
}

bool HierDeviceComm::failed() const {
  return failed_.load() || flat_->failed() || local_->asyncError() != loomSuccess ||
         rail_->asyncError() != loomSuccess;
}

bool HierDeviceComm::markFailed(loomResult_t code, const std::string& msg) {
  const bool first = !failed_.exchange(true);
  flat_->markFailed(code, msg);
  // On this rank only (the peers hear of it from their own parent): their
  // streams are released, their pending host steps stop.
  local_->failFromParent(code, msg);
  rail_->failFromParent(code, msg);
  return first;
}

void HierDeviceComm::setTimeoutMs(int64_t ms) {
  flat_->setTimeoutMs(ms);
  local_->setTimeoutMs(ms);
  rail_->setTimeoutMs(ms);
}

void HierDeviceComm::stopWatchdog() {
  if (sigThread_.joinable()) {
    {
      std::lock_guard<std::mutex> g(sigMu_);
      sigStop_ = true;
    }
    sigCv_.notify_all();
    sigThread_.join();
    // A healthy communicator going away: send what is left, give the
    // previous rank's last batches a moment (as the ipc path does).
    if (!failed()) {
      signatureStep(true);
      sigs_->awaitChecked(nowMs() + SignatureCheck::kFinishMs);
      signatureStep(true);  // reports a mismatch found meanwhile
    }
  }
  // The hooks call into the owner, which is going.
  local_->setFailureHook(nullptr);
  rail_->setFailureHook(nullptr);
  flat_->stopWatchdog();
}

size_t HierDeviceComm::scratchBytes() const {
  std::lock_guard<std::mutex> g(runMu_);
  return scratchBytes_;
}

std::string HierDeviceComm::describe() const {
  std::lock_guard<std::mutex> g(runMu_);
  std::string s = strf("hierarchical path: %d hosts x %d ranks, this rank host %d, local index %d; all-reduces of "
                       "%zu B or more: reduce-scatter (local, %s), all-reduce of the shard (rail, %s), all-gather "
                       "(local); reduce-scatters and all-gathers of as many: %s; %llu so far\n",
                       shape_.hosts, shape_.perHost, shape_.hostIndex, shape_.localIndex, minBytes_,
                       local_->deviceComm()->pathName(), rail_->deviceComm()->pathName(),
                       orderFlag_ ? "local by host, then rail (all-gather: rail, then local)"
                                  : "flat (ranks not numbered host by host)",
                       static_cast<unsigned long long>(hierRuns_.load()));
  if (scratchBytes_) s += strf("  scratch: %zu B of device memory, %llu calls\n", scratchBytes_,
                               static_cast<unsigned long long>(scratchUses_));
  s += "  local: " + local_->deviceComm()->describe();
  if (s.back() != '\n') s += '\n';
  s += "  rail: " + rail_->deviceComm()->describe();
  if (s.back() != '\n') s += '\n';
  s += "  flat: " + flat_->describe();
  return s;
}

}  // namespace loom
