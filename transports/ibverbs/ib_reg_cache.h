// The registration cache of the ibverbs transport: which memory regions
// cover which user memory, so that a rendezvous (ib_connection.cc) finds
// the MR of a buffer instead of registering it for every transfer.  The
// logic is here without libibverbs (a Registrar does the registering), so
// that host tests check it without an RDMA device.
//
// Entries are sorted by start address; a lookup returns one that covers the
// whole range with at least the access wanted.  Three kinds of entry, by how
// the cache learns that the memory went away:
//  - Pinned: loomCommRegister's (Transport::registerBuffer).  The user says
//    when it ends (loomCommDeregister: unpin()); never evicted.
//  - Coherent: registered with on-demand paging (IBV_ACCESS_ON_DEMAND): the
//    kernel follows the process's page tables (MMU notifiers), so a freed
//    and reused address is served by its new pages.  Kept while unused,
//    least recently used dropped first past the byte or entry limit.
//  - Transient: any other memory on a device without on-demand paging
//    (rxe).  Nothing tells the cache when such memory is freed or unmapped,
//    and an MR pins the old pages (a later transfer would land in memory
//    nobody sees any more), so the entry lives only while an operation uses
//    it: registered on acquire, deregistered at the last release.
// invalidate(range) drops every entry overlapping it (loomMemFree-style
// notices); an entry still in use is deregistered at its last release.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>

namespace loom {

// Registers and deregisters memory (ibverbs: ibv_reg_mr / ibv_dereg_mr).
class Registrar {
 public:
  virtual ~Registrar() = default;
  // Registers [addr, addr + bytes) with `access` (Registrar-defined bits);
  // returns an opaque handle, or throws loom::Error.
  virtual void* reg(uintptr_t addr, size_t bytes, unsigned access, bool onDemand) = 0;
  virtual void dereg(void* handle) = 0;
  // Whether registrations follow the page tables (on-demand paging).
  virtual bool onDemand() const { return false; }
};

struct RegCacheLimits {
  size_t maxBytes = size_t(1) << 30;  // unused coherent entries kept
  size_t maxEntries = 256;
};

class RegCache {
 public:
  enum class Kind { Pinned, Coherent, Transient };
  struct Entry {
    uintptr_t start = 0;
    size_t bytes = 0;
    unsigned access = 0;
    Kind kind = Kind::Transient;
    void* handle = nullptr;  // the Registrar's
    int refs = 0;
    bool valid = true;  // false: invalidated or unpinned; dropped at the last release
    std::list<Entry*>::iterator lru;  // position in lru_ while unused and cached
  };

  RegCache(Registrar& r, RegCacheLimits limits, size_t page = 4096) : reg_(r), limits_(limits), page_(page) {}
  ~RegCache();
  RegCache(const RegCache&) = delete;
  RegCache& operator=(const RegCache&) = delete;

  // An entry covering [addr, addr + bytes) with at least `access`,
  // registering one (page-aligned) if none does; holds a reference until
  // release().  Throws what the Registrar throws.
  Entry* acquire(const void* addr, size_t bytes, unsigned access);
  void release(Entry* e);
  // loomCommRegister: registers the range once as a pinned entry (nullptr
  // if it cannot be registered with any access).  The caller unpins it.
  Entry* pin(const void* addr, size_t bytes, unsigned access, unsigned fallbackAccess);
  void unpin(Entry* e);
  // Drops every entry overlapping [addr, addr + bytes).
  void invalidate(const void* addr, size_t bytes);

  // For tests and loomCommDump-style notes.
  size_t entries() const;
  size_t cachedBytes() const;  // unused coherent entries
  size_t registrations() const { return registrations_; }

 private:
  Entry* findLocked(uintptr_t a, uintptr_t end, unsigned access);
  Entry* insertLocked(uintptr_t start, size_t bytes, unsigned access, Kind kind);
  void dropLocked(Entry* e);  // out of the index; deregistered now if unused
  void destroyLocked(Entry* e);
  void evictLocked();

  Registrar& reg_;
  RegCacheLimits limits_;
  size_t page_;
  mutable std::mutex mu_;
  std::multimap<uintptr_t, std::unique_ptr<Entry>> byStart_;
  size_t maxEntryBytes_ = 0;  // bounds the backward scan of a lookup
  std::list<Entry*> lru_;     // unused coherent entries, most recent first
  size_t lruBytes_ = 0;
  std::map<Entry*, std::unique_ptr<Entry>> dropped_;  // invalid but in use
  size_t registrations_ = 0;
};

}  // namespace loom
