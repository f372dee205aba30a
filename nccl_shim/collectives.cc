// NCCL's collectives and point-to-point calls on loom's.
//
// NCCL's datatypes int8..bfloat16 and ops sum..avg have loom's numbering and
// pass through.  float8 (e4m3, e5m2) moves as bytes (uint8) where nothing is
// reduced and is refused where it would be.  A PreMulSum operator is loom's
// sum over a scaled copy of the input (loomScale): on a host communicator a
// host copy made when the operation is issued, on a CUDA one device scratch
// scaled on the caller's stream just before the sum (premulsum.cc).
//
// On a CUDA communicator the caller's cudaStream_t is loom's stream: each
// call is enqueued on it and returns, as NCCL's do.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "nccl_shim/shim.h"

using namespace nccl_shim;

namespace {

// How a reducing call reaches loom.
struct Reduction {
  loomRedOp_t op = loomSum;
  bool preMul = false;
  // A PreMulSum all-reduce on a stream being captured: the scaled copy goes
  // to recvbuff and the sum runs in place there (no scratch, which would be
  // allocated during the capture or shared with calls outside it).
  bool scaleIntoRecv = false;
  ncclComm::PreMulSum pms{};

  // The input loom sums: sendbuff, or for a PreMulSum its scaled copy (on a
  // host communicator in hostScratch, scaled now; on a CUDA one in the
  // communicator's device scratch for stream s, scaled on s).
  loomResult_t input(ncclComm* comm, const void* sendbuff, size_t count, loomStream_t s,
                     std::vector<char>* hostScratch, const void** out) const {
    *out = sendbuff;
    if (!preMul || count == 0) return loomSuccess;
    const size_t bytes = count * typeSize(pms.type);
    const loomDataType_t t = loomDataType_t(pms.type);
    if (!comm->cuda()) {
      hostScratch->resize(bytes);
      const void* scalar = pms.residence == ncclScalarDevice ? pms.scalarPtr : pms.scalarBytes;
      *out = hostScratch->data();
      return loomScale(hostScratch->data(), sendbuff, count, t, scalar, 0, comm->loom, nullptr);
    }
    void* scratch = nullptr;
    if (loomResult_t r = deviceScratch(comm, s, bytes, &scratch)) return r;
    *out = scratch;
    const bool onDevice = pms.residence == ncclScalarDevice;
    return loomScale(scratch, sendbuff, count, t, onDevice ? pms.scalarPtr : pms.scalarBytes, onDevice ? 1 : 0,
                     comm->loom, s);
  }
};

// A reducing call's input as loom reads it: sendbuff, or a PreMulSum's
// scaled copy, made by `prepare` before the launch issues anything
// (PendingOp::prepare) and held until the call is done.
struct Scaled {
  const void* sendbuff = nullptr;
  std::shared_ptr<const void*> in;  // a PreMulSum's copy, once prepared (nothing allocated otherwise)
  std::shared_ptr<std::vector<char>> hostScratch;
  std::function<loomResult_t(loomStream_t)> prepare;
  const void* input() const { return in ? *in : sendbuff; }
};

Scaled scaled(const Reduction& red, ncclComm* comm, const void* sendbuff, size_t count) {
  Scaled sc;
  sc.sendbuff = sendbuff;
  if (!red.preMul) return sc;
  sc.in = std::make_shared<const void*>(sendbuff);
  sc.hostScratch = std::make_shared<std::vector<char>>();
  auto in = sc.in;
  auto host = sc.hostScratch;
  sc.prepare = [red, comm, sendbuff, count, in, host](loomStream_t s) {
    return red.input(comm, sendbuff, count, s, host.get(), in.get());
  };
  return sc;
}

ncclResult_t prologue(const char* call, ncclComm_t comm, cudaStream_t stream) {
  ensureEnv();
  clearLastError();
  if (ncclResult_t r = checkComm(call, comm)) return r;
  return checkStream(call, comm, stream);
}

// The op and type of a reducing call.  The PreMulSum is copied: NCCL lets
// the operator be destroyed as soon as the call that uses it returns.
ncclResult_t reduction(const char* call, ncclComm_t comm, ncclDataType_t type, ncclRedOp_t op,
                       const void* sendbuff, size_t inCount, cudaStream_t stream, Reduction* out,
                       bool allReduce = false) {
  int t = int(type), o = int(op);
  if (t == ncclFloat8e4m3 || t == ncclFloat8e5m2)
    return fail(ncclInvalidUsage,
                "%s: loom cannot reduce float8 (%s); it reduces int8..int64, float16, bfloat16, "
                "float32 and float64",
                call, t == ncclFloat8e4m3 ? "e4m3" : "e5m2");
  if (t < 0 || t >= int(loomNumTypes)) return fail(ncclInvalidArgument, "%s: unknown datatype %d", call, t);
  if (o >= 0 && o < int(ncclNumOps)) {
    out->op = loomRedOp_t(o);
    return ncclSuccess;
  }
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    auto it = comm->preMulSums.find(o);
    if (it == comm->preMulSums.end())
      return fail(ncclInvalidArgument,
                  "%s: unknown reduction op %d (not built in, not a PreMulSum of this comm)", call, o);
    out->pms = it->second;
  }
  if (out->pms.type != type)
    return fail(ncclInvalidArgument, "%s: the PreMulSum op %d was made for datatype %d, not %d", call, o,
                int(out->pms.type), t);
  if (inCount > SIZE_MAX / 16) return fail(ncclInvalidArgument, "%s: count %zu is too large", call, inCount);
  if (inCount && !sendbuff) return fail(ncclInvalidArgument, "%s: sendbuff is NULL", call);
  int capturing = 0;
  if (comm->cuda() && loomCudaStreamCapturing(stream, &capturing) == loomSuccess && capturing) {
    if (!allReduce)
      return fail(ncclInvalidUsage,
                  "%s: a PreMulSum on a stream being captured into a CUDA graph is supported for ncclAllReduce "
                  "only: this call's scaled copy needs device scratch that would be allocated during the capture "
                  "(which invalidates it) or shared with calls outside it; issue it outside the capture, or sum and "
                  "scale apart",
                  call);
    // Refused before its scaled copy is captured where the sum would be.
    int capturable = 0;
    if (loomCommCanCapture(comm->loom, &capturable) != loomSuccess || !capturable)
      return fail(ncclInvalidUsage,
                  "%s: stream %p is being captured into a CUDA graph, but this communicator cannot capture calls "
                  "(the staged or hierarchical path, or LOOM_DEVICE_GRAPH_SLOT_BYTES=0): issue it outside the "
                  "capture",
                  call, static_cast<void*>(stream));
    out->scaleIntoRecv = true;
  }
  out->op = loomSum;
  out->preMul = true;
  return ncclSuccess;
}

}  // namespace

