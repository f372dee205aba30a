// Stream programs on a CUDA device: each program op becomes one CUDA call
// through the plug-in's table (cuda_api.h).  Program stream 0 is the
// caller's cudaStream_t; streams 1.. are the communicator's side streams.
#pragma once
#include <vector>

#include "src/device/cuda_api.h"
#include "src/device/stream_program.h"

namespace loom {

class CudaStreamBackend final : public StreamBackend {
 public:
  // streams[0]: the caller's stream; events: one cudaEvent_t per program event.
  // The plug-in's kernels must be loaded on the device first
  // (CudaApi::loadKernels; a communicator's init does it).
  CudaStreamBackend(const CudaApi& api, std::vector<void*> streams, std::vector<void*> events)
      : api_(api), streams_(std::move(streams)), events_(std::move(events)) {}

  void waitFlag(int stream, const uint64_t* flag, uint64_t value, int ownerRank) override;
  void setFlag(int stream, uint64_t* flag, uint64_t value) override;
  // One writeValues64 (cuStreamBatchMemOp) when the table has it.
  void setFlags(int stream, uint64_t* const* flags, size_t n, uint64_t value) override;
  void copy(int stream, void* dst, const void* src, size_t bytes) override;
  // More than kCudaMaxReduceSources sources: chained launches that keep the
  // left-to-right order (dst = dst op next sources).
  void reduce(int stream, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, loomDataType_t type,
              loomRedOp_t op) override;
  void divide(int stream, void* dst, const void* src, size_t count, loomDataType_t type,
              int divisor) override;
  void recordEvent(int stream, int event) override;
  void waitEvent(int stream, int event) override;
  // A kernel copy (launchCopyIndirect), and reduce() through
  // launchReduceIndirect (a chain's partial result is read directly).
  void copyIndirect(int stream, void* dst, const void* src, CellRef cell, size_t bytes) override;
  void reduceIndirect(int stream, void* dst, void* dst2, const void* const* srcs, const CellRef* cells, int nsrcs,
                      size_t count, loomDataType_t type, loomRedOp_t op) override;

 private:
  void* stream(int s) const;
  void* event(int e) const;
  // loomUnhandledCudaError with CUDA's message unless rc == 0.
  void check(int rc, const char* call) const;

  const CudaApi& api_;
  std::vector<void*> streams_;
  std::vector<void*> events_;
};

}  // namespace loom
