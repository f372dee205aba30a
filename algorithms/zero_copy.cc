// Zero-copy collectives for ranks that share memory: when every buffer a
// collective reads or writes across ranks lies in memory the peers can map
// (loomMemAlloc), nothing goes through staging buffers or connection
// slots.  Each rank publishes where its buffers are, the ranks vote in
// their windows that all of them can be mapped, and each rank then moves
// its share of the data straight between the users' buffers:
//
//   all-reduce      reduce my 1/N part out of all N inputs (a cache-sized
//                   piece at a time) and write it into all N outputs
//   all-gather      copy every rank's input into my output (pull)
//   reduce-scatter  reduce my part out of all N inputs into my output (pull)
//   broadcast       copy the root's input into my output (pull)
//   all-to-all      copy block `me` of every rank's input into my output
//   gather          the root copies every rank's input into its output
//   scatter         copy block `me` of the root's input into my output
//
// Per operation there are two rounds of flags whatever the size: the vote,
// and "done" (a rank returns only when nobody reads its buffers any more).
// A ring moves the same bytes in 2(N-1) or N-1 dependent slot hand-offs per
// chunk; a hand-off is cheap on an idle core, but when the ranks share
// their cores with compute (an all-gather prefetched while a layer
// computes, more ranks than cores) every one can wait for a time slice.
//
// The vote is a barrier: it costs every rank the wait for the slowest to
// arrive, a few us even on a quiet host (measured: 256 KiB all-reduces on
// ordinary buffers lost ~20% to it, 1 MiB ones nothing visible), and with
// more ranks than cores a sleep and a wake-up per rank.  So only operations
// that move at least 1 MiB vote (4 MiB with more ranks than cores), and
// reduce (one rank's output, reduced by it alone) never does.  Every rank of one host computes
// the same (oversubscribed() counts the host's ranks and cores).
#include <algorithm>
#include <cstring>

#include "algorithms/direct.h"
#include "src/core/log.h"
#include "src/device/host_copy.h"    // kStreamingCopyBytes
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

size_t directZeroCopyMinBytes(size_t stageBytes, bool oversubscribed) {
  return std::max<size_t>(stageBytes, oversubscribed ? (4u << 20) : (1u << 20));
}

namespace {

// What of a rank's buffers the other ranks touch in a zero-copy run.
struct Exposure {
  bool input = false;   // they read my input
  bool output = false;  // they write my output (all-reduce)
};

Exposure exposureOf(const OpDesc& op, int me) {
  switch (op.coll) {
    case Collective::AllReduce: return {true, true};
    case Collective::AllGather:
    case Collective::ReduceScatter:
    case Collective::AllToAll: return {true, false};
    case Collective::Broadcast:
    case Collective::Scatter: return {me == op.root, false};
    case Collective::Gather: return {me != op.root, false};
    default: return {};
  }
}

// Bytes of the operation's largest buffer (all ranks compute the same).
size_t movedBytes(const OpDesc& op, int N) {
  const size_t b = op.count * dtypeSize(op.dtype);
  return op.coll == Collective::AllReduce || op.coll == Collective::Broadcast ? b : b * size_t(N);
}

// Bytes of the buffer a peer maps: the input, or (all-reduce) the output.
size_t inputBytes(const OpDesc& op, int N) {
  const size_t b = op.count * dtypeSize(op.dtype);
  const bool blocks = op.coll == Collective::ReduceScatter || op.coll == Collective::AllToAll ||
                      op.coll == Collective::Scatter;
  return blocks ? b * size_t(N) : b;
}

// Reduces elements [off, off + n) of every rank's input into acc: mine
// first, then the others in rank order after me (the order the staged path
// uses), then the average's division.
void reducePart(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins, uint8_t* acc,
                size_t off, size_t n) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t esz = dtypeSize(op.dtype);
  ctx.device.reduce(acc, ins[size_t(me)] + off * esz, ins[size_t((me + 1) % N)] + off * esz, n, op.dtype, op.op);
  for (int i = 2; i < N; ++i)
    ctx.device.reduce(acc, acc, ins[size_t((me + i) % N)] + off * esz, n, op.dtype, op.op);
  if (op.op == loomAvg) ctx.device.divide(acc, acc, n, op.dtype, N);
}

