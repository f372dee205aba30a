// The staged path of a CUDA communicator (staged_comm.h): device buffers
// through pinned host memory and the host path.
#include "src/device/staged_comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "src/core/backoff.h"  // cpuRelax
#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

namespace {

size_t roundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

// How a collective lays out one rank's buffers: one block, or one per rank
// (the same piece of every block travels together), and whether the host
// operation runs in place (its output overwrites its input).
size_t blocksIn(Collective c, size_t N) {
  return c == Collective::ReduceScatter || c == Collective::AllToAll || c == Collective::Scatter ? N : 1;
}
size_t blocksOut(Collective c, size_t N) {
  return c == Collective::AllGather || c == Collective::AllToAll || c == Collective::Gather ? N : 1;
}
bool inPlace(Collective c) {
  return c == Collective::AllReduce || c == Collective::Reduce || c == Collective::Broadcast;
}

}  // namespace

StagedDeviceComm::StagedDeviceComm(int rank, int nranks, std::unique_ptr<DeviceDriver> driver,
                                   StagedCommOptions options)
    : rank_(rank),
      nranks_(nranks),
      driver_(std::move(driver)),
      // A piece holds at least one element of every rank's block.
      pieceBytes_(roundUp(std::max(options.pieceBytes, size_t(nranks) * 16), 256)),
      drainTimeoutMs_(options.drainTimeoutMs),
      reapTimeoutMs_(options.reapTimeoutMs),
      issueHost_(std::move(options.issueHost)),
      onFailure_(std::move(options.onFailure)),
      timeoutMs_(options.timeoutMs) {
  if (!issueHost_) fail(loomInternalError, "a staged device communicator needs the host path");
  if (options.slots < 2)
    fail(loomInvalidArgument, "staged device path: %d slots, need at least 2", options.slots);
  {
    DeviceScope current(*driver_);
    try {
      for (int i = 0; i < options.slots; ++i) slots_.push_back(allocateBuffer(2 * pieceBytes_));
    } catch (...) {
      for (auto& b : slots_) driver_->releaseHost(b->mem);
      throw;
    }
  }
  worker_ = std::thread([this] { work(); });
}

std::unique_ptr<StagedDeviceComm::Buffer> StagedDeviceComm::allocateBuffer(size_t bytes) {
  auto b = std::make_unique<Buffer>();
  b->mem = static_cast<uint8_t*>(driver_->allocateHost(kHeader + bytes));
  memset(b->mem, 0, kHeader);  // the flags start at 0: no use yet
  b->bytes = bytes;
  return b;
}

size_t StagedDeviceComm::pinnedBytes() const {
  std::lock_guard<std::mutex> g(mu_);
  size_t n = 0;
  for (const auto& b : slots_) n += kHeader + b->bytes;
  if (bulk_) n += kHeader + bulk_->bytes;
  for (const auto& b : retired_) n += kHeader + b->bytes;
  return n;
}

std::string StagedDeviceComm::describe() const {
  size_t bulk = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    bulk = bulk_ ? bulk_->bytes : 0;
  }
  return strf(
      "  device %s:%d, staged path (pinned host memory, then the host path): %zu B pinned (%zu slots of 2 "
      "x %zu B, send/recv %zu B); host steps run: %llu\n",
      deviceName(), device(), pinnedBytes(), slots_.size(), pieceBytes_, bulk,
      (unsigned long long)stepsRun_.load());
}

void StagedDeviceComm::check(const OpDesc& op) const { checkDeviceOp(*driver_, op, rank_, nranks_); }

size_t StagedDeviceComm::pieceElements(const OpDesc& op) const {
  const size_t N = size_t(nranks_);
  const size_t blocks = std::max(blocksIn(op.coll, N), blocksOut(op.coll, N));
  return std::max<size_t>(1, pieceBytes_ / (blocks * dtypeSize(op.dtype)));
}

size_t StagedDeviceComm::pieces(const OpDesc& op) const {
  const size_t e = pieceElements(op);
  return (op.count + e - 1) / e;
}

bool StagedDeviceComm::markFailed(loomResult_t code, const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(failMu_);
    if (failCode_ != loomSuccess) return false;
    failCode_ = code == loomSuccess ? loomInternalError : code;
    failMsg_ = msg;
  }
  failedFlag_.store(true, std::memory_order_release);
  // The staging thread releases the streams' waits (it takes mu_, which an
  // enqueue that fails holds while it calls here).
  { std::lock_guard<std::mutex> q(qmu_); }
  qcv_.notify_all();
  return true;
}

