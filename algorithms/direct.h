// The direct algorithms: one-shot and staged run without the executor,
// straight through PeerMemory (transports/transport.h): every rank reads
// and writes the other ranks' windows and synchronises on 64-bit flags in
// them.  They serve ranks that all share one PeerMemory (shm on one host
// today; CUDA IPC next).  This header holds what both share: the layout of
// a window, the per-communicator state, and how a rank waits on a flag.
#pragma once
#include <array>
#include <atomic>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/schedule.h"
#include "src/core/backoff.h"
#include "src/core/error.h"
#include "src/core/executor.h"
#include "src/device/device.h"
#include "transports/transport.h"

namespace loom {

// A small-message mailbox: the sender writes the payload and the tag, then
// publishes seq (the operation's sequence number + 1).  Two per sender,
// used alternately by operation parity.
struct DirectMailbox {
  std::atomic<uint64_t> seq;
  SlotTag tag;
  uint8_t pad[64 - 8 - sizeof(SlotTag)];
};
static_assert(sizeof(DirectMailbox) == 64, "mailbox header is one cache line");

// The pull line: one cache line in each rank's own window for the smallest
// all-reduces (blocks of at most kPullBytes): the owner publishes its block
// there and every rank reads it in place (one_shot.cc), so an operation
// costs each rank one line written and N read, where mailboxes cost N
// written (header and data) and N read.  Only its owner writes it.
struct DirectPullMeta {
  uint8_t count, bytes, coll, dtype, op;
  uint8_t stamp[3];  // low 24 bits of the stamp its data belongs to
};
struct DirectPullLine {
  std::atomic<uint64_t> seq;   // stamp (seq + 1) of the newest operation published
  std::atomic<uint64_t> done;  // stamp of the newest operation whose lines the owner has all read
  DirectPullMeta meta[2];      // by operation parity, as the data
  uint8_t data[2][16];
};
static_assert(sizeof(DirectPullLine) == 64, "the pull line is one cache line");
constexpr size_t kPullBytes = sizeof(DirectPullLine::data[0]);

// Header of a staging buffer: `input` = chunk stamp once the owner copied
// its input chunk in; `result` = chunk stamp once it wrote its reduced part.
struct DirectStageHeader {
  std::atomic<uint64_t> input;
  std::atomic<uint64_t> result;
  SlotTag tag;
  uint8_t pad[64 - 16 - sizeof(SlotTag)];
};
static_assert(sizeof(DirectStageHeader) == 64, "stage header is one cache line");

// SlotTag::flags of a staging header: kTagInputInPlace (transports/
// transport.h, beside the other flag bits) says the owner's input is not
// staged; it is read in place from the buffer the header's PeerBuffer line
// describes (zero-copy: memory from loomMemAlloc).

// Where things are in one rank's window: acknowledgements (a cache line per
// reader), two mailboxes per sender, staging control (two headers, an ack
// line per reader, two input descriptions), two staging buffers.
struct DirectLayout {
  int nranks = 0;
  size_t mailBytes = 0;   // payload of one mailbox (LOOM_SHM_SMALL_BYTES)
  size_t stageBytes = 0;  // one staging buffer (LOOM_SHM_STAGE_BYTES)
  size_t mailStride() const { return 64 + mailBytes; }
  size_t mailOffset() const { return size_t(nranks) * 64; }
  size_t stageCtlOffset() const { return mailOffset() + size_t(nranks) * 2 * mailStride(); }
  size_t stageInputOffset() const { return stageCtlOffset() + 2 * 64 + size_t(nranks) * 64; }
  size_t zeroCopyOffset() const { return stageInputOffset() + 2 * 64; }
  size_t pullOffset() const { return zeroCopyOffset() + 2 * 64; }
  size_t stageOffset() const { return pullOffset() + 64; }
  // Window bytes the direct algorithms need (0: neither is enabled).
  size_t bytes() const { return mailBytes || stageBytes ? stageOffset() + 2 * stageBytes : 0; }
};

// One rank's window seen through the layout.
struct DirectWindow {
  uint8_t* base;
  const DirectLayout* l;
  // In the sender's window: seq + 1 of the last mailbox `reader` consumed.
  std::atomic<uint64_t>* mailAck(int reader) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + size_t(reader) * 64);
  }
  // Mailbox that `sender` fills in this window for operations of parity p.
  DirectMailbox* mailbox(int sender, int parity) const {
    return reinterpret_cast<DirectMailbox*>(base + l->mailOffset() +
                                            (size_t(sender) * 2 + size_t(parity)) * l->mailStride());
  }
  uint8_t* mailData(int sender, int parity) const { return reinterpret_cast<uint8_t*>(mailbox(sender, parity)) + 64; }
  DirectStageHeader* stageHeader(int parity) const {
    return reinterpret_cast<DirectStageHeader*>(base + l->stageCtlOffset() + size_t(parity) * 64);
  }
  std::atomic<uint64_t>* stageAck(int reader) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + l->stageCtlOffset() + 128 + size_t(reader) * 64);
  }
  // Where the owner's input is when its header has kTagInputInPlace.
  PeerBuffer* stageInput(int parity) const {
    return reinterpret_cast<PeerBuffer*>(base + l->stageInputOffset() + size_t(parity) * 64);
  }
  // Zero-copy collectives (directZeroCopy): (seq + 1) << 1, | 1 if this
  // rank's buffers of operation seq can be mapped (then stageInput(0) and
  // (1) describe its input and output, where peers touch them); and
  // seq + 1 once it wrote its last byte and read its last byte of the
  // others' buffers.
  std::atomic<uint64_t>* zeroCopyVote() const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + l->zeroCopyOffset());
  }
  // The operation this rank voted for (written before the vote): a peer
  // that runs another operation as this sequence number on another path
  // learns it here rather than at the timeout.
  SlotTag* zeroCopyVoteTag() const { return reinterpret_cast<SlotTag*>(base + l->zeroCopyOffset() + 8); }
  // The vote's tag as a seqlock on its `seq`: the owner writes ~0 there,
  // the other fields, then the number; a reader that finds the number it
  // wants before and after its copy has an untorn tag of that operation.
  void publishVoteTag(const SlotTag& t) const {
    SlotTag* d = zeroCopyVoteTag();
    __atomic_store_n(&d->seq, ~uint64_t(0), __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_release);
    SlotTag rest = t;
    rest.seq = ~uint64_t(0);
    memcpy(static_cast<void*>(d), &rest, sizeof rest);
    __atomic_store_n(&d->seq, t.seq, __ATOMIC_RELEASE);
  }
  bool readVoteTag(uint64_t seq, SlotTag* out) const {
    const SlotTag* s = zeroCopyVoteTag();
    if (__atomic_load_n(&s->seq, __ATOMIC_ACQUIRE) != seq) return false;
    memcpy(out, static_cast<const void*>(s), sizeof *out);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) != seq) return false;
    out->seq = seq;
    return true;
  }
  std::atomic<uint64_t>* zeroCopyDone() const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base + l->zeroCopyOffset() + 64);
  }
  DirectPullLine* pullLine() const { return reinterpret_cast<DirectPullLine*>(base + l->pullOffset()); }
  uint8_t* stage(int parity) const { return base + l->stageOffset() + size_t(parity) * l->stageBytes; }
};

