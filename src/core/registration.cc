#include "src/core/registration.h"

#include <atomic>

#include "src/core/error.h"
#include "src/device/host_memory.h"

namespace loom {

namespace {

bool covers(const Registration& r, const void* p, size_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(r.base);
  return a >= b && a - b <= r.bytes && bytes <= r.bytes - (a - b);
}

}  // namespace

void* RegistrationTable::add(void* buff, size_t bytes, const std::vector<Transport*>& transports, MemoryKind kind,
                             void* allocation) {
  if (!buff) fail(loomInvalidArgument, "buff is NULL");
  if (bytes == 0) fail(loomInvalidArgument, "size is 0");
  if (reinterpret_cast<uintptr_t>(buff) + bytes < reinterpret_cast<uintptr_t>(buff))
    fail(loomInvalidArgument, "buff %p + size %zu wraps around the address space", buff, bytes);
  auto reg = std::make_unique<Registration>();
  reg->base = buff;
  reg->bytes = bytes;
  if (kind == MemoryKind::CudaDevice) {
    reg->kind = kind;
    reg->allocation = allocation;
  } else {
    PeerBuffer pb;
    reg->peerMappable = hostMemExport(buff, bytes, &pb);
    reg->kind = reg->peerMappable ? MemoryKind::RegisteredHost : MemoryKind::Host;
  }
  for (Transport* t : transports)
    if (t->serves(reg->kind == MemoryKind::RegisteredHost ? MemoryKind::Host : reg->kind))
      if (std::shared_ptr<void> h = t->registerBuffer(buff, bytes, reg->kind)) reg->handles.push_back(std::move(h));
  // Handles are numbers never handed out twice in this process (not the
  // record's address, which the heap reuses): a stale one, deregistered
  // already, must not release a newer registration.
  static std::atomic<uintptr_t> serial{0};
  void* handle = reinterpret_cast<void*>((serial.fetch_add(1) + 1) << 4);
  std::lock_guard<std::mutex> lock(mu_);
  regs_[handle] = std::move(reg);
  return handle;
}

std::unique_ptr<Registration> RegistrationTable::remove(void* handle) {
  std::unique_ptr<Registration> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regs_.find(handle);
    if (!handle || it == regs_.end())
      fail(loomInvalidArgument, "handle %p is not a registration of this communicator (deregistered already?)",
           handle);
    gone = std::move(it->second);
    regs_.erase(it);
  }
  return gone;  // its transports' handles are released with it, outside the lock
}

const Registration* RegistrationTable::find(const void* p, size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : regs_)
    if (covers(*kv.second, p, bytes)) return kv.second.get();
  return nullptr;
}

bool RegistrationTable::findAllocation(const void* p, size_t bytes, void** allocation) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : regs_)
    if (kv.second->allocation && covers(*kv.second, p, bytes)) {
      *allocation = kv.second->allocation;
      return true;
    }
  return false;
}

bool RegistrationTable::holdsAllocation(const void* allocation) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : regs_)
    if (kv.second->allocation == allocation) return true;
  return false;
}

size_t RegistrationTable::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return regs_.size();
}

void RegistrationTable::clear() {
  std::map<const void*, std::unique_ptr<Registration>> gone;
  std::lock_guard<std::mutex> lock(mu_);
  gone.swap(regs_);
}

}  // namespace loom
