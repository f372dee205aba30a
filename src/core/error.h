// Errors inside loom are C++ exceptions carrying a loomResult_t; the C entry
// points (src/api) catch them, so no exception ever crosses the C boundary.
#pragma once
#include <exception>
#include <string>
#include "loom.h"

namespace loom {

class Error : public std::exception {
 public:
  Error(loomResult_t code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  loomResult_t code() const { return code_; }
  const char* what() const noexcept override { return msg_.c_str(); }

 private:
  loomResult_t code_;
  std::string msg_;
};

// printf into a std::string.
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void fail(loomResult_t code, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));

// fail(loomSystemError, "<what>: <strerror(errno)>").
[[noreturn]] void failErrno(const char* what);

}  // namespace loom