NCCL_SHIM_API(ncclResult_t, ncclAllReduce, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclAllReduce";
  Reduction red;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, count, stream, &red, true)) return r;
  loomComm_t lc = comm->loom;
  if (red.scaleIntoRecv) {
    if (count && !recvbuff) return fail(ncclInvalidArgument, "%s: recvbuff is NULL", call);
    const ncclComm::PreMulSum pms = red.pms;
    const bool onDevice = pms.residence == ncclScalarDevice;
    return submit(
        comm, call, stream,
        [=](loomStream_t s) { return loomAllReduce(recvbuff, recvbuff, count, loomDataType_t(datatype), loomSum, lc, s); },
        [=](loomStream_t s) {
          return count == 0 ? loomSuccess
                            : loomScale(recvbuff, sendbuff, count, loomDataType_t(datatype),
                                        onDevice ? pms.scalarPtr : pms.scalarBytes, onDevice ? 1 : 0, lc, s);
        });
  }
  Scaled in = scaled(red, comm, sendbuff, count);
  return submit(
      comm, call, stream,
      [=](loomStream_t s) { return loomAllReduce(in.input(), recvbuff, count, loomDataType_t(datatype), red.op, lc, s); },
      in.prepare);
}

NCCL_SHIM_API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclReduce";
  Reduction red;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, count, stream, &red)) return r;
  Scaled in = scaled(red, comm, sendbuff, count);
  loomComm_t lc = comm->loom;
  return submit(
      comm, call, stream,
      [=](loomStream_t s) {
        return loomReduce(in.input(), recvbuff, count, loomDataType_t(datatype), red.op, root, lc, s);
      },
      in.prepare);
}

NCCL_SHIM_API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
              ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclReduceScatter";
  Reduction red;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  size_t inCount = recvcount * size_t(comm->nranks);
  if (comm->nranks && inCount / size_t(comm->nranks) != recvcount)
    return fail(ncclInvalidArgument, "%s: recvcount %zu is too large", call, recvcount);
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, inCount, stream, &red)) return r;
  Scaled in = scaled(red, comm, sendbuff, inCount);
  loomComm_t lc = comm->loom;
  // A scaled copy is never in place: loom then reads all of it.
  return submit(
      comm, call, stream,
      [=](loomStream_t s) {
        return loomReduceScatter(in.input(), recvbuff, recvcount, loomDataType_t(datatype), red.op, lc, s);
      },
      in.prepare);
}

NCCL_SHIM_API(ncclResult_t, ncclBroadcast, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclBroadcast";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomBroadcast(sendbuff, recvbuff, count, t, root, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclBcast, void* buff, size_t count, ncclDataType_t datatype, int root,
              ncclComm_t comm, cudaStream_t stream) {
  return pncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}

NCCL_SHIM_API(ncclResult_t, ncclAllGather, const void* sendbuff, void* recvbuff, size_t sendcount,
              ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclAllGather";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomAllGather(sendbuff, recvbuff, sendcount, t, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclAlltoAll, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclAlltoAll";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomAllToAll(sendbuff, recvbuff, count, t, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclGather, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclGather";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  if (root < 0 || root >= comm->nranks)
    return fail(ncclInvalidArgument, "%s: root %d is out of range [0, %d)", call, root, comm->nranks);
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomGather(sendbuff, recvbuff, count, t, root, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclScatter, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclScatter";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  if (root < 0 || root >= comm->nranks)
    return fail(ncclInvalidArgument, "%s: root %d is out of range [0, %d)", call, root, comm->nranks);
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomScatter(sendbuff, recvbuff, count, t, root, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclSend, const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
              ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclSend";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomSend(sendbuff, count, t, peer, lc, s); });
}

NCCL_SHIM_API(ncclResult_t, ncclRecv, void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
              ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclRecv";
  loomDataType_t t;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = moveType(call, datatype, &t)) return r;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream,
                [=](loomStream_t s) { return loomRecv(recvbuff, count, t, peer, lc, s); });
}
