/*
 * loom.h - the public C API of loom, a collective-communication library for
 * data-parallel training.
 *
 * The API has the shape of NCCL's: communicators are created from a unique id
 * (or from launcher environment variables), collectives take
 * (send, recv, count, datatype, op, comm, stream), and every call returns a
 * loomResult_t.  Host buffers are first-class: a host "stream" is a loom object
 * with the same ordering rules as a CUDA stream.
 *
 * Thread safety: a communicator may be used from several threads, but the
 * ranks of a communicator must issue its operations in the same order.
 * Operations of one communicator execute in the order they were issued.
 *
 * This header compiles as C and as C++.
 */
#ifndef LOOM_H_
#define LOOM_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_MAJOR 0
#define LOOM_MINOR 1
#define LOOM_PATCH 0
/* LOOM_VERSION_CODE == loomGetVersion() of the library this header belongs to. */
#define LOOM_VERSION_CODE (LOOM_MAJOR * 10000 + LOOM_MINOR * 100 + LOOM_PATCH)

/* Marks the functions libloom.so exports: the library is built with hidden
 * visibility, so these are its only symbols (cmake/libloom.map agrees). */
#if defined(__GNUC__)
#define LOOM_API __attribute__((visibility("default")))
#else
#define LOOM_API
#endif

/* Result codes.  Numbering follows NCCL's where both have the code. */
typedef enum {
  loomSuccess = 0,
  loomUnhandledCudaError = 1, /* a CUDA call failed */
  loomSystemError = 2,        /* an OS call failed (socket, mmap, ...) */
  loomInternalError = 3,      /* a bug in loom */
  loomInvalidArgument = 4,    /* a bad argument: null pointer, unknown type, ... */
  loomInvalidUsage = 5,       /* a bad sequence of calls, or ranks that disagree */
  loomRemoteError = 6,        /* a peer died, closed its connection or failed */
  loomInProgress = 7,         /* the operation has not completed yet */
  loomTimeout = 8,            /* no progress within LOOM_TIMEOUT_MS */
  loomNumResults = 9
} loomResult_t;

typedef enum {
  loomInt8 = 0,
  loomChar = 0,
  loomUint8 = 1,
  loomInt32 = 2,
  loomInt = 2,
  loomUint32 = 3,
  loomInt64 = 4,
  loomUint64 = 5,
  loomFloat16 = 6,
  loomHalf = 6,
  loomFloat32 = 7,
  loomFloat = 7,
  loomFloat64 = 8,
  loomDouble = 8,
  loomBfloat16 = 9,
  loomNumTypes = 10
} loomDataType_t;

/* Reductions.  float16 and bfloat16 are reduced in float32 and rounded to
 * their own type (round to nearest even) once per reduction step, i.e. each
 * time two operands are combined.  loomAvg divides the sum by the number of
 * ranks at the end (integer types: truncating division). */
typedef enum {
  loomSum = 0,
  loomProd = 1,
  loomMax = 2,
  loomMin = 3,
  loomAvg = 4,
  loomNumOps = 5
} loomRedOp_t;

/* An opaque unique id.  Rank 0 creates it with loomGetUniqueId and ships its
 * bytes to every other rank out of band. */
#define LOOM_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[LOOM_UNIQUE_ID_BYTES];
} loomUniqueId;

typedef struct loomComm* loomComm_t;

/* A stream orders operations.  For a host communicator it is a loom host
 * stream made by loomStreamCreate, or NULL: with NULL the call returns when its
 * operation is complete.  The handle is opaque and loom never reads memory
 * through a handle it did not make: any other non-NULL value (such as a
 * cudaStream_t cast to loomStream_t, which CUDA communicators will accept)
 * makes a call on a host communicator return loomInvalidArgument. */
typedef struct loomStream* loomStream_t;

/* ---- Versions and errors ------------------------------------------------ */

/* Stores LOOM_VERSION_CODE of the library in *version.
 * Returns loomInvalidArgument if version is NULL. */
