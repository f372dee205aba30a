// loomMemAlloc's memory (src/device/host_memory.h): allocations, their
// descriptions, and the import cache that maps another rank's allocation
// (here: this process's own, through /proc/<pid>/fd, as a peer would).
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <functional>
#include <string>

#include "loom.h"
#include "src/core/error.h"
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
  const uint8_t* m = cache.import(1, int(getpid()), d, 8192, epoch.load());
  REQUIRE(m);
  CHECK(static_cast<const void*>(m) != static_cast<uint8_t*>(p) + 4096);  // a second mapping...
  static_cast<uint8_t*>(p)[4096 + 7] = 42;
  CHECK(m[7] == 42);  // ...of the same memory
  CHECK(cache.import(1, int(getpid()), d, 8192, epoch.load()) == m);  // cached
  CHECK(cache.mappings() == 1);

  // Descriptions that do not fit, or name memory that is not there.
  loom::PeerBuffer bad = d;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, d.bytes, epoch.load()); }) == loomRemoteError);
  bad.offset = d.bytes + 1;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 0, epoch.load()); }) == loomRemoteError);
  bad = d;
  bad.id += 12345;  // another inode behind the same descriptor
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 8, epoch.load()); }) == loomRemoteError);
  bad = d;
  bad.fd = 100000;
  bad.id += 1;
  CHECK(codeOf([&] { cache.import(1, int(getpid()), bad, 8, epoch.load()); }) == loomSystemError);

  // The owner frees: the mapping still reads (no crash), and the next
  // import of that rank drops it.
  REQUIRE(loomMemFree(p) == loomSuccess);
  CHECK(epoch.load() >= 1);
  CHECK(m[7] == 42);
  void* q = nullptr;
  REQUIRE(loomMemAlloc(&q, 1 << 20) == loomSuccess);
  REQUIRE(loom::hostMemExport(q, 64, &d));
  cache.import(1, int(getpid()), d, 64, epoch.load());
  CHECK(cache.mappings() == 1);
  REQUIRE(loomMemFree(q) == loomSuccess);
  loom::hostMemUnwatchFrees(&epoch);
}
