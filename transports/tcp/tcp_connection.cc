#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "src/core/error.h"
#include "transports/tcp/tcp_transport.h"

namespace loom {

namespace {

class TcpConnection : public Connection {
 public:
  TcpConnection(int fd, int peer, size_t slotBytes, int slots)
      : fd_(fd), peer_(peer), slotBytes_(slotBytes), slots_(uint64_t(slots)),
        stride_(sizeof(SlotTag) + slotBytes),
        sendBuf_(stride_ * slots_), recvBuf_(stride_ * slots_) {}
  ~TcpConnection() override {
    if (fd_ >= 0) close(fd_);
  }

  const char* name() const override { return "tcp"; }
  size_t slotBytes() const override { return slotBytes_; }

  void* sendAcquire() override {
    if (sendHead_ - sendDone_ >= slots_) {
      progress();
      if (sendHead_ - sendDone_ >= slots_) return nullptr;
    }
    return sendSlot(sendHead_) + sizeof(SlotTag);
  }

  void sendPost(const SlotTag& tag) override {
    memcpy(sendSlot(sendHead_), &tag, sizeof tag);
    ++sendHead_;
    writeSome();
  }

  bool sendIdle() override {
    writeSome();
    return sendDone_ == sendHead_;
  }

  const void* recvPeek(SlotTag* tag) override {
    if (recvTail_ == recvReady_) {
      readSome();
      if (recvTail_ == recvReady_) {
        // End of stream only matters once everything before it is consumed.
        if (eof_) failPeer(peer_, loomRemoteError, "rank %d closed its tcp connection", peer_);
        return nullptr;
      }
    }
    uint8_t* s = recvSlot(recvTail_);
    memcpy(tag, s, sizeof *tag);
    return s + sizeof(SlotTag);
  }

  void recvRelease() override { ++recvTail_; }

  // The peer closed and everything it sent has been consumed.
  void checkPeer() override {
    if (eof_ && recvTail_ == recvReady_) failPeer(peer_, loomRemoteError, "rank %d closed its tcp connection", peer_);
  }

  void progress() override {
    writeSome();
    readSome();
  }

  void addPollFds(std::vector<pollfd>& fds) override {
    short ev = eof_ ? 0 : POLLIN;
    if (sendDone_ != sendHead_) ev |= POLLOUT;
    fds.push_back(pollfd{fd_, ev, 0});
  }

 private:
  uint8_t* sendSlot(uint64_t i) { return sendBuf_.data() + size_t(i % slots_) * stride_; }
  uint8_t* recvSlot(uint64_t i) { return recvBuf_.data() + size_t(i % slots_) * stride_; }

  size_t sendSlotBytes(uint64_t i) {
    SlotTag t;
    memcpy(&t, sendSlot(i), sizeof t);
    return sizeof(SlotTag) + t.bytes;
  }

  // Writes as many posted slots as the socket takes, several per syscall.
  void writeSome() {
    while (sendDone_ != sendHead_) {
      iovec iov[8];
      int n = 0;
      size_t off = sendOffset_;
      for (uint64_t i = sendDone_; i != sendHead_ && n < 8; ++i, ++n) {
        iov[n].iov_base = sendSlot(i) + off;
        iov[n].iov_len = sendSlotBytes(i) - off;
        off = 0;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = size_t(n);
      ssize_t w = sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        failPeer(peer_, loomRemoteError, "tcp connection to rank %d failed while sending: %s", peer_,
                 strerror(errno));
      }
      size_t left = size_t(w);
      while (left > 0) {
        size_t rest = sendSlotBytes(sendDone_) - sendOffset_;
        if (left >= rest) {
          left -= rest;
          sendOffset_ = 0;
          ++sendDone_;
        } else {
          sendOffset_ += left;
          left = 0;
        }
      }
    }
  }

  // Reads into free receive slots: the tag first, then its payload.
  void readSome() {
    while (recvReady_ - recvTail_ < slots_) {
      uint8_t* s = recvSlot(recvReady_);
      size_t want;
      if (recvOffset_ < sizeof(SlotTag)) {
        want = sizeof(SlotTag) - recvOffset_;
      } else {
        SlotTag t;
        memcpy(&t, s, sizeof t);
        if (t.bytes > slotBytes_)
          fail(loomRemoteError,
               "rank %d sent a %u-byte slot, more than the %zu agreed (corrupt stream?)", peer_,
               t.bytes, slotBytes_);
        want = sizeof(SlotTag) + t.bytes - recvOffset_;
        if (want == 0) {
          recvOffset_ = 0;
          ++recvReady_;
          continue;
        }
      }
      if (eof_) return;
      ssize_t r = recv(fd_, s + recvOffset_, want, MSG_DONTWAIT);
      if (r == 0) {
        eof_ = true;
        return;
      }
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        eof_ = true;  // reported by recvPeek once the slots before it are used
        return;
      }
      recvOffset_ += size_t(r);
      if (recvOffset_ >= sizeof(SlotTag)) {
        SlotTag t;
        memcpy(&t, s, sizeof t);
        if (t.bytes <= slotBytes_ && recvOffset_ == sizeof(SlotTag) + t.bytes) {
          recvOffset_ = 0;
          ++recvReady_;
        }
      }
    }
  }

  int fd_;
  int peer_;
  size_t slotBytes_;
  uint64_t slots_;
  size_t stride_;
  std::vector<uint8_t> sendBuf_, recvBuf_;
  uint64_t sendHead_ = 0, sendDone_ = 0;
  size_t sendOffset_ = 0;
  uint64_t recvReady_ = 0, recvTail_ = 0;
  size_t recvOffset_ = 0;
  bool eof_ = false;  // the peer closed; slots already read stay valid
};

}  // namespace

std::unique_ptr<Connection> makeTcpConnection(int fd, int peer, size_t slotBytes, int slots) {
  return std::make_unique<TcpConnection>(fd, peer, slotBytes, slots);
}

}  // namespace loom
