// Stream programs (src/device/stream_program.h, algorithms/stream_collectives.cc)
// run on the simulated device (tests/sim_device.h): exact results for every
// collective and program variant, N = 1..8, ranks sharing one device and
// spread over several, every datatype and op (floats bit for bit against the
// host arithmetic combined in rank order, which is what the host one-shot
// path computes), in and out of place, counts 0, 1, odd and large, many
// rounds per operation and operations back to back on one world; stream
// ordering against the caller's own work; a killed or absent rank turning
// into an error within the deadline; bad programs refused before anything
// is enqueued.
#include "loom_catch.h"
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/stream_collectives.h"
#include "src/core/error.h"
#include "src/device/device.h"
#include "src/device/host_reduce.h"
#include "tests/sim_device.h"

namespace {

using loom::Collective;
using loom::StreamAlgorithm;

const loomDataType_t kAllTypes[] = {loomInt8,   loomUint8,   loomInt32,   loomUint32,  loomInt64,
                                    loomUint64, loomFloat16, loomFloat32, loomFloat64, loomBfloat16};
const loomRedOp_t kAllOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

struct Variant {
  Collective coll;
  StreamAlgorithm algo;
};
const Variant kVariants[] = {
    {Collective::AllReduce, StreamAlgorithm::OneShot},
    {Collective::AllReduce, StreamAlgorithm::ReduceScatterAllGather},
    {Collective::ReduceScatter, StreamAlgorithm::OneShot},
    {Collective::AllGather, StreamAlgorithm::OneShot},
    {Collective::Broadcast, StreamAlgorithm::OneShot},
    {Collective::Reduce, StreamAlgorithm::OneShot},
    {Collective::AllToAll, StreamAlgorithm::OneShot},
    {Collective::Gather, StreamAlgorithm::OneShot},
    {Collective::Scatter, StreamAlgorithm::OneShot},
};

bool reducing(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

struct Case {
  Variant v;
  loomDataType_t type = loomFloat32;
  loomRedOp_t op = loomSum;
  size_t count = 0;
  int root = 0;
  bool inPlace = false;
  // Device zero-copy: 0 no cells (windows only); 1 cells, nobody
  // publishes; 2 every rank publishes; 3 odd ranks publish.
  int publish = 0;
};

std::string caseName(const Case& c, int n) {
  return loom::strf("%s/%s N=%d %s %s count=%zu root=%d %s publish=%d", loom::collectiveName(c.v.coll),
                    loom::streamAlgorithmName(c.v.algo), n, loom::dtypeName(c.type), loom::redOpName(c.op),
                    c.count, c.root, c.inPlace ? "in-place" : "out-of-place", c.publish);
}

// Random inputs with no special values: floats of mixed magnitudes, so a
// different combining order gives different bits.
void fillRandom(uint8_t* p, size_t n, loomDataType_t t, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> ex(-6, 6);
  const size_t esz = loom::dtypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    double x = std::ldexp(mant(rng), ex(rng));
    uint8_t* e = p + i * esz;
    switch (t) {
      case loomFloat16: {
        uint16_t h = loom::floatToHalf(float(x));
        memcpy(e, &h, 2);
        break;
      }
      case loomBfloat16: {
        uint16_t h = loom::floatToBf16(float(x));
        memcpy(e, &h, 2);
        break;
      }
      case loomFloat32: {
        float f = float(x);
        memcpy(e, &f, 4);
        break;
      }
      case loomFloat64:
        memcpy(e, &x, 8);
        break;
      default: {
        uint64_t r = rng();
        memcpy(e, &r, esz);
      }
    }
  }
}

// A rank's memory: one block with guard bytes on both sides.
struct Guarded {
  static constexpr size_t kGuard = 64;
  std::vector<uint8_t> mem;
  explicit Guarded(size_t bytes) : mem(bytes + 2 * kGuard) {
    for (size_t i = 0; i < mem.size(); ++i) mem[i] = uint8_t(0xA5 ^ i);
  }
  uint8_t* data() { return mem.data() + kGuard; }
  size_t size() const { return mem.size() - 2 * kGuard; }
  bool guardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (mem[i] != uint8_t(0xA5 ^ i)) return false;
      size_t j = mem.size() - 1 - i;
      if (mem[j] != uint8_t(0xA5 ^ j)) return false;
    }
    return true;
  }
};

