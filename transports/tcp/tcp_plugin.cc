// The tcp plug-in: every rank listens; of each pair the higher rank
// connects and opens with a TcpHello (secret, communicator tag, rank,
// channel), the lower rank accepts and checks it.  Connections that arrive
// for another (peer, channel) than the one awaited are kept for later;
// anything that is not a valid hello is dropped with a warning.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "transports/tcp/tcp_transport.h"

namespace loom {

void checkTcpRecord(const TcpRecord& rec, int r) {
  if (rec.len > sizeof rec.addr || rec.len == 0)
    fail(loomRemoteError, "rank %d sent an address of %u bytes during init", r, rec.len);
  if (rec.addr.ss_family != AF_INET && rec.addr.ss_family != AF_INET6)
    fail(loomRemoteError, "rank %d sent an address of family %u during init", r, unsigned(rec.addr.ss_family));
}

namespace {

class TcpTransport : public Transport {
 public:
  ~TcpTransport() override {
    for (auto& kv : accepted_) close(kv.second);
    if (listenFd_ >= 0) close(listenFd_);
  }

  const char* name() const override { return "tcp"; }
  bool mayReach(const TransportEnv&, int) const override { return true; }
  size_t recordBytes() const override { return sizeof(TcpRecord); }

  void publish(const TransportEnv& env, const std::vector<bool>&, void* record) override {
    env_ = env;
    peers_.resize(size_t(env.nranks));
    SockAddr bind = env.bindAny ? resolveAddr("0.0.0.0", 0) : env.netAddr;
    bind.setPort(0);
    listenFd_ = listenOn(bind);
    SockAddr advertise = env.netAddr;
    advertise.setPort(localAddr(listenFd_).port());
    listen_ = advertise;
    TcpRecord rec{};
    memcpy(&rec.addr, &advertise.ss, sizeof rec.addr);
    rec.len = advertise.len;
    memcpy(record, &rec, sizeof rec);
  }

  bool accept(int r, const void* record, std::string*) override {
    TcpRecord rec;
    memcpy(&rec, record, sizeof rec);
    checkTcpRecord(rec, r);
    SockAddr& a = peers_[size_t(r)];
    memcpy(&a.ss, &rec.addr, sizeof a.ss);
    a.len = rec.len;
    // Same loopback domain: the peer is reachable on 127.0.0.1 whatever it advertised.
    if (env_.sameLoopback(r)) a = resolveAddr("127.0.0.1", a.port());
    return true;
  }

