// Fault tests: a rank dies (SIGKILL) in the middle of a 64 MiB all-reduce;
// the others must return an error (not hang) and leave nothing in /dev/shm.
#include <dirent.h>

#include <catch2/catch.hpp>
#include <set>
#include <string>

#include "tests/proc_util.h"

static std::set<std::string> devShm() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

static void killDuringAllReduce(const std::string& transports, int n, int victim) {
  std::set<std::string> before = devShm();
  bool timedOut = false;
  auto res = loomtest::spawnRanks(n, {"crash", std::to_string(victim), std::to_string(64 << 20)},
                                  {"LOOM_TRANSPORTS=" + transports, "LOOM_TIMEOUT_MS=30000"}, 90, &timedOut);
  CHECK_FALSE(timedOut);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    if (r == victim) {
      CHECK(res[size_t(r)].signal == SIGKILL);
    } else {
      CHECK(res[size_t(r)].exited);
      CHECK(res[size_t(r)].code == 0);  // it saw remote error / timeout, as expected
    }
  }
  std::set<std::string> after = devShm();
  for (const std::string& name : after) {
    INFO("left in /dev/shm: " << name);
    CHECK(before.count(name) == 1);
  }
}

TEST_CASE("killing a rank during a 64 MiB all-reduce over shm fails the others cleanly", "[fault][shm]") {
  int n = GENERATE(2, 4);
  killDuringAllReduce("shm,tcp", n, 1);
}

TEST_CASE("killing a rank during a 64 MiB all-reduce over tcp fails the others cleanly", "[fault][tcp]") {
  killDuringAllReduce("tcp", 3, 2);
}
