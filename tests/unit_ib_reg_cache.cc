// The ibverbs registration cache's bookkeeping (transports/ibverbs/ib_reg_cache.h)
// without an RDMA device: a Registrar that records what it registered stands
// in for ibv_reg_mr, so lookups, overlaps, reference counts, eviction and
// invalidation are checked here; the MRs themselves are checked over
// Soft-RoCE (tests/vm/ibverbs_vm_test.sh rendezvous).
#ifdef LOOM_HAVE_IBVERBS
#include "loom_catch.h"

#include <map>
#include <set>

#include "src/core/error.h"
#include "transports/ibverbs/ib_reg_cache.h"

namespace {

constexpr unsigned kWrite = 1;

struct Reg {
  uintptr_t addr;
  size_t bytes;
  unsigned access;
  bool onDemand;
};

class RecordingRegistrar : public loom::Registrar {
 public:
  explicit RecordingRegistrar(bool odp) : odp_(odp) {}
  void* reg(uintptr_t addr, size_t bytes, unsigned access, bool onDemand) override {
    if ((access & kWrite) && addr >= readOnlyFrom_) loom::fail(loomSystemError, "read-only memory");
    auto* r = new Reg{addr, bytes, access, onDemand};
    live_.insert(r);
    return r;
  }
  void dereg(void* h) override {
    REQUIRE(live_.erase(static_cast<Reg*>(h)) == 1);  // never twice, never unknown
    ++deregs_;
    delete static_cast<Reg*>(h);
  }
  bool onDemand() const override { return odp_; }
  size_t live() const { return live_.size(); }
  int deregs() const { return deregs_; }
  uintptr_t readOnlyFrom_ = UINTPTR_MAX;

 private:
  bool odp_;
  std::set<Reg*> live_;
  int deregs_ = 0;
};

const void* at(uintptr_t a) { return reinterpret_cast<const void*>(a); }
const Reg& regOf(const loom::RegCache::Entry* e) { return *static_cast<const Reg*>(e->handle); }

}  // namespace

using Cache = loom::RegCache;

TEST_CASE("ibverbs registration cache: page-aligned entries, found again for any range inside them", "[ibverbs][regcache]") {
  RecordingRegistrar r(true);
  Cache c(r, loom::RegCacheLimits{});
  Cache::Entry* a = c.acquire(at(0x10010), 0x2000, 0);
  CHECK(regOf(a).addr == 0x10000);
  CHECK(regOf(a).bytes == 0x3000);  // 0x10010 .. 0x12010 rounded out to pages
  CHECK(regOf(a).onDemand);
  Cache::Entry* b = c.acquire(at(0x11000), 0x2000, 0);
  CHECK(b == a);
  CHECK(a->refs == 2);
  CHECK(c.registrations() == 1);
  // Wider access than the entry has: a second registration of the same pages.
  Cache::Entry* w = c.acquire(at(0x10010), 0x100, kWrite);
  CHECK(w != a);
  CHECK(c.registrations() == 2);
  // Past the entry's end: another one.
  Cache::Entry* d = c.acquire(at(0x12800), 0x1000, 0);
  CHECK(d != a);
  CHECK(regOf(d).addr == 0x12000);
  for (Cache::Entry* e : {a, b, w, d}) c.release(e);
  CHECK(r.live() == 3);  // on-demand entries stay cached
}

TEST_CASE("ibverbs registration cache: overlapping entries, each lookup gets one covering its whole range", "[ibverbs][regcache]") {
  RecordingRegistrar r(true);
  Cache c(r, loom::RegCacheLimits{});
  Cache::Entry* low = c.acquire(at(0x100000), 0x10000, 0);   // [0x100000, 0x110000)
  Cache::Entry* high = c.acquire(at(0x108000), 0x10000, 0);  // [0x108000, 0x118000)
  Cache::Entry* big = c.acquire(at(0x0f0000), 0x40000, 0);   // covers both
  CHECK(c.registrations() == 3);
  // Spanning low and high: only big covers it, though both start nearer.
  CHECK(c.acquire(at(0x107000), 0xa000, 0) == big);
  // Inside high only (low ends first): high or big, never low.
  Cache::Entry* h = c.acquire(at(0x111000), 0x1000, 0);
  CHECK((h == high || h == big));
  Cache::Entry* l = c.acquire(at(0x100000), 0x100, 0);
  CHECK((l == low || l == big));
  CHECK(c.registrations() == 3);
  // Below every entry and above every entry: new ones.
  Cache::Entry* below = c.acquire(at(0x1000), 0x10, 0);
  Cache::Entry* above = c.acquire(at(0x200000), 0x10, 0);
  CHECK(regOf(below).addr == 0x1000);
  CHECK(regOf(above).addr == 0x200000);
  CHECK(c.registrations() == 5);
}

