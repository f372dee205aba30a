// AlltoAll, Gather and Scatter as loom point-to-point calls in one group.
//
// This is the one place that says how these three reach loom: when loom's
// own loomAllToAll/loomGather/loomScatter land, each body becomes one call.
// Every rank posts its sends and receives for all peers, itself included
// (loom copies a self send/recv locally), inside one loom group so that no
// pair can deadlock.  A block already in place (Gather's root with
// sendbuff == recvbuff + root*count, Scatter's root with
// recvbuff == sendbuff + root*count) is not copied.  Bytes per rank: count
// elements to and from each peer (AlltoAll), or count to/from the root.
#include "nccl_shim/shim.h"

namespace nccl_shim {
namespace {

const char* at(const void* base, size_t block, size_t bytes) {
  return static_cast<const char*>(base) + block * bytes;
}
char* at(void* base, size_t block, size_t bytes) { return static_cast<char*>(base) + block * bytes; }

// Ends the group whatever happened: loom does not launch a group with a
// failed member, and the first error is the one to report.
loomResult_t endGroup(loomResult_t first) {
  loomResult_t r = loomGroupEnd();
  return first != loomSuccess ? first : r;
}

}  // namespace

loomResult_t composedAlltoAll(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t type,
                              size_t esz, Peers comm, loomStream_t stream) {
  size_t bytes = count * esz;
  loomResult_t first = loomGroupStart();
  for (int p = 0; p < comm.nranks && first == loomSuccess; ++p) {
    first = loomSend(at(sendbuff, size_t(p), bytes), count, type, p, comm.loom, stream);
    if (first == loomSuccess)
      first = loomRecv(at(recvbuff, size_t(p), bytes), count, type, p, comm.loom, stream);
  }
  return endGroup(first);
}

loomResult_t composedGather(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t type,
                            size_t esz, int root, Peers comm, loomStream_t stream) {
  size_t bytes = count * esz;
  loomResult_t first = loomGroupStart();
  if (comm.rank != root) {
    first = loomSend(sendbuff, count, type, root, comm.loom, stream);
    return endGroup(first);
  }
  for (int p = 0; p < comm.nranks && first == loomSuccess; ++p) {
    char* dst = at(recvbuff, size_t(p), bytes);
    if (p == root && dst == sendbuff) continue;  // in place
    if (p == root) first = loomSend(sendbuff, count, type, root, comm.loom, stream);
    if (first == loomSuccess) first = loomRecv(dst, count, type, p, comm.loom, stream);
  }
  return endGroup(first);
}

loomResult_t composedScatter(const void* sendbuff, void* recvbuff, size_t count, loomDataType_t type,
                             size_t esz, int root, Peers comm, loomStream_t stream) {
  size_t bytes = count * esz;
  loomResult_t first = loomGroupStart();
  if (comm.rank != root) {
    first = loomRecv(recvbuff, count, type, root, comm.loom, stream);
    return endGroup(first);
  }
  for (int p = 0; p < comm.nranks && first == loomSuccess; ++p) {
    const char* src = at(sendbuff, size_t(p), bytes);
    if (p == root && src == recvbuff) continue;  // in place
    first = loomSend(src, count, type, p, comm.loom, stream);
    if (first == loomSuccess && p == root) first = loomRecv(recvbuff, count, type, root, comm.loom, stream);
  }
  return endGroup(first);
}

}  // namespace nccl_shim
