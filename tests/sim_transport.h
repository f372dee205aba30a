// Schedule simulator: N virtual ranks as threads of one process, joined by an
// in-memory transport, run the real schedules (any algorithm entry point)
// with the real executor (loom::execute).  Header-only so that any
// tests/unit_*.cc can include it (the unit-test target globs only those).
//
// Transport.  For every ordered pair (src, dst) and channel there is one SPSC
// ring of `slots` slots of `slotBytes` payload bytes plus a SlotTag; head and
// tail are atomics (release on publish, acquire on read), so sendAcquire /
// sendPost on rank src pair with recvPeek / recvRelease on rank dst.  One
// SimConnection per (me, peer, channel) wraps the rings me->peer and
// peer->me.  Posting or releasing rings the peer's doorbell (a futex-like
// counter + condition variable), so sleeping ranks wake at once.  The
// connection also checks the executor's use of the interface (post without
// acquire, release without peek, 0 or oversized slots) and, with
// `poison`, scribbles over every slot it releases so that a read of a freed
// slot or a partly written slot shows up as a wrong result.  A rank that
// throws makes the others stop (checkAborted) instead of waiting for the
// timeout.
//
// API (namespace loomsim):
//
//   using AlgorithmFn = std::function<void(const loom::OpDesc&, int opIndex, int rank,
//                                          int nranks, const loom::Plan&, loom::Schedule*)>;
//     loom::ringSchedule, loom::halvingDoublingSchedule and
//     loom::doubleBinaryTreeSchedule all fit; so does a test's own lambda.
//
//   struct SimOptions { slotBytes (4096, multiple of 64 like LOOM_SLOT_BYTES),
//                       slots (8), timeoutMs (20000), spinUs (5), poison (true),
//                       precheck (true), mailBytes (16384), stageBytes (262144),
//                       directMinBytes (0), directRefuse (-1) }
//     directMinBytes > 0: connections offer loom::DirectTransfer from that
//     size (the receiver's offer goes through a box beside the ring, the
//     sender memcpys into the offered buffer); directRefuse: that rank
//     answers "slots" to every direct transfer, as a rank whose memory
//     cannot be registered does.
//     precheck: before running, validateSchedule() every rank's schedule and
//     matchSchedules() the slots each pair exchanges; a bad schedule is then
//     reported at once (result.problem) instead of timing out.
//
//   struct SimResult { bytesSent[r] (execute()'s return), bytesPosted[r] and
//                      slotsPosted[r] (counted by the transport), schedules[r],
//                      errors[r] (what execute threw, "" if nothing),
//                      problem ("" = ok), seconds; ok(); totalSent(); }
//
//   class SimWorld(nranks, SimOptions)    // rings + doorbells of N ranks
//     SimResult run(fn, ops, plan)        // ops[r]: rank r's operations, run as one
//                                         // group (one schedule per rank, built by fn
//                                         // for collectives, loom::p2pSchedule for P2P);
//                                         // tags and sequence numbers as comm.cc makes
//                                         // them; avg divisor = nranks.  Sequence
//                                         // numbers continue across runs of one world;
//                                         // after a failed run, use a fresh world.
//     SimResult runExec(execOps, schedules)  // lowest level: your own ExecOps/schedules
//     SimResult runDirect(directFn, ops)  // the direct algorithms (loom::oneShotRun,
//                                         // loom::stagedRun) over an in-memory PeerMemory:
//                                         // one window per rank, laid out by DirectLayout
//                                         // from mailBytes/stageBytes; ops[r] one op each
//     std::string leftovers()             // "" when every ring is empty
//
//   SimResult simulate(fn, tmpl, nranks, send, recv, plan = {}, opts = {})
//     One operation: tmpl with sendbuf/recvbuf replaced by send[r]/recv[r].
//
//   struct CollCase { coll, dtype, op, nranks, count (OpDesc::count: RS recvcount,
//                     AG sendcount), root, inPlace, plan, sim }
//   CollOutcome runCollective(fn, CollCase, SimWorld* world = nullptr)
//   std::vector<CollOutcome> runGroup(fn, std::vector<CollCase>, SimWorld* = nullptr)
//     (one group: same nranks; the plan and SimOptions of the first case apply)
//     Allocates guarded buffers (NCCL's in-place layouts: all-gather send =
//     recv + rank*count, reduce-scatter recv = send + rank*count), fills
//     inputs with tests/mp_common.h's patterns (reductions) or per-rank
//     byte hashes (all-gather, broadcast), runs, and compares exactly:
//     outputs, untouched inputs
//     (out of place), untouched non-root output (reduce), untouched guards,
//     bytesSent == bytesPosted.  CollOutcome::ok(), describe(), wrong,
//     sim (the SimResult).  std::string caseName(const CollCase&).
//     The mp_common patterns keep every type x op exact for N <= 64 (sums
//     stay within +-192, products are +-powers of two that wrap or overflow
//     to inf the same way in any order; all 50 checked at N = 43 and 64).
//
//   std::string validateSchedule(sched, ops, rank, nranks)   // "" or what is wrong
//   std::string matchSchedules(execOps, schedules, slotBytes)  // "" or first mismatch
//
// Caveat (executor behaviour, not the simulator's): a lane runs one step at
// a time, and a step that only sends (the first of every ring step
// sequence) must post all its slots before the lane receives anything.
// When every rank of a cycle starts with a send of >= `slots` slots, all
// connections fill and nobody can receive: a deadlock the executor reports
// as loomTimeout after timeoutMs.  Keep ceil(plan.chunkBytes / slotBytes) <
// slots for cyclic schedules (the default Plan's 128 KiB chunks need
// slotBytes > 16 KiB with 8 slots, or smaller chunks).  See the hidden test
// "[.sim-capacity]" in tests/unit_simulator.cc.
//
// Example (in a unit_*.cc):
//   loomsim::CollCase c;
//   c.coll = loom::Collective::AllReduce; c.nranks = 13; c.count = 1009;
//   c.plan.chunkBytes = 16 << 10;  // below 8 slots x 4 KiB (see the caveat)
//   auto out = loomsim::runCollective(loom::halvingDoublingSchedule, c);
//   INFO(loomsim::caseName(c) << ": " << out.describe());
//   CHECK(out.ok());
#pragma once
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/direct.h"
#include "src/core/error.h"
#include "src/core/executor.h"
#include "src/device/host_memory.h"
#include "src/device/host_reduce.h"
#include "tests/mp_common.h"
#include "transports/transport.h"

