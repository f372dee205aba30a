// All-to-all, gather and scatter as pairwise exchange, and all-to-allv as a
// group of sends and receives.
//
// Pairwise (the schedule builder): rank r runs one send lane to r+k and one
// receive lane from r-k for every k = 1..N-1, all at once, and copies its own
// block locally; every connection carries exactly one block each way, and
// every pair exchanges concurrently.  Gather: the root receives a block from
// every other rank, which each send one; scatter is the mirror.
//
// Volume: all-to-all, per rank (N-1) x block sent and received, 1 step of
// latency when the links carry the pairs in parallel; gather and scatter:
// the root receives / sends (N-1) x block, every other rank one block.
// Small blocks at larger N go to bruck.cc's log-step algorithm instead.
//
// All-to-allv has per-peer counts that differ between ranks, so it stays what
// NCCL makes of it: one group of point-to-point operations (allToAllvOps),
// marked in their tags so that a mismatch names it.
#include "algorithms/algorithms.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

OpDesc p2p(bool isSend, int peer, const void* buf, size_t count, loomDataType_t dtype) {
  OpDesc d;
  d.coll = Collective::P2P;
  d.isSend = isSend;
  d.peer = peer;
  d.count = count;
  d.dtype = dtype;
  d.inAllToAllv = true;
  if (isSend)
    d.sendbuf = buf;
  else
    d.recvbuf = const_cast<void*>(buf);
  return d;
}

const char* at(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }

void addLane(Schedule* out, int opIndex, const Step& st) {
  Lane lane;
  lane.op = opIndex;
  lane.channel = 0;
  lane.steps.push_back(st);
  out->lanes.push_back(std::move(lane));
}

void sendLane(Schedule* out, int opIndex, int to, size_t srcOffset, size_t bytes) {
  addLane(out, opIndex, makeStep(StepKind::Send, -1, to, BufRef{Buf::Send, srcOffset}, BufRef{}, bytes));
}
void recvLane(Schedule* out, int opIndex, int from, size_t dstOffset, size_t bytes) {
  addLane(out, opIndex, makeStep(StepKind::Recv, from, -1, BufRef{}, BufRef{Buf::Recv, dstOffset}, bytes));
}
void copyLane(Schedule* out, int opIndex, size_t srcOffset, size_t dstOffset, size_t bytes) {
  addLane(out, opIndex,
          makeStep(StepKind::Copy, -1, -1, BufRef{Buf::Send, srcOffset}, BufRef{Buf::Recv, dstOffset}, bytes));
}

}  // namespace

void pairwiseSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan&, Schedule* out) {
  const int N = nranks;
  const size_t block = op.count * dtypeSize(op.dtype);
  if (block == 0) return;
  const uint8_t* send = static_cast<const uint8_t*>(op.sendbuf);
  const uint8_t* recv = static_cast<const uint8_t*>(op.recvbuf);
  switch (op.coll) {
    case Collective::AllToAll:
      for (int k = 1; k < N; ++k) {
        int to = (rank + k) % N, from = (rank - k + N) % N;
        sendLane(out, opIndex, to, size_t(to) * block, block);
        recvLane(out, opIndex, from, size_t(from) * block, block);
      }
      copyLane(out, opIndex, size_t(rank) * block, size_t(rank) * block, block);
      break;
    case Collective::Gather:
      if (rank != op.root) {
        sendLane(out, opIndex, op.root, 0, block);
        break;
      }
      for (int k = 1; k < N; ++k) {
        int from = (rank + k) % N;
        recvLane(out, opIndex, from, size_t(from) * block, block);
      }
      if (send != recv + size_t(rank) * block) copyLane(out, opIndex, 0, size_t(rank) * block, block);
      break;
    case Collective::Scatter:
      if (rank != op.root) {
        recvLane(out, opIndex, op.root, 0, block);
        break;
      }
      for (int k = 1; k < N; ++k) {
        int to = (rank + k) % N;
        sendLane(out, opIndex, to, size_t(to) * block, block);
      }
      if (recv != send + size_t(rank) * block) copyLane(out, opIndex, size_t(rank) * block, 0, block);
      break;
    default:
      fail(loomInternalError, "pairwise exchange does not serve %s", collectiveName(op.coll));
  }
}

// Cost: every message is in flight at once, so one dependent step (the
// link's latency, with the wake-up of a shared core) plus, for each further
// message, a quarter of the link's latency (the executor posts and polls one
// more lane) and, with ranks sharing cores, one more wake-up (the peers'
// blocks arrive as each gets a core); then the (N-1) blocks at the link's
// rate.  Against bruck.cc's ceil(log2 N) dependent rounds this favours
// pairwise on fast links and few ranks per core, and Bruck for small blocks
// at larger N or oversubscribed hosts.  Fit to loom-perf alltoall with
// LOOM_ALGO=alltoall:pairwise / :bruck on the 2-core dev VM, quiet, over
// tcp at 1 KiB: N=4 pairwise 133 us, Bruck 155 us; N=8 pairwise 385 us,
// Bruck 252 us (the model's ratios: 0.83 and 1.4).
constexpr double kPerMessage = 0.25;

void pairwiseEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double n = in.n;
  double a, b;
  in.anyPair(&a, &b);
  double us;
  if (in.N == 1) us = xfer(in.block, 10.0);
  else us = a + (n - 2) * (kPerMessage * (a - in.osUs) + in.osUs) + xfer((n - 1) * in.block, b);
  out->push_back(Estimate{Algorithm::Pairwise, Algorithm::Ring, us, ""});
}

std::vector<OpDesc> allToAllvOps(const void* sendbuf, const size_t* sendcounts, const size_t* sdispls,
                                 void* recvbuf, const size_t* recvcounts, const size_t* rdispls,
                                 loomDataType_t dtype, int rank, int nranks) {
  std::vector<OpDesc> ops;
  size_t esz = dtypeSize(dtype);
  for (int k = 0; k < nranks; ++k) {
    int to = (rank + k) % nranks, from = (rank - k + nranks) % nranks;
    if (sendcounts[to] > 0)
      ops.push_back(p2p(true, to, at(sendbuf, sdispls[to] * esz), sendcounts[to], dtype));
    if (recvcounts[from] > 0)
      ops.push_back(p2p(false, from, at(recvbuf, rdispls[from] * esz), recvcounts[from], dtype));
  }
  return ops;
}

}  // namespace loom
