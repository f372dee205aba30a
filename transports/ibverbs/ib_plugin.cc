// The ibverbs plug-in: opens the RDMA device when some peer is left for it
// (LOOM_TRANSPORTS order), publishes device, port, GID and its setup
// listener as the init record, and per (peer, channel) connects an RC QP
// after exchanging IbConnRecords on a socket (the higher rank dials).
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "src/core/clock.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "transports/ibverbs/ib_connection.h"

namespace loom {

namespace {

class IbTransport : public Transport {
 public:
  ~IbTransport() override {
    for (auto& kv : accepted_) close(kv.second.fd);
    if (listenFd_ >= 0) close(listenFd_);
  }

  const char* name() const override { return "ibverbs"; }

  bool mayReach(const TransportEnv& env, int) const override {
    if (!probed_) {
      probed_ = true;
      dev_ = ibOpenDevice(&why_);
      if (!dev_) LOOM_INFO("INIT", "rank %d: ibverbs transport unavailable: %s", env.rank, why_.c_str());
    }
    return dev_ != nullptr;
  }

  size_t recordBytes() const override { return sizeof(IbRecord); }

  void publish(const TransportEnv& env, const std::vector<bool>& want, void* record) override {
    env_ = env;
    peers_.resize(size_t(env.nranks));
    IbRecord rec{};
    rec.magic = kIbRecordMagic;
    rec.version = kIbVersion;
    bool need = std::find(want.begin(), want.end(), true) != want.end();
    if (need && dev_) {
      SockAddr bind = env.bindAny ? resolveAddr("0.0.0.0", 0) : env.netAddr;
      bind.setPort(0);
      listenFd_ = listenOn(bind);
      SockAddr advertise = env.netAddr;
      advertise.setPort(localAddr(listenFd_).port());
      memcpy(&rec.addr, &advertise.ss, sizeof rec.addr);
      rec.addrLen = advertise.len;
      rec.present = 1;
      rec.linkLayer = dev_->linkLayer;
      rec.port = uint8_t(dev_->port);
      rec.mtu = uint8_t(dev_->mtu);
      rec.lid = dev_->lid;
      rec.gidIndex = uint16_t(dev_->gidIndex);
      memcpy(rec.gid, dev_->gid.raw, 16);
      char gid[INET6_ADDRSTRLEN];
      inet_ntop(AF_INET6, dev_->gid.raw, gid, sizeof gid);
      LOOM_INFO("INIT", "rank %d: ibverbs on %s port %d, GID %d (%s), %s, MTU %d", env.rank, dev_->name.c_str(),
                dev_->port, dev_->gidIndex, gid, dev_->linkLayer == 1 ? "InfiniBand" : "RoCE", 128 << dev_->mtu);
    }
    memcpy(record, &rec, sizeof rec);
  }

  bool accept(int r, const void* record, std::string* why) override {
    IbRecord& rec = peers_[size_t(r)];
    checkIbRecord(record, sizeof rec, r, &rec);
    if (!dev_ || listenFd_ < 0) {
      *why = "no ibverbs here: " + (why_.empty() ? std::string("no peer left for it") : why_);
      return false;
    }
    if (!rec.present) {
      *why = strf("rank %d has no RDMA device (see its log)", r);
      return false;
    }
    if (rec.linkLayer != dev_->linkLayer) {
      *why = strf("rank %d's RDMA port is %s, this rank's %s", r, rec.linkLayer == 1 ? "InfiniBand" : "Ethernet",
                  dev_->linkLayer == 1 ? "InfiniBand" : "Ethernet");
      return false;
    }
    return true;
  }

  std::string unavailable() const override { return dev_ ? "" : why_; }

  std::unique_ptr<Connection> connect(int peer, int ch, int64_t deadline, ConnectHost& host) override {
    auto c = std::make_unique<IbConnection>(dev_, env_.rank, peer, ch, env_.slotBytes, int(env_.slots));
    IbConnRecord mine{kIbRecordMagic, kIbVersion, {}, env_.commTag, env_.rank, ch, 0, 0, 0, 0, 0, 0, 0};
    memcpy(mine.secret, env_.secret, 16);
    c->fillRecord(&mine);
    mine.directKiB = uint32_t(std::min<int64_t>((config().ibRendezvousBytes + 1023) >> 10, UINT32_MAX));
    IbConnRecord theirs{};
    int fd;
    if (env_.rank > peer) {
      fd = dial(peer, deadline);
      sendAll(fd, &mine, sizeof mine, deadline);
      recvRecord(fd, peer, ch, uint32_t(c->stride()), deadline, &theirs);
    } else {
      Pending p = await(peer, ch, uint32_t(c->stride()), deadline, host);
      fd = p.fd;
      theirs = p.rec;
      sendAll(fd, &mine, sizeof mine, deadline);
    }
    track(fd);
    // The rendezvous threshold: the larger of the two ends' (off if either is off).
    uint64_t kib = mine.directKiB && theirs.directKiB ? std::max(mine.directKiB, theirs.directKiB) : 0;
    c->setDirectMin(size_t(kib) << 10);
    c->start(theirs, peers_[size_t(peer)], fd);
    c->track(live_);
    // Both QPs are ready to receive before either side writes.
    char ready = 1;
    sendAll(fd, &ready, 1, deadline);
    try {
      recvAll(fd, &ready, 1, deadline);
    } catch (const Error& e) {
      fail(loomRemoteError, "rank %d: rank %d left while connecting its ibverbs QP (channel %d): %s", env_.rank, peer,
           ch, e.what());
    }
    setNonBlocking(fd, true);
    return c;
  }

