// The one-shot path for small collectives between ranks that share memory.
//
// Every rank writes its block straight into a mailbox in each reader's
// window (one cache-line-aligned copy, then a release store of the sequence
// number), then reads the blocks addressed to it and combines them in rank
// order, so every rank computes bit-identical results.  Latency is one
// cache-line transfer plus the copies; there is no progress thread, no
// lock and no system call unless a rank has to sleep.  Readers acknowledge
// in the writer's window so a mailbox is never overwritten while in use
// (two mailboxes per writer, alternating by operation parity).
#include <algorithm>
#include <cstring>

#include "algorithms/direct.h"
#include "algorithms/registry.h"
#include "src/core/hot.h"
#include "src/device/host_reduce.h"

namespace loom {

// At run time the communicator's limits are zero unless every rank shares
// peer memory; the cost model sees the shape instead.
const char* oneShotEligible(const Eligibility& q) {
  if (!q.allShm) return "it needs every rank to share memory";
  if (!q.oneShotBytes || q.block > double(q.oneShotBytes)) return "it needs blocks of at most LOOM_SHM_SMALL_BYTES";
  return nullptr;
}

// One-shot: every rank reads every other rank's block from its mailbox
// (all-to-all: every rank writes N-1 blocks too; gather and scatter: only the
// root handles N-1 blocks).
void oneShotEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double n = in.n, block = in.block;
  double us = in.p.oneShotUs + 1.5 * in.osUs + xfer((n - 1) * block, in.lp(CostLink::Shm).betaGBps) +
              (in.reducing ? in.reduce((n - 1) * block) : 0);
  out->push_back(Estimate{Algorithm::OneShot, Algorithm::Ring, us, ""});
}


// The operation a pull line's metadata describes (seq: the stamp's).
static SlotTag pullTag(const DirectPullMeta& m, uint64_t seq) {
  SlotTag t{};
  t.seq = seq;
  t.count = m.count;
  t.bytes = m.bytes;
  t.coll = m.coll;
  t.dtype = m.dtype;
  t.op = m.op;
  t.root = -1;
  return t;
}

LOOM_HOT bool directPeerOnOtherPath(const DirectContext& ctx, int peer, const SlotTag& mine, SlotTag* t) {
  DirectMailbox* mb = ctx.win(ctx.rank).mailbox(peer, int(mine.seq & 1));
  if (mb->seq.load(std::memory_order_acquire) == mine.seq + 1) {
    memcpy(t, &mb->tag, sizeof *t);
    return true;
  }
  // Or the peer staged this operation (staged.cc).
  for (int p = 0; p < 2 && ctx.layout.stageBytes; ++p) {
    DirectStageHeader* h = ctx.win(peer).stageHeader(p);
    memcpy(t, &h->tag, sizeof *t);
    if (h->input.load(std::memory_order_acquire) != 0 && t->seq == mine.seq) return true;
  }
  // Or it published this operation in its pull line.
  DirectPullLine* pl = ctx.win(peer).pullLine();
  // Exactly: a line one operation further on means the peer ran this one
  // (somehow) and waits for this rank in the next.
  if (pl->seq.load(std::memory_order_acquire) == mine.seq + 1) {
    *t = pullTag(pl->meta[mine.seq & 1], mine.seq);
    return true;
  }
  // Or it voted for another operation as this one (zero_copy.cc).  The
  // same operation's vote stays visible while every rank runs it on the
  // executor path (the vote said no), so only another one counts.  The
  // tag is this operation's (its number, read untorn) while the vote still is.
  if (ctx.layout.stageBytes) {
    const DirectWindow w = ctx.win(peer);
    const uint64_t want = (mine.seq + 1) << 1;
    if ((w.zeroCopyVote()->load(std::memory_order_acquire) | 1) == (want | 1) && w.readVoteTag(mine.seq, t) &&
        (w.zeroCopyVote()->load(std::memory_order_acquire) | 1) == (want | 1) && !sameOperation(*t, mine))
      return true;
  }
  return false;
}

void directCheckPosted(const DirectContext& ctx, int peer, const SlotTag& mine) {
  // One-shot rooted collectives whose root the ranks name differently (a
  // reduce's data, a broadcast's header gone to another root) would
  // otherwise end only at the timeout.  The tag is read between two looks
  // at the stamp.
  const uint64_t stamp = mine.seq + 1;
  for (int x = 0; x < ctx.nranks; ++x) {
    if (x == ctx.rank) continue;  // the peer's mail to this rank is the caller's to judge
    DirectMailbox* mb = ctx.win(x).mailbox(peer, int(mine.seq & 1));
    if (mb->seq.load(std::memory_order_acquire) != stamp) continue;
    SlotTag t;
    memcpy(&t, &mb->tag, sizeof t);
    std::atomic_thread_fence(std::memory_order_acquire);
    // The tag must be this operation's too: a peer two operations ahead may
    // be between writing the next tag and its stamp.
    if (mb->seq.load(std::memory_order_relaxed) == stamp && t.seq == mine.seq && !sameOperation(t, mine))
      failMismatch(ctx.rank, peer, t, mine);
  }
}

