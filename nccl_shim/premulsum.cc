// ncclRedOpCreatePreMulSum: each rank scales its input by its scalar, then
// the scaled inputs are summed (loomSum).  The scaling is done here, on a
// copy, in the operator's type: integers multiply with wrap-around as C's
// unsigned arithmetic does, float16 and bfloat16 multiply in float32 and round
// to nearest even once (loom's rule for their reductions).
#include <cstdint>
#include <cstring>

#include "nccl_shim/shim.h"

namespace nccl_shim {
namespace {

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) man <<= 1, --exp;
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  uint16_t sign = uint16_t((x >> 16) & 0x8000);
  uint32_t ax = x & 0x7fffffff;
  if (ax > 0x7f800000) return uint16_t(sign | 0x7e00);   // NaN
  if (ax >= 0x477ff000) return uint16_t(sign | 0x7c00);  // rounds to infinity
  if (ax < 0x38800000) {                                 // subnormal or zero in half
    float a;
    memcpy(&a, &ax, 4);
    // a * 2^24 is exact and its integer part is the subnormal's mantissa.
    float m = a * 16777216.0f;
    uint32_t mi = uint32_t(m);
    float frac = m - float(mi);
    if (frac > 0.5f || (frac == 0.5f && (mi & 1))) ++mi;
    return uint16_t(sign | mi);
  }
  uint32_t r = ax - 0x38000000;  // rebias the exponent (127 -> 15)
  r += 0xfff + ((r >> 13) & 1);  // round to nearest even at bit 13; a carry bumps the exponent
  return uint16_t(sign | (r >> 13));
}

float bf16ToFloat(uint16_t b) {
  uint32_t bits = uint32_t(b) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fff + ((x >> 16) & 1);
  return uint16_t(x >> 16);
}

template <class T, class S = T>
void scaleAs(void* dst, const void* src, size_t n, const void* scalar) {
  T k;
  memcpy(&k, scalar, sizeof k);
  for (size_t i = 0; i < n; ++i) {
    T v;
    memcpy(&v, static_cast<const char*>(src) + i * sizeof(T), sizeof v);
    T out = T(S(v) * S(k));
    memcpy(static_cast<char*>(dst) + i * sizeof(T), &out, sizeof out);
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void scale16(void* dst, const void* src, size_t n, const void* scalar) {
  uint16_t k;
  memcpy(&k, scalar, 2);
  float kf = ToFloat(k);
  for (size_t i = 0; i < n; ++i) {
    uint16_t v;
    memcpy(&v, static_cast<const char*>(src) + i * 2, 2);
    uint16_t out = FromFloat(ToFloat(v) * kf);
    memcpy(static_cast<char*>(dst) + i * 2, &out, 2);
  }
}

}  // namespace

void scaleInto(void* dst, const void* src, size_t count, ncclDataType_t type, const void* scalar) {
  switch (type) {
    case ncclInt8:
      scaleAs<int8_t, uint32_t>(dst, src, count, scalar);
      break;
    case ncclUint8:
      scaleAs<uint8_t, uint32_t>(dst, src, count, scalar);
      break;
    case ncclInt32:
      scaleAs<int32_t, uint32_t>(dst, src, count, scalar);
      break;
    case ncclUint32:
      scaleAs<uint32_t>(dst, src, count, scalar);
      break;
    case ncclInt64:
      scaleAs<int64_t, uint64_t>(dst, src, count, scalar);
      break;
    case ncclUint64:
      scaleAs<uint64_t>(dst, src, count, scalar);
      break;
    case ncclFloat16:
      scale16<halfToFloat, floatToHalf>(dst, src, count, scalar);
      break;
    case ncclBfloat16:
      scale16<bf16ToFloat, floatToBf16>(dst, src, count, scalar);
      break;
    case ncclFloat32:
      scaleAs<float>(dst, src, count, scalar);
      break;
    case ncclFloat64:
      scaleAs<double>(dst, src, count, scalar);
      break;
    default:
      break;  // refused before an operation is made
  }
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
  // The scaling runs on the host (scaleInto); a CUDA communicator's buffers
  // are device memory, which the host must not touch.
  if (comm->cuda())
    return fail(ncclInvalidUsage,
                "%s: this communicator runs on CUDA device %d, and loom cannot scale device buffers yet "
                "(PreMulSum scales on the host); use ncclSum and scale the input or result yourself, or "
                "ncclAvg for a mean",
                call, comm->cudaDevice);
  ncclComm::PreMulSum p{};
  p.type = datatype;
  p.residence = residence;
  // ncclScalarDevice: "device-visible memory" is host memory here; it is read
  // each time an operation using the op is issued.
  p.scalarPtr = scalar;
  memcpy(p.scalarBytes, scalar, typeSize(datatype));
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
