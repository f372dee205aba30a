// Host memory that the other ranks of a host can map (loomMemAlloc), and
// the mappings of other ranks' such memory (the import cache).
//
// An allocation is a memfd, sized to whole pages, placed on the caller's
// NUMA node and pre-faulted, mapped once in the owner.  A peer maps it by
// opening /proc/<owner pid>/fd/<fd> (the inbox's mechanism, so it works
// wherever shm does) and keeps the mapping in its import cache, keyed by
// (rank, inode): a freed and reallocated buffer has a new inode, so a stale
// mapping is never used for new memory.  A mapping keeps the pages alive, so
// an owner freeing a buffer a peer has mapped costs the peer nothing but the
// memory until it drops the mapping; owners bump a free epoch that peers
// read (shm: in the inbox header) to drop their mappings of that rank.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom {

// A buffer of one rank that its peers may read in place, as it travels in a
// PeerMemory window (fixed size, no pointers that mean something only in
// the owner, except `addr` for in-process PeerMemory).
struct PeerBuffer {
  uint64_t id = 0;      // the memory object's identity (memfd: its inode); 0: none
  uint64_t bytes = 0;   // size of the memory object
  uint64_t offset = 0;  // where the buffer starts in it
  uint64_t addr = 0;    // the buffer's address in the owner
  int32_t fd = -1;      // the memfd's descriptor number in the owner
  uint32_t kind = 0;    // MemoryKind of the memory
  uint64_t reserved = 0;
};
static_assert(sizeof(PeerBuffer) <= 64, "a PeerBuffer fits one cache line of a window");

// loomMemAlloc / loomMemFree: throw loom::Error (loomInvalidArgument for a
// pointer that is not an allocation's start, loomSystemError when the OS
// refuses).
void* hostMemAlloc(size_t bytes);
void hostMemFree(void* ptr);

// Describes [ptr, ptr + bytes) when it lies inside one live allocation of
// this process (false: ordinary memory, which peers cannot map).
bool hostMemExport(const void* ptr, size_t bytes, PeerBuffer* out);

// The allocation holding `ptr` (base and size), for registrations.
bool hostMemFind(const void* ptr, void** base, size_t* bytes);

// Words in shared memory that hostMemFree increments (shm: each inbox's
// free epoch), so that peers learn to drop their mappings of this rank.
void hostMemWatchFrees(std::atomic<uint64_t>* epoch);
void hostMemUnwatchFrees(std::atomic<uint64_t>* epoch);

// Scratch space from hostMemAlloc, grown on demand and kept (a
// communicator's copy of in-place all-to-alls' inputs: the peers can map
// it, so the zero-copy paths still apply to those calls).  get() is called
// by one thread at a time; bytes() may be read from any (loomCommDump).
class SharedScratch {
 public:
  SharedScratch() = default;
  SharedScratch(const SharedScratch&) = delete;
  SharedScratch& operator=(const SharedScratch&) = delete;
  ~SharedScratch();
  // At least `bytes` (> 0); what it held is lost when it is reallocated.
  // It grows to at least 1.5 times its size (so sizes that creep up do not
  // reallocate every call), and shrinks to what is asked only when it holds
  // 16 MiB or more and kShrinkAfter calls in a row asked for less than a
  // quarter of it (sizes that vary from call to call keep it).  Each
  // reallocation frees the old memory, and a free makes the peers drop
  // their mappings of this process's loomMemAlloc memory.  Throws as
  // hostMemAlloc.
  uint8_t* get(size_t bytes);
  size_t bytes() const { return bytes_.load(std::memory_order_relaxed); }
  static constexpr int kShrinkAfter = 16;

 private:
  void* p_ = nullptr;
  std::atomic<size_t> bytes_{0};
  int small_ = 0;  // calls in a row that asked for less than a quarter
};

// The room the memory cgroups named in `procCgroupFile` (/proc/self/cgroup)
// leave, under `sysfsRoot` (/sys/fs/cgroup; v1, v2 or both): for each and
// its ancestors, limit - (usage - inactive file pages); UINT64_MAX where
// none limits.  loomMemAlloc refuses more than this or MemAvailable.
uint64_t cgroupMemoryRoom(const std::string& procCgroupFile, const std::string& sysfsRoot);

// One communicator's mappings of its peers' allocations.  Not thread-safe:
// a communicator runs one operation at a time.
class HostImportCache {
 public:
  ~HostImportCache();
  // The address of rank r's buffer `b` (owner process `pid`) mapped here,
  // with at least `need` bytes from its start inside the mapping, for
  // operation `op`.  `epoch` is rank r's free epoch now: when it moved, r's
  // older mappings leave the cache (a new buffer may reuse an inode).  A
  // mapping handed to operation `op` stays mapped until the first import
  // for another operation, even when it leaves the cache meanwhile (the
  // epoch moving between an operation's imports, the cap on mappings).
  // Throws loomSystemError if the memory cannot be mapped, loomRemoteError
  // for a description that does not fit the memory it names.
  const uint8_t* import(int r, int pid, const PeerBuffer& b, size_t need, uint64_t epoch, uint64_t op);
  // Unmaps everything of rank r (everything: r < 0).
  void drop(int r);
  size_t mappings() const { return maps_.size(); }

 private:
  struct Mapping {
    uint8_t* base;
    size_t bytes;
    uint64_t op;  // the last operation it was handed to
  };
  // Takes rank r's mappings (everything: r < 0) out of the cache: unmapped,
  // or retired while the current operation may still use them.
  void evict(int r);
  void evictOne(std::map<std::pair<int, uint64_t>, Mapping>::iterator it);
  std::map<std::pair<int, uint64_t>, Mapping> maps_;  // (rank, id)
  std::map<int, uint64_t> epochs_;                    // per rank: epoch of its mappings
  std::vector<Mapping> retired_;                      // out of the cache, handed to operation op_
  uint64_t op_ = ~uint64_t(0);                        // the operation of the latest import
};

}  // namespace loom
