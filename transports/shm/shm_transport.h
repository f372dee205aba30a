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

#include "src/core/process_watch.h"
#include "transports/transport.h"

namespace loom {

struct ShmLayout {
  uint32_t nranks = 0;
  uint32_t channels = 0;
  uint32_t slots = 0;
  uint32_t slotBytes = 0;
  uint64_t windowBytes = 0;  // the PeerMemory window (direct algorithms' area)
  size_t slotStride() const { return 64 + size_t(slotBytes); }
  size_t ringBytes() const { return 128 + size_t(slots) * slotStride(); }
  // Header page, then the window (page-aligned), then the rings.
  size_t windowOffset() const { return 4096; }
  size_t ringOffset() const { return windowOffset() + ((windowBytes + 4095) & ~size_t(4095)); }
  size_t totalBytes() const { return ringOffset() + size_t(nranks) * channels * ringBytes(); }
};

struct ShmInboxHeader {
  uint32_t magic;
  ShmLayout layout;
  alignas(64) std::atomic<uint32_t> bell;
  // 0 awake; kSleepFutex: sleeps on `bell`; kSleepPoll: sleeps in poll() on
  // its wake-up socket together with tcp sockets.
  std::atomic<uint32_t> sleeping;
  alignas(64) std::atomic<uint32_t> aborted;
  // Moved by loomMemFree in the owner: peers then drop their mappings of
  // its buffers (src/device/host_memory.h).
  alignas(64) std::atomic<uint64_t> freeEpoch;
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
  // socket is `wakeName`; its bell rings through `bellFd` (an unbound
  // datagram socket the caller owns and keeps open while the inbox lives,
  // shared by the peer inboxes of one communicator); returns nullptr and
  // sets *why when impossible.
  static std::unique_ptr<ShmInbox> map(int pid, int fd, const std::string& wakeName, const ShmLayout& layout,
                                       int bellFd, std::string* why);
  ~ShmInbox();

  // Owner side: the memfd's descriptor number, for peers to open.
  int fd() const { return fd_; }
  // Owner side: the socket to poll() for wake-ups.
  int wakeFd() const { return wakeFd_; }
  ShmInboxHeader* header() const { return reinterpret_cast<ShmInboxHeader*>(base_); }
  ShmRingCtl* ring(int sender, int channel) const;
  uint8_t* window() const { return base_ + layout_.windowOffset(); }
  uint8_t* slot(int sender, int channel, uint64_t index) const;
  const ShmLayout& layout() const { return layout_; }

  // Wakes the owner if it sleeps.  Call after publishing head/tail.
  void ring_bell() const;
  // ring_bell without its fence: for a caller that fenced once before
  // ringing several bells (ShmTransport::wakeOthers).
  void ring_bell_fenced() const;
  // Owner side: sleep until the bell moves past `seen` or timeoutUs passes.
  void sleep(uint32_t seen, int64_t timeoutUs) const;
  // Owner side, after a poll() that included wakeFd(): empty it.
  void drainWakeFd() const;

 private:
  ShmInbox() = default;
  int fd_ = -1;          // owner: the memfd peers open; peer: -1 (closed once mapped)
  int wakeFd_ = -1;      // owner: bound socket; peer: the transport's bell socket to send from
  sockaddr_un wakeAddr_{};
  socklen_t wakeLen_ = 0;
  uint8_t* base_ = nullptr;
  ShmLayout layout_;
  bool owner_ = false;
};

// Throws loomRemoteError if the peer owning `box` aborted or its process
// (watched by `process`) died.
void shmCheckPeer(const ShmInbox* box, int peer, const ProcessWatch* process);

// Makes the Connection between me and peer on channel over shared memory.
// peerProcess lets checkPeer notice a dead peer.
std::unique_ptr<Connection> makeShmConnection(ShmInbox* mine, ShmInbox* peers, int me, int peer,
                                              int channel, std::shared_ptr<const ProcessWatch> peerProcess);

// The plug-in (shm_plugin.cc): inboxes, their doorbell and their windows.
std::unique_ptr<Transport> makeShmTransport();

}  // namespace loom