namespace loomsim {

using AlgorithmFn = std::function<void(const loom::OpDesc&, int, int, int, const loom::Plan&,
                                       loom::Schedule*)>;
using DirectFn = std::function<void(loom::DirectContext&, const loom::OpDesc&, const loom::SlotTag&)>;

struct SimOptions {
  size_t slotBytes = 4096;   // payload bytes per slot (a multiple of 64)
  size_t slots = 8;          // slots per ring (LOOM_SLOTS default)
  int64_t timeoutMs = 20000; // ExecEnv::timeoutMs: a stuck schedule fails after this
  int64_t spinUs = 5;        // ExecEnv::spinUs
  bool poison = true;        // overwrite slots on release
  bool precheck = true;      // validate and match schedules before running them
  size_t mailBytes = 16384;  // direct algorithms: one-shot mailbox payload
  size_t stageBytes = 262144;  // direct algorithms: one staging buffer
  size_t directMinBytes = 0;   // > 0: connections offer DirectTransfer
  int directRefuse = -1;       // this rank answers Slots to direct transfers
};

struct SimResult {
  std::vector<uint64_t> bytesSent;    // per rank: what execute() returned
  std::vector<uint64_t> bytesPosted;  // per rank: payload bytes its connections posted
  std::vector<uint64_t> slotsPosted;  // per rank: slots its connections posted
  std::vector<loom::Schedule> schedules;
  std::vector<std::string> errors;  // per rank: what execute() threw ("" if nothing)
  std::string problem;              // "" when everything went well
  double seconds = 0;
  bool ok() const { return problem.empty(); }
  uint64_t totalSent() const {
    uint64_t s = 0;
    for (uint64_t b : bytesSent) s += b;
    return s;
  }
};

namespace detail {
// The simulated rank this thread runs (-1: none), for per-rank state such
// as the import caches.
inline thread_local int tlsSimRank = -1;


inline bool sameOp(const loom::SlotTag& a, const loom::SlotTag& b) {
  return a.seq == b.seq && a.count == b.count && a.coll == b.coll && a.dtype == b.dtype &&
         a.op == b.op && a.root == b.root;
}

// One direction of one (pair, channel): SPSC ring.
struct SimRing {
  SimRing(size_t nslots, size_t bytes) : slots(nslots), slotBytes(bytes), tags(nslots) {
    for (size_t i = 0; i < nslots; ++i) {
      auto* p = static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(64)));
      memset(p, 0xCD, bytes);
      payload.push_back(p);
    }
  }
  ~SimRing() {
    for (uint8_t* p : payload) ::operator delete(p, std::align_val_t(64));
  }
  SimRing(const SimRing&) = delete;
  SimRing& operator=(const SimRing&) = delete;

  const size_t slots, slotBytes;
  std::vector<loom::SlotTag> tags;
  std::vector<uint8_t*> payload;  // one allocation per slot: overruns hit ASan
  alignas(64) std::atomic<uint64_t> head{0};  // slots posted (producer)
  alignas(64) std::atomic<uint64_t> tail{0};  // slots released (consumer)
  // DirectTransfer: the receiver's offer for the transfer in flight.
  std::mutex boxMu;
  uint8_t* boxDst = nullptr;
  size_t boxBytes = 0;
  bool boxOffered = false, boxRefused = false, boxDone = false;
};

// Per-rank doorbell: a counter bumped on every post/release that concerns
// the rank, and a condition variable for when it sleeps.
struct SimBell {
  std::atomic<uint32_t> seq{0};
  std::atomic<int> sleeping{0};
  std::mutex mu;
  std::condition_variable cv;
  void ring() {
    seq.fetch_add(1);  // seq_cst: pairs with sleeping.store + seq.load in sleepBegin
    if (sleeping.load()) {
      std::lock_guard<std::mutex> g(mu);
      cv.notify_all();
    }
  }
};

struct SimCounters {
  uint64_t bytes = 0, slots = 0;
};

class SimConnection : public loom::Connection, public loom::DirectTransfer {
 public:
  SimConnection(int me, int peer, int channel, SimRing* out, SimRing* in, SimBell* peerBell,
                SimCounters* counters, bool poison, size_t directMin = 0, bool refuse = false)
      : me_(me), peer_(peer), channel_(channel), out_(out), in_(in), peerBell_(peerBell),
        counters_(counters), poison_(poison), directMin_(directMin), refuse_(refuse) {
    sendHead_ = out_->head.load(std::memory_order_relaxed);
    sendTailCache_ = out_->tail.load(std::memory_order_acquire);
    recvTail_ = in_->tail.load(std::memory_order_relaxed);
    recvHeadCache_ = in_->head.load(std::memory_order_acquire);
  }

  const char* name() const override { return "sim"; }
  size_t slotBytes() const override { return out_->slotBytes; }

  void* sendAcquire() override {
    if (sendHead_ - sendTailCache_ >= out_->slots) {
      sendTailCache_ = out_->tail.load(std::memory_order_acquire);
      if (sendHead_ - sendTailCache_ >= out_->slots) return nullptr;
    }
    acquired_ = true;
    return out_->payload[size_t(sendHead_ % out_->slots)];
  }

  void sendPost(const loom::SlotTag& tag) override {
    if (!acquired_) misuse("sendPost without a successful sendAcquire");
    if (tag.bytes == 0 || tag.bytes > out_->slotBytes)
      misuse(loom::strf("sendPost of a slot holding %u bytes (slot size %zu)", tag.bytes,
                        out_->slotBytes));
    out_->tags[size_t(sendHead_ % out_->slots)] = tag;
    out_->head.store(++sendHead_, std::memory_order_release);
    acquired_ = false;
    counters_->bytes += tag.bytes;
    counters_->slots += 1;
    peerBell_->ring();
  }

  const void* recvPeek(loom::SlotTag* tag) override {
    if (recvTail_ == recvHeadCache_) {
      recvHeadCache_ = in_->head.load(std::memory_order_acquire);
      if (recvTail_ == recvHeadCache_) return nullptr;
    }
    size_t i = size_t(recvTail_ % in_->slots);
    *tag = in_->tags[i];
    peeked_ = true;
    return in_->payload[i];
  }

  void recvRelease() override {
    if (!peeked_) misuse("recvRelease without a successful recvPeek");
    if (poison_) memset(in_->payload[size_t(recvTail_ % in_->slots)], 0xCD, in_->slotBytes);
    in_->tail.store(++recvTail_, std::memory_order_release);
    peeked_ = false;
    peerBell_->ring();
  }

  bool usesDoorbell() const override { return true; }

  loom::DirectTransfer* direct() override { return directMin_ ? this : nullptr; }
  size_t directMinBytes() const override { return directMin_; }
  bool directSend(const void* src, size_t bytes, const loom::SlotTag& tag) override {
    if (sendState_ == State::Waiting) misuse("a second direct send while one is in flight");
    void* slot = sendAcquire();
    if (!slot) return false;
    uint64_t request[2] = {bytes, refuse_ ? 1u : 0u};
    memcpy(slot, request, sizeof request);
    loom::SlotTag t = tag;
    t.flags |= loom::kTagDirect;
    t.bytes = uint32_t(sizeof request);
    sendPost(t);
    counters_->bytes -= t.bytes;  // a request, not payload: bytesPosted counts what execute() counts
    src_ = static_cast<const uint8_t*>(src);
    sendBytes_ = bytes;
    sendState_ = refuse_ ? State::Slots : State::Waiting;
    return true;
  }
  State directSendState() override {
    if (sendState_ != State::Waiting) return sendState_;
    std::lock_guard<std::mutex> g(out_->boxMu);
    if (!out_->boxOffered) return State::Waiting;
    out_->boxOffered = false;
    if (out_->boxRefused) return sendState_ = State::Slots;
    if (out_->boxBytes != sendBytes_)
      loom::fail(loomRemoteError, "rank %d: rank %d offered %zu bytes for a direct transfer of %zu", me_, peer_,
                 out_->boxBytes, sendBytes_);
    memcpy(out_->boxDst, src_, sendBytes_);
    counters_->bytes += sendBytes_;
    out_->boxDone = true;
    peerBell_->ring();
    return sendState_ = State::Done;
  }
  void directRecv(void* dst, size_t bytes) override {
    if (recvState_ == State::Waiting) misuse("a second direct receive while one is in flight");
    std::lock_guard<std::mutex> g(in_->boxMu);
    in_->boxDst = static_cast<uint8_t*>(dst);
    in_->boxBytes = bytes;
    in_->boxOffered = true;
    in_->boxRefused = refuse_;
    in_->boxDone = false;
    recvState_ = refuse_ ? State::Slots : State::Waiting;
    peerBell_->ring();
  }
  State directRecvState() override {
    if (recvState_ != State::Waiting) return recvState_;
    std::lock_guard<std::mutex> g(in_->boxMu);
    if (in_->boxDone) {
      in_->boxDone = false;
      recvState_ = State::Done;
    }
    return recvState_;
  }

