// Error handling of the trainer: a failed loom call or a bad input ends the
// rank with a message; loom-run then stops the other ranks.  In elastic mode
// (--elastic) a failed loom call instead revokes the communicator (so that
// every operation still pending on it returns at once) and throws
// LoomFailure, which the elastic loop in trainer_main.cc catches: it shrinks
// the communicator to the survivors and continues.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "include/loom.h"

namespace trainer {

struct LoomFailure : std::runtime_error {
  loomResult_t code;
  LoomFailure(loomResult_t c, const std::string& what) : std::runtime_error(what), code(c) {}
};

// Elastic mode: the communicator a failure revokes (nullptr: not elastic).
inline loomComm_t& elasticComm() {
  static loomComm_t comm = nullptr;
  return comm;
}

[[noreturn]] inline void loomCallFailed(const char* call, loomResult_t r) {
  std::string why = std::string(call) + " failed: " + loomGetErrorString(r) + ": " + loomGetLastError(nullptr);
  if (loomComm_t c = elasticComm()) {
    std::string more = loomGetLastError(c);
    loomCommRevoke(c);
    throw LoomFailure(r, why + (more.empty() ? "" : " (" + more + ")"));
  }
  fprintf(stderr, "loom-trainer: %s\n", why.c_str());
  exit(3);
}

}  // namespace trainer

#define TRAINER_CHECK_LOOM(call)                                 \
  do {                                                           \
    loomResult_t r_ = (call);                                    \
    if (r_ != loomSuccess) ::trainer::loomCallFailed(#call, r_); \
  } while (0)

[[noreturn]] inline void trainerFail(const char* what) {
  fprintf(stderr, "loom-trainer: %s\n", what);
  exit(2);
}
