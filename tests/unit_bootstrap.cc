// Bootstrap and init in one process: two ranks as threads, plus hostile
// connections to the root's port.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include "loom_catch.h"
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "loom.h"
#include "src/core/bootstrap.h"
#include "src/core/clock.h"
#include "src/core/socket.h"

namespace {

int connectLoopback(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

void sendBytes(int fd, const void* p, size_t n) { REQUIRE(send(fd, p, n, MSG_NOSIGNAL) == ssize_t(n)); }

}  // namespace

TEST_CASE("garbage and wrong secrets on the bootstrap port are dropped while init succeeds", "[bootstrap]") {
  setenv("LOOM_SOCKET_IFNAME", "lo", 1);
  setenv("LOOM_TIMEOUT_MS", "20000", 1);
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loom::UniqueIdData data = loom::decodeUniqueId(id);

  // Hostile clients first: garbage, a hello with the wrong secret, a
  // truncated hello, and one that connects and says nothing.
  std::vector<int> fds;
  int g = connectLoopback(data.port);
  char junk[300];
  for (size_t i = 0; i < sizeof junk; ++i) junk[i] = char(i * 7 + 3);
  sendBytes(g, junk, sizeof junk);
  fds.push_back(g);
  int w = connectLoopback(data.port);
  struct { uint32_t magic, version; uint8_t secret[16]; int32_t rank, nranks; } hello{0x4c4d4a4e, 1, {}, 1, 2};
  memset(hello.secret, 0xab, 16);
  sendBytes(w, &hello, sizeof hello);
  fds.push_back(w);
  int t = connectLoopback(data.port);
  sendBytes(t, &hello, 7);
  close(t);
  fds.push_back(connectLoopback(data.port));

  loomComm_t comms[2] = {nullptr, nullptr};
  loomResult_t res[2] = {loomInternalError, loomInternalError};
  int64_t start = loom::nowMs();
  std::thread r0([&] { res[0] = loomCommInitRank(&comms[0], 2, id, 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::thread r1([&] { res[1] = loomCommInitRank(&comms[1], 2, id, 1); });
  r0.join();
  r1.join();
  CHECK(res[0] == loomSuccess);
  CHECK(res[1] == loomSuccess);
  CHECK(loom::nowMs() - start < 5000);  // hostile clients did not stall init
  for (int fd : fds) close(fd);
  REQUIRE(comms[0]);
  REQUIRE(comms[1]);

  // The communicator works: an all-reduce between the two threads.
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  std::thread t0([&] { res[0] = loomAllReduce(a.data(), a.data(), a.size(), loomFloat32, loomSum, comms[0], nullptr); });
  std::thread t1([&] { res[1] = loomAllReduce(b.data(), b.data(), b.size(), loomFloat32, loomSum, comms[1], nullptr); });
  t0.join();
  t1.join();
  CHECK(res[0] == loomSuccess);
  CHECK(res[1] == loomSuccess);
  CHECK(a[999] == 3.0f);
  CHECK(b[0] == 3.0f);
  CHECK(loomCommDestroy(comms[0]) == loomSuccess);
  CHECK(loomCommDestroy(comms[1]) == loomSuccess);
  unsetenv("LOOM_SOCKET_IFNAME");
}

TEST_CASE("the bootstrap port derived from a job id stays below Linux's ephemeral ports and is the same for every rank",
          "[bootstrap]") {
  // Outgoing connections take their local ports from 32768-60999 by
  // default; a derived port in there can be held by one (mpirun's own), and
  // rank 0's bind then fails.
  int lo = 65536, hi = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string job = "ompi:" + std::to_string(i * 7919) + "@job" + std::to_string(i);
    const int port = loom::bootstrapPortForJob(job);
    lo = std::min(lo, port), hi = std::max(hi, port);
    REQUIRE(port == loom::bootstrapPortForJob(job));
  }
  CHECK(lo >= 20000);
  CHECK(hi <= 32767);
  CHECK(hi - lo > 10000);  // spread over the range, not a handful of ports
}

TEST_CASE("a bootstrap port another process holds fails init from the environment naming it and the way out",
          "[bootstrap]") {
  int holder = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(holder >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(holder, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(listen(holder, 1) == 0);
  socklen_t len = sizeof a;
  REQUIRE(getsockname(holder, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string root = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  setenv("LOOM_RANK", "0", 1);
  setenv("LOOM_WORLD_SIZE", "2", 1);
  setenv("LOOM_ROOT_ADDR", root.c_str(), 1);
  loomComm_t comm = nullptr;
  CHECK(loomCommInitFromEnv(&comm) == loomSystemError);
  const std::string msg = loomGetLastError(nullptr);
  INFO(msg);
  CHECK(msg.find("cannot open the bootstrap port " + root) != std::string::npos);
  CHECK(msg.find("LOOM_ROOT_PORT") != std::string::npos);
  CHECK(comm == nullptr);
  unsetenv("LOOM_RANK");
  unsetenv("LOOM_WORLD_SIZE");
  unsetenv("LOOM_ROOT_ADDR");
  close(holder);
}

TEST_CASE("loopback and unspecified addresses are never advertised to other hosts", "[bootstrap]") {
  // A rank sharing the root's loopback domain sees the root on 127.0.0.1;
  // init must not advertise that (ranks on other hosts could not reach it).
  for (const char* local : {"127.0.0.1", "127.3.2.1", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1"}) {
    INFO(local);
    CHECK(loom::isLocalOnly(loom::resolveAddr(local, 1)));
  }
  for (const char* remote : {"10.77.0.1", "192.168.1.2", "128.0.0.1", "fe80::1", "2001:db8::1", "::ffff:10.0.0.1"}) {
    INFO(remote);
    CHECK_FALSE(loom::isLocalOnly(loom::resolveAddr(remote, 1)));
  }
}

TEST_CASE("init with a missing rank times out with a message naming it", "[bootstrap]") {
  setenv("LOOM_SOCKET_IFNAME", "lo", 1);
  setenv("LOOM_TIMEOUT_MS", "800", 1);
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comm = nullptr;
  int64_t start = loom::nowMs();
  loomResult_t r = loomCommInitRank(&comm, 3, id, 0);
  CHECK(r == loomTimeout);
  CHECK(comm == nullptr);
  CHECK(loom::nowMs() - start < 5000);
  std::string msg = loomGetLastError(nullptr);
  CHECK(msg.find("missing: 1 2") != std::string::npos);
  unsetenv("LOOM_SOCKET_IFNAME");
  setenv("LOOM_TIMEOUT_MS", "600000", 1);
}

TEST_CASE("error strings name every result code", "[api]") {
  for (int r = 0; r < loomNumResults; ++r) CHECK(std::strlen(loomGetErrorString(loomResult_t(r))) > 3);
  int v = 0;
  CHECK(loomGetVersion(&v) == loomSuccess);
  CHECK(v == LOOM_VERSION_CODE);
  CHECK(loomGetVersion(nullptr) == loomInvalidArgument);
}

TEST_CASE("unused unique ids hold at most 64 listening descriptors, and an id whose listener was closed still works",
          "[bootstrap]") {
  auto fds = [] {
    int n = 0;
    for (int fd = 0; fd < 4096; ++fd) n += fcntl(fd, F_GETFD) >= 0;
    return n;
  };
  loomUniqueId first;
  REQUIRE(loomGetUniqueId(&first) == loomSuccess);
  const int before = fds();
  for (int i = 0; i < 300; ++i) {
    loomUniqueId id;
    REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  }
  CHECK(fds() - before <= 64);  // was one more per id, for good
  // `first` lost its listener long ago: rank 0 binds the port again.
  loomComm_t c[2] = {nullptr, nullptr};
  loomResult_t rc[2];
  std::thread t([&] { rc[1] = loomCommInitRank(&c[1], 2, first, 1); });
  rc[0] = loomCommInitRank(&c[0], 2, first, 0);
  t.join();
  INFO(loomGetLastError(nullptr));
  CHECK(rc[0] == loomSuccess);
  CHECK(rc[1] == loomSuccess);
  for (loomComm_t x : c)
    if (x) loomCommDestroy(x);
}
