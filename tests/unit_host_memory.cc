// loomMemAlloc's memory (src/device/host_memory.h): allocations, their
// descriptions, and the import cache that maps another rank's allocation
// (here: this process's own, through /proc/<pid>/fd, as a peer would).
#include <sys/mman.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loom_catch.h"
#include <cerrno>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <string>

#include "loom.h"
#include "src/core/error.h"
#include "src/core/registration.h"
#include "src/device/host_memory.h"

namespace {

loomResult_t codeOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::Error& e) {
    return e.code();
  }
  return loomSuccess;
}

}  // namespace

// mkdir -p / rm -rf for the fake cgroup trees.
static bool loomtest_mkdirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i)
    if (i == dir.size() || dir[i] == '/') {
      std::string d = dir.substr(0, i);
      if (mkdir(d.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  return true;
}
static bool loomtest_rmtree(const std::string& dir) {
  return system(("rm -rf '" + dir + "'").c_str()) == 0;
}

TEST_CASE("loomMemAlloc: page-aligned, zeroed, described at any offset, freed once", "[registered]") {
  void* p = nullptr;
  REQUIRE(loomMemAlloc(&p, 10000) == loomSuccess);
  REQUIRE(p);
  CHECK(reinterpret_cast<uintptr_t>(p) % 4096 == 0);
  const uint8_t* b = static_cast<const uint8_t*>(p);
  bool zero = true;
  for (size_t i = 0; i < 10000; ++i) zero &= b[i] == 0;
  CHECK(zero);
  loom::PeerBuffer d;
  REQUIRE(loom::hostMemExport(b + 100, 5000, &d));
  CHECK(d.offset == 100);
  CHECK(d.bytes == 12288);  // whole pages
  CHECK(d.id != 0);
  CHECK(d.fd >= 0);
  CHECK(loom::hostMemExport(b + 12000, 288, &d));
  CHECK_FALSE(loom::hostMemExport(b + 12000, 289, &d));  // runs past the allocation
  int stack = 0;
  CHECK_FALSE(loom::hostMemExport(&stack, sizeof stack, &d));
  CHECK(loomMemFree(static_cast<uint8_t*>(p) + 64) == loomInvalidArgument);
  CHECK(std::string(loomGetLastError(nullptr)).find("inside the allocation") != std::string::npos);
  CHECK(loomMemFree(&stack) == loomInvalidArgument);
  CHECK(loomMemFree(p) == loomSuccess);
  CHECK(loomMemFree(p) == loomInvalidArgument);
  CHECK_FALSE(loom::hostMemExport(p, 1, &d));
  CHECK(loomMemAlloc(&p, 0) == loomInvalidArgument);
  CHECK(loomMemAlloc(nullptr, 64) == loomInvalidArgument);
  CHECK(loomMemFree(nullptr) == loomSuccess);
}

TEST_CASE("the import cache maps the same memory once, and drops it when the owner frees", "[registered]") {
  loom::HostImportCache cache;
  std::atomic<uint64_t> epoch{0};
  loom::hostMemWatchFrees(&epoch);
  void* p = nullptr;
  REQUIRE(loomMemAlloc(&p, 1 << 20) == loomSuccess);
  loom::PeerBuffer d;
  REQUIRE(loom::hostMemExport(static_cast<uint8_t*>(p) + 4096, 8192, &d));
  const uint8_t* m = cache.import(1, int(getpid()), d, 8192, epoch.load(), 1);
  REQUIRE(m);
  CHECK(static_cast<const void*>(m) != static_cast<uint8_t*>(p) + 4096);  // a second mapping...
  static_cast<uint8_t*>(p)[4096 + 7] = 42;
  CHECK(m[7] == 42);  // ...of the same memory
  CHECK(cache.import(1, int(getpid()), d, 8192, epoch.load(), 1) == m);  // cached
  CHECK(cache.mappings() == 1);

  // Descriptions that do not fit, or name memory that is not there.
  loom::PeerBuffer bad = d;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, d.bytes, epoch.load(), 1); }) == loomRemoteError);
  bad.offset = d.bytes + 1;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 0, epoch.load(), 1); }) == loomRemoteError);
  bad = d;
  bad.id += 12345;  // another inode behind the same descriptor
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 8, epoch.load(), 1); }) == loomRemoteError);
  bad = d;
  bad.fd = 100000;
  bad.id += 1;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 8, epoch.load(), 1); }) == loomSystemError);

  // The owner frees: the mapping still reads (no crash), and the next
  // import of that rank drops it.
  REQUIRE(loomMemFree(p) == loomSuccess);
  CHECK(epoch.load() >= 1);
  CHECK(m[7] == 42);
  void* q = nullptr;
  REQUIRE(loomMemAlloc(&q, 1 << 20) == loomSuccess);
  REQUIRE(loom::hostMemExport(q, 64, &d));
  cache.import(1, int(getpid()), d, 64, epoch.load(), 1);
  CHECK(cache.mappings() == 1);
  REQUIRE(loomMemFree(q) == loomSuccess);
  loom::hostMemUnwatchFrees(&epoch);
}

