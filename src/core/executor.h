// The executor runs a schedule: it advances every lane as far as the
// connections allow, slot by slot, fusing each receive with its reduction
// and its forwarding, and sleeps (after a short spin) when nothing can move.
#pragma once
#include <poll.h>

#include <atomic>
#include <memory>
#include <cstdint>
#include <utility>
#include <vector>

#include "algorithms/schedule.h"
#include "src/device/device.h"
#include "transports/transport.h"

namespace loom {

class Tracer;

// One operation of a run, with its buffers and the tag its slots carry.
// `device` copies and reduces its data and provides its scratch; it must be
// able to access both buffers' memory kinds (execute() checks).  All
// operations of a run share one device.
struct ExecOp {
  SlotTag tag{};
  const uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  loomDataType_t dtype = loomFloat32;
  loomRedOp_t op = loomSum;
  MemoryKind sendMem = MemoryKind::Host;
  MemoryKind recvMem = MemoryKind::Host;
  int divisor = 1;  // loomAvg: nranks
  Device* device = &hostDevice();
  uint8_t* scratch = nullptr;  // set by execute() from Schedule::scratch
};

// Memory of one device grown to the largest size asked for and kept, so
// that the steady state allocates nothing.  Not thread-safe.
class ScratchBuffer {
 public:
  // At least `bytes` of `device`'s memory; what it held before is lost when
  // it grows.  loomSystemError (naming `rank`) if the device has none.
  uint8_t* get(size_t bytes, Device& device, int rank);

 private:
  struct Free {
    Device* device;
    void operator()(uint8_t* p) const { device->free(p); }
  };
  std::unique_ptr<uint8_t, Free> mem_{nullptr, Free{nullptr}};
  size_t bytes_ = 0;
};

// What the executor needs from its communicator (or from a simulator).
class ExecEnv {
 public:
  virtual ~ExecEnv() = default;
  virtual int rank() const = 0;
  // Makes sure the connections (peer, channel) exist; may block briefly.
  virtual void prepare(const std::vector<std::pair<int, int>>& needed) = 0;
  virtual Connection* connection(int peer, int channel) = 0;
  // Sleeping: begin() publishes "I sleep" (withFds: in poll() together with
  // sockets) and returns a token; the executor then checks once more for
  // work and either calls end() or wait(token...).
  virtual uint32_t sleepBegin(bool withFds) = 0;
  virtual void sleepWait(uint32_t token, std::vector<pollfd>& fds, bool doorbell,
                         int64_t timeoutUs) = 0;
  virtual void sleepEnd() = 0;
  // Throws if the communicator was aborted locally.
  virtual void checkAborted() = 0;
  virtual int64_t timeoutMs() const = 0;
  virtual int64_t spinUs() const = 0;
  // True when this host runs more ranks than cores (spin by yielding).
  virtual bool oversubscribed() const { return false; }
  // Shared by the communicator's waits: evidence that its ranks share CPUs
  // with other work (src/core/backoff.h); nullptr: none kept.
  virtual std::atomic<uint32_t>* cpuContention() { return nullptr; }
  virtual bool checkMode() const = 0;
  // LOOM_TRACE's recorder (src/core/trace.h), nullptr when not tracing.
  virtual Tracer* tracer() { return nullptr; }
  // Called while this rank waits on `peer` for an operation tagged `mine`:
  // throws if the peer is visibly running a different operation.
  virtual void checkStalled(const SlotTag& mine, int peer) { (void)mine, (void)peer; }
  // The same for a rank waiting on a direct path (algorithms/direct.h):
  // throws if the peer visibly runs another operation on the executor path.
  virtual void checkOtherPath(const SlotTag& mine, int peer) { (void)mine, (void)peer; }
  // Scratch space of at least `bytes` of `device`'s memory for one run,
  // kept between runs so the steady state allocates nothing.  Not
  // thread-safe: one run at a time.
  uint8_t* scratch(size_t bytes, Device& device) { return scratch_.get(bytes, device, rank()); }

 private:
  ScratchBuffer scratch_;
};

// Runs `sched` for `ops` (scratch space from env.scratch()); returns the payload bytes this rank sent.  Throws
// loom::Error on failure (remote error, timeout, mismatched operations).
uint64_t execute(ExecEnv& env, const std::vector<ExecOp>& ops, const Schedule& sched);

// "AllReduce #3 (count 10, float32, sum)" for messages.
std::string describeTag(const SlotTag& t);

// The tag an operation's slots carry: its signature and sequence number.
SlotTag operationTag(const OpDesc& op, uint64_t seq);

// True if `got` belongs to the same operation as `want` (bytes aside).
bool sameOperation(const SlotTag& got, const SlotTag& want);

// loomInvalidUsage naming both calls: rank `peer` ran `got`, `me` runs `want`.
[[noreturn]] void failMismatch(int me, int peer, const SlotTag& got, const SlotTag& want);

}  // namespace loom
