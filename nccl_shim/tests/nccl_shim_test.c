/*
 * An NCCL program that knows only nccl.h and is linked only with
 * libloom_nccl.so.  Run under loom-run (LOOM_RANK, LOOM_WORLD_SIZE,
 * LOOM_SECRET); rank 0 makes the ncclUniqueId and hands it to the others in a
 * file named after the job's secret in the directory given as argv[1].  Host
 * buffers, stream 0.  Every collective's result is checked element by element
 * against the value computed here; error paths check the code and the text
 * of ncclGetLastError.  Exits 0 when all pass.
 */
#include <math.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, nranks;

#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      fprintf(stderr, "rank %d: line %d: ", rank, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                          \
      fputc('\n', stderr);                                   \
      exit(1);                                               \
    }                                                        \
  } while (0)
#define OK(call)                                                                                     \
  do {                                                                                               \
    ncclResult_t r_ = (call);                                                                        \
    CHECK(r_ == ncclSuccess, "%s -> %s: %s", #call, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
  } while (0)
/* call must fail with code, and ncclGetLastError must contain text. */
#define FAILS(call, code, text)                                                                             \
  do {                                                                                                      \
    ncclResult_t r_ = (call);                                                                               \
    CHECK(r_ == (code), "%s -> %d, expected %d (%s)", #call, (int)r_, (int)(code), ncclGetLastError(NULL)); \
    CHECK(strstr(ncclGetLastError(NULL), text), "%s: last error \"%s\" lacks \"%s\"", #call,                \
          ncclGetLastError(NULL), text);                                                                    \
  } while (0)
#define PASSED(what) \
  if (rank == 0) printf("ok: %s\n", what)

/* ---- values in every datatype ------------------------------------------ */

static size_t tsize(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    default:
      return 8;
  }
}

static int isInt(ncclDataType_t t) { return t <= ncclUint64; }

/* Small integers and quarters, which every type here holds exactly. */
static uint16_t toHalf(double v) {
  if (v == 0) return 0;
  int e = 0;
  double m = frexp(v, &e); /* v = m * 2^e, 0.5 <= m < 1 */
  return (uint16_t)(((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024));
}
static double fromHalf(uint16_t h) {
  int e = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (e == 0) return ldexp(man, -24);
  return ldexp(1 + man / 1024.0, e - 15);
}

static void put(ncclDataType_t t, void* buf, size_t i, double v) {
  char* p = (char*)buf + i * tsize(t);
  switch (t) {
    case ncclInt8:
      *(int8_t*)p = (int8_t)v;
      break;
    case ncclUint8:
      *(uint8_t*)p = (uint8_t)v;
      break;
    case ncclInt32:
      *(int32_t*)p = (int32_t)v;
      break;
    case ncclUint32:
      *(uint32_t*)p = (uint32_t)v;
      break;
    case ncclInt64:
      *(int64_t*)p = (int64_t)v;
      break;
    case ncclUint64:
      *(uint64_t*)p = (uint64_t)v;
      break;
    case ncclFloat16:
      *(uint16_t*)p = toHalf(v);
      break;
    case ncclBfloat16: {
      float f = (float)v;
      uint32_t bits;
      memcpy(&bits, &f, 4);
      *(uint16_t*)p = (uint16_t)(bits >> 16);
      break;
    }
    case ncclFloat32:
      *(float*)p = (float)v;
      break;
    default:
      *(double*)p = v;
      break;
  }
}

static double get(ncclDataType_t t, const void* buf, size_t i) {
  const char* p = (const char*)buf + i * tsize(t);
  switch (t) {
    case ncclInt8:
      return *(const int8_t*)p;
    case ncclUint8:
      return *(const uint8_t*)p;
    case ncclInt32:
      return *(const int32_t*)p;
    case ncclUint32:
      return *(const uint32_t*)p;
    case ncclInt64:
      return (double)*(const int64_t*)p;
    case ncclUint64:
      return (double)*(const uint64_t*)p;
    case ncclFloat16:
      return fromHalf(*(const uint16_t*)p);
    case ncclBfloat16: {
      uint32_t bits = (uint32_t) * (const uint16_t*)p << 16;
      float f;
      memcpy(&f, &bits, 4);
      return f;
    }
    case ncclFloat32:
      return *(const float*)p;
    default:
      return *(const double*)p;
  }
}

/* What rank r contributes at index i: 1..3, so 4 ranks' product fits int8. */
static double value(int r, size_t i) { return 1 + (double)((r + i) % 3); }

static double expected(ncclRedOp_t op, ncclDataType_t t, size_t i) {
  double acc = value(0, i);
  for (int r = 1; r < nranks; ++r) {
    double v = value(r, i);
    if (op == ncclSum || op == ncclAvg)
      acc += v;
    else if (op == ncclProd)
      acc *= v;
    else if (op == ncclMax)
      acc = v > acc ? v : acc;
    else
      acc = v < acc ? v : acc;
  }
  if (op == ncclAvg) acc = isInt(t) ? floor(acc / nranks) : acc / nranks;
  return acc;
}

static void* fill(ncclDataType_t t, size_t count, double (*f)(size_t)) {
  void* b = malloc(count * tsize(t) + 1);
  CHECK(b, "out of memory");
  for (size_t i = 0; i < count; ++i) put(t, b, i, f(i));
  return b;
}
static double mine(size_t i) { return value(rank, i); }
static double sentinel(size_t i) { return (double)(i % 7) + 100; }

static void expectAll(const char* what, ncclDataType_t t, const void* buf, size_t count,
                      double (*want)(size_t)) {
  for (size_t i = 0; i < count; ++i)
    CHECK(get(t, buf, i) == want(i), "%s (type %d, count %zu): element %zu is %g, expected %g", what, (int)t,
          count, i, get(t, buf, i), want(i));
}

/* ---- the tests ------------------------------------------------------------ */

static ncclRedOp_t gOp;
static ncclDataType_t gType;
static double wantReduced(size_t i) { return expected(gOp, gType, i); }

static void allReduceEveryOp(ncclComm_t comm) {
  static const size_t counts[] = {1, 1000, 70001};
  for (int t = ncclInt8; t <= ncclBfloat16; ++t)
    for (int op = ncclSum; op <= ncclAvg; ++op)
      for (size_t c = 0; c < sizeof counts / sizeof counts[0]; ++c) {
        size_t n = counts[c];
        gOp = (ncclRedOp_t)op, gType = (ncclDataType_t)t;
        void* send = fill(gType, n, mine);
        void* recv = fill(gType, n, sentinel);
        OK(ncclAllReduce(send, recv, n, gType, gOp, comm, 0));
        expectAll("ncclAllReduce", gType, recv, n, wantReduced);
        OK(ncclAllReduce(send, send, n, gType, gOp, comm, 0)); /* in place */
        expectAll("ncclAllReduce in place", gType, send, n, wantReduced);
        free(send);
        free(recv);
      }
  PASSED("ncclAllReduce: 10 types x sum/prod/max/min/avg x 3 counts, out of place and in place");
}

static double wantPreMul(size_t i) {
  double acc = 0;
  for (int r = 0; r < nranks; ++r) acc += (r + 1) * value(r, i);
  return acc;
}

static void preMulSum(ncclComm_t comm) {
  const ncclDataType_t types[] = {ncclFloat32, ncclFloat64, ncclInt32, ncclFloat16, ncclBfloat16};
  for (size_t k = 0; k < sizeof types / sizeof types[0]; ++k) {
    ncclDataType_t t = types[k];
    gType = t;
    char scalar[8];
    put(t, scalar, 0, rank + 1);
    ncclRedOp_t op;
    ncclScalarResidence_t where = k % 2 ? ncclScalarDevice : ncclScalarHostImmediate;
    OK(ncclRedOpCreatePreMulSum(&op, scalar, t, where, comm));
    CHECK((int)op >= (int)ncclNumOps, "PreMulSum op %d collides with a built-in op", (int)op);
    size_t n = 4099;
    void* send = fill(t, n, mine);
    void* recv = fill(t, n, sentinel);
    OK(ncclAllReduce(send, recv, n, t, op, comm, 0));
    expectAll("ncclAllReduce PreMulSum", t, recv, n, wantPreMul);
    expectAll("PreMulSum leaves sendbuff alone", t, send, n, mine);
    /* Reduce-scatter with the op: block r of the scaled sum. */
    void* big = fill(t, n * nranks, mine);
    OK(ncclReduceScatter(big, recv, n, t, op, comm, 0));
    for (size_t i = 0; i < n; ++i) {
      double acc = 0;
      for (int r = 0; r < nranks; ++r) acc += (r + 1) * value(r, (size_t)rank * n + i);
      CHECK(get(t, recv, i) == acc, "ncclReduceScatter PreMulSum type %d element %zu: %g, expected %g",
            (int)t, i, get(t, recv, i), acc);
    }
    FAILS(ncclAllReduce(send, recv, n, t == ncclFloat32 ? ncclFloat64 : ncclFloat32, op, comm, 0),
          ncclInvalidArgument, "was made for datatype");
    OK(ncclRedOpDestroy(op, comm));
    FAILS(ncclAllReduce(send, recv, n, t, op, comm, 0), ncclInvalidArgument, "unknown reduction op");
    free(send);
    free(recv);
    free(big);
  }
  PASSED("ncclRedOpCreatePreMulSum: float32, float64, int32, float16, bfloat16; host and device residence");
}

static int gRoot;
static double rootValue(size_t i) { return value(gRoot, i) * 10 + (double)(i % 5); }
static double rootsOwn(size_t i) { return rank == gRoot ? rootValue(i) : sentinel(i); }

static void broadcastAndReduce(ncclComm_t comm) {
  size_t n = 5000;
  gType = ncclInt32;
  for (gRoot = 0; gRoot < nranks; ++gRoot) {
    void* send = fill(ncclInt32, n, rootsOwn);
    void* recv = fill(ncclInt32, n, sentinel);
    OK(ncclBroadcast(send, recv, n, ncclInt32, gRoot, comm, 0));
    expectAll("ncclBroadcast", ncclInt32, recv, n, rootValue);
    OK(ncclBcast(send, n, ncclInt32, gRoot, comm, 0));
    expectAll("ncclBcast", ncclInt32, send, n, rootValue);
    free(send);
    free(recv);
  }
  PASSED("ncclBroadcast and ncclBcast from every root");
  gType = ncclFloat64;
  gOp = ncclSum;
  for (gRoot = 0; gRoot < nranks; ++gRoot) {
    void* send = fill(ncclFloat64, n, mine);
    void* recv = rank == gRoot ? fill(ncclFloat64, n, sentinel) : NULL;
    OK(ncclReduce(send, recv, n, ncclFloat64, ncclSum, gRoot, comm, 0));
    if (rank == gRoot) expectAll("ncclReduce", ncclFloat64, recv, n, wantReduced);
    OK(ncclReduce(send, send, n, ncclFloat64, ncclMax, gRoot, comm, 0));
    gOp = ncclMax;
    if (rank == gRoot) expectAll("ncclReduce max in place", ncclFloat64, send, n, wantReduced);
    gOp = ncclSum;
    free(send);
    free(recv);
  }
  PASSED("ncclReduce to every root (NULL recvbuff off root), sum and in-place max");
}

static size_t gBlock;
static double blockOfRank(size_t i) {
  return value((int)(i / gBlock), i % gBlock) * 3 + (double)(i / gBlock);
}
static double myBlock(size_t i) { return blockOfRank((size_t)rank * gBlock + i); }

static void allGatherAndReduceScatter(ncclComm_t comm) {
  gBlock = 777;
  size_t n = gBlock * nranks;
  void* send = fill(ncclInt64, gBlock, myBlock);
  void* recv = fill(ncclInt64, n, sentinel);
  OK(ncclAllGather(send, recv, gBlock, ncclInt64, comm, 0));
  expectAll("ncclAllGather", ncclInt64, recv, n, blockOfRank);
  void* inplace = fill(ncclInt64, n, sentinel);
  memcpy((char*)inplace + (size_t)rank * gBlock * 8, send, gBlock * 8);
  OK(ncclAllGather((char*)inplace + (size_t)rank * gBlock * 8, inplace, gBlock, ncclInt64, comm, 0));
  expectAll("ncclAllGather in place", ncclInt64, inplace, n, blockOfRank);
  free(send);
  free(recv);
  free(inplace);
  /* float8 moves as bytes where nothing is reduced. */
  unsigned char f8[4] = {(unsigned char)(0x10 + rank), 0x7e, 0x80, 0x01}, all8[64];
  OK(ncclAllGather(f8, all8, 4, ncclFloat8e4m3, comm, 0));
  for (int r = 0; r < nranks; ++r)
    CHECK(all8[r * 4] == 0x10 + r && all8[r * 4 + 2] == 0x80, "float8 all-gather");
  PASSED("ncclAllGather, in place, and float8 as bytes");

  size_t rc = 513;
  gType = ncclInt32;
  for (int op = ncclSum; op <= ncclMin; op += 2) { /* sum and max */
    gOp = (ncclRedOp_t)op;
    void* in = fill(ncclInt32, rc * nranks, mine);
    void* out = fill(ncclInt32, rc, sentinel);
    OK(ncclReduceScatter(in, out, rc, ncclInt32, gOp, comm, 0));
    for (size_t i = 0; i < rc; ++i)
      CHECK(get(ncclInt32, out, i) == expected(gOp, ncclInt32, (size_t)rank * rc + i),
            "ncclReduceScatter op %d element %zu", op, i);
    OK(ncclReduceScatter(in, (char*)in + (size_t)rank * rc * 4, rc, ncclInt32, gOp, comm, 0)); /* in place */
    for (size_t i = 0; i < rc; ++i)
      CHECK(get(ncclInt32, in, (size_t)rank * rc + i) == expected(gOp, ncclInt32, (size_t)rank * rc + i),
            "ncclReduceScatter in place op %d element %zu", op, i);
    free(in);
    free(out);
  }
  PASSED("ncclReduceScatter sum and max, in place");
}

/* AlltoAll: element i of the block rank s sends to rank d. */
static double a2a(int s, int d, size_t i) { return s * 1000 + d * 10 + (double)(i % 10); }

static void alltoallGatherScatter(ncclComm_t comm) {
  size_t c = 1001, n = c * nranks;
  float* send = malloc(n * 4);
  float* recv = malloc(n * 4);
  for (int d = 0; d < nranks; ++d)
    for (size_t i = 0; i < c; ++i) send[d * c + i] = (float)a2a(rank, d, i), recv[d * c + i] = -1;
  OK(ncclAlltoAll(send, recv, c, ncclFloat32, comm, 0));
  for (int s = 0; s < nranks; ++s)
    for (size_t i = 0; i < c; ++i)
      CHECK(recv[s * c + i] == (float)a2a(s, rank, i), "ncclAlltoAll block %d element %zu: %g", s, i,
            recv[s * c + i]);
  PASSED("ncclAlltoAll");
  /* In place (sendbuff == recvbuff), as nccl-tests' alltoall_perf calls it. */
  for (int d = 0; d < nranks; ++d)
    for (size_t i = 0; i < c; ++i) send[d * c + i] = (float)a2a(rank, d, i);
  OK(ncclAlltoAll(send, send, c, ncclFloat32, comm, 0));
  for (int s = 0; s < nranks; ++s)
    for (size_t i = 0; i < c; ++i)
      CHECK(send[s * c + i] == (float)a2a(s, rank, i), "ncclAlltoAll in place block %d element %zu: %g", s, i,
            send[s * c + i]);
  PASSED("ncclAlltoAll in place");

  for (int root = 0; root < nranks; ++root) {
    for (size_t i = 0; i < n; ++i) recv[i] = -1;
    for (size_t i = 0; i < c; ++i) send[i] = (float)a2a(rank, root, i);
    OK(ncclGather(send, rank == root ? recv : NULL, c, ncclFloat32, root, comm, 0));
    if (rank == root)
      for (int s = 0; s < nranks; ++s)
        for (size_t i = 0; i < c; ++i)
          CHECK(recv[s * c + i] == (float)a2a(s, root, i), "ncclGather root %d", root);
    /* In place at the root: sendbuff == recvbuff + root*count. */
    float* mineAt = rank == root ? recv + (size_t)root * c : send;
    for (size_t i = 0; i < n && rank == root; ++i) recv[i] = -1;
    for (size_t i = 0; i < c; ++i) mineAt[i] = (float)a2a(rank, root, i);
    OK(ncclGather(mineAt, rank == root ? recv : NULL, c, ncclFloat32, root, comm, 0));
    if (rank == root)
      for (int s = 0; s < nranks; ++s)
        for (size_t i = 0; i < c; ++i)
          CHECK(recv[s * c + i] == (float)a2a(s, root, i), "in-place ncclGather");

    for (int d = 0; d < nranks; ++d)
      for (size_t i = 0; i < c; ++i) send[d * c + i] = (float)a2a(root, d, i);
    for (size_t i = 0; i < c; ++i) recv[i] = -1;
    OK(ncclScatter(rank == root ? send : NULL, recv, c, ncclFloat32, root, comm, 0));
    for (size_t i = 0; i < c; ++i) CHECK(recv[i] == (float)a2a(root, rank, i), "ncclScatter root %d", root);
    if (rank == root) { /* in place: recvbuff == sendbuff + root*count */
      OK(ncclScatter(send, send + (size_t)root * c, c, ncclFloat32, root, comm, 0));
      for (size_t i = 0; i < c; ++i)
        CHECK(send[root * c + i] == (float)a2a(root, root, i), "in-place ncclScatter");
    } else {
      OK(ncclScatter(NULL, recv, c, ncclFloat32, root, comm, 0));
      for (size_t i = 0; i < c; ++i) CHECK(recv[i] == (float)a2a(root, rank, i), "ncclScatter root %d", root);
    }
  }
  PASSED("ncclGather and ncclScatter from every root, in place at the root");
  free(send);
  free(recv);
}

static void sendRecvAndGroups(ncclComm_t comm) {
  int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  size_t n = 100000;
  int32_t* out = malloc(n * 4);
  int32_t* in = malloc(n * 4);
  for (size_t i = 0; i < n; ++i) out[i] = rank * 100000 + (int32_t)i, in[i] = -1;
  OK(ncclGroupStart());
  OK(ncclSend(out, n, ncclInt32, next, comm, 0));
  OK(ncclRecv(in, n, ncclInt32, prev, comm, 0));
  OK(ncclGroupEnd());
  for (size_t i = 0; i < n; ++i) CHECK(in[i] == prev * 100000 + (int32_t)i, "ring send/recv element %zu", i);
  /* Without a group: even ranks send first, odd ranks receive first. */
  if (rank % 2 == 0 && nranks % 2 == 0) {
    OK(ncclSend(out, 10, ncclInt32, next, comm, 0));
    OK(ncclRecv(in, 10, ncclInt32, prev, comm, 0));
  } else if (nranks % 2 == 0) {
    OK(ncclRecv(in, 10, ncclInt32, prev, comm, 0));
    OK(ncclSend(out, 10, ncclInt32, next, comm, 0));
  }
  for (size_t i = 0; i < 10; ++i)
    CHECK(in[i] == prev * 100000 + (int32_t)i, "blocking send/recv element %zu", i);
  PASSED("ncclSend/ncclRecv in a group (ring) and blocking");

  /* A group of several collectives, AlltoAll among them, nested groups. */
  gType = ncclFloat32;
  gOp = ncclSum;
  size_t c = 3000;
  void* a = fill(ncclFloat32, c, mine);
  void* b = fill(ncclFloat32, c, mine);
  void* ra = fill(ncclFloat32, c, sentinel);
  float* s2 = malloc(nranks * 4 * sizeof(float));
  float* r2 = malloc(nranks * 4 * sizeof(float));
  for (int d = 0; d < nranks; ++d)
    for (int i = 0; i < 4; ++i) s2[d * 4 + i] = (float)a2a(rank, d, (size_t)i);
  OK(ncclGroupStart());
  OK(ncclAllReduce(a, ra, c, ncclFloat32, ncclSum, comm, 0));
  OK(ncclGroupStart());
  OK(ncclAllReduce(b, b, c, ncclFloat32, ncclSum, comm, 0));
  OK(ncclAlltoAll(s2, r2, 4, ncclFloat32, comm, 0));
  OK(ncclGroupEnd());
  OK(ncclGroupEnd());
  expectAll("group: first all-reduce", ncclFloat32, ra, c, wantReduced);
  expectAll("group: second all-reduce (in place)", ncclFloat32, b, c, wantReduced);
  for (int s = 0; s < nranks; ++s)
    for (int i = 0; i < 4; ++i) CHECK(r2[s * 4 + i] == (float)a2a(s, rank, (size_t)i), "group: alltoall");
  PASSED("groups: nested, two all-reduces and an all-to-all launched together");

  /* A group with a refused member is not launched at all. */
  void* untouched = fill(ncclFloat32, c, sentinel);
  OK(ncclGroupStart());
  OK(ncclAllReduce(a, untouched, c, ncclFloat32, ncclSum, comm, 0));
  FAILS(ncclAllReduce(a, b, c, ncclFloat32, ncclSum, comm, (cudaStream_t)0x1000), ncclInvalidUsage,
        "CUDA stream");
  FAILS(ncclGroupEnd(), ncclInvalidUsage, "was not launched");
  expectAll("the cancelled group wrote nothing", ncclFloat32, untouched, c, sentinel);
  FAILS(ncclGroupEnd(), ncclInvalidUsage, "no matching ncclGroupStart");
  PASSED("a group with a refused call is not launched; ncclGroupEnd without start fails");
  free(out), free(in), free(a), free(b), free(ra), free(s2), free(r2), free(untouched);
}

static void split(ncclComm_t comm) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ncclComm_t sub = NULL;
  /* color: parity; key: -rank, so the new order is reversed. */
  OK(ncclCommSplit(comm, rank % 2, -rank, &sub, &config));
  CHECK(sub, "ncclCommSplit gave no communicator");
  int subN = 0, subRank = -1;
  OK(ncclCommCount(sub, &subN));
  OK(ncclCommUserRank(sub, &subRank));
  int members = (nranks - rank % 2 + 1) / 2;
  CHECK(subN == members, "split: %d ranks, expected %d", subN, members);
  CHECK(subRank == members - 1 - rank / 2, "split: rank %d, expected %d", subRank, members - 1 - rank / 2);
  int64_t v = rank, sum = 0, want = 0;
  for (int r = rank % 2; r < nranks; r += 2) want += r;
  OK(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, sub, 0));
  CHECK(sum == want, "split: all-reduce %lld, expected %lld", (long long)sum, (long long)want);

  /* A group spanning two communicators (each on its own loom host stream). */
  int64_t worldSum = 0, subSum = 0, worldWant = (int64_t)nranks * (nranks - 1) / 2;
  OK(ncclGroupStart());
  OK(ncclAllReduce(&v, &worldSum, 1, ncclInt64, ncclSum, comm, 0));
  OK(ncclAllReduce(&v, &subSum, 1, ncclInt64, ncclSum, sub, 0));
  OK(ncclGroupEnd());
  CHECK(worldSum == worldWant && subSum == want, "two-communicator group: %lld %lld", (long long)worldSum,
        (long long)subSum);
  OK(ncclCommDestroy(sub));

  /* NCCL_SPLIT_NOCOLOR: the last rank is left out. */
  ncclComm_t most = (ncclComm_t)0x1;
  OK(ncclCommSplit(comm, rank == nranks - 1 ? NCCL_SPLIT_NOCOLOR : 7, 0, &most, NULL));
  if (rank == nranks - 1) {
    CHECK(most == NULL, "NCCL_SPLIT_NOCOLOR gave a communicator");
  } else {
    OK(ncclCommCount(most, &subN));
    CHECK(subN == nranks - 1, "split without the last rank: %d ranks", subN);
    OK(ncclCommDestroy(most));
  }
  ncclConfig_t bad;
  memset(&bad, 0, sizeof bad);
  FAILS(ncclCommSplit(comm, 0, 0, &sub, &bad), ncclInvalidArgument, "NCCL_CONFIG_INITIALIZER");
  PASSED("ncclCommSplit (colors, keys, NOCOLOR, config), a group over two communicators");
}

