// Bruck's all-to-all: ceil(log2 N) rounds instead of N-1 messages, for small
// blocks where a message's latency costs more than its bytes.
//
// Rank r first rotates its send buffer into scratch, so that work block i is
// the block for rank r+i.  In round k it sends every work block whose index
// has bit k set to rank r + 2^k, and puts the blocks from rank r - 2^k at the
// same indices.  A block for r+i thus travels i ranks onward in the rounds of
// i's bits and ends, still at index i, at its destination; there work block i
// holds the block from rank r-i, which the last copies put in place.
//
// Each round runs as lanes ordered by Lane::after: pack the outgoing blocks
// into a send area and send them (one lane), receive into a receive area
// (another, concurrently, so neither side waits for the other's send), then
// unpack into the work blocks once both are done.  Scratch: the N work
// blocks and two areas of ceil(N/2) blocks.
//
// Volume: ceil(log2 N) messages of about N/2 blocks each, so about
// (N/2) log2 N blocks sent against pairwise's N-1, plus local copies of
// about 2 + log2 N passes over the buffer.
#include <algorithm>

#include "algorithms/algorithms.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

// Work blocks with bit k of their index set, as runs [first, first+len).
std::vector<std::pair<int, int>> roundRuns(int n, int k) {
  std::vector<std::pair<int, int>> runs;
  const int step = 1 << k;
  for (int first = step; first < n; first += 2 * step) runs.push_back({first, std::min(step, n - first)});
  return runs;
}

int roundBlocks(int n, int k) {
  int total = 0;
  for (const auto& run : roundRuns(n, k)) total += run.second;
  return total;
}

}  // namespace

void bruckSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan&, Schedule* out) {
  if (op.coll != Collective::AllToAll) fail(loomInternalError, "bruck does not serve %s", collectiveName(op.coll));
  const int N = nranks;
  const size_t block = op.count * dtypeSize(op.dtype);
  if (block == 0) return;
  auto lane = [&](std::vector<int> after) {
    Lane l;
    l.op = opIndex;
    l.channel = 0;
    l.after = std::move(after);
    out->lanes.push_back(std::move(l));
    return int(out->lanes.size() - 1);
  };
  auto copy = [&](int l, BufRef src, BufRef dst, size_t bytes) {
    out->lanes[size_t(l)].steps.push_back(makeStep(StepKind::Copy, -1, -1, src, dst, bytes));
  };
  if (N == 1) {
    copy(lane({}), BufRef{Buf::Send, 0}, BufRef{Buf::Recv, 0}, block);
    return;
  }
  // Scratch: work blocks, then the send area, then the receive area.
  const size_t half = size_t((N + 1) / 2) * block;
  const size_t work = 0, sendArea = size_t(N) * block, recvArea = sendArea + half;
  out->needScratch(opIndex, recvArea + half);

  // Rotate: work[i] = send[(r + i) % N], as two contiguous copies.
  int rotate = lane({});
  copy(rotate, BufRef{Buf::Send, size_t(rank) * block}, BufRef{Buf::Scratch, work}, size_t(N - rank) * block);
  if (rank > 0)
    copy(rotate, BufRef{Buf::Send, 0}, BufRef{Buf::Scratch, work + size_t(N - rank) * block}, size_t(rank) * block);

  int last = rotate;  // the lane every later round waits for
  for (int k = 0; (1 << k) < N; ++k) {
    const int to = (rank + (1 << k)) % N, from = (rank - (1 << k) + N) % N;
    const size_t bytes = size_t(roundBlocks(N, k)) * block;
    const auto runs = roundRuns(N, k);
    int s = lane({last});
    size_t packed = 0;
    for (const auto& run : runs) {
      copy(s, BufRef{Buf::Scratch, work + size_t(run.first) * block}, BufRef{Buf::Scratch, sendArea + packed},
           size_t(run.second) * block);
      packed += size_t(run.second) * block;
    }
    out->lanes[size_t(s)].steps.push_back(
        makeStep(StepKind::Send, -1, to, BufRef{Buf::Scratch, sendArea}, BufRef{}, bytes));
    int r = lane({last});
    out->lanes[size_t(r)].steps.push_back(
        makeStep(StepKind::Recv, from, -1, BufRef{}, BufRef{Buf::Scratch, recvArea}, bytes));
    int u = lane({s, r});
    size_t unpacked = 0;
    for (const auto& run : runs) {
      copy(u, BufRef{Buf::Scratch, recvArea + unpacked}, BufRef{Buf::Scratch, work + size_t(run.first) * block},
           size_t(run.second) * block);
      unpacked += size_t(run.second) * block;
    }
    last = u;
  }
  // recv[(r - i) % N] = work[i].
  int place = lane({last});
  for (int i = 0; i < N; ++i)
    copy(place, BufRef{Buf::Scratch, work + size_t(i) * block}, BufRef{Buf::Recv, size_t((rank - i + N) % N) * block},
         block);
}

// Cost: ceil(log2 N) dependent rounds of about N/2 blocks, and the local
// copies (rotate, pack, unpack, place) at memory speed.
void bruckEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const int N = in.N;
  double a, b;
  in.anyPair(&a, &b);
  double us = 0, moved = 0;
  for (int k = 0; (1 << k) < N; ++k) {
    us += a;
    moved += double(roundBlocks(N, k)) * in.block;
  }
  const double copied = (2 * in.n + 2 * moved / std::max(in.block, 1.0)) * in.block;
  us += xfer(moved, b) + xfer(copied, in.lp(CostLink::Shm).betaGBps);
  out->push_back(Estimate{Algorithm::Bruck, Algorithm::Ring, us, ""});
}

}  // namespace loom
