// loomCommRegister's records.  A registration says "this range of memory
// will be used for operations of this communicator again and again": each
// transport that wants to prepare such memory (verbs: a memory region; UCX:
// ucp_mem_map) gets Transport::registerBuffer, and the record keeps its
// handles until loomCommDeregister.  Host transports need none: shm reads
// memory from loomMemAlloc in place whether or not it is registered (the
// allocator knows its memfd), and copies other host memory through its
// staging buffers as before.  Registration is local: no peer is told.
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
  MemoryKind kind = MemoryKind::Host;  // host, registered host (loomMemAlloc), CUDA next
  void* base = nullptr;
  size_t bytes = 0;
  bool peerMappable = false;  // inside a loomMemAlloc allocation: peers of the host map it
  std::vector<std::shared_ptr<void>> handles;  // transports' (released with the record)
};

class RegistrationTable {
 public:
  // Records [buff, buff + bytes) and returns its handle.  Throws
  // loomInvalidArgument for a range that is empty or wraps.
  void* add(void* buff, size_t bytes, const std::vector<Transport*>& transports);
  // Releases a handle add() returned; loomInvalidArgument for any other.
  void remove(void* handle);
  // The registration covering [p, p + bytes) (nullptr: none).  The record
  // stays valid until its handle is removed.
  const Registration* find(const void* p, size_t bytes) const;
  size_t size() const;
  void clear();

 private:
  mutable std::mutex mu_;
  std::map<const void*, std::unique_ptr<Registration>> regs_;  // by handle
};

}  // namespace loom
