// The checks on bytes from the network (the same functions the fuzz targets
// in tests/fuzz drive), and the LOOM_CHECK_MODE / LOOM_DUMP_SIGNAL parsing.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "loom_catch.h"
#include <thread>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "src/core/bootstrap.h"
#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/control.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "transports/tcp/tcp_transport.h"

namespace {

const uint8_t kSecret[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

loom::JoinHello goodHello(int rank, int nranks) {
  loom::JoinHello h{};
  h.magic = 0x4c4d4a4e;
  h.version = loom::kBootVersion;
  memcpy(h.secret, kSecret, 16);
  h.rank = rank;
  h.nranks = nranks;
  return h;
}

loomResult_t replyCode(const loom::JoinReply& r) {
  try {
    loom::checkJoinReply(&r, sizeof r, 1);
    return loomSuccess;
  } catch (const loom::Error& e) {
    return e.code();
  }
}

}  // namespace

TEST_CASE("join hellos: accepted only whole, with the secret, version and a free rank", "[parsers]") {
  std::vector<bool> joined{true, false, true, false};
  loom::JoinHello h = goodHello(1, 4);
  CHECK(loom::checkJoinHello(&h, sizeof h, kSecret, 4, joined).verdict == loom::JoinVerdict::Accept);
  CHECK(loom::checkJoinHello(&h, sizeof h, kSecret, 4, joined).rank == 1);
  CHECK(loom::checkJoinHello(&h, sizeof h - 1, kSecret, 4, joined).verdict == loom::JoinVerdict::Drop);
  loom::JoinHello bad = h;
  bad.secret[15] ^= 1;
  CHECK(loom::checkJoinHello(&bad, sizeof bad, kSecret, 4, joined).why == "wrong secret");
  bad = h;
  bad.magic = 0;
  CHECK(loom::checkJoinHello(&bad, sizeof bad, kSecret, 4, joined).verdict == loom::JoinVerdict::Drop);
  bad = h;
  bad.version = 99;
  CHECK(loom::checkJoinHello(&bad, sizeof bad, kSecret, 4, joined).verdict == loom::JoinVerdict::Reject);
  for (int r : {0, 2, 4, -1, 1 << 30}) {
    bad = goodHello(r, 4);
    INFO("rank " << r);
    CHECK(loom::checkJoinHello(&bad, sizeof bad, kSecret, 4, joined).verdict == loom::JoinVerdict::Fatal);
  }
  bad = goodHello(3, 5);
  CHECK(loom::checkJoinHello(&bad, sizeof bad, kSecret, 4, joined).verdict == loom::JoinVerdict::Fatal);
}

TEST_CASE("join replies: a garbage status never becomes an unknown result code", "[parsers]") {
  loom::JoinReply r{};
  r.magic = 0x4c4d4a4e;
  r.status = loomSuccess;
  CHECK(replyCode(r) == loomSuccess);
  r.status = loomInvalidUsage;
  memset(r.message, 'x', sizeof r.message);  // unterminated: must not be read past
  CHECK(replyCode(r) == loomInvalidUsage);
  for (int bogus : {-1, int(loomNumResults), 1000, int(loomInProgress)}) {
    r.status = bogus;
    INFO("status " << bogus);
    CHECK(replyCode(r) == loomRemoteError);
  }
  r.magic = 7;
  r.status = loomSuccess;
  CHECK(replyCode(r) == loomRemoteError);
}

TEST_CASE("tcp hellos: wrong secret, communicator, rank or channel are refused with a reason", "[parsers]") {
  loom::TcpHello h{loom::kTcpHelloMagic, loom::kTcpVersion, {}, 42, 2, 1};
  memcpy(h.secret, kSecret, 16);
  loom::TcpHello out{};
  std::string why;
  CHECK(loom::checkTcpHello(&h, sizeof h, kSecret, 42, 3, 4, &out, &why));
  CHECK(out.rank == 2);
  CHECK_FALSE(loom::checkTcpHello(&h, sizeof h, kSecret, 43, 3, 4, &out, &why));
  CHECK(why == "another communicator");
  CHECK_FALSE(loom::checkTcpHello(&h, sizeof h, kSecret, 42, 2, 4, &out, &why));
  CHECK_FALSE(loom::checkTcpHello(&h, sizeof h, kSecret, 42, 3, 1, &out, &why));
  CHECK_FALSE(loom::checkTcpHello(&h, 3, kSecret, 42, 3, 4, &out, &why));
  h.secret[0] ^= 1;
  CHECK_FALSE(loom::checkTcpHello(&h, sizeof h, kSecret, 42, 3, 4, &out, &why));
  CHECK(why == "wrong secret");
}

TEST_CASE("rank records: rank 0's settings are bounded before use", "[parsers]") {
  loom::RankInfo info{};
  memset(info.hostId, 'h', sizeof info.hostId);  // unterminated
  info.slots = 8;
  info.slotBytes = 65536;
  snprintf(info.transports, sizeof info.transports, "shm,tcp");
  info.mailBytes = 16384;
  info.stageBytes = 262144;
  info.deviceStageBytes = 2 << 20;
  info.deviceSlotBytes = 4 << 20;
  info.deviceOneShotBytes = 256 << 10;
  info.ctlAddr.ss_family = AF_INET;
  info.ctlLen = sizeof(sockaddr_in);
  CHECK_NOTHROW(loom::checkRankInfo(&info, 0));
  CHECK(strlen(info.hostId) == sizeof info.hostId - 1);
  loom::RankInfo bad = info;
  bad.slots = 0;  // would divide by zero in the tcp ring
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  CHECK_NOTHROW(loom::checkRankInfo(&bad, 1));  // only rank 0's settings are used
  bad = info;
  bad.slotBytes = 0xffffffffu;
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  bad = info;
  bad.deviceStageBytes = 100;  // the staged path's piece: a multiple of 256, at least 4096
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  bad = info;
  bad.deviceSlotBytes = 0;  // windows of nothing: no round would fit
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  bad.deviceSlotBytes = 65536 + 100;  // a multiple of 4096
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  bad.deviceSlotBytes = 0x80000000u;  // 2 GiB slots: 4 GiB of device memory per rank
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  CHECK_NOTHROW(loom::checkRankInfo(&bad, 1));
  bad = info;
  bad.devicePath = 7;
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  bad = info;
  memset(bad.transports, 'x', sizeof bad.transports);  // unterminated, unknown
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  CHECK(strlen(bad.transports) == sizeof bad.transports - 1);
  bad = info;
  snprintf(bad.transports, sizeof bad.transports, ",");
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 0), loom::Error);
  // Every rank's control address is checked (any rank's, not only rank 0's).
  bad = info;
  bad.ctlLen = sizeof bad.ctlAddr + 1;
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 1), loom::Error);
  bad = info;
  bad.ctlAddr.ss_family = AF_UNIX;
  CHECK_THROWS_AS(loom::checkRankInfo(&bad, 2), loom::Error);
}

