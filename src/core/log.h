// Logging controlled by LOOM_DEBUG (NONE|WARN|INFO|TRACE, default WARN) and
// LOOM_DEBUG_SUBSYS (comma list: INIT,BOOT,NET,SHM,COLL,TUNE or ALL).
#pragma once
#include <cstdarg>

namespace loom {

enum class LogLevel { None = 0, Warn = 1, Info = 2, Trace = 3 };

bool logEnabled(LogLevel level, const char* subsys);
void logPrint(LogLevel level, const char* subsys, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
// Rank shown in log lines of this process (set when a communicator is made).
void logSetRank(int rank);

}  // namespace loom

#define LOOM_LOG(level, subsys, ...)                                     \
  do {                                                                   \
    if (::loom::logEnabled(level, subsys)) ::loom::logPrint(level, subsys, __VA_ARGS__); \
  } while (0)
#define LOOM_WARN(subsys, ...) LOOM_LOG(::loom::LogLevel::Warn, subsys, __VA_ARGS__)
#define LOOM_INFO(subsys, ...) LOOM_LOG(::loom::LogLevel::Info, subsys, __VA_ARGS__)
#define LOOM_TRACE(subsys, ...) LOOM_LOG(::loom::LogLevel::Trace, subsys, __VA_ARGS__)