  void abort() override {
    {
      std::lock_guard<std::mutex> lock(live_->mu);
      live_->aborted = true;
      for (IbConnection* c : live_->conns) c->stopRemoteAccess();
    }
    std::lock_guard<std::mutex> lock(fdMutex_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
  }

  CostLink costAs() const override { return CostLink::Verbs; }

  // loomCommRegister: a pinned MR in the registration cache, which the
  // rendezvous then finds without registering again.  A range that cannot
  // be registered is only a warning: its transfers register per operation.
  std::shared_ptr<void> registerBuffer(void* ptr, size_t bytes, MemoryKind kind) override {
    if (!dev_ || (kind != MemoryKind::Host && kind != MemoryKind::RegisteredHost)) return nullptr;
    RegCache::Entry* e =
        dev_->regCache->pin(ptr, bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, 0);  // read-only: sends only
    if (!e) {
      LOOM_WARN("NET", "rank %d: cannot register %zu bytes at %p with %s (transfers will register per operation)",
                env_.rank, bytes, ptr, dev_->name.c_str());
      return nullptr;
    }
    std::shared_ptr<IbDevice> dev = dev_;
    return std::shared_ptr<void>(e, [dev](void* p) { dev->regCache->unpin(static_cast<RegCache::Entry*>(p)); });
  }

 private:
  struct Pending {
    int fd;
    IbConnRecord rec;
  };

  void track(int fd) {
    std::lock_guard<std::mutex> lock(fdMutex_);
    fds_.push_back(fd);
  }

  int dial(int peer, int64_t deadline) {
    const IbRecord& rec = peers_[size_t(peer)];
    SockAddr a;
    memcpy(&a.ss, &rec.addr, sizeof a.ss);
    a.len = rec.addrLen;
    if (env_.sameLoopback(peer)) a = resolveAddr("127.0.0.1", a.port());
    try {
      return connectTo(a, deadline);
    } catch (const Error& e) {
      fail(loomRemoteError, "rank %d cannot reach rank %d's ibverbs setup listener at %s: %s", env_.rank, peer,
           a.str().c_str(), e.what());
    }
  }

  bool readRecord(int fd, uint32_t stride, int64_t deadline, IbConnRecord* out, std::string* why) {
    uint8_t buf[sizeof(IbConnRecord)];
    try {
      recvAll(fd, buf, sizeof buf, deadline);
    } catch (const Error& e) {
      *why = e.what();
      return false;
    }
    return checkIbConnRecord(buf, sizeof buf, env_.secret, env_.commTag, env_.nranks, env_.maxChannels,
                             uint32_t(IbConnection::ringSlots(int(env_.slots))),
                             stride, out, why);
  }

  void recvRecord(int fd, int peer, int ch, uint32_t stride, int64_t deadline, IbConnRecord* out) {
    std::string why;
    if (!readRecord(fd, stride, deadline, out, &why) || out->rank != peer || out->channel != ch) {
      close(fd);
      fail(loomRemoteError, "rank %d: rank %d answered the ibverbs setup of channel %d badly: %s", env_.rank, peer, ch,
           why.empty() ? "for another rank or channel" : why.c_str());
    }
  }

  // Accepts until (peer, channel) has dialled; others wait in accepted_.
  Pending await(int peer, int ch, uint32_t stride, int64_t deadline, ConnectHost& host) {
    auto key = std::make_pair(peer, ch);
    for (;;) {
      auto it = accepted_.find(key);
      if (it != accepted_.end()) {
        Pending p = it->second;
        accepted_.erase(it);
        return p;
      }
      host.checkAborted();
      host.noteWaiting(peer);
      int fd = acceptUntil(listenFd_, std::min(deadline, nowMs() + 100));
      if (fd < 0) {
        if (nowMs() >= deadline)
          fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (to set up its ibverbs "
               "QP, channel %d)", env_.rank, host.runningOp().c_str(), (long long)env_.timeoutMs, peer, ch);
        continue;
      }
      Pending p{fd, {}};
      std::string why;
      if (!readRecord(fd, stride, std::min(deadline, nowMs() + 2000), &p.rec, &why)) {
        LOOM_WARN("NET", "rank %d: dropped an ibverbs setup connection (%s)", env_.rank, why.c_str());
        close(fd);
        continue;
      }
      auto k = std::make_pair(int(p.rec.rank), int(p.rec.channel));
      if (accepted_.count(k)) {
        LOOM_WARN("NET", "rank %d: dropped a duplicate ibverbs setup connection from rank %d", env_.rank, p.rec.rank);
        close(fd);
        continue;
      }
      accepted_[k] = p;
    }
  }

  TransportEnv env_;
  mutable bool probed_ = false;
  mutable std::shared_ptr<IbDevice> dev_;
  mutable std::string why_;
  int listenFd_ = -1;
  std::vector<IbRecord> peers_;
  std::map<std::pair<int, int>, Pending> accepted_;
  std::shared_ptr<IbLiveSet> live_ = std::make_shared<IbLiveSet>();
  std::mutex fdMutex_;
  std::vector<int> fds_;  // setup sockets, shut down on abort (under fdMutex_)
};

}  // namespace

std::unique_ptr<Transport> makeIbTransport() { return std::make_unique<IbTransport>(); }

}  // namespace loom
