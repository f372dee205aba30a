// Multi-process test worker: runs one scenario as one rank (started by
// loom-run or by the fault tests) and exits 0 only if every check passed.
//
//   mp-worker matrix [counts] [types] [ops]   every collective x type x op x count,
//                                             in-place and out-of-place, exact
//   mp-worker sequence     mixed collectives on one and on two communicators at once
//   mp-worker group        send/recv rings, self send/recv, grouped collectives
//   mp-worker streams      many operations on a stream, one synchronize
//   mp-worker badargs      wrong arguments fail cleanly and do no harm
//   mp-worker mismatch     ranks calling different collectives get an error, no hang
//   mp-worker a2amismatch  an all-to-all whose counts disagree: an error, no hang
//   mp-worker a2ainplace   in-place all-to-all (even ranks only, then all):
//                          every size, streams, a group of two, exact
//   mp-worker pullmix      tiny all-reduces (the pull line) alternating with
//                          every other kind of operation, one rank late at
//                          times: all exact, none waits for a timeout
//   mp-worker smallmismatch count|path|coll|large  rank 0 calls another tiny
//                          all-reduce (or a broadcast) than the others, or
//                          the others a large one: all fail
//   mp-worker split        loomCommSplit into even/odd ranks
//   mp-worker tagged       loomSendTagged/loomRecvTagged: tags out of order,
//                          any source, eager and rendezvous sizes, too small a
//                          receive, stashed messages beside collectives
//   mp-worker taggednostash  (LOOM_TAGGED_STASH_BYTES=0) 50 messages wait in
//                          the connection until their receives, all exact
//   mp-worker taggedtimeout  receives nobody matches time out, naming themselves
//   mp-worker taggedfault one|any   tagged senders die (rank 1; every rank
//                          but 0): rank 0's receive is a remote error
//   mp-worker soak SEED N SECONDS   N random operations (collective, size,
//                          type, op, root, in-place, stream), all checked
//   mp-worker fault PHASE R B DIR   rank R dies (SIGKILL) during init, during a
//                          B-byte all-reduce or between two; every other rank
//                          writes what it got and how fast to DIR/rank<r>
//   mp-worker registered all|mixed|none [mapped]   loomMemAlloc / loomCommRegister
//                          buffers (every rank's, odd ranks', none) are exact; bad
//                          handles; mapped: peers must have mapped them
//   mp-worker rendezvous SIZES   (2 ranks) loomSend/loomRecv of each size in bytes
//                          both ways, exact and nothing written past the end:
//                          buffers malloc'd and freed around every transfer, buffers
//                          from loomCommRegister, both directions at once in a group;
//                          last, a receive larger than its send fails both ranks
//   mp-worker shrinksatout   a live rank sits out one shrink, then joins the
//                          next one of the same parent: it succeeds everywhere
//   mp-worker manybuffers    zero-copy all-reduces over 80 loomMemAlloc buffers
//                          while another thread allocates and frees: exact
//   mp-worker fork           a forked child's call on its parent's communicator
//                          fails naming the fork; the parent's stay exact
//   mp-worker p2pgroups      (2 ranks) sends and receives around a collective in
//                          one group; refused groups leave the communicator in step
//   mp-worker unreceived matched|unmatched   rank 0 sends 16 floats to rank 1,
//                          which receives them or not; loomCommDestroy warns on
//                          rank 1 (and only there) exactly when they were not
//   mp-worker rendezvouskill VICTIM BYTES DIR   rank 0 sends BYTES to rank 1 again
//                          and again; VICTIM dies (SIGKILL) 300 ms into the third
//                          transfer; the other writes what it got to DIR/rank<r>
//   mp-worker cpubind bound|unbound [launcher]   LOOM_CPU_BIND: after init every
//                          thread (one started before init too) runs on the
//                          rank's new CPU set, local ranks' sets are even
//                          contiguous blocks (bound), or the sets are what they
//                          were (unbound); launcher: each rank binds itself to
//                          CPU rank % ncpu before init, as mpirun would
//   mp-worker dump         rank 1 is late: rank 0 checks loomCommDump, the
//                          LOOM_DUMP_SIGNAL output and its timeout message
//   mp-worker shrink MODE VICTIMS B DIR   the survivors of dead ranks revoke
//                          and shrink, then check the new communicator; MODE:
//                          between (VICTIMS die between two B-byte all-reduces),
//                          allreduce (during one), during (the first dies between,
//                          the second during the shrink), revoke (no death: rank 0
//                          revokes while the others wait; all shrink without the
//                          last rank), init (the victim dies a few ms into its
//                          loomCommInitFromEnv: the others' init fails cleanly, or
//                          their first all-reduce does and they shrink), connect
//                          (the victim dies 0.2-2 ms into the first all-reduce,
//                          while the connections are being opened; connect0: just
//                          before it, so the others wait for a connection from a
//                          dead rank).  Each
//                          survivor writes DIR/rank<r>.
//   mp-worker cut CUTRANKS B DIR [implicit]   a network cut (tests/rig/rig_cut_test.sh): B-byte
//                          all-reduces until one fails (the test takes the link of
//                          CUTRANKS' host down once every rank wrote DIR/running<r>);
//                          each rank must name the ranks across the cut unreachable
//                          and shrink without them (implicit: loomCommShrink(NULL, 0)
//                          leaves them out by itself): the connected side gets an exact
//                          communicator, the cut side an error.  Writes DIR/rank<r>.
#include <fcntl.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <set>
#include <thread>
#include <vector>

#include "tests/mp_common.h"

using namespace loomtest;

static int gRank = 0, gSize = 1;
static int gFailures = 0;

#define CHECK_LOOM(call)                                                                      \
  do {                                                                                        \
    loomResult_t r_ = (call);                                                                 \
    if (r_ != loomSuccess) {                                                                  \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", gRank, #call, loomGetErrorString(r_),   \
              loomGetLastError(nullptr));                                                     \
      exit(3);                                                                                \
    }                                                                                         \
  } while (0)

static void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++gFailures;
    if (gFailures < 20) fprintf(stderr, "rank %d: FAILED: %s\n", gRank, what.c_str());
  }
}

