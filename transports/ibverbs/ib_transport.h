// ibverbs transport: RC queue pairs over libibverbs (RoCE, InfiniBand; in
// CI Soft-RoCE inside a VM, tests/vm/).
//
// One RC QP per (peer, channel).  Each side owns a receive ring of R slots
// (SlotTag + payload, 64-byte aligned stride) registered for remote write;
// the sender writes slot k into the peer's ring at k % R with RDMA WRITE
// WITH IMMEDIATE (imm: k mod 2^16), so the data lands where the executor
// reads it and the receive completion says it arrived.  Credits (the
// receiver's cumulative count of freed slots) ride in the same immediate
// of every slot written the other way; when none goes that way, a
// zero-byte WRITE WITH IMMEDIATE carries them alone once C = LOOM_SLOTS/2
// slots were freed.  So a sender never overwrites an unread slot and a
// sleeping sender is woken by the credit's completion.  Up to C - 1 freed
// slots can stay unknown to the sender, so R = LOOM_SLOTS + C - 1: a sender
// waits for credit only while LOOM_SLOTS slots are unread at the peer, the
// capacity the schedules count on (a ring chunk of LOOM_SLOTS - 1 slots).
// Receive WRs are plain zero-length recvs, reposted as they complete; the
// queue holds more than can ever be outstanding (R slots of data plus the
// bounded number of credit messages), and rnr_retry 7 covers a peer that
// lags in reposting.  Send WRs ask for a completion only every few (RC
// completes in order; completions only free queue entries, a slot is
// reused on credit), writes of at most 64 bytes go inline, and a step is
// done once its slots are posted (sendIdle): the device delivers them
// without this process.  A connection being destroyed waits (at most 2 s,
// less if the peer closes its socket) until its writes are acknowledged.
//
// Bootstrap: the init record (IbRecord) says which device, port, GID/LID
// and MTU a rank uses and where its tcp listener is.  connect() opens one
// socket per (peer, channel) -- the higher rank dials -- and both ends
// exchange an IbConnRecord (QP number, PSN, ring address and rkey) over it,
// checked as bytes from the network.  The socket stays open: a peer that
// dies closes it, which checkPeer() turns into loomRemoteError naming the
// peer (faster than RC retry exhaustion), and abort() shuts it down so
// that peers learn at once.
//
// Rendezvous (Connection::direct(), transports/transport.h): a step of at
// least the agreed threshold (IbConnRecord::directKiB, the larger of the two
// ends' LOOM_IB_RENDEZVOUS_BYTES) starts with a request slot in the ring;
// the receiver writes a clear-to-send (its buffer's address, size and rkey)
// into the control area behind the sender's receive ring, with an immediate
// of type 11/CTS; the sender RDMA-writes its buffer there, the last write
// with an immediate of type 11/FIN, which RC delivers after the data.  User
// memory is registered through the device's RegCache (ib_reg_cache.h).
//
// Sleeping: each connection's CQ has a completion channel whose fd (and
// the socket's) go into the sleeping rank's poll set; addPollFds() arms the
// CQ before the caller's last look for work, so no completion is missed.
// An arm lasts until a completion fires it, and the channel is read only
// after a sleep was prepared: a spinning rank makes no system call for it.
#pragma once
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transports/transport.h"

namespace loom {

constexpr uint32_t kIbRecordMagic = 0x4c4d4942;  // "LMIB"
constexpr uint32_t kIbVersion = 2;  // 2: credits ride on data slots (ib_connection.cc)

// A rank's ibverbs record in the init all-gather.
struct IbRecord {
  uint32_t magic;
  uint32_t version;
  uint8_t present;     // 0: no usable RDMA device on this rank
  uint8_t linkLayer;   // 1: InfiniBand, 2: Ethernet (RoCE)
  uint8_t port;
  uint8_t mtu;         // enum ibv_mtu: 1 (256) .. 5 (4096)
  uint16_t lid;
  uint16_t gidIndex;
  uint8_t gid[16];
  sockaddr_storage addr;  // tcp listener for connection setup
  uint32_t addrLen;
  uint32_t pad;
};

// Sent both ways on the setup socket of one (peer, channel).
struct IbConnRecord {
  uint32_t magic;
  uint32_t version;
  uint8_t secret[16];
  uint64_t commTag;
  int32_t rank;
  int32_t channel;
  uint32_t qpn;
  uint32_t psn;
  uint64_t ringAddr;
  uint32_t ringRkey;
  uint32_t slots;
  uint32_t stride;
  uint32_t directKiB;  // LOOM_IB_RENDEZVOUS_BYTES in KiB, rounded up (0: off)
};

// Checks rank r's init record (bytes from the network; n must be
// sizeof(IbRecord)); throws loomRemoteError for garbage.
void checkIbRecord(const void* bytes, size_t n, int r, IbRecord* out);
// Checks a connection record that claims to come from a member of this
// communicator; false and *why for anything wrong.
bool checkIbConnRecord(const void* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                       int maxChannels, uint32_t slots, uint32_t stride, IbConnRecord* out, std::string* why);

// The plug-in (ib_plugin.cc).
std::unique_ptr<Transport> makeIbTransport();

}  // namespace loom
