// Host reduction kernels against plain scalar references: every type x op,
// aliasing and alignment shapes, both ISA paths, and the float16/bfloat16
// conversions (exhaustive where 2^16 allows it).
#include <algorithm>
#include "loom_catch.h"
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../src/device/host_reduce.h"

namespace loom {
namespace detail {
void hostReduceForceGeneric(bool on);  // defined in host_reduce.cc (test hook)
}
}  // namespace loom

namespace {

using loom::bf16ToFloat;
using loom::floatToBf16;
using loom::floatToHalf;
using loom::halfToFloat;

const loomDataType_t kTypes[] = {loomInt8,    loomUint8,   loomInt32,   loomUint32,  loomInt64,
                                 loomUint64,  loomFloat16, loomBfloat16, loomFloat32, loomFloat64};
const loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

// Runs the body once on the best ISA and once forced to the baseline one.
struct ForceGeneric {
  explicit ForceGeneric(bool on) { loom::detail::hostReduceForceGeneric(on); }
  ~ForceGeneric() { loom::detail::hostReduceForceGeneric(false); }
};

uint32_t bitsOf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
float floatOf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ---- independent references for the 16-bit formats ------------------------

struct Format {
  int mantBits;          // 10 for float16, 7 for bfloat16
  int expBits;           // 5, 8
  uint16_t maxFinite;    // 0x7bff, 0x7f7f
  uint16_t inf;          // 0x7c00, 0x7f80
};
const Format kHalf{10, 5, 0x7bff, 0x7c00};
const Format kBf16{7, 8, 0x7f7f, 0x7f80};

// Exact value of a bit pattern, by the textbook formula.
double decodeRef(const Format& f, uint16_t h) {
  int bias = (1 << (f.expBits - 1)) - 1;
  int e = (h >> f.mantBits) & ((1 << f.expBits) - 1);
  int m = h & ((1 << f.mantBits) - 1);
  double v;
  if (e == (1 << f.expBits) - 1) v = m ? std::nan("") : INFINITY;
  else if (e == 0) v = std::ldexp(m, 1 - bias - f.mantBits);
  else v = std::ldexp((1 << f.mantBits) + m, e - bias - f.mantBits);
  return (h & 0x8000) ? -v : v;
}

bool isNanBits(const Format& f, uint16_t h) { return (h & 0x7fff) > f.inf; }

// Nearest representable value, ties to the even pattern, by searching the
// table of all non-negative finite values (which are sorted by pattern).
uint16_t encodeRef(const Format& f, double x) {
  static std::vector<double> half, bf;
  std::vector<double>& tab = (&f == &kHalf) ? half : bf;
  if (tab.empty())
    for (uint32_t h = 0; h <= f.maxFinite; ++h) tab.push_back(decodeRef(f, uint16_t(h)));
  if (std::isnan(x)) return uint16_t(f.inf | 1);  // any NaN; callers compare NaN-ness
  uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  double a = std::fabs(x);
  double maxv = tab.back(), limit = maxv + (maxv - tab[tab.size() - 2]) / 2;
  if (a >= limit) return sign | f.inf;  // the tie at limit goes to inf (maxFinite is odd)
  size_t hi = std::lower_bound(tab.begin(), tab.end(), a) - tab.begin();
  if (hi == tab.size()) hi = tab.size() - 1;
  size_t lo = hi ? hi - 1 : 0, pick;
  double dlo = a - tab[lo], dhi = tab[hi] - a;
  if (tab[hi] == a) pick = hi;
  else if (dlo < dhi) pick = lo;
  else if (dhi < dlo) pick = hi;
  else pick = (lo % 2 == 0) ? lo : hi;
  return uint16_t(sign | pick);
}

// ---- scalar reference for reduceHost --------------------------------------

template <class T>
T refOp(loomRedOp_t op, T a, T b) {
  if constexpr (std::is_integral<T>::value) {
    // Wide unsigned arithmetic, then truncate: two's complement wrap.
    uint64_t ua = uint64_t(a), ub = uint64_t(b);
    switch (op) {
      case loomSum:
      case loomAvg: return T(ua + ub);
      case loomProd: return T(ua * ub);
      case loomMax: return std::max(a, b);
      default: return std::min(a, b);
    }
  }
  if (std::isnan(double(a)) || std::isnan(double(b))) return std::numeric_limits<T>::quiet_NaN();
  switch (op) {
    case loomSum:
    case loomAvg: return a + b;
    case loomProd: return a * b;
    case loomMax: return std::max(a, b);
    default: return std::min(a, b);
  }
}

// Same value, or both NaN, or both zeros from max/min (either sign allowed).
template <class T>
bool sameResult(T got, T want, loomRedOp_t op) {
  if (memcmp(&got, &want, sizeof(T)) == 0) return true;
  if (std::is_integral<T>::value) return false;
  double g = double(got), w = double(want);
  if (std::isnan(g) && std::isnan(w)) return true;
  return (op == loomMax || op == loomMin) && g == 0 && w == 0;
}

bool sameResult16(const Format& f, uint16_t got, uint16_t want, loomRedOp_t op) {
  if (got == want) return true;
  if (isNanBits(f, got) && isNanBits(f, want)) return true;
  return (op == loomMax || op == loomMin) && (got & 0x7fff) == 0 && (want & 0x7fff) == 0;
}

// Random bytes, with special float values planted so every NaN/inf/zero/
// subnormal combination shows up in a reduction of ~1000 elements.
std::vector<uint8_t> randomBytes(loomDataType_t t, size_t n, std::mt19937_64& rng) {
  size_t esz = loom::dtypeSize(t);
  std::vector<uint8_t> v(n * esz);
  for (auto& b : v) b = uint8_t(rng());
  auto put = [&](size_t i, uint64_t bits) { memcpy(&v[i * esz], &bits, esz); };
  static const uint64_t s32[] = {0x7fc00000, 0xff800001, 0x7f800000, 0xff800000, 0, 0x80000000,
                                 1,          0x80000001, 0x3f800000, 0x7f7fffff, 0x00800000};
  static const uint64_t s64[] = {0x7ff8000000000000, 0x7ff0000000000000, 0xfff0000000000000,
                                 0x8000000000000000, 0, 1, 0x3ff0000000000000,
                                 0x7fefffffffffffff};
  static const uint64_t s16[] = {0x7e00, 0x7c01, 0x7c00, 0xfc00, 0, 0x8000, 1, 0x8001, 0x3c00,
                                 0x7bff, 0x7f80, 0xff80, 0x7fc0, 0x7f7f, 0x0400};
  for (size_t i = 0; i < n; ++i) {
    if (rng() % 4) continue;
    if (t == loomFloat32) put(i, s32[rng() % 11]);
    else if (t == loomFloat64) put(i, s64[rng() % 8]);
    else if (t == loomFloat16 || t == loomBfloat16) put(i, s16[rng() % 15]);
  }
  // Keep float32/float64 magnitudes mostly moderate so sums and products
  // are not all inf or zero.
  if (t == loomFloat32)
    for (size_t i = 0; i < n; ++i)
      if (rng() % 2) {
        float x = float(int64_t(rng() % 2001) - 1000) / 8;
        memcpy(&v[i * 4], &x, 4);
      }
  if (t == loomFloat64)
    for (size_t i = 0; i < n; ++i)
      if (rng() % 2) {
        double x = double(int64_t(rng() % 2001) - 1000) / 8;
        memcpy(&v[i * 8], &x, 8);
      }
  return v;
}

template <class T>
T at(const uint8_t* p, size_t i) {
  T x;
  memcpy(&x, p + i * sizeof(T), sizeof(T));
  return x;
}

template <class T>
bool checkPlain(const uint8_t* a, const uint8_t* b, const uint8_t* got, size_t n, loomRedOp_t op,
                size_t* bad) {
  for (size_t i = 0; i < n; ++i)
    if (!sameResult(at<T>(got, i), refOp(op, at<T>(a, i), at<T>(b, i)), op)) return *bad = i, false;
  return true;
}

bool check16(const Format& f, const uint8_t* a, const uint8_t* b, const uint8_t* got, size_t n,
             loomRedOp_t op, size_t* bad) {
  for (size_t i = 0; i < n; ++i) {
    // The spec: operands to float32, combine in float32, round once.
    float x = float(decodeRef(f, at<uint16_t>(a, i))), y = float(decodeRef(f, at<uint16_t>(b, i)));
    uint16_t want = encodeRef(f, double(refOp(op, x, y)));
    if (!sameResult16(f, at<uint16_t>(got, i), want, op)) return *bad = i, false;
  }
  return true;
}

// got = a op b, elementwise, checked against the scalar reference.
bool matchesReference(loomDataType_t t, loomRedOp_t op, const uint8_t* a, const uint8_t* b,
                      const uint8_t* got, size_t n, size_t* bad) {
  switch (t) {
    case loomInt8: return checkPlain<int8_t>(a, b, got, n, op, bad);
    case loomUint8: return checkPlain<uint8_t>(a, b, got, n, op, bad);
    case loomInt32: return checkPlain<int32_t>(a, b, got, n, op, bad);
    case loomUint32: return checkPlain<uint32_t>(a, b, got, n, op, bad);
    case loomInt64: return checkPlain<int64_t>(a, b, got, n, op, bad);
    case loomUint64: return checkPlain<uint64_t>(a, b, got, n, op, bad);
    case loomFloat16: return check16(kHalf, a, b, got, n, op, bad);
    case loomBfloat16: return check16(kBf16, a, b, got, n, op, bad);
    case loomFloat32: return checkPlain<float>(a, b, got, n, op, bad);
    case loomFloat64: return checkPlain<double>(a, b, got, n, op, bad);
    default: return false;
  }
}

}  // namespace