static std::vector<size_t> parseList(const char* s) {
  std::vector<size_t> v;
  for (const char* p = s; *p;) {
    v.push_back(strtoull(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return v;
}

static const loomDataType_t kTypes[] = {loomInt8,    loomUint8,    loomInt32,   loomUint32, loomInt64,
                                        loomUint64,  loomFloat16,  loomBfloat16, loomFloat32, loomFloat64};
static const loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

enum Coll { AR, RS, AG, BC, RED, A2A, GATHER, SCATTER, A2AV };
static const char* kCollNames[] = {"allreduce", "reducescatter", "allgather", "broadcast", "reduce",
                                   "alltoall",  "gather",        "scatter",   "alltoallv"};
// loomAllToAllv's layout in the matrix: rank r sends count + (r + j) % 3
// elements to rank j, blocks packed in rank order from the start.
static size_t a2avCount(size_t count, int from, int to) { return count + size_t((from + to) % 3); }

// Buffers of runChecked: ordinary memory, or (gLoomMemBuffers) memory from
// loomMemAlloc, which the peers of the host map (the zero-copy paths).
// Ordinary memory comes from a per-role pool that only grows: a fresh
// 256 MiB buffer per check costs 64 Ki page faults, and on the CI VM the
// 64 MiB matrix spent most of its time in the kernel faulting pages in
// (6.7 M faults, 19 s of 22 with 4 ranks).  Every use still fills the
// whole buffer, so nothing of an earlier check survives into a later one.
static bool gLoomMemBuffers = false;
enum BufRole { kSendBuf, kRecvBuf, kWantBuf, kBufRoles };
static char* pooledBuffer(BufRole role, size_t bytes) {
  static std::vector<char> pool[kBufRoles];
  std::vector<char>& v = pool[role];
  if (v.size() < bytes) {
    std::vector<char>().swap(v);  // free before growing: one copy at a time
    v.resize(bytes);
  }
  return v.data();
}
struct CheckedBuf {
  void* alloc = nullptr;
  char* mem = nullptr;
  CheckedBuf(BufRole role, size_t bytes, int fill) {
    if (gLoomMemBuffers && loomMemAlloc(&alloc, bytes) == loomSuccess) {
      memset(alloc, fill, bytes);
      return;
    }
    if (gLoomMemBuffers) {
      fprintf(stderr, "rank %d: loomMemAlloc(%zu) failed: %s\n", gRank, bytes, loomGetLastError(nullptr));
      exit(4);
    }
    mem = pooledBuffer(role, bytes);
    memset(mem, fill, bytes);
  }
  ~CheckedBuf() {
    if (alloc) loomMemFree(alloc);
  }
  CheckedBuf(const CheckedBuf&) = delete;
  CheckedBuf& operator=(const CheckedBuf&) = delete;
  char* data() { return alloc ? static_cast<char*>(alloc) : mem; }
};

// Runs one collective and checks it exactly.  Returns false on a loom error.
static void runChecked(loomComm_t comm, loomStream_t stream, Coll coll, loomDataType_t t, loomRedOp_t op,
                       size_t count, bool inPlace, int root) {
  size_t esz = typeSize(t);
  int n = gSize, me = gRank;
  size_t sendCount = (coll == RS || coll == A2A || coll == SCATTER) ? count * size_t(n) : count;
  size_t recvCount = (coll == AG || coll == A2A || coll == GATHER) ? count * size_t(n) : count;
  const size_t ranks = size_t(n);
  std::vector<size_t> scounts(ranks), sdispls(ranks), rcounts(ranks), rdispls(ranks);
  if (coll == A2AV) {
    sendCount = recvCount = 0;
    for (int j = 0; j < n; ++j) {
      scounts[size_t(j)] = a2avCount(count, me, j), sdispls[size_t(j)] = sendCount, sendCount += scounts[size_t(j)];
      rcounts[size_t(j)] = a2avCount(count, j, me), rdispls[size_t(j)] = recvCount, recvCount += rcounts[size_t(j)];
    }
  }
  CheckedBuf sbuf(kSendBuf, sendCount * esz + 64, 0), rbuf(kRecvBuf, recvCount * esz + 64, 0x5a);
  char* want = pooledBuffer(kWantBuf, recvCount * esz + 8);
  memset(want, 0, recvCount * esz + 8);
  void* send = sbuf.data();
  void* recv = rbuf.data();
  loomRedOp_t fillOp = (coll == AG || coll == BC) ? loomMax : op;
  if (inPlace) {
    // NCCL's in-place layouts.
    if (coll == AG) send = rbuf.data() + size_t(me) * count * esz;
    else if (coll == RS) recv = sbuf.data() + size_t(me) * count * esz, send = sbuf.data();
    else if (coll == GATHER) send = rbuf.data() + size_t(root) * count * esz;
    else if (coll == SCATTER) recv = sbuf.data() + size_t(me) * count * esz;
    else if (coll != A2AV) send = recv;  // all-to-allv has no in-place form
  }
  if (coll == RS) fillInput(send, op, t, me, sendCount);
  else if (coll == AG || coll == GATHER) fillInput(send, loomMax, t, me, count, size_t(me) * count);
  else if (coll == A2A || coll == A2AV) fillInput(send, loomMax, t, me, sendCount);
  else if (coll == SCATTER) {
    if (me == root) fillInput(send, loomMax, t, me, sendCount);
  } else fillInput(send, fillOp, t, me, count);
  loomResult_t r = loomSuccess;
  switch (coll) {
    case AR: r = loomAllReduce(send, recv, count, t, op, comm, stream); break;
    case RS: r = loomReduceScatter(send, recv, count, t, op, comm, stream); break;
    case AG: r = loomAllGather(send, recv, count, t, comm, stream); break;
    case BC: r = loomBroadcast(send, recv, count, t, root, comm, stream); break;
    case RED: r = loomReduce(send, recv, count, t, op, root, comm, stream); break;
    case A2A: r = loomAllToAll(send, recv, count, t, comm, stream); break;
    case GATHER: r = loomGather(send, recv, count, t, root, comm, stream); break;
    case SCATTER: r = loomScatter(send, recv, count, t, root, comm, stream); break;
    case A2AV:
      r = loomAllToAllv(send, scounts.data(), sdispls.data(), recv, rcounts.data(), rdispls.data(), t, comm, stream);
      break;
  }
  if (r == loomSuccess && stream) r = loomStreamSynchronize(stream);
  std::string what = std::string(kCollNames[coll]) + " " + typeName(t) + " " + opName(op) +
                     " count " + std::to_string(count) + (inPlace ? " in-place" : " out-of-place") +
                     " root " + std::to_string(root);
  if (r != loomSuccess) {
    fprintf(stderr, "rank %d: %s returned %s: %s\n", me, what.c_str(), loomGetErrorString(r),
            loomGetLastError(comm));
    exit(4);
  }
  if ((coll == RED || coll == GATHER) && me != root) return;
  // The expected result, block by block (each block is a run of one
  // rank's inputs or of the reduction at consecutive indices).
  auto block = [&](size_t b) { return want + b * count * esz; };
  switch (coll) {
    case AR:
    case RED: fillExpected(want, op, t, n, count); break;
    case RS: fillExpected(want, op, t, n, count, size_t(me) * count); break;
    case BC: fillInput(want, loomMax, t, root, count); break;
    case SCATTER: fillInput(want, loomMax, t, root, count, size_t(me) * count); break;
    case AG:
    case GATHER:
      for (int j = 0; j < n; ++j) fillInput(block(size_t(j)), loomMax, t, j, count, size_t(j) * count);
      break;
    case A2A:
      for (int j = 0; j < n; ++j) fillInput(block(size_t(j)), loomMax, t, j, count, size_t(me) * count);
      break;
    case A2AV:
      // Rank j's block to me: its elements sdispls_j[me].. of its input.
      for (int j = 0; j < n; ++j) {
        size_t from = 0;
        for (int k = 0; k < me; ++k) from += a2avCount(count, j, k);
        fillInput(want + rdispls[size_t(j)] * esz, loomMax, t, j, rcounts[size_t(j)], from);
      }
      break;
  }
  size_t wrong = countWrong(recv, want, recvCount, t);
  expect(wrong == 0, what + ": " + std::to_string(wrong) + " wrong elements");
}

static void scenarioMatrix(loomComm_t comm, int argc, char** argv) {
  std::vector<size_t> counts = argc > 0 ? parseList(argv[0]) : std::vector<size_t>{0, 1, 7, 1027};
  std::vector<loomDataType_t> types(std::begin(kTypes), std::end(kTypes));
  if (argc > 1 && strcmp(argv[1], "all") != 0) {
    types.clear();
    for (size_t v : parseList(argv[1])) types.push_back(loomDataType_t(v));
  }
  std::vector<loomRedOp_t> ops(std::begin(kOps), std::end(kOps));
  if (argc > 2 && strcmp(argv[2], "all") != 0) {
    ops.clear();
    for (size_t v : parseList(argv[2])) ops.push_back(loomRedOp_t(v));
  }
  loomStream_t stream;
  CHECK_LOOM(loomStreamCreate(&stream));
  int checks = 0;
  for (size_t count : counts)
    for (loomDataType_t t : types)
      for (int c = AR; c <= A2AV; ++c)
        for (loomRedOp_t op : ops) {
          if (c != AR && c != RS && c != RED && op != ops[0]) continue;  // no op involved
          for (int inPlace = 0; inPlace < 2; ++inPlace) {
            if (c == A2AV && inPlace) continue;
            bool rooted = c == BC || c == RED || c == GATHER || c == SCATTER;
            int root = rooted ? int((count + size_t(op) + size_t(c)) % size_t(gSize)) : 0;
            // Alternate the NULL stream and a loom stream.
            runChecked(comm, (checks % 2) ? stream : nullptr, Coll(c), t, op, count, inPlace, root);
            ++checks;
          }
        }
  CHECK_LOOM(loomStreamDestroy(stream));
  if (gRank == 0) printf("matrix: %d checks on %d ranks\n", checks, gSize);
}

static void scenarioSequence(loomComm_t comm) {
  // Mixed collectives back to back on one communicator.
  for (int i = 0; i < 30; ++i)
    runChecked(comm, nullptr, Coll(i % 5), kTypes[i % 10], kOps[i % 5], size_t(1 + i * 97), i % 3 == 0, i % gSize);
  // Two communicators used at once from two threads, each with its own stream.
  loomComm_t other;
  CHECK_LOOM(loomCommSplit(comm, 0, gSize - gRank, &other));  // reversed rank order
  int otherRank;
  CHECK_LOOM(loomCommUserRank(other, &otherRank));
  expect(otherRank == gSize - 1 - gRank, "split with reversed keys reverses ranks");
  std::vector<float> a(5000), b(3000);
  std::thread t1([&] {
    for (int it = 0; it < 20; ++it) {
      for (size_t i = 0; i < a.size(); ++i) a[i] = float(gRank + int(i % 5));
      CHECK_LOOM(loomAllReduce(a.data(), a.data(), a.size(), loomFloat32, loomSum, comm, nullptr));
      for (size_t i = 0; i < a.size(); ++i)
        if (a[i] != float(gSize * (gSize - 1) / 2 + gSize * int(i % 5))) {
          expect(false, "concurrent comm A allreduce");
          break;
        }
    }
  });
  std::thread t2([&] {
    for (int it = 0; it < 20; ++it) {
      for (size_t i = 0; i < b.size(); ++i) b[i] = float(otherRank * 2);
      CHECK_LOOM(loomAllReduce(b.data(), b.data(), b.size(), loomFloat32, loomMax, other, nullptr));
      for (size_t i = 0; i < b.size(); ++i)
        if (b[i] != float((gSize - 1) * 2)) {
          expect(false, "concurrent comm B allreduce");
          break;
        }
    }
  });
  t1.join();
  t2.join();
  CHECK_LOOM(loomCommDestroy(other));
}

static void scenarioGroup(loomComm_t comm) {
  int n = gSize, me = gRank;
  int next = (me + 1) % n, prev = (me + n - 1) % n;
  // Ring shift: every rank sends to next and receives from prev, in one group.
  for (size_t count : {size_t(1), size_t(1000), size_t(300000)}) {
    std::vector<int32_t> out(count), in(count, -1), self(count, -1);
    for (size_t i = 0; i < count; ++i) out[i] = int32_t(me * 1000000 + int(i));
    CHECK_LOOM(loomGroupStart());
    CHECK_LOOM(loomSend(out.data(), count, loomInt32, next, comm, nullptr));
    CHECK_LOOM(loomRecv(in.data(), count, loomInt32, prev, comm, nullptr));
    CHECK_LOOM(loomSend(out.data(), count, loomInt32, me, comm, nullptr));  // to self
    CHECK_LOOM(loomRecv(self.data(), count, loomInt32, me, comm, nullptr));
    CHECK_LOOM(loomGroupEnd());
    bool ok = true, okSelf = true;
    for (size_t i = 0; i < count; ++i) {
      ok &= in[i] == int32_t(prev * 1000000 + int(i));
      okSelf &= self[i] == out[i];
    }
    expect(ok, "group send/recv ring shift count " + std::to_string(count));
    expect(okSelf, "group self send/recv count " + std::to_string(count));
  }
  // Several messages to the same peer in one group arrive in order.
  if (n > 1) {
    std::vector<int64_t> m1(777, me), m2(5, me + 100), r1(777), r2(5);
    CHECK_LOOM(loomGroupStart());
    CHECK_LOOM(loomSend(m1.data(), m1.size(), loomInt64, next, comm, nullptr));
    CHECK_LOOM(loomSend(m2.data(), m2.size(), loomInt64, next, comm, nullptr));
    CHECK_LOOM(loomRecv(r1.data(), r1.size(), loomInt64, prev, comm, nullptr));
    CHECK_LOOM(loomRecv(r2.data(), r2.size(), loomInt64, prev, comm, nullptr));
    CHECK_LOOM(loomGroupEnd());
    expect(r1[0] == prev && r1[776] == prev && r2[0] == prev + 100, "two sends to one peer keep their order");
  }
  // Collectives in one group run as one operation.
  std::vector<float> x(1000, float(me)), y(10, 1.0f), z(10 * size_t(n));
  CHECK_LOOM(loomGroupStart());
  CHECK_LOOM(loomAllReduce(x.data(), x.data(), x.size(), loomFloat32, loomSum, comm, nullptr));
  CHECK_LOOM(loomAllGather(y.data(), z.data(), y.size(), loomFloat32, comm, nullptr));
  CHECK_LOOM(loomGroupEnd());
  expect(x[999] == float(n * (n - 1) / 2), "grouped allreduce");
  expect(z[10 * size_t(n) - 1] == 1.0f, "grouped allgather");
}

static void scenarioStreams(loomComm_t comm) {
  loomStream_t s;
  CHECK_LOOM(loomStreamCreate(&s));
  const int kOpsCount = 100;
  std::vector<std::vector<int32_t>> bufs(kOpsCount, std::vector<int32_t>(2049));
  for (int k = 0; k < kOpsCount; ++k)
    for (auto& v : bufs[size_t(k)]) v = gRank + k;
  for (int k = 0; k < kOpsCount; ++k)
    CHECK_LOOM(loomAllReduce(bufs[size_t(k)].data(), bufs[size_t(k)].data(), 2049, loomInt32, loomSum, comm, s));
  loomResult_t q = loomStreamQuery(s);
  expect(q == loomSuccess || q == loomInProgress, "loomStreamQuery returns success or in-progress");
  CHECK_LOOM(loomStreamSynchronize(s));
  expect(loomStreamQuery(s) == loomSuccess, "query after synchronize is success");
  for (int k = 0; k < kOpsCount; ++k)
    expect(bufs[size_t(k)][2048] == gSize * (gSize - 1) / 2 + gSize * k, "stream op " + std::to_string(k));
  CHECK_LOOM(loomStreamDestroy(s));
}

static void expectInvalid(loomResult_t r, const char* what) {
  const char* msg = loomGetLastError(nullptr);
  expect(r == loomInvalidArgument, std::string(what) + " returns loomInvalidArgument (got " + loomGetErrorString(r) + ")");
  expect(msg && strlen(msg) > 10, std::string(what) + " leaves a message");
}

static void scenarioBadArgs(loomComm_t comm) {
  float buf[16] = {0};
  expectInvalid(loomAllReduce(nullptr, buf, 4, loomFloat32, loomSum, comm, nullptr), "null sendbuff");
  expectInvalid(loomAllReduce(buf, nullptr, 4, loomFloat32, loomSum, comm, nullptr), "null recvbuff");
  expectInvalid(loomAllReduce(buf, buf, 4, loomDataType_t(42), loomSum, comm, nullptr), "unknown datatype");
  expectInvalid(loomAllReduce(buf, buf, 4, loomFloat32, loomRedOp_t(-1), comm, nullptr), "unknown op");
  expectInvalid(loomAllReduce(buf, buf, SIZE_MAX / 2, loomFloat32, loomSum, comm, nullptr), "count overflow");
  expectInvalid(loomAllGather(buf, buf, SIZE_MAX / 3, loomFloat64, comm, nullptr), "allgather count overflow");
  expectInvalid(loomBroadcast(buf, buf, 4, loomFloat32, gSize, comm, nullptr), "root out of range");
  expectInvalid(loomReduce(buf, buf, 4, loomFloat32, loomSum, -1, comm, nullptr), "negative root");
  expectInvalid(loomSend(buf, 4, loomFloat32, gSize + 3, comm, nullptr), "peer out of range");
  expectInvalid(loomAllReduce(buf, buf + 1, 4, loomFloat32, loomSum, comm, nullptr), "overlapping buffers");
  expectInvalid(loomAllReduce(buf, buf, 4, loomFloat32, loomSum, nullptr, nullptr), "null comm");
  {
    loomComm_t nc = comm;
    int bad[2] = {0, gSize};
    expectInvalid(loomCommShrink(comm, nullptr, 1, &nc), "shrink: null exclusion list with a count");
    expect(nc == nullptr, "a refused shrink sets *newcomm to NULL");
    expectInvalid(loomCommShrink(comm, bad, 2, &nc), "shrink: excluded rank out of range");
    expectInvalid(loomCommShrink(comm, bad, -1, &nc), "shrink: negative count");
    expectInvalid(loomCommShrink(comm, nullptr, 0, nullptr), "shrink: null newcomm");
    expectInvalid(loomCommShrink(nullptr, nullptr, 0, &nc), "shrink: null comm");
    expectInvalid(loomCommRevoke(nullptr), "revoke: null comm");
  }
  // All-to-all, gather, scatter (issue 17): checked before anything is sent.
  std::vector<float> big(size_t(gSize) * 8);
  // In place (sendbuff == recvbuff) is fine; any other overlap is not.
  expectInvalid(loomAllToAll(big.data(), big.data() + 1, 4, loomFloat32, comm, nullptr),
                "all-to-all overlap off the in-place layout");
  expect(strstr(loomGetLastError(nullptr), "overlap") != nullptr, "the all-to-all overlap message says overlap");
  expectInvalid(loomAllToAll(big.data() + 4, big.data(), 4, loomFloat32, comm, nullptr),
                "all-to-all recvbuff inside sendbuff");
  expectInvalid(loomAllToAll(nullptr, big.data(), 4, loomFloat32, comm, nullptr), "all-to-all null sendbuff");
  expectInvalid(loomAllToAll(buf, big.data(), SIZE_MAX / 3, loomFloat64, comm, nullptr), "all-to-all count overflow");
  expectInvalid(loomAllToAll(buf, big.data(), 4, loomDataType_t(99), comm, nullptr), "all-to-all unknown datatype");
  expectInvalid(loomGather(buf, big.data(), 4, loomFloat32, gSize, comm, nullptr), "gather root out of range");
  expectInvalid(loomScatter(big.data(), buf, 4, loomFloat32, -2, comm, nullptr), "scatter negative root");
  expectInvalid(loomScatter(big.data(), nullptr, 4, loomFloat32, 0, comm, nullptr), "scatter null recvbuff");
  if (gRank == 0) {
    expectInvalid(loomGather(big.data() + 1, big.data(), 4, loomFloat32, 0, comm, nullptr),
                  "gather overlap off NCCL's in-place offset");
    expectInvalid(loomScatter(big.data(), big.data() + 1, 4, loomFloat32, 0, comm, nullptr),
                  "scatter overlap off NCCL's in-place offset");
    expectInvalid(loomGather(buf, nullptr, 4, loomFloat32, 0, comm, nullptr), "gather null recvbuff on root");
  }
  std::vector<size_t> counts(size_t(gSize), 2), displs(size_t(gSize), 0);
  expectInvalid(loomAllToAllv(buf, counts.data(), displs.data(), big.data(), counts.data(), nullptr, loomFloat32,
                              comm, nullptr),
                "all-to-allv null rdispls");
  if (gSize > 1)
    expectInvalid(loomAllToAllv(buf, counts.data(), displs.data(), big.data(), counts.data(), displs.data(),
                                loomFloat32, comm, nullptr),
                  "all-to-allv overlapping receive regions");
  expectInvalid(loomCommSetTimeout(comm, 0), "zero timeout");
  expectInvalid(loomCommCount(comm, nullptr), "null count");
  expectInvalid(loomCommInitRank(nullptr, 2, loomUniqueId{}, 0), "null comm pointer");
  loomComm_t c2;
  loomUniqueId id;
  memset(&id, 0, sizeof id);
  expectInvalid(loomCommInitRank(&c2, 2, id, 5), "rank out of range");
  expectInvalid(loomCommInitRank(&c2, 0, id, 0), "zero ranks");
  expectInvalid(loomCommInitRank(&c2, 2, id, 1), "garbage unique id");
  // A group with a bad member is not launched, and says so.
  loomGroupStart();
  loomAllReduce(buf, buf, 4, loomFloat32, loomSum, comm, nullptr);
  loomAllReduce(buf, nullptr, 4, loomFloat32, loomSum, comm, nullptr);
  expect(loomGroupEnd() == loomInvalidArgument, "group with a bad member fails at loomGroupEnd");
  // No harm done: the communicator still works.
  loomResult_t async;
  CHECK_LOOM(loomCommGetAsyncError(comm, &async));
  expect(async == loomSuccess, "bad arguments do not fail the communicator");
  runChecked(comm, nullptr, AR, loomFloat32, loomSum, 1000, false, 0);
}

// Inodes of the loomMemAlloc memory mapped in this process (its own and
// its peers'), from /proc/self/maps.
static std::set<unsigned long> loomMemInodes() {
  std::set<unsigned long> inodes;
  FILE* f = fopen("/proc/self/maps", "r");
  if (!f) return inodes;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    unsigned long inode = 0;
    if (strstr(line, "memfd:loom-mem") && sscanf(line, "%*s %*s %*s %*s %lu", &inode) == 1) inodes.insert(inode);
  }
  fclose(f);
  return inodes;
}

// A buffer for the registered scenario: from loomMemAlloc (`offset` bytes
// into the allocation) or from the heap.
struct TestBuf {
  void* alloc = nullptr;
  std::vector<char> heap;
  char* data = nullptr;
  TestBuf(bool shared, size_t bytes, size_t offset) {
    if (shared) {
      CHECK_LOOM(loomMemAlloc(&alloc, bytes + offset));
      data = static_cast<char*>(alloc) + offset;
    } else {
      heap.resize(bytes + 8);
      data = heap.data();
    }
  }
  ~TestBuf() {
    if (alloc) CHECK_LOOM(loomMemFree(alloc));
  }
};

// All-reduce of `count` elements from/to `send`/`recv`, checked exactly.
static void allReduceChecked(loomComm_t comm, void* send, void* recv, size_t count, loomDataType_t t, loomRedOp_t op,
                             const std::string& what) {
  fillInput(send, op, t, gRank, count);
  std::vector<char> want(count * typeSize(t) + 8);
  fillExpected(want.data(), op, t, gSize, count);
  loomResult_t r = loomAllReduce(send, recv, count, t, op, comm, nullptr);
  if (r != loomSuccess) {
    fprintf(stderr, "rank %d: %s returned %s: %s\n", gRank, what.c_str(), loomGetErrorString(r), loomGetLastError(comm));
    exit(4);
  }
  size_t wrong = countWrong(recv, want.data(), count, t);
  expect(wrong == 0, what + ": " + std::to_string(wrong) + " wrong elements");
}

// Zero-copy buffers (issue 18).  mode: all (every rank's buffers come from
// loomMemAlloc), mixed (odd ranks' only), none.
static void scenarioRegistered(loomComm_t comm, const std::string& mode, bool mapped) {
  const bool mine = mode == "all" || (mode == "mixed" && gRank % 2 == 1);
  int others = 0;  // other ranks whose buffers peers map
  for (int r = 0; r < gSize; ++r) others += r != gRank && (mode == "all" || (mode == "mixed" && r % 2 == 1));

  // The calls' argument checks.
  void* p = nullptr;
  float heap[64];
  void* h = nullptr;
  expectInvalid(loomMemAlloc(nullptr, 100), "loomMemAlloc with NULL ptr");
  expectInvalid(loomMemAlloc(&p, 0), "loomMemAlloc of 0 bytes");
  CHECK_LOOM(loomMemAlloc(&p, 100));
  expectInvalid(loomMemFree(heap), "loomMemFree of heap memory");
  expectInvalid(loomMemFree(static_cast<char*>(p) + 64), "loomMemFree of a pointer inside an allocation");
  expect(loomMemFree(nullptr) == loomSuccess, "loomMemFree(NULL) is a no-op");
  expectInvalid(loomCommRegister(nullptr, heap, sizeof heap, &h), "loomCommRegister with NULL comm");
  expectInvalid(loomCommRegister(comm, nullptr, 64, &h), "loomCommRegister of NULL");
  expectInvalid(loomCommRegister(comm, heap, 0, &h), "loomCommRegister of 0 bytes");
  expectInvalid(loomCommRegister(comm, heap, sizeof heap, nullptr), "loomCommRegister with NULL handle");
  CHECK_LOOM(loomCommRegister(comm, heap, sizeof heap, &h));
  void* h2 = nullptr;
  CHECK_LOOM(loomCommRegister(comm, p, 100, &h2));
  expect(h2 != h, "two registrations have two handles");
  CHECK_LOOM(loomCommDeregister(comm, h));
  expectInvalid(loomCommDeregister(comm, h), "loomCommDeregister twice");
  expectInvalid(loomCommDeregister(comm, nullptr), "loomCommDeregister of NULL");
  expectInvalid(loomCommDeregister(comm, heap), "loomCommDeregister of a pointer that is no handle");
  expectInvalid(loomCommDeregister(nullptr, h2), "loomCommDeregister with NULL comm");
  CHECK_LOOM(loomCommDeregister(comm, h2));
  CHECK_LOOM(loomMemFree(p));
  expectInvalid(loomMemFree(p), "loomMemFree twice");

  // Exact results: sizes from the one-shot path's to many staged chunks,
  // in and out of place, at an offset inside the allocation.
  const loomDataType_t types[] = {loomFloat32, loomBfloat16, loomInt32};
  const loomRedOp_t ops[] = {loomSum, loomMax, loomAvg};
  int k = 0;
  for (size_t count : {size_t(1027), size_t(70001), size_t(262149)})
    for (size_t offset : {size_t(0), size_t(4160)})
      for (bool inPlace : {false, true}) {
        loomDataType_t t = types[k % 3];
        loomRedOp_t op = ops[(k / 3) % 3];
        ++k;
        size_t bytes = count * typeSize(t);
        TestBuf a(mine, bytes, offset), b(mine, bytes, offset);
        std::string what = std::string("registered(") + mode + ") allreduce " + typeName(t) + " " + opName(op) +
                           " count " + std::to_string(count) + " offset " + std::to_string(offset) +
                           (inPlace ? " in-place" : " out-of-place");
        allReduceChecked(comm, a.data, inPlace ? a.data : b.data, count, t, op, what);
      }

  std::set<unsigned long> keptCopies;  // the communicators' in-place all-to-all copies, here or mapped
  // All-gather, reduce-scatter, broadcast, all-to-all, gather and scatter on
  // such buffers: zero-copy when the buffers peers read can be mapped, from 4 MiB
  // (the size every rank votes at, oversubscribed or not); exact either way,
  // in and out of place.
  {
    gLoomMemBuffers = mine;
    std::set<unsigned long> before = loomMemInodes();
    const size_t big = (size_t(4) << 20) / 4 + 3;  // float32 elements of the largest buffer
    for (bool inPlace : {false, true}) {
      runChecked(comm, nullptr, AG, loomFloat32, loomSum, big / size_t(gSize) + 1, inPlace, 0);
      runChecked(comm, nullptr, RS, loomBfloat16, loomAvg, 2 * big / size_t(gSize) + 5, inPlace, 0);
      runChecked(comm, nullptr, RS, loomInt32, loomMax, big / size_t(gSize) + 1, inPlace, 0);
      runChecked(comm, nullptr, BC, loomFloat32, loomSum, big, inPlace, gSize - 1);
      runChecked(comm, nullptr, AG, loomInt8, loomSum, 1000, inPlace, 0);  // small: no vote
    }
    runChecked(comm, nullptr, A2A, loomFloat32, loomSum, big / size_t(gSize) + 3, false, 0);
    runChecked(comm, nullptr, GATHER, loomInt64, loomSum, big / size_t(gSize) / 2 + 1, false, gSize - 1);
    runChecked(comm, nullptr, SCATTER, loomFloat32, loomSum, big / size_t(gSize) + 1, false, 0);
    int fresh = 0;
    for (unsigned long i : loomMemInodes()) fresh += before.count(i) == 0;
    // (`mapped` and every rank's buffers, no algorithm forced: zero-copy ran.)
    if (mapped && mode == "all" && !getenv("LOOM_ALGO"))
      expect(fresh >= 1, "all-gather/reduce-scatter/broadcast mapped peers' buffers (" + std::to_string(fresh) +
                             " new loom-mem mappings)");
    if (mode == "none") expect(fresh == 0, "no peer memory is mapped when no rank has any");
    // In place, an all-to-all runs from a copy of its input that the
    // communicator keeps in loomMemAlloc memory, so it stays zero-copy: the
    // peers map that copy (a memory object none of them had seen; with
    // this rank's own copy, N new objects here).
    before = loomMemInodes();
    runChecked(comm, nullptr, A2A, loomFloat32, loomSum, big / size_t(gSize) + 3, true, 0);
    fresh = 0;
    for (unsigned long i : loomMemInodes())
      if (!before.count(i)) {
        ++fresh;
        keptCopies.insert(i);  // live for the communicator's life: not counted as stale below
      }
    // Whatever the caller's buffers: every rank here calls in place, so
    // over shared memory (no algorithm forced) every input the peers read
    // is a kept copy they can map; over tcp nobody maps anything.
    const char* transports = getenv("LOOM_TRANSPORTS");
    const bool shm = transports && strncmp(transports, "shm", 3) == 0;
    if (shm && !getenv("LOOM_ALGO"))
      expect(fresh >= gSize, "in-place all-to-all read the peers' kept copies in place (" + std::to_string(fresh) +
                                 " new loom-mem mappings)");
    if (!shm) expect(fresh == 1, "over tcp only this rank's own kept copy is new (" + std::to_string(fresh) + ")");
    char dump[4096];
    CHECK_LOOM(loomCommDump(comm, dump, sizeof dump));
    expect(strstr(dump, "kept for in-place all-to-all inputs: ") != nullptr,
           std::string("the dump shows the kept copy: ") + dump);
    gLoomMemBuffers = false;
  }

  // A registered buffer: used, deregistered, used again; the peers have
  // mapped it (`mapped`: the caller knows the staged path reads it in
  // place: every rank's buffer is mappable, or LOOM_ALGO=staged), then it
  // is freed while they hold the mapping and a new one is allocated (often
  // with the same descriptor number).
  const size_t count = 1 << 20;  // 4 MiB of float32
  {
    TestBuf a(mine, count * 4, 128);
    void* handle = nullptr;
    CHECK_LOOM(loomCommRegister(comm, a.data, count * 4, &handle));
    std::set<unsigned long> before = loomMemInodes();  // mine included
    allReduceChecked(comm, a.data, a.data, count, loomFloat32, loomSum, "registered buffer");
    int fresh = 0;  // peers' buffers mapped during the operation
    for (unsigned long i : loomMemInodes()) fresh += before.count(i) == 0;
    if (mapped && mine)
      expect(fresh >= others, "peers' buffers are mapped here (" + std::to_string(fresh) + " new loom-mem mappings, " +
                                  std::to_string(others) + " other ranks with such buffers)");
    if (!mapped && mode == "none") expect(fresh == 0, "no peer memory is mapped when no rank has any");
    CHECK_LOOM(loomCommDeregister(comm, handle));
    allReduceChecked(comm, a.data, a.data, count, loomFloat32, loomMax, "the buffer after deregistering it");
  }  // freed here, while peers still map it
  for (int round = 0; round < 3; ++round) {
    TestBuf a(mine, count * 4, size_t(round) * 64);
    allReduceChecked(comm, a.data, a.data, count, loomFloat32, loomSum,
                     "a new buffer after the last was freed, round " + std::to_string(round));
  }
  // Freed memory does not pile up in the peers: each drops its mappings of
  // a rank that freed memory when it next maps that rank's memory.
  int left = 0;
  for (unsigned long i : loomMemInodes()) left += keptCopies.count(i) == 0;
  expect(left <= others + 1, "stale mappings are dropped (" + std::to_string(left) + " loom-mem mappings left)");
  loomResult_t async;
  CHECK_LOOM(loomCommGetAsyncError(comm, &async));
  expect(async == loomSuccess, "the communicator is healthy after the registered scenario");
}

static void scenarioMismatch(loomComm_t comm) {
  // Larger than a connection's slots, so no rank can finish on its own.
  std::vector<float> buf(4 << 20, 1.0f);
  loomResult_t r;
  if (gRank == 0) r = loomBroadcast(buf.data(), buf.data(), buf.size(), loomFloat32, 0, comm, nullptr);
  else r = loomAllReduce(buf.data(), buf.data(), buf.size() - size_t(gRank), loomFloat32, loomSum, comm, nullptr);
  const char* msg = loomGetLastError(comm);
  printf("rank %d: %s: %s\n", gRank, loomGetErrorString(r), msg);
  // Ranks that never see the other call themselves (rank 0's neighbours in
  // a ring) inherit the root cause from the rank that found it.
  expect(r == loomInvalidUsage, std::string("every rank fails with invalid usage, not ") + loomGetErrorString(r));
  expect(strstr(msg, "mismatched operations") != nullptr, std::string("every rank names the mismatch: ") + msg);
  loomResult_t async;
  CHECK_LOOM(loomCommGetAsyncError(comm, &async));
  expect(async != loomSuccess, "the communicator reports the failure asynchronously too");
  // Later calls fail fast instead of hanging.
  r = loomAllReduce(buf.data(), buf.data(), 10, loomFloat32, loomSum, comm, nullptr);
  expect(r != loomSuccess, "calls after a failure fail");
}

// Mismatches around the smallest all-reduces (blocks of at most 16 bytes
// take the pull line, one_shot.cc): rank 0 calls something else than the
// others, which must all fail with invalid usage naming the mismatch.
//   count: all-reduces of 2 and 3 floats (both on the pull path)
//   path:  2 floats against 64 (pull line against mailboxes)
//   coll:  a broadcast of 2 floats against an all-reduce of 2 (the root of
//          a one-shot broadcast returns before anyone reads: it may succeed)
// A pull all-reduce stores its `done` only when the rank's next operation
// is not a pull (algorithms/direct.h): every kind of operation between two
// pulls, a late rank among them (a broadcast's root then runs ahead into
// the next pull and waits for the late rank's `done`).
static void scenarioPullMix(loomComm_t comm) {
  const int n = gSize, me = gRank;
  std::vector<float> big(size_t(1) << 19);  // 2 MiB: the staged path (or zero-copy's vote)
  int64_t late = 0;
  for (int i = 0; i < 120; ++i) {
    int64_t v = me + i, want = int64_t(n) * (n - 1) / 2 + int64_t(n) * i;
    CHECK_LOOM(loomAllReduce(&v, &v, 1, loomInt64, loomSum, comm, nullptr));
    expect(v == want, "pull " + std::to_string(i));
    const int kind = i % 7, root = i % n;
    if (i % 14 == 1 && me == (root + 1) % n) {
      usleep(20000);  // past every spin: the root sleeps in its next pull
      ++late;
    }
    switch (kind) {
      case 0: {  // nothing moves
        CHECK_LOOM(loomAllReduce(&v, &v, 0, loomInt64, loomSum, comm, nullptr));
        break;
      }
      case 1: {  // the root returns without hearing from the others
        double b[2] = {me == root ? 1.5 * i : 0, me == root ? -2.0 : 0};
        CHECK_LOOM(loomBroadcast(b, b, 2, loomFloat64, root, comm, nullptr));
        expect(b[0] == 1.5 * i && b[1] == -2.0, "broadcast " + std::to_string(i));
        break;
      }
      case 2: {  // mailboxes
        std::vector<int32_t> m(16, me + 1);
        CHECK_LOOM(loomAllReduce(m.data(), m.data(), m.size(), loomInt32, loomSum, comm, nullptr));
        expect(m[15] == n * (n + 1) / 2, "64 B all-reduce " + std::to_string(i));
        break;
      }
      case 3: {
        std::fill(big.begin(), big.end(), float(me + 1));
        CHECK_LOOM(loomAllReduce(big.data(), big.data(), big.size(), loomFloat32, loomSum, comm, nullptr));
        expect(big.back() == float(n * (n + 1) / 2), "2 MiB all-reduce " + std::to_string(i));
        break;
      }
      case 4: {  // a ring of sends and receives
        int64_t s = me * 1000 + i, r = -1;
        CHECK_LOOM(loomGroupStart());
        CHECK_LOOM(loomSend(&s, 1, loomInt64, (me + 1) % n, comm, nullptr));
        CHECK_LOOM(loomRecv(&r, 1, loomInt64, (me + n - 1) % n, comm, nullptr));
        CHECK_LOOM(loomGroupEnd());
        expect(r == ((me + n - 1) % n) * 1000 + i, "send/recv " + std::to_string(i));
        break;
      }
      case 5: {
        std::vector<int64_t> g(size_t(n), -1);
        int64_t mine = me * 7 + i;
        CHECK_LOOM(loomAllGather(&mine, g.data(), 1, loomInt64, comm, nullptr));
        for (int r = 0; r < n; ++r) expect(g[size_t(r)] == r * 7 + i, "all-gather " + std::to_string(i));
        break;
      }
      default: {  // two pulls in a row
        int64_t w = 1;
        CHECK_LOOM(loomAllReduce(&w, &w, 1, loomInt64, loomSum, comm, nullptr));
        expect(w == n, "second pull " + std::to_string(i));
      }
    }
  }
  CHECK_LOOM(loomAllReduce(&late, &late, 1, loomInt64, loomSum, comm, nullptr));
  expect(late > 0, "some rank was late");
}

static void scenarioSmallMismatch(loomComm_t comm, const std::string& mode) {
  // large: the others' all-reduce is large enough to vote on zero-copy
  // (8 MiB) while rank 0's goes through the pull line.
  std::vector<float> buf(mode == "large" ? (2u << 20) : 1024, 1.0f);
  size_t mine = 2;
  if (gRank != 0) mine = mode == "count" ? 3 : mode == "path" ? 64 : mode == "large" ? buf.size() : 2;
  // A few good operations first, so the mismatch meets lines and mailboxes in use.
  for (int i = 0; i < 5; ++i) CHECK_LOOM(loomAllReduce(buf.data(), buf.data(), 2, loomFloat32, loomSum, comm, nullptr));
  loomResult_t r;
  if (mode == "coll" && gRank == 0) r = loomBroadcast(buf.data(), buf.data(), 2, loomFloat32, 0, comm, nullptr);
  else r = loomAllReduce(buf.data(), buf.data(), mine, loomFloat32, loomSum, comm, nullptr);
  const char* msg = loomGetLastError(comm);
  printf("rank %d: %s: %s\n", gRank, loomGetErrorString(r), msg);
  if (mode == "coll" && gRank == 0 && r == loomSuccess) {
    // Its next call waits for the others, who failed: it fails too (and
    // only then does this rank abort, so no one learns "aborted" first).
    r = loomAllReduce(buf.data(), buf.data(), 2, loomFloat32, loomSum, comm, nullptr);
    expect(r != loomSuccess, "coll: the root's next call fails");
    return;
  }
  expect(r == loomInvalidUsage, mode + ": every rank fails with invalid usage, not " + loomGetErrorString(r));
  expect(strstr(msg, "mismatched operations") != nullptr, mode + ": every rank names the mismatch: " + msg);
}

// In-place all-to-all (sendbuff == recvbuff; the host path runs it from a
// copy of the input): exact when only the even ranks call it in place (each
// rank chooses for itself, so the ranks must still pick one algorithm), on
// the NULL stream and a loom stream, for blocks of 0 elements to past a
// connection's slots and a ring chunk; then two in one group around an
// all-reduce (two copies side by side), sizes that shrink and grow again
// (the copy's space is kept and grown), and in-place calls queued on a
// stream behind one another.
static void scenarioA2AInPlace(loomComm_t comm) {
  loomStream_t stream;
  CHECK_LOOM(loomStreamCreate(&stream));
  const bool mine = gRank % 2 == 0;
  int checks = 0;
  for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(1027), size_t(70001), size_t(262149)})
    for (loomDataType_t t : {loomFloat32, loomInt8, loomFloat64}) {
      runChecked(comm, checks % 2 ? stream : nullptr, A2A, t, loomSum, count, mine, 0);
      ++checks;
    }
  for (size_t count : {size_t(5), size_t(300000), size_t(3)}) {
    runChecked(comm, stream, A2A, loomInt32, loomSum, count, true, 0);
    ++checks;
  }
  // A group: all-to-all in place, an all-reduce, another all-to-all in place.
  // Block j of rank r's input to rank j, element i: value(r, j, i).
  auto value = [](int from, int to, size_t i) { return int32_t(from * 100000 + to * 1000 + int(i)); };
  const size_t c1 = 999, c2 = 33, n = size_t(gSize);
  std::vector<int32_t> a(n * c1), b(n * c2), sum(64, gRank + 1);
  for (int j = 0; j < gSize; ++j) {
    for (size_t i = 0; i < c1; ++i) a[size_t(j) * c1 + i] = value(gRank, j, i);
    for (size_t i = 0; i < c2; ++i) b[size_t(j) * c2 + i] = value(gRank, j, i + 500);
  }
  CHECK_LOOM(loomGroupStart());
  CHECK_LOOM(loomAllToAll(a.data(), a.data(), c1, loomInt32, comm, stream));
  CHECK_LOOM(loomAllReduce(sum.data(), sum.data(), sum.size(), loomInt32, loomSum, comm, stream));
  CHECK_LOOM(loomAllToAll(b.data(), b.data(), c2, loomInt32, comm, stream));
  CHECK_LOOM(loomGroupEnd());
  CHECK_LOOM(loomStreamSynchronize(stream));
  size_t wrong = 0;
  for (int q = 0; q < gSize; ++q) {
    for (size_t i = 0; i < c1; ++i) wrong += a[size_t(q) * c1 + i] != value(q, gRank, i);
    for (size_t i = 0; i < c2; ++i) wrong += b[size_t(q) * c2 + i] != value(q, gRank, i + 500);
  }
  for (int32_t v : sum) wrong += v != gSize * (gSize + 1) / 2;
  expect(wrong == 0, "group of two in-place all-to-alls and an all-reduce: " + std::to_string(wrong) + " wrong");
  // Two in place in a row on a loom stream, nothing synchronised between:
  // the second copies what the first left in the buffer (the copy is made
  // when the operation runs, not when it is issued; two all-to-alls undo
  // each other), and a larger third one grows the kept copy while the
  // others may still be queued.
  {
    const size_t c = 4099, c3 = 70001;
    std::vector<int32_t> x(n * c), y(n * c3);
    for (int j = 0; j < gSize; ++j) {
      for (size_t i = 0; i < c; ++i) x[size_t(j) * c + i] = value(gRank, j, i);
      for (size_t i = 0; i < c3; ++i) y[size_t(j) * c3 + i] = value(gRank, j, i + 7);
    }
    const std::vector<int32_t> original = x;
    CHECK_LOOM(loomAllToAll(x.data(), x.data(), c, loomInt32, comm, stream));
    CHECK_LOOM(loomAllToAll(x.data(), x.data(), c, loomInt32, comm, stream));
    CHECK_LOOM(loomAllToAll(y.data(), y.data(), c3, loomInt32, comm, stream));
    CHECK_LOOM(loomStreamSynchronize(stream));
    size_t bad = x == original ? 0 : 1;
    for (int q = 0; q < gSize; ++q)
      for (size_t i = 0; i < c3; ++i) bad += y[size_t(q) * c3 + i] != value(q, gRank, i + 7);
    expect(bad == 0, "in-place all-to-alls queued back to back on a stream: " + std::to_string(bad) + " wrong");
    checks += 3;
  }
  CHECK_LOOM(loomStreamDestroy(stream));
  if (gRank == 0) printf("a2ainplace: %d checks and a group on %d ranks\n", checks, gSize);
}

