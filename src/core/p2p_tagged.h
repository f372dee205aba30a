// Tagged point to point (loomSendTagged / loomRecvTagged): MPI's matching
// by (source, tag) with receive-from-any-source, in the core.
//
// Why here and not in the PyTorch backend: a communicator runs its
// operations one at a time in issue order, and plain sends and receives
// match strictly in that order per pair.  A backend that maps tags onto
// them cannot receive tag 2 before tag 1 (the receive for tag 2 would wait
// behind the peer's tag-1 send for ever), nor wait on every peer at once.
// That takes a matching layer under the operations: one that can read a
// whole message nobody asked for yet and keep it, and a receive that
// watches every peer.
//
// How: tagged traffic has its own connection per peer (channel index
// LOOM_NCHANNELS' maximum, after the collectives' channels), so it never
// sits in front of a collective's slots.  Every slot carries its frame in
// its SlotTag (kTagTagged set; op = frame kind; seq = the sender's message
// number to this peer; count = message bytes; root = the user's tag):
//   Eager    data of a message of at most LOOM_TAGGED_EAGER_BYTES, sent at once;
//   Rts      "ready to send" a larger message (no data);
//   Cts      "clear to send" the message seq, from the receiver that matched it;
//   RdvData  the larger message's data, after its Cts.
// A sender posts one message's data at a time per peer (Cts frames of the
// other direction may come in between), so a receiver keeps one message in
// progress per peer.  Messages that arrive before a receive matches them are
// kept in arrival order in the stash (eager: the data, at most
// LOOM_TAGGED_STASH_BYTES in all, past which this rank stops reading that
// peer and the sender waits; rendezvous: the header only).  While a tagged
// operation waits, whether it sends or receives, it reads every peer's
// tagged connection, so sends to a rank never stop it from receiving.
//
// Matching: a receive takes the first stashed message (arrival order) with
// its source and tag, else the first arriving one.  Messages from one
// sender arrive in send order, so messages from a sender with one tag are
// received in order.  Peers are read in turn starting after the source that
// last matched an any-source receive, so one busy sender cannot starve the
// others.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "src/core/executor.h"
#include "transports/transport.h"

namespace loom {

// What the matcher needs from its communicator besides the ExecEnv.
class TaggedHost {
 public:
  virtual ~TaggedHost() = default;
  virtual int taggedRanks() const = 0;
  // The tagged connection to `peer`, or nullptr while it cannot be opened
  // without waiting for the peer (tcp: a higher rank that has not dialled
  // yet; it dials at its first tagged operation).
  virtual Connection* taggedConnection(int peer) = 0;
};

struct TaggedLimits {
  size_t eagerBytes = 1 << 20;  // LOOM_TAGGED_EAGER_BYTES
  size_t stashBytes = 64 << 20; // LOOM_TAGGED_STASH_BYTES
};

class TaggedP2P {
 public:
  TaggedP2P(int rank, int nranks, TaggedLimits limits);

  // Runs one batch of tagged sends and receives (one call or one group)
  // until every one has completed.  Throws loom::Error for what fails the
  // communicator (a dead peer, the timeout, a broken protocol).  A receive
  // whose buffer cannot take the message it matched is a usage error: the
  // message stays stashed, the rest of the batch runs, and run() returns
  // loomInvalidUsage with *usage saying why.
  loomResult_t run(ExecEnv& env, TaggedHost& host, const std::vector<OpDesc>& ops, std::string* usage);

  size_t stashedBytes() const { return stashBytes_; }
  size_t stashedMessages() const { return stash_.size(); }

 private:
  enum Frame : uint8_t { kEager = 1, kRts = 2, kCts = 3, kRdvData = 4 };
  struct Msg {
    int src = 0, tag = 0;
    uint64_t seq = 0, bytes = 0;
    bool rdv = false, complete = false, claimed = false;
    std::vector<uint8_t> data;
  };
  // The message in progress from one peer.
  struct In {
    enum Kind { Idle, Eager, Rdv } kind = Idle;
    uint64_t seq = 0, total = 0, done = 0;
    uint8_t* dest = nullptr;
    Msg* msg = nullptr;  // into the stash, or
    int recv = -1;       // straight into this run's receive
  };
  struct Recv {
    const OpDesc* op;
    size_t cap, esz;
    enum { Unmatched, Receiving, FromStash, Done, Failed } st = Unmatched;
    std::list<Msg>::iterator msg;  // FromStash
    int from = -1;                 // Receiving: the peer
  };
  struct Send {
    const OpDesc* op;
    uint64_t bytes = 0, seq = 0, done = 0;
    enum { Queued, Eager, Rts, WaitCts, Data, Done } st = Queued;
    bool posted = false;  // a frame of its data went (zero-byte messages)
  };

  bool pass(ExecEnv& env, TaggedHost& host);
  bool advanceSend(TaggedHost& host, Send& s);
  bool drainPeer(int p, Connection* c);
  // Handles the frame at the head of p's connection; false: it must wait.
  bool frame(int p, Connection* c, const SlotTag& t, const void* data);
  void consume(int p, Connection* c, const SlotTag& t, const void* data);
  int matchArrival(int src, int tag, uint64_t bytes);
  bool fits(Recv& r, int src, int tag, uint64_t bytes);
  void complete(Recv& r, int src, int tag, uint64_t bytes);
  void postFromStash(size_t ri);
  bool finished(TaggedHost& host);
  bool needs(int p) const;  // this batch waits on rank p
  template <class F>
  void guarded(int p, F&& f);
  void checkPeers(ExecEnv& env, TaggedHost& host);
  [[noreturn]] void timeout(ExecEnv& env, TaggedHost& host);
  std::string describe(const OpDesc& op) const;

  int rank_, nranks_;
  TaggedLimits limits_;
  std::list<Msg> stash_;  // arrival order
  size_t stashBytes_ = 0;
  std::vector<In> in_;                       // per peer
  std::vector<uint64_t> sendSeq_;            // per peer
  std::vector<std::deque<uint64_t>> cts_;    // per peer: Cts frames to post
  int rrStart_ = 0;
  // One run's state.
  std::vector<Recv> recvs_;
  std::vector<Send> sends_;
  std::vector<std::vector<size_t>> sendQueue_;  // per peer: sends_ indices in issue order
  std::vector<std::string> usage_;
  std::vector<bool> deadAny_;  // peers found dead while an any-source receive waited
};

}  // namespace loom
