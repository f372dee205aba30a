// loom-perf: the collective benchmark of loom, shaped like nccl-tests.
//
//   loom-run -n 4 build/bin/loom-perf all_reduce -b 8 -e 64M -f 2 -d float32 -o sum
//
// Each rank creates its communicator with loomCommInitFromEnv (loom-run,
// torchrun, mpirun and srun all work), blocking calls (or with -s 1 one loom
// host stream), and persistent (with -R: from loomMemAlloc, registered)
// buffers allocated and pre-faulted once at the largest size.  For every
// (datatype, op, size) it runs, out-of-place and then in-place:
//   1. (with -c 1) one checked run on freshly generated data, verified
//      element by element against a locally computed exact result;
//   2. -w warm-up iterations;
//   3. -n timed iterations, each timed on its own (the blocking call, or issue +
//      loomStreamSynchronize with -s 1);
// then, outside the timed loop, the per-iteration times are all-reduced with
// loomMax (float64, a separate small buffer) so that each iteration counts as
// long as its slowest rank, and the median over iterations is reported.
//
// Sizes, algbw and busbw follow nccl-tests exactly:
//   size  = max(send bytes, recv bytes) of one rank: for all_gather and
//           reduce_scatter that is the full nranks*count buffer, count being
//           the per-rank count (rounded down so that a block is 16 B aligned);
//   algbw = size / time;
//   busbw = algbw * 2(n-1)/n (all_reduce), (n-1)/n (all_gather,
//           reduce_scatter, alltoall, gather, scatter), 1 (broadcast,
//           reduce, sendrecv).
// sendrecv's pattern (-p): exchange (default; every rank sends to the next
// and receives from the previous at once, both directions busy at N = 2),
// oneway (even ranks send to the next odd rank, which only receives: one
// direction, as ib_write_bw), pingpong (even ranks send and then receive the
// reply, odd ranks receive and answer: the time is half the round trip, as
// ib_send_lat and osu_latency report it).  oneway and pingpong need an even
// number of ranks.
// alltoall, gather and scatter take nranks*count-element buffers on the
// side that holds every rank's block (both sides for alltoall), count per
// rank being rounded down to a 16-byte-aligned block, as for all_gather.
//
// With -G (--device cuda) the communicator is a CUDA one (LOOM_DEVICE=cuda)
// on device local-rank % devices, the buffers are device memory (cudaMalloc)
// and every call is issued on one cudaStream_t and timed up to
// cudaStreamSynchronize; checked runs fill and verify host copies and move
// them with cudaMemcpy.  The CUDA runtime is loaded at run time (dlopen), as
// loom loads its CUDA plug-in: loom-perf runs without any CUDA library, and
// -G there fails with "no CUDA device" and the reason.
//
// Check data (-c 1) is made of small integers chosen so that every
// reduction is exact in every datatype (int8 and bfloat16 included), in any
// reduction order, for any number of ranks: see Pattern below.
//
// Exit status: 0 success, 1 a loom call failed, 2 bad arguments (or -G
// without a usable CUDA device), 3 wrong results (or values written out of
// bounds) were found.

#include <loom.h>

#include <dlfcn.h>
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

extern char** environ;

namespace {

// ---------------------------------------------------------------------------
// Collectives, datatypes, ops
// ---------------------------------------------------------------------------

enum Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kSendRecv, kAllToAll, kGather, kScatter };

struct CollInfo {
  Coll coll;
  const char* name;
  bool reducing;
  bool rooted;
};

const CollInfo kColls[] = {
    {kAllReduce, "all_reduce", true, false},  {kReduceScatter, "reduce_scatter", true, false},
    {kAllGather, "all_gather", false, false}, {kBroadcast, "broadcast", false, true},
    {kReduce, "reduce", true, true},          {kSendRecv, "sendrecv", false, false},
    {kAllToAll, "alltoall", false, false},    {kGather, "gather", false, true},
    {kScatter, "scatter", false, true},
};

enum Kind { kSigned, kUnsigned, kF16, kBF16, kF32, kF64 };

struct TypeInfo {
  loomDataType_t type;
  const char* name;
  size_t size;
  Kind kind;
  // Largest magnitude up to which every integer is exactly representable and
  // sums stay in range (int8: 127, uint8: 254 so 255 stays free for the
  // sentinel, float16: 2048, bfloat16: 256; others: 2^24, exact in float32).
  int64_t exact;
  // Largest k such that +-2^k is representable (products).
  int kmax;
};

const TypeInfo kTypes[] = {
    {loomInt8, "int8", 1, kSigned, 127, 6},
    {loomUint8, "uint8", 1, kUnsigned, 254, 7},
    {loomInt32, "int32", 4, kSigned, 1 << 24, 30},
    {loomUint32, "uint32", 4, kUnsigned, 1 << 24, 30},
    {loomInt64, "int64", 8, kSigned, 1 << 24, 30},
    {loomUint64, "uint64", 8, kUnsigned, 1 << 24, 30},
    {loomFloat16, "float16", 2, kF16, 2048, 15},
    {loomFloat32, "float32", 4, kF32, 1 << 24, 30},
    {loomFloat64, "float64", 8, kF64, 1 << 24, 30},
    {loomBfloat16, "bfloat16", 2, kBF16, 256, 30},
};

struct TypeAlias {
  const char* alias;
  loomDataType_t type;
};
const TypeAlias kTypeAliases[] = {
    {"char", loomInt8},   {"int", loomInt32},      {"half", loomFloat16}, {"fp16", loomFloat16},
    {"float", loomFloat32}, {"fp32", loomFloat32}, {"double", loomFloat64}, {"fp64", loomFloat64},
    {"bf16", loomBfloat16},
};

struct OpInfo {
  loomRedOp_t op;
  const char* name;
};
const OpInfo kOps[] = {
    {loomSum, "sum"}, {loomProd, "prod"}, {loomMax, "max"}, {loomMin, "min"}, {loomAvg, "avg"},
};

const TypeInfo& typeInfo(loomDataType_t t) {
  for (const TypeInfo& ti : kTypes)
    if (ti.type == t) return ti;
  return kTypes[0];
}

// ---------------------------------------------------------------------------
// float16 / bfloat16 conversions (round to nearest even)
// ---------------------------------------------------------------------------

struct Half {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t floatToHalf(float f) {
  uint32_t x = floatBits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t man = x & 0x7fffffu;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (man ? 0x200u : 0u));
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return static_cast<uint16_t>(sign);
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (man >> 13);
  uint32_t rem = man & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;  // may carry into exp: fine
  return static_cast<uint16_t>(sign | half);
}