// All-to-all with counts that disagree (rank 0's blocks are one element
// shorter): every rank fails with an error, none hangs.
static void scenarioExchangeMismatch(loomComm_t comm) {
  size_t count = size_t(1) << 16;  // larger than a connection's slots
  if (gRank == 0) --count;
  std::vector<float> send(size_t(gSize) * count, 1.0f), recv(size_t(gSize) * count);
  loomResult_t r = loomAllToAll(send.data(), recv.data(), count, loomFloat32, comm, nullptr);
  printf("rank %d: %s: %s\n", gRank, loomGetErrorString(r), loomGetLastError(comm));
  expect(r == loomInvalidUsage, std::string("all-to-all with disagreeing counts fails with invalid usage on every rank, not ") +
                                    loomGetErrorString(r));
  expect(strstr(loomGetLastError(comm), "called AllToAll") != nullptr, "the mismatch names the all-to-all");
}

// Rooted collectives whose root the ranks name differently (rank r names
// r % 2, or in "bcastlast" only the last rank names 1): no rank may
// return success from both the collective and the all-reduce after it,
// some rank names the mismatch, and all of it well before LOOM_TIMEOUT_MS.
// Options: `mem`: the buffers come from loomMemAlloc (the zero-copy path at
// 1 MiB and more); `ar`: an all-reduce first (it opens the ring's
// connections, not the root's); `roots=A,B,..`: rank r names the r-th.
static void scenarioRootMismatch(loomComm_t comm, const std::string& mode, size_t count,
                                 const std::vector<std::string>& options) {
  bool mem = false, ar = false;
  int root = mode == "bcastlast" ? (gRank == gSize - 1 ? 1 : 0) : gRank % 2;
  for (const std::string& o : options) {
    if (o == "mem") mem = true;
    if (o == "ar") ar = true;
    if (o.compare(0, 6, "roots=") == 0) {
      std::vector<size_t> roots = parseList(o.substr(6).c_str());
      if (roots.size() == size_t(gSize)) root = int(roots[size_t(gRank)]);
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  gLoomMemBuffers = mem;
  CheckedBuf sendBuf(kSendBuf, count * size_t(gSize) * sizeof(float), 0), recvBuf(kRecvBuf, count * size_t(gSize) * sizeof(float), 0);
  gLoomMemBuffers = false;
  float* send = reinterpret_cast<float*>(sendBuf.data());
  float* recv = reinterpret_cast<float*>(recvBuf.data());
  std::fill(send, send + count * size_t(gSize), float(gRank + 1));
  std::fill(recv, recv + count * size_t(gSize), -1.0f);
  loomResult_t r = loomSuccess;
  // The all-reduce before may fail too: a slow rank still finishing it when
  // the others, done with it, find the mismatch learns of it there.
  if (ar) {
    float v = 1;
    r = loomAllReduce(&v, &v, 1, loomFloat32, loomSum, comm, nullptr);
  }
  if (r != loomSuccess) {
  } else if (mode == "reduce") r = loomReduce(send, recv, count, loomFloat32, loomSum, root, comm, nullptr);
  else if (mode == "gather") r = loomGather(send, recv, count, loomFloat32, root, comm, nullptr);
  else if (mode == "scatter") r = loomScatter(send, recv, count, loomFloat32, root, comm, nullptr);
  else r = loomBroadcast(send, recv, count, loomFloat32, root, comm, nullptr);
  std::string msg = loomGetLastError(comm);
  loomResult_t next = loomAllReduce(send, recv, 1, loomFloat32, loomSum, comm, nullptr);
  if (r == loomSuccess) msg = loomGetLastError(comm);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  printf("rank %d: %s root %d: %s, then %s: %s (%.2f s)\n", gRank, mode.c_str(), root, loomGetErrorString(r),
         loomGetErrorString(next), msg.c_str(), secs);
  expect(r != loomSuccess || next != loomSuccess, mode + ": the mismatch fails this rank's collective or the next");
  expect(msg.find("mismatched operations") != std::string::npos && msg.find("root") != std::string::npos,
         mode + ": the error names the mismatched roots: " + msg);
  expect(secs < 10, mode + ": found in " + std::to_string(secs) + " s, not at the timeout");
}

// Healthy ranks that pass loomCommShrink different lists: rank 0 leaves out
// rank 1, the others leave out rank 0.  The others agree among themselves
// (an exact all-reduce); rank 0, which they left out, must not go on with a
// communicator of its own: it learns from them that they shrink without it
// (they keep the parent a while, as a program that frees it later does).
// `late`: rank 0 calls 300 ms after the others, who are done by then and
// have told it so (ShrankWithout): it must still learn that the lists differ.
static void scenarioShrinkLists(loomComm_t comm, bool late) {
  if (late && gRank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int exclude = gRank == 0 ? 1 : 0;
  loomComm_t sub = nullptr;
  loomResult_t r = loomCommShrink(comm, &exclude, 1, &sub);
  const std::string msg = loomGetLastError(nullptr);
  printf("rank %d: shrink without %d: %s %s\n", gRank, exclude, loomGetErrorString(r), msg.c_str());
  if (gRank == 0) {
    expect(r == loomInvalidUsage && sub == nullptr, "rank 0, left out by the others, gets no communicator");
    expect(msg.find("same excludeRanks") != std::string::npos, "rank 0's error says the lists differ: " + msg);
    return;
  }
  expect(r == loomSuccess && sub != nullptr, "the others agree");
  if (!sub) return;
  int n = 0;
  loomCommCount(sub, &n);
  expect(n == gSize - 1, "the others' communicator has all but rank 0");
  int64_t v = gRank;
  CHECK_LOOM(loomAllReduce(&v, &v, 1, loomInt64, loomSum, sub, nullptr));
  expect(v == int64_t(gSize) * (gSize - 1) / 2, "the others' all-reduce is exact");
  CHECK_LOOM(loomCommDestroy(sub));
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
}

// A live rank sits out a shrink (the others leave it out; it never calls),
// then all but the last rank shrink the parent again, rank 0 first and the
// others 0.5 s later.  Rank 0 asks them about their shrink meanwhile: their
// last one, done without rank 0, must not read as this one (it did: "rank 1
// shrank this communicator without this rank", and ranks 1-2 went on alone).
static void scenarioShrinkSatOut(loomComm_t comm) {
  if (gRank != 0) {
    int ex = 0;
    loomComm_t a = nullptr;
    CHECK_LOOM(loomCommShrink(comm, &ex, 1, &a));
    CHECK_LOOM(loomCommDestroy(a));
  }
  float v = 1;
  CHECK_LOOM(loomAllReduce(&v, &v, 1, loomFloat32, loomSum, comm, nullptr));  // everyone, on the parent
  if (gRank == gSize - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // keeps the parent until they are done
    return;
  }
  if (gRank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int ex = gSize - 1;
  loomComm_t b = nullptr;
  loomResult_t r = loomCommShrink(comm, &ex, 1, &b);
  printf("rank %d: the second shrink: %s %s\n", gRank, loomGetErrorString(r), loomGetLastError(nullptr));
  expect(r == loomSuccess && b != nullptr, "the second shrink succeeds on every rank that calls it");
  if (!b) return;
  int n = 0;
  loomCommCount(b, &n);
  expect(n == gSize - 1, "the second shrink keeps all but the last rank");
  CHECK_LOOM(loomCommDestroy(b));
}

// Zero-copy all-reduces, out of place, over 80 distinct loomMemAlloc buffers
// (each peer maps more than its cache's 64), while another thread of every
// rank allocates and frees small buffers (each free moves the rank's free
// epoch, evicting the peers' mappings of it).  A peer's input used to be
// unmapped while the same all-reduce mapped its output: wrong sums, then
// SIGSEGV.  Every result must be exact.
static void scenarioManyBuffers(loomComm_t comm) {
  const size_t count = (size_t(1) << 20) / sizeof(int32_t);  // 1 MiB: zero-copy with a core per rank
  std::vector<int32_t*> bufs(80, nullptr);
  for (int32_t*& b : bufs) CHECK_LOOM(loomMemAlloc(reinterpret_cast<void**>(&b), count * sizeof(int32_t)));
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      void* p = nullptr;
      if (loomMemAlloc(&p, 4096) == loomSuccess) loomMemFree(p);
    }
  });
  int wrong = 0;
  for (size_t i = 0; i + 1 < bufs.size(); i += 2) {
    int32_t* in = bufs[i];
    int32_t* out = bufs[i + 1];
    for (size_t k = 0; k < count; ++k) in[k] = int32_t(k % 1000) + gRank;
    loomResult_t r = loomAllReduce(in, out, count, loomInt32, loomSum, comm, nullptr);
    expect(r == loomSuccess, std::string("all-reduce over buffers ") + std::to_string(i) + ": " + loomGetErrorString(r));
    for (size_t k = 0; k < count; ++k)
      wrong += out[k] != int32_t(k % 1000) * gSize + gSize * (gSize - 1) / 2;
  }
  stop.store(true);
  churn.join();
  expect(wrong == 0, std::to_string(wrong) + " wrong elements");
  for (int32_t* b : bufs) CHECK_LOOM(loomMemFree(b));
}

// A forked child calls its parent's communicator: loomInvalidUsage naming
// the fork (it used to succeed, taking the parent's data, whose next
// all-reduce then came out wrong), then destroys it while the parents'
// all-reduces go on (its destroy used to read what arrived on the shared
// tcp sockets); the parent's communicator stays exact.
static void scenarioFork(loomComm_t comm) {
  std::vector<int32_t> v(1 << 16, 1);
  CHECK_LOOM(loomAllReduce(v.data(), v.data(), v.size(), loomInt32, loomSum, comm, nullptr));
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    loomResult_t r = loomAllReduce(v.data(), v.data(), v.size(), loomInt32, loomSum, comm, nullptr);
    const std::string msg = loomGetLastError(comm);
    const bool named = msg.find("is a fork of it") != std::string::npos;
    printf("rank %d's child: %s: %s\n", gRank, loomGetErrorString(r), msg.c_str());
    fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the parents run all-reduces meanwhile
    _exit(r == loomInvalidUsage && named && loomCommDestroy(comm) == loomSuccess ? 0 : 1);
  }
  int st = 0;
  bool exited = false;
  // Until every rank's child is gone (the ranks agree on it each round).
  for (int it = 0;; ++it) {
    std::fill(v.begin(), v.end(), gRank + it);
    CHECK_LOOM(loomAllReduce(v.data(), v.data(), v.size(), loomInt32, loomSum, comm, nullptr));
    size_t wrong = 0;
    for (int32_t x : v) wrong += x != gSize * (gSize - 1) / 2 + gSize * it;
    expect(wrong == 0, "the parent's all-reduces while and after the child destroys are exact");
    if (!exited) exited = waitpid(pid, &st, WNOHANG) == pid;
    int32_t running = exited ? 0 : 1;
    CHECK_LOOM(loomAllReduce(&running, &running, 1, loomInt32, loomSum, comm, nullptr));
    if (running == 0 && it >= 3) break;
  }
  expect(exited && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child's call fails naming the fork, and its destroys succeed");
}

// Point-to-point in groups (2 ranks): sends and receives with a collective
// between them, in either order, on every rank alike (they failed, or hung:
// lanes sharing a connection ran in group order, the send before the
// all-reduce on one side and the receive after it on the other); a group
// that mixes tagged and plain operations, refused on rank 0 alone, must not
// take sequence numbers; self-sends without their receives are refused
// without failing the communicator.
static void scenarioP2PGroups(loomComm_t comm) {
  const int peer = 1 - gRank;
  for (int order = 0; order < 2; ++order) {
    int32_t out[5] = {gRank, gRank, gRank, gRank, gRank}, in[5] = {-1, -1, -1, -1, -1}, sum = 1;
    CHECK_LOOM(loomGroupStart());
    if (order == 0) CHECK_LOOM(loomSend(out, 5, loomInt32, peer, comm, nullptr));
    else CHECK_LOOM(loomRecv(in, 5, loomInt32, peer, comm, nullptr));
    CHECK_LOOM(loomAllReduce(&sum, &sum, 1, loomInt32, loomSum, comm, nullptr));
    if (order == 0) CHECK_LOOM(loomRecv(in, 5, loomInt32, peer, comm, nullptr));
    else CHECK_LOOM(loomSend(out, 5, loomInt32, peer, comm, nullptr));
    loomResult_t r = loomGroupEnd();
    expect(r == loomSuccess, std::string("send, all-reduce, receive in one group: ") + loomGetErrorString(r) + " " +
                                 loomGetLastError(nullptr));
    expect(sum == 2 && in[0] == peer && in[4] == peer, "the group's all-reduce and exchange are exact");
  }
  if (gRank == 0) {
    int32_t v = 7;
    CHECK_LOOM(loomGroupStart());
    loomSendTagged(&v, 1, loomInt32, 1, 3, comm, nullptr);
    loomSend(&v, 1, loomInt32, 1, comm, nullptr);
    expect(loomGroupEnd() == loomInvalidUsage, "a group mixing tagged and plain operations is refused");
  }
  int32_t self = 5, back = 0;
  expect(loomSend(&self, 1, loomInt32, gRank, comm, nullptr) == loomInvalidUsage,
         "a send to itself without its receive is refused");
  CHECK_LOOM(loomGroupStart());
  loomSend(&self, 2, loomInt32, gRank, comm, nullptr);
  loomRecv(&back, 1, loomInt32, gRank, comm, nullptr);
  expect(loomGroupEnd() == loomInvalidUsage, "a send to itself with a receive of another size is refused");
  // The communicator is still usable and in step.
  int32_t out = gRank, in = -1;
  CHECK_LOOM(loomGroupStart());
  CHECK_LOOM(loomSend(&out, 1, loomInt32, peer, comm, nullptr));
  CHECK_LOOM(loomRecv(&in, 1, loomInt32, peer, comm, nullptr));
  CHECK_LOOM(loomGroupEnd());
  expect(in == peer, "a later exchange is exact");
  int32_t sum = 1;
  CHECK_LOOM(loomAllReduce(&sum, &sum, 1, loomInt32, loomSum, comm, nullptr));
  expect(sum == 2, "a later all-reduce is exact");
}

static void scenarioSplit(loomComm_t comm) {
  loomComm_t half;
  CHECK_LOOM(loomCommSplit(comm, gRank % 2, gRank, &half));
  int hn, hr;
  CHECK_LOOM(loomCommCount(half, &hn));
  CHECK_LOOM(loomCommUserRank(half, &hr));
  expect(hn == (gSize + 1 - gRank % 2) / 2, "split size");
  expect(hr == gRank / 2, "split rank");
  std::vector<int64_t> v(4099, gRank);
  CHECK_LOOM(loomAllReduce(v.data(), v.data(), v.size(), loomInt64, loomSum, half, nullptr));
  int64_t want = 0;
  for (int r = gRank % 2; r < gSize; r += 2) want += r;
  expect(v[4098] == want, "allreduce on the split communicator");
  loomComm_t none;
  CHECK_LOOM(loomCommSplit(comm, gRank == 0 ? LOOM_SPLIT_NOCOLOR : 1, 0, &none));
  expect((gRank == 0) == (none == nullptr), "NOCOLOR gives NULL");
  if (none) CHECK_LOOM(loomCommDestroy(none));
  CHECK_LOOM(loomCommDestroy(half));
}

// Entries of a directory, less . and ..
static int entriesOf(const char* dir) {
  int n = 0;
  if (DIR* d = opendir(dir)) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n;
}

// Open descriptors of this process, less the one that counts them.
static int descriptorCount() { return entriesOf("/proc/self/fd") - 1; }

// A communicator holds a few descriptors of its own, however many peers
// share its host: what it needs of each peer process (a pidfd, a socket to
// ring its bell) is shared by every communicator of this process.  Then,
// with the descriptor limit lowered, making communicators until one fails:
// the failure is an error on every rank (no hang), the ones made still
// work, and destroying them all gives every descriptor back.
static void scenarioDescriptors(loomComm_t comm, int perComm) {
  const int kComms = 24;
  std::vector<loomComm_t> subs;
  auto exact = [&](loomComm_t c, const char* what) {
    std::vector<int32_t> v(1027, gRank + 1);
    CHECK_LOOM(loomAllReduce(v.data(), v.data(), v.size(), loomInt32, loomSum, c, nullptr));
    CHECK_LOOM(loomStreamSynchronize(nullptr));
    expect(v[1026] == gSize * (gSize + 1) / 2, what);
  };
  // One first, so that what the process keeps for good (the shared
  // sockets, the peers' pidfds) is in the baseline.
  loomComm_t first;
  CHECK_LOOM(loomCommSplit(comm, 0, gRank, &first));
  exact(first, "all-reduce on the first split");
  const int before = descriptorCount();
  for (int i = 0; i < kComms; ++i) {
    loomComm_t c;
    CHECK_LOOM(loomCommSplit(comm, 0, gRank, &c));
    exact(c, "all-reduce on a split");
    subs.push_back(c);
  }
  const int grown = descriptorCount() - before;
  expect(grown <= kComms * perComm,
         loomtest::strf("%d communicators of %d ranks hold %d descriptors (%.1f each; at most %d expected)", kComms, gSize,
              grown, double(grown) / kComms, perComm));
  if (gRank == 0) printf("%d ranks: %.1f descriptors per communicator\n", gSize, double(grown) / kComms);

  // Out of descriptors: a little room, then more communicators than fit,
  // with the limit at each place in a communicator's sequence of opens.
  struct rlimit old;
  getrlimit(RLIMIT_NOFILE, &old);
  for (int slack = 0; slack < perComm; ++slack) {
    struct rlimit low = old;
    low.rlim_cur = rlim_t(descriptorCount() + 3 + slack + 2 * perComm);
    setrlimit(RLIMIT_NOFILE, &low);
    loomResult_t r = loomSuccess;
    int made = 0;
    for (int i = 0; i < 200 && r == loomSuccess; ++i) {
      loomComm_t c = nullptr;
      r = loomCommSplit(comm, 0, gRank, &c);
      if (r == loomSuccess) {
        subs.push_back(c);
        ++made;
      }
    }
    setrlimit(RLIMIT_NOFILE, &old);
    const std::string why = loomGetLastError(nullptr);
    // loomTimeout: a joiner of a split whose root gave up finds its
    // listener closed and stops retrying after 2 s.
    expect(r == loomSystemError || r == loomRemoteError || r == loomTimeout,
           loomtest::strf("running out of descriptors after %d more communicators: %s (%s)", made,
                          loomGetErrorString(r), why.c_str()));
    expect(why.find("Too many open files") != std::string::npos || why.find("rank") != std::string::npos,
           "the error says why or names the rank that failed: " + why);
    if (gRank == 0) printf("out of descriptors after %d more: %s\n", made, why.c_str());
    exact(comm, "all-reduce on the parent after the failed split");
  }
  for (loomComm_t c : subs) exact(c, "all-reduce on a split made before the failure");
  exact(comm, "all-reduce on the parent after the failed split");
  for (loomComm_t c : subs) CHECK_LOOM(loomCommDestroy(c));
  CHECK_LOOM(loomCommDestroy(first));
  // `first` was made before the baseline: its own descriptors go too.
  const int after = descriptorCount();
  expect(after <= before, loomtest::strf("after destroy: %d descriptors, %d before the splits", after, before));
}

// Threads of this process (/proc/self/task entries).
static int threadCount() { return entriesOf("/proc/self/task"); }

static double msSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Tagged point to point (loomSendTagged / loomRecvTagged), every value checked.
static int32_t tagValue(int src, int tag, size_t i) { return int32_t(src * 1000003 + tag * 1009 + int(i)); }
static std::vector<int32_t> tagMessage(int src, int tag, size_t count) {
  std::vector<int32_t> v(count);
  for (size_t i = 0; i < count; ++i) v[i] = tagValue(src, tag, i);
  return v;
}
static bool tagExact(const std::vector<int32_t>& v, int src, int tag, size_t count) {
  for (size_t i = 0; i < count; ++i)
    if (v[i] != tagValue(src, tag, i)) return false;
  return true;
}

static void scenarioTagged(loomComm_t comm) {
  const int n = gSize, me = gRank;
  auto str = [](size_t v) { return std::to_string(v); };
  // 1. Pairs (0,1), (2,3)...: the even rank sends tag 1 then tag 2, the odd
  // one receives tag 2 first.  7 elements; more than a slot (64 KiB); more
  // than a whole slot ring (8 x 64 KiB) but eager (<= 1 MiB); rendezvous (3 MiB).
  for (size_t count : {size_t(7), size_t(30000), size_t(200000)}) {
    if ((me ^ 1) >= n) break;
    if (me % 2 == 0) {
      auto a = tagMessage(me, 1, count), b = tagMessage(me, 2, count + 1);
      CHECK_LOOM(loomSendTagged(a.data(), count, loomInt32, me + 1, 1, comm, nullptr));
      CHECK_LOOM(loomSendTagged(b.data(), count + 1, loomInt32, me + 1, 2, comm, nullptr));
    } else {
      std::vector<int32_t> a(count + 10, -1), b(count + 10, -1);
      loomP2PStatus sa{}, sb{};
      CHECK_LOOM(loomRecvTagged(b.data(), b.size(), loomInt32, me - 1, 2, comm, nullptr, &sb));
      CHECK_LOOM(loomRecvTagged(a.data(), a.size(), loomInt32, me - 1, 1, comm, nullptr, &sa));
      expect(tagExact(a, me - 1, 1, count) && tagExact(b, me - 1, 2, count + 1) && a[count] == -1 &&
                 b[count + 1] == -1,
             "tag 2 received before tag 1, count " + str(count));
      expect(sa.source == me - 1 && sa.tag == 1 && sa.count == count && sb.source == me - 1 && sb.tag == 2 &&
                 sb.count == count + 1,
             "status of out-of-order tagged receives, count " + str(count));
    }
  }
  // 2. Both ranks of a pair send first (more than a slot ring each), then receive.
  if ((me ^ 1) < n) {
    int peer = me ^ 1;
    const size_t count = 200000;
    auto out = tagMessage(me, 7, count);
    std::vector<int32_t> in(count, -1);
    CHECK_LOOM(loomSendTagged(out.data(), count, loomInt32, peer, 7, comm, nullptr));
    CHECK_LOOM(loomRecvTagged(in.data(), count, loomInt32, peer, 7, comm, nullptr, nullptr));
    expect(tagExact(in, peer, 7, count), "both ranks send first, then receive");
  }
  // 3. Rank 0 receives from any source, any tag: every other rank sends 6
  // messages (tags 0, 1, 0, 1, ...; the value says which of its tag).
  // Per (source, tag) they must come in order.
  if (me == 0) {
    std::vector<std::vector<int>> next(size_t(n), std::vector<int>(2, 0));
    for (int k = 0; k < 6 * (n - 1); ++k) {
      std::vector<int32_t> in(40, -1);
      loomP2PStatus st{-5, -5, 0};
      CHECK_LOOM(loomRecvTagged(in.data(), in.size(), loomInt32, LOOM_ANY_SOURCE, LOOM_ANY_TAG, comm, nullptr, &st));
      bool okStatus = st.source > 0 && st.source < n && (st.tag == 0 || st.tag == 1) && st.count == 33;
      expect(okStatus, "any-source status (source " + std::to_string(st.source) + ", tag " + std::to_string(st.tag) + ")");
      if (!okStatus) break;
      int& nx = next[size_t(st.source)][size_t(st.tag)];
      expect(in[0] == nx && tagExact(std::vector<int32_t>(in.begin() + 1, in.end()), st.source, st.tag, 32) && in[33] == -1,
             "any-source message " + std::to_string(nx) + " from rank " + std::to_string(st.source) + " tag " +
                 std::to_string(st.tag) + " in order and exact");
      ++nx;
    }
  } else {
    for (int j = 0; j < 6; ++j) {
      std::vector<int32_t> m(33);
      m[0] = j / 2;
      auto body = tagMessage(me, j % 2, 32);
      std::copy(body.begin(), body.end(), m.begin() + 1);
      CHECK_LOOM(loomSendTagged(m.data(), m.size(), loomInt32, 0, j % 2, comm, nullptr));
    }
  }
  {  // Later sections send other tags: none may reach rank 0's any-tag receives.
    std::vector<float> x(1, 1.0f);
    CHECK_LOOM(loomAllReduce(x.data(), x.data(), 1, loomFloat32, loomSum, comm, nullptr));
  }
  // 4. Rendezvous (3 MiB > LOOM_TAGGED_EAGER_BYTES): in order, and two in one
  // group received in the other order in one group.
  if ((me ^ 1) < n) {
    const size_t big = 786432;
    if (me % 2 == 0) {
      auto a = tagMessage(me, 3, big), b = tagMessage(me, 4, big / 2);
      CHECK_LOOM(loomSendTagged(a.data(), big, loomInt32, me + 1, 3, comm, nullptr));
      CHECK_LOOM(loomGroupStart());
      CHECK_LOOM(loomSendTagged(a.data(), big, loomInt32, me + 1, 3, comm, nullptr));
      CHECK_LOOM(loomSendTagged(b.data(), big / 2, loomInt32, me + 1, 4, comm, nullptr));
      CHECK_LOOM(loomGroupEnd());
    } else {
      std::vector<int32_t> a(big, -1), a2(big, -1), b(big / 2, -1);
      CHECK_LOOM(loomRecvTagged(a.data(), big, loomInt32, me - 1, 3, comm, nullptr, nullptr));
      CHECK_LOOM(loomGroupStart());
      CHECK_LOOM(loomRecvTagged(b.data(), big / 2, loomInt32, me - 1, 4, comm, nullptr, nullptr));
      CHECK_LOOM(loomRecvTagged(a2.data(), big, loomInt32, me - 1, 3, comm, nullptr, nullptr));
      CHECK_LOOM(loomGroupEnd());
      expect(tagExact(a, me - 1, 3, big) && tagExact(a2, me - 1, 3, big) && tagExact(b, me - 1, 4, big / 2),
             "rendezvous messages exact, alone and in a group out of order");
    }
  }
  // 5. A receive too small for its message: loomInvalidUsage naming both
  // sizes; the message stays for a receive that fits; the communicator works.
  if ((me ^ 1) < n) {
    if (me % 2 == 0) {
      auto a = tagMessage(me, 9, 100);
      CHECK_LOOM(loomSendTagged(a.data(), 100, loomInt32, me + 1, 9, comm, nullptr));
    } else {
      std::vector<int32_t> small(10, -1), in(100, -1);
      loomResult_t r = loomRecvTagged(small.data(), 10, loomInt32, me - 1, 9, comm, nullptr, nullptr);
      std::string msg = loomGetLastError(comm);
      expect(r == loomInvalidUsage && msg.find("400 bytes") != std::string::npos && msg.find("(40 bytes)") != std::string::npos,
             "too small a receive is invalid usage naming 400 and 40 bytes: " + msg);
      expect(small[0] == -1, "too small a receive writes nothing");
      CHECK_LOOM(loomRecvTagged(in.data(), 100, loomInt32, me - 1, 9, comm, nullptr, nullptr));
      expect(tagExact(in, me - 1, 9, 100), "the message survives a receive too small for it");
    }
  }
  // 6. Tagged messages waiting in the stash disturb neither collectives nor
  // plain sends and receives; then a stream with status, and a send to self.
  {
    int next = (me + 1) % n, prev = (me + n - 1) % n;
    auto t = tagMessage(me, 11, 5000);
    CHECK_LOOM(loomSendTagged(t.data(), t.size(), loomInt32, next, 11, comm, nullptr));
    std::vector<float> x(70001, 1.0f);
    CHECK_LOOM(loomAllReduce(x.data(), x.data(), x.size(), loomFloat32, loomSum, comm, nullptr));
    expect(x[70000] == float(n), "all-reduce with tagged messages pending");
    std::vector<int32_t> po(1000, me), pi(1000, -1);
    CHECK_LOOM(loomGroupStart());
    CHECK_LOOM(loomSend(po.data(), po.size(), loomInt32, next, comm, nullptr));
    CHECK_LOOM(loomRecv(pi.data(), pi.size(), loomInt32, prev, comm, nullptr));
    CHECK_LOOM(loomGroupEnd());
    expect(pi[0] == prev && pi[999] == prev, "plain send/recv with tagged messages pending");
    loomStream_t s;
    CHECK_LOOM(loomStreamCreate(&s));
    std::vector<int32_t> in(6000, -1), self(5000, -1);
    loomP2PStatus st{}, sst{};
    CHECK_LOOM(loomRecvTagged(in.data(), in.size(), loomInt32, prev, 11, comm, s, &st));
    CHECK_LOOM(loomSendTagged(t.data(), t.size(), loomInt32, me, 12, comm, s));
    CHECK_LOOM(loomRecvTagged(self.data(), self.size(), loomInt32, me, LOOM_ANY_TAG, comm, s, &sst));
    CHECK_LOOM(loomStreamSynchronize(s));
    CHECK_LOOM(loomStreamDestroy(s));
    expect(tagExact(in, prev, 11, 5000) && st.source == prev && st.tag == 11 && st.count == 5000,
           "tagged receive on a stream, with status");
    expect(tagExact(self, me, 11, 5000) && sst.source == me && sst.tag == 12 && sst.count == 5000,
           "tagged send to self");
  }
  // Bad arguments.
  std::vector<int32_t> b(4);
  expectInvalid(loomSendTagged(b.data(), 4, loomInt32, 0, -1, comm, nullptr), "send with a negative tag");
  expectInvalid(loomSendTagged(b.data(), 4, loomInt32, LOOM_ANY_SOURCE, 0, comm, nullptr), "send to any source");
  expectInvalid(loomRecvTagged(b.data(), 4, loomInt32, n, 0, comm, nullptr, nullptr), "receive from rank n");
  expectInvalid(loomRecvTagged(b.data(), 4, loomInt32, 0, -2, comm, nullptr, nullptr), "receive with tag -2");
  loomResult_t async;
  CHECK_LOOM(loomCommGetAsyncError(comm, &async));
  expect(async == loomSuccess, "the communicator is healthy after the tagged scenario");
  std::vector<float> x(16, 1.0f);
  CHECK_LOOM(loomAllReduce(x.data(), x.data(), x.size(), loomFloat32, loomSum, comm, nullptr));
}

// Run with LOOM_TAGGED_STASH_BYTES=0: nothing may be stashed, so a message
// that arrives before its receive waits in the connection (the sender waits
// once the slots are full) and is read when a receive for it is posted.
// Rank 0 sends 50 messages to rank 1 (tags 0, 1, 2, 0, ...), rank 1
// receives them in order after a pause; every value is checked.
static void scenarioTaggedNoStash(loomComm_t comm) {
  if (gSize < 2 || gRank > 1) return;
  for (int j = 0; j < 50; ++j) {
    size_t count = 1000 + size_t(j) * 997;  // one to 13 slots
    if (gRank == 0) {
      auto m = tagMessage(0, j % 3, count);
      CHECK_LOOM(loomSendTagged(m.data(), count, loomInt32, 1, j % 3, comm, nullptr));
    } else {
      if (j == 0) usleep(100000);  // the sender runs ahead into full slots
      std::vector<int32_t> in(count, -1);
      loomP2PStatus st{};
      CHECK_LOOM(loomRecvTagged(in.data(), count, loomInt32, 0, j % 3, comm, nullptr, &st));
      expect(tagExact(in, 0, j % 3, count) && st.count == count, "message " + std::to_string(j) + " without a stash");
    }
  }
}

// Two ranks each wait for a tagged message the other never sends: both get
// loomTimeout (1 s) naming the call and what it waited for.
static void scenarioTaggedTimeout(loomComm_t comm) {
  CHECK_LOOM(loomCommSetTimeout(comm, 1000));
  std::vector<int32_t> buf(10);
  int peer = gRank ^ 1;
  if (peer >= gSize) return;
  auto m = tagMessage(gRank, 1, 10);
  CHECK_LOOM(loomSendTagged(m.data(), 10, loomInt32, peer, 1, comm, nullptr));  // stashed there, tag 1
  loomResult_t r = loomRecvTagged(buf.data(), 10, loomInt32, peer, 99, comm, nullptr, nullptr);
  std::string msg = loomGetLastError(comm);
  // The rank that timed out first fails the communicator; the other inherits
  // its cause (loomRemoteError with the first rank's message).
  std::string want = ", tag 99, up to 40 bytes) made no progress for 1000 ms waiting for a matching message "
                     "(1 messages stashed here, none matches)";
  expect((r == loomTimeout || r == loomRemoteError) && msg.find("RecvTagged (from rank ") != std::string::npos &&
             msg.find(want) != std::string::npos,
         "an unmatched tagged receive times out naming it: " + msg);
}

// A tagged sender dies: rank 0's receive from it (victim 1) or from any
// source (every other rank dies) returns loomRemoteError, not a hang or the
// timeout (the test sets LOOM_TIMEOUT_MS far above its own limit).
static int scenarioTaggedFault(const std::string& mode) {
  loomComm_t comm;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  CHECK_LOOM(loomCommCount(comm, &gSize));
  const bool any = mode == "any";
  std::vector<int32_t> buf(1000, -1);
  if (gRank != 0) {
    if (any || gRank == 1) {
      auto m = tagMessage(gRank, 1, 1000);
      CHECK_LOOM(loomSendTagged(m.data(), m.size(), loomInt32, 0, 1, comm, nullptr));
      usleep(200000);
      raise(SIGKILL);
    }
    // Others wait to be told the communicator failed.
    loomResult_t r = loomRecvTagged(buf.data(), buf.size(), loomInt32, 0, 5, comm, nullptr, nullptr);
    printf("rank %d: waiting receive returned %s\n", gRank, loomGetErrorString(r));
    loomCommAbort(comm);
    return r == loomRemoteError ? 0 : 1;
  }
  int senders = any ? gSize - 1 : 1;
  for (int k = 0; k < senders; ++k) {
    loomP2PStatus st{};
    CHECK_LOOM(loomRecvTagged(buf.data(), buf.size(), loomInt32, any ? LOOM_ANY_SOURCE : 1, 1, comm, nullptr, &st));
    expect(tagExact(buf, st.source, 1, 1000), "the message sent before the death is exact");
  }
  loomResult_t r = loomRecvTagged(buf.data(), buf.size(), loomInt32, any ? LOOM_ANY_SOURCE : 1, 1, comm, nullptr, nullptr);
  std::string msg = loomGetLastError(comm);
  printf("rank 0: receive from a dead sender returned %s: %s\n", loomGetErrorString(r), msg.c_str());
  expect(r == loomRemoteError, "receive from a dead sender is a remote error: " + msg);
  loomCommAbort(comm);
  return gFailures ? 1 : 0;
}

// The fault table's scenario.  Surviving ranks record: the call that failed,
// its result, the time from the call to the error, and how long
// loomCommAbort took.  Exit 0 when the failure was one of the expected ones.
static int scenarioFault(const std::string& phase, int victim, size_t bytes, const std::string& dir) {
  int rank = atoi(getenv("LOOM_RANK"));
  auto record = [&](const char* call, loomResult_t r, double ms, double abortMs, const char* msg) {
    std::string path = dir + "/rank" + std::to_string(rank);
    if (FILE* f = fopen(path.c_str(), "w")) {
      fprintf(f, "%s|%d|%.0f|%.1f|%s\n", call, int(r), ms, abortMs, msg);
      fclose(f);
    }
    printf("rank %d: %s returned %s after %.0f ms (abort %.1f ms): %s\n", rank, call, loomGetErrorString(r), ms,
           abortMs, msg);
  };
  auto kill9 = [](int afterUs) {
    std::thread([afterUs] {
      if (afterUs) usleep(useconds_t(afterUs));
      raise(SIGKILL);
    }).detach();
  };
  loomComm_t comm = nullptr;
  // TSan starts a thread of its own with a process's first thread (here the
  // communicator's control thread): start one first so that the count is
  // loom's alone.
  std::thread([] {}).join();
  const int threadsBefore = threadCount();
  // loomCommAbort frees everything: no thread of loom's may outlive it.
  auto leftThreads = [&]() {
    for (int i = 0; i < 100 && threadCount() > threadsBefore; ++i) usleep(10000);
    int now = threadCount();
    if (now > threadsBefore) printf("rank %d: %d threads after loomCommAbort, %d before init\n", rank, now, threadsBefore);
    return now > threadsBefore;
  };
  auto t0 = std::chrono::steady_clock::now();
  if (phase == "init") {
    // The victim starts late, while the others wait in init, and dies a few
    // milliseconds into its own init (connecting, joining or exchanging).
    if (rank == victim) {
      usleep(300000);
      kill9(1000 + 1000 * (getpid() % 5));
    }
    t0 = std::chrono::steady_clock::now();
    loomResult_t r = loomCommInitFromEnv(&comm);
    if (r == loomSuccess) {
      // Init can finish before the victim dies: then the first operation must fail.
      int me;
      loomCommUserRank(comm, &me);
      std::vector<float> buf(1024, 1.0f);
      if (rank == victim) usleep(10000000);  // dies here
      r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
      if (r == loomSuccess) {
        record("loomAllReduce after init", r, msSince(t0), 0, "succeeded although a rank died");
        return 1;
      }
    }
    std::string msg = loomGetLastError(comm);
    double ms = msSince(t0);
    auto ta = std::chrono::steady_clock::now();
    if (comm) loomCommAbort(comm);
    record(comm ? "loomAllReduce after init" : "loomCommInitFromEnv", r, ms, comm ? msSince(ta) : 0, msg.c_str());
    if (leftThreads()) return 1;
    return (r == loomRemoteError || r == loomTimeout) ? 0 : 1;
  }
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  CHECK_LOOM(loomCommCount(comm, &gSize));
  std::vector<float> buf(bytes / 4, 1.0f), out(bytes / 4);
  // "alltoall": the same with all-to-alls of the same buffer (pairwise: every
  // pair at once, so the victim dies with messages to and from everyone).
  const bool a2a = phase == "alltoall";
  const char* call = a2a ? "loomAllToAll" : "loomAllReduce";
  auto collective = [&](size_t elems) {
    if (a2a) return loomAllToAll(buf.data(), out.data(), elems / size_t(gSize), loomFloat32, comm, nullptr);
    return loomAllReduce(buf.data(), buf.data(), elems, loomFloat32, loomSum, comm, nullptr);
  };
  for (int it = 0; it < 1000; ++it) {
    if (gRank == victim && it == 2) {
      if (phase == "allreduce" || a2a) kill9(2000);  // in the middle of this operation
      else raise(SIGKILL);                           // between the second and the third
    }
    if (phase == "between" && it == 2) usleep(300000);  // the victim is surely dead now
    t0 = std::chrono::steady_clock::now();
    loomResult_t r = collective(buf.size());
    if (r != loomSuccess) {
      double ms = msSince(t0);
      std::string msg = loomGetLastError(comm);
      // A later call fails at once with the same error.
      loomResult_t again = collective(16 * size_t(gSize));
      expect(again == r, "a call after the failure returns the same error");
      auto ta = std::chrono::steady_clock::now();
      CHECK_LOOM(loomCommAbort(comm));
      record(call, r, ms, msSince(ta), msg.c_str());
      if (leftThreads()) return 1;
      return (r == loomRemoteError || r == loomTimeout) && !gFailures ? 0 : 1;
    }
  }
  record(call, loomSuccess, 0, 0, "1000 operations succeeded although a rank died");
  return 1;
}

// Rank 1 arrives 4 s late to an all-reduce that times out after
// LOOM_TIMEOUT_MS (2.5 s): meanwhile rank 0 checks what loomCommDump and the
// LOOM_DUMP_SIGNAL signal print, then that the timeout names rank 1.
static void scenarioDump(loomComm_t comm) {
  std::vector<float> buf(4096, 1.0f);
  if (gRank == 1) {
    usleep(4000000);
    // Over shm rank 0 posted its data before it gave up, so this call may
    // still complete, correctly; the next one must fail.
    loomResult_t r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
    printf("rank 1: late all-reduce: %s: %s\n", loomGetErrorString(r), loomGetLastError(comm));
    expect(r == loomRemoteError || r == loomTimeout || (r == loomSuccess && buf[4095] == 2.0f),
           "the late all-reduce fails or is exact");
    r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
    printf("rank 1: next all-reduce: %s: %s\n", loomGetErrorString(r), loomGetLastError(comm));
    expect(r == loomRemoteError || r == loomTimeout, "the late rank is told its peer failed");
    return;
  }
  if (gRank != 0) return;
  char text[4096];
  expect(loomCommDump(comm, text, sizeof text) == loomSuccess, "loomCommDump on an idle communicator");
  expect(strstr(text, "running: nothing") != nullptr, std::string("idle dump says nothing runs: ") + text);
  std::thread watcher([&] {
    usleep(800000);
    char t[4096];
    expect(loomCommDump(comm, t, sizeof t) == loomSuccess, "loomCommDump while an operation hangs");
    printf("rank 0: loomCommDump:\n%s", t);
    expect(strstr(t, "running: AllReduce #0 (count 4096, float32, sum)") != nullptr, "dump names the operation");
    expect(strstr(t, "waiting for rank 1") != nullptr, "dump names the peer it waits for");
    char small[16];
    expect(loomCommDump(comm, small, sizeof small) == loomSuccess && strlen(small) == 15, "dump truncates to size");
    // The signal: its output goes to stderr, which we catch in a file.
    std::string path = "/tmp/loom-dump-" + std::to_string(getpid());
    int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
    int saved = dup(2);
    fflush(stderr);
    dup2(fd, 2);
    kill(getpid(), atoi(getenv("LOOM_DUMP_SIGNAL")));
    std::string got;
    for (int i = 0; i < 300 && got.find("waiting for rank 1") == std::string::npos; ++i) {
      usleep(10000);
      char b[4096];
      ssize_t n = pread(fd, b, sizeof b - 1, 0);
      got.assign(b, n > 0 ? size_t(n) : 0);
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    unlink(path.c_str());
    printf("rank 0: LOOM_DUMP_SIGNAL printed:\n%s", got.c_str());
    expect(got.find("loom rank 0 of 2") != std::string::npos && got.find("waiting for rank 1") != std::string::npos,
           "the dump signal prints the pending operation");
  });
  loomResult_t r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
  watcher.join();
  std::string msg = loomGetLastError(comm);
  printf("rank 0: %s: %s\n", loomGetErrorString(r), msg.c_str());
  expect(r == loomTimeout, "the hung all-reduce times out");
  expect(msg.find("waiting for rank 1") != std::string::npos && msg.find("AllReduce #0") != std::string::npos,
         "the timeout names the peer and the operation's sequence number");
  expect(loomCommDump(comm, text, sizeof text) == loomSuccess && strstr(text, "failed (") != nullptr,
         "the dump shows the failure");
  usleep(2500000);  // let rank 1 find the failure through the live communicator
}

// Random operations, identical on every rank (same seed), each checked
// exactly.  Sizes straddle the one-shot / staged / ring thresholds, half of
// the operations go through a host stream and half are blocking calls.
static void scenarioSoak(loomComm_t comm, uint64_t seed, int count, double seconds) {
  uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&](uint64_t n) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state % n;
  };
  static const size_t kSizes[] = {0, 1, 3, 17, 255, 1000, 4093, 16384, 65537, 300007, 1 << 20};
  loomStream_t stream;
  CHECK_LOOM(loomStreamCreate(&stream));
  if (gRank == 0) printf("soak: seed %llu, %d operations, at most %.0f s\n", (unsigned long long)seed, count, seconds);
  auto start = std::chrono::steady_clock::now();
  int done = 0;
  for (; done < count; ++done) {
    Coll c = Coll(next(5));
    loomDataType_t t = kTypes[next(10)];
    loomRedOp_t op = kOps[next(5)];
    size_t n = kSizes[next(sizeof kSizes / sizeof kSizes[0])];
    if (c == RS || c == AG) n = n / size_t(gSize) + 1;
    bool inPlace = next(2);
    int root = int(next(uint64_t(gSize)));
    bool onStream = next(2);
    runChecked(comm, onStream ? stream : nullptr, c, t, op, n, inPlace, root);
    // Every rank stops at the same operation: agree on whether time is up.
    int64_t stop = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds;
    CHECK_LOOM(loomAllReduce(&stop, &stop, 1, loomInt64, loomMax, comm, nullptr));
    if (stop) {
      ++done;
      break;
    }
  }
  CHECK_LOOM(loomStreamDestroy(stream));
  if (gRank == 0) printf("soak: %d operations checked, seed %llu\n", done, (unsigned long long)seed);
}

