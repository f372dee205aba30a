// loomMemAlloc / loomMemFree on a process whose communicators run on CUDA
// (LOOM_DEVICE=cuda, or auto with a GPU): device memory of the current
// device, as ncclMemAlloc gives, allocated through the DeviceDriver (so the
// tests' simulated device stands in for CUDA).  It is cudaMalloc'd, so the
// communicator's cuda_ipc export (cuMemGetAddressRange for the base, then
// cudaIpcGetMemHandle) works on any buffer inside it.
#pragma once
#include <cstddef>
#include <functional>

namespace loom {

// Device memory of `bytes` (not zeroed, as cudaMalloc), or nullptr when
// LOOM_DEVICE says the host (the caller then gives host memory).  Throws
// loom::Error: loomInvalidArgument for size 0, loomInvalidUsage when
// LOOM_DEVICE=cuda has no usable device (the reason, as communicator init
// gives it), loomUnhandledCudaError with CUDA's message.  On the current
// CUDA device, or on `device` when it is >= 0 (loomCommMemAlloc: a CUDA
// communicator's own, whatever the calling thread has current).
void* deviceMemAlloc(size_t bytes, int device = -1);
// Frees `ptr` and returns true if deviceMemAlloc returned it (and it is
// still live); false otherwise, touching nothing.
bool deviceMemFree(void* ptr);
// Live allocations of deviceMemAlloc (tests).
size_t deviceMemLive();
// Whether [p, p + bytes) lies inside one live allocation of deviceMemAlloc
// (*base: its start).  Device zero-copy publishes only such memory: its
// free goes through deviceMemFree, which first has every peer unmap it
// (CUDA: freeing memory an importer still has open is undefined).
bool deviceMemFind(const void* p, size_t bytes, void** base);
// Called by deviceMemFree with an allocation's base before it is freed
// (a communicator that published it has its peers unmap it).  Returns an
// id for removeDeviceMemFreeHook, which waits for a call in progress.
int addDeviceMemFreeHook(std::function<void(void* base)> hook);
void removeDeviceMemFreeHook(int id);

}  // namespace loom
