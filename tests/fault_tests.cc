// Fault tests: a rank is killed with SIGKILL during init, in the middle of a
// 64 MiB all-reduce or all-to-all, or between two operations, over shm and
// over tcp.
// Every surviving rank must return loomRemoteError or loomTimeout within the
// timeout, loomCommAbort must return promptly, and /dev/shm must be left as
// it was.  Each case prints one row of the fault table (fault | transport |
// what each surviving rank returned | time to error | abort | leftovers).
#include <dirent.h>
#include <unistd.h>

#include "loom_catch.h"
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "include/loom.h"
#include "tests/mp_common.h"
#include "tests/proc_util.h"

namespace {

std::set<std::string> devShm() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

struct Survivor {
  bool found = false;
  std::string call;
  int code = -1;
  double ms = 0, abortMs = 0;
  std::string message;
};

Survivor readSurvivor(const std::string& path) {
  Survivor s;
  std::ifstream f(path);
  std::string line;
  if (!std::getline(f, line)) return s;
  std::stringstream ss(line);
  std::string code, ms, abortMs;
  std::getline(ss, s.call, '|');
  std::getline(ss, code, '|');
  std::getline(ss, ms, '|');
  std::getline(ss, abortMs, '|');
  std::getline(ss, s.message);
  s.code = atoi(code.c_str());
  s.ms = atof(ms.c_str());
  s.abortMs = atof(abortMs.c_str());
  s.found = true;
  return s;
}

const char* shortName(int code) {
  switch (code) {
    case loomSuccess: return "success";
    case loomRemoteError: return "loomRemoteError";
    case loomTimeout: return "loomTimeout";
    case loomSystemError: return "loomSystemError";
    case loomInvalidUsage: return "loomInvalidUsage";
    case loomInternalError: return "loomInternalError";
    default: return "other";
  }
}

// Kills `victim` of n ranks at `phase` (init, allreduce, alltoall, between) and checks
// every other rank.  timeoutMs is LOOM_TIMEOUT_MS.
void killRank(const std::string& phase, const std::string& transports, int n, int victim, int timeoutMs) {
  std::set<std::string> before = devShm();
  char dirTemplate[] = "/tmp/loom-fault-XXXXXX";
  REQUIRE(mkdtemp(dirTemplate) != nullptr);
  std::string dir = dirTemplate;
  bool timedOut = false;
  auto res = loomtest::spawnRanks(
      n, {"fault", phase, std::to_string(victim), std::to_string(64 << 20), dir},
      {"LOOM_TRANSPORTS=" + transports, "LOOM_TIMEOUT_MS=" + std::to_string(timeoutMs)}, 120, &timedOut);
  CHECK_FALSE(timedOut);
  std::string returned, times, aborts;
  double worst = 0, worstAbort = 0;
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    if (r == victim) {
      CHECK(res[size_t(r)].signal == SIGKILL);
      continue;
    }
    Survivor s = readSurvivor(dir + "/rank" + std::to_string(r));
    unlink((dir + "/rank" + std::to_string(r)).c_str());
    REQUIRE(s.found);
    INFO(s.call << " returned " << s.code << " after " << s.ms << " ms: " << s.message);
    CHECK(res[size_t(r)].exited);
    CHECK(res[size_t(r)].code == 0);
    CHECK((s.code == loomRemoteError || s.code == loomTimeout));
    // Within the timeout (plus a margin for a loaded machine).
    CHECK(s.ms < timeoutMs + 3000);
    // Abort never waits for peers.
    CHECK(s.abortMs < 1000);
    returned += loomtest::strf(" %d:%s", r, shortName(s.code));
    times += loomtest::strf(" %.0f", s.ms);
    aborts += loomtest::strf(" %.1f", s.abortMs);
    worst = std::max(worst, s.ms);
    worstAbort = std::max(worstAbort, s.abortMs);
  }
  rmdir(dir.c_str());
  std::string leftovers;
  for (const std::string& name : devShm()) {
    INFO("left in /dev/shm: " << name);
    CHECK(before.count(name) == 1);
    if (!before.count(name)) leftovers += " " + name;
  }
  printf("fault table | kill rank %d of %d %s | %s | rank:result%s | ms%s | abort ms%s | %s\n", victim, n,
         phase.c_str(), transports.c_str(), returned.c_str(), times.c_str(), aborts.c_str(),
         leftovers.empty() ? "/dev/shm clean" : leftovers.c_str());
  fflush(stdout);
}

}  // namespace

TEST_CASE("a rank killed during init fails the others' init cleanly (shm and tcp)", "[fault]") {
  const char* transports = GENERATE("shm,tcp", "tcp");
  killRank("init", transports, 3, 1, 5000);
}

TEST_CASE("a rank killed during a 64 MiB all-reduce fails the others cleanly (shm)", "[fault][shm]") {
  int n = GENERATE(2, 4);
  killRank("allreduce", "shm,tcp", n, 1, 20000);
}

TEST_CASE("a rank killed during a 64 MiB all-reduce fails the others cleanly (tcp)", "[fault][tcp]") {
  killRank("allreduce", "tcp", 3, 2, 20000);
}

TEST_CASE("a rank killed during a 64 MiB all-to-all fails the others cleanly (shm and tcp)", "[fault][exchange]") {
  std::string transports = GENERATE("shm,tcp", "tcp");
  killRank("alltoall", transports, 4, 2, 20000);
}

TEST_CASE("a rank killed between operations fails the others' next operation cleanly (shm and tcp)", "[fault]") {
  const char* transports = GENERATE("shm,tcp", "tcp");
  killRank("between", transports, 3, 1, 20000);
}

TEST_CASE("loomCommDump, LOOM_DUMP_SIGNAL and the timeout message name the operation and the late peer", "[fault][dump]") {
  const char* transports = GENERATE("shm,tcp", "tcp");
  INFO("LOOM_TRANSPORTS=" << transports);
  CHECK(loomtest::loomRun(std::string("LOOM_TRANSPORTS=") + transports + " LOOM_TIMEOUT_MS=2500 LOOM_DUMP_SIGNAL=10",
                          2, "dump", 60) == 0);
}
