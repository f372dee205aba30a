// Surviving dead ranks: ranks are killed with SIGKILL (between operations,
// during a large all-reduce, during the shrink itself); the survivors'
// loomCommGetAsyncError messages must name the dead, loomCommRevoke must stop
// a pending operation on another rank at once, and loomCommShrink must give
// every survivor the same membership and a communicator whose collectives
// are exact (mp-worker's shrink scenario checks each rank; this checks that
// they agree).  Each case prints one row: shrink table | case | transport |
// members | ms to error | ms in loomCommShrink.
#include <dirent.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "tests/proc_util.h"

namespace {

std::set<std::string> shmNames() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

// Runs n ranks of `mp-worker shrink mode victims` and checks what the survivors agreed on.
void shrinkCase(const std::string& mode, const std::string& transports, int n, const std::vector<int>& victims,
                size_t bytes = 1 << 20) {
  std::set<std::string> before = shmNames();
  char dirTemplate[] = "/tmp/loom-shrink-XXXXXX";
  REQUIRE(mkdtemp(dirTemplate) != nullptr);
  std::string dir = dirTemplate;
  std::string vlist;
  for (int v : victims) vlist += (vlist.empty() ? "" : ",") + std::to_string(v);
  if (vlist.empty()) vlist = "0";
  bool timedOut = false;
  auto res = loomtest::spawnRanks(n, {"shrink", mode, vlist, std::to_string(bytes), dir},
                                  {"LOOM_TRANSPORTS=" + transports, "LOOM_TIMEOUT_MS=5000"}, 60, &timedOut);
  CHECK_FALSE(timedOut);
  std::set<int> dead(victims.begin(), victims.end());
  if (mode == "revoke") dead.clear();
  std::string expected;
  for (int r = 0; r < n; ++r)
    if (!dead.count(r) && !(mode == "revoke" && r == n - 1)) expected += (expected.empty() ? "" : ",") + std::to_string(r);
  std::string times, shrinks;
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << " of " << n << ", " << mode << ", " << transports);
    std::string path = dir + "/rank" + std::to_string(r);
    unlink((dir + "/killed" + std::to_string(r)).c_str());
    if (dead.count(r)) {
      CHECK(res[size_t(r)].signal == SIGKILL);
      continue;
    }
    CHECK(res[size_t(r)].exited);
    CHECK(res[size_t(r)].code == 0);
    if (mode == "revoke" && r == n - 1) continue;  // excluded: got NULL (the worker checks it)
    std::ifstream f(path);
    std::string line;
    REQUIRE(std::getline(f, line));
    unlink(path.c_str());
    std::stringstream ss(line);
    std::string members, detect, shrinkMs, doneAt, message;
    std::getline(ss, members, '|');
    std::getline(ss, detect, '|');
    std::getline(ss, shrinkMs, '|');
    std::getline(ss, doneAt, '|');
    std::getline(ss, message);
    INFO("error: " << message);
    // Every survivor ends with the same membership: the ranks that are left.
    CHECK(members == expected);
    // Revoke reaches a pending operation long before the 5 s timeout.
    if (mode == "revoke" && r != 0) CHECK(atof(detect.c_str()) < 2000);
    CHECK(atof(shrinkMs.c_str()) < 10000);
    times += " " + std::to_string(int(atof(detect.c_str())));
    shrinks += " " + std::to_string(int(atof(shrinkMs.c_str())));
  }
  rmdir(dir.c_str());
  for (const std::string& name : shmNames()) {
    INFO("left in /dev/shm: " << name);
    CHECK(before.count(name) == 1);
  }
  printf("shrink table | %s, victims %s of %d | %s | members %s | error ms%s | shrink ms%s\n", mode.c_str(),
         vlist.c_str(), n, transports.c_str(), expected.c_str(), times.c_str(), shrinks.c_str());
  fflush(stdout);
}

}  // namespace

TEST_CASE("revoke stops a pending all-reduce on the other ranks; all shrink without the last rank", "[shrink]") {
  shrinkCase("revoke", "shm,tcp", 3, {});
  shrinkCase("revoke", "tcp", 4, {});
}

TEST_CASE("a rank killed between operations: survivors name it, shrink and agree (shm)", "[shrink][shm]") {
  for (int n = 3; n <= 6; ++n) shrinkCase("between", "shm,tcp", n, {n / 2});
}

TEST_CASE("a rank killed between operations: survivors name it, shrink and agree (tcp)", "[shrink][tcp]") {
  for (int n = 3; n <= 6; ++n) shrinkCase("between", "tcp", n, {0});
}

TEST_CASE("a rank killed during a 64 MiB all-reduce: survivors shrink and agree (shm and tcp)", "[shrink]") {
  shrinkCase("allreduce", "shm,tcp", 4, {1}, 64 << 20);
  shrinkCase("allreduce", "tcp", 3, {2}, 64 << 20);
}

TEST_CASE("two ranks killed one after the other, the second during the shrink (shm and tcp)", "[shrink]") {
  shrinkCase("during", "shm,tcp", 5, {1, 0});
  shrinkCase("during", "tcp", 4, {3, 1});
}