void directCheckStalled(const DirectContext& ctx, int peer, const SlotTag& mine) {
  SlotTag t;
  if (directPeerOnOtherPath(ctx, peer, mine, &t)) failMismatch(ctx.rank, peer, t, mine);
  directCheckPosted(ctx, peer, mine);
}

// The smallest all-reduces: each rank publishes its block in its own pull
// line and reads everyone's in place, in rank order (bit-identical results
// everywhere).  A line's data of parity p is rewritten two operations
// later, once every rank finished that operation: its `done` says so, or
// its line carrying a later stamp does (a rank publishes only after its
// previous operation ended).  A rank learns that from the lines it reads
// anyway, so it waits only when the operation in between was not a pull;
// and it stores its own `done` only before an operation that is not a pull
// (directPublishPullDone).
LOOM_HOT static void pullAllReduce(DirectContext& ctx, const OpDesc& op, const SlotTag& tag, size_t block) {
  const int N = ctx.nranks, me = ctx.rank;
  const int parity = int(tag.seq & 1);
  const uint64_t stamp = tag.seq + 1;
  DirectState& st = ctx.state;
  st.pullDone.resize(size_t(N), 0);
  DirectPullLine* mine = ctx.win(me).pullLine();
  if (uint64_t last = st.lastPull[size_t(parity)]) {
    for (int r = 0; r < N; ++r) {
      if (r == me || st.pullDone[size_t(r)] >= last) continue;
      DirectPullLine* l = ctx.win(r).pullLine();
      directWait(ctx,
                 [&] {
                   return l->done.load(std::memory_order_acquire) >= last ||
                          l->seq.load(std::memory_order_acquire) > last;
                 },
                 r, tag, "its acknowledgement");
      st.pullDone[size_t(r)] = last;
    }
  }
  DirectPullMeta m{uint8_t(op.count), uint8_t(block), uint8_t(op.coll), uint8_t(op.dtype), uint8_t(op.op),
                   {uint8_t(stamp), uint8_t(stamp >> 8), uint8_t(stamp >> 16)}};
  ctx.device.copy(mine->data[parity], op.sendbuf, block, CopyHint::Cached);
  mine->meta[parity] = m;
  mine->seq.store(stamp, std::memory_order_release);  // and so: my previous pull is done
  st.lastPull[size_t(parity)] = stamp;
  st.pullUnpublished = 0;
  ctx.mem.wakeOthers(me, N);

  // op over the lines in rank order, each as soon as it is there (the last
  // one's arrival ends the wait: little work after it), assembled aside: a
  // mismatch found at a later line leaves the caller's buffer as it was.
  // The lines and `out` are host memory wherever the caller's buffers live.
  const HostReduceFn combine = hostReduceSmallFn(op.dtype, op.op);
  if (!combine) fail(loomInternalError, "rank %d: no reduction for %s", me, describeTag(tag).c_str());
  alignas(16) uint8_t out[kPullBytes];
  for (int q = 0; q < N; ++q) {
    DirectPullLine* l = ctx.win(q).pullLine();
    SlotTag other;
    bool elsewhere = false;
    if (l->seq.load(std::memory_order_acquire) < stamp) {
      // q on another path is a mismatch, an error: looked for on every
      // 16th look only, as a look reads lines in four places of two
      // windows, and with more ranks than cores a rank looks once per
      // time slice (8 ranks on 2 cores, 8 B: 0.5 us of 10 looking every time).
      unsigned looks = 0;
      directWait(ctx,
                 [&] {
                   return l->seq.load(std::memory_order_acquire) >= stamp ||
                          ((++looks & 15) == 0 && (elsewhere = directPeerOnOtherPath(ctx, q, tag, &other)));
                 },
                 q, tag, "its data");
      if (elsewhere && l->seq.load(std::memory_order_acquire) < stamp) failMismatch(me, q, other, tag);
    }
    const DirectPullMeta qm = l->meta[parity];
    // Its line has moved past this operation, but its data of this parity
    // is older: it ran this operation on another path.
    if (memcmp(qm.stamp, m.stamp, sizeof m.stamp) != 0) {
      if (directPeerOnOtherPath(ctx, q, tag, &other)) failMismatch(me, q, other, tag);
      fail(loomInvalidUsage, "rank %d: mismatched operations: rank %d did not run %s the way rank %d did (not as the "
           "same small all-reduce)", me, q, describeTag(tag).c_str(), me);
    }
    if (qm.bytes != m.bytes || (ctx.checkMode && (qm.count != m.count || qm.coll != m.coll || qm.dtype != m.dtype ||
                                                  qm.op != m.op)))
      failMismatch(me, q, pullTag(qm, tag.seq), tag);
    // q published this operation, so it finished every earlier one.
    if (q != me) st.pullDone[size_t(q)] = std::max(st.pullDone[size_t(q)], stamp - 1);
    if (q == 0) memcpy(out, l->data[parity], block);
    else combine(out, out, l->data[parity], op.count);
  }
  if (op.op == loomAvg) divideHost(out, out, op.count, op.dtype, N);
  ctx.device.copy(op.recvbuf, out, block, CopyHint::Cached);
  st.pullUnpublished = stamp;
}