/* ncclCommRevoke and ncclCommShrink, on communicators split off for it:
 * the excluded rank does not call shrink (NCCL's contract). */
static void revokeAndShrink(ncclComm_t comm) {
  ncclComm_t parent = NULL, child = NULL;
  int64_t v = rank, sum = 0, want = 0;
  for (int r = 0; r < nranks - 1; ++r) want += r;
  int last = nranks - 1, n = 0;

  /* Revoke, then shrink without the last rank. */
  OK(ncclCommSplit(comm, 0, rank, &parent, NULL));
  OK(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, parent, 0));
  FAILS(ncclCommRevoke(parent, 1), ncclInvalidArgument, "NCCL_REVOKE_DEFAULT");
  OK(ncclCommRevoke(parent, NCCL_REVOKE_DEFAULT));
  OK(ncclCommRevoke(parent, NCCL_REVOKE_DEFAULT)); /* again: nothing more to do */
  ncclResult_t async = ncclInternalError;
  OK(ncclCommGetAsyncError(parent, &async));
  CHECK(async == ncclSuccess, "revoked communicator: async state %d, expected ncclSuccess (quiescent)", (int)async);
  FAILS(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, parent, 0), ncclInvalidUsage, "revoked");
  FAILS(ncclCommFinalize(parent), ncclInvalidUsage, "revoked");
  FAILS(ncclCommShrink(parent, &last, 1, &child, NULL, 2), ncclInvalidArgument, "shrinkFlags 2");
  FAILS(ncclCommShrink(parent, NULL, 1, &child, NULL, NCCL_SHRINK_DEFAULT), ncclInvalidArgument, "excludeRanksList");
  if (rank != last) {
    OK(ncclCommShrink(parent, &last, 1, &child, NULL, NCCL_SHRINK_DEFAULT));
    CHECK(child, "ncclCommShrink gave no communicator");
    OK(ncclCommCount(child, &n));
    CHECK(n == nranks - 1, "shrunk communicator of %d ranks, expected %d", n, nranks - 1);
    sum = 0;
    OK(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, child, 0));
    CHECK(sum == want, "shrunk all-reduce %lld, expected %lld", (long long)sum, (long long)want);
    OK(ncclCommDestroy(child));
  }
  OK(ncclCommDestroy(parent));

  /* NCCL_SHRINK_ABORT on a working communicator: revoke and shrink in one
   * call; nobody excluded. */
  OK(ncclCommSplit(comm, 0, rank, &parent, NULL));
  OK(ncclCommShrink(parent, NULL, 0, &child, NULL, NCCL_SHRINK_ABORT));
  OK(ncclCommCount(child, &n));
  CHECK(n == nranks, "NCCL_SHRINK_ABORT, nobody excluded: %d ranks", n);
  FAILS(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, parent, 0), ncclInvalidUsage, "revoked");
  sum = 0;
  OK(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, child, 0));
  CHECK(sum == (int64_t)nranks * (nranks - 1) / 2, "all-reduce after NCCL_SHRINK_ABORT: %lld", (long long)sum);
  OK(ncclCommDestroy(child));
  OK(ncclCommAbort(parent));
  PASSED("ncclCommRevoke, ncclCommShrink (the excluded rank does not call; NCCL_SHRINK_ABORT)");
}

