// Python.h first, as Python asks (it defines feature macros).
#include <Python.h>

#include "python/process_group_loom.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <string>

namespace loom_torch {
namespace {

const char kUniqueIdKey[] = "loom_unique_id";

// torch dtype -> loom datatype, for a tensor as it travels (see wire()):
// bool as uint8 (see redOpFor).
loomDataType_t dtypeFor(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kChar:
      return loomInt8;
    case at::kByte:
      return loomUint8;
    case at::kBool:
      return loomUint8;
    case at::kInt:
      return loomInt32;
    case at::kLong:
      return loomInt64;
    case at::kHalf:
      return loomFloat16;
    case at::kBFloat16:
      return loomBfloat16;
    case at::kFloat:
      return loomFloat32;
    case at::kDouble:
      return loomFloat64;
    default:
      TORCH_CHECK(
          false, "loom backend: dtype ", t.scalar_type(),
          " is not supported (supported: int8, uint8, bool, int32, int64, float16, bfloat16, float32, "
          "float64, and complex64/complex128 as pairs of reals)");
  }
}

// What loom moves for a tensor: complex tensors as their real views (two
// reals per element; sums and averages stay exact per component).
at::Tensor wire(const at::Tensor& t) { return t.is_complex() ? at::view_as_real(t) : t; }

// The host buffers the backend allocates for its own collectives (flattened
// lists, gather targets) and loom_torch.empty's tensors come from
// loomMemAlloc when they are large enough for loom's zero-copy path (1 MiB:
// below it loom never votes), so that over shared memory loom moves their
// data straight between the ranks' buffers (docs/usage.md, "Registered
// memory").  loomMemAlloc maps and faults in fresh pages, so blocks are
// pooled: a freed tensor's block goes back to the pool and serves the next
// request of about its size (the same buckets come back every step), and
// peers keep their mappings of it.  At most kPoolKeepBytes wait in the pool.
class SharedPool {
 public:
  static SharedPool& get() {
    static SharedPool* pool = new SharedPool;  // never destroyed: tensors may outlive everything
    return *pool;
  }

  // A 1-D tensor of `numel` elements; ordinary memory below kMinBytes or
  // when loomMemAlloc fails (said once).
  at::Tensor empty(int64_t numel, const at::TensorOptions& opt) {
    const size_t bytes = size_t(numel) * size_t(c10::elementSize(c10::typeMetaToScalarType(opt.dtype())));
    if (bytes < kMinBytes) return at::empty({numel}, opt);
    size_t have = 0;
    void* p = take(bytes, &have);
    if (!p) return at::empty({numel}, opt);
    return at::from_blob(
        p, {numel}, [have](void* q) { SharedPool::get().give(q, have); }, opt.device(at::kCPU));
  }

 private:
  static constexpr size_t kMinBytes = size_t(1) << 20;
  static constexpr size_t kPoolKeepBytes = size_t(512) << 20;

  void* take(size_t bytes, size_t* have) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      // The smallest free block that fits, if it wastes at most a quarter.
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first - bytes <= bytes / 4) {
        void* p = it->second;
        *have = it->first;
        kept_ -= it->first;
        free_.erase(it);
        return p;
      }
    }
    const size_t rounded = (bytes + 65535) & ~size_t(65535);
    void* p = nullptr;
    if (loomMemAlloc(&p, rounded) != loomSuccess) {
      TORCH_WARN_ONCE("loom backend: loomMemAlloc failed (", loomGetLastError(nullptr),
                      "); the backend's buffers are ordinary memory (no zero-copy)");
      return nullptr;
    }
    *have = rounded;
    return p;
  }

  void give(void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(bytes, p);
    kept_ += bytes;
    // Over the cap: free the largest blocks first (the rarest sizes).
    while (kept_ > kPoolKeepBytes && !free_.empty()) {
      auto last = std::prev(free_.end());
      kept_ -= last->first;
      loomMemFree(last->second);
      free_.erase(last);
    }
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;  // by size
  size_t kept_ = 0;
};

}  // namespace

at::Tensor sharedEmpty(int64_t numel, const at::TensorOptions& options) {
  return SharedPool::get().empty(numel, options);
}

namespace {

// torch reduce op -> loom op. As NCCL does for bool: sum is logical or (max),
// product is logical and (min). Complex: only SUM and AVG are component-wise.
loomRedOp_t redOpFor(const c10d::ReduceOp& op, const at::Tensor& t) {
  bool isBool = t.scalar_type() == at::kBool;
  if (t.is_complex())
    TORCH_CHECK(op.op_ == c10d::ReduceOp::SUM || op.op_ == c10d::ReduceOp::AVG,
                "loom backend: complex tensors reduce with SUM or AVG only (PRODUCT, MIN, MAX are not "
                "component-wise)");
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return isBool ? loomMax : loomSum;
    case c10d::ReduceOp::PRODUCT:
      return isBool ? loomMin : loomProd;
    case c10d::ReduceOp::MIN:
      return loomMin;
    case c10d::ReduceOp::MAX:
      return loomMax;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(!isBool, "loom backend: ReduceOp.AVG is not defined for bool tensors");
      return loomAvg;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(false,
                  "loom backend: bitwise reductions (BAND, BOR, BXOR) are not supported "
                  "(supported: SUM, AVG, PRODUCT, MIN, MAX)");
    default:
      TORCH_CHECK(false, "loom backend: reduce op ", int(op.op_),
                  " is not supported (supported: SUM, AVG, PRODUCT, MIN, MAX)");
  }
}

void checkTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.defined(), "loom backend: ", what, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "loom backend: ", what,
              ": only CPU tensors are supported, got a tensor on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "loom backend: ", what,
              ": only dense (strided) tensors are supported");
  TORCH_CHECK(t.is_contiguous(), "loom backend: ", what,
              ": the tensor must be contiguous (pass tensor.contiguous() and copy back)");
  dtypeFor(wire(t));
}

// The one tensor of `tensors`, checked, as it travels.
at::Tensor single(const std::vector<at::Tensor>& tensors, const char* what) {
  TORCH_CHECK(tensors.size() == 1, "loom backend: ", what, " takes exactly one tensor per rank, got ",
              tensors.size());
  checkTensor(tensors[0], what);
  return wire(tensors[0]);
}

void checkSameKind(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "loom backend: ", what, ": tensors have different dtypes (",
              a.scalar_type(), " and ", b.scalar_type(), ")");
}

// An output tensor of a list: defined, on the CPU, of `like`'s dtype and size.
void checkOutput(const at::Tensor& o, const at::Tensor& like, const char* what) {
  TORCH_CHECK(o.defined() && o.device().is_cpu() && o.layout() == at::kStrided, "loom backend: ", what,
              ": every tensor of the list must be a dense CPU tensor");
  checkSameKind(like, o, what);
  TORCH_CHECK(o.numel() == like.numel(), "loom backend: ", what, ": a tensor of the list has ", o.numel(),
              " elements, expected ", like.numel());
}

// One contiguous tensor holding `parts` (as they travel) back to back, in
// loomMemAlloc memory when large (sharedEmpty).
at::Tensor flatten(const std::vector<at::Tensor>& parts) {
  int64_t n = 0;
  for (const at::Tensor& p : parts) n += wire(p).numel();
  at::Tensor flat = sharedEmpty(n, wire(parts.at(0)).options());
  int64_t off = 0;
  for (const at::Tensor& p : parts) {
    at::Tensor w = wire(p);
    flat.narrow(0, off, w.numel()).copy_(w.reshape({-1}));
    off += w.numel();
  }
  return flat;
}

// dst = the `n` traveling elements of flat from `offset` (dst any layout).
void copyInto(at::Tensor& dst, const at::Tensor& flat, int64_t offset) {
  at::Tensor src = flat.narrow(0, offset, wire(dst).numel());
  if (dst.is_complex()) src = at::view_as_complex(src.view({-1, 2}));
  dst.copy_(src.view(dst.sizes()));
}

// Releases the GIL for its scope if this thread holds it. torch 1.13 can
// drop the last reference to a group with the GIL held (destroy_process_group),
// while the completer thread may need the GIL to finish: a tensor whose last
// reference it releases has a Python object to free, a future callback may be
// Python. Joining it with the GIL held would deadlock.
class GilRelease {
 public:
  GilRelease() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

[[noreturn]] void failInit(const char* what, loomResult_t r, loomComm_t comm) {
  std::string detail = comm ? loomGetLastError(comm) : "";
  if (detail.empty()) detail = loomGetLastError(nullptr);
  TORCH_CHECK(false, "loom backend: ", what, " failed: ", loomGetErrorString(r), detail.empty() ? "" : ": ",
              detail);
}

}  // namespace

LoomWork::LoomWork(int rank, c10d::OpType type, const char* profilingTitle,
                   const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                   std::vector<at::Tensor> keepAlive, std::function<void()> copyOut)
    : c10d::Work(rank, type, profilingTitle, c10::optional<std::vector<at::Tensor>>(inputs)),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(keepAlive)),
      copyOut_(std::move(copyOut)),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

bool LoomWork::wait(std::chrono::milliseconds timeout) {
  if (queue_) queue_->issueHeld();
  if (timeout == kNoTimeout && !c10d::Work::isCompleted() && queue_) queue_->drain();
  return c10d::Work::wait(timeout);
}

bool LoomWork::isCompleted() {
  if (c10d::Work::isCompleted()) return true;
  if (queue_) queue_->issueHeld();
  return c10d::Work::isCompleted();
}

c10::intrusive_ptr<c10::ivalue::Future> LoomWork::getFuture() {
  if (queue_) queue_->issueHeld();
  return future_;
}

