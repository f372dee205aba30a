// Finding CUDA at run time.  libloom.so links no CUDA library: the first
// question about CUDA loads the plug-in libloom_cuda.so (built where nvcc
// is found, src/device/cuda/) next to libloom, in ../lib from the program,
// or through the library path.  Without it, or without a driver, or when
// cudaGetDeviceCount fails (a machine with the toolkit but no GPU), the
// process has zero CUDA devices and every buffer is host memory.
#pragma once
#include <string>

#include "src/device/cuda_api.h"

namespace loom {

// The plug-in's table, or nullptr with the reason in *why.  Loaded once.
const CudaApi* cudaPlugin(std::string* why);

// CUDA devices this process can use; 0, with the reason in *why, if none.
int cudaDeviceCount(std::string* why);

// The CUDA device whose memory `p` points into, or -1 for host memory (and
// whenever the process has no CUDA device: nothing is asked then).
int cudaPointerDevice(const void* p);

// Whether `stream` (a cudaStream_t; null: the legacy stream) is being
// captured into a CUDA graph.  False when the process has no CUDA device.
// loomUnhandledCudaError if CUDA cannot say.
bool cudaStreamCapturing(void* stream);
// The same in detail: 0 none, 1 `stream` is being captured, 2 it is the
// legacy stream while a blocking stream of its device is being captured
// (cudaErrorStreamCaptureImplicit; nothing may
// be enqueued on it then: that would invalidate the capture).
int cudaStreamCaptureState(void* stream);
// cudaStreamCaptureState for a stream loom is about to enqueue on: 0 or 1,
// or loomInvalidUsage for 2 (the legacy stream during a capture of a
// blocking stream, any thread's and any mode's:
// global-mode capture) with the reason.
int usableCaptureState(void* stream);
// Makes the calling thread's CUDA calls relaxed about graph captures
// (cudaThreadExchangeStreamCaptureMode): for loom's own threads, once each,
// so that their calls never invalidate another thread's global-mode
// capture.  Nothing when the process has no CUDA device.
void relaxCudaCaptureModeOnThisThread();
// Tests only: answer cudaStreamCapturing with fn (nonzero: capturing)
// instead of CUDA (nullptr: CUDA again).
void setCudaCaptureProbeForTesting(int (*fn)(void*));

// Tests only: classify pointers with fn instead of CUDA (nullptr: CUDA
// again), so that the API's handling of device pointers is tested on
// machines without a GPU.
void setCudaPointerClassifierForTesting(int (*fn)(const void*));

}  // namespace loom
