// The host side of the CUDA device path, on machines with or without a GPU:
// how CudaStreamBackend maps stream-program ops onto CUDA calls (through a
// recording CudaApi table: this checks loom's mapping, not CUDA, which only
// tests/gpu/run.sh exercises), the CUDA plug-in loading and counting zero
// devices where there is no GPU, LOOM_DEVICE at init, device pointers
// given to a host communicator, and the CUDA communicator's driver (its
// calls, again through a recording table, with host memory standing in for
// device memory).
#include "loom_catch.h"
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/stream_collectives.h"
#include "loom.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/device/cuda_device_driver.h"
#include "src/device/cuda_loader.h"
#include "src/device/device_choice.h"
#include "src/device/cuda_stream_backend.h"
#include "src/device/device_comm.h"
#include "src/device/host_reduce.h"
#include "src/device/reduce_ops.h"

namespace {

// Every call the backend makes, as text, in order.
std::vector<std::string> g_calls;
int g_failMemcpy = 0;

std::string ptr(const void* p) { return loom::strf("%p", p); }

const loom::CudaApi kRecording = {
    loom::kCudaApiVersion,
    [](void* s, const uint64_t* a, uint64_t v) {
      g_calls.push_back("wait " + ptr(s) + " " + ptr(a) + " >= " + std::to_string(v));
      return 0;
    },
    [](void* s, uint64_t* a, uint64_t v) {
      g_calls.push_back("write " + ptr(s) + " " + ptr(a) + " = " + std::to_string(v));
      return 0;
    },
    [](void* d, const void* src, size_t n, void* s) {
      g_calls.push_back("memcpy " + ptr(s) + " " + ptr(d) + " <- " + ptr(src) + " " + std::to_string(n));
      return g_failMemcpy;
    },
    [](void* d, void* d2, const void* const* srcs, int ns, size_t n, int t, int op, void* s) {
      std::string c = "reduce " + ptr(s) + " " + ptr(d) + (d2 ? " and " + ptr(d2) : std::string()) + " <-";
      for (int i = 0; i < ns; ++i) c += " " + ptr(srcs[i]);
      g_calls.push_back(c + loom::strf(" n=%zu t=%d op=%d", n, t, op));
      return 0;
    },
    [](void* d, const void* src, size_t n, int t, int div, void* s) {
      g_calls.push_back(loom::strf("divide %p %p <- %p n=%zu t=%d /%d", s, d, src, n, t, div));
      return 0;
    },
    [](void* e, void* s) {
      g_calls.push_back("record " + ptr(e) + " on " + ptr(s));
      return 0;
    },
    [](void* s, void* e) {
      g_calls.push_back("waitevent " + ptr(s) + " on " + ptr(e));
      return 0;
    },
    [](int e) { return e == 700 ? "an illegal memory access was encountered" : "?"; },
    [](int* n) {
      *n = 0;
      return 0;
    },
    [](const void*, int* d) {
      *d = -1;
      return 0;
    },
    // The communicator's resources: the backend never calls them.
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
    nullptr, nullptr, nullptr, nullptr,
    nullptr,  // loadKernels: a communicator's init calls it, never the backend
    [](void* d, void* d2, const void* const* srcs, const uint64_t* const* cells, const size_t* offs,
       const uint64_t* const* tags, const uint64_t* minTags, int ns, size_t n, int t, int op, void* s) {
      std::string c = "reduce " + ptr(s) + " " + ptr(d) + (d2 ? " and " + ptr(d2) : std::string()) + " <-";
      for (int i = 0; i < ns; ++i)
        c += " " + ptr(srcs[i]) +
             (cells[i] ? loom::strf("|cell %p+%zu tag %p>=%llu", (const void*)cells[i], offs[i], (const void*)tags[i],
                                    (unsigned long long)minTags[i])
                       : "");
      g_calls.push_back(c + loom::strf(" n=%zu t=%d op=%d", n, t, op));
      return 0;
    },
    [](void* d, const void* src, const uint64_t* cell, size_t off, const uint64_t* tag, uint64_t minTag, size_t n,
       void* s) {
      g_calls.push_back(loom::strf("copykernel %p %p <- %p|cell %p+%zu tag %p>=%llu %zu", s, d, src, (const void*)cell,
                                   off, (const void*)tag, (unsigned long long)minTag, n));
      return 0;
    },
    nullptr,  // deviceSynchronize: the driver's
    nullptr,  // contextDevice, clearContext, streamMemOps, streamQuery, streamCapturing, relaxCaptureMode,
    nullptr,  // launchScale: the driver's, init's, the API's and loom's threads'
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,  // retainOnCapture
    nullptr,  // captureId
    [](void* s, uint64_t* const* a, int n, uint64_t v) {  // writeValues64: one batch
      std::string c = "writes " + ptr(s);
      for (int i = 0; i < n; ++i) c += " " + ptr(a[i]);
      g_calls.push_back(c + loom::strf(" = %llu", (unsigned long long)v));
      return 0;
    },
};

void* handle(uintptr_t v) { return reinterpret_cast<void*>(v); }

}  // namespace

TEST_CASE("CUDA backend: a replayable program's runs of zeroings of the peers' flags become one batch each "
          "(cuStreamBatchMemOp), its own row's marks stay single writes in program order, and the busy mark goes "
          "down last",
          "[cuda][graph]") {
  const int N = 4, me = 1;
  std::vector<float> send(600), recv(600);
  std::vector<std::vector<uint8_t>> win(N, std::vector<uint8_t>(4096));
  std::vector<std::vector<uint64_t>> flags(N, std::vector<uint64_t>(loom::kFlagCount));
  std::vector<std::vector<uint64_t>> peerCopies(N, std::vector<uint64_t>(loom::kFlagCount));  // what each peer reads
  loom::OpDesc op;
  op.sendbuf = send.data();
  op.recvbuf = recv.data();
  op.count = 600;
  op.op = loomSum;
  uint64_t round = 0;
  const loom::StreamProgram p = loom::makeReplayable(
      loom::compileStreamProgram(op, me, N, loom::StreamAlgorithm::ReduceScatterAllGather, 2048, &round), 99);
  loom::ProgramBuffers b;
  b.send = send.data();
  b.sendBytes = b.recvBytes = 2400;
  b.recv = recv.data();
  b.windowBytes = 4096;
  for (int r = 0; r < N; ++r) {
    b.windows.push_back(win[size_t(r)].data());
    b.flags.push_back(flags[size_t(r)].data());
    b.peerFlags.push_back(peerCopies[size_t(r)].data());
  }
  void *s0 = handle(0x5000), *s1 = handle(0x5100), *e0 = handle(0xe000), *e1 = handle(0xe100);
  loom::CudaStreamBackend be(kRecording, {s0, s1}, {e0, e1});
  g_calls.clear();
  loom::enqueueProgram(be, p, b);
  INFO(p.describe());
  // Every zeroing of another rank's row is in exactly one batch; every
  // other SetLocal is a single write, in program order.
  std::vector<std::string> zeroed;
  size_t batches = 0;
  for (const std::string& c : g_calls) {
    if (c.rfind("writes ", 0) == 0) {
      ++batches;
      CHECK(c.substr(c.size() - 4) == " = 0");
      std::istringstream in(c.substr(7, c.size() - 11));
      std::string stream, a;
      in >> stream;
      CHECK(stream == ptr(s0));
      while (in >> a) zeroed.push_back(a);
    }
  }
  std::vector<std::string> expectZeroed, expectSingles;
  for (const loom::StreamOp& o : p.ops)
    if (o.kind == loom::StreamOpKind::SetLocal) {
      const std::string a = ptr(&flags[size_t(o.flagRank)][o.flag]);
      if (o.value == 0 && o.flagRank != me)
        expectZeroed.push_back(a);
      else
        expectSingles.push_back("write " + ptr(s0) + " " + a + " = " + std::to_string(o.value));
    }
  CHECK(zeroed == expectZeroed);
  CHECK(expectZeroed.size() == size_t(5 * (N - 1) + (N - 1)));  // round flags, end and sig; then resets
  CHECK(batches == 2);  // the peers' rows after `end` (the own row after them), and their resets after `reset`
  size_t next = 0;  // expectSingles, in order, among the calls
  for (const std::string& c : g_calls)
    if (next < expectSingles.size() && c == expectSingles[next]) ++next;
  CHECK(next == expectSingles.size());
  REQUIRE_FALSE(g_calls.empty());
  CHECK(g_calls.back() == "write " + ptr(s0) + " " + ptr(&flags[me][loom::kFlagGraphBusy]) + " = 0");
  CHECK(g_calls.size() == p.ops.size() - expectZeroed.size() + batches);
}

