// The transport interface, in two parts:
//  - a Connection moves fixed-size slots between this rank and one peer on
//    one channel, in both directions.  Slots are FIFO per direction; flow
//    control is the slot count.
//  - a Transport is the plug-in that makes Connections: its record in the
//    init all-gather, which peers it reaches, connect(), what memory its
//    slots live in, the link class the tuner costs it as.  A transport may
//    also offer a Doorbell (how a sleeping rank is woken) and PeerMemory
//    (windows of other ranks mapped into this process, for the direct
//    algorithms in algorithms/direct.h).
// Nothing above this interface knows which transport it talks to, and no
// transport knows which collective it serves.  How to add one: docs/design.md.
#pragma once
#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "src/core/socket.h"
#include "src/device/host_memory.h"  // PeerBuffer
#include "src/device/memory_kind.h"

namespace loom {

// Travels in front of every slot: which operation the bytes belong to (so
// that ranks calling different operations are told so) and how many bytes
// the slot holds.
struct SlotTag {
  uint64_t seq;    // operation sequence number (collectives: per comm; p2p: per pair)
  uint64_t count;  // element count argument of the operation
  uint32_t bytes;  // payload bytes in this slot
  uint8_t coll;    // Collective
  uint8_t dtype;   // loomDataType_t
  uint8_t op;      // loomRedOp_t
  uint8_t flags;
  int32_t root;
  uint32_t reserved;
};
static_assert(sizeof(SlotTag) == 32, "SlotTag is a wire format");
// SlotTag::flags bits.  A send or receive of a loomAllToAllv:
constexpr uint8_t kTagPartOfAllToAllv = 1;
// In a staging header (algorithms/staged.cc): the owner's input is read in
// place from its loomMemAlloc buffer.
constexpr uint8_t kTagInputInPlace = 2;
// A frame of the tagged point-to-point channel (src/core/p2p_tagged.h).
constexpr uint8_t kTagTagged = 4;
// A direct transfer's request (DirectTransfer below): the slot's 8-byte
// payload is the transfer's size in bytes.
constexpr uint8_t kTagDirect = 8;

// Optional capability of a Connection: a whole step's bytes written by the
// sender straight into the receiver's buffer (RDMA rendezvous), with no
// copy through slots on either side.  The executor uses it for point-to-point
// steps of at least directMinBytes() (src/core/executor.cc):
//   sender:   directSend(src, bytes, tag) posts a request slot (tag with
//             kTagDirect, payload: bytes), then waits for the receiver's
//             buffer, writes into it and tells the receiver it is done;
//   receiver: takes that slot with recvPeek/recvRelease (checking it like
//             any slot), then directRecv(dst, bytes) offers its buffer.
// Either side may find it cannot (memory it cannot register): the transfer
// then goes through the slots, and both ends are told (Slots).  One
// transfer per direction at a time.  Errors throw loom::Error (a peer that
// offers another size is loomRemoteError; nothing is written then).
class DirectTransfer {
 public:
  enum class State { Waiting, Done, Slots };
  virtual ~DirectTransfer() = default;
  // The same at both ends of the connection; 0: never.
  virtual size_t directMinBytes() const = 0;
  // False: no slot free for the request yet (call again).
  virtual bool directSend(const void* src, size_t bytes, const SlotTag& tag) = 0;
  // Done: the data is in the peer's buffer and src may be reused.
  virtual State directSendState() = 0;
  virtual void directRecv(void* dst, size_t bytes) = 0;
  // Done: the data is in dst.
  virtual State directRecvState() = 0;
  // True when this process moved bytes of a transfer in flight since the
  // last call (UCX over tcp reads and writes the socket in progress()): the
  // executor then counts it as progress and keeps spinning, as a sleeping
  // receiver would let the socket fill and wait for a wake-up per burst.
  // Transports whose bytes move without this process (shm, RDMA) say false.
  virtual bool directMoved() { return false; }
};

class Connection {
 public:
  virtual ~Connection() = default;
  virtual const char* name() const = 0;  // the transport's name
  // Payload capacity of one slot.
  virtual size_t slotBytes() const = 0;

  // Send side: a free slot's payload area, or nullptr if all are in flight.
  virtual void* sendAcquire() = 0;
  // Hands the slot from the last sendAcquire to the peer.
  virtual void sendPost(const SlotTag& tag) = 0;
  // True when every posted slot has left this process (tcp: written;
  // ibverbs: posted to the queue pair, which delivers it on its own).
  virtual bool sendIdle() { return true; }

