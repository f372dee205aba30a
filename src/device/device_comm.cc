// The device side of a communicator (device_comm.h): peer memory through
// IPC records and an import cache, and collectives as stream programs.
#include "src/device/device_comm.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <system_error>
#include <thread>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_memory.h"
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

uint64_t thisProcessToken() {
  static const uint64_t random = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd();
  }();
  return random ^ (uint64_t(getpid()) * 0x9e3779b97f4a7c15ull);
}

QuietDeviceScope::QuietDeviceScope(DeviceDriver& driver, int rank, const char* what) : d(driver) {
  try {
    previous = d.enter();
  } catch (const Error& e) {
    LOOM_WARN("DEVICE", "rank %d: selecting the device to %s: %s", rank, what, e.what());
  }
}

IpcImportCache::~IpcImportCache() {
  for (auto& [key, e] : entries_) close(e);
  for (Entry& e : retired_) close(e);
}

void IpcImportCache::close(Entry& e) {
  if (e.opened && e.mapped) {
    try {
      driver_.closeHandle(e.mapped);
    } catch (const Error& err) {  // called from destructors: said, not thrown
      LOOM_WARN("DEVICE", "%s", err.what());
    }
  }
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

bool IpcImportCache::forget(int r, uint64_t base) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(std::make_pair(r, base));
  if (it == entries_.end()) return false;
  close(it->second);
  entries_.erase(it);
  return true;
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

std::vector<uint8_t> encodeRegionAnswer(loomResult_t code, const IpcRecord* rec, const std::string& msg) {
  const int32_t c = int32_t(code);
  const bool ok = code == loomSuccess && rec;
  const size_t text = std::min<size_t>(msg.size(), 1024);
  std::vector<uint8_t> out(sizeof c + (ok ? sizeof *rec : text));
  memcpy(out.data(), &c, sizeof c);
  if (ok)
    memcpy(out.data() + sizeof c, rec, sizeof *rec);
  else if (text)
    memcpy(out.data() + sizeof c, msg.data(), text);
  return out;
}

bool decodeRegionAnswer(int peer, const std::vector<uint8_t>& bytes, IpcRecord* rec, const char* what) {
  int32_t c = -1;
  if (bytes.size() >= sizeof c) memcpy(&c, bytes.data(), sizeof c);
  if (c < 0 || c >= int32_t(loomNumResults))
    fail(loomRemoteError, "rank %d's answer for %s is garbage (%zu bytes)", peer, what, bytes.size());
  if (c == int32_t(loomInProgress)) return false;
  if (c == int32_t(loomSuccess)) {
    if (bytes.size() != sizeof c + sizeof *rec)
      fail(loomRemoteError, "rank %d's record for %s is %zu bytes, not %zu", peer, what, bytes.size() - sizeof c,
           sizeof *rec);
    memcpy(rec, bytes.data() + sizeof c, sizeof *rec);
    return true;
  }
  std::string text;
  for (size_t i = sizeof c; i < bytes.size(); ++i)  // printable only: it ends up in logs
    text.push_back(bytes[i] >= 0x20 && bytes[i] < 0x7f ? char(bytes[i]) : '?');
  fail(loomResult_t(c), "rank %d could not give %s: %s", peer, what, text.c_str());
}

DeviceComm::DeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver, const AllGather& allGather,
                       const DeviceCommOptions& options)
    : rank_(rank),
      nranks_(nranks),
      slotBytes_(options.slotBytes),
      oneShotBytes_(options.oneShotBytes),
      zeroCopy_(options.zeroCopy),
      publishable_(options.publishable),
      publishTo_(options.publishTo),
      unpublishTo_(options.unpublishTo),
      process_(options.process),
      drainTimeoutMs_(options.drainTimeoutMs),
      driver_(std::move(driver)),
      timeoutMs_(options.timeoutMs),
      probeAfterMs_(std::max<int64_t>(1, options.probeAfterMs)),
      reapTimeoutMs_(options.reapTimeoutMs),
      peerGone_(options.peerGone),
      onFailure_(options.onFailure) {
  const uint64_t process = options.process;
  fetchRegion_ = options.fetchRegion;
  if (options.sendSignatures && nranks > 1) {
    sigs_ = std::make_unique<SignatureCheck>(rank, (rank + nranks - 1) % nranks);
    p2pCheck_ = std::make_unique<P2PCheck>(rank, nranks);
    sendSignatures_ = options.sendSignatures;
  }
  out_.assign(size_t(nranks), nullptr);
  outRecords_.resize(size_t(nranks));
  in_.assign(size_t(nranks), nullptr);
  inRecords_.resize(size_t(nranks));
  if (slotBytes_ < 256 || slotBytes_ % 256)
    fail(loomInvalidArgument, "device slots of %zu bytes: need a multiple of 256", slotBytes_);
  graphSlotBytes_ = options.graphSlotBytes;
  if (graphSlotBytes_ % 256)
    fail(loomInvalidArgument, "graph lane slots of %zu bytes: need a multiple of 256 (or 0)", graphSlotBytes_);
  imports_ = std::make_unique<IpcImportCache>(*driver_, process);
  // The block: flags, cells, the collectives' window, then the graph
  // lane's flags and window.
  const size_t flagBytes = flagAreaBytes(nranks), cellBytes = zeroCopy_ ? cellAreaBytes(nranks) : 0,
               graphAt = flagBytes + cellBytes + streamWindowBytes(slotBytes_),
               blockBytes = graphAt + graphLaneBytes(nranks, graphSlotBytes_);
  blockBytes_ = blockBytes;
  // Everything below allocates, maps or creates streams: on this
  // communicator's device, whichever device the calling thread has current
  // (a config naming another device, a split from a thread on another).
  // (Left before undo() hands the driver to the reaper, which may free it.)
  std::optional<DeviceScope> current;
  current.emplace(*driver_);
  // The watchdog's reads of the whole flag area; first, so that a failure
  // here leaves nothing to free but the driver's own.
  driver_->prepareFlagReads(size_t(nranks) * kFlagCount);
  block_ = driver_->allocate(blockBytes);
  // A failed init: this rank's part undone, its block freed once no peer
  // that may have mapped it maps it any more.
  auto undo = [&] {
    current.reset();
    tracked_.clear();
    for (int r = 0; r < nranks; ++r)
      if (r != rank) tracked_.push_back(r);
    leaveMemory(false);
  };
  try {
    IpcRecord mine = exportRange(*driver_, block_, blockBytes, process);
    try {
      board_ = std::make_unique<MapBoard>(process);
      mine.board = board_->serial();
    } catch (const Error& e) {
      LOOM_WARN("DEVICE", "rank %d: %s; this rank's device memory is freed once the peers finished reading it, "
                "whether or not they still map it", rank, e.what());
    }
    records_.resize(size_t(nranks));
    allGather(&mine, sizeof mine, records_.data());
  } catch (...) {
    undo();
    throw;
  }
  // Every rank takes a hold on each peer's board before it maps the peer's
  // memory, then says in a last exchange whether it mapped everything and
  // whose boards it holds: a rank that failed fails every rank's init (its
  // peers would wait for it in their first collective), and a board is
  // unlinked once every peer that will ever open it has.
  struct Mapped {
    char error[248];  // empty: every peer's memory is mapped here
  };
  Mapped status{};
  std::vector<uint8_t> holding(size_t(nranks), 0);
  loomResult_t code = loomSuccess;
  try {
    auto* own = static_cast<uint64_t*>(block_);
    for (int r = 0; r < nranks; ++r) {
      const IpcRecord& rec = records_[size_t(r)];
      if (rec.bytes != blockBytes)
        fail(loomRemoteError, "rank %d's device window is %llu bytes, this rank's %zu: every rank must use the same "
             "slot sizes (LOOM_DEVICE_SLOT_BYTES, LOOM_DEVICE_GRAPH_SLOT_BYTES), zero-copy setting "
             "(LOOM_DEVICE_ZERO_COPY) and number of ranks", r,
             (unsigned long long)rec.bytes, blockBytes);
      if (r != rank && rec.board != 0) {
        try {
          holds_.push_back(std::make_unique<MapHold>(rec.process, rec.board, rank));
          holding[size_t(r)] = 1;
        } catch (const Error& e) {
          LOOM_WARN("DEVICE", "rank %d: %s; rank %d may free its device memory while this rank still maps it", rank,
                    e.what(), r);
        }
      }
      uint8_t* at = r == rank ? static_cast<uint8_t*>(block_) : imports_->import(r, rec);
      windows_.push_back(at + flagBytes + cellBytes);
      if (zeroCopy_) {
        const size_t row = kCellRowWords;
        cells_.push_back(own + flagBytes / sizeof(uint64_t) + size_t(r) * row);
        peerCells_.push_back(reinterpret_cast<uint64_t*>(at + flagBytes) + size_t(rank) * row);
      }
      flags_.push_back(own + size_t(r) * kFlagCount);
      peerFlags_.push_back(reinterpret_cast<uint64_t*>(at) + size_t(rank) * kFlagCount);
      if (r != rank) {
        flagCopies_.push_back(reinterpret_cast<uint64_t*>(at) + size_t(rank) * kFlagCount);
        for (int f = 0; f < kFlagCount; ++f) released_.push_back(flags_.back() + f);
      }
      if (graphSlotBytes_) {
        uint8_t* lane = at + graphAt;
        gwindows_.push_back(lane + flagBytes);
        gflags_.push_back(own + (graphAt + size_t(r) * kFlagCount * sizeof(uint64_t)) / sizeof(uint64_t));
        gpeerFlags_.push_back(reinterpret_cast<uint64_t*>(lane) + size_t(rank) * kFlagCount);
        if (r != rank) {
          gflagCopies_.push_back(gpeerFlags_.back());
          // Every flag of a peer's row, its signature included (the start gate).
          for (int f = 0; f < kFlagCount; ++f) greleased_.push_back(gflags_.back() + f);
        }
      }
    }
    // Its own copy last: seeing it set means the copies in the peers' memory were written before.
    flagCopies_.push_back(own + size_t(rank) * kFlagCount);
    if (graphSlotBytes_) gflagCopies_.push_back(gflags_[size_t(rank)]);
    allReleased_ = released_;
    allReleased_.insert(allReleased_.end(), greleased_.begin(), greleased_.end());
  } catch (const Error& e) {
    code = e.code();
    snprintf(status.error, sizeof status.error, "%s", e.what());
  } catch (const std::exception& e) {
    code = loomSystemError;
    snprintf(status.error, sizeof status.error, "%s", e.what());
  }
  if (code != loomSuccess && !status.error[0]) snprintf(status.error, sizeof status.error, "%s", "mapping failed");
  std::vector<uint8_t> mineLast(sizeof status + size_t(nranks)), all(mineLast.size() * size_t(nranks));
  memcpy(mineLast.data(), &status, sizeof status);
  memcpy(mineLast.data() + sizeof status, holding.data(), holding.size());
  try {
    allGather(mineLast.data(), mineLast.size(), all.data());
  } catch (...) {
    undo();
    throw;
  }
  if (board_) board_->unlink();
  if (code != loomSuccess) {
    undo();
    fail(code, "%s", status.error);
  }
  for (int r = 0; r < nranks; ++r) {
    const uint8_t* theirs = all.data() + size_t(r) * mineLast.size();
    Mapped st;
    memcpy(&st, theirs, sizeof st);
    st.error[sizeof st.error - 1] = 0;
    if (st.error[0]) {
      undo();
      fail(loomRemoteError, "rank %d could not set up its device window: %s", r, st.error);
    }
    if (r != rank && board_) {
      if (theirs[sizeof st + size_t(rank)])
        tracked_.push_back(r);
      else
        LOOM_INFO("DEVICE", "rank %d: rank %d holds no lock on %s; this rank frees its device memory once rank %d "
                  "finished reading it", rank, r, board_->path().c_str(), r);
    }
  }
  for (auto& held : cellsHeld_) held.assign(size_t(nranks), {});  // the cells start zeroed
  if (zeroCopy_ && options.freeHook && publishTo_)
    freeHook_ = addDeviceMemFreeHook([this](void* base) { unpublish(base); });
  movedMs_ = nowMs();
  watchdog_ = std::thread([this] { watch(); });
}