TEST_CASE("dtypeSize, dtypeName and redOpName cover every enum value and reject others",
          "[reduce]") {
  const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 2, 4, 8};
  const char* names[] = {"int8",   "uint8",   "int32",    "uint32",  "int64",
                         "uint64", "float16", "bfloat16", "float32", "float64"};
  for (int i = 0; i < 10; ++i) {
    CHECK(loom::dtypeSize(kTypes[i]) == sizes[i]);
    CHECK(std::string(loom::dtypeName(kTypes[i])) == names[i]);
  }
  CHECK(loom::dtypeSize(loomDataType_t(loomNumTypes)) == 0);
  CHECK(loom::dtypeSize(loomDataType_t(-1)) == 0);
  CHECK(std::string(loom::dtypeName(loomDataType_t(loomNumTypes))) == "?");
  CHECK(std::string(loom::dtypeName(loomDataType_t(-1))) == "?");
  const char* ops[] = {"sum", "prod", "max", "min", "avg"};
  for (int i = 0; i < 5; ++i) CHECK(std::string(loom::redOpName(kOps[i])) == ops[i]);
  CHECK(std::string(loom::redOpName(loomRedOp_t(loomNumOps))) == "?");
  CHECK(std::string(loom::redOpName(loomRedOp_t(-3))) == "?");
}