LOOM_API loomResult_t loomGetVersion(int* version);

/* A static, human-readable name for a result code ("invalid argument", ...).
 * Never returns NULL. */
LOOM_API const char* loomGetErrorString(loomResult_t result);

/* The message of the last error seen by this thread, or if comm is non-NULL,
 * the last error recorded on comm (naming the call, the rank and the cause).
 * Returns "" when there was none.  The string stays valid until the next loom
 * call on the same thread or communicator. */
LOOM_API const char* loomGetLastError(loomComm_t comm);

/* ---- Communicators ----------------------------------------------------- */

/* Creates a unique id for a new communicator and opens the bootstrap
 * listener of its root in this process; the process that calls it must later
 * call loomCommInitRank with rank 0.  The id holds the root's address and a
 * 128-bit random secret: a connection that does not present the secret is
 * dropped.  Returns loomInvalidArgument on NULL, loomSystemError if no socket
 * can be opened. */
LOOM_API loomResult_t loomGetUniqueId(loomUniqueId* uniqueId);

/* Creates a communicator of nranks ranks in which the caller is `rank`.
 * Every rank calls it with the same id and nranks; it blocks until all ranks
 * have joined (or LOOM_TIMEOUT_MS passes: loomTimeout).  Returns
 * loomInvalidArgument for a NULL comm, nranks < 1 or rank out of
 * [0, nranks). */
LOOM_API loomResult_t loomCommInitRank(loomComm_t* comm, int nranks, loomUniqueId commId, int rank);

/* The configuration form of init.  Fill a loomConfig_t from
 * LOOM_CONFIG_INITIALIZER, then set the fields to change:
 *
 *   loomConfig_t config = LOOM_CONFIG_INITIALIZER;
 *   config.deviceKind = loomDeviceCuda;
 *   config.cudaDevice = 1;
 *   loomCommInitRankConfig(&comm, nranks, id, rank, &config);
 *
 * size, magic and version are the initializer's: they tell the library which
 * loom.h the program was built with, so a struct from an older or newer
 * header is either read as that version or refused (loomInvalidArgument
 * naming the version), never misread. */
typedef enum {
  loomDeviceFromEnv = 0, /* what LOOM_DEVICE says (unset: host); the default */
  loomDeviceHost = 1,    /* host memory, loom host streams */
  loomDeviceCuda = 2,    /* CUDA device memory, cudaStream_t streams */
  loomDeviceAuto = 3     /* CUDA where the process has a CUDA device, else the host */
} loomDeviceKind_t;

#define LOOM_CONFIG_MAGIC 0x6c6f6f6dU /* "loom" */
#define LOOM_CONFIG_VERSION 2
typedef struct {
  size_t size;          /* sizeof(loomConfig_t) of the program's loom.h */
  unsigned int magic;   /* LOOM_CONFIG_MAGIC */
  unsigned int version; /* LOOM_CONFIG_VERSION of the program's loom.h */
  int deviceKind;       /* a loomDeviceKind_t: where the communicator runs */
  /* The CUDA device of a communicator that runs on CUDA: an ordinal below
   * the process's device count, or -1 (the default) for the device current
   * on the calling thread at init, as loomCommInitRank takes.  A host
   * communicator (deviceKind host, or LOOM_DEVICE/auto choosing the host)
   * ignores it; deviceKind loomDeviceHost with an ordinal >= 0 is a
   * contradiction and refused. */
  int cudaDevice;
  /* Version 2.  The communicator's timeout in milliseconds, from its init on
   * (the bootstrap waits for the other ranks that long): as
   * loomCommSetTimeout after init, but init is bounded by it too.  0 (the
   * default): LOOM_TIMEOUT_MS.  Negative: refused. */
  long long timeoutMs;
} loomConfig_t;
#define LOOM_CONFIG_INITIALIZER \
  { sizeof(loomConfig_t), LOOM_CONFIG_MAGIC, LOOM_CONFIG_VERSION, loomDeviceFromEnv, -1, 0 }

