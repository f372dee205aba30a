// The registration cache's bookkeeping (the policy: ib_reg_cache.h).
#include "transports/ibverbs/ib_reg_cache.h"

#include <algorithm>
#include <vector>

namespace loom {

RegCache::~RegCache() {
  for (auto& kv : byStart_) reg_.dereg(kv.second->handle);
  for (auto& kv : dropped_) reg_.dereg(kv.second->handle);
}

RegCache::Entry* RegCache::findLocked(uintptr_t a, uintptr_t end, unsigned access) {
  // Entries starting at or before a, nearest first; none longer than
  // maxEntryBytes_, so the scan stops where no entry can reach a.
  auto it = byStart_.upper_bound(a);
  while (it != byStart_.begin()) {
    --it;
    Entry* e = it->second.get();
    if (a - e->start >= maxEntryBytes_) break;
    if (end <= e->start + e->bytes && (e->access & access) == access) return e;
  }
  return nullptr;
}

RegCache::Entry* RegCache::insertLocked(uintptr_t start, size_t bytes, unsigned access, Kind kind) {
  bool onDemand = kind == Kind::Coherent;
  void* h = reg_.reg(start, bytes, access, onDemand);
  ++registrations_;
  auto e = std::make_unique<Entry>();
  e->start = start;
  e->bytes = bytes;
  e->access = access;
  e->kind = kind;
  e->handle = h;
  e->lru = lru_.end();
  Entry* p = e.get();
  byStart_.emplace(start, std::move(e));
  maxEntryBytes_ = std::max(maxEntryBytes_, bytes);
  return p;
}

RegCache::Entry* RegCache::acquire(const void* addr, size_t bytes, unsigned access) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  uintptr_t end = a + std::max<size_t>(bytes, 1);
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = findLocked(a, end, access);
  if (!e) {
    uintptr_t s = a / page_ * page_;
    uintptr_t t = (end + page_ - 1) / page_ * page_;
    e = insertLocked(s, size_t(t - s), access, reg_.onDemand() ? Kind::Coherent : Kind::Transient);
  }
  if (e->lru != lru_.end()) {
    lru_.erase(e->lru);
    e->lru = lru_.end();
    lruBytes_ -= e->bytes;
  }
  ++e->refs;
  return e;
}

void RegCache::release(Entry* e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--e->refs > 0) return;
  if (!e->valid) {
    auto it = dropped_.find(e);
    reg_.dereg(e->handle);
    dropped_.erase(it);
    return;
  }
  if (e->kind == Kind::Transient) {
    destroyLocked(e);
  } else if (e->kind == Kind::Coherent) {
    lru_.push_front(e);
    e->lru = lru_.begin();
    lruBytes_ += e->bytes;
    evictLocked();
  }
}

RegCache::Entry* RegCache::pin(const void* addr, size_t bytes, unsigned access, unsigned fallbackAccess) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr);
  std::lock_guard<std::mutex> lock(mu_);
  for (unsigned acc : {access, fallbackAccess}) {
    try {
      return insertLocked(a, bytes, acc, Kind::Pinned);
    } catch (...) {
      if (acc == fallbackAccess) return nullptr;
    }
  }
  return nullptr;
}

void RegCache::unpin(Entry* e) {
  std::lock_guard<std::mutex> lock(mu_);
  dropLocked(e);
}

void RegCache::invalidate(const void* addr, size_t bytes) {
  uintptr_t a = reinterpret_cast<uintptr_t>(addr), end = a + bytes;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Entry*> hit;
  for (auto& kv : byStart_) {
    Entry* e = kv.second.get();
    if (e->start < end && a < e->start + e->bytes) hit.push_back(e);
  }
  for (Entry* e : hit) dropLocked(e);
}

void RegCache::dropLocked(Entry* e) {
  if (e->refs == 0) {
    destroyLocked(e);
    return;
  }
  // In use: the operation keeps its MR; nobody finds it any more.
  auto range = byStart_.equal_range(e->start);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second.get() == e) {
      e->valid = false;
      dropped_[e] = std::move(it->second);
      byStart_.erase(it);
      return;
    }
}

void RegCache::destroyLocked(Entry* e) {
  if (e->lru != lru_.end()) {
    lru_.erase(e->lru);
    lruBytes_ -= e->bytes;
  }
  auto range = byStart_.equal_range(e->start);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second.get() == e) {
      reg_.dereg(e->handle);
      byStart_.erase(it);
      return;
    }
}

void RegCache::evictLocked() {
  while (!lru_.empty() && (lruBytes_ > limits_.maxBytes || lru_.size() > limits_.maxEntries))
    destroyLocked(lru_.back());
}

size_t RegCache::entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return byStart_.size() + dropped_.size();
}

size_t RegCache::cachedBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lruBytes_;
}

}  // namespace loom
