// Loading the CUDA plug-in (cuda_loader.h).
#include "src/device/cuda_loader.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <vector>

#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"

namespace loom {

namespace {

struct Plugin {
  const CudaApi* api = nullptr;
  std::string why;
  int devices = 0;
  std::string devicesWhy;
};

std::string dirOf(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

const Plugin& plugin() {
  static const Plugin p = [] {
    Plugin x;
    std::vector<std::string> candidates;
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&cudaPlugin), &info) && info.dli_fname) {
      std::string dir = dirOf(info.dli_fname);
      candidates.push_back(dir + "/libloom_cuda.so");         // next to libloom.so
      candidates.push_back(dir + "/../lib/libloom_cuda.so");  // a program in bin/ linked with libloom.a
    }
    candidates.push_back("libloom_cuda.so");  // the library path
    std::string errors;
    void* handle = nullptr;
    for (const std::string& c : candidates) {
      handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      const char* e = dlerror();
      errors += (errors.empty() ? "" : "; ") + std::string(e ? e : c.c_str());
    }
    if (!handle) {
      x.why = "the CUDA plug-in libloom_cuda.so could not be loaded (" + errors + ")";
      x.devicesWhy = x.why;
      return x;
    }
    auto fn = reinterpret_cast<LoomCudaPluginFn>(dlsym(handle, LOOM_CUDA_PLUGIN_SYMBOL));
    x.api = fn ? fn(kCudaApiVersion) : nullptr;
    if (!x.api) {
      x.why = "libloom_cuda.so is not the plug-in of this libloom (ABI version mismatch)";
      x.devicesWhy = x.why;
      return x;
    }
    int rc = x.api->deviceCount(&x.devices);
    if (rc != 0) {
      x.devices = 0;
      x.devicesWhy = strf("cudaGetDeviceCount failed: %s", x.api->errorString(rc));
    } else if (x.devices == 0) {
      x.devicesWhy = "cudaGetDeviceCount found no CUDA device";
    }
    LOOM_INFO("INIT", "CUDA: %d device(s)%s%s", x.devices, x.devices ? "" : ": ", x.devicesWhy.c_str());
    return x;
  }();
  return p;
}

std::atomic<int (*)(const void*)> g_classifier{nullptr};
std::atomic<int (*)(void*)> g_captureProbe{nullptr};

}  // namespace

const CudaApi* cudaPlugin(std::string* why) {
  const Plugin& p = plugin();
  if (!p.api && why) *why = p.why;
  return p.api;
}

int cudaDeviceCount(std::string* why) {
  const Plugin& p = plugin();
  if (!p.devices && why) *why = p.devicesWhy;
  return p.devices;
}

LOOM_HOT int cudaPointerDevice(const void* ptr) {
  if (auto fn = g_classifier.load(std::memory_order_acquire)) return fn(ptr);
  const Plugin& p = plugin();
  if (!p.devices || !ptr) return -1;
  int device = -1;
  return p.api->pointerDevice(ptr, &device) == 0 ? device : -1;
}

int cudaStreamCaptureState(void* stream) {
  if (auto fn = g_captureProbe.load(std::memory_order_acquire)) return fn(stream);
  const Plugin& p = plugin();
  if (!p.devices) return 0;
  int capturing = 0;
  if (int rc = p.api->streamCapturing(stream, &capturing))
    fail(loomUnhandledCudaError, "cudaStreamIsCapturing(%p) failed: %s (CUDA error %d)", stream,
         p.api->errorString(rc), rc);
  return capturing;
}

bool cudaStreamCapturing(void* stream) { return cudaStreamCaptureState(stream) != 0; }

int usableCaptureState(void* stream) {
  const int state = cudaStreamCaptureState(stream);
  if (state == 2)
    fail(loomInvalidUsage,
         "stream %p is the legacy default stream while a blocking stream of the device is being captured into a CUDA "
         "graph: work enqueued on it would invalidate that capture (cudaErrorStreamCaptureImplicit); use a stream of "
         "your own (cudaStreamNonBlocking)",
         stream);
  return state;
}

void relaxCudaCaptureModeOnThisThread() {
  thread_local bool relaxed = false;
  if (relaxed) return;
  relaxed = true;
  const Plugin& p = plugin();
  if (!p.devices) return;
  if (int rc = p.api->relaxCaptureMode())
    LOOM_WARN("DEVICE", "cudaThreadExchangeStreamCaptureMode failed: %s (CUDA error %d)", p.api->errorString(rc), rc);
}

void setCudaCaptureProbeForTesting(int (*fn)(void*)) { g_captureProbe.store(fn, std::memory_order_release); }

void setCudaPointerClassifierForTesting(int (*fn)(const void*)) {
  g_classifier.store(fn, std::memory_order_release);
}

}  // namespace loom