void StagedDeviceComm::failIfFailed() const {
  std::lock_guard<std::mutex> g(failMu_);
  if (failCode_ != loomSuccess)
    fail(failCode_, "the %s communicator has failed: %s", driver_->name(), failMsg_.c_str());
}

void StagedDeviceComm::enqueueIn(StreamBackend& be, Buffer& b, uint64_t use,
                                 const std::vector<Copy>& copies) {
  if (use > 1) be.waitFlag(0, b.free(), use - 1, rank_);  // its last use is copied out
  for (const Copy& c : copies)
    if (c.bytes) be.copy(0, c.dst, c.src, c.bytes);
  be.setFlag(0, b.in(), use);
}

void StagedDeviceComm::enqueueOut(StreamBackend& be, Buffer& b, uint64_t use,
                                  const std::vector<Copy>& copies) {
  be.waitFlag(0, b.out(), use, rank_);
  for (const Copy& c : copies)
    if (c.bytes) be.copy(0, c.dst, c.src, c.bytes);
  be.setFlag(0, b.free(), use);
}

void StagedDeviceComm::failEnqueue(const Error& e, std::vector<Step>& steps) {
  markFailed(e.code(), e.what());
  push(steps);  // their turns were taken: they run (and fail at once)
}

void StagedDeviceComm::push(std::vector<Step>& steps) {
  if (steps.empty()) return;
  {
    std::lock_guard<std::mutex> q(qmu_);
    for (Step& s : steps) queue_.push_back(std::move(s));
  }
  steps.clear();
  qcv_.notify_all();
}

void StagedDeviceComm::run(const OpDesc& op, void* callerStream) {
  if (op.coll == Collective::P2P) return runP2P({op}, callerStream);
  check(op);
  const DeviceOpShape sh = deviceOpShape(op, rank_, nranks_);
  const size_t N = size_t(nranks_), esz = dtypeSize(op.dtype), e = pieceElements(op), n = pieces(op);
  const size_t bin = blocksIn(op.coll, N), bout = blocksOut(op.coll, N);
  const auto* send = static_cast<const uint8_t*>(op.sendbuf);
  auto* recv = static_cast<uint8_t*>(op.recvbuf);
  std::lock_guard<std::mutex> g(mu_);
  failIfFailed();
  if (n == 0) return;
  DeviceScope current(*driver_);
  std::vector<Step> steps;
  try {
    StreamBackend& be = driver_->backend(callerStream, 1, 0);
    struct Ahead {
      Buffer* b;
      uint64_t use;
      size_t first, len;
    };
    std::deque<Ahead> ahead;  // staged in, not yet copied out
    auto copyOut = [&] {
      const Ahead a = ahead.front();
      ahead.pop_front();
      const uint8_t* out = a.b->data() + (inPlace(op.coll) ? 0 : pieceBytes_);
      std::vector<Copy> copies;
      if (sh.needRecv)
        for (size_t j = 0; j < bout; ++j)
          copies.push_back(
              {recv + ((bout > 1 ? j * op.count : 0) + a.first) * esz, out + j * a.len * esz, a.len * esz});
      enqueueOut(be, *a.b, a.use, copies);
    };
    for (size_t p = 0; p < n; ++p) {
      const size_t first = p * e, len = std::min(e, op.count - first);
      Buffer& b = *slots_[nextSlot_++ % slots_.size()];
      const uint64_t use = ++b.uses;
      uint8_t* in = b.data();
      OpDesc h = op;
      h.count = len;
      h.sendbuf = in;
      h.recvbuf = inPlace(op.coll) ? in : in + pieceBytes_;
      h.sendMem = h.recvMem = MemoryKind::Host;
      steps.push_back({&b, use, issueHost_({h}), collectiveName(op.coll), p, n});
      std::vector<Copy> copies;
      if (sh.needSend)
        for (size_t j = 0; j < bin; ++j)
          copies.push_back(
              {in + j * len * esz, send + ((bin > 1 ? j * op.count : 0) + first) * esz, len * esz});
      enqueueIn(be, b, use, copies);
      ahead.push_back({&b, use, first, len});
      // At most slots - 1 pieces ahead: the next piece on this slot waits
      // for this copy out, which must come first in the stream.
      if (ahead.size() == slots_.size()) copyOut();
    }
    while (!ahead.empty()) copyOut();
  } catch (const Error& err) {
    failEnqueue(err, steps);
    throw;
  }
  push(steps);
}

