// The C entry points: validate arguments, translate to the core, and turn
// every internal exception into a result code plus a message.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "algorithms/algorithms.h"
#include "loom.h"
#include "src/core/bootstrap.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/stream.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_choice.h"
#include "src/device/device_memory.h"
#include "src/device/host_memory.h"
#include "src/device/host_reduce.h"

using namespace loom;

namespace {

thread_local std::string tlsLastError;
thread_local std::string tlsCommError;

// A group's members on one communicator.  They may use several streams,
// as NCCL allows: all run on the first (`stream`), which first waits for
// the others' earlier work, and the others then wait for the group's end
// (loomGroupEnd), as if the group were issued on each of them.  On a host
// communicator a NULL stream among them makes the group a blocking call
// that first waits for the loom streams' earlier work.
struct GroupPart {
  loomComm* comm = nullptr;
  std::shared_ptr<loomComm> keep;  // the group's hold: destroyed elsewhere, it lives until the group ends
  loomStream_t stream = nullptr;
  std::vector<loomStream_t> others;  // the other streams its members named, each once
  std::vector<OpDesc> ops;
};
struct GroupState {
  int depth = 0;
  std::vector<GroupPart> parts;  // in the order the communicators joined
  loomResult_t error = loomSuccess;
  std::string errorMsg;
};
thread_local GroupState tlsGroup;
// Threads with a group open (loomGroupStart without its loomGroupEnd): while
// none has, a blocking call needs no look at its thread's group (a TLS
// lookup through __tls_get_addr in a shared library).
std::atomic<int> gOpenGroups{0};

// Adds checked members to the caller's group (several streams per
// communicator: GroupPart).  Several communicators only when all are CUDA
// ones (their calls only enqueue, so one thread can
// issue every rank's part; a host communicator's group runs on the
// calling thread and would wait there for its peers while the next
// communicator's part, maybe the one they wait for, has not started).
void joinGroup(GroupState& g, loomComm* comm, loomStream_t stream, const std::vector<OpDesc>& ops) {
  for (GroupPart& part : g.parts)
    if (part.comm == comm) {
      if (part.stream != stream && std::find(part.others.begin(), part.others.end(), stream) == part.others.end())
        part.others.push_back(stream);
      part.ops.insert(part.ops.end(), ops.begin(), ops.end());
      return;
    }
  if (!g.parts.empty() && (!comm->deviceComm() || !g.parts[0].comm->deviceComm()))
    fail(loomInvalidUsage,
         "a group spanning several communicators needs CUDA communicators (LOOM_DEVICE=cuda); a host "
         "communicator's group must use that communicator alone");
  g.parts.push_back(GroupPart{comm, comm->shared_from_this(), stream, {}, ops});
}

// Runs f, converting exceptions into a result code and a message that names
// the call.
//
// A call holds its communicator while it runs: loomCommAbort from another
// thread (a watchdog's way out of a call blocked on dead peers) releases the
// handle at once, and the communicator is freed when the last call using it
// has returned, after it saw the abort.  Calls that take a communicator but
// pass none here hold it themselves (Hold).
template <class F>
LOOM_HOT loomResult_t guarded(const char* call, loomComm* comm, F&& f) {
  const std::shared_ptr<loomComm> hold = comm ? comm->weak_from_this().lock() : nullptr;
  try {
    loomResult_t r = f();
    if (r != loomSuccess && comm) tlsLastError = std::string(call) + ": " + comm->lastError() + comm->deadSuffix();
    return r;
  } catch (const Error& e) {
    tlsLastError = std::string(call) + ": " + e.what();
    if (comm) comm->setLastError(tlsLastError);
    return e.code();
  } catch (const std::bad_alloc&) {
    tlsLastError = std::string(call) + ": out of memory";
    return loomSystemError;
  } catch (const std::exception& e) {
    tlsLastError = std::string(call) + ": internal error: " + e.what();
    return loomInternalError;
  }
}

// Enum arguments come from C callers as plain ints, and an out-of-range
// value of an enum type is undefined behaviour in C++: read them as ints,
// before any other use.
int rawInt(const void* e) {
  int v;
  memcpy(&v, e, sizeof v);
  return v;
}

LOOM_HOT loomResult_t checkEnums(const char* call, loomComm* comm, const loomDataType_t* type,
                                 const loomRedOp_t* op) {
  int t = rawInt(type);
  if (t < 0 || t >= int(loomNumTypes)) {
    tlsLastError = strf("%s: unknown datatype %d", call, t);
  } else if (op && (rawInt(op) < 0 || rawInt(op) >= int(loomNumOps))) {
    tlsLastError = strf("%s: unknown reduction op %d", call, rawInt(op));
  } else {
    return loomSuccess;
  }
  if (comm) comm->setLastError(tlsLastError);  // as every other refusal of a call on it
  GroupState& g = tlsGroup;
  if (g.depth > 0 && g.error == loomSuccess) {
    g.error = loomInvalidArgument;
    g.errorMsg = tlsLastError;
  }
  return loomInvalidArgument;
}

LOOM_HOT void checkComm(const loomComm* comm) {
  if (!comm) fail(loomInvalidArgument, "comm is NULL");
  // A forked child shares the parent's sockets and windows: an operation
  // there would take the parent's data (and the child's result is wrong).
  if (__builtin_expect(!comm->madeInThisProcess(), 0))
    fail(loomInvalidUsage,
         "the communicator belongs to process %d, and this process (%d) is a fork of it: a child cannot use its "
         "parent's communicators (destroying one only lets go of the handle); create one in the child",
         comm->creatorPid(), int(getpid()));
}

LOOM_HOT void checkType(loomDataType_t t) {
  if (int(t) < 0 || int(t) >= int(loomNumTypes)) fail(loomInvalidArgument, "unknown datatype %d", int(t));
}

LOOM_HOT void checkOp(loomRedOp_t op) {
  if (int(op) < 0 || int(op) >= int(loomNumOps)) fail(loomInvalidArgument, "unknown reduction op %d", int(op));
}

// count * esz * factor bytes, failing on overflow.
LOOM_HOT size_t checkedBytes(size_t count, loomDataType_t t, size_t factor) {
  size_t esz = dtypeSize(t);
  if (count > size_t(PTRDIFF_MAX) / esz / factor)
    fail(loomInvalidArgument, "count %zu of %s is too large (byte size overflows)", count, dtypeName(t));
  return count * esz * factor;
}

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

void checkRank(const char* what, int r, int nranks) {
  if (r < 0 || r >= nranks) fail(loomInvalidArgument, "%s %d is out of range [0, %d)", what, r, nranks);
}

// Validates one collective; throws loomInvalidArgument with the reason.
LOOM_HOT void validate(loomComm* comm, const OpDesc& op) {
  checkComm(comm);
  checkType(op.dtype);
  if (reduces(op.coll)) checkOp(op.op);
  int n = comm->nranks(), me = comm->rank();
  checkedBytes(op.count, op.dtype, perRankCount(op.coll) ? size_t(n) : 1);  // overflow
  if (rooted(op.coll)) checkRank("root", op.root, n);
  if (op.coll == Collective::P2P && !(op.tagged && !op.isSend && op.peer == LOOM_ANY_SOURCE))
    checkRank("peer", op.peer, n);
  if (op.tagged && op.tag < 0 && !(op.tag == LOOM_ANY_TAG && !op.isSend))
    fail(loomInvalidArgument, "tag %d is negative (tags are >= 0; a receive may use LOOM_ANY_TAG)", op.tag);
  // A host communicator's kernels given device memory would fault; a CUDA
  // communicator checks its buffers itself (DeviceComm::run).
  if (!comm->deviceComm() && (op.sendMem == MemoryKind::CudaDevice || op.recvMem == MemoryKind::CudaDevice)) {
    const bool s = op.sendMem == MemoryKind::CudaDevice;
    const void* p = s ? op.sendbuf : op.recvbuf;
    fail(loomInvalidArgument,
         "%s %p is CUDA device memory (cuda:%d), but this communicator runs on the host: pass host memory, or "
         "create the communicator with LOOM_DEVICE=cuda",
         s ? "sendbuff" : "recvbuff", p, cudaPointerDevice(p));
  }
  if (op.count == 0) return;
  const bool root = me == op.root;
  bool needSend = true, needRecv = true;
  switch (op.coll) {
    case Collective::Broadcast: needSend = root; break;
    case Collective::Scatter: needSend = root; break;
    case Collective::Reduce: needRecv = root; break;
    case Collective::Gather: needRecv = root; break;
    case Collective::P2P: needSend = op.isSend, needRecv = !op.isSend; break;
    default: break;
  }
  if (needSend && !op.sendbuf) fail(loomInvalidArgument, "sendbuff is NULL");
  if (needRecv && !op.recvbuf) fail(loomInvalidArgument, "recvbuff is NULL");
  if (!needSend || !needRecv) return;
  // The buffers may overlap only in NCCL's in-place layouts.
  const char* s = static_cast<const char*>(op.sendbuf);
  const char* r = static_cast<const char*>(op.recvbuf);
  const size_t block = op.count * dtypeSize(op.dtype);
  const char* inPlace = "sendbuff = recvbuff";  // the layout allowed, for the message
  bool isInPlace = false;
  switch (op.coll) {
    case Collective::AllGather:
      isInPlace = s == r + size_t(me) * block, inPlace = "sendbuff = recvbuff + rank*sendcount";
      break;
    case Collective::ReduceScatter:
      isInPlace = r == s + size_t(me) * block, inPlace = "recvbuff = sendbuff + rank*recvcount";
      break;
    case Collective::Gather:
      isInPlace = s == r + size_t(op.root) * block, inPlace = "sendbuff = recvbuff + root*count";
      break;
    case Collective::Scatter:
      isInPlace = r == s + size_t(op.root) * block, inPlace = "recvbuff = sendbuff + root*count";
      break;
    // All-to-all too: NCCL accepts it (nccl-tests' in-place column calls it).
    default: isInPlace = s == r; break;
  }
  if (!isInPlace && overlaps(s, sendBytes(op, n), r, recvBytes(op, n)))
    fail(loomInvalidArgument, "sendbuff and recvbuff overlap outside NCCL's in-place layout (%s)", inPlace);
}

// The host stream behind a handle, nullptr for NULL.  Anything else fails
// without being dereferenced: a cudaStream_t passed as loomStream_t (as NCCL
// programs do) is recognised here once loom has CUDA communicators.
LOOM_HOT HostStream* hostStreamOf(loomStream_t stream) {
  StreamRef s = classifyStream(stream);
  switch (s.kind) {
    case StreamKind::Null: return nullptr;
    case StreamKind::Host: return s.host;
    case StreamKind::Destroyed:
      fail(loomInvalidArgument, "stream %p was destroyed (loomStreamDestroy)", static_cast<void*>(stream));
    case StreamKind::Foreign: break;
  }
  fail(loomInvalidArgument,
       "stream %p is not a loom stream; a CUDA stream needs a CUDA communicator (LOOM_DEVICE=cuda)",
       static_cast<void*>(stream));
}

// The cudaStream_t behind a CUDA communicator's stream argument (NULL: the
// legacy default stream).  A loom host stream is refused, and so is the
// legacy stream while a blocking stream of its device is captured; whether the
// stream is being captured in *captureState (usableCaptureState).
void* cudaStreamOf(loomStream_t stream, int* captureState = nullptr) {
  StreamRef s = classifyStream(stream);
  switch (s.kind) {
    case StreamKind::Host:
      fail(loomInvalidArgument,
           "stream %p is a loom host stream, but this communicator runs on CUDA: pass a cudaStream_t",
           static_cast<void*>(stream));
    case StreamKind::Destroyed:
      fail(loomInvalidArgument, "stream %p was destroyed (loomStreamDestroy)", static_cast<void*>(stream));
    case StreamKind::Null:
    case StreamKind::Foreign:
      break;
  }
  const int state = usableCaptureState(static_cast<void*>(stream));
  if (captureState) *captureState = state;
  return static_cast<void*>(stream);
}

// cudaStreamOf for a call of `comm` (p2p: sends and receives): on a stream
// being captured into a CUDA graph, only what the communicator's path can
// capture is taken (DeviceCollectives::checkCapture: the ipc path's graph
// lane captures collectives), before anything is issued (a group member:
// at its call, so the group launches nothing).
void* deviceStreamOf(loomComm* comm, loomStream_t stream, bool p2p) {
  int capturing = 0;
  void* cs = cudaStreamOf(stream, &capturing);
  if (capturing) comm->deviceComm()->checkCapture(cs, p2p);
  return cs;
}

// A collective on a CUDA communicator: compiled to a stream program and
// enqueued on the caller's cudaStream_t; returns once enqueued.
// Runs f on a CUDA communicator's device side: an error that left it failed
// (an enqueue stopped half-way: the peers' rounds no longer agree with this
// rank's) fails the whole communicator.
template <class F>
auto onDevice(loomComm* comm, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (comm->deviceComm()->failed()) comm->setFailed(e.code(), e.what());
    throw;
  }
}