TEST_CASE("CUDA backend: only runs of zeroings of the peers' flags on one stream are batched: a run that changes "
          "stream, a nonzero write and an own-row zeroing stay single writes, and a captured send/recv group's gate "
          "and ack zeroings batch",
          "[cuda][graph]") {
  const int N = 3, me = 0;
  std::vector<std::vector<uint64_t>> flags(N, std::vector<uint64_t>(loom::kFlagCount));
  std::vector<std::vector<uint64_t>> peerCopies(N, std::vector<uint64_t>(loom::kFlagCount));
  std::vector<std::vector<uint8_t>> win(N, std::vector<uint8_t>(4096));
  std::vector<uint8_t> in(2000), out(2000);
  loom::ProgramBuffers b;
  b.windowBytes = 4096;
  for (int r = 0; r < N; ++r) {
    b.windows.push_back(win[size_t(r)].data());
    b.flags.push_back(flags[size_t(r)].data());
    b.peerFlags.push_back(peerCopies[size_t(r)].data());
  }
  void *s0 = handle(0x5000), *s1 = handle(0x5100), *s2 = handle(0x5200), *e0 = handle(0xe000), *e1 = handle(0xe100);
  auto local = [](int stream, int r, uint8_t f, uint64_t v) {
    loom::StreamOp o;
    o.kind = loom::StreamOpKind::SetLocal;
    o.stream = uint8_t(stream);
    o.flagRank = r;
    o.flag = f;
    o.value = v;
    return o;
  };
  auto at = [&](int r, int f) { return ptr(&flags[size_t(r)][size_t(f)]); };
  {
    loom::StreamProgram p;
    p.nranks = N;
    p.rank = me;
    p.streams = 2;
    p.events = 2;
    loom::StreamOp fork, wait, rec, join;
    fork.kind = rec.kind = loom::StreamOpKind::RecordEvent;
    wait.kind = join.kind = loom::StreamOpKind::WaitEvent;
    wait.stream = rec.stream = 1;
    rec.event = join.event = 1;
    p.ops = {fork, wait,
             local(0, 1, 0, 0), local(0, 2, 0, 0),  // a run of two: one batch
             local(1, 1, 1, 0),                     // another stream: ends the run
             local(0, 2, 1, 0), local(0, 2, 2, 5),  // a nonzero write: single
             local(0, 1, 2, 0), local(0, 0, 2, 0), local(0, 2, 3, 0),  // an own-row zeroing splits it
             rec, join};
    loom::CudaStreamBackend be(kRecording, {s0, s1}, {e0, e1});
    g_calls.clear();
    loom::enqueueProgram(be, p, b);
    const std::vector<std::string> expect = {
        "record " + ptr(e0) + " on " + ptr(s0),
        "waitevent " + ptr(s1) + " on " + ptr(e0),
        "writes " + ptr(s0) + " " + at(1, 0) + " " + at(2, 0) + " = 0",
        "write " + ptr(s1) + " " + at(1, 1) + " = 0",
        "write " + ptr(s0) + " " + at(2, 1) + " = 0",
        "write " + ptr(s0) + " " + at(2, 2) + " = 5",
        "write " + ptr(s0) + " " + at(1, 2) + " = 0",
        "write " + ptr(s0) + " " + at(0, 2) + " = 0",
        "write " + ptr(s0) + " " + at(2, 3) + " = 0",
        "record " + ptr(e1) + " on " + ptr(s1),
        "waitevent " + ptr(s0) + " on " + ptr(e1),
    };
    CHECK(g_calls == expect);
  }
  {
    // Rank 0 sends to 1 and 2 and receives from both in one captured group.
    std::vector<loom::OpDesc> ops(4);
    for (int i = 0; i < 4; ++i) {
      ops[size_t(i)].coll = loom::Collective::P2P;
      ops[size_t(i)].isSend = i < 2;
      ops[size_t(i)].peer = 1 + i % 2;
      ops[size_t(i)].count = 300;
      ops[size_t(i)].dtype = loomUint8;
      if (i < 2)
        ops[size_t(i)].sendbuf = in.data();
      else
        ops[size_t(i)].recvbuf = out.data();
    }
    const loom::StreamProgram p = loom::compileGraphP2PProgram(ops, me, N, 1024, loom::kGraphP2PBusy + 1);
    loom::ProgramBuffers pb = b;
    pb.send = in.data();
    pb.sendBytes = 300;
    pb.moreSends.push_back({in.data(), 300});
    pb.recv = out.data();
    pb.recvBytes = 300;
    pb.moreRecvs.push_back({out.data() + 300, 300});
    pb.p2pBytes = 1024;
    for (int r = 0; r < N; ++r) {
      pb.p2pOut.push_back(win[size_t(me)].data() + size_t(r) * 1024);
      pb.p2pIn.push_back(win[size_t(r)].data());
    }
    loom::CudaStreamBackend be(kRecording, {s0, s1, s2}, {e0, e1});
    g_calls.clear();
    loom::enqueueProgram(be, p, pb);
    INFO(p.describe());
    auto has = [&](const std::string& c) { return std::find(g_calls.begin(), g_calls.end(), c) != g_calls.end(); };
    for (int q : {1, 2})  // each sender's gate values, zeroed as one batch on the receives' stream
      CHECK(has("writes " + ptr(s2) + " " + at(q, loom::kFlagGraphMessages) + " " +
                at(q, loom::kFlagGraphMessagesNot) + " = 0"));
    CHECK(has("writes " + ptr(s0) + " " + at(1, loom::kFlagGraphAcked) + " " + at(2, loom::kFlagGraphAcked) +
              " = 0"));  // the acks after every last-ack wait
    CHECK(g_calls.back() == "write " + ptr(s0) + " " + at(me, loom::kFlagGraphBusy) + " = 0");
  }
}