static void errorsAndRest(ncclComm_t comm) {
  float x[4] = {0}, y[4];
  FAILS(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, comm, (cudaStream_t)0x1234), ncclInvalidUsage,
        "CUDA stream");
  FAILS(ncclBroadcast(x, y, 4, ncclFloat32, 0, comm, (cudaStream_t)0x1234), ncclInvalidUsage, "stream 0");
  FAILS(ncclAllReduce(x, y, 4, ncclFloat8e4m3, ncclSum, comm, 0), ncclInvalidUsage, "float8");
  FAILS(ncclAllReduce(x, y, 4, (ncclDataType_t)99, ncclSum, comm, 0), ncclInvalidArgument, "datatype 99");
  FAILS(ncclAllReduce(x, y, 4, ncclFloat32, (ncclRedOp_t)77, comm, 0), ncclInvalidArgument, "op 77");
  FAILS(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, NULL, 0), ncclInvalidArgument, "comm is NULL");
  FAILS(ncclBroadcast(x, y, 4, ncclFloat32, nranks, comm, 0), ncclInvalidArgument, "root");
  FAILS(ncclAllReduce(NULL, y, 4, ncclFloat32, ncclSum, comm, 0), ncclInvalidArgument, "sendbuff is NULL");
  FAILS(ncclAlltoAll(NULL, y, 1, ncclFloat32, comm, 0), ncclInvalidArgument, "sendbuff is NULL");
  FAILS(ncclGather(x, y, 1, ncclFloat32, -1, comm, 0), ncclInvalidArgument, "root -1");
  FAILS(ncclSend(x, 4, ncclFloat32, nranks, comm, 0), ncclInvalidArgument, "peer");
  /* ncclCommInitAll: without a GPU (LOOM_DEVICE=auto) two host
   * communicators in this process, driven from this thread by a group. */
  ncclComm_t all[2] = {NULL, NULL};
  OK(ncclCommInitAll(all, 2, NULL));
  {
    int64_t v[2] = {5 + rank, 7}, s[2] = {0, 0};
    int n0 = 0, r1 = -1;
    OK(ncclCommCount(all[0], &n0));
    OK(ncclCommUserRank(all[1], &r1));
    CHECK(n0 == 2 && r1 == 1, "InitAll: count %d, rank %d", n0, r1);
    OK(ncclGroupStart());
    for (int i = 0; i < 2; ++i) OK(ncclAllReduce(&v[i], &s[i], 1, ncclInt64, ncclSum, all[i], 0));
    OK(ncclGroupEnd());
    CHECK(s[0] == 12 + rank && s[1] == 12 + rank, "InitAll: sums %lld %lld", (long long)s[0],
          (long long)s[1]);
    OK(ncclCommDestroy(all[0]));
    OK(ncclCommDestroy(all[1]));
  }
  FAILS(ncclCommInitAll(all, 0, NULL), ncclInvalidArgument, "ndev 0");
  int dev;
  FAILS(ncclCommCuDevice(comm, &dev), ncclInvalidUsage, "no CUDA device");
  FAILS(ncclCommWindowRegister(comm, x, sizeof x, NULL, 0), ncclInvalidUsage, "symmetric memory");
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  OK(ncclGroupStart());
  FAILS(ncclGroupSimulateEnd(&sim), ncclInvalidUsage, "cannot simulate");
  CHECK(strlen(ncclGetErrorString(ncclInvalidUsage)) > 0, "no error string");
  PASSED(
      "errors: CUDA stream, float8 reduction, bad type/op/comm/root/peer/buffer, CuDevice, windows; InitAll "
      "on the host");

  ncclResult_t async = ncclInternalError;
  OK(ncclCommGetAsyncError(comm, &async));
  CHECK(async == ncclSuccess, "async error %d", (int)async);

  void* mem = NULL;
  OK(ncclMemAlloc(&mem, 1 << 20));
  CHECK(mem && ((uintptr_t)mem % 4096) == 0, "ncclMemAlloc: %p is not 4096-aligned", mem);
  void* handle = NULL;
  OK(ncclCommRegister(comm, mem, 1 << 20, &handle));
  gType = ncclFloat32;
  gOp = ncclSum;
  for (size_t i = 0; i < 1000; ++i) put(ncclFloat32, mem, i, mine(i));
  OK(ncclAllReduce(mem, mem, 1000, ncclFloat32, ncclSum, comm, 0));
  expectAll("all-reduce in ncclMemAlloc'd, registered memory", ncclFloat32, mem, 1000, wantReduced);
  OK(ncclCommDeregister(comm, handle));
  FAILS(ncclCommDeregister(comm, handle), ncclInvalidArgument, "not a registration");
  OK(ncclMemFree(mem));
  PASSED("ncclMemAlloc (4096-aligned host memory), ncclCommRegister/Deregister, ncclCommGetAsyncError");
}