// Runs one collective on every rank of `w` and checks it; "" when right.
std::string runCase(loomsim::SimDeviceWorld& w, const Case& c, size_t slotBytes, uint64_t seed) {
  const int N = w.nranks();
  const size_t esz = loom::dtypeSize(c.type), n = c.count;
  size_t sendElems = n, recvElems = n;
  if (c.v.coll == Collective::ReduceScatter || c.v.coll == Collective::AllToAll || c.v.coll == Collective::Scatter)
    sendElems = size_t(N) * n;
  if (c.v.coll == Collective::AllGather || c.v.coll == Collective::AllToAll || c.v.coll == Collective::Gather)
    recvElems = size_t(N) * n;
  // Gather and scatter are in place at the root only (the others' buffers
  // are separate).
  const bool inPlace = c.inPlace;
  const size_t bufElems = std::max(sendElems, recvElems);
  std::mt19937_64 rng(seed);

  std::vector<Guarded> sendMem, recvMem;
  std::vector<const uint8_t*> send(static_cast<size_t>(N));
  std::vector<uint8_t*> recv(static_cast<size_t>(N));
  std::vector<std::vector<uint8_t>> input(static_cast<size_t>(N)), before(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    const bool rootOnly = c.v.coll == Collective::Gather || c.v.coll == Collective::Scatter;
    const bool ip = inPlace && (!rootOnly || r == c.root);
    sendMem.emplace_back(ip ? 0 : sendElems * esz);
    recvMem.emplace_back(ip ? bufElems * esz : recvElems * esz);
    Guarded& rm = recvMem.back();
    fillRandom(rm.data(), rm.size() / esz, c.type, rng);  // recv starts as garbage
    uint8_t* in;
    if (!ip) {
      in = sendMem.back().data();
      recv[size_t(r)] = rm.data();
    } else if (c.v.coll == Collective::ReduceScatter) {
      in = rm.data();
      recv[size_t(r)] = rm.data() + size_t(r) * n * esz;
    } else if (c.v.coll == Collective::AllGather) {
      in = rm.data() + size_t(r) * n * esz;
      recv[size_t(r)] = rm.data();
    } else if (c.v.coll == Collective::Gather) {  // the root: sendbuff = recvbuff + root*count
      in = rm.data() + size_t(r) * n * esz;
      recv[size_t(r)] = rm.data();
    } else if (c.v.coll == Collective::Scatter) {  // the root: recvbuff = sendbuff + root*count
      in = rm.data();
      recv[size_t(r)] = rm.data() + size_t(r) * n * esz;
    } else {
      in = rm.data();
      recv[size_t(r)] = rm.data();
    }
    fillRandom(in, sendElems, c.type, rng);
    send[size_t(r)] = in;
    input[size_t(r)].assign(in, in + sendElems * esz);
    before[size_t(r)].assign(recv[size_t(r)], recv[size_t(r)] + recvElems * esz);
  }

  // Expected outputs: the host arithmetic, ranks combined in rank order.
  loom::Device& host = loom::hostDevice();
  auto fold = [&](size_t blockOff, std::vector<uint8_t>* out) {
    out->assign(input[0].begin() + long(blockOff), input[0].begin() + long(blockOff + n * esz));
    for (int q = 1; q < N; ++q)
      host.reduce(out->data(), out->data(), input[size_t(q)].data() + blockOff, n, c.type, c.op);
    if (c.op == loomAvg) host.divide(out->data(), out->data(), n, c.type, N);
  };
  std::vector<std::vector<uint8_t>> expect(static_cast<size_t>(N));
  for (int r = 0; r < N; ++r) {
    std::vector<uint8_t>& e = expect[size_t(r)];
    switch (c.v.coll) {
      case Collective::AllReduce:
        fold(0, &e);
        break;
      case Collective::ReduceScatter:
        fold(size_t(r) * n * esz, &e);
        break;
      case Collective::AllGather:
        for (int q = 0; q < N; ++q) e.insert(e.end(), input[size_t(q)].begin(), input[size_t(q)].end());
        break;
      case Collective::Broadcast:
        e = input[size_t(c.root)];
        break;
      case Collective::Reduce:
        if (r == c.root)
          fold(0, &e);
        else
          e = before[size_t(r)];  // untouched
        break;
      case Collective::AllToAll:  // block q of rank r's output: block r of rank q's input
        for (int q = 0; q < N; ++q)
          e.insert(e.end(), input[size_t(q)].begin() + long(size_t(r) * n * esz),
                   input[size_t(q)].begin() + long(size_t(r + 1) * n * esz));
        break;
      case Collective::Gather:
        if (r == c.root)
          for (int q = 0; q < N; ++q) e.insert(e.end(), input[size_t(q)].begin(), input[size_t(q)].end());
        else
          e = before[size_t(r)];  // untouched
        break;
      case Collective::Scatter:
        e.assign(input[size_t(c.root)].begin() + long(size_t(r) * n * esz),
                 input[size_t(c.root)].begin() + long(size_t(r + 1) * n * esz));
        break;
      case Collective::P2P:  // stream programs do not serve it
        break;
    }
  }

  for (int r = 0; r < N; ++r) {
    loom::OpDesc op;
    op.coll = c.v.coll;
    op.sendbuf = send[size_t(r)];
    op.recvbuf = recv[size_t(r)];
    op.count = n;
    op.dtype = c.type;
    op.op = c.op;
    op.root = c.root;
    loom::StreamPublish pub;
    pub.cells = c.publish > 0;
    pub.mine = (c.publish == 2 || (c.publish == 3 && r % 2 == 1)) && loom::mayPublish(op, r, N, c.v.algo);
    loom::StreamProgram p = loom::compileStreamProgram(op, r, N, c.v.algo, slotBytes, &w.round(r), pub);
    loom::ProgramBuffers b = w.buffers(r, send[size_t(r)], sendElems * esz, recv[size_t(r)], recvElems * esz);
    if (pub.cells) w.addCells(r, b, pub.mine);
    loom::enqueueProgram(w.rank(r), p, b);
  }
  std::string problems;
  for (int r = 0; r < N; ++r) {
    std::string msg;
    loomResult_t res = w.rank(r).synchronize(&msg);
    if (res != loomSuccess) problems += loom::strf("rank %d failed (%d): %s; ", r, int(res), msg.c_str());
  }
  if (!problems.empty()) return problems;
  for (int r = 0; r < N; ++r) {
    const std::vector<uint8_t>& e = expect[size_t(r)];
    if (!e.empty() && memcmp(recv[size_t(r)], e.data(), e.size()) != 0) {
      size_t i = 0;
      while (recv[size_t(r)][i] == e[i]) ++i;
      return loom::strf("rank %d: wrong result at element %zu of %zu", r, i / esz, e.size() / esz);
    }
    if (!recvMem[size_t(r)].guardsIntact()) return loom::strf("rank %d: recv guard overwritten", r);
    const bool rootOnly = c.v.coll == Collective::Gather || c.v.coll == Collective::Scatter;
    if (!inPlace || (rootOnly && r != c.root)) {
      const std::vector<uint8_t>& in = input[size_t(r)];
      if (!in.empty() && memcmp(send[size_t(r)], in.data(), in.size()) != 0)
        return loom::strf("rank %d: send buffer changed", r);
      if (!sendMem[size_t(r)].guardsIntact()) return loom::strf("rank %d: send guard overwritten", r);
    }
  }
  return "";
}

bool check(loomsim::SimDeviceWorld& w, const Case& c, size_t slotBytes, uint64_t seed) {
  std::string why = runCase(w, c, slotBytes, seed);
  INFO(caseName(c, w.nranks()) << ": " << why);
  CHECK(why.empty());
  return why.empty();
}

}  // namespace

TEST_CASE(
    "stream programs: every collective and variant is exact for N = 1..8, on one shared device and on "
    "several",
    "[streamprog]") {
  const size_t slot = 2048;  // small slots: many rounds, both slots, the reuse guard
  uint64_t seed = 1;
  for (int n = 1; n <= 8; ++n)
    for (int gpus : std::vector<int>(n == 1 ? std::vector<int>{1} : std::vector<int>{1, n})) {
      loomsim::SimDeviceWorld w(n, gpus, loom::streamWindowBytes(slot));
      for (const Variant& v : kVariants)
        for (loomDataType_t t :
             {loomBfloat16, loomInt64})  // 2- and 8-byte elements (every type: the next test)
          for (size_t count : {size_t(0), size_t(1), size_t(37), size_t(2053)})
            for (bool inPlace : {false, true}) {
              Case c;
              c.v = v;
              c.type = t;
              c.op = loomSum;
              c.count = count;
              c.root = (n - 1) / 2;
              c.inPlace = inPlace;
              if (!check(w, c, slot, seed++)) return;
            }
    }
}

TEST_CASE("stream programs: every datatype and op is exact, floats bit for bit with the host arithmetic",
          "[streamprog]") {
  const size_t slot = 4096;
  uint64_t seed = 100;
  for (int gpus : {1, 2}) {
    const int n = 3;
    loomsim::SimDeviceWorld w(n, gpus, loom::streamWindowBytes(slot));
    for (const Variant& v : kVariants) {
      if (!reducing(v.coll)) continue;
      for (loomDataType_t t : kAllTypes)
        for (loomRedOp_t op : kAllOps)
          for (bool inPlace : {false, true}) {
            Case c;
            c.v = v;
            c.type = t;
            c.op = op;
            c.count = 1031;
            c.root = 1;
            c.inPlace = inPlace;
            if (!check(w, c, slot, seed++)) return;
          }
    }
  }
}

TEST_CASE(
    "stream programs: large sizes are exact (all-reduce 1 Mi float32 with 4 and 8 ranks, the others 256 Ki)",
    "[streamprog]") {
  const size_t slot = 256 << 10;
  for (int n : {4, 8}) {
    loomsim::SimDeviceOptions o;
    o.pausePermille = 0;  // thousands of ops: pauses would only make it slow
    loomsim::SimDeviceWorld w(n, 2, loom::streamWindowBytes(slot), o);
    for (const Variant& v : kVariants) {
      if (v.coll != Collective::AllReduce && n != 4) continue;
      Case c;
      c.v = v;
      c.type = loomFloat32;
      c.op = loomSum;
      c.count = v.coll == Collective::AllReduce ? (size_t(1) << 20) + 3 : (size_t(1) << 18) + 3;
      c.root = 1;
      c.inPlace = v.algo == StreamAlgorithm::OneShot;
      check(w, c, slot, 7);
    }
  }
}

