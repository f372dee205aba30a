// NVLink connections read from NVML, which is loaded at run time with dlopen
// so that loom runs (and builds) where the NVIDIA driver is absent.
#pragma once
#include <string>
#include <vector>

namespace loom {

struct NvmlLink {
  std::string gpuBusId;     // normalised "dddd:bb:dd.f"
  std::string remoteBusId;  // the GPU or NVSwitch at the other end
  int links = 0;            // active links between the two
};

// Active NVLinks of every GPU NVML sees.  Returns false (and says why) when
// NVML cannot be loaded or initialised; that is the normal case on machines
// without NVIDIA GPUs.
bool nvmlNvLinks(std::vector<NvmlLink>* out, int* gpuCount, std::string* why);

// "00000000:3B:00.0" or "0000:3b:00.0" -> "0000:3b:00.0"; "" when unparsable.
std::string normalizePciBusId(const std::string& busId);

}  // namespace loom