static void exchangeId(const char* dir, ncclUniqueId* id) {
  const char* secret = getenv("LOOM_SECRET");
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/nccl_id.%s", dir, secret ? secret : "nosecret");
  if (rank == 0) {
    OK(ncclGetUniqueId(id));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    CHECK(f && fwrite(id, sizeof *id, 1, f) == 1 && fclose(f) == 0, "cannot write %s", tmp);
    CHECK(rename(tmp, path) == 0, "cannot rename %s", tmp);
    return;
  }
  for (int tries = 0; tries < 6000; ++tries) {
    FILE* f = fopen(path, "rb");
    if (f) {
      size_t got = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (got == 1) return;
    }
    usleep(10000);
  }
  CHECK(0, "no unique id in %s after 60 s", path);
}

int main(int argc, char** argv) {
  const char* r = getenv("LOOM_RANK");
  const char* n = getenv("LOOM_WORLD_SIZE");
  if (argc < 2 || !r || !n) {
    fprintf(
        stderr,
        "usage: loom-run -n N nccl-shim-test DIR [--init-only] (DIR: where rank 0 leaves the unique id)\n");
    return 2;
  }
  rank = atoi(r);
  nranks = atoi(n);
  setvbuf(stdout, NULL, _IOLBF, 0);

  int version = 0;
  OK(ncclGetVersion(&version));
  CHECK(version == NCCL_VERSION_CODE, "ncclGetVersion %d, expected %d", version, NCCL_VERSION_CODE);
  CHECK(sizeof(ncclUniqueId) == 128, "ncclUniqueId is %zu bytes", sizeof(ncclUniqueId));

  ncclUniqueId id;
  exchangeId(argv[1], &id);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0; /* a blocking init is a valid non-blocking one */
  ncclComm_t comm = NULL;
  OK(ncclCommInitRankConfig(&comm, nranks, id, rank, &config));
  int count = 0, me = -1;
  OK(ncclCommCount(comm, &count));
  OK(ncclCommUserRank(comm, &me));
  CHECK(count == nranks && me == rank, "comm: %d ranks, rank %d", count, me);
  if (rank == 0) {
    char path[4096];
    snprintf(path, sizeof path, "%s/nccl_id.%s", argv[1],
             getenv("LOOM_SECRET") ? getenv("LOOM_SECRET") : "nosecret");
    unlink(path); /* every rank has joined, so every rank has read it */
  }
  PASSED("ncclGetVersion, ncclGetUniqueId, ncclCommInitRankConfig (blocking=0), Count, UserRank");
  if (argc > 2 && !strcmp(argv[2], "--init-only")) { /* for env_test.sh */
    int64_t v = rank, sum = 0;
    OK(ncclAllReduce(&v, &sum, 1, ncclInt64, ncclSum, comm, 0));
    CHECK(sum == (int64_t)nranks * (nranks - 1) / 2, "all-reduce %lld", (long long)sum);
    OK(ncclCommDestroy(comm));
    return 0;
  }

  allReduceEveryOp(comm);
  preMulSum(comm);
  broadcastAndReduce(comm);
  allGatherAndReduceScatter(comm);
  alltoallGatherScatter(comm);
  sendRecvAndGroups(comm);
  split(comm);
  revokeAndShrink(comm);
  errorsAndRest(comm);

  OK(ncclCommFinalize(comm));
  float x = 1, y = 0;
  FAILS(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, 0), ncclInvalidUsage, "finalized");
  OK(ncclCommDestroy(comm));
  PASSED("ncclCommFinalize (later calls refused), ncclCommDestroy");
  return 0;
}