 private:
  [[noreturn]] void misuse(const std::string& what) {
    throw std::logic_error(loom::strf("rank %d, connection to rank %d channel %d: %s", me_, peer_,
                                      channel_, what.c_str()));
  }

  int me_, peer_, channel_;
  SimRing* out_;
  SimRing* in_;
  SimBell* peerBell_;
  SimCounters* counters_;
  bool poison_;
  bool acquired_ = false, peeked_ = false;
  size_t directMin_;
  bool refuse_;
  const uint8_t* src_ = nullptr;
  size_t sendBytes_ = 0;
  State sendState_ = State::Done, recvState_ = State::Done;
  uint64_t sendHead_, sendTailCache_, recvTail_, recvHeadCache_;
};

// The PeerMemory of a world: one zeroed window per rank in this process.
class SimPeerMemory : public loom::PeerMemory {
 public:
  SimPeerMemory(int nranks, size_t bytes, std::vector<std::unique_ptr<SimBell>>* bells, std::atomic<int>* failed)
      : bytes_(bytes), bells_(bells), failed_(failed) {
    for (int r = 0; r < nranks; ++r) {
      auto* p = static_cast<uint8_t*>(::operator new(bytes, std::align_val_t(4096)));
      memset(p, 0, bytes);
      windows_.push_back(p);
    }
  }
  ~SimPeerMemory() override {
    for (uint8_t* p : windows_) ::operator delete(p, std::align_val_t(4096));
  }
  size_t windowBytes() const override { return bytes_; }
  uint8_t* window(int r) const override { return windows_.at(size_t(r)); }
  void wake(int r) const override { (*bells_)[size_t(r)]->ring(); }
  void checkPeer(int r) const override {
    if (failed_->load() == r) throw loom::Error(loomRemoteError, loom::strf("rank %d failed", r));
  }
  // Zero-copy as shm does it: memory from loomMemAlloc is exported, and a
  // peer maps it anew through /proc/<pid>/fd (this process: a second
  // mapping of the same memfd), cached; the ranks are threads, so the
  // caches are kept under a lock.  imports() counts the maps made.
  bool exportBuffer(const void* p, size_t bytes, loom::PeerBuffer* out) const override {
    return loom::hostMemExport(p, bytes, out);
  }
  // One cache per importing rank, as each process has its own: a
  // cache keeps what it handed to an operation mapped until that rank's
  // next operation, which another rank's imports know nothing of.
  const uint8_t* importBuffer(int r, const loom::PeerBuffer& b, size_t need, uint64_t op) const override {
    std::lock_guard<std::mutex> lock(importMu_);
    ++imports_;
    return caches_[detail::tlsSimRank].import(r, int(getpid()), b, need, freeEpoch_.load(), op);
  }
  size_t imports() const { return imports_; }
  size_t mappings() const {
    std::lock_guard<std::mutex> lock(importMu_);
    size_t n = 0;
    for (const auto& kv : caches_) n += kv.second.mappings();
    return n;
  }

 private:
  size_t bytes_;
  std::vector<uint8_t*> windows_;
  mutable std::mutex importMu_;
  mutable size_t imports_ = 0;
  mutable std::map<int, loom::HostImportCache> caches_;  // by importing rank
  std::atomic<uint64_t> freeEpoch_{0};
  struct Watch {  // hostMemFree moves freeEpoch_
    std::atomic<uint64_t>* e;
    explicit Watch(std::atomic<uint64_t>* x) : e(x) { loom::hostMemWatchFrees(e); }
    ~Watch() { loom::hostMemUnwatchFrees(e); }
  } watch_{&freeEpoch_};
  std::vector<std::unique_ptr<SimBell>>* bells_;
  std::atomic<int>* failed_;
};

inline std::string tagString(const loom::SlotTag& t) { return loom::describeTag(t); }

}  // namespace detail