bool DeviceComm::drain() {
  const int64_t deadline = nowMs() + drainTimeoutMs_;
  std::lock_guard<std::mutex> g(mu_);
  bool sent = false;
  for (uint64_t k : p2p_.sent) sent |= k > 0;
  if (drainTimeoutMs_ == 0 && (round_ > 0 || sent || captured_.load() > 0)) return false;
  // A replay running here (the caller should have synchronised, but a
  // graph launched on another stream...): once it ends, every peer has
  // finished reading this rank's graph window (makeReplayable).
  while (captured_.load() > 0 && graphBusyNow()) {
    if (nowMs() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (round_ == 0 && !sent) return true;
  for (int r = 0; r < nranks_; ++r) {
    // A peer that holds this rank's board keeps its memory allocated until
    // it unmaps it, after its last read: no need to wait for it here.
    if (r == rank_ || std::find(tracked_.begin(), tracked_.end(), r) != tracked_.end()) continue;
    // Round g's done value is g + 1: the last round is round_ - 1.  A
    // receiver has copied out every chunk sent to it when it acked them all.
    while (driver_->readFlag(flags_[size_t(r)] + kFlagDone) < round_ ||
           (size_t(r) < p2p_.sent.size() &&
            driver_->readFlag(flags_[size_t(r)] + kFlagP2PAcked) < p2p_.sent[size_t(r)])) {
      if (nowMs() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return true;
}

namespace {

// What a destroyed IPC communicator leaves: its device memory, the peers'
// mappings (until its streams are done: a failed communicator's may still
// run) and the driver, with what the reaper needs to keep releasing, to see
// the streams finish and to see every peer unmap this rank's memory.
struct IpcRemains final : DeviceRemains {
  std::unique_ptr<DeviceDriver> driver;
  std::unique_ptr<IpcImportCache> imports;  // null once the peers' memory is unmapped here
  std::vector<std::unique_ptr<MapHold>> holds;
  std::unique_ptr<MapBoard> board;  // null: no board, the memory goes when the streams are done
  std::vector<int> tracked;         // the peers whose holds the board tracks
  std::vector<IpcRecord> records;
  void* block = nullptr;
  std::vector<void*> regions;                     // send/recv staging allocated here
  std::vector<std::pair<int, IpcRecord>> mapped;  // peers' staging mapped here
  std::vector<uint64_t*> released;
  const uint64_t* ownDone = nullptr;
  uint64_t target = 0;
  const uint64_t* ownP2PDone = nullptr;  // and the send/recv programs'
  uint64_t p2pTarget = 0;
  // The graph lane's (when calls were captured): this rank's busy flag
  // (a replay runs while it is set), the peer rows a release writes, and
  // how many holds CUDA graphs with its calls still keep
  // (DeviceDriver::retainOnCapture): while any does, a replay may start
  // whenever such a graph is launched, after the destroy too, and is
  // released then (its peers may be gone; its output is undefined), and
  // nothing is freed or unmapped.
  const uint64_t* graphBusy = nullptr;
  std::vector<uint64_t*> graphReleased;
  std::vector<uint64_t*> allReleased;  // both, as one batch (the CUDA driver skips a batch equal to the last)
  std::shared_ptr<std::atomic<int64_t>> graphHolds;
  bool eagerDone = false;  // the eager programs (done at once for a healthy destroy)
  bool replaying = false;  // a replay ran at the last step
  bool warnedRelease = false;
  bool streamsDone = false;
  std::vector<int> holding;  // who held the board at the last step (the warning)

  bool graphsHeld() const { return graphHolds && graphHolds->load() > 0; }
  // Releases once more until the streams are done (and while graphs that
  // captured its calls exist, whenever one replays), then unmaps the
  // peers' memory here; true once no peer maps this rank's.
  bool step() override {
    const bool held = graphsHeld();
    if (!streamsDone || held) {
      try {
        const int previous = driver->enter();
        try {
          if (!eagerDone)
            eagerDone = driver->readFlag(ownDone) >= target && driver->readFlag(ownP2PDone) >= p2pTarget;
          replaying = graphBusy && driver->readFlag(graphBusy) != 0;
          streamsDone = eagerDone && !replaying;
          const std::vector<uint64_t*>& batch = !eagerDone && replaying ? allReleased
                                                : !eagerDone             ? released
                                                                         : graphReleased;
          if (!streamsDone) driver->writeFlags(batch.data(), batch.size(), kReleasedFlag);
        } catch (...) {
          driver->leave(previous);
          throw;
        }
        driver->leave(previous);
      } catch (const Error& e) {
        if (!warnedRelease)  // once: it is tried again at every step
          LOOM_WARN("DEVICE", "rank %d: releasing a destroyed communicator's stream waits: %s", rank, e.what());
        warnedRelease = true;
      }
      if (!streamsDone || held) return false;
    }
    if (imports && deferBlocking) return false;  // unmapped at a later step (patient() holds it meanwhile)
    unmapPeers();
    if (board) holding = board->holders(tracked);
    return holding.empty();
  }
  // While graphs with its calls exist a replay may be launched any time
  // (after the destroy too) and wait for this thread's release: a free
  // elsewhere (cudaFree synchronises the device) would wait for it for
  // ever.  So nothing is freed meanwhile.
  bool releasing() const override { return (!eagerDone && !released.empty()) || replaying || graphsHeld(); }
  std::string waitingFor() const override {
    if (!streamsDone) return "its streams to finish";
    if (graphsHeld()) return "the CUDA graphs that captured its calls to be destroyed";
    if (imports) return "another destroyed communicator's streams, before it unmaps the peers' memory";
    std::string who;
    for (int r : holding) who += strf("%s%d", who.empty() ? "" : ", ", r);
    return strf("rank%s %s to unmap it (to destroy %s communicator%s)", holding.size() > 1 ? "s" : "", who.c_str(),
                holding.size() > 1 ? "their" : "its", holding.size() > 1 ? "s" : "");
  }
  void unmapPeers() {
    if (!imports) return;
    {
      QuietDeviceScope current(*driver, rank, "unmap the peers' memory");
      for (int r = 0; r < int(records.size()); ++r)
        if (r != rank) imports->release(r, records[size_t(r)]);
      for (const auto& [r, rec] : mapped) imports->release(r, rec);
      imports.reset();
    }
    holds.clear();  // the peers may free what this rank mapped
  }
  void free() override {
    unmapPeers();
    {
      QuietDeviceScope current(*driver, rank, "free its memory");
      for (void* p : regions) {
        try {
          driver->release(p);
        } catch (const Error&) {  // nothing to tell from here
        }
      }
      try {
        driver->release(block);
      } catch (const Error&) {  // nothing to tell from here
      }
    }
    board.reset();
    driver.reset();
  }
  // Once its streams are done it waits for the peers however long it takes
  // (a peer may keep its communicator for hours), and for the graphs that
  // captured its calls (they may live as long); never given up on.
  bool patient() const override { return streamsDone || (graphsHeld() && eagerDone); }
  void forget() override {
    if (board) board->unlink();
  }
};

// One thread for the process, started by the first communicator it gets.
class Reaper {
 public:
  ~Reaper() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // The process is exiting: what is left stays allocated (the device
    // goes with the process), reachable from here.
    static auto* kept = new std::vector<std::unique_ptr<DeviceRemains>>();
    for (auto& r : list_) {
      r->forget();
      kept->push_back(std::move(r));
    }
    std::lock_guard<std::mutex> k(keptMu_);
    for (auto& r : kept_) kept->push_back(std::move(r));
  }
  void add(std::unique_ptr<DeviceRemains> r) {
    std::lock_guard<std::mutex> g(mu_);
    list_.push_back(std::move(r));  // kept (never freed) even if the thread cannot start
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_all();
  }
  // Given up on: never freed (a stream may still touch it).
  void giveUp(std::unique_ptr<DeviceRemains> r) {
    LOOM_WARN("DEVICE", "rank %d: a destroyed communicator's device memory stays allocated: it waited for %s "
              "in vain", r->rank, r->waitingFor().c_str());
    r->forget();
    std::lock_guard<std::mutex> k(keptMu_);
    kept_.push_back(std::move(r));
  }
  // Past its deadline but patient: told once, then polled slowly.
  static void overdue(DeviceRemains& r) {
    if (r.warned) return;
    r.warned = true;
    LOOM_WARN("DEVICE", "rank %d: a destroyed communicator's device memory stays allocated while it waits for %s", r.rank,
              r.waitingFor().c_str());
  }
  size_t pending() {
    std::lock_guard<std::mutex> g(mu_);
    return list_.size() + busy_;
  }
  bool waitEmpty(int64_t timeoutMs) {
    std::unique_lock<std::mutex> g(mu_);
    return cv_.wait_for(g, std::chrono::milliseconds(timeoutMs), [&] { return list_.empty() && !busy_; });
  }

 private:
  void loop() {
    relaxCudaCaptureModeOnThisThread();  // its releases and frees must not break a graph capture
    std::unique_lock<std::mutex> g(mu_);
    while (!stop_) {
      if (list_.empty()) {
        cv_.wait(g, [&] { return stop_ || !list_.empty(); });
        continue;
      }
      std::vector<std::unique_ptr<DeviceRemains>> work;
      work.swap(list_);
      busy_ = work.size();
      g.unlock();
      std::vector<std::unique_ptr<DeviceRemains>> keep, ready;
      bool urgent = false;  // some stream may still need releasing: poll every millisecond
      const int64_t now = nowMs();
      bool releasingNow = false;  // as at the start of this round (see DeviceRemains::deferBlocking)
      for (const auto& r : work) releasingNow = releasingNow || r->releasing();
      for (auto& r : work) {
        r->deferBlocking = releasingNow;
        if (r->warned && now < r->nextPollMs) {
          keep.push_back(std::move(r));
        } else if (r->step()) {
          ready.push_back(std::move(r));
        } else if (const int64_t t = nowMs(); t > r->deadline && !r->patient()) {
          giveUp(std::move(r));
        } else {
          if (t > r->deadline) {
            overdue(*r);
            r->nextPollMs = t + 100;
          }
          urgent |= !r->warned;
          keep.push_back(std::move(r));
        }
      }
      // Frees synchronise the device: none while a kept remains' streams
      // may still need this thread's next release (DeviceRemains::releasing),
      // or this thread could wait in the free for a stream only it can let
      // go.  A remains that never finishes is given up at its deadline, and
      // the frees go on then.
      bool releasing = false;
      for (const auto& r : keep) releasing = releasing || r->releasing();
      for (auto& r : ready) {
        if (releasing)
          keep.push_back(std::move(r));  // its step() says done again next time
        else
          r->free();
      }
      g.lock();
      for (auto& r : keep) list_.push_back(std::move(r));
      busy_ = 0;
      cv_.notify_all();
      if (!list_.empty()) cv_.wait_for(g, std::chrono::milliseconds(urgent ? 1 : 20), [&] { return stop_; });
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<DeviceRemains>> list_;
  size_t busy_ = 0;
  bool stop_ = false;
  std::thread thread_;
  std::mutex keptMu_;
  std::vector<std::unique_ptr<DeviceRemains>> kept_;  // given up on: never freed
};

Reaper& reaper() {
  static Reaper r;
  return r;
}

}  // namespace

size_t deviceRemainsPending() { return reaper().pending(); }

void reapDeviceRemains(std::unique_ptr<DeviceRemains> r) {
  if (r->step()) {
    r->free();
    return;
  }
  if (r->deadline <= nowMs() && !r->patient()) {
    reaper().giveUp(std::move(r));
    return;
  }
  const int rank = r->rank;
  try {
    reaper().add(std::move(r));
  } catch (const std::exception& e) {  // no thread for the reaper: kept, never freed under a user
    LOOM_WARN("DEVICE", "rank %d: cannot start the reaper thread: %s", rank, e.what());
  }
}

void DeviceCollectives::checkCapture(void* stream, bool /*p2p*/) const {
  fail(loomInvalidUsage,
       "stream %p is being captured into a CUDA graph, but the %s path cannot capture loom's calls (a replay would "
       "repeat the capture's flag values and not synchronise with the peers): issue them outside the capture, or "
       "use the ipc path (LOOM_DEVICE_PATH=ipc: the ranks on one host)",
       stream, pathName());
}

void DeviceComm::checkCapture(void* stream, bool p2p) const {
  if (!graphSlotBytes_)
    fail(loomInvalidUsage,
         "stream %p is being captured into a CUDA graph, but this communicator has no graph lane "
         "(LOOM_DEVICE_GRAPH_SLOT_BYTES=0 when it was made)",
         stream);
  if (p2p && graphP2PRegionBytes(nranks_, graphSlotBytes_) == 0)
    fail(loomInvalidUsage,
         "stream %p is being captured into a CUDA graph, but this communicator's graph lane (2 x %zu B, "
         "LOOM_DEVICE_GRAPH_SLOT_BYTES) is too small to give each of its %d ranks a send/recv region of 256 B",
         stream, graphSlotBytes_, nranks_);
}

IpcRecord DeviceCollectives::p2pRegionFor(int reader) {
  fail(loomRemoteError, "rank %d asked this %s communicator (%s path) for a send/recv region, which it has none of",
       reader, deviceName(), pathName());
}
uint64_t DeviceCollectives::importPublished(int owner, const IpcRecord&) {
  fail(loomRemoteError, "rank %d published device memory to this %s communicator (%s path), which reads none in place",
       owner, deviceName(), pathName());
}
void DeviceCollectives::forgetPublished(int, const IpcRecord&) {}
bool waitDeviceRemains(int64_t timeoutMs) { return reaper().waitEmpty(timeoutMs); }

void DeviceComm::stopWatchdog() {
  {
    std::lock_guard<std::mutex> g(wmu_);
    stop_ = true;
  }
  wcv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  finishSignatures();
}

void DeviceComm::finishSignatures() {
  // A healthy communicator going away: what the watchdog had not sent goes
  // now, and the previous rank's last batches get a moment to arrive, so
  // that a mismatch in the last calls before destroy is still reported.
  if (!sigs_ || failed() || !sendSignatures_) return;
  int64_t next;
  for (std::vector<uint8_t>& b : sigs_->due(nowMs(), true, &next)) sendSignatures_((rank_ + 1) % nranks_, std::move(b));
  for (auto& [peer, b] : p2pCheck_->due(nowMs(), true, &next)) sendSignatures_(peer, std::move(b));
  const int64_t deadline = nowMs() + SignatureCheck::kFinishMs;
  sigs_->awaitChecked(deadline);
  p2pCheck_->awaitChecked(deadline);
  std::string mismatch = sigs_->mismatch();
  if (mismatch.empty()) mismatch = p2pCheck_->mismatch();
  if (!mismatch.empty()) {
    failFromWatchdog(loomInvalidUsage, mismatch, -1);
    release();  // the watchdog is gone: release this rank's waits here
  } else {
    if (sigs_->unchecked() > 0)
      LOOM_INFO("DEVICE", "rank %d: the last %zu collectives were not compared with rank %d's before destroy",
                rank_, sigs_->unchecked(), (rank_ + nranks_ - 1) % nranks_);
    if (p2pCheck_->unchecked() > 0)
      LOOM_INFO("DEVICE", "rank %d: %zu receives were not compared with their senders' sizes before destroy",
                rank_, p2pCheck_->unchecked());
  }
}

DeviceComm::~DeviceComm() {
  // The release stream, the drain's reads, the unmaps: on this device.  Left
  // before leaveMemory hands the driver to the reaper, which may free it.
  std::optional<DeviceScope> current;
  current.emplace(*driver_);
  if (freeHook_) removeDeviceMemFreeHook(freeHook_);
  stopWatchdog();
  {
    std::lock_guard<std::mutex> g(p2pMu_);
    closing_ = true;  // no region is made from here on
  }
  bool running = failed() || drainTimeoutMs_ == 0;
  if (!running) {
    // The caller synchronised its own streams (as NCCL requires before
    // ncclCommDestroy), but a peer may still be reading this rank's window
    // for the last round: wait for it.
    try {
      if (!drain())
        LOOM_WARN("DEVICE", "rank %d: peers did not finish reading this rank's window within %lld ms; freeing it "
                  "once they unmapped it", rank_, (long long)drainTimeoutMs_);
    } catch (const Error& e) {
      LOOM_WARN("DEVICE", "rank %d: reading the peers' flags failed: %s", rank_, e.what());
    }
    // A replay still running here: it waits for a peer that never
    // launched its graph (the caller was to destroy after the last
    // replay).  Released from now on, as a failed communicator's streams
    // are, and the memory kept until it ends.
    if (captured_.load() > 0 && replaying()) {
      LOOM_WARN("DEVICE", "rank %d: destroyed while a replay of a captured call still runs on it; releasing it (its "
                "output is undefined) and keeping the memory until it ends", rank_);
      running = true;
    }
    // The peers unmap what this rank published (the caller may free it
    // once the communicator is gone).  A failed communicator's peers may
    // still run programs that read it: they unmap it when they go.
    if (!running) unpublishAll();
  }
  // Failed or abandoned (running): never waits for the peers, but never
  // frees what a stream of this rank may still touch either.
  current.reset();
  leaveMemory(running);
}

void DeviceComm::leaveMemory(bool streamsMayRun) {
  auto rest = std::make_unique<IpcRemains>();
  rest->rank = rank_;
  rest->records = records_;
  rest->block = block_;
  for (void* p : out_)
    if (p) rest->regions.push_back(p);
  for (int r = 0; r < nranks_; ++r)
    if (in_[size_t(r)] && r != rank_) rest->mapped.emplace_back(r, inRecords_[size_t(r)]);
  rest->board = std::move(board_);
  rest->tracked = tracked_;
  rest->holds = std::move(holds_);
  rest->imports = std::move(imports_);
  rest->deadline = reapTimeoutMs_ <= 0 ? 0 : nowMs() + reapTimeoutMs_;
  rest->streamsDone = rest->eagerDone = !streamsMayRun;
  if (streamsMayRun) {
    rest->released = released_;
    rest->ownDone = flags_[size_t(rank_)] + kFlagDone;
    rest->target = enqueued_.load();
    rest->ownP2PDone = flags_[size_t(rank_)] + kFlagP2PDone;
    rest->p2pTarget = p2pEnqueued_.load();
  }
  // A capture that failed half-way may have left a graph holding it too
  // (a failed init has no lane set up: nothing ran on it).
  if (graphSlotBytes_ && gflags_.size() == size_t(nranks_)) {
    rest->graphBusy = gflags_[size_t(rank_)] + kFlagGraphBusy;
    rest->graphReleased = greleased_;
    rest->allReleased = allReleased_;
    rest->graphHolds = graphHolds_;
  }
  // Freed now if no peer maps it any more, else once none does.
  rest->driver = std::move(driver_);
  reapDeviceRemains(std::move(rest));
}

bool DeviceComm::markFailed(loomResult_t code, const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (failCode_ != loomSuccess) return false;
    failCode_ = code == loomSuccess ? loomInternalError : code;
    failed_ = msg;
  }
  failedFlag_.store(true);
  {
    std::lock_guard<std::mutex> g(wmu_);
    wake_ = true;
  }
  wcv_.notify_all();
  return true;
}

loomResult_t DeviceComm::failure(std::string* msg) const {
  std::lock_guard<std::mutex> g(mu_);
  if (msg) *msg = failed_;
  return failCode_;
}

bool DeviceComm::programsDone() {
  return driver_->readFlag(flags_[size_t(rank_)] + kFlagDone) >= enqueued_.load() &&
         driver_->readFlag(flags_[size_t(rank_)] + kFlagP2PDone) >= p2pEnqueued_.load();
}

void DeviceComm::release() { driver_->writeFlags(released_.data(), released_.size(), kReleasedFlag); }

bool DeviceComm::graphBusyNow() { return driver_->readFlag(gflags_[size_t(rank_)] + kFlagGraphBusy) != 0; }

bool DeviceComm::replaying() {
  if (captured_.load() == 0) return false;
  DeviceScope current(*driver_);
  return graphBusyNow();
}

std::vector<uint64_t> DeviceComm::graphFlags() {
  if (!graphSlotBytes_ || gflags_.size() != size_t(nranks_)) return {};
  DeviceScope current(*driver_);
  std::vector<uint64_t> all(size_t(nranks_) * kFlagCount);
  driver_->readFlags(gflags_[0], all.size(), all.data());  // the rows are contiguous
  return all;
}

int64_t DeviceComm::checkSignatures() {
  if (!sigs_) return 100;
  std::string mismatch = sigs_->mismatch();
  if (mismatch.empty()) mismatch = p2pCheck_->mismatch();
  if (!mismatch.empty()) {
    failFromWatchdog(loomInvalidUsage, mismatch, -1);
    return 1;
  }
  if (const size_t skipped = sigs_->skipped(); skipped > sigSkippedWarned_) {
    LOOM_WARN("DEVICE", "rank %d: the mismatch check skipped %zu collectives so far (a batch lost, or one rank "
              "more than %zu collectives ahead of the next)",
              rank_, skipped, SignatureCheck::kKeep);
    sigSkippedWarned_ = skipped * 2;  // warn again only as it grows
  }
  if (const size_t skipped = p2pCheck_->skipped(); skipped > p2pSkippedWarned_) {
    LOOM_WARN("DEVICE", "rank %d: the send/recv mismatch check skipped %zu receives so far (a batch lost, or a "
              "sender more than %zu messages ahead of this rank or behind it)",
              rank_, skipped, P2PCheck::kKeep);
    p2pSkippedWarned_ = skipped * 2;
  }
  int64_t next, p2pNext;
  for (std::vector<uint8_t>& b : sigs_->due(nowMs(), false, &next))
    sendSignatures_((rank_ + 1) % nranks_, std::move(b));
  for (auto& [peer, b] : p2pCheck_->due(nowMs(), false, &p2pNext)) sendSignatures_(peer, std::move(b));
  return std::min(next, p2pNext);
}

void DeviceComm::onPeerSignatures(int from, const std::vector<uint8_t>& bytes) {
  if (!sigs_) return;
  if (P2PCheck::isP2PBatch(bytes)) {  // a peer's sends to this rank
    p2pCheck_->receive(from, bytes);
    if (p2pCheck_->mismatch().empty()) return;
  } else {
    if (from != (rank_ + nranks_ - 1) % nranks_) return;
    sigs_->receive(bytes);
    if (sigs_->mismatch().empty()) return;
  }
  {
    std::lock_guard<std::mutex> w(wmu_);
    wake_ = true;
  }
  wcv_.notify_all();
}

void DeviceComm::failFromWatchdog(loomResult_t code, const std::string& msg, int peer) {
  if (!markFailed(code, msg)) return;
  LOOM_WARN("DEVICE", "%s", msg.c_str());
  if (onFailure_) onFailure_(Error(code, msg, peer));
}

int64_t DeviceComm::checkProgress(int64_t now) {
  const uint64_t target = enqueued_.load(), p2pTarget = p2pEnqueued_.load();
  if ((target == 0 && p2pTarget == 0) || (!peerGone_ && timeoutMs_.load() <= 0)) {  // nothing to watch
    movedMs_ = probedMs_ = now;
    return 100;
  }
  enterDevice();
  std::vector<uint64_t> all(size_t(nranks_) * kFlagCount);
  driver_->readFlags(flags_[0], all.size(), all.data());  // the rows are contiguous
  auto at = [&](int r, int f) { return all[size_t(r) * kFlagCount + size_t(f)]; };
  if (at(rank_, kFlagDone) >= target && at(rank_, kFlagP2PDone) >= p2pTarget) {
    movedMs_ = probedMs_ = now;
    return 100;  // idle: run() wakes the watchdog
  }
  // Send/recv chunks this rank expects from each peer, and acks for its own.
  std::vector<uint64_t> p2pSent, p2pRecvd;
  {
    std::lock_guard<std::mutex> g(mu_);
    p2pSent = p2p_.sent;
    p2pRecvd = p2p_.recvd;
  }
  std::vector<uint64_t> seen(static_cast<size_t>(nranks_));  // per rank: its highest flag here
  uint64_t sum = 0;
  for (int r = 0; r < nranks_; ++r)
    for (int f = 0; f < kFlagCount; ++f) {
      const uint64_t v = at(r, f);
      sum += v;
      if (f < kRoundFlags) seen[size_t(r)] = std::max(seen[size_t(r)], v);  // rounds, not chunk counts
    }
  if (sum != seenSum_) {
    seenSum_ = sum;
    movedMs_ = probedMs_ = now;
  }
  const int64_t still = now - movedMs_;
  // The peers this rank's streams may wait for: behind the last round.
  std::vector<int> behind;
  uint64_t least = ~uint64_t(0);
  for (int r = 0; r < nranks_; ++r)
    if (r != rank_ && seen[size_t(r)] < target) least = std::min(least, seen[size_t(r)]);
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    const bool p2pBehind = (size_t(r) < p2pSent.size() && at(r, kFlagP2PAcked) < p2pSent[size_t(r)]) ||
                           (size_t(r) < p2pRecvd.size() && at(r, kFlagP2PSent) < p2pRecvd[size_t(r)]);
    if (seen[size_t(r)] < target || p2pBehind) behind.push_back(r);
  }
  if (least == ~uint64_t(0)) least = 0;
  if (peerGone_ && still >= probeAfterMs_ && now - probedMs_ >= probeAfterMs_) {
    probedMs_ = now;
    for (int r : behind) {
      std::string why;
      if (peerGone_(r, &why)) {
        failFromWatchdog(loomRemoteError,
                         strf("rank %d: rank %d is gone (%s) while this rank's %s streams waited for it (its flags "
                              "reached round %llu, this rank's %llu, of %llu enqueued)",
                              rank_, r, why.c_str(), driver_->name(), (unsigned long long)seen[size_t(r)],
                              (unsigned long long)seen[size_t(rank_)], (unsigned long long)target),
                         r);
        return 1;
      }
    }
  }
  const int64_t timeoutMs = timeoutMs_.load();
  if (timeoutMs > 0 && still >= timeoutMs) {
    std::string who;
    for (int r : behind)
      if (seen[size_t(r)] == least) who += strf("%s%d", who.empty() ? "" : ", ", r);
    if (who.empty())  // behind on send/recv only
      for (int r : behind) who += strf("%s%d", who.empty() ? "" : ", ", r);
    failFromWatchdog(loomTimeout,
                     strf("rank %d: no progress on %s:%d for %lld ms (LOOM_TIMEOUT_MS): this rank's streams wait "
                          "for rank %s (its flags reached round %llu, this rank's %llu, of %llu enqueued)",
                          rank_, driver_->name(), driver_->device(), (long long)still,
                          who.empty() ? "?" : who.c_str(), (unsigned long long)least,
                          (unsigned long long)seen[size_t(rank_)], (unsigned long long)target),
                     behind.empty() ? -1 : behind.front());
    return 1;
  }
  return 5;
}

int64_t DeviceComm::checkGraphProgress(int64_t now) {
  const int64_t timeoutMs = timeoutMs_.load();
  enterDevice();
  std::vector<uint64_t> all(size_t(nranks_) * kFlagCount);
  driver_->readFlags(gflags_[0], all.size(), all.data());  // the rows are contiguous
  auto at = [&](int r, int f) { return all[size_t(r) * kFlagCount + size_t(f)]; };
  const uint64_t mine = at(rank_, kFlagGraphBusy);  // this replay's signature
  if (mine == 0) {  // no replay here: a launch starts one any time
    gMovedMs_ = gProbedMs_ = now;
    return 100;
  }
  uint64_t sum = 0;
  for (uint64_t v : all) sum += v;
  if (sum != gSeenSum_) {
    gSeenSum_ = sum;
    gMovedMs_ = gProbedMs_ = now;
  }
  const int64_t still = now - gMovedMs_;
  // Mismatched captured calls stop every rank involved (makeReplayable's
  // start gate), with a peer's signature here that differs from this
  // rank's.  Only before this rank's reset: after it, a peer may already
  // have started its next call (and written its next signature) while this
  // rank waits for a slow one's reset.
  // A captured send/recv has no start gate and no signature: its
  // partners alone synchronise with it (compileGraphP2PProgram).
  const bool p2p = mine >= kGraphP2PBusy && mine < kReleasedFlag;
  if (!p2p && still >= kGraphMismatchMs && at(rank_, kFlagGraphReset) == 0)
    for (int r = 0; r < nranks_; ++r) {
      const uint64_t theirs = at(r, kFlagGraphSig);
      if (r == rank_ || theirs == 0 || theirs == mine || theirs >= kReleasedFlag) continue;
      std::string what = "?";
      {
        std::lock_guard<std::mutex> g(mu_);
        auto it = graphSigs_.find(mine);
        if (it != graphSigs_.end()) what = it->second;
      }
      failFromWatchdog(loomInvalidUsage,
                       strf("rank %d: mismatched captured calls (CUDA graph replays): this rank replays %s, rank %d "
                            "a different call (signature %#llx, this rank's %#llx); every rank must capture the same "
                            "calls and launch their graphs in the same order",
                            rank_, what.c_str(), r, (unsigned long long)theirs, (unsigned long long)mine),
                       r);
      return 1;
    }
  // A captured send/recv at a sender's size gate with that sender's value
  // there differing from its own: a receive of another size (the gate
  // holds it before it reads anything).  Only once the flags have been
  // still for a while, so that the rows read are one moment's.
  const uint64_t gate = at(rank_, kFlagGraphMessages);  // the sender + 1 while at its gate
  if (p2p && still >= kGraphMismatchMs && gate >= 1 && gate <= uint64_t(nranks_)) {
    GraphP2PCall call;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = graphP2P_.find(mine);
      if (it != graphP2P_.end()) call = it->second;
    }
    const int q = int(gate - 1);
    const uint64_t theirs = at(q, kFlagGraphMessages);
    const uint64_t expect = size_t(q) < call.recvMessages.size() ? call.recvMessages[size_t(q)] : 0;
    if (q != rank_ && expect != 0 && theirs != 0 && theirs != expect && theirs < kGraphMessagesSum) {
      const std::vector<uint64_t>& sizes = call.recvSizes[size_t(q)];
      uint64_t total = 0;
      for (uint64_t v : sizes) total += v;
      const uint64_t theirBytes = graphP2PMessagesBytes(theirs);
      const std::string mineText =
          sizes.size() == 1 ? strf("one message of %llu bytes", (unsigned long long)total)
                            : strf("%zu messages, %llu bytes in all", sizes.size(), (unsigned long long)total);
      const std::string theirText = theirBytes == graphP2PMessagesBytes(expect)
                                        ? strf("other messages of the same %llu bytes in all",
                                               (unsigned long long)theirBytes)
                                        : strf("%llu bytes in all", (unsigned long long)theirBytes);
      failFromWatchdog(loomInvalidUsage,
                       strf("rank %d: mismatched captured send/recv (CUDA graph replays): rank %d's sends to this "
                            "rank in the call it replays are %s, but this rank replays %s whose receives from it "
                            "are %s; a receive must have the size of its send (a pair's messages match in order), "
                            "and every rank must launch the graphs with this communicator's calls in the same order",
                            rank_, q, theirText.c_str(), call.what.c_str(), mineText.c_str()),
                       q);
      return 1;
    }
  }
  if (!peerGone_ && timeoutMs <= 0) return 5;
  // How far each peer's replay got as seen here: reset, end, started (its
  // signature came), then its round flags.  The peers furthest behind are
  // the ones waited for.
  auto progress = [&](int r) {
    return (at(r, kFlagGraphReset) ? uint64_t(1) << 62 : 0) + (at(r, kFlagGraphEnd) ? uint64_t(1) << 61 : 0) +
           (at(r, kFlagGraphSig) ? uint64_t(1) << 60 : 0) +
           std::min(std::max({at(r, kFlagInput), at(r, kFlagReduced), at(r, kFlagDone)}), uint64_t(1) << 59);
  };
  uint64_t least = ~uint64_t(0);
  for (int r = 0; r < nranks_; ++r)
    if (r != rank_) least = std::min(least, progress(r));
  std::vector<int> behind;
  std::string what;
  if (p2p) {  // its partners: which one is behind, the flags cannot tell (a finished pair's read as zero)
    std::lock_guard<std::mutex> g(mu_);
    auto it = graphP2P_.find(mine);
    if (it != graphP2P_.end()) behind = it->second.partners, what = it->second.what;
  } else {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_ && progress(r) == least) behind.push_back(r);
  }
  if (peerGone_ && still >= probeAfterMs_ && now - gProbedMs_ >= probeAfterMs_) {
    gProbedMs_ = now;
    for (int r = 0; r < nranks_; ++r) {
      std::string why;
      // A captured send/recv waits for its partners only.
      if (p2p && std::find(behind.begin(), behind.end(), r) == behind.end()) continue;
      if (r != rank_ && peerGone_(r, &why)) {
        failFromWatchdog(loomRemoteError,
                         strf("rank %d: rank %d is gone (%s) while this rank's %s streams replayed a captured call "
                              "(a CUDA graph) with it",
                              rank_, r, why.c_str(), driver_->name()),
                         r);
        return 1;
      }
    }
  }
  if (timeoutMs > 0 && still >= timeoutMs) {
    std::string who;
    for (int r : behind) who += strf("%s%d", who.empty() ? "" : ", ", r);
    if (p2p)
      failFromWatchdog(loomTimeout,
                       strf("rank %d: a replay of a captured call (a CUDA graph) made no progress on %s:%d for %lld "
                            "ms (LOOM_TIMEOUT_MS): this rank replays %s and its streams wait for one of its partners "
                            "(rank %s); every rank must launch the graphs with this communicator's calls in the same "
                            "order",
                            rank_, driver_->name(), driver_->device(), (long long)still,
                            what.empty() ? "a send/recv group" : what.c_str(), who.empty() ? "?" : who.c_str()),
                       behind.empty() ? -1 : behind.front());
    else
      failFromWatchdog(loomTimeout,
                       strf("rank %d: a replay of a captured call (a CUDA graph) made no progress on %s:%d for %lld "
                            "ms (LOOM_TIMEOUT_MS): this rank's streams wait for rank %s (every rank must launch the "
                            "graphs with this communicator's calls in the same order)",
                            rank_, driver_->name(), driver_->device(), (long long)still,
                            who.empty() ? "?" : who.c_str()),
                       behind.empty() ? -1 : behind.front());
    return 1;
  }
  return 5;
}

void DeviceComm::enterDevice() {
  if (entered_) return;
  previousDevice_ = driver_->enter();
  entered_ = true;
}

void DeviceComm::watch() {
  relaxCudaCaptureModeOnThisThread();  // its reads must not break another thread's graph capture
  bool released = false;  // the streams finished after the release
  bool warned = false;
  std::unique_lock<std::mutex> lk(wmu_);
  while (!stop_) {
    wake_ = false;
    lk.unlock();
    int64_t sleepMs = 100;
    try {
      if (failedFlag_.load()) {
        // Repeated until the streams are done: a live peer's program may
        // still write a lower value over a released flag.
        // A replay may start any time a graph is launched, and zeroes its
        // flags as it goes: released whenever one runs, for as long as the
        // communicator lives.  One batch per step (the CUDA driver skips
        // one equal to the last, so releases do not pile up behind a
        // blocked wait).
        enterDevice();
        const bool replay = captured_.load() > 0 && graphBusyNow();
        if (!released || replay) {
          const std::vector<uint64_t*>& batch = !released && replay ? allReleased_ : replay ? greleased_ : released_;
          driver_->writeFlags(batch.data(), batch.size(), kReleasedFlag);
          if (!released) released = programsDone();
        }
        sleepMs = !released || replay ? 1 : captured_.load() > 0 ? 10 : 100;
      } else {
        sleepMs = checkSignatures();
        if (!failedFlag_.load()) sleepMs = std::min(sleepMs, checkProgress(nowMs()));
        if (!failedFlag_.load() && captured_.load() > 0) sleepMs = std::min(sleepMs, checkGraphProgress(nowMs()));
      }
    } catch (const Error& e) {
      // A CUDA error in the watchdog's own reads is the device's (a sticky
      // error, an illegal address in some kernel: every later call fails
      // alike), not a hiccup: the communicator fails with it, so that its
      // callers and its peers hear of it instead of timing out.
      if (e.code() == loomUnhandledCudaError && !failedFlag_.load())
        failFromWatchdog(e.code(), strf("rank %d: the device failed: %s", rank_, e.what()), -1);
      else if (!warned)
        LOOM_WARN("DEVICE", "rank %d: device watchdog: %s", rank_, e.what());
      warned = true;  // once: it tries again every 100 ms
    }
    lk.lock();
    if (!stop_ && !wake_) wcv_.wait_for(lk, std::chrono::milliseconds(sleepMs), [&] { return stop_ || wake_; });
  }
  lk.unlock();
  if (entered_) driver_->leave(previousDevice_);
}

bool DeviceComm::serves(Collective coll) {
  switch (coll) {
    case Collective::AllReduce:
    case Collective::ReduceScatter:
    case Collective::AllGather:
    case Collective::Broadcast:
    case Collective::Reduce:
    case Collective::AllToAll:
    case Collective::Gather:
    case Collective::Scatter:
    case Collective::P2P:
      return true;
  }
  return false;
}

bool DeviceComm::failed() const {
  std::lock_guard<std::mutex> g(mu_);
  return failCode_ != loomSuccess;
}

uint64_t DeviceComm::round() const {
  std::lock_guard<std::mutex> g(mu_);
  return round_;
}

namespace {

void checkBuffer(const DeviceDriver& driver, const char* what, const void* p) {
  const int d = driver.pointerDevice(p);
  if (d < 0)
    fail(loomInvalidArgument,
         "%s %p is host memory, but this communicator runs on %s:%d: pass device memory (a device communicator "
         "does not stage host buffers, as NCCL does not)",
         what, p, driver.name(), driver.device());
  if (d != driver.device())
    fail(loomInvalidArgument, "%s %p is memory of %s:%d, but this communicator runs on %s:%d", what, p,
         driver.name(), d, driver.name(), driver.device());
}

}  // namespace

DeviceOpShape deviceOpShape(const OpDesc& op, int rank, int nranks) {
  const size_t bytes = op.count * dtypeSize(op.dtype), N = size_t(nranks);
  const bool root = rank == op.root;
  DeviceOpShape s;
  s.sendBytes = s.recvBytes = bytes;
  switch (op.coll) {
    case Collective::ReduceScatter: s.sendBytes *= N; break;
    case Collective::AllGather: s.recvBytes *= N; break;
    case Collective::Broadcast: s.needSend = root; break;
    case Collective::Reduce: s.needRecv = root; break;
    case Collective::AllToAll: s.sendBytes *= N, s.recvBytes *= N; break;
    case Collective::Gather: s.recvBytes *= N, s.needRecv = root; break;
    case Collective::Scatter: s.sendBytes *= N, s.needSend = root; break;
    case Collective::P2P: s.needSend = op.isSend, s.needRecv = !op.isSend; break;
    default: break;
  }
  return s;
}

void checkDeviceOp(const DeviceDriver& driver, const OpDesc& op, int rank, int nranks) {
  if (!DeviceComm::serves(op.coll))
    fail(loomInvalidUsage, "%s is not implemented on %s communicators yet", collectiveName(op.coll), driver.name());
  if (op.tagged)
    fail(loomInvalidUsage,
         "tagged send/recv (loomSendTagged/loomRecvTagged) is not supported on %s communicators: a receive is "
         "enqueued on the stream before the sender's tags are known, so it cannot match by tag (use "
         "loomSend/loomRecv, matched in issue order per pair)",
         driver.name());
  const DeviceOpShape sh = deviceOpShape(op, rank, nranks);
  if (op.count > 0) {
    if (sh.needSend) checkBuffer(driver, "sendbuff", op.sendbuf);
    if (sh.needRecv) checkBuffer(driver, "recvbuff", op.recvbuf);
    // The reduction kernels load and store whole elements: a buffer that
    // is not a multiple of its element's size from an aligned address
    // would fault on the device (a sticky misaligned-address error that
    // kills every communicator of the process) rather than fail here.
    const size_t esz = dtypeSize(op.dtype);
    auto aligned = [&](const char* what, const void* p) {
      if (reinterpret_cast<uintptr_t>(p) % esz != 0)
        fail(loomInvalidArgument, "%s %p is not aligned to its %s elements (%zu bytes): the device reduces whole "
             "elements", what, p, dtypeName(op.dtype), esz);
    };
    if (op.coll == Collective::AllReduce || op.coll == Collective::ReduceScatter || op.coll == Collective::Reduce) {
      if (sh.needSend) aligned("sendbuff", op.sendbuf);
      if (sh.needRecv) aligned("recvbuff", op.recvbuf);
    }
  }
}

void DeviceComm::check(const OpDesc& op) const { checkDeviceOp(*driver_, op, rank_, nranks_); }

std::string DeviceComm::describe() const {
  const DeviceMemoryStats m = memoryStats();
  std::string s = strf("  device %s:%d, ipc path: %zu B allocated at init (flags and the collectives' window); "
                       "send/recv staging: %zu region%s allocated here (%zu B), %zu of peers mapped here\n",
                       deviceName(), device(), m.blockBytes, m.regionsOut, m.regionsOut == 1 ? "" : "s",
                       m.regionBytesOut, m.regionsIn);
  if (zeroCopy_)
    s += strf("  zero-copy: %zu allocation%s published, %zu of peers mapped here\n", m.published,
              m.published == 1 ? "" : "s", m.publishedIn);
  else
    s += "  zero-copy: off (LOOM_DEVICE_ZERO_COPY=0)\n";
  if (graphSlotBytes_)
    s += strf("  graph lane: 2 x %zu B slots, %llu call%s captured\n", graphSlotBytes_,
              (unsigned long long)captured_.load(), captured_.load() == 1 ? "" : "s");
  else
    s += "  graph lane: none (LOOM_DEVICE_GRAPH_SLOT_BYTES=0)\n";
  return s;
}

namespace {

// Whether two calls' stream handles are surely one stream.
// cudaStreamPerThread (handle 2) is a different stream on every thread.
bool sameStream(const void* a, const void* b) {
  return a == b && a != reinterpret_cast<const void*>(uintptr_t(2));
}

}  // namespace

// A call being enqueued: holds the communicator's lock (mu_), the program
// and its buffers, and enqueues them in steps (ProgramEnqueuer).
class DeviceComm::Run final : public SteppedRun {
 public:
  Run(DeviceComm& comm, std::unique_lock<std::mutex> lock, StreamProgram program, ProgramBuffers buffers, Lane lane)
      : comm_(comm), lock_(std::move(lock)), p_(std::move(program)), b_(std::move(buffers)), lane_(lane) {}
  ~Run() override {
    if (failed_) return;
    if (enq_ && !done_ && lane_ != Lane::Graph)
      comm_.failEnqueue(loomInternalError, "a call was left half enqueued (its group stopped at another's error)",
                        lane_);
    else
      comm_.noteEnqueued(lane_);
  }
  const StreamProgram& program() const { return p_; }
  // After the backend's preamble: checks the whole program, enqueues none of it.
  void start(StreamBackend& be) { enq_ = std::make_unique<ProgramEnqueuer>(be, p_, b_); }
  bool step(size_t maxOps) override {
    if (failed_) fail(loomInternalError, "a failed call stepped again");
    if (!enq_ || done_) return done_ = true;
    DeviceScope current(*comm_.driver_);
    try {
      done_ = enq_->step(maxOps);
    } catch (const Error& e) {
      failWith(e);
      throw;
    }
    return done_;
  }
  // The call failed (the caller rethrows): the communicator fails, and this
  // run lets go of it at once, since whoever catches the error asks the
  // communicator (failed(), under the same lock) while the run still lives.
  void failWith(const Error& e) {
    failed_ = true;
    // A captured call's error spoils the capture, not the communicator:
    // nothing of it ran, and no counter moved.
    if (lane_ != Lane::Graph) comm_.failEnqueue(e.code(), e.what(), lane_);
    lock_.unlock();
  }

 private:
  DeviceComm& comm_;
  std::unique_lock<std::mutex> lock_;
  StreamProgram p_;
  ProgramBuffers b_;
  Lane lane_;
  std::unique_ptr<ProgramEnqueuer> enq_;
  bool done_ = false, failed_ = false;
};

void DeviceComm::failEnqueue(loomResult_t code, const std::string& what, Lane lane) {
  failCode_ = code;
  failed_ = what;
  // Half a program may be enqueued: release its waits (its last round may
  // never be done; the memory then outlives it, see ~DeviceComm).
  if (lane == Lane::P2P)
    p2pEnqueued_.store(p2p_.programs);
  else
    enqueued_.store(round_);
  failedFlag_.store(true);
  {
    std::lock_guard<std::mutex> w(wmu_);
    wake_ = true;
  }
  wcv_.notify_all();
}

void DeviceComm::noteEnqueued(Lane lane) {
  if (lane == Lane::Graph)
    captured_.fetch_add(1);
  else if (lane == Lane::P2P)
    p2pEnqueued_.store(p2p_.programs);
  else
    enqueued_.store(round_);
  {
    std::lock_guard<std::mutex> w(wmu_);
    wake_ = true;
  }
  wcv_.notify_all();
}

void DeviceComm::run(const OpDesc& op, void* callerStream) {
  DeviceScope current(*driver_);  // once: the begin's and the step's own then switch nothing
  std::unique_ptr<SteppedRun> r = beginRun(op, callerStream);
  r->step(SIZE_MAX);
}

std::unique_ptr<SteppedRun> DeviceComm::beginRun(const OpDesc& op, void* callerStream) {
  if (op.coll == Collective::P2P) return beginRunP2P({op}, callerStream);
  // From here on (publishFor exports and asks for address ranges, the
  // enqueue creates streams): this communicator's device.  The API calls
  // beginRun directly, from a thread that may have another device current.
  DeviceScope current(*driver_);
  check(op);
  if (usableCaptureState(callerStream) == 1) return beginGraphRun(op, callerStream);
  const size_t esz = dtypeSize(op.dtype), n = op.count;
  const DeviceOpShape sh = deviceOpShape(op, rank_, nranks_);
  const bool needSend = sh.needSend, needRecv = sh.needRecv;
  const size_t sendBytes = sh.sendBytes, recvBytes = sh.recvBytes;
  const StreamAlgorithm algo = allReduceAlgorithm(n * esz);
  // Device zero-copy: the reduce-scatter + all-gather all-reduce and the
  // other collectives read the peers through their cells, and publish this
  // rank's buffers when they can.  Only large calls (over
  // LOOM_DEVICE_ONESHOT_BYTES, the same on every rank): zero-copy saves
  // bandwidth, and a small call would only pay the cells' writes.
  ProgramBuffers b;
  StreamPublish pub;
  pub.cells = zeroCopy_ && readsPublished(op, nranks_, algo) && zeroCopyBytes(op, nranks_) > oneShotBytes_;
  if (pub.cells) {
    b.published.assign(size_t(nranks_), {});  // nothing published unless publishFor fills it
    if (mayPublish(op, rank_, nranks_, algo)) pub.mine = publishFor(op, sendBytes, recvBytes, &b);
  }
  std::unique_lock<std::mutex> g(mu_);
  if (failCode_ != loomSuccess) fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  const uint64_t before = round_;  // rounds enqueued so far: the value the last one's done flag reaches
  uint64_t round = round_;
  if (pub.cells && writesCells(op, rank_))
    for (int slot = 0; slot < 2; ++slot) {
      bool same = true;
      for (int q = 0; q < nranks_; ++q)
        for (int c = 0; c < kCellCount; ++c)
          if (c % 2 == slot) {
            const ProgramBuffers::Cell &want = b.published[size_t(q)][size_t(c)],
                                       &held = cellsHeld_[slot][size_t(q)][size_t(c)];
            same = same && want.addr == held.addr && want.bytes == held.bytes;
          }
      pub.write[slot] = !same;
    }
  StreamProgram p = compileStreamProgram(op, rank_, nranks_, algo, slotBytes_, &round, pub);
  if (pub.cells) {
    // The slots this program's rounds use now hold its values (a rank
    // whose program writes no cells leaves them as they were).
    if (writesCells(op, rank_))
      for (uint64_t k = p.firstRound; k < p.firstRound + std::min<uint64_t>(p.rounds, 2); ++k)
        for (int q = 0; q < nranks_; ++q)
          for (int c = 0; c < kCellCount; ++c)
            if (c % 2 == int(k % 2)) cellsHeld_[k % 2][size_t(q)][size_t(c)] = b.published[size_t(q)][size_t(c)];
    b.cells = cells_;
    b.peerCells = peerCells_;
  }
  b.send = needSend ? op.sendbuf : nullptr;
  b.sendBytes = needSend ? sendBytes : 0;
  b.recv = needRecv ? op.recvbuf : nullptr;
  b.recvBytes = needRecv ? recvBytes : 0;
  b.windows = windows_;
  b.windowBytes = streamWindowBytes(slotBytes_);
  b.flags = flags_;
  b.flagCopies = flagCopies_;
  auto run = std::make_unique<Run>(*this, std::move(g), std::move(p), std::move(b), Lane::Collective);
  try {
    round_ = round;  // the peers advance theirs whatever happens here
    // The mismatch check: the watchdog, woken once the call is enqueued,
    // sends it on and reports a mismatch (recorded once the call counts, as round_).
    if (sigs_) sigs_->recordMine(op);
    const StreamProgram& prog = run->program();
    if (!prog.ops.empty()) {
      StreamBackend& be = driver_->backend(callerStream, prog.streams, prog.events);
      // On another stream than the last program, this one first waits
      // until that one is done here (see collStream_).
      if (before > 0 && !sameStream(callerStream, collStream_))
        be.waitFlag(0, flags_[size_t(rank_)] + kFlagDone, before, rank_);
      run->start(be);
      collStream_ = callerStream;
    }
  } catch (const Error& e) {
    run->failWith(e);
    throw;
  }
  return run;
}

// A collective on a stream being captured: a replayable program in the
// graph lane (makeReplayable), which leaves the round counter, the stream
// order of eager calls and the mismatch check alone.
std::unique_ptr<SteppedRun> DeviceComm::beginGraphRun(const OpDesc& op, void* callerStream) {
  checkCapture(callerStream, false);
  const DeviceOpShape sh = deviceOpShape(op, rank_, nranks_);
  const StreamAlgorithm algo = allReduceAlgorithm(op.count * dtypeSize(op.dtype));
  std::unique_lock<std::mutex> g(mu_);
  if (failCode_ != loomSuccess) fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  uint64_t round = 0;
  const OpSignature sig = signatureOf(0, op);
  const uint64_t sigFlag = signatureFlag(sig);
  graphSigs_.emplace(sigFlag, describeSignature(sig));
  StreamProgram p = makeReplayable(compileStreamProgram(op, rank_, nranks_, algo, graphSlotBytes_, &round), sigFlag);
  ProgramBuffers b;
  b.send = sh.needSend ? op.sendbuf : nullptr;
  b.sendBytes = sh.needSend ? sh.sendBytes : 0;
  b.recv = sh.needRecv ? op.recvbuf : nullptr;
  b.recvBytes = sh.needRecv ? sh.recvBytes : 0;
  b.windows = gwindows_;
  b.windowBytes = streamWindowBytes(graphSlotBytes_);
  b.flags = gflags_;
  b.flagCopies = gflagCopies_;
  b.peerFlags = gpeerFlags_;
  return startGraphRun(std::make_unique<Run>(*this, std::move(g), std::move(p), std::move(b), Lane::Graph),
                       callerStream);
}

std::unique_ptr<SteppedRun> DeviceComm::startGraphRun(std::unique_ptr<Run> run, void* callerStream) {
  try {
    // The graph keeps this rank's memory (and its mappings of the peers')
    // until it is destroyed, the communicator's destroy notwithstanding.
    graphHolds_->fetch_add(1);
    driver_->retainOnCapture(callerStream, [holds = graphHolds_] { holds->fetch_sub(1); });
    const StreamProgram& prog = run->program();
    if (!prog.ops.empty()) run->start(driver_->captureBackend(callerStream, prog.streams, prog.events));
  } catch (const Error& e) {
    run->failWith(e);
    throw;
  }
  return run;
}

namespace {

// A send/recv program's own buffers: send i reads buffer i of the sends,
// receive j writes buffer j of the receives (compileP2PProgram's numbering).
ProgramBuffers p2pBuffers(const std::vector<OpDesc>& ops) {
  ProgramBuffers b;
  bool haveSend = false, haveRecv = false;
  for (const OpDesc& op : ops) {
    const size_t bytes = op.count * dtypeSize(op.dtype);
    if (op.isSend && !haveSend) {
      b.send = op.sendbuf, b.sendBytes = bytes, haveSend = true;
    } else if (op.isSend) {
      b.moreSends.push_back({const_cast<void*>(op.sendbuf), bytes});
    } else if (!haveRecv) {
      b.recv = op.recvbuf, b.recvBytes = bytes, haveRecv = true;
    } else {
      b.moreRecvs.push_back({op.recvbuf, bytes});
    }
  }
  return b;
}

}  // namespace

// Sends and receives on a stream being captured: a replayable program
// (compileGraphP2PProgram) staging in the graph window, which each rank
// divides into a region per receiver; nothing is allocated or asked of a
// peer, so a capture makes no CUDA call but the program's.
std::unique_ptr<SteppedRun> DeviceComm::beginGraphRunP2P(const std::vector<OpDesc>& ops, void* callerStream) {
  checkCapture(callerStream, true);
  const size_t region = graphP2PRegionBytes(nranks_, graphSlotBytes_);
  ProgramBuffers b = p2pBuffers(ops);
  b.windows = gwindows_;
  b.windowBytes = streamWindowBytes(graphSlotBytes_);
  b.flags = gflags_;
  b.flagCopies = gflagCopies_;
  b.peerFlags = gpeerFlags_;
  b.p2pBytes = region;
  for (int q = 0; q < nranks_; ++q) {
    b.p2pOut.push_back(gwindows_[size_t(rank_)] + size_t(q) * region);  // this rank's region for q
    b.p2pIn.push_back(gwindows_[size_t(q)] + size_t(rank_) * region);   // q's region for this rank
  }
  std::unique_lock<std::mutex> g(mu_);
  if (failCode_ != loomSuccess) fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  GraphP2PCall call;
  std::string sends, recvs;
  std::vector<int> to, from;  // each peer once, in the order of the members
  for (const OpDesc& op : ops) {
    std::vector<int>& v = op.isSend ? to : from;
    if (op.count == 0 || std::find(v.begin(), v.end(), op.peer) != v.end()) continue;
    v.push_back(op.peer);
    (op.isSend ? sends : recvs) += strf("%s%d", (op.isSend ? sends : recvs).empty() ? "" : ", ", op.peer);
    if (op.peer != rank_ && std::find(call.partners.begin(), call.partners.end(), op.peer) == call.partners.end())
      call.partners.push_back(op.peer);
  }
  call.what = strf("a send/recv group (%s%s%s%s%s)", sends.empty() ? "" : "sends to ", sends.c_str(),
                   !sends.empty() && !recvs.empty() ? "; " : "", recvs.empty() ? "" : "receives from ",
                   recvs.c_str());
  call.recvSizes = p2pPairSizes(ops, nranks_, false);
  const std::vector<std::vector<uint64_t>> sendSizes = p2pPairSizes(ops, nranks_, true);
  for (int q = 0; q < nranks_; ++q) {
    call.recvMessages.push_back(q == rank_ ? 0 : graphP2PMessages(call.recvSizes[size_t(q)]));
    call.sendMessages.push_back(q == rank_ ? 0 : graphP2PMessages(sendSizes[size_t(q)]));
  }
  // One mark per distinct call (captured again, the same mark: the map stays small).
  uint64_t busy = kGraphP2PBusy + 1 + graphP2P_.size();
  for (const auto& [mark, known] : graphP2P_)
    if (known.what == call.what && known.recvMessages == call.recvMessages &&
        known.sendMessages == call.sendMessages)
      busy = mark;
  StreamProgram p = compileGraphP2PProgram(ops, rank_, nranks_, region, busy);
  graphP2P_.emplace(busy, std::move(call));
  return startGraphRun(std::make_unique<Run>(*this, std::move(g), std::move(p), std::move(b), Lane::Graph),
                       callerStream);
}

const IpcRecord& DeviceComm::outRegionLocked(int peer) {
  if (closing_) fail(loomRemoteError, "rank %d's %s communicator is being destroyed", rank_, driver_->name());
  if (!out_[size_t(peer)]) {
    const size_t bytes = p2pRegionBytes(slotBytes_);
    const int previous = driver_->enter();
    void* p = nullptr;
    try {
      p = driver_->allocateStaging(bytes);
      outRecords_[size_t(peer)] = exportRange(*driver_, p, bytes, process_);
    } catch (...) {
      if (p) {
        try {
          driver_->release(p);
        } catch (const Error&) {  // the first error is the one to report
        }
      }
      driver_->leave(previous);
      throw;
    }
    driver_->leave(previous);
    out_[size_t(peer)] = p;
    LOOM_INFO("DEVICE", "rank %d: send/recv staging for rank %d: %zu B on %s:%d", rank_, peer, bytes,
               driver_->name(), driver_->device());
  }
  return outRecords_[size_t(peer)];
}

IpcRecord DeviceComm::p2pRegionFor(int reader) {
  if (reader < 0 || reader >= nranks_)
    fail(loomRemoteError, "rank %d asked for a send/recv region for rank %d of %d", rank_, reader, nranks_);
  std::lock_guard<std::mutex> g(p2pMu_);
  return outRegionLocked(reader);
}

void joinStreamsOn(DeviceDriver& driver, void* main, const std::vector<void*>& others, bool before) {
  DeviceScope current(driver);
  if (before) {  // the first error stops it: the caller launches nothing then
    for (void* s : others)
      if (s != main) driver.streamWaitStream(main, s);
    return;
  }
  // The group is enqueued: every stream that can be joined is, and the
  // first error is reported after.
  std::optional<Error> first;
  for (void* s : others) {
    if (s == main) continue;
    try {
      driver.streamWaitStream(s, main);
    } catch (const Error& e) {
      if (!first)
        first = Error(e.code(), strf("%s (the group's calls were enqueued on stream %p; stream %p does not wait for "
                                     "them)",
                                     e.what(), main, s));
    }
  }
  if (first) throw *first;
}

void DeviceComm::joinStreams(void* main, const std::vector<void*>& others, bool before) {
  std::lock_guard<std::mutex> g(mu_);
  joinStreamsOn(*driver_, main, others, before);
}

void scaleOn(DeviceDriver& driver, void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
             bool scalarOnDevice, void* stream) {
  // NULLs, count 0 and overlap are loomScale's (the API's) checks; these
  // are the device's.
  const size_t esz = dtypeSize(type);
  for (const auto& [what, p] : {std::pair<const char*, const void*>{"dst", dst}, {"src", src}}) {
    checkBuffer(driver, what, p);
    if (reinterpret_cast<uintptr_t>(p) % esz != 0)
      fail(loomInvalidArgument, "%s %p is not aligned to its %s elements (%zu bytes): the device scales whole "
           "elements", what, p, dtypeName(type), esz);
  }
  if (scalarOnDevice) {
    checkBuffer(driver, "scalar (on the device)", scalar);
    if (reinterpret_cast<uintptr_t>(scalar) % esz != 0)
      fail(loomInvalidArgument, "scalar (on the device) %p is not aligned to its %s element (%zu bytes)", scalar,
           dtypeName(type), esz);
  }
  DeviceScope current(driver);
  driver.scale(stream, dst, src, count, type, scalar, scalarOnDevice);
}

void DeviceComm::scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
                       bool scalarOnDevice, void* callerStream) {
  std::lock_guard<std::mutex> g(mu_);
  scaleOn(*driver_, dst, src, count, type, scalar, scalarOnDevice, callerStream);
}

void DeviceComm::prepareP2P(const std::vector<OpDesc>& ops) {
  for (const OpDesc& op : ops) {
    if (op.coll != Collective::P2P || op.peer < 0 || op.peer >= nranks_)
      fail(loomInternalError, "send/recv setup given %s (peer %d)", collectiveName(op.coll), op.peer);
    if (op.count == 0) continue;  // moves nothing
    if (op.isSend || op.peer == rank_) {
      uint8_t* own;
      {
        std::lock_guard<std::mutex> g(p2pMu_);
        outRegionLocked(op.peer);
        own = static_cast<uint8_t*>(out_[size_t(op.peer)]);
      }
      // Never inMu_ under p2pMu_: inMu_ is held while a peer is asked, whose
      // answer may need that peer's p2pMu_.
      if (op.peer != rank_) continue;
      std::lock_guard<std::mutex> i(inMu_);
      in_[size_t(rank_)] = own;  // its own, as it is
      continue;
    }
    std::lock_guard<std::mutex> i(inMu_);
    if (in_[size_t(op.peer)]) continue;
    if (!fetchRegion_)
      fail(loomInvalidUsage, "rank %d: this %s communicator has no way to ask rank %d for its send/recv region",
           rank_, driver_->name(), op.peer);
    const IpcRecord rec = fetchRegion_(op.peer);
    if (rec.bytes != p2pRegionBytes(slotBytes_))
      fail(loomRemoteError, "rank %d's send/recv region for rank %d is %llu bytes, this rank expects %zu: every "
           "rank must use the same slot size", op.peer, rank_, (unsigned long long)rec.bytes,
           p2pRegionBytes(slotBytes_));
    in_[size_t(op.peer)] = imports_->import(op.peer, rec);
    inRecords_[size_t(op.peer)] = rec;
  }
}

DeviceMemoryStats DeviceComm::memoryStats() const {
  DeviceMemoryStats st;
  st.blockBytes = blockBytes_;
  {
    std::lock_guard<std::mutex> g(p2pMu_);
    for (void* p : out_) st.regionsOut += p != nullptr;
  }
  st.regionBytesOut = st.regionsOut * p2pRegionBytes(slotBytes_);
  {
    std::lock_guard<std::mutex> i(inMu_);
    for (int r = 0; r < nranks_; ++r) st.regionsIn += r != rank_ && in_[size_t(r)];
  }
  std::lock_guard<std::mutex> g(pubMu_);
  for (auto& [base, pub] : pubs_) st.published += pub.ok;
  st.publishedIn = publishedIn_.size();
  return st;
}

uint64_t DeviceComm::importPublished(int owner, const IpcRecord& rec) {
  if (!zeroCopy_) fail(loomInvalidUsage, "rank %d's %s communicator has no zero-copy (LOOM_DEVICE_ZERO_COPY=0)",
                       rank_, driver_->name());
  if (owner < 0 || owner >= nranks_ || owner == rank_) fail(loomRemoteError, "a publish from rank %d", owner);
  if (rec.offset != 0 || rec.bytes != rec.allocBytes)
    fail(loomRemoteError, "rank %d published part of an allocation (%llu bytes at %llu of %llu)", owner,
         (unsigned long long)rec.bytes, (unsigned long long)rec.offset, (unsigned long long)rec.allocBytes);
  {
    std::lock_guard<std::mutex> g(p2pMu_);
    if (closing_) fail(loomRemoteError, "rank %d's %s communicator is being destroyed", rank_, driver_->name());
  }
  DeviceScope current(*driver_);
  std::lock_guard<std::mutex> g(pubMu_);
  // Asked again for one it maps (the owner lost its answer): the same
  // mapping, one reference.
  for (auto& [r, held] : publishedIn_)
    if (r == owner && held.base == rec.base && memcmp(held.handle, rec.handle, kIpcHandleBytes) == 0) {
      uint8_t* at = imports_->import(owner, rec);
      imports_->release(owner, rec);
      return uint64_t(uintptr_t(at));
    }
  // A new allocation at a base it maps (the owner freed the old one without
  // telling, e.g. its notice was lost): the old mapping goes.
  for (size_t i = 0; i < publishedIn_.size(); ++i)
    if (publishedIn_[i].first == owner && publishedIn_[i].second.base == rec.base) {
      imports_->forget(owner, rec.base);
      publishedIn_.erase(publishedIn_.begin() + std::ptrdiff_t(i));
      break;
    }
  uint8_t* at = imports_->import(owner, rec);
  publishedIn_.emplace_back(owner, rec);
  return uint64_t(uintptr_t(at));
}

void DeviceComm::forgetPublished(int owner, const IpcRecord& rec) {
  DeviceScope current(*driver_);
  std::lock_guard<std::mutex> g(pubMu_);
  for (size_t i = 0; i < publishedIn_.size(); ++i)
    if (publishedIn_[i].first == owner && publishedIn_[i].second.base == rec.base &&
        memcmp(publishedIn_[i].second.handle, rec.handle, kIpcHandleBytes) == 0) {
      imports_->forget(owner, rec.base);
      publishedIn_.erase(publishedIn_.begin() + std::ptrdiff_t(i));
      return;
    }
}

void DeviceComm::unpublish(void* base, bool destroying) {
  {
    // Most frees are of memory this communicator never published: no wait
    // for a publish in progress (askMu_) then.
    std::lock_guard<std::mutex> g(pubMu_);
    if (!pubs_.count(uint64_t(uintptr_t(base)))) return;
  }
  std::lock_guard<std::mutex> ask(askMu_);
  unpublishHeld(base, destroying);
}

namespace {

// Runs ask(r) for every rank r but `self`, the peers at once: up to 16
// threads, the caller's one of them.  Each question is its own connection
// to that peer's control thread, and each peer answers once it has mapped
// (or unmapped) the memory, about a millisecond on a GPU: asked one after
// another, 7 peers took 7 of them for every allocation first published.
// `ask` must not throw.
void askPeersAtOnce(int self, int nranks, const std::function<void(int)>& ask) {
  std::vector<int> peers;
  for (int r = 0; r < nranks; ++r)
    if (r != self) peers.push_back(r);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < peers.size();) ask(peers[i]);
  };
  std::vector<std::thread> helpers;
  for (size_t k = 1; k < std::min<size_t>(peers.size(), 16); ++k) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads now: the ones there (and this one) ask the rest
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
}

}  // namespace