  // Receive side: the oldest arrived slot (and its tag), or nullptr.
  virtual const void* recvPeek(SlotTag* tag) = 0;
  // Frees the slot returned by the last recvPeek.
  virtual void recvRelease() = 0;

  // Moves bytes that need this process's help (sockets); never blocks.
  virtual void progress() {}
  // Adds the descriptors a sleeping rank should poll for this connection.
  virtual void addPollFds(std::vector<pollfd>&) {}
  // True if the peer wakes this rank through this rank's Doorbell.
  virtual bool usesDoorbell() const { return false; }
  // Throws loomRemoteError if the peer is known to be dead or aborted.
  virtual void checkPeer() {}
  // Large transfers without slots (above), nullptr where not offered.
  virtual DirectTransfer* direct() { return nullptr; }
};

// How this rank sleeps when it has nothing to do, and how peers wake it
// (shm: a futex word in shared memory plus a socket for poll()).
class Doorbell {
 public:
  virtual ~Doorbell() = default;
  // Publishes "I sleep" (withFds: in poll(), together with descriptors) and
  // returns a token; the caller checks once more for work, then calls
  // sleep(token...) or end().
  virtual uint32_t begin(bool withFds) = 0;
  // Sleeps until woken or timeoutUs passes; with descriptors, poll()s them
  // and the doorbell's own socket.
  virtual void sleep(uint32_t token, std::vector<pollfd>& fds, int64_t timeoutUs) = 0;
  virtual void end() = 0;
};

// Memory of other ranks mapped into this process: every rank exposes one
// window of windowBytes() (zeroed at creation); the direct algorithms lay
// their mailboxes and flags out in it (algorithms/direct.h).  Flags are
// 64-bit atomics in windows: a writer stores with release and wakes the
// owner; a reader waits (spin, then sleep on its Doorbell) until the value
// it wants appears.  Shared memory implements it for host ranks of a host
// today; CUDA IPC will for device memory.
class PeerMemory {
 public:
  virtual ~PeerMemory() = default;
  virtual size_t windowBytes() const = 0;
  // Rank r's window as mapped here (r == this rank: its own).
  virtual uint8_t* window(int r) const = 0;
  // Wakes rank r if it sleeps (after publishing a flag it may wait on).
  virtual void wake(int r) const = 0;
  // Wakes every rank of [0, nranks) but `me` that sleeps: one wake(r) each
  // unless the transport can do better (shm: one fence for all of them).
  virtual void wakeOthers(int me, int nranks) const {
    for (int r = 0; r < nranks; ++r)
      if (r != me) wake(r);
  }
  // Throws loomRemoteError if rank r died or aborted.
  virtual void checkPeer(int r) const = 0;
  virtual MemoryKind memoryKind() const { return MemoryKind::Host; }

  // Zero-copy buffers (loomMemAlloc, loomCommRegister).  Whether the peers
  // can read this rank's [p, p + bytes) in place (shm: memory from
  // loomMemAlloc, which they map through its memfd); fills its description,
  // which the direct algorithms publish in this rank's window.
  virtual bool exportBuffer(const void* p, size_t bytes, PeerBuffer* out) const {
    (void)p, (void)bytes, (void)out;
    return false;
  }
  // Rank r's buffer `b` (as r exported it) mapped here, with `need` bytes
  // from its start, for operation `op` (its sequence number): the address
  // stays valid until an import for a later operation; the mapping is
  // cached for later operations.  Throws loom::Error when it cannot be mapped.
  virtual const uint8_t* importBuffer(int r, const PeerBuffer& b, size_t need, uint64_t op) const;
};

// What a transport sees of its communicator.  Filled before setup.
struct TransportEnv {
  int rank = 0;
  int nranks = 0;
  uint8_t secret[16] = {};
  uint64_t commTag = 0;     // random per communicator (rank 0's): tells communicators apart
  uint32_t slotBytes = 0;   // connection slots (rank 0's settings)
  uint32_t slots = 0;
  int maxChannels = 0;
  size_t windowBytes = 0;   // PeerMemory window each rank exposes (0: none wanted)
  int64_t timeoutMs = 0;
  SockAddr netAddr;         // this rank's network address (port 0)
  bool bindAny = true;      // LOOM_SOCKET_IFNAME unset: listen on every interface
  // Per rank: host identity (equal: same host), loopback domain, process id.
  std::vector<std::string> hostId;
  std::vector<uint64_t> localKey;
  std::vector<int32_t> pid;
  bool sameHost(int r) const { return hostId[size_t(r)] == hostId[size_t(rank)]; }
  // Same loopback domain and pid namespace (a peer's pid means something here).
  bool sameLoopback(int r) const { return localKey[size_t(r)] == localKey[size_t(rank)]; }
};

// What the communicator offers a transport while it connects (which may
// wait for the peer): abort checks and notes for loomCommDump.
class ConnectHost {
 public:
  virtual ~ConnectHost() = default;
  virtual void checkAborted() = 0;
  virtual void noteWaiting(int peer) = 0;
  virtual std::string runningOp() const = 0;  // "AllReduce #3 (...)" for messages
  // While waiting for `peer` to open a connection: throws loomRemoteError if
  // its process is gone (its control socket refuses), so that a rank that
  // died before connecting fails the wait at once rather than at the
  // timeout.  Cheap to call in a loop (it looks at most every 250 ms).
  virtual void checkPeerAlive(int peer) { (void)peer; }
};

// The cost model's link classes (src/tuner/cost_model.h prices each).
enum class CostLink : int { Shm = 0, ShmCrossNuma = 1, Tcp = 2, Ucx = 3, Verbs = 4 };

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;