TEST_CASE(
    "stream programs: a collective reads its input only after the caller's earlier work, and later work "
    "follows it",
    "[streamprog]") {
  const size_t slot = 512;
  for (const Variant& v : kVariants) {
    const int N = 4;
    loomsim::SimDeviceWorld w(N, 1, loom::streamWindowBytes(slot));
    const size_t n = 1000;
    const bool nIn = v.coll == Collective::ReduceScatter || v.coll == Collective::AllToAll ||
                     v.coll == Collective::Scatter;
    const bool nOut = v.coll == Collective::AllGather || v.coll == Collective::AllToAll ||
                      v.coll == Collective::Gather;
    size_t sendElems = nIn ? N * n : n;
    size_t recvElems = nOut ? N * n : n;
    std::vector<std::vector<int32_t>> send(N, std::vector<int32_t>(sendElems, -1)),
        recv(N, std::vector<int32_t>(recvElems, -7)), seen(N);
    for (int r = 0; r < N; ++r) {
      // The caller's "kernel" produces the input late (while the program is
      // already enqueued behind it) ...
      w.rank(r).enqueueWork(0, [&, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        for (size_t i = 0; i < sendElems; ++i) send[size_t(r)][i] = int32_t(1000 * r + int(i % 997));
      });
      loom::OpDesc op;
      op.coll = v.coll;
      op.sendbuf = send[size_t(r)].data();
      op.recvbuf = recv[size_t(r)].data();
      op.count = n;
      op.dtype = loomInt32;
      op.op = loomSum;
      op.root = 2;
      loom::StreamProgram p = loom::compileStreamProgram(op, r, N, v.algo, slot, &w.round(r));
      loom::enqueueProgram(
          w.rank(r), p,
          w.buffers(r, send[size_t(r)].data(), sendElems * 4, recv[size_t(r)].data(), recvElems * 4));
      // ... and the next "kernel" on the caller's stream snapshots the output.
      w.rank(r).enqueueWork(0, [&, r] { seen[size_t(r)] = recv[size_t(r)]; });
    }
    for (int r = 0; r < N; ++r) {
      std::string msg;
      REQUIRE(w.rank(r).synchronize(&msg) == loomSuccess);
    }
    for (int r = 0; r < N; ++r) {
      INFO(loom::collectiveName(v.coll) << "/" << loom::streamAlgorithmName(v.algo) << " rank " << r);
      // The snapshot taken after the collective in stream order is the final
      // result, and the result is of the late input, not of the -1s.
      CHECK(seen[size_t(r)] == recv[size_t(r)]);
      size_t bad = 0;
      for (size_t i = 0; i < recvElems; ++i) {
        int32_t want = 0;
        int32_t e = int32_t(i % n % 997);
        switch (v.coll) {
          case Collective::AllReduce:
            want = N * e + 1000 * (0 + 1 + 2 + 3);
            break;
          case Collective::ReduceScatter: {
            int32_t g = int32_t((size_t(r) * n + i) % 997);
            want = N * g + 1000 * 6;
            break;
          }
          case Collective::AllGather:
            want = int32_t(1000 * (i / n)) + e;
            break;
          case Collective::Broadcast:
            want = 2000 + e;
            break;
          case Collective::Reduce:
            want = r == 2 ? N * e + 6000 : -7;
            break;
          case Collective::AllToAll:  // block q: rank q's block r
            want = int32_t(1000 * (i / n)) + int32_t((size_t(r) * n + i % n) % 997);
            break;
          case Collective::Gather:
            want = r == 2 ? int32_t(1000 * (i / n)) + e : -7;
            break;
          case Collective::Scatter:  // the root's block r
            want = 2000 + int32_t((size_t(r) * n + i) % 997);
            break;
          case Collective::P2P:  // stream programs do not serve it
            break;
        }
        if (recv[size_t(r)][i] != want) ++bad;
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("stream programs: a killed rank makes the others fail within the deadline, not hang",
          "[streamprog]") {
  for (StreamAlgorithm a : {StreamAlgorithm::OneShot, StreamAlgorithm::ReduceScatterAllGather})
    for (bool dies : {true, false}) {
      loomsim::SimDeviceOptions o;
      o.deadlineMs = 1500;
      o.peerShortcuts = true;  // the simulator's own failure path: no communicator releases here
      const int N = 4, victim = 2;
      const size_t slot = 1024, n = 5000;
      loomsim::SimDeviceWorld w(N, 1, loom::streamWindowBytes(slot), o);
      if (dies) w.kill(victim);
      std::vector<std::vector<float>> buf(N, std::vector<float>(n, 1.0f));
      auto start = std::chrono::steady_clock::now();
      for (int r = 0; r < N; ++r) {
        loom::OpDesc op;
        op.coll = Collective::AllReduce;
        op.sendbuf = op.recvbuf = buf[size_t(r)].data();
        op.count = n;
        loom::StreamProgram p = loom::compileStreamProgram(op, r, N, a, slot, &w.round(r));
        // Without `dies` the victim is alive but never joins.
        if (r != victim || dies)
          loom::enqueueProgram(w.rank(r), p,
                               w.buffers(r, buf[size_t(r)].data(), n * 4, buf[size_t(r)].data(), n * 4));
      }
      for (int r = 0; r < N; ++r) {
        if (r == victim) continue;
        std::string msg;
        loomResult_t res = w.rank(r).synchronize(&msg);
        INFO(loom::streamAlgorithmName(a) << (dies ? " killed" : " absent") << " rank " << r << ": " << msg);
        if (dies) {
          CHECK(res == loomRemoteError);
        } else {
          // Ranks waiting on the absent one time out; the rest may see that
          // failure first (remote error).
          CHECK((res == loomTimeout || res == loomRemoteError));
        }
        CHECK(!msg.empty());
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      // Each wait gives up after deadlineMs; a chain of failures takes about one.
      CHECK(s < 10.0);
    }
}

TEST_CASE(
    "stream programs: flag values only grow, every wait is answered by a set, and each round uses one slot",
    "[streamprog]") {
  for (const Variant& v : kVariants)
    for (int n : {2, 5}) {
      std::vector<uint64_t> round(size_t(n), 0);
      std::vector<std::vector<loom::StreamProgram>> progs(static_cast<size_t>(n));
      for (int k = 0; k < 3; ++k)
        for (int r = 0; r < n; ++r) {
          loom::OpDesc op;
          op.coll = v.coll;
          op.sendbuf = reinterpret_cast<void*>(0x1000);
          op.recvbuf = reinterpret_cast<void*>(0x900000);
          op.count = 700 + size_t(k);
          op.root = k % n;
          progs[size_t(r)].push_back(loom::compileStreamProgram(op, r, n, v.algo, 1024, &round[size_t(r)]));
        }
      for (int r = 1; r < n; ++r) CHECK(round[size_t(r)] == round[0]);
      // Every (rank, flag) value set is strictly larger than the one before;
      // every wait names a value its owner sets in the same operation.
      for (int k = 0; k < 3; ++k) {
        for (int r = 0; r < n; ++r) {
          const loom::StreamProgram& p = progs[size_t(r)][size_t(k)];
          for (const loom::StreamOp& o : p.ops) {
            if (o.kind != loom::StreamOpKind::WaitFlag) continue;
            if (o.flag == loom::kFlagDone && o.value < p.firstRound + 1) continue;  // an earlier op's round
            bool answered = false;
            for (const loom::StreamOp& s : progs[size_t(o.flagRank)][size_t(k)].ops)
              answered |= s.kind == loom::StreamOpKind::SetFlag && s.flag == o.flag && s.value == o.value;
            INFO(loom::collectiveName(v.coll) << " rank " << r << " op " << k << "\n" << p.describe());
            CHECK(answered);
          }
        }
      }
      for (int r = 0; r < n; ++r) {
        uint64_t last[loom::kFlagCount] = {};
        for (const loom::StreamProgram& p : progs[size_t(r)])
          for (const loom::StreamOp& o : p.ops)
            if (o.kind == loom::StreamOpKind::SetFlag) {
              CHECK(o.value > last[o.flag]);
              last[o.flag] = o.value;
            }
      }
    }
}

TEST_CASE(
    "stream programs: a program that would touch memory outside its buffers is refused before anything runs",
    "[streamprog]") {
  loomsim::SimDeviceWorld w(2, 1, 4096);
  std::vector<float> a(100), b(100);
  loom::OpDesc op;
  op.coll = Collective::AllReduce;
  op.sendbuf = a.data();
  op.recvbuf = b.data();
  op.count = 100;
  uint64_t round = 0;
  loom::StreamProgram p = loom::compileStreamProgram(op, 0, 2, StreamAlgorithm::OneShot, 2048, &round);
  // The buffers are smaller than the program's count.
  try {
    loom::enqueueProgram(w.rank(0), p, w.buffers(0, a.data(), 50 * 4, b.data(), 100 * 4));
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(e.code() == loomInternalError);
    CHECK(std::string(e.what()).find("past the send buffer") != std::string::npos);
  }
  // Nothing of it was enqueued: no flag was set.
  std::string msg;
  CHECK(w.rank(0).synchronize(&msg) == loomSuccess);
  CHECK(w.flag(0, loom::kFlagInput) == 0);
}

TEST_CASE(
    "stream programs: a reduction into its own sources (beyond one pass), a second destination over part of a "
    "source, overlapping destinations, or a second destination on a copy are refused before anything runs",
    "[streamprog]") {
  loomsim::SimDeviceWorld w(1, 1, 4096);
  std::vector<float> a(256), b(256);
  auto ref = [](loom::Space sp, size_t off) { return loom::ProgramRef{sp, 0, off}; };
  // dst, optional dst2, sources: each case one op, plus a flag set before
  // it that must not happen when the op is refused.
  struct Case {
    const char* why;
    loom::StreamOpKind kind;
    loom::ProgramRef dst;
    bool dual;
    loom::ProgramRef dst2;
    std::vector<loom::ProgramRef> srcs;
  };
  using loom::Space;
  const std::vector<Case> cases = {
      {"reduces into one of its sources", loom::StreamOpKind::Reduce, ref(Space::Recv, 0), false, {},
       {ref(Space::Send, 0), ref(Space::Recv, 64)}},
      // Exactly one of its sources is allowed in one pass only (at most
      // kOnePassSources): 9 are chained through dst.
      {"reduces into one of its sources", loom::StreamOpKind::Reduce, ref(Space::Recv, 0), false, {},
       {ref(Space::Recv, 0), ref(Space::Send, 0), ref(Space::Window, 0), ref(Space::Window, 512),
        ref(Space::Window, 1024), ref(Space::Window, 1536), ref(Space::Window, 2048), ref(Space::Window, 2560),
        ref(Space::Window, 3072)}},
      {"writes its second destination over part of a source", loom::StreamOpKind::Reduce, ref(Space::Window, 0),
       true, ref(Space::Recv, 4), {ref(Space::Send, 0), ref(Space::Recv, 0)}},
      {"has overlapping destinations", loom::StreamOpKind::Reduce, ref(Space::Window, 0), true,
       ref(Space::Window, 64), {ref(Space::Send, 0)}},
      {"has a second destination but is no reduction", loom::StreamOpKind::Copy, ref(Space::Window, 0), true,
       ref(Space::Recv, 0), {ref(Space::Send, 0)}},
  };
  for (const Case& c : cases) {
    INFO(c.why);
    loom::StreamProgram p;
    p.rank = 0;
    p.nranks = 1;
    loom::StreamOp set;
    set.kind = loom::StreamOpKind::SetFlag;
    set.flag = loom::kFlagInput;
    set.value = 1;
    p.ops.push_back(set);
    loom::StreamOp o;
    o.kind = c.kind;
    o.dst = c.dst;
    o.dual = c.dual;
    o.dst2 = c.dst2;
    o.srcBegin = 0;
    o.srcCount = uint32_t(c.srcs.size());
    o.count = c.kind == loom::StreamOpKind::Copy ? 128 * 4 : 128;  // copies count bytes
    p.srcs = c.srcs;
    p.ops.push_back(o);
    try {
      loom::enqueueProgram(w.rank(0), p, w.buffers(0, a.data(), a.size() * 4, b.data(), b.size() * 4));
      FAIL("no error");
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomInternalError);
      CHECK(std::string(e.what()).find(c.why) != std::string::npos);
    }
    std::string msg;
    CHECK(w.rank(0).synchronize(&msg) == loomSuccess);
    CHECK(w.flag(0, loom::kFlagInput) == 0);
  }
  // The second destination exactly one of the sources (an in-place
  // caller's buffer) is what the all-reduce does, and runs.
  loom::StreamProgram p;
  p.rank = 0;
  p.nranks = 1;
  p.srcs = {ref(Space::Send, 0), ref(Space::Window, 1024)};
  loom::StreamOp o;
  o.kind = loom::StreamOpKind::Reduce;
  o.dst = ref(Space::Window, 0);
  o.dual = true;
  o.dst2 = ref(Space::Send, 0);
  o.srcCount = 2;
  o.count = 128;
  p.ops.push_back(o);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i);
  loom::ProgramBuffers buf = w.buffers(0, a.data(), a.size() * 4, b.data(), b.size() * 4);
  std::fill(reinterpret_cast<float*>(buf.windows[0] + 1024), reinterpret_cast<float*>(buf.windows[0] + 1024) + 128,
            0.5f);
  // Send is read-only to programs, so it cannot be dst2: refused as such.
  try {
    loom::enqueueProgram(w.rank(0), p, buf);
    FAIL("no error");
  } catch (const loom::Error& e) {
    CHECK(std::string(e.what()).find("writes the send buffer") != std::string::npos);
  }
  p.srcs[0] = ref(Space::Recv, 0);  // in place: recv is both a source and the second destination
  p.ops[0].dst2 = ref(Space::Recv, 0);
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(i);
  loom::enqueueProgram(w.rank(0), p, buf);
  std::string msg;
  REQUIRE(w.rank(0).synchronize(&msg) == loomSuccess);
  for (size_t i = 0; i < 128; ++i) {
    CHECK(b[i] == float(i) + 0.5f);
    CHECK(reinterpret_cast<const float*>(buf.windows[0])[i] == float(i) + 0.5f);
  }
}

TEST_CASE(
    "stream programs: ranks on their own threads, each compiling, enqueueing and synchronizing, stay exact",
    "[streamprog]") {
  const int N = 8, kOpsPerRank = 24;
  const size_t slot = 1024, n = 777;
  loomsim::SimDeviceWorld w(N, 3, loom::streamWindowBytes(slot));  // 3 devices: some shared by 3 ranks
  std::vector<std::string> errors(static_cast<size_t>(N));
  std::vector<std::thread> threads;
  for (int r = 0; r < N; ++r)
    threads.emplace_back([&, r] {
      std::vector<int32_t> buf(n);
      for (int k = 0; k < kOpsPerRank && errors[size_t(r)].empty(); ++k) {
        for (size_t i = 0; i < n; ++i) buf[i] = int32_t(r + 1 + k + int(i));
        loom::OpDesc op;
        op.sendbuf = op.recvbuf = buf.data();
        op.count = n;
        op.dtype = loomInt32;
        StreamAlgorithm a = k % 2 ? StreamAlgorithm::OneShot : StreamAlgorithm::ReduceScatterAllGather;
        loom::StreamProgram p = loom::compileStreamProgram(op, r, N, a, slot, &w.round(r));
        loom::enqueueProgram(w.rank(r), p, w.buffers(r, buf.data(), n * 4, buf.data(), n * 4));
        std::string msg;
        if (w.rank(r).synchronize(&msg) != loomSuccess) {
          errors[size_t(r)] = msg;
          break;
        }
        for (size_t i = 0; i < n; ++i)
          if (buf[i] != int32_t(N * (N + 1) / 2 + N * (k + int(i)))) {
            errors[size_t(r)] = loom::strf("op %d: wrong element %zu", k, i);
            break;
          }
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < N; ++r) {
    INFO("rank " << r << ": " << errors[size_t(r)]);
    CHECK(errors[size_t(r)].empty());
  }
}

TEST_CASE(
    "simulated device: a kernel spinning on a peer's flag starves the peer that shares its device (why "
    "programs "
    "only use stream waits)",
    "[streamprog]") {
  for (int gpus : {1, 2}) {
    loomsim::SimDeviceOptions o;
    o.pausePermille = 0;
    loomsim::SimDeviceWorld w(2, gpus, 4096, o);
    loom::ProgramBuffers b = w.buffers(1, nullptr, 0, nullptr, 0);
    auto* flag = reinterpret_cast<std::atomic<uint64_t>*>(b.flags[1] + loom::kFlagInput);
    bool seen = false;
    std::atomic<bool> running{false};
    // Rank 0's "kernel" polls rank 1's flag for 300 ms; rank 1 sets it with
    // a stream write, which needs its device.
    w.rank(0).enqueueWork(0, [&] {
      running = true;
      auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
      while (!seen && std::chrono::steady_clock::now() < end) seen = flag->load() >= 1;
    });
    while (!running) std::this_thread::yield();
    w.rank(1).setFlag(0, b.flags[1] + loom::kFlagInput, 1);
    std::string msg;
    REQUIRE(w.rank(0).synchronize(&msg) == loomSuccess);
    REQUIRE(w.rank(1).synchronize(&msg) == loomSuccess);
    INFO(gpus << " device(s)");
    CHECK(seen == (gpus == 2));  // one device: the write waits for the spinning kernel to give up
  }
}

namespace {
// Bytes a program reads plus bytes it writes (what bounds a large
// collective when every rank shares one GPU's memory).
size_t traffic(const loom::StreamProgram& p) {
  const size_t esz = loom::dtypeSize(p.dtype);
  size_t t = 0;
  for (const loom::StreamOp& o : p.ops) switch (o.kind) {
      case loom::StreamOpKind::Copy:
        t += 2 * o.count;
        break;
      case loom::StreamOpKind::Reduce:
        t += (o.srcCount + 1 + (o.dual ? 1 : 0)) * o.count * esz;
        break;
      case loom::StreamOpKind::Divide:
        t += 2 * o.count * esz;
        break;
      default:
        break;
    }
  return t;
}
}  // namespace

TEST_CASE(
    "stream programs: memory traffic per rank is what the layout promises (all-reduce (5N-2)/N x bytes, its own "
    "part never staged, reduce-scatter and all-to-all stage no block of their own)",
    "[streamprog]") {
  const size_t slot = 64 << 10, esz = 4;
  for (int N = 2; N <= 8; ++N)
    for (size_t n : {size_t(1000), size_t(100003)})
      for (bool inPlace : {false, true})
        for (int r : {0, N - 1}) {
          INFO("N=" << N << " n=" << n << " in place " << inPlace << " rank " << r);
          std::vector<uint8_t> a(size_t(N) * n * esz), c(size_t(N) * n * esz);
          loom::OpDesc op;
          op.dtype = loomFloat32;
          op.op = loomSum;
          op.count = n;
          op.sendbuf = a.data();
          op.recvbuf = inPlace ? a.data() : c.data();
          // All-reduce, reduce-scatter + all-gather: per round of c elements
          // and own part pl, 2(c - pl) copied in, (N + 2) pl reduced, 2(c -
          // pl) copied out: 4n + (N - 2) * sum(pl) in all.
          op.coll = Collective::AllReduce;
          uint64_t round = 0;
          loom::StreamProgram p =
              loom::compileStreamProgram(op, r, N, StreamAlgorithm::ReduceScatterAllGather, slot, &round);
          const size_t B = n * esz, rounds = size_t(p.rounds);
          // Rounds are whole slots (the reduced part takes the place of the
          // input part a rank does not stage).
          CHECK(rounds == (B + slot - 1) / slot);
          // Parts start on whole 256-byte lines: each is within a line of
          // an N-th of its round.
          CHECK(traffic(p) <= 4 * B + size_t(N - 2) * (B / size_t(N) + rounds * 256));
          CHECK(traffic(p) + size_t(N - 2) * rounds * 256 >= 4 * B + size_t(N - 2) * (B / size_t(N)));
          for (const loom::StreamOp& o : p.ops)
            if (o.kind == loom::StreamOpKind::Reduce) CHECK(o.dst.offset % 256 == 0);  // aligned parts
          // loomAvg divides in the window, then copies its part out too.
          op.op = loomAvg;
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::ReduceScatterAllGather, slot, &round);
          CHECK(traffic(p) <= 6 * B + size_t(N) * (B / size_t(N) + rounds * 256));
          op.op = loomSum;
          // Reduce-scatter out of place: (N-1) blocks staged, N read + 1
          // written: (3N - 1) x the output.  In place (NCCL's layout) the own
          // block is staged too: (3N + 1).
          op.coll = Collective::ReduceScatter;
          op.recvbuf = inPlace ? a.data() + size_t(r) * B : c.data();
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round);
          CHECK(traffic(p) == size_t(inPlace ? 3 * N + 1 : 3 * N - 1) * B);
          // All-to-all: (N-1) blocks staged and read out, the own block
          // copied straight across (in place: left where it is).
          op.coll = Collective::AllToAll;
          op.recvbuf = inPlace ? a.data() : c.data();
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round);
          CHECK(traffic(p) == size_t(4 * (N - 1) + (inPlace ? 0 : 2)) * B);
          // Zero-copy all-reduce, published: nothing staged, the own part
          // reduced into the recv buffer alone, the others' parts copied
          // straight from theirs: per round (N + 1) pl + 2 (c - pl), 2n +
          // (N - 1) * sum(pl) in all ((3N-1)/N x bytes: 2.5 at N = 2).
          op.coll = Collective::AllReduce;
          op.recvbuf = inPlace ? a.data() : c.data();
          loom::StreamPublish pub;
          pub.cells = pub.mine = true;
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::ReduceScatterAllGather, slot, &round, pub);
          CHECK(traffic(p) <= 2 * B + size_t(N - 1) * (B / size_t(N) + rounds * 256));
          CHECK(traffic(p) + size_t(N - 1) * rounds * 256 >= 2 * B + size_t(N - 1) * (B / size_t(N)));
          size_t windowWrites = 0, cellWrites = 0;
          for (const loom::StreamOp& o : p.ops) {
            windowWrites += o.dst.space == loom::Space::Window || (o.dual && o.dst2.space == loom::Space::Window);
            cellWrites += o.kind == loom::StreamOpKind::SetCell;
          }
          CHECK(windowWrites == 0);
          // Two cells per peer for each slot the program uses, once.
          CHECK(cellWrites == size_t(2 * (N - 1)) * std::min<size_t>(2, rounds));
          // Not publishing (but reading the peers through cells): the
          // window layout's traffic, and the same cell writes (zeros).
          pub.mine = false;
          pub.write[1] = false;  // slot 1's cells already hold what this program publishes
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::ReduceScatterAllGather, slot, &round, pub);
          CHECK(traffic(p) <= 4 * B + size_t(N - 2) * (B / size_t(N) + rounds * 256));
          cellWrites = 0;
          for (const loom::StreamOp& o : p.ops) cellWrites += o.kind == loom::StreamOpKind::SetCell;
          CHECK(cellWrites == size_t(2 * (N - 1)));
          // Reduce-scatter, published: nothing staged, N blocks read and
          // one written, (N + 1) x the output, in and out of place.
          op.coll = Collective::ReduceScatter;
          op.recvbuf = inPlace ? a.data() + size_t(r) * B : c.data();
          pub.mine = true;
          pub.write[1] = true;
          REQUIRE(loom::mayPublish(op, r, N, StreamAlgorithm::OneShot));
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round, pub);
          CHECK(traffic(p) == size_t(N + 1) * B);
          // All-gather, published: the others' blocks copied straight from
          // their send buffers, the own block across (in place: there).
          op.coll = Collective::AllGather;
          op.sendbuf = inPlace ? c.data() + size_t(r) * B : a.data();
          op.recvbuf = c.data();
          REQUIRE(loom::mayPublish(op, r, N, StreamAlgorithm::OneShot));
          round = 0;
          p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round, pub);
          CHECK(traffic(p) == size_t(2 * (N - 1) + (inPlace ? 0 : 2)) * B);
          // All-to-all, published (out of place only): nothing staged, the
          // others' chunks copied straight from their send buffers, the own
          // block across: 2N x a block, against 4(N - 1) + 2.
          op.coll = Collective::AllToAll;
          op.sendbuf = a.data();
          op.recvbuf = inPlace ? a.data() : c.data();
          CHECK(loom::mayPublish(op, r, N, StreamAlgorithm::OneShot) == !inPlace);
          if (!inPlace) {
            round = 0;
            p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round, pub);
            CHECK(traffic(p) == size_t(2 * N) * B);
          }
          // Rooted, published by the side the others read: a broadcast or
          // scatter root moves only its own block into its output (nothing
          // in place), a reduce's or gather's sender nothing at all.
          for (Collective rc : {Collective::Broadcast, Collective::Reduce, Collective::Gather, Collective::Scatter}) {
            INFO(loom::collectiveName(rc));
            op.coll = rc;
            const bool rootSide = rc == Collective::Broadcast || rc == Collective::Scatter;
            op.root = rootSide ? r : (r + 1) % N;  // this rank is the side that publishes
            op.sendbuf = a.data();
            op.recvbuf = rc == Collective::Scatter && inPlace ? a.data() + size_t(r) * B
                         : inPlace && rc == Collective::Broadcast ? a.data() : c.data();
            REQUIRE(loom::mayPublish(op, r, N, StreamAlgorithm::OneShot));
            round = 0;
            p = loom::compileStreamProgram(op, r, N, StreamAlgorithm::OneShot, slot, &round, pub);
            CHECK(traffic(p) == (rootSide && !inPlace ? 2 * B : 0));
            op.root = rootSide ? (r + 1) % N : r;  // the other side never publishes
            CHECK_FALSE(loom::mayPublish(op, r, N, StreamAlgorithm::OneShot));
          }
        }
}