// What the direct algorithms remember between operations of a communicator.
struct DirectState {
  std::vector<std::array<uint64_t, 2>> lastMail;  // per reader: seq+1 last written per parity
  uint64_t stageChunk = 0;                        // chunks staged so far (stamps of the staging buffers)
  std::vector<uint8_t*> windows;                  // PeerMemory::window(r), looked up once
  std::vector<uint8_t> piece;                     // zero-copy all-reduce: one reduced piece
  std::array<uint64_t, 2> lastPull{{0, 0}};        // stamp last published in the pull line, per parity
  std::vector<uint64_t> pullDone;                 // per rank: pulls it has finished, as far as seen
  uint64_t pullUnpublished = 0;                   // stamp of my last pull, finished but its `done` not stored
};

// Everything a direct algorithm runs with.
struct DirectContext {
  ExecEnv& env;           // sleeping, aborts, timeouts, the other path's stalls
  const PeerMemory& mem;  // every rank's window
  Device& device;         // copies and reduces the buffers and windows (the memory's device)
  DirectLayout layout;
  DirectState& state;
  int rank = 0;
  int nranks = 0;
  bool checkMode = true;
  // Rank r's window (the addresses are fixed for the communicator's life,
  // so they are asked of the PeerMemory once: the one-shot path's latency
  // is a few cache-line transfers, and a virtual call per access shows).
  DirectWindow win(int r) const {
    if (state.windows.empty()) {
      for (int q = 0; q < nranks; ++q) state.windows.push_back(mem.window(q));
    }
    return DirectWindow{state.windows[size_t(r)], &layout};
  }
};