/* loomCommInitRank with a configuration (NULL: loomCommInitRank's).  Every
 * rank must choose the same device kind (loomInvalidUsage otherwise); ranks
 * may name different CUDA devices, or the same one.  Returns
 * loomInvalidArgument, naming the field, for a config not made from
 * LOOM_CONFIG_INITIALIZER (magic), a version or size this library does not
 * know, an unknown deviceKind, a cudaDevice below -1 or beyond the process's
 * devices, or cudaDevice >= 0 with deviceKind loomDeviceHost; CUDA chosen
 * on a process without a usable CUDA device is loomInvalidUsage with the
 * reason, as LOOM_DEVICE=cuda is. */
LOOM_API loomResult_t loomCommInitRankConfig(loomComm_t* comm, int nranks, loomUniqueId commId, int rank,
                                             const loomConfig_t* config);

/* Creates a communicator from launcher environment variables, in this order
 * of preference:
 *   loom-run:  LOOM_RANK, LOOM_WORLD_SIZE, LOOM_ROOT_ADDR (host:port), LOOM_SECRET
 *   torchrun:  RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (loom listens on
 *              MASTER_PORT + 1 unless LOOM_ROOT_PORT is set, because torchrun's
 *              store owns MASTER_PORT)
 *   OpenMPI:   OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE
 *   Slurm:     SLURM_PROCID, SLURM_NTASKS
 * For OpenMPI and Slurm the root address comes from LOOM_ROOT_ADDR, or
 * MASTER_ADDR/MASTER_PORT, or 127.0.0.1:29500 + 1 when all ranks are local.
 * Rank 0 opens the listener.  Returns loomInvalidArgument when no launcher's
 * variables are present or they are inconsistent. */
LOOM_API loomResult_t loomCommInitFromEnv(loomComm_t* comm);

/* Creates communicators by splitting comm: ranks passing the same color end
 * up in one new communicator, ordered by key (ties: by rank in comm).  Every
 * rank of comm must call it.  color < 0 (LOOM_SPLIT_NOCOLOR) gives
 * *newcomm = NULL.  The new communicators run on comm's device (its CUDA
 * device, or the host).  Returns loomInvalidArgument on NULL arguments. */
#define LOOM_SPLIT_NOCOLOR (-1)
LOOM_API loomResult_t loomCommSplit(loomComm_t comm, int color, int key, loomComm_t* newcomm);

/* Waits for the communicator's pending operations, then frees it.  A
 * communicator that failed is freed without waiting.  NULL is a no-op. */
LOOM_API loomResult_t loomCommDestroy(loomComm_t comm);

/* Frees the communicator at once: pending operations fail with
 * loomRemoteError on this rank; peers see the connection close and fail
 * too.  Never blocks on peers.  NULL is a no-op. */
LOOM_API loomResult_t loomCommAbort(loomComm_t comm);

/* Revokes the communicator: this rank's pending and later operations on it
 * fail with loomRemoteError, and every peer that can still be reached is
 * told to do the same (its waiting operations return within milliseconds,
 * not at the timeout).  Never blocks on peers.  The communicator stays valid
 * for loomCommShrink, loomCommGetAsyncError and loomCommDump; free it with
 * loomCommDestroy or loomCommAbort.  Calling it again is a no-op. */
LOOM_API loomResult_t loomCommRevoke(loomComm_t comm);

