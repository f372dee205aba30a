// Fuzzes what the bootstrap reads from the network: the hello a joining rank
// sends to the root (checkJoinHello), the root's reply (checkJoinReply), and
// the unique id an application passes around (decodeUniqueId).
#include <cstring>
#include <vector>

#include "src/core/bootstrap.h"
#include "src/core/error.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  loomfuzz::quiet();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // First byte: nranks and which ranks have joined; the rest is the message.
  int nranks = 1 + data[0] % 16;
  std::vector<bool> joined(static_cast<size_t>(nranks), false);
  for (int r = 0; r < nranks; ++r) joined[size_t(r)] = (data[1] >> (r % 8)) & 1;
  const uint8_t* msg = data + 2;
  size_t n = size - 2;

  loom::JoinCheck c = loom::checkJoinHello(msg, n, loomfuzz::kSecret, nranks, joined);
  if (c.verdict == loom::JoinVerdict::Accept) {
    // An accepted hello must name a rank the root can index, not yet joined.
    if (c.rank <= 0 || c.rank >= nranks || joined[size_t(c.rank)]) abort();
    if (n != sizeof(loom::JoinHello) || memcmp(msg + 8, loomfuzz::kSecret, 16) != 0) abort();
  } else if (c.why.empty()) {
    abort();  // every refusal says why
  }

  try {
    loom::checkJoinReply(msg, n, 1);
  } catch (const loom::Error& e) {
    // A refusal carries a real code and a terminated message.
    if (e.code() <= loomSuccess || e.code() >= loomNumResults || e.code() == loomInProgress) abort();
    if (strlen(e.what()) > 4096) abort();
  }

  loomUniqueId id;
  memset(&id, 0, sizeof id);
  memcpy(id.internal, msg, n < sizeof id.internal ? n : sizeof id.internal);
  try {
    loom::UniqueIdData d = loom::decodeUniqueId(id);
    if (strnlen(d.host, sizeof d.host) == sizeof d.host) abort();  // host must be terminated
  } catch (const loom::Error& e) {
    if (e.code() != loomInvalidArgument) abort();
  }
  return 0;
}