// Checks one rank's schedule against its operations: op indices, peers,
// step kinds and their operands, sizes in whole elements, every buffer range
// inside the buffer the operation owns, no write into a send buffer, and
// reductions whose source and destination are the same or disjoint.
inline std::string validateSchedule(const loom::Schedule& s, const std::vector<loom::OpDesc>& ops,
                                    int rank, int nranks) {
  using loom::Buf;
  using loom::StepKind;
  using loom::strf;
  for (size_t li = 0; li < s.lanes.size(); ++li) {
    const loom::Lane& l = s.lanes[li];
    if (l.op < 0 || size_t(l.op) >= ops.size())
      return strf("rank %d lane %zu: op index %d out of range (%zu ops)", rank, li, l.op, ops.size());
    if (l.channel < 0) return strf("rank %d lane %zu: channel %d", rank, li, l.channel);
    for (int a : l.after)
      if (a < 0 || size_t(a) >= li) return strf("rank %d lane %zu: waits for lane %d, which does not precede it", rank, li, a);
    const loom::OpDesc& op = ops[size_t(l.op)];
    size_t esz = loom::dtypeSize(op.dtype);
    size_t sb = loom::sendBytes(op, nranks), rb = loom::recvBytes(op, nranks);
    for (size_t si = 0; si < l.steps.size(); ++si) {
      const loom::Step& st = l.steps[si];
      auto where = [&]() {
        return strf("rank %d lane %zu (op %d, channel %d) step %zu (%s, %zu B, from %d, to %d)", rank,
                    li, l.op, l.channel, si, loom::stepKindName(st.kind), st.bytes, st.recvPeer,
                    st.sendPeer);
      };
      for (int p : {st.recvPeer, st.sendPeer})
        if (p < -1 || p >= nranks || p == rank) return where() + ": bad peer " + std::to_string(p);
      bool needRecv = false, needSend = false, needSrc = false;
      int dstRule = 0;  // 0 forbidden, 1 required, 2 optional
      switch (st.kind) {
        case StepKind::Send: needSend = needSrc = true; break;
        case StepKind::Recv: needRecv = true; dstRule = 1; break;
        case StepKind::RecvReduce: needRecv = needSrc = true; dstRule = 1; break;
        case StepKind::RecvReduceSend: needRecv = needSend = needSrc = true; dstRule = 2; break;
        case StepKind::RecvCopySend: needRecv = needSend = true; dstRule = 2; break;
        case StepKind::Copy: needSrc = true; dstRule = 1; break;
        case StepKind::Handshake:
          if ((st.recvPeer >= 0) == (st.sendPeer >= 0)) return where() + ": a handshake either sends or receives";
          needRecv = st.recvPeer >= 0, needSend = st.sendPeer >= 0;
          break;
        default: return where() + ": unknown step kind";
      }
      if (needRecv != (st.recvPeer >= 0)) return where() + ": recvPeer does not fit the kind";
      if (needSend != (st.sendPeer >= 0)) return where() + ": sendPeer does not fit the kind";
      if (needSrc != (st.src.buf != Buf::None)) return where() + ": src does not fit the kind";
      bool hasDst = st.dst.buf != Buf::None;
      if ((dstRule == 0 && hasDst) || (dstRule == 1 && !hasDst))
        return where() + ": dst does not fit the kind";
      if (esz == 0 || st.bytes % esz) return where() + ": not a whole number of elements";
      if (st.dst.buf == Buf::Send) return where() + ": writes into the send buffer";
      const uint8_t* addr[2] = {nullptr, nullptr};
      const loom::BufRef* refs[2] = {&st.src, &st.dst};
      for (int k = 0; k < 2; ++k) {
        const loom::BufRef& r = *refs[k];
        if (r.buf == Buf::None) continue;
        size_t limit = r.buf == Buf::Send ? sb : r.buf == Buf::Recv ? rb : s.scratchOf(l.op);
        // Scratch has no address yet: the schedule's own address stands in
        // (only compared with other scratch references).
        const void* base = r.buf == Buf::Send ? op.sendbuf : r.buf == Buf::Recv ? op.recvbuf : static_cast<const void*>(&s);
        if (r.offset % esz) return where() + strf(": %s offset %zu not element-aligned", k ? "dst" : "src", r.offset);
        if (r.offset > limit || st.bytes > limit - r.offset)
          return where() + strf(": %s [%zu, %zu) outside its %s buffer of %zu bytes", k ? "dst" : "src",
                                r.offset, r.offset + st.bytes,
                                r.buf == Buf::Send ? "send" : r.buf == Buf::Recv ? "recv" : "scratch", limit);
        if (st.bytes && !base) return where() + strf(": %s buffer is null", k ? "dst" : "src");
        addr[k] = static_cast<const uint8_t*>(base) + r.offset;
      }
      bool comparable = (st.src.buf == Buf::Scratch) == (st.dst.buf == Buf::Scratch);
      if (st.kind == StepKind::RecvReduce && st.bytes && comparable && addr[0] != addr[1] &&
          addr[0] < addr[1] + st.bytes && addr[1] < addr[0] + st.bytes)
        return where() + ": reduction source and destination overlap partially";
    }
  }
  return "";
}

// Checks that every (sender, receiver, channel) stream of slots is the same
// seen from both ends: the sender's slots (in lane order, as the executor
// serialises lanes that share a connection) against the receiver's, slot by
// slot (operation tag and size).
inline std::string matchSchedules(const std::vector<std::vector<loom::ExecOp>>& ops,
                                  const std::vector<loom::Schedule>& scheds, size_t slotBytes) {
  using loom::strf;
  struct Slot {
    const loom::SlotTag* tag;
    size_t bytes;
  };
  struct Flow {
    std::vector<Slot> sent, received;
  };
  std::map<std::tuple<int, int, int>, Flow> flows;
  for (size_t r = 0; r < scheds.size(); ++r)
    for (const loom::Lane& l : scheds[r].lanes)
      for (const loom::Step& st : l.steps) {
        const loom::SlotTag* tag = &ops[r][size_t(l.op)].tag;
        for (size_t done = 0; done < st.bytes;) {
          size_t n = std::min(slotBytes, st.bytes - done);
          if (st.sendPeer >= 0) flows[{int(r), st.sendPeer, l.channel}].sent.push_back({tag, n});
          if (st.recvPeer >= 0) flows[{st.recvPeer, int(r), l.channel}].received.push_back({tag, n});
          done += n;
        }
      }
  for (auto& kv : flows) {
    int a, b, ch;
    std::tie(a, b, ch) = kv.first;
    const Flow& f = kv.second;
    size_t n = std::min(f.sent.size(), f.received.size());
    for (size_t i = 0; i < n; ++i) {
      const Slot& x = f.sent[i];
      const Slot& y = f.received[i];
      if (x.bytes != y.bytes || !detail::sameOp(*x.tag, *y.tag))
        return strf("rank %d -> rank %d, channel %d, slot %zu: rank %d sends %zu bytes of %s, rank %d "
                    "expects %zu bytes of %s",
                    a, b, ch, i, a, x.bytes, loom::describeTag(*x.tag).c_str(), b, y.bytes,
                    loom::describeTag(*y.tag).c_str());
    }
    if (f.sent.size() != f.received.size())
      return strf("rank %d -> rank %d, channel %d: rank %d sends %zu slots, rank %d receives %zu", a, b,
                  ch, a, f.sent.size(), b, f.received.size());
  }
  return "";
}

class SimWorld;

namespace detail {

class SimRankEnv : public loom::ExecEnv {
 public:
  SimRankEnv(SimWorld* w, int rank) : world_(w), rank_(rank) {}
  int rank() const override { return rank_; }
  inline void prepare(const std::vector<std::pair<int, int>>& needed) override;
  loom::Connection* connection(int peer, int channel) override {
    auto it = conns_.find({peer, channel});
    if (it == conns_.end())
      throw std::logic_error(loom::strf("rank %d: connection(%d, %d) was not prepared", rank_, peer, channel));
    return it->second.get();
  }
  inline uint32_t sleepBegin(bool withFds) override;
  inline void sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell,
                        int64_t timeoutUs) override;
  inline void sleepEnd() override;
  inline void checkAborted() override;
  inline int64_t timeoutMs() const override;
  inline int64_t spinUs() const override;
  inline bool oversubscribed() const override;
  bool checkMode() const override { return true; }

  SimCounters counters;

 private:
  SimWorld* world_;
  int rank_;
  std::map<std::pair<int, int>, std::unique_ptr<SimConnection>> conns_;
};

}  // namespace detail

class SimWorld {
 public:
  explicit SimWorld(int nranks, SimOptions opts = {}) : n_(nranks), opts_(opts) {
    if (nranks < 1) throw std::invalid_argument("SimWorld: nranks < 1");
    if (opts_.slotBytes == 0 || opts_.slotBytes % 64)
      throw std::invalid_argument("SimWorld: slotBytes must be a positive multiple of 64");
    if (opts_.slots < 1) throw std::invalid_argument("SimWorld: slots < 1");
    for (int r = 0; r < n_; ++r) {
      bells_.push_back(std::make_unique<detail::SimBell>());
      envs_.push_back(std::make_unique<detail::SimRankEnv>(this, r));
    }
    sendSeq_.assign(size_t(n_), std::vector<uint64_t>(size_t(n_), 0));
    recvSeq_.assign(size_t(n_), std::vector<uint64_t>(size_t(n_), 0));
  }

