// The control plane: a small TCP side channel every communicator keeps
// beside its transports, for what must still work when the data paths are
// broken.  Each rank listens on one socket (its address travels in RankInfo)
// and runs one thread that accepts connections, reads one message from each
// and answers it with one byte.  It carries:
//  - failure and revoke notices (which ranks the sender knows to be dead),
//  - liveness probes: a rank whose process is gone refuses the connection
//    (the kernel closed its listener), so "refused" means dead for certain,
//  - the shrink agreement (src/core/shrink.cc): Join connections are handed
//    to the shrinking thread instead of being answered,
//  - questions answered with a message (Why; Region: a CUDA communicator's
//    send/recv staging for the asker, src/device/device_comm.h).
// Outgoing messages also go through the thread's event loop (non-blocking
// sockets), so two ranks notifying each other at once never wait on each
// other.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "src/core/socket.h"

namespace loom {

enum class CtlType : uint32_t {
  Probe = 1,     // are you there? (answered)
  Fail = 2,      // the sender's communicator failed (answered)
  Revoke = 3,    // the sender revoked the communicator (answered)
  Join = 4,      // shrink: a member joins the coordinator (handed over)
  Propose = 5,   // shrink: coordinator -> member, the proposed excluded set
  Ack = 6,       // shrink: member -> coordinator, its own excluded set
  Commit = 7,    // shrink: coordinator -> member, the final set and the new unique id
  Excluded = 8,  // shrink: coordinator -> member, you are not in the new communicator
  Why = 9,       // why did your communicator fail? (answered with a Why message, not a byte)
  Refuse = 10,   // shrink: coordinator -> member, no agreement: the ranks listed do not answer and
                 // outnumber the members (this side of a network cut may be the smaller one)
  Region = 11,   // CUDA send/recv: the sender's staging region for the asker (answered with a
                 // Region message whose extra bytes the answer function wrote)
  Sigs = 12,     // CUDA IPC path: signatures of the sender's collectives (src/device/op_signature.h;
                 // answered, handed to onNotice)
  Shrinking = 13,  // shrink: whom does your shrink leave out? (answered with a Shrinking message:
                   // ranks = its set; extra = {1 while it shrinks, else 0; its shrink's number, 4 bytes})
  ShrankWithout = 14,  // shrink: coordinator -> a live rank it left out: the shrink numbered extra[0..4)
                       // is done without you, at the coordinator's collective count extra[4..12)
                       // (acked, handed to onNotice)
};

struct CtlMsg {
  CtlType type = CtlType::Probe;
  int from = -1;
  std::vector<int> ranks;      // a set of ranks (dead, or excluded)
  std::vector<uint8_t> extra;  // Commit: the new unique id
};

// Why a communicator failed: the first error, and the rank where the failure
// began (the rank itself, or the peer whose notice or abort it inherited).
// It travels in the `extra` bytes of Fail notices and of Why answers, so
// every rank can report the root cause rather than "rank X aborted".
struct CtlCause {
  int code = 0;  // loomResult_t; 0 (loomSuccess): not failed
  int root = -1;
  std::string msg;
};
std::vector<uint8_t> encodeCause(const CtlCause& c);
bool decodeCause(const std::vector<uint8_t>& extra, int nranks, CtlCause* c);

// The wire format, as pure functions of bytes (tests/fuzz can drive them).
std::vector<uint8_t> encodeCtl(const CtlMsg& m, const uint8_t secret[16], uint64_t commTag);
// Bytes needed before the message is complete (0: complete, -1: invalid;
// *why says why).  `n` bytes are at `bytes`.
long ctlMissing(const uint8_t* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                std::string* why);
CtlMsg decodeCtl(const uint8_t* bytes, size_t n);

// What happened to one message of a broadcast.
enum class Reach : uint8_t { Acked, Refused, Timeout };

class Control {
 public:
  // Opens the listener (before the communicator's first all-gather).
  Control(int rank, int nranks, const uint8_t secret[16], const SockAddr& bindAddr,
          const SockAddr& advertise);
  ~Control();
  // Ends the thread (no onNotice runs after it returns).  The owner calls it
  // before letting go of the Control, which the thread's callbacks may read.
  void stop();
  const SockAddr& address() const { return advertise_; }

  // Starts the thread once every rank's address is known.  onNotice runs on
  // the control thread for Fail, Revoke, Sigs and ShrankWithout messages, and cause to
  // answer Why questions: neither may block.
  void start(uint64_t commTag, std::vector<SockAddr> peers, std::function<void(const CtlMsg&)> onNotice,
             std::function<CtlCause()> cause);

