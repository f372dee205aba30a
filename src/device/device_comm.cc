// The device side of a communicator (device_comm.h): peer memory through
// IPC records and an import cache, and collectives as stream programs.
#include "src/device/device_comm.h"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

uint64_t thisProcessToken() {
  static const uint64_t random = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd();
  }();
  return random ^ (uint64_t(getpid()) * 0x9e3779b97f4a7c15ull);
}

IpcImportCache::~IpcImportCache() {
  for (auto& [key, e] : entries_) close(e);
  for (Entry& e : retired_) close(e);
}

void IpcImportCache::close(Entry& e) {
  if (e.opened && e.mapped) driver_.closeHandle(e.mapped);
  e.mapped = nullptr;
  e.opened = false;
}

uint8_t* IpcImportCache::import(int r, const IpcRecord& rec) {
  if (rec.offset > rec.allocBytes || rec.bytes > rec.allocBytes - rec.offset)
    fail(loomRemoteError, "rank %d published a device range [%llu, +%llu) outside its allocation of %llu bytes",
         r, (unsigned long long)rec.offset, (unsigned long long)rec.bytes, (unsigned long long)rec.allocBytes);
  std::lock_guard<std::mutex> g(mu_);
  auto key = std::make_pair(r, rec.base);
  auto it = entries_.find(key);
  if (it != entries_.end() && memcmp(it->second.handle, rec.handle, kIpcHandleBytes) != 0) {
    // The owner freed that allocation and got the address back for a new
    // one: the old mapping shows the old memory.
    if (it->second.refs > 0)
      retired_.push_back(it->second);
    else
      close(it->second);
    entries_.erase(it);
    it = entries_.end();
  }
  if (it == entries_.end()) {
    Entry e;
    memcpy(e.handle, rec.handle, kIpcHandleBytes);
    if (rec.process == process_) {
      e.mapped = reinterpret_cast<uint8_t*>(uintptr_t(rec.base));
    } else {
      e.mapped = static_cast<uint8_t*>(driver_.openHandle(rec.handle));
      e.opened = true;
      ++opens_;
    }
    it = entries_.emplace(key, e).first;
  }
  ++it->second.refs;
  return it->second.mapped + rec.offset;
}

void IpcImportCache::release(int r, const IpcRecord& rec) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(std::make_pair(r, rec.base));
  if (it != entries_.end() && memcmp(it->second.handle, rec.handle, kIpcHandleBytes) == 0) {
    --it->second.refs;  // kept mapped: the next operation may use it again
    return;
  }
  for (size_t i = 0; i < retired_.size(); ++i)
    if (memcmp(retired_[i].handle, rec.handle, kIpcHandleBytes) == 0 && --retired_[i].refs == 0) {
      close(retired_[i]);
      retired_.erase(retired_.begin() + std::ptrdiff_t(i));
      return;
    }
}

size_t IpcImportCache::mapped() const {
  std::lock_guard<std::mutex> g(mu_);
  size_t n = retired_.size();
  for (const auto& [key, e] : entries_) n += e.mapped != nullptr;
  return n;
}

IpcRecord exportRange(const DeviceDriver& driver, const void* p, size_t bytes, uint64_t process) {
  IpcRecord rec;
  void* base = nullptr;
  size_t alloc = 0;
  driver.addressRange(p, &base, &alloc);
  const auto b = reinterpret_cast<uintptr_t>(base), q = reinterpret_cast<uintptr_t>(p);
  if (q < b || q - b > alloc || bytes > alloc - (q - b))
    fail(loomInvalidArgument, "device range %p + %zu is not inside one allocation (base %p, %zu bytes)", p, bytes,
         base, alloc);
  driver.exportHandle(base, rec.handle);
  rec.base = uint64_t(b);
  rec.allocBytes = alloc;
  rec.offset = q - b;
  rec.bytes = bytes;
  rec.process = process;
  rec.device = driver.device();
  return rec;
}

DeviceComm::DeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver, const AllGather& allGather,
                       const DeviceCommOptions& options)
    : rank_(rank),
      nranks_(nranks),
      slotBytes_(options.slotBytes),
      oneShotBytes_(options.oneShotBytes),
      drainTimeoutMs_(options.drainTimeoutMs),
      driver_(std::move(driver)) {
  const uint64_t process = options.process;
  if (slotBytes_ < 256 || slotBytes_ % 256)
    fail(loomInvalidArgument, "device slots of %zu bytes: need a multiple of 256", slotBytes_);
  imports_ = std::make_unique<IpcImportCache>(*driver_, process);
  const size_t blockBytes = kFlagBlockBytes + streamWindowBytes(slotBytes_);
  block_ = driver_->allocate(blockBytes);
  try {
    IpcRecord mine = exportRange(*driver_, block_, blockBytes, process);
    records_.resize(size_t(nranks));
    allGather(&mine, sizeof mine, records_.data());
    for (int r = 0; r < nranks; ++r) {
      const IpcRecord& rec = records_[size_t(r)];
      if (rec.bytes != blockBytes)
        fail(loomRemoteError, "rank %d's device window is %llu bytes, this rank's %zu: every rank must use the same "
             "slot size", r, (unsigned long long)rec.bytes, blockBytes);
      uint8_t* at = r == rank ? static_cast<uint8_t*>(block_) : imports_->import(r, rec);
      flags_.push_back(reinterpret_cast<uint64_t*>(at));
      windows_.push_back(at + kFlagBlockBytes);
    }
  } catch (...) {
    for (int r = 0; r < int(windows_.size()); ++r)
      if (r != rank) imports_->release(r, records_[size_t(r)]);
    imports_.reset();
    driver_->release(block_);
    throw;
  }
}

