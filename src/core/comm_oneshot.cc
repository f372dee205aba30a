// The one-shot path for small collectives between ranks that share memory.
//
// Every rank writes its block straight into a mailbox in each reader's inbox
// (one cache-line-aligned copy, then a release store of the sequence
// number), then reads the blocks addressed to it and combines them in rank
// order, so every rank computes bit-identical results.  Latency is one
// cache-line transfer plus the copies; there is no progress thread, no
// lock and no system call unless a rank has to sleep.  Readers acknowledge
// in the writer's inbox so a mailbox is never overwritten while in use
// (two mailboxes per writer, alternating by operation parity).
#include <cstring>

#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/comm_wait.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

using namespace loom;

void loomComm::crossPathCheck(int peer, const SlotTag& tag) {
  if (tag.coll == uint8_t(Collective::P2P) || peer == rank_) return;
  // A slot the peer posted for this sequence number means it runs this
  // operation on the executor (ring) path while we wait on a direct path.
  auto check = [&](const SlotTag& t) {
    if (t.coll != uint8_t(Collective::P2P) && t.seq == tag.seq) failMismatch(rank_, peer, t, tag);
  };
  SlotTag t;
  if (shmPeer_[size_t(peer)]) {
    // Look at the rings in my inbox directly: the connection may not exist yet.
    for (int ch = 0; ch < maxChannels_; ++ch) {
      ShmRingCtl* r = inbox_->ring(peer, ch);
      uint64_t tail = r->tail.load(std::memory_order_acquire);
      if (r->head.load(std::memory_order_acquire) == tail) continue;
      memcpy(&t, inbox_->slot(peer, ch, tail), sizeof t);
      check(t);
    }
    return;
  }
  auto it = conns_.find(std::make_pair(peer, 0));
  if (it != conns_.end() && it->second->recvPeek(&t)) check(t);
}

void loomComm::checkStalled(const SlotTag& mine, int peer) {
  noteWaiting(peer);
  if (!inbox_ || mine.coll == uint8_t(Collective::P2P) || !shmPeer_[size_t(peer)]) return;
  ShmMailbox* mb = inbox_->mailbox(peer, int(mine.seq & 1));
  SlotTag t;
  bool other = false;
  if (mb->seq.load(std::memory_order_acquire) == mine.seq + 1) {
    memcpy(&t, &mb->tag, sizeof t);
    other = true;
  }
  // Or the peer staged this operation (comm_staged.cc).
  for (int p = 0; p < 2 && !other; ++p) {
    ShmStageHeader* h = peerInbox_[size_t(peer)]->stageHeader(p);
    memcpy(&t, &h->tag, sizeof t);
    other = h->input.load(std::memory_order_acquire) != 0 && t.seq == mine.seq;
  }
  if (other) failMismatch(rank_, peer, t, mine);
}

void loomComm::runOneShot(const OpDesc& op, const SlotTag& tag) {
  const int N = nranks_, me = rank_;
  const size_t esz = dtypeSize(op.dtype), block = op.count * esz;
  if (block == 0) return;
  const int parity = int(tag.seq & 1);
  const uint64_t stamp = tag.seq + 1;
  const uint8_t* send = static_cast<const uint8_t*>(op.sendbuf);
  uint8_t* recv = static_cast<uint8_t*>(op.recvbuf);
  auto box = [&](int p) { return p == me ? inbox_.get() : peerInbox_[size_t(p)].get(); };

  // Writes `data` into p's mailbox from me (p == me: my own, which keeps
  // in-place operations safe: every input is read from a mailbox).
  auto post = [&](int p, const void* data) {
    uint64_t last = lastMail_[size_t(p)][size_t(parity)];
    if (last) {
      std::atomic<uint64_t>* ack = inbox_->mailAck(p);
      waitFor([&] { return ack->load(std::memory_order_acquire) >= last; }, p, tag, "its acknowledgement");
    }
    ShmInbox* b = box(p);
    memcpy(b->mailData(me, parity), data, block);
    SlotTag t = tag;
    t.bytes = uint32_t(block);
    ShmMailbox* mb = b->mailbox(me, parity);
    memcpy(&mb->tag, &t, sizeof t);
    mb->seq.store(stamp, std::memory_order_release);
    lastMail_[size_t(p)][size_t(parity)] = stamp;
    if (p != me) b->ring_bell();
  };
  // Waits for q's block in my inbox and checks that q runs the same operation.
  auto take = [&](int q) -> const uint8_t* {
    ShmMailbox* mb = inbox_->mailbox(q, parity);
    waitFor([&] { return mb->seq.load(std::memory_order_acquire) == stamp; }, q, tag, "its data");
    SlotTag t;
    memcpy(&t, &mb->tag, sizeof t);
    if (t.bytes != block || (checkMode_ && !sameOperation(t, tag))) failMismatch(me, q, t, tag);
    return inbox_->mailData(q, parity);
  };
  auto ack = [&](int q) {
    ShmInbox* b = box(q);
    b->mailAck(me)->store(stamp, std::memory_order_release);
    if (q != me) b->ring_bell();
  };
  // recv = op over ranks of the mailboxes, in rank order.
  auto combineAll = [&](uint8_t* out) {
    for (int q = 0; q < N; ++q) {
      const uint8_t* d = take(q);
      if (q == 0) memcpy(out, d, block);
      else reduceHost(out, out, d, op.count, op.dtype, op.op);
    }
    if (op.op == loomAvg) divideHost(out, out, op.count, op.dtype, N);
    for (int q = 0; q < N; ++q) ack(q);
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
      if (me != op.root) {
        post(op.root, send);
      } else {
        post(me, send);
        combineAll(recv);
      }
      break;
    case Collective::Broadcast:
      if (me == op.root) {
        for (int p = 0; p < N; ++p)
          if (p != me) post(p, send);
        if (recv != send) memmove(recv, send, block);
      } else {
        memcpy(recv, take(op.root), block);
        ack(op.root);
      }
      break;
    case Collective::AllGather:
      for (int i = 1; i < N; ++i) post((me + i) % N, send);
      if (recv + size_t(me) * block != send) memmove(recv + size_t(me) * block, send, block);
      for (int q = 0; q < N; ++q) {
        if (q == me) continue;
        memcpy(recv + size_t(q) * block, take(q), block);
        ack(q);
      }
      break;
    case Collective::P2P:
      fail(loomInternalError, "send/recv cannot take the one-shot path");
  }
}