// Begins a collective (op) or a batch of sends and receives (p2p, one
// stream program: DeviceComm::runP2P) on a CUDA communicator; step() then
// enqueues it.  nullptr: enqueued whole already (a path that does not step).
std::unique_ptr<SteppedRun> beginOnDevice(loomComm* comm, loomStream_t stream, const OpDesc* op,
                                          const std::vector<OpDesc>* p2p) {
  void* cs = deviceStreamOf(comm, stream, op == nullptr || op->coll == Collective::P2P);
  loomResult_t prior = comm->asyncError();
  if (prior != loomSuccess) fail(prior, "the communicator has failed: %s", comm->failure().c_str());
  return onDevice(comm, [&] {
    DeviceCollectives* d = comm->deviceComm();
    std::unique_ptr<SteppedRun> r = op ? d->beginRun(*op, cs) : d->beginRunP2P(*p2p, cs);
    if (!r) {
      if (op)
        d->run(*op, cs);
      else
        d->runP2P(*p2p, cs);
    }
    return r;
  });
}

bool stepOnDevice(loomComm* comm, SteppedRun& run, size_t maxOps) {
  return onDevice(comm, [&] { return run.step(maxOps); });
}

loomResult_t runOnDevice(loomComm* comm, loomStream_t stream, const OpDesc& op) {
  std::unique_ptr<SteppedRun> r = beginOnDevice(comm, stream, &op, nullptr);
  if (r) stepOnDevice(comm, *r, SIZE_MAX);
  return loomSuccess;
}

// Sends and receives on a CUDA communicator as one stream program
// (DeviceComm::runP2P).
loomResult_t runP2POnDevice(loomComm* comm, loomStream_t stream, const std::vector<OpDesc>& ops) {
  std::unique_ptr<SteppedRun> r = beginOnDevice(comm, stream, nullptr, &ops);
  if (r) stepOnDevice(comm, *r, SIZE_MAX);
  return loomSuccess;
}

// Where a buffer the caller passed lives: CUDA device memory if CUDA says
// so (only asked when the process has a CUDA device), else host memory.
LOOM_HOT MemoryKind memoryKindOf(const void* buf) {
  return cudaPointerDevice(buf) >= 0 ? MemoryKind::CudaDevice : MemoryKind::Host;
}

// Issues a batch of operations on comm/stream (NULL stream: runs it now).
// What one rank can tell wrong about a batch before it takes sequence
// numbers (so the communicator stays usable and in step with its peers):
// tagged and plain operations mixed, sends to itself without their receives.
void checkBatch(const loomComm* comm, const std::vector<OpDesc>& ops) {
  size_t tagged = 0;
  std::vector<size_t> sends, recvs;  // bytes of plain sends to / receives from this rank, in order
  for (const OpDesc& op : ops) {
    tagged += op.tagged;
    if (op.coll == Collective::P2P && !op.tagged && op.peer == comm->rank())
      (op.isSend ? sends : recvs).push_back(op.count * dtypeSize(op.dtype));
  }
  if (tagged && tagged != ops.size())
    fail(loomInvalidUsage,
         "rank %d: a group mixes tagged sends/receives (loomSendTagged, loomRecvTagged) with other operations; issue "
         "them in separate groups",
         comm->rank());
  if (sends.empty() && recvs.empty()) return;
  if (ops.size() == 1)
    fail(loomInvalidUsage, "rank %d: a %s this rank itself needs its %s in the same group (loomGroupStart/End)",
         comm->rank(), sends.empty() ? "receive from" : "send to", sends.empty() ? "send" : "receive");
  if (sends.size() != recvs.size())
    fail(loomInvalidUsage, "rank %d: a group has %zu sends to itself but %zu receives from itself", comm->rank(),
         sends.size(), recvs.size());
  for (size_t k = 0; k < sends.size(); ++k)
    if (sends[k] != recvs[k])
      fail(loomInvalidUsage, "rank %d: send to self of %zu bytes matched with a receive of %zu", comm->rank(),
           sends[k], recvs[k]);
}

