// What the NCCL shim's files share: the communicator behind ncclComm_t, the
// shim's error and log helpers, and the queue of operations a group holds.
// The shim uses only loom's C API (loom.h); libloom.so exports nothing else.
#pragma once

#include <nccl.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom.h"

// NCCL's ncclComm_t points to this.  It wraps a loom communicator and keeps
// what NCCL has and loom does not: PreMulSum operators, registrations, the
// finalized state, and a host stream for groups that span communicators.
struct ncclComm {
  loomComm_t loom = nullptr;
  int rank = 0;
  int nranks = 0;
  // loomCommCuDevice: the CUDA device of a CUDA communicator (its calls take
  // the caller's cudaStream_t and device buffers), -1 on the host.
  int cudaDevice = -1;
  bool cuda() const { return cudaDevice >= 0; }
  std::string loomDevice;  // LOOM_DEVICE when it was made, for messages
  bool finalized = false;
  std::atomic<bool> revoked{false};  // ncclCommRevoke, or ncclCommShrink with NCCL_SHRINK_ABORT, here
  loomStream_t groupStream = nullptr;  // made on first use by a multi-communicator group

  struct PreMulSum {
    ncclDataType_t type;
    ncclScalarResidence_t residence;
    const void* scalarPtr;  // ncclScalarDevice: read when the collective runs
    double scalarBytes[2];  // ncclScalarHostImmediate: the scalar, copied at creation
  };
  std::mutex mu;  // guards the tables below
  std::map<int, PreMulSum> preMulSums;
  int nextOp = ncclNumOps;
  std::set<void*> registrations;
  // A CUDA communicator's PreMulSum inputs are scaled into device memory of
  // its own (loomMemAlloc), one arena per stream: a call's region is reused
  // only by later work on that stream, and the calls of one launch (a
  // group) get regions of their own.  Outgrown arenas stay until the
  // communicator goes (work in flight may still read them).
  struct Scratch {
    loomStream_t stream = nullptr;
    void* base = nullptr;
    size_t bytes = 0, used = 0;
    uint64_t launch = 0;  // the launch whose regions `used` counts
  };
  std::vector<Scratch> scratch;
  std::vector<void*> retiredScratch;
};