TEST_CASE("float16 decodes every one of the 65536 patterns exactly and re-encodes to itself",
          "[reduce]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = halfToFloat(uint16_t(h));
    double want = decodeRef(kHalf, uint16_t(h));
    uint16_t back = floatToHalf(f);
    if (isNanBits(kHalf, uint16_t(h))) {
      INFO("pattern " << h);
      REQUIRE(std::isnan(f));
      REQUIRE(isNanBits(kHalf, back));       // NaN stays NaN ...
      REQUIRE((back & 0x8000) == (h & 0x8000));  // ... with its sign
      REQUIRE((back & 0x0200) != 0);         // ... and comes back quiet
      REQUIRE((back & 0x1ff) == (h & 0x1ff));  // ... keeping the payload
    } else {
      INFO("pattern " << h);
      REQUIRE(double(f) == want);
      REQUIRE(std::signbit(f) == bool(h & 0x8000));
      REQUIRE(back == h);
    }
  }
}

TEST_CASE("bfloat16 decodes every one of the 65536 patterns exactly and re-encodes to itself",
          "[reduce]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16ToFloat(uint16_t(h));
    uint16_t back = floatToBf16(f);
    INFO("pattern " << h);
    REQUIRE(bitsOf(f) == h << 16);
    if (isNanBits(kBf16, uint16_t(h))) {
      REQUIRE(std::isnan(f));
      REQUIRE(isNanBits(kBf16, back));
      REQUIRE(back == (h | 0x40));  // quieted, sign and payload kept
    } else {
      REQUIRE(double(f) == decodeRef(kBf16, uint16_t(h)));
      REQUIRE(back == h);
    }
  }
}

