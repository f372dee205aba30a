#include "src/core/log.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "src/core/config.h"

namespace loom {

static std::atomic<int> gRank{-1};

void logSetRank(int rank) { gRank.store(rank); }

static LogLevel configuredLevel() {
  static const LogLevel level = [] {
    const std::string& v = logConfig().level;
    if (v == "NONE") return LogLevel::None;
    if (v == "INFO") return LogLevel::Info;
    if (v == "TRACE") return LogLevel::Trace;
    return LogLevel::Warn;
  }();
  return level;
}

bool logEnabled(LogLevel level, const char* subsys) {
  if (level > configuredLevel()) return false;
  if (level == LogLevel::Warn) return true;
  const std::string& subs = logConfig().subsys;
  if (subs.empty() || subs == "ALL") return true;
  size_t n = strlen(subsys);
  for (size_t pos = 0; pos <= subs.size();) {
    size_t end = subs.find(',', pos);
    if (end == std::string::npos) end = subs.size();
    if (end - pos == n && subs.compare(pos, n, subsys) == 0) return true;
    pos = end + 1;
  }
  return false;
}

void logPrint(LogLevel level, const char* subsys, const char* fmt, ...) {
  static const char* names[] = {"", "WARN", "INFO", "TRACE"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char line[1200];
  int n = snprintf(line, sizeof line, "loom %d:%d %s %s %s\n", int(getpid()), gRank.load(),
                   names[int(level)], subsys, msg);
  if (n > int(sizeof line) - 1) n = sizeof line - 1;
  // One write per line so lines of concurrent ranks do not interleave.
  ssize_t w = write(2, line, size_t(n));
  (void)w;
}

}  // namespace loom