/* Builds a new communicator from the ranks of comm that are alive, less the
 * nExclude ranks listed in excludeRanks (may be NULL when nExclude is 0).
 * Ranks found dead (killed, crashed, or whose communicator was destroyed or
 * aborted) are always left out, so loomCommShrink(comm, NULL, 0, &newcomm)
 * is "continue with whoever is left".  Across a network cut the side whose
 * members are not more than the ranks it left out and cannot reach gets
 * loomRemoteError instead of a communicator (both sides could otherwise go
 * on, each believing the other dead; two equal halves both fail).  Every surviving rank that is not
 * excluded must call it, with the same list (a rank that the others leave
 * out while it leaves out one of them gets loomInvalidUsage when it can
 * still ask them); a listed rank need not call
 * (if it does, it gets *newcomm = NULL at once).  The callers run a
 * fault-tolerant agreement on who is alive: they all return the same
 * membership even if another rank dies during the shrink, and none waits
 * past about twice the communicator's timeout.  New ranks are the old ones
 * in order, renumbered from 0; the new communicator has its own connections,
 * tuning and topology, and comm's timeout and device.  comm is usually revoked or
 * failed first; it is not freed (destroy or abort it afterwards).  A rank
 * that is alive but did not call within the timeout is left out: if it calls
 * while the others still agree it gets *newcomm = NULL, later it gets
 * loomTimeout.  Returns loomInvalidArgument for a rank out of range,
 * loomInvalidUsage inside a group, loomTimeout or loomRemoteError when no
 * agreement could be reached or this rank is on the smaller side of a cut. */
LOOM_API loomResult_t loomCommShrink(loomComm_t comm, const int* excludeRanks, int nExclude, loomComm_t* newcomm);

/* Number of ranks / this rank's index.  loomInvalidArgument on NULL. */
LOOM_API loomResult_t loomCommCount(const loomComm_t comm, int* count);
LOOM_API loomResult_t loomCommUserRank(const loomComm_t comm, int* rank);

/* The CUDA device a communicator runs on (its ordinal, as cudaGetDevice
 * numbers them), or -1 for a host communicator.  loomInvalidArgument on
 * NULL. */
LOOM_API loomResult_t loomCommCuDevice(const loomComm_t comm, int* device);

/* The number of CUDA devices this process can make communicators on (what
 * loomConfig_t's cudaDevice may name): 0 where there is no GPU, CUDA driver
 * or loom CUDA plug-in.  loomInvalidArgument on NULL. */
LOOM_API loomResult_t loomCudaDeviceCount(int* count);

/* The calling thread's current CUDA device (cudaGetDevice's ordinal), the
 * one loomCommInitRank puts a CUDA communicator on, or -1 where the process
 * has no CUDA device.  loomInvalidArgument on NULL; loomUnhandledCudaError
 * with CUDA's message if CUDA cannot say. */
LOOM_API loomResult_t loomCudaGetDevice(int* device);

/* Whether `stream` (a cudaStream_t; NULL: the legacy default stream) is
 * being captured into a CUDA graph now (cudaStreamIsCapturing): *capturing
 * is 1 or 0, and 0 where the process has no CUDA device (and for the legacy
 * stream while a blocking stream of the device is being captured, which
 * loom's calls refuse: enqueueing there would invalidate that capture).  A CUDA
 * communicator's collectives on such a stream are captured (the ipc path's
 * graph lane, docs/usage.md "CUDA graphs").  loomInvalidArgument on NULL
 * capturing. */
LOOM_API loomResult_t loomCudaStreamCapturing(void* stream, int* capturing);

/* Whether `comm`'s collectives, sends and receives issued on a stream being
 * captured into a CUDA graph are captured (*capturable = 1: a CUDA
 * communicator on the ipc path with a graph lane) or refused with
 * loomInvalidUsage (0: a host communicator, the staged or hierarchical
 * path, LOOM_DEVICE_GRAPH_SLOT_BYTES=0).  loomInvalidArgument on NULL
 * capturable. */
LOOM_API loomResult_t loomCommCanCapture(const loomComm_t comm, int* capturable);

/* Stores in *asyncError the error that failed the communicator in the
 * background (loomSuccess when none).  Once a communicator has failed every
 * later call on it returns that error; destroy or abort it, or shrink it.
 * When it has failed, loomGetLastError(comm) then says why and names the
 * ranks known to be dead (their control socket refused: "dead ranks: 2")
 * and those that neither answered nor refused, as across a network cut
 * ("unreachable ranks: 3"). */
