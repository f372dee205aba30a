// The ibverbs records, checked as plain bytes from the network (also by
// tests/unit_ibverbs_records.cc and tests/fuzz).
#include <netinet/in.h>

#include <cstring>

#include "src/core/error.h"
#include "transports/ibverbs/ib_transport.h"

namespace loom {

void checkIbRecord(const void* bytes, size_t n, int r, IbRecord* out) {
  IbRecord rec;
  if (n != sizeof rec) fail(loomRemoteError, "rank %d sent a %zu-byte ibverbs record (%zu expected)", r, n, sizeof rec);
  memcpy(&rec, bytes, sizeof rec);
  if (rec.magic != kIbRecordMagic) fail(loomRemoteError, "rank %d sent an ibverbs record without its magic", r);
  if (rec.version != kIbVersion)
    fail(loomRemoteError, "rank %d runs ibverbs record version %u, this rank %u", r, rec.version, kIbVersion);
  if (rec.present > 1) fail(loomRemoteError, "rank %d sent an ibverbs record with present=%u", r, rec.present);
  if (rec.present) {
    if (rec.linkLayer != 1 && rec.linkLayer != 2)
      fail(loomRemoteError, "rank %d sent an ibverbs record with link layer %u", r, rec.linkLayer);
    if (rec.mtu < 1 || rec.mtu > 5) fail(loomRemoteError, "rank %d sent an ibverbs record with MTU code %u", r, rec.mtu);
    if (rec.port == 0) fail(loomRemoteError, "rank %d sent an ibverbs record with port 0", r);
    if (rec.addrLen == 0 || rec.addrLen > sizeof rec.addr ||
        (rec.addr.ss_family != AF_INET && rec.addr.ss_family != AF_INET6))
      fail(loomRemoteError, "rank %d sent an ibverbs record with a bad listener address (family %u, %u bytes)", r,
           unsigned(rec.addr.ss_family), rec.addrLen);
  }
  *out = rec;
}

bool checkIbConnRecord(const void* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                       int maxChannels, uint32_t slots, uint32_t stride, IbConnRecord* out, std::string* why) {
  IbConnRecord c;
  if (n != sizeof c) {
    *why = strf("a %zu-byte ibverbs connection record where %zu were expected", n, sizeof c);
    return false;
  }
  memcpy(&c, bytes, sizeof c);
  if (c.magic != kIbRecordMagic) *why = "not a loom ibverbs connection record";
  else if (c.version != kIbVersion) *why = strf("ibverbs version %u, this rank has %u", c.version, kIbVersion);
  else if (memcmp(c.secret, secret, 16) != 0) *why = "wrong secret";
  else if (c.commTag != commTag) *why = "another communicator";
  else if (c.rank < 0 || c.rank >= nranks) *why = strf("rank %d out of range [0, %d)", c.rank, nranks);
  else if (c.channel < 0 || c.channel >= maxChannels) *why = strf("channel %d out of range [0, %d)", c.channel, maxChannels);
  else if (c.qpn == 0 || c.qpn >= (1u << 24)) *why = strf("QP number %u is not a 24-bit QP number", c.qpn);
  else if (c.psn >= (1u << 24)) *why = strf("PSN %u is not 24-bit", c.psn);
  else if (c.slots != slots || c.stride != stride)
    *why = strf("a ring of %u slots of %u bytes where %u of %u were agreed", c.slots, c.stride, slots, stride);
  else if (c.ringAddr == 0) *why = "a null ring address";
  else {
    *out = c;
    return true;
  }
  return false;
}

}  // namespace loom
