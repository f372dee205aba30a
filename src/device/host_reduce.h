// Host reduction kernels: elementwise a op b for every loom datatype and op.
#pragma once
#include <cstddef>
#include <cstdint>
#include "loom.h"

namespace loom {

// Bytes per element of a datatype; 0 for an unknown type.  Inline: every
// operation asks, on the latency path too.
inline size_t dtypeSize(loomDataType_t type) {
  switch (type) {
    case loomInt8:
    case loomUint8: return 1;
    case loomFloat16:
    case loomBfloat16: return 2;
    case loomInt32:
    case loomUint32:
    case loomFloat32: return 4;
    case loomInt64:
    case loomUint64:
    case loomFloat64: return 8;
    default: return 0;
  }
}
const char* dtypeName(loomDataType_t type);  // "float32", ...; "?" if unknown
const char* redOpName(loomRedOp_t op);       // "sum", ...; "?" if unknown

// dst[i] = a[i] op b[i] for i < n.  dst may alias a or b (exactly, not
// partially).  loomAvg reduces as loomSum (see finalizeAvg).  float16 and
// bfloat16 are converted to float32, combined, and rounded back once
// (round to nearest even).  Integer sum/prod wrap (two's complement).
void reduceHost(void* dst, const void* a, const void* b, size_t n, loomDataType_t type,
                loomRedOp_t op);

// A pairwise reduction: dst[i] = a[i] op b[i] for i < n.
using HostReduceFn = void (*)(void* dst, const void* a, const void* b, size_t n);
// reduceHost's arithmetic for (type, op) as scalar loops, chosen once per
// operation, for a few elements at a time (the pull line of
// algorithms/one_shot.cc reduces N lines of at most 16 bytes): no dispatch
// and no vector set-up per call.  The values of reduceHost (a NaN may carry
// another payload, as reduceHost's vector and scalar paths may differ
// there).  dst may alias a or b (exactly).  nullptr for an unknown type or op.
HostReduceFn hostReduceSmallFn(loomDataType_t type, loomRedOp_t op);

// dst[i] = src[i] / divisor for i < n (the last step of loomAvg).  Integers
// truncate toward zero; float16/bfloat16 divide in float32 and round once.
// dst may alias src.
void divideHost(void* dst, const void* src, size_t n, loomDataType_t type, int divisor);

// dst[i] = src[i] * k for i < n, k the one element of `type` at `scalar`
// (loomScale): one step of the product, so integers wrap and float16 and
// bfloat16 multiply in float32 and round once, as the device kernel does.
// dst may alias src exactly.
void scaleHost(void* dst, const void* src, size_t n, loomDataType_t type, const void* scalar);

// float <-> float16 / bfloat16 conversions (round to nearest even, NaN kept).
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float bf16ToFloat(uint16_t h);
uint16_t floatToBf16(float f);

}  // namespace loom
