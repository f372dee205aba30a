// Versions, errors, memory, registration and communicators of the NCCL API on
// loom's communicators.
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "nccl_shim/shim.h"

using namespace nccl_shim;

namespace {

// What ncclCommRegister's handle points to.
struct Registration {
  void* buff;
  size_t size;
  void* loomHandle;  // loomCommRegister's
};

// What ncclComm_t wraps: loom's communicator and the shim's own state.
ncclResult_t wrap(loomComm_t loom, ncclComm_t* out, const char* call) {
  ncclComm* c = new (std::nothrow) ncclComm;
  if (!c) {
    loomCommAbort(loom);
    return fail(ncclSystemError, "%s: out of memory", call);
  }
  fillComm(c, loom, call);
  *out = c;
  return ncclSuccess;
}

}  // namespace

void nccl_shim::fillComm(ncclComm* c, loomComm_t loom, const char* call) {
  c->loom = loom;
  loomCommCount(loom, &c->nranks);
  loomCommUserRank(loom, &c->rank);
  loomCommCuDevice(loom, &c->cudaDevice);
  const char* device = getenv("LOOM_DEVICE");
  c->loomDevice = device ? device : "";
  if (c->cuda())
    logf(Level::Info, "%s: rank %d of %d ready on CUDA device %d (loom communicator %p)", call, c->rank,
         c->nranks, c->cudaDevice, static_cast<void*>(loom));
  else
    logf(Level::Info, "%s: rank %d of %d ready on the host (loom communicator %p)", call, c->rank, c->nranks,
         static_cast<void*>(loom));
}

ncclResult_t nccl_shim::runInits(std::vector<PendingInit>& inits) {
  const size_t n = inits.size();
  std::vector<loomComm_t> loom(n, nullptr);
  std::vector<loomResult_t> rc(n, loomSuccess);
  std::vector<std::string> why(n);
  auto initOne = [&](size_t i) {
    loomConfig_t config = LOOM_CONFIG_INITIALIZER;
    config.cudaDevice = inits[i].device;
    rc[i] = loomCommInitRankConfig(&loom[i], inits[i].nranks, inits[i].id, inits[i].rank, &config);
    if (rc[i] != loomSuccess) why[i] = loomGetLastError(nullptr);
  };
  if (n == 1) {
    initOne(0);
  } else {
    std::vector<std::thread> threads;
    try {
      for (size_t i = 0; i < n; ++i) threads.emplace_back(initOne, i);
    } catch (const std::exception& e) {
      // The ranks already started wait for the others until loom's timeout.
      for (std::thread& t : threads) t.join();
      for (loomComm_t c : loom) loomCommAbort(c);
      return fail(ncclSystemError, "cannot start a thread per rank to initialise %zu communicators: %s", n,
                  e.what());
    }
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < n; ++i)
    if (rc[i] != loomSuccess) {
      for (loomComm_t c : loom) loomCommAbort(c);
      return fail(toNccl(rc[i]), "rank %d of %d (device %d): %s", inits[i].rank, inits[i].nranks, inits[i].device,
                  why[i].c_str());
    }
  for (size_t i = 0; i < n; ++i) fillComm(inits[i].comm, loom[i], "ncclCommInitRank");
  return ncclSuccess;
}

namespace {

void unwrap(ncclComm_t comm, bool aborted = false) {
  if (comm->groupStream) loomStreamDestroy(comm->groupStream);
  freeScratch(comm, aborted);
  for (void* reg : comm->registrations) delete static_cast<Registration*>(reg);
  delete comm;
}

// ncclConfig_t: the initializer's size, magic and version must be there (as
// NCCL checks).  Its fields tune CUDA launches (CTAs, clusters, NVLS) or
// name things; loom uses none of them, and blocking=0 is accepted because a
// blocking init is a valid non-blocking one (it returns ncclSuccess, never
// ncclInProgress).
ncclResult_t checkConfig(const char* call, const ncclConfig_t* config) {
  if (!config) return ncclSuccess;
  if (config->magic != 0xcafebeef || config->size < offsetof(ncclConfig_t, cgaClusterSize))
    return fail(ncclInvalidArgument, "%s: config was not initialised with NCCL_CONFIG_INITIALIZER", call);
  if (config->blocking == 0)
    logf(Level::Info, "%s: blocking=0: loom initialises blocking and returns ncclSuccess", call);
  return ncclSuccess;
}

}  // namespace

