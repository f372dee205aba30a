// The staged all-reduce for ranks that share memory (a two-shot algorithm:
// reduce-scatter then all-gather, both straight out of shared buffers).
//
// The input is cut into chunks of at most LOOM_SHM_STAGE_BYTES.  For chunk k
// every rank (1) copies the parts of its chunk that the others reduce into
// its staging buffer and stamps it, (2) reduces its own 1/N part (its input
// and the N-1 staged copies) into its staging buffer, stamps that and
// copies it to its output, and (3) copies
// the other N-1 reduced parts out of the other staging buffers.  Output of
// 16 MiB or more is written with non-temporal stores (no read-for-ownership).  Per rank:
// (N-1)/N x S copied in, S read for the reduction, (N-1)/N x S gathered; the
// staging buffers stay in cache between the steps.  Two buffers per rank
// alternate by chunk parity, so a rank may stage chunk k+1 while others
// still read chunk k; a reader acknowledges chunk k in the owner's window
// and the owner reuses a buffer only once every reader is done with it.
// Each chunk costs three waits whatever N is, where a ring costs 2(N-1)
// slot hand-offs per chunk: with more ranks than cores every hand-off can
// be a sleep and a wake-up.
//
// Zero-copy (memory from loomMemAlloc, which peers can map): a rank whose
// input can be mapped skips step (1)'s copy and publishes where its input
// is; the others reduce straight out of it.  And when every rank's input
// and output can be mapped, directZeroCopy (algorithms/zero_copy.cc)
// replaces the chunks altogether.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "algorithms/direct.h"
#include "algorithms/registry.h"
#include "src/core/log.h"
#include "src/device/host_copy.h"    // kStreamingCopyBytes
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

const char* stagedEligible(const Eligibility& q) {
  if (!q.allShm) return "it needs every rank to share memory";
  if (!q.stageBytes) return "it needs LOOM_SHM_STAGE_BYTES above 0";
  return nullptr;
}

// Staged (all-reduce): per stage three waits for all ranks; each rank
// copies S into its stage, reads S to reduce its S/N and copies S out.
// Counted in slot-transfer equivalents (a ring byte is written into a slot
// and read out of it): about (1 + 0.5/N) x S, since the stage copies move
// whole chunks with streaming stores and the reduction reads in place.
// Fit: 3373 us measured for 16 MiB at N=4, 3426 predicted.
void stagedEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double S = in.S, n = in.n;
  double stages = std::ceil(S / double(in.s.stageBytes));
  double us = stages * 3 * in.alpha(CostLink::Shm) + xfer((1.0 + 0.5 / n) * S, in.lp(CostLink::Shm).betaGBps) +
              in.reduce((n - 1) / n * S);
  out->push_back(Estimate{Algorithm::Staged, Algorithm::Ring, us, ""});
}