  std::unique_ptr<Connection> connect(int peer, int ch, int64_t deadline, ConnectHost& host) override {
    auto key = std::make_pair(peer, ch);
    int fd = env_.rank > peer ? dial(peer, ch, deadline, host) : await(key, deadline, host);
    std::unique_ptr<Connection> c = makeTcpConnection(fd, peer, env_.slotBytes, int(env_.slots));
    made_[key] = c.get();
    return c;
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(fdMutex_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
  }

  CostLink costAs() const override { return CostLink::Tcp; }
  const SockAddr& listenAddress() const { return listen_; }

 private:
  void track(int fd) {
    std::lock_guard<std::mutex> lock(fdMutex_);
    fds_.push_back(fd);
  }

  int dial(int peer, int ch, int64_t deadline, ConnectHost& host) {
    const SockAddr& addr = peers_[size_t(peer)];
    int fd = -1;
    // In short attempts: between them, a failed communicator (a peer's
    // notice) or a peer that is gone ends the wait rather than the timeout.
    while (fd < 0) {
      try {
        fd = connectTo(addr, std::min(deadline, nowMs() + 250));
      } catch (const Error& e) {
        if (nowMs() >= deadline)
          fail(loomRemoteError, "rank %d cannot connect to rank %d at %s: %s", env_.rank, peer, addr.str().c_str(),
               e.what());
        host.checkAborted();
        host.checkPeerAlive(peer);
      }
    }
    TcpHello h{kTcpHelloMagic, kTcpVersion, {}, env_.commTag, env_.rank, ch};
    memcpy(h.secret, env_.secret, 16);
    sendAll(fd, &h, sizeof h, deadline);
    track(fd);
    return fd;
  }

  // Accepts until (peer, channel) has arrived; what arrives for other keys waits in accepted_.
  int await(std::pair<int, int> key, int64_t deadline, ConnectHost& host) {
    for (;;) {
      auto it = accepted_.find(key);
      if (it != accepted_.end()) {
        int fd = it->second;
        accepted_.erase(it);
        track(fd);
        return fd;
      }
      host.checkAborted();
      // A peer that failed (say, on a mismatched call) never opens this
      // connection; it shut the ones it had with us, so look at those.
      for (auto& kv : made_)
        if (kv.first.first == key.first) {
          kv.second->progress();
          kv.second->checkPeer();
        }
      for (auto& kv : accepted_) {  // opened for a later operation, not used yet
        char c;
        if (kv.first.first == key.first && recv(kv.second, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0)
          failPeer(key.first, loomRemoteError,
                   "rank %d: rank %d closed its tcp connection (channel %d) while %s waited for it", env_.rank, key.first, kv.first.second, host.runningOp().c_str());
      }
      host.noteWaiting(key.first);
      host.checkPeerAlive(key.first);
      if (acceptOne(std::min(deadline, nowMs() + 100), deadline) < 0 && nowMs() >= deadline)
        fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (to open its tcp connection, channel %d)",
             env_.rank, host.runningOp().c_str(), (long long)env_.timeoutMs, key.first, key.second);
    }
  }

  // -1: nothing arrived before acceptDeadline; 0: dropped; 1: kept.  The
  // hello may take until 2 s after the accept (or `deadline`): a slice of
  // the caller's polling (100 ms) is too short on a loaded host, where the
  // dialer can lose the CPU between its connect and its hello.
  int acceptOne(int64_t acceptDeadline, int64_t deadline) {
    int fd = acceptUntil(listenFd_, acceptDeadline);
    if (fd < 0) return -1;
    TcpHello h{};
    try {
      // The dialer sends its hello right after connecting: give it at least
      // 500 ms even when the caller only looks (a tagged channel's deadline is now).
      recvAll(fd, &h, sizeof h, std::max(std::min(deadline, nowMs() + 2000), nowMs() + 500));
    } catch (const Error& e) {
      LOOM_WARN("NET", "rank %d: dropped a data connection without a valid hello (%s)", env_.rank, e.what());
      close(fd);
      return 0;
    }
    std::string why;
    if (!checkTcpHello(&h, sizeof h, env_.secret, env_.commTag, env_.nranks, env_.maxChannels, &h, &why)) {
      LOOM_WARN("NET", "rank %d: dropped a data connection with a bad hello (%s)", env_.rank, why.c_str());
      close(fd);
      return 0;
    }
    auto key = std::make_pair(int(h.rank), int(h.channel));
    if (accepted_.count(key) || made_.count(key)) {
      LOOM_WARN("NET", "rank %d: dropped a duplicate data connection from rank %d", env_.rank, h.rank);
      close(fd);
      return 0;
    }
    accepted_[key] = fd;
    return 1;
  }

  TransportEnv env_;
  int listenFd_ = -1;
  SockAddr listen_;
  std::vector<SockAddr> peers_;
  std::map<std::pair<int, int>, int> accepted_;            // arrived, not yet used
  std::map<std::pair<int, int>, Connection*> made_;        // owned by the communicator
  std::mutex fdMutex_;
  std::vector<int> fds_;  // to shut down on abort (under fdMutex_)
};

}  // namespace

std::unique_ptr<Transport> makeTcpTransport() { return std::make_unique<TcpTransport>(); }

SockAddr tcpListenAddress(const Transport& t) {
  const auto* tcp = dynamic_cast<const TcpTransport*>(&t);
  if (!tcp) fail(loomInternalError, "tcpListenAddress: transport %s is not tcp", t.name());
  return tcp->listenAddress();
}

}  // namespace loom
