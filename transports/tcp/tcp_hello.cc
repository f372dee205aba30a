// The data-connection hello, checked as plain bytes (also by tests/fuzz).
#include <cstring>

#include "src/core/error.h"
#include "transports/tcp/tcp_transport.h"

namespace loom {

bool checkTcpHello(const void* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                   int maxChannels, TcpHello* out, std::string* why) {
  TcpHello h;
  if (n != sizeof h) {
    *why = strf("a %zu-byte hello where %zu were expected", n, sizeof h);
    return false;
  }
  memcpy(&h, bytes, sizeof h);
  if (h.magic != kTcpHelloMagic) *why = "not a loom hello";
  else if (h.version != kTcpVersion) *why = strf("tcp hello version %u, this rank has %u", h.version, kTcpVersion);
  else if (memcmp(h.secret, secret, 16) != 0) *why = "wrong secret";
  else if (h.commTag != commTag) *why = "another communicator";
  else if (h.rank < 0 || h.rank >= nranks) *why = strf("rank %d out of range [0, %d)", h.rank, nranks);
  else if (h.channel < 0 || h.channel >= maxChannels)
    *why = strf("channel %d out of range [0, %d)", h.channel, maxChannels);
  else {
    *out = h;
    return true;
  }
  return false;
}

}  // namespace loom