TEST_CASE(
    "stream programs, device zero-copy: every collective is exact whoever publishes (nobody, everyone, odd ranks), "
    "N = 1..8, every op, in and out of place, roots varied, one device and several",
    "[streamprog]") {
  const size_t slot = 2048;
  uint64_t seed = 500;
  for (int n = 1; n <= 8; ++n)
    for (int gpus : std::vector<int>(n == 1 ? std::vector<int>{1} : std::vector<int>{1, n})) {
      loomsim::SimDeviceWorld w(n, gpus, loom::streamWindowBytes(slot));
      uint64_t published = 0, fellBack = 0;
      // Modes in an order that flips every cell between programs: what a
      // rank published before must not leak into the next program.
      for (int mode : {2, 1, 3, 2, 0, 3, 1})
        for (const Variant& v : {Variant{Collective::AllReduce, StreamAlgorithm::ReduceScatterAllGather},
                                 Variant{Collective::ReduceScatter, StreamAlgorithm::OneShot},
                                 Variant{Collective::AllGather, StreamAlgorithm::OneShot},
                                 Variant{Collective::AllToAll, StreamAlgorithm::OneShot},
                                 Variant{Collective::Broadcast, StreamAlgorithm::OneShot},
                                 Variant{Collective::Reduce, StreamAlgorithm::OneShot},
                                 Variant{Collective::Gather, StreamAlgorithm::OneShot},
                                 Variant{Collective::Scatter, StreamAlgorithm::OneShot}})
        for (loomRedOp_t op : {loomSum, loomAvg, loomMax})
          for (size_t count : {size_t(1), size_t(37), size_t(2053)})
            for (bool inPlace : {false, true}) {
              if (op != loomSum && !loom::reduces(v.coll)) continue;  // the op changes nothing there
              Case c;
              c.v = v;
              c.root = int((count + size_t(mode)) % size_t(n));
              c.type = op == loomMax ? loomInt64 : loomBfloat16;
              c.op = op;
              c.count = count;
              c.inPlace = inPlace;
              c.publish = mode;
              if (!check(w, c, slot, seed++)) return;
            }
      for (int r = 0; r < n; ++r) {
        published += w.rank(r).publishedReads();
        fellBack += w.rank(r).fallbackReads();
      }
      INFO("N=" << n << " gpus=" << gpus << ": " << published << " published reads, " << fellBack << " fallbacks");
      if (n > 1) {
        CHECK(published > 0);  // the modes that publish do read in place
        CHECK(fellBack > 0);   // and the others read windows
      }
    }
}

