// ncclRedOpCreatePreMulSum: each rank scales its input by its scalar, then
// the scaled inputs are summed (loomSum).  The scaling is loom's (loomScale:
// one step of loomProd, so integers wrap and float16/bfloat16 multiply in
// float32 and round once), into a copy: on a host communicator a host copy
// made when the operation is issued; on a CUDA one device scratch of the
// communicator's, scaled on the caller's stream just before the sum
// (collectives.cc).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "nccl_shim/shim.h"

namespace nccl_shim {
namespace {

std::atomic<uint64_t> gLaunches{0};
thread_local uint64_t tlsLaunch = 0;

}  // namespace

void beginLaunch() { tlsLaunch = gLaunches.fetch_add(1, std::memory_order_relaxed) + 1; }

loomResult_t deviceScratch(ncclComm* comm, loomStream_t stream, size_t bytes, void** out) {
  const size_t need = (bytes + 255) / 256 * 256;
  std::lock_guard<std::mutex> lock(comm->mu);
  ncclComm::Scratch* a = nullptr;
  for (ncclComm::Scratch& s : comm->scratch)
    if (s.stream == stream) a = &s;
  if (!a) {
    comm->scratch.push_back(ncclComm::Scratch{});
    a = &comm->scratch.back();
    a->stream = stream;
  }
  if (a->launch != tlsLaunch) a->launch = tlsLaunch, a->used = 0;  // earlier launches' work is ahead on the stream
  if (a->used + need > a->bytes) {
    // Outgrown: a fresh arena; the old one may hold this launch's earlier
    // regions, and work in flight may read it, so it stays until the end.
    const size_t grown = std::max(a->used + need, 2 * a->bytes);
    void* p = nullptr;
    if (loomResult_t r = loomCommMemAlloc(comm->loom, &p, grown)) return r;  // on the communicator's device
    if (a->base) comm->retiredScratch.push_back(a->base);
    a->base = p, a->bytes = grown, a->used = 0;
    logf(Level::Info, "PreMulSum: %zu B of device scratch for stream %p", grown, static_cast<void*>(stream));
  }
  *out = static_cast<char*>(a->base) + a->used;
  a->used += need;
  return loomSuccess;
}

void freeScratch(ncclComm* comm, bool leave) {
  std::vector<void*> all = comm->retiredScratch;
  for (const ncclComm::Scratch& s : comm->scratch)
    if (s.base) all.push_back(s.base);
  comm->scratch.clear();
  comm->retiredScratch.clear();
  // An aborted communicator's scratch waits for the next destroy of any
  // communicator (abort, then init again, is how elastic jobs recover), so
  // at most one generation of it stays allocated.
  static std::mutex abandonedMu;
  static auto* abandoned = new std::vector<void*>();  // leaked: used at exit
  std::lock_guard<std::mutex> lock(abandonedMu);
  if (leave) {
    if (!all.empty())
      logf(Level::Info,
           "ncclCommAbort: rank %d's PreMulSum scratch (%zu allocation%s) is freed at the next "
           "ncclCommDestroy: freeing it now would wait for the device",
           comm->rank, all.size(), all.size() == 1 ? "" : "s");
    abandoned->insert(abandoned->end(), all.begin(), all.end());
    return;
  }
  all.insert(all.end(), abandoned->begin(), abandoned->end());
  abandoned->clear();
  for (void* p : all) loomMemFree(p);
}

}  // namespace nccl_shim

using namespace nccl_shim;

NCCL_SHIM_API(ncclResult_t, ncclRedOpCreatePreMulSum, ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
              ncclScalarResidence_t residence, ncclComm_t comm) {
  const char* call = "ncclRedOpCreatePreMulSum";
  ensureEnv();
  if (ncclResult_t r = checkComm(call, comm)) return r;
  if (!op || !scalar) return fail(ncclInvalidArgument, "%s: op or scalar is NULL", call);
  int t = int(datatype);
  if (t == ncclFloat8e4m3 || t == ncclFloat8e5m2)
    return fail(ncclInvalidUsage, "%s: loom cannot reduce float8", call);
  if (t < 0 || t >= int(loomNumTypes)) return fail(ncclInvalidArgument, "%s: unknown datatype %d", call, t);
  if (residence != ncclScalarDevice && residence != ncclScalarHostImmediate)
    return fail(ncclInvalidArgument, "%s: unknown scalar residence %d", call, int(residence));
  ncclComm::PreMulSum p{};
  p.type = datatype;
  p.residence = residence;
  // ncclScalarDevice: on a CUDA communicator device memory of its device,
  // read when the scaling runs on the stream; on a host one host memory,
  // read each time an operation using the op is issued.  Host immediate:
  // copied now (the pointer may be NULL'd or freed after this call).
  p.scalarPtr = scalar;
  if (residence == ncclScalarHostImmediate || !comm->cuda()) memcpy(p.scalarBytes, scalar, typeSize(datatype));
  std::lock_guard<std::mutex> lock(comm->mu);
  if (comm->nextOp == int(ncclMaxRedOp)) return fail(ncclInvalidUsage, "%s: no reduction op ids left", call);
  int id = comm->nextOp++;
  comm->preMulSums[id] = p;
  *op = ncclRedOp_t(id);
  return ncclSuccess;
}

NCCL_SHIM_API(ncclResult_t, ncclRedOpDestroy, ncclRedOp_t op, ncclComm_t comm) {
  ensureEnv();
  if (!comm) return fail(ncclInvalidArgument, "ncclRedOpDestroy: comm is NULL");
  std::lock_guard<std::mutex> lock(comm->mu);
  if (!comm->preMulSums.erase(int(op)))
    return fail(ncclInvalidArgument, "ncclRedOpDestroy: op %d is not a PreMulSum of this communicator",
                int(op));
  return ncclSuccess;
}
