// The ucx plug-in: a worker per communicator when some peer is left for
// UCX (LOOM_TRANSPORTS order), its address as the init record.  A rank that
// needs no UCX, or cannot start it, sends an empty record; a pair uses UCX
// when both ends have a worker.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "transports/ucx/ucx_transport.h"

namespace loom {

namespace {

class UcxTransport : public Transport {
 public:
  const char* name() const override { return "ucx"; }
  bool mayReach(const TransportEnv&, int) const override { return true; }
  size_t recordBytes() const override { return sizeof(UcxAddrRecord); }

  void publish(const TransportEnv& env, const std::vector<bool>& want, void* record) override {
    env_ = env;
    addrs_.resize(size_t(env.nranks));
    bool need = false;
    for (bool w : want) need |= w;
    UcxAddrRecord mine{};
    if (need) {
      const std::string& tls = config().ucxTls;
      worker_ = ucxCreateWorker(env.rank, tls, env.slotBytes, &why_);
      if (worker_) mine = ucxAddress(*worker_, &why_);
      if (mine.len)
        mine.directKiB = uint32_t(std::min<int64_t>((config().ucxRendezvousBytes + 1023) >> 10, UINT32_MAX));
      if (!mine.len) {
        worker_.reset();
        LOOM_WARN("NET", "rank %d: no UCX (%s)", env.rank, why_.c_str());
      } else {
        const char* envTls = foreignEnv("UCX_TLS");
        LOOM_INFO("INIT", "rank %d: ucx worker address %u bytes (UCX_TLS %s)", env.rank, mine.len,
                  !tls.empty() ? tls.c_str() : envTls ? envTls : "default");
      }
    }
    directKiB_ = mine.directKiB;
    memcpy(record, &mine, sizeof mine);
  }

  bool accept(int r, const void* record, std::string* why) override {
    UcxAddrRecord& rec = addrs_[size_t(r)];
    memcpy(&rec, record, sizeof rec);
    if (rec.len > kUcxAddrMax) fail(loomRemoteError, "rank %d sent a UCX address of %u bytes during init", r, rec.len);
    if (!worker_) {
      *why = "no UCX here: " + why_;
      return false;
    }
    if (!rec.len) {
      *why = strf("rank %d has no UCX worker (see its log)", r);
      return false;
    }
    return true;
  }

  void serve(const std::vector<bool>& chosen) override {
    peerDirectKiB_.assign(chosen.size(), 0);
    for (size_t r = 0; r < chosen.size(); ++r) {
      if (!chosen[r]) continue;
      ucxSetPeerAddress(*worker_, int(r), addrs_[r]);
      peerDirectKiB_[r] = addrs_[r].directKiB;
    }
    addrs_.clear();
  }

  std::string unavailable() const override { return worker_ ? "" : why_; }

  std::unique_ptr<Connection> connect(int peer, int channel, int64_t, ConnectHost&) override {
    // Same loopback domain: the peer's pid means something here.
    int pid = env_.sameLoopback(peer) ? env_.pid[size_t(peer)] : 0;
    // The direct-transfer threshold: the larger of the two ends' (off if either is off).
    uint64_t mine = directKiB_, theirs = peerDirectKiB_[size_t(peer)];
    uint64_t kib = mine && theirs ? std::max(mine, theirs) : 0;
    return makeUcxConnection(worker_, env_.rank, peer, channel, env_.slotBytes, int(env_.slots), pid,
                             size_t(kib) << 10);
  }

  CostLink costAs() const override { return CostLink::Ucx; }

 private:
  TransportEnv env_;
  std::shared_ptr<UcxWorker> worker_;
  std::string why_;
  std::vector<UcxAddrRecord> addrs_;
  uint32_t directKiB_ = 0;                // this rank's LOOM_UCX_RENDEZVOUS_BYTES in KiB
  std::vector<uint32_t> peerDirectKiB_;   // each served peer's
};

}  // namespace

std::unique_ptr<Transport> makeUcxTransport() { return std::make_unique<UcxTransport>(); }

}  // namespace loom
