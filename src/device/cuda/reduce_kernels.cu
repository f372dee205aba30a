// The reduction and divide kernels of the CUDA device path, for every
// datatype and op.  The arithmetic is reduce_ops.h, the header the host
// kernels use, so a CUDA reduction gives the host's bits: sources combine
// left to right, float16/bfloat16 through float32 with one rounding per step.
//
// When the destination and every source are 16-byte aligned, each thread
// loads 16 bytes per source (one uint4) and combines 16/sizeof(element)
// elements; the tail that does not fill a vector, and unaligned buffers,
// take the one-element-per-thread kernel.  A second destination, when
// given, gets each element (or vector) right after the first: a thread reads
// every source's element before it writes either, so the second may be one
// of the sources exactly (an in-place caller's buffer); so may the first
// (one pass reads an element of every source before writing it).  Both are
// grid-stride loops over at most kMaxBlocks blocks of kThreads threads.
//
// Device zero-copy: a source may be read through a cell (Sources below),
// and copyBytes copies from one, since cudaMemcpyAsync cannot look up its
// source when it runs.
//
// Launches go through cudaLaunchKernel, whose return is that launch's own
// status: after <<<>>>, cudaGetLastError would also return an error an
// earlier runtime call of the thread left behind (the caller's
// cudaStreamQuery saying cudaErrorNotReady, a failed cudaMalloc), and a
// reduction would fail for it.
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "src/device/cuda/kernels.h"
#include "src/device/reduce_ops.h"