void LoomWork::complete(std::exception_ptr error) {
  if (!error && copyOut_) {
    try {
      copyOut_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  copyOut_ = nullptr;
  keepAlive_.clear();
  finish(error);
  if (error)
    future_->setError(error);
  else
    future_->markCompleted(c10::IValue(outputs_));
}

void LoomQueue::fail(const char* what, loomResult_t r) const {
  std::string detail = loomGetLastError(comm_);
  if (detail.empty()) detail = loomGetLastError(nullptr);
  TORCH_CHECK(false, "loom backend: ", what, " failed: ", loomGetErrorString(r), detail.empty() ? "" : ": ",
              detail);
}

void LoomQueue::issue(const char* what, const c10::intrusive_ptr<LoomWork>& work,
                      const std::function<loomResult_t()>& launch) {
  Failed failed;
  loomResult_t r = loomSuccess;
  {
    std::lock_guard<std::mutex> lock(m_);
    issueHeldLocked(&failed);
    r = launch();
    if (r == loomSuccess) {
      if (coalescing_) {
        coalesced_.push_back(work);
      } else {
        pending_.push_back(work);
        cv_.notify_one();
      }
    }
  }
  completeFailed(failed);
  if (r != loomSuccess) fail(what, r);
}

void LoomQueue::hold(const char* what, const c10::intrusive_ptr<LoomWork>& work,
                     std::function<loomResult_t()> launch) {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (!coalescing_) {
      held_.push_back({what, work, std::move(launch), std::chrono::steady_clock::now()});
      cv_.notify_one();  // the completer's deadline for held calls
      return;
    }
  }
  issue(what, work, launch);
}

void LoomQueue::issueHeld() {
  Failed failed;
  {
    std::lock_guard<std::mutex> lock(m_);
    issueHeldLocked(&failed);
  }
  completeFailed(failed);
}

void LoomQueue::issueHeldLocked(Failed* failed) {
  if (held_.empty()) return;
  std::vector<Held> held;
  held.swap(held_);
  // Inside an open group (coalescing) they simply join it.
  const bool own = !coalescing_ && held.size() > 1;
  loomResult_t r = own ? loomGroupStart() : loomSuccess;
  const char* what = own ? "loomGroupStart" : held[0].what;
  std::exception_ptr thrown;
  if (r == loomSuccess) {
    for (Held& h : held) {
      loomResult_t hr;
      try {
        hr = h.launch();
      } catch (...) {
        if (!thrown) thrown = std::current_exception();
        hr = loomInvalidArgument;
      }
      if (r == loomSuccess && hr != loomSuccess) r = hr, what = h.what;
    }
    if (own) {
      loomResult_t er = loomGroupEnd();  // a group with a bad member issues nothing
      if (r == loomSuccess && er != loomSuccess) r = er, what = "loomGroupEnd";
    }
  }
  if (r == loomSuccess && !thrown) {
    for (Held& h : held) {
      if (coalescing_)
        coalesced_.push_back(h.work);
      else
        pending_.push_back(h.work);
    }
    cv_.notify_one();
    return;
  }
  if (coalescing_ && !thrown) {
    // loom refused a member: loomGroupEnd (endCoalescing) fails the whole group, these too.
    for (Held& h : held) coalesced_.push_back(h.work);
    return;
  }
  std::exception_ptr error = thrown ? thrown : errorOf(what, r);
  for (Held& h : held) failed->emplace_back(h.work, error);
}

// Outside m_: a work's callbacks may drop the last reference to the group.
void LoomQueue::completeFailed(Failed& failed) {
  for (auto& f : failed) f.first->complete(f.second);
  failed.clear();
}

std::exception_ptr LoomQueue::errorOf(const char* what, loomResult_t r) const {
  try {
    fail(what, r);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

// Everything in `batch` was enqueued on the stream before the synchronize
// started, so it is complete when the synchronize returns. The stream reports
// the first error since the last synchronize; the whole batch carries it (a
// failed communicator fails every later call anyway). Several threads may
// complete batches (the completer, a waiting thread): each completes the
// batch it took, synchronizing one at a time, and once a synchronize has
// seen the communicator fail, every later batch carries that error too, so
// a batch whose own error another thread's synchronize took never
// completes as a success (syncMu_, failedWith_). The works complete
// outside streamLock_: their callbacks may drop the last reference to the
// group, whose destructor takes that lock exclusively.
void LoomQueue::completeBatch(std::deque<c10::intrusive_ptr<LoomWork>>& batch) {
  // Nothing taken, nothing to complete: a synchronize here (a wait() whose
  // work the completer thread already took) could take the error that
  // belongs to the completer's batch, which would then complete as a
  // success (the stream hands its error to one synchronize only).
  if (batch.empty()) return;
  std::exception_ptr error;
  {
    std::shared_lock<std::shared_mutex> lock(streamLock_);
    std::lock_guard<std::mutex> one(syncMu_);
    // Once closed, close() synchronized the stream: the batch is done.
    loomResult_t r = closed_ ? loomSuccess : loomStreamSynchronize(stream_);
    if (r != loomSuccess && failedWith_ == loomSuccess) {
      loomResult_t async = loomSuccess;
      if (loomCommGetAsyncError(comm_, &async) == loomSuccess && async != loomSuccess) failedWith_ = r;
    }
    if (r == loomSuccess) r = failedWith_;
    if (r != loomSuccess) {
      try {
        fail("operation", r);
      } catch (...) {
        error = std::current_exception();
      }
    }
  }
  for (auto& w : batch) w->complete(error);
  batch.clear();
}

void LoomQueue::drain() {
  std::deque<c10::intrusive_ptr<LoomWork>> batch;
  {
    std::lock_guard<std::mutex> lock(m_);
    batch.swap(pending_);
  }
  completeBatch(batch);
}

void LoomQueue::completerLoop() {
  for (;;) {
    std::deque<c10::intrusive_ptr<LoomWork>> batch;
    Failed failed;
    {
      std::unique_lock<std::mutex> lock(m_);
      for (;;) {
        if (stop_ || !pending_.empty()) break;
        if (held_.empty()) {
          cv_.wait(lock);
          continue;
        }
        // Held calls go out kHoldMs after the first was held.
        const auto due = held_.front().at + kHoldMs;
        if (std::chrono::steady_clock::now() >= due) {
          issueHeldLocked(&failed);
          break;
        }
        cv_.wait_until(lock, due);
      }
      if (pending_.empty() && failed.empty()) {
        if (stop_) return;
        continue;
      }
      batch.swap(pending_);
    }
    completeFailed(failed);
    completeBatch(batch);
  }
}

void LoomQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
}

void LoomQueue::close() {
  issueHeld();
  std::deque<c10::intrusive_ptr<LoomWork>> batch;
  std::exception_ptr error;
  {
    std::unique_lock<std::shared_mutex> lock(streamLock_);
    if (closed_) return;
    {
      std::lock_guard<std::mutex> l(m_);
      batch.swap(pending_);
      for (auto& w : coalesced_) batch.push_back(w);
      coalesced_.clear();
    }
    loomResult_t r = loomStreamSynchronize(stream_);
    if (r != loomSuccess) {
      try {
        fail("operation", r);
      } catch (...) {
        error = std::current_exception();
      }
    }
    loomStreamDestroy(stream_);
    loomCommDestroy(comm_);
    closed_ = true;
  }
  for (auto& w : batch) w->complete(error);
}

void LoomQueue::startCoalescing() {
  Failed failed;
  struct Complete {  // after m_ is released
    Failed& f;
    ~Complete() { completeFailed(f); }
  } complete{failed};
  std::lock_guard<std::mutex> lock(m_);
  TORCH_CHECK(!coalescing_, "loom backend: coalescing is already on");
  loomResult_t r = loomGroupStart();
  if (r != loomSuccess) fail("loomGroupStart", r);
  coalescing_ = true;
  // The held calls join the coalesced group (batch_isend_irecv after an
  // irecv: one group, as gloo would run them together).
  issueHeldLocked(&failed);
}

c10::intrusive_ptr<LoomWork> LoomQueue::endCoalescing() {
  std::lock_guard<std::mutex> lock(m_);
  TORCH_CHECK(coalescing_, "loom backend: endCoalescing without startCoalescing");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<LoomWork>> works;
  works.swap(coalesced_);
  loomResult_t r = loomGroupEnd();
  if (r != loomSuccess) {
    std::exception_ptr error;
    try {
      fail("loomGroupEnd", r);
    } catch (...) {
      error = std::current_exception();
    }
    for (auto& w : works) w->complete(error);
    std::rethrow_exception(error);
  }
  for (auto& w : works) pending_.push_back(w);
  cv_.notify_one();
  return works.empty() ? c10::intrusive_ptr<LoomWork>() : works.back();
}

ProcessGroupLoom::ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout)
    : GroupBase(rank, size) {
  loomUniqueId id;
  if (rank == 0) {
    loomResult_t r = loomGetUniqueId(&id);
    if (r != loomSuccess) failInit("loomGetUniqueId", r, nullptr);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(id.internal);
    store->set(kUniqueIdKey, std::vector<uint8_t>(bytes, bytes + sizeof id.internal));
  } else {
    store->wait({kUniqueIdKey}, timeout);
    std::vector<uint8_t> bytes = store->get(kUniqueIdKey);
    TORCH_CHECK(bytes.size() == sizeof id.internal, "loom backend: the unique id in the store has ",
                bytes.size(), " bytes, expected ", sizeof id.internal);
    memcpy(id.internal, bytes.data(), sizeof id.internal);
  }
  // The group's timeout bounds its init (a member that never joins fails
  // the others within it, as gloo's store timeout does) and every
  // operation: one that makes no progress for that long fails, naming the
  // rank it waited for.
  loomConfig_t config = LOOM_CONFIG_INITIALIZER;
  config.timeoutMs = std::max<int64_t>(1, timeout.count());
  loomResult_t r = loomCommInitRankConfig(&comm_, size, id, rank, &config);
  if (r != loomSuccess) failInit("loomCommInitRankConfig", r, comm_);
  start();
}

void ProcessGroupLoom::start() {
  loomResult_t r = loomStreamCreate(&stream_);
  if (r != loomSuccess) {
    loomCommAbort(comm_);
    failInit("loomStreamCreate", r, nullptr);
  }
  queue_ = std::make_shared<LoomQueue>(comm_, stream_);
  // The thread holds the queue, not the group.
  completer_ = std::thread([q = queue_] { q->completerLoop(); });
  init();
}

ProcessGroupLoom::ProcessGroupLoom(FromShrink, loomComm_t comm, int rank, int size, std::vector<int64_t> parentRanks)
    : GroupBase(rank, size), parentRanks_(std::move(parentRanks)) {
  comm_ = comm;
  start();
}

c10::intrusive_ptr<ProcessGroupLoom> ProcessGroupLoom::shrink(const std::vector<int64_t>& exclude) {
  std::vector<int> ex;
  for (int64_t r : exclude) {
    TORCH_CHECK(r >= 0 && r < size_, "loom backend: shrink: rank ", r, " is not a rank of this group of ", size_);
    ex.push_back(int(r));
  }
  GilRelease unlocked;
  loomCommRevoke(comm_);
  loomComm_t next = nullptr;
  loomResult_t r = loomCommShrink(comm_, ex.empty() ? nullptr : ex.data(), int(ex.size()), &next);
  TORCH_CHECK(r == loomSuccess, "loom backend: shrink: loomCommShrink: ", loomGetErrorString(r), ": ",
              loomGetLastError(comm_));
  if (!next) return c10::intrusive_ptr<ProcessGroupLoom>();
  int me = 0, n = 0;
  loomCommUserRank(next, &me);
  loomCommCount(next, &n);
  // Which rank of this group each new rank was.
  int64_t mine = rank_;
  std::vector<int64_t> parents(size_t(n), -1);
  r = loomAllGather(&mine, parents.data(), 1, loomInt64, next, nullptr);
  if (r != loomSuccess) {
    std::string why = loomGetLastError(next);
    loomCommAbort(next);
    TORCH_CHECK(false, "loom backend: shrink: exchanging ranks on the new communicator: ", why);
  }
  return c10::make_intrusive<ProcessGroupLoom>(FromShrink{}, next, me, n, std::move(parents));
}

// Runs on whichever thread drops the last reference to the group. That is
// never the completer through loom's own works (they hold the queue only);
// a user's future callback that owns the group could still make it so, and
// then the thread is detached instead of joining itself: it holds the queue
// and exits once nothing is pending.
ProcessGroupLoom::~ProcessGroupLoom() {
  GilRelease unlocked;
  queue_->stop();
  if (completer_.get_id() == std::this_thread::get_id())
    completer_.detach();
  else
    completer_.join();
  queue_->close();
}

c10::intrusive_ptr<GroupBase> ProcessGroupLoom::create(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                       int size, std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupLoom>(store, rank, size, timeout);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::issue(const char* what, c10::intrusive_ptr<LoomWork> work,
                                                       const std::function<loomResult_t()>& launch) {
  work->setQueue(queue_);
  queue_->issue(what, work, launch);
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::hold(const char* what, c10::intrusive_ptr<LoomWork> work,
                                                      std::function<loomResult_t()> launch) {
  work->setQueue(queue_);
  queue_->hold(what, work, std::move(launch));
  return work;
}

void ProcessGroupLoom::startCoalescing() { queue_->startCoalescing(); }

#if LOOM_TORCH_BACKEND
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::endCoalescing() {
  c10::intrusive_ptr<LoomWork> last = queue_->endCoalescing();
  if (last) return last;
  auto none = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::UNKNOWN, "loom:coalesced", std::vector<at::Tensor>{},
                                            std::vector<at::Tensor>{}, std::vector<at::Tensor>{}, nullptr);
  none->complete(nullptr);
  return none;
}
#else
void ProcessGroupLoom::endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& /*reqs*/) {
  queue_->endCoalescing();
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  at::Tensor t = single(tensors, "broadcast");
  TORCH_CHECK(opts.rootTensor == 0, "loom backend: broadcast: rootTensor must be 0");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "loom backend: broadcast: root ", opts.rootRank,
              " is not a rank of this group of ", size_);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::BROADCAST, "loom:broadcast", tensors, tensors,
                                         tensors, nullptr);
  return issue("loomBroadcast", w, [&] {
    return loomBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), int(opts.rootRank),
                         comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "loom backend: allreduce takes exactly one tensor per rank, got ",
              tensors.size());
  if (tensors[0].defined() && tensors[0].is_sparse()) {
    // loom reduces dense buffers: the sparse tensor's dense form is reduced
    // and the sum stored back (as a coalesced sparse tensor).
    // The shape is spelled out by hand: streaming the IntArrayRef itself
    // (c10's operator<<) died with SIGSEGV inside this module on torch 2.11's
    // pip build (a native backtrace on the H200 machine), where 1.13 printed it.
    std::string shape;
    for (int64_t d : tensors[0].sizes()) shape += (shape.empty() ? "" : " x ") + std::to_string(d);
    TORCH_WARN_ONCE("loom backend: all_reduce of a sparse tensor reduces its dense form (" + shape +
                    "); gloo exchanges only the nonzeros");
    at::Tensor sparse = tensors[0];
    at::Tensor dense = sparse.to_dense();
    TORCH_CHECK(dense.device().is_cpu(), "loom backend: allreduce: only CPU tensors are supported");
    at::Tensor t = wire(dense);
    loomRedOp_t op = redOpFor(opts.reduceOp, dense);
    dtypeFor(t);
    auto copyOut = [sparse, dense]() mutable { sparse.copy_(dense.to_sparse(sparse.sparse_dim())); };
    auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLREDUCE, "loom:all_reduce", tensors,
                                           tensors, std::vector<at::Tensor>{dense}, copyOut);
    return issue("loomAllReduce", w, [&] {
      return loomAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), op, comm_, stream_);
    });
  }
  at::Tensor t = single(tensors, "allreduce");
  loomRedOp_t op = redOpFor(opts.reduceOp, tensors[0]);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLREDUCE, "loom:all_reduce", tensors, tensors,
                                         tensors, nullptr);
  return issue("loomAllReduce", w, [&] {
    return loomAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), op, comm_, stream_);
  });
}

