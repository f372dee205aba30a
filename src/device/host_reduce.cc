// Vectorisation checked (g++ 12 -O3 -fopt-info-vec-optimized): every reduce loop (all types x ops, 3 alias shapes, baseline + AVX2 copies) and the float/fp16/bf16 divide loops vectorise, except int64/uint64 prod/max/min in the SSE2 baseline copy (SSE2 has no 64-bit multiply/compare; the AVX2 copy vectorises them).
//
// Host reduction kernels.  Design notes:
//  * Dispatch on (type, op, ISA) happens once per call and picks a function
//    pointer; the loops inside are plain templates that g++ -O3 vectorises.
//  * Each kernel is compiled twice: for the baseline ISA (SSE2 on x86-64)
//    and, on x86, for AVX2+F16C, chosen at runtime with
//    __builtin_cpu_supports.  The library is built without -march, so without
//    the second copy we would be stuck with 16-byte vectors.
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

#if defined(__x86_64__) || defined(__i386__)
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
LOOM_INLINE uint32_t bitsOf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
LOOM_INLINE float floatOf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- float16 / bfloat16 <-> float32 ---------------------------------------
// Written as straight-line code so a loop of them vectorises: every
// candidate result is computed and the right one picked.  Picks downstream
// of a float op use masks, not ?:, because g++ otherwise sinks the float op
// into a branch and then will not if-convert it (it may trap).

LOOM_INLINE uint32_t blend(bool c, uint32_t x, uint32_t y) {
  uint32_t m = 0u - uint32_t(c);
  return (x & m) | (y & ~m);
}

LOOM_INLINE float h2f(uint16_t h) {
  uint32_t em = h & 0x7fffu, sign = uint32_t(h & 0x8000u) << 16;
  // Normal: move exponent+mantissa into place and rebias 15 -> 127.
  uint32_t norm = (em << 13) + (112u << 23);
  // Inf/NaN: rebias again so the exponent becomes 255; payload is kept.
  norm = em >= 0x7c00u ? norm + (112u << 23) : norm;
  // Subnormal: m * 2^-24 is exact and a normal float, so this also works
  // with FTZ/DAZ set (some ML frameworks set them); m == 0 gives +0.
  uint32_t sub = bitsOf(float(int32_t(em)) * 0x1p-24f);
  return floatOf(blend(em < 0x0400u, sub, norm) | sign);
}

// The result is assembled in bits 13..28 of a 32-bit word and shifted down
// once at the end.  Building it in the low 16 bits instead lets g++ narrow
// every blend to 16 bits separately, with a pack per operand: 2x slower.
LOOM_INLINE uint16_t f2h(float f) {
  uint32_t u = bitsOf(f), a = u & 0x7fffffffu;
  // Normal result: rebias 127 -> 15, then round to nearest even by adding
  // just under half an ulp plus the lsb of the kept mantissa.  A mantissa
  // carry correctly bumps the exponent, and [65520, 65536) carries into
  // 0x7c00 = inf.  (Wraps harmlessly when a is small; not selected then.)
  uint32_t norm = a - (112u << 23) + 0xfffu + ((a >> 13) & 1u);
  // Subnormal result (|f| < 2^-14): adding 0.5 puts the half's ulp (2^-24)
  // at the float's lsb, so the FPU does the round-to-nearest-even for us and
  // the low bits are the half's bits (0x400 = smallest normal on carry).
  // A float subnormal flushed by DAZ would round to 0 here anyway.
  uint32_t sub = (bitsOf(floatOf(a) + 0.5f) - bitsOf(0.5f)) << 13;
  uint32_t r = blend(a < (113u << 23), sub, norm);
  r = blend(a >= (143u << 23), 0x7c00u << 13, r);  // >= 65536: inf
  // NaN: quiet, keep the top of the payload (what vcvtps2ph does too).
  r = blend(a > 0x7f800000u, (0x7e00u << 13) | (a & (0x3ffu << 13)), r);
  return uint16_t((r | ((u >> 3) & (1u << 28))) >> 13);
}