LOOM_API loomResult_t loomCommGetAsyncError(loomComm_t comm, loomResult_t* asyncError);

/* Sets how long an operation of comm may make no progress before it fails
 * with loomTimeout, naming the rank it was waiting for (every rank's calls
 * then fail, as with any error).  The default is LOOM_TIMEOUT_MS; a framework
 * passes its own per-group timeout here (the PyTorch backend does).  May be
 * called at any time; operations waiting now use the new value.
 * loomInvalidArgument on a NULL comm or timeoutMs < 1. */
LOOM_API loomResult_t loomCommSetTimeout(loomComm_t comm, int64_t timeoutMs);

/* Describes what this rank of comm is doing, for debugging a hang: the
 * operations issued and completed, the one running now (collective, sequence
 * number, count, type, op, root) and for how long, the peer it waits for and
 * since when, and how many operations are queued behind it.  Writes the text
 * to buf (NUL-terminated, truncated to size bytes) or, when buf is NULL, to
 * stderr.  Safe to call from another thread while an operation hangs.
 * LOOM_DUMP_SIGNAL=N prints the same for every communicator of the process
 * when signal N arrives.  loomInvalidArgument on a NULL comm. */
LOOM_API loomResult_t loomCommDump(loomComm_t comm, char* buf, size_t size);

/* ---- Registered memory ------------------------------------------------- */
/* Shaped like NCCL's ncclMemAlloc / ncclCommRegister; the same calls will
 * cover CUDA device memory and RDMA registration.
 *
 * On a process whose communicators run on CUDA (LOOM_DEVICE=cuda, or auto
 * with a GPU), loomMemAlloc returns device memory of the current CUDA
 * device, as ncclMemAlloc does (cudaMalloc'd: CUDA IPC can export any
 * buffer inside it; not zeroed), and loomMemFree frees it.  Large
 * collectives (not send/recv, not the in-place all-to-all) whose buffers
 * lie in it are read in place by the peers on the same host
 * (LOOM_DEVICE_ZERO_COPY, docs/usage.md); loomMemFree then first has those
 * peers unmap it.  Otherwise:
 *
 * loomMemAlloc returns host memory that the other ranks on this host can map
 * (a memfd, whole pages, placed on the caller's NUMA node where the rank is
 * bound to one, every page faulted in).  All-reduces of 1 MiB and more whose
 * buffers come from it on every rank reduce straight out of the peers'
 * buffers over shared memory, without copying them into loom's staging
 * memory first (docs/usage.md, "Registered memory"); any buffer inside an
 * allocation (at any offset) qualifies, on any communicator, registered or
 * not.  Other operations work on it as on any host memory.  Peers map a buffer the first time they need it and keep the
 * mapping; freeing memory a peer has mapped is safe (the peer drops its
 * mapping when it next looks).  Free it only once no operation of any rank
 * still uses it.  The memory is shared (MAP_SHARED): a forked child shares
 * it with its parent rather than copying it.  Returns loomInvalidArgument for
 * a NULL ptr or size 0, loomSystemError when the OS refuses or the size is
 * more than the process may fault in (MemAvailable, its memory cgroups). */
LOOM_API loomResult_t loomMemAlloc(void** ptr, size_t size);

/* loomMemAlloc for a communicator's buffers: on a CUDA communicator device
 * memory of its device (whatever device the calling thread has current),
 * otherwise loomMemAlloc's host memory.  Freed with loomMemFree. */
LOOM_API loomResult_t loomCommMemAlloc(loomComm_t comm, void** ptr, size_t size);

/* Frees memory from loomMemAlloc.  NULL is a no-op; a pointer loomMemAlloc
 * did not return (or one freed already) is loomInvalidArgument. */
LOOM_API loomResult_t loomMemFree(void* ptr);

