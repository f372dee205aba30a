// Launchers of the CUDA kernels (reduce_kernels.cu); semantics as
// CudaApi::launchReduce and CudaApi::launchDivide (src/device/cuda_api.h).
#pragma once
#include <stddef.h>

#include "src/device/cuda_api.h"

namespace loom {
namespace cuda {

int launchReduce(void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count, int dtype, int op, void* stream);
int launchReduceIndirect(void* dst, void* dst2, const void* const* srcs, const uint64_t* const* cells,
                         const size_t* offsets, const uint64_t* const* tags, const uint64_t* minTags, int nsrcs,
                         size_t count, int dtype, int op, void* stream);
int launchCopyIndirect(void* dst, const void* src, const uint64_t* cell, size_t offset, const uint64_t* tag,
                       uint64_t minTag, size_t bytes, void* stream);
int launchDivide(void* dst, const void* src, size_t count, int dtype, int divisor, void* stream);
int launchScale(void* dst, const void* src, size_t count, int dtype, const void* scalar, int scalarOnDevice,
                void* stream);
// cudaFuncGetAttributes on every kernel of reduce_kernels.cu: loads them
// into the current context now (CudaApi::loadKernels).
int loadKernels();

}  // namespace cuda
}  // namespace loom