namespace loom {
namespace cuda {
namespace {

using namespace elementwise;

constexpr int kThreads = 256;
constexpr size_t kMaxBlocks = 1024;

// A launch's sources: p[k] directly, or, where cell[k] is not null, the
// buffer a peer published in that cell (+ off[k]) when it is published and
// holds the `bytes` the reduction reads (device zero-copy, CellRef in
// stream_program.h).  Every thread resolves them the same way when the
// kernel starts; the cells were written before the stream's waits let it.
template <class Ty>
struct Sources {
  const typename Ty::Store* p[kCudaMaxReduceSources];
  const uint64_t* cell[kCudaMaxReduceSources];
  size_t off[kCudaMaxReduceSources];
  const uint64_t* tag[kCudaMaxReduceSources];
  uint64_t minTag[kCudaMaxReduceSources];
  size_t bytes;
};

// A load that later loads cannot pass (the cells are written by another
// process's stream writes, each after a fence).
__device__ inline uint64_t loadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// The tag first, then the cell.  The owner rewrites a cell as addr = 0,
// bytes, addr (SetCell, stream_program.cc), so the same nonzero addr read
// before and after bytes means bytes is that buffer's: a reader released
// while the owner rewrites (mismatched calls, a failure) never pairs an
// old buffer with a new, larger size and reads past it.
__device__ inline const void* resolveSource(const void* direct, const uint64_t* cell, size_t off, const uint64_t* tag,
                                            uint64_t minTag, size_t bytes) {
  if (!cell || (tag && loadAcquire(tag) < minTag)) return direct;
  const uint64_t addr = loadAcquire(cell);
  const uint64_t len = loadAcquire(cell + 1);
  if (addr == 0 || loadAcquire(cell) != addr || off > len || bytes > len - off) return direct;
  return reinterpret_cast<const uint8_t*>(addr) + off;
}

// Thread 0 of each block resolves the sources once, the block's threads all
// take its answer (one set of reads per block instead of per thread, and no
// thread of a block reads another buffer than its neighbours).  Every
// thread of the block must call it, before any returns.  Loops over the
// sources run to kCudaMaxReduceSources with `k < nsrcs` inside, unrolled:
// every index is then a constant and the pointers stay in registers (a
// loop to nsrcs indexed them at run time, which put the whole Sources in
// local memory and reloaded a pointer from it for every element).
constexpr int kMaxSrc = kCudaMaxReduceSources;

template <class Ty>
__device__ inline void resolveAll(const Sources<Ty>& s, int nsrcs, const typename Ty::Store* (&p)[kMaxSrc]) {
  __shared__ const void* resolved[kMaxSrc];
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kMaxSrc; ++k)
      if (k < nsrcs) resolved[k] = resolveSource(s.p[k], s.cell[k], s.off[k], s.tag[k], s.minTag[k], s.bytes);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kMaxSrc; ++k) p[k] = k < nsrcs ? static_cast<const typename Ty::Store*>(resolved[k]) : nullptr;
}

// Elements [begin, n).
template <class Ty, class Op>
__global__ void reduceElements(typename Ty::Store* dst, typename Ty::Store* dst2, Sources<Ty> s, int nsrcs,
                               size_t begin, size_t n) {
  const typename Ty::Store* p[kMaxSrc];
  resolveAll(s, nsrcs, p);
  for (size_t i = begin + size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    typename Ty::Store acc = p[0][i];
#pragma unroll
    for (int k = 1; k < kMaxSrc; ++k)
      if (k < nsrcs) acc = reduce<Ty, Op>(acc, p[k][i]);
    dst[i] = acc;
    if (dst2) dst2[i] = acc;
  }
}

// Vectors [0, nvec) of 16 bytes.  A published source that turns out not
// to be 16-byte aligned makes the whole launch go element by element over
// the same range (resolveAll: a block's threads take the same pointers).
template <class Ty, class Op>
__global__ void reduceVectors(typename Ty::Store* dst, typename Ty::Store* dst2, Sources<Ty> s, int nsrcs,
                              size_t nvec) {
  using S = typename Ty::Store;
  constexpr int V = 16 / sizeof(S);
  union Pack {
    uint4 v;
    S e[V];
  };
  const S* p[kMaxSrc];
  resolveAll(s, nsrcs, p);
  bool aligned = true;
#pragma unroll
  for (int k = 0; k < kMaxSrc; ++k)
    if (k < nsrcs) aligned = aligned && (reinterpret_cast<uintptr_t>(p[k]) & 15) == 0;
  const size_t step = size_t(gridDim.x) * blockDim.x, first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!aligned) {
    for (size_t i = first; i < nvec * V; i += step) {
      S acc = p[0][i];
#pragma unroll
      for (int k = 1; k < kMaxSrc; ++k)
        if (k < nsrcs) acc = reduce<Ty, Op>(acc, p[k][i]);
      dst[i] = acc;
      if (dst2) dst2[i] = acc;
    }
    return;
  }
  for (size_t i = first; i < nvec; i += step) {
    Pack acc, in;
    acc.v = reinterpret_cast<const uint4*>(p[0])[i];
#pragma unroll
    for (int k = 1; k < kMaxSrc; ++k) {
      if (k < nsrcs) {
        in.v = reinterpret_cast<const uint4*>(p[k])[i];
#pragma unroll
        for (int j = 0; j < V; ++j) acc.e[j] = reduce<Ty, Op>(acc.e[j], in.e[j]);
      }
    }
    reinterpret_cast<uint4*>(dst)[i] = acc.v;
    if (dst2) reinterpret_cast<uint4*>(dst2)[i] = acc.v;
  }
}

// dst = the (resolved) source, `bytes` bytes, in the widest words both
// addresses allow once aligned alike: 16 bytes when they agree modulo 16,
// down to single bytes only when one is odd and the other even (a bfloat16
// view two bytes into a buffer copies 2 bytes at a time, not 1).
__global__ void copyBytes(uint8_t* dst, const uint8_t* src, const uint64_t* cell, size_t off, const uint64_t* tag,
                          uint64_t minTag, size_t bytes) {
  __shared__ const void* resolved;  // as resolveAll: once per block
  if (threadIdx.x == 0) resolved = resolveSource(src, cell, off, tag, minTag, bytes);
  __syncthreads();
  src = static_cast<const uint8_t*>(resolved);
  const size_t step = size_t(gridDim.x) * blockDim.x, first = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  copyShare<uint4>(dst, src, bytes, first, step);
}

template <class Ty>
__global__ void divideElements(typename Ty::Store* dst, const typename Ty::Store* src, size_t n,
                               typename Ty::Divisor q) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = divide<Ty>(src[i], q);
}