// Taking a ticket and enqueuing what it runs happen under one process-wide
// lock (held for both, never while an operation runs).  Otherwise two
// threads issuing on one communicator could enqueue on one loom stream in
// the opposite order to their tickets and each wait for the other's turn,
// and a joined group's markers (submitJoined) could land behind another
// thread's later operation, or two joined groups' markers cross.
std::mutex gEnqueueMu;

// A group's operations as one run on its stream, in its turn.
struct IssuedGroup {
  std::shared_ptr<loomComm> comm;
  std::vector<OpDesc> ops;
  std::vector<SlotTag> tags;
  uint64_t ticket = 0;
  loomResult_t run() const {
    comm->waitTurn(ticket);
    loomResult_t r = comm->runOps(ops, tags);
    comm->endTurn();
    return r;
  }
};

// Checks a group's operations and takes their turn (the caller holds
// gEnqueueMu when it will enqueue them).
IssuedGroup issueGroup(loomComm* comm, std::vector<OpDesc> ops) {
  loomResult_t prior = comm->asyncError();
  if (prior != loomSuccess) fail(prior, "the communicator has failed: %s", comm->failure().c_str());
  checkBatch(comm, ops);
  IssuedGroup g;
  g.comm = comm->shared_from_this();
  g.ops = std::move(ops);
  g.ticket = comm->issue(g.ops, &g.tags);
  return g;
}

loomResult_t submit(loomComm* comm, HostStream* stream, std::vector<OpDesc> ops) {
  if (!stream) return issueGroup(comm, std::move(ops)).run();
  std::lock_guard<std::mutex> lock(gEnqueueMu);
  auto g = std::make_shared<IssuedGroup>(issueGroup(comm, std::move(ops)));
  stream->enqueue([g] { return g->run(); });
  return loomSuccess;
}

// A host communicator's group whose members named several streams
// (GroupPart): as if issued on each of them.  All loom streams: each other
// stream reaches a marker that waits for the group's end and then reports
// its result; the first stream waits for every marker, then runs the group
// and lets them go (one operation).  A NULL stream among them: the group
// blocks here, after every loom stream's earlier work.  Nothing is enqueued
// unless the group was checked and has its turn.
loomResult_t submitJoined(loomComm* comm, const GroupPart& part) {
  HostStream* main = hostStreamOf(part.stream);
  std::vector<HostStream*> others;
  bool blocking = !main;
  for (loomStream_t s : part.others) {
    HostStream* h = hostStreamOf(s);
    if (h)
      others.push_back(h);
    else
      blocking = true;
  }
  if (blocking) {
    if (main) main->drain();
    for (HostStream* h : others) h->drain();
    return submit(comm, nullptr, part.ops);
  }
  struct Join {
    IssuedGroup group;
    std::mutex m;
    std::condition_variable cv;
    size_t arrived = 0;
    bool done = false;
    loomResult_t result = loomSuccess;
  };
  auto j = std::make_shared<Join>();
  const size_t n = others.size();
  std::lock_guard<std::mutex> lock(gEnqueueMu);
  j->group = issueGroup(comm, part.ops);
  main->enqueue([j, n] {
    {
      std::unique_lock<std::mutex> g(j->m);
      j->cv.wait(g, [&] { return j->arrived == n; });
    }
    const loomResult_t r = j->group.run();
    {
      std::lock_guard<std::mutex> g(j->m);
      j->done = true;
      j->result = r;
    }
    j->cv.notify_all();
    return r;
  });
  for (HostStream* h : others)
    h->enqueue([j] {
      std::unique_lock<std::mutex> g(j->m);
      ++j->arrived;
      j->cv.notify_all();
      j->cv.wait(g, [&] { return j->done; });
      return j->result;
    });
  return loomSuccess;
}

// The latency path (8 ranks on 2 cores pay this once per rank and time
// slice): an all-reduce on the host with the NULL stream, from a process where
// no thread is inside a group, whose arguments need none of validate()'s
// general checks: at most 16 elements (no overflow), host buffers that are
// one buffer or do not overlap.  The same turn and run as the
// general path; anything else, errors included, goes there.
LOOM_HOT bool plainSmallAllReduce(const loomComm* comm, loomStream_t stream, const OpDesc& op) {
  if (stream || !comm || op.coll != Collective::AllReduce || gOpenGroups.load(std::memory_order_relaxed) != 0)
    return false;
  const size_t bytes = op.count * dtypeSize(op.dtype);
  const char* s = static_cast<const char*>(op.sendbuf);
  const char* r = static_cast<const char*>(op.recvbuf);
  return op.count <= 16 && bytes > 0 && s && r && (s == r || s + bytes <= r || r + bytes <= s) &&
         op.sendMem == MemoryKind::Host && op.recvMem == MemoryKind::Host && !comm->deviceComm();
}

// A blocking call (NULL stream), checked: runs it here, in its turn,
// without allocating (the latency path).
LOOM_HOT loomResult_t runBlocking(loomComm* comm, const OpDesc& op) {
  loomResult_t prior = comm->asyncError();
  if (prior != loomSuccess) fail(prior, "the communicator has failed: %s", comm->failure().c_str());
  if (op.coll == Collective::P2P && op.peer == comm->rank()) checkBatch(comm, {op});
  SlotTag tag;
  uint64_t ticket = comm->issueOne(op, &tag);
  comm->waitTurn(ticket);
  loomResult_t r = comm->runOne(op, tag);
  comm->endTurn();
  return r;
}

LOOM_HOT loomResult_t issueOp(const char* call, loomComm* comm, loomStream_t stream, const OpDesc& op) {
  if (plainSmallAllReduce(comm, stream, op)) return guarded(call, comm, [&] { return runBlocking(comm, op); });
  return guarded(call, comm, [&]() -> loomResult_t {
    GroupState& g = tlsGroup;
    HostStream* hostStream;
    try {
      validate(comm, op);
      if (comm->deviceComm()) {
        if (g.depth == 0) return runOnDevice(comm, stream, op);
        // In a group: checked now, enqueued by loomGroupEnd with the rest
        // (a group with a bad member enqueues nothing).
        deviceStreamOf(comm, stream, op.coll == Collective::P2P);
        comm->deviceComm()->check(op);
      }
      hostStream = comm->deviceComm() ? nullptr : hostStreamOf(stream);
      if (g.depth > 0) {
        joinGroup(g, comm, stream, {op});
        return loomSuccess;
      }
    } catch (const Error& e) {
      // A group with a bad member is not launched at all (see loomGroupEnd).
      if (g.depth > 0 && g.error == loomSuccess) {
        g.error = e.code();
        g.errorMsg = std::string(call) + ": " + e.what();
      }
      throw;
    }
    if (!stream) return runBlocking(comm, op);
    return submit(comm, hostStream, {op});
  });
}

// All-to-allv: a group of sends and receives (algorithms/pairwise_exchange.cc).
// Issues what check() returns after it validated the arguments, as one group
// or into the caller's group.
template <class Check>
loomResult_t issueExchange(const char* call, loomComm* comm, loomStream_t stream, Check&& check) {
  return guarded(call, comm, [&]() -> loomResult_t {
    GroupState& g = tlsGroup;
    std::vector<OpDesc> ops;
    HostStream* hostStream;
    try {
      checkComm(comm);
      ops = check(comm->nranks(), comm->rank());
      for (OpDesc& op : ops) {
        if (op.sendbuf) op.sendMem = memoryKindOf(op.sendbuf);
        if (op.recvbuf) op.recvMem = memoryKindOf(op.recvbuf);
        validate(comm, op);
      }
      if (comm->deviceComm()) {
        // One send/recv program (or into the caller's group, checked now).
        if (g.depth == 0) return ops.empty() ? loomSuccess : runP2POnDevice(comm, stream, ops);
        deviceStreamOf(comm, stream, true);
        for (const OpDesc& op : ops) comm->deviceComm()->check(op);
      }
      hostStream = comm->deviceComm() ? nullptr : hostStreamOf(stream);
      if (ops.empty()) return loomSuccess;
      if (g.depth > 0) {
        joinGroup(g, comm, stream, ops);
        return loomSuccess;
      }
    } catch (const Error& e) {
      if (g.depth > 0 && g.error == loomSuccess) {
        g.error = e.code();
        g.errorMsg = std::string(call) + ": " + e.what();
      }
      throw;
    }
    return submit(comm, hostStream, std::move(ops));
  });
}