LOOM_INLINE float bf2f(uint16_t h) { return floatOf(uint32_t(h) << 16); }

LOOM_INLINE uint16_t f2bf(float f) {
  uint32_t u = bitsOf(f);
  // Round to nearest even; overflow carries into the exponent and lands on
  // inf exactly when IEEE says it should.  NaN must not be rounded (it could
  // carry into inf or the sign), so it is truncated and made quiet.  Shift
  // once after the select, for the same reason as in f2h.
  uint32_t r = f != f ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(r >> 16);
}

// ---- element types: how a stored element becomes a value to compute with --

template <class T>
struct Plain {
  using Store = T;
  static LOOM_INLINE T load(T x) { return x; }
  static LOOM_INLINE T save(T x) { return x; }
};
struct Half {
  using Store = uint16_t;
  static LOOM_INLINE float load(uint16_t x) { return h2f(x); }
  static LOOM_INLINE uint16_t save(float x) { return f2h(x); }
};
struct BF16 {
  using Store = uint16_t;
  static LOOM_INLINE float load(uint16_t x) { return bf2f(x); }
  static LOOM_INLINE uint16_t save(float x) { return f2bf(x); }
};

// ---- ops ------------------------------------------------------------------
// Integer sum/prod are done in an unsigned type so overflow wraps instead of
// being UB; unsigned int (not the narrow type) avoids promotion to signed int.
// apply() also accepts GCC vector types (the F16C path).  It takes
// references because a 32-byte vector passed by value to a non-AVX function
// draws a -Wpsabi note that no pragma silences; inlined, it costs nothing.

template <class T, bool = std::is_integral<T>::value>
struct WideOf {
  using type = T;
};
template <class T>
struct WideOf<T, true> {
  using type = typename std::conditional<(sizeof(T) < sizeof(unsigned)), unsigned,
                                         std::make_unsigned_t<T>>::type;
};
template <class T>
using Wide = typename WideOf<T>::type;

struct Sum {
  template <class T>
  static LOOM_INLINE void apply(const T& a, const T& b, T& r) {
    r = T(Wide<T>(a) + Wide<T>(b));
  }
};
struct Prod {
  template <class T>
  static LOOM_INLINE void apply(const T& a, const T& b, T& r) {
    r = T(Wide<T>(a) * Wide<T>(b));
  }
};
// Max/min propagate NaN: if either operand is NaN the result is NaN (like
// IEEE 754-2019 maximum/minimum, not fmax, which would drop it).  A rank
// with a NaN gradient should poison the result, not vanish.  For integers
// a != a is false and folds away.  Between +0 and -0 either may be returned.
struct Max {
  template <class T>
  static LOOM_INLINE void apply(const T& a, const T& b, T& r) {
    T m = a > b ? a : b;  // b if b is NaN
    r = a != a ? a : m;
  }
};
struct Min {
  template <class T>
  static LOOM_INLINE void apply(const T& a, const T& b, T& r) {
    T m = a < b ? a : b;
    r = a != a ? a : m;
  }
};

template <class Op, class T>
LOOM_INLINE T combine(T a, T b) {
  T r;
  Op::apply(a, b, r);
  return r;
}

// ---- the loops --------------------------------------------------------------

template <class Ty, class Op>
struct Kernel {
  using S = typename Ty::Store;

  static LOOM_INLINE S one(S x, S y) { return Ty::save(combine<Op>(Ty::load(x), Ty::load(y))); }

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
  switch (type) {
    case loomInt8: return pickOp<Plain<int8_t>>(op, avx2);
    case loomUint8: return pickOp<Plain<uint8_t>>(op, avx2);
    case loomInt32: return pickOp<Plain<int32_t>>(op, avx2);
    case loomUint32: return pickOp<Plain<uint32_t>>(op, avx2);
    case loomInt64: return pickOp<Plain<int64_t>>(op, avx2);
    case loomUint64: return pickOp<Plain<uint64_t>>(op, avx2);
    case loomFloat16: return pickOp<Half>(op, avx2);
    case loomBfloat16: return pickOp<BF16>(op, avx2);
    case loomFloat32: return pickOp<Plain<float>>(op, avx2);
    case loomFloat64: return pickOp<Plain<double>>(op, avx2);
    default: return nullptr;
  }
}