TEST_CASE(
    "CUDA backend: every stream-program op becomes its one CUDA call, on the right stream and addresses",
    "[cuda]") {
  // Rank 1 of 3, reduce-scatter + all-gather all-reduce: two streams, both
  // events, waits, writes, copies, reductions and the avg divide.
  const int N = 3, me = 1;
  std::vector<float> send(600), recv(600);
  std::vector<std::vector<uint8_t>> win(N, std::vector<uint8_t>(4096));
  std::vector<std::vector<uint64_t>> flags(N, std::vector<uint64_t>(loom::kFlagCount));
  loom::OpDesc op;
  op.sendbuf = send.data();
  op.recvbuf = recv.data();
  op.count = 600;
  op.op = loomAvg;
  uint64_t round = 0;
  loom::StreamProgram p =
      loom::compileStreamProgram(op, me, N, loom::StreamAlgorithm::ReduceScatterAllGather, 2048, &round);
  loom::ProgramBuffers b;
  b.send = send.data();
  b.sendBytes = b.recvBytes = 2400;
  b.recv = recv.data();
  b.windowBytes = 4096;
  for (int r = 0; r < N; ++r) {
    b.windows.push_back(win[size_t(r)].data());
    b.flags.push_back(flags[size_t(r)].data());
  }
  void *s0 = handle(0x5000), *s1 = handle(0x5100), *e0 = handle(0xe000), *e1 = handle(0xe100);
  loom::CudaStreamBackend be(kRecording, {s0, s1}, {e0, e1});
  g_calls.clear();
  loom::enqueueProgram(be, p, b);
  INFO(p.describe());
  REQUIRE(g_calls.size() == p.ops.size());  // one call per op (no reduce has more than 8 sources)
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const loom::StreamOp& o = p.ops[i];
    const std::string& c = g_calls[i];
    void* s = o.stream ? s1 : s0;
    INFO("op " << i << ": " << c);
    switch (o.kind) {
      case loom::StreamOpKind::WaitFlag:
        CHECK(c == "wait " + ptr(s) + " " + ptr(&flags[size_t(o.flagRank)][o.flag]) +
                       " >= " + std::to_string(o.value));
        break;
      case loom::StreamOpKind::SetFlag:
        CHECK(c == "write " + ptr(s) + " " + ptr(&flags[me][o.flag]) + " = " + std::to_string(o.value));
        break;
      case loom::StreamOpKind::SetPeerFlag:
        FAIL_CHECK("an all-reduce sets no per-pair flag");
        break;
      case loom::StreamOpKind::SetCell:
      case loom::StreamOpKind::SetCellTag:
        FAIL_CHECK("a program without cells publishes none");
        break;
      case loom::StreamOpKind::SetLocal:
        FAIL_CHECK("an eager program sets no local flag");
        break;
      case loom::StreamOpKind::Copy:
        CHECK(c.rfind("memcpy " + ptr(s), 0) == 0);
        break;
      case loom::StreamOpKind::Reduce:
        CHECK(c.rfind("reduce " + ptr(s), 0) == 0);
        CHECK(c.find(loom::strf("n=%zu t=%d op=%d", o.count, int(loomFloat32), int(loomAvg))) !=
              std::string::npos);
        break;
      case loom::StreamOpKind::Divide:
        CHECK(c.find(loom::strf("/%d", N)) != std::string::npos);
        break;
      case loom::StreamOpKind::RecordEvent:
        CHECK(c == "record " + ptr(o.event ? e1 : e0) + " on " + ptr(s));
        break;
      case loom::StreamOpKind::WaitEvent:
        CHECK(c == "waitevent " + ptr(s) + " on " + ptr(o.event ? e1 : e0));
        break;
    }
  }
}

TEST_CASE("CUDA backend: a cell is rewritten as addr = 0, its size, then addr (a released reader never pairs an "
          "old buffer with a new size)",
          "[cuda]") {
  // Rank 1 of 3 publishes its buffers for a reduce-scatter + all-gather
  // all-reduce: every SetCell becomes three stream writes into the peer's
  // cell, in this order (resolveSource reads addr, size, addr).
  const int N = 3, me = 1;
  std::vector<float> send(6000), recv(6000);
  std::vector<std::vector<uint8_t>> win(N, std::vector<uint8_t>(4096));
  std::vector<std::vector<uint64_t>> flags(N, std::vector<uint64_t>(loom::kFlagCount));
  std::vector<std::vector<uint64_t>> cellArea(N, std::vector<uint64_t>(size_t(N) * loom::kCellRowWords));
  loom::OpDesc op;
  op.sendbuf = send.data();
  op.recvbuf = recv.data();
  op.count = 6000;
  loom::StreamPublish pub;
  pub.cells = true;
  pub.mine = true;
  uint64_t round = 0;
  loom::StreamProgram p =
      loom::compileStreamProgram(op, me, N, loom::StreamAlgorithm::ReduceScatterAllGather, 2048, &round, pub);
  loom::ProgramBuffers b;
  b.send = send.data();
  b.sendBytes = b.recvBytes = 24000;
  b.recv = recv.data();
  b.windowBytes = 4096;
  b.published.assign(size_t(N), {});
  for (int r = 0; r < N; ++r) {
    b.windows.push_back(win[size_t(r)].data());
    b.flags.push_back(flags[size_t(r)].data());
    b.cells.push_back(cellArea[size_t(me)].data() + size_t(r) * loom::kCellRowWords);
    b.peerCells.push_back(cellArea[size_t(r)].data() + size_t(me) * loom::kCellRowWords);
    for (int c = 0; c < loom::kCellCount; ++c)
      b.published[size_t(r)][size_t(c)] = {0x100000u * uint64_t(r + 1) + uint64_t(c) * 0x1000u, 24000};
  }
  void* s0 = handle(0x5000);
  loom::CudaStreamBackend be(kRecording, {s0, handle(0x5100)}, {handle(0xe000), handle(0xe100)});
  g_calls.clear();
  loom::enqueueProgram(be, p, b);
  INFO(p.describe());
  size_t cellOps = 0, at = 0;
  for (const loom::StreamOp& o : p.ops) {
    if (o.kind != loom::StreamOpKind::SetCell) {
      ++at;
      continue;
    }
    ++cellOps;
    REQUIRE(at + 3 <= g_calls.size());
    uint64_t* cell = b.peerCells[size_t(o.flagRank)] + size_t(o.flag) * loom::kCellWords;
    const loom::ProgramBuffers::Cell& want = b.published[size_t(o.flagRank)][o.flag];
    void* s = o.stream ? handle(0x5100) : s0;
    CHECK(g_calls[at] == "write " + ptr(s) + " " + ptr(cell) + " = 0");
    CHECK(g_calls[at + 1] == "write " + ptr(s) + " " + ptr(cell + 1) + " = " + std::to_string(want.bytes));
    CHECK(g_calls[at + 2] == "write " + ptr(s) + " " + ptr(cell) + " = " + std::to_string(want.addr));
    at += 3;
  }
  CHECK(cellOps > 0);
}

TEST_CASE("device copy kernel's words: every alignment of source and destination, sizes and thread counts copy "
          "exactly the range",
          "[cuda]") {
  // copyBytes (reduce_kernels.cu) runs copyShare for each thread of its grid.
  struct alignas(16) Vec16 {
    uint8_t b[16];
  };
  auto copyAll = [](uint8_t* dst, const uint8_t* src, size_t bytes, size_t threads) {
    for (size_t t = 0; t < threads; ++t) loom::elementwise::copyShare<Vec16>(dst, src, bytes, t, threads);
  };
  alignas(64) static uint8_t s[1024], d[1024];
  long bad = 0, cases = 0;
  for (int so = 0; so < 32; ++so)
    for (int dof = 0; dof < 32; ++dof)
      for (size_t n : {0, 1, 2, 3, 5, 15, 16, 17, 31, 33, 100, 257, 900})
        for (size_t threads : {1, 3, 64}) {
          for (int i = 0; i < 1024; ++i) s[i] = uint8_t(i * 7 + 3), d[i] = 0xee;
          copyAll(d + dof, s + so, n, threads);
          ++cases;
          for (int i = 0; i < 1024; ++i) {
            const bool in = i >= dof && size_t(i) < size_t(dof) + n;
            if (d[i] != (in ? s[so + i - dof] : 0xee)) {
              ++bad;
              break;
            }
          }
        }
  CHECK(cases == 32 * 32 * 13 * 3);
  CHECK(bad == 0);
}