const char* at(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }

// All-to-all, gather or scatter as one collective (the registry's pairwise,
// bruck or one-shot algorithms run it); validate() checks it like the rest.
OpDesc exchange(Collective coll, const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                int root) {
  OpDesc d;
  d.coll = coll;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = count;
  d.dtype = datatype;
  d.root = root;
  return d;
}

// A send (buf is the send buffer) or a receive from or to `peer`; tagged
// ones carry their tag (and a receive its status).
OpDesc pointToPoint(bool isSend, const void* buf, size_t count, loomDataType_t datatype, int peer) {
  OpDesc d;
  d.coll = Collective::P2P;
  if (isSend) {
    d.sendbuf = buf;
    d.sendMem = memoryKindOf(buf);
  } else {
    d.recvbuf = const_cast<void*>(buf);  // loomRecv's own (non-const) buffer
    d.recvMem = memoryKindOf(buf);
  }
  d.count = count;
  d.dtype = datatype;
  d.peer = peer;
  d.isSend = isSend;
  return d;
}

OpDesc tagged(OpDesc d, int tag, loomP2PStatus* status) {
  d.tagged = true;
  d.tag = tag;
  d.status = status;
  return d;
}

// The bytes of loomConfig_t in each version (index: version), so that a
// struct from an older loom.h is read as what it is.
struct ConfigV1 {  // loomConfig_t as version 1 of loom.h had it
  size_t size;
  unsigned int magic, version;
  int deviceKind, cudaDevice;
};
constexpr size_t kConfigBytes[] = {0, sizeof(ConfigV1), sizeof(loomConfig_t)};
static_assert(sizeof kConfigBytes / sizeof kConfigBytes[0] == LOOM_CONFIG_VERSION + 1,
              "a size for every config version");

// What loomCommInitRankConfig's config asks for; throws loomInvalidArgument
// naming the field.  NULL: LOOM_DEVICE and the current device.
DeviceRequest deviceRequestOf(const loomConfig_t* config) {
  DeviceRequest r;
  if (!config) return r;
  if (config->magic != LOOM_CONFIG_MAGIC)
    fail(loomInvalidArgument,
         "config was not initialised with LOOM_CONFIG_INITIALIZER (magic 0x%x, expected 0x%x)", config->magic,
         LOOM_CONFIG_MAGIC);
  if (config->version < 1 || config->version > LOOM_CONFIG_VERSION)
    fail(loomInvalidArgument,
         "config version %u: this library (loom %d.%d.%d) knows loomConfig_t versions 1 to %d; was the "
         "program built against another loom.h?",
         config->version, LOOM_MAJOR, LOOM_MINOR, LOOM_PATCH, LOOM_CONFIG_VERSION);
  if (config->size != kConfigBytes[config->version])
    fail(loomInvalidArgument,
         "config size %zu: a version %u loomConfig_t has %zu bytes (not initialised with "
         "LOOM_CONFIG_INITIALIZER, or built against another loom.h?)",
         config->size, config->version, kConfigBytes[config->version]);
  const int kind = config->deviceKind;
  switch (kind) {
    case loomDeviceFromEnv: r.kind = DeviceRequest::Kind::FromEnv; break;
    case loomDeviceHost: r.kind = DeviceRequest::Kind::Host; break;
    case loomDeviceCuda: r.kind = DeviceRequest::Kind::Cuda; break;
    case loomDeviceAuto: r.kind = DeviceRequest::Kind::Auto; break;
    default:
      fail(loomInvalidArgument,
           "config deviceKind %d is not a loomDeviceKind_t (loomDeviceFromEnv 0, loomDeviceHost 1, "
           "loomDeviceCuda 2, loomDeviceAuto 3)",
           kind);
  }
  if (config->cudaDevice < -1)
    fail(loomInvalidArgument,
         "config cudaDevice %d: expected a CUDA device ordinal (>= 0), or -1 for the current device",
         config->cudaDevice);
  if (kind == loomDeviceHost && config->cudaDevice >= 0)
    fail(loomInvalidArgument, "config cudaDevice %d names a CUDA device, but deviceKind is loomDeviceHost",
         config->cudaDevice);
  r.device = config->cudaDevice;
  if (config->version >= 2) {
    if (config->timeoutMs < 0)
      fail(loomInvalidArgument, "config timeoutMs %lld: expected milliseconds (> 0), or 0 for LOOM_TIMEOUT_MS",
           config->timeoutMs);
    // Deadlines are now + timeout: a year is forever enough, and no overflow.
    r.timeoutMs = int64_t(std::min<long long>(config->timeoutMs, 365LL * 24 * 3600 * 1000));
  }
  return r;
}

loomResult_t initRank(const char* call, loomComm_t* comm, int nranks, const loomUniqueId& commId, int rank,
                      const loomConfig_t* config) {
  return guarded(call, nullptr, [&] {
    if (!comm) fail(loomInvalidArgument, "comm is NULL");
    *comm = nullptr;
    if (nranks < 1) fail(loomInvalidArgument, "nranks %d must be at least 1", nranks);
    checkRank("rank", rank, nranks);
    const DeviceRequest device = deviceRequestOf(config);
    configReload();
    checkDeviceChoice(device);  // before waiting for the peers
    UniqueIdData id = decodeUniqueId(commId);
    std::shared_ptr<loomComm> c = loomComm::create(id, nranks, rank, nullptr, device);
    *comm = c.get();
    return loomSuccess;
  });
}

}  // namespace