  // Asks rank r why its communicator failed: Acked with *c filled, Refused
  // (its process is gone), or Timeout.  Safe from any thread but the control one.
  Reach askWhy(int r, CtlCause* c, int64_t deadlineMs);
  // Answers Region questions (on the control thread; it may allocate
  // device memory, nothing slower): the answer's extra bytes (at most
  // 16384; a region record is far smaller).  Set before start().  Unset: the answer is empty.
  // The question's own extra bytes say what is asked (empty: the send/recv
  // region; device zero-copy's publish and unpublish carry a record,
  // comm.cc).
  void setRegionAnswer(std::function<std::vector<uint8_t>(int from, const std::vector<uint8_t>& question)> answer) {
    region_ = std::move(answer);
  }
  // Asks rank r a Region question (`question`: its extra bytes): Acked with
  // the answer's extra bytes in *answer, Refused (its process is gone), or
  // Timeout.  Any thread but the control one.
  Reach askRegion(int r, std::vector<uint8_t>* answer, int64_t deadlineMs,
                  const std::vector<uint8_t>& question = {});
  // What this rank's shrink number `round` (1 for its first shrink of this
  // communicator) leaves out, for Shrinking questions (active: shrinking
  // now; false with the set it ended with).  Any thread.
  void setShrinking(bool active, const std::vector<int>& out, uint32_t round);
  // Asks rank r whom its latest shrink leaves out (*active: it is shrinking
  // now; *round 0: it never shrank): Acked, Refused or Timeout.  Any thread
  // but the control one.
  Reach askShrinking(int r, bool* active, std::vector<int>* out, uint32_t* round, int64_t deadlineMs);

  // Sends m to every rank r with to[r] at once and waits until each answered,
  // refused, or deadlineMs passed.  Safe from any thread but the control one.
  std::vector<Reach> broadcast(const CtlMsg& m, const std::vector<bool>& to, int64_t deadlineMs);
  // The same without waiting; `done` runs on the control thread.
  void broadcastAsync(const CtlMsg& m, const std::vector<bool>& to, int64_t deadlineMs,
                      std::function<void(const std::vector<Reach>&)> done);
  // Until every broadcast issued so far has finished, or deadlineMs.
  void waitQuiet(int64_t deadlineMs);
  // Until the control thread has handled every message it had received
  // when called (so their notices have run), or deadlineMs.
  void settleIncoming(int64_t deadlineMs);

  // ---- shrink: blocking point-to-point messages on connections of its own ----
  // The oldest Join connection received (the caller owns *fd), or false at deadlineMs.
  bool nextJoin(int* fd, CtlMsg* m, int64_t deadlineMs);
  // Connects to rank r's listener (one attempt): -1 if refused.  Throws
  // loomTimeout when deadlineMs passes first or the host is unreachable
  // (no route, no neighbour): that is no proof the process is gone.
  int dial(int r, int64_t deadlineMs);
  void send(int fd, const CtlMsg& m, int64_t deadlineMs);
  // Reads one message; false on end of stream, garbage or a reset.  Throws
  // loomTimeout at deadlineMs.
  bool recv(int fd, CtlMsg* m, int64_t deadlineMs);
  int nranks() const { return nranks_; }

 private:
  struct Out;
  struct In;
  struct Job;
  void loop();
  void wake();
  void finish(const std::shared_ptr<Job>& job);

  int rank_, nranks_;
  uint8_t secret_[16];
  std::atomic<uint64_t> commTag_{0};
  int listenFd_ = -1;
  int wakeFd_ = -1;  // eventfd: wake() makes it readable
  bool acceptWarned_ = false;  // the control thread's: out of descriptors, said once
  SockAddr advertise_;
  std::vector<SockAddr> peers_;
  std::function<void(const CtlMsg&)> onNotice_;
  std::function<CtlCause()> cause_;
  std::function<std::vector<uint8_t>(int from, const std::vector<uint8_t>& question)> region_;
  bool shrinking_ = false;         // under mutex_: setShrinking
  std::vector<int> shrinkOut_;     // under mutex_
  uint32_t shrinkRound_ = 0;       // under mutex_
  std::thread thread_;

  std::mutex mutex_;  // guards everything below
  std::condition_variable cv_;
  bool stop_ = false;
  std::deque<std::shared_ptr<Job>> newJobs_;
  int active_ = 0;  // broadcasts issued and not finished
  uint64_t passes_ = 0;  // passes of the loop over incoming messages completed
  uint64_t settleTarget_ = 0;  // settleIncoming waits until passes_ reaches it
  std::deque<std::pair<int, CtlMsg>> joins_;
};

}  // namespace loom