TEST_CASE("CUDA backend: a reduction of more sources than one launch takes is chained in source order",
          "[cuda]") {
  std::vector<const void*> srcs;
  for (uintptr_t i = 0; i < 19; ++i) srcs.push_back(handle(0x10000 + i * 0x100));
  void* dst = handle(0x90000);
  loom::CudaStreamBackend be(kRecording, {handle(0x5000)}, {});
  g_calls.clear();
  void* dst2 = handle(0x10000 + 3 * 0x100);  // an in-place caller's buffer: one of the sources
  be.reduce(0, dst, dst2, srcs.data(), 19, 1000, loomBfloat16, loomSum);
  // 8, then dst + 7, then dst + 4: 19 sources, left to right; only the last
  // launch writes the second destination (earlier ones would overwrite a
  // source the chain has not finished with).
  REQUIRE(g_calls.size() == 3);
  auto expect = [&](std::vector<const void*> in, bool last) {
    std::string c = "reduce " + ptr(handle(0x5000)) + " " + ptr(dst) + (last ? " and " + ptr(dst2) : "") + " <-";
    for (const void* p : in) c += " " + ptr(p);
    return c + loom::strf(" n=1000 t=%d op=%d", int(loomBfloat16), int(loomSum));
  };
  CHECK(g_calls[0] == expect({srcs.begin(), srcs.begin() + 8}, false));
  std::vector<const void*> second{dst};
  second.insert(second.end(), srcs.begin() + 8, srcs.begin() + 15);
  CHECK(g_calls[1] == expect(second, false));
  std::vector<const void*> third{dst};
  third.insert(third.end(), srcs.begin() + 15, srcs.end());
  CHECK(g_calls[2] == expect(third, true));
  // A single launch writes both.
  g_calls.clear();
  be.reduce(0, dst, dst2, srcs.data(), 8, 1000, loomBfloat16, loomSum);
  REQUIRE(g_calls.size() == 1);
  CHECK(g_calls[0] == expect({srcs.begin(), srcs.begin() + 8}, true));
}

TEST_CASE("CUDA backend: sources read through cells go to the indirect kernels, each cell with its own source",
          "[cuda]") {
  std::vector<const void*> srcs;
  std::vector<loom::CellRef> cells;
  std::vector<uint64_t> cellMem(19 * 2);
  for (uintptr_t i = 0; i < 19; ++i) {
    srcs.push_back(handle(0x10000 + i * 0x100));
    // Every third source is direct.
    cells.push_back(i % 3 ? loom::CellRef{&cellMem[i * 2], 4096 * i, &cellMem[0], 7 + i} : loom::CellRef{});
  }
  void* dst = handle(0x90000);
  loom::CudaStreamBackend be(kRecording, {handle(0x5000)}, {});
  g_calls.clear();
  be.reduceIndirect(0, dst, nullptr, srcs.data(), cells.data(), 19, 1000, loomFloat32, loomSum);
  REQUIRE(g_calls.size() == 3);
  auto src = [&](size_t i) {
    return " " + ptr(srcs[i]) + (cells[i].cell ? loom::strf("|cell %p+%zu tag %p>=%llu", (const void*)cells[i].cell,
                                                            cells[i].offset, (const void*)cells[i].tag,
                                                            (unsigned long long)cells[i].minTag)
                                               : "");
  };
  std::string first = "reduce " + ptr(handle(0x5000)) + " " + ptr(dst) + " <-";
  for (size_t i = 0; i < 8; ++i) first += src(i);
  CHECK(g_calls[0] == first + loom::strf(" n=1000 t=%d op=%d", int(loomFloat32), int(loomSum)));
  // The chain's partial result is read directly; the next sources keep their cells.
  std::string second = "reduce " + ptr(handle(0x5000)) + " " + ptr(dst) + " <- " + ptr(dst);
  for (size_t i = 8; i < 15; ++i) second += src(i);
  CHECK(g_calls[1] == second + loom::strf(" n=1000 t=%d op=%d", int(loomFloat32), int(loomSum)));
  g_calls.clear();
  be.copyIndirect(0, dst, srcs[1], cells[1], 777);
  REQUIRE(g_calls.size() == 1);
  CHECK(g_calls[0] == loom::strf("copykernel %p %p <- %p|cell %p+%zu tag %p>=%llu 777", handle(0x5000), dst, srcs[1],
                                 (const void*)cells[1].cell, cells[1].offset, (const void*)cells[1].tag,
                                 (unsigned long long)cells[1].minTag));
}

TEST_CASE("CUDA backend: a failing CUDA call is loomUnhandledCudaError with CUDA's own message", "[cuda]") {
  loom::CudaStreamBackend be(kRecording, {handle(0x5000)}, {});
  g_failMemcpy = 700;
  int x = 0, y = 0;
  try {
    be.copy(0, &x, &y, 4);
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
    CHECK(std::string(e.what()) ==
          "cudaMemcpyAsync failed: an illegal memory access was encountered (CUDA error 700)");
  }
  g_failMemcpy = 0;
}

TEST_CASE("CUDA plug-in: loaded where it was built, and no GPU counts as zero devices with CUDA's reason",
          "[cuda]") {
  std::string why;
  const loom::CudaApi* api = loom::cudaPlugin(&why);
#ifdef LOOM_HAVE_CUDA_PLUGIN
  // Built with nvcc: libloom finds libloom_cuda.so and loads it even on a
  // machine without a GPU or driver (the runtime is linked statically).
  INFO(why);
  REQUIRE(api != nullptr);
  CHECK(api->abiVersion == loom::kCudaApiVersion);
#endif
  std::string devWhy;
  int n = loom::cudaDeviceCount(&devWhy);
  CHECK(n >= 0);
  if (n == 0) {
    INFO(devWhy);
    CHECK(!devWhy.empty());
    if (api) CHECK(devWhy.find("cudaGetDeviceCount") != std::string::npos);
    // A communicator's init checks its device and loads the kernels on it:
    // without one, a clear error naming the call, not a crash.
    if (api) {
      loom::DeviceChoice choice;
      choice.cuda = true;
      choice.device = 0;
      try {
        loom::loadDeviceKernels(choice);
        FAIL("no error");
      } catch (const loom::Error& e) {
        CHECK(e.code() == loomUnhandledCudaError);
        INFO(e.what());  // the first question (a device attribute, through the driver)
        CHECK(std::string(e.what()).rfind("asking whether device 0 runs stream memory operations failed: ", 0) == 0);
      }
    }
    // Nothing is device memory then: CUDA is not even asked.
    int x = 0;
    CHECK(loom::cudaPointerDevice(&x) == -1);
  } else {
    CHECK(api != nullptr);
  }
}