extern "C" {

loomResult_t loomGetVersion(int* version) {
  if (!version) {
    tlsLastError = "loomGetVersion: version is NULL";
    return loomInvalidArgument;
  }
  *version = LOOM_VERSION_CODE;
  return loomSuccess;
}

const char* loomGetErrorString(loomResult_t r) {
  switch (r) {
    case loomSuccess: return "no error";
    case loomUnhandledCudaError: return "unhandled cuda error";
    case loomSystemError: return "unhandled system error (socket, memory, ...)";
    case loomInternalError: return "internal error (a bug in loom)";
    case loomInvalidArgument: return "invalid argument";
    case loomInvalidUsage: return "invalid usage (wrong call sequence or ranks that disagree)";
    case loomRemoteError: return "remote error (a peer died, aborted or closed its connection)";
    case loomInProgress: return "operation in progress";
    case loomTimeout: return "timeout (no progress within the communicator's timeout)";
    default: return "unknown result code";
  }
}

const char* loomGetLastError(loomComm_t comm) {
  if (!comm) return tlsLastError.c_str();
  tlsCommError = comm->lastError();
  return tlsCommError.c_str();
}

loomResult_t loomGetUniqueId(loomUniqueId* id) {
  return guarded("loomGetUniqueId", nullptr, [&] {
    if (!id) fail(loomInvalidArgument, "uniqueId is NULL");
    configReload();
    makeUniqueId(id);
    return loomSuccess;
  });
}

loomResult_t loomCommInitRank(loomComm_t* comm, int nranks, loomUniqueId commId, int rank) {
  return initRank("loomCommInitRank", comm, nranks, commId, rank, nullptr);
}

loomResult_t loomCommInitRankConfig(loomComm_t* comm, int nranks, loomUniqueId commId, int rank,
                                    const loomConfig_t* config) {
  return initRank("loomCommInitRankConfig", comm, nranks, commId, rank, config);
}

namespace {

// A launcher's variable: loom's own (LOOM_RANK, ...) from config(), others'
// (RANK, OMPI_COMM_WORLD_RANK, ...) through foreignEnv.  nullptr when unset.
const char* env(const char* name) {
  static const std::pair<const char*, std::string Config::*> kOwn[] = {
      {"LOOM_RANK", &Config::rank},          {"LOOM_WORLD_SIZE", &Config::worldSize},
      {"LOOM_ROOT_ADDR", &Config::rootAddr}, {"LOOM_ROOT_PORT", &Config::rootPort},
      {"LOOM_SECRET", &Config::secret}};
  for (const auto& [own, field] : kOwn)
    if (strcmp(name, own) == 0) {
      const std::string& v = config().*field;  // a Config outlives every reader
      return v.empty() ? nullptr : v.c_str();
    }
  return foreignEnv(name);
}

int envRank(const char* name) {
  const char* v = env(name);
  char* end = nullptr;
  long x = strtol(v, &end, 10);
  if (!*v || *end || x < 0 || x > INT_MAX) fail(loomInvalidArgument, "%s=%s is not a number", name, v);
  return int(x);
}

void secretFromString(const std::string& s, uint8_t out[16]) {
  // Two FNV-1a hashes with different seeds: deterministic across the job.
  uint64_t h1 = 1469598103934665603ull, h2 = 0x9e3779b97f4a7c15ull;
  for (unsigned char c : s) {
    h1 = (h1 ^ c) * 1099511628211ull;
    h2 = (h2 ^ c) * 0x100000001b3ull + 0x632be59bd9b4e019ull;
  }
  memcpy(out, &h1, 8);
  memcpy(out + 8, &h2, 8);
}

}  // namespace

loomResult_t loomCommInitFromEnv(loomComm_t* comm) {
  return guarded("loomCommInitFromEnv", nullptr, [&] {
    if (!comm) fail(loomInvalidArgument, "comm is NULL");
    *comm = nullptr;
    configReload();
    checkDeviceChoice();
    int rank, size;
    std::string jobKey;
    if (env("LOOM_RANK") && env("LOOM_WORLD_SIZE")) {
      rank = envRank("LOOM_RANK");
      size = envRank("LOOM_WORLD_SIZE");
      jobKey = "loom";
    } else if (env("RANK") && env("WORLD_SIZE")) {
      rank = envRank("RANK");
      size = envRank("WORLD_SIZE");
      jobKey = std::string("torch:") + (env("TORCHELASTIC_RUN_ID") ? env("TORCHELASTIC_RUN_ID") : "");
    } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
      rank = envRank("OMPI_COMM_WORLD_RANK");
      size = envRank("OMPI_COMM_WORLD_SIZE");
      jobKey = std::string("ompi:") + (env("OMPI_MCA_orte_hnp_uri") ? env("OMPI_MCA_orte_hnp_uri") : "") +
               (env("PMIX_NAMESPACE") ? env("PMIX_NAMESPACE") : "");
    } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
      rank = envRank("SLURM_PROCID");
      size = envRank("SLURM_NTASKS");
      jobKey = std::string("slurm:") + (env("SLURM_JOB_ID") ? env("SLURM_JOB_ID") : "") + "." +
               (env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : "");
    } else {
      fail(loomInvalidArgument,
           "no launcher environment found (LOOM_RANK/LOOM_WORLD_SIZE from loom-run, RANK/WORLD_SIZE "
           "from torchrun, OMPI_COMM_WORLD_RANK/SIZE from mpirun, SLURM_PROCID/NTASKS from srun)");
    }
    if (size < 1 || rank >= size)
      fail(loomInvalidArgument, "rank %d and world size %d from the environment are inconsistent", rank, size);
    std::string root;
    if (env("LOOM_ROOT_ADDR")) {
      root = env("LOOM_ROOT_ADDR");
    } else {
      long port;
      if (env("LOOM_ROOT_PORT")) port = envRank("LOOM_ROOT_PORT");
      else if (env("MASTER_PORT")) port = envRank("MASTER_PORT") + 1;
      else port = bootstrapPortForJob(jobKey);
      if (port <= 0 || port > 65535) fail(loomInvalidArgument, "bootstrap port %ld is out of range", port);
      root = std::string(env("MASTER_ADDR") ? env("MASTER_ADDR") : "127.0.0.1") + ":" + std::to_string(port);
    }
    uint8_t secret[16];
    if (const char* s = env("LOOM_SECRET")) {
      if (strlen(s) != 32) fail(loomInvalidArgument, "LOOM_SECRET must be 32 hex digits");
      for (int i = 0; i < 16; ++i) {
        char byte[3] = {s[2 * i], s[2 * i + 1], 0};
        char* end = nullptr;
        secret[i] = uint8_t(strtoul(byte, &end, 16));
        if (*end) fail(loomInvalidArgument, "LOOM_SECRET must be 32 hex digits");
      }
    } else {
      secretFromString(jobKey + "|" + root + "|" + std::to_string(size), secret);
    }
    loomUniqueId id = uniqueIdFor(root, secret);
    std::shared_ptr<loomComm> c = loomComm::create(decodeUniqueId(id), size, rank);
    *comm = c.get();
    return loomSuccess;
  });
}

loomResult_t loomCommSplit(loomComm_t comm, int color, int key, loomComm_t* newcomm) {
  return guarded("loomCommSplit", comm, [&] {
    checkComm(comm);
    if (!newcomm) fail(loomInvalidArgument, "newcomm is NULL");
    if (tlsGroup.depth > 0) fail(loomInvalidUsage, "loomCommSplit cannot be called inside a group");
    *newcomm = nullptr;
    int n = comm->nranks(), me = comm->rank();
    if (color < 0) color = LOOM_SPLIT_NOCOLOR;
    std::vector<int32_t> mine = {color, key};
    std::vector<int32_t> all(size_t(n) * 2);
    OpDesc ag;
    ag.coll = Collective::AllGather;
    ag.sendbuf = mine.data();
    ag.recvbuf = all.data();
    ag.count = 2;
    ag.dtype = loomInt32;
    loomResult_t r = submit(comm, nullptr, {ag});
    if (r != loomSuccess) return r;
    // Members of my color ordered by (key, rank); the first is the new root.
    std::vector<std::pair<int, int>> members;
    for (int i = 0; i < n; ++i)
      if (color != LOOM_SPLIT_NOCOLOR && all[size_t(i) * 2] == color) members.emplace_back(all[size_t(i) * 2 + 1], i);
    std::sort(members.begin(), members.end());
    int newRank = -1;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i].second == me) newRank = int(i);
    loomUniqueId myId;
    memset(&myId, 0, sizeof myId);
    if (newRank == 0) makeUniqueId(&myId);
    std::vector<loomUniqueId> ids;
    ids.resize(size_t(n));
    ag.sendbuf = &myId;
    ag.recvbuf = ids.data();
    ag.count = sizeof myId;
    ag.dtype = loomUint8;
    r = submit(comm, nullptr, {ag});
    if (r != loomSuccess) return r;
    if (newRank < 0) return loomSuccess;
    UniqueIdData id = decodeUniqueId(ids[size_t(members[0].second)]);
    // The new root listened before the ids went round (makeUniqueId), so a
    // refused connection means it gave up (out of descriptors, say): a
    // check, even one that checks nothing, makes the joiners stop retrying
    // after 2 s instead of at the init timeout.
    std::shared_ptr<loomComm> c = loomComm::create(id, int(members.size()), newRank,
                                                   [](const std::vector<bool>&) {}, comm->deviceRequest());
    *newcomm = c.get();
    return loomSuccess;
  });
}

// A forked child's copy of its parent's communicator: its sockets and
// shared memory are the parent's too, so tearing it down (reading what
// arrived, closing connections gracefully) would take the parent's data.
// The child lets go of the handle and leaves the object alone.
// No lock is taken: one another thread of the parent held at the fork
// stays held in the child for ever.
static bool forgetInForkedChild(loomComm_t comm) {
  if (comm->madeInThisProcess()) return false;
  new std::shared_ptr<loomComm>(comm->weak_from_this().lock());  // never freed: the parent's
  return true;
}

loomResult_t loomCommDestroy(loomComm_t comm) {
  if (!comm) return loomSuccess;
  if (forgetInForkedChild(comm)) return loomSuccess;
  // Held until the call returns: an abort from another thread meanwhile
  // releases the handle, and the communicator must outlive this call.
  const std::shared_ptr<loomComm> hold = comm->weak_from_this().lock();
  return guarded("loomCommDestroy", nullptr, [&] {
    // Its operations in this thread's open group would wait for it at
    // loomGroupEnd (abort still frees it: the group then fails).
    for (const GroupPart& part : tlsGroup.parts)
      if (part.comm == comm)
        fail(loomInvalidUsage,
             "the communicator has operations in this thread's open group: end the group (loomGroupEnd) before "
             "destroying it, or abort it");
    comm->waitIdle();
    try {
      comm->warnUnreceived();  // a warning: nothing in it may fail the destroy
    } catch (...) {
    }
    comm->releaseHandle();
    return loomSuccess;
  });
}

loomResult_t loomCommAbort(loomComm_t comm) {
  if (!comm) return loomSuccess;
  if (forgetInForkedChild(comm)) return loomSuccess;
  const std::shared_ptr<loomComm> hold = comm->weak_from_this().lock();  // as in loomCommDestroy
  return guarded("loomCommAbort", nullptr, [&] {
    comm->abort();
    comm->releaseHandle();
    return loomSuccess;
  });
}

