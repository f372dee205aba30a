// The device of a new communicator: LOOM_DEVICE or the config form of init
// (device_choice.h).
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
int g_factoryDevices = 0;

// The simulated devices of a test factory, 0 without one.
int testFactoryDevices() {
  std::lock_guard<std::mutex> g(g_factoryMu);
  return g_factory ? g_factoryDevices : 0;
}

bool haveTestFactory() {
  std::lock_guard<std::mutex> g(g_factoryMu);
  return bool(g_factory);
}

}  // namespace

void setDeviceDriverFactoryForTesting(DeviceDriverFactory factory, int devices) {
  std::lock_guard<std::mutex> g(g_factoryMu);
  g_factory = std::move(factory);
  g_factoryDevices = devices;
}

namespace {
thread_local int tlsTestDevice = -1;
}

void setThreadDeviceForTesting(int device) { tlsTestDevice = device; }

int currentCudaDevice() {
  if (haveTestFactory()) return tlsTestDevice;
  std::string why;
  if (cudaDeviceCount(&why) == 0) return -1;
  const CudaApi* api = cudaPlugin(&why);
  int dev = -1;
  if (int rc = api->getDevice(&dev))
    fail(loomUnhandledCudaError, "cudaGetDevice failed: %s (CUDA error %d)", api->errorString(rc), rc);
  return dev;
}

int deviceCountForInit() {
  if (haveTestFactory()) return testFactoryDevices();
  std::string why;
  return cudaDeviceCount(&why);
}

DeviceChoice checkDeviceChoice(const DeviceRequest& request) {
  // Loads the CUDA plug-in now (about 0.3 ms on the dev VM), not in the
  // first collective, which asks it where each buffer lives.
  std::string why;
  int devices = cudaDeviceCount(&why);
  // The mode asked for, and how the messages name where it came from.
  std::string mode, source;
  switch (request.kind) {
    case DeviceRequest::Kind::FromEnv:
      mode = config().device.empty() ? "host" : config().device;
      source = "LOOM_DEVICE=" + config().device;
      break;
    case DeviceRequest::Kind::Host: mode = "host", source = "config deviceKind loomDeviceHost"; break;
    case DeviceRequest::Kind::Cuda: mode = "cuda", source = "config deviceKind loomDeviceCuda"; break;
    case DeviceRequest::Kind::Auto: mode = "auto", source = "config deviceKind loomDeviceAuto"; break;
  }
  DeviceChoice c;
  if (mode == "host") return c;
  if (mode != "cuda" && mode != "auto")
    fail(loomInvalidUsage, "LOOM_DEVICE=%s: expected host, cuda or auto", mode.c_str());
  const bool factory = haveTestFactory();
  if (factory) {
    devices = testFactoryDevices();
    why = "the test's simulated devices";
  }
  // auto: CUDA where this process has a usable GPU, host memory otherwise
  // (what the NCCL shim asks for unless the user chose).
  if (mode == "auto" && devices == 0) return c;
  if (devices == 0)
    fail(loomInvalidUsage, "%s, but this process has no usable CUDA device: %s", source.c_str(), why.c_str());
  if (request.device >= devices)
    fail(loomInvalidArgument, "config cudaDevice %d: this process has %d CUDA device%s (0 to %d)",
         request.device, devices, devices == 1 ? "" : "s", devices - 1);
  c.cuda = true;
  if (factory) {  // the thread's test device, else -1: the factory picks
    c.device = request.device >= 0 ? request.device : tlsTestDevice;
    return c;
  }
  if (request.device >= 0) {
    c.device = request.device;
    return c;
  }
  const CudaApi* api = cudaPlugin(&why);
  int dev = -1;
  if (int rc = api->getDevice(&dev))
    fail(loomUnhandledCudaError, "%s: cudaGetDevice failed: %s (CUDA error %d)", source.c_str(),
         api->errorString(rc), rc);
  if (dev < 0 || dev >= devices)
    fail(loomInvalidUsage, "%s: the current CUDA device %d is not one of the %d devices", source.c_str(), dev,
         devices);
  c.device = dev;
  return c;
}

void loadDeviceKernels(const DeviceChoice& choice) {
  {
    std::lock_guard<std::mutex> g(g_factoryMu);
    if (g_factory) return;  // the simulated device runs no kernels
  }
  std::string why;
  const CudaApi* api = cudaPlugin(&why);
  if (!api) fail(loomInvalidUsage, "no CUDA plug-in: %s", why.c_str());
  // (A device attribute: no context needed, nothing to restore.)
  int memOps = 0;
  if (int q = api->streamMemOps(choice.device, &memOps))
    fail(loomUnhandledCudaError, "asking whether device %d runs stream memory operations failed: %s (CUDA error %d)",
         choice.device, api->errorString(q), q);
  if (!memOps)
    fail(loomUnhandledCudaError, "device %d cannot run 64-bit stream memory operations "
         "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0; some virtual GPUs and old drivers lack them): "
         "every wait and flag of loom's CUDA path is one (use LOOM_DEVICE=host with host buffers)", choice.device);
  // The thread's context, restored after (none: none again, not device
  // 0's, which cudaSetDevice(0) would make).
  int previous = -1;
  const bool known = api->contextDevice(&previous) == 0;
  if (previous != choice.device) {
    int rc = api->setDevice(choice.device);
    if (rc != 0)
      fail(loomUnhandledCudaError, "cudaSetDevice(%d) failed: %s (CUDA error %d)", choice.device,
           api->errorString(rc), rc);
  }
  int rc = api->loadKernels();
  if (known && previous < 0)
    api->clearContext();
  else if (known && previous != choice.device)
    api->setDevice(previous);
  if (rc != 0)
    fail(loomUnhandledCudaError, "loading loom's CUDA kernels on device %d (cudaFuncGetAttributes) failed: %s (CUDA "
         "error %d)", choice.device, api->errorString(rc), rc);
}

std::unique_ptr<DeviceDriver> deviceDriverFor(const DeviceChoice& choice, int rank, int nranks) {
  {
    std::lock_guard<std::mutex> g(g_factoryMu);
    if (g_factory) return g_factory(rank, nranks, choice.device);
  }
  std::string why;
  const CudaApi* api = cudaPlugin(&why);
  if (!api) fail(loomInvalidUsage, "no CUDA plug-in: %s", why.c_str());
  return makeCudaDeviceDriver(*api, choice.device);
}

}  // namespace loom
