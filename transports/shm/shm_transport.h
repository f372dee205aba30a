// Shared-memory transport for ranks on one host.
//
// Every rank owns one "inbox": a memfd mapping holding a doorbell and one slot
// ring per (sender rank, channel).  Peers on the same host map it through
// /proc/<pid>/fd/<fd>, so the memory never has a name in /dev/shm: nothing can
// be left behind by a crash, and it vanishes when the last mapping goes.
//
// A ring is single-producer single-consumer: the sender advances `head` after
// filling a slot, the receiver advances `tail` after consuming one.  A rank
// with nothing to do sleeps on its own doorbell (a futex word); whoever makes
// work for it (posting data or returning a slot) rings the bell, but only when
// the sleeper has said it sleeps, so the hot path makes no system call.
#pragma once
#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transports/transport.h"

namespace loom {

struct ShmLayout {
  uint32_t nranks = 0;
  uint32_t channels = 0;
  uint32_t slots = 0;
  uint32_t slotBytes = 0;
  uint32_t mailBytes = 0;  // payload of one small-message mailbox
  uint32_t stageBytes = 0; // one staging buffer (two per rank, by chunk parity)
  size_t slotStride() const { return 64 + size_t(slotBytes); }
  size_t ringBytes() const { return 128 + size_t(slots) * slotStride(); }
  size_t mailStride() const { return 64 + size_t(mailBytes); }
  // Header page, then acks (one cache line per peer), then two mailboxes per
  // sender, then the rings.
  size_t ackOffset() const { return 4096; }
  size_t mailOffset() const { return ackOffset() + size_t(nranks) * 64; }
  size_t stageCtlOffset() const { return mailOffset() + size_t(nranks) * 2 * mailStride(); }
  // Staging control: 2 headers (one per parity) + one ack line per reader.
  size_t stageOffset() const { return stageCtlOffset() + 2 * 64 + size_t(nranks) * 64; }
  size_t ringOffset() const { return stageOffset() + 2 * size_t(stageBytes); }
  size_t totalBytes() const { return ringOffset() + size_t(nranks) * channels * ringBytes(); }
};

// A small-message mailbox: the sender writes the payload and the tag, then
// publishes seq (the operation's sequence number + 1).  Two per sender,
// used alternately by operation parity; the receiver acknowledges what it
// consumed in the sender's inbox so that the sender never overwrites a
// mailbox still being read.
struct ShmMailbox {
  std::atomic<uint64_t> seq;
  SlotTag tag;
  uint8_t pad[64 - 8 - sizeof(SlotTag)];
};
static_assert(sizeof(ShmMailbox) == 64, "mailbox header is one cache line");

// Header of a staging buffer: `input` = chunk stamp once the owner copied
// its input chunk in; `result` = chunk stamp once it wrote its reduced part.
struct ShmStageHeader {
  std::atomic<uint64_t> input;
  std::atomic<uint64_t> result;
  SlotTag tag;
  uint8_t pad[64 - 16 - sizeof(SlotTag)];
};
static_assert(sizeof(ShmStageHeader) == 64, "stage header is one cache line");

struct ShmInboxHeader {
  uint32_t magic;
  ShmLayout layout;
  alignas(64) std::atomic<uint32_t> bell;
  // 0 awake; kSleepFutex: sleeps on `bell`; kSleepPoll: sleeps in poll() on
  // its wake-up socket together with tcp sockets.
  std::atomic<uint32_t> sleeping;
  alignas(64) std::atomic<uint32_t> aborted;
};

constexpr uint32_t kSleepFutex = 1;
constexpr uint32_t kSleepPoll = 2;

struct ShmRingCtl {
  alignas(64) std::atomic<uint64_t> head;  // slots posted by the sender
  alignas(64) std::atomic<uint64_t> tail;  // slots released by the receiver
};

class ShmInbox {
 public:
  // Creates this rank's inbox; `wakeName` names its wake-up socket (an
  // abstract unix datagram address, unique per communicator and rank).
  static std::unique_ptr<ShmInbox> create(const ShmLayout& layout, const std::string& wakeName);
  // Maps the inbox of process `pid` (fd number `fd` there) whose wake-up
  // socket is `wakeName`; returns nullptr and sets *why when impossible.
  static std::unique_ptr<ShmInbox> map(int pid, int fd, const std::string& wakeName, const ShmLayout& layout,
                                       std::string* why);
  ~ShmInbox();

  int fd() const { return fd_; }
  // Owner side: the socket to poll() for wake-ups.
  int wakeFd() const { return wakeFd_; }
  ShmInboxHeader* header() const { return reinterpret_cast<ShmInboxHeader*>(base_); }
  ShmRingCtl* ring(int sender, int channel) const;
  // Mailbox that `sender` fills in this inbox for operations of parity p.
  ShmMailbox* mailbox(int sender, int parity) const {
    return reinterpret_cast<ShmMailbox*>(base_ + layout_.mailOffset() +
                                         (size_t(sender) * 2 + size_t(parity)) * layout_.mailStride());
  }
  uint8_t* mailData(int sender, int parity) const {
    return reinterpret_cast<uint8_t*>(mailbox(sender, parity)) + 64;
  }
  // Staging buffers of this rank for chunk parity p (the staged algorithm):
  // a header (tag of the operation + chunk stamps) and the data.
  ShmStageHeader* stageHeader(int parity) const {
    return reinterpret_cast<ShmStageHeader*>(base_ + layout_.stageCtlOffset() + size_t(parity) * 64);
  }
  std::atomic<uint64_t>* stageAck(int reader) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + layout_.stageCtlOffset() + 128 +
                                                    size_t(reader) * 64);
  }
  uint8_t* stage(int parity) const { return base_ + layout_.stageOffset() + size_t(parity) * layout_.stageBytes; }
  // In the sender's inbox: seq + 1 of the last mailbox `reader` consumed.
  std::atomic<uint64_t>* mailAck(int reader) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(base_ + layout_.ackOffset() + size_t(reader) * 64);
  }
  uint8_t* slot(int sender, int channel, uint64_t index) const;
  const ShmLayout& layout() const { return layout_; }

  // Wakes the owner if it sleeps.  Call after publishing head/tail.
  void ring_bell() const;
  // Owner side: sleep until the bell moves past `seen` or timeoutUs passes.
  void sleep(uint32_t seen, int64_t timeoutUs) const;
  // Owner side, after a poll() that included wakeFd(): empty it.
  void drainWakeFd() const;

 private:
  ShmInbox() = default;
  int fd_ = -1;
  int wakeFd_ = -1;      // owner: bound socket; peer: unbound socket to send from
  sockaddr_un wakeAddr_{};
  socklen_t wakeLen_ = 0;
  uint8_t* base_ = nullptr;
  ShmLayout layout_;
};

// Throws loomRemoteError if the peer owning `box` aborted or its process died.
void shmCheckPeer(const ShmInbox* box, int peer, int pid, int pidfd);

// Makes the Connection between me and peer on channel over shared memory.
// peerPidfd (-1 if unavailable) lets checkPeer notice a dead peer.
std::unique_ptr<Connection> makeShmConnection(ShmInbox* mine, ShmInbox* peers, int me, int peer,
                                              int channel, int peerPid, int peerPidfd);

}  // namespace loom
