// Vectorisation checked (g++ 12 -O3 -fopt-info-vec-optimized): every reduce loop (all types x ops, 3 alias shapes, baseline + AVX2 copies) and the float/fp16/bf16 divide loops vectorise, except int64/uint64 prod/max/min in the SSE2 baseline copy (SSE2 has no 64-bit multiply/compare; the AVX2 copy vectorises them).
//
// Host reduction kernels.  Design notes:
//  * Dispatch on (type, op, ISA) happens once per call and picks a function
//    pointer; the loops inside are plain templates that g++ -O3 vectorises.
//  * The arithmetic of one element (conversions, ops, avg's division) is in
//    reduce_ops.h, which CUDA kernels include too; this file is the loops.
//  * Each kernel is compiled for the baseline ISA (SSE2 on x86-64, NEON on
//    aarch64) and, on x86-64 only, again for AVX2+F16C, chosen at runtime
//    with __builtin_cpu_supports.  The library is built without -march, so
//    without the second copy we would be stuck with 16-byte vectors.
//  * Elements are loaded and stored with memcpy: callers pass byte offsets
//    into staging buffers, so a float* need not be 4-byte aligned (and g++
//    may not assume it is, or it could emit aligned vector loads that fault).
//    The memcpy folds into one unaligned vector load.
//  * dst may equal a or b exactly.  Each of the three shapes (distinct,
//    dst==a or dst==b, dst==a==b) gets its own loop whose __restrict
//    promises are true, so the compiler needs no runtime overlap checks.
#include "host_reduce.h"

#include <cstring>
#include <type_traits>

#include "src/core/hot.h"
#include "src/device/reduce_ops.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define LOOM_X86 1
#define LOOM_AVX2 __attribute__((target("avx2,f16c")))
#else
#define LOOM_X86 0
#endif

#define LOOM_INLINE inline __attribute__((always_inline))

namespace loom {

namespace {

using u8 = unsigned char;

template <class T>
LOOM_INLINE T ld(const u8* p, size_t i) {
  T v;
  memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}
template <class T>
LOOM_INLINE void st(u8* p, size_t i, T v) {
  memcpy(p + i * sizeof(T), &v, sizeof(T));
}

// The arithmetic of one element is reduce_ops.h's (shared with CUDA).
using elementwise::BF16;
using elementwise::Half;
using elementwise::Max;
using elementwise::Min;
using elementwise::Plain;
using elementwise::Prod;
using elementwise::Sum;

// ---- the loops --------------------------------------------------------------

template <class Ty, class Op>
struct Kernel {
  using S = typename Ty::Store;

  static LOOM_INLINE S one(S x, S y) { return elementwise::reduce<Ty, Op>(x, y); }

  // dst distinct from a and b (a == b is fine: both are only read).
  static LOOM_INLINE void distinct(u8* __restrict d, const u8* __restrict a,
                                   const u8* __restrict b, size_t n) {
    for (size_t i = 0; i < n; ++i) st<S>(d, i, one(ld<S>(a, i), ld<S>(b, i)));
  }
  // dst == a (Swap = false) or dst == b (Swap = true); operand order is kept
  // so results do not depend on which buffer is in place.
  template <bool Swap>
  static LOOM_INLINE void inPlace(u8* __restrict d, const u8* __restrict o, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      S x = ld<S>(d, i), y = ld<S>(o, i);
      st<S>(d, i, Swap ? one(y, x) : one(x, y));
    }
  }
  static LOOM_INLINE void self(u8* __restrict d, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      S x = ld<S>(d, i);
      st<S>(d, i, one(x, x));
    }
  }

  static LOOM_INLINE void body(void* dst, const void* a, const void* b, size_t n) {
    u8* d = static_cast<u8*>(dst);
    const u8* pa = static_cast<const u8*>(a);
    const u8* pb = static_cast<const u8*>(b);
    if (d != pa && d != pb) distinct(d, pa, pb, n);
    else if (pa == pb) self(d, n);
    else if (d == pa) inPlace<false>(d, pb, n);
    else inPlace<true>(d, pa, n);
  }
};

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

template <class Ty, class Op>
void runGeneric(void* d, const void* a, const void* b, size_t n) {
  Kernel<Ty, Op>::body(d, a, b, n);
}

