// Collectives as stream programs (src/device/stream_program.h): the device
// path, where every rank reads the other ranks' windows directly (CUDA IPC
// between GPUs of a host, or ranks sharing one GPU).
#pragma once
#include <cstddef>
#include <cstdint>

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

// Rank `rank`'s program for `op` (sendbuf/recvbuf only compared, never read:
// equal means in place).  `*round` is the communicator's round counter: the
// program uses rounds [*round, *round + program.rounds) and advances it.
// Every rank must compile the same operations in the same order.  The
// algorithm matters for all-reduce only; the other collectives have one
// program each.  loomInternalError if slotBytes cannot hold one element per
// rank.
StreamProgram compileStreamProgram(const OpDesc& op, int rank, int nranks, StreamAlgorithm algo,
                                   size_t slotBytes, uint64_t* round);

}  // namespace loom
