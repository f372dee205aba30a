// LOOM_DEVICE at communicator init (device_choice.h).
#include "src/device/device_choice.h"

#include <mutex>
#include <string>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/device/cuda_device_driver.h"
#include "src/device/cuda_loader.h"

namespace loom {

namespace {

std::mutex g_factoryMu;
DeviceDriverFactory g_factory;  // tests' simulated device

bool haveTestFactory() {
  std::lock_guard<std::mutex> g(g_factoryMu);
  return bool(g_factory);
}

}  // namespace

void setDeviceDriverFactoryForTesting(DeviceDriverFactory factory) {
  std::lock_guard<std::mutex> g(g_factoryMu);
  g_factory = std::move(factory);
}

DeviceChoice checkDeviceChoice() {
  // Loads the CUDA plug-in now (about 0.3 ms on the dev VM), not in the
  // first collective, which asks it where each buffer lives.
  std::string why;
  const int devices = cudaDeviceCount(&why);
  const std::string& d = config().device;
  DeviceChoice c;
  if (d.empty() || d == "host") return c;
  if (d != "cuda" && d != "auto") fail(loomInvalidUsage, "LOOM_DEVICE=%s: expected host, cuda or auto", d.c_str());
  // auto: CUDA where this process has a usable GPU, host memory otherwise
  // (what the NCCL shim asks for unless the user chose).
  if (d == "auto" && devices == 0 && !haveTestFactory()) return c;
  if (haveTestFactory()) {
    c.cuda = true;
    c.device = 0;
    return c;
  }
  if (devices == 0)
    fail(loomInvalidUsage, "LOOM_DEVICE=cuda, but this process has no usable CUDA device: %s", why.c_str());
  const CudaApi* api = cudaPlugin(&why);
  int dev = -1;
  if (int rc = api->getDevice(&dev))
    fail(loomUnhandledCudaError, "LOOM_DEVICE=cuda: cudaGetDevice failed: %s (CUDA error %d)", api->errorString(rc),
         rc);
  if (dev < 0 || dev >= devices)
    fail(loomInvalidUsage, "LOOM_DEVICE=cuda: the current CUDA device %d is not one of the %d devices", dev, devices);
  c.cuda = true;
  c.device = dev;
  return c;
}

std::unique_ptr<DeviceDriver> deviceDriverFor(const DeviceChoice& choice, int rank, int nranks) {
  {
    std::lock_guard<std::mutex> g(g_factoryMu);
    if (g_factory) return g_factory(rank, nranks);
  }
  std::string why;
  const CudaApi* api = cudaPlugin(&why);
  if (!api) fail(loomInvalidUsage, "no CUDA plug-in: %s", why.c_str());
  return makeCudaDeviceDriver(*api, choice.device);
}

}  // namespace loom