#if LOOM_X86
// Same source, AVX2 code generation: the always_inline loops above are
// compiled again inside this function with 256-bit vectors.
template <class Ty, class Op>
LOOM_AVX2 void runAvx2(void* d, const void* a, const void* b, size_t n) {
  Kernel<Ty, Op>::body(d, a, b, n);
}

// float16 with F16C: the bit-trick conversions vectorise but take ~35
// instructions per 8 elements where vcvtph2ps/vcvtps2ph take one (measured:
// ~6 vs ~75 GB/s for a 256 KiB sum).  They give the same bits as h2f/f2h
// (RNE, NaN quieted with its top payload kept); the tail uses h2f/f2h.
typedef float v8sf __attribute__((vector_size(32)));

template <class Op>
LOOM_AVX2 LOOM_INLINE void halfF16c(u8* d, const u8* a, const u8* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8sf x = (v8sf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 2 * i)));
    v8sf y = (v8sf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i)));
    v8sf r;
    Op::apply(x, y, r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * i),
                     _mm256_cvtps_ph((__m256)r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i)
    st<uint16_t>(d, i, Kernel<Half, Op>::one(ld<uint16_t>(a, i), ld<uint16_t>(b, i)));
}

// Each 8-element block is loaded before it is stored, so d == a or d == b
// needs no special loop here; only operand order matters.
template <class Op>
LOOM_AVX2 void runHalfF16c(void* dst, const void* a, const void* b, size_t n) {
  auto d = static_cast<u8*>(dst);
  auto pa = static_cast<const u8*>(a), pb = static_cast<const u8*>(b);
  halfF16c<Op>(d, pa, pb, n);
}
#endif

// CPU support is probed once; a test can force the baseline kernels
// (loom::detail::hostReduceForceGeneric) so that both copies get covered.
int g_forceGeneric = 0;

bool useAvx2() {
#if LOOM_X86
  static const bool has = [] {
    __builtin_cpu_init();
#if defined(__clang__)  // clang's __builtin_cpu_supports has no "f16c"
    unsigned eax, ebx, ecx, edx;
    bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
#else
    bool f16c = __builtin_cpu_supports("f16c");
#endif
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return has && !__atomic_load_n(&g_forceGeneric, __ATOMIC_RELAXED);
#else
  return false;
#endif
}

template <class Ty, class Op>
ReduceFn pickIsa(bool avx2) {
#if LOOM_X86
  if (avx2) {
    if constexpr (std::is_same<Ty, Half>::value) return &runHalfF16c<Op>;
    else return &runAvx2<Ty, Op>;
  }
#endif
  (void)avx2;
  return &runGeneric<Ty, Op>;
}

template <class Ty>
ReduceFn pickOp(loomRedOp_t op, bool avx2) {
  switch (op) {
    case loomSum:
    case loomAvg: return pickIsa<Ty, Sum>(avx2);
    case loomProd: return pickIsa<Ty, Prod>(avx2);
    case loomMax: return pickIsa<Ty, Max>(avx2);
    case loomMin: return pickIsa<Ty, Min>(avx2);
    default: return nullptr;
  }
}

ReduceFn pick(loomDataType_t type, loomRedOp_t op) {
  bool avx2 = useAvx2();
  return elementwise::withElem(
      type, [&](auto ty) { return pickOp<decltype(ty)>(op, avx2); }, ReduceFn(nullptr));
}

template <class Ty, class Op>
LOOM_HOT void smallPair(void* dst, const void* a, const void* b, size_t n) {
  using S = typename Ty::Store;
  u8* d = static_cast<u8*>(dst);
  const u8* pa = static_cast<const u8*>(a);
  const u8* pb = static_cast<const u8*>(b);
  for (size_t i = 0; i < n; ++i) st<S>(d, i, Kernel<Ty, Op>::one(ld<S>(pa, i), ld<S>(pb, i)));
}

template <class Ty>
ReduceFn smallOp(loomRedOp_t op) {
  switch (op) {
    case loomSum:
    case loomAvg: return &smallPair<Ty, Sum>;
    case loomProd: return &smallPair<Ty, Prod>;
    case loomMax: return &smallPair<Ty, Max>;
    case loomMin: return &smallPair<Ty, Min>;
    default: return nullptr;
  }
}

// ---- division (loomAvg's last step; runs once per collective, so only the
// baseline ISA).  Integers divide in 64 bits so a divisor wider than the type
// is exact; x86 has no SIMD integer divide, so their loops stay scalar. ------

template <class Ty>
LOOM_INLINE void divideDistinct(u8* __restrict d, const u8* __restrict s, size_t n,
                                typename Ty::Divisor q) {
  using S = typename Ty::Store;
  for (size_t i = 0; i < n; ++i) st<S>(d, i, elementwise::divide<Ty>(ld<S>(s, i), q));
}

// In place and out of place get separate loops for the same reason as in
// Kernel: each one's __restrict promise is then true.
template <class Ty>
void divideLoop(void* dst, const void* src, size_t n, int divisor) {
  using S = typename Ty::Store;
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  auto q = typename Ty::Divisor(divisor);
  if (d == s) {
    for (size_t i = 0; i < n; ++i) st<S>(d, i, elementwise::divide<Ty>(ld<S>(d, i), q));
  } else {
    divideDistinct<Ty>(d, s, n, q);
  }
}

}  // namespace