namespace {

struct EnvVar {
  const char* name;
  explicit EnvVar(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~EnvVar() {
    unsetenv(name);
    loom::configReload();
  }
};

std::string initError(loomResult_t* rc) {
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  *rc = loomCommInitRank(&comm, 1, id, 0);
  std::string msg = loomGetLastError(nullptr);
  if (comm) loomCommDestroy(comm);
  return msg;
}

}  // namespace

TEST_CASE("LOOM_DEVICE: cuda without a usable GPU, or a value but host, cuda and auto, fails init with the reason",
          "[cuda]") {
  loomResult_t rc;
  {
    EnvVar v("LOOM_DEVICE", "cuda");
    std::string msg = initError(&rc);
    INFO(msg);
    std::string why;
    if (loom::cudaDeviceCount(&why) == 0) {
      CHECK(rc == loomInvalidUsage);
      CHECK(msg.find("LOOM_DEVICE=cuda, but this process has no usable CUDA device: " + why) !=
            std::string::npos);
      CHECK(!why.empty());  // names what is missing: the plug-in, the driver, or cudaGetDeviceCount's error
    } else {
      CHECK(rc == loomSuccess);  // a CUDA communicator on the current device
    }
  }
  {
    EnvVar v("LOOM_DEVICE", "tpu");
    std::string msg = initError(&rc);
    CHECK(rc == loomInvalidUsage);
    CHECK(msg.find("LOOM_DEVICE=tpu: expected host, cuda or auto") != std::string::npos);
  }
  {
    EnvVar v("LOOM_DEVICE", "host");
    initError(&rc);
    CHECK(rc == loomSuccess);
  }
  {
    // auto (the NCCL shim's default): a host communicator where there is no
    // GPU, a CUDA one where there is; init succeeds either way.
    EnvVar v("LOOM_DEVICE", "auto");
    std::string msg = initError(&rc);
    INFO(msg);
    CHECK(rc == loomSuccess);
  }
}

namespace {
float g_deviceBuf[16];  // what the classifier below calls CUDA memory of device 3
int classify(const void* p) {
  const char* c = static_cast<const char*>(p);
  const char* b = reinterpret_cast<const char*>(g_deviceBuf);
  return c >= b && c < b + sizeof g_deviceBuf ? 3 : -1;
}
}  // namespace

TEST_CASE("a CUDA device pointer given to a host communicator is loomInvalidArgument, naming the buffer",
          "[cuda]") {
  // The classifier stands in for cudaPointerGetAttributes, which needs a GPU;
  // what is tested is the API's answer to device memory.
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  REQUIRE(loomCommInitRank(&comm, 1, id, 0) == loomSuccess);
  loom::setCudaPointerClassifierForTesting(classify);
  float host[16] = {};
  CHECK(loomAllReduce(g_deviceBuf, host, 16, loomFloat32, loomSum, comm, nullptr) == loomInvalidArgument);
  std::string msg = loomGetLastError(comm);
  CHECK(msg.find("sendbuff " + ptr(g_deviceBuf) +
                 " is CUDA device memory (cuda:3), but this communicator runs on the host") !=
        std::string::npos);
  CHECK(loomBroadcast(host, g_deviceBuf + 4, 4, loomFloat32, 0, comm, nullptr) == loomInvalidArgument);
  msg = loomGetLastError(comm);
  CHECK(msg.find("recvbuff " + ptr(g_deviceBuf + 4) + " is CUDA device memory") != std::string::npos);
  // Host memory still works on the same communicator.
  float other[16] = {};
  for (int i = 0; i < 16; ++i) host[i] = float(i);
  CHECK(loomAllReduce(host, other, 16, loomFloat32, loomSum, comm, nullptr) == loomSuccess);
  CHECK(other[15] == 15.0f);
  loom::setCudaPointerClassifierForTesting(nullptr);
  loomCommDestroy(comm);
}

namespace {

// A CUDA table for the communicator's driver: memory is host memory
// (calloc), handles and streams are counters, every call is recorded.
// Two ranks' threads call it at once: the record and the counters are
// guarded (TSan).  The test reads g_drv only while no rank runs.
std::vector<std::string> g_drv;
std::mutex g_drvMu;
std::atomic<int> g_current{0};      // cudaGetDevice's answer; -1: the thread has no context
std::atomic<int> g_failIpcOpen{0};  // cudaIpcOpenMemHandle's result
std::atomic<bool> g_pending{false};  // cudaStreamQuery: work left on the stream
std::atomic<uintptr_t> g_next{0x1000};
std::vector<std::pair<void*, size_t>> g_blocks;  // cudaMalloc'd (zeroed) memory: the communicators' blocks
std::vector<std::pair<void (*)(void*), void*>> g_retained;  // retainOnCapture's user objects, not yet released
std::map<void*, uint64_t> g_captures;  // captureId's answers: stream -> its capture (absent: none)
void record(std::string call) {
  std::lock_guard<std::mutex> g(g_drvMu);
  g_drv.push_back(std::move(call));
}

const loom::CudaApi kDriverTable = {
    loom::kCudaApiVersion,
    [](void* s, const uint64_t* a, uint64_t v) {
      record(loom::strf("wait %p %p %llu", s, static_cast<const void*>(a), (unsigned long long)v));
      return 0;
    },
    [](void* s, uint64_t* a, uint64_t v) {
      record(loom::strf("write %p %p %llu", s, static_cast<void*>(a), (unsigned long long)v));
      return 0;
    },
    [](void* d, const void* src, size_t n, void* s) {
      record(loom::strf("memcpy %p %p <- %p %zu", s, d, src, n));
      return 0;
    },
    [](void*, void*, const void* const*, int, size_t, int, int, void*) { return 0; },
    [](void*, const void*, size_t, int, int, void*) { return 0; },
    [](void* e, void* s) {
      record(loom::strf("record %p %p", e, s));
      return 0;
    },
    [](void* s, void* e) {
      record(loom::strf("waitevent %p %p", s, e));
      return 0;
    },
    [](int e) { return e == 201 ? "invalid device context" : "?"; },
    [](int* n) {
      *n = 2;
      return 0;
    },
    [](const void*, int* d) {
      *d = 1;
      return 0;
    },
    [](int* d) {
      *d = g_current;
      return 0;
    },
    [](int d) {
      record(loom::strf("setDevice %d", d));
      g_current = d;
      return 0;
    },
    [](void** p, size_t n) {
      *p = calloc(1, n);
      record(loom::strf("malloc %zu on %d", n, g_current.load()));
      std::lock_guard<std::mutex> g(g_drvMu);
      g_blocks.emplace_back(*p, n);
      return 0;
    },
    [](void* p) {
      free(p);
      record("free");
      return 0;
    },
    [](const void* p, void** base, size_t* n) {
      *base = const_cast<void*>(p);
      *n = loom::flagAreaBytes(8) + loom::streamWindowBytes(loom::kDeviceSlotBytes) + loom::p2pRegionBytes(loom::kDeviceSlotBytes);
      return 0;
    },
    [](void* base, void* h) {
      memset(h, 0, loom::kCudaIpcHandleBytes);
      memcpy(h, &base, sizeof base);
      return 0;
    },
    [](const void*, void**) { return g_failIpcOpen.load(); },
    [](void*) { return 0; },
    [](void** s) {
      *s = reinterpret_cast<void*>(g_next++);
      record(loom::strf("streamCreate %p", *s));
      return 0;
    },
    [](void* s) {
      record(loom::strf("streamDestroy %p", s));
      return 0;
    },
    [](void** e) {
      *e = reinterpret_cast<void*>(g_next++);
      record(loom::strf("eventCreate %p", *e));
      return 0;
    },
    [](void* e) {
      record(loom::strf("eventDestroy %p", e));
      return 0;
    },
    [](const uint64_t* a, uint64_t* v, void*) {
      *v = *a;
      return 0;
    },
    [](void** p, size_t n) {  // cudaMalloc alone: send/recv staging
      *p = malloc(n);
      record(loom::strf("mallocRaw %zu", n));
      return 0;
    },
    [](void** p, size_t n) {  // pinned host memory: the staged path, flag reads
      *p = calloc(1, n);  // memcpyAsync above copies nothing: what it "read" is 0
      record(loom::strf("hostAlloc %zu", n));
      return 0;
    },
    [](void* p) {
      free(p);
      record("hostFree");
      return 0;
    },
    nullptr,  // loadKernels: init's, not the driver's
    nullptr,  // launchReduceIndirect, launchCopyIndirect: the backend's
    nullptr,
    []() {
      record("deviceSynchronize");
      return 0;
    },
    [](int* d) {  // the thread's context: g_current, -1 for none
      *d = g_current;
      return 0;
    },
    []() {
      record("clearContext");
      g_current = -1;
      return 0;
    },
    [](int, int* supported) {
      *supported = 1;
      return 0;
    },
    [](void* s) {  // cudaStreamQuery: g_pending says whether the stream has work left
      record(loom::strf("streamQuery %p", s));
      return g_pending.load() ? 1 : 0;
    },
    [](void*, int* capturing) {  // the API's, not the driver's
      *capturing = 0;
      return 0;
    },
    []() { return 0; },  // relaxCaptureMode: loom's threads', not the driver's
    [](void* d, const void* src, size_t n, int t, const void* k, int onDevice, void* s) {
      uint64_t v = 0;
      if (!onDevice) memcpy(&v, k, loom::dtypeSize(loomDataType_t(t)));
      record(onDevice ? loom::strf("scale %p %p <- %p n=%zu t=%d by *%p", s, d, src, n, t, k)
                      : loom::strf("scale %p %p <- %p n=%zu t=%d by %llu", s, d, src, n, t, (unsigned long long)v));
      return 0;
    },
    [](void* s, void (*release)(void*), void* arg) {  // retainOnCapture: held until the test lets go
      record(loom::strf("retain %p", s));
      g_retained.emplace_back(release, arg);
      return 0;
    },
    [](void* s, uint64_t* id) {  // captureId: g_captures says which stream is in which capture
      std::lock_guard<std::mutex> g(g_drvMu);
      auto it = g_captures.find(s);
      *id = it == g_captures.end() ? 0 : it->second;
      return 0;
    },
    nullptr,  // writeValues64: the backend's
};

size_t countOf(const std::string& prefix) {
  size_t n = 0;
  for (const std::string& c : g_drv) n += c.compare(0, prefix.size(), prefix) == 0;
  return n;
}

}  // namespace

TEST_CASE("CUDA communicator driver: the watchdog's repeated release writes never pile up behind a batch that "
          "has not run",
          "[cuda]") {
  g_drv.clear();
  g_current = 0;
  g_pending = false;
  auto drv = loom::makeCudaDeviceDriver(kDriverTable, 0);
  uint64_t a = 0, b = 0;
  uint64_t* flags[] = {&a, &b};
  drv->writeFlags(flags, 2, 7);
  CHECK(countOf("write ") == 2);
  g_pending = true;  // that batch has not run: the same one again is not enqueued
  drv->writeFlags(flags, 2, 7);
  CHECK(countOf("write ") == 2);
  CHECK(countOf("streamQuery") == 1);
  drv->writeFlags(flags, 2, 9);  // other values are always written
  CHECK(countOf("write ") == 4);
  drv->writeFlags(flags, 1, 9);  // and other flags
  CHECK(countOf("write ") == 5);
  g_pending = false;  // it ran: the same batch goes again (a peer may have lowered a flag since)
  drv->writeFlags(flags, 1, 9);
  CHECK(countOf("write ") == 6);
  g_pending = false;
}

TEST_CASE("CUDA communicator driver: a group's streams are joined by one event, recorded on the stream waited "
          "for and waited for by the other, on the communicator's device",
          "[cuda]") {
  g_drv.clear();
  g_current = 0;
  auto* a = reinterpret_cast<void*>(uintptr_t(0xa0));
  auto* b = reinterpret_cast<void*>(uintptr_t(0xb0));
  auto* c = reinterpret_cast<void*>(uintptr_t(0xc0));
  std::string ev;
  {
    loom::DeviceComm dc(0, 1, loom::makeCudaDeviceDriver(kDriverTable, 1),
                        [](const void* m, size_t bytes, void* all) { memcpy(all, m, bytes); });
    g_drv.clear();
    dc.joinStreams(a, {b, a, c}, true);  // a waits for b and c (a itself is skipped)
    REQUIRE(g_drv.size() == 7);
    CHECK(g_drv[0] == "setDevice 1");
    REQUIRE(g_drv[1].rfind("eventCreate ", 0) == 0);
    ev = g_drv[1].substr(12);
    CHECK(g_drv[2] == "record " + ev + " " + ptr(b));
    CHECK(g_drv[3] == "waitevent " + ptr(a) + " " + ev);
    CHECK(g_drv[4] == "record " + ev + " " + ptr(c));
    CHECK(g_drv[5] == "waitevent " + ptr(a) + " " + ev);
    CHECK(g_drv[6] == "setDevice 0");
    g_drv.clear();
    dc.joinStreams(a, {b, c}, false);  // b and c wait for a: the same event, made once
    REQUIRE(g_drv.size() == 6);
    CHECK(g_drv[1] == "record " + ev + " " + ptr(a));
    CHECK(g_drv[2] == "waitevent " + ptr(b) + " " + ev);
    CHECK(g_drv[3] == "record " + ev + " " + ptr(a));
    CHECK(g_drv[4] == "waitevent " + ptr(c) + " " + ev);
    g_drv.clear();
  }
  CHECK(countOf("eventDestroy " + ev) == 1);
}

TEST_CASE("CUDA communicator driver: loomScale's kernel is launched on the caller's stream on the communicator's "
          "device, a host scalar passed by value and a device one by address",
          "[cuda][scale]") {
  g_drv.clear();
  g_current = 0;
  auto* stream = reinterpret_cast<void*>(uintptr_t(0x5ca1));
  {
    loom::DeviceComm dc(0, 1, loom::makeCudaDeviceDriver(kDriverTable, 1),
                        [](const void* m, size_t bytes, void* all) { memcpy(all, m, bytes); });
    std::vector<int32_t> buf(64);  // "device memory": the table says every pointer is device 1's
    const int32_t k = 7;
    g_drv.clear();
    dc.scale(buf.data() + 32, buf.data(), 16, loomInt32, &k, false, stream);
    REQUIRE(g_drv.size() == 3);
    CHECK(g_drv[0] == "setDevice 1");
    CHECK(g_drv[1] == loom::strf("scale %p %p <- %p n=16 t=%d by 7", stream, static_cast<void*>(buf.data() + 32),
                                 static_cast<void*>(buf.data()), int(loomInt32)));
    CHECK(g_drv[2] == "setDevice 0");
    g_drv.clear();
    dc.scale(buf.data(), buf.data(), 16, loomInt32, buf.data() + 63, true, stream);
    REQUIRE(g_drv.size() == 3);
    CHECK(g_drv[1] == loom::strf("scale %p %p <- %p n=16 t=%d by *%p", stream, static_cast<void*>(buf.data()),
                                 static_cast<void*>(buf.data()), int(loomInt32), static_cast<void*>(buf.data() + 63)));
    g_drv.clear();
  }
}

TEST_CASE("CUDA communicator driver: a thread with no CUDA context gets none back, not device 0's (the "
          "control thread, the watchdog, the reaper, a user's fresh thread)",
          "[cuda]") {
  g_drv.clear();
  g_current = -1;  // no context on this thread
  auto* stream = reinterpret_cast<void*>(uintptr_t(0xcafe));
  {
    loom::DeviceComm dc(0, 1, loom::makeCudaDeviceDriver(kDriverTable, 1),
                        [](const void* m, size_t b, void* all) { memcpy(all, m, b); });
    for (const std::string& c : g_drv)
      if (c.rfind("malloc ", 0) == 0) CHECK(c.substr(c.size() - 5) == " on 1");
    CHECK(g_current == -1);
    std::vector<uint8_t> a(4096), b(4096);
    loom::OpDesc op;
    op.sendbuf = a.data();
    op.recvbuf = b.data();
    op.count = 1024;
    g_drv.clear();
    dc.run(op, stream);
    REQUIRE(g_drv.size() == 3);
    CHECK(g_drv[0] == "setDevice 1");
    CHECK(g_drv[2] == "clearContext");
    CHECK(g_current == -1);
  }
  CHECK(countOf("setDevice 0") == 0);  // never: that would make device 0's context
  CHECK(g_current == -1);
  g_current = 0;
}

TEST_CASE("CUDA communicator driver: its calls through the plug-in table (device, memory, side streams and "
          "events made once, the caller's stream as program stream 0, errors with CUDA's message)",
          "[cuda]") {
  g_drv.clear();
  g_current = 0;
  auto* stream = reinterpret_cast<void*>(uintptr_t(0xcafe));
  {
    // One rank on device 1 while the caller's current device is 0.
    loom::DeviceComm dc(0, 1, loom::makeCudaDeviceDriver(kDriverTable, 1),
                        [](const void* m, size_t b, void* all) { memcpy(all, m, b); });
    CHECK(countOf("malloc") == 1);
    CHECK(countOf("setDevice 1") >= 1);
    for (const std::string& c : g_drv)
      if (c.rfind("malloc ", 0) == 0) CHECK(c.substr(c.size() - 5) == " on 1");  // the window on its device
    CHECK(g_current == 0);  // the caller's device again
    CHECK(dc.device() == 1);
    std::vector<uint8_t> a(1 << 20), b(1 << 20);
    loom::OpDesc op;
    op.sendbuf = a.data();  // the table says every pointer is memory of device 1
    op.recvbuf = b.data();
    op.count = 1 << 18;
    g_drv.clear();
    dc.run(op, stream);
    // Device 1 for the enqueue, the caller's 0 again after; one rank: one copy on the caller's stream.
    REQUIRE(g_drv.size() == 3);
    CHECK(g_drv[0] == "setDevice 1");
    CHECK(g_drv[1] == loom::strf("memcpy %p %p <- %p %zu", stream, static_cast<void*>(b.data()),
                                 static_cast<void*>(a.data()), size_t(1) << 20));
    CHECK(g_drv[2] == "setDevice 0");
    CHECK(g_current == 0);
    g_drv.clear();
  }
  // Destroy frees on the communicator's device, whatever the caller's (or
  // the reaper thread's) current one is, and restores it.
  CHECK(countOf("free") == 1);
  {
    int lastSet = -1;
    for (const std::string& call : g_drv) {
      if (call.rfind("setDevice ", 0) == 0) lastSet = std::stoi(call.substr(10));
      if (call == "free") CHECK(lastSet == 1);
    }
    CHECK(g_current == 0);
  }

  // Two ranks of this process (threads): the large all-reduce uses a side
  // stream and two events, made on first use and reused; no IPC open is
  // needed for this process's own blocks.
  g_drv.clear();
  g_current = 1;
  g_failIpcOpen = 999;  // would fail if any handle were opened
  {
    std::vector<uint8_t> rec[2];
    std::unique_ptr<loom::DeviceComm> dc[2];
    std::mutex mu;
    std::condition_variable cv;
    int arrived = 0, taken = 0;
    std::vector<uint8_t> all;
    auto gather = [&](int r) {  // init makes two exchanges of different sizes
      return [&, r](const void* m, size_t b, void* out) {
        std::unique_lock<std::mutex> g(mu);
        cv.wait(g, [&] { return arrived < 2; });  // the previous exchange fully taken
        if (arrived == 0) all.assign(2 * b, 0);
        memcpy(all.data() + size_t(r) * b, m, b);
        if (++arrived == 2) cv.notify_all();
        cv.wait(g, [&] { return arrived == 2; });
        memcpy(out, all.data(), 2 * b);
        if (++taken == 2) {
          arrived = taken = 0;
          cv.notify_all();
        }
      };
    };
    // Nothing runs the recorded programs, so the peers' done flags never
    // move: destroy must not wait for them (it writes its done flags below,
    // as the device would once they ran, so that the reaper frees them).
    loom::DeviceCommOptions o{loom::kDeviceSlotBytes, loom::kDeviceOneShotBytes, 7, 0};
    o.reapTimeoutMs = 0;
    g_blocks.clear();
    std::thread t([&] {
      dc[1] = std::make_unique<loom::DeviceComm>(1, 2, loom::makeCudaDeviceDriver(kDriverTable, 1), gather(1), o);
    });
    dc[0] = std::make_unique<loom::DeviceComm>(0, 2, loom::makeCudaDeviceDriver(kDriverTable, 1), gather(0), o);
    t.join();
    std::vector<float> x(1 << 20);
    loom::OpDesc op;
    op.sendbuf = op.recvbuf = x.data();
    op.count = x.size();  // 4 MiB: reduce-scatter + all-gather
    g_drv.clear();
    dc[0]->run(op, stream);
    dc[0]->run(op, stream);
    CHECK(countOf("streamCreate") == 1);
    CHECK(countOf("eventCreate") == 2);
    CHECK(countOf("setDevice") == 0);  // already current
    CHECK(countOf("record ") == 4);  // fork and join of each program
    CHECK(countOf(loom::strf("wait %p", stream)) > 0);  // program stream 0 is the caller's
    // Send/recv staging: made at the first send to a peer, with cudaMalloc
    // alone (no memset, no device synchronisation: streams may be waiting
    // on peers), once per peer.
    CHECK(countOf("mallocRaw") == 0);
    loom::OpDesc send;
    send.coll = loom::Collective::P2P;
    send.isSend = true;
    send.peer = 1;
    send.sendbuf = x.data();
    send.count = 1000;
    send.dtype = loomUint8;
    g_drv.clear();
    dc[0]->runP2P({send}, stream);
    dc[0]->runP2P({send}, stream);
    CHECK(countOf("mallocRaw") == 1);
    CHECK(countOf(loom::strf("mallocRaw %zu", loom::p2pRegionBytes(loom::kDeviceSlotBytes))) == 1);
    CHECK(countOf("malloc ") == 0);
    CHECK(dc[0]->memoryStats().regionsOut == 1);
    CHECK(dc[1]->memoryStats().regionsOut == 0);
    // The programs "ran": every done flag of every row, in both blocks.
    REQUIRE(g_blocks.size() == 2);
    for (auto& [p, n] : g_blocks)
      for (int r = 0; r < 2; ++r) {
        auto* row = static_cast<uint64_t*>(p) + size_t(r) * loom::kFlagCount;
        row[loom::kFlagDone] = row[loom::kFlagP2PDone] = uint64_t(1) << 40;
      }
  }
  CHECK(loom::waitDeviceRemains(10000));  // freed once neither maps the other's
  g_failIpcOpen = 0;

  // A CUDA error: loomUnhandledCudaError with CUDA's message and the device.
  g_current = 1;
  g_failIpcOpen = 201;
  {
    auto drv = loom::makeCudaDeviceDriver(kDriverTable, 1);
    uint8_t h[loom::kIpcHandleBytes] = {};
    try {
      drv->openHandle(h);
      FAIL("no error");
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomUnhandledCudaError);
      CHECK(std::string(e.what()) == "cuda:1: cudaIpcOpenMemHandle failed: invalid device context (CUDA error 201)");
    }
  }
  g_failIpcOpen = 0;
}