/* Registers [buff, buff + size) for repeated use with comm, for buffers a
 * framework already owns (gradient buckets, an allocator's segments).  Local
 * and cheap: no peer is contacted.  Transports that need registration (RDMA)
 * prepare the memory here; on shared memory, memory from loomMemAlloc is
 * read in place with or without registration, and other host memory is
 * still copied through loom's staging buffers (peers cannot map it).
 *
 * CUDA device memory (cudaMalloc'd, of comm's device) registers only with a
 * CUDA communicator.  Large collectives (not send/recv, not the in-place
 * all-to-all) whose buffers each lie inside a registration (or in
 * loomMemAlloc memory) are then read in place by the peers on the same
 * host, as loomMemAlloc's are (device zero-copy; the first use of an
 * allocation asks the peers to map it, about a millisecond).  Such memory
 * must be deregistered before it is freed (as with NCCL).
 *
 * A range may be registered more than once; each call returns its own
 * handle.  Returns loomInvalidArgument for a NULL comm, buff or handle,
 * size 0, device memory on a host communicator or of another device. */
LOOM_API loomResult_t loomCommRegister(const loomComm_t comm, void* buff, size_t size, void** handle);

/* Releases a handle loomCommRegister returned for comm.  For device memory
 * that this rank published and no other registration of comm holds, it
 * first waits for this process's work on the device to finish (as cudaFree
 * does) and then has the peers that map the allocation unmap it, so that it
 * may be freed after.
 * A handle that is not a live registration of comm is loomInvalidArgument. */
LOOM_API loomResult_t loomCommDeregister(const loomComm_t comm, void* handle);

/* ---- Collectives ------------------------------------------------------- */
/* All collectives are enqueued on `stream` and return before they complete
 * (NULL stream: after).  In-place use is allowed: sendbuff == recvbuff for
 * AllReduce/Broadcast/Reduce, and NCCL's offsets for AllGather
 * (sendbuff == recvbuff + rank*sendcount) and ReduceScatter
 * (sendbuff + rank*recvcount == recvbuff).  Buffers must stay valid until the
 * operation completes.  Argument errors return loomInvalidArgument and do
 * nothing.  Ranks that call different operations get loomInvalidUsage. */

/* recvbuff[i] = op over ranks of sendbuff[i], i < count, on every rank. */
LOOM_API loomResult_t loomAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                    loomDataType_t datatype, loomRedOp_t op, loomComm_t comm,
                                    loomStream_t stream);

/* sendbuff has nranks*recvcount elements; rank r receives block r of the
 * reduction. */
LOOM_API loomResult_t loomReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                        loomDataType_t datatype, loomRedOp_t op, loomComm_t comm,
                                        loomStream_t stream);

/* recvbuff has nranks*sendcount elements; block r comes from rank r. */
LOOM_API loomResult_t loomAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                    loomDataType_t datatype, loomComm_t comm, loomStream_t stream);

/* Copies root's sendbuff into every rank's recvbuff.  sendbuff is only read
 * on root. */
LOOM_API loomResult_t loomBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                    loomDataType_t datatype, int root, loomComm_t comm,
                                    loomStream_t stream);

/* Reduces every rank's sendbuff into root's recvbuff (recvbuff is only written
 * on root and may be NULL elsewhere). */
LOOM_API loomResult_t loomReduce(const void* sendbuff, void* recvbuff, size_t count,
                                 loomDataType_t datatype, loomRedOp_t op, int root, loomComm_t comm,
                                 loomStream_t stream);