static double realMs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}

// See the usage above.  A survivor's line: members (old ranks, in new rank
// order) | ms from the failed call to its error | ms in loomCommShrink (all
// attempts) | wall-clock ms when the shrunken communicator's first all-reduce
// was checked | the error message.  A victim writes DIR/killed<r> (the
// wall-clock ms just before it dies).
static int scenarioShrink(const std::string& mode, const std::vector<size_t>& victims, size_t bytes,
                          const std::string& dir) {
  int rank = atoi(getenv("LOOM_RANK"));
  gRank = rank;
  auto isVictim = [&](int r, size_t which) { return victims.size() > which && int(victims[which]) == r; };
  auto die = [&](int afterUs) {
    std::thread([afterUs, rank, dir] {
      if (afterUs) usleep(useconds_t(afterUs));
      if (FILE* f = fopen((dir + "/killed" + std::to_string(rank)).c_str(), "w")) {
        fprintf(f, "%.3f\n", realMs());
        fclose(f);
      }
      raise(SIGKILL);
    }).detach();
    if (!afterUs) pause();
  };
  // Descriptors open before init (the dead rank's memfds and pidfds, the
  // control sockets: all must be closed once both communicators are freed).
  // Each descriptor with what it names (readlink), so that a difference says
  // which descriptors it is.  The directory's own descriptor is left out.
  auto openFds = [] {
    std::map<int, std::string> fds;
    if (DIR* d = opendir("/proc/self/fd")) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d)) continue;
        char target[256] = "?";
        ssize_t len = readlink(("/proc/self/fd/" + std::string(e->d_name)).c_str(), target, sizeof target - 1);
        if (len >= 0) target[len] = 0;
        fds[atoi(e->d_name)] = target;
      }
      closedir(d);
    }
    return fds;
  };
  std::thread([] {}).join();  // TSan's own thread (see scenarioFault) opens what it opens now
  const std::map<int, std::string> fdsBefore = openFds();
  const char* tr = getenv("LOOM_TRANSPORTS");
  const bool countFds = tr && std::string(tr).find("ucx") == std::string::npos;  // UCX keeps its own
  loomComm_t comm = nullptr;
  if (mode == "init") {
    // The victim starts late, while the others wait in init, and dies 1-5 ms
    // into its own (joining, exchanging, setting up): the others' init must
    // fail cleanly, or succeed and leave them a communicator they can shrink.
    if (isVictim(rank, 0)) {
      usleep(300000);
      die(1000 + 1000 * int(getpid() % 5));
    }
    auto t0 = std::chrono::steady_clock::now();
    loomResult_t r = loomCommInitFromEnv(&comm);
    if (r != loomSuccess) {
      double ms = msSince(t0);
      std::string msg = loomGetLastError(nullptr);
      expect(r == loomRemoteError || r == loomTimeout,
             std::string("a rank killed during init fails the others' init cleanly, not with ") + loomGetErrorString(r));
      expect(comm == nullptr, "a failed init leaves the communicator NULL");
      for (char& c : msg)
        if (c == '\n' || c == '|') c = ' ';
      if (FILE* f = fopen((dir + "/rank" + std::to_string(rank)).c_str(), "w")) {
        fprintf(f, "init failed|%.1f|0|0|%s\n", ms, msg.c_str());
        fclose(f);
      }
      printf("rank %d: init failed after %.0f ms: %s\n", rank, ms, msg.c_str());
      return gFailures ? 1 : 0;
    }
    if (isVictim(rank, 0)) pause();  // its init won the race: it dies in a moment
  } else {
    CHECK_LOOM(loomCommInitFromEnv(&comm));
  }
  CHECK_LOOM(loomCommCount(comm, &gSize));
  const int n0 = gSize;
  std::vector<float> buf(bytes / 4, 1.0f);
  double detectMs = 0;
  std::string message;
  if (mode == "revoke") {
    // Rank 0 never joins the all-reduce: it revokes; the others must be told.
    if (rank == 0) {
      usleep(300000);
      CHECK_LOOM(loomCommRevoke(comm));
      CHECK_LOOM(loomCommRevoke(comm));  // a no-op the second time
      loomResult_t r = loomAllReduce(buf.data(), buf.data(), 16, loomFloat32, loomSum, comm, nullptr);
      expect(r == loomRemoteError, "an operation on a revoked communicator fails with loomRemoteError");
    } else {
      auto t0 = std::chrono::steady_clock::now();
      loomResult_t r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
      detectMs = msSince(t0);
      message = loomGetLastError(comm);
      expect(r == loomRemoteError, "a pending all-reduce on a revoked communicator returns loomRemoteError: " +
                                       std::string(loomGetErrorString(r)));
      expect(message.find("revoked") != std::string::npos, "the message says revoked: " + message);
    }
  } else {
    for (int it = 0;; ++it) {
      const bool connecting = mode == "connect" || mode == "connect0";
      if (it == 2 && isVictim(rank, 0) && mode != "init" && !connecting) die(mode == "allreduce" ? 2000 : 0);
      // connect: init is done, the first operation opens the connections; the
      // victim dies 0.2-2 ms into it (connect0: just before it).
      if (it == 0 && isVictim(rank, 0) && connecting) die(mode == "connect0" ? 0 : 200 + 600 * int(getpid() % 4));
      if (mode != "allreduce" && it == 2) usleep(200000);  // the victim is surely dead now
      auto t0 = std::chrono::steady_clock::now();
      loomResult_t r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
      if (r == loomSuccess) {
        if (it > 50) {
          expect(false, "50 all-reduces succeeded although a rank died");
          return 1;
        }
        continue;
      }
      detectMs = msSince(t0);
      expect(r == loomRemoteError || r == loomTimeout, "a dead rank fails the all-reduce cleanly");
      break;
    }
    // The async error's message names the dead rank (each survivor finds it on its own).
    std::string want = " " + std::to_string(victims[0]);
    for (int i = 0; i < 200; ++i) {
      loomResult_t async = loomSuccess;
      CHECK_LOOM(loomCommGetAsyncError(comm, &async));
      expect(async != loomSuccess, "the async error is set");
      message = loomGetLastError(nullptr);
      size_t at = message.find("dead ranks:");
      if (at != std::string::npos && (message.substr(at, message.find(';', at) - at) + " ").find(want + " ") != std::string::npos) break;
      if (i == 199) expect(false, "loomCommGetAsyncError's message names dead rank" + want + ": " + message);
      usleep(10000);
    }
    char dump[4096];
    CHECK_LOOM(loomCommDump(comm, dump, sizeof dump));
    expect(strstr(dump, "dead ranks") != nullptr, std::string("loomCommDump names the dead: ") + dump);
  }
  CHECK_LOOM(loomCommRevoke(comm));
  // Shrink, check, and shrink again if a rank died meanwhile.
  auto ts = std::chrono::steady_clock::now();
  double shrinkMs = 0, doneAt = 0;
  std::vector<int> members;
  loomComm_t cur = comm;
  std::vector<int> exclude;
  if (mode == "revoke") exclude.push_back(n0 - 1);
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (mode == "during" && isVictim(rank, 1) && attempt == 0) die(1000 + 1000 * int(getpid() % 20));
    loomComm_t next = nullptr;
    ts = std::chrono::steady_clock::now();
    loomResult_t r = loomCommShrink(cur, exclude.data(), int(exclude.size()), &next);
    shrinkMs += msSince(ts);
    if (r != loomSuccess) {
      fprintf(stderr, "rank %d: loomCommShrink: %s: %s\n", rank, loomGetErrorString(r), loomGetLastError(nullptr));
      expect(false, "loomCommShrink succeeds");
      return 1;
    }
    exclude.clear();
    if (cur != comm) loomCommAbort(cur);
    cur = next;
    if (!next) {
      expect(mode == "revoke" && rank == n0 - 1, "only an excluded rank gets NULL");
      CHECK_LOOM(loomCommAbort(comm));
      return gFailures ? 1 : 0;
    }
    if (mode == "during" && isVictim(rank, 1)) pause();  // dies in a moment
    int nn, nr;
    CHECK_LOOM(loomCommCount(next, &nn));
    CHECK_LOOM(loomCommUserRank(next, &nr));
    int32_t mine = rank;
    std::vector<int32_t> all(size_t(nn), -1);
    loomResult_t g = loomAllGather(&mine, all.data(), 1, loomInt32, next, nullptr);
    // Exactness is the point here, not size (a 64 MiB case already ran).
    std::vector<double> v(std::min<size_t>(bytes / 8, 1 << 17) + 1000, double(rank + 1));
    loomResult_t a = g == loomSuccess
                         ? loomAllReduce(v.data(), v.data(), v.size(), loomFloat64, loomSum, next, nullptr)
                         : g;
    if (a != loomSuccess) {
      // A rank of the new communicator died too: revoke it and shrink again.
      CHECK_LOOM(loomCommRevoke(next));
      continue;
    }
    doneAt = realMs();
    members.assign(all.begin(), all.end());
    double want = 0;
    for (int m : members) want += m + 1;
    bool exact = true;
    for (double x : v) exact &= x == want;
    expect(exact, "the shrunken communicator's all-reduce is exact");
    expect(all[size_t(nr)] == rank, "the new ranks are the old ones in order");
    for (size_t i = 1; i < members.size(); ++i) expect(members[i - 1] < members[i], "new ranks keep the old order");
    break;
  }
  std::string list;
  for (int m : members) list += (list.empty() ? "" : ",") + std::to_string(m);
  for (char& c : message)
    if (c == '\n' || c == '|') c = ' ';
  if (FILE* f = fopen((dir + "/rank" + std::to_string(rank)).c_str(), "w")) {
    fprintf(f, "%s|%.1f|%.1f|%.3f|%s\n", list.c_str(), detectMs, shrinkMs, doneAt, message.c_str());
    fclose(f);
  }
  printf("rank %d: members %s, error after %.0f ms, shrink %.0f ms: %s\n", rank, list.c_str(), detectMs, shrinkMs,
         message.c_str());
  if (cur) CHECK_LOOM(loomCommDestroy(cur));
  CHECK_LOOM(loomCommAbort(comm));
  if (countFds) {
    std::map<int, std::string> after = openFds();
    std::string diff;
    for (const auto& [fd, what] : fdsBefore)
      if (!after.count(fd) || after[fd] != what) diff += " gone: " + std::to_string(fd) + " " + what + ";";
    for (const auto& [fd, what] : after)
      if (!fdsBefore.count(fd) || fdsBefore.at(fd) != what) diff += " new: " + std::to_string(fd) + " " + what + ";";
    expect(diff.empty(), "no descriptor left open after both communicators are freed (" +
                             std::to_string(fdsBefore.size()) + " before init, " + std::to_string(after.size()) +
                             " after;" + diff + ")");
  }
  return gFailures ? 1 : 0;
}

