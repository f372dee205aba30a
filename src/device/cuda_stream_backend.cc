// CudaStreamBackend: program ops -> CUDA calls (cuda_stream_backend.h).
#include "src/device/cuda_stream_backend.h"

#include <algorithm>

#include "src/core/error.h"

namespace loom {

void* CudaStreamBackend::stream(int s) const {
  if (s < 0 || size_t(s) >= streams_.size()) fail(loomInternalError, "CUDA backend has no stream %d", s);
  return streams_[size_t(s)];
}

void* CudaStreamBackend::event(int e) const {
  if (e < 0 || size_t(e) >= events_.size()) fail(loomInternalError, "CUDA backend has no event %d", e);
  return events_[size_t(e)];
}

void CudaStreamBackend::check(int rc, const char* call) const {
  if (rc != 0) fail(loomUnhandledCudaError, "%s failed: %s (CUDA error %d)", call, api_.errorString(rc), rc);
}

void CudaStreamBackend::waitFlag(int s, const uint64_t* flag, uint64_t value, int ownerRank) {
  (void)ownerRank;
  check(api_.waitValue64(stream(s), flag, value), "cuStreamWaitValue64");
}

void CudaStreamBackend::setFlag(int s, uint64_t* flag, uint64_t value) {
  check(api_.writeValue64(stream(s), flag, value), "cuStreamWriteValue64");
}

void CudaStreamBackend::setFlags(int s, uint64_t* const* flags, size_t n, uint64_t value) {
  if (!api_.writeValues64) {
    StreamBackend::setFlags(s, flags, n, value);
    return;
  }
  check(api_.writeValues64(stream(s), flags, int(n), value), "cuStreamBatchMemOp");
}

void CudaStreamBackend::copy(int s, void* dst, const void* src, size_t bytes) {
  check(api_.memcpyAsync(dst, src, bytes, stream(s)), "cudaMemcpyAsync");
}

void CudaStreamBackend::reduce(int s, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count,
                               loomDataType_t type, loomRedOp_t op) {
  reduceIndirect(s, dst, dst2, srcs, nullptr, nsrcs, count, type, op);
}

void CudaStreamBackend::reduceIndirect(int s, void* dst, void* dst2, const void* const* srcs, const CellRef* cells,
                                       int nsrcs, size_t count, loomDataType_t type, loomRedOp_t op) {
  static_assert(kOnePassSources <= size_t(kCudaMaxReduceSources), "a one-pass reduction must fit one launch");
  if (nsrcs < 1) fail(loomInternalError, "CUDA reduce with %d sources", nsrcs);
  // First launch: up to kCudaMaxReduceSources sources; each next one takes
  // dst (the partial result so far) and kCudaMaxReduceSources - 1 more.
  // Only the last launch writes dst2, which may be one of the sources.
  const void* chain[kCudaMaxReduceSources];
  const uint64_t* cellOf[kCudaMaxReduceSources];
  size_t offsetOf[kCudaMaxReduceSources];
  const uint64_t* tagOf[kCudaMaxReduceSources];
  uint64_t minTagOf[kCudaMaxReduceSources];
  auto launch = [&](const void* const* in, int n, bool last) {
    const bool indirect = cells != nullptr;
    check(indirect ? api_.launchReduceIndirect(dst, last ? dst2 : nullptr, in, cellOf, offsetOf, tagOf, minTagOf, n,
                                               count, int(type), int(op), stream(s))
                   : api_.launchReduce(dst, last ? dst2 : nullptr, in, n, count, int(type), int(op), stream(s)),
          "reduction kernel launch");
  };
  int used = std::min(nsrcs, kCudaMaxReduceSources);
  auto take = [&](int at, int i) {  // launch source `at` is program source i (-1: the chain's partial result)
    const bool c = cells && i >= 0;
    cellOf[at] = c ? cells[i].cell : nullptr;
    offsetOf[at] = c ? cells[i].offset : 0;
    tagOf[at] = c ? cells[i].tag : nullptr;
    minTagOf[at] = c ? cells[i].minTag : 0;
  };
  for (int i = 0; i < used; ++i) take(i, i);
  launch(srcs, used, used == nsrcs);
  while (used < nsrcs) {
    int more = std::min(nsrcs - used, kCudaMaxReduceSources - 1);
    chain[0] = dst;
    take(0, -1);
    for (int i = 0; i < more; ++i) {
      chain[i + 1] = srcs[used + i];
      take(i + 1, used + i);
    }
    used += more;
    launch(chain, more + 1, used == nsrcs);
  }
}

void CudaStreamBackend::copyIndirect(int s, void* dst, const void* src, CellRef cell, size_t bytes) {
  check(api_.launchCopyIndirect(dst, src, cell.cell, cell.offset, cell.tag, cell.minTag, bytes, stream(s)),
        "copy kernel launch");
}

void CudaStreamBackend::divide(int s, void* dst, const void* src, size_t count, loomDataType_t type,
                               int divisor) {
  check(api_.launchDivide(dst, src, count, int(type), divisor, stream(s)), "divide kernel launch");
}

void CudaStreamBackend::recordEvent(int s, int e) {
  check(api_.eventRecord(event(e), stream(s)), "cudaEventRecord");
}

void CudaStreamBackend::waitEvent(int s, int e) {
  check(api_.streamWaitEvent(stream(s), event(e)), "cudaStreamWaitEvent");
}

}  // namespace loom