TEST_CASE(
    "stream programs, device zero-copy: a published read that the publisher's buffer does not hold falls back "
    "to the window (mismatched counts read no byte past the buffer)",
    "[streamprog]") {
  // Rank 1 publishes a recv buffer of 16 elements while rank 0 all-reduces
  // 1024: rank 0's reads of rank 1's parts past those bytes fall back.
  const size_t slot = 4096;
  loomsim::SimDeviceOptions o;
  o.pausePermille = 0;
  loomsim::SimDeviceWorld w(2, 1, loom::streamWindowBytes(slot), o);
  std::vector<float> a(1024, 1.0f), b(1024, 2.0f), ra(1024), rb(1024);
  for (int r = 0; r < 2; ++r) {
    loom::OpDesc op;
    op.sendbuf = r ? b.data() : a.data();
    op.recvbuf = r ? rb.data() : ra.data();
    op.count = 1024;
    loom::StreamPublish pub;
    pub.cells = true;
    pub.mine = r == 1;
    loom::StreamProgram p =
        loom::compileStreamProgram(op, r, 2, StreamAlgorithm::ReduceScatterAllGather, slot, &w.round(r), pub);
    loom::ProgramBuffers buf = w.buffers(r, op.sendbuf, 4096, op.recvbuf, 4096);
    w.addCells(r, buf, pub.mine);
    if (r == 1)  // what it publishes says 64 bytes
      for (auto& cells : buf.published)
        for (auto& cell : cells)
          if (cell.addr) cell.bytes = 64;
    loom::enqueueProgram(w.rank(r), p, buf);
  }
  std::string msg;
  REQUIRE(w.rank(0).synchronize(&msg) == loomSuccess);
  REQUIRE(w.rank(1).synchronize(&msg) == loomSuccess);
  CHECK(w.rank(0).publishedReads() == 0);
  CHECK(w.rank(0).fallbackReads() > 0);
  // Rank 1 staged nothing, so rank 0's result is whatever the window held:
  // wrong, but read from the window, never from past rank 1's buffer (ASan
  // would name a read out of bounds).  The mismatch check reports it.
}