// The ranks after "unreachable ranks:" in a message, up to the next ';'.
static std::set<int> unreachableIn(const std::string& message) {
  std::set<int> ranks;
  size_t at = message.find("unreachable ranks:");
  if (at == std::string::npos) return ranks;
  std::string list = message.substr(at + strlen("unreachable ranks:"));
  list = list.substr(0, list.find(';'));
  const char* p = list.c_str();
  for (;;) {
    char* end;
    long r = strtol(p, &end, 10);
    if (end == p) break;
    ranks.insert(int(r));
    p = end;
  }
  return ranks;
}

// See the usage above.  A rank's line: wall-clock ms of its error | result
// code | ms in loomCommShrink | members of the shrunken communicator (old
// ranks) or "refused" | the error message | loomCommShrink's message.
static int scenarioCut(const std::vector<size_t>& cutList, size_t bytes, const std::string& dir, bool implicit) {
  loomComm_t comm = nullptr;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  CHECK_LOOM(loomCommCount(comm, &gSize));
  const int rank = gRank;
  std::set<int> cut(cutList.begin(), cutList.end());
  const bool cutSide = cut.count(rank) != 0;
  // Across the cut: what this rank must call unreachable.
  std::set<int> across;
  for (int r = 0; r < gSize; ++r)
    if (cut.count(r) != cutSide) across.insert(r);
  std::vector<float> buf(bytes / 4);
  auto start = std::chrono::steady_clock::now();
  loomResult_t r = loomSuccess;
  for (int it = 0;; ++it) {
    std::fill(buf.begin(), buf.end(), 1.0f);
    r = loomAllReduce(buf.data(), buf.data(), buf.size(), loomFloat32, loomSum, comm, nullptr);
    if (r != loomSuccess) break;
    bool exact = std::all_of(buf.begin(), buf.end(), [](float x) { return x == float(gSize); });
    expect(exact, "all-reduce " + std::to_string(it) + " before the cut is exact");
    if (it == 0)
      if (FILE* f = fopen((dir + "/running" + std::to_string(rank)).c_str(), "w")) fclose(f);
    if (msSince(start) > 90000) {
      expect(false, "all-reduces still succeed 90 s on: was the link not cut?");
      return 1;
    }
  }
  const double errorAt = realMs();
  std::string message = loomGetLastError(comm);
  expect(r == loomTimeout || r == loomRemoteError,
         std::string("the cut fails the all-reduce with a timeout or a remote error, not ") + loomGetErrorString(r));
  // The async error names the ranks across the cut unreachable (the failure
  // notices to them go unanswered for 1 s: poll a little longer than that).
  std::string async;
  for (int i = 0; i < 300; ++i) {
    loomResult_t a = loomSuccess;
    CHECK_LOOM(loomCommGetAsyncError(comm, &a));
    expect(a != loomSuccess, "the async error is set");
    async = loomGetLastError(nullptr);
    if (unreachableIn(async) == across) break;
    usleep(10000);
  }
  std::string want;
  for (int x : across) want += " " + std::to_string(x);
  expect(unreachableIn(async) == across, "loomCommGetAsyncError names exactly the ranks across the cut (" + want +
                                             ") unreachable: " + async);
  expect(async.find("dead ranks:") == std::string::npos, "nobody is called dead across a cut: " + async);
  char dump[4096];
  CHECK_LOOM(loomCommDump(comm, dump, sizeof dump));
  expect(strstr(dump, "unreachable ranks") != nullptr, std::string("loomCommDump names the unreachable: ") + dump);
  // Shrink without the ranks found unreachable (implicit: NULL, 0, and the
  // coordinator leaves out whoever has not joined by the timeout).
  std::set<int> found = unreachableIn(async);
  std::vector<int> exclude;
  if (!implicit) exclude.assign(found.begin(), found.end());
  CHECK_LOOM(loomCommRevoke(comm));
  auto ts = std::chrono::steady_clock::now();
  loomComm_t next = nullptr;
  loomResult_t sr = loomCommShrink(comm, exclude.data(), int(exclude.size()), &next);
  const double shrinkMs = msSince(ts);
  std::string shrinkMsg = sr == loomSuccess ? "" : loomGetLastError(nullptr);
  std::string members;
  if (cutSide) {
    // The smaller side of the cut: no communicator (it could not tell itself from a partition).
    expect(sr == loomRemoteError, std::string("the cut side's loomCommShrink fails with loomRemoteError, not ") +
                                      loomGetErrorString(sr) + ": " + shrinkMsg);
    expect(next == nullptr, "a failed shrink leaves *newcomm NULL");
    expect(shrinkMsg.find("unreachable") != std::string::npos, "the refusal says unreachable: " + shrinkMsg);
    members = "refused";
  } else if (sr != loomSuccess || !next) {
    expect(false, "the connected side's loomCommShrink succeeds: " + shrinkMsg);
  } else {
    int nn, nr;
    CHECK_LOOM(loomCommCount(next, &nn));
    CHECK_LOOM(loomCommUserRank(next, &nr));
    int32_t mine = rank;
    std::vector<int32_t> all(size_t(nn), -1);
    CHECK_LOOM(loomAllGather(&mine, all.data(), 1, loomInt32, next, nullptr));
    std::vector<double> v((1 << 20) + 7, double(rank + 1));
    CHECK_LOOM(loomAllReduce(v.data(), v.data(), v.size(), loomFloat64, loomSum, next, nullptr));
    double sum = 0;
    for (int32_t m : all) sum += m + 1;
    expect(std::all_of(v.begin(), v.end(), [&](double x) { return x == sum; }),
           "the shrunken communicator's all-reduce is exact");
    expect(all[size_t(nr)] == rank, "the new ranks are the old ones in order");
    for (int32_t m : all) members += (members.empty() ? "" : ",") + std::to_string(m);
    CHECK_LOOM(loomCommDestroy(next));
  }
  for (std::string* t : {&message, &shrinkMsg})
    for (char& c : *t)
      if (c == '\n' || c == '|') c = ' ';
  if (FILE* f = fopen((dir + "/rank" + std::to_string(rank)).c_str(), "w")) {
    fprintf(f, "%.3f|%d|%.1f|%s|%s|%s\n", errorAt, int(r), shrinkMs, members.c_str(), message.c_str(),
            shrinkMsg.c_str());
    fclose(f);
  }
  printf("rank %d (%s): %s after the cut; shrink %.0f ms: %s; %s\n", rank, cutSide ? "cut off" : "connected",
         loomGetErrorString(r), shrinkMs, members.c_str(), (message + " / " + shrinkMsg).c_str());
  CHECK_LOOM(loomCommAbort(comm));
  return gFailures ? 1 : 0;
}

