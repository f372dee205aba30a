// Which device a new communicator runs on (LOOM_DEVICE).
#pragma once
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

// The CUDA driver of a CUDA communicator on `device` (choice.cuda).
std::unique_ptr<DeviceDriver> cudaDeviceDriver(int device);

}  // namespace loom
