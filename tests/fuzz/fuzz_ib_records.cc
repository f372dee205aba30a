// Fuzzes the ibverbs transport's records, both bytes from a peer: the init
// record (checkIbRecord) and the per-QP connection record
// (checkIbConnRecord).  Built in fuzz builds that found libibverbs.
#include <cstring>
#include <string>

#include "src/core/error.h"
#include "tests/fuzz/fuzz_common.h"
#include "transports/ibverbs/ib_transport.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  loomfuzz::quiet();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  int nranks = 1 + data[0] % 9;
  loom::IbRecord rec;
  try {
    loom::checkIbRecord(data + 1, size - 1, 0, &rec);
    if (size - 1 != sizeof rec || rec.magic != loom::kIbRecordMagic) abort();
    if (rec.present && (rec.mtu < 1 || rec.mtu > 5 || rec.addrLen > sizeof rec.addr)) abort();
  } catch (const loom::Error& e) {
    if (e.code() != loomRemoteError) abort();
  }
  loom::IbConnRecord c;
  std::string why;
  if (loom::checkIbConnRecord(data + 1, size - 1, loomfuzz::kSecret, 7, nranks, 4, 8, 65600, &c, &why)) {
    if (c.rank < 0 || c.rank >= nranks || c.channel < 0 || c.channel >= 4 || c.qpn >= (1u << 24) || c.slots != 8)
      abort();
  } else if (why.empty()) {
    abort();
  }
  return 0;
}
