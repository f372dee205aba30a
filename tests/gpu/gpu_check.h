// The GPU suite's checks: a failed CUDA or loom call prints where and why
// and ends the process (exit 3), which tests/gpu/run.sh reports as a failure.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "loom.h"

#define CK(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(3);                                                                                \
    }                                                                                              \
  } while (0)

#define LK(call)                                                                                     \
  do {                                                                                               \
    loomResult_t r_ = (call);                                                                        \
    if (r_ != loomSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, loomGetErrorString(r_), \
                   loomGetLastError(nullptr));                                                       \
      std::exit(3);                                                                                  \
    }                                                                                                \
  } while (0)