static bool mapped(const void* p) {
  unsigned char v;
  void* page = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t(4095));
  return mincore(page, 1, &v) == 0;
}

TEST_CASE("the import cache keeps what it handed to an operation mapped until the next operation", "[registered]") {
  // An all-reduce imports a peer's input, then its output: a free anywhere
  // in that peer meanwhile (another thread's), or its 64th buffer, used to
  // unmap the input under the operation (wrong data, then SIGSEGV).
  loom::HostImportCache cache;
  std::atomic<uint64_t> epoch{0};
  loom::hostMemWatchFrees(&epoch);
  std::vector<void*> bufs(70, nullptr);
  std::vector<loom::PeerBuffer> d(bufs.size());
  for (size_t i = 0; i < bufs.size(); ++i) {
    REQUIRE(loomMemAlloc(&bufs[i], 4096) == loomSuccess);
    static_cast<uint8_t*>(bufs[i])[5] = uint8_t(i);
    REQUIRE(loom::hostMemExport(bufs[i], 4096, &d[i]));
  }
  // Operation 7: the epoch moves between two imports.
  const uint8_t* in = cache.import(1, int(getpid()), d[0], 4096, epoch.load(), 7);
  void* other = nullptr;
  REQUIRE(loomMemAlloc(&other, 4096) == loomSuccess);
  REQUIRE(loomMemFree(other) == loomSuccess);
  const uint8_t* out = cache.import(1, int(getpid()), d[1], 4096, epoch.load(), 7);
  CHECK(mapped(in));
  CHECK(in[5] == 0);
  CHECK(out[5] == 1);
  // Operation 8 may unmap it (it left the cache: a new buffer may reuse its inode).
  cache.import(1, int(getpid()), d[1], 4096, epoch.load(), 8);
  CHECK_FALSE(mapped(in));
  // Operation 9 maps 70 buffers of one rank: past 64 the cache evicts, but
  // every address handed to operation 9 still reads.
  std::vector<const uint8_t*> got;
  for (size_t i = 0; i < bufs.size(); ++i) got.push_back(cache.import(1, int(getpid()), d[i], 4096, epoch.load(), 9));
  size_t readable = 0;
  for (size_t i = 0; i < got.size(); ++i) readable += mapped(got[i]) && got[i][5] == uint8_t(i);
  CHECK(readable == bufs.size());
  CHECK(cache.mappings() <= 64);
  cache.import(1, int(getpid()), d[0], 4096, epoch.load(), 10);
  size_t still = 0;
  for (const uint8_t* g : got) still += mapped(g);
  CHECK(still <= 64);  // what operation 9's evictions retired is gone
  for (void* b : bufs) REQUIRE(loomMemFree(b) == loomSuccess);
  loom::hostMemUnwatchFrees(&epoch);
}

