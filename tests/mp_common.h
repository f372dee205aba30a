// Shared by the multi-process test worker and loom-perf-style checks:
// deterministic inputs whose reduction is exact in any order, and the
// expected results computed independently of loom.  Uses loom's C API only
// (mp-worker links libloom.so as applications do, and that exports nothing
// else), so the element sizes, names and float16/bfloat16 rounding are its own.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "loom.h"

namespace loomtest {

// printf into a std::string (messages of checks).
__attribute__((format(printf, 1, 2))) inline std::string strf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

inline size_t typeSize(loomDataType_t t) {
  switch (t) {
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

inline const char* typeName(loomDataType_t t) {
  static const char* const kNames[loomNumTypes] = {"int8",  "uint8",   "int32",   "uint32",  "int64",
                                                   "uint64", "float16", "float32", "float64", "bfloat16"};
  return unsigned(t) < unsigned(loomNumTypes) ? kNames[t] : "?";
}

inline const char* opName(loomRedOp_t op) {
  static const char* const kNames[loomNumOps] = {"sum", "prod", "max", "min", "avg"};
  return unsigned(op) < unsigned(loomNumOps) ? kNames[op] : "?";
}

// float -> IEEE half, round to nearest even (as loom.h promises), written
// the plain way rather than as loom's branch-free kernel.
inline uint16_t halfOf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to inf
  if (a < 0x38800000u)                           // below 2^-14: a multiple of 2^-24
    return sign | uint16_t(std::nearbyint(std::fabs(f) * 16777216.0f));
  uint32_t h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3ffu), rest = a & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent
  return uint16_t(sign | h);
}

// float -> bfloat16 (the top half of a float), round to nearest even.
inline uint16_t bf16Of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  uint32_t h = u >> 16, rest = u & 0xffffu;
  if (rest > 0x8000u || (rest == 0x8000u && (h & 1u))) ++h;
  return uint16_t(h);
}

inline bool isSigned(loomDataType_t t) {
  return t == loomInt8 || t == loomInt32 || t == loomInt64 || t == loomFloat16 ||
         t == loomBfloat16 || t == loomFloat32 || t == loomFloat64;
}
inline bool isFloat(loomDataType_t t) {
  return t == loomFloat16 || t == loomBfloat16 || t == loomFloat32 || t == loomFloat64;
}

// Input element i of `rank` for reduction `op` (small integers: every
// partial sum/product over <= 8 ranks is exact in every type).
inline int64_t inputValue(loomRedOp_t op, loomDataType_t t, int rank, size_t i) {
  int64_t k = int64_t(i % 1000003);
  switch (op) {
    case loomSum:
    case loomAvg:
      return isSigned(t) ? (rank * 3 + k) % 7 - 3 : (rank * 3 + k) % 4;
    case loomProd: {
      int64_t v = ((rank + k) % 3 == 0) ? 2 : 1;
      if (isSigned(t) && (rank + 2 * k) % 5 == 0) v = -v;
      return v;
    }
    case loomMax:
    case loomMin:
    default:
      return isSigned(t) ? (rank * 37 + k * 11) % 101 - 50 : (rank * 37 + k * 11) % 101;
  }
}

// Stores integer value v as element i of a buffer of type t (wrapping).
inline void store(void* buf, loomDataType_t t, size_t i, int64_t v) {
  switch (t) {
    case loomInt8: static_cast<int8_t*>(buf)[i] = int8_t(v); break;
    case loomUint8: static_cast<uint8_t*>(buf)[i] = uint8_t(v); break;
    case loomInt32: static_cast<int32_t*>(buf)[i] = int32_t(v); break;
    case loomUint32: static_cast<uint32_t*>(buf)[i] = uint32_t(v); break;
    case loomInt64: static_cast<int64_t*>(buf)[i] = v; break;
    case loomUint64: static_cast<uint64_t*>(buf)[i] = uint64_t(v); break;
    case loomFloat16: static_cast<uint16_t*>(buf)[i] = halfOf(float(v)); break;
    case loomBfloat16: static_cast<uint16_t*>(buf)[i] = bf16Of(float(v)); break;
    case loomFloat32: static_cast<float*>(buf)[i] = float(v); break;
    case loomFloat64: static_cast<double*>(buf)[i] = double(v); break;
    default: break;
  }
}