// algorithms/one_shot.cc: every collective but P2P, blocks of at most mailBytes.
void oneShotRun(DirectContext& ctx, const OpDesc& op, const SlotTag& tag);
// A pull all-reduce (one_shot.cc) leaves its `done` unstored: this rank's
// next pull line says it finished (a line is published only after the
// previous operation ended), which saves a store and a round of wake-ups
// per operation.  Every other operation stores it first, through this (the
// direct paths themselves, loomComm::runOps for the rest); it does nothing
// when there is nothing to store.
void directPublishPullDone(DirectContext& ctx);
// Whether oneShotRun runs `op` as a pull all-reduce.
bool oneShotPulls(const OpDesc& op, int nranks);
// algorithms/staged.cc: all-reduce of any size, in chunks of stageBytes.
void stagedRun(DirectContext& ctx, const OpDesc& op, const SlotTag& tag);

// The zero-copy collectives (algorithms/zero_copy.cc), tried first by
// stagedRun and, for a collective the tuner gave to a schedule, by the
// communicator: when every buffer the ranks read or write across ranks can
// be mapped (memory from loomMemAlloc), each rank moves its share straight
// between the users' buffers (all-reduce: reduces its 1/N part out of all
// inputs into every output; all-gather, reduce-scatter, broadcast: pulls
// into its own output) and true is returned; otherwise false, and the
// caller runs its own path.  Operations that move less than
// directZeroCopyMinBytes, and other collectives, answer false at once on
// every rank alike; the others cost one round of flags (each rank's vote
// in its window), which is how all ranks decide alike without a message.
bool directZeroCopy(DirectContext& ctx, const OpDesc& op, const SlotTag& tag);
// The fewest bytes (of the operation's largest buffer) that vote.
size_t directZeroCopyMinBytes(size_t stageBytes, bool oversubscribed);

// Their registry entries' rules and costs (algorithms/registry.cc).
struct Eligibility;
struct CostInput;
struct Estimate;
const char* oneShotEligible(const Eligibility& q);
void oneShotEstimate(const CostInput& in, std::vector<Estimate>* out);
const char* stagedEligible(const Eligibility& q);
void stagedEstimate(const CostInput& in, std::vector<Estimate>* out);

// For a rank waiting on the executor path: throws loomInvalidUsage if
// `peer` visibly runs another operation than `mine` on a direct path.
void directCheckStalled(const DirectContext& ctx, int peer, const SlotTag& mine);
// Fails naming the mismatch when `peer` posted another operation than
// `mine` under its sequence number into any rank's mailbox (its own too).
void directCheckPosted(const DirectContext& ctx, int peer, const SlotTag& mine);
// The same without throwing: true, with *t what `peer` runs, when it
// visibly runs another operation than `mine` on a direct path (a mailbox
// for this rank, a staging header or its pull line stamped with mine.seq).
bool directPeerOnOtherPath(const DirectContext& ctx, int peer, const SlotTag& mine, SlotTag* t);

// Waits until ready(): spin, then sleep on the rank's doorbell, checking
// every 20 ms that the peer is alive and not running another operation on
// the executor path, and failing with loomTimeout after the timeout.
template <class Ready>
void directWait(DirectContext& ctx, Ready ready, int peer, const SlotTag& tag, const char* what) {
  if (ready()) return;
  Backoff backoff(ctx.env.spinUs(), ctx.env.oversubscribed(), ctx.env.cpuContention());
  int64_t lastCheck = 0;
  std::vector<pollfd> none;
  for (;;) {
    if (ready()) return;
    if (backoff.spin()) continue;
    const int64_t now = backoff.lastNs();
    if (!lastCheck) lastCheck = now;  // the first check 20 ms into the sleeping
    if (now - lastCheck > 20 * 1000000LL) {
      lastCheck = now;
      ctx.env.checkAborted();
      try {
        ctx.mem.checkPeer(peer);
      } catch (const Error&) {
        if (ready()) return;  // it finished its part before exiting
        throw;
      }
      try {
        ctx.env.checkOtherPath(tag, peer);
        if (tag.coll != uint8_t(Collective::P2P)) directCheckPosted(ctx, peer, tag);
      } catch (const Error&) {
        // The zero-copy vote: a peer that saw every vote may already run
        // the operation on the executor path while this rank, between its
        // last look and this check, was about to see the last vote.
        if (ready()) return;
        throw;
      }
    }
    if (backoff.waited() / 1000000 > ctx.env.timeoutMs())
      fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (%s)", ctx.rank,
           describeTag(tag).c_str(), (long long)ctx.env.timeoutMs(), peer, what);
    uint32_t token = ctx.env.sleepBegin(false);
    if (ready()) {
      ctx.env.sleepEnd();
      return;
    }
    ctx.env.sleepWait(token, none, true, 5000);
    ctx.env.sleepEnd();
  }
}

}  // namespace loom
