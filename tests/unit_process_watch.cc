// ProcessWatch (src/core/process_watch.h): one pidfd per watched process,
// shared by every communicator of this one, and a dead process's watch
// never handed out again.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "loom_catch.h"
#include <chrono>
#include <thread>

#include "src/core/process_watch.h"

using loom::ProcessWatch;

namespace {

// A child that sleeps until killed.
pid_t sleeper() {
  pid_t pid = fork();
  if (pid == 0) {
    for (;;) pause();
  }
  REQUIRE(pid > 0);
  return pid;
}

bool becomesDead(const ProcessWatch& w) {
  for (int i = 0; i < 2000 && !w.dead(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return w.dead();
}

}  // namespace

TEST_CASE("watches of one process share one watch (and one descriptor) while any lives", "[watch]") {
  const size_t base = loom::processWatchCount();
  pid_t child = sleeper();
  auto a = ProcessWatch::of(child);
  auto b = ProcessWatch::of(child);
  CHECK(a.get() == b.get());
  CHECK(a->pid() == child);
  CHECK(a->exact());  // the dev and CI kernels have pidfd_open
  CHECK_FALSE(a->dead());
  CHECK(loom::processWatchCount() == base + 1);
  auto self = ProcessWatch::of(getpid());
  CHECK(loom::processWatchCount() == base + 2);
  CHECK_FALSE(self->dead());
  a.reset();
  CHECK(loom::processWatchCount() == base + 2);  // b keeps it
  b.reset();
  self.reset();
  CHECK(loom::processWatchCount() == base);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
}

TEST_CASE("a watch sees its process die, zombie or reaped, and a dead watch is not handed out again", "[watch]") {
  const size_t base = loom::processWatchCount();
  pid_t child = sleeper();
  auto w = ProcessWatch::of(child);
  kill(child, SIGKILL);
  CHECK(becomesDead(*w));  // not reaped yet: a zombie is dead
  // Its pid could be another process's by now (once reaped): a fresh watch.
  auto again = ProcessWatch::of(child);
  CHECK(again.get() != w.get());
  CHECK(again->dead());
  CHECK(loom::processWatchCount() == base + 1);  // the cache holds the newer one
  // Destroying the older watch leaves the newer one's entry in place.
  w.reset();
  CHECK(loom::processWatchCount() == base + 1);
  waitpid(child, nullptr, 0);
  CHECK(again->dead());
  auto late = ProcessWatch::of(child);  // no such process now: kill() says so
  CHECK(late->dead());
  again.reset();
  late.reset();
  CHECK(loom::processWatchCount() == base);
}
