#include "src/device/host_memory.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/memory_kind.h"
#include "src/topology/numa.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace loom {

namespace {

struct Allocation {
  size_t bytes;  // mapped (whole pages)
  int fd;
  uint64_t ino;
};

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, Allocation> allocs;  // by base address
  std::vector<std::atomic<uint64_t>*> watchers;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: frees may run at exit
  return *r;
}

// fork: the registry is consistent in the child (its lock is held across
// the fork), and the child drops the free watchers, which point into its
// parent's communicators' shared windows: a child's loomMemFree would move
// the parent's free epochs and make the parent's peers map everything anew.
void forkPrepare() { registry().mu.lock(); }
void forkParent() { registry().mu.unlock(); }
void forkChild() {
  registry().watchers.clear();
  registry().mu.unlock();
}
const int gForkHandlers = pthread_atfork(forkPrepare, forkParent, forkChild);

size_t pageBytes() {
  static const size_t p = size_t(sysconf(_SC_PAGESIZE));
  return p;
}

// The allocation containing [p, p + bytes), under the registry's lock.
const std::pair<const uintptr_t, Allocation>* findLocked(Registry& reg, const void* ptr, size_t bytes) {
  uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto it = reg.allocs.upper_bound(p);
  if (it == reg.allocs.begin()) return nullptr;
  --it;
  if (p - it->first >= it->second.bytes || bytes > it->second.bytes - (p - it->first)) return nullptr;
  return &*it;
}

uint64_t readNumber(const std::string& path) {  // UINT64_MAX: missing, or "max"
  FILE* f = fopen(path.c_str(), "re");
  if (!f) return UINT64_MAX;
  unsigned long long v = 0;
  const bool ok = fscanf(f, "%llu", &v) == 1;
  fclose(f);
  return ok ? uint64_t(v) : UINT64_MAX;
}

// A "key value" line of a cgroup's memory.stat (0: missing).
uint64_t statField(const std::string& path, const char* key) {
  FILE* f = fopen(path.c_str(), "re");
  if (!f) return 0;
  char name[128];
  unsigned long long v;
  uint64_t found = 0;
  while (fscanf(f, "%127s %llu", name, &v) == 2)
    if (strcmp(name, key) == 0) found = uint64_t(v);
  fclose(f);
  return found;
}

}  // namespace

uint64_t cgroupMemoryRoom(const std::string& procCgroupFile, const std::string& sysfsRoot) {
  uint64_t room = UINT64_MAX;
  FILE* f = fopen(procCgroupFile.c_str(), "re");
  if (!f) return room;
  char line[4096];
  while (fgets(line, sizeof line, f)) {
    std::string l(line);
    if (!l.empty() && l.back() == '\n') l.pop_back();
    size_t a = l.find(':'), b = a == std::string::npos ? a : l.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = "," + l.substr(a + 1, b - a - 1) + ",", path = l.substr(b + 1);
    // Usage counts the page cache, which the kernel reclaims before it
    // refuses: the inactive file pages are left out (the working set).
    std::string base, limitFile, usageFile, inactiveKey;
    if (controllers.find(",memory,") != std::string::npos) {
      base = sysfsRoot + "/memory", limitFile = "memory.limit_in_bytes", usageFile = "memory.usage_in_bytes",
      inactiveKey = "total_inactive_file";
    } else if (controllers == ",," && l.compare(0, 2, "0:") == 0) {
      base = access((sysfsRoot + "/cgroup.controllers").c_str(), F_OK) == 0 ? sysfsRoot : sysfsRoot + "/unified";
      limitFile = "memory.max", usageFile = "memory.current", inactiveKey = "inactive_file";
    } else {
      continue;
    }
    for (std::string dir = base + (path == "/" ? "" : path);;) {
      const uint64_t limit = readNumber(dir + "/" + limitFile), usage = readNumber(dir + "/" + usageFile);
      if (limit != UINT64_MAX && usage != UINT64_MAX) {
        const uint64_t inactive = statField(dir + "/memory.stat", inactiveKey.c_str());
        const uint64_t used = usage > inactive ? usage - inactive : 0;
        room = std::min(room, limit > used ? limit - used : 0);
      }
      if (dir.size() <= base.size()) break;
      dir.erase(dir.rfind('/'));
    }
  }
  fclose(f);
  return room;
}