TEST_CASE("CUDA communicator driver: retainOnCapture hands the plug-in a callback that runs the release once, "
          "when the graph lets go, and a plug-in error runs it at once and is loomUnhandledCudaError",
          "[cuda][graph]") {
  g_current = 1;
  auto drv = loom::makeCudaDeviceDriver(kDriverTable, 1);
  int released = 0;
  g_retained.clear();
  drv->retainOnCapture(reinterpret_cast<void*>(uintptr_t(0x5150)), [&released] { ++released; });
  REQUIRE(g_retained.size() == 1);
  CHECK(countOf("retain 0x5150") == 1);
  CHECK(released == 0);  // held by the graph
  g_retained[0].first(g_retained[0].second);  // the graph is destroyed
  CHECK(released == 1);
  g_retained.clear();
  loom::CudaApi failing = kDriverTable;
  failing.retainOnCapture = [](void*, void (*release)(void*), void* arg) {
    release(arg);  // as the plug-in does on an error
    return 901;    // cudaErrorStreamCaptureInvalidated
  };
  auto bad = loom::makeCudaDeviceDriver(failing, 1);
  try {
    bad->retainOnCapture(nullptr, [&released] { ++released; });
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomUnhandledCudaError);
  }
  CHECK(released == 2);
}

namespace {
// The streams a backend's program stream `s` is (a wait enqueued there, as recorded).
void* backendStream(loom::StreamBackend& be, int s) {
  uint64_t flag = 0;
  const size_t before = g_drv.size();
  be.waitFlag(s, &flag, 1, 0);
  REQUIRE(g_drv.size() == before + 1);
  void* p = nullptr;
  REQUIRE(sscanf(g_drv.back().c_str(), "wait %p", &p) == 1);
  return p;
}
}  // namespace