  int nranks() const { return n_; }
  const SimOptions& options() const { return opts_; }

  // One group of operations: ops[r] are rank r's.  Builds ExecOps (tags as
  // comm.cc's tagFor) and schedules, then runs them.
  SimResult run(const AlgorithmFn& fn, const std::vector<std::vector<loom::OpDesc>>& ops,
                const loom::Plan& plan) {
    SimResult res;
    if (int(ops.size()) != n_) {
      res.problem = loom::strf("run: %zu ranks of operations for a world of %d", ops.size(), n_);
      return res;
    }
    std::vector<std::vector<loom::ExecOp>> eops(static_cast<size_t>(n_));
    std::vector<loom::Schedule> scheds(static_cast<size_t>(n_));
    for (int r = 0; r < n_; ++r) {
      uint64_t collSeq = collSeq_;
      for (size_t i = 0; i < ops[size_t(r)].size(); ++i) {
        const loom::OpDesc& op = ops[size_t(r)][i];
        loom::ExecOp e;
        e.tag = tagFor(op, r, &collSeq);
        e.send = static_cast<const uint8_t*>(op.sendbuf);
        e.recv = static_cast<uint8_t*>(op.recvbuf);
        e.dtype = op.dtype;
        e.op = op.op;
        e.sendMem = op.sendMem;
        e.recvMem = op.recvMem;
        e.divisor = op.op == loomAvg ? n_ : 1;
        eops[size_t(r)].push_back(e);
        if (op.coll == loom::Collective::P2P) {
          if (op.peer == r) {
            res.problem = loom::strf("rank %d: the simulator does not run sends to self", r);
            return res;
          }
          loom::p2pSchedule(op, int(i), &scheds[size_t(r)]);
        } else {
          fn(op, int(i), r, n_, plan, &scheds[size_t(r)]);
        }
      }
      if (r == n_ - 1) collSeq_ = collSeq;
    }
    if (opts_.precheck) {
      for (int r = 0; r < n_ && res.problem.empty(); ++r) {
        std::string e = validateSchedule(scheds[size_t(r)], ops[size_t(r)], r, n_);
        if (!e.empty()) res.problem = "schedule check: " + e;
      }
      if (res.problem.empty()) {
        std::string e = matchSchedules(eops, scheds, opts_.slotBytes);
        if (!e.empty()) res.problem = "schedule match: " + e;
      }
      if (!res.problem.empty()) {
        res.schedules = std::move(scheds);
        res.bytesSent.assign(size_t(n_), 0);
        res.bytesPosted.assign(size_t(n_), 0);
        res.slotsPosted.assign(size_t(n_), 0);
        res.errors.assign(size_t(n_), "");
        return res;
      }
    }
    res = runExec(eops, scheds);
    res.schedules = std::move(scheds);
    return res;
  }

  // The world's PeerMemory (nullptr before the first runDirect).
  const detail::SimPeerMemory* peerMemory() const { return mem_.get(); }

  // Runs ops[r] (one operation per rank) with a direct algorithm on N
  // threads over this world's PeerMemory.  Tags as comm.cc makes them.
  SimResult runDirect(const DirectFn& fn, const std::vector<std::vector<loom::OpDesc>>& ops) {
    SimResult res;
    res.bytesSent.assign(size_t(n_), 0);
    res.bytesPosted.assign(size_t(n_), 0);
    res.slotsPosted.assign(size_t(n_), 0);
    res.errors.assign(size_t(n_), "");
    if (int(ops.size()) != n_) {
      res.problem = "runDirect: need one op list per rank";
      return res;
    }
    loom::DirectLayout layout{n_, opts_.mailBytes, opts_.stageBytes};
    if (!mem_) mem_ = std::make_unique<detail::SimPeerMemory>(n_, layout.bytes(), &bells_, &failedRank_);
    if (directState_.empty()) directState_.resize(size_t(n_));
    failedRank_.store(-1);
    std::vector<loom::SlotTag> tags;
    uint64_t collSeq = collSeq_;
    for (int r = 0; r < n_; ++r) {
      uint64_t seq = collSeq_;
      for (const loom::OpDesc& op : ops[size_t(r)]) tags.push_back(tagFor(op, r, &seq));
      collSeq = seq;
    }
    collSeq_ = collSeq;
    auto t0 = std::chrono::steady_clock::now();
    auto body = [&](int r) {
      detail::tlsSimRank = r;
      loom::DirectContext ctx{*envs_[size_t(r)], *mem_, loom::hostDevice(), layout, directState_[size_t(r)], r, n_, true};
      try {
        size_t k = 0;
        for (int q = 0; q < r; ++q) k += ops[size_t(q)].size();
        for (const loom::OpDesc& op : ops[size_t(r)]) fn(ctx, op, tags[k++]);
      } catch (const std::exception& e) {
        res.errors[size_t(r)] = e.what();
        markFailed(r);
      }
    };
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) threads.emplace_back(body, r);
    for (auto& t : threads) t.join();
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int first = failedRank_.load();
    if (first >= 0) res.problem = loom::strf("rank %d failed: %s", first, res.errors[size_t(first)].c_str());
    return res;
  }

  // Runs rank r's schedule scheds[r] for ops[r] on N threads.
  SimResult runExec(const std::vector<std::vector<loom::ExecOp>>& ops,
                    const std::vector<loom::Schedule>& scheds) {
    SimResult res;
    res.bytesSent.assign(size_t(n_), 0);
    res.bytesPosted.assign(size_t(n_), 0);
    res.slotsPosted.assign(size_t(n_), 0);
    res.errors.assign(size_t(n_), "");
    if (int(ops.size()) != n_ || int(scheds.size()) != n_) {
      res.problem = "runExec: need one op list and one schedule per rank";
      return res;
    }
    failedRank_.store(-1);
    for (auto& e : envs_) e->counters = detail::SimCounters{};
    auto t0 = std::chrono::steady_clock::now();
    auto body = [&](int r) {
      detail::tlsSimRank = r;
      try {
        res.bytesSent[size_t(r)] = loom::execute(*envs_[size_t(r)], ops[size_t(r)], scheds[size_t(r)]);
      } catch (const std::exception& e) {
        res.errors[size_t(r)] = e.what();
        markFailed(r);
      }
    };
    if (n_ == 1) {
      body(0);
    } else {
      std::vector<std::thread> threads;
      threads.reserve(size_t(n_));
      for (int r = 0; r < n_; ++r) threads.emplace_back(body, r);
      for (auto& t : threads) t.join();
    }
    res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int r = 0; r < n_; ++r) {
      res.bytesPosted[size_t(r)] = envs_[size_t(r)]->counters.bytes;
      res.slotsPosted[size_t(r)] = envs_[size_t(r)]->counters.slots;
    }
    int first = failedRank_.load();
    if (first >= 0) {
      res.problem = loom::strf("rank %d failed: %s", first, res.errors[size_t(first)].c_str());
      return res;
    }
    for (int r = 0; r < n_; ++r)
      if (res.bytesSent[size_t(r)] != res.bytesPosted[size_t(r)]) {
        res.problem = loom::strf("rank %d: execute() says it sent %llu bytes, its connections posted %llu",
                                 r, (unsigned long long)res.bytesSent[size_t(r)],
                                 (unsigned long long)res.bytesPosted[size_t(r)]);
        return res;
      }
    res.problem = leftovers();
    return res;
  }

  // "" when every ring is empty; else which ones hold unreceived slots.
  std::string leftovers() {
    std::lock_guard<std::mutex> g(ringMu_);
    for (auto& kv : rings_) {
      uint64_t h = kv.second->head.load(), t = kv.second->tail.load();
      if (h != t) {
        int a, b, ch;
        std::tie(a, b, ch) = kv.first;
        return loom::strf("rank %d -> rank %d, channel %d: %llu slot(s) posted but never received", a,
                          b, ch, (unsigned long long)(h - t));
      }
    }
    return "";
  }

 private:
  friend class detail::SimRankEnv;

  loom::SlotTag tagFor(const loom::OpDesc& op, int rank, uint64_t* collSeq) {
    if (op.coll == loom::Collective::P2P) {
      size_t p = size_t(std::max(0, std::min(n_ - 1, op.peer)));
      return loom::operationTag(op, op.isSend ? sendSeq_[size_t(rank)][p]++ : recvSeq_[size_t(rank)][p]++);
    }
    return loom::operationTag(op, (*collSeq)++);
  }

  detail::SimRing* ring(int from, int to, int channel) {
    std::lock_guard<std::mutex> g(ringMu_);
    auto& slot = rings_[std::make_tuple(from, to, channel)];
    if (!slot) slot = std::make_unique<detail::SimRing>(opts_.slots, opts_.slotBytes);
    return slot.get();
  }

  void markFailed(int r) {
    int expected = -1;
    failedRank_.compare_exchange_strong(expected, r);
    for (auto& b : bells_) b->ring();
    for (auto& b : bells_) {
      std::lock_guard<std::mutex> g(b->mu);
      b->cv.notify_all();
    }
  }

  int n_;
  SimOptions opts_;
  std::mutex ringMu_;
  std::map<std::tuple<int, int, int>, std::unique_ptr<detail::SimRing>> rings_;
  std::vector<std::unique_ptr<detail::SimBell>> bells_;
  std::vector<std::unique_ptr<detail::SimRankEnv>> envs_;
  std::atomic<int> failedRank_{-1};
  std::unique_ptr<detail::SimPeerMemory> mem_;
  std::vector<loom::DirectState> directState_;
  uint64_t collSeq_ = 0;
  std::vector<std::vector<uint64_t>> sendSeq_, recvSeq_;
};

