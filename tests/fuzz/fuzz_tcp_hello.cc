// Fuzzes the records that open a data connection and that every rank sends
// during init: the tcp hello (checkTcpHello), the rank record
// (checkRankInfo) and the tcp transport's record (checkTcpRecord), and the
// control socket's messages (ctlMissing / decodeCtl: notices and the shrink
// agreement; a CUDA communicator's signature batches), all taken from a
// peer's bytes.
#include <cstring>
#include <string>

#include "src/core/comm.h"
#include "src/core/control.h"
#include "src/core/error.h"
#include "src/device/op_signature.h"
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
  // A control message read the way the control thread reads it: ask how
  // many bytes are missing, take that many, until complete or refused.
  const uint8_t* msg = data + 1;
  size_t have = 0, left = size - 1;
  std::string ctlWhy;
  for (;;) {
    long want = loom::ctlMissing(msg, have, loomfuzz::kSecret, commTag, nranks, &ctlWhy);
    if (want < 0) {
      if (ctlWhy.empty()) abort();
      break;
    }
    if (want == 0) {
      loom::CtlMsg m = loom::decodeCtl(msg, have);
      if (m.from < 0 || m.from >= nranks || int(m.ranks.size()) > nranks || m.extra.size() > 16384) abort();
      std::vector<uint8_t> again = loom::encodeCtl(m, loomfuzz::kSecret, commTag);
      if (again.size() != have || memcmp(again.data(), msg, have) != 0) abort();
      // A failure cause in the extra bytes: bounded, printable, a known code.
      loom::CtlCause c;
      if (loom::decodeCause(m.extra, nranks, &c)) {
        if (c.code < 0 || c.code >= loomNumResults || c.root < -1 || c.root >= nranks) abort();
        for (char ch : c.msg)
          if (ch < 0x20 || ch > 0x7e) abort();
      }
      // A CUDA communicator's signature batch (Sigs): decoded whole or not
      // at all, and the same bytes again when encoded.
      std::vector<loom::OpSignature> sigs;
      if (loom::decodeSignatures(m.extra, &sigs)) {
        if (sigs.size() > loom::kSignatureBatch || loom::encodeSignatures(sigs) != m.extra) abort();
        loom::SignatureCheck check(1, 0);
        check.receive(m.extra);
      }
      break;
    }
    if (size_t(want) > left) break;  // truncated: the reader waits for more
    have += size_t(want);
    left -= size_t(want);
  }
  return 0;
}