TEST_CASE(
    "stream programs, device zero-copy: cells a rank published for an earlier program are not read in a later one "
    "that did not write them (their tag is older than the round), so a freed buffer is never read",
    "[streamprog]") {
  const size_t slot = 2048, n = 1500;  // two rounds: both slots
  loomsim::SimDeviceOptions o;
  o.pausePermille = 0;
  loomsim::SimDeviceWorld w(2, 1, loom::streamWindowBytes(slot), o);
  std::vector<std::vector<int32_t>> send(2, std::vector<int32_t>(n)), recv(2, std::vector<int32_t>(n));
  auto run = [&](int r, const int32_t* s, int32_t* d, bool cells, bool mine) {
    loom::OpDesc op;
    op.sendbuf = s;
    op.recvbuf = d;
    op.count = n;
    op.dtype = loomInt32;
    loom::StreamPublish pub;
    pub.cells = cells;
    pub.mine = mine;
    loom::StreamProgram p =
        loom::compileStreamProgram(op, r, 2, StreamAlgorithm::ReduceScatterAllGather, slot, &w.round(r), pub);
    loom::ProgramBuffers b = w.buffers(r, s, n * 4, d, n * 4);
    if (cells) w.addCells(r, b, mine);
    loom::enqueueProgram(w.rank(r), p, b);
  };
  // Program 0: rank 1 publishes its buffers.
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) send[size_t(r)][i] = int32_t(r + 1);
  for (int r = 0; r < 2; ++r) run(r, send[size_t(r)].data(), recv[size_t(r)].data(), true, r == 1);
  std::string msg;
  for (int r = 0; r < 2; ++r) REQUIRE(w.rank(r).synchronize(&msg) == loomSuccess);
  for (int r = 0; r < 2; ++r) CHECK(recv[size_t(r)][n - 1] == 3);
  const uint64_t published = w.rank(0).publishedReads();
  CHECK(published > 0);
  // "Freed": rank 1's old buffers now hold garbage, and its next program
  // (new buffers, run without cells) writes no cell; rank 0 still reads
  // through cells and must take rank 1's window.
  std::fill(send[1].begin(), send[1].end(), -1000000);
  std::fill(recv[1].begin(), recv[1].end(), -1000000);
  std::vector<int32_t> send1(n, 5), recv1(n, 0);
  for (size_t i = 0; i < n; ++i) send[0][i] = 10;
  run(0, send[0].data(), recv[0].data(), true, false);
  run(1, send1.data(), recv1.data(), false, false);
  for (int r = 0; r < 2; ++r) REQUIRE(w.rank(r).synchronize(&msg) == loomSuccess);
  long wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += (recv[0][i] != 15) + (recv1[i] != 15);
  CHECK(wrong == 0);
  CHECK(w.rank(0).publishedReads() == published);  // nothing read through the old cells
}