loomResult_t loomCommRevoke(loomComm_t comm) {
  return guarded("loomCommRevoke", nullptr, [&] {
    checkComm(comm);
    comm->revoke();
    return loomSuccess;
  });
}

loomResult_t loomCommShrink(loomComm_t comm, const int* excludeRanks, int nExclude, loomComm_t* newcomm) {
  return guarded("loomCommShrink", nullptr, [&] {
    checkComm(comm);
    const std::shared_ptr<loomComm> hold = comm->weak_from_this().lock();  // see guarded()
    if (!newcomm) fail(loomInvalidArgument, "newcomm is NULL");
    *newcomm = nullptr;
    if (tlsGroup.depth > 0) fail(loomInvalidUsage, "loomCommShrink cannot be called inside a group");
    if (nExclude < 0) fail(loomInvalidArgument, "nExclude %d is negative", nExclude);
    if (nExclude > 0 && !excludeRanks) fail(loomInvalidArgument, "excludeRanks is NULL but nExclude is %d", nExclude);
    std::vector<int> exclude;
    for (int i = 0; i < nExclude; ++i) {
      if (excludeRanks[i] < 0 || excludeRanks[i] >= comm->nranks())
        fail(loomInvalidArgument, "excludeRanks[%d] = %d is not a rank of a communicator of %d", i, excludeRanks[i],
             comm->nranks());
      exclude.push_back(excludeRanks[i]);
    }
    std::shared_ptr<loomComm> c = comm->shrink(exclude);
    *newcomm = c.get();
    return loomSuccess;
  });
}

loomResult_t loomCommDump(loomComm_t comm, char* buf, size_t size) {
  return guarded("loomCommDump", nullptr, [&] {
    checkComm(comm);
    const std::shared_ptr<loomComm> hold = comm->weak_from_this().lock();  // see guarded()
    std::string text = comm->dump();
    if (!buf) {
      fputs(text.c_str(), stderr);
      fflush(stderr);
    } else if (size > 0) {
      size_t n = std::min(size - 1, text.size());
      memcpy(buf, text.data(), n);
      buf[n] = 0;
    }
    return loomSuccess;
  });
}

loomResult_t loomCommCount(const loomComm_t comm, int* count) {
  return guarded("loomCommCount", nullptr, [&] {
    checkComm(comm);
    if (!count) fail(loomInvalidArgument, "count is NULL");
    *count = comm->nranks();
    return loomSuccess;
  });
}

loomResult_t loomCommUserRank(const loomComm_t comm, int* rank) {
  return guarded("loomCommUserRank", nullptr, [&] {
    checkComm(comm);
    if (!rank) fail(loomInvalidArgument, "rank is NULL");
    *rank = comm->rank();
    return loomSuccess;
  });
}

loomResult_t loomCommCuDevice(const loomComm_t comm, int* device) {
  return guarded("loomCommCuDevice", nullptr, [&] {
    checkComm(comm);
    if (!device) fail(loomInvalidArgument, "device is NULL");
    *device = comm->deviceComm() ? comm->deviceComm()->device() : -1;
    return loomSuccess;
  });
}

loomResult_t loomCudaDeviceCount(int* count) {
  return guarded("loomCudaDeviceCount", nullptr, [&] {
    if (!count) fail(loomInvalidArgument, "count is NULL");
    *count = deviceCountForInit();
    return loomSuccess;
  });
}

loomResult_t loomCudaGetDevice(int* device) {
  return guarded("loomCudaGetDevice", nullptr, [&] {
    if (!device) fail(loomInvalidArgument, "device is NULL");
    *device = currentCudaDevice();
    return loomSuccess;
  });
}

loomResult_t loomCudaStreamCapturing(void* stream, int* capturing) {
  return guarded("loomCudaStreamCapturing", nullptr, [&] {
    if (!capturing) fail(loomInvalidArgument, "capturing is NULL");
    *capturing = cudaStreamCaptureState(stream) == 1 ? 1 : 0;
    return loomSuccess;
  });
}

loomResult_t loomCommCanCapture(const loomComm_t comm, int* capturable) {
  return guarded("loomCommCanCapture", nullptr, [&] {
    checkComm(comm);
    if (!capturable) fail(loomInvalidArgument, "capturable is NULL");
    *capturable = 0;
    if (DeviceCollectives* dev = comm->deviceComm()) {
      try {
        dev->checkCapture(nullptr, false);  // refuses (throws) what cannot be captured
        *capturable = 1;
      } catch (const Error&) {
      }
    }
    return loomSuccess;
  });
}

loomResult_t loomCommGetAsyncError(loomComm_t comm, loomResult_t* asyncError) {
  return guarded("loomCommGetAsyncError", nullptr, [&] {
    checkComm(comm);
    if (!asyncError) fail(loomInvalidArgument, "asyncError is NULL");
    *asyncError = comm->asyncError();
    // What failed it, and which ranks are known to be dead, for loomGetLastError.
    if (*asyncError != loomSuccess)
      tlsLastError = "loomCommGetAsyncError: " + comm->lastError() + comm->deadSuffix();
    return loomSuccess;
  });
}

loomResult_t loomCommSetTimeout(loomComm_t comm, int64_t timeoutMs) {
  return guarded("loomCommSetTimeout", nullptr, [&] {
    checkComm(comm);
    if (timeoutMs < 1) fail(loomInvalidArgument, "timeoutMs %lld is not positive", (long long)timeoutMs);
    comm->setTimeoutMs(timeoutMs);
    return loomSuccess;
  });
}

loomResult_t loomMemAlloc(void** ptr, size_t size) {
  return guarded("loomMemAlloc", nullptr, [&] {
    if (!ptr) fail(loomInvalidArgument, "ptr is NULL");
    // Device memory where LOOM_DEVICE chooses CUDA (as ncclMemAlloc), else host memory peers can map.
    void* p = deviceMemAlloc(size);
    *ptr = p ? p : hostMemAlloc(size);
    return loomSuccess;
  });
}

loomResult_t loomCommMemAlloc(loomComm_t comm, void** ptr, size_t size) {
  return guarded("loomCommMemAlloc", comm, [&] {
    checkComm(comm);
    if (!ptr) fail(loomInvalidArgument, "ptr is NULL");
    if (DeviceCollectives* d = comm->deviceComm()) {
      *ptr = deviceMemAlloc(size, d->device());
      return loomSuccess;
    }
    *ptr = hostMemAlloc(size);
    return loomSuccess;
  });
}

loomResult_t loomMemFree(void* ptr) {
  return guarded("loomMemFree", nullptr, [&] {
    if (ptr && !deviceMemFree(ptr)) hostMemFree(ptr);
    return loomSuccess;
  });
}

loomResult_t loomCommRegister(const loomComm_t comm, void* buff, size_t size, void** handle) {
  return guarded("loomCommRegister", comm, [&] {
    checkComm(comm);
    if (!handle) fail(loomInvalidArgument, "handle is NULL");
    *handle = comm->registerBuffer(buff, size);
    return loomSuccess;
  });
}

loomResult_t loomCommDeregister(const loomComm_t comm, void* handle) {
  return guarded("loomCommDeregister", comm, [&] {
    checkComm(comm);
    comm->deregisterBuffer(handle);
    return loomSuccess;
  });
}

