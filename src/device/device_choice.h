// Which device a new communicator runs on (LOOM_DEVICE).
#pragma once
#include <functional>
#include <memory>

namespace loom {

class DeviceDriver;

struct DeviceChoice {
  bool cuda = false;  // false: the host
  int device = -1;    // the CUDA device (current at init) when cuda
};

// Called by every communicator init before anything else is set up: the
// device LOOM_DEVICE names, or loomInvalidUsage with the reason it cannot
// be used (LOOM_DEVICE=cuda on a process without a usable CUDA device says
// what is missing: no plug-in, no driver, cudaGetDeviceCount's error, or
// zero devices).  Also loads the CUDA plug-in, if there is one.
DeviceChoice checkDeviceChoice();

// The driver of rank `rank`'s device communicator (choice.cuda): CUDA's,
// on choice.device.
std::unique_ptr<DeviceDriver> deviceDriverFor(const DeviceChoice& choice, int rank, int nranks);

// Tests only: with a factory set, LOOM_DEVICE=cuda needs no CUDA device and
// communicators get the factory's drivers (the simulated device), so the
// API's CUDA-communicator path runs on machines without a GPU.  An empty
// function restores CUDA.
using DeviceDriverFactory = std::function<std::unique_ptr<DeviceDriver>(int rank, int nranks)>;
void setDeviceDriverFactoryForTesting(DeviceDriverFactory factory);

}  // namespace loom