namespace {

// Memory a loomMemAlloc may fault in: MemAvailable, and the room its cgroups
// leave.  Past it the kernel would not fail the call: its OOM killer would
// end this process (or another).
uint64_t memoryForAlloc() {
  uint64_t avail = UINT64_MAX;
  if (FILE* f = fopen("/proc/meminfo", "re")) {
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f))
      if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) avail = uint64_t(kb) * 1024;
    fclose(f);
  }
  return std::min(avail, cgroupMemoryRoom("/proc/self/cgroup", "/sys/fs/cgroup"));
}

}  // namespace

void* hostMemAlloc(size_t bytes) {
  (void)gForkHandlers;
  if (bytes == 0) fail(loomInvalidArgument, "size is 0");
  const size_t page = pageBytes();
  if (bytes > (size_t(1) << 46)) fail(loomInvalidArgument, "size %zu is larger than any host memory", bytes);
  size_t len = (bytes + page - 1) / page * page;
  const uint64_t room = memoryForAlloc();
  if (len > room)
    fail(loomSystemError,
         "cannot allocate %zu bytes: only %llu are free for this process (MemAvailable, and what its memory cgroups "
         "allow), and loomMemAlloc faults every page in at once",
         bytes, (unsigned long long)room);
  int fd = int(syscall(SYS_memfd_create, "loom-mem", unsigned(MFD_CLOEXEC)));
  if (fd < 0) failErrno("memfd_create");
  fchmod(fd, 0600);
  struct stat st;
  if (ftruncate(fd, off_t(len)) != 0 || fstat(fd, &st) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    failErrno("ftruncate(loomMemAlloc)");
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    errno = e;
    failErrno("mmap(loomMemAlloc)");
  }
  // Place it on this thread's NUMA node, then fault every page in there, so
  // that neither the first operation nor a peer's first touch pays for it.
  std::string where = bindToLocalNumaNode(p, len);
  if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
    volatile uint8_t* b = static_cast<uint8_t*>(p);
    for (size_t off = 0; off < len; off += page) b[off] = 0;
  }
  LOOM_INFO("MEM", "loomMemAlloc: %zu bytes at %p (memfd %d, inode %llu): %s", len, p, fd,
             (unsigned long long)st.st_ino, where.c_str());
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.allocs[reinterpret_cast<uintptr_t>(p)] = Allocation{len, fd, uint64_t(st.st_ino)};
  return p;
}

void hostMemFree(void* ptr) {
  Registry& reg = registry();
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.allocs.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == reg.allocs.end()) {
      const auto* in = findLocked(reg, ptr, 1);
      if (in)
        fail(loomInvalidArgument, "%p lies inside the allocation at %p: pass the pointer loomMemAlloc returned",
             ptr, reinterpret_cast<void*>(in->first));
      fail(loomInvalidArgument, "%p is not memory from loomMemAlloc (or was freed already)", ptr);
    }
    a = it->second;
    reg.allocs.erase(it);
    // Peers drop their mappings of this rank's memory when they next look.
    for (std::atomic<uint64_t>* w : reg.watchers) w->fetch_add(1, std::memory_order_release);
  }
  munmap(ptr, a.bytes);
  close(a.fd);
}

SharedScratch::~SharedScratch() {
  if (p_) hostMemFree(p_);
}

uint8_t* SharedScratch::get(size_t bytes) {
  const size_t have = bytes_.load(std::memory_order_relaxed);
  const bool little = have >= (size_t(16) << 20) && bytes < have / 4;
  small_ = little ? small_ + 1 : 0;
  if (p_ && bytes <= have && small_ < kShrinkAfter) return static_cast<uint8_t*>(p_);
  small_ = 0;
  const size_t want = bytes > have ? std::max(bytes, have + have / 2) : bytes;
  if (p_) hostMemFree(p_);  // peers drop their mappings of it when they next look
  p_ = nullptr;
  bytes_.store(0, std::memory_order_relaxed);
  const size_t page = pageBytes();
  const size_t size = (want + page - 1) / page * page;
  p_ = hostMemAlloc(size);
  bytes_.store(size, std::memory_order_relaxed);
  return static_cast<uint8_t*>(p_);
}