loomResult_t loomScale(void* dst, const void* src, size_t count, loomDataType_t datatype, const void* scalar,
                       int scalarOnDevice, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomScale", comm, &datatype, nullptr)) return r;
  return guarded("loomScale", comm, [&]() -> loomResult_t {
    try {
      checkComm(comm);
      const size_t bytes = checkedBytes(count, datatype, 1);  // overflow
      DeviceCollectives* dev = comm->deviceComm();
      void* cs = dev ? cudaStreamOf(stream) : nullptr;
      HostStream* hs = dev ? nullptr : hostStreamOf(stream);
      if (!scalar) fail(loomInvalidArgument, "scalar is NULL");
      if (count == 0) return loomSuccess;
      if (!dst || !src) fail(loomInvalidArgument, "%s is NULL", dst ? "src" : "dst");
      if (dst != src && overlaps(dst, bytes, src, bytes))
        fail(loomInvalidArgument, "dst %p and src %p overlap without being one buffer", dst, src);
      if (dev) {
        dev->scale(dst, src, count, datatype, scalar, scalarOnDevice != 0, cs);
        return loomSuccess;
      }
      for (const auto& [what, p] :
           {std::pair<const char*, const void*>{"dst", dst}, {"src", src}, {"scalar", scalar}})
        if (memoryKindOf(p) == MemoryKind::CudaDevice)
          fail(loomInvalidArgument,
               "%s %p is CUDA device memory (cuda:%d), but this communicator runs on the host: pass host "
               "memory, or create the communicator with LOOM_DEVICE=cuda",
               what, p, cudaPointerDevice(p));
      uint64_t k = 0;  // one element, read now unless it is read when the work runs
      if (!scalarOnDevice) memcpy(&k, scalar, dtypeSize(datatype));
      auto work = [=]() {
        uint64_t by = k;
        if (scalarOnDevice) memcpy(&by, scalar, dtypeSize(datatype));
        scaleHost(dst, src, count, datatype, &by);
        return loomSuccess;
      };
      if (!hs) return work();
      hs->enqueue(work);
      return loomSuccess;
    } catch (const Error& e) {
      // Inside a group an error cancels it, as a refused member's does.
      GroupState& g = tlsGroup;
      if (g.depth > 0 && g.error == loomSuccess) {
        g.error = e.code();
        g.errorMsg = std::string("loomScale: ") + e.what();
      }
      throw;
    }
  });
}

loomResult_t loomAllReduce(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                           loomRedOp_t op, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomAllReduce", comm, &datatype, &op)) return r;
  OpDesc d;
  d.coll = Collective::AllReduce;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = count;
  d.dtype = datatype;
  d.op = op;
  return issueOp("loomAllReduce", comm, stream, d);
}

loomResult_t loomReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               loomDataType_t datatype, loomRedOp_t op, loomComm_t comm,
                               loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomReduceScatter", comm, &datatype, &op)) return r;
  OpDesc d;
  d.coll = Collective::ReduceScatter;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = recvcount;
  d.dtype = datatype;
  d.op = op;
  return issueOp("loomReduceScatter", comm, stream, d);
}

loomResult_t loomAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, loomDataType_t datatype,
                           loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomAllGather", comm, &datatype, nullptr)) return r;
  OpDesc d;
  d.coll = Collective::AllGather;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = sendcount;
  d.dtype = datatype;
  return issueOp("loomAllGather", comm, stream, d);
}

loomResult_t loomBroadcast(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                           int root, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomBroadcast", comm, &datatype, nullptr)) return r;
  OpDesc d;
  d.coll = Collective::Broadcast;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = count;
  d.dtype = datatype;
  d.root = root;
  return issueOp("loomBroadcast", comm, stream, d);
}

loomResult_t loomReduce(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                        loomRedOp_t op, int root, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomReduce", comm, &datatype, &op)) return r;
  OpDesc d;
  d.coll = Collective::Reduce;
  d.sendbuf = sendbuff;
  d.sendMem = memoryKindOf(sendbuff);
  d.recvbuf = recvbuff;
  d.recvMem = memoryKindOf(recvbuff);
  d.count = count;
  d.dtype = datatype;
  d.op = op;
  d.root = root;
  return issueOp("loomReduce", comm, stream, d);
}

loomResult_t loomSend(const void* sendbuff, size_t count, loomDataType_t datatype, int peer,
                      loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomSend", comm, &datatype, nullptr)) return r;
  return issueOp("loomSend", comm, stream, pointToPoint(true, sendbuff, count, datatype, peer));
}

loomResult_t loomRecv(void* recvbuff, size_t count, loomDataType_t datatype, int peer, loomComm_t comm,
                      loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomRecv", comm, &datatype, nullptr)) return r;
  return issueOp("loomRecv", comm, stream, pointToPoint(false, recvbuff, count, datatype, peer));
}

loomResult_t loomSendTagged(const void* sendbuff, size_t count, loomDataType_t datatype, int peer, int tag,
                            loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomSendTagged", comm, &datatype, nullptr)) return r;
  return issueOp("loomSendTagged", comm, stream,
                 tagged(pointToPoint(true, sendbuff, count, datatype, peer), tag, nullptr));
}

loomResult_t loomRecvTagged(void* recvbuff, size_t count, loomDataType_t datatype, int peer, int tag,
                            loomComm_t comm, loomStream_t stream, loomP2PStatus* status) {
  if (loomResult_t r = checkEnums("loomRecvTagged", comm, &datatype, nullptr)) return r;
  return issueOp("loomRecvTagged", comm, stream,
                 tagged(pointToPoint(false, recvbuff, count, datatype, peer), tag, status));
}

loomResult_t loomAllToAll(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                          loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomAllToAll", comm, &datatype, nullptr)) return r;
  return issueOp("loomAllToAll", comm, stream, exchange(Collective::AllToAll, sendbuff, recvbuff, count, datatype, 0));
}

loomResult_t loomAllToAllv(const void* sendbuff, const size_t sendcounts[], const size_t sdispls[],
                           void* recvbuff, const size_t recvcounts[], const size_t rdispls[],
                           loomDataType_t datatype, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomAllToAllv", comm, &datatype, nullptr)) return r;
  return issueExchange("loomAllToAllv", comm, stream, [&](int n, int me) {
    if (!sendcounts || !sdispls || !recvcounts || !rdispls)
      fail(loomInvalidArgument,
           "sendcounts, sdispls, recvcounts and rdispls must all be given (nranks entries each)");
    // [begin, end) in bytes of region j, failing on overflow.
    auto region = [&](const char* what, const size_t* counts, const size_t* displs, int j) {
      size_t end = checkedBytes(counts[j], datatype, 1);
      size_t begin = checkedBytes(displs[j], datatype, 1);
      if (begin > size_t(PTRDIFF_MAX) - end)
        fail(loomInvalidArgument, "%s[%d]: displacement + count overflows", what, j);
      return std::pair<size_t, size_t>(begin, begin + end);
    };
    std::vector<std::pair<size_t, size_t>> sends, recvs;
    bool anySend = false, anyRecv = false;
    for (int j = 0; j < n; ++j) {
      sends.push_back(region("sendcounts/sdispls", sendcounts, sdispls, j));
      recvs.push_back(region("recvcounts/rdispls", recvcounts, rdispls, j));
      anySend |= sendcounts[j] > 0;
      anyRecv |= recvcounts[j] > 0;
    }
    if (anySend && !sendbuff) fail(loomInvalidArgument, "sendbuff is NULL");
    if (anyRecv && !recvbuff) fail(loomInvalidArgument, "recvbuff is NULL");
    if (sendcounts[me] != recvcounts[me])
      fail(loomInvalidArgument,
           "sendcounts[%d] = %zu but recvcounts[%d] = %zu: a rank's block to itself must match", me,
           sendcounts[me], me, recvcounts[me]);
    std::vector<int> order;
    for (int j = 0; j < n; ++j)
      if (recvcounts[j] > 0) order.push_back(j);
    std::sort(order.begin(), order.end(),
              [&](int a, int b) { return recvs[size_t(a)].first < recvs[size_t(b)].first; });
    for (size_t k = 1; k < order.size(); ++k)
      if (recvs[size_t(order[k])].first < recvs[size_t(order[k - 1])].second)
        fail(loomInvalidArgument, "the receive regions of ranks %d and %d overlap", order[k - 1], order[k]);
    for (int j : order)
      for (int i = 0; i < n; ++i)
        if (sendcounts[i] > 0 &&
            overlaps(at(sendbuff, sends[size_t(i)].first), sends[size_t(i)].second - sends[size_t(i)].first,
                     at(recvbuff, recvs[size_t(j)].first), recvs[size_t(j)].second - recvs[size_t(j)].first))
          fail(loomInvalidArgument, "the send region for rank %d overlaps the receive region from rank %d", i,
               j);
    return allToAllvOps(sendbuff, sendcounts, sdispls, recvbuff, recvcounts, rdispls, datatype, me, n);
  });
}

loomResult_t loomGather(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype, int root,
                        loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomGather", comm, &datatype, nullptr)) return r;
  return issueOp("loomGather", comm, stream, exchange(Collective::Gather, sendbuff, recvbuff, count, datatype, root));
}

loomResult_t loomScatter(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t datatype,
                         int root, loomComm_t comm, loomStream_t stream) {
  if (loomResult_t r = checkEnums("loomScatter", comm, &datatype, nullptr)) return r;
  return issueOp("loomScatter", comm, stream, exchange(Collective::Scatter, sendbuff, recvbuff, count, datatype, root));
}

