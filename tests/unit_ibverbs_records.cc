// The ibverbs transport's records are bytes from the network: garbage,
// truncated and foreign ones are refused with an error, never trusted.
// (Builds with libibverbs only; the transport itself runs in tests/vm/.)
#ifdef LOOM_HAVE_IBVERBS
#include <netinet/in.h>

#include "loom_catch.h"
#include <cstring>
#include <random>
#include <string>

#include "src/core/error.h"
#include "transports/ibverbs/ib_transport.h"

namespace {

loom::IbRecord goodRecord() {
  loom::IbRecord r{};
  r.magic = loom::kIbRecordMagic;
  r.version = loom::kIbVersion;
  r.present = 1;
  r.linkLayer = 2;
  r.port = 1;
  r.mtu = 3;
  r.gidIndex = 1;
  auto* in = reinterpret_cast<sockaddr_in*>(&r.addr);
  in->sin_family = AF_INET;
  in->sin_port = htons(1234);
  r.addrLen = sizeof(sockaddr_in);
  return r;
}

const uint8_t kSecret[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

loom::IbConnRecord goodConn() {
  loom::IbConnRecord c{};
  c.magic = loom::kIbRecordMagic;
  c.version = loom::kIbVersion;
  memcpy(c.secret, kSecret, 16);
  c.commTag = 77;
  c.rank = 1;
  c.channel = 0;
  c.qpn = 0x11;
  c.psn = 0x123456;
  c.ringAddr = 0x7f0000001000;
  c.ringRkey = 5;
  c.slots = 8;
  c.stride = 65600;
  return c;
}

bool checkConn(const loom::IbConnRecord& c, size_t n = sizeof(loom::IbConnRecord), std::string* why = nullptr) {
  loom::IbConnRecord out;
  std::string w;
  bool ok = loom::checkIbConnRecord(&c, n, kSecret, 77, 4, 2, 8, 65600, &out, &w);
  if (why) *why = w;
  if (!ok) CHECK(!w.empty());
  return ok;
}

}  // namespace

TEST_CASE("ibverbs init records: a good one passes, garbage and truncated ones are loomRemoteError", "[ibverbs]") {
  loom::IbRecord out;
  loom::IbRecord r = goodRecord();
  loom::checkIbRecord(&r, sizeof r, 3, &out);
  CHECK(out.port == 1);
  auto rejects = [&](const loom::IbRecord& bad, size_t n) {
    try {
      loom::checkIbRecord(&bad, n, 3, &out);
    } catch (const loom::Error& e) {
      CHECK(e.code() == loomRemoteError);
      CHECK(std::string(e.what()).find("rank 3") != std::string::npos);
      return true;
    }
    return false;
  };
  CHECK(rejects(r, sizeof r - 1));
  loom::IbRecord b = r;
  b.magic ^= 1;
  CHECK(rejects(b, sizeof b));
  b = r, b.version = 99;
  CHECK(rejects(b, sizeof b));
  b = r, b.mtu = 9;
  CHECK(rejects(b, sizeof b));
  b = r, b.linkLayer = 7;
  CHECK(rejects(b, sizeof b));
  b = r, b.addrLen = 100000;
  CHECK(rejects(b, sizeof b));
  b = r, b.addr.ss_family = AF_UNIX;
  CHECK(rejects(b, sizeof b));
  b = r, b.present = 2;
  CHECK(rejects(b, sizeof b));
  // A rank without a device sends present = 0 and nothing else is looked at.
  loom::IbRecord none{};
  none.magic = loom::kIbRecordMagic, none.version = loom::kIbVersion;
  CHECK_FALSE(rejects(none, sizeof none));
  // Random bytes never pass for a record.
  std::mt19937 rng(14);
  for (int i = 0; i < 1000; ++i) {
    uint8_t junk[sizeof(loom::IbRecord)];
    for (uint8_t& x : junk) x = uint8_t(rng());
    loom::IbRecord j;
    memcpy(&j, junk, sizeof j);
    CHECK(rejects(j, sizeof j));
  }
}

TEST_CASE("ibverbs connection records: foreign, out-of-range and truncated ones are refused with a reason", "[ibverbs]") {
  loom::IbConnRecord c = goodConn();
  CHECK(checkConn(c));
  std::string why;
  CHECK_FALSE(checkConn(c, sizeof c - 8, &why));
  CHECK(why.find("byte") != std::string::npos);
  loom::IbConnRecord b = c;
  b.secret[3] ^= 1;
  CHECK_FALSE(checkConn(b, sizeof b, &why));
  CHECK(why == "wrong secret");
  b = c, b.commTag = 78;
  CHECK_FALSE(checkConn(b));
  b = c, b.rank = 4;
  CHECK_FALSE(checkConn(b));
  b = c, b.rank = -1;
  CHECK_FALSE(checkConn(b));
  b = c, b.channel = 2;
  CHECK_FALSE(checkConn(b));
  b = c, b.qpn = 1u << 24;
  CHECK_FALSE(checkConn(b));
  b = c, b.qpn = 0;
  CHECK_FALSE(checkConn(b));
  b = c, b.psn = 1u << 24;
  CHECK_FALSE(checkConn(b));
  b = c, b.slots = 16;
  CHECK_FALSE(checkConn(b, sizeof b, &why));
  CHECK(why.find("agreed") != std::string::npos);
  b = c, b.stride = 64;
  CHECK_FALSE(checkConn(b));
  b = c, b.ringAddr = 0;
  CHECK_FALSE(checkConn(b));
  std::mt19937 rng(14);
  for (int i = 0; i < 1000; ++i) {
    loom::IbConnRecord j;
    auto* p = reinterpret_cast<uint8_t*>(&j);
    for (size_t k = 0; k < sizeof j; ++k) p[k] = uint8_t(rng());
    CHECK_FALSE(checkConn(j));
  }
}
#endif