void DeviceComm::unpublishHeld(void* base, bool destroying) {
  Published pub;
  {
    std::lock_guard<std::mutex> g(pubMu_);
    auto it = pubs_.find(uint64_t(uintptr_t(base)));
    if (it == pubs_.end()) return;
    pub = it->second;
    pubs_.erase(it);
  }
  if (!unpublishTo_) return;
  askPeersAtOnce(rank_, nranks_, [&](int r) {
    if (!pub.at[size_t(r)]) return;
    try {
      unpublishTo_(r, pub.rec);
    } catch (const Error& e) {
      // A peer that is gone (its control socket refuses) maps nothing any
      // more; one whose communicator is destroyed unmaps all at its end.
      if (destroying || e.code() == loomRemoteError)
        LOOM_INFO("DEVICE", "rank %d: rank %d did not unmap this rank's device memory at %p (it unmaps it when its "
                  "communicator goes): %s", rank_, r, base, e.what());
      else
        LOOM_WARN("DEVICE", "rank %d: rank %d did not unmap this rank's device memory at %p before it is freed: %s",
                  rank_, r, base, e.what());
    }
  });
}

void DeviceComm::unpublishAll() {
  std::vector<uint64_t> bases;
  {
    std::lock_guard<std::mutex> g(pubMu_);
    for (auto& [base, pub] : pubs_) bases.push_back(base);
  }
  if (bases.empty()) return;
  // This rank's programs end only once the peers are done reading its
  // published buffers: wait for them (a caller that did not synchronise
  // before destroy) before the peers unmap.  Called once the watchdog is
  // stopped (its flag reads are not meant for two threads).
  const int64_t deadline = nowMs() + drainTimeoutMs_;
  try {
    while (!programsDone() && nowMs() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
  } catch (const Error& e) {
    LOOM_WARN("DEVICE", "rank %d: reading this rank's flags failed: %s", rank_, e.what());
  }
  for (uint64_t base : bases) unpublish(reinterpret_cast<void*>(uintptr_t(base)), true);
}

namespace {

void checkRegisteredDevice(const void* p, int device, int mine, const char* name) {
  if (device != mine)
    fail(loomInvalidArgument, "buff %p is memory of cuda:%d, but this communicator runs on %s:%d", p, device, name,
         mine);
}

}  // namespace

void DeviceComm::noteUnpublishable(const void* p, const char* why) {
  // Once as a warning: memory from cudaMallocAsync pools or PyTorch's
  // expandable segments (cuMem) has no CUDA IPC handle, so every large call
  // on it stages, and a user who expected zero-copy should hear why.
  if (!warnedUnpublishable_.exchange(true))
    LOOM_WARN("DEVICE", "rank %d: device memory at %p cannot be published to the peers, so operations on it are "
              "staged (zero-copy off for it; memory from cudaMallocAsync pools or PyTorch's expandable segments "
              "has no CUDA IPC handle; said once per communicator): %s", rank_, p, why);
  else
    LOOM_INFO("DEVICE", "rank %d: device memory at %p is not published (zero-copy off for it): %s", rank_, p, why);
}

bool DeviceCollectives::deviceMemory(const void* p, size_t /*bytes*/, void** allocation) {
  const int d = cudaPointerDevice(p);
  if (d < 0) return false;
  checkRegisteredDevice(p, d, device(), deviceName());
  *allocation = nullptr;
  return true;
}

bool DeviceComm::deviceMemory(const void* p, size_t bytes, void** allocation) {
  DeviceScope current(*driver_);
  const int d = driver_->pointerDevice(p);
  if (d < 0) return false;
  checkRegisteredDevice(p, d, driver_->device(), driver_->name());
  *allocation = nullptr;
  void* base = nullptr;
  size_t alloc = 0;
  try {
    driver_->addressRange(p, &base, &alloc);
  } catch (const Error& e) {
    noteUnpublishable(p, e.what());
    return true;
  }
  const auto b = reinterpret_cast<uintptr_t>(base), q = reinterpret_cast<uintptr_t>(p);
  if (base && q >= b && q - b <= alloc && bytes <= alloc - (q - b)) *allocation = base;  // else spans allocations
  return true;
}

void DeviceComm::withdraw(void* allocation, const std::function<bool()>& held) {
  const uint64_t key = uint64_t(uintptr_t(allocation));
  bool mapped = false;
  {
    std::lock_guard<std::mutex> g(pubMu_);
    auto it = pubs_.find(key);
    if (it == pubs_.end()) return;
    for (uint64_t at : it->second.at) mapped = mapped || at;
  }
  if (failed()) {
    std::lock_guard<std::mutex> ask(askMu_);
    if (held && held()) return;
    std::lock_guard<std::mutex> g(pubMu_);
    if (pubs_.erase(key) && mapped)
      LOOM_INFO("DEVICE", "rank %d: the communicator has failed, so the peers are not asked to unmap its device "
                "memory at %p (they unmap it when their communicators go)", rank_, allocation);
    return;
  }
  // A program on published buffers ends only once the peers are done
  // reading them, so once this process's work on the device is done no
  // peer reads the allocation any more (loomMemFree waits the same way).
  if (mapped) {
    try {
      DeviceScope current(*driver_);
      driver_->synchronize();
    } catch (const Error& e) {
      LOOM_WARN("DEVICE", "rank %d: deregistering device memory at %p: %s", rank_, allocation, e.what());
    }
  }
  std::lock_guard<std::mutex> ask(askMu_);
  if (held && held()) return;  // registered again meanwhile: still published
  unpublishHeld(allocation, false);
}

const DeviceComm::Published* DeviceComm::publishedAlloc(void* base) {
  const uint64_t key = uint64_t(uintptr_t(base));
  {
    std::lock_guard<std::mutex> g(pubMu_);
    auto it = pubs_.find(key);
    if (it != pubs_.end()) return &it->second;  // entries go only in unpublish, under askMu_ (held by the caller)
  }
  // First use: every peer maps it, or it is not published (and not asked
  // again: a peer that cannot map it now will not later).
  Published pub;
  pub.at.assign(size_t(nranks_), 0);
  pub.ok = true;
  try {
    void* b = nullptr;
    size_t bytes = 0;
    driver_->addressRange(base, &b, &bytes);
    pub.rec = exportRange(*driver_, b, bytes, process_);
  } catch (const Error& e) {
    noteUnpublishable(base, e.what());
    pub.ok = false;
  }
  // Every peer is asked, even once one has failed: those that mapped it
  // are asked to unmap it when it goes (unpublishHeld), as ever.
  std::vector<char> refused(size_t(nranks_), 0);
  if (pub.ok)
    askPeersAtOnce(rank_, nranks_, [&](int r) {
      try {
        pub.at[size_t(r)] = publishTo_(r, pub.rec);
        if (!pub.at[size_t(r)]) fail(loomRemoteError, "rank %d mapped it at address 0", r);
      } catch (const Error& e) {
        LOOM_INFO("DEVICE", "rank %d: rank %d cannot map this rank's device memory at %p, so its operations on it "
                  "are staged: %s", rank_, r, base, e.what());
        refused[size_t(r)] = 1;
      }
    });
  for (char no : refused) pub.ok = pub.ok && !no;
  std::lock_guard<std::mutex> g(pubMu_);
  return &(pubs_[key] = pub);
}

bool DeviceComm::publishFor(const OpDesc& op, size_t sendBytes, size_t recvBytes, ProgramBuffers* b) {
  if (!publishable_ || !publishTo_ || nranks_ < 2) return false;
  // Under askMu_: a deregistration (withdraw) in another thread either
  // comes after this publish, and has the peers unmap it, or before, and
  // the memory is not publishable any more.
  std::lock_guard<std::mutex> ask(askMu_);
  // Rooted collectives: the others read the send buffer only.
  const bool withRecv = !rooted(op.coll);
  void *sendBase = nullptr, *recvBase = nullptr;
  if (!publishable_(op.sendbuf, sendBytes, &sendBase) ||
      (withRecv && !publishable_(op.recvbuf, recvBytes, &recvBase)))
    return false;
  const Published* s = publishedAlloc(sendBase);
  const Published* r = s->ok && withRecv ? publishedAlloc(recvBase) : s;
  if (!s->ok || !r->ok) return false;
  const uint64_t sendOff = uint64_t(static_cast<const uint8_t*>(op.sendbuf) - static_cast<const uint8_t*>(sendBase));
  const uint64_t recvOff =
      withRecv ? uint64_t(static_cast<uint8_t*>(op.recvbuf) - static_cast<uint8_t*>(recvBase)) : 0;
  for (int q = 0; q < nranks_; ++q) {
    if (q == rank_) continue;
    auto& c = b->published[size_t(q)];
    c[kCellSend0] = c[kCellSend1] = ProgramBuffers::Cell{s->at[size_t(q)] + sendOff, sendBytes};
    c[kCellRecv0] = c[kCellRecv1] =
        withRecv ? ProgramBuffers::Cell{r->at[size_t(q)] + recvOff, recvBytes} : ProgramBuffers::Cell{};
  }
  return true;
}


void DeviceComm::runP2P(const std::vector<OpDesc>& ops, void* callerStream) {
  DeviceScope current(*driver_);  // once, as run()
  std::unique_ptr<SteppedRun> r = beginRunP2P(ops, callerStream);
  r->step(SIZE_MAX);
}

std::unique_ptr<SteppedRun> DeviceComm::beginRunP2P(const std::vector<OpDesc>& ops, void* callerStream) {
  DeviceScope current(*driver_);  // prepareP2P maps peers' regions: into this device's context
  for (const OpDesc& op : ops) {
    if (op.coll != Collective::P2P) fail(loomInternalError, "runP2P given %s", collectiveName(op.coll));
    check(op);
  }
  if (usableCaptureState(callerStream) == 1) return beginGraphRunP2P(ops, callerStream);
  {
    std::lock_guard<std::mutex> g(mu_);
    if (failCode_ != loomSuccess)
      fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  }
  prepareP2P(ops);
  ProgramBuffers b = p2pBuffers(ops);
  b.windows = windows_;
  b.windowBytes = streamWindowBytes(slotBytes_);
  b.flags = flags_;
  b.flagCopies = flagCopies_;
  b.peerFlags = peerFlags_;
  b.p2pBytes = p2pRegionBytes(slotBytes_);
  {
    std::lock_guard<std::mutex> g(p2pMu_);
    for (void* o : out_) b.p2pOut.push_back(static_cast<uint8_t*>(o));
  }
  {
    std::lock_guard<std::mutex> i(inMu_);
    b.p2pIn = in_;
  }
  std::unique_lock<std::mutex> g(mu_);
  if (failCode_ != loomSuccess) fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failed_.c_str());
  P2PCounters counters = p2p_;
  const uint64_t before = p2p_.programs;  // send/recv programs enqueued so far (kFlagP2PDone's last value)
  StreamProgram p = compileP2PProgram(ops, rank_, nranks_, slotBytes_, &counters);
  auto run = std::make_unique<Run>(*this, std::move(g), std::move(p), std::move(b), Lane::P2P);
  try {
    p2p_ = counters;  // the peers count these chunks whatever happens here
    // The mismatch check: each message's size, in the order the program
    // moves them (an empty one too: the host path numbers it alike).
    if (p2pCheck_)
      for (const OpDesc& op : ops) {
        const uint64_t bytes = op.count * dtypeSize(op.dtype);
        if (op.isSend)
          p2pCheck_->recordSend(op.peer, bytes);
        else
          p2pCheck_->recordRecv(op.peer, bytes);
      }
    const StreamProgram& prog = run->program();
    if (prog.ops.empty()) return run;
    StreamBackend& be = driver_->backend(callerStream, prog.streams, prog.events);
    if (before > 0 && !sameStream(callerStream, p2pStream_))
      be.waitFlag(0, flags_[size_t(rank_)] + kFlagP2PDone, before, rank_);
    run->start(be);
    p2pStream_ = callerStream;
  } catch (const Error& e) {
    run->failWith(e);
    throw;
  }
  return run;
}

}  // namespace loom