// The rendezvous scenarios (ibverbs: transports/ibverbs/ib_connection.cc).
static uint8_t rndvByte(size_t i, size_t size, int it, int from) {
  return uint8_t((i % 251) ^ (size % 7) ^ unsigned(it * 17 + from * 5));
}

static void scenarioRendezvous(loomComm_t comm, const std::vector<size_t>& sizes) {
  expect(gSize == 2, "the rendezvous scenario runs with 2 ranks");
  const int peer = 1 - gRank;
  constexpr size_t kGuard = 64;
  auto fill = [](uint8_t* p, size_t n, int it, int from) {
    for (size_t i = 0; i < n; ++i) p[i] = rndvByte(i, n, it, from);
  };
  auto check = [&](const uint8_t* p, size_t n, int it, int from, const std::string& what) {
    size_t bad = n;
    for (size_t i = 0; i < n && bad == n; ++i)
      if (p[i] != rndvByte(i, n, it, from)) bad = i;
    expect(bad == n, what + ": byte " + std::to_string(bad) + " of " + std::to_string(n) + " differs");
    bool guard = true;
    for (size_t i = 0; i < kGuard; ++i) guard &= p[n + i] == 0x5a;
    expect(guard, what + ": bytes written past the end");
  };
  // One message each way; `from` sends first.
  auto exchange = [&](uint8_t* sbuf, uint8_t* rbuf, size_t n, int it, const std::string& what) {
    for (int from = 0; from < 2; ++from) {
      if (gRank == from) {
        fill(sbuf, n, it, from);
        CHECK_LOOM(loomSend(sbuf, n, loomUint8, peer, comm, nullptr));
      } else {
        memset(rbuf, 0x5a, n + kGuard);
        CHECK_LOOM(loomRecv(rbuf, n, loomUint8, peer, comm, nullptr));
        check(rbuf, n, it, from, what + " from rank " + std::to_string(from));
      }
    }
  };
  for (size_t n : sizes) {
    std::string sz = std::to_string(n) + " bytes";
    // Fresh memory around every transfer: freed buffers' addresses come back
    // (malloc reuses them), with other pages behind them.
    for (int it = 0; it < 3; ++it) {
      auto* sbuf = static_cast<uint8_t*>(malloc(n + kGuard));
      auto* rbuf = static_cast<uint8_t*>(malloc(n + kGuard));
      exchange(sbuf, rbuf, n, it, "plain " + sz + " #" + std::to_string(it));
      free(sbuf);
      free(rbuf);
    }
    std::vector<uint8_t> sreg(n + kGuard), rreg(n + kGuard);
    void *hs = nullptr, *hr = nullptr;
    CHECK_LOOM(loomCommRegister(comm, sreg.data(), n, &hs));
    CHECK_LOOM(loomCommRegister(comm, rreg.data(), n + kGuard, &hr));
    for (int it = 0; it < 2; ++it) exchange(sreg.data(), rreg.data(), n, 10 + it, "registered " + sz);
    // Both directions at once.
    fill(sreg.data(), n, 20, gRank);
    memset(rreg.data(), 0x5a, n + kGuard);
    CHECK_LOOM(loomGroupStart());
    CHECK_LOOM(loomSend(sreg.data(), n, loomUint8, peer, comm, nullptr));
    CHECK_LOOM(loomRecv(rreg.data(), n, loomUint8, peer, comm, nullptr));
    CHECK_LOOM(loomGroupEnd());
    check(rreg.data(), n, 20, peer, "grouped " + sz);
    CHECK_LOOM(loomCommDeregister(comm, hs));
    CHECK_LOOM(loomCommDeregister(comm, hr));
    printf("rank %d: rendezvous %s exact (plain, registered, grouped)\n", gRank, sz.c_str());
  }
  // A receive larger than the send: loomInvalidUsage for the receiver, an
  // error for the sender, nothing written.
  size_t n = sizes.back();
  std::vector<uint8_t> buf(n + 8192 + kGuard, 0x5a);
  loomResult_t r = gRank == 0 ? loomSend(buf.data(), n, loomUint8, 1, comm, nullptr)
                              : loomRecv(buf.data(), n + 8192, loomUint8, 0, comm, nullptr);
  std::string msg = loomGetLastError(comm);
  printf("rank %d: mismatched sizes: %s: %s\n", gRank, loomGetErrorString(r), msg.c_str());
  expect(r == loomInvalidUsage || (gRank == 0 && r == loomRemoteError),
         "a send and a receive of different sizes fail with loomInvalidUsage: " + msg);
  if (gRank == 1) {
    expect(msg.find("mismatched") != std::string::npos, "the receiver's error names the mismatch: " + msg);
    expect(std::all_of(buf.begin(), buf.end(), [](uint8_t b) { return b == 0x5a; }), "nothing was written");
  }
}