TEST_CASE("ibverbs registration cache: without on-demand paging an entry lives only while an operation uses it", "[ibverbs][regcache]") {
  RecordingRegistrar r(false);
  Cache c(r, loom::RegCacheLimits{});
  Cache::Entry* a = c.acquire(at(0x40000), 0x8000, kWrite);
  CHECK_FALSE(regOf(a).onDemand);
  CHECK(a->kind == Cache::Kind::Transient);
  Cache::Entry* b = c.acquire(at(0x40000), 0x8000, 0);  // shared while both use it
  CHECK(b == a);
  c.release(a);
  CHECK(r.live() == 1);
  c.release(b);
  CHECK(r.live() == 0);  // freed memory can never be reached through a stale MR
  CHECK(c.entries() == 0);
  Cache::Entry* again = c.acquire(at(0x40000), 0x8000, 0);
  CHECK(c.registrations() == 2);
  c.release(again);
}

TEST_CASE("ibverbs registration cache: unused entries past the byte or entry limit go, least recently used first", "[ibverbs][regcache]") {
  RecordingRegistrar r(true);
  loom::RegCacheLimits lim;
  lim.maxBytes = 3 * 0x10000;
  lim.maxEntries = 100;
  Cache c(r, lim);
  auto use = [&](uintptr_t a) { c.release(c.acquire(at(a), 0x10000, 0)); };
  use(0x100000);
  use(0x200000);
  use(0x300000);
  CHECK(c.cachedBytes() == 3 * 0x10000);
  use(0x100000);  // most recent now: 0x200000 is the oldest
  CHECK(c.registrations() == 3);
  use(0x400000);
  CHECK(r.live() == 3);
  CHECK(c.cachedBytes() == 3 * 0x10000);
  size_t before = c.registrations();
  use(0x100000);
  use(0x300000);
  use(0x400000);
  CHECK(c.registrations() == before);  // still cached
  use(0x200000);
  CHECK(c.registrations() == before + 1);  // was evicted
  // An entry in use is never evicted, whatever the limits.
  Cache::Entry* held = c.acquire(at(0x900000), 0x100000, 0);
  use(0xa00000);
  CHECK(r.live() >= 2);
  CHECK(c.acquire(at(0x900000), 0x10, 0) == held);
  c.release(held);
  c.release(held);
  CHECK(c.cachedBytes() <= lim.maxBytes);

  loom::RegCacheLimits two;
  two.maxEntries = 2;
  Cache byCount(r, two);
  size_t live0 = r.live();
  for (uintptr_t a : {0x1000000u, 0x2000000u, 0x3000000u}) byCount.release(byCount.acquire(at(a), 0x1000, 0));
  CHECK(r.live() == live0 + 2);
}

TEST_CASE("ibverbs registration cache: invalidated ranges are never found again, entries in use go at their last release", "[ibverbs][regcache]") {
  RecordingRegistrar r(true);
  Cache c(r, loom::RegCacheLimits{});
  c.release(c.acquire(at(0x100000), 0x10000, 0));
  Cache::Entry* inUse = c.acquire(at(0x200000), 0x10000, 0);
  c.release(c.acquire(at(0x300000), 0x10000, 0));
  CHECK(r.live() == 3);
  c.invalidate(at(0x10f000), 0x100000);  // overlaps the first two, not the third
  CHECK(r.live() == 2);                  // the unused one at once
  Cache::Entry* fresh = c.acquire(at(0x200000), 0x10000, 0);
  CHECK(fresh != inUse);                 // the invalidated entry is not handed out
  CHECK(c.registrations() == 4);
  c.release(inUse);
  CHECK(r.live() == 2);                  // deregistered at its last release
  c.release(fresh);
  CHECK(c.acquire(at(0x300000), 0x100, 0)->refs == 1);  // untouched
}

TEST_CASE("ibverbs registration cache: loomCommRegister's pinned entries are found without registering again", "[ibverbs][regcache]") {
  RecordingRegistrar r(false);
  Cache c(r, loom::RegCacheLimits{});
  Cache::Entry* p = c.pin(at(0x500000), 0x100000, kWrite, 0);
  REQUIRE(p);
  CHECK(p->kind == Cache::Kind::Pinned);
  CHECK(regOf(p).addr == 0x500000);
  Cache::Entry* a = c.acquire(at(0x540000), 0x20000, kWrite);
  Cache::Entry* b = c.acquire(at(0x500000), 0x100000, 0);
  CHECK(a == p);
  CHECK(b == p);
  CHECK(c.registrations() == 1);
  c.release(a);
  c.release(b);
  CHECK(r.live() == 1);  // pinned: stays after its users
  // Deregistered while an operation uses it: the MR lives until that ends.
  Cache::Entry* user = c.acquire(at(0x500000), 0x10, 0);
  c.unpin(p);
  CHECK(r.live() == 1);
  CHECK(c.acquire(at(0x500000), 0x10, 0) != user);  // not found any more: a new (transient) entry
  c.release(user);
  CHECK(r.live() == 1);  // the pinned MR went; the transient one is still held
  // Read-only memory: registered without write access, for sends only.
  r.readOnlyFrom_ = 0x800000;
  Cache::Entry* ro = c.pin(at(0x800000), 0x1000, kWrite, 0);
  REQUIRE(ro);
  CHECK(ro->access == 0);
  CHECK(c.acquire(at(0x800000), 0x10, 0) == ro);
  r.readOnlyFrom_ = 0;
  CHECK(c.pin(at(0x900000), 0x1000, kWrite, kWrite) == nullptr);
  CHECK_THROWS_AS(c.acquire(at(0xa00000), 0x10, kWrite), loom::Error);
}
#endif
