// Errors, argument checks and groups: how an NCCL call becomes loom calls.
//
// Outside a group a host communicator's operation runs at once on loom's
// NULL stream (the call returns when it is complete); a CUDA communicator's
// is enqueued on the caller's cudaStream_t.  Inside
// ncclGroupStart/ncclGroupEnd the shim queues operations itself and
// launches them at the outermost ncclGroupEnd: that way a call the shim
// refuses (a CUDA stream on a host communicator, a float8 reduction)
// cancels the whole group as NCCL does, and a group may span communicators.
// Host communicators: one as one loom group on the NULL stream; several as
// one loom group per communicator on that communicator's host stream, so
// they progress together, then the shim waits for all of them.  CUDA
// communicators: one loom group, each call on its own cudaStream_t (loom's
// groups may span CUDA communicators; they only enqueue).  A group mixing
// host and CUDA communicators is refused whole.
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nccl_shim/shim.h"

namespace nccl_shim {
namespace {

thread_local std::string tlsError;
// NCCL keeps one last-error string for the process: PyTorch's watchdog asks
// ncclGetLastError(NULL) on its own thread after ncclCommGetAsyncError said
// a communicator failed.  The thread's own error comes first (it is about
// that thread's last call), then this.
std::mutex gErrorMu;
std::string gError;
thread_local std::string tlsGlobalCopy;  // what processLastError() handed this thread from gError

struct Group {
  int depth = 0;
  std::vector<PendingOp> ops;
  std::vector<PendingInit> inits;
  ncclResult_t error = ncclSuccess;
  std::string errorMsg;
};
thread_local Group tlsGroup;

// Launches the queued operations of one communicator as one loom group.
loomResult_t launch(const std::vector<PendingOp*>& ops, loomStream_t stream) {
  loomResult_t first = loomGroupStart();
  for (PendingOp* op : ops) {
    loomResult_t r = op->issue(stream);
    if (first == loomSuccess) first = r;
  }
  // loom does not launch a group that had a failed member: ending it is safe.
  loomResult_t r = loomGroupEnd();
  return first != loomSuccess ? first : r;
}

// CUDA communicators' operations as one loom group, each on its own stream.
loomResult_t launchOnDevices(std::vector<PendingOp>& ops) {
  loomResult_t first = loomGroupStart();
  for (PendingOp& op : ops) {
    loomResult_t r = op.issue(op.stream);
    if (first == loomSuccess) first = r;
  }
  loomResult_t r = loomGroupEnd();
  return first != loomSuccess ? first : r;
}

ncclResult_t endGroup(std::vector<PendingOp> ops) {
  std::vector<ncclComm*> comms;
  const ncclComm* host = nullptr;
  const ncclComm* cuda = nullptr;
  for (const PendingOp& op : ops) {
    bool seen = false;
    for (ncclComm* c : comms) seen |= c == op.comm;
    if (!seen) comms.push_back(op.comm);
    (op.comm->cuda() ? cuda : host) = op.comm;
  }
  if (host && cuda)
    return fail(
        ncclInvalidUsage,
        "ncclGroupEnd: the group mixes a host communicator (rank %d of %d) and a CUDA communicator (rank "
        "%d of %d, CUDA device %d); a group must use host communicators only or CUDA ones only; the "
        "group was not launched",
        host->rank, host->nranks, cuda->rank, cuda->nranks, cuda->cudaDevice);
  // Every call's preparation (a PreMulSum's scaled copy) before anything
  // is launched: one that fails launches nothing.
  beginLaunch();
  for (PendingOp& op : ops)
    if (op.prepare)
      if (loomResult_t r = op.prepare(op.stream))
        return fromLoom(r, "ncclGroupEnd (the group was not launched)");
  if (cuda) return fromLoom(launchOnDevices(ops), "ncclGroupEnd");
  auto opsOf = [&](ncclComm* c) {
    std::vector<PendingOp*> mine;
    for (PendingOp& op : ops)
      if (op.comm == c) mine.push_back(&op);
    return mine;
  };
  if (comms.size() == 1) return fromLoom(launch(opsOf(comms[0]), nullptr), "ncclGroupEnd");
  ncclResult_t result = ncclSuccess;
  std::vector<ncclComm*> launched;
  for (ncclComm* c : comms) {
    loomResult_t r = c->groupStream ? loomSuccess : loomStreamCreate(&c->groupStream);
    if (r == loomSuccess) r = launch(opsOf(c), c->groupStream);
    if (r == loomSuccess)
      launched.push_back(c);
    else if (result == ncclSuccess)
      result = fromLoom(r, "ncclGroupEnd");
  }
  for (ncclComm* c : launched) {
    loomResult_t r = loomStreamSynchronize(c->groupStream);
    if (r != loomSuccess && result == ncclSuccess) result = fromLoom(r, "ncclGroupEnd");
  }
  return result;
}

}  // namespace

ncclResult_t toNccl(loomResult_t r) {
  switch (r) {
    case loomSuccess:
      return ncclSuccess;
    case loomUnhandledCudaError:
      return ncclUnhandledCudaError;
    case loomSystemError:
      return ncclSystemError;
    case loomInternalError:
      return ncclInternalError;
    case loomInvalidArgument:
      return ncclInvalidArgument;
    case loomInvalidUsage:
      return ncclInvalidUsage;
    case loomInProgress:
      return ncclInProgress;
    // NCCL has no timeout code; a peer that stops answering is a remote error.
    case loomRemoteError:
    case loomTimeout:
      return ncclRemoteError;
    default:
      return ncclInternalError;
  }
}

ncclResult_t fail(ncclResult_t r, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  noteError(msg);
  Group& g = tlsGroup;
  if (g.depth > 0 && g.error == ncclSuccess) {
    g.error = r;
    g.errorMsg = msg;
  }
  logf(Level::Info, "%s: %s", ncclGetErrorString(r), msg);
  return r;
}

ncclResult_t fromLoom(loomResult_t r, const char* call) {
  if (r == loomSuccess) return ncclSuccess;
  noteError(std::string(call) + ": " + loomGetLastError(nullptr));
  logf(Level::Info, "%s", tlsError.c_str());
  return toNccl(r);
}

void noteError(const std::string& msg) {
  tlsError = msg;
  std::lock_guard<std::mutex> g(gErrorMu);
  gError = msg;
}

void clearLastError() { tlsError.clear(); }
const char* lastError() { return tlsError.c_str(); }

const char* processLastError() {
  std::lock_guard<std::mutex> g(gErrorMu);
  tlsGlobalCopy = gError;
  return tlsGlobalCopy.c_str();
}

bool inGroup() { return tlsGroup.depth > 0; }

ncclResult_t enqueue(PendingOp op) {
  tlsGroup.ops.push_back(std::move(op));
  return ncclSuccess;
}

void enqueueInit(PendingInit init) { tlsGroup.inits.push_back(init); }

ncclResult_t checkComm(const char* call, ncclComm_t comm, bool revokedOk) {
  if (!comm) return fail(ncclInvalidArgument, "%s: comm is NULL", call);
  if (comm->revoked && !revokedOk)
    return fail(ncclInvalidUsage,
                "%s: the communicator was revoked (ncclCommRevoke or ncclCommShrink with NCCL_SHRINK_ABORT); "
                "shrink, destroy or abort it",
                call);
  if (comm->finalized)
    return fail(ncclInvalidUsage, "%s: the communicator was finalized (ncclCommFinalize); only destroy it",
                call);
  if (!comm->loom)
    return fail(ncclInvalidUsage,
                "%s: the communicator's ncclCommInitRank ran inside a group and completes at its ncclGroupEnd "
                "(or failed there); call it after the group",
                call);
  return ncclSuccess;
}

ncclResult_t checkStream(const char* call, ncclComm_t comm, cudaStream_t stream) {
  if (!stream || comm->cuda()) return ncclSuccess;
  const char* device = comm->loomDevice.c_str();
  return fail(
      ncclInvalidUsage,
      "%s: stream %p is a CUDA stream, but this communicator runs on the host (LOOM_DEVICE=%s when it "
      "was made%s): a host communicator takes host buffers with stream 0 (NULL), where each call "
      "returns when it is complete; for CUDA streams and device buffers make the communicator on a "
      "process with a GPU (LOOM_DEVICE=cuda, or auto)",
      call, static_cast<void*>(stream), device,
      strcmp(device, "auto") == 0 ? ", which found no usable CUDA device" : "");
}

size_t typeSize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

ncclResult_t moveType(const char* call, ncclDataType_t in, loomDataType_t* out) {
  int t = int(in);
  if (t == ncclFloat8e4m3 || t == ncclFloat8e5m2) {
    *out = loomUint8;  // bytes move unchanged; only reductions need the type
    return ncclSuccess;
  }
  if (t < 0 || t >= int(loomNumTypes)) return fail(ncclInvalidArgument, "%s: unknown datatype %d", call, t);
  *out = loomDataType_t(t);  // ncclInt8..ncclBfloat16 have loom's numbering
  return ncclSuccess;
}

}  // namespace nccl_shim

