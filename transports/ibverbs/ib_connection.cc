// One RC QP between this rank and a peer on one channel: the slot rings,
// RDMA WRITE WITH IMMEDIATE, credits (the protocol: ib_transport.h).
#include "transports/ibverbs/ib_connection.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>

#include "src/core/clock.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"

namespace loom {

namespace {

// Immediates: bit 31 clear: a data slot, its number in bits 0-15 and the
// sender's credit (its consumed count) in bits 16-30; 10: a credit alone
// (30-bit count); 11: a rendezvous message (type in bits 24-29, transfer
// number in bits 0-23): a clear-to-send (its Cts is in the control area) or
// the end of a transfer's data.  Counts travel modulo their field and are
// extended by the distance from what the receiver knows (at most the ring's
// slots, LOOM_SLOTS <= 1024 makes that < 1536).
constexpr uint32_t kCreditBit = 0x80000000u, kCtlBits = 0xc0000000u, kCreditMask = 0x3fffffffu;
constexpr uint32_t kSlotMask = 0xffff, kPiggyShift = 16, kPiggyMask = 0x7fff;
constexpr uint32_t kCts = 1, kFin = 2, kSeqMask = 0xffffff;
// Receive WRs' id; a send WR's id is its number (sendPosted_ when posted).
constexpr uint64_t kRecvWr = ~uint64_t(0);
// Writes this small go inline (in the work request; no read of the ring's MR).
constexpr uint32_t kInlineBytes = 64;
// How long a connection being destroyed waits for the peer to acknowledge
// its last writes (normally one round trip; a peer that is gone closes the
// socket, which ends the wait at once).
constexpr int64_t kDrainMs = 2000;
// Each ring is followed by a control area; a receiver writes its Cts into
// the sender's (one transfer per direction at a time, so one suffices).
constexpr size_t kCtlBytes = 4096;
// The largest RDMA write posted at once (well below any device's maximum).
constexpr size_t kWriteChunk = size_t(4) << 20;

// For LOOM_DEBUG=TRACE (tests/vm checks which memory each transfer used).
const char* entryKind(const RegCache::Entry* e) {
  switch (e->kind) {
    case RegCache::Kind::Pinned: return "loomCommRegister'd";
    case RegCache::Kind::Coherent: return "cached (on-demand paging)";
    case RegCache::Kind::Transient: return "registered for this transfer";
  }
  return "?";
}

struct Cts {
  uint64_t addr;   // 0: the receiver cannot take it directly, send slots
  uint64_t bytes;
  uint32_t rkey;
  uint32_t seq;
};

size_t roundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// enum ibv_mtu (1: 256 .. 5: 4096) in bytes.
int mtuBytes(int mtu) { return mtu >= 1 && mtu <= 5 ? 128 << mtu : 0; }

}  // namespace

int IbConnection::creditEvery(int slots) { return std::max(1, slots / 2); }
int IbConnection::ringSlots(int slots) { return slots + creditEvery(slots) - 1; }

IbConnection::IbConnection(std::shared_ptr<IbDevice> dev, int rank, int peer, int channel, size_t slotBytes,
                           int slots)
    : dev_(std::move(dev)),
      rank_(rank),
      peer_(peer),
      channel_(channel),
      slotBytes_(slotBytes),
      slots_(ringSlots(slots)),
      creditEvery_(creditEvery(slots)) {
  stride_ = roundUp(sizeof(SlotTag) + slotBytes, 64);
  ringBytes_ = roundUp(stride_ * size_t(slots_), 4096);
  recvDepth_ = slots_ + 12;  // + credits, a clear-to-send and an end of data
  sendDepth_ = slots_ + 8;
  // Completions only tell the sender that queue entries are free again (a
  // slot is reused on the peer's credit, which comes after its data landed):
  // every signalEvery_-th write asks for one, and RC completes in order.
  signalEvery_ = std::max(1, (sendDepth_ - 2) / 2);
  try {
    setup();
  } catch (...) {
    release();
    throw;
  }
}

void IbConnection::setup() {
  auto sys = [&](const char* what) {
    fail(loomSystemError, "rank %d: ibverbs %s for rank %d on %s: %s", rank_, what, peer_, dev_->name.c_str(),
         strerror(errno));
  };
  const size_t all = ringBytes_ + kCtlBytes;
  if (posix_memalign(reinterpret_cast<void**>(&sendRing_), 4096, all) ||
      posix_memalign(reinterpret_cast<void**>(&recvRing_), 4096, all))
    fail(loomSystemError, "rank %d: cannot allocate %zu bytes of ibverbs rings", rank_, 2 * all);
  memset(sendRing_, 0, all);
  memset(recvRing_, 0, all);
  sendMr_ = ibv_reg_mr(dev_->pd, sendRing_, all, IBV_ACCESS_LOCAL_WRITE);
  if (!sendMr_) sys("ibv_reg_mr (send ring)");
  recvMr_ = ibv_reg_mr(dev_->pd, recvRing_, all, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!recvMr_) sys("ibv_reg_mr (receive ring)");
  chan_ = ibv_create_comp_channel(dev_->ctx);
  if (!chan_) sys("ibv_create_comp_channel");
  fcntl(chan_->fd, F_SETFL, fcntl(chan_->fd, F_GETFL) | O_NONBLOCK);
  cq_ = ibv_create_cq(dev_->ctx, recvDepth_ + sendDepth_, nullptr, chan_, 0);
  if (!cq_) sys("ibv_create_cq");
  ibv_qp_init_attr qa{};
  qa.send_cq = cq_;
  qa.recv_cq = cq_;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = uint32_t(sendDepth_);
  qa.cap.max_recv_wr = uint32_t(recvDepth_);
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = kInlineBytes;
  qp_ = ibv_create_qp(dev_->pd, &qa);
  if (!qp_) {  // a device without inline data
    qa.cap.max_inline_data = 0;
    qp_ = ibv_create_qp(dev_->pd, &qa);
  }
  if (!qp_) sys("ibv_create_qp");
  maxInline_ = qa.cap.max_inline_data;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = uint8_t(dev_->port);
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
  if (ibv_modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    sys("ibv_modify_qp(INIT)");
  for (int i = 0; i < recvDepth_; ++i) postRecv();
  std::random_device rd;
  psn_ = rd() & 0xffffff;
}

void IbConnection::fillRecord(IbConnRecord* r) const {
  r->qpn = qp_->qp_num;
  r->psn = psn_;
  r->ringAddr = uint64_t(uintptr_t(recvRing_));
  r->ringRkey = recvMr_->rkey;
  r->slots = uint32_t(slots_);
  r->stride = uint32_t(stride_);
}

void IbConnection::start(const IbConnRecord& remote, const IbRecord& peerDev, int sockFd) {
  sock_ = sockFd;
  remoteAddr_ = remote.ringAddr;
  remoteRkey_ = remote.ringRkey;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  // The smaller of both ports' active MTUs: a packet the other end's link
  // cannot carry would be dropped (rxe sets DF), not fragmented.
  a.path_mtu = ibv_mtu(std::min(int(dev_->mtu), int(peerDev.mtu)));
  LOOM_INFO("NET", "rank %d: ibverbs QP to rank %d (channel %d): path MTU %d (this port %d, the peer's %d)", rank_,
            peer_, channel_, mtuBytes(a.path_mtu), mtuBytes(dev_->mtu), mtuBytes(peerDev.mtu));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = uint8_t(dev_->port);
  if (dev_->linkLayer == 1) a.ah_attr.dlid = peerDev.lid;
  if (dev_->linkLayer == 2 || peerDev.linkLayer == 2) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peerDev.gid, 16);
    a.ah_attr.grh.sgid_index = uint8_t(dev_->gidIndex);
    a.ah_attr.grh.hop_limit = 64;
  }
  if (ibv_modify_qp(qp_, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    fail(loomRemoteError, "rank %d: ibverbs QP to rank %d (channel %d) cannot go to RTR: %s", rank_, peer_, channel_,
         strerror(errno));
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  // A write unacknowledged after 4.096 us x 2^timeout is sent again (with
  // every write after it).  14 (67 ms) fired for writes that had arrived
  // but whose acknowledgement was late -- behind a burst of data the other
  // way, on a loaded host: Soft-RoCE between two VMs resent thousands of
  // packets per all-reduce (perf/ibverbs_two_vms.sh, docs/usage.md).
  s.timeout = uint8_t(config().ibTimeout);
  s.retry_cnt = 7;
  s.rnr_retry = 7;
  s.sq_psn = psn_;
  s.max_rd_atomic = 1;
  if (ibv_modify_qp(qp_, &s,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
    fail(loomRemoteError, "rank %d: ibverbs QP to rank %d (channel %d) cannot go to RTS: %s", rank_, peer_, channel_,
         strerror(errno));
}

IbConnection::~IbConnection() {
  bool aborted = false;
  if (live_) {
    std::lock_guard<std::mutex> lock(live_->mu);
    live_->conns.erase(this);
    aborted = live_->aborted;
  }
  if (!aborted) drain();
  release();
}

// An operation ends once its writes are posted (sendIdle): the device
// delivers them without this process.  Destroying the QP would drop the
// ones not yet sent, so wait until the peer acknowledged them -- unless the
// peer is gone (closed socket) or the QP failed; never throws.
void IbConnection::drain() {
  if (!qp_ || sendDone_ == sendPosted_) return;
  try {
    int64_t deadline = nowMs() + kDrainMs;
    while (sendDone_ != sendPosted_ && nowMs() < deadline) {
      if (lastSignaled_ + 1 != sendPosted_ && sendQueueHas(1)) {
        // Only a signaled write reports the ones before it: a zero-byte
        // RDMA WRITE (no immediate, so the peer sees nothing) asks for that.
        ibv_send_wr wr{};
        wr.opcode = IBV_WR_RDMA_WRITE;
        wr.wr.rdma.remote_addr = remoteAddr_;
        wr.wr.rdma.rkey = remoteRkey_;
        post(wr, true);
      }
      poll();
      checkSocket();
      if (sendDone_ != sendPosted_) sched_yield();
    }
  } catch (const Error& e) {
    LOOM_TRACE("NET", "rank %d: ibverbs connection to rank %d (channel %d) closed with writes unacknowledged: %s",
               rank_, peer_, channel_, e.what());
  }
}

void IbConnection::track(std::shared_ptr<IbLiveSet> live) {
  live_ = std::move(live);
  std::lock_guard<std::mutex> lock(live_->mu);
  live_->conns.insert(this);
  if (live_->aborted) stopRemoteAccess();
}

void IbConnection::stopRemoteAccess() {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  if (qp_) ibv_modify_qp(qp_, &a, IBV_QP_STATE);
}

void IbConnection::release() {
  if (qp_) ibv_destroy_qp(qp_);
  // A transfer cut short (a failed operation) gives its buffers back; no
  // write can touch them once the QP is gone.
  releaseEntry(out_.mr);
  releaseEntry(in_.mr);
  if (cq_) {
    if (unackedEvents_) ibv_ack_cq_events(cq_, unackedEvents_);
    ibv_destroy_cq(cq_);
  }
  if (chan_) ibv_destroy_comp_channel(chan_);
  if (sendMr_) ibv_dereg_mr(sendMr_);
  if (recvMr_) ibv_dereg_mr(recvMr_);
  free(sendRing_);
  free(recvRing_);
  if (sock_ >= 0) close(sock_);
  qp_ = nullptr, cq_ = nullptr, chan_ = nullptr, sendMr_ = recvMr_ = nullptr;
  sendRing_ = recvRing_ = nullptr;
  sock_ = -1;
}

void IbConnection::postRecv() {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = kRecvWr;
  wr.num_sge = 0;
  if (ibv_post_recv(qp_, &wr, &bad))
    fail(loomRemoteError, "rank %d: ibv_post_recv for rank %d failed: %s", rank_, peer_, strerror(errno));
}

uint64_t IbConnection::post(ibv_send_wr& wr, bool signal) {
  uint64_t n = sendPosted_;
  // RC completes in order: one signaled write in every signalEvery_ frees
  // the queue entries of the unsignaled ones before it.
  if (signal || n + 1 - (lastSignaled_ + 1) >= uint64_t(signalEvery_)) {
    wr.send_flags |= IBV_SEND_SIGNALED;
    lastSignaled_ = n;
  }
  wr.wr_id = n;
  ibv_send_wr* bad = nullptr;
  if (ibv_post_send(qp_, &wr, &bad))
    fail(loomRemoteError, "rank %d: ibv_post_send to rank %d (channel %d) failed: %s", rank_, peer_, channel_,
         strerror(errno));
  ++sendPosted_;
  return n;
}

void IbConnection::postWrite(uint64_t offset, uint32_t bytes, uint32_t imm) {
  ibv_sge sge{uint64_t(uintptr_t(sendRing_ + offset)), bytes, sendMr_->lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  if (bytes && bytes <= maxInline_) wr.send_flags = IBV_SEND_INLINE;
  wr.imm_data = htonl(imm);
  wr.sg_list = bytes ? &sge : nullptr;
  wr.num_sge = bytes ? 1 : 0;
  wr.wr.rdma.remote_addr = remoteAddr_ + offset;
  wr.wr.rdma.rkey = remoteRkey_;
  post(wr, false);
}

bool IbConnection::sendQueueHas(int entries) const {
  return sendPosted_ - sendDone_ + uint64_t(entries) <= uint64_t(sendDepth_);
}

void* IbConnection::sendAcquire() {
  poll();
  if (posted_ - credited_ >= uint64_t(slots_) || !sendQueueHas(2)) return nullptr;
  return sendRing_ + (posted_ % uint64_t(slots_)) * stride_ + sizeof(SlotTag);
}

void IbConnection::sendPost(const SlotTag& tag) {
  uint64_t off = (posted_ % uint64_t(slots_)) * stride_;
  memcpy(sendRing_ + off, &tag, sizeof tag);
  // The slot carries this end's credit too: traffic both ways needs no credit writes.
  uint32_t imm = uint32_t(posted_ & kSlotMask) | (uint32_t(consumed_ & kPiggyMask) << kPiggyShift);
  postWrite(off, uint32_t(sizeof tag + tag.bytes), imm);
  creditSent_ = consumed_;
  ++posted_;
}

bool IbConnection::sendIdle() {
  poll();
  // Posted writes need nothing more from this process (drain() covers the
  // connection's end); only a credit or clear-to-send waiting for queue space does.
  return consumed_ - creditSent_ < uint64_t(creditEvery_) && !in_.ctsPending;
}

const void* IbConnection::recvPeek(SlotTag* tag) {
  poll();
  if (consumed_ == arrived_) return nullptr;
  const uint8_t* slot = recvRing_ + (consumed_ % uint64_t(slots_)) * stride_;
  memcpy(tag, slot, sizeof *tag);
  if (tag->bytes > slotBytes_)
    fail(loomRemoteError, "rank %d: rank %d sent a slot of %u bytes over ibverbs (slots hold %zu)", rank_, peer_,
         tag->bytes, slotBytes_);
  return slot + sizeof(SlotTag);
}

void IbConnection::recvRelease() {
  ++consumed_;
  sendCredits();
}

void IbConnection::sendCredits() {
  if (consumed_ - creditSent_ < uint64_t(creditEvery_)) return;
  if (!sendQueueHas(1)) return;  // poll() retries
  postWrite(0, 0, kCreditBit | uint32_t(consumed_ & kCreditMask));
  creditSent_ = consumed_;
}

void IbConnection::poll() {
  ibv_wc wc[16];
  for (;;) {
    int n = ibv_poll_cq(cq_, 16, wc);
    if (n < 0) fail(loomRemoteError, "rank %d: ibv_poll_cq for rank %d failed", rank_, peer_);
    for (int i = 0; i < n; ++i) complete(wc[i]);
    if (n < 16) break;
  }
  if (consumed_ - creditSent_ >= uint64_t(creditEvery_)) sendCredits();
  if (out_.ready) pumpWrites();
  if (in_.ctsPending) postCts();
}

void IbConnection::complete(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    // The peer's death usually shows first as the closed setup socket; say so if it is.
    checkSocket();
    failPeer(peer_, loomRemoteError, "rank %d: ibverbs connection to rank %d (channel %d) failed: %s (vendor error 0x%x)", rank_,
         peer_, channel_, ibv_wc_status_str(wc.status), wc.vendor_err);
  }
  if (wc.wr_id == kRecvWr) {
    uint32_t imm = ntohl(wc.imm_data);
    postRecv();
    if ((imm & kCtlBits) == kCtlBits) {
      control(imm);
    } else if (imm & kCreditBit) {
      credit(imm & kCreditMask, kCreditMask);
    } else {
      if ((imm & kSlotMask) != uint32_t(arrived_ & kSlotMask))
        fail(loomRemoteError, "rank %d: rank %d wrote slot %u over ibverbs where %llu was next", rank_, peer_,
             imm & kSlotMask, (unsigned long long)arrived_);
      if (arrived_ - consumed_ >= uint64_t(slots_))
        fail(loomRemoteError, "rank %d: rank %d overran the ibverbs ring", rank_, peer_);
      ++arrived_;
      credit((imm >> kPiggyShift) & kPiggyMask, kPiggyMask);
    }
  } else {
    sendDone_ = std::max(sendDone_, wc.wr_id + 1);
  }
}

void IbConnection::credit(uint32_t count, uint32_t mask) {
  // A cumulative count modulo mask + 1: extend it by the distance from what we know.
  uint64_t delta = (count - uint32_t(credited_)) & mask;
  if (credited_ + delta > posted_)
    fail(loomRemoteError, "rank %d: rank %d returned credit for %llu slots over ibverbs, %llu were sent", rank_, peer_,
         (unsigned long long)(credited_ + delta), (unsigned long long)posted_);
  credited_ += delta;
}

void IbConnection::progress() {
  // The channel has an event only if the CQ was armed; look once after each
  // sleep rather than with a system call on every pass of a spinning rank.
  if (lookForEvent_) {
    lookForEvent_ = false;
    ibv_cq* cq;
    void* ctx;
    while (ibv_get_cq_event(chan_, &cq, &ctx) == 0) {
      ++unackedEvents_;
      armed_ = false;
    }
  }
  if (unackedEvents_ >= 64) {
    ibv_ack_cq_events(cq_, unackedEvents_);
    unackedEvents_ = 0;
  }
  poll();
}

void IbConnection::addPollFds(std::vector<pollfd>& fds) {
  // Armed before the executor's last look for work (executor.cc): a
  // completion after that look raises the channel's fd.  An arm lasts until
  // a completion fires it, so one not yet fired need not be renewed.
  if (!armed_) {
    if (ibv_req_notify_cq(cq_, 0))
      fail(loomRemoteError, "rank %d: ibv_req_notify_cq for rank %d failed", rank_, peer_);
    armed_ = true;
  }
  lookForEvent_ = true;
  fds.push_back({chan_->fd, POLLIN, 0});
  if (sock_ >= 0) fds.push_back({sock_, POLLIN, 0});
}

void IbConnection::checkSocket() {
  if (sock_ < 0) return;
  char c;
  ssize_t n = recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
    failPeer(peer_, loomRemoteError, "rank %d: rank %d closed its ibverbs connection (channel %d): it exited, was killed or "
         "aborted", rank_, peer_, channel_);
}

void IbConnection::checkPeer() {
  checkSocket();
  dev_->checkAsyncEvents(rank_);
}

void IbConnection::shutdownSocket() {
  if (sock_ >= 0) shutdown(sock_, SHUT_RDWR);
}

// ---- the rendezvous ----

uint64_t IbConnection::postRdma(uint64_t local, uint32_t lkey, uint64_t remote, uint32_t rkey, uint32_t bytes,
                                bool withImm, uint32_t imm) {
  ibv_sge sge{local, bytes, lkey};
  ibv_send_wr wr{};
  wr.opcode = withImm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.imm_data = htonl(imm);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  // The last write's completion says the source may be reused.
  return post(wr, withImm);
}

void IbConnection::releaseEntry(RegCache::Entry*& e) {
  if (e) dev_->regCache->release(e);
  e = nullptr;
}

bool IbConnection::directSend(const void* src, size_t bytes, const SlotTag& tag) {
  if (out_.active)
    fail(loomInternalError, "rank %d: a second direct transfer to rank %d (channel %d) while one is in progress", rank_,
         peer_, channel_);
  void* slot = sendAcquire();
  if (!slot) return false;
  RegCache::Entry* e = nullptr;
  try {
    e = dev_->regCache->acquire(src, bytes, 0);
  } catch (const Error& err) {
    LOOM_WARN("NET", "rank %d: %zu bytes to rank %d go through the slots: %s", rank_, bytes, peer_, err.what());
  }
  // The request: the size, and whether the data follows in slots instead.
  uint64_t request[2] = {bytes, e ? 0u : 1u};
  memcpy(slot, request, sizeof request);
  SlotTag t = tag;
  t.flags |= kTagDirect;
  t.bytes = uint32_t(sizeof request);
  sendPost(t);
  out_ = Outgoing{};
  out_.src = static_cast<const uint8_t*>(src);
  out_.bytes = bytes;
  out_.mr = e;
  out_.active = e != nullptr;
  out_.state = e ? State::Waiting : State::Slots;
  if (e) out_.seq = outSeq_++ & kSeqMask;
  return true;
}

DirectTransfer::State IbConnection::directSendState() {
  poll();
  if (out_.active && out_.ready && out_.posted == out_.bytes && sendDone_ > out_.lastWr) {
    LOOM_TRACE("NET", "rank %d: direct transfer of %zu bytes to rank %d done (source %s)", rank_, out_.bytes, peer_,
               entryKind(out_.mr));
    releaseEntry(out_.mr);
    out_.active = false;
    out_.state = State::Done;
  }
  return out_.active ? State::Waiting : out_.state;
}

void IbConnection::pumpWrites() {
  const uint32_t fin = kCtlBits | (kFin << 24) | out_.seq;
  while (out_.posted < out_.bytes && sendQueueHas(2)) {
    size_t n = std::min(kWriteChunk, out_.bytes - out_.posted);
    bool last = out_.posted + n == out_.bytes;
    // The last write carries the end-of-data immediate: RC delivers it after every earlier write landed.
    out_.lastWr = postRdma(uint64_t(uintptr_t(out_.src + out_.posted)), entryMr(out_.mr)->lkey,
                           out_.remote + out_.posted, out_.rkey, uint32_t(n), last, fin);
    out_.posted += n;
  }
}

void IbConnection::directRecv(void* dst, size_t bytes) {
  if (in_.active)
    fail(loomInternalError, "rank %d: a second direct transfer from rank %d (channel %d) while one is in progress",
         rank_, peer_, channel_);
  in_ = Incoming{};
  in_.seq = inSeq_++ & kSeqMask;
  in_.bytes = bytes;
  Cts c{0, bytes, 0, in_.seq};
  try {
    in_.mr = dev_->regCache->acquire(dst, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    c.addr = uint64_t(uintptr_t(dst));
    c.rkey = entryMr(in_.mr)->rkey;
  } catch (const Error& err) {
    LOOM_WARN("NET", "rank %d: %zu bytes from rank %d come through the slots: %s", rank_, bytes, peer_, err.what());
  }
  memcpy(sendRing_ + ringBytes_, &c, sizeof c);
  in_.active = in_.mr != nullptr;
  in_.state = in_.mr ? State::Waiting : State::Slots;
  in_.ctsPending = true;
  postCts();
}

void IbConnection::postCts() {
  if (!sendQueueHas(1)) return;  // poll() retries
  postWrite(ringBytes_, uint32_t(sizeof(Cts)), kCtlBits | (kCts << 24) | in_.seq);
  in_.ctsPending = false;
}

DirectTransfer::State IbConnection::directRecvState() {
  poll();
  return in_.active ? State::Waiting : in_.state;
}

void IbConnection::control(uint32_t imm) {
  uint32_t type = (imm >> 24) & 0x3f, seq = imm & kSeqMask;
  if (type == kCts) {
    Cts c;
    memcpy(&c, recvRing_ + ringBytes_, sizeof c);
    if (!out_.active || out_.ready || seq != out_.seq || c.seq != seq)
      fail(loomRemoteError, "rank %d: rank %d sent a clear-to-send for direct transfer %u over ibverbs, %s", rank_,
           peer_, seq, out_.active ? strf("transfer %u waits", out_.seq).c_str() : "none waits");
    if (c.addr == 0) {
      releaseEntry(out_.mr);
      out_.active = false;
      out_.state = State::Slots;
      return;
    }
    if (c.bytes != out_.bytes)
      fail(loomRemoteError, "rank %d: rank %d offered a buffer of %llu bytes for a direct transfer of %zu over ibverbs "
           "(nothing was written)", rank_, peer_, (unsigned long long)c.bytes, out_.bytes);
    out_.remote = c.addr;
    out_.rkey = c.rkey;
    out_.ready = true;
  } else if (type == kFin) {
    if (!in_.active || seq != in_.seq)
      fail(loomRemoteError, "rank %d: rank %d ended direct transfer %u over ibverbs, %s", rank_, peer_, seq,
           in_.active ? strf("transfer %u was expected", in_.seq).c_str() : "none was expected");
    LOOM_TRACE("NET", "rank %d: direct transfer of %zu bytes from rank %d done (destination %s)", rank_, in_.bytes,
               peer_, entryKind(in_.mr));
    releaseEntry(in_.mr);
    in_.active = false;
    in_.state = State::Done;
  } else {
    fail(loomRemoteError, "rank %d: rank %d sent an unknown ibverbs control message (0x%x)", rank_, peer_, imm);
  }
}

}  // namespace loom