TEST_CASE("control messages: framing, secret and bounds are checked before use", "[parsers]") {
  const uint8_t secret[16] = {1, 2, 3};
  loom::CtlMsg m;
  m.type = loom::CtlType::Commit;
  m.from = 2;
  m.ranks = {0, 3};
  m.extra = {9, 8, 7};
  std::vector<uint8_t> b = loom::encodeCtl(m, secret, 77);
  std::string why;
  CHECK(loom::ctlMissing(b.data(), 0, secret, 77, 4, &why) == 48);
  CHECK(loom::ctlMissing(b.data(), 48, secret, 77, 4, &why) == long(b.size() - 48));
  REQUIRE(loom::ctlMissing(b.data(), b.size(), secret, 77, 4, &why) == 0);
  loom::CtlMsg d = loom::decodeCtl(b.data(), b.size());
  CHECK(d.type == loom::CtlType::Commit);
  CHECK(d.from == 2);
  CHECK(d.ranks == std::vector<int>{0, 3});
  CHECK(d.extra == std::vector<uint8_t>{9, 8, 7});
  CHECK(loom::ctlMissing(b.data(), b.size(), secret, 78, 4, &why) == -1);  // another communicator
  CHECK(why == "another communicator");
  const uint8_t other[16] = {1, 2, 4};
  CHECK(loom::ctlMissing(b.data(), b.size(), other, 77, 4, &why) == -1);
  CHECK(loom::ctlMissing(b.data(), b.size(), secret, 77, 2, &why) == -1);  // sender 2 of 2 ranks
  m.ranks.assign(5, 0);  // more ranks than the communicator has
  b = loom::encodeCtl(m, secret, 77);
  CHECK(loom::ctlMissing(b.data(), 48, secret, 77, 4, &why) == -1);
  b[4] = 99;  // unknown type
  CHECK(loom::ctlMissing(b.data(), 48, secret, 77, 8, &why) == -1);
}