using namespace nccl_shim;

NCCL_SHIM_API(ncclResult_t, ncclGroupStart) {
  ensureEnv();
  ++tlsGroup.depth;
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclGroupEnd) {
  ensureEnv();
  Group& g = tlsGroup;
  if (g.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd: no matching ncclGroupStart");
  if (--g.depth > 0) return ncclSuccess;
  Group done = std::move(g);
  g = Group();
  if (done.error != ncclSuccess) {
    noteError("ncclGroupEnd: the group was not launched because one of its calls failed: " + done.errorMsg);
    return done.error;  // deferred inits included: their handles stay without a communicator
  }
  if (!done.inits.empty())
    if (ncclResult_t r = runInits(done.inits)) return r;
  for (const PendingOp& op : done.ops)
    if (op.comm->finalized)
      return fail(ncclInvalidUsage,
                  "ncclGroupEnd: %s on a finalized communicator; the group was not launched", op.name);
  if (done.ops.empty()) return ncclSuccess;
  return endGroup(std::move(done.ops));
}

// loom has no cost estimate for a group through its API: the group is ended
// without launching anything and the call says so.
NCCL_SHIM_API(ncclResult_t, ncclGroupSimulateEnd, ncclSimInfo_t* simInfo) {
  ensureEnv();
  Group& g = tlsGroup;
  if (g.depth == 0) return fail(ncclInvalidUsage, "ncclGroupSimulateEnd: no matching ncclGroupStart");
  if (--g.depth == 0) g = Group();
  if (simInfo) simInfo->estimatedTime = NCCL_UNDEF_FLOAT;
  return fail(
      ncclInvalidUsage,
      "ncclGroupSimulateEnd: loom cannot simulate a group (loom-topo prints its cost model); the group "
      "was ended without launching anything");
}