// One all-reduce over the tensors concatenated, then copied back.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "loom backend: allreduce_coalesced: no tensors");
  for (const at::Tensor& t : tensors) {
    checkTensor(t, "allreduce_coalesced");
    checkSameKind(tensors[0], t, "allreduce_coalesced");
  }
  loomRedOp_t op = redOpFor(opts.reduceOp, tensors[0]);
  at::Tensor flat = flatten(tensors);
  std::vector<at::Tensor> outs = tensors;
  auto copyOut = [flat, outs]() mutable {
    int64_t off = 0;
    for (at::Tensor& o : outs) {
      copyInto(o, flat, off);
      off += wire(o).numel();
    }
  };
  auto w =
      c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLREDUCE_COALESCED, "loom:all_reduce_coalesced",
                                    tensors, tensors, std::vector<at::Tensor>{flat}, copyOut);
  return issue("loomAllReduce", w, [&] {
    return loomAllReduce(flat.data_ptr(), flat.data_ptr(), size_t(flat.numel()), dtypeFor(flat), op, comm_,
                         stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  at::Tensor t = single(tensors, "reduce");
  TORCH_CHECK(opts.rootTensor == 0, "loom backend: reduce: rootTensor must be 0");
  TORCH_CHECK(opts.rootRank >= 0 && opts.rootRank < size_, "loom backend: reduce: root ", opts.rootRank,
              " is not a rank of this group of ", size_);
  loomRedOp_t op = redOpFor(opts.reduceOp, tensors[0]);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::REDUCE, "loom:reduce", tensors, tensors,
                                         tensors, nullptr);
  return issue("loomReduce", w, [&] {
    return loomReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), dtypeFor(t), op, int(opts.rootRank),
                      comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& /*opts*/) {
  at::Tensor in = single(inputs, "allgather");
  TORCH_CHECK(outputs.size() == 1, "loom backend: allgather takes one output list per rank, got ",
              outputs.size());
  std::vector<at::Tensor> outs = outputs[0];
  TORCH_CHECK(int(outs.size()) == size_, "loom backend: allgather: the output list has ", outs.size(),
              " tensors, expected the group size ", size_);
  for (const at::Tensor& o : outs) checkOutput(o, inputs[0], "allgather");
  int64_t m = in.numel();
  // In place (my input copied into my block of the target): both buffers
  // are then the pool's, which zero-copy needs.
  at::Tensor flat = sharedEmpty(int64_t(size_) * m, in.options());
  at::Tensor mine = flat.narrow(0, int64_t(rank_) * m, m);
  mine.copy_(in.reshape({-1}));
  auto copyOut = [flat, outs, m]() mutable {
    for (size_t i = 0; i < outs.size(); ++i) copyInto(outs[i], flat, int64_t(i) * m);
  };
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLGATHER, "loom:all_gather", inputs, outs,
                                         std::vector<at::Tensor>{in, flat}, copyOut);
  return issue("loomAllGather", w, [&] {
    return loomAllGather(mine.data_ptr(), flat.data_ptr(), size_t(m), dtypeFor(in), comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& /*opts*/) {
  checkTensor(input, "all_gather_into_tensor");
  checkTensor(output, "all_gather_into_tensor");
  checkSameKind(input, output, "all_gather_into_tensor");
  TORCH_CHECK(output.numel() == int64_t(size_) * input.numel(),
              "loom backend: all_gather_into_tensor: the output has ", output.numel(),
              " elements, expected group size x input = ", int64_t(size_) * input.numel());
  at::Tensor in = wire(input), out = wire(output);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::_ALLGATHER_BASE, "loom:all_gather_into_tensor",
                                         std::vector<at::Tensor>{input}, std::vector<at::Tensor>{output},
                                         std::vector<at::Tensor>{input, output}, nullptr);
  return issue("loomAllGather", w, [&] {
    return loomAllGather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), dtypeFor(in), comm_, stream_);
  });
}

// One all-gather of every input concatenated; outputLists[r][j] receives
// rank r's input j.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& /*opts*/) {
  TORCH_CHECK(!inputs.empty(), "loom backend: allgather_coalesced: no input tensors");
  for (const at::Tensor& t : inputs) {
    checkTensor(t, "allgather_coalesced");
    checkSameKind(inputs[0], t, "allgather_coalesced");
  }
  TORCH_CHECK(int(outputLists.size()) == size_, "loom backend: allgather_coalesced: ", outputLists.size(),
              " output lists, expected one per rank (", size_, ")");
  for (const auto& list : outputLists) {
    TORCH_CHECK(list.size() == inputs.size(), "loom backend: allgather_coalesced: an output list has ",
                list.size(), " tensors, expected one per input (", inputs.size(), ")");
    for (size_t j = 0; j < list.size(); ++j) checkOutput(list[j], inputs[j], "allgather_coalesced");
  }
  at::Tensor in = flatten(inputs);
  int64_t total = in.numel();
  at::Tensor flat = sharedEmpty(int64_t(size_) * total, in.options());
  std::vector<std::vector<at::Tensor>> outs = outputLists;
  auto copyOut = [flat, outs, total]() mutable {
    for (size_t r = 0; r < outs.size(); ++r) {
      int64_t off = int64_t(r) * total;
      for (at::Tensor& o : outs[r]) {
        copyInto(o, flat, off);
        off += wire(o).numel();
      }
    }
  };
  std::vector<at::Tensor> results;
  for (const auto& list : outputLists) results.insert(results.end(), list.begin(), list.end());
  auto w =
      c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLGATHER_COALESCED, "loom:all_gather_coalesced",
                                    inputs, results, std::vector<at::Tensor>{in, flat}, copyOut);
  return issue("loomAllGather", w, [&] {
    return loomAllGather(in.data_ptr(), flat.data_ptr(), size_t(total), dtypeFor(in), comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  at::Tensor in = single(inputs, "gather");
  int root = int(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "loom backend: gather: root ", root,
              " is not a rank of this group of ", size_);
  std::vector<at::Tensor> outs;
  at::Tensor flat;
  int64_t m = in.numel();
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1, "loom backend: gather: the root takes one output list, got ",
                outputs.size());
    outs = outputs[0];
    TORCH_CHECK(int(outs.size()) == size_, "loom backend: gather: the output list has ", outs.size(),
                " tensors, expected the group size ", size_);
    for (const at::Tensor& o : outs) checkOutput(o, inputs[0], "gather");
    flat = at::empty({int64_t(size_) * m}, in.options());
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                "loom backend: gather: only the root (rank ", root, ") takes an output list");
  }
  std::function<void()> copyOut;
  if (rank_ == root)
    copyOut = [flat, outs, m]() mutable {
      for (size_t i = 0; i < outs.size(); ++i) copyInto(outs[i], flat, int64_t(i) * m);
    };
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::GATHER, "loom:gather", inputs, outs,
                                         std::vector<at::Tensor>{in, flat}, copyOut);
  return issue("loomGather", w, [&] {
    return loomGather(in.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, size_t(m), dtypeFor(in),
                      root, comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  at::Tensor out = single(outputs, "scatter");
  int root = int(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "loom backend: scatter: root ", root,
              " is not a rank of this group of ", size_);
  at::Tensor flat;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1, "loom backend: scatter: the root takes one input list, got ",
                inputs.size());
    TORCH_CHECK(int(inputs[0].size()) == size_, "loom backend: scatter: the input list has ",
                inputs[0].size(), " tensors, expected the group size ", size_);
    for (const at::Tensor& i : inputs[0]) checkOutput(i, outputs[0], "scatter");
    flat = flatten(inputs[0]);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                "loom backend: scatter: only the root (rank ", root, ") takes an input list");
  }
  std::vector<at::Tensor> ins = rank_ == root ? inputs[0] : std::vector<at::Tensor>{};
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::SCATTER, "loom:scatter", ins, outputs,
                                         std::vector<at::Tensor>{flat, out}, nullptr);
  return issue("loomScatter", w, [&] {
    return loomScatter(flat.defined() ? flat.data_ptr() : nullptr, out.data_ptr(), size_t(out.numel()),
                       dtypeFor(out), root, comm_, stream_);
  });
}