TEST_CASE("loomMemAlloc of more than the process may fault in is loomSystemError, not the OOM killer",
          "[registered]") {
  // It faults every page in at once: past what the memory cgroup allows,
  // the kernel's OOM killer ended the process inside the call.  A child in
  // a cgroup of 256 MiB asks for 512 MiB (and 16 MiB, which fits).  Needs a
  // memory cgroup this process may create (root, cgroup v1 or v2).
  std::string dir, limitFile;
  for (const char* base : {"/sys/fs/cgroup/memory", "/sys/fs/cgroup"}) {
    std::string d = std::string(base) + "/loom-test-" + std::to_string(getpid());
    const std::string lf = std::string(base) == "/sys/fs/cgroup" ? "memory.max" : "memory.limit_in_bytes";
    if (mkdir(d.c_str(), 0755) != 0) continue;
    FILE* f = fopen((d + "/" + lf).c_str(), "w");
    if (f && fprintf(f, "%d\n", 256 << 20) > 0 && fclose(f) == 0) {
      dir = d, limitFile = lf;
      break;
    }
    if (f) fclose(f);
    rmdir(d.c_str());
  }
  if (dir.empty()) {
    WARN("no memory cgroup could be made here: this case checks nothing");
    return;
  }
  int pipefd[2];
  REQUIRE(pipe(pipefd) == 0);
  pid_t pid = fork();
  if (pid == 0) {
    close(pipefd[0]);
    FILE* f = fopen((dir + "/cgroup.procs").c_str(), "w");
    if (!f || fprintf(f, "%d\n", int(getpid())) <= 0 || fclose(f) != 0) _exit(3);
    void* p = nullptr;
    int codes[2];
    codes[0] = loomMemAlloc(&p, size_t(512) << 20);
    void* q = nullptr;
    codes[1] = loomMemAlloc(&q, size_t(16) << 20);
    if (q) loomMemFree(q);
    if (write(pipefd[1], codes, sizeof codes) != sizeof codes) _exit(4);
    _exit(0);
  }
  close(pipefd[1]);
  int codes[2] = {-1, -1};
  const ssize_t got = read(pipefd[0], codes, sizeof codes);
  close(pipefd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  rmdir(dir.c_str());
  INFO("child status " << st);
  REQUIRE(got == ssize_t(sizeof codes));
  CHECK(codes[0] == loomSystemError);
  CHECK(codes[1] == loomSuccess);
}

TEST_CASE("a registration handle released once cannot release a later registration", "[registered]") {
  // Handles were the records' addresses: the heap handed the next record the
  // same one, so deregistering a stale handle released someone else's.
  loom::RegistrationTable table;
  std::vector<char> buf(4096);
  void* first = table.add(buf.data(), buf.size(), {});
  table.remove(first);
  void* second = table.add(buf.data(), buf.size(), {});
  CHECK(second != first);
  CHECK(codeOf([&] { table.remove(first); }) == loomInvalidArgument);
  CHECK(table.size() == 1);
  table.remove(second);
  CHECK(table.size() == 0);
}

namespace {
void writeFile(const std::string& path, const std::string& text) {
  std::string dir = path.substr(0, path.rfind('/'));
  REQUIRE(loomtest_mkdirs(dir));
  FILE* f = fopen(path.c_str(), "w");
  REQUIRE(f);
  fputs(text.c_str(), f);
  fclose(f);
}
}  // namespace

TEST_CASE("the memory cgroup room loomMemAlloc checks: v1, v2, hybrid, ancestors, page cache", "[registered]") {
  char tmpl[] = "/tmp/loom-cgroup-XXXXXX";
  REQUIRE(mkdtemp(tmpl));
  const std::string root = tmpl;
  // v1, a leaf missing its files (its parent limits), page cache left out:
  // a: limit 1000000, usage 900000 of which 500000 inactive file -> 600000;
  // its parent p: limit 800000, usage 100000 -> 700000.
  writeFile(root + "/v1/memory/p/memory.limit_in_bytes", "800000\n");
  writeFile(root + "/v1/memory/p/memory.usage_in_bytes", "100000\n");
  writeFile(root + "/v1/memory/p/a/memory.limit_in_bytes", "1000000\n");
  writeFile(root + "/v1/memory/p/a/memory.usage_in_bytes", "900000\n");
  writeFile(root + "/v1/memory/p/a/memory.stat", "cache 600000\ntotal_inactive_file 500000\n");
  writeFile(root + "/v1/memory/memory.limit_in_bytes", "9223372036854771712\n");
  writeFile(root + "/v1/memory/memory.usage_in_bytes", "5000000000\n");
  writeFile(root + "/v1.cgroup", "4:memory:/p/a/gone\n3:cpu:/x\n0::/\n");
  CHECK(loom::cgroupMemoryRoom(root + "/v1.cgroup", root + "/v1") == 600000);
  // v2: "max" does not limit; inactive_file is left out of memory.current.
  writeFile(root + "/v2/cgroup.controllers", "cpu memory\n");
  writeFile(root + "/v2/c/memory.max", "max\n");
  writeFile(root + "/v2/c/memory.current", "7000000\n");
  writeFile(root + "/v2/c/d/memory.max", "2000000\n");
  writeFile(root + "/v2/c/d/memory.current", "1500000\n");
  writeFile(root + "/v2/c/d/memory.stat", "anon 500000\ninactive_file 1000000\n");
  writeFile(root + "/v2.cgroup", "0::/c/d\n");
  CHECK(loom::cgroupMemoryRoom(root + "/v2.cgroup", root + "/v2") == 1500000);
  // Over the limit: no room.
  writeFile(root + "/v2/c/d/memory.current", "2500000\n");
  writeFile(root + "/v2/c/d/memory.stat", "inactive_file 0\n");
  CHECK(loom::cgroupMemoryRoom(root + "/v2.cgroup", root + "/v2") == 0);
  // Hybrid: v2 mounted at unified without a memory controller: v1 decides.
  writeFile(root + "/hy/memory/j/memory.limit_in_bytes", "300000\n");
  writeFile(root + "/hy/memory/j/memory.usage_in_bytes", "100000\n");
  writeFile(root + "/hy/unified/cgroup.procs", "\n");
  writeFile(root + "/hy.cgroup", "9:name=systemd:/\n4:memory:/j\n0::/\n");
  CHECK(loom::cgroupMemoryRoom(root + "/hy.cgroup", root + "/hy") == 200000);
  // No memory cgroup at all, or no file: no limit.
  writeFile(root + "/none.cgroup", "1:cpu:/\n");
  CHECK(loom::cgroupMemoryRoom(root + "/none.cgroup", root + "/v1") == UINT64_MAX);
  CHECK(loom::cgroupMemoryRoom(root + "/missing", root + "/v1") == UINT64_MAX);
  CHECK(loomtest_rmtree(root));
}

TEST_CASE("a forked child's loomMemFree does not move its parent's free epochs", "[registered]") {
  // The watchers point into the parent's shared windows (modelled here by a
  // shared page, as shm's inboxes): the child drops them.
  void* page = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  REQUIRE(page != MAP_FAILED);
  auto* epoch = new (page) std::atomic<uint64_t>(0);
  loom::hostMemWatchFrees(epoch);
  void* p = nullptr;
  REQUIRE(loomMemAlloc(&p, 4096) == loomSuccess);
  pid_t pid = fork();
  if (pid == 0) {
    void* q = nullptr;
    const bool ok = loomMemFree(p) == loomSuccess && loomMemAlloc(&q, 4096) == loomSuccess && loomMemFree(q) == loomSuccess;
    _exit(ok ? 0 : 1);
  }
  int st = 0;
  REQUIRE(waitpid(pid, &st, 0) == pid);
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
  CHECK(epoch->load() == 0);
  REQUIRE(loomMemFree(p) == loomSuccess);
  CHECK(epoch->load() == 1);  // the parent's own free still counts
  loom::hostMemUnwatchFrees(epoch);
  munmap(page, 4096);
}

TEST_CASE("shared scratch: loomMemAlloc memory that grows by half again, is reused, and shrinks only after many "
          "small calls in a row",
          "[registered]") {
  loom::SharedScratch s;
  CHECK(s.bytes() == 0);
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  uint8_t* a = s.get(100);
  REQUIRE(a != nullptr);
  CHECK(s.bytes() == page);
  loom::PeerBuffer pb;
  CHECK(loom::hostMemExport(a, 100, &pb));  // peers can map it
  CHECK(s.get(page) == a);                  // fits: the same memory
  uint8_t* big = s.get(size_t(32) << 20);
  CHECK(s.bytes() == size_t(32) << 20);
  CHECK(loom::hostMemExport(big, size_t(32) << 20, &pb));
  const bool inside = a >= big && a < big + (size_t(32) << 20);  // the new block may cover the freed page
  if (!inside) CHECK(!loom::hostMemExport(a, 100, &pb));          // the old one was freed
  s.get((size_t(32) << 20) + 1);  // creeping up: grows by half again, not to the byte
  CHECK(s.bytes() == size_t(48) << 20);
  uint8_t* now = s.get(size_t(1) << 20);
  // Sizes that vary from call to call (a quarter and less, then more) keep it.
  for (int i = 0; i < 40; ++i) CHECK(s.get(i % 4 ? size_t(1) << 20 : size_t(20) << 20) == now);
  CHECK(s.bytes() == size_t(48) << 20);
  // kShrinkAfter small calls in a row: shrunk to what the last asked.
  s.get(size_t(20) << 20);
  for (int i = 1; i < loom::SharedScratch::kShrinkAfter; ++i) s.get(size_t(1) << 20);
  CHECK(s.bytes() == size_t(48) << 20);
  s.get(size_t(1) << 20);
  CHECK(s.bytes() == size_t(1) << 20);
  // Below 16 MiB it is kept, however small the calls.
  for (int i = 0; i < 3 * loom::SharedScratch::kShrinkAfter; ++i) s.get(4096);
  CHECK(s.bytes() == size_t(1) << 20);
}