float halfToFloat(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bitsFloat(sign);
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return bitsFloat(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

uint16_t floatToBF16(float f) {
  uint32_t x = floatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}
float bf16ToFloat(uint16_t b) { return bitsFloat(static_cast<uint32_t>(b) << 16); }

template <typename T>
struct Codec {
  static T store(int64_t v) { return static_cast<T>(v); }
  static double load(T v) { return static_cast<double>(v); }
};
template <>
struct Codec<Half> {
  static Half store(int64_t v) { return Half{floatToHalf(static_cast<float>(v))}; }
  static double load(Half v) { return halfToFloat(v.bits); }
};
template <>
struct Codec<BF16> {
  static BF16 store(int64_t v) { return BF16{floatToBF16(static_cast<float>(v))}; }
  static double load(BF16 v) { return bf16ToFloat(v.bits); }
};

// ---------------------------------------------------------------------------
// Check data
// ---------------------------------------------------------------------------
//
// value(r, i) is the element i that rank r contributes.  All values are small
// integers, so results are exact whatever the order of reduction, as long as
// every partial result is exactly representable:
//   kSum  : v in [0, E/n]            (E = TypeInfo::exact): all partial sums
//                                     are in [0, E].
//   kAvg  : v = g(i) +- e(r, i): ranks 2p and 2p+1 get +e and -e, an unpaired
//           last rank gets g, so the sum is exactly n*g(i) (<= E/2) and the
//           average is g(i) exactly, with truncating or true division.
//   kProd : v in {1, 2} (and -1, -2 for signed and floating types), with at
//           most kmax ranks contributing a 2 at any index: |product| <= 2^kmax.
//   kMixed: (max, min and the copy collectives) v in a range of width E,
//           negative values included for signed and floating types.
// The sentinel written into result buffers before a checked run is a value
// that none of the patterns can produce.
enum PatternKind { kSum, kAvg, kProd, kMixed };

struct Pattern {
  PatternKind kind;
  int nranks;
  bool hasSign;
  uint64_t mod;     // kSum, kMixed: values are (mix(i) + 13 r) % mod
  int64_t shift;    // kMixed: subtracted
  uint64_t gmod;    // kAvg: g(i) = mix(i) % gmod
  uint64_t period;  // kProd: rank r contributes magnitude 2 when (r + i) % period == 0
  int64_t sentinel;

  static uint64_t mix(uint64_t i) { return i * 7 + (i >> 5) * 3; }

  int64_t value(int r, uint64_t i) const {
    switch (kind) {
      case kSum:
        return static_cast<int64_t>((mix(i) + 13u * static_cast<uint64_t>(r)) % mod);
      case kMixed:
        return static_cast<int64_t>((mix(i) + 13u * static_cast<uint64_t>(r)) % mod) - shift;
      case kAvg: {
        int64_t g = static_cast<int64_t>(mix(i) % gmod);
        if ((r ^ 1) >= nranks) return g;  // unpaired last rank
        uint64_t pair = static_cast<uint64_t>(r / 2);
        int64_t e = static_cast<int64_t>((i * 3 + pair * 5) % static_cast<uint64_t>(g + 1));
        return (r & 1) ? g - e : g + e;
      }
      case kProd: {
        int64_t mag = ((static_cast<uint64_t>(r) + i) % period == 0) ? 2 : 1;
        bool neg = hasSign && ((static_cast<uint64_t>(r) * 3 + i * 5) % 7 == 0);
        return neg ? -mag : mag;
      }
    }
    return 0;
  }

  // The exact result of op over all ranks' value(r, i).
  int64_t reduce(loomRedOp_t op, uint64_t i) const {
    int64_t acc = value(0, i);
    for (int r = 1; r < nranks; ++r) {
      int64_t v = value(r, i);
      switch (op) {
        case loomSum:
        case loomAvg: acc += v; break;
        case loomProd: acc *= v; break;
        case loomMax: acc = std::max(acc, v); break;
        case loomMin: acc = std::min(acc, v); break;
        default: break;
      }
    }
    if (op == loomAvg) acc /= nranks;  // exact: the sum is a multiple of nranks
    return acc;
  }
};

Pattern makePattern(const TypeInfo& ti, bool reducing, loomRedOp_t op, int nranks) {
  Pattern p{};
  p.nranks = nranks;
  bool isSigned = ti.kind != kUnsigned;
  p.hasSign = isSigned;
  int64_t e = ti.exact;
  p.sentinel = isSigned ? -(e / 2) - 5 : e + 1;
  int64_t vmax = std::max<int64_t>(e / nranks, 1);
  if (!reducing || op == loomMax || op == loomMin) {
    p.kind = kMixed;
    p.mod = static_cast<uint64_t>(e) + 1;
    p.shift = isSigned ? e / 2 : 0;
  } else if (op == loomSum) {
    p.kind = kSum;
    p.mod = static_cast<uint64_t>(vmax) + 1;
  } else if (op == loomAvg) {
    p.kind = kAvg;
    p.gmod = static_cast<uint64_t>(vmax / 2) + 1;
  } else {  // prod
    p.kind = kProd;
    p.period = static_cast<uint64_t>((nranks + ti.kmax - 1) / ti.kmax);
    if (p.period == 0) p.period = 1;
  }
  return p;
}

// Typed fill / verify helpers.  `first` is the pattern index of element 0.
template <typename T>
void fillValues(void* buf, size_t count, const Pattern& p, int rank, uint64_t first) {
  T* b = static_cast<T*>(buf);
  for (size_t k = 0; k < count; ++k) b[k] = Codec<T>::store(p.value(rank, first + k));
}
template <typename T>
void fillConst(void* buf, size_t count, int64_t v) {
  T* b = static_cast<T*>(buf);
  T c = Codec<T>::store(v);
  for (size_t k = 0; k < count; ++k) b[k] = c;
}
// Mismatches of buf[k] against value(rank, first + k).
template <typename T>
int64_t verifyValues(const void* buf, size_t count, const Pattern& p, int rank, uint64_t first) {
  const T* b = static_cast<const T*>(buf);
  int64_t wrong = 0;
  for (size_t k = 0; k < count; ++k)
    if (Codec<T>::load(b[k]) != static_cast<double>(p.value(rank, first + k))) ++wrong;
  return wrong;
}
// Mismatches of buf[k] against the reduction of value(*, first + k).
template <typename T>
int64_t verifyReduced(const void* buf, size_t count, const Pattern& p, loomRedOp_t op,
                      uint64_t first) {
  const T* b = static_cast<const T*>(buf);
  int64_t wrong = 0;
  for (size_t k = 0; k < count; ++k)
    if (Codec<T>::load(b[k]) != static_cast<double>(p.reduce(op, first + k))) ++wrong;
  return wrong;
}
template <typename T>
int64_t verifyConst(const void* buf, size_t count, int64_t v) {
  const T* b = static_cast<const T*>(buf);
  double c = Codec<T>::load(Codec<T>::store(v));
  int64_t wrong = 0;
  for (size_t k = 0; k < count; ++k)
    if (Codec<T>::load(b[k]) != c) ++wrong;
  return wrong;
}

// Dispatch on the datatype: calls f.template operator()<T>() ... C++17 has no
// templated lambdas, so use a functor with a templated call operator.
template <typename F>
auto dispatch(loomDataType_t t, F&& f) {
  switch (t) {
    case loomInt8: return f(int8_t{});
    case loomUint8: return f(uint8_t{});
    case loomInt32: return f(int32_t{});
    case loomUint32: return f(uint32_t{});
    case loomInt64: return f(int64_t{});
    case loomUint64: return f(uint64_t{});
    case loomFloat16: return f(Half{});
    case loomFloat32: return f(float{});
    case loomFloat64: return f(double{});
    case loomBfloat16: return f(BF16{});
    default: break;
  }
  return f(float{});
}

void fillValuesT(loomDataType_t t, void* buf, size_t count, const Pattern& p, int rank,
                 uint64_t first) {
  dispatch(t, [&](auto tag) {
    fillValues<decltype(tag)>(buf, count, p, rank, first);
    return 0;
  });
}
void fillConstT(loomDataType_t t, void* buf, size_t count, int64_t v) {
  dispatch(t, [&](auto tag) {
    fillConst<decltype(tag)>(buf, count, v);
    return 0;
  });
}
int64_t verifyValuesT(loomDataType_t t, const void* buf, size_t count, const Pattern& p, int rank,
                      uint64_t first) {
  return dispatch(t, [&](auto tag) { return verifyValues<decltype(tag)>(buf, count, p, rank, first); });
}
int64_t verifyReducedT(loomDataType_t t, const void* buf, size_t count, const Pattern& p,
                       loomRedOp_t op, uint64_t first) {
  return dispatch(t, [&](auto tag) { return verifyReduced<decltype(tag)>(buf, count, p, op, first); });
}
int64_t verifyConstT(loomDataType_t t, const void* buf, size_t count, int64_t v) {
  return dispatch(t, [&](auto tag) { return verifyConst<decltype(tag)>(buf, count, v); });
}

// Guard bytes after every result region: filled with kGuardByte before a
// checked run; any change is an out-of-bounds write.
constexpr size_t kGuardBytes = 4096;
constexpr unsigned char kGuardByte = 0xA5;

void fillGuard(char* p) { std::memset(p, kGuardByte, kGuardBytes); }
int64_t verifyGuard(const char* p) {
  int64_t bad = 0;
  for (size_t k = 0; k < kGuardBytes; ++k)
    if (static_cast<unsigned char>(p[k]) != kGuardByte) ++bad;
  return bad;
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

struct Options {
  const CollInfo* coll = nullptr;
  size_t minBytes = 8;
  size_t maxBytes = 64ull << 20;
  size_t stepFactor = 2;
  int iters = 20;
  int warmup = 5;
  int check = 1;
  std::vector<loomDataType_t> types{loomFloat32};
  std::vector<loomRedOp_t> ops{loomSum};
  int root = 0;
  int stream = 0;  // 1: issue on a loom host stream; 0: blocking calls (NULL stream)
  bool registered = false;  // -R: buffers from loomMemAlloc, registered with the communicator
  bool cuda = false;        // -G / --device cuda: device buffers on a CUDA communicator
  bool cudaRegistered = false;  // --cuda-registered (with -G): cudaMalloc'd, registered with the communicator
  std::string json;
  enum Pattern { kExchange, kOneWay, kPingPong } pattern = kExchange;  // sendrecv only (-p)
};

const char* const kPatternNames[] = {"exchange", "oneway", "pingpong"};

// Rank from the launcher variables, before the communicator exists: used only
// to print usage and argument errors once.
bool envRankIsZero() {
  const char* vars[] = {"LOOM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"};
  for (const char* v : vars) {
    const char* s = std::getenv(v);
    if (s && *s) return std::strcmp(s, "0") == 0;
  }
  return true;
}

void usage(FILE* f) {
  std::fprintf(f,
               "usage: loom-perf COLLECTIVE [options]\n"
               "  COLLECTIVE: all_reduce, reduce_scatter, all_gather, broadcast, reduce, sendrecv, alltoall,\n"
               "              gather, scatter\n"
               "  -b, --minbytes N      smallest size (default 8; suffixes K, M, G)\n"
               "  -e, --maxbytes N      largest size (default 64M)\n"
               "  -f, --stepfactor N    multiply the size by N each step (default 2, >= 2)\n"
               "  -n, --iters N         timed iterations per size (default 20)\n"
               "  -w, --warmup_iters N  warm-up iterations per size (default 5)\n"
               "  -c, --check 0|1       verify results (default 1)\n"
               "  -d, --datatype T      int8 uint8 int32 uint32 int64 uint64 float16 float32\n"
               "                        float64 bfloat16, a comma-separated list, or all\n"
               "                        (default float32)\n"
               "  -o, --op OP           sum prod max min avg, a list, or all (default sum;\n"
               "                        reducing collectives only)\n"
               "  -r, --root R          root of broadcast, reduce, gather, scatter (default 0)\n"
               "  -R, --registered      buffers from loomMemAlloc, registered with loomCommRegister\n"
               "                        (peers on the host reduce straight out of them; with -G:\n"
               "                        device memory from loomMemAlloc, not registered, which\n"
               "                        large all-reduces read in place, LOOM_DEVICE_ZERO_COPY)\n"
               "      --cuda-registered with -G: cudaMalloc'd buffers registered with\n"
               "                        loomCommRegister, as a framework registers its allocator's\n"
               "                        segments (read in place as -G -R's are)\n"
               "  -p, --pattern P       sendrecv only: exchange (default: send to the next rank and\n"
               "                        receive from the previous at once), oneway (even ranks only\n"
               "                        send, to the odd rank after them), pingpong (even ranks send\n"
               "                        and wait for the reply; time = half the round trip);\n"
               "                        oneway and pingpong need an even number of ranks\n"
               "  -s, --stream 0|1      0 (default): blocking calls (NULL stream), as MPI_Allreduce\n"
               "                        is measured; 1: issue on a loom host stream and\n"
               "                        loomStreamSynchronize each iteration\n"
               "  -G, --device cuda     a CUDA communicator (LOOM_DEVICE=cuda) on device buffers,\n"
               "                        issued on a cudaStream_t (default: --device host)\n"
               "      --json FILE       rank 0 also writes every row as JSON to FILE\n"
               "  -h, --help            this help\n"
               "Run it under a launcher, e.g.:\n"
               "  loom-run -n 4 loom-perf all_reduce -b 8 -e 64M -f 2 -d float32 -o sum\n"
               "Size is the per-rank buffer size as in nccl-tests (all_gather, reduce_scatter:\n"
               "the full nranks*count buffer).  Time: per iteration, max over ranks, median\n"
               "over iterations.  Exit status: 0 ok, 1 loom error, 2 bad arguments,\n"
               "3 wrong results.\n");
}

[[noreturn]] void badArgs(const char* fmt, ...) {
  if (envRankIsZero()) {
    std::fprintf(stderr, "loom-perf: ");
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n(loom-perf -h for help)\n");
  }
  std::exit(2);
}

bool parseSize(const char* s, size_t* out) {
  if (!s || !*s || *s == '-' || *s == '+') return false;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, 10);
  if (errno || end == s) return false;
  unsigned long long mul = 1;
  if (*end) {
    switch (*end) {
      case 'k': case 'K': mul = 1ull << 10; break;
      case 'm': case 'M': mul = 1ull << 20; break;
      case 'g': case 'G': mul = 1ull << 30; break;
      default: return false;
    }
    ++end;
    if (*end == 'B' || *end == 'b') ++end;  // accept 64MB
    if (*end) return false;
  }
  if (v > UINT64_MAX / mul) return false;
  *out = static_cast<size_t>(v * mul);
  return true;
}

bool parseInt(const char* s, long lo, long hi, long* out) {
  if (!s || !*s) return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (errno || *end || end == s || v < lo || v > hi) return false;
  *out = v;
  return true;
}

std::vector<std::string> splitList(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = s;; ++p) {
    if (*p == ',' || *p == '\0') {
      out.push_back(cur);
      cur.clear();
      if (!*p) break;
    } else {
      cur += *p;
    }
  }
  return out;
}

std::vector<loomDataType_t> parseTypes(const char* s) {
  std::vector<loomDataType_t> out;
  if (std::strcmp(s, "all") == 0) {
    for (const TypeInfo& ti : kTypes) out.push_back(ti.type);
    return out;
  }
  for (const std::string& name : splitList(s)) {
    bool found = false;
    for (const TypeInfo& ti : kTypes)
      if (name == ti.name) { out.push_back(ti.type); found = true; }
    for (const TypeAlias& a : kTypeAliases)
      if (!found && name == a.alias) { out.push_back(a.type); found = true; }
    if (!found)
      badArgs("unknown datatype '%s' (int8 uint8 int32 uint32 int64 uint64 float16 float32 "
              "float64 bfloat16 or all)", name.c_str());
  }
  return out;
}

std::vector<loomRedOp_t> parseOps(const char* s) {
  std::vector<loomRedOp_t> out;
  if (std::strcmp(s, "all") == 0) {
    for (const OpInfo& oi : kOps) out.push_back(oi.op);
    return out;
  }
  for (const std::string& name : splitList(s)) {
    bool found = false;
    for (const OpInfo& oi : kOps)
      if (name == oi.name) { out.push_back(oi.op); found = true; }
    if (!found) badArgs("unknown op '%s' (sum prod max min avg or all)", name.c_str());
  }
  return out;
}

const CollInfo* parseColl(const char* s) {
  std::string n(s);
  if (n.size() > 5 && n.compare(n.size() - 5, 5, "_perf") == 0) n.resize(n.size() - 5);
  for (const CollInfo& ci : kColls) {
    std::string plain;
    for (const char* p = ci.name; *p; ++p)
      if (*p != '_') plain += *p;
    if (n == ci.name || n == plain) return &ci;
  }
  return nullptr;
}

Options parseArgs(int argc, char** argv) {
  Options o;
  static const struct option longOpts[] = {
      {"minbytes", required_argument, nullptr, 'b'},
      {"maxbytes", required_argument, nullptr, 'e'},
      {"stepfactor", required_argument, nullptr, 'f'},
      {"iters", required_argument, nullptr, 'n'},
      {"warmup_iters", required_argument, nullptr, 'w'},
      {"check", required_argument, nullptr, 'c'},
      {"datatype", required_argument, nullptr, 'd'},
      {"op", required_argument, nullptr, 'o'},
      {"root", required_argument, nullptr, 'r'},
      {"json", required_argument, nullptr, 'J'},
      {"stream", required_argument, nullptr, 's'},
      {"registered", no_argument, nullptr, 'R'},
      {"cuda-registered", no_argument, nullptr, 'C'},
      {"device", required_argument, nullptr, 'D'},
      {"pattern", required_argument, nullptr, 'p'},
      {"help", no_argument, nullptr, 'h'},
      {nullptr, 0, nullptr, 0},
  };
  opterr = 0;
  bool sawOp = false;
  long v = 0;
  for (;;) {
    int c = getopt_long(argc, argv, ":b:e:f:n:w:c:d:o:r:s:p:RGh", longOpts, nullptr);
    if (c == -1) break;
    switch (c) {
      case 'b':
        if (!parseSize(optarg, &o.minBytes) || o.minBytes == 0)
          badArgs("-b: bad size '%s' (a positive number of bytes, suffixes K, M, G)", optarg);
        break;
      case 'e':
        if (!parseSize(optarg, &o.maxBytes) || o.maxBytes == 0)
          badArgs("-e: bad size '%s' (a positive number of bytes, suffixes K, M, G)", optarg);
        break;
      case 'f':
        if (!parseInt(optarg, 2, 1 << 20, &v)) badArgs("-f: bad step factor '%s' (an integer >= 2)", optarg);
        o.stepFactor = static_cast<size_t>(v);
        break;
      case 'n':
        if (!parseInt(optarg, 1, 1 << 24, &v)) badArgs("-n: bad iteration count '%s' (>= 1)", optarg);
        o.iters = static_cast<int>(v);
        break;
      case 'w':
        if (!parseInt(optarg, 0, 1 << 24, &v)) badArgs("-w: bad warm-up count '%s' (>= 0)", optarg);
        o.warmup = static_cast<int>(v);
        break;
      case 'c':
        if (!parseInt(optarg, 0, 1, &v)) badArgs("-c: expected 0 or 1, got '%s'", optarg);
        o.check = static_cast<int>(v);
        break;
      case 'd': o.types = parseTypes(optarg); break;
      case 'o': o.ops = parseOps(optarg); sawOp = true; break;
      case 'r':
        if (!parseInt(optarg, 0, 1 << 30, &v)) badArgs("-r: bad root '%s'", optarg);
        o.root = static_cast<int>(v);
        break;
      case 's':
        if (!parseInt(optarg, 0, 1, &v)) badArgs("-s: expected 0 or 1, got '%s'", optarg);
        o.stream = static_cast<int>(v);
        break;
      case 'R': o.registered = true; break;
      case 'C': o.cudaRegistered = true; break;
      case 'G': o.cuda = true; break;
      case 'D':
        if (std::strcmp(optarg, "cuda") == 0)
          o.cuda = true;
        else if (std::strcmp(optarg, "host") == 0)
          o.cuda = false;
        else
          badArgs("--device: expected host or cuda, got '%s'", optarg);
        break;
      case 'p': {
        bool found = false;
        for (int i = 0; i < 3; ++i)
          if (std::strcmp(optarg, kPatternNames[i]) == 0) o.pattern = Options::Pattern(i), found = true;
        if (!found) badArgs("-p: unknown pattern '%s' (exchange, oneway, pingpong)", optarg);
        break;
      }
      case 'J':
        if (!*optarg) badArgs("--json: empty file name");
        o.json = optarg;
        break;
      case 'h':
        if (envRankIsZero()) usage(stdout);
        std::exit(0);
      case ':': badArgs("option %s needs an argument", argv[optind - 1]);
      default:
        if (optopt) badArgs("unknown option -%c", optopt);
        badArgs("unknown option %s", argv[optind - 1]);
    }
  }
  if (optind >= argc)
    badArgs("missing the collective (all_reduce, reduce_scatter, all_gather, broadcast, reduce, sendrecv, "
            "alltoall, gather, scatter)");
  if (argc - optind > 1) badArgs("unexpected argument '%s'", argv[optind + 1]);
  o.coll = parseColl(argv[optind]);
  if (!o.coll)
    badArgs("unknown collective '%s' (all_reduce, reduce_scatter, all_gather, broadcast, reduce, sendrecv, "
            "alltoall, gather, scatter)",
            argv[optind]);
  if (o.minBytes > o.maxBytes) badArgs("-b %zu is larger than -e %zu", o.minBytes, o.maxBytes);
  if (o.cudaRegistered && !o.cuda) badArgs("--cuda-registered needs -G (device buffers)");
  if (o.cudaRegistered && o.registered) badArgs("--cuda-registered and -R: choose one (-R: loomMemAlloc's memory)");
  if (sawOp && !o.coll->reducing && envRankIsZero())
    std::fprintf(stderr, "loom-perf: note: -o is ignored by %s\n", o.coll->name);
  if (!o.coll->reducing) o.ops = {loomSum};  // one pass, printed as "none"
  if (o.pattern != Options::kExchange && o.coll->coll != kSendRecv)
    badArgs("-p %s: patterns are for sendrecv only", kPatternNames[o.pattern]);
  return o;
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

struct Cell {
  bool valid = false;
  double timeUs = 0, timeMinUs = 0, timeMaxUs = 0;
  double algbw = 0, busbw = 0;
  int64_t wrong = -1;  // -1: not checked
  int64_t oob = 0;
};

struct Row {
  size_t size;
  size_t count;
  const char* type;
  const char* op;
  int root;
  Cell oop, ip;
};

loomComm_t gComm = nullptr;
int gRank = 0;

[[noreturn]] void loomFailed(const char* call, loomResult_t r, int line) {
  const char* last = loomGetLastError(gComm);
  std::fprintf(stderr, "loom-perf: rank %d: %s failed (line %d): %s%s%s\n", gRank, call, line,
               loomGetErrorString(r), (last && *last) ? ": " : "", last ? last : "");
  std::fflush(stderr);
  if (gComm) loomCommAbort(gComm);
  std::exit(1);
}

#define LOOMCHECK(call)                                  \
  do {                                                   \
    loomResult_t res_ = (call);                          \
    if (res_ != loomSuccess) loomFailed(#call, res_, __LINE__); \
  } while (0)

void* allocBuffer(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0 || !p) {
    std::fprintf(stderr, "loom-perf: rank %d: cannot allocate %zu bytes\n", gRank, bytes);
    std::exit(1);
  }
  std::memset(p, 0, bytes);  // pre-fault every page now, not in the timed loop
  return p;
}

// The CUDA runtime, loaded at run time (-G): the calls loom-perf makes.
struct CudaRuntime {
  using Err = int;  // cudaError_t
  enum { kHostToDevice = 1, kDeviceToHost = 2 };  // cudaMemcpyKind
  Err (*getDeviceCount)(int*) = nullptr;
  Err (*setDevice)(int) = nullptr;
  Err (*malloc)(void**, size_t) = nullptr;
  Err (*free)(void*) = nullptr;
  Err (*memset)(void*, int, size_t) = nullptr;
  Err (*memcpy)(void*, const void*, size_t, int) = nullptr;
  Err (*memcpyAsync)(void*, const void*, size_t, int, void*) = nullptr;
  Err (*streamCreateWithFlags)(void**, unsigned) = nullptr;
  Err (*streamSynchronize)(void*) = nullptr;
  Err (*streamDestroy)(void*) = nullptr;
  const char* (*errorString)(Err) = nullptr;
  int devices = 0;

  // False, with the reason in *why, unless a CUDA device can be used.
  bool open(std::string* why) {
    void* h = nullptr;
    std::string tried;
    std::vector<std::string> names = {"libcudart.so", "libcudart.so.13", "libcudart.so.12"};
    for (const char* dir : {static_cast<const char*>(std::getenv("CUDA_HOME")), "/usr/local/cuda"})
      if (dir && *dir) names.push_back(std::string(dir) + "/lib64/libcudart.so");
    for (const std::string& n : names) {
      if ((h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      const char* e = dlerror();
      if (tried.empty()) tried = e ? e : n;
    }
    if (!h) {
      *why = "no CUDA runtime library (" + tried + ")";
      return false;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) ok = false;
    };
    sym(getDeviceCount, "cudaGetDeviceCount");
    sym(setDevice, "cudaSetDevice");
    sym(malloc, "cudaMalloc");
    sym(free, "cudaFree");
    sym(memset, "cudaMemset");
    sym(memcpy, "cudaMemcpy");
    sym(memcpyAsync, "cudaMemcpyAsync");
    sym(streamCreateWithFlags, "cudaStreamCreateWithFlags");
    sym(streamSynchronize, "cudaStreamSynchronize");
    sym(streamDestroy, "cudaStreamDestroy");
    sym(errorString, "cudaGetErrorString");
    if (!ok) {
      *why = "the CUDA runtime library lacks a function loom-perf needs";
      return false;
    }
    Err rc = getDeviceCount(&devices);
    if (rc != 0) {
      *why = std::string("cudaGetDeviceCount: ") + errorString(rc);
      devices = 0;
      return false;
    }
    if (devices <= 0) {
      *why = "cudaGetDeviceCount says 0 devices";
      return false;
    }
    return true;
  }
  void check(Err rc, const char* call, int line) const {
    if (rc == 0) return;
    std::fprintf(stderr, "loom-perf: rank %d: %s failed: %s (CUDA error %d, line %d)\n", gRank, call,
                 errorString(rc), rc, line);
    std::fflush(stderr);
    if (gComm) loomCommAbort(gComm);
    std::exit(1);
  }
};

CudaRuntime* gCuda = nullptr;  // -G only

#define CUDACHECK(call) gCuda->check(gCuda->call, #call, __LINE__)

double medianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string fmtTime(double us) {
  char b[32];
  if (us >= 10000.0)
    std::snprintf(b, sizeof b, "%7.0f", us);
  else if (us >= 100.0)
    std::snprintf(b, sizeof b, "%7.1f", us);
  else
    std::snprintf(b, sizeof b, "%7.2f", us);
  return b;
}

std::string jsonEscape(const std::string& s) {
  std::string o;
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      o += '\\';
      o += ch;
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else {
      o += ch;
    }
  }
  return o;
}

std::string jsonNum(double v) {
  if (!std::isfinite(v)) return "null";
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

class Bench {
 public:
  Bench(const Options& o, loomComm_t comm, loomStream_t stream, int rank, int nranks)
      : o_(o), comm_(comm), stream_(stream), rank_(rank), n_(nranks) {
    // Both buffers hold the largest size plus a guard region.  (In-place runs
    // use recvbuff as their only buffer, as nccl-tests does, so it must hold
    // the full buffer of every collective.)
    cap_ = o.maxBytes + kGuardBytes + 64;
    if (o.cuda) {
      // Device buffers; checked runs fill and verify host copies of them.
      // With -R from loomMemAlloc (device memory on a CUDA process), which
      // large all-reduces read in place (LOOM_DEVICE_ZERO_COPY).
      void* p = nullptr;
      if (o.registered) {
        LOOMCHECK(loomMemAlloc(&p, cap_));
        send_ = static_cast<char*>(p);
        LOOMCHECK(loomMemAlloc(&p, cap_));
        recv_ = static_cast<char*>(p);
      } else {
        CUDACHECK(malloc(&p, cap_));
        send_ = static_cast<char*>(p);
        CUDACHECK(malloc(&p, cap_));
        recv_ = static_cast<char*>(p);
        if (o.cudaRegistered) {
          LOOMCHECK(loomCommRegister(comm_, send_, cap_, &sendReg_));
          LOOMCHECK(loomCommRegister(comm_, recv_, cap_, &recvReg_));
        }
      }
      CUDACHECK(memset(send_, 0, cap_));
      CUDACHECK(memset(recv_, 0, cap_));
      CUDACHECK(streamSynchronize(nullptr));  // the memsets ran on the legacy stream, not ordered with ours
      const size_t small = std::max<size_t>(64, static_cast<size_t>(o.iters) * sizeof(double));
      CUDACHECK(malloc(&p, small));
      scratch_ = static_cast<char*>(p);
      hostSend_ = static_cast<char*>(allocBuffer(cap_));
      hostRecv_ = static_cast<char*>(allocBuffer(cap_));
    } else if (o.registered) {
      // Memory the peers map (pre-faulted by loomMemAlloc), registered as a
      // framework registers its buckets.
      void* p = nullptr;
      LOOMCHECK(loomMemAlloc(&p, cap_));
      send_ = static_cast<char*>(p);
      LOOMCHECK(loomMemAlloc(&p, cap_));
      recv_ = static_cast<char*>(p);
      LOOMCHECK(loomCommRegister(comm_, send_, cap_, &sendReg_));
      LOOMCHECK(loomCommRegister(comm_, recv_, cap_, &recvReg_));
    } else {
      send_ = static_cast<char*>(allocBuffer(cap_));
      recv_ = static_cast<char*>(allocBuffer(cap_));
    }
    if (!o.cuda) hostSend_ = send_, hostRecv_ = recv_;
    times_.resize(static_cast<size_t>(o.iters));
  }
  ~Bench() {
    if (o_.cuda) {
      if (o_.registered) {
        loomMemFree(send_);
        loomMemFree(recv_);
      } else {
        if (o_.cudaRegistered) {  // before the free: the peers unmap it
          loomCommDeregister(comm_, sendReg_);
          loomCommDeregister(comm_, recvReg_);
        }
        gCuda->free(send_);
        gCuda->free(recv_);
      }
      gCuda->free(scratch_);
      std::free(hostSend_);
      std::free(hostRecv_);
      return;
    }
    if (o_.registered) {
      loomCommDeregister(comm_, sendReg_);
      loomCommDeregister(comm_, recvReg_);
      loomMemFree(send_);
      loomMemFree(recv_);
      return;
    }
    std::free(send_);
    std::free(recv_);
  }

  // Geometry of one size, as nccl-tests' getCollByteCount.
  struct Geo {
    size_t count;       // the count argument of the call (per rank)
    size_t sendCount;   // elements in sendbuff
    size_t recvCount;   // elements in recvbuff
    size_t sizeBytes;   // the size column: max(send, recv) bytes
  };
  Geo geometry(size_t bytes, size_t elt) const {
    Geo g{};
    size_t count = bytes / elt;
    switch (o_.coll->coll) {
      case kAllGather:
      case kReduceScatter:
      case kAllToAll:
      case kGather:
      case kScatter: {
        size_t align = 16 / elt;  // per-rank block 16-byte aligned
        size_t base = (count / static_cast<size_t>(n_)) & ~(align - 1);
        size_t all = base * static_cast<size_t>(n_);
        Coll c = o_.coll->coll;
        g.count = base;
        g.sendCount = (c == kAllGather || c == kGather) ? base : all;
        g.recvCount = (c == kReduceScatter || c == kScatter) ? base : all;
        break;
      }
      default:
        g.count = g.sendCount = g.recvCount = count;
        break;
    }
    g.sizeBytes = std::max(g.sendCount, g.recvCount) * elt;
    return g;
  }

  double busFactor() const {
    double n = n_;
    switch (o_.coll->coll) {
      case kAllReduce: return 2.0 * (n - 1) / n;
      case kAllGather:
      case kReduceScatter:
      case kAllToAll:
      case kGather:
      case kScatter: return (n - 1) / n;
      default: return 1.0;
    }
  }

  // Issues one operation on the stream.
  void issue(const Geo& g, const TypeInfo& ti, loomRedOp_t op, bool inPlace) {
    size_t elt = ti.size;
    char* sb = inPlace ? recv_ : send_;
    char* rb = recv_;
    switch (o_.coll->coll) {
      case kAllReduce:
        LOOMCHECK(loomAllReduce(sb, rb, g.count, ti.type, op, comm_, stream_));
        break;
      case kReduceScatter:
        if (inPlace) rb = recv_ + static_cast<size_t>(rank_) * g.count * elt;
        LOOMCHECK(loomReduceScatter(sb, rb, g.count, ti.type, op, comm_, stream_));
        break;
      case kAllGather:
        if (inPlace) sb = recv_ + static_cast<size_t>(rank_) * g.count * elt;
        LOOMCHECK(loomAllGather(sb, rb, g.count, ti.type, comm_, stream_));
        break;
      case kBroadcast:
        LOOMCHECK(loomBroadcast(sb, rb, g.count, ti.type, o_.root, comm_, stream_));
        break;
      case kReduce:
        LOOMCHECK(loomReduce(sb, rb, g.count, ti.type, op, o_.root, comm_, stream_));
        break;
      case kSendRecv: {
        if (o_.pattern != Options::kExchange) {
          bool even = rank_ % 2 == 0;
          int peer = rank_ ^ 1;
          if (o_.pattern == Options::kOneWay) {
            if (even) LOOMCHECK(loomSend(sb, g.count, ti.type, peer, comm_, stream_));
            else LOOMCHECK(loomRecv(rb, g.count, ti.type, peer, comm_, stream_));
          } else if (even) {  // ping: the reply lands in rb
            LOOMCHECK(loomSend(sb, g.count, ti.type, peer, comm_, stream_));
            LOOMCHECK(loomRecv(rb, g.count, ti.type, peer, comm_, stream_));
          } else {  // pong: send back what arrived
            LOOMCHECK(loomRecv(rb, g.count, ti.type, peer, comm_, stream_));
            LOOMCHECK(loomSend(rb, g.count, ti.type, peer, comm_, stream_));
          }
          break;
        }
        int next = (rank_ + 1) % n_;
        int prev = (rank_ + n_ - 1) % n_;
        LOOMCHECK(loomGroupStart());
        LOOMCHECK(loomSend(sb, g.count, ti.type, next, comm_, stream_));
        LOOMCHECK(loomRecv(rb, g.count, ti.type, prev, comm_, stream_));
        LOOMCHECK(loomGroupEnd());
        break;
      }
      case kAllToAll:  // in place: sendbuff = recvbuff
        LOOMCHECK(loomAllToAll(sb, rb, g.count, ti.type, comm_, stream_));
        break;
      case kGather:  // in place: sendbuff = recvbuff + root*count
        if (inPlace) sb = recv_ + static_cast<size_t>(o_.root) * g.count * elt;
        LOOMCHECK(loomGather(sb, rb, g.count, ti.type, o_.root, comm_, stream_));
        break;
      case kScatter:  // in place: recvbuff = sendbuff + rank*count
        if (inPlace) rb = recv_ + static_cast<size_t>(rank_) * g.count * elt;
        LOOMCHECK(loomScatter(sb, rb, g.count, ti.type, o_.root, comm_, stream_));
        break;
    }
  }

  // Waits for what was issued: the loom host stream (or nothing: blocking
  // calls), or with -G the CUDA stream.
  // Blocking calls (the NULL stream on a host communicator) are complete
  // when they return, so there is nothing to wait for, and the timed loop
  // makes no call the MPI harness does not make (perf/mpi_allreduce.c).
  void sync() {
    if (o_.cuda)
      CUDACHECK(streamSynchronize(stream_));
    else if (stream_)
      LOOMCHECK(loomStreamSynchronize(stream_));
  }

  // Host to device, on the collectives' stream, finished on return.  Not
  // cudaMemcpy: from pageable memory it may return before the copy lands,
  // and it is not ordered with a non-blocking stream, so a collective
  // issued next could read the buffer's old contents.
  void toDevice(void* dst, const void* src, size_t bytes) {
    CUDACHECK(memcpyAsync(dst, src, bytes, CudaRuntime::kHostToDevice, stream_));
    CUDACHECK(streamSynchronize(stream_));
  }

  // An all-reduce of a few host values (the checks' counts, the times),
  // through device scratch memory with -G.
  void smallAllReduce(void* host, size_t count, loomDataType_t t, loomRedOp_t op) {
    if (!o_.cuda) {
      LOOMCHECK(loomAllReduce(host, host, count, t, op, comm_, stream_));
      LOOMCHECK(loomStreamSynchronize(stream_));
      return;
    }
    const size_t bytes = count * 8;  // int64 or float64
    toDevice(scratch_, host, bytes);
    LOOMCHECK(loomAllReduce(scratch_, scratch_, count, t, op, comm_, stream_));
    sync();
    CUDACHECK(memcpy(host, scratch_, bytes, CudaRuntime::kDeviceToHost));
  }

  // Fills the buffers, runs once, verifies.  Returns (wrong, oob) of this rank.
  void checkedRun(const Geo& g, const TypeInfo& ti, loomRedOp_t op, bool inPlace, int64_t* wrongOut,
                  int64_t* oobOut) {
    const Pattern p = makePattern(ti, o_.coll->reducing, op, n_);
    const loomDataType_t t = ti.type;
    const size_t elt = ti.size;
    const size_t n = static_cast<size_t>(n_);
    const size_t me = static_cast<size_t>(rank_);
    const int root = o_.root;
    const Coll c = o_.coll->coll;
    int64_t wrong = 0, oob = 0;
    // Filled and verified here; with -G copied to the device buffers and back.
    char* hs = hostSend_;
    char* hr = hostRecv_;

    // ---- fill ----
    if (!inPlace) {
      fillValuesT(t, hs, g.sendCount, p, rank_, 0);
      fillConstT(t, hr, g.recvCount, p.sentinel);
      fillGuard(hr + g.recvCount * elt);
    } else {
      // The single buffer (recvbuff) holds the largest of the two regions.
      size_t total = std::max(g.sendCount, g.recvCount);
      switch (c) {
        case kAllReduce:
        case kReduce:
        case kReduceScatter:
          fillValuesT(t, hr, total, p, rank_, 0);
          break;
        case kBroadcast:
          if (rank_ == root)
            fillValuesT(t, hr, total, p, root, 0);
          else
            fillConstT(t, hr, total, p.sentinel);
          break;
        case kAllGather:
          fillConstT(t, hr, total, p.sentinel);
          fillValuesT(t, hr + me * g.count * elt, g.count, p, rank_, 0);
          break;
        case kGather:
          fillConstT(t, hr, total, p.sentinel);
          fillValuesT(t, hr + static_cast<size_t>(root) * g.count * elt, g.count, p, rank_, 0);
          break;
        case kScatter:
          if (rank_ == root)
            fillValuesT(t, hr, total, p, root, 0);
          else
            fillConstT(t, hr, total, p.sentinel);
          break;
        case kAllToAll:
          fillValuesT(t, hr, total, p, rank_, 0);
          break;
        case kSendRecv: break;  // no in-place form
      }
      fillGuard(hr + total * elt);
    }

    // The regions this run touches (with the guard after the result).
    const size_t sendBytes = inPlace ? 0 : g.sendCount * elt;
    const size_t recvBytes = (inPlace ? std::max(g.sendCount, g.recvCount) : g.recvCount) * elt + kGuardBytes;
    if (o_.cuda) {
      if (sendBytes) toDevice(send_, hs, sendBytes);
      toDevice(recv_, hr, recvBytes);
    }
    issue(g, ti, op, inPlace);
    sync();
    if (o_.cuda) {
      if (sendBytes) CUDACHECK(memcpy(hs, send_, sendBytes, CudaRuntime::kDeviceToHost));
      CUDACHECK(memcpy(hr, recv_, recvBytes, CudaRuntime::kDeviceToHost));
    }

    // ---- verify ----
    if (!inPlace) {
      // The input must be left alone.
      oob += verifyValuesT(t, hs, g.sendCount, p, rank_, 0);
      oob += verifyGuard(hr + g.recvCount * elt);
      switch (c) {
        case kAllReduce: wrong += verifyReducedT(t, hr, g.count, p, op, 0); break;
        case kReduce:
          if (rank_ == root)
            wrong += verifyReducedT(t, hr, g.count, p, op, 0);
          else  // recvbuff is only written on root
            oob += verifyConstT(t, hr, g.count, p.sentinel);
          break;
        case kReduceScatter: wrong += verifyReducedT(t, hr, g.count, p, op, me * g.count); break;
        case kAllGather:
          for (size_t r = 0; r < n; ++r)
            wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), 0);
          break;
        case kBroadcast: wrong += verifyValuesT(t, hr, g.count, p, root, 0); break;
        case kSendRecv:
          if (o_.pattern == Options::kExchange)
            wrong += verifyValuesT(t, hr, g.count, p, (rank_ + n_ - 1) % n_, 0);
          else if (o_.pattern == Options::kPingPong || rank_ % 2 == 1)  // ping: the even rank's data came back
            wrong += verifyValuesT(t, hr, g.count, p, rank_ & ~1, 0);
          else  // oneway: the sender's receive buffer is left alone
            oob += verifyConstT(t, hr, g.count, p.sentinel);
          break;
        case kAllToAll:
          for (size_t r = 0; r < n; ++r)
            wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), me * g.count);
          break;
        case kGather:
          if (rank_ == root)
            for (size_t r = 0; r < n; ++r)
              wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), 0);
          else  // recvbuff is only written on root
            oob += verifyConstT(t, hr, g.recvCount, p.sentinel);
          break;
        case kScatter: wrong += verifyValuesT(t, hr, g.count, p, root, me * g.count); break;
      }
    } else {
      size_t total = std::max(g.sendCount, g.recvCount);
      oob += verifyGuard(hr + total * elt);
      switch (c) {
        case kAllReduce: wrong += verifyReducedT(t, hr, g.count, p, op, 0); break;
        case kReduce:
          if (rank_ == root)
            wrong += verifyReducedT(t, hr, g.count, p, op, 0);
          else  // the buffer is only written on root: it must still hold the input
            oob += verifyValuesT(t, hr, g.count, p, rank_, 0);
          break;
        case kReduceScatter:
          wrong += verifyReducedT(t, hr + me * g.count * elt, g.count, p, op, me * g.count);
          break;
        case kAllGather:
          for (size_t r = 0; r < n; ++r)
            wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), 0);
          break;
        case kBroadcast: wrong += verifyValuesT(t, hr, g.count, p, root, 0); break;
        case kGather:
          if (rank_ == root)
            for (size_t r = 0; r < n; ++r)
              wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), 0);
          else  // the buffer is only read on other ranks: it must still hold the input
            oob += verifyValuesT(t, hr + static_cast<size_t>(root) * g.count * elt, g.count, p, rank_, 0);
          break;
        case kScatter: wrong += verifyValuesT(t, hr + me * g.count * elt, g.count, p, root, me * g.count); break;
        case kAllToAll:
          for (size_t r = 0; r < n; ++r)
            wrong += verifyValuesT(t, hr + r * g.count * elt, g.count, p, static_cast<int>(r), me * g.count);
          break;
        case kSendRecv: break;
      }
    }
    *wrongOut = wrong;
    *oobOut = oob;
  }

  Cell measure(const Geo& g, const TypeInfo& ti, loomRedOp_t op, bool inPlace) {
    Cell cell;
    cell.valid = true;
    if (o_.check) {
      int64_t counts[2] = {0, 0};
      checkedRun(g, ti, op, inPlace, &counts[0], &counts[1]);
      smallAllReduce(counts, 2, loomInt64, loomSum);
      cell.wrong = counts[0];
      cell.oob = counts[1];
    }
    for (int i = 0; i < o_.warmup; ++i) {
      issue(g, ti, op, inPlace);
      sync();
    }
    using clk = std::chrono::steady_clock;
    for (int i = 0; i < o_.iters; ++i) {
      auto t0 = clk::now();
      issue(g, ti, op, inPlace);
      sync();
      auto t1 = clk::now();
      times_[static_cast<size_t>(i)] = std::chrono::duration<double, std::micro>(t1 - t0).count();
    }
    // Outside the timed loop: each iteration lasts as long as its slowest rank.
    smallAllReduce(times_.data(), times_.size(), loomFloat64, loomMax);
    // pingpong: one way is half the round trip (as ib_send_lat reports).
    if (o_.pattern == Options::kPingPong)
      for (double& t : times_) t /= 2;
    cell.timeUs = medianOf(times_);
    cell.timeMinUs = *std::min_element(times_.begin(), times_.end());
    cell.timeMaxUs = *std::max_element(times_.begin(), times_.end());
    double sec = cell.timeUs * 1e-6;
    cell.algbw = sec > 0 ? static_cast<double>(g.sizeBytes) / 1e9 / sec : 0.0;
    cell.busbw = cell.algbw * busFactor();
    return cell;
  }

  int run() {
    printHeader();
    for (loomDataType_t t : o_.types) {
      const TypeInfo& ti = typeInfo(t);
      for (loomRedOp_t op : o_.ops) {
        const char* opName = o_.coll->reducing ? kOps[op].name : "none";
        int root = o_.coll->rooted ? o_.root : -1;
        size_t lastSize = SIZE_MAX;
        for (size_t bytes = o_.minBytes; bytes <= o_.maxBytes;) {
          Geo g = geometry(bytes, ti.size);
          // Rows whose count rounds to 0 or repeats the previous row are skipped.
          if (g.count > 0 && g.sizeBytes != lastSize) {
            lastSize = g.sizeBytes;
            Row row{g.sizeBytes, g.count, ti.name, opName, root, Cell(), Cell()};
            row.oop = measure(g, ti, op, false);
            if (o_.coll->coll != kSendRecv) row.ip = measure(g, ti, op, true);
            printRow(row);
            rows_.push_back(row);
          }
          if (bytes > o_.maxBytes / o_.stepFactor) break;
          bytes *= o_.stepFactor;
        }
      }
    }
    return finish();
  }

 private:
  void printHeader() {
    if (rank_ != 0) return;
    int version = 0;
    loomGetVersion(&version);
    char host[256] = "?";
    gethostname(host, sizeof host - 1);
    std::printf("# loom-perf: nranks %d, collective %s%s%s, %s\n", n_, o_.coll->name,
                o_.coll->coll == kSendRecv ? ", pattern " : "",
                o_.coll->coll == kSendRecv ? kPatternNames[o_.pattern] : "",
                o_.cuda     ? "device buffers, issued on a cudaStream_t (--device cuda)"
                : o_.stream ? "issued on a loom host stream (-s 1)"
                            : "blocking calls (NULL stream)");
    std::printf("# loom version %d.%d.%d, host %s, pid of rank 0 %d\n", version / 10000,
                (version / 100) % 100, version % 100, host, static_cast<int>(getpid()));
    std::printf("# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %d iters: %d "
                "validation: %d root: %d\n",
                o_.minBytes, o_.maxBytes, o_.stepFactor, o_.warmup, o_.iters, o_.check,
                o_.coll->rooted ? o_.root : -1);
    std::printf("# time: per iteration, max over ranks; median over %d iterations%s\n", o_.iters,
                o_.pattern == Options::kPingPong ? "; pingpong: half the round trip" : "");
    std::vector<std::string> env;
    for (char** e = environ; e && *e; ++e)
      if (std::strncmp(*e, "LOOM_", 5) == 0) env.emplace_back(*e);
    std::sort(env.begin(), env.end());
    std::printf("# environment:%s\n", env.empty() ? " (no LOOM_* variables)" : "");
    for (const std::string& s : env) {
      if (s.compare(0, 12, "LOOM_SECRET=") == 0)
        std::printf("#   LOOM_SECRET=(set, not shown)\n");
      else
        std::printf("#   %s\n", s.c_str());
      env_.push_back(s.compare(0, 12, "LOOM_SECRET=") == 0 ? "LOOM_SECRET=(set)" : s);
    }
    std::printf("#\n");
    // Columns as nccl-tests: a 52-character prefix, then two 33-character cells.
    std::printf("#%51s%s%s\n", "", centered("out-of-place", 33).c_str(), centered("in-place", 33).c_str());
    std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "size",
                "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                "algbw", "busbw", "#wrong");
    std::printf("#%11s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s\n", "(B)",
                "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                "(GB/s)", "");
    std::fflush(stdout);
  }

  static void printCell(const Cell& c) {
    if (!c.valid) {
      std::printf("  %7s  %6s  %6s  %6s", "N/A", "N/A", "N/A", "N/A");
      return;
    }
    char wrong[32];
    if (c.wrong < 0)
      std::snprintf(wrong, sizeof wrong, "N/A");
    else
      std::snprintf(wrong, sizeof wrong, "%" PRId64, c.wrong);
    std::printf("  %7s  %6.2f  %6.2f  %6s", fmtTime(c.timeUs).c_str(), c.algbw, c.busbw, wrong);
  }

  static std::string centered(const char* s, size_t width) {
    size_t len = std::strlen(s);
    size_t left = len < width ? (width - len) / 2 : 0;
    std::string out(left, ' ');
    out += s;
    if (out.size() < width) out.append(width - out.size(), ' ');
    return out;
  }

  void printRow(const Row& r) {
    accumulate(r.oop);
    accumulate(r.ip);
    if (rank_ != 0) return;
    std::printf("%12zu  %12zu  %8s  %6s  %6d", r.size, r.count, r.type, r.op, r.root);
    printCell(r.oop);
    printCell(r.ip);
    std::printf("\n");
    std::fflush(stdout);
  }

  void accumulate(const Cell& c) {
    if (!c.valid) return;
    bwSum_ += c.busbw;
    ++bwCount_;
    if (c.wrong > 0) wrongTotal_ += c.wrong;
    oobTotal_ += c.oob;
  }

  static std::string cellJson(const Cell& c) {
    if (!c.valid) return "null";
    std::string s = "{\"time_us\": " + jsonNum(c.timeUs) + ", \"time_us_min\": " + jsonNum(c.timeMinUs) +
                    ", \"time_us_max\": " + jsonNum(c.timeMaxUs) + ", \"algbw_GBps\": " +
                    jsonNum(c.algbw) + ", \"busbw_GBps\": " + jsonNum(c.busbw) + ", \"wrong\": " +
                    (c.wrong < 0 ? std::string("null") : std::to_string(c.wrong)) +
                    ", \"oob\": " + std::to_string(c.oob) + "}";
    return s;
  }

  void writeJson(double avgBus) {
    FILE* f = std::fopen(o_.json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "loom-perf: cannot write %s: %s\n", o_.json.c_str(), std::strerror(errno));
      jsonFailed_ = true;
      return;
    }
    std::fprintf(f, "{\n  \"tool\": \"loom-perf\",\n  \"collective\": \"%s\",\n  \"nranks\": %d,\n",
                 o_.coll->name, n_);
    std::fprintf(f, "  \"iters\": %d,\n  \"warmup_iters\": %d,\n  \"check\": %d,\n", o_.iters,
                 o_.warmup, o_.check);
    std::fprintf(f, "  \"time\": \"per-iteration max over ranks, median over iterations\",\n");
    std::fprintf(f, "  \"env\": [");
    for (size_t k = 0; k < env_.size(); ++k)
      std::fprintf(f, "%s\"%s\"", k ? ", " : "", jsonEscape(env_[k]).c_str());
    std::fprintf(f, "],\n  \"rows\": [\n");
    for (size_t k = 0; k < rows_.size(); ++k) {
      const Row& r = rows_[k];
      std::fprintf(f,
                   "    {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
                   "\"root\": %d, \"out_of_place\": %s, \"in_place\": %s}%s\n",
                   r.size, r.count, r.type, r.op, r.root, cellJson(r.oop).c_str(),
                   cellJson(r.ip).c_str(), k + 1 < rows_.size() ? "," : "");
    }
    std::fprintf(f, "  ],\n  \"wrong_total\": %" PRId64 ",\n  \"oob_total\": %" PRId64
                    ",\n  \"avg_busbw_GBps\": %s\n}\n",
                 wrongTotal_, oobTotal_, jsonNum(avgBus).c_str());
    if (std::fclose(f) != 0) jsonFailed_ = true;
  }

  int finish() {
    double avgBus = bwCount_ ? bwSum_ / bwCount_ : 0.0;
    if (rank_ == 0) {
      std::printf("# Out of bounds values : %" PRId64 " %s\n", oobTotal_, oobTotal_ ? "FAILED" : "OK");
      std::printf("# Avg bus bandwidth    : %g \n", avgBus);
      if (o_.check)
        std::printf("# Wrong values         : %" PRId64 " %s\n", wrongTotal_, wrongTotal_ ? "FAILED" : "OK");
      std::printf("#\n");
      std::fflush(stdout);
      if (!o_.json.empty()) writeJson(avgBus);
    }
    if (wrongTotal_ > 0 || oobTotal_ > 0) return 3;
    return jsonFailed_ ? 1 : 0;
  }

  const Options& o_;
  loomComm_t comm_;
  loomStream_t stream_;
  int rank_, n_;
  size_t cap_ = 0;
  char* send_ = nullptr;
  char* recv_ = nullptr;
  char* hostSend_ = nullptr;  // send_/recv_ themselves, or with -G their host copies
  char* hostRecv_ = nullptr;
  char* scratch_ = nullptr;   // -G: device memory for smallAllReduce
  void* sendReg_ = nullptr;  // -R: the registrations of send_ and recv_
  void* recvReg_ = nullptr;
  std::vector<double> times_;
  std::vector<Row> rows_;
  std::vector<std::string> env_;
  double bwSum_ = 0;
  int bwCount_ = 0;
  int64_t wrongTotal_ = 0, oobTotal_ = 0;
  bool jsonFailed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  Options o = parseArgs(argc, argv);

  CudaRuntime cuda;
  if (o.cuda) {
    std::string why;
    if (!cuda.open(&why)) {
      std::fprintf(stderr, "loom-perf: --device cuda: no CUDA device: %s\n", why.c_str());
      return 2;
    }
    gCuda = &cuda;
    // The communicator's device is the current one at init: ranks of a
    // host spread over its devices by local rank.
    long local = 0;
    for (const char* v : {"LOOM_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
      if (const char* s = std::getenv(v)) {
        local = std::strtol(s, nullptr, 10);
        break;
      }
    CUDACHECK(setDevice(static_cast<int>(local % cuda.devices)));
    setenv("LOOM_DEVICE", "cuda", 1);
  }

  LOOMCHECK(loomCommInitFromEnv(&gComm));
  int nranks = 0;
  LOOMCHECK(loomCommUserRank(gComm, &gRank));
  LOOMCHECK(loomCommCount(gComm, &nranks));
  if (o.coll->rooted && o.root >= nranks) {
    if (gRank == 0)
      std::fprintf(stderr, "loom-perf: -r %d: the root must be in [0, %d)\n", o.root, nranks);
    loomCommDestroy(gComm);
    return 2;
  }
  if (o.pattern != Options::kExchange && nranks % 2) {
    if (gRank == 0)
      std::fprintf(stderr, "loom-perf: -p %s pairs even and odd ranks: it needs an even number of ranks, not %d\n",
                   kPatternNames[o.pattern], nranks);
    loomCommDestroy(gComm);
    return 2;
  }
  loomStream_t stream = nullptr;
  if (o.cuda) {
    void* cs = nullptr;
    CUDACHECK(streamCreateWithFlags(&cs, 1u));  // cudaStreamNonBlocking
    stream = static_cast<loomStream_t>(cs);
  } else if (o.stream) {
    LOOMCHECK(loomStreamCreate(&stream));
  }

  int rc;
  {
    Bench bench(o, gComm, stream, gRank, nranks);
    rc = bench.run();
  }
  if (o.cuda)
    CUDACHECK(streamDestroy(stream));
  else if (stream)
    LOOMCHECK(loomStreamDestroy(stream));
  LOOMCHECK(loomCommDestroy(gComm));
  gComm = nullptr;
  return rc;
}
