// Surviving dead ranks: ranks are killed with SIGKILL (during init, between
// operations, during a large all-reduce, during the shrink itself); the survivors'
// loomCommGetAsyncError messages must name the dead, loomCommRevoke must stop
// a pending operation on another rank at once, and loomCommShrink must give
// every survivor the same membership and a communicator whose collectives
// are exact (mp-worker's shrink scenario checks each rank; this checks that
// they agree).  Each case prints one row: shrink table | case | transport |
// members | ms to error | ms in loomCommShrink.
#include "tests/shrink_case.h"

using loomtest::shrinkCase;

TEST_CASE("revoke stops a pending all-reduce on the other ranks, then all shrink without the last rank",
          "[shrink]") {
  shrinkCase("revoke", "shm,tcp", 3, {});
  shrinkCase("revoke", "tcp", 4, {});
}

TEST_CASE("survivors of a rank killed between operations name it, shrink and agree (shm)", "[shrink][shm]") {
  for (int n = 3; n <= 6; ++n) shrinkCase("between", "shm,tcp", n, {n / 2});
}

TEST_CASE("survivors of a rank killed between operations name it, shrink and agree (tcp)", "[shrink][tcp]") {
  for (int n = 3; n <= 6; ++n) shrinkCase("between", "tcp", n, {0});
}

TEST_CASE("survivors of a rank killed during a 64 MiB all-reduce shrink and agree (shm and tcp)",
          "[shrink]") {
  shrinkCase("allreduce", "shm,tcp", 4, {1}, 64 << 20);
  shrinkCase("allreduce", "tcp", 3, {2}, 64 << 20);
}

TEST_CASE("two ranks killed one after the other, the second during the shrink (shm and tcp)", "[shrink]") {
  shrinkCase("during", "shm,tcp", 5, {1, 0});
  shrinkCase("during", "tcp", 4, {3, 1});
}

TEST_CASE("a rank killed during init: the others' init fails cleanly, or they shrink and agree (shm and tcp)",
          "[shrink]") {
  // Init fails when the victim dies before the exchange completes (waiting
  // for it until the timeout: 2 s here); when it dies later, init succeeds,
  // the first all-reduce fails and the survivors shrink to an exact communicator.
  for (int n = 3; n <= 6; ++n) {
    shrinkCase("init", "shm,tcp", n, {n - 1}, 1 << 20, {"LOOM_TIMEOUT_MS=2000"});
    shrinkCase("init", "tcp", n, {n / 2}, 1 << 20, {"LOOM_TIMEOUT_MS=2000"});
  }
  shrinkCase("init", "tcp", 3, {0}, 1 << 20, {"LOOM_TIMEOUT_MS=2000"});  // the bootstrap root dies
}

TEST_CASE("a rank killed while the first operation opens the connections: the others shrink and agree (shm and tcp)",
          "[shrink]") {
  for (int n = 3; n <= 6; ++n) {
    shrinkCase("connect", "shm,tcp", n, {n - 1});
    shrinkCase("connect", "tcp", n, {n / 2});
  }
  shrinkCase("connect", "tcp", 4, {0});  // the lowest rank: the next one coordinates the shrink
  // Dead before its first operation: the others wait for connections it
  // never opens; its refusing control socket ends the wait (not the timeout).
  shrinkCase("connect0", "tcp", 4, {2});
  shrinkCase("connect0", "shm,tcp", 5, {0});
  shrinkCase("connect0", "tcp", 3, {1});
}