TEST_CASE("CUDA communicator driver: a captured program's side streams are never the eager ones nor another "
          "capture's, and are reused within a capture and after it ends",
          "[cuda][graph]") {
  g_drv.clear();
  g_captures.clear();
  g_current = 0;
  auto drv = loom::makeCudaDeviceDriver(kDriverTable, 0);
  void* callerA = reinterpret_cast<void*>(uintptr_t(0xa0));
  void* callerB = reinterpret_cast<void*>(uintptr_t(0xb0));
  void* eager1 = backendStream(drv->backend(callerA, 3, 2), 1);
  void* eager2 = backendStream(drv->backend(callerA, 3, 2), 2);
  CHECK(countOf("streamCreate") == 2);
  // callerA is captured (capture 7): two side streams of the capture pool.
  g_captures[callerA] = 7;
  loom::StreamBackend& a = drv->captureBackend(callerA, 3, 2);
  CHECK(backendStream(a, 0) == callerA);
  void* a1 = backendStream(a, 1);
  void* a2 = backendStream(a, 2);
  CHECK(countOf("streamCreate") == 4);
  for (void* s : {eager1, eager2, callerA}) {
    CHECK(a1 != s);
    CHECK(a2 != s);
  }
  CHECK(a1 != a2);
  // The fork joined them to capture 7.  Capture 9 on callerB gets others.
  g_captures[a1] = g_captures[a2] = 7;
  g_captures[callerB] = 9;
  loom::StreamBackend& b = drv->captureBackend(callerB, 3, 2);
  void* b1 = backendStream(b, 1);
  void* b2 = backendStream(b, 2);
  CHECK(countOf("streamCreate") == 6);
  for (void* s : {a1, a2, eager1, eager2}) {
    CHECK(b1 != s);
    CHECK(b2 != s);
  }
  g_captures[b1] = g_captures[b2] = 9;
  // A second call of capture 7 reuses its streams; eager calls keep theirs.
  loom::StreamBackend& a3 = drv->captureBackend(callerA, 3, 2);
  CHECK(((backendStream(a3, 1) == a1 && backendStream(a3, 2) == a2) ||
         (backendStream(a3, 1) == a2 && backendStream(a3, 2) == a1)));
  CHECK(backendStream(drv->backend(callerB, 3, 2), 2) == eager2);
  CHECK(countOf("streamCreate") == 6);
  // Capture 7 ends: its streams serve capture 9's next call too (one of
  // 9's own first), then a new capture's.
  g_captures.erase(callerA);
  g_captures.erase(a1);
  g_captures.erase(a2);
  loom::StreamBackend& b3 = drv->captureBackend(callerB, 3, 2);
  void* b31 = backendStream(b3, 1);
  void* b32 = backendStream(b3, 2);
  CHECK((b31 == b1 || b31 == b2));
  CHECK((b32 == b1 || b32 == b2));
  g_captures[callerA] = 11;
  loom::StreamBackend& c = drv->captureBackend(callerA, 2, 0);
  void* c1 = backendStream(c, 1);
  CHECK((c1 == a1 || c1 == a2));
  CHECK(countOf("streamCreate") == 6);
  // One stream: the caller's alone, no query.
  g_captures[callerA] = 12;
  CHECK(backendStream(drv->captureBackend(callerA, 1, 0), 0) == callerA);
  // A fresh driver whose first program on two streams is captured makes
  // its events there; and stream 2's pool is not stream 1's.
  g_drv.clear();
  auto fresh = loom::makeCudaDeviceDriver(kDriverTable, 0);
  loom::StreamBackend& f = fresh->captureBackend(callerA, 2, 2);
  CHECK(countOf("eventCreate") == 2);
  void* f1 = backendStream(f, 1);
  g_captures[f1] = 12;  // joined
  loom::StreamBackend& f2 = fresh->captureBackend(callerA, 3, 2);
  CHECK(backendStream(f2, 1) == f1);
  CHECK(backendStream(f2, 2) != f1);
  CHECK(countOf("streamCreate") == 2);
  g_captures.clear();
}