/* A local operation (this rank's buffers only, no peer takes part):
 * dst[i] = src[i] * k for i < count, one step of loomProd (float16 and
 * bfloat16 multiply in float32 and round once, integers wrap), dst may
 * equal src.  k is the one element of `datatype` at `scalar`: host memory
 * read during the call, or with scalarOnDevice nonzero memory read when the
 * work runs (on a CUDA communicator, device memory of its device).  It is
 * what a PreMulSum reduction (NCCL's ncclRedOpCreatePreMulSum) does to each
 * rank's input before loomSum: loom's NCCL shim maps one onto the two.  On a
 * CUDA communicator the buffers are device memory and the work is enqueued on
 * the cudaStream_t; otherwise host memory, done during the call (NULL
 * stream) or enqueued on the loom stream.  Inside loomGroupStart/End it is
 * issued at the call, before the group's collectives, and an error cancels
 * the group's collectives as a refused member's does (loomScale calls of
 * the group that succeeded before it are already issued). */
LOOM_API loomResult_t loomScale(void* dst, const void* src, size_t count, loomDataType_t datatype,
                                const void* scalar, int scalarOnDevice, loomComm_t comm, loomStream_t stream);

/* The exchanges below are, as in NCCL, one group of sends and receives
 * between every pair that exchanges data (a rank's own block is copied
 * locally); every rank must call the same one with matching counts, or the
 * ranks get loomInvalidUsage (counts that disagree) or, for calls that do not
 * match at all, the communicator's timeout.  Inside a loomGroupStart/End
 * group they join that group. */

/* All-to-all: rank r sends sendbuff + j*count (count elements) to rank j and
 * receives rank i's block r at recvbuff + i*count.  Both buffers hold
 * nranks*count elements.  In place when sendbuff == recvbuff (as NCCL takes
 * it; each rank chooses for itself): a host communicator first copies the
 * nranks*count elements aside (one extra local copy, into loomMemAlloc
 * memory the communicator keeps for later calls and resizes as they need,
 * which the peers on this host read in place as they would read
 * loomMemAlloc buffers); a CUDA communicator
 * needs no copy (its program reads each piece of the input before it writes
 * that piece of the output).  Any other overlap is loomInvalidArgument. */
LOOM_API loomResult_t loomAllToAll(const void* sendbuff, void* recvbuff, size_t count,
                                   loomDataType_t datatype, loomComm_t comm, loomStream_t stream);

/* All-to-all with a size per pair (MPI_Alltoallv's shape, in elements):
 * sendcounts[j] elements from sendbuff + sdispls[j] go to rank j, and
 * recvcounts[i] elements from rank i land at recvbuff + rdispls[i].  Each
 * array has nranks entries; rank i's sendcounts[r] must equal rank r's
 * recvcounts[i] (loomInvalidUsage otherwise).  The send and receive regions
 * must not overlap each other, so there is no in-place form (unlike
 * loomAllToAll); receive regions must not overlap one another
 * (loomInvalidArgument). */
LOOM_API loomResult_t loomAllToAllv(const void* sendbuff, const size_t sendcounts[], const size_t sdispls[],
                                    void* recvbuff, const size_t recvcounts[], const size_t rdispls[],
                                    loomDataType_t datatype, loomComm_t comm, loomStream_t stream);

/* Gather: every rank sends count elements from sendbuff to root, which
 * places rank i's at recvbuff + i*count (nranks*count elements; recvbuff is
 * not used elsewhere and may be NULL).  In place on root when
 * sendbuff == recvbuff + root*count (NCCL's rule); any other overlap is
 * loomInvalidArgument. */
LOOM_API loomResult_t loomGather(const void* sendbuff, void* recvbuff, size_t count,
                                 loomDataType_t datatype, int root, loomComm_t comm, loomStream_t stream);

/* Scatter: root sends sendbuff + i*count (count elements) to rank i, which
 * receives it in recvbuff.  sendbuff is only read on root (NULL elsewhere is
 * fine).  In place on root when recvbuff == sendbuff + root*count (NCCL's
 * rule); any other overlap is loomInvalidArgument. */
LOOM_API loomResult_t loomScatter(const void* sendbuff, void* recvbuff, size_t count,
                                  loomDataType_t datatype, int root, loomComm_t comm, loomStream_t stream);

