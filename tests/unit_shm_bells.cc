// The shm transport's bells (transports/shm): a rank sleeping in poll()
// (shm together with tcp sockets) is woken by a datagram on its wake-up
// socket.  The kernel charges every unread datagram to the socket that sent
// it, and a send buffer holds only a few hundred, so idle inboxes with
// leftover bells must not silence the bells of other communicators.  Two
// ranks as one process's transports, driven through the plug-in interface.
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "loom_catch.h"
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transports/shm/shm_transport.h"

namespace {

// One communicator's two shm transports (ranks 0 and 1 of this process).
struct Pair {
  std::unique_ptr<loom::Transport> t[2];
  explicit Pair(uint64_t tag) {
    loom::TransportEnv env;
    env.nranks = 2;
    env.commTag = tag;
    env.slotBytes = 4096;
    env.slots = 4;
    env.maxChannels = 1;
    env.windowBytes = 4096;
    env.hostId = {"h", "h"};
    env.localKey = {1, 1};
    env.pid = {int32_t(getpid()), int32_t(getpid())};
    std::vector<std::vector<uint8_t>> rec(2);
    for (int r = 0; r < 2; ++r) {
      t[r] = loom::makeShmTransport();
      env.rank = r;
      rec[size_t(r)].resize(t[r]->recordBytes());
      t[r]->publish(env, {r != 0, r != 1}, rec[size_t(r)].data());
    }
    for (int r = 0; r < 2; ++r) {
      std::string why;
      REQUIRE(t[r]->accept(1 - r, rec[size_t(1 - r)].data(), &why));
      t[r]->serve({r != 0, r != 1});
    }
  }
};

}  // namespace

TEST_CASE("shm bells: idle inboxes full of unread bells do not silence another communicator's bell", "[shm]") {
  const uint64_t base = uint64_t(getpid()) << 20;
  // 40 communicators whose rank 0 said it sleeps in poll() and then never
  // looked again: rank 1 rings it until its queue is full (10 by default).
  // 400 unread datagrams: more than one socket's send buffer holds.
  std::vector<std::unique_ptr<Pair>> idle;
  for (int i = 0; i < 40; ++i) {
    idle.push_back(std::make_unique<Pair>(base + uint64_t(i)));
    idle.back()->t[0]->doorbell()->begin(true);
    for (int k = 0; k < 20; ++k) idle.back()->t[1]->peerMemory()->wake(0);
  }
  // Another communicator: rank 0 sleeps in poll() (on a descriptor that
  // never fires, as a tcp socket would be), rank 1 rings once.
  Pair live(base + 100);
  loom::Doorbell* bell = live.t[0]->doorbell();
  const uint32_t token = bell->begin(true);
  live.t[1]->peerMemory()->wake(0);
  int quiet = eventfd(0, EFD_CLOEXEC);
  REQUIRE(quiet >= 0);
  std::vector<pollfd> fds{{quiet, POLLIN, 0}};
  const auto t0 = std::chrono::steady_clock::now();
  bell->sleep(token, fds, 5 * 1000 * 1000);  // 5 s unless the bell wakes it
  bell->end();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  close(quiet);
  {
    INFO("slept " << ms << " ms");
    CHECK(ms < 2500);  // woken by the bell, not by the 5 s timeout
  }

  // Leftover bells from before a sleep are dropped when the next one
  // begins: the idle ones' queues empty as soon as they sleep again.
  for (auto& p : idle) {
    loom::Doorbell* b = p->t[0]->doorbell();
    const uint32_t tk = b->begin(true);
    std::vector<pollfd> none{{-1, 0, 0}};  // poll() ignores a negative descriptor
    const auto s0 = std::chrono::steady_clock::now();
    b->sleep(tk, none, 20 * 1000);  // nothing rang since begin(): sleeps the 20 ms
    b->end();
    const double slept = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
    INFO("slept " << slept << " ms");
    CHECK(slept >= 15);
  }
}