bool DeviceComm::drain() {
  const int64_t deadline = nowMs() + drainTimeoutMs_;
  std::lock_guard<std::mutex> g(mu_);
  if (round_ == 0) return true;
  if (drainTimeoutMs_ == 0) return false;
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    // Round g's done value is g + 1: the last round is round_ - 1.
    while (driver_->readFlag(flags_[size_t(r)] + kFlagDone) < round_) {
      if (nowMs() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return true;
}

DeviceComm::~DeviceComm() {
  // The caller synchronised its own streams (as NCCL requires before
  // ncclCommDestroy), but a peer may still be reading this rank's window
  // for the last round: wait for it before the block is freed.
  try {
    if (!drain() && drainTimeoutMs_ > 0)
      LOOM_WARN("DEVICE", "rank %d: peers did not finish reading this rank's window within %lld ms; freeing it",
                rank_, (long long)drainTimeoutMs_);
  } catch (const Error& e) {
    LOOM_WARN("DEVICE", "rank %d: reading the peers' flags failed: %s", rank_, e.what());
  }
  for (int r = 0; r < int(windows_.size()); ++r)
    if (r != rank_) imports_->release(r, records_[size_t(r)]);
  imports_.reset();
  try {
    driver_->release(block_);
  } catch (const Error&) {  // nothing to tell from a destructor
  }
}

bool DeviceComm::serves(Collective coll) {
  switch (coll) {
    case Collective::AllReduce:
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::Broadcast:
    case Collective::Reduce:
      return true;
    default:
      return false;
  }
}

bool DeviceComm::failed() const {
  std::lock_guard<std::mutex> g(mu_);
  return failCode_ != loomSuccess;
}

uint64_t DeviceComm::round() const {
  std::lock_guard<std::mutex> g(mu_);
  return round_;
}

void DeviceComm::checkBuffer(const char* what, const void* p) const {
  const int d = driver_->pointerDevice(p);
  if (d < 0)
    fail(loomInvalidArgument,
         "%s %p is host memory, but this communicator runs on %s:%d: pass device memory (a device communicator "
         "does not stage host buffers, as NCCL does not)",
         what, p, driver_->name(), driver_->device());
  if (d != driver_->device())
    fail(loomInvalidArgument, "%s %p is memory of %s:%d, but this communicator runs on %s:%d", what, p,
         driver_->name(), d, driver_->name(), driver_->device());
}

void DeviceComm::run(const OpDesc& op, void* callerStream) {
  if (!serves(op.coll))
    fail(loomInvalidUsage, "%s is not implemented on %s communicators yet (all-reduce, reduce-scatter, all-gather, "
         "broadcast and reduce are)", collectiveName(op.coll), driver_->name());
  const size_t esz = dtypeSize(op.dtype), n = op.count, N = size_t(nranks_);
  const bool root = rank_ == op.root;
  size_t sendBytes = n * esz, recvBytes = n * esz;
  bool needSend = true, needRecv = true;
  switch (op.coll) {
    case Collective::ReduceScatter: sendBytes *= N; break;
    case Collective::AllGather: recvBytes *= N; break;
    case Collective::Broadcast: needSend = root; break;
    case Collective::Reduce: needRecv = root; break;
    default: break;
  }
  if (n > 0) {
    if (needSend) checkBuffer("sendbuff", op.sendbuf);
    if (needRecv) checkBuffer("recvbuff", op.recvbuf);
  }
  std::lock_guard<std::mutex> g(mu_);
  if (failCode_ != loomSuccess) fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  uint64_t round = round_;
  StreamProgram p = compileStreamProgram(op, rank_, nranks_, allReduceAlgorithm(n * esz), slotBytes_, &round);
  ProgramBuffers b;
  b.send = needSend ? op.sendbuf : nullptr;
  b.sendBytes = needSend ? sendBytes : 0;
  b.recv = needRecv ? op.recvbuf : nullptr;
  b.recvBytes = needRecv ? recvBytes : 0;
  b.windows = windows_;
  b.windowBytes = streamWindowBytes(slotBytes_);
  b.flags = flags_;
  struct Current {  // the driver's device for the calls below, the caller's again after
    DeviceDriver& d;
    int previous;
    ~Current() { d.leave(previous); }
  } current{*driver_, driver_->enter()};
  try {
    round_ = round;  // the peers advance theirs whatever happens here
    if (p.ops.empty()) return;
    enqueueProgram(driver_->backend(callerStream, p.streams, p.events), p, b);
  } catch (const Error& e) {
    failCode_ = e.code();
    failed_ = e.what();
    throw;
  }
}

}  // namespace loom