TEST_CASE("control dial: a live peer is found even when the caller comes back past its deadline (a loaded "
          "machine), a closed listener is refused",
          "[parsers][control]") {
  // A process not scheduled for the whole of a dial's time used to call a
  // made connection a timeout, and a shrink then took a live coordinator
  // for cut off (session 40, under TSan).  A deadline already past stands
  // for that: the connection is polled once before giving up.
  const loom::SockAddr local = loom::resolveAddr("127.0.0.1", 0);
  loom::Control c0(0, 2, kSecret, local, local);
  auto c1 = std::make_unique<loom::Control>(1, 2, kSecret, local, local);
  const std::vector<loom::SockAddr> peers = {c0.address(), c1->address()};
  c0.start(7, peers, [](const loom::CtlMsg&) {}, [] { return loom::CtlCause{}; });
  c1->start(7, peers, [](const loom::CtlMsg&) {}, [] { return loom::CtlCause{}; });
  const int fd = c0.dial(1, loom::nowMs() - 1);
  CHECK(fd >= 0);
  if (fd >= 0) close(fd);
  c1->stop();
  c1.reset();  // its listener closes
  CHECK(c0.dial(1, loom::nowMs() - 1) == -1);
  c0.stop();
}

TEST_CASE("failure causes: code, root rank and printable text survive the wire, garbage is refused", "[parsers]") {
  loom::CtlCause c;
  c.code = loomInvalidUsage;
  c.root = 2;
  c.msg = "rank 2: mismatched operations";
  loom::CtlCause d;
  REQUIRE(loom::decodeCause(loom::encodeCause(c), 4, &d));
  CHECK(d.code == loomInvalidUsage);
  CHECK(d.root == 2);
  CHECK(d.msg == c.msg);
  CHECK_FALSE(loom::decodeCause(loom::encodeCause(c), 2, &d));  // root 2 of 2 ranks
  c.code = 77;                                                 // no such result code
  CHECK_FALSE(loom::decodeCause(loom::encodeCause(c), 4, &d));
  CHECK_FALSE(loom::decodeCause({1, 2, 3}, 4, &d));  // shorter than code and root
  c.code = loomRemoteError;
  c.msg = std::string("line\nbreak\x01") + std::string(5000, 'x');  // control bytes; longer than a message holds
  REQUIRE(loom::decodeCause(loom::encodeCause(c), 4, &d));
  CHECK(d.msg.substr(0, 11) == "line?break?");
  CHECK(d.msg.size() < 2048);
  // It fits a control message's extra bytes.
  const uint8_t secret[16] = {5};
  loom::CtlMsg m;
  m.type = loom::CtlType::Why;
  m.from = 1;
  m.extra = loom::encodeCause(c);
  std::vector<uint8_t> b = loom::encodeCtl(m, secret, 9);
  std::string why;
  CHECK(loom::ctlMissing(b.data(), b.size(), secret, 9, 4, &why) == 0);
}

TEST_CASE("tcp records: a peer's listener address is checked before use", "[parsers]") {
  loom::TcpRecord rec{};
  rec.addr.ss_family = AF_INET;
  rec.len = sizeof(sockaddr_in);
  CHECK_NOTHROW(loom::checkTcpRecord(rec, 1));
  loom::TcpRecord bad = rec;
  bad.len = 1000;
  CHECK_THROWS_AS(loom::checkTcpRecord(bad, 1), loom::Error);
  bad = rec;
  bad.addr.ss_family = AF_UNIX;
  CHECK_THROWS_AS(loom::checkTcpRecord(bad, 1), loom::Error);
}

TEST_CASE("LOOM_CHECK_MODE takes on/off and 1/0, LOOM_DUMP_SIGNAL a signal number", "[parsers][config]") {
  struct Case {
    const char* value;
    bool want;
  } cases[] = {{"on", true}, {"off", false}, {"1", true}, {"0", false}, {"OFF", false}, {"maybe", true}};
  for (const Case& c : cases) {
    setenv("LOOM_CHECK_MODE", c.value, 1);
    loom::configReload();
    INFO("LOOM_CHECK_MODE=" << c.value);
    CHECK(loom::config().checkMode == c.want);
  }
  unsetenv("LOOM_CHECK_MODE");
  setenv("LOOM_DUMP_SIGNAL", "10", 1);
  loom::configReload();
  CHECK(loom::config().dumpSignal == 10);
  setenv("LOOM_DUMP_SIGNAL", "999", 1);
  loom::configReload();
  CHECK(loom::config().dumpSignal == 0);
  unsetenv("LOOM_DUMP_SIGNAL");
  loom::configReload();
  CHECK(loom::config().checkMode);
}