void allReduce(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins,
               const std::vector<uint8_t*>& outs) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t esz = dtypeSize(op.dtype), bytes = op.count * esz;
  // My part, a cache-sized piece at a time: reduce the inputs into my
  // output, then copy the piece (from cache) into the others'.  In
  // place, the piece of q's output I write is the piece of q's input that
  // only I read, and I have read it already; the piece is reduced where it
  // lies (those lines were just read).  Out of place it is reduced into a
  // cache-resident scratch piece, which is then copied into every output,
  // mine included, so that no output line is read for ownership.
  const size_t pb = partBegin(op.count, N, me), pn = partBegin(op.count, N, me + 1) - pb;
  const size_t pieceBytes = 64u << 10, piece = std::max<size_t>(1, pieceBytes / esz);
  const bool inPlace = op.sendbuf == op.recvbuf;
  // In place, the piece of q's output I write is the piece of q's input I
  // just read: those lines are in my cache, and a streaming store would
  // throw them out (measured, N = 2 in place: 16 MiB 24 GB/s cached, 12-19
  // streaming; 64 MiB 14 vs 11).  Out of place, large outputs are written
  // around the cache (no read for ownership: 64 MiB 9 GB/s vs 6).
  const CopyHint hint = !inPlace && bytes >= kStreamingCopyBytes ? CopyHint::Streaming : CopyHint::Cached;
  uint8_t* scratch = nullptr;
  if (!inPlace) {
    if (ctx.state.piece.size() < piece * esz + 64) ctx.state.piece.resize(piece * esz + 64);
    scratch = ctx.state.piece.data() + (64 - reinterpret_cast<uintptr_t>(ctx.state.piece.data()) % 64) % 64;
  }
  for (size_t off = pb; off < pb + pn; off += piece) {
    const size_t n = std::min(piece, pb + pn - off);
    uint8_t* acc = inPlace ? outs[size_t(me)] + off * esz : scratch;
    reducePart(ctx, op, ins, acc, off, n);
    for (int q = 0; q < N; ++q)
      if (q != me || !inPlace) ctx.device.copy(outs[size_t(q)] + off * esz, acc, n * esz, hint);
  }
}

void allGather(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t block = op.count * dtypeSize(op.dtype);
  uint8_t* out = static_cast<uint8_t*>(op.recvbuf);
  const CopyHint hint = block * size_t(N) >= kStreamingCopyBytes ? CopyHint::Streaming : CopyHint::Cached;
  // Starting after me spreads the readers of one input over time.
  for (int i = 0; i < N; ++i) {
    const int q = (me + i) % N;
    uint8_t* dst = out + size_t(q) * block;
    if (dst != ins[size_t(q)]) ctx.device.copy(dst, ins[size_t(q)], block, hint);  // in place: mine is there
  }
}

void reduceScatter(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins) {
  const int me = ctx.rank;
  const size_t esz = dtypeSize(op.dtype);
  // Part me of every input, reduced straight into my output (in place my
  // output is part me of my input, which only I read).
  std::vector<const uint8_t*> part(ins.size());
  for (size_t q = 0; q < ins.size(); ++q) part[q] = ins[q] + size_t(me) * op.count * esz;
  uint8_t* out = static_cast<uint8_t*>(op.recvbuf);
  const size_t piece = std::max<size_t>(1, (size_t(64) << 10) / esz);
  for (size_t off = 0; off < op.count; off += piece)
    reducePart(ctx, op, part, out + off * esz, off, std::min(piece, op.count - off));
}

void broadcast(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins) {
  const size_t bytes = op.count * dtypeSize(op.dtype);
  const uint8_t* src = ins[size_t(op.root)];
  if (src != op.recvbuf)
    ctx.device.copy(static_cast<uint8_t*>(op.recvbuf), src, bytes,
                    bytes >= kStreamingCopyBytes ? CopyHint::Streaming : CopyHint::Cached);
}

// All-to-all: block me of every input; gather (root): every input;
// scatter: block me of the root's input.  Each into its block of my output
// (scatter: my output), skipping what in place is already there.
void exchange(DirectContext& ctx, const OpDesc& op, const std::vector<const uint8_t*>& ins) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t block = op.count * dtypeSize(op.dtype);
  uint8_t* out = static_cast<uint8_t*>(op.recvbuf);
  const CopyHint hint = block * size_t(N) >= kStreamingCopyBytes ? CopyHint::Streaming : CopyHint::Cached;
  auto move = [&](uint8_t* dst, const uint8_t* src) {
    if (dst != src) ctx.device.copy(dst, src, block, hint);
  };
  if (op.coll == Collective::Scatter) {
    move(out, ins[size_t(op.root)] + size_t(me) * block);
    return;
  }
  if (op.coll == Collective::Gather && me != op.root) return;
  for (int i = 0; i < N; ++i) {
    const int q = (me + i) % N;
    const uint8_t* src = op.coll == Collective::AllToAll ? ins[size_t(q)] + size_t(me) * block : ins[size_t(q)];
    move(out + size_t(q) * block, src);
  }
}

}  // namespace