void stagedRun(DirectContext& ctx, const OpDesc& op, const SlotTag& tag) {
  const int N = ctx.nranks, me = ctx.rank;
  const size_t esz = dtypeSize(op.dtype);
  if (op.coll != Collective::AllReduce) fail(loomInternalError, "the staged path serves all-reduce only");
  directPublishPullDone(ctx);
  if (directZeroCopy(ctx, op, tag)) return;
  const size_t chunkElems = std::max<size_t>(1, ctx.layout.stageBytes / esz);
  const uint8_t* send = static_cast<const uint8_t*>(op.sendbuf);
  uint8_t* recv = static_cast<uint8_t*>(op.recvbuf);
  auto box = [&](int q) { return ctx.win(q); };
  // Output larger than the caches is written around them.
  const bool streaming = op.count * esz >= kStreamingCopyBytes;
  const CopyHint out = streaming ? CopyHint::Streaming : CopyHint::Cached;
  auto copyOut = [&](uint8_t* dst, const uint8_t* src, size_t bytes) { ctx.device.copy(dst, src, bytes, out); };
  auto copyIn = [&](uint8_t* dst, const uint8_t* src, size_t bytes) {
    ctx.device.copy(dst, src, bytes, CopyHint::Cached);
  };
  auto wakeAll = [&] {
    for (int q = 0; q < N; ++q) ctx.mem.wake(q);
  };
  const DirectWindow myWin = ctx.win(me);
  // Zero-copy: when the peers can map my input (memory from loomMemAlloc)
  // I publish where it is instead of staging it, and they reduce straight
  // out of it.  Each rank decides for itself and says so in its header, so
  // registered and unregistered ranks mix.  My input stays valid long
  // enough: a reader finishes with my part-p bytes of chunk k before it
  // stamps its result for k, and I wait for every result before I write
  // that part of my output (in place, my input) or return.
  PeerBuffer myInput;
  const bool inPlace = N > 1 && ctx.mem.exportBuffer(send, op.count * esz, &myInput);
  SlotTag myTag = tag;
  if (inPlace) myTag.flags |= kTagInputInPlace;
  std::vector<const uint8_t*> peerInput(size_t(N), nullptr);  // mapped in-place inputs, per op

  for (size_t off = 0; off < op.count; off += chunkElems) {
    const size_t n = std::min(chunkElems, op.count - off);
    const uint64_t k = ++ctx.state.stageChunk;
    const int parity = int(k & 1);
    DirectStageHeader* mine = myWin.stageHeader(parity);

    // 1. Reuse my buffer only when every reader is done with chunk k-2.
    if (k > 2)
      for (int q = 0; q < N; ++q) {
        if (q == me) continue;
        std::atomic<uint64_t>* ack = myWin.stageAck(q);
        directWait(ctx, [&] { return ack->load(std::memory_order_acquire) >= k - 2; }, q, tag,
                "it to finish reading my staging buffer");
      }
    // Only the parts the others reduce are staged; my own part is read
    // straight from my input below.
    const size_t pb = partBegin(n, N, me), pn = partBegin(n, N, me + 1) - pb;
    if (inPlace) {
      memcpy(myWin.stageInput(parity), &myInput, sizeof myInput);
    } else {
      copyIn(myWin.stage(parity), send + off * esz, pb * esz);
      copyIn(myWin.stage(parity) + (pb + pn) * esz, send + (off + pb + pn) * esz, (n - pb - pn) * esz);
    }
    memcpy(&mine->tag, &myTag, sizeof myTag);
    mine->input.store(k, std::memory_order_release);
    wakeAll();

    // 2. Reduce my part: my input, then every other rank's staged copy of
    //    it in rank order after me, into my staging buffer (it stays in
    //    cache).  The owner of a part is fixed, so the order is too, and
    //    every rank copies the same result.
    uint8_t* acc = myWin.stage(parity) + pb * esz;
    const uint8_t* own = send + (off + pb) * esz;
    if (N == 1) copyIn(acc, own, pn * esz);
    for (int i = 1; i < N; ++i) {
      int q = (me + i) % N;
      DirectStageHeader* h = box(q).stageHeader(parity);
      directWait(ctx, [&] { return h->input.load(std::memory_order_acquire) == k; }, q, tag, "its staged input");
      SlotTag t;
      memcpy(&t, &h->tag, sizeof t);
      if (ctx.checkMode && !sameOperation(t, tag)) failMismatch(me, q, t, tag);
      const uint8_t* theirs = box(q).stage(parity) + pb * esz;
      if (t.flags & kTagInputInPlace) {
        if (!peerInput[size_t(q)]) {
          PeerBuffer b;
          memcpy(&b, box(q).stageInput(parity), sizeof b);
          peerInput[size_t(q)] = ctx.mem.importBuffer(q, b, op.count * esz, tag.seq);
        }
        theirs = peerInput[size_t(q)] + (off + pb) * esz;
      }
      ctx.device.reduce(acc, i == 1 ? own : acc, theirs, pn, op.dtype, op.op);
    }
    if (op.op == loomAvg) ctx.device.divide(acc, acc, pn, op.dtype, N);
    mine->result.store(k, std::memory_order_release);
    wakeAll();
    copyOut(recv + (off + pb) * esz, acc, pn * esz);

    // 3. Gather the other parts, then release every buffer read.
    for (int i = 1; i < N; ++i) {
      int q = (me + i) % N;
      DirectStageHeader* h = box(q).stageHeader(parity);
      directWait(ctx, [&] { return h->result.load(std::memory_order_acquire) == k; }, q, tag, "its reduced part");
      size_t qb = partBegin(n, N, q), qn = partBegin(n, N, q + 1) - qb;
      copyOut(recv + (off + qb) * esz, box(q).stage(parity) + qb * esz, qn * esz);
    }
    for (int q = 0; q < N; ++q) {
      if (q == me) continue;
      box(q).stageAck(me)->store(k, std::memory_order_release);
      ctx.mem.wake(q);
    }
  }
}

}  // namespace loom