void StagedDeviceComm::joinStreams(void* main, const std::vector<void*>& others, bool before) {
  std::lock_guard<std::mutex> g(mu_);
  joinStreamsOn(*driver_, main, others, before);
}

void StagedDeviceComm::scale(void* dst, const void* src, size_t count, loomDataType_t type, const void* scalar,
                             bool scalarOnDevice, void* callerStream) {
  std::lock_guard<std::mutex> g(mu_);
  scaleOn(*driver_, dst, src, count, type, scalar, scalarOnDevice, callerStream);
}

void StagedDeviceComm::runP2P(const std::vector<OpDesc>& ops, void* callerStream) {
  for (const OpDesc& op : ops) {
    if (op.coll != Collective::P2P) fail(loomInternalError, "runP2P given %s", collectiveName(op.coll));
    check(op);
  }
  std::lock_guard<std::mutex> g(mu_);
  failIfFailed();
  if (ops.empty()) return;
  std::vector<size_t> at;
  size_t total = 0;
  for (const OpDesc& op : ops) {
    at.push_back(total);
    total += roundUp(op.count * dtypeSize(op.dtype), 256);
  }
  DeviceScope current(*driver_);
  if (!bulk_ || bulk_->bytes < total) {
    // Outgrown: streams may still use the old buffer, so it stays until
    // the communicator goes.  Nothing is issued yet: an allocation error
    // leaves the communicator as it was.
    auto grown = allocateBuffer(std::max(total, bulk_ ? 2 * bulk_->bytes : size_t(256)));
    if (bulk_) retired_.push_back(std::move(bulk_));
    bulk_ = std::move(grown);
    LOOM_INFO("DEVICE", "rank %d: staged send/recv buffer of %zu B (pinned host memory)", rank_,
              bulk_->bytes);
  }
  Buffer& b = *bulk_;
  const uint64_t use = ++b.uses;
  std::vector<OpDesc> host = ops;
  std::vector<Copy> in, out;
  for (size_t i = 0; i < ops.size(); ++i) {
    const size_t bytes = ops[i].count * dtypeSize(ops[i].dtype);
    uint8_t* p = b.data() + at[i];
    host[i].sendMem = host[i].recvMem = MemoryKind::Host;
    if (ops[i].isSend) {
      host[i].sendbuf = p;
      in.push_back({p, ops[i].sendbuf, bytes});
    } else {
      host[i].recvbuf = p;
      out.push_back({ops[i].recvbuf, p, bytes});
    }
  }
  std::vector<Step> steps;
  try {
    StreamBackend& be = driver_->backend(callerStream, 1, 0);
    steps.push_back({&b, use, issueHost_(host),
                     ops.size() > 1  ? "a send/recv group"
                     : ops[0].isSend ? "Send"
                                     : "Recv",
                     0, 1});
    enqueueIn(be, b, use, in);
    enqueueOut(be, b, use, out);
  } catch (const Error& err) {
    failEnqueue(err, steps);
    throw;
  }
  push(steps);
}

bool StagedDeviceComm::waitIn(const Step& s) {
  const int64_t start = nowMs();
  int64_t sleepUs = 2;
  for (int spins = 0;; ++spins) {
    if (__atomic_load_n(s.buf->in(), __ATOMIC_ACQUIRE) >= s.use) return true;
    if (failed()) return false;
    const int64_t now = nowMs(), timeout = timeoutMs_.load();
    const bool stopping = stopping_.load(std::memory_order_acquire);
    if ((timeout > 0 && now - start >= timeout) ||
        (stopping && (abandoned_ || now - stopAtMs_ >= drainTimeoutMs_))) {
      const std::string msg =
          stopping
              ? strf(
                    "rank %d: the %s communicator was destroyed while %s (piece %zu of %zu) waited for the "
                    "caller's stream to stage its input; the stream never got there (synchronise the "
                    "streams before loomCommDestroy)",
                    rank_, driver_->name(), s.what, s.piece + 1, s.pieces)
              : strf(
                    "rank %d: the caller's stream did not reach the staging copy of %s (piece %zu of %zu) "
                    "within %lld ms (LOOM_TIMEOUT_MS): it waits for something that does not happen",
                    rank_, s.what, s.piece + 1, s.pieces, (long long)(now - start));
      if (markFailed(stopping ? loomInvalidUsage : loomTimeout, msg)) {
        LOOM_WARN("DEVICE", "%s", msg.c_str());
        if (onFailure_) onFailure_(Error(stopping ? loomInvalidUsage : loomTimeout, msg));
      }
      return false;
    }
    if (spins < 64) {
      cpuRelax();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleepUs));
      sleepUs = std::min<int64_t>(sleepUs * 2, 100);  // at most 0.1 ms late on a stream that was busy
    }
  }
}