TEST_CASE("float16 and bfloat16 encoders round halfway cases to even, and neighbours away",
          "[reduce]") {
  for (const Format* f : {&kHalf, &kBf16}) {
    auto enc = [&](float x) { return f == &kHalf ? floatToHalf(x) : floatToBf16(x); };
    // Every pair of adjacent finite values, including subnormals, zero, and
    // maxFinite -> inf (whose midpoint must round up to inf).
    for (uint32_t h = 0; h <= f->maxFinite; ++h) {
      INFO("between " << h << " and " << h + 1);
      double lo = decodeRef(*f, uint16_t(h));
      double hi = h == f->maxFinite ? std::ldexp(1.0, f == &kHalf ? 16 : 128)  // next power of 2
                                    : decodeRef(*f, uint16_t(h + 1));
      float mid = float((lo + hi) / 2);  // exact: one more bit than the format has
      REQUIRE(double(mid) == (lo + hi) / 2);
      uint16_t even = (h % 2 == 0) ? uint16_t(h) : uint16_t(h + 1);
      REQUIRE(enc(mid) == even);
      REQUIRE(enc(-mid) == (even | 0x8000));
      REQUIRE(enc(std::nextafter(mid, 0.0f)) == h);
      REQUIRE(enc(std::nextafter(mid, INFINITY)) == h + 1);
    }
  }
}

TEST_CASE("float16 and bfloat16 encoders match a nearest-value search on many floats",
          "[reduce]") {
  // Every sign/exponent/top-10-mantissa combination, with the bits that
  // decide rounding set to just-below, exactly, and just-above half.
  const uint32_t halfLow[] = {0, 1, 0x0fff, 0x1000, 0x1001, 0x1fff};
  for (uint32_t top = 0; top < (1u << 19); ++top)
    for (uint32_t low : halfLow) {
      float x = floatOf(top << 13 | low);
      uint16_t got = floatToHalf(x), want = encodeRef(kHalf, x);
      if (got != want && !(std::isnan(x) && isNanBits(kHalf, got))) {
        INFO("float bits " << (top << 13 | low));
        REQUIRE(got == want);
      }
    }
  const uint32_t bfLow[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff};
  for (uint32_t top = 0; top < (1u << 16); ++top)
    for (uint32_t low : bfLow) {
      float x = floatOf(top << 16 | low);
      uint16_t got = floatToBf16(x), want = encodeRef(kBf16, x);
      if (got != want && !(std::isnan(x) && isNanBits(kBf16, got))) {
        INFO("float bits " << (top << 16 | low));
        REQUIRE(got == want);
      }
    }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    float x = floatOf(uint32_t(rng()));
    if (std::isnan(x)) continue;
    INFO("float bits " << bitsOf(x));
    REQUIRE(floatToHalf(x) == encodeRef(kHalf, x));
    REQUIRE(floatToBf16(x) == encodeRef(kBf16, x));
  }
}

