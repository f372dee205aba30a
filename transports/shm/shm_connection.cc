#include <cstring>

#include "src/core/error.h"
#include "transports/shm/shm_transport.h"

namespace loom {

namespace {

// Sends into the peer's inbox ring (me -> peer), receives from the ring in
// my inbox (peer -> me).  Head and tail are cached so the common case touches
// only the slot and one counter.
class ShmConnection : public Connection {
 public:
  ShmConnection(ShmInbox* mine, ShmInbox* peers, int me, int peer, int channel,
                std::shared_ptr<const ProcessWatch> peerProcess)
      : peers_(peers), peer_(peer), peerProcess_(std::move(peerProcess)) {
    out_ = peers->ring(me, channel);
    in_ = mine->ring(peer, channel);
    outSlot0_ = peers->slot(me, channel, 0);
    inSlot0_ = mine->slot(peer, channel, 0);
    slots_ = mine->layout().slots;
    stride_ = mine->layout().slotStride();
    slotBytes_ = mine->layout().slotBytes;
    sendHead_ = out_->head.load(std::memory_order_relaxed);
    sendTailCache_ = out_->tail.load(std::memory_order_acquire);
    recvTail_ = in_->tail.load(std::memory_order_relaxed);
    recvHeadCache_ = in_->head.load(std::memory_order_acquire);
  }

  const char* name() const override { return "shm"; }
  size_t slotBytes() const override { return slotBytes_; }

  void* sendAcquire() override {
    if (sendHead_ - sendTailCache_ >= slots_) {
      sendTailCache_ = out_->tail.load(std::memory_order_acquire);
      if (sendHead_ - sendTailCache_ >= slots_) return nullptr;
    }
    return outSlot0_ + size_t(sendHead_ % slots_) * stride_ + 64;
  }

  void sendPost(const SlotTag& tag) override {
    memcpy(outSlot0_ + size_t(sendHead_ % slots_) * stride_, &tag, sizeof tag);
    out_->head.store(++sendHead_, std::memory_order_release);
    peers_->ring_bell();
  }

  const void* recvPeek(SlotTag* tag) override {
    if (recvTail_ == recvHeadCache_) {
      recvHeadCache_ = in_->head.load(std::memory_order_acquire);
      if (recvTail_ == recvHeadCache_) return nullptr;
    }
    const uint8_t* s = inSlot0_ + size_t(recvTail_ % slots_) * stride_;
    memcpy(tag, s, sizeof *tag);
    return s + 64;
  }

  void recvRelease() override {
    in_->tail.store(++recvTail_, std::memory_order_release);
    peers_->ring_bell();
  }

  bool usesDoorbell() const override { return true; }

  void checkPeer() override {
    try {
      shmCheckPeer(peers_, peer_, peerProcess_.get());
    } catch (const Error&) {
      // A peer that finished its part may exit before we consumed the slots
      // it posted: it has failed us only once nothing of it is left to
      // read, or once our slots to it can never drain.
      SlotTag t;
      bool leftovers = recvPeek(&t) != nullptr;
      bool outFull = sendHead_ - out_->tail.load(std::memory_order_acquire) >= slots_;
      if (leftovers && !outFull) return;
      throw;
    }
  }

 private:
  ShmInbox* peers_;
  int peer_;
  std::shared_ptr<const ProcessWatch> peerProcess_;
  ShmRingCtl* out_;
  ShmRingCtl* in_;
  uint8_t* outSlot0_;
  uint8_t* inSlot0_;
  uint64_t slots_;
  size_t stride_;
  size_t slotBytes_;
  uint64_t sendHead_, sendTailCache_;
  uint64_t recvTail_, recvHeadCache_;
};

}  // namespace

std::unique_ptr<Connection> makeShmConnection(ShmInbox* mine, ShmInbox* peers, int me, int peer,
                                              int channel, std::shared_ptr<const ProcessWatch> peerProcess) {
  return std::make_unique<ShmConnection>(mine, peers, me, peer, channel, std::move(peerProcess));
}

}  // namespace loom