// k: *kp when kp is set (device memory, read as the kernel runs), else k.
template <class Ty>
__global__ void scaleElements(typename Ty::Store* dst, const typename Ty::Store* src, size_t n,
                              const typename Ty::Store* kp, typename Ty::Store k) {
  const typename Ty::Store by = kp ? *kp : k;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = scaleElement<Ty>(src[i], by);
}

unsigned blocksFor(size_t work) {
  size_t b = (work + kThreads - 1) / kThreads;
  return unsigned(b < kMaxBlocks ? b : kMaxBlocks);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Ty, class Op>
cudaError_t launchReduceTyped(void* dst, void* dst2, const void* const* srcs, const uint64_t* const* cells,
                              const size_t* offsets, const uint64_t* const* tags, const uint64_t* minTags, int nsrcs,
                              size_t n, cudaStream_t st) {
  using S = typename Ty::Store;
  constexpr size_t V = 16 / sizeof(S);
  Sources<Ty> s;
  s.bytes = n * sizeof(S);
  bool vec = aligned16(dst) && aligned16(dst2);
  for (int k = 0; k < nsrcs; ++k) {
    s.p[k] = static_cast<const S*>(srcs[k]);
    s.cell[k] = cells ? cells[k] : nullptr;
    s.off[k] = cells ? offsets[k] : 0;
    s.tag[k] = cells && tags ? tags[k] : nullptr;
    s.minTag[k] = cells && minTags ? minTags[k] : 0;
    // A published source's alignment is checked by the kernel (the
    // fallback's here: the one it reads otherwise).
    vec = vec && aligned16(srcs[k]);
  }
  for (int k = nsrcs; k < kCudaMaxReduceSources; ++k) {
    s.p[k] = nullptr;
    s.cell[k] = nullptr;
    s.off[k] = 0;
    s.tag[k] = nullptr;
    s.minTag[k] = 0;
  }
  S* d = static_cast<S*>(dst);
  S* d2 = static_cast<S*>(dst2);
  size_t nvec = vec ? n / V : 0;
  if (nvec) {
    void* args[] = {&d, &d2, &s, &nsrcs, &nvec};
    cudaError_t rc = cudaLaunchKernel(reinterpret_cast<const void*>(&reduceVectors<Ty, Op>), dim3(blocksFor(nvec)),
                                      dim3(kThreads), args, 0, st);
    if (rc != cudaSuccess) return rc;
  }
  size_t done = nvec * V;
  if (done < n) {
    void* args[] = {&d, &d2, &s, &nsrcs, &done, &n};
    return cudaLaunchKernel(reinterpret_cast<const void*>(&reduceElements<Ty, Op>), dim3(blocksFor(n - done)),
                            dim3(kThreads), args, 0, st);
  }
  return cudaSuccess;
}

template <class Ty>
cudaError_t launchReduceOp(void* dst, void* dst2, const void* const* srcs, const uint64_t* const* cells,
                           const size_t* offsets, const uint64_t* const* tags, const uint64_t* minTags, int nsrcs,
                           size_t n, int op, cudaStream_t st) {
  switch (op) {
    case loomSum: return launchReduceTyped<Ty, Sum>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, st);
    case loomProd: return launchReduceTyped<Ty, Prod>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, st);
    case loomMax: return launchReduceTyped<Ty, Max>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, st);
    case loomMin: return launchReduceTyped<Ty, Min>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, st);
    case loomAvg: return launchReduceTyped<Ty, Sum>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, st);  // divided at the end
  }
  return cudaErrorInvalidValue;
}

template <class Ty>
cudaError_t launchDivideTyped(void* dst, const void* src, size_t n, int divisor, cudaStream_t st) {
  using S = typename Ty::Store;
  if (divisor <= 1)  // as the host: dividing by one rank copies
    return dst == src ? cudaSuccess : cudaMemcpyAsync(dst, src, n * sizeof(S), cudaMemcpyDefault, st);
  S* d = static_cast<S*>(dst);
  const S* from = static_cast<const S*>(src);
  typename Ty::Divisor q(divisor);
  void* args[] = {&d, &from, &n, &q};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&divideElements<Ty>), dim3(blocksFor(n)), dim3(kThreads),
                          args, 0, st);
}

