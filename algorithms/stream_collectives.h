// Collectives as stream programs (src/device/stream_program.h): the device
// path, where every rank reads the other ranks' windows directly (CUDA IPC
// between GPUs of a host, or ranks sharing one GPU).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/schedule.h"
#include "src/device/stream_program.h"

namespace loom {

enum class StreamAlgorithm : uint8_t {
  // All-reduce: every rank reduces every rank's whole input (N-1 blocks read
  // per rank): fewest steps, for small sizes.
  OneShot,
  // All-reduce: reduce-scatter, then all-gather on a second stream so that
  // round k's gather overlaps round k+1's reduction: each rank reads about
  // 2 blocks whatever N is, for large sizes.
  ReduceScatterAllGather,
};
const char* streamAlgorithmName(StreamAlgorithm a);

// A window is two slots of slotBytes (alternate rounds use alternate slots).
inline size_t streamWindowBytes(size_t slotBytes) { return 2 * slotBytes; }

// Device zero-copy for the reduce-scatter + all-gather all-reduce and
// every other collective but send/recv (CellIndex in stream_program.h).
// Ranks may differ in `mine`; `cells` is the communicator's and the same
// everywhere for a call.
struct StreamPublish {
  // The communicator has cell areas: the peers' parts are read through
  // their cells (Space::Published), and the program writes this rank's
  // cells where `write` says.  False: windows only, no cell is touched.
  bool cells = false;
  // This rank publishes its buffers (ProgramBuffers::published holds them
  // for every reader; rooted collectives: the send buffer only): it stages
  // nothing in its window, an all-reduce's reduced part goes to its recv
  // buffer only, and its program ends only once every peer is done with the
  // last round (they read its buffers).
  bool mine = false;
  // Per slot: this program's values differ from what the cells of that
  // slot hold now, so its first round on that slot writes them.
  bool write[2] = {true, true};
};

// Whether `op`'s program reads the peers through their cells (given a
// communicator with cell areas): the same on every rank for the same call.
bool readsPublished(const OpDesc& op, int nranks, StreamAlgorithm algo);
// Whether rank `rank`'s program writes its cells (where readsPublished):
// every rank's, but for rooted collectives only the side whose send buffer
// the others read (a broadcast's or scatter's root, a reduce's or gather's
// other ranks).  A rank that does not write them leaves its cells' tags
// older than the program's rounds, so its readers (none) would fall back.
bool writesCells(const OpDesc& op, int rank);
// The size the zero-copy threshold compares (the same on every rank): the
// buffer, N blocks for collectives whose count is per rank.
size_t zeroCopyBytes(const OpDesc& op, int nranks);
// Whether rank `rank` may publish its buffers of `op` (StreamPublish::mine):
// a reduce-scatter whose own block lies apart from its output, or is it
// exactly in a one-pass reduction (NCCL's in-place layout, at most
// kOnePassSources ranks); an all-gather whose input lies apart from its
// output or is its own block; an all-to-all out of place; the rank of a
// rooted collective whose send buffer the others read (writesCells).
bool mayPublish(const OpDesc& op, int rank, int nranks, StreamAlgorithm algo);

// Rank `rank`'s program for `op` (sendbuf/recvbuf only compared, never read:
// equal means in place).  `*round` is the communicator's round counter: the
// program uses rounds [*round, *round + program.rounds) and advances it.
// Every rank must compile the same operations in the same order.  The
// algorithm matters for all-reduce only; the other collectives have one
// program each.  `publish` applies where readsPublished says (the
// reduce-scatter + all-gather all-reduce and every other collective).  loomInternalError if slotBytes cannot hold one element per
// rank.
StreamProgram compileStreamProgram(const OpDesc& op, int rank, int nranks, StreamAlgorithm algo,
                                   size_t slotBytes, uint64_t* round, const StreamPublish& publish = {});

// Rank p.rank's program `p` (compileStreamProgram from round 0, without
// zero-copy) made replayable: a call captured into a CUDA graph, which every
// replay repeats with the capture's flag values (kFlagGraphEnd in
// stream_program.h).  Its streams are the program's (the reduce-scatter +
// all-gather's second stream forks after the start gate and joins back
// before `end`; in a capture it is a stream that joins the capture:
// DeviceDriver::captureBackend), and around the program, on the caller's:
//   own busy = sig (the call's signature, nonzero: signatureFlag);
//   sig = sig in each peer's copy of this rank's flags; wait every peer's
//     sig >= sig: a peer whose call differs has a different signature,
//     and either it or this rank stops here (a smaller one passes, but
//     then waits for flags the other never writes: nobody reads a window
//     the other filled), so a mismatch stops the ranks instead of
//     computing garbage silently, and the watchdog names it (DeviceComm;
//     its release then lets the programs end, with undefined output, as
//     after any failure);
//   <the program>;
//   end = 1 (after all of this rank's other writes of it);
//   wait every peer's end >= 1: nobody reads this rank's window or writes
//     its flag area for this call any more;
//   zero this rank's own area (every row's round flags and end, the
//     peers' sigs);
//   reset = 1; wait every peer's reset >= 1: everyone zeroed theirs, so no
//     peer's next call can write into an area before it is zeroed;
//   zero the peers' resets; own busy = 0 (this rank's own reset is zeroed
//     at the start of its next call, while busy is still 0: the watchdog
//     compares signatures only while busy is set and this rank's own
//     reset is 0).
// A call of count 0 passes the gate and the barriers too (N > 1).
// A peer writes anything of its next call only after it saw this rank's
// reset, which this rank writes after zeroing its round flags and end; and
// its next reset only after its next end barrier, which needs this rank's
// next end, written after this rank zeroed its resets: nothing of a next
// call is ever zeroed (a peer that waits for nobody in its program, a
// broadcast root, may write its next end early, but ends are zeroed only
// before this rank's reset).  Every wait
// is "flag >= value" on this rank's own memory, so a failed communicator's
// release (kReleasedFlag) still ends each one.  loomInternalError for a
// program that does not start at round 0, or publishes.
StreamProgram makeReplayable(StreamProgram p, uint64_t sig);

// Send/recv.  A pair's messages go through a region of the sender's
// device memory for that receiver: two chunks of p2pChunkBytes, used by
// alternate chunks of the pair.  Regions are made on first use of the pair
// (DeviceComm::prepareP2P), not at init, so a communicator that never sends
// or receives has none.  Pairs count their own chunks (no communicator-wide
// round: ranks not in a send take no part), in the per-pair flags
// (kFlagP2PSent/kFlagP2PAcked, stream_program.h).
inline size_t p2pChunkBytes(size_t slotBytes) { return slotBytes / 2; }
inline size_t p2pRegionBytes(size_t slotBytes) { return 2 * p2pChunkBytes(slotBytes); }
// What a rank has done with each peer so far (every program advances it).
struct P2PCounters {
  std::vector<uint64_t> sent;   // per peer: chunks staged for it
  std::vector<uint64_t> recvd;  // per peer: chunks of it copied out
  uint64_t programs = 0;        // send/recv programs (kFlagP2PDone's value)
};
// Rank `rank`'s program for the sends and receives `ops` (P2P, in the
// order issued; a group's members or one call): send i reads buffer i of
// the sends (ProgramRef rank i, buffer 0 = ops' first send), receive j
// writes buffer j of the receives; a send stages its chunks in
// Space::P2POut of its peer, a receive copies them out of Space::P2PIn of
// its peer.  Each pair's members are cut into chunks in
// their order, and step t runs chunk t of every pair this rank sends on,
// then chunk t of every pair it receives on, so that the members of a
// group never wait on each other in a cycle, however many a pair has (a
// send and a receive that depend on each other must be in one group, as
// in NCCL).  A pair's sender and receiver must issue the same byte counts
// in the same order.  Advances *st.
StreamProgram compileP2PProgram(const std::vector<OpDesc>& ops, int rank, int nranks, size_t slotBytes,
                                P2PCounters* st);

// Captured sends and receives (a CUDA graph's; DeviceComm's graph lane):
// the program compileP2PProgram makes from fresh counters, made
// replayable like makeReplayable's.  It stages in the graph window, which
// each sender divides into a region per receiver (graphP2PRegionBytes),
// and counts each pair's chunks in the graph lane's own per-pair flags
// (kFlagGraphSent/kFlagGraphAcked, which no collective uses) from zero.
// Around it:
//   own busy = `busy` (kGraphP2PBusy + the call's number: the watchdog's
//     and destroy's "a replay is running here");
//   the size gate's values: for each receiver, its copies of this rank's
//     kFlagGraphMessages = v (graphP2PMessages of this rank's messages to
//     it) and kFlagGraphMessagesNot = kGraphMessagesSum - v, before
//     anything waits;
//   <the chunks, as compileP2PProgram's>, where a receiver zeroes its copy
//     of a sender's `sent` after the pair's last chunk of the call, before
//     its last ack (the sender wrote its last `sent` of the call: the wait
//     for it passed), and where, just before the wait for a sender's first
//     chunk, it passes that sender's gate: own kFlagGraphMessages = the
//     sender + 1 (the watchdog's "at this sender's gate"), wait for both
//     of its values >= this rank's v and sum - v (both pass only if they
//     are equal: a receive of another size stops here, before it reads
//     anything), own mark = 0, zero this rank's copies of the two.  The
//     values precede the first chunk on the sender's stream, so the gate
//     adds no wait the chunk's own did not have; and the sender writes its
//     next call's values only after this receiver's last ack, so while a
//     rank is at a sender's gate a nonzero value there that differs from
//     its own is that sender's in this same call;
//   wait for each receiver's last ack, then zero this rank's copies of
//     their `acked` (a receiver acks the next call's chunks only after
//     this rank's next `sent`, written after this);
//   own busy = 0.
// Only the pairs of the call synchronise: there is no start gate, so a
// rank that replays a collective where its partner replays a send, or a
// send whose receiver replays none, shows as a replay that stops, which
// the watchdog reports as loomTimeout.  Messages to itself have no gate
// (the group's issue compared them: checkBatch).  Nothing
// else in the graph lane conflicts: a rank's region for a receiver is
// written again only after that receiver's last ack, and a collective's
// flags and window are never these.  No ops when nothing moves (every
// count 0).
StreamProgram compileGraphP2PProgram(const std::vector<OpDesc>& ops, int rank, int nranks, size_t regionBytes,
                                     uint64_t busy);
// One pair's messages (their byte counts, in order, empty ones included)
// as the size gate's value: bits 40..59 a hash of the counts, bits 0..39
// their total (capped at 2^40 - 1, see graphP2PMessagesBytes); nonzero when
// any byte moves, 0 when none does (no gate), below kGraphMessagesSum.
uint64_t graphP2PMessages(const std::vector<uint64_t>& sizes);
inline uint64_t graphP2PMessagesBytes(uint64_t value) { return value & ((uint64_t(1) << 40) - 1); }
// Per peer: the byte counts of this rank's sends to it (sends true) or
// receives from it (false) among `ops`, in order.
std::vector<std::vector<uint64_t>> p2pPairSizes(const std::vector<OpDesc>& ops, int nranks, bool sends);
// A sender's region per receiver in the graph window (two graph slots),
// a multiple of 256 bytes; 0 when the window is too small to hold one.
inline size_t graphP2PRegionBytes(int nranks, size_t graphSlotBytes) {
  return nranks < 1 ? 0 : streamWindowBytes(graphSlotBytes) / size_t(nranks) / 256 * 256;
}

}  // namespace loom
