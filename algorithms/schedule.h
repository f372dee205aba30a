// Schedules: what each rank does for one collective, as plain data.
//
// A schedule is a list of lanes.  A lane is an ordered list of steps that
// uses one channel; lanes run concurrently, steps of a lane one after
// another (each step is itself pipelined slot by slot).  Algorithms produce
// schedules; the executor (src/core/executor.cc) runs them; neither knows
// the other's internals, and schedules can be printed and checked.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom.h"
#include "src/device/memory_kind.h"

namespace loom {

enum class Collective : uint8_t {
  AllReduce = 1,
  ReduceScatter = 2,
  AllGather = 3,
  Broadcast = 4,
  Reduce = 5,
  P2P = 6,  // a loomSend or loomRecv (matched per pair)
  AllToAll = 7,
  Gather = 8,
  Scatter = 9,
};
const char* collectiveName(Collective c);
// Arrays indexed by a Collective's value (0 is unused).
constexpr int kCollectiveValues = int(Collective::Scatter) + 1;
// The collectives the tuner decides (every one but P2P), in value order.
constexpr Collective kTunedCollectives[] = {Collective::AllReduce, Collective::ReduceScatter, Collective::AllGather,
                                            Collective::Broadcast, Collective::Reduce,        Collective::AllToAll,
                                            Collective::Gather,    Collective::Scatter};
// A set of collectives, one bit per value.
using CollectiveSet = unsigned;
constexpr CollectiveSet collectiveBit(Collective c) { return 1u << unsigned(c); }
// All-reduce, reduce-scatter and reduce combine data with an op.
inline bool reduces(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}
// Collectives with a root (OpDesc::root, part of the slot tag).
inline bool rooted(Collective c) {
  return c == Collective::Broadcast || c == Collective::Reduce || c == Collective::Gather || c == Collective::Scatter;
}
// Collectives whose count is per rank and whose buffer (as nccl-tests and
// the tuner's size buckets count it) is N blocks: reduce-scatter, all-gather,
// all-to-all, gather and scatter.
inline bool perRankCount(Collective c) {
  return c == Collective::ReduceScatter || c == Collective::AllGather || c == Collective::AllToAll ||
         c == Collective::Gather || c == Collective::Scatter;
}

// One call as the user made it.
struct OpDesc {
  Collective coll = Collective::AllReduce;
  const void* sendbuf = nullptr;
  void* recvbuf = nullptr;
  // AllReduce/Broadcast/Reduce/P2P: count; RS: recvcount; AG: sendcount;
  // AllToAll, Gather, Scatter: elements per rank's block.
  size_t count = 0;
  loomDataType_t dtype = loomFloat32;
  loomRedOp_t op = loomSum;
  int root = 0;
  int peer = -1;        // P2P only
  bool isSend = false;  // P2P only
  // P2P only: part of a loomAllToAllv (a group of sends and receives), said
  // in its tag so that a mismatch with a plain send or receive names it.
  bool inAllToAllv = false;
  // P2P only: loomSendTagged/loomRecvTagged (src/core/p2p_tagged.h), matched
  // by (source, tag) on the tagged channel instead of in order per pair.
  // peer may be LOOM_ANY_SOURCE and tag LOOM_ANY_TAG for a receive.
  bool tagged = false;
  int tag = 0;
  loomP2PStatus* status = nullptr;  // receive: filled when it completes
  // Where sendbuf and recvbuf live (set by the API layer).
  MemoryKind sendMem = MemoryKind::Host;
  MemoryKind recvMem = MemoryKind::Host;
};

enum class StepKind : uint8_t {
  Send,            // send src
  Recv,            // dst = incoming
  RecvReduce,      // dst = src (op) incoming
  RecvReduceSend,  // out = src (op) incoming; send out; dst = out if dst given
  RecvCopySend,    // send incoming on; dst = incoming if dst given
  Copy,            // dst = src (local)
  // Check mode: send this operation's tag to sendPeer, or check the one
  // recvPeer sent; moves no data (kHandshakeBytes of zeros; no src or dst).
  Handshake,
};
constexpr size_t kHandshakeBytes = 8;
const char* stepKindName(StepKind k);

// Scratch is space the executor provides for the operation (Schedule::scratch
// bytes of it), for partial results that have no place in the user's buffers.
enum class Buf : uint8_t { None, Send, Recv, Scratch };

struct BufRef {
  Buf buf = Buf::None;
  size_t offset = 0;  // bytes
};

struct Step {
  StepKind kind;
  int recvPeer = -1;
  int sendPeer = -1;
  BufRef src;
  BufRef dst;
  size_t bytes = 0;
  bool finalize = false;  // apply the op's last step (avg: divide) to the result
};

// A step in one expression (the algorithms build hundreds of them).
Step makeStep(StepKind kind, int recvPeer, int sendPeer, BufRef src, BufRef dst, size_t bytes,
              bool finalize = false);

// First element of part i when `total` elements are cut into `parts` parts
// as evenly as possible (the first total % parts parts get one more).
size_t partBegin(size_t total, int parts, int i);

struct Lane {
  int op = 0;  // which operation of the run (groups run several)
  int channel = 0;
  std::vector<Step> steps;
  // Lanes (indices into Schedule::lanes, all earlier) that must finish
  // before this one starts: phases of a composed algorithm.
  std::vector<int> after;
};

struct Schedule {
  std::vector<Lane> lanes;
  // Scratch bytes per operation index (missing or 0: none).
  std::vector<size_t> scratch;
  void needScratch(int op, size_t bytes) {
    if (scratch.size() <= size_t(op)) scratch.resize(size_t(op) + 1, 0);
    if (bytes > scratch[size_t(op)]) scratch[size_t(op)] = bytes;
  }
  size_t scratchOf(int op) const { return size_t(op) < scratch.size() ? scratch[size_t(op)] : 0; }
};

// Check mode, rooted collectives on the executor path: each rank sends its
// operation's tag (which names the root) to rank+1 and checks the one from
// rank-1, ahead of the algorithm's lanes (so first on every connection
// they share).  The ring does not depend on the root, so ranks that name
// different roots always leave some rank a neighbour whose tag differs, and
// that rank fails the communicator for all: otherwise a root nobody else
// names can send into buffered slots and return its own data, and a rank
// waiting for a root that never sends waits for the timeout.
void addRootCheck(int opIndex, int rank, int nranks, Schedule* out);

// Puts `front` ahead of s's lanes (their `after` indices follow them).
void prependLanes(Schedule* s, std::vector<Lane> front);

// What the tuner decided for one operation.
enum class Algorithm : uint8_t {
  Ring = 0,
  OneShot = 1,
  Staged = 2,
  HalvingDoubling = 3,
  Tree = 4,
  Hierarchical = 5,
  Pairwise = 6,
  Bruck = 7,
};
const char* algorithmName(Algorithm a);

// Default ring chunk: a ring loop then covers nranks x 128 KiB, small enough
// to stay in L2 while a slot is reduced and forwarded.  (From loom-perf
// all_reduce sweeps of LOOM_CHUNK_SIZE 32K..1M on the 2-core dev machine.)
// The tuner plans with it and the cost model counts loops with it.
constexpr size_t kDefaultChunkBytes = 128 << 10;

struct Plan {
  Algorithm algo = Algorithm::Ring;
  int channels = 1;
  size_t chunkBytes = kDefaultChunkBytes;
  // Hierarchical: the flat algorithm of the inter-host all-reduce.
  Algorithm inner = Algorithm::Ring;
};

// Human-readable dump of a schedule (for loom-topo and test failures).
std::string describe(const Schedule& s);

}  // namespace loom