namespace detail {

inline void SimRankEnv::prepare(const std::vector<std::pair<int, int>>& needed) {
  for (const auto& pc : needed) {
    int peer = pc.first, ch = pc.second;
    if (peer < 0 || peer >= world_->n_ || peer == rank_ || ch < 0)
      throw std::logic_error(loom::strf("rank %d: schedule needs connection to rank %d channel %d",
                                        rank_, peer, ch));
    auto key = std::make_pair(peer, ch);
    if (conns_.count(key)) continue;
    SimRing* out = world_->ring(rank_, peer, ch);
    SimRing* in = world_->ring(peer, rank_, ch);
    conns_[key] = std::make_unique<SimConnection>(rank_, peer, ch, out, in,
                                                  world_->bells_[size_t(peer)].get(), &counters,
                                                  world_->opts_.poison, world_->opts_.directMinBytes,
                                                  world_->opts_.directRefuse == rank_);
  }
}

inline uint32_t SimRankEnv::sleepBegin(bool withFds) {
  (void)withFds;
  SimBell& b = *world_->bells_[size_t(rank_)];
  b.sleeping.store(1);
  return b.seq.load();
}

inline void SimRankEnv::sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell,
                                  int64_t timeoutUs) {
  (void)fds;
  (void)doorbell;
  SimBell& b = *world_->bells_[size_t(rank_)];
  std::unique_lock<std::mutex> lk(b.mu);
  b.cv.wait_for(lk, std::chrono::microseconds(std::max<int64_t>(1, std::min<int64_t>(timeoutUs, 20000))),
                [&] { return b.seq.load() != token || world_->failedRank_.load() >= 0; });
}

inline void SimRankEnv::sleepEnd() { world_->bells_[size_t(rank_)]->sleeping.store(0); }

inline void SimRankEnv::checkAborted() {
  int f = world_->failedRank_.load();
  if (f >= 0 && f != rank_)
    throw loom::Error(loomRemoteError, loom::strf("rank %d: stopped because rank %d failed", rank_, f));
}

inline int64_t SimRankEnv::timeoutMs() const { return world_->opts_.timeoutMs; }
inline int64_t SimRankEnv::spinUs() const { return world_->opts_.spinUs; }
inline bool SimRankEnv::oversubscribed() const {
  unsigned hc = std::thread::hardware_concurrency();
  return hc == 0 || unsigned(world_->n_) > hc;
}

}  // namespace detail

// One operation on a fresh world: tmpl with sendbuf/recvbuf set per rank.
inline SimResult simulate(const AlgorithmFn& fn, const loom::OpDesc& tmpl, int nranks,
                          const std::vector<const void*>& send, const std::vector<void*>& recv,
                          const loom::Plan& plan = loom::Plan{}, const SimOptions& opts = SimOptions{}) {
  std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    loom::OpDesc op = tmpl;
    op.sendbuf = size_t(r) < send.size() ? send[size_t(r)] : nullptr;
    op.recvbuf = size_t(r) < recv.size() ? recv[size_t(r)] : nullptr;
    ops[size_t(r)].push_back(op);
  }
  SimWorld w(nranks, opts);
  return w.run(fn, ops, plan);
}

// ---------------------------------------------------------------------------
// Collectives with checked results.

// Every datatype and reduction op, for tests that sweep them.
inline constexpr loomDataType_t kTypes[] = {loomInt8,   loomUint8,   loomInt32,    loomUint32,  loomInt64,
                                            loomUint64, loomFloat16, loomBfloat16, loomFloat32, loomFloat64};
inline constexpr loomRedOp_t kOps[] = {loomSum, loomProd, loomMax, loomMin, loomAvg};

struct CollCase {
  loom::Collective coll = loom::Collective::AllReduce;
  loomDataType_t dtype = loomFloat32;
  loomRedOp_t op = loomSum;
  int nranks = 2;
  size_t count = 0;  // OpDesc::count: reduce-scatter recvcount, all-gather sendcount
  int root = 0;
  bool inPlace = false;
  loom::Plan plan;
  SimOptions sim;
  // Ranks (bit r) whose buffers come from loomMemAlloc, `sharedOffset`
  // bytes (plus the guard) into the allocation: the direct paths may read
  // them in place.  Other ranks use ordinary memory.
  uint64_t sharedRanks = 0;
  size_t sharedOffset = 0;
};

