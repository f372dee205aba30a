// NCCL's collectives and point-to-point calls on loom's.
//
// NCCL's datatypes int8..bfloat16 and ops sum..avg have loom's numbering and
// pass through.  float8 (e4m3, e5m2) moves as bytes (uint8) where nothing is
// reduced and is refused where it would be.  A PreMulSum operator is loom's
// sum over a scaled copy of the input, made when the operation is issued
// (host communicators only: the copy is made on the host).
//
// On a CUDA communicator the caller's cudaStream_t is loom's stream: each
// call is enqueued on it and returns, as NCCL's do.
#include <cstdint>
#include <memory>
#include <vector>

#include "nccl_shim/shim.h"

using namespace nccl_shim;

namespace {

// How a reducing call reaches loom.
struct Reduction {
  loomRedOp_t op = loomSum;
  bool preMul = false;
  ncclComm::PreMulSum pms{};

  // sendbuff, or for a PreMulSum its scaled copy in scratch.
  const void* input(const void* sendbuff, size_t count, std::vector<char>* scratch) const {
    if (!preMul) return sendbuff;
    scratch->resize(count * typeSize(pms.type) + 1);
    const void* scalar = pms.residence == ncclScalarDevice ? pms.scalarPtr : pms.scalarBytes;
    scaleInto(scratch->data(), sendbuff, count, pms.type, scalar);
    return scratch->data();
  }
};

ncclResult_t prologue(const char* call, ncclComm_t comm, cudaStream_t stream) {
  ensureEnv();
  clearLastError();
  if (ncclResult_t r = checkComm(call, comm)) return r;
  return checkStream(call, comm, stream);
}

// The op and type of a reducing call.  The PreMulSum is copied: NCCL lets
// the operator be destroyed as soon as the call that uses it returns.
ncclResult_t reduction(const char* call, ncclComm_t comm, ncclDataType_t type, ncclRedOp_t op,
                       const void* sendbuff, size_t inCount, Reduction* out) {
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
  if (comm->cuda())  // never made on one (ncclRedOpCreatePreMulSum): the host must not read device buffers
    return fail(ncclInvalidUsage, "%s: PreMulSum op %d on a CUDA communicator", call, o);
  if (out->pms.type != type)
    return fail(ncclInvalidArgument, "%s: the PreMulSum op %d was made for datatype %d, not %d", call, o,
                int(out->pms.type), t);
  if (inCount > SIZE_MAX / 16) return fail(ncclInvalidArgument, "%s: count %zu is too large", call, inCount);
  if (inCount && !sendbuff) return fail(ncclInvalidArgument, "%s: sendbuff is NULL", call);
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
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, count, &red)) return r;
  auto scratch = red.preMul ? std::make_shared<std::vector<char>>() : nullptr;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream, [=](loomStream_t s) {
    return loomAllReduce(red.input(sendbuff, count, scratch.get()), recvbuff, count, loomDataType_t(datatype),
                         red.op, lc, s);
  });
}

NCCL_SHIM_API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count,
              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclReduce";
  Reduction red;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, count, &red)) return r;
  auto scratch = red.preMul ? std::make_shared<std::vector<char>>() : nullptr;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream, [=](loomStream_t s) {
    return loomReduce(red.input(sendbuff, count, scratch.get()), recvbuff, count, loomDataType_t(datatype),
                      red.op, root, lc, s);
  });
}

NCCL_SHIM_API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
              ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const char* call = "ncclReduceScatter";
  Reduction red;
  if (ncclResult_t r = prologue(call, comm, stream)) return r;
  size_t inCount = recvcount * size_t(comm->nranks);
  if (comm->nranks && inCount / size_t(comm->nranks) != recvcount)
    return fail(ncclInvalidArgument, "%s: recvcount %zu is too large", call, recvcount);
  if (ncclResult_t r = reduction(call, comm, datatype, op, sendbuff, inCount, &red)) return r;
  auto scratch = red.preMul ? std::make_shared<std::vector<char>>() : nullptr;
  loomComm_t lc = comm->loom;
  return submit(comm, call, stream, [=](loomStream_t s) {
    // A scaled copy is never in place: loom then reads all of it.
    return loomReduceScatter(red.input(sendbuff, inCount, scratch.get()), recvbuff, recvcount,
                             loomDataType_t(datatype), red.op, lc, s);
  });
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
