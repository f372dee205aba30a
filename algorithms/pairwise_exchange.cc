// All-to-all, all-to-allv, gather and scatter as pairwise exchange.
//
// Each is one group of point-to-point operations, as NCCL builds them: rank r
// sends its block for rank j to j and receives j's block for r from j, for
// every j; a rank's own block is a send to and a receive from itself, which
// the communicator matches and copies locally.  The operations are issued in
// pairwise order (step k: send to r+k, receive from r-k, k = 0..N-1) and the
// executor runs all lanes of a group at once, so every pair exchanges
// concurrently and each connection carries exactly one block each way.
//
// Volume: all-to-all, per rank (N-1) x block sent and received, 1 step of
// latency when the links carry the pairs in parallel; gather and scatter:
// the root receives / sends (N-1) x block, every other rank one block.
// Small blocks at large N would profit from a log-step (Bruck) algorithm
// (log2 N steps of N/2 blocks each); loom does not have one yet.
#include "algorithms/algorithms.h"
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
  if (isSend)
    d.sendbuf = buf;
  else
    d.recvbuf = const_cast<void*>(buf);
  return d;
}

const char* at(const void* base, size_t bytes) { return static_cast<const char*>(base) + bytes; }

}  // namespace

std::vector<OpDesc> allToAllOps(const void* sendbuf, void* recvbuf, size_t count, loomDataType_t dtype,
                                int rank, int nranks) {
  std::vector<OpDesc> ops;
  if (count == 0) return ops;
  size_t block = count * dtypeSize(dtype);
  for (int k = 0; k < nranks; ++k) {
    int to = (rank + k) % nranks, from = (rank - k + nranks) % nranks;
    ops.push_back(p2p(true, to, at(sendbuf, size_t(to) * block), count, dtype));
    ops.push_back(p2p(false, from, at(recvbuf, size_t(from) * block), count, dtype));
  }
  return ops;
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

std::vector<OpDesc> gatherOps(const void* sendbuf, void* recvbuf, size_t count, loomDataType_t dtype,
                              int root, int rank, int nranks) {
  std::vector<OpDesc> ops;
  if (count == 0) return ops;
  if (rank != root) {
    ops.push_back(p2p(true, root, sendbuf, count, dtype));
    return ops;
  }
  size_t block = count * dtypeSize(dtype);
  const void* mine = at(recvbuf, size_t(root) * block);
  for (int k = 1; k < nranks; ++k) {
    int from = (root + k) % nranks;
    ops.push_back(p2p(false, from, at(recvbuf, size_t(from) * block), count, dtype));
  }
  if (sendbuf != mine) {  // not in place: copy the root's own block
    ops.push_back(p2p(true, root, sendbuf, count, dtype));
    ops.push_back(p2p(false, root, mine, count, dtype));
  }
  return ops;
}

std::vector<OpDesc> scatterOps(const void* sendbuf, void* recvbuf, size_t count, loomDataType_t dtype,
                               int root, int rank, int nranks) {
  std::vector<OpDesc> ops;
  if (count == 0) return ops;
  if (rank != root) {
    ops.push_back(p2p(false, root, recvbuf, count, dtype));
    return ops;
  }
  size_t block = count * dtypeSize(dtype);
  const void* mine = at(sendbuf, size_t(root) * block);
  for (int k = 1; k < nranks; ++k) {
    int to = (root + k) % nranks;
    ops.push_back(p2p(true, to, at(sendbuf, size_t(to) * block), count, dtype));
  }
  if (recvbuf != mine) {
    ops.push_back(p2p(true, root, mine, count, dtype));
    ops.push_back(p2p(false, root, recvbuf, count, dtype));
  }
  return ops;
}

}  // namespace loom
