// Error handling of the trainer: a failed loom call or a bad input ends the
// rank with a message; loom-run then stops the other ranks.
#pragma once
#include <cstdio>
#include <cstdlib>

#include "include/loom.h"

#define TRAINER_CHECK_LOOM(call)                                                          \
  do {                                                                                    \
    loomResult_t r_ = (call);                                                             \
    if (r_ != loomSuccess) {                                                              \
      fprintf(stderr, "loom-trainer: %s failed: %s: %s\n", #call, loomGetErrorString(r_), \
              loomGetLastError(nullptr));                                                 \
      exit(3);                                                                            \
    }                                                                                     \
  } while (0)

[[noreturn]] inline void trainerFail(const char* what) {
  fprintf(stderr, "loom-trainer: %s\n", what);
  exit(2);
}
