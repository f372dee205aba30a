// LOOM_DEVICE at communicator init (device_choice.h).
#include "src/device/device_choice.h"

#include <string>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/device/cuda_loader.h"

namespace loom {

void checkDeviceChoice() {
  // Loads the CUDA plug-in now (about 0.3 ms on the dev VM), not in the
  // first collective, which asks it where each buffer lives.
  std::string why;
  const int devices = cudaDeviceCount(&why);
  const std::string& d = config().device;
  if (d.empty() || d == "host") return;
  if (d != "cuda") fail(loomInvalidUsage, "LOOM_DEVICE=%s: expected host or cuda", d.c_str());
  if (devices == 0)
    fail(loomInvalidUsage, "LOOM_DEVICE=cuda, but this process has no usable CUDA device: %s", why.c_str());
  fail(loomInvalidUsage,
       "LOOM_DEVICE=cuda: CUDA communicators are not implemented yet (the stream programs they will run are; "
       "docs/design.md); use LOOM_DEVICE=host");
}

}  // namespace loom