NCCL_SHIM_API(ncclResult_t, ncclGetVersion, int* version) {
  ensureEnv();
  if (!version) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;  // the API this shim implements, which PyTorch and nccl-tests check
  return ncclSuccess;
}

NCCL_SHIM_API(const char*, ncclGetErrorString, ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:
      return "internal error - please report this issue to the loom developers";
    case ncclInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:
      return "remote process exited or there was a network error";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

// The thread's last error (the shim's or loom's message), else the
// communicator's own (an asynchronous failure), else the process's last
// error, as NCCL's one string (another thread's, or a failure
// ncclCommGetAsyncError reported), else "".
NCCL_SHIM_API(const char*, ncclGetLastError, ncclComm_t comm) {
  const char* mine = lastError();
  if (*mine) return mine;
  if (comm) {
    const char* its = loomGetLastError(comm->loom);
    if (its && *its) return its;
  }
  return processLastError();
}

NCCL_SHIM_API(ncclResult_t, ncclGetUniqueId, ncclUniqueId* uniqueId) {
  ensureEnv();
  if (!uniqueId) return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  static_assert(sizeof(ncclUniqueId) == sizeof(loomUniqueId), "the ids have one size");
  loomUniqueId id;
  loomResult_t r = loomGetUniqueId(&id);
  if (r == loomSuccess) memcpy(uniqueId, &id, sizeof id);
  return fromLoom(r, "ncclGetUniqueId");
}

NCCL_SHIM_API(ncclResult_t, ncclCommInitRankConfig, ncclComm_t* comm, int nranks, ncclUniqueId commId,
              int rank, ncclConfig_t* config) {
  ensureEnv();
  if (!comm) return fail(ncclInvalidArgument, "ncclCommInitRankConfig: comm is NULL");
  *comm = nullptr;
  if (ncclResult_t r = checkConfig("ncclCommInitRankConfig", config)) return r;
  loomUniqueId id;
  memcpy(&id, &commId, sizeof id);
  if (inGroup()) {
    // As NCCL: made at the group's end, with the others of the group.
    if (nranks < 1 || rank < 0 || rank >= nranks)
      return fail(ncclInvalidArgument, "ncclCommInitRank: rank %d of %d ranks", rank, nranks);
    int device = -1;
    if (loomResult_t r = loomCudaGetDevice(&device)) return fromLoom(r, "ncclCommInitRank");
    ncclComm* c = new (std::nothrow) ncclComm;
    if (!c) return fail(ncclSystemError, "ncclCommInitRank: out of memory");
    c->rank = rank;
    c->nranks = nranks;
    enqueueInit(PendingInit{c, nranks, rank, id, device});
    *comm = c;
    return ncclSuccess;
  }
  loomComm_t loom = nullptr;
  loomResult_t r = loomCommInitRank(&loom, nranks, id, rank);
  if (r != loomSuccess) return fromLoom(r, "ncclCommInitRank");
  return wrap(loom, comm, "ncclCommInitRank");
}

NCCL_SHIM_API(ncclResult_t, ncclCommInitRank, ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return pncclCommInitRankConfig(comm, nranks, commId, rank, nullptr);
}

// loom's bootstrap has one root: the id made by rank 0 (commIds[0]) is used
// and the others are ignored, so rank 0 must be the one that made commIds[0].
NCCL_SHIM_API(ncclResult_t, ncclCommInitRankScalable, ncclComm_t* newcomm, int nranks, int myrank, int nId,
              ncclUniqueId* commIds, ncclConfig_t* config) {
  ensureEnv();
  if (nId < 1 || !commIds)
    return fail(ncclInvalidArgument, "ncclCommInitRankScalable: needs nId >= 1 ids (nId %d, commIds %p)", nId,
                static_cast<void*>(commIds));
  return pncclCommInitRankConfig(newcomm, nranks, commIds[0], myrank, config);
}

// NCCL's semantics: ndev ranks of one new communicator in this process,
// rank i on CUDA device devlist[i] (device i when devlist is NULL).  Each
// init blocks until every rank has joined, so they run concurrently, one
// thread each.  The devices are checked first, so that no rank waits for
// one that failed at once.  Where loom makes host communicators (no GPU,
// LOOM_DEVICE=host) the devices are not used: ndev host communicators.
NCCL_SHIM_API(ncclResult_t, ncclCommInitAll, ncclComm_t* comms, int ndev, const int* devlist) {
  const char* call = "ncclCommInitAll";
  ensureEnv();
  if (!comms) return fail(ncclInvalidArgument, "%s: comms is NULL", call);
  if (ndev < 1) return fail(ncclInvalidArgument, "%s: ndev %d must be at least 1", call, ndev);
  for (int i = 0; i < ndev; ++i) comms[i] = nullptr;
  int devices = 0;
  if (loomResult_t r = loomCudaDeviceCount(&devices)) return fromLoom(r, call);
  auto deviceOf = [&](int i) { return devlist ? devlist[i] : i; };
  for (int i = 0; i < ndev; ++i) {
    if (!(deviceOf(i) < 0 || (devices > 0 && deviceOf(i) >= devices))) continue;
    if (devlist)
      return fail(ncclInvalidArgument,
                  "%s: devlist[%d] = %d is not a CUDA device of this process (it has %d)", call, i,
                  devlist[i], devices);
    return fail(
        ncclInvalidArgument,
        "%s: ndev %d with devlist NULL puts rank i on device i, but this process has %d CUDA device%s", call,
        ndev, devices, devices == 1 ? "" : "s");
  }
  loomUniqueId id;
  if (loomResult_t r = loomGetUniqueId(&id)) return fromLoom(r, call);
  std::vector<PendingInit> inits;
  for (int i = 0; i < ndev; ++i) {
    ncclComm* c = new (std::nothrow) ncclComm;
    if (!c) {
      for (PendingInit& p : inits) delete p.comm;
      return fail(ncclSystemError, "%s: out of memory", call);
    }
    inits.push_back(PendingInit{c, ndev, i, id, deviceOf(i)});
  }
  if (ncclResult_t r = runInits(inits)) {
    for (PendingInit& p : inits) delete p.comm;
    std::string why = lastError();
    return fail(r, "%s: %s", call, why.c_str());
  }
  for (int i = 0; i < ndev; ++i) comms[i] = inits[size_t(i)].comm;
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommSplit, ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
              ncclConfig_t* config) {
  ensureEnv();
  if (ncclResult_t r = checkComm("ncclCommSplit", comm)) return r;
  if (!newcomm) return fail(ncclInvalidArgument, "ncclCommSplit: newcomm is NULL");
  *newcomm = nullptr;
  if (ncclResult_t r = checkConfig("ncclCommSplit", config)) return r;
  loomComm_t loom = nullptr;
  loomResult_t r =
      loomCommSplit(comm->loom, color == NCCL_SPLIT_NOCOLOR ? LOOM_SPLIT_NOCOLOR : color, key, &loom);
  if (r != loomSuccess) return fromLoom(r, "ncclCommSplit");
  if (!loom) return ncclSuccess;  // NCCL_SPLIT_NOCOLOR
  return wrap(loom, newcomm, "ncclCommSplit");
}

// loomCommShrink has NCCL's contract: the ranks that remain call it with the
// same list, the excluded ones need not call.  It also leaves out ranks it
// finds dead (NCCL would wait for them), so the new communicator may be
// smaller than the list says: ncclCommCount tells.
NCCL_SHIM_API(ncclResult_t, ncclCommShrink, ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
              ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags) {
  ensureEnv();
  if (ncclResult_t r = checkComm("ncclCommShrink", comm, /*revokedOk=*/true)) return r;
  if (!newcomm) return fail(ncclInvalidArgument, "ncclCommShrink: newcomm is NULL");
  *newcomm = nullptr;
  if (ncclResult_t r = checkConfig("ncclCommShrink", config)) return r;
  if (shrinkFlags != NCCL_SHRINK_DEFAULT && shrinkFlags != NCCL_SHRINK_ABORT)
    return fail(ncclInvalidArgument,
                "ncclCommShrink: shrinkFlags %d is neither NCCL_SHRINK_DEFAULT (0) nor NCCL_SHRINK_ABORT (1)",
                shrinkFlags);
  if (excludeRanksCount < 0 || (excludeRanksCount > 0 && !excludeRanksList))
    return fail(ncclInvalidArgument, "ncclCommShrink: excludeRanksList %p with excludeRanksCount %d",
                static_cast<void*>(excludeRanksList), excludeRanksCount);
  // NCCL_SHRINK_ABORT: the parent's operations in flight end first (they
  // fail), here and, through loom's revoke, on the peers.
  if (shrinkFlags == NCCL_SHRINK_ABORT && !comm->revoked.exchange(true)) loomCommRevoke(comm->loom);
  loomComm_t loom = nullptr;
  loomResult_t r = loomCommShrink(comm->loom, excludeRanksList, excludeRanksCount, &loom);
  if (r != loomSuccess) return fromLoom(r, "ncclCommShrink");
  if (!loom) return ncclSuccess;  // this rank is excluded
  return wrap(loom, newcomm, "ncclCommShrink");
}

// A host communicator's operations complete before their call returns, so
// nothing is in flight; a CUDA communicator's are on the caller's streams,
// and ncclCommDestroy waits for them (loomCommDestroy drains the device
// side).  Finalizing marks the communicator so later operations fail.
NCCL_SHIM_API(ncclResult_t, ncclCommFinalize, ncclComm_t comm) {
  ensureEnv();
  if (ncclResult_t r = checkComm("ncclCommFinalize", comm)) return r;
  comm->finalized = true;
  return ncclSuccess;
}

// loomCommRevoke: the communicator's operations in flight and later ones
// fail (within milliseconds, on the peers too, which loom tells), and it
// stays valid for ncclCommShrink, destroy and abort.  loom's revoke does not
// block, and those three deal with whatever is still in flight (a CUDA
// communicator's stream work is released, then drained), so the
// communicator counts as quiescent at once: ncclCommGetAsyncError says
// ncclSuccess from then on (NCCL's ncclInProgress-then-ncclSuccess, without
// the ncclInProgress).
NCCL_SHIM_API(ncclResult_t, ncclCommRevoke, ncclComm_t comm, int revokeFlags) {
  ensureEnv();
  if (ncclResult_t r = checkComm("ncclCommRevoke", comm, /*revokedOk=*/true)) return r;
  if (revokeFlags != NCCL_REVOKE_DEFAULT)
    return fail(ncclInvalidArgument, "ncclCommRevoke: revokeFlags %d must be NCCL_REVOKE_DEFAULT (0)",
                revokeFlags);
  if (!comm->revoked.exchange(true)) {
    loomResult_t r = loomCommRevoke(comm->loom);
    if (r != loomSuccess) return fromLoom(r, "ncclCommRevoke");
  }
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommDestroy, ncclComm_t comm) {
  ensureEnv();
  if (!comm) return ncclSuccess;
  loomResult_t r = loomCommDestroy(comm->loom);
  unwrap(comm);
  return fromLoom(r, "ncclCommDestroy");
}

NCCL_SHIM_API(ncclResult_t, ncclCommAbort, ncclComm_t comm) {
  ensureEnv();
  if (!comm) return ncclSuccess;
  loomResult_t r = loomCommAbort(comm->loom);
  unwrap(comm, /*aborted=*/true);
  return fromLoom(r, "ncclCommAbort");
}

NCCL_SHIM_API(ncclResult_t, ncclCommGetAsyncError, ncclComm_t comm, ncclResult_t* asyncError) {
  ensureEnv();
  if (!comm || !asyncError) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
  if (comm->revoked) {  // revoked here: quiescent (see ncclCommRevoke)
    *asyncError = ncclSuccess;
    return ncclSuccess;
  }
  loomResult_t e = loomSuccess;
  loomResult_t r = loomCommGetAsyncError(comm->loom, &e);
  if (r != loomSuccess) return fromLoom(r, "ncclCommGetAsyncError");
  *asyncError = toNccl(e);
  // The reason stays on the communicator (ncclGetLastError(comm)) and is
  // the process's last error too, for ncclGetLastError(NULL) (PyTorch's
  // watchdog asks that way).
  if (e != loomSuccess) noteError(std::string("ncclCommGetAsyncError: ") + loomGetLastError(comm->loom));
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommCount, const ncclComm_t comm, int* count) {
  ensureEnv();
  if (!comm || !count) return fail(ncclInvalidArgument, "ncclCommCount: NULL argument");
  *count = comm->nranks;
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommUserRank, const ncclComm_t comm, int* rank) {
  ensureEnv();
  if (!comm || !rank) return fail(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
  *rank = comm->rank;
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommCuDevice, const ncclComm_t comm, int* device) {
  ensureEnv();
  if (!comm || !device) return fail(ncclInvalidArgument, "ncclCommCuDevice: NULL argument");
  if (!comm->cuda())
    return fail(
        ncclInvalidUsage,
        "ncclCommCuDevice: this communicator runs on the host (LOOM_DEVICE=%s when it was made) and has "
        "no CUDA device (host buffers)",
        comm->loomDevice.c_str());
  *device = comm->cudaDevice;
  return ncclSuccess;
}

// loomMemAlloc: CUDA device memory on the current device when the process
// has a GPU (the shim sets LOOM_DEVICE=auto), as NCCL gives; host memory
// otherwise (whole pages, so NCCL_WIN_REQUIRED_ALIGNMENT holds), which
// peers on the host reduce straight out of.
NCCL_SHIM_API(ncclResult_t, ncclMemAlloc, void** ptr, size_t size) {
  ensureEnv();
  if (!ptr) return fail(ncclInvalidArgument, "ncclMemAlloc: ptr is NULL");
  *ptr = nullptr;
  if (size == 0) return fail(ncclInvalidArgument, "ncclMemAlloc: size is 0");
  if (loomResult_t r = loomMemAlloc(ptr, size)) {
    *ptr = nullptr;
    return fromLoom(r, "ncclMemAlloc");
  }
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclMemFree, void* ptr) {
  ensureEnv();
  if (loomResult_t r = loomMemFree(ptr)) return fromLoom(r, "ncclMemFree");
  return ncclSuccess;
}

// loomCommRegister's handle, wrapped so that deregistration can check it
// was one of this communicator's.
NCCL_SHIM_API(ncclResult_t, ncclCommRegister, const ncclComm_t comm, void* buff, size_t size, void** handle) {
  ensureEnv();
  if (ncclResult_t r = checkComm("ncclCommRegister", comm)) return r;
  if (!buff || !handle || size == 0)
    return fail(ncclInvalidArgument, "ncclCommRegister: NULL buffer, handle or size 0");
  Registration* reg = new (std::nothrow) Registration{buff, size, nullptr};
  if (!reg) return fail(ncclSystemError, "ncclCommRegister: out of memory");
  if (loomResult_t r = loomCommRegister(comm->loom, buff, size, &reg->loomHandle)) {
    delete reg;
    return fromLoom(r, "ncclCommRegister");
  }
  std::lock_guard<std::mutex> lock(comm->mu);
  comm->registrations.insert(reg);
  *handle = reg;
  logf(Level::Info, "ncclCommRegister(%p, %zu): registered with loom", buff, size);
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclCommDeregister, const ncclComm_t comm, void* handle) {
  ensureEnv();
  if (!comm) return fail(ncclInvalidArgument, "ncclCommDeregister: comm is NULL");
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    if (!comm->registrations.erase(handle))
      return fail(ncclInvalidArgument, "ncclCommDeregister: %p is not a registration of this communicator",
                  handle);
  }
  // Outside the lock: for published device memory this waits for the
  // device and for the peers to unmap it.
  Registration* reg = static_cast<Registration*>(handle);
  loomResult_t r = loomCommDeregister(comm->loom, reg->loomHandle);
  delete reg;
  return r == loomSuccess ? ncclSuccess : fromLoom(r, "ncclCommDeregister");
}

NCCL_SHIM_API(ncclResult_t, ncclCommWindowRegister, ncclComm_t comm, void* buff, size_t size,
              ncclWindow_t* win, int winFlags) {
  ensureEnv();
  (void)comm, (void)buff, (void)win, (void)winFlags;
  return fail(
      ncclInvalidUsage,
      "ncclCommWindowRegister(%zu bytes): symmetric memory windows need CUDA memory and NCCL's device "
      "API, which loom does not have",
      size);
}

NCCL_SHIM_API(ncclResult_t, ncclCommWindowDeregister, ncclComm_t comm, ncclWindow_t win) {
  ensureEnv();
  (void)comm, (void)win;
  return fail(ncclInvalidUsage,
              "ncclCommWindowDeregister: loom registers no windows (see ncclCommWindowRegister)");
}
