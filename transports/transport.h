// The transport interface: a Connection moves fixed-size slots between this
// rank and one peer on one channel, in both directions.  Slots are FIFO per
// direction; flow control is the slot count.  Nothing above this interface
// knows which transport it talks to, and no transport knows which collective
// it serves.
#pragma once
#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <vector>

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

class Connection {
 public:
  virtual ~Connection() = default;
  virtual const char* name() const = 0;  // "shm", "tcp"
  // Payload capacity of one slot.
  virtual size_t slotBytes() const = 0;

  // Send side: a free slot's payload area, or nullptr if all are in flight.
  virtual void* sendAcquire() = 0;
  // Hands the slot from the last sendAcquire to the peer.
  virtual void sendPost(const SlotTag& tag) = 0;
  // True when every posted slot has left this process (tcp: written).
  virtual bool sendIdle() { return true; }

  // Receive side: the oldest arrived slot (and its tag), or nullptr.
  virtual const void* recvPeek(SlotTag* tag) = 0;
  // Frees the slot returned by the last recvPeek.
  virtual void recvRelease() = 0;

  // Moves bytes that need this process's help (sockets); never blocks.
  virtual void progress() {}
  // Adds the descriptors a sleeping rank should poll for this connection.
  virtual void addPollFds(std::vector<pollfd>&) {}
  // True if the peer wakes this rank through its shared-memory doorbell.
  virtual bool usesDoorbell() const { return false; }
  // Throws loomRemoteError if the peer is known to be dead or aborted.
  virtual void checkPeer() {}
};

}  // namespace loom
