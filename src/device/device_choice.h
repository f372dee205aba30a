// Which device a new communicator runs on (LOOM_DEVICE).
#pragma once

namespace loom {

// Called by every communicator init before anything else is set up: throws
// loomInvalidUsage with the reason unless the communicator can run on the
// device LOOM_DEVICE names.  Today that is the host only: LOOM_DEVICE=cuda
// says why not (no usable GPU, with CUDA's own reason, or no CUDA
// communicators yet).  Also loads the CUDA plug-in, if there is one.
void checkDeviceChoice();

}  // namespace loom