// all_to_all_single: equal blocks through loomAllToAll, splits (rows of dim
// 0 per rank) through loomAllToAllv.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplits,
                                                               std::vector<int64_t>& inputSplits,
                                                               const c10d::AllToAllOptions& /*opts*/) {
  checkTensor(input, "all_to_all_single");
  checkTensor(output, "all_to_all_single");
  checkSameKind(input, output, "all_to_all_single");
  at::Tensor in = wire(input), out = wire(output);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLTOALL_BASE, "loom:all_to_all_single",
                                         std::vector<at::Tensor>{input}, std::vector<at::Tensor>{output},
                                         std::vector<at::Tensor>{input, output}, nullptr);
  if (outputSplits.empty() && inputSplits.empty()) {
    TORCH_CHECK(
        input.numel() == output.numel() && in.numel() % size_ == 0, "loom backend: all_to_all_single: ",
        "without splits, input and output need the same number of elements, a multiple of the group size ",
        size_, " (got ", input.numel(), " and ", output.numel(), ")");
    return issue("loomAllToAll", w, [&] {
      return loomAllToAll(in.data_ptr(), out.data_ptr(), size_t(in.numel() / size_), dtypeFor(in), comm_,
                          stream_);
    });
  }
  // Counts and displacements in traveling elements, from rows of dim 0.
  auto layout = [&](const at::Tensor& t, const at::Tensor& travel, const std::vector<int64_t>& splits,
                    const char* which, std::vector<size_t>* counts, std::vector<size_t>* displs) {
    TORCH_CHECK(t.dim() > 0, "loom backend: all_to_all_single: a 0-dim ", which, " cannot be split");
    int64_t rows = t.size(0), rowElems = rows ? travel.numel() / rows : 0;
    std::vector<int64_t> s = splits;
    if (s.empty()) {
      TORCH_CHECK(rows % size_ == 0, "loom backend: all_to_all_single: the ", which, "'s ", rows,
                  " rows do not split evenly over ", size_, " ranks");
      s.assign(size_t(size_), rows / size_);
    }
    TORCH_CHECK(int(s.size()) == size_, "loom backend: all_to_all_single: ", s.size(), " ", which,
                " split sizes, expected one per rank (", size_, ")");
    int64_t sum = 0;
    for (int64_t x : s) {
      TORCH_CHECK(x >= 0, "loom backend: all_to_all_single: negative ", which, " split size ", x);
      counts->push_back(size_t(x * rowElems));
      displs->push_back(size_t(sum * rowElems));
      sum += x;
    }
    TORCH_CHECK(sum == rows, "loom backend: all_to_all_single: the ", which, " split sizes add up to ", sum,
                " rows, the ", which, " has ", rows);
  };
  std::vector<size_t> sc, sd, rc, rd;
  layout(input, in, inputSplits, "input", &sc, &sd);
  layout(output, out, outputSplits, "output", &rc, &rd);
  return issue("loomAllToAllv", w, [&] {
    return loomAllToAllv(in.data_ptr(), sc.data(), sd.data(), out.data_ptr(), rc.data(), rd.data(),
                         dtypeFor(in), comm_, stream_);
  });
}