static int scenarioRendezvousKill(int victim, size_t bytes, const std::string& dir) {
  loomComm_t comm;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  std::vector<uint8_t> buf(bytes, uint8_t(gRank + 1));
  for (int it = 0; it < 100; ++it) {
    if (gRank == victim && it == 2)
      std::thread([] {
        usleep(300000);
        raise(SIGKILL);
      }).detach();
    auto t0 = std::chrono::steady_clock::now();
    loomResult_t r = gRank == 0 ? loomSend(buf.data(), bytes, loomUint8, 1, comm, nullptr)
                                : loomRecv(buf.data(), bytes, loomUint8, 0, comm, nullptr);
    if (r != loomSuccess) {
      std::string msg = loomGetLastError(comm);
      for (char& c : msg)
        if (c == '\n' || c == '|') c = ' ';
      if (FILE* f = fopen((dir + "/rank" + std::to_string(gRank)).c_str(), "w")) {
        fprintf(f, "%d|%.0f|%s\n", int(r), msSince(t0), msg.c_str());
        fclose(f);
      }
      printf("rank %d: transfer %d returned %s after %.0f ms: %s\n", gRank, it, loomGetErrorString(r), msSince(t0),
             msg.c_str());
      loomCommAbort(comm);
      return 0;
    }
    printf("rank %d: transfer %d of %zu bytes took %.0f ms\n", gRank, it, bytes, msSince(t0));
  }
  printf("rank %d: 100 transfers succeeded although rank %d died\n", gRank, victim);
  return 1;
}

