// Bootstrap and init in one process: two ranks as threads, plus hostile
// connections to the root's port.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <catch2/catch.hpp>
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

namespace {

// A listener on a free port of 127.0.0.1 without SO_REUSEADDR: while it is
// open, nobody else can bind the port.
int holdFreePort(uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(listen(fd, 16) == 0);
  socklen_t len = sizeof a;
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  *port = ntohs(a.sin_port);
  return fd;
}

// Rank 0 from the environment (this thread), rank 1 from the same id by hand
// (another thread), then one all-reduce; returns rank 0's result.
loomResult_t initPairFromEnv(const std::string& root, std::string* err) {
  const char* hex = "00112233445566778899aabbccddeeff";
  uint8_t secret[16];
  for (int i = 0; i < 16; ++i) secret[i] = uint8_t(std::stoi(std::string(hex + 2 * i, 2), nullptr, 16));
  setenv("LOOM_RANK", "0", 1);
  setenv("LOOM_WORLD_SIZE", "2", 1);
  setenv("LOOM_ROOT_ADDR", root.c_str(), 1);
  setenv("LOOM_SECRET", hex, 1);
  loomComm_t c1 = nullptr;
  loomResult_t r1 = loomInternalError;
  std::string err1;
  std::thread t([&] {
    r1 = loomCommInitRank(&c1, 2, loom::uniqueIdFor(root, secret), 1);
    if (r1 != loomSuccess) err1 = std::string(" rank 1: ") + loomGetLastError(nullptr);
  });
  err->clear();
  loomComm_t c0 = nullptr;
  loomResult_t r0 = loomCommInitFromEnv(&c0);
  if (r0 != loomSuccess) *err = loomGetLastError(nullptr);
  t.join();
  *err += err1;
  if (!err->empty()) UNSCOPED_INFO(*err);
  for (const char* v : {"LOOM_RANK", "LOOM_WORLD_SIZE", "LOOM_ROOT_ADDR", "LOOM_SECRET"}) unsetenv(v);
  if (r0 != loomSuccess || r1 != loomSuccess) {
    if (c0) loomCommDestroy(c0);
    if (c1) loomCommDestroy(c1);
    return r0 != loomSuccess ? r0 : r1;
  }
  float a[4] = {1, 2, 3, 4}, b[4] = {10, 20, 30, 40};
  loomResult_t s1 = loomInternalError;
  std::thread t2([&] { s1 = loomAllReduce(b, b, 4, loomFloat32, loomSum, c1, nullptr); });
  loomResult_t s0 = loomAllReduce(a, a, 4, loomFloat32, loomSum, c0, nullptr);
  t2.join();
  CHECK(s0 == loomSuccess);
  CHECK(s1 == loomSuccess);
  CHECK(a[3] == 44.0f);
  CHECK(b[0] == 11.0f);
  loomCommDestroy(c0);
  loomCommDestroy(c1);
  return loomSuccess;
}

bool portRefuses(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool refused = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == ECONNREFUSED;
  close(fd);
  return refused;
}

}  // namespace

TEST_CASE("rank 0 serves the bootstrap port loom-run holds for it (LOOM_ROOT_FD), once, and checks what it is given",
          "[bootstrap]") {
  // The launcher's listener has no SO_REUSEADDR: had rank 0 tried to bind
  // the port itself, init would fail as in the test above.
  uint16_t port = 0;
  const int held = holdFreePort(&port);
  const std::string root = "127.0.0.1:" + std::to_string(port);
  const std::string heldFd = std::to_string(held);
  setenv("LOOM_ROOT_FD", heldFd.c_str(), 1);
  std::string err;
  CHECK(initPairFromEnv(root, &err) == loomSuccess);
  // Rank 0 owned the descriptor and closed it with its bootstrap: nothing
  // listens on the port now.
  CHECK(portRefuses(port));

  // The same value again (a second init in the process) is not taken again:
  // that descriptor number may be anything by now.  Rank 0 binds the port.
  CHECK(initPairFromEnv(root, &err) == loomSuccess);

  // A descriptor that is not a listener on that port is refused with a
  // warning, and rank 0 binds the port itself.
  uint16_t other = 0;
  const int elsewhere = holdFreePort(&other);
  setenv("LOOM_ROOT_FD", std::to_string(elsewhere).c_str(), 1);
  CHECK(initPairFromEnv(root, &err) == loomSuccess);
  CHECK(fcntl(elsewhere, F_GETFD) >= 0);  // left open: not ours
  CHECK_FALSE(portRefuses(other));
  close(elsewhere);
  setenv("LOOM_ROOT_FD", "not-a-number", 1);
  CHECK(initPairFromEnv(root, &err) == loomSuccess);
  unsetenv("LOOM_ROOT_FD");
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