template <class Ty>
cudaError_t launchScaleTyped(void* dst, const void* src, size_t n, const void* scalar, int onDevice, cudaStream_t st) {
  using S = typename Ty::Store;
  S* d = static_cast<S*>(dst);
  const S* from = static_cast<const S*>(src);
  const S* kp = onDevice ? static_cast<const S*>(scalar) : nullptr;
  S k{};
  if (!onDevice) memcpy(&k, scalar, sizeof k);
  void* args[] = {&d, &from, &n, &kp, &k};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&scaleElements<Ty>), dim3(blocksFor(n)), dim3(kThreads),
                          args, 0, st);
}


}  // namespace

int launchReduceIndirect(void* dst, void* dst2, const void* const* srcs, const uint64_t* const* cells,
                         const size_t* offsets, const uint64_t* const* tags, const uint64_t* minTags, int nsrcs,
                         size_t n, int dtype, int op, void* stream) {
  if (nsrcs < 1 || nsrcs > kCudaMaxReduceSources) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return int(withElem(
      dtype,
      [&](auto ty) {
        return launchReduceOp<decltype(ty)>(dst, dst2, srcs, cells, offsets, tags, minTags, nsrcs, n, op, st);
      },
      cudaErrorInvalidValue));
}

int launchReduce(void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t n, int dtype, int op,
                 void* stream) {
  return launchReduceIndirect(dst, dst2, srcs, nullptr, nullptr, nullptr, nullptr, nsrcs, n, dtype, op, stream);
}

int launchCopyIndirect(void* dst, const void* src, const uint64_t* cell, size_t offset, const uint64_t* tag,
                       uint64_t minTag, size_t bytes, void* stream) {
  if (bytes == 0) return 0;
  uint8_t* d = static_cast<uint8_t*>(dst);
  const uint8_t* from = static_cast<const uint8_t*>(src);
  void* args[] = {&d, &from, &cell, &offset, &tag, &minTag, &bytes};
  return int(cudaLaunchKernel(reinterpret_cast<const void*>(&copyBytes), dim3(blocksFor((bytes + 15) / 16)),
                              dim3(kThreads), args, 0, static_cast<cudaStream_t>(stream)));
}

namespace {
template <class Ty, class Op>
cudaError_t loadReduce() {
  cudaFuncAttributes a;
  cudaError_t rc = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&reduceElements<Ty, Op>));
  if (rc == cudaSuccess) rc = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&reduceVectors<Ty, Op>));
  return rc;
}

template <class Ty>
cudaError_t loadType() {
  cudaFuncAttributes a;
  for (cudaError_t rc : {loadReduce<Ty, Sum>(), loadReduce<Ty, Prod>(), loadReduce<Ty, Max>(), loadReduce<Ty, Min>(),
                         cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&divideElements<Ty>)),
                         cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&scaleElements<Ty>))})
    if (rc != cudaSuccess) return rc;
  return cudaSuccess;
}
}  // namespace

int loadKernels() {
  cudaFuncAttributes a;
  if (cudaError_t rc = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(&copyBytes))) return int(rc);
  for (int t : {loomInt8, loomUint8, loomInt32, loomUint32, loomInt64, loomUint64, loomFloat16, loomBfloat16,
                loomFloat32, loomFloat64}) {
    cudaError_t rc = withElem(t, [](auto ty) { return loadType<decltype(ty)>(); }, cudaErrorInvalidValue);
    if (rc != cudaSuccess) return int(rc);
  }
  return 0;
}

int launchDivide(void* dst, const void* src, size_t n, int dtype, int divisor, void* stream) {
  if (n == 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return int(withElem(
      dtype, [&](auto ty) { return launchDivideTyped<decltype(ty)>(dst, src, n, divisor, st); },
      cudaErrorInvalidValue));
}

int launchScale(void* dst, const void* src, size_t n, int dtype, const void* scalar, int scalarOnDevice, void* stream) {
  if (n == 0) return 0;
  if (!scalar) return int(cudaErrorInvalidValue);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return int(withElem(
      dtype, [&](auto ty) { return launchScaleTyped<decltype(ty)>(dst, src, n, scalar, scalarOnDevice, st); },
      cudaErrorInvalidValue));
}

}  // namespace cuda
}  // namespace loom