namespace nccl_shim {

// Reads the NCCL_* variables once per process and sets the LOOM_* ones they
// map to (only those the user has not set), before the shim's first loom call.
// Every exported function calls it first.
void ensureEnv();

// Logging at the level NCCL_DEBUG / LOOM_DEBUG asks for, prefixed "loom-nccl".
enum class Level { None = 0, Warn = 1, Info = 2, Trace = 3 };
bool logOn(Level level);
void logf(Level level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Records a shim error for ncclGetLastError (and the group in progress, whose
// launch it cancels) and returns r.
ncclResult_t fail(ncclResult_t r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// loom's result code as NCCL's (loomTimeout, which NCCL lacks: ncclRemoteError).
ncclResult_t toNccl(loomResult_t r);
// Translates a loom result, taking loom's message for ncclGetLastError.
ncclResult_t fromLoom(loomResult_t r, const char* call);
void clearLastError();
const char* lastError();
// Records msg as this thread's last error and the process's (NCCL's one
// string); processLastError() is the latter, valid until the thread asks again.
void noteError(const std::string& msg);
const char* processLastError();

// One operation as the shim hands it to loom: issue() makes the loom call
// on the given stream.  Scratch memory it
// needs lives in the closure until the operation has completed.  stream is
// the caller's cudaStream_t on a CUDA communicator (loom's stream argument
// there), NULL on a host one.
struct PendingOp {
  ncclComm* comm;
  const char* name;
  loomStream_t stream;
  std::function<loomResult_t(loomStream_t)> issue;
  // What must be done before any call of the launch is issued (a
  // PreMulSum's scaled copy); may be empty.  A launch runs every prepare
  // first and launches nothing if one fails.
  std::function<loomResult_t(loomStream_t)> prepare{};
};

bool inGroup();
// A launch (a call outside a group, or a group's end) begins on this
// thread: the device scratch of the PreMulSum calls it issues is handed out
// afresh (deviceScratch).  A communicator is used by one thread at a time
// (as NCCL requires): two threads launching on one communicator and
// stream at once could be handed one region.
void beginLaunch();
// `bytes` of comm's device scratch for `stream`, apart from every region
// this launch took before (premulsum.cc).
loomResult_t deviceScratch(ncclComm* comm, loomStream_t stream, size_t bytes, void** out);
// Frees a communicator's device scratch (after its loom communicator is
// gone); with `leave`, only forgets it (ncclCommAbort: loomMemFree waits for
// the device, which may wait for another communicator's stuck stream).
void freeScratch(ncclComm* comm, bool leave = false);
// Queues op for ncclGroupEnd.
ncclResult_t enqueue(PendingOp op);

// ncclCommInitRank* inside a group, as NCCL runs it: the handle is returned
// at once and the initialisation happens at the outermost ncclGroupEnd,
// every deferred one at the same time (one thread each: each blocks until
// its communicator's ranks have all joined, so one thread can make several
// ranks), on the CUDA device that was current at the call.
struct PendingInit {
  ncclComm* comm;  // returned to the caller; its loom communicator comes at ncclGroupEnd
  int nranks;
  int rank;
  loomUniqueId id;
  int device;  // loomCudaGetDevice at the call (-1: none)
};
void enqueueInit(PendingInit init);
// Makes the loom communicators of `inits` (all at once) and fills their
// handles; the first error, with every rank's reason, if any failed.
ncclResult_t runInits(std::vector<PendingInit>& inits);
// Fills a handle from its loom communicator: rank, size, device.
void fillComm(ncclComm* c, loomComm_t loom, const char* call);

// Runs issue now, outside a group, or queues it for ncclGroupEnd.  A host
// communicator's call is blocking, on loom's NULL stream, with nothing
// allocated (the latency path); a CUDA communicator's is enqueued on the
// caller's cudaStream_t, passed through as loom's stream.  The caller has
// checked the communicator (checkComm) and the stream (checkStream).
template <class Issue>
ncclResult_t submit(ncclComm* comm, const char* name, cudaStream_t stream, Issue&& issue,
                    std::function<loomResult_t(loomStream_t)> prepare = {}) {
  loomStream_t s = comm->cuda() ? reinterpret_cast<loomStream_t>(stream) : nullptr;
  if (inGroup()) return enqueue(PendingOp{comm, name, s, std::forward<Issue>(issue), std::move(prepare)});
  beginLaunch();
  if (prepare)
    if (loomResult_t r = prepare(s)) return fromLoom(r, name);
  return fromLoom(issue(s), name);
}

// Argument checks shared by the entry points.  Each returns ncclSuccess or
// records the reason (fail) and returns the NCCL code.
// A revoked communicator (ncclCommRevoke) takes only shrink, revoke, destroy
// and abort: revokedOk for the first two.
ncclResult_t checkComm(const char* call, ncclComm_t comm, bool revokedOk = false);
// Any stream on a CUDA communicator; only NULL on a host one.
ncclResult_t checkStream(const char* call, ncclComm_t comm, cudaStream_t stream);
// A datatype that moves bytes only: float8 travels as uint8.
ncclResult_t moveType(const char* call, ncclDataType_t in, loomDataType_t* out);
size_t typeSize(ncclDataType_t t);


}  // namespace nccl_shim

// Defines pnccl<name> and makes nccl<name> a weak alias of it, as NCCL does,
// so a profiler can interpose nccl<name> and call pnccl<name>.
#define NCCL_SHIM_API(ret, name, ...)                                                              \
  extern "C" ret name(__VA_ARGS__) __attribute__((weak, alias("p" #name), visibility("default"))); \
  extern "C" __attribute__((visibility("default"))) ret p##name(__VA_ARGS__)
