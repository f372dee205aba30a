// The CUDA communicator's DeviceDriver (device_comm.h): its device memory,
// IPC handles, side streams and events, and the stream backend, all through
// the plug-in's table (cuda_api.h).  Only this file and the plug-in touch
// CUDA; the rest of the CUDA communicator runs on the simulated device in
// ctest.
#pragma once
#include <memory>

#include "src/device/cuda_api.h"
#include "src/device/device_comm.h"

namespace loom {

// A driver for `device` (the current CUDA device at communicator init).
// The side streams and events are created on first use.
std::unique_ptr<DeviceDriver> makeCudaDeviceDriver(const CudaApi& api, int device);

}  // namespace loom
