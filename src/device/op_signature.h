// Mismatch checks for the CUDA IPC path.
//
// The host path checks every slot's signature, so ranks that call different
// collectives are told so.  The IPC path's stream programs carry none: two
// ranks enqueueing, say, an all-reduce of 1000 and one of 1001 elements run
// the same rounds and finish with undefined output, and other mismatches
// wait until the watchdog's timeout.  So each rank keeps the signature of
// every collective it enqueued (its sequence number, collective, count,
// type, op, root), sends them in batches to the next rank over the control
// plane (a message per 600 collectives, or per 10 ms when fewer: at most
// about a hundred a second), off the streams and the caller's thread, and
// compares the batches
// it receives from the previous rank with its own.  Adjacent ranks agreeing
// on every operation means all do.  A mismatch fails the communicator on
// every rank with loomInvalidUsage naming both operations, within a few
// milliseconds of the later of the two enqueues; the mismatched operation's
// output is undefined, as after any failure.  No flag, copy or kernel is
// added to the programs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "algorithms/schedule.h"

namespace loom {

struct OpSignature {
  uint64_t seq = 0;    // the rank's collectives enqueued before this one
  uint64_t count = 0;
  uint8_t coll = 0, dtype = 0, op = 0;  // op: reductions only, else 0
  int32_t root = 0;                     // rooted collectives only, else 0
  bool operator==(const OpSignature& o) const {
    return seq == o.seq && count == o.count && coll == o.coll && dtype == o.dtype && op == o.op && root == o.root;
  }
};
OpSignature signatureOf(uint64_t seq, const OpDesc& op);
// "AllReduce of 1000 x float32, sum" / "Broadcast of 7 x int8 from rank 2".
std::string describeSignature(const OpSignature& s);
// A captured call's signature as a flag value (the graph lane's start
// gate, makeReplayable): a hash of everything but seq, in [1, 2^61), so it
// is never 0 (no call) and below kReleasedFlag (a release passes it).
uint64_t signatureFlag(const OpSignature& s);

// A batch as bytes (at most kSignatureBatch entries of 24 bytes, under the
// control plane's 16 KiB of extra bytes), and back: false for bytes that
// are no batch.
constexpr size_t kSignatureBatch = 600;
std::vector<uint8_t> encodeSignatures(const std::vector<OpSignature>& sigs);
bool decodeSignatures(const std::vector<uint8_t>& bytes, std::vector<OpSignature>* sigs);

class SignatureCheck {
 public:
  // rank: this rank; from: the rank whose batches receive() gets (the one
  // before this in the ring).
  SignatureCheck(int rank, int from) : rank_(rank), from_(from) {}
  // This rank enqueues `op` (in enqueue order, the same on every rank).
  void recordMine(const OpDesc& op);
  // Up to kSignatureBatch of this rank's signatures not yet taken, as bytes
  // (empty: none).
  std::vector<uint8_t> takeBatch();
  size_t pending() const;  // signatures not yet taken
  // The batches due at nowMs: a full one at once, else at most one per
  // 10 ms (every one left when flush); *nextMs: how long until the next is
  // due.  Called by one thread at a time (the sender's).
  std::vector<std::vector<uint8_t>> due(int64_t nowMs, bool flush, int64_t* nextMs);
  // Until every kept signature of this rank was compared, a mismatch was
  // found, or deadlineMs (a communicator going away gives the previous
  // rank's last batches this moment).
  void awaitChecked(int64_t deadlineMs) const;
  // A batch from `from` (any order, repeated entries fine).
  void receive(const std::vector<uint8_t>& bytes);
  // The first mismatch found ("" if none).
  std::string mismatch() const;
  // This rank's signatures kept and not yet compared with the previous
  // rank's; and how many were never compared (a lost batch, or one side
  // more than kKeep ahead).
  size_t unchecked() const;
  size_t skipped() const;

  // Signatures kept for comparison, each way; older ones are dropped (the
  // check then skips them rather than guess).
  static constexpr size_t kKeep = 4096;
  // How long awaitChecked waits at destruction, at most.
  static constexpr int64_t kFinishMs = 200;

