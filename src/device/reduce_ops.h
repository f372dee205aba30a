// Element-wise reduction arithmetic for every loom datatype and op, written
// once for every device: host_reduce.cc wraps it in vectorised loops and a
// CUDA kernel includes this header unchanged (tests/cuda/reduce_ops_check.cu
// proves it compiles under nvcc), so host and device results agree bit for bit.
//
// Rules that keep it includable from device code: every function is
// LOOM_HD_INLINE (__host__ __device__ under nvcc), no std:: calls (type
// traits only), no exceptions, and bit casts go through CUDA intrinsics in
// device code and memcpy on the host.
//
// Semantics: float16 and bfloat16 are converted to float32, combined, and
// rounded back once (round to nearest even, NaN kept quiet); integer sum and
// prod wrap (two's complement); max/min propagate NaN; loomAvg combines as
// sum and divides once at the end (Elem::divide).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "loom.h"

#if defined(__CUDACC__)
#define LOOM_HD __host__ __device__
#define LOOM_HD_INLINE __forceinline__ __host__ __device__
#else
#define LOOM_HD
#define LOOM_HD_INLINE inline __attribute__((always_inline))
#endif

namespace loom {
namespace elementwise {

LOOM_HD_INLINE uint32_t bitsOf(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}
LOOM_HD_INLINE float floatOf(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- float16 / bfloat16 <-> float32 ---------------------------------------
// Written as straight-line code so a loop of them vectorises: every
// candidate result is computed and the right one picked.  Picks downstream
// of a float op use masks, not ?:, because g++ otherwise sinks the float op
// into a branch and then will not if-convert it (it may trap).

LOOM_HD_INLINE uint32_t blend(bool c, uint32_t x, uint32_t y) {
  uint32_t m = 0u - uint32_t(c);
  return (x & m) | (y & ~m);
}

LOOM_HD_INLINE float h2f(uint16_t h) {
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
LOOM_HD_INLINE uint16_t f2h(float f) {
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

LOOM_HD_INLINE float bf2f(uint16_t h) { return floatOf(uint32_t(h) << 16); }

LOOM_HD_INLINE uint16_t f2bf(float f) {
  uint32_t u = bitsOf(f);
  // Round to nearest even; overflow carries into the exponent and lands on
  // inf exactly when IEEE says it should.  NaN must not be rounded (it could
  // carry into inf or the sign), so it is truncated and made quiet.  Shift
  // once after the select, for the same reason as in f2h.
  uint32_t r = f != f ? (u | 0x400000u) : u + 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(r >> 16);
}

// ---- element types: how a stored element becomes a value to compute with --
// Store: the bytes in memory; Value: what ops combine; Divisor: what loomAvg
// divides by (integers divide in 64 bits so any rank count is exact).

template <class T, bool = std::is_integral<T>::value>
struct DivisorOf {
  using type = T;
};
template <class T>
struct DivisorOf<T, true> {
  using type = typename std::conditional<std::is_signed<T>::value, int64_t, uint64_t>::type;
};

template <class T>
struct Plain {
  using Store = T;
  using Value = T;
  using Divisor = typename DivisorOf<T>::type;
  static LOOM_HD_INLINE T load(T x) { return x; }
  static LOOM_HD_INLINE T save(T x) { return x; }
};
struct Half {
  using Store = uint16_t;
  using Value = float;
  using Divisor = float;
  static LOOM_HD_INLINE float load(uint16_t x) { return h2f(x); }
  static LOOM_HD_INLINE uint16_t save(float x) { return f2h(x); }
};
struct BF16 {
  using Store = uint16_t;
  using Value = float;
  using Divisor = float;
  static LOOM_HD_INLINE float load(uint16_t x) { return bf2f(x); }
  static LOOM_HD_INLINE uint16_t save(float x) { return f2bf(x); }
};

// The element type of each loomDataType_t.
template <int Type>
struct ElemOf;
template <> struct ElemOf<loomInt8> { using type = Plain<int8_t>; };
template <> struct ElemOf<loomUint8> { using type = Plain<uint8_t>; };
template <> struct ElemOf<loomInt32> { using type = Plain<int32_t>; };
template <> struct ElemOf<loomUint32> { using type = Plain<uint32_t>; };
template <> struct ElemOf<loomInt64> { using type = Plain<int64_t>; };
template <> struct ElemOf<loomUint64> { using type = Plain<uint64_t>; };
template <> struct ElemOf<loomFloat16> { using type = Half; };
template <> struct ElemOf<loomFloat32> { using type = Plain<float>; };
template <> struct ElemOf<loomFloat64> { using type = Plain<double>; };
template <> struct ElemOf<loomBfloat16> { using type = BF16; };

// Calls f(Ty{}) with the element type of `type` (host code: the host kernels'
// and the CUDA launchers' dispatch); `unknown` for a type loom does not have.
template <class R, class F>
R withElem(int type, F f, R unknown) {
  switch (type) {
    case loomInt8: return f(typename ElemOf<loomInt8>::type{});
    case loomUint8: return f(typename ElemOf<loomUint8>::type{});
    case loomInt32: return f(typename ElemOf<loomInt32>::type{});
    case loomUint32: return f(typename ElemOf<loomUint32>::type{});
    case loomInt64: return f(typename ElemOf<loomInt64>::type{});
    case loomUint64: return f(typename ElemOf<loomUint64>::type{});
    case loomFloat16: return f(typename ElemOf<loomFloat16>::type{});
    case loomBfloat16: return f(typename ElemOf<loomBfloat16>::type{});
    case loomFloat32: return f(typename ElemOf<loomFloat32>::type{});
    case loomFloat64: return f(typename ElemOf<loomFloat64>::type{});
    default: return unknown;
  }
}

// ---- ops ------------------------------------------------------------------
// Integer sum/prod are done in an unsigned type so overflow wraps instead of
// being UB; unsigned int (not the narrow type) avoids promotion to signed int.
// apply() also accepts GCC vector types (the host's F16C path).  It takes
// references because a 32-byte vector passed by value to a non-AVX function
// draws a -Wpsabi note that no pragma silences; inlined, it costs nothing.

template <class T, bool = std::is_integral<T>::value>
struct WideOf {
  using type = T;
};
template <class T>
struct WideOf<T, true> {
  using type = typename std::conditional<(sizeof(T) < sizeof(unsigned)), unsigned,
                                         typename std::make_unsigned<T>::type>::type;
};
template <class T>
using Wide = typename WideOf<T>::type;

struct Sum {
  template <class T>
  static LOOM_HD_INLINE void apply(const T& a, const T& b, T& r) {
    r = T(Wide<T>(a) + Wide<T>(b));
  }
};
struct Prod {
  template <class T>
  static LOOM_HD_INLINE void apply(const T& a, const T& b, T& r) {
    r = T(Wide<T>(a) * Wide<T>(b));
  }
};
// Max/min propagate NaN: if either operand is NaN the result is NaN (like
// IEEE 754-2019 maximum/minimum, not fmax, which would drop it).  A rank
// with a NaN gradient should poison the result, not vanish.  For integers
// a != a is false and folds away.  Between +0 and -0 either may be returned.
struct Max {
  template <class T>
  static LOOM_HD_INLINE void apply(const T& a, const T& b, T& r) {
    T m = a > b ? a : b;  // b if b is NaN
    r = a != a ? a : m;
  }
};
struct Min {
  template <class T>
  static LOOM_HD_INLINE void apply(const T& a, const T& b, T& r) {
    T m = a < b ? a : b;
    r = a != a ? a : m;
  }
};

// The op of each loomRedOp_t during combining (avg combines as sum).
template <int Op>
struct OpOf;
template <> struct OpOf<loomSum> { using type = Sum; };
template <> struct OpOf<loomProd> { using type = Prod; };
template <> struct OpOf<loomMax> { using type = Max; };
template <> struct OpOf<loomMin> { using type = Min; };
template <> struct OpOf<loomAvg> { using type = Sum; };

template <class Op, class T>
LOOM_HD_INLINE T combine(T a, T b) {
  T r;
  Op::apply(a, b, r);
  return r;
}

// One stored element of a op b, rounded once.
template <class Ty, class Op>
LOOM_HD_INLINE typename Ty::Store reduce(typename Ty::Store a, typename Ty::Store b) {
  return Ty::save(combine<Op>(Ty::load(a), Ty::load(b)));
}

// One stored element times k (loomScale): one step of loom's product, so
// host and device agree bit for bit.
template <class Ty>
LOOM_HD_INLINE typename Ty::Store scaleElement(typename Ty::Store x, typename Ty::Store k) {
  return reduce<Ty, Prod>(x, k);
}

// One stored element divided by q (loomAvg's last step): integers truncate
// toward zero, float16/bfloat16 divide in float32 and round once.  q > 0.
template <class Ty>
LOOM_HD_INLINE typename Ty::Store divide(typename Ty::Store x, typename Ty::Divisor q) {
  using V = typename Ty::Value;
  using D = typename Ty::Divisor;
  return Ty::save(V(D(Ty::load(x)) / q));
}

// A grid-stride share (this thread: first, first + step, ...) of copying
// `bytes` from src to dst, which lie alike modulo sizeof(W): the bytes up to
// dst's first W boundary, then whole Ws, then the rest.  The device copy
// kernel (reduce_kernels.cu, copyBytes) picks the widest W the two
// addresses allow; tests/unit_cuda.cc runs it here for every alignment.
template <class W>
LOOM_HD_INLINE void copyWords(uint8_t* dst, const uint8_t* src, size_t bytes, size_t first, size_t step) {
  constexpr uintptr_t m = sizeof(W) - 1;
  size_t head = size_t((sizeof(W) - (reinterpret_cast<uintptr_t>(dst) & m)) & m);
  if (head > bytes) head = bytes;
  for (size_t i = first; i < head; i += step) dst[i] = src[i];
  const size_t nw = (bytes - head) / sizeof(W);
  W* dw = reinterpret_cast<W*>(dst + head);
  const W* sw = reinterpret_cast<const W*>(src + head);
  for (size_t i = first; i < nw; i += step) dw[i] = sw[i];
  for (size_t i = head + nw * sizeof(W) + first; i < bytes; i += step) dst[i] = src[i];
}

// The copy kernel's share of `bytes` from src to dst, in the widest words
// the two addresses allow once aligned alike: 16 bytes (W16, uint4 on the
// device) when they agree modulo 16, down to single bytes only when one is
// odd and the other even.
template <class W16>
LOOM_HD_INLINE void copyShare(uint8_t* dst, const uint8_t* src, size_t bytes, size_t first, size_t step) {
  const uintptr_t apart = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((apart & 15) == 0)
    copyWords<W16>(dst, src, bytes, first, step);
  else if ((apart & 7) == 0)
    copyWords<uint64_t>(dst, src, bytes, first, step);
  else if ((apart & 3) == 0)
    copyWords<uint32_t>(dst, src, bytes, first, step);
  else if ((apart & 1) == 0)
    copyWords<uint16_t>(dst, src, bytes, first, step);
  else
    copyWords<uint8_t>(dst, src, bytes, first, step);
}

}  // namespace elementwise
}  // namespace loom