  // ---- init, on every rank in LOOM_TRANSPORTS order ----
  // Whether this transport could serve `peer` at all (shm: same host).
  virtual bool mayReach(const TransportEnv& env, int peer) const = 0;
  // Size of the record this transport publishes in its init all-gather
  // (the same on every rank of one build).
  virtual size_t recordBytes() const = 0;
  // Fills this rank's record; `want[r]` marks the peers that no earlier
  // transport took and that mayReach() allows.  Throws loom::Error when the
  // transport cannot start at all and must not be skipped.
  virtual void publish(const TransportEnv& env, const std::vector<bool>& want, void* record) = 0;
  // Reads peer r's record (bytes from the network: check every field;
  // throw loomRemoteError for garbage).  True if this rank can reach r with
  // it; otherwise *why says what stands in the way.
  virtual bool accept(int r, const void* record, std::string* why) = 0;
  // The pairs both ends accepted (chosen[r]): this transport serves them.
  virtual void serve(const std::vector<bool>& chosen) { (void)chosen; }
  // Why this rank reaches nobody with it ("" if it may), for errors.
  virtual std::string unavailable() const { return ""; }

  // ---- use ----
  // Opens the connection to `peer` on `channel` (both ranks call it; may
  // wait for the peer until `deadlineMs`).
  virtual std::unique_ptr<Connection> connect(int peer, int channel, int64_t deadlineMs, ConnectHost& host) = 0;
  // Tells reachable peers at once that this rank failed (best effort; never blocks).
  virtual void abort() {}
  // The oldest slot `peer` posted to this rank on `channel` that is not yet
  // received, if this transport can see it without a connection (shm): lets
  // a rank waiting on one path notice a peer running another.  False: none
  // seen (the communicator then asks an open connection).
  virtual bool peekIncoming(int peer, int channel, SlotTag* tag) const {
    (void)peer, (void)channel, (void)tag;
    return false;
  }
  virtual Doorbell* doorbell() { return nullptr; }
  virtual PeerMemory* peerMemory() { return nullptr; }

  // ---- what it is ----
  virtual CostLink costAs() const = 0;
  // Memory its slots live in (the executor copies and reduces into them).
  virtual MemoryKind slotMemory() const { return MemoryKind::Host; }
  // Whether a user buffer of `kind` can be handed to this transport.  Host
  // transports move host memory only; a device pointer must be refused.
  virtual bool serves(MemoryKind kind) const { return kind == MemoryKind::Host; }
  // Registers a user buffer for zero-copy use (verbs: a memory region; UCX:
  // ucp_mem_map) and returns the handle, released when the last copy goes.
  // nullptr: this transport needs no registration for that memory (shm and
  // tcp copy host memory through their slots).
  virtual std::shared_ptr<void> registerBuffer(void* ptr, size_t bytes, MemoryKind kind) {
    (void)ptr, (void)bytes, (void)kind;
    return nullptr;
  }
};

// ---- the registry (transports/registry.cc) ----
struct TransportEntry {
  std::string name;
  std::string about;  // one line for docs and errors
  std::function<std::unique_ptr<Transport>()> make;
};
// Every transport of this build, built-in first, then registered ones.
std::vector<TransportEntry> transportRegistry();
// Adds a transport (tests' own transports; a plug-in built outside the
// library).  Registering an existing name replaces it.
void registerTransport(TransportEntry entry);
// Parses a LOOM_TRANSPORTS list into registered names, in preference order;
// throws loomInvalidArgument naming what this build has.
std::vector<std::string> parseTransports(const std::string& spec);

}  // namespace loom