// Stores the expected avg result: sum / n as loom defines it per type.
inline void storeAvg(void* buf, loomDataType_t t, size_t i, int64_t sum, int n) {
  switch (t) {
    case loomFloat16: static_cast<uint16_t*>(buf)[i] = halfOf(float(sum) / float(n)); break;
    case loomBfloat16: static_cast<uint16_t*>(buf)[i] = bf16Of(float(sum) / float(n)); break;
    case loomFloat32: static_cast<float*>(buf)[i] = float(sum) / float(n); break;
    case loomFloat64: static_cast<double*>(buf)[i] = double(sum) / double(n); break;
    case loomUint8: store(buf, t, i, int64_t(uint8_t(sum)) / n); break;
    case loomUint32: store(buf, t, i, int64_t(uint32_t(sum)) / n); break;
    case loomUint64: store(buf, t, i, int64_t(uint64_t(sum) / uint64_t(n))); break;
    default: store(buf, t, i, sum / n); break;
  }
}

// Every input value depends on its index only through k = i % 1000003,
// and on k only modulo 7, 4, 3, 5 and 101: a run of indices that does not
// cross a multiple of 1000003 repeats with period lcm = 42420.
constexpr size_t kInputWrap = 1000003, kInputPeriod = 7 * 4 * 15 * 101;

// Writes count elements of type t at buf, element i being the value at
// absolute index base + i that set(buf, i, base + i) stores: computed one
// by one for the first period of each run between wraps, copied after it
// (a fill of 64 Mi elements costs a memcpy, not 64 Mi calls).
template <class Set>
void fillPeriodic(void* buf, loomDataType_t t, size_t count, size_t base, Set set) {
  const size_t esz = typeSize(t);
  char* p = static_cast<char*>(buf);
  for (size_t i = 0; i < count;) {
    const size_t run = std::min(count - i, kInputWrap - (base + i) % kInputWrap);
    const size_t first = std::min(run, kInputPeriod);
    for (size_t j = 0; j < first; ++j) set(p, i + j, base + i + j);
    // Element j + L equals element j for any L that is a multiple of the period.
    for (size_t have = first; have < run;) {
      const size_t n = std::min(have, run - have);
      memcpy(p + (i + have) * esz, p + i * esz, n * esz);
      have += n;
    }
    i += run;
  }
}

inline void fillInput(void* buf, loomRedOp_t op, loomDataType_t t, int rank, size_t count, size_t base = 0) {
  fillPeriodic(buf, t, count, base,
               [&](void* b, size_t i, size_t gi) { store(b, t, i, inputValue(op, t, rank, gi)); });
}

// Expected reduction over ranks [0, n) of element index `gi`, stored at i.
inline void storeExpected(void* buf, loomRedOp_t op, loomDataType_t t, int n, size_t i, size_t gi) {
  int64_t acc = inputValue(op, t, 0, gi);
  for (int r = 1; r < n; ++r) {
    int64_t v = inputValue(op, t, r, gi);
    switch (op) {
      case loomSum:
      case loomAvg: acc += v; break;
      case loomProd: acc *= v; break;
      case loomMax: acc = v > acc ? v : acc; break;
      case loomMin: acc = v < acc ? v : acc; break;
      default: break;
    }
  }
  if (op == loomAvg) storeAvg(buf, t, i, acc, n);
  else store(buf, t, i, acc);
}

// storeExpected for elements [0, count) of buf, at indices base + i.
inline void fillExpected(void* buf, loomRedOp_t op, loomDataType_t t, int n, size_t count, size_t base = 0) {
  fillPeriodic(buf, t, count, base, [&](void* b, size_t i, size_t gi) { storeExpected(b, op, t, n, i, gi); });
}

// Number of elements whose bytes differ.
inline size_t countWrong(const void* got, const void* want, size_t count, loomDataType_t t) {
  size_t esz = typeSize(t), wrong = 0;
  const char* a = static_cast<const char*>(got);
  const char* b = static_cast<const char*>(want);
  if (count == 0 || memcmp(a, b, count * esz) == 0) return 0;
  for (size_t i = 0; i < count; ++i) wrong += memcmp(a + i * esz, b + i * esz, esz) != 0;
  return wrong;
}

}  // namespace loomtest
