// Compiled (not run) by the ctest "cuda: tests/cuda/reduce_ops_check.cu
// compiles for sm ...": the element-wise arithmetic the host kernels use, instantiated
// in device code for every loom datatype and op, including avg's division.
#include "src/device/reduce_ops.h"

namespace {

using namespace loom::elementwise;

template <int Type, int Op>
__global__ void reduceKernel(void* dst, const void* a, const void* b, size_t n, int divisor) {
  using Ty = typename ElemOf<Type>::type;
  using S = typename Ty::Store;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  S r = reduce<Ty, typename OpOf<Op>::type>(static_cast<const S*>(a)[i], static_cast<const S*>(b)[i]);
  if (Op == loomAvg) r = divide<Ty>(r, typename Ty::Divisor(divisor));
  static_cast<S*>(dst)[i] = r;
}

template <int Type>
void instantiateOps() {
  (void)&reduceKernel<Type, loomSum>;
  (void)&reduceKernel<Type, loomProd>;
  (void)&reduceKernel<Type, loomMax>;
  (void)&reduceKernel<Type, loomMin>;
  (void)&reduceKernel<Type, loomAvg>;
}

}  // namespace

void loomReduceOpsCudaCheck() {
  instantiateOps<loomInt8>();
  instantiateOps<loomUint8>();
  instantiateOps<loomInt32>();
  instantiateOps<loomUint32>();
  instantiateOps<loomInt64>();
  instantiateOps<loomUint64>();
  instantiateOps<loomFloat16>();
  instantiateOps<loomFloat32>();
  instantiateOps<loomFloat64>();
  instantiateOps<loomBfloat16>();
}