bool hostMemExport(const void* ptr, size_t bytes, PeerBuffer* out) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const auto* a = findLocked(reg, ptr, bytes);
  if (!a) return false;
  *out = PeerBuffer{};
  out->id = a->second.ino;
  out->bytes = a->second.bytes;
  out->offset = reinterpret_cast<uintptr_t>(ptr) - a->first;
  out->addr = reinterpret_cast<uintptr_t>(ptr);
  out->fd = a->second.fd;
  out->kind = uint32_t(MemoryKind::RegisteredHost);
  return true;
}

bool hostMemFind(const void* ptr, void** base, size_t* bytes) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const auto* a = findLocked(reg, ptr, 1);
  if (!a) return false;
  *base = reinterpret_cast<void*>(a->first);
  *bytes = a->second.bytes;
  return true;
}

void hostMemWatchFrees(std::atomic<uint64_t>* epoch) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.watchers.push_back(epoch);
}

void hostMemUnwatchFrees(std::atomic<uint64_t>* epoch) {
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.watchers.erase(std::remove(reg.watchers.begin(), reg.watchers.end(), epoch), reg.watchers.end());
}

// ---- the import cache ----

HostImportCache::~HostImportCache() { drop(-1); }

void HostImportCache::drop(int r) {
  for (auto it = maps_.begin(); it != maps_.end();) {
    if (r >= 0 && it->first.first != r) {
      ++it;
      continue;
    }
    munmap(it->second.base, it->second.bytes);
    it = maps_.erase(it);
  }
  if (r < 0) {
    for (const Mapping& m : retired_) munmap(m.base, m.bytes);
    retired_.clear();
  }
}

void HostImportCache::evictOne(std::map<std::pair<int, uint64_t>, Mapping>::iterator it) {
  if (it->second.op == op_) retired_.push_back(it->second);  // handed to this operation: it may still read it
  else munmap(it->second.base, it->second.bytes);
  maps_.erase(it);
}

void HostImportCache::evict(int r) {
  for (auto it = maps_.begin(); it != maps_.end();) {
    auto next = std::next(it);
    if (r < 0 || it->first.first == r) evictOne(it);
    it = next;
  }
}

const uint8_t* HostImportCache::import(int r, int pid, const PeerBuffer& b, size_t need, uint64_t epoch, uint64_t op) {
  if (b.id == 0 || b.fd < 0 || b.bytes == 0 || b.offset > b.bytes || need > b.bytes - b.offset)
    fail(loomRemoteError, "rank %d described a shared buffer that does not fit its memory (%llu + %zu of %llu bytes)",
         r, (unsigned long long)b.offset, need, (unsigned long long)b.bytes);
  if (op != op_) {  // the previous operation is over: nothing reads what it retired
    for (const Mapping& m : retired_) munmap(m.base, m.bytes);
    retired_.clear();
    op_ = op;
  }
  auto ep = epochs_.find(r);
  if (ep == epochs_.end()) {
    epochs_[r] = epoch;
  } else if (ep->second != epoch) {
    evict(r);  // it freed memory since: some mappings may be of freed buffers
    ep->second = epoch;
  }
  auto key = std::make_pair(r, b.id);
  auto it = maps_.find(key);
  if (it != maps_.end() && it->second.bytes >= b.bytes) {
    it->second.op = op;
    return it->second.base + b.offset;
  }
  if (it != maps_.end()) evictOne(it);
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, b.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) fail(loomSystemError, "cannot open rank %d's registered buffer %s: %s", r, path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0 || uint64_t(st.st_ino) != b.id || uint64_t(st.st_size) < b.bytes) {
    close(fd);
    fail(loomRemoteError,
         "rank %d's registered buffer (memfd %d, inode %llu) is gone: was it freed while an operation used it?", r,
         b.fd, (unsigned long long)b.id);
  }
  // Populated: the owner faulted the pages in, so this only fills page
  // tables, once, rather than faulting page by page in the first operation.
  void* p = mmap(nullptr, b.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int e = errno;
  close(fd);  // the mapping keeps the memory
  if (p == MAP_FAILED) fail(loomSystemError, "cannot map rank %d's registered buffer: %s", r, strerror(e));
  // Bounded: a rank cycling through buffers must not pile up mappings.
  size_t mine = 0;
  for (const auto& m : maps_) mine += m.first.first == r;
  if (mine >= 64) evict(r);
  maps_[key] = Mapping{static_cast<uint8_t*>(p), size_t(b.bytes), op};
  return static_cast<uint8_t*>(p) + b.offset;
}

}  // namespace loom
