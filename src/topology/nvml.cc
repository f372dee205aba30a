#include "src/topology/nvml.h"

#include <dlfcn.h>

#include <cstdio>
#include <map>

namespace loom {

namespace {

// The few NVML entry points loom needs, declared here (the CUDA toolkit's
// nvml.h is not needed to build).  Layouts follow NVML's documented ABI.
typedef int nvmlReturn_t;  // 0 = NVML_SUCCESS
typedef struct nvmlDevice_st* nvmlDevice_t;
struct nvmlPciInfo_t {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};
constexpr unsigned kMaxNvLinks = 18;  // NVML_NVLINK_MAX_LINKS (Hopper)

struct NvmlApi {
  nvmlReturn_t (*init)();
  nvmlReturn_t (*shutdown)();
  nvmlReturn_t (*count)(unsigned*);
  nvmlReturn_t (*byIndex)(unsigned, nvmlDevice_t*);
  nvmlReturn_t (*pciInfo)(nvmlDevice_t, nvmlPciInfo_t*);
  nvmlReturn_t (*linkState)(nvmlDevice_t, unsigned, int*);
  nvmlReturn_t (*remotePci)(nvmlDevice_t, unsigned, nvmlPciInfo_t*);
};

template <class F>
bool sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

}  // namespace

std::string normalizePciBusId(const std::string& busId) {
  unsigned dom = 0, bus = 0, dev = 0, fn = 0;
  if (sscanf(busId.c_str(), "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4) return "";
  char buf[32];
  snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", dom & 0xffff, bus & 0xff, dev & 0x1f, fn & 0x7);
  return buf;
}

bool nvmlNvLinks(std::vector<NvmlLink>* out, int* gpuCount, std::string* why) {
  out->clear();
  *gpuCount = 0;
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();  // also releases glibc's record of the failure
    *why = std::string("NVML not loaded (") + (err ? err : "libnvidia-ml.so.1") + ")";
    return false;
  }
  NvmlApi api{};
  if (!sym(lib, "nvmlInit_v2", &api.init) || !sym(lib, "nvmlShutdown", &api.shutdown) ||
      !sym(lib, "nvmlDeviceGetCount_v2", &api.count) ||
      !sym(lib, "nvmlDeviceGetHandleByIndex_v2", &api.byIndex) ||
      !sym(lib, "nvmlDeviceGetPciInfo_v3", &api.pciInfo) ||
      !sym(lib, "nvmlDeviceGetNvLinkState", &api.linkState) ||
      !sym(lib, "nvmlDeviceGetNvLinkRemotePciInfo_v2", &api.remotePci)) {
    *why = "NVML lacks an entry point loom needs (driver too old)";
    dlclose(lib);
    return false;
  }
  if (api.init() != 0) {
    *why = "nvmlInit failed (no NVIDIA driver loaded?)";
    dlclose(lib);
    return false;
  }
  unsigned n = 0;
  if (api.count(&n) == 0) {
    *gpuCount = int(n);
    for (unsigned i = 0; i < n; ++i) {
      nvmlDevice_t dev;
      nvmlPciInfo_t pci{};
      if (api.byIndex(i, &dev) != 0 || api.pciInfo(dev, &pci) != 0) continue;
      std::map<std::string, int> perRemote;
      for (unsigned l = 0; l < kMaxNvLinks; ++l) {
        int active = 0;
        nvmlPciInfo_t remote{};
        if (api.linkState(dev, l, &active) != 0 || !active) continue;
        if (api.remotePci(dev, l, &remote) != 0) continue;
        ++perRemote[normalizePciBusId(remote.busId)];
      }
      for (const auto& kv : perRemote)
        out->push_back(NvmlLink{normalizePciBusId(pci.busId), kv.first, kv.second});
    }
  }
  api.shutdown();
  dlclose(lib);
  return true;
}

}  // namespace loom