loomResult_t loomGroupStart(void) {
  if (tlsGroup.depth++ == 0) gOpenGroups.fetch_add(1, std::memory_order_relaxed);
  return loomSuccess;
}

loomResult_t loomGroupEnd(void) {
  GroupState& g = tlsGroup;
  if (g.depth == 0) {
    tlsLastError = "loomGroupEnd: no matching loomGroupStart";
    return loomInvalidUsage;
  }
  if (--g.depth > 0) return loomSuccess;
  gOpenGroups.fetch_sub(1, std::memory_order_relaxed);
  std::vector<GroupPart> parts = std::move(g.parts);
  loomResult_t err = g.error;
  std::string msg = g.errorMsg;
  g = GroupState();
  if (err != loomSuccess) {
    tlsLastError = "loomGroupEnd: the group was not launched because one of its operations failed: " + msg;
    return err;
  }
  if (parts.empty()) return loomSuccess;
  for (const GroupPart& part : parts)  // a group opened before a fork, ended in the child
    if (!part.comm->madeInThisProcess())
      return guarded("loomGroupEnd", part.comm, [&] {
        checkComm(part.comm);
        return loomSuccess;
      });
  if (!parts[0].comm->deviceComm())  // a host group: one communicator (joinGroup)
    return guarded("loomGroupEnd", parts[0].comm, [&] {
      if (!parts[0].others.empty()) return submitJoined(parts[0].comm, parts[0]);
      return submit(parts[0].comm, hostStreamOf(parts[0].stream), std::move(parts[0].ops));
    });
  // CUDA communicators, in the order they joined.  Each part's collectives
  // in order on its stream, each a stream program (every rank enqueues the
  // same sequence, so rounds agree), then its sends and receives as one
  // program.  Each member was checked when it joined the group; the
  // send/recv staging of every part is set up first (it may ask peers and
  // enqueues nothing), so a peer that does not answer launches nothing.
  std::vector<std::vector<OpDesc>> p2p(parts.size());
  for (size_t i = 0; i < parts.size(); ++i)
    for (const OpDesc& op : parts[i].ops)
      if (op.coll == Collective::P2P) p2p[i].push_back(op);
  for (size_t i = 0; i < parts.size(); ++i) {
    if (p2p[i].empty()) continue;
    loomResult_t r = guarded("loomGroupEnd", parts[i].comm, [&] {
      // Captured sends and receives stage in the graph lane's window:
      // nothing to set up (and no CUDA call to make during the capture).
      int state = 0;
      cudaStreamOf(parts[i].stream, &state);
      if (state == 1) return loomSuccess;
      parts[i].comm->deviceComm()->prepareP2P(p2p[i]);
      return loomSuccess;
    });
    if (r != loomSuccess) return r;
  }
  // A part whose members used several streams: its first stream waits for
  // the others' earlier work before anything of the group is enqueued (an
  // error here launches nothing, as one of the setup above).  The handles
  // are checked once, here (cudaStreamOf: a capture begun since the calls).
  std::vector<std::pair<void*, std::vector<void*>>> joined(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].others.empty()) continue;
    loomResult_t r = guarded("loomGroupEnd", parts[i].comm, [&] {
      int mainState = 0;
      joined[i].first = cudaStreamOf(parts[i].stream, &mainState);
      for (loomStream_t s : parts[i].others) {
        int state = 0;
        joined[i].second.push_back(cudaStreamOf(s, &state));
        // Joined, a stream outside a capture would be pulled into it (it
        // waits for an event recorded there), and a captured one waiting
        // for work outside its capture breaks it.
        if (state != mainState)
          fail(loomInvalidUsage,
               "a group's calls on one communicator name streams %p and %p, and only %s is being captured into a "
               "CUDA graph: joining them would pull the other into the capture or invalidate it; issue them in "
               "separate groups",
               joined[i].first, joined[i].second.back(), mainState ? "the first" : "the second");
      }
      parts[i].comm->deviceComm()->joinStreams(joined[i].first, joined[i].second, true);
      return loomSuccess;
    });
    if (r != loomSuccess) return r;
  }
  // One thread may drive several ranks here (NCCL's one-thread groups,
  // nccl-tests' -t): the parts' calls are enqueued round-robin, a few
  // stream operations of each in turn, so that no rank's stream queue
  // fills with waits for work that a rank after it has not enqueued yet (a
  // GPU's host thread then blocks in the enqueue for ever; see
  // ProgramEnqueuer).  They go in waves: the k-th call of every part is
  // begun, in the order of the communicators' addresses, and stepped until
  // all of them are enqueued, before any part begins its next.  A begun
  // call holds its communicator, so the communicators are always taken in
  // that one order, never one while a later one is held (two threads with
  // groups over the same communicators cannot deadlock, and lock-order
  // checkers have nothing to report).  A part that fails stops; the others
  // are enqueued to the end, so that their rounds stay in step with their
  // peers'.
  struct Cursor {
    size_t next = 0;        // its next collective in parts[i].ops
    bool p2pBegun = false;  // its sends and receives (one program, last)
    bool done = false;
    std::unique_ptr<SteppedRun> run;
  };
  constexpr size_t kOpsPerTurn = 4;
  std::vector<Cursor> cursors(parts.size());
  std::vector<size_t> order(parts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::less<const loomComm*>()(parts[a].comm, parts[b].comm);
  });
  loomResult_t first = loomSuccess;
  auto failed = [&](Cursor& c, loomResult_t r) {
    c.run.reset();  // its communicator has failed (a step that threw says so)
    c.done = true;
    if (first == loomSuccess) first = r;
  };
  for (;;) {
    bool begun = false;
    for (size_t i : order) {  // the wave's calls
      Cursor& c = cursors[i];
      if (c.done) continue;
      loomResult_t r = guarded("loomGroupEnd", parts[i].comm, [&] {
        const std::vector<OpDesc>& ops = parts[i].ops;
        while (c.next < ops.size() && ops[c.next].coll == Collective::P2P) ++c.next;
        if (c.next < ops.size()) {
          c.run = beginOnDevice(parts[i].comm, parts[i].stream, &ops[c.next++], nullptr);
        } else if (!p2p[i].empty() && !c.p2pBegun) {
          c.p2pBegun = true;
          c.run = beginOnDevice(parts[i].comm, parts[i].stream, nullptr, &p2p[i]);
        } else {
          c.done = true;
        }
        return loomSuccess;
      });
      if (r != loomSuccess) failed(c, r);
      begun = begun || !c.done;
    }
    if (!begun) break;
    for (bool busy = true; busy;) {  // stepped round-robin until all are enqueued
      busy = false;
      for (size_t i : order) {
        Cursor& c = cursors[i];
        if (!c.run) continue;
        loomResult_t r = guarded("loomGroupEnd", parts[i].comm, [&] {
          if (stepOnDevice(parts[i].comm, *c.run, kOpsPerTurn)) c.run.reset();
          return loomSuccess;
        });
        if (r != loomSuccess) failed(c, r);
        busy = busy || c.run;
      }
    }
  }
  // Every call is enqueued (a failed part's up to where it stopped): the
  // other streams of a part wait for its end.
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].others.empty()) continue;
    loomResult_t r = guarded("loomGroupEnd", parts[i].comm, [&] {
      parts[i].comm->deviceComm()->joinStreams(joined[i].first, joined[i].second, false);
      return loomSuccess;
    });
    if (r != loomSuccess && first == loomSuccess) first = r;
  }
  return first;
}

loomResult_t loomStreamCreate(loomStream_t* stream) {
  return guarded("loomStreamCreate", nullptr, [&] {
    if (!stream) fail(loomInvalidArgument, "stream is NULL");
    *stream = registerStream(std::make_unique<HostStream>());
    return loomSuccess;
  });
}

loomResult_t loomStreamDestroy(loomStream_t stream) {
  if (!stream) return loomSuccess;
  return guarded("loomStreamDestroy", nullptr, [&] {
    hostStreamOf(stream);  // the error for a handle that is not a live loom stream
    unregisterStream(stream).reset();
    return loomSuccess;
  });
}

loomResult_t loomStreamSynchronize(loomStream_t stream) {
  if (!stream) return loomSuccess;
  return guarded("loomStreamSynchronize", nullptr, [&] { return hostStreamOf(stream)->synchronize(); });
}

loomResult_t loomStreamQuery(loomStream_t stream) {
  if (!stream) return loomSuccess;
  return guarded("loomStreamQuery", nullptr, [&] { return hostStreamOf(stream)->query(); });
}

}  // extern "C"
