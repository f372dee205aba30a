// Which device a new communicator runs on (LOOM_DEVICE, or the config
// form of init: loomCommInitRankConfig).
#pragma once
#include <functional>
#include <memory>

namespace loom {

class DeviceDriver;
struct RankInfo;
class RegistrationTable;

// What init was asked for: loomConfig_t's deviceKind and cudaDevice, or
// LOOM_DEVICE and the current device (the default).
struct DeviceRequest {
  enum class Kind { FromEnv, Host, Cuda, Auto };
  Kind kind = Kind::FromEnv;
  int device = -1;  // the CUDA ordinal named; -1: the current device at init
  // Not the device's, but init's too: the timeout loomConfig_t asked for
  // (0: LOOM_TIMEOUT_MS).  Children (split, shrink) take their parent's
  // timeout as they take its device.
  int64_t timeoutMs = 0;
  // Set only for the internal sub-communicators of the hierarchical device
  // path (src/core/hier_device.h): the path they must take (1: ipc, 2:
  // staged; 0: LOOM_DEVICE_PATH), the rank whose device driver they use
  // (the parent's rank; -1: their own), and their role for messages (they
  // then neither bind CPUs, nor trace, nor change the log's rank).
  int path = 0;
  int driverRank = -1;
  const char* part = nullptr;
  // The parent's rank 0 record, whose communicator-wide settings (slots,
  // transports, staged pieces, ...) a sub-communicator takes instead of its
  // own root's environment.
  const RankInfo* parentRoot = nullptr;
  // The hierarchical path's local sub-communicator: its parent's
  // loomCommRegister records, whose device memory it may publish (the
  // parent's buffers are the ones it reads).  nullptr: its own.
  const RegistrationTable* registrations = nullptr;
  // Made by loomCommSplit or loomCommShrink from a communicator: where
  // LOOM_DEVICE_PATH=hier does not apply to its shape, the path auto picks
  // is taken instead of failing.
  bool derived = false;
};

struct DeviceChoice {
  bool cuda = false;  // false: the host
  // The CUDA device when cuda: the one requested, else the current one at
  // init (with a test factory: as requested, -1 letting the factory pick).
  int device = -1;
};

// Called by every communicator init before anything else is set up: the
// device requested (by default what LOOM_DEVICE names), or loomInvalidUsage
// with the reason it cannot be used (CUDA on a process without a usable
// CUDA device says what is missing: no plug-in, no driver,
// cudaGetDeviceCount's error, or zero devices), loomInvalidArgument for a
// requested device beyond the process's.  Also loads the CUDA plug-in, if
// there is one.
DeviceChoice checkDeviceChoice(const DeviceRequest& request = DeviceRequest());

// The CUDA devices a communicator may be made on: cudaGetDeviceCount's
// (0 without a GPU, driver or plug-in), or a test factory's simulated ones.
int deviceCountForInit();
// The calling thread's current CUDA device (cudaGetDevice), -1 where the
// process has none; with a test factory, the thread's
// setThreadDeviceForTesting value (-1: none set).
int currentCudaDevice();
// Tests only: the simulated "current device" of the calling thread, which
// a communicator made on this thread without naming one gets (-1: the
// factory's choice).
void setThreadDeviceForTesting(int device);

// The driver of rank `rank`'s device communicator (choice.cuda): CUDA's,
// on choice.device.
std::unique_ptr<DeviceDriver> deviceDriverFor(const DeviceChoice& choice, int rank, int nranks);

// Loads the CUDA plug-in's kernels on choice.device (CudaApi::loadKernels,
// once per device and process; nothing with a test factory).  Init calls
// it before the all-gather every rank passes: under lazy loading, loading
// waits for the device, so it must not happen once a rank of this process
// may have enqueued a program waiting for another rank of this process,
// whose init would then wait for it (threads each with a communicator on
// one GPU, as nccl-tests' thread mode runs).
void loadDeviceKernels(const DeviceChoice& choice);

// Tests only: with a factory set, CUDA needs no CUDA device: the process
// has `devices` simulated devices, and communicators get the factory's
// drivers (the simulated device), so the API's CUDA-communicator path runs
// on machines without a GPU.  The factory gets the device init asked for
// (loomConfig_t's cudaDevice), or -1 when none was named: the "current
// device", which the factory picks.  An empty function restores CUDA.
using DeviceDriverFactory = std::function<std::unique_ptr<DeviceDriver>(int rank, int nranks, int device)>;
void setDeviceDriverFactoryForTesting(DeviceDriverFactory factory, int devices = 1);

}  // namespace loom