namespace detail {
// Test hook (not in the header on purpose): force the baseline ISA kernels.
void hostReduceForceGeneric(bool on) {
  __atomic_store_n(&g_forceGeneric, on ? 1 : 0, __ATOMIC_RELAXED);
}
}  // namespace detail

const char* dtypeName(loomDataType_t type) {
  static const char* const kNames[loomNumTypes] = {"int8",    "uint8",   "int32",   "uint32",
                                                   "int64",   "uint64",  "float16", "float32",
                                                   "float64", "bfloat16"};
  unsigned t = unsigned(type);
  return t < unsigned(loomNumTypes) ? kNames[t] : "?";
}

const char* redOpName(loomRedOp_t op) {
  static const char* const kNames[loomNumOps] = {"sum", "prod", "max", "min", "avg"};
  unsigned o = unsigned(op);
  return o < unsigned(loomNumOps) ? kNames[o] : "?";
}

LOOM_HOT void reduceHost(void* dst, const void* a, const void* b, size_t n, loomDataType_t type,
                loomRedOp_t op) {
  if (n == 0) return;
  if (ReduceFn fn = pick(type, op)) fn(dst, a, b, n);
}

LOOM_HOT HostReduceFn hostReduceSmallFn(loomDataType_t type, loomRedOp_t op) {
  return elementwise::withElem(type, [&](auto ty) { return smallOp<decltype(ty)>(op); }, ReduceFn(nullptr));
}

void divideHost(void* dst, const void* src, size_t n, loomDataType_t type, int divisor) {
  if (n == 0) return;
  // divisor is a rank count.  Below 1 it is a caller bug; copying keeps the
  // integer paths free of UB (x / 0, INT64_MIN / -1) and floats consistent.
  if (divisor <= 1) {
    if (dst != src) memmove(dst, src, n * dtypeSize(type));
    return;
  }
  elementwise::withElem(
      type, [&](auto ty) { divideLoop<decltype(ty)>(dst, src, n, divisor); return 0; }, 0);
}

void scaleHost(void* dst, const void* src, size_t n, loomDataType_t type, const void* scalar) {
  if (n == 0) return;
  elementwise::withElem(
      type,
      [&](auto ty) {
        using Ty = decltype(ty);
        using S = typename Ty::Store;
        S k;
        memcpy(&k, scalar, sizeof k);
        u8* d = static_cast<u8*>(dst);
        const u8* s = static_cast<const u8*>(src);
        for (size_t i = 0; i < n; ++i) st<S>(d, i, elementwise::scaleElement<Ty>(ld<S>(s, i), k));
        return 0;
      },
      0);
}

float halfToFloat(uint16_t h) { return elementwise::h2f(h); }
uint16_t floatToHalf(float f) { return elementwise::f2h(f); }
float bf16ToFloat(uint16_t h) { return elementwise::bf2f(h); }
uint16_t floatToBf16(float f) { return elementwise::f2bf(f); }

}  // namespace loom