// all_to_all on lists: inputs[j] goes to rank j, outputs[i] comes from rank
// i; one loomAllToAllv over the lists packed into one buffer each.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& /*opts*/) {
  TORCH_CHECK(int(inputs.size()) == size_ && int(outputs.size()) == size_,
              "loom backend: all_to_all: ", inputs.size(), " inputs and ", outputs.size(),
              " outputs, expected one per rank (", size_, ")");
  for (const at::Tensor& t : inputs) {
    checkTensor(t, "all_to_all");
    checkSameKind(inputs[0], t, "all_to_all");
  }
  for (const at::Tensor& t : outputs) {
    TORCH_CHECK(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided,
                "loom backend: all_to_all: outputs must be dense CPU tensors");
    checkSameKind(inputs[0], t, "all_to_all");
  }
  at::Tensor in = flatten(inputs);
  std::vector<size_t> sc, sd, rc, rd;
  size_t off = 0;
  for (const at::Tensor& t : inputs)
    sc.push_back(size_t(wire(t).numel())), sd.push_back(off), off += sc.back();
  off = 0;
  for (const at::Tensor& t : outputs)
    rc.push_back(size_t(wire(t).numel())), rd.push_back(off), off += rc.back();
  at::Tensor flat = at::empty({int64_t(off)}, in.options());
  std::vector<at::Tensor> outs = outputs;
  auto copyOut = [flat, outs, rd]() mutable {
    for (size_t i = 0; i < outs.size(); ++i) copyInto(outs[i], flat, int64_t(rd[i]));
  };
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::ALLTOALL, "loom:all_to_all", inputs, outputs,
                                         std::vector<at::Tensor>{in, flat}, copyOut);
  return issue("loomAllToAllv", w, [&] {
    return loomAllToAllv(in.data_ptr(), sc.data(), sd.data(), flat.data_ptr(), rc.data(), rd.data(),
                         dtypeFor(in), comm_, stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  at::Tensor out = single(outputs, "reduce_scatter");
  TORCH_CHECK(inputs.size() == 1, "loom backend: reduce_scatter takes one input list per rank, got ",
              inputs.size());
  const std::vector<at::Tensor>& ins = inputs[0];
  TORCH_CHECK(int(ins.size()) == size_, "loom backend: reduce_scatter: the input list has ", ins.size(),
              " tensors, expected the group size ", size_);
  for (const at::Tensor& i : ins) checkOutput(i, outputs[0], "reduce_scatter");
  loomRedOp_t op = redOpFor(opts.reduceOp, outputs[0]);
  at::Tensor flat = flatten(ins);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::REDUCE_SCATTER, "loom:reduce_scatter", ins,
                                         outputs, std::vector<at::Tensor>{flat, out}, nullptr);
  return issue("loomReduceScatter", w, [&] {
    return loomReduceScatter(flat.data_ptr(), out.data_ptr(), size_t(out.numel()), dtypeFor(out), op, comm_,
                             stream_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  checkTensor(input, "reduce_scatter_tensor");
  checkTensor(output, "reduce_scatter_tensor");
  checkSameKind(input, output, "reduce_scatter_tensor");
  TORCH_CHECK(input.numel() == int64_t(size_) * output.numel(),
              "loom backend: reduce_scatter_tensor: the input has ", input.numel(),
              " elements, expected group size x output = ", int64_t(size_) * output.numel());
  loomRedOp_t op = redOpFor(opts.reduceOp, output);
  at::Tensor in = wire(input), out = wire(output);
  auto w = c10::make_intrusive<LoomWork>(
      rank_, c10d::OpType::_REDUCE_SCATTER_BASE, "loom:reduce_scatter_tensor", std::vector<at::Tensor>{input},
      std::vector<at::Tensor>{output}, std::vector<at::Tensor>{input, output}, nullptr);
  return issue("loomReduceScatter", w, [&] {
    return loomReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), dtypeFor(out), op, comm_,
                             stream_);
  });
}

// A one-byte all-reduce: returns on every rank only once all have entered.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::barrier(const c10d::BarrierOptions& /*opts*/) {
  at::Tensor token = at::zeros({1}, at::TensorOptions().dtype(at::kByte));
  auto w =
      c10::make_intrusive<LoomWork>(rank_, c10d::OpType::BARRIER, "loom:barrier", std::vector<at::Tensor>{},
                                    std::vector<at::Tensor>{}, std::vector<at::Tensor>{token}, nullptr);
  return issue("loomAllReduce (barrier)", w, [&] {
    return loomAllReduce(token.data_ptr(), token.data_ptr(), 1, loomUint8, loomMax, comm_, stream_);
  });
}

// Sends and receives are loom's tagged ones (loomSendTagged/loomRecvTagged):
// messages between two ranks match by tag, in order per tag, and a receive
// may take any source, as with gloo.
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                      int tag) {
  at::Tensor t = single(tensors, "send");
  TORCH_CHECK(tag >= 0, "loom backend: send: tags are >= 0; got ", tag);
  TORCH_CHECK(dstRank >= 0 && dstRank < size_ && dstRank != rank_,
              "loom backend: send: bad destination rank ", dstRank);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::SEND, "loom:send", tensors,
                                         std::vector<at::Tensor>{}, tensors, nullptr);
  return hold("loomSendTagged", w, [t, dstRank, tag, comm = comm_, stream = stream_] {
    return loomSendTagged(t.data_ptr(), size_t(t.numel()), dtypeFor(t), dstRank, tag, comm, stream);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                      int tag) {
  at::Tensor t = single(tensors, "recv");
  TORCH_CHECK(tag >= 0, "loom backend: recv: tags are >= 0; got ", tag);
  TORCH_CHECK(srcRank >= 0 && srcRank < size_ && srcRank != rank_, "loom backend: recv: bad source rank ",
              srcRank);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::RECV, "loom:recv", std::vector<at::Tensor>{},
                                         tensors, tensors, nullptr);
  return hold("loomRecvTagged", w, [t, srcRank, tag, comm = comm_, stream = stream_, status = w->status()] {
    return loomRecvTagged(t.data_ptr(), size_t(t.numel()), dtypeFor(t), srcRank, tag, comm, stream, status);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  at::Tensor t = single(tensors, "recv");
  TORCH_CHECK(tag >= 0, "loom backend: recv: tags are >= 0; got ", tag);
  auto w = c10::make_intrusive<LoomWork>(rank_, c10d::OpType::RECVANYSOURCE, "loom:recv_anysource",
                                         std::vector<at::Tensor>{}, tensors, tensors, nullptr);
  return hold("loomRecvTagged (any source)", w, [t, tag, comm = comm_, stream = stream_, status = w->status()] {
    return loomRecvTagged(t.data_ptr(), size_t(t.numel()), dtypeFor(t), LOOM_ANY_SOURCE, tag, comm, stream, status);
  });
}

}  // namespace loom_torch