bool directZeroCopy(DirectContext& ctx, const OpDesc& op, const SlotTag& tag) {
  const int N = ctx.nranks, me = ctx.rank;
  const Exposure mineExposed = exposureOf(op, me);
  const bool serves = op.coll != Collective::Reduce && op.coll != Collective::P2P;
  if (!serves || N < 2 || !ctx.layout.stageBytes ||
      movedBytes(op, N) < directZeroCopyMinBytes(ctx.layout.stageBytes, ctx.env.oversubscribed()))
    return false;
  const DirectWindow myWin = ctx.win(me);
  const size_t inBytes = inputBytes(op, N), outBytes = op.count * dtypeSize(op.dtype);
  PeerBuffer in, out;
  bool mine = true;
  if (mineExposed.input) mine = ctx.mem.exportBuffer(op.sendbuf, inBytes, &in);
  if (mine && mineExposed.output) mine = ctx.mem.exportBuffer(op.recvbuf, outBytes, &out);
  if (mine) {
    memcpy(myWin.stageInput(0), &in, sizeof in);
    memcpy(myWin.stageInput(1), &out, sizeof out);
  }
  // Vote.  A rank that votes for a later operation before I read its vote
  // for this one has finished this one, so it found some vote false (with
  // every vote true it would wait for my "done"): the answer is no.  Every
  // collective but broadcast finishes only after every rank joined it; a
  // broadcast's root can finish on the executor path while a receiver is
  // still about to read the vote, as far ahead as the connections buffer.
  // A peer that ran this sequence number as another operation on another
  // direct path (a tiny all-reduce on its pull line against this large
  // one) never votes: seen there, it is a mismatch now, not a timeout.
  const uint64_t stamp = (tag.seq + 1) << 1;
  myWin.publishVoteTag(tag);
  myWin.zeroCopyVote()->store(stamp | uint64_t(mine), std::memory_order_release);
  ctx.mem.wakeOthers(me, N);
  bool all = mine;
  for (int q = 0; q < N; ++q) {
    if (q == me) continue;
    std::atomic<uint64_t>* vote = ctx.win(q).zeroCopyVote();
    SlotTag other;
    bool elsewhere = false;
    auto voted = [&] { return (vote->load(std::memory_order_acquire) | 1) >= (stamp | 1); };
    directWait(ctx,
               [&] {
                 return voted() ||
                        (elsewhere = directPeerOnOtherPath(ctx, q, tag, &other) && !sameOperation(other, tag));
               },
               q, tag, "its zero-copy vote");
    if (elsewhere && !voted()) failMismatch(me, q, other, tag);
    const uint64_t v = vote->load(std::memory_order_acquire);
    // Check mode: every rank reads every vote's tag, so ranks that name
    // different roots (each exposing the buffers its own view needs) all
    // stop here instead of reading a root that never exposed its input.
    // The tag is this operation's (its number, read untorn) while the vote
    // still is: a peer done with it may be writing its next one's.
    if (ctx.checkMode && (v | 1) == (stamp | 1)) {
      if (ctx.win(q).readVoteTag(tag.seq, &other) && (vote->load(std::memory_order_acquire) | 1) == (stamp | 1) &&
          !sameOperation(other, tag))
        failMismatch(me, q, other, tag);
    }
    all &= v == (stamp | 1);
  }
  LOOM_TRACE("COLL", "rank %d: %s: %s", me, describeTag(tag).c_str(),
             all ? "every rank's buffers can be mapped: zero-copy"
                 : mine ? "some rank's buffers cannot be mapped: no zero-copy" : "my buffers cannot be mapped");
  if (!all) return false;

  // Everyone's exposed buffers, mapped here (cached by the PeerMemory).
  std::vector<const uint8_t*> ins(size_t(N), nullptr);
  std::vector<uint8_t*> outs(size_t(N), nullptr);
  for (int q = 0; q < N; ++q) {
    const Exposure e = exposureOf(op, q);
    if (q == me) {
      ins[size_t(q)] = static_cast<const uint8_t*>(op.sendbuf);
      outs[size_t(q)] = static_cast<uint8_t*>(op.recvbuf);
      continue;
    }
    PeerBuffer b;
    // Gather: only the root reads the others' inputs.
    if (e.input && (op.coll != Collective::Gather || me == op.root)) {
      memcpy(&b, ctx.win(q).stageInput(0), sizeof b);
      ins[size_t(q)] = ctx.mem.importBuffer(q, b, inBytes, tag.seq);
    }
    if (e.output) {
      memcpy(&b, ctx.win(q).stageInput(1), sizeof b);
      outs[size_t(q)] = const_cast<uint8_t*>(ctx.mem.importBuffer(q, b, outBytes, tag.seq));
    }
  }
  switch (op.coll) {
    case Collective::AllReduce: allReduce(ctx, op, ins, outs); break;
    case Collective::AllGather: allGather(ctx, op, ins); break;
    case Collective::ReduceScatter: reduceScatter(ctx, op, ins); break;
    case Collective::Broadcast: broadcast(ctx, op, ins); break;
    default: exchange(ctx, op, ins); break;
  }
  // Done; return once everyone is: then all of my output is written and
  // nobody reads my buffers any more.  (>=: a faster rank may already have
  // stamped its next operation.)
  myWin.zeroCopyDone()->store(tag.seq + 1, std::memory_order_release);
  ctx.mem.wakeOthers(me, N);
  for (int q = 0; q < N; ++q) {
    if (q == me) continue;
    std::atomic<uint64_t>* done = ctx.win(q).zeroCopyDone();
    directWait(ctx, [&] { return done->load(std::memory_order_acquire) >= tag.seq + 1; }, q, tag,
               "it to finish the zero-copy operation");
  }
  return true;
}

}  // namespace loom
