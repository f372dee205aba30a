// Errors inside loom are C++ exceptions carrying a loomResult_t; the C entry
// points (src/api) catch them, so no exception ever crosses the C boundary.
#pragma once
#include <exception>
#include <string>
#include "loom.h"

namespace loom {

class Error : public std::exception {
 public:
  Error(loomResult_t code, std::string msg, int peer = -1) : code_(code), msg_(std::move(msg)), peer_(peer) {}
  loomResult_t code() const { return code_; }
  const char* what() const noexcept override { return msg_.c_str(); }
  // The rank whose connection broke or who aborted, when that is what failed
  // (-1 otherwise): the communicator asks that rank why (src/core/comm.cc).
  int peer() const { return peer_; }

 private:
  loomResult_t code_;
  std::string msg_;
  int peer_;
};

// printf into a std::string.
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void fail(loomResult_t code, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

// fail() for a failure seen on the connection to `peer` (it closed, aborted
// or died); the Error carries the peer so its own reason can be fetched.
[[noreturn]] void failPeer(int peer, loomResult_t code, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

// fail(loomSystemError, "<what>: <strerror(errno)>").
[[noreturn]] void failErrno(const char* what);

}  // namespace loom
