// A stream program: what one rank enqueues on its streams for one collective
// on device memory.  Plain data, printed and checked on the host; executed by
// a StreamBackend (the CUDA one maps each op onto one CUDA call, the
// simulated one in tests/sim_device.* runs them on host threads).
//
// Synchronisation is by 64-bit flags that only ever grow: a rank sets its own
// flag to a value, peers wait until the flag is >= that value.  Waits are
// stream waits (cuStreamWaitValue64), never a kernel spinning on a peer, so
// ranks that time-slice one GPU cannot deadlock: a waiting stream holds no
// SMs.  Values come from a per-communicator round counter that every rank
// advances identically, so no flag is ever reset.
//
// Memory a program touches: the caller's send and recv buffers (this rank's
// only) and the windows of every rank (peer memory: this rank's own and the
// others' mapped here).  Each window holds two slots, used by alternate
// rounds, and each rank owns kFlagCount flags that every rank can read.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom.h"

namespace loom {

enum class Space : uint8_t {
  Send,    // this rank's send buffer
  Recv,    // this rank's recv buffer
  Window,  // rank `rank`'s window (peer memory)
  P2POut,  // send/recv: this rank's staging region for receiver `rank`
  P2PIn,   // send/recv: sender `rank`'s staging region for this rank (peer memory)
  // Rank `rank`'s own send or recv buffer, read in place (device zero-copy):
  // `offset` bytes into the buffer that rank published in cell `cell` of
  // this rank's cell area; when the cell is empty (0), or what it publishes
  // does not hold the bytes read, rank's window at `fallback` instead.  The
  // choice is made when the op runs, so each rank decides for itself
  // whether it publishes (see CellIndex).  A source only.
  Published,
};

struct ProgramRef {
  Space space = Space::Send;
  int32_t rank = 0;   // Window/Published: whose; Send/Recv: which buffer (0, or 1.. of a send/recv group)
  size_t offset = 0;  // bytes
  uint8_t cell = 0;   // Published: the cell (CellIndex)
  size_t fallback = 0;  // Published: the window offset read when the cell is empty
  uint64_t minTag = 0;  // Published: the cell counts only if its slot's tag is >= this
};

// A rank's flags.  Each is set only by its owner and read by everyone.  The
// collectives' flags (input, reduced, done) hold the same value for every
// reader; send/recv's (p2p sent and acked) are per pair: the owner writes
// each reader's copy on its own (SetPeerFlag), so the copy a reader sees
// counts what the owner did for that reader only.
enum FlagIndex : uint8_t {
  kFlagInput = 0,    // the owner's input for a round is in its window
  kFlagReduced = 1,  // the owner's reduced part of a round is in its window
  kFlagDone = 2,     // the owner has finished reading every window for a round
  kFlagP2PSent = 3,  // chunks the owner has staged for this reader (send/recv)
  kFlagP2PAcked = 4, // chunks of this reader's the owner has copied out
  kFlagP2PDone = 5,  // send/recv programs the owner has finished
  // The graph lane's send/recv flags (below; unused in the eager area):
  // per pair like kFlagP2PSent/kFlagP2PAcked, counted from zero per call.
  kFlagGraphSent = 6,
  kFlagGraphAcked = 7,
  // The graph lane's size gate (compileGraphP2PProgram): per pair, the
  // sender's messages to the reader as one value (graphP2PMessages) and
  // kGraphMessagesSum minus it; in the owner's own row of its own area,
  // which no peer writes, kFlagGraphMessages is sender + 1 while its
  // program waits at that sender's gate (the watchdog's "a value of that
  // sender's here is this call's").
  kFlagGraphMessages = 8,
  kFlagGraphMessagesNot = 9,
  kFlagCount = 10,
};
// A reader that waits for both per-pair values, `v` and kGraphMessagesSum
// - v, passes only when its sender wrote exactly v (or a release).
constexpr uint64_t kGraphMessagesSum = uint64_t(1) << 60;
// The flags of the collectives' rounds (a round counter every rank advances).
constexpr int kRoundFlags = 3;

// Replayable programs: a call captured into a CUDA graph.  A replay repeats
// every value the capture enqueued, so such a program cannot continue the
// communicator's round counter: it runs in a flag area and window of its
// own (DeviceComm's graph lane), counts its rounds from zero, and returns
// every flag it used to zero before it ends (makeReplayable,
// algorithms/stream_collectives.h), so the next replay, or the next
// captured call, starts from zeros again.  Its flags, in the same layout:
// the round flags (kFlagInput, kFlagReduced, kFlagDone), then these three.
constexpr uint8_t kFlagGraphEnd = 3;    // the owner finished the program: none of its writes of it is to come
constexpr uint8_t kFlagGraphReset = 4;  // the owner zeroed its own area's rows after seeing everyone's end
// In the owner's own row of its own area, which no peer writes: the
// call's signature (signatureFlag, nonzero) from a replayable program's
// first op to its last (the watchdog's and destroy's "a replay is running
// here").  In a peer's row: that peer's signature of the call it runs (the
// start gate), written into this reader's copy only (SetPeerFlag).
constexpr uint8_t kFlagGraphBusy = 5;
constexpr uint8_t kFlagGraphSig = 5;
// Captured sends and receives (compileGraphP2PProgram) use the per-pair
// kFlagGraphSent/kFlagGraphAcked instead, which no collective touches, and
// mark the owner's busy flag with kGraphP2PBusy + the call's number on
// this communicator: above every signature (those are below 2^61), so
// the watchdog tells the two apart, and below kReleasedFlag (2^62).
constexpr uint64_t kGraphP2PBusy = uint64_t(1) << 61;

// Device zero-copy.  Each rank has a cell area beside its flags: row q holds
// rank q's cells as published to this rank, kCellCount cells of
// kCellWords words each: {the buffer's start as mapped in this rank, its
// bytes}; a start of 0 means "not published: read my window".  A rank
// publishes its send and recv buffers of a collective (a cell per buffer
// and slot: round g uses the cells of slot g % 2, which it writes, when it
// must, after the same guard as that slot, so no reader of the round
// before that used them still reads them) and then stages nothing in its
// window: the peers reduce or copy straight from its send buffer (and, the
// reduce-scatter + all-gather all-reduce, copy the reduced parts straight
// from its recv buffer).  Rooted collectives publish the send buffer of
// the side the others read only (writesCells, stream_collectives.h).
enum CellIndex : uint8_t {
  kCellSend0 = 0,  // send buffer, slot 0 rounds
  kCellSend1 = 1,
  kCellRecv0 = 2,  // recv buffer, slot 0 rounds
  kCellRecv1 = 3,
  kCellCount = 4,
};
constexpr int kCellWords = 2;
// After the cells, a tag per slot: the flag value of the last round of the
// program that wrote that slot's cells (every program that uses the slot
// writes it, the cells themselves only when they change).  A reader in
// round g takes a cell only when its slot's tag is >= g + 1: a cell left
// from an earlier program (whose buffer may be unmapped since: loomMemFree,
// a destroy), as a reader sees it when ranks mismatch or after a failure
// releases its waits, falls back to the window instead.
constexpr int kCellTagWords = 2;
constexpr size_t kCellRowWords = size_t(kCellCount) * kCellWords + kCellTagWords;
// A reduction may write its destination over one of its sources exactly
// when it has at most this many (one pass reads every source's element
// before it writes it; longer reductions are chained through the
// destination).
constexpr uint32_t kOnePassSources = 8;

enum class StreamOpKind : uint8_t {
  WaitFlag,     // stream waits until flag(flagRank, flag) >= value
  SetFlag,      // flag(owner = this rank, flag) = value, after all earlier work on the stream
  SetPeerFlag,  // the same, in the copy rank `flagRank` reads only (send/recv's per-pair flags)
  SetCell,      // cell `flag` (CellIndex) of this rank in rank `flagRank`'s cell area = what
                // ProgramBuffers::published holds for that reader and cell, after all earlier work
  SetCellTag,   // the tag of slot `flag` of this rank's cells in rank `flagRank`'s area = `value`
  Copy,         // dst = src[0], `bytes` bytes (never overlapping)
  Reduce,       // dst = src[0] op src[1] op ... (left to right, rounded each step), `count` elements;
                // with `dual`, the result goes to dst2 as well (written last: dst2 may be a source);
                // with at most kOnePassSources sources dst may be one of them exactly
  Divide,       // dst = src[0] / divisor, `count` elements (loomAvg's last step)
  RecordEvent,  // event `event` completes when the stream's earlier work has
  WaitEvent,    // stream waits for the last record of `event` enqueued before this op
  SetLocal,     // this rank's own copy of flag(flagRank, flag), where its waits read it, = value;
                // no peer sees it (a replayable program's zeroing and busy mark)
};

struct StreamOp {
  StreamOpKind kind = StreamOpKind::Copy;
  uint8_t stream = 0;  // 0: the caller's stream; 1..: the communicator's side streams
  uint8_t flag = 0;
  int32_t flagRank = 0;
  uint64_t value = 0;
  ProgramRef dst;
  ProgramRef dst2;    // Reduce with `dual`: a second destination
  bool dual = false;
  uint32_t srcBegin = 0;  // sources: program.srcs[srcBegin, srcBegin + srcCount)
  uint32_t srcCount = 0;
  size_t count = 0;  // Reduce/Divide: elements; Copy: bytes
  int32_t divisor = 0;
  int32_t event = 0;
};

struct StreamProgram {
  int rank = 0;
  int nranks = 0;
  int streams = 1;  // streams used (0 .. streams-1)
  int events = 0;   // events used (0 .. events-1)
  loomDataType_t dtype = loomFloat32;
  loomRedOp_t op = loomSum;
  uint64_t firstRound = 0;  // rounds [firstRound, firstRound + rounds) of the communicator
  uint64_t rounds = 0;
  bool replayable = false;  // made by makeReplayable or compileGraphP2PProgram (flags 3..7 are the graph lane's)
  std::vector<StreamOp> ops;
  std::vector<ProgramRef> srcs;

