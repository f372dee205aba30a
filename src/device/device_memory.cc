// loomMemAlloc's device memory (device_memory.h): a registry of live
// allocations, each with the driver that made it, so that loomMemFree
// frees it the same way.
#include "src/device/device_memory.h"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/device/device_choice.h"
#include "src/device/device_comm.h"

namespace loom {

namespace {

struct Allocation {
  std::unique_ptr<DeviceDriver> driver;
  size_t bytes = 0;
};

std::mutex g_mu;
std::map<void*, Allocation>& live() {
  static auto* m = new std::map<void*, Allocation>();  // leaked: used at exit
  return *m;
}

// The free hooks; g_hookMu is held while they run (removal waits for them).
std::mutex g_hookMu;
int g_nextHook = 0;
std::map<int, std::function<void(void*)>>& hooks() {
  static auto* m = new std::map<int, std::function<void(void*)>>();  // leaked: used at exit
  return *m;
}

}  // namespace

void* deviceMemAlloc(size_t bytes, int device) {
  DeviceRequest request;
  if (device >= 0) {
    request.kind = DeviceRequest::Kind::Cuda;
    request.device = device;
  } else {
    const std::string& d = config().device;
    if (d.empty() || d == "host") return nullptr;  // without loading the CUDA plug-in
  }
  const DeviceChoice choice = checkDeviceChoice(request);
  if (!choice.cuda) return nullptr;
  if (bytes == 0) fail(loomInvalidArgument, "size is 0");
  Allocation a;
  a.driver = deviceDriverFor(choice, 0, 1);
  a.bytes = bytes;
  const int previous = a.driver->enter();
  void* p = nullptr;
  try {
    p = a.driver->allocateStaging(bytes);
  } catch (...) {
    a.driver->leave(previous);
    throw;
  }
  a.driver->leave(previous);
  std::lock_guard<std::mutex> g(g_mu);
  live().emplace(p, std::move(a));
  return p;
}

bool deviceMemFree(void* ptr) {
  DeviceDriver* driver = nullptr;  // stays with the allocation until it is erased below
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = live().find(ptr);
    if (it == live().end()) return false;
    driver = it->second.driver.get();
  }
  {
    // Peers that may map it (device zero-copy) unmap it first, once this
    // process's work on the device is done, as cudaFree would wait for it:
    // a program on published buffers ends only once the peers are done
    // reading them (never thrown: the memory is freed).
    std::lock_guard<std::mutex> h(g_hookMu);
    if (!hooks().empty()) {
      const int previous = driver->enter();
      try {
        driver->synchronize();
      } catch (const Error& e) {
        LOOM_WARN("DEVICE", "loomMemFree(%p): %s", ptr, e.what());
      }
      driver->leave(previous);
    }
    for (auto& [id, hook] : hooks()) hook(ptr);
  }
  Allocation a;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = live().find(ptr);
    if (it == live().end()) return false;  // a concurrent free of the same pointer won
    a = std::move(it->second);
    live().erase(it);
  }
  const int previous = a.driver->enter();
  try {
    a.driver->release(ptr);
  } catch (...) {
    a.driver->leave(previous);
    throw;
  }
  a.driver->leave(previous);
  return true;
}

bool deviceMemFind(const void* p, size_t bytes, void** base) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = live().upper_bound(const_cast<void*>(p));
  if (it == live().begin()) return false;
  --it;
  const auto b = reinterpret_cast<uintptr_t>(it->first), q = reinterpret_cast<uintptr_t>(p);
  if (q < b || q - b > it->second.bytes || bytes > it->second.bytes - (q - b)) return false;
  *base = it->first;
  return true;
}

int addDeviceMemFreeHook(std::function<void(void* base)> hook) {
  std::lock_guard<std::mutex> h(g_hookMu);
  hooks().emplace(++g_nextHook, std::move(hook));
  return g_nextHook;
}

void removeDeviceMemFreeHook(int id) {
  std::lock_guard<std::mutex> h(g_hookMu);
  hooks().erase(id);
}

size_t deviceMemLive() {
  std::lock_guard<std::mutex> g(g_mu);
  return live().size();
}

}  // namespace loom