TEST_CASE("CUDA communicator driver: flag reads land in pinned memory made once at init, never allocated "
          "while programs may run, and larger reads (or reads without pinned memory) go to pageable memory",
          "[cuda]") {
  // The table above, with copies that copy (the flags are host memory
  // here) and pinned memory that can be refused.
  static std::atomic<bool> refusePinned{false};
  loom::CudaApi api = kDriverTable;
  api.memcpyAsync = [](void* d, const void* src, size_t n, void* s) {
    record(loom::strf("memcpy %p %p <- %p %zu", s, d, src, n));
    memcpy(d, src, n);
    return 0;
  };
  static void* pinned = nullptr;  // the last pinned buffer handed out
  api.hostAllocMapped = [](void** p, size_t n) {
    record(loom::strf("hostAlloc %zu", n));
    if (refusePinned) return 2;  // cudaErrorMemoryAllocation
    *p = pinned = calloc(1, n);
    return 0;
  };
  std::vector<uint64_t> flags(200);
  for (size_t i = 0; i < flags.size(); ++i) flags[i] = 1000 + i * 7;
  auto readAll = [&](loom::DeviceDriver& drv) {
    CHECK(drv.readFlag(&flags[5]) == 1035);
    std::vector<uint64_t> out(flags.size(), 0);
    drv.readFlags(flags.data(), 10, out.data());  // fits the prepared 64
    for (size_t i = 0; i < 10; ++i) CHECK(out[i] == flags[i]);
    // Where the copy landed: the pinned buffer when there is one, else the
    // caller's (pageable) memory.
    const bool intoPinned = pinned && countOf("hostAlloc") > 0 && !refusePinned;
    const void* landed = intoPinned ? static_cast<uint64_t*>(pinned) + 1 : out.data() + 1;
    const std::string copy = loom::strf(" %p <- %p %zu", landed, static_cast<const void*>(flags.data() + 1),
                                        9 * sizeof(uint64_t));
    size_t copies = 0;
    for (const std::string& c : g_drv) copies += c.rfind("memcpy ", 0) == 0 && c.find(copy) != std::string::npos;
    CHECK(copies == 1);
    CHECK(out[10] == 0);  // nothing past n
    drv.readFlags(flags.data() + 3, flags.size() - 3, out.data());  // more than was prepared
    for (size_t i = 0; i + 3 < flags.size(); ++i) CHECK(out[i] == flags[i + 3]);
    drv.readFlags(flags.data(), 0, out.data());  // nothing to read: no call
  };
  for (int mode = 0; mode < 3; ++mode) {
    const char* names[] = {"prepared", "prepared, pinned memory refused", "not prepared"};
    INFO(names[mode]);
    refusePinned = mode == 1;
    g_drv.clear();
    {
      auto drv = loom::makeCudaDeviceDriver(api, 1);
      if (mode < 2) {
        drv->prepareFlagReads(64);
        drv->prepareFlagReads(64);  // once only
      }
      const size_t allocs = countOf("hostAlloc");
      CHECK(allocs == (mode < 2 ? 1u : 0u));
      CHECK(countOf("hostAlloc 512") == allocs);
      readAll(*drv);
      CHECK(countOf("hostAlloc") == allocs);  // reads never allocate
      CHECK(countOf("hostFree") == 0);
      CHECK(countOf("streamCreate") == 1);  // one read stream for all of them
    }
    CHECK(countOf("hostFree") == (mode == 0 ? 1u : 0u));  // the driver frees its buffer
  }
  refusePinned = false;

  // A communicator prepares its reads at init: the whole flag area.
  g_drv.clear();
  {
    loom::DeviceComm dc(0, 1, loom::makeCudaDeviceDriver(kDriverTable, 1),
                        [](const void* m, size_t b, void* all) { memcpy(all, m, b); });
    CHECK(countOf(loom::strf("hostAlloc %zu", loom::kFlagCount * sizeof(uint64_t))) == 1);
  }
  CHECK(countOf("hostFree") == 1);
}