TEST_CASE(
    "stream programs, device zero-copy: a publishing rank's later work waits until the peers are done with its "
    "buffers (the caller may overwrite them at once): every collective",
    "[streamprog]") {
  const int N = 4, root = 2;
  const size_t slot = 1024, n = 1000;  // several rounds
  for (Collective coll : {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                          Collective::AllToAll, Collective::Broadcast, Collective::Reduce, Collective::Gather,
                          Collective::Scatter}) {
    INFO(loom::collectiveName(coll));
    const bool rs = coll == Collective::ReduceScatter, ag = coll == Collective::AllGather,
               a2a = coll == Collective::AllToAll;
    const size_t sendElems = rs || a2a || coll == Collective::Scatter ? N * n : n,
                 recvElems = ag || a2a || coll == Collective::Gather ? N * n : n;
    const StreamAlgorithm algo =
        coll == Collective::AllReduce ? StreamAlgorithm::ReduceScatterAllGather : StreamAlgorithm::OneShot;
    loomsim::SimDeviceWorld w(N, 1, loom::streamWindowBytes(slot));
    std::vector<std::vector<int32_t>> send(N, std::vector<int32_t>(sendElems)),
        recv(N, std::vector<int32_t>(recvElems)), seen(N, std::vector<int32_t>(recvElems));
    size_t bad = 0;
    for (int iter = 0; iter < 12; ++iter) {
      for (int r = 0; r < N; ++r)
        for (size_t j = 0; j < sendElems; ++j) send[size_t(r)][j] = int32_t(r * 1000 + iter + int(j % 89));
      for (int r = 0; r < N; ++r) {
        loom::OpDesc op;
        op.coll = coll;
        op.sendbuf = send[size_t(r)].data();
        op.recvbuf = recv[size_t(r)].data();
        op.count = n;
        op.dtype = loomInt32;
        op.root = root;
        loom::StreamPublish pub;
        pub.cells = true;
        pub.mine = loom::mayPublish(op, r, N, algo);
        loom::StreamProgram p = loom::compileStreamProgram(op, r, N, algo, slot, &w.round(r), pub);
        loom::ProgramBuffers b = w.buffers(r, op.sendbuf, sendElems * 4, op.recvbuf, recvElems * 4);
        w.addCells(r, b, pub.mine);
        loom::enqueueProgram(w.rank(r), p, b);
        // The caller's next kernel keeps the result and scribbles over both
        // buffers at once.
        w.rank(r).enqueueWork(0, [&, r] {
          seen[size_t(r)] = recv[size_t(r)];
          std::fill(send[size_t(r)].begin(), send[size_t(r)].end(), -1000000);
          std::fill(recv[size_t(r)].begin(), recv[size_t(r)].end(), -1000000);
        });
      }
      for (int r = 0; r < N; ++r) {
        std::string msg;
        REQUIRE(w.rank(r).synchronize(&msg) == loomSuccess);
      }
      for (int r = 0; r < N; ++r) {
        if ((coll == Collective::Reduce || coll == Collective::Gather) && r != root) continue;  // no output
        for (size_t i = 0; i < recvElems; ++i) {
          const int q = int(i / n);  // the rank whose block this is (all-gather, all-to-all, gather)
          int32_t want = 0;
          switch (coll) {
            case Collective::AllToAll:  // block r of rank q's input
              want = int32_t(q * 1000 + iter + int((size_t(r) * n + i % n) % 89));
              break;
            case Collective::AllGather:
            case Collective::Gather: want = int32_t(q * 1000 + iter + int(i % n % 89)); break;
            case Collective::ReduceScatter: want = int32_t(6000 + N * (iter + int((size_t(r) * n + i) % 89))); break;
            case Collective::Broadcast: want = int32_t(root * 1000 + iter + int(i % 89)); break;
            case Collective::Scatter: want = int32_t(root * 1000 + iter + int((size_t(r) * n + i) % 89)); break;
            default: want = int32_t(6000 + N * (iter + int(i % 89))); break;  // all-reduce, reduce
          }
          bad += seen[size_t(r)][i] != want;
        }
      }
    }
    CHECK(bad == 0);
    uint64_t published = 0;
    for (int r = 0; r < N; ++r) published += w.rank(r).publishedReads();
    CHECK(published > 0);
  }
}