void StagedDeviceComm::releaseAll() {
  std::lock_guard<std::mutex> g(mu_);
  // Only `out`, which the streams wait for: with it released, each use's
  // copy-out runs and writes `free` itself, which is what a later use's
  // wait and the reaper (StagedRemains::step: the streams are done with a
  // buffer once `free` reaches its uses) read.  Releasing `free` too made
  // every buffer look done at once, and a destroy after a failure freed
  // pinned memory the stream would still copy through.
  auto one = [&](Buffer& b) { driver_->storeHostFlag(b.out(), kReleasedFlag); };
  for (auto& b : slots_) one(*b);
  if (bulk_) one(*bulk_);
  for (auto& b : retired_) one(*b);
}

void StagedDeviceComm::work() {
  bool released = false;
  for (;;) {
    Step s;
    {
      std::unique_lock<std::mutex> q(qmu_);
      qcv_.wait(q, [&] { return stop_ || !queue_.empty() || (failed() && !released); });
      if (queue_.empty()) {
        if (failed() && !released) {
          q.unlock();
          releaseAll();
          released = true;
          continue;
        }
        break;  // stopping, nothing left
      }
      s = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!failed()) waitIn(s);
    try {
      s.host();  // always: its turn was taken (a failed communicator's fails at once)
    } catch (const Error& e) {
      markFailed(e.code(), e.what());
    }
    // Counted before its flag lets the stream go: a caller that saw the
    // stream finish sees the step counted (a test read one short under TSan).
    stepsRun_.fetch_add(1);
    if (failed()) {
      releaseAll();
      released = true;
    } else {
      driver_->storeHostFlag(s.buf->out(), s.use);
    }
  }
}

void StagedDeviceComm::stopWatchdog() {
  {
    std::lock_guard<std::mutex> q(qmu_);
    if (!stop_) stopAtMs_ = nowMs();
    stop_ = true;
  }
  stopping_.store(true, std::memory_order_release);
  qcv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

namespace {

// A staged communicator's pinned memory while its streams may still use it.
struct StagedRemains final : DeviceRemains {
  std::unique_ptr<DeviceDriver> driver;
  struct Part {
    uint8_t* mem;
    uint64_t* out;
    uint64_t* free;
    uint64_t uses;
  };
  std::vector<Part> parts;
  bool released = false;
  bool done = false;  // at the last step: the streams are done with every part

  bool step() override {
    done = true;
    for (const Part& p : parts) done &= __atomic_load_n(p.free, __ATOMIC_ACQUIRE) >= p.uses;
    if (!done && released)
      for (const Part& p : parts) driver->storeHostFlag(p.out, kReleasedFlag);
    return done;
  }
  bool releasing() const override { return released && !done; }
  void free() override {
    {
      QuietDeviceScope current(*driver, rank, "free its pinned memory");
      for (const Part& p : parts) {
        try {
          driver->releaseHost(p.mem);
        } catch (const Error&) {  // nothing to tell from here
        }
      }
    }
    driver.reset();
  }
};

}  // namespace

StagedDeviceComm::~StagedDeviceComm() {
  stopWatchdog();
  auto rest = std::make_unique<StagedRemains>();
  rest->rank = rank_;
  rest->released = failed();
  {
    std::lock_guard<std::mutex> g(mu_);
    auto add = [&](const Buffer& b) { rest->parts.push_back({b.mem, b.out(), b.free(), b.uses}); };
    for (auto& b : slots_) add(*b);
    if (bulk_) add(*bulk_);
    for (auto& b : retired_) add(*b);
  }
  rest->driver = std::move(driver_);
  if (!rest->released && !abandoned_) {
    // Healthy: the caller synchronised its streams before destroying (as
    // NCCL requires); the last copies out may still be landing.
    const int64_t deadline = nowMs() + drainTimeoutMs_;
    while (!rest->step() && nowMs() < deadline) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!rest->step() && !rest->released) {
    LOOM_WARN("DEVICE",
              "rank %d: the streams still use the staged path's pinned memory; it is freed once they are "
              "done",
              rank_);
  }
  rest->deadline = reapTimeoutMs_ <= 0 ? 0 : nowMs() + reapTimeoutMs_;
  reapDeviceRemains(std::move(rest));
}

}  // namespace loom