// ---- division (loomAvg's last step; runs once per collective, so only the
// baseline ISA) -----------------------------------------------------------------

template <class Ty, class Q>
LOOM_INLINE void divideDistinct(u8* __restrict d, const u8* __restrict s, size_t n, Q q) {
  using S = typename Ty::Store;
  for (size_t i = 0; i < n; ++i) st<S>(d, i, Ty::save(Ty::load(ld<S>(s, i)) / q));
}

// In place and out of place get separate loops for the same reason as in
// Kernel: each one's __restrict promise is then true.
template <class Ty, class Q>
void divideLoop(void* dst, const void* src, size_t n, Q q) {
  using S = typename Ty::Store;
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  if (d == s) {
    for (size_t i = 0; i < n; ++i) st<S>(d, i, Ty::save(Ty::load(ld<S>(d, i)) / q));
  } else {
    divideDistinct<Ty>(d, s, n, q);
  }
}

// Integers: divide in 64 bits so a divisor wider than the type is exact.
// (x86 has no SIMD integer divide, so this loop stays scalar.)
template <class T>
void divideInt(void* dst, const void* src, size_t n, int divisor) {
  using Q = typename std::conditional<std::is_signed<T>::value, int64_t, uint64_t>::type;
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  Q q = Q(divisor);
  for (size_t i = 0; i < n; ++i) st<T>(d, i, T(Q(ld<T>(s, i)) / q));
}

}  // namespace

namespace detail {
// Test hook (not in the header on purpose): force the baseline ISA kernels.
void hostReduceForceGeneric(bool on) {
  __atomic_store_n(&g_forceGeneric, on ? 1 : 0, __ATOMIC_RELAXED);
}
}  // namespace detail

size_t dtypeSize(loomDataType_t type) {
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

void reduceHost(void* dst, const void* a, const void* b, size_t n, loomDataType_t type,
                loomRedOp_t op) {
  if (n == 0) return;
  if (ReduceFn fn = pick(type, op)) fn(dst, a, b, n);
}

void divideHost(void* dst, const void* src, size_t n, loomDataType_t type, int divisor) {
  if (n == 0) return;
  // divisor is a rank count.  Below 1 it is a caller bug; copying keeps the
  // integer paths free of UB (x / 0, INT64_MIN / -1) and floats consistent.
  if (divisor <= 1) {
    if (dst != src) memmove(dst, src, n * dtypeSize(type));
    return;
  }
  switch (type) {
    case loomInt8: return divideInt<int8_t>(dst, src, n, divisor);
    case loomUint8: return divideInt<uint8_t>(dst, src, n, divisor);
    case loomInt32: return divideInt<int32_t>(dst, src, n, divisor);
    case loomUint32: return divideInt<uint32_t>(dst, src, n, divisor);
    case loomInt64: return divideInt<int64_t>(dst, src, n, divisor);
    case loomUint64: return divideInt<uint64_t>(dst, src, n, divisor);
    case loomFloat16: return divideLoop<Half>(dst, src, n, float(divisor));
    case loomBfloat16: return divideLoop<BF16>(dst, src, n, float(divisor));
    case loomFloat32: return divideLoop<Plain<float>>(dst, src, n, float(divisor));
    case loomFloat64: return divideLoop<Plain<double>>(dst, src, n, double(divisor));
    default: return;
  }
}

float halfToFloat(uint16_t h) { return h2f(h); }
uint16_t floatToHalf(float f) { return f2h(f); }
float bf16ToFloat(uint16_t h) { return bf2f(h); }
uint16_t floatToBf16(float f) { return f2bf(f); }

}  // namespace loom
