#include "src/core/error.h"

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace loom {

static std::string vstrf(const char* fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  int n = vsnprintf(nullptr, 0, fmt, ap2);
  va_end(ap2);
  std::string s(n > 0 ? size_t(n) : 0, '\0');
  if (n > 0) vsnprintf(&s[0], size_t(n) + 1, fmt, ap);
  return s;
}

std::string strf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vstrf(fmt, ap);
  va_end(ap);
  return s;
}

void fail(loomResult_t code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vstrf(fmt, ap);
  va_end(ap);
  throw Error(code, std::move(s));
}

void failPeer(int peer, loomResult_t code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vstrf(fmt, ap);
  va_end(ap);
  throw Error(code, std::move(s), peer);
}

void failErrno(const char* what) {
  int e = errno;
  throw Error(loomSystemError, strf("%s: %s", what, strerror(e)));
}

}  // namespace loom