 private:
  struct Mine;
  void compare(Mine& mine, const OpSignature& theirs);  // mu_ held

  int rank_, from_;
  mutable std::mutex mu_;
  struct Mine {
    OpSignature sig;
    bool checked = false;
  };
  std::deque<Mine> mine_;  // seq mineBase_ ..
  uint64_t mineBase_ = 0, next_ = 0, sent_ = 0;
  int64_t sentMs_ = 0;  // due()'s last batch
  size_t unchecked_ = 0, skipped_ = 0;
  std::map<uint64_t, OpSignature> ahead_;  // theirs not yet enqueued here (the lowest kKeep)
  std::string mismatch_;
};


// Send/recv's mismatch check on the IPC path.  A send/recv program finds a
// pair's chunks by counting them, so a receive of another size than its
// send copies bytes the sender never staged (or leaves some behind), and
// every later message of the pair is off by as many chunks: silent garbage,
// or a wait that ends only at LOOM_TIMEOUT_MS.  So each rank numbers its
// messages per pair (its sends to q and its receives from q, from 0, in the
// order the programs move them: the group's order), sends the sizes of its
// sends to each receiver in batches over the control plane, paced as the
// collectives' (at most one per receiver per 10 ms, a full batch at once),
// and the receiver compares them with its receives.  A mismatch fails the
// communicator (the watchdog's loomInvalidUsage, which its peers hear)
// naming the pair, the message's number and both sizes; the mismatched
// receive's output is undefined, as after any failure.  Messages to this
// rank itself are checked when the group is issued (checkBatch).
//
// On the wire a batch is the collectives' (encodeSignatures): one entry per
// send, coll = P2P, seq = the message's number in its pair, count = its
// bytes, root = the receiver; so a receiver tells the two kinds apart
// (isP2PBatch) and the collectives' check ignores these entries.
class P2PCheck {
 public:
  P2PCheck(int rank, int nranks);
  // This rank enqueues a send of `bytes` to `to` / a receive of `bytes`
  // from `from` (a program's members, in order; never this rank itself).
  void recordSend(int to, uint64_t bytes);
  void recordRecv(int from, uint64_t bytes);
  // The batches due at nowMs, each with its receiver (as
  // SignatureCheck::due, per receiver).  Called by one thread at a time.
  std::vector<std::pair<int, std::vector<uint8_t>>> due(int64_t nowMs, bool flush, int64_t* nextMs);
  // A batch of `from`'s sends to this rank (any order, repeated entries fine;
  // garbage is ignored).
  void receive(int from, const std::vector<uint8_t>& bytes);
  static bool isP2PBatch(const std::vector<uint8_t>& bytes);
  std::string mismatch() const;  // the first mismatch found ("" if none)
  size_t unchecked() const;      // this rank's receives not yet compared
  size_t skipped() const;        // receives never compared (more than kKeep behind or ahead)
  void awaitChecked(int64_t deadlineMs) const;  // as SignatureCheck's

  static constexpr size_t kKeep = SignatureCheck::kKeep;  // per pair, each way

 private:
  struct Recv {
    uint64_t bytes = 0;
    bool checked = false;
  };
  struct Pair {
    std::vector<OpSignature> unsent;  // this rank's sends to the peer, not yet in a batch
    uint64_t sends = 0;               // sends numbered so far
    std::deque<Recv> recvs;           // this rank's receives from the peer, numbered recvBase ..
    uint64_t recvBase = 0, recvNext = 0;
    std::map<uint64_t, uint64_t> ahead;  // the peer's sends not yet received here: number -> bytes
  };
  void compare(int from, uint64_t seq, Recv& mine, uint64_t theirs);  // mu_ held
  size_t pendingLocked() const;

  int rank_, nranks_;
  mutable std::mutex mu_;
  std::vector<Pair> pairs_;
  int64_t sentMs_ = 0;
  size_t unchecked_ = 0, skipped_ = 0;
  std::string mismatch_;
};

}  // namespace loom