TEST_CASE("float16 and bfloat16 encoders handle overflow, underflow, signed zero and NaN",
          "[reduce]") {
  CHECK(floatToHalf(65504.0f) == 0x7bff);
  CHECK(floatToHalf(std::nextafter(65520.0f, 0.0f)) == 0x7bff);
  CHECK(floatToHalf(65520.0f) == 0x7c00);  // halfway to 2^16 rounds to inf
  CHECK(floatToHalf(1e10f) == 0x7c00);
  CHECK(floatToHalf(-1e10f) == 0xfc00);
  CHECK(floatToHalf(INFINITY) == 0x7c00);
  CHECK(floatToHalf(std::ldexp(1.0f, -25)) == 0x0000);  // tie between 0 and 2^-24: even
  CHECK(floatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(floatToHalf(std::ldexp(3.0f, -25)) == 0x0002);  // tie between 1 and 2 ulps: even
  CHECK(floatToHalf(std::ldexp(1.0f, -14)) == 0x0400);  // smallest normal
  CHECK(floatToHalf(std::ldexp(1023.5f, -24)) == 0x0400);  // rounds up out of subnormals
  CHECK(floatToHalf(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(floatToHalf(-0.0f) == 0x8000);
  CHECK(floatToBf16(floatOf(0x7f7f8000)) == 0x7f80);  // halfway past max: inf
  CHECK(floatToBf16(floatOf(0x7f7f7fff)) == 0x7f7f);
  CHECK(floatToBf16(floatOf(0x00018000)) == 0x0002);  // subnormal tie to even
  CHECK(floatToBf16(floatOf(0xffffffff)) == 0xffff);  // NaN with all-ones payload stays NaN
  CHECK(floatToBf16(floatOf(0x7f800001)) == 0x7fc0);  // sNaN whose payload truncates away
}

TEST_CASE("reduceHost matches a scalar reference for every type, op, n, alias and alignment",
          "[reduce]") {
  std::mt19937_64 rng(1234);
  const size_t counts[] = {0, 1, 2, 7, 8, 9, 33, 1027};
  for (bool generic : {false, true}) {
    ForceGeneric force(generic);
    for (loomDataType_t t : kTypes)
      for (loomRedOp_t op : kOps)
        for (size_t n : counts)
          for (size_t misalign : {size_t(0), size_t(1), loom::dtypeSize(t)})
            for (int alias = 0; alias < 4; ++alias) {  // none, dst==a, dst==b, dst==a==b
              size_t bytes = n * loom::dtypeSize(t);
              std::vector<uint8_t> a = randomBytes(t, n, rng), b = randomBytes(t, n, rng);
              if (alias == 3) b = a;
              // Separate heap blocks, each used at a byte offset, so the
              // kernel sees pointers that are not element-aligned.
              std::vector<uint8_t> ba(bytes + 16), bb(bytes + 16), bd(bytes + 16, 0xAB);
              uint8_t* pa = ba.data() + misalign;
              uint8_t* pb = bb.data() + misalign;
              uint8_t* pd = bd.data() + misalign;
              if (bytes) {  // memcpy's pointers must be valid even for 0 bytes
                memcpy(pa, a.data(), bytes);
                memcpy(pb, b.data(), bytes);
              }
              if (alias == 1) pd = pa;
              if (alias == 2) pd = pb;
              if (alias == 3) pd = pb = pa;
              loom::reduceHost(pd, pa, pb, n, t, op);
              size_t bad = 0;
              INFO(loom::dtypeName(t) << " " << loom::redOpName(op) << " n=" << n << " misalign="
                                      << misalign << " alias=" << alias << " generic=" << generic);
              bool ok = matchesReference(t, op, a.data(), b.data(), pd, n, &bad);
              INFO("first wrong element " << bad);
              REQUIRE(ok);
              // Nothing written past the end (only checkable in our own dst).
              if (alias == 0) REQUIRE(bd[misalign + bytes] == 0xAB);
            }
  }
}

// got and want agree element by element as the reference checks do (any NaN
// for a NaN: the vector and scalar paths may carry different payloads; either
// zero for max/min of zeros).
bool sameElements(loomDataType_t t, loomRedOp_t op, const uint8_t* got, const uint8_t* want, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    bool same = true;
    switch (t) {
      case loomFloat16: same = sameResult16(kHalf, at<uint16_t>(got, i), at<uint16_t>(want, i), op); break;
      case loomBfloat16: same = sameResult16(kBf16, at<uint16_t>(got, i), at<uint16_t>(want, i), op); break;
      case loomFloat32: same = sameResult(at<float>(got, i), at<float>(want, i), op); break;
      case loomFloat64: same = sameResult(at<double>(got, i), at<double>(want, i), op); break;
      default: {
        size_t esz = loom::dtypeSize(t);
        same = memcmp(got + i * esz, want + i * esz, esz) == 0;
      }
    }
    if (!same) return false;
  }
  return true;
}

TEST_CASE("hostReduceSmallFn gives reduceHost's values for every type, op, n and alias", "[reduce]") {
  std::mt19937_64 rng(99);
  for (bool generic : {false, true}) {
    ForceGeneric force(generic);
    for (loomDataType_t t : kTypes)
      for (loomRedOp_t op : kOps) {
        loom::HostReduceFn fn = loom::hostReduceSmallFn(t, op);
        REQUIRE(fn != nullptr);
        for (size_t n : {size_t(1), size_t(2), size_t(3), size_t(4), size_t(8), size_t(16)})
          for (int alias = 0; alias < 3; ++alias) {  // none, dst==a, dst==b
            const size_t bytes = n * loom::dtypeSize(t);
            std::vector<uint8_t> a = randomBytes(t, n, rng), b = randomBytes(t, n, rng);
            std::vector<uint8_t> want(bytes), got(bytes + 1, 0xAB);
            loom::reduceHost(want.data(), a.data(), b.data(), n, t, op);
            uint8_t* d = alias == 1 ? a.data() : alias == 2 ? b.data() : got.data();
            fn(d, a.data(), b.data(), n);
            INFO(loom::dtypeName(t) << " " << loom::redOpName(op) << " n=" << n << " alias=" << alias
                                    << " generic=" << generic);
            REQUIRE(sameElements(t, op, d, want.data(), n));
            REQUIRE(got[bytes] == 0xAB);
          }
      }
  }
  CHECK(loom::hostReduceSmallFn(loomDataType_t(loomNumTypes), loomSum) == nullptr);
  CHECK(loom::hostReduceSmallFn(loomInt32, loomRedOp_t(loomNumOps)) == nullptr);
}

TEST_CASE("reduceHost with n = 0 touches nothing, even through null pointers", "[reduce]") {
  for (loomDataType_t t : kTypes)
    for (loomRedOp_t op : kOps) loom::reduceHost(nullptr, nullptr, nullptr, 0, t, op);
  uint8_t d[8] = {1, 2, 3, 4, 5, 6, 7, 8}, a[8] = {}, b[8] = {};
  loom::reduceHost(d, a, b, 0, loomInt8, loomSum);
  CHECK(d[0] == 1);
}

TEST_CASE("reduceHost ignores an unknown type or op", "[reduce]") {
  int32_t d[4] = {9, 9, 9, 9}, a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 3, 4};
  loom::reduceHost(d, a, b, 4, loomDataType_t(loomNumTypes), loomSum);
  loom::reduceHost(d, a, b, 4, loomInt32, loomRedOp_t(loomNumOps));
  CHECK(d[0] == 9);
  CHECK(d[3] == 9);
}

TEST_CASE("integer sum and prod wrap around in two's complement", "[reduce]") {
  int8_t i8a[3] = {127, -128, -128}, i8b[3] = {1, -1, -1}, i8d[3];
  loom::reduceHost(i8d, i8a, i8b, 3, loomInt8, loomSum);
  CHECK(i8d[0] == -128);
  CHECK(i8d[1] == 127);
  loom::reduceHost(i8d, i8a, i8b, 3, loomInt8, loomProd);
  CHECK(i8d[1] == -128);  // -128 * -1 has no int8 value; it wraps to itself

  uint8_t u8a[2] = {255, 16}, u8b[2] = {1, 16}, u8d[2];
  loom::reduceHost(u8d, u8a, u8b, 2, loomUint8, loomSum);
  CHECK(u8d[0] == 0);
  loom::reduceHost(u8d, u8a, u8b, 2, loomUint8, loomProd);
  CHECK(u8d[1] == 0);

  int32_t i32a[2] = {INT32_MAX, INT32_MIN}, i32b[2] = {1, -1}, i32d[2];
  loom::reduceHost(i32d, i32a, i32b, 2, loomInt32, loomSum);
  CHECK(i32d[0] == INT32_MIN);
  CHECK(i32d[1] == INT32_MAX);
  loom::reduceHost(i32d, i32a, i32b, 2, loomInt32, loomAvg);  // avg reduces as sum
  CHECK(i32d[0] == INT32_MIN);

  int64_t i64a[2] = {INT64_MAX, INT64_MIN}, i64b[2] = {2, -1}, i64d[2];
  loom::reduceHost(i64d, i64a, i64b, 2, loomInt64, loomProd);
  CHECK(i64d[0] == -2);
  CHECK(i64d[1] == INT64_MIN);

  uint64_t u64a[1] = {UINT64_MAX}, u64d[1];
  loom::reduceHost(u64d, u64a, u64a, 1, loomUint64, loomProd);
  CHECK(u64d[0] == 1);
  loom::reduceHost(u64d, u64a, u64a, 1, loomUint64, loomSum);
  CHECK(u64d[0] == UINT64_MAX - 1);
}

TEST_CASE("float max and min propagate NaN from either operand, for all float types",
          "[reduce]") {
  const float nan = std::nanf("");
  for (loomRedOp_t op : {loomMax, loomMin}) {
    float fa[2] = {nan, 1.0f}, fb[2] = {1.0f, nan}, fd[2];
    loom::reduceHost(fd, fa, fb, 2, loomFloat32, op);
    CHECK(std::isnan(fd[0]));
    CHECK(std::isnan(fd[1]));
    double da[2] = {double(nan), -1.0}, db[2] = {-1.0, double(nan)}, dd[2];
    loom::reduceHost(dd, da, db, 2, loomFloat64, op);
    CHECK(std::isnan(dd[0]));
    CHECK(std::isnan(dd[1]));
    uint16_t ha[2] = {0x7e00, 0x3c00}, hb[2] = {0x3c00, 0xfe00}, hd[2];
    loom::reduceHost(hd, ha, hb, 2, loomFloat16, op);
    CHECK(isNanBits(kHalf, hd[0]));
    CHECK(isNanBits(kHalf, hd[1]));
    uint16_t ba[2] = {0x7fc0, 0x3f80}, bb[2] = {0x3f80, 0xffc0}, bd[2];
    loom::reduceHost(bd, ba, bb, 2, loomBfloat16, op);
    CHECK(isNanBits(kBf16, bd[0]));
    CHECK(isNanBits(kBf16, bd[1]));
  }
}

TEST_CASE("float16 and bfloat16 reductions round once per combine and overflow to inf",
          "[reduce]") {
  // 2048 + 1 is exactly between float16 2048 and 2050: ties to even, 2048.
  uint16_t a[3] = {floatToHalf(2048.0f), floatToHalf(2048.0f), 0x7bff};
  uint16_t b[3] = {floatToHalf(1.0f), floatToHalf(3.0f), 0x7bff}, d[3];
  loom::reduceHost(d, a, b, 3, loomFloat16, loomSum);
  CHECK(halfToFloat(d[0]) == 2048.0f);
  CHECK(halfToFloat(d[1]) == 2052.0f);  // 2051 is a tie too: to even 2052
  CHECK(d[2] == 0x7c00);                // 65504 + 65504 overflows
  // bfloat16: 256 + 1 is a tie between 256 and 258.
  uint16_t x[1] = {floatToBf16(256.0f)}, y[1] = {floatToBf16(1.0f)}, z[1];
  loom::reduceHost(z, x, y, 1, loomBfloat16, loomSum);
  CHECK(bf16ToFloat(z[0]) == 256.0f);
}

TEST_CASE("divideHost truncates integers toward zero and rounds floats once", "[reduce]") {
  for (bool inPlace : {false, true}) {
    int32_t i32[4] = {-7, 7, INT32_MIN, 1}, i32d[4];
    int32_t* out = inPlace ? i32 : i32d;
    loom::divideHost(out, i32, 4, loomInt32, 2);
    CHECK(out[0] == -3);
    CHECK(out[1] == 3);
    CHECK(out[2] == INT32_MIN / 2);
    CHECK(out[3] == 0);

    int8_t i8[2] = {-128, 127};  // divisor wider than the type
    loom::divideHost(i8, i8, 2, loomInt8, 200);
    CHECK(i8[0] == 0);
    uint8_t u8[2] = {255, 199}, u8d[2];
    loom::divideHost(inPlace ? u8 : u8d, u8, 2, loomUint8, 200);
    CHECK((inPlace ? u8 : u8d)[0] == 1);
    CHECK((inPlace ? u8 : u8d)[1] == 0);

    int64_t i64[1] = {INT64_MIN};
    uint64_t u64[1] = {UINT64_MAX};
    loom::divideHost(i64, i64, 1, loomInt64, 3);
    loom::divideHost(u64, u64, 1, loomUint64, 3);
    CHECK(i64[0] == INT64_MIN / 3);
    CHECK(u64[0] == UINT64_MAX / 3);
  }

  float f[3] = {1.0f, -10.0f, std::nanf("")}, fd[3];
  loom::divideHost(fd, f, 3, loomFloat32, 3);
  CHECK(fd[0] == 1.0f / 3.0f);
  CHECK(fd[1] == -10.0f / 3.0f);
  CHECK(std::isnan(fd[2]));
  double dd[1] = {1.0};
  loom::divideHost(dd, dd, 1, loomFloat64, 3);
  CHECK(dd[0] == 1.0 / 3.0);

  // float16/bfloat16: every pattern, divided in float32, rounded once.
  const int divisors[] = {2, 3, 7};
  std::vector<uint16_t> all(65536), out(65536);
  for (uint32_t h = 0; h < 65536; ++h) all[h] = uint16_t(h);
  size_t wrong = 0;
  for (int dv : divisors)
    for (const Format* fm : {&kHalf, &kBf16}) {
      loomDataType_t t = fm == &kHalf ? loomFloat16 : loomBfloat16;
      loom::divideHost(out.data(), all.data(), 65536, t, dv);
      for (uint32_t h = 0; h < 65536; ++h) {
        uint16_t want = encodeRef(*fm, double(float(decodeRef(*fm, uint16_t(h))) / float(dv)));
        if (sameResult16(*fm, out[h], want, loomSum)) continue;
        if (++wrong < 5) FAIL_CHECK(loom::dtypeName(t) << " pattern " << h << " / " << dv);
      }
    }
  CHECK(wrong == 0);
}

TEST_CASE("divideHost by 1 or by a non-positive divisor copies instead of dividing", "[reduce]") {
  int32_t s[2] = {INT32_MIN, 5}, d[2] = {0, 0};
  loom::divideHost(d, s, 2, loomInt32, 1);
  CHECK(d[0] == INT32_MIN);
  d[1] = 0;
  loom::divideHost(d, s, 2, loomInt32, 0);  // no division by zero
  CHECK(d[1] == 5);
  loom::divideHost(s, s, 2, loomInt32, -1);  // no INT32_MIN / -1
  CHECK(s[0] == INT32_MIN);
  loom::divideHost(nullptr, nullptr, 0, loomFloat32, 4);
}

TEST_CASE("scaleHost (loomScale, the device kernel's arithmetic) is one step of loomProd by the scalar: integers "
          "wrap, float16/bfloat16 multiply in float32 and round once, in and out of place",
          "[reduce]") {
  std::mt19937_64 rng(42);
  for (loomDataType_t t : kTypes) {
    INFO(loom::dtypeName(t));
    const size_t esz = loom::dtypeSize(t), n = 1000;
    std::vector<uint8_t> src(n * esz), ks(n * esz), want(n * esz), got(n * esz);
    for (auto& b : src) b = uint8_t(rng());
    if (t == loomFloat16 || t == loomBfloat16 || t == loomFloat32 || t == loomFloat64) {
      // Finite values of moderate size (random bits are often NaN or huge).
      for (size_t i = 0; i < n; ++i) {
        const double v = double(int64_t(rng() % 20001) - 10000) / 97.0;
        if (t == loomFloat16) {
          uint16_t h = floatToHalf(float(v / 64));
          memcpy(&src[i * 2], &h, 2);
        } else if (t == loomBfloat16) {
          uint16_t h = floatToBf16(float(v));
          memcpy(&src[i * 2], &h, 2);
        } else if (t == loomFloat32) {
          float f = float(v);
          memcpy(&src[i * 4], &f, 4);
        } else {
          memcpy(&src[i * 8], &v, 8);
        }
      }
    }
    std::vector<uint8_t> k(esz);
    for (auto& b : k) b = uint8_t(rng());
    if (t == loomFloat16) {
      uint16_t h = floatToHalf(0.37f);
      memcpy(k.data(), &h, 2);
    } else if (t == loomBfloat16) {
      uint16_t h = floatToBf16(-1.7f);
      memcpy(k.data(), &h, 2);
    } else if (t == loomFloat32) {
      float f = 1.0f / 3.0f;
      memcpy(k.data(), &f, 4);
    } else if (t == loomFloat64) {
      double d = 1.0 / 7.0;
      memcpy(k.data(), &d, 8);
    }
    for (size_t i = 0; i < n; ++i) memcpy(&ks[i * esz], k.data(), esz);
    loom::reduceHost(want.data(), src.data(), ks.data(), n, t, loomProd);
    loom::scaleHost(got.data(), src.data(), n, t, k.data());
    CHECK(got == want);
    std::vector<uint8_t> inPlace = src;
    loom::scaleHost(inPlace.data(), inPlace.data(), n, t, k.data());
    CHECK(inPlace == want);
  }
  int8_t w[2] = {100, -128};
  const int8_t three = 3;
  loom::scaleHost(w, w, 2, loomInt8, &three);
  CHECK(w[0] == int8_t(44));    // 300 wraps
  CHECK(w[1] == int8_t(-128));  // -384 wraps
  uint16_t h = floatToHalf(3.0f), k2 = floatToHalf(0.5f);
  loom::scaleHost(&h, &h, 1, loomFloat16, &k2);
  CHECK(halfToFloat(h) == 1.5f);
}
