// IbConnection: one RC QP, its two slot rings and their memory regions
// (protocol: ib_transport.h).  Made in two steps because the QP number
// must travel to the peer before the QP can be connected.
#pragma once
#include <arpa/inet.h>

#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "transports/ibverbs/ib_device.h"
#include "transports/ibverbs/ib_transport.h"

namespace loom {

class IbConnection;

// A transport's live connections, so that its abort() can stop them.
struct IbLiveSet {
  std::mutex mu;
  std::set<IbConnection*> conns;
  bool aborted = false;
};

class IbConnection : public Connection, public DirectTransfer {
 public:
  // slots: LOOM_SLOTS, the capacity the schedules count on (ringSlots()).
  IbConnection(std::shared_ptr<IbDevice> dev, int rank, int peer, int channel, size_t slotBytes, int slots);
  // Credits go back on their own once creditEvery(slots) slots were freed
  // (else with the next slot written back).  Up to creditEvery - 1 freed
  // slots may thus be unknown to the sender, so the ring has that many more:
  // a sender that waits for credit always has `slots` unread slots at the peer.
  static int creditEvery(int slots);
  static int ringSlots(int slots);
  ~IbConnection() override;
  // This end's QP number, PSN and receive ring (the caller adds the rest).
  void fillRecord(IbConnRecord* r) const;
  // Connects the QP to the peer's (RTR, RTS); keeps the setup socket to
  // watch the peer.
  void start(const IbConnRecord& remote, const IbRecord& peerDev, int sockFd);
  size_t stride() const { return stride_; }
  // Steps of at least `bytes` go by rendezvous (0: none); both ends agree on it.
  void setDirectMin(size_t bytes) { directMin_ = bytes; }

  const char* name() const override { return "ibverbs"; }
  size_t slotBytes() const override { return slotBytes_; }
  void* sendAcquire() override;
  void sendPost(const SlotTag& tag) override;
  bool sendIdle() override;
  const void* recvPeek(SlotTag* tag) override;
  void recvRelease() override;
  void progress() override;
  void addPollFds(std::vector<pollfd>& fds) override;
  void checkPeer() override;
  DirectTransfer* direct() override { return directMin_ ? this : nullptr; }
  void shutdownSocket();
  // Joins the transport's live set (and stops at once if it was aborted).
  void track(std::shared_ptr<IbLiveSet> live);
  // Moves the QP to the error state: no RDMA moves in or out any more, so a
  // peer still writing a rendezvous into a buffer this rank gave up on (a
  // failed operation; the user may reuse the memory) cannot land.  Never
  // blocks on the peer.  Called under the live set's lock.
  void stopRemoteAccess();

  // The rendezvous (ib_transport.h).
  size_t directMinBytes() const override { return directMin_; }
  bool directSend(const void* src, size_t bytes, const SlotTag& tag) override;
  State directSendState() override;
  void directRecv(void* dst, size_t bytes) override;
  State directRecvState() override;

 private:
  void setup();
  void drain();
  void release();
  void postRecv();
  // Posts a send WR (numbered, signaled when asked or due); returns its number.
  uint64_t post(ibv_send_wr& wr, bool signal);
  void postWrite(uint64_t offset, uint32_t bytes, uint32_t imm);
  bool sendQueueHas(int entries) const;
  void sendCredits();
  void credit(uint32_t count, uint32_t mask);
  void poll();
  void complete(const ibv_wc& wc);
  void checkSocket();
  uint64_t postRdma(uint64_t local, uint32_t lkey, uint64_t remote, uint32_t rkey, uint32_t bytes, bool withImm,
                    uint32_t imm);
  void control(uint32_t imm);
  void pumpWrites();
  void releaseEntry(RegCache::Entry*& e);
  void postCts();

  std::shared_ptr<IbDevice> dev_;
  std::shared_ptr<IbLiveSet> live_;
  int rank_, peer_, channel_;
  size_t slotBytes_;
  int slots_;        // in the ring: ringSlots(LOOM_SLOTS)
  int creditEvery_;
  size_t stride_ = 0, ringBytes_ = 0;
  int recvDepth_ = 0, sendDepth_ = 0, signalEvery_ = 1;
  uint32_t maxInline_ = 0;
  uint8_t* sendRing_ = nullptr;
  uint8_t* recvRing_ = nullptr;
  ibv_mr* sendMr_ = nullptr;
  ibv_mr* recvMr_ = nullptr;
  ibv_comp_channel* chan_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;
  uint64_t remoteAddr_ = 0;
  uint32_t remoteRkey_ = 0;
  int sock_ = -1;
  unsigned unackedEvents_ = 0;
  bool armed_ = false;         // the CQ will raise an event on its next completion
  bool lookForEvent_ = false;  // the channel may hold one (a sleep was prepared)
  // Counters in slots since the connection was made.
  uint64_t posted_ = 0, credited_ = 0;             // send side
  uint64_t arrived_ = 0, consumed_ = 0, creditSent_ = 0;  // receive side
  // Send WRs posted, known completed, and the last that asked for a completion.
  uint64_t sendPosted_ = 0, sendDone_ = 0, lastSignaled_ = ~uint64_t(0);

  size_t directMin_ = 0;
  // The transfer this rank sends (one at a time): its source's MR, the
  // receiver's buffer once its clear-to-send arrived, bytes posted so far.
  struct Outgoing {
    bool active = false, ready = false;
    State state = State::Done;
    uint32_t seq = 0;
    const uint8_t* src = nullptr;
    size_t bytes = 0, posted = 0;
    uint64_t lastWr = 0;  // the number of its last write
    RegCache::Entry* mr = nullptr;
    uint64_t remote = 0;
    uint32_t rkey = 0;
  } out_;
  struct Incoming {
    bool active = false, ctsPending = false;
    State state = State::Done;
    uint32_t seq = 0;
    size_t bytes = 0;
    RegCache::Entry* mr = nullptr;
  } in_;
  uint32_t outSeq_ = 0, inSeq_ = 0;  // direct transfers per direction (24 bits on the wire)
};

}  // namespace loom
