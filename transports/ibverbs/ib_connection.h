// IbConnection: one RC QP, its two slot rings and their memory regions
// (protocol: ib_transport.h).  Made in two steps because the QP number
// must travel to the peer before the QP can be connected.
#pragma once
#include <arpa/inet.h>

#include <memory>
#include <vector>

#include "transports/ibverbs/ib_device.h"
#include "transports/ibverbs/ib_transport.h"

namespace loom {

class IbConnection : public Connection {
 public:
  IbConnection(std::shared_ptr<IbDevice> dev, int rank, int peer, int channel, size_t slotBytes, int slots);
  ~IbConnection() override;
  // This end's QP number, PSN and receive ring (the caller adds the rest).
  void fillRecord(IbConnRecord* r) const;
  // Connects the QP to the peer's (RTR, RTS); keeps the setup socket to
  // watch the peer.
  void start(const IbConnRecord& remote, const IbRecord& peerDev, int sockFd);
  size_t stride() const { return stride_; }

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
  void shutdownSocket();

 private:
  void setup();
  void release();
  void postRecv();
  void postWrite(uint64_t wrId, uint64_t offset, uint32_t bytes, uint32_t imm);
  void sendCredits();
  void poll();
  void complete(const ibv_wc& wc);
  void checkSocket();

  std::shared_ptr<IbDevice> dev_;
  int rank_, peer_, channel_;
  size_t slotBytes_;
  int slots_;
  size_t stride_ = 0, ringBytes_ = 0;
  int recvDepth_ = 0, sendDepth_ = 0;
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
  // Counters in slots since the connection was made.
  uint64_t posted_ = 0, credited_ = 0;             // send side
  uint64_t arrived_ = 0, consumed_ = 0, creditSent_ = 0;  // receive side
  int sendOutstanding_ = 0, dataOutstanding_ = 0;  // WRs not yet completed
};

}  // namespace loom