// LOOM_CPU_BIND (src/topology/cpu_bind.h), seen from the ranks.
static std::vector<int> cpusOf(pid_t tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> v;
  if (sched_getaffinity(tid, sizeof set, &set) != 0) return v;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) v.push_back(c);
  return v;
}

static std::string cpuText(const std::vector<int>& v) {
  std::string s;
  for (int c : v) s += (s.empty() ? "" : ",") + std::to_string(c);
  return "{" + s + "}";
}

static int scenarioCpuBind(bool expectBound, bool launcher) {
  const char* rankEnv = getenv("LOOM_RANK");
  gRank = rankEnv ? atoi(rankEnv) : 0;
  std::vector<int> start = cpusOf(0);
  if (start.empty()) {
    fprintf(stderr, "rank %d: sched_getaffinity failed\n", gRank);
    return 1;
  }
  if (launcher) {  // a launcher's binding: CPU rank % ncpu
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(start[size_t(gRank) % start.size()], &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
      fprintf(stderr, "rank %d: sched_setaffinity failed\n", gRank);
      return 1;
    }
  }
  const std::vector<int> before = cpusOf(0);
  // A thread that exists before init, as an application's would.
  std::atomic<pid_t> tid{0};
  std::atomic<bool> stop{false};
  std::thread t([&] {
    tid.store(pid_t(syscall(SYS_gettid)));
    while (!stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (!tid.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Both of the thread's sets are read before and after init: a thread
  // created before init started with the process's set.
  const std::vector<int> threadBefore = cpusOf(tid.load());
  loomComm_t comm;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  CHECK_LOOM(loomCommCount(comm, &gSize));
  const std::vector<int> after = cpusOf(0), threadAfter = cpusOf(tid.load());
  stop.store(true);
  t.join();
  expect(threadBefore == before, "the thread started on the process's CPUs");
  // Everyone's sets, as 1024-bit masks.
  constexpr int kWords = 16;
  std::vector<uint64_t> mine(size_t(kWords), 0), all(size_t(kWords) * size_t(gSize), 0);
  for (int c : after)
    if (c < 64 * kWords) mine[size_t(c / 64)] |= uint64_t(1) << (c % 64);
  CHECK_LOOM(loomAllGather(mine.data(), all.data(), kWords, loomUint64, comm, nullptr));
  CHECK_LOOM(loomStreamSynchronize(nullptr));
  std::vector<std::vector<int>> sets(static_cast<size_t>(gSize));
  for (int r = 0; r < gSize; ++r)
    for (int c = 0; c < 64 * kWords; ++c)
      if (all[size_t(r) * kWords + size_t(c / 64)] >> (c % 64) & 1) sets[size_t(r)].push_back(c);
  if (!expectBound) {
    expect(after == before, "unbound: CPUs " + cpuText(after) + " after init, " + cpuText(before) + " before");
    expect(threadAfter == threadBefore, "unbound: the other thread's CPUs are unchanged");
  } else {
    expect(threadAfter == after, "the thread started before init runs on " + cpuText(threadAfter) +
                                     ", the rank on " + cpuText(after));
    const int ncpu = int(start.size());
    for (int r = 0; r < gSize; ++r) {
      const std::vector<int>& v = sets[size_t(r)];
      expect(!v.empty(), "rank " + std::to_string(r) + " has CPUs");
      for (int c : v)
        expect(std::find(start.begin(), start.end(), c) != start.end(),
               "rank " + std::to_string(r) + "'s CPU " + std::to_string(c) + " is one the job may use");
      if (gSize >= ncpu) expect(v.size() == 1, "oversubscribed: rank " + std::to_string(r) + " on one CPU, " +
                                                   cpuText(v));
      // Contiguous blocks in rank order: a later rank never sits below an
      // earlier one, and ranks on one CPU differ by at most one in count.
      if (r > 0 && !v.empty() && !sets[size_t(r - 1)].empty())
        expect(v.front() >= sets[size_t(r - 1)].back() || (gSize > ncpu && v == sets[size_t(r - 1)]),
               "rank " + std::to_string(r) + "'s CPUs " + cpuText(v) + " follow rank " + std::to_string(r - 1) +
                   "'s " + cpuText(sets[size_t(r - 1)]));
    }
    std::vector<int> perCpu(size_t(start.back()) + 1, 0);
    for (const auto& v : sets)
      for (int c : v) ++perCpu[size_t(c)];
    int lo = 1 << 30, hi = 0;
    for (int c : start) lo = std::min(lo, perCpu[size_t(c)]), hi = std::max(hi, perCpu[size_t(c)]);
    expect(hi - lo <= 1, "every CPU has an even share of the ranks (" + std::to_string(lo) + ".." +
                             std::to_string(hi) + " per CPU)");
  }
  // And collectives still work on the new placement.
  std::vector<int32_t> x(1027, gRank + 1);
  CHECK_LOOM(loomAllReduce(x.data(), x.data(), x.size(), loomInt32, loomSum, comm, nullptr));
  CHECK_LOOM(loomStreamSynchronize(nullptr));
  expect(x[0] == gSize * (gSize + 1) / 2 && x[1026] == x[0], "all-reduce after binding is exact");
  CHECK_LOOM(loomCommDestroy(comm));
  if (gFailures) fprintf(stderr, "rank %d: %d checks failed\n", gRank, gFailures);
  return gFailures ? 1 : 0;
}

// Two communicators from the environment one after the other (loom-run's
// listener serves both; see bootstrap.cc); "child": first start a child
// that outlives init, as a data loader's worker would (it must not keep the
// port).  Each gives an exact all-reduce.
static int scenarioUnreceived(bool matched) {
  loomComm_t comm;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  // A second communicator (its own connections) orders rank 0's send before
  // rank 1's destroy: the send has left once rank 0's all-reduce on it
  // starts, which is before rank 1's ends.
  loomComm_t sync;
  CHECK_LOOM(loomCommSplit(comm, 0, gRank, &sync));
  float v[16] = {1.0f};
  if (gRank == 0) CHECK_LOOM(loomSend(v, 16, loomFloat32, 1, comm, nullptr));
  if (gRank == 1 && matched) CHECK_LOOM(loomRecv(v, 16, loomFloat32, 0, comm, nullptr));
  CHECK_LOOM(loomAllReduce(v, v, 1, loomFloat32, loomSum, sync, nullptr));
  CHECK_LOOM(loomCommDestroy(sync));
  // loomCommDestroy's warning, from this process's stderr.
  fflush(stderr);
  FILE* log = tmpfile();
  const int saved = dup(2);
  dup2(fileno(log), 2);
  CHECK_LOOM(loomCommDestroy(comm));
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::string text;
  rewind(log);
  for (int ch; (ch = fgetc(log)) != EOF;) text += char(ch);
  fclose(log);
  fputs(text.c_str(), stderr);
  const bool warned = text.find("no call of this rank received") != std::string::npos;
  const bool wantWarning = gRank == 1 && !matched;
  expect(warned == wantWarning, std::string("destroy ") + (wantWarning ? "warns" : "does not warn") + " about unreceived data");
  if (wantWarning) expect(text.find("from rank 0") != std::string::npos, "the warning names the sender: " + text);
  return gFailures ? 1 : 0;
}

static int scenarioInitAgain(bool child) {
  if (child && system("sleep 2 &") != 0) return 3;
  for (int round = 0; round < 2; ++round) {
    loomComm_t comm;
    CHECK_LOOM(loomCommInitFromEnv(&comm));
    CHECK_LOOM(loomCommUserRank(comm, &gRank));
    CHECK_LOOM(loomCommCount(comm, &gSize));
    int64_t v = gRank + 1;
    CHECK_LOOM(loomAllReduce(&v, &v, 1, loomInt64, loomSum, comm, nullptr));
    expect(v == int64_t(gSize) * (gSize + 1) / 2, "init " + std::to_string(round) + ": all-reduce");
    CHECK_LOOM(loomCommDestroy(comm));
  }
  if (gRank == 0) printf("two inits from the environment: ok\n");
  return gFailures ? 1 : 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) {
    fprintf(stderr, "usage: mp-worker SCENARIO [args]\n");
    return 2;
  }
  std::string sc = argv[1];
  if (sc == "fault") {
    if (argc < 6) {
      fprintf(stderr, "usage: mp-worker fault init|allreduce|between VICTIM BYTES DIR\n");
      return 2;
    }
    return scenarioFault(argv[2], atoi(argv[3]), strtoull(argv[4], nullptr, 10), argv[5]);
  }
  if (sc == "cut") {
    if (argc < 5) {
      fprintf(stderr, "usage: mp-worker cut CUTRANKS BYTES DIR [implicit]\n");
      return 2;
    }
    return scenarioCut(parseList(argv[2]), strtoull(argv[3], nullptr, 10), argv[4],
                       argc > 5 && strcmp(argv[5], "implicit") == 0);
  }
  if (sc == "shrink") {
    if (argc < 6) {
      fprintf(stderr, "usage: mp-worker shrink between|allreduce|during|revoke|init|connect|connect0 VICTIMS BYTES DIR\n");
      return 2;
    }
    return scenarioShrink(argv[2], parseList(argv[3]), strtoull(argv[4], nullptr, 10), argv[5]);
  }
  if (sc == "cpubind")
    return scenarioCpuBind(argc > 2 && strcmp(argv[2], "bound") == 0, argc > 3 && strcmp(argv[3], "launcher") == 0);
  if (sc == "unreceived") return scenarioUnreceived(argc > 2 && strcmp(argv[2], "matched") == 0);
  if (sc == "initagain") return scenarioInitAgain(argc > 2 && strcmp(argv[2], "child") == 0);
  if (sc == "taggedfault") return scenarioTaggedFault(argc > 2 ? argv[2] : "one");
  if (sc == "rendezvouskill") {
    if (argc < 5) {
      fprintf(stderr, "usage: mp-worker rendezvouskill VICTIM BYTES DIR\n");
      return 2;
    }
    return scenarioRendezvousKill(atoi(argv[2]), strtoull(argv[3], nullptr, 10), argv[4]);
  }
  loomComm_t comm;
  CHECK_LOOM(loomCommInitFromEnv(&comm));
  CHECK_LOOM(loomCommUserRank(comm, &gRank));
  CHECK_LOOM(loomCommCount(comm, &gSize));
  if (sc == "matrix") scenarioMatrix(comm, argc - 2, argv + 2);
  else if (sc == "sequence") scenarioSequence(comm);
  else if (sc == "group") scenarioGroup(comm);
  else if (sc == "streams") scenarioStreams(comm);
  else if (sc == "badargs") scenarioBadArgs(comm);
  else if (sc == "mismatch") scenarioMismatch(comm);
  else if (sc == "a2amismatch") scenarioExchangeMismatch(comm);
  else if (sc == "a2ainplace") scenarioA2AInPlace(comm);
  else if (sc == "smallmismatch") scenarioSmallMismatch(comm, argc > 2 ? argv[2] : "count");
  else if (sc == "pullmix") scenarioPullMix(comm);
  else if (sc == "split") scenarioSplit(comm);
  else if (sc == "shrinklists") scenarioShrinkLists(comm, argc > 2 && strcmp(argv[2], "late") == 0);
  else if (sc == "shrinksatout") scenarioShrinkSatOut(comm);
  else if (sc == "manybuffers") scenarioManyBuffers(comm);
  else if (sc == "fork") scenarioFork(comm);
  else if (sc == "p2pgroups") scenarioP2PGroups(comm);
  else if (sc == "rootmismatch") scenarioRootMismatch(comm, argc > 2 ? argv[2] : "bcast", argc > 3 ? strtoull(argv[3], nullptr, 10) : 8,
                                                   std::vector<std::string>(argv + std::min(argc, 4), argv + argc));
  else if (sc == "descriptors") scenarioDescriptors(comm, argc > 2 ? atoi(argv[2]) : 5);
  else if (sc == "tagged") scenarioTagged(comm);
  else if (sc == "taggedtimeout") scenarioTaggedTimeout(comm);
  else if (sc == "taggednostash") scenarioTaggedNoStash(comm);
  else if (sc == "dump") scenarioDump(comm);
  else if (sc == "registered") scenarioRegistered(comm, argc > 2 ? argv[2] : "all", argc > 3 && strcmp(argv[3], "mapped") == 0);
  else if (sc == "rendezvous") scenarioRendezvous(comm, parseList(argc > 2 ? argv[2] : "1048576"));
  else if (sc == "soak")
    scenarioSoak(comm, argc > 2 ? strtoull(argv[2], nullptr, 10) : 1, argc > 3 ? atoi(argv[3]) : 1000,
                 argc > 4 ? atof(argv[4]) : 60);
  else {
    fprintf(stderr, "unknown scenario %s\n", sc.c_str());
    return 2;
  }
  if (sc == "mismatch" || sc == "a2amismatch" || sc == "smallmismatch" || sc == "rootmismatch" || sc == "shrinklists" || sc == "dump" || sc == "taggedtimeout" || sc == "rendezvous")
    loomCommAbort(comm);
  else CHECK_LOOM(loomCommDestroy(comm));
  if (gFailures) fprintf(stderr, "rank %d: %d checks failed\n", gRank, gFailures);
  return gFailures ? 1 : 0;
}