TEST_CASE("integer variables with suffixes reject negative and overflowing values (fuzz_env finding)", "[parsers][config]") {
  setenv("LOOM_SLOTS", "-9k", 1);
  setenv("LOOM_TIMEOUT_MS", "9223372036854775807k", 1);
  setenv("LOOM_SLOT_BYTES", "128k", 1);
  loom::configReload();
  CHECK(loom::config().slots == 8);
  CHECK(loom::config().timeoutMs == 600000);
  CHECK(loom::config().slotBytes == 128 << 10);
  unsetenv("LOOM_SLOTS");
  unsetenv("LOOM_SLOT_BYTES");
  setenv("LOOM_TIMEOUT_MS", "600000", 1);
  loom::configReload();
}

TEST_CASE("a reload never changes the Config another thread is reading", "[parsers][config]") {
  const loom::Config& before = loom::config();
  int64_t slots = before.slots;
  setenv("LOOM_SLOTS", "16", 1);
  loom::configReload();
  CHECK(before.slots == slots);  // the old snapshot is intact and alive
  CHECK(loom::config().slots == 16);
  const loom::Config* same = &loom::config();
  loom::configReload();  // unchanged environment: same object
  CHECK(&loom::config() == same);
  unsetenv("LOOM_SLOTS");
  loom::configReload();
}

TEST_CASE("garbage, wrong secrets, truncated and silent clients on a rank's data port do not stop tcp", "[hostile]") {
  setenv("LOOM_SOCKET_IFNAME", "lo", 1);
  setenv("LOOM_TRANSPORTS", "tcp", 1);
  setenv("LOOM_TIMEOUT_MS", "20000", 1);
  loom::configReload();
  loomUniqueId id;
  REQUIRE(loomGetUniqueId(&id) == loomSuccess);
  loomComm_t comms[2] = {nullptr, nullptr};
  loomResult_t res[2] = {loomInternalError, loomInternalError};
  std::thread r0([&] { res[0] = loomCommInitRank(&comms[0], 2, id, 0); });
  std::thread r1([&] { res[1] = loomCommInitRank(&comms[1], 2, id, 1); });
  r0.join();
  r1.join();
  REQUIRE(res[0] == loomSuccess);
  REQUIRE(res[1] == loomSuccess);

  // Rank 1 connects to rank 0's data port at the first operation; hostile
  // clients get there first.
  sockaddr_in a{};
  loom::SockAddr listen = loom::tcpListenAddress(*comms[0]->transportNamed("tcp"));
  memcpy(&a, &listen.ss, sizeof a);
  REQUIRE(a.sin_family == AF_INET);
  auto dial = [&] {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = a.sin_port;
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0);
    return fd;
  };
  std::vector<int> fds;
  int g = dial();
  char junk[300];
  for (size_t i = 0; i < sizeof junk; ++i) junk[i] = char(i * 13 + 1);
  REQUIRE(send(g, junk, sizeof junk, MSG_NOSIGNAL) == ssize_t(sizeof junk));
  fds.push_back(g);
  loom::TcpHello h{loom::kTcpHelloMagic, loom::kTcpVersion, {}, 0, 1, 0};
  memset(h.secret, 0x5a, 16);  // wrong secret, right shape
  int w = dial();
  REQUIRE(send(w, &h, sizeof h, MSG_NOSIGNAL) == ssize_t(sizeof h));
  fds.push_back(w);
  int t = dial();
  REQUIRE(send(t, &h, 9, MSG_NOSIGNAL) == 9);
  close(t);
  fds.push_back(dial());  // silent

  int64_t start = loom::nowMs();
  std::vector<float> x(1000, 1.0f), y(1000, 2.0f);
  std::thread t0([&] { res[0] = loomAllReduce(x.data(), x.data(), x.size(), loomFloat32, loomSum, comms[0], nullptr); });
  std::thread t1([&] { res[1] = loomAllReduce(y.data(), y.data(), y.size(), loomFloat32, loomSum, comms[1], nullptr); });
  t0.join();
  t1.join();
  CHECK(res[0] == loomSuccess);
  CHECK(res[1] == loomSuccess);
  CHECK(x[999] == 3.0f);
  CHECK(y[0] == 3.0f);
  CHECK(loom::nowMs() - start < 10000);  // a silent client costs at most its 2 s hello window
  for (int fd : fds) close(fd);
  CHECK(loomCommDestroy(comms[0]) == loomSuccess);
  CHECK(loomCommDestroy(comms[1]) == loomSuccess);
  unsetenv("LOOM_SOCKET_IFNAME");
  unsetenv("LOOM_TRANSPORTS");
  setenv("LOOM_TIMEOUT_MS", "600000", 1);
  loom::configReload();
}