TEST_CASE("simulated device: a capture that forks a second stream (events) replays as a graph: nothing runs at "
          "capture, each launch runs its branches concurrently and in their order with events of its own, and an "
          "unjoined branch or a wait across a capture's boundary is CUDA's error",
          "[sim][graph]") {
  loomsim::SimDeviceWorld w(1, 1, 256);
  loomsim::SimRank& r = w.rank(0);
  char key = 0, other = 0;
  const int c = r.addCallerStream(&key);
  const int o = r.addCallerStream(&other);
  auto throwsWith = [](const std::function<void()>& f, const char* text) {
    try {
      f();
    } catch (const loom::Error& e) {
      INFO(e.what());
      CHECK(std::string(e.what()).find(text) != std::string::npos);
      return true;
    }
    return false;
  };
  std::mutex mu;
  std::string log;
  auto note = [&](char ch) {
    std::lock_guard<std::mutex> g(mu);
    log += ch;
  };
  std::atomic<int> cRuns{0};
  r.beginCapture(&key);
  r.enqueueWork(c, [&] { note('a'); });
  r.recordEvent(c, 0);  // fork: stream 1 joins the capture
  r.waitEvent(1, 0);
  CHECK(r.captureOf(1) == r.captureOf(c));
  CHECK(r.captureOf(1) != 0);
  const int runs = 3;
  std::atomic<int> bRuns{0};
  r.enqueueWait(1, [&] {
    // A wait (holding no device) that passes once this launch's `c` has
    // run: the branches are concurrent (on one stream it would wait for
    // ever).
    const int mine = bRuns.fetch_add(1) + 1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (cRuns.load() < mine && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  });
  r.enqueueWork(1, [&] { note('b'); });
  r.recordEvent(1, 1);  // join
  r.enqueueWork(c, [&] {
    note('c');
    cRuns.fetch_add(1);
  });
  r.waitEvent(c, 1);
  r.enqueueWork(c, [&] { note('d'); });
  const loomsim::SimGraph g = r.endCapture(&key);
  CHECK(r.captureOf(1) == 0);  // the capture ended for every stream in it
  CHECK(r.captureOf(c) == 0);
  REQUIRE(g->lanes.size() == 2);
  std::string msg;
  REQUIRE(r.synchronize(&msg) == loomSuccess);
  CHECK(log.empty());  // a capture runs nothing
  for (int i = 0; i < runs; ++i) r.launchGraph(&key, g);
  REQUIRE(r.synchronize(&msg) == loomSuccess);
  INFO(msg);
  std::string expect;
  for (int i = 0; i < runs; ++i) expect += "acbd";  // b waits for c; d for both
  CHECK(log == expect);

  // A branch not joined back: the end is cudaErrorStreamCaptureUnjoined,
  // and the capture is over for both streams all the same.
  r.beginCapture(&key);
  r.recordEvent(c, 0);
  r.waitEvent(1, 0);
  r.enqueueWork(1, [] {});
  CHECK(throwsWith([&] { r.endCapture(&key); }, "cudaErrorStreamCaptureUnjoined"));
  CHECK(r.captureOf(1) == 0);
  CHECK(r.captureOf(c) == 0);

  // An eager event waited for in a capture, and a captured event waited
  // for by a stream of another capture: cudaErrorStreamCaptureIsolation.
  r.recordEvent(2, 2);
  r.beginCapture(&key);
  CHECK(throwsWith([&] { r.waitEvent(c, 2); }, "cudaErrorStreamCaptureIsolation"));
  r.beginCapture(&other);
  r.recordEvent(o, 3);
  CHECK(throwsWith([&] { r.waitEvent(c, 3); }, "cudaErrorStreamCaptureIsolation"));
  CHECK(throwsWith([&] { r.joinStream(c, o); }, "cudaErrorStreamCaptureIsolation"));
  CHECK(r.endCapture(&other)->empty() == false);
  CHECK(r.endCapture(&key)->empty());
  REQUIRE(r.synchronize(&msg) == loomSuccess);
}

TEST_CASE("stream programs: a replayable reduce-scatter + all-gather all-reduce keeps its second stream, forked "
          "after the start gate and joined before `end`, and a replayable send/recv group's receives run on a "
          "side stream of their own",
          "[stream][graph]") {
  loom::OpDesc op;
  op.coll = Collective::AllReduce;
  op.count = 3000;
  op.dtype = loomFloat32;
  op.op = loomSum;
  uint64_t round = 0;
  const loom::StreamProgram p = loom::makeReplayable(
      loom::compileStreamProgram(op, 1, 3, StreamAlgorithm::ReduceScatterAllGather, 1024, &round), 77);
  INFO(p.describe());
  CHECK(p.streams == 2);
  long gate = -1, fork = -1, join = -1, end = -1, first1 = -1, last1 = -1;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const loom::StreamOp& o = p.ops[i];
    if (o.kind == loom::StreamOpKind::WaitFlag && o.flag == loom::kFlagGraphSig) gate = long(i);
    if (o.kind == loom::StreamOpKind::WaitEvent && o.stream == 1 && fork < 0) fork = long(i);
    if (o.kind == loom::StreamOpKind::WaitEvent && o.stream == 0) join = long(i);
    if (o.kind == loom::StreamOpKind::SetFlag && o.flag == loom::kFlagGraphEnd && end < 0) end = long(i);
    if (o.stream == 1) {
      if (first1 < 0) first1 = long(i);
      last1 = long(i);
    }
  }
  CHECK(gate >= 0);
  CHECK(fork > gate);
  CHECK(first1 == fork);  // nothing on stream 1 before it follows the gate
  CHECK(join > last1);
  CHECK(end > join);
  size_t reductions1 = 0;
  for (const loom::StreamOp& o : p.ops) reductions1 += o.stream == 1 && o.kind == loom::StreamOpKind::Reduce;
  CHECK(reductions1 == 0);  // stream 1 gathers; the reductions stay on the caller's
  size_t copies1 = 0;
  for (const loom::StreamOp& o : p.ops) copies1 += o.stream == 1 && o.kind == loom::StreamOpKind::Copy;
  CHECK(copies1 > 0);

  // Send/recv: rank 0 sends to 1 and receives from 2 in one group.
  std::vector<loom::OpDesc> ops(2);
  for (int i = 0; i < 2; ++i) {
    ops[size_t(i)].coll = Collective::P2P;
    ops[size_t(i)].isSend = i == 0;
    ops[size_t(i)].peer = i == 0 ? 1 : 2;
    ops[size_t(i)].count = 700;
    ops[size_t(i)].dtype = loomUint8;
  }
  const loom::StreamProgram q = loom::compileGraphP2PProgram(ops, 0, 3, 512, loom::kGraphP2PBusy + 1);
  INFO(q.describe());
  CHECK(q.streams == 3);
  for (const loom::StreamOp& o : q.ops) {
    if (o.kind == loom::StreamOpKind::Copy)
      CHECK(o.stream == (o.dst.space == loom::Space::Recv ? 2 : 0));  // receives' copy-outs on stream 2
    if (o.kind == loom::StreamOpKind::WaitFlag && o.flagRank == 2) CHECK(o.stream == 2);  // waits for the sender
  }
}

TEST_CASE("stream programs: one that leaves a side stream unjoined, or a replayable one that lowers its busy mark "
          "before its end, is loomInternalError before anything is enqueued",
          "[stream][graph]") {
  loomsim::SimDeviceWorld w(2, 1, 1024);
  std::vector<uint8_t> in(64), out(64);
  for (size_t i = 0; i < in.size(); ++i) in[i] = uint8_t(i + 1);
  const loom::ProgramBuffers b = w.buffers(0, in.data(), in.size(), out.data(), out.size());
  auto op = [](loom::StreamOpKind k, int stream, int event = 0) {
    loom::StreamOp o;
    o.kind = k;
    o.stream = uint8_t(stream);
    o.event = event;
    return o;
  };
  auto errorOf = [&](const loom::StreamProgram& p) -> std::string {
    try {
      loom::enqueueProgram(w.rank(0), p, b);
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomInternalError);
      return e.what();
    }
    return "";
  };
  loom::StreamProgram p;
  p.nranks = 2;
  p.streams = 2;
  p.events = 2;
  loom::StreamOp copy = op(loom::StreamOpKind::Copy, 1);
  copy.dst = loom::ProgramRef{loom::Space::Recv, 0, 0};
  copy.count = 8;
  p.srcs.push_back(loom::ProgramRef{loom::Space::Send, 0, 0});
  copy.srcBegin = 0;
  copy.srcCount = 1;
  p.ops = {op(loom::StreamOpKind::RecordEvent, 0, 0), op(loom::StreamOpKind::WaitEvent, 1, 0), copy};
  CHECK(errorOf(p).find("leaves stream 1 unjoined") != std::string::npos);  // no join at all
  p.ops.push_back(op(loom::StreamOpKind::RecordEvent, 1, 1));
  CHECK(errorOf(p).find("unjoined") != std::string::npos);  // recorded, never waited for
  p.ops.push_back(op(loom::StreamOpKind::WaitEvent, 0, 0));
  CHECK(errorOf(p).find("unjoined") != std::string::npos);  // waited for another event
  p.ops.back().event = 1;
  CHECK(errorOf(p) == "");  // joined
  std::string msg;
  REQUIRE(w.rank(0).synchronize(&msg) == loomSuccess);
  CHECK(memcmp(out.data(), in.data(), 8) == 0);
  // Replayable: the busy mark goes down last, on stream 0.
  p.replayable = true;
  loom::StreamOp down = op(loom::StreamOpKind::SetLocal, 0);
  down.flagRank = 0;
  down.flag = loom::kFlagGraphBusy;
  down.value = 0;
  p.ops.insert(p.ops.begin() + 3, down);
  CHECK(errorOf(p).find("zeroes its busy mark at op #3") != std::string::npos);
  p.ops.erase(p.ops.begin() + 3);
  p.ops.push_back(down);
  CHECK(errorOf(p) == "");
  REQUIRE(w.rank(0).synchronize(&msg) == loomSuccess);
}
