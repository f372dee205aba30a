// Ring algorithms (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
// for clusters of workstations", JPDC 2009; the layout NCCL uses).
//
// N ranks form a ring r -> r+1.  For all-reduce of S bytes the buffer is cut
// into loops of N chunks; in each loop, N-1 steps of reduce-scatter leave
// chunk r fully reduced on rank r, then N-1 steps of all-gather circulate the
// reduced chunks.  Each rank sends 2(N-1)/N x S bytes in 2(N-1) sequential
// steps per loop: bandwidth-optimal, latency linear in N.  Reduce-scatter and
// all-gather are the two halves alone ((N-1)/N x N*count bytes each).
// Broadcast and reduce run as a chain (root -> ... -> last, or first -> ...
// -> root), one step per rank, pipelined slot by slot by the executor, so
// large messages move at link speed after N-1 slot times of fill.
//
// Blocks may be empty (count < N): both neighbours compute the same sizes
// and skip them.  Each channel takes a contiguous part of the data and uses
// its own connections, so channels never share a slot ring.
#include <algorithm>

#include "algorithms/algorithms.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

int mod(int x, int n) { return ((x % n) + n) % n; }


struct Ctx {
  int rank, nranks, next, prev;
  size_t esz;
  BufRef S(size_t elem) const { return BufRef{Buf::Send, elem * esz}; }
  BufRef R(size_t elem) const { return BufRef{Buf::Recv, elem * esz}; }
};


void allReduceLane(const Ctx& c, size_t begin, size_t end, size_t chunkElems, Lane* lane) {
  const int N = c.nranks, r = c.rank;
  const size_t loopElems = chunkElems * size_t(N);
  for (size_t ls = begin; ls < end; ls += loopElems) {
    size_t ll = std::min(loopElems, end - ls);
    auto blk = [&](int b) { return ls + partBegin(ll, N, mod(b, N)); };
    auto len = [&](int b) {
      int m = mod(b, N);
      return (partBegin(ll, N, m + 1) - partBegin(ll, N, m)) * c.esz;
    };
    BufRef none;
    lane->steps.push_back(makeStep(StepKind::Send, -1, c.next, c.S(blk(r - 1)), none, len(r - 1)));
    for (int j = 2; j <= N - 1; ++j)
      lane->steps.push_back(
          makeStep(StepKind::RecvReduceSend, c.prev, c.next, c.S(blk(r - j)), none, len(r - j)));
    lane->steps.push_back(
        makeStep(StepKind::RecvReduceSend, c.prev, c.next, c.S(blk(r)), c.R(blk(r)), len(r), true));
    for (int j = 1; j <= N - 2; ++j)
      lane->steps.push_back(
          makeStep(StepKind::RecvCopySend, c.prev, c.next, none, c.R(blk(r - j)), len(r - j)));
    lane->steps.push_back(
        makeStep(StepKind::Recv, c.prev, -1, none, c.R(blk(r - (N - 1))), len(r - (N - 1))));
  }
}

void reduceScatterLane(const Ctx& c, size_t rc, size_t begin, size_t end, size_t chunkElems,
                       Lane* lane) {
  const int N = c.nranks, r = c.rank;
  BufRef none;
  for (size_t o = begin; o < end; o += chunkElems) {
    size_t k = std::min(chunkElems, end - o), bytes = k * c.esz;
    auto at = [&](int b) { return size_t(mod(b, N)) * rc + o; };
    lane->steps.push_back(makeStep(StepKind::Send, -1, c.next, c.S(at(r - 1)), none, bytes));
    for (int j = 2; j <= N - 1; ++j)
      lane->steps.push_back(
          makeStep(StepKind::RecvReduceSend, c.prev, c.next, c.S(at(r - j)), none, bytes));
    lane->steps.push_back(makeStep(StepKind::RecvReduce, c.prev, -1, c.S(at(r)), c.R(o), bytes, true));
  }
}

void allGatherLane(const Ctx& c, size_t sc, bool inPlace, size_t begin, size_t end,
                   size_t chunkElems, Lane* lane) {
  const int N = c.nranks, r = c.rank;
  BufRef none;
  if (!inPlace && end > begin)
    lane->steps.push_back(makeStep(StepKind::Copy, -1, -1, c.S(begin), c.R(size_t(r) * sc + begin),
                               (end - begin) * c.esz));
  for (size_t o = begin; o < end; o += chunkElems) {
    size_t k = std::min(chunkElems, end - o), bytes = k * c.esz;
    auto at = [&](int b) { return size_t(mod(b, N)) * sc + o; };
    lane->steps.push_back(makeStep(StepKind::Send, -1, c.next, c.S(o), none, bytes));
    for (int j = 1; j <= N - 2; ++j)
      lane->steps.push_back(makeStep(StepKind::RecvCopySend, c.prev, c.next, none, c.R(at(r - j)), bytes));
    lane->steps.push_back(makeStep(StepKind::Recv, c.prev, -1, none, c.R(at(r - (N - 1))), bytes));
  }
}

}  // namespace

size_t sendBytes(const OpDesc& op, int nranks) {
  size_t esz = dtypeSize(op.dtype);
  if (op.coll == Collective::ReduceScatter || op.coll == Collective::AllToAll || op.coll == Collective::Scatter)
    return op.count * size_t(nranks) * esz;
  return op.count * esz;
}

size_t recvBytes(const OpDesc& op, int nranks) {
  size_t esz = dtypeSize(op.dtype);
  if (op.coll == Collective::AllGather || op.coll == Collective::AllToAll || op.coll == Collective::Gather)
    return op.count * size_t(nranks) * esz;
  return op.count * esz;
}

void ringSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                  Schedule* out) {
  Ctx c{rank, nranks, mod(rank + 1, nranks), mod(rank - 1, nranks), dtypeSize(op.dtype)};
  const int N = nranks;
  size_t chunkElems = std::max<size_t>(1, plan.chunkBytes / c.esz);
  size_t total = op.count;  // the per-channel split is over this many elements
  bool inPlaceAG = op.coll == Collective::AllGather &&
                   static_cast<const char*>(op.sendbuf) ==
                       static_cast<const char*>(op.recvbuf) + size_t(rank) * op.count * c.esz;
  bool sameBuf = op.sendbuf == op.recvbuf;
  bool inPlaceRS = op.coll == Collective::ReduceScatter &&
                   static_cast<const char*>(op.recvbuf) ==
                       static_cast<const char*>(op.sendbuf) + size_t(rank) * op.count * c.esz;

  int channels = std::max(1, plan.channels);
  for (int ch = 0; ch < channels; ++ch) {
    size_t b = partBegin(total, channels, ch), e = partBegin(total, channels, ch + 1);
    if (b == e) continue;
    Lane lane;
    lane.op = opIndex;
    lane.channel = ch;
    BufRef none;
    if (N == 1) {
      // Nothing to exchange: the result is the input.
      bool inPlace = op.coll == Collective::AllGather ? inPlaceAG
                     : op.coll == Collective::ReduceScatter ? inPlaceRS
                                                            : sameBuf;
      if (!inPlace && !(op.coll == Collective::Reduce && !op.recvbuf))
        lane.steps.push_back(makeStep(StepKind::Copy, -1, -1, c.S(b), c.R(b), (e - b) * c.esz));
    } else {
      switch (op.coll) {
        case Collective::AllReduce:
          allReduceLane(c, b, e, chunkElems, &lane);
          break;
        case Collective::ReduceScatter:
          reduceScatterLane(c, op.count, b, e, chunkElems, &lane);
          break;
        case Collective::AllGather:
          allGatherLane(c, op.count, inPlaceAG, b, e, chunkElems, &lane);
          break;
        case Collective::Broadcast: {
          int p = mod(rank - op.root, N);
          size_t bytes = (e - b) * c.esz;
          if (p == 0) {
            lane.steps.push_back(makeStep(StepKind::Send, -1, c.next, c.S(b), none, bytes));
            if (!sameBuf) lane.steps.push_back(makeStep(StepKind::Copy, -1, -1, c.S(b), c.R(b), bytes));
          } else if (p < N - 1) {
            lane.steps.push_back(makeStep(StepKind::RecvCopySend, c.prev, c.next, none, c.R(b), bytes));
          } else {
            lane.steps.push_back(makeStep(StepKind::Recv, c.prev, -1, none, c.R(b), bytes));
          }
          break;
        }
        case Collective::Reduce: {
          int p = mod(rank - op.root - 1, N);
          size_t bytes = (e - b) * c.esz;
          if (p == 0)
            lane.steps.push_back(makeStep(StepKind::Send, -1, c.next, c.S(b), none, bytes));
          else if (p < N - 1)
            lane.steps.push_back(makeStep(StepKind::RecvReduceSend, c.prev, c.next, c.S(b), none, bytes));
          else
            lane.steps.push_back(makeStep(StepKind::RecvReduce, c.prev, -1, c.S(b), c.R(b), bytes, true));
          break;
        }
        case Collective::P2P:
        case Collective::AllToAll:
        case Collective::Gather:
        case Collective::Scatter:
          fail(loomInternalError, "the ring does not serve %s", collectiveName(op.coll));
      }
    }
    if (!lane.steps.empty()) out->lanes.push_back(std::move(lane));
  }
}

void p2pSchedule(const OpDesc& op, int opIndex, Schedule* out) {
  Lane lane;
  lane.op = opIndex;
  lane.channel = 0;
  size_t bytes = op.count * dtypeSize(op.dtype);
  if (bytes == 0) return;
  if (op.isSend)
    lane.steps.push_back(makeStep(StepKind::Send, -1, op.peer, BufRef{Buf::Send, 0}, BufRef{}, bytes));
  else
    lane.steps.push_back(makeStep(StepKind::Recv, op.peer, -1, BufRef{}, BufRef{Buf::Recv, 0}, bytes));
  out->lanes.push_back(std::move(lane));
}

// Cost (src/tuner/cost_model.h): 2(N-1) steps per loop of N chunks
// (all-reduce), N-1 for RS/AG, and a chain of N-1 hops for broadcast and
// reduce; one rank copies at a nominal 10 GB/s.
void ringEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double S = in.S, n = in.n;
  auto add = [&](double us) { out->push_back(Estimate{Algorithm::Ring, Algorithm::Ring, us, ""}); };
  if (in.N == 1) return add(xfer(S, 10.0));
  double ra, rb;
  in.ring(&ra, &rb);
  switch (in.coll) {
    case Collective::AllReduce:
      add(2 * (n - 1) * in.loops(S, n) * ra + xfer(2 * (n - 1) / n * S, rb) + in.reduce((n - 1) / n * S));
      break;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      add((n - 1) * in.loops(S / n, 1) * ra + xfer((n - 1) / n * S, rb) + (in.reducing ? in.reduce((n - 1) / n * S) : 0));
      break;
    default:
      add(((n - 1) + in.loops(S, 1)) * ra + xfer(S, rb) + (in.reducing ? in.reduce(S) : 0));
      break;
  }
}

// As the rails' all-reduce: 2(H-1) steps per loop of H chunks of a rail.
StepsAndBytesUs ringRailCost(const CostInput& in, const RailCost& r) {
  return {2 * (r.h - 1) * in.loops(r.rail, r.h) * r.na, xfer(r.netBytes, r.nb)};
}

}  // namespace loom