  const ProgramRef& src(const StreamOp& o, uint32_t i) const { return srcs[o.srcBegin + i]; }
  // One line per op, e.g. "s0 wait flag[2].done >= 7".
  std::string describe() const;
};

// The memory a program runs on, as this rank sees it.
struct ProgramBuffers {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t sendBytes = 0;
  size_t recvBytes = 0;
  std::vector<uint8_t*> windows;  // per rank, windowBytes each
  size_t windowBytes = 0;
  // Where this rank reads rank r's flags (kFlagCount each): WaitFlag's addresses.
  std::vector<uint64_t*> flags;
  // Where this rank's SetFlag writes go: every entry gets the write, in
  // this order (a communicator gives each reader a copy in the reader's own
  // memory, see device_comm.h).  Empty: flags[rank] alone.
  std::vector<uint64_t*> flagCopies;
  // Per rank r: the copy of this rank's flags that r reads (SetPeerFlag's
  // addresses).  Empty: the program may not use SetPeerFlag.
  std::vector<uint64_t*> peerFlags;
  // Buffers 1.. of a send/recv program (Send/Recv refs with rank i >= 1
  // name more[i - 1]); buffer 0 is send/recv above.
  struct Range {
    void* p = nullptr;
    size_t bytes = 0;
  };
  std::vector<Range> moreSends, moreRecvs;
  // Send/recv staging, per peer r: this rank's region for r (P2POut) and
  // r's region for this rank as mapped here (P2PIn), p2pBytes each; null
  // where the pair has none (regions are made on the pair's first use).
  std::vector<uint8_t*> p2pOut, p2pIn;
  size_t p2pBytes = 0;
  // Device zero-copy (CellIndex).  cells[q]: row q of this rank's cell
  // area (where Published refs to rank q read); peerCells[r]: this rank's
  // row in rank r's cell area (SetCell's addresses); published[r]: what
  // SetCell writes there, per cell.  Empty cells: Published refs read the
  // fallback window (nobody publishes), and SetCell is refused.
  struct Cell {
    uint64_t addr = 0;  // the buffer's start as mapped in the reader; 0: not published
    uint64_t bytes = 0;
  };
  std::vector<const uint64_t*> cells;
  std::vector<uint64_t*> peerCells;
  std::vector<std::array<Cell, kCellCount>> published;
};

// A source read through a cell (Space::Published) as a backend gets it:
// cell[0] is an address, cell[1] a size in bytes; the source is cell[0] +
// offset when *tag >= minTag, cell[0] is not 0 and [offset, offset + the
// bytes read) lies within cell[1], else the direct pointer given beside
// it.  All are read when the op runs, after the stream's earlier waits.
// cell null: direct.
struct CellRef {
  const uint64_t* cell = nullptr;
  size_t offset = 0;
  const uint64_t* tag = nullptr;
  uint64_t minTag = 0;
};

// What executes stream operations: one call per op, in program order per
// stream.  Calls enqueue and return; nothing here waits on the host.
// Pointers are resolved (ProgramBuffers); `stream` is the program's index.
class StreamBackend {
 public:
  virtual ~StreamBackend() = default;
  virtual void waitFlag(int stream, const uint64_t* flag, uint64_t value, int ownerRank) = 0;
  virtual void setFlag(int stream, uint64_t* flag, uint64_t value) = 0;
  // setFlag of each of `n` flags, as one operation where the backend can
  // (CUDA: one batch of stream memory operations); the writes land in no
  // particular order.  The enqueuer gives it runs of zeroings (SetLocal).
  virtual void setFlags(int stream, uint64_t* const* flags, size_t n, uint64_t value) {
    for (size_t i = 0; i < n; ++i) setFlag(stream, flags[i], value);
  }
  virtual void copy(int stream, void* dst, const void* src, size_t bytes) = 0;
  // dst = srcs[0] op ... op srcs[nsrcs-1]; when dst2 is not null, dst2
  // gets the same elements.  dst never overlaps a source; dst2 may be one
  // of them exactly (an in-place caller's buffer): every element of the
  // sources is read before that element of dst2 is written.
  virtual void reduce(int stream, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count,
                      loomDataType_t type, loomRedOp_t op) = 0;
  virtual void divide(int stream, void* dst, const void* src, size_t count, loomDataType_t type,
                      int divisor) = 0;
  virtual void recordEvent(int stream, int event) = 0;
  virtual void waitEvent(int stream, int event) = 0;
  // copy and reduce with sources read through cells (CellRef; cells[i] for
  // srcs[i], whose pointer is the fallback): device zero-copy.
  virtual void copyIndirect(int stream, void* dst, const void* src, CellRef cell, size_t bytes) = 0;
  virtual void reduceIndirect(int stream, void* dst, void* dst2, const void* const* srcs, const CellRef* cells,
                              int nsrcs, size_t count, loomDataType_t type, loomRedOp_t op) = 0;
};

// Checks every op of `p` against `b` (bounds, ranks, streams, events; a
// bad program is loomInternalError naming the op) before enqueueing any,
// then enqueues them on `be` in order.
void enqueueProgram(StreamBackend& be, const StreamProgram& p, const ProgramBuffers& b);

// enqueueProgram in steps.  The constructor checks every op as
// enqueueProgram does and enqueues nothing; step(n) enqueues the next n ops
// and says whether all are.  One host thread that drives several ranks
// (loomGroupEnd over CUDA communicators) interleaves their programs with
// it: a stream's queue of pending work is bounded (on a GPU the host blocks
// in an enqueue once it is full), and a rank's program enqueued whole could
// fill its queue with waits for flags that only the next rank's program,
// not yet enqueued, sets.  `be`, `p` and `b` must outlive the enqueuer.
class ProgramEnqueuer {
 public:
  ProgramEnqueuer(StreamBackend& be, const StreamProgram& p, const ProgramBuffers& b);
  bool step(size_t n);

 private:
  void visit(size_t index, bool enqueue);
  // The ops from `index` that one setFlags call enqueues (1: none to batch).
  size_t batchable(size_t index) const;
  StreamBackend& be_;
  const StreamProgram& p_;
  const ProgramBuffers& b_;
  size_t next_ = 0;
  std::vector<const void*> srcs_;
  std::vector<CellRef> cells_;
  std::vector<uint64_t*> batch_;
};

}  // namespace loom
