// Fuzzes the records that open a data connection and that every rank sends
// during init: the tcp hello (checkTcpHello), the rank record
// (checkRankInfo) and the tcp transport's record (checkTcpRecord), all taken
// from a peer's bytes.
#include <cstring>
#include <string>

#include "src/core/comm.h"
#include "src/core/error.h"
#include "tests/fuzz/fuzz_common.h"
#include "transports/tcp/tcp_transport.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  loomfuzz::quiet();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  int nranks = 1 + data[0] % 9;
  const uint64_t commTag = 0x0123456789abcdefull;
  loom::TcpHello h{};
  std::string why;
  if (loom::checkTcpHello(data + 1, size - 1, loomfuzz::kSecret, commTag, nranks, 4, &h, &why)) {
    if (h.rank < 0 || h.rank >= nranks || h.channel < 0 || h.channel >= 4 || h.commTag != commTag) abort();
  } else if (why.empty()) {
    abort();
  }

  loom::RankInfo info;
  memset(&info, 0, sizeof info);
  memcpy(&info, data + 1, size - 1 < sizeof info ? size - 1 : sizeof info);
  try {
    loom::checkRankInfo(&info, data[0] & 1 ? 0 : 1);
    if (strnlen(info.hostId, sizeof info.hostId) == sizeof info.hostId) abort();
    if (strnlen(info.transports, sizeof info.transports) == sizeof info.transports) abort();
    if ((data[0] & 1) && (info.slots < 2 || info.slotBytes < 4096)) abort();
  } catch (const loom::Error& e) {
    if (e.code() != loomRemoteError) abort();
  }
  loom::TcpRecord rec;
  memset(&rec, 0, sizeof rec);
  memcpy(&rec, data + 1, size - 1 < sizeof rec ? size - 1 : sizeof rec);
  try {
    loom::checkTcpRecord(rec, 1);
    if (rec.len > sizeof rec.addr || (rec.addr.ss_family != AF_INET && rec.addr.ss_family != AF_INET6)) abort();
  } catch (const loom::Error& e) {
    if (e.code() != loomRemoteError) abort();
  }
  return 0;
}