/* Point to point.  A send must be matched by a recv of the same count and
 * datatype on the peer; several sends/recvs between a pair match in order.
 * Put a send and a recv that depend on each other in one group. */
LOOM_API loomResult_t loomSend(const void* sendbuff, size_t count, loomDataType_t datatype, int peer,
                               loomComm_t comm, loomStream_t stream);
LOOM_API loomResult_t loomRecv(void* recvbuff, size_t count, loomDataType_t datatype, int peer,
                               loomComm_t comm, loomStream_t stream);

/* Tagged point to point (MPI's matching, on its own channel: tagged and
 * plain loomSend/loomRecv never match each other, and neither disturbs the
 * collectives).  A message from rank s with tag t matches the first posted
 * receive that names s (or LOOM_ANY_SOURCE) and t (or LOOM_ANY_TAG); messages
 * from one sender with one tag are received in the order they were sent.
 * Tags are >= 0.  A receive buffer of count elements takes any message of
 * at most that many bytes (the status says how many elements arrived); a
 * larger message is loomInvalidUsage naming both sizes, and stays queued
 * for a later receive (the communicator does not fail).  Messages of at
 * most LOOM_TAGGED_EAGER_BYTES are sent at once and kept by the receiver until
 * a receive matches them (at most LOOM_TAGGED_STASH_BYTES in all; past that
 * the sender waits); larger ones wait until the receiver has matched them
 * (rendezvous), so a blocking send of a large message waits for its
 * receive, as MPI_Send may.  An any-source receive takes the message that
 * reached this rank first.  status (may be NULL) is filled when the receive
 * completes (on a stream: after loomStreamSynchronize).  See docs/usage.md. */
#define LOOM_ANY_SOURCE (-1)
#define LOOM_ANY_TAG (-1)
typedef struct {
  int source;   /* the rank the message came from */
  int tag;      /* its tag */
  size_t count; /* elements (of the receive's datatype) received */
} loomP2PStatus;
LOOM_API loomResult_t loomSendTagged(const void* sendbuff, size_t count, loomDataType_t datatype, int peer,
                                     int tag, loomComm_t comm, loomStream_t stream);
LOOM_API loomResult_t loomRecvTagged(void* recvbuff, size_t count, loomDataType_t datatype, int peer,
                                     int tag, loomComm_t comm, loomStream_t stream, loomP2PStatus* status);

/* Group calls: operations issued between loomGroupStart and loomGroupEnd
 * (on this thread) are started together at loomGroupEnd, as one operation,
 * so that e.g. a send and a recv between two ranks cannot deadlock.  Groups
 * nest; the outermost loomGroupEnd launches.  A group's operations may name
 * several streams: it runs after every one's earlier work and their later
 * work waits for it (with NULL among them it blocks).  A group spans several
 * communicators only when all are CUDA ones (loomInvalidUsage otherwise);
 * one refused member launches nothing. */
LOOM_API loomResult_t loomGroupStart(void);
LOOM_API loomResult_t loomGroupEnd(void);

/* ---- Host streams ------------------------------------------------------ */

/* Creates a host stream: operations issued on it run one after another in
 * issue order on a worker thread. */
LOOM_API loomResult_t loomStreamCreate(loomStream_t* stream);

/* Waits for the stream's operations, then frees it.  NULL is a no-op; a
 * handle that is not a live loom stream (already destroyed, or foreign)
 * returns loomInvalidArgument.  No other thread may be using the stream. */
LOOM_API loomResult_t loomStreamDestroy(loomStream_t stream);

/* Waits until every operation issued on the stream has completed.  Returns
 * the first error any of them returned since the last synchronize. */
LOOM_API loomResult_t loomStreamSynchronize(loomStream_t stream);

/* loomSuccess if every operation on the stream has completed, loomInProgress
 * if some have not, or the error of a failed one. */
LOOM_API loomResult_t loomStreamQuery(loomStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_H_ */