inline std::string caseName(const CollCase& c) {
  using loom::Collective;
  std::string s = loom::strf("%s n=%d count=%zu %s", loom::collectiveName(c.coll), c.nranks, c.count,
                             loom::dtypeName(c.dtype));
  if (c.coll == Collective::AllReduce || c.coll == Collective::ReduceScatter || c.coll == Collective::Reduce)
    s += std::string(" ") + loom::redOpName(c.op);
  if (c.coll == Collective::Broadcast || c.coll == Collective::Reduce) s += loom::strf(" root=%d", c.root);
  s += c.inPlace ? " in-place" : " out-of-place";
  if (c.sharedRanks) s += loom::strf(" loomMemAlloc ranks 0x%llx at +%zu", (unsigned long long)c.sharedRanks, c.sharedOffset);
  s += loom::strf(" channels=%d chunk=%zu slot=%zux%zu", c.plan.channels, c.plan.chunkBytes,
                  c.sim.slots, c.sim.slotBytes);
  return s;
}

struct CollOutcome {
  SimResult sim;
  size_t wrong = 0;    // elements (over all ranks and buffers) that differ
  std::string detail;  // the first difference, or damaged guards
  bool ok() const { return sim.ok() && wrong == 0 && detail.empty(); }
  std::string describe() const {
    if (!sim.ok()) return sim.problem;
    if (wrong) return loom::strf("%zu wrong element(s); first: %s", wrong, detail.c_str());
    return detail;
  }
};

namespace detail {

inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Deterministic bytes for (seed, rank): byte i of the stream.
inline void fillBytes(uint8_t* p, size_t n, uint64_t seed, int rank) {
  uint64_t base = mix64(seed * 0x100000001b3ull + uint64_t(rank));
  for (size_t i = 0; i < n; i += 8) {
    uint64_t w = mix64(base ^ (i / 8));
    size_t k = std::min<size_t>(8, n - i);
    memcpy(p + i, &w, k);
  }
}

inline std::string elemString(const uint8_t* p, loomDataType_t t) {
  std::string hex;
  size_t esz = loom::dtypeSize(t);
  for (size_t i = esz; i-- > 0;) hex += loom::strf("%02x", p[i]);
  double v = 0;
  switch (t) {
    case loomInt8: { int8_t x; memcpy(&x, p, 1); v = x; break; }
    case loomUint8: { uint8_t x; memcpy(&x, p, 1); v = x; break; }
    case loomInt32: { int32_t x; memcpy(&x, p, 4); v = x; break; }
    case loomUint32: { uint32_t x; memcpy(&x, p, 4); v = x; break; }
    case loomInt64: { int64_t x; memcpy(&x, p, 8); v = double(x); break; }
    case loomUint64: { uint64_t x; memcpy(&x, p, 8); v = double(x); break; }
    case loomFloat16: { uint16_t x; memcpy(&x, p, 2); v = loom::halfToFloat(x); break; }
    case loomBfloat16: { uint16_t x; memcpy(&x, p, 2); v = loom::bf16ToFloat(x); break; }
    case loomFloat32: { float x; memcpy(&x, p, 4); v = x; break; }
    case loomFloat64: { memcpy(&v, p, 8); break; }
    default: break;
  }
  return loom::strf("%g (0x%s)", v, hex.c_str());
}

constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xA5;

struct GuardedMem {
  std::vector<uint8_t> raw;
  std::shared_ptr<uint8_t> shared;  // from loomMemAlloc (CollCase::sharedRanks)
  size_t sharedOffset = 0;          // where the guarded area starts in it
  size_t bytes = 0;
  void alloc(size_t n) {
    bytes = n;
    raw.assign(n + 2 * kGuard, kGuardByte);
  }
  // In memory from loomMemAlloc, `offset` bytes into the allocation.
  void allocShared(size_t n, size_t offset) {
    bytes = n;
    sharedOffset = offset;
    shared.reset(static_cast<uint8_t*>(loom::hostMemAlloc(offset + n + 2 * kGuard)),
                 [](uint8_t* p) { loom::hostMemFree(p); });
    memset(start(), kGuardByte, n + 2 * kGuard);
  }
  uint8_t* start() const { return shared ? shared.get() + sharedOffset : const_cast<uint8_t*>(raw.data()); }
  uint8_t* data() { return start() + kGuard; }
  const uint8_t* data() const { return start() + kGuard; }
  bool guardsIntact() const {
    const uint8_t* b = start();
    for (size_t i = 0; i < kGuard; ++i)
      if (b[i] != kGuardByte || b[kGuard + bytes + i] != kGuardByte) return false;
    return true;
  }
};

// The buffers of one collective on every rank, their initial contents and
// what they must hold afterwards.
class CollBuffers {
 public:
  explicit CollBuffers(const CollCase& c) : c_(c) {
    using loom::Collective;
    N_ = c.nranks;
    esz_ = loom::dtypeSize(c.dtype);
    reduces_ = c.coll == Collective::AllReduce || c.coll == Collective::ReduceScatter ||
               c.coll == Collective::Reduce;
    // All-to-all, gather and scatter: out of place only (their in-place
    // forms are the root's alone).
    const bool blockSend = c.coll == Collective::ReduceScatter || c.coll == Collective::AllToAll ||
                           c.coll == Collective::Scatter;
    const bool blockRecv = c.coll == Collective::AllGather || c.coll == Collective::AllToAll ||
                           c.coll == Collective::Gather;
    sendE_ = blockSend ? size_t(N_) * c.count : c.count;
    recvE_ = blockRecv ? size_t(N_) * c.count : c.count;
    bufE_ = std::max(sendE_, recvE_);
    recv_.resize(size_t(N_));
    if (!c.inPlace) send_.resize(size_t(N_));
    for (int r = 0; r < N_; ++r) {
      const bool shared = r < 64 && (c.sharedRanks >> r & 1);
      auto alloc = [&](GuardedMem& m, size_t bytes) {
        if (shared) m.allocShared(bytes, c.sharedOffset);
        else m.alloc(bytes);
      };
      if (c.inPlace) {
        alloc(recv_[size_t(r)], bufE_ * esz_);
        initialInPlace(r, recv_[size_t(r)].data());
      } else {
        alloc(send_[size_t(r)], sendE_ * esz_);
        input(r, send_[size_t(r)].data());
        alloc(recv_[size_t(r)], recvE_ * esz_);
        junk(r, recv_[size_t(r)].data(), recvE_ * esz_);
      }
    }
  }

  loom::OpDesc op(int r) {
    using loom::Collective;
    loom::OpDesc d;
    d.coll = c_.coll;
    d.count = c_.count;
    d.dtype = c_.dtype;
    d.op = c_.op;
    d.root = c_.root;
    if (!c_.inPlace) {
      d.sendbuf = send_[size_t(r)].data();
      d.recvbuf = recv_[size_t(r)].data();
    } else {
      uint8_t* b = recv_[size_t(r)].data();
      size_t off = size_t(r) * c_.count * esz_;
      d.sendbuf = c_.coll == Collective::AllGather ? b + off : b;
      d.recvbuf = c_.coll == Collective::ReduceScatter ? b + off : b;
    }
    return d;
  }

