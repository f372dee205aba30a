// loomCommRegister's records.  A registration says "this range of memory
// will be used for operations of this communicator again and again": each
// transport that wants to prepare such memory (verbs: a memory region; UCX:
// ucp_mem_map) gets Transport::registerBuffer, and the record keeps its
// handles until loomCommDeregister.  Host transports need none: shm reads
// memory from loomMemAlloc in place whether or not it is registered (the
// allocator knows its memfd), and copies other host memory through its
// staging buffers as before.  Registration is local: no peer is told.
//
// CUDA device memory registered with a CUDA communicator (a framework's
// gradient buckets, PyTorch's allocator segments through ncclCommRegister)
// records the CUDA allocation holding it: device zero-copy may then publish
// that allocation to the peers as it does loomMemAlloc's, and the
// deregistration has them unmap it (loomComm::deregisterBuffer).
#pragma once
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "src/device/memory_kind.h"
#include "transports/transport.h"

namespace loom {

struct Registration {
  MemoryKind kind = MemoryKind::Host;  // host, registered host (loomMemAlloc), CUDA device
  void* base = nullptr;
  size_t bytes = 0;
  bool peerMappable = false;  // inside a loomMemAlloc allocation: peers of the host map it
  void* allocation = nullptr;  // CUDA device memory: the base of the CUDA allocation holding it (nullptr: none known)
  std::vector<std::shared_ptr<void>> handles;  // transports' (released with the record)
};

class RegistrationTable {
 public:
  // Records [buff, buff + bytes) and returns its handle.  Host memory
  // (kind Host) is found to be a loomMemAlloc allocation's or not here;
  // CUDA device memory names the allocation holding it (nullptr: unknown).
  // Throws loomInvalidArgument for a range that is empty or wraps.
  void* add(void* buff, size_t bytes, const std::vector<Transport*>& transports, MemoryKind kind = MemoryKind::Host,
            void* allocation = nullptr);
  // Takes out the record of a handle add() returned (its transports'
  // handles go with it); loomInvalidArgument for any other handle.
  std::unique_ptr<Registration> remove(void* handle);
  // The registration covering [p, p + bytes) (nullptr: none).  The record
  // stays valid until its handle is removed.
  const Registration* find(const void* p, size_t bytes) const;
  // Whether a registration of CUDA device memory covers [p, p + bytes)
  // whole, and the base of its CUDA allocation (*allocation).
  bool findAllocation(const void* p, size_t bytes, void** allocation) const;
  // Whether any registration lies in the CUDA allocation at `allocation`.
  bool holdsAllocation(const void* allocation) const;
  size_t size() const;
  void clear();

 private:
  mutable std::mutex mu_;
  std::map<const void*, std::unique_ptr<Registration>> regs_;  // by handle
};

}  // namespace loom