LOOM_HOT bool oneShotPulls(const OpDesc& op, int nranks) {
  const size_t block = op.count * dtypeSize(op.dtype);
  return op.coll == Collective::AllReduce && block > 0 && block <= kPullBytes &&
         nranks > 1;
}

void directPublishPullDone(DirectContext& ctx) {
  DirectState& st = ctx.state;
  if (!st.pullUnpublished) return;
  ctx.win(ctx.rank).pullLine()->done.store(st.pullUnpublished, std::memory_order_release);
  st.pullUnpublished = 0;
  // A rank whose next pull follows this operation may wait for it.
  ctx.mem.wakeOthers(ctx.rank, ctx.nranks);
}

LOOM_HOT void oneShotRun(DirectContext& ctx, const OpDesc& op, const SlotTag& tag) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t esz = dtypeSize(op.dtype), block = op.count * esz;
  if (oneShotPulls(op, N)) {
    pullAllReduce(ctx, op, tag, block);
    return;
  }
  // Before anything else, even an operation of no bytes: two pulls on
  // either side of an operation that stored nothing would each wait for
  // the other's `done`.
  directPublishPullDone(ctx);
  if (block == 0) return;
  if (block > ctx.layout.mailBytes)
    fail(loomInternalError, "one-shot block of %zu bytes above the mailbox's %zu", block, ctx.layout.mailBytes);
  const int parity = int(tag.seq & 1);
  const uint64_t stamp = tag.seq + 1;
  const uint8_t* send = static_cast<const uint8_t*>(op.sendbuf);
  uint8_t* recv = static_cast<uint8_t*>(op.recvbuf);
  const DirectWindow mine = ctx.win(me);
  ctx.state.lastMail.resize(size_t(N), {0, 0});

  // Writes `data` into p's mailbox from me (p == me: my own, which keeps
  // in-place operations safe: every input is read from a mailbox); null: a
  // header, the tag alone.
  auto post = [&](int p, const void* data) {
    uint64_t last = ctx.state.lastMail[size_t(p)][size_t(parity)];
    if (last) {
      std::atomic<uint64_t>* ack = mine.mailAck(p);
      directWait(ctx, [&] { return ack->load(std::memory_order_acquire) >= last; }, p, tag, "its acknowledgement");
    }
    DirectWindow w = ctx.win(p);
    if (data) ctx.device.copy(w.mailData(me, parity), data, block, CopyHint::Cached);
    SlotTag t = tag;
    t.bytes = data ? uint32_t(block) : 0;
    DirectMailbox* mb = w.mailbox(me, parity);
    memcpy(&mb->tag, &t, sizeof t);
    mb->seq.store(stamp, std::memory_order_release);
    ctx.state.lastMail[size_t(p)][size_t(parity)] = stamp;
    ctx.mem.wake(p);
  };
  // Waits for q's block (`bytes` of it: the block, or 0 for a header) in my
  // window and checks that q runs the same operation.
  auto take = [&](int q, size_t bytes) -> const uint8_t* {
    DirectMailbox* mb = mine.mailbox(q, parity);
    DirectPullLine* pl = ctx.win(q).pullLine();  // q on the pull path: another operation
    directWait(ctx,
               [&] {
                 return mb->seq.load(std::memory_order_acquire) == stamp ||
                        pl->seq.load(std::memory_order_acquire) == stamp;
               },
               q, tag, "its data");
    if (mb->seq.load(std::memory_order_acquire) != stamp) failMismatch(me, q, pullTag(pl->meta[parity], tag.seq), tag);
    SlotTag t;
    memcpy(&t, &mb->tag, sizeof t);
    if (t.bytes != bytes || (ctx.checkMode && !sameOperation(t, tag))) failMismatch(me, q, t, tag);
    return mine.mailData(q, parity);
  };
  auto ack = [&](int q) {
    ctx.win(q).mailAck(me)->store(stamp, std::memory_order_release);
    ctx.mem.wake(q);
  };
  // recv = op over ranks of the mailboxes, in rank order.
  auto combineAll = [&](uint8_t* out) {
    for (int q = 0; q < N; ++q) {
      const uint8_t* d = take(q, block);
      if (q == 0) ctx.device.copy(out, d, block, CopyHint::Cached);
      else ctx.device.reduce(out, out, d, op.count, op.dtype, op.op);
    }
    if (op.op == loomAvg) ctx.device.divide(out, out, op.count, op.dtype, N);
    for (int q = 0; q < N; ++q) ack(q);
  };

  // Copies q's block from my mailbox to dst and frees the mailbox.
  auto receive = [&](int q, uint8_t* dst) {
    ctx.device.copy(dst, take(q, block), block, CopyHint::Cached);
    ack(q);
  };
  // Posts base + p*block to each other rank p (all-to-all, scatter's root).
  auto postEach = [&](const uint8_t* base) {
    for (int i = 1; i < N; ++i) post((me + i) % N, base + size_t((me + i) % N) * block);
  };
  // recv + q*block = q's block for every q: mine from `own` unless it is
  // there already (in place), the others' from my mailboxes.
  auto collect = [&](const uint8_t* own) {
    uint8_t* mine = recv + size_t(me) * block;
    if (mine != own) ctx.device.copy(mine, own, block, CopyHint::Cached);
    for (int q = 0; q < N; ++q)
      if (q != me) receive(q, recv + size_t(q) * block);
  };
  const bool root = me == op.root;
  // Check mode, broadcast and scatter: each non-root tells its root which
  // operation it runs (a header: its tag, no data), and the root checks
  // them all after it posted its data.  Otherwise a rank that alone took
  // itself for the root would return its own buffer and nobody would know;
  // with the headers its data, or the header it did not send, shows at a
  // root (a false root's data lands where the true root looks for its
  // header).  Gather and reduce, the other way round: the root's header to
  // each non-root, so that two ranks that both collect see each other's,
  // and ranks none of which names itself (each posts its data to another
  // and returns) wait for a header that shows their data instead.
  const bool headers = ctx.checkMode && (op.coll == Collective::Broadcast || op.coll == Collective::Scatter ||
                                         op.coll == Collective::Gather || op.coll == Collective::Reduce);
  auto takeHeaders = [&] {
    for (int i = 1; i < N; ++i) {
      const int q = (me + i) % N;
      take(q, 0);
      ack(q);
    }
  };

  switch (op.coll) {
    case Collective::AllReduce:
      for (int i = 1; i <= N; ++i) post((me + i) % N, send);
      combineAll(recv);
      break;
    case Collective::ReduceScatter:
      for (int i = 1; i <= N; ++i) post((me + i) % N, send + size_t((me + i) % N) * block);
      combineAll(recv);
      break;
    case Collective::Reduce:
      post(op.root, send);
      if (root) {
        if (headers)
          for (int i = 1; i < N; ++i) post((me + i) % N, nullptr);
        combineAll(recv);
      } else if (headers) {
        take(op.root, 0);
        ack(op.root);
      }
      break;
    case Collective::Broadcast:
      if (!root) {
        if (headers) post(op.root, nullptr);
        receive(op.root, recv);
        break;
      }
      for (int p = 0; p < N; ++p)
        if (p != me) post(p, send);
      if (recv != send) ctx.device.copy(recv, send, block, CopyHint::Cached);
      if (headers) takeHeaders();
      break;
    case Collective::AllGather:
      for (int i = 1; i < N; ++i) post((me + i) % N, send);
      collect(send);
      break;
    case Collective::AllToAll:
      postEach(send);
      collect(send + size_t(me) * block);
      break;
    case Collective::Gather:
      if (root) {
        if (headers)
          for (int i = 1; i < N; ++i) post((me + i) % N, nullptr);
        collect(send);
        break;
      }
      post(op.root, send);
      if (headers) {
        take(op.root, 0);
        ack(op.root);
      }
      break;
    case Collective::Scatter:
      if (!root) {
        if (headers) post(op.root, nullptr);
        receive(op.root, recv);
        break;
      }
      postEach(send);
      if (recv != send + size_t(me) * block) ctx.device.copy(recv, send + size_t(me) * block, block, CopyHint::Cached);
      if (headers) takeHeaders();
      break;
    case Collective::P2P:
      fail(loomInternalError, "send/recv cannot take the one-shot path");
  }
}

}  // namespace loom