  // Compares every rank's buffers with what they must hold; adds to *wrong
  // and sets *detail at the first difference.
  void check(size_t* wrong, std::string* detail) {
    std::vector<uint8_t> want;
    for (int r = 0; r < N_; ++r) {
      if (c_.inPlace) {
        want.assign(bufE_ * esz_, 0);
        expectedInPlace(r, want.data());
        compare(r, "buffer", recv_[size_t(r)], want, wrong, detail);
      } else {
        want.assign(sendE_ * esz_, 0);
        input(r, want.data());
        compare(r, "send buffer", send_[size_t(r)], want, wrong, detail);
        want.assign(recvE_ * esz_, 0);
        expectedRecv(r, want.data());
        compare(r, "recv buffer", recv_[size_t(r)], want, wrong, detail);
      }
    }
  }

 private:
  void input(int r, uint8_t* p) const {
    if (reduces_) loomtest::fillInput(p, c_.op, c_.dtype, r, sendE_);
    else fillBytes(p, sendE_ * esz_, 1, r);
  }
  void junk(int r, uint8_t* p, size_t bytes) const { fillBytes(p, bytes, 2, r); }

  void initialInPlace(int r, uint8_t* p) const {
    using loom::Collective;
    if (c_.coll == Collective::AllGather) {
      junk(r, p, bufE_ * esz_);
      input(r, p + size_t(r) * c_.count * esz_);
    } else {
      input(r, p);
    }
  }

  // Reduction over all ranks of global elements [gi0, gi0 + n) into p.
  void reduced(uint8_t* p, size_t gi0, size_t n) const {
    loomtest::fillExpected(p, c_.op, c_.dtype, N_, n, gi0);
  }

  const std::vector<uint8_t>& fullReduction() {
    if (red_.empty() && c_.count) {
      red_.assign(c_.count * esz_, 0);
      reduced(red_.data(), 0, c_.count);
    }
    return red_;
  }

  void expectedRecv(int r, uint8_t* p) {
    using loom::Collective;
    size_t bytes = c_.count * esz_;
    switch (c_.coll) {
      case Collective::AllReduce:
        if (bytes) memcpy(p, fullReduction().data(), bytes);
        break;
      case Collective::ReduceScatter:
        reduced(p, size_t(r) * c_.count, c_.count);
        break;
      case Collective::AllGather:
        for (int q = 0; q < N_; ++q) input(q, p + size_t(q) * bytes);
        break;
      case Collective::Broadcast:
        input(c_.root, p);
        break;
      case Collective::Reduce:
        if (r == c_.root) {
          if (bytes) memcpy(p, fullReduction().data(), bytes);
        } else {
          junk(r, p, bytes);
        }
        break;
      case Collective::AllToAll:
      case Collective::Scatter: {
        std::vector<uint8_t> in(sendE_ * esz_);
        for (int q = 0; q < N_; ++q) {
          if (c_.coll == Collective::Scatter && q != c_.root) continue;
          input(q, in.data());
          uint8_t* dst = c_.coll == Collective::Scatter ? p : p + size_t(q) * bytes;
          if (bytes) memcpy(dst, in.data() + size_t(r) * bytes, bytes);
        }
        break;
      }
      case Collective::Gather:
        if (r == c_.root) {
          for (int q = 0; q < N_; ++q) input(q, p + size_t(q) * bytes);
        } else {
          junk(r, p, recvE_ * esz_);
        }
        break;
      default:
        break;
    }
  }

  void expectedInPlace(int r, uint8_t* p) {
    using loom::Collective;
    size_t bytes = c_.count * esz_;
    switch (c_.coll) {
      case Collective::ReduceScatter:
        input(r, p);
        reduced(p + size_t(r) * bytes, size_t(r) * c_.count, c_.count);
        break;
      case Collective::Reduce:
        if (r == c_.root) {
          if (bytes) memcpy(p, fullReduction().data(), bytes);
        } else {
          input(r, p);
        }
        break;
      default:
        expectedRecv(r, p);
        break;
    }
  }

  void compare(int r, const char* what, const GuardedMem& m, const std::vector<uint8_t>& want,
               size_t* wrong, std::string* detail) const {
    if (!m.guardsIntact() && detail->empty())
      *detail = loom::strf("rank %d: %s: bytes written outside the buffer", r, what);
    if (want.empty() || memcmp(m.data(), want.data(), want.size()) == 0) return;
    size_t n = want.size() / esz_;
    for (size_t i = 0; i < n; ++i) {
      const uint8_t* g = m.data() + i * esz_;
      const uint8_t* w = want.data() + i * esz_;
      if (memcmp(g, w, esz_) == 0) continue;
      if (*wrong == 0 && detail->empty())
        *detail = loom::strf("rank %d %s element %zu: got %s, want %s", r, what, i,
                             elemString(g, c_.dtype).c_str(), elemString(w, c_.dtype).c_str());
      ++*wrong;
    }
  }

  CollCase c_;
  int N_;
  size_t esz_, sendE_, recvE_, bufE_;
  bool reduces_;
  std::vector<GuardedMem> send_, recv_;
  std::vector<uint8_t> red_;
};

}  // namespace detail

// Runs several collectives (same nranks) as one group and checks each.
inline std::vector<CollOutcome> runGroup(const AlgorithmFn& fn, const std::vector<CollCase>& cases,
                                         SimWorld* world = nullptr) {
  std::vector<CollOutcome> outs(cases.size());
  if (cases.empty()) return outs;
  int N = cases[0].nranks;
  std::vector<std::unique_ptr<detail::CollBuffers>> bufs;
  std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(N));
  for (const CollCase& c : cases) {
    if (c.nranks != N) throw std::invalid_argument("runGroup: cases differ in nranks");
    bufs.push_back(std::make_unique<detail::CollBuffers>(c));
    for (int r = 0; r < N; ++r) ops[size_t(r)].push_back(bufs.back()->op(r));
  }
  std::unique_ptr<SimWorld> own;
  if (!world) {
    own = std::make_unique<SimWorld>(N, cases[0].sim);
    world = own.get();
  }
  SimResult res = world->run(fn, ops, cases[0].plan);
  for (size_t i = 0; i < cases.size(); ++i)
    if (res.ok()) bufs[i]->check(&outs[i].wrong, &outs[i].detail);
  for (size_t i = 0; i + 1 < cases.size(); ++i) outs[i].sim = res;
  outs.back().sim = std::move(res);
  return outs;
}

// Runs one collective on a fresh world (or `world`) and checks it.
inline CollOutcome runCollective(const AlgorithmFn& fn, const CollCase& c, SimWorld* world = nullptr) {
  return runGroup(fn, {c}, world)[0];
}

// Runs one collective with a direct algorithm (loom::oneShotRun,
// loom::stagedRun) on a fresh world (or `world`) and checks it.
inline CollOutcome runDirectCollective(const DirectFn& fn, const CollCase& c, SimWorld* world = nullptr) {
  detail::CollBuffers buf(c);
  std::vector<std::vector<loom::OpDesc>> ops(static_cast<size_t>(c.nranks));
  for (int r = 0; r < c.nranks; ++r) ops[size_t(r)].push_back(buf.op(r));
  std::unique_ptr<SimWorld> own;
  if (!world) {
    own = std::make_unique<SimWorld>(c.nranks, c.sim);
    world = own.get();
  }
  CollOutcome out;
  out.sim = world->runDirect(fn, ops);
  if (out.sim.ok()) buf.check(&out.wrong, &out.detail);
  return out;
}

}  // namespace loomsim
