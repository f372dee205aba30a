#include "src/core/bootstrap.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>

#include "src/core/clock.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"

namespace loom {

namespace {

constexpr uint32_t kIdMagic = 0x4c4d4944;     // "LMID"
constexpr uint32_t kJoinMagic = 0x4c4d4a4e;   // "LMJN"

// Listeners opened by loomGetUniqueId, waiting for this process's rank 0.
std::mutex gListenMutex;
std::deque<std::pair<std::string, int>> gListeners;  // (secret, listener), oldest first
// Ids made and never used hold a descriptor each; past this many the oldest
// listener is closed.  Its id still works: rank 0 then binds the port again
// (bootstrap from the environment's way), unless another process took it.
constexpr size_t kMaxIdListeners = 64;

std::string secretKey(const uint8_t s[16]) { return std::string(reinterpret_cast<const char*>(s), 16); }

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// loom-run hands rank 0 the bootstrap port already listening, as descriptor
// LOOM_ROOT_FD, so that no other process can take the port between the
// launcher's choice and rank 0's bind.  The process keeps it for good and
// serves every init from the environment on that port with it: a wrapper
// script or a child started before init may hold a copy, and while any
// copy listens nobody can bind the port again.  It is marked close-on-exec
// when the library loads, so children started later do not get it.
struct InheritedRoot {
  std::mutex busy;      // one bootstrap at a time serves it
  std::string value;    // LOOM_ROOT_FD as read
  int fd = -1;          // the listener, or -1
  uint16_t port = 0;
  bool warned = false;
};

InheritedRoot& inheritedRoot() {
  static InheritedRoot* r = [] {
    auto* root = new InheritedRoot;  // never freed: the descriptor is the process's
    const char* e = getenv("LOOM_ROOT_FD");
    if (!e || !*e) return root;
    root->value = e;
    char* end = nullptr;
    long fd = strtol(e, &end, 10);
    int listening = 0;
    socklen_t len = sizeof listening;
    SockAddr a;
    a.len = sizeof a.ss;
    if (*end != 0 || fd <= 2 || fd >= (1l << 30) ||
        getsockopt(int(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening ||
        getsockname(int(fd), reinterpret_cast<sockaddr*>(&a.ss), &a.len) != 0)
      return root;  // not a listening socket: serve() warns once
    fcntl(int(fd), F_SETFD, FD_CLOEXEC);
    // Accepted connections inherit SO_REUSEADDR; loom's own listeners set it.
    int one = 1;
    setsockopt(int(fd), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    root->fd = int(fd);
    root->port = a.port();
    return root;
  }();
  return *r;
}

// At load: close-on-exec from here on.
[[maybe_unused]] const bool gInheritedRootMarked = (inheritedRoot(), true);

std::string linkTarget(const char* path) {
  char buf[256];
  ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

}  // namespace

JoinCheck checkJoinHello(const void* bytes, size_t n, const uint8_t secret[16], int nranks,
                         const std::vector<bool>& joined) {
  JoinHello h;
  if (n != sizeof h) return {JoinVerdict::Drop, -1, "truncated hello"};
  memcpy(&h, bytes, sizeof h);
  if (h.magic != kJoinMagic) return {JoinVerdict::Drop, -1, "not a loom hello"};
  if (memcmp(h.secret, secret, 16) != 0) return {JoinVerdict::Drop, -1, "wrong secret"};
  if (h.version != kBootVersion)
    return {JoinVerdict::Reject, -1, strf("loom bootstrap version %u, root has %u", h.version, kBootVersion)};
  if (h.nranks != nranks)
    return {JoinVerdict::Fatal, -1,
            strf("rank %d called init with nranks %d but rank 0 with %d", h.rank, h.nranks, nranks)};
  if (h.rank <= 0 || h.rank >= nranks || size_t(h.rank) >= joined.size() || joined[size_t(h.rank)])
    return {JoinVerdict::Fatal, -1, strf("rank %d joined twice or is out of range [0, %d)", h.rank, nranks)};
  return {JoinVerdict::Accept, h.rank, ""};
}

void checkJoinReply(const void* bytes, size_t n, int rank) {
  JoinReply r;
  if (n != sizeof r) fail(loomRemoteError, "rank %d: the bootstrap root sent a truncated reply", rank);
  memcpy(&r, bytes, sizeof r);
  r.message[sizeof r.message - 1] = 0;
  if (r.magic != kJoinMagic) fail(loomRemoteError, "rank %d: the bootstrap root sent garbage", rank);
  if (r.status == loomSuccess) return;
  // Only the root's own codes: garbage must not become an unknown loomResult_t.
  if (r.status < 0 || r.status >= loomNumResults || r.status == loomInProgress)
    fail(loomRemoteError, "rank %d: the bootstrap root sent an unknown status %d", rank, int(r.status));
  fail(loomResult_t(r.status), "%s", r.message);
}

uint64_t localKey() {
  return fnv1a(readFirstLine("/proc/sys/kernel/random/boot_id") + "|" + linkTarget("/proc/self/ns/net"));
}

std::string machineHostId() {
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  return std::string(host) + "/" + readFirstLine("/proc/sys/kernel/random/boot_id");
}

void fillRandom(void* buf, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      failErrno("getrandom");
    }
    p += r;
    n -= size_t(r);
  }
}

void makeUniqueId(loomUniqueId* out, const SockAddr* advertiseAt) {
  const Config& cfg = config();
  SockAddr bindAddr, advertise;
  if (!cfg.socketIfname.empty()) {
    bindAddr = advertise = interfaceAddr(cfg.socketIfname);
  } else if (advertiseAt) {
    bindAddr = resolveAddr(advertiseAt->ss.ss_family == AF_INET6 ? "::" : "0.0.0.0", 0);
    advertise = *advertiseAt;
  } else {
    // Listen everywhere; local ranks come through loopback, others through
    // the first interface that is up.
    bindAddr = resolveAddr("0.0.0.0", 0);
    advertise = defaultInterfaceAddr();
  }
  bindAddr.setPort(0);
  int fd = listenOn(bindAddr);
  UniqueIdData id{};
  id.magic = kIdMagic;
  id.version = kBootVersion;
  id.port = localAddr(fd).port();
  fillRandom(id.secret, sizeof id.secret);
  id.localKey = cfg.socketIfname.empty() ? localKey() : 0;
  std::string host = advertise.str();
  host = host.substr(0, host.rfind(':'));
  if (!host.empty() && host[0] == '[') host = host.substr(1, host.size() - 2);
  snprintf(id.host, sizeof id.host, "%s", host.c_str());
  {
    std::lock_guard<std::mutex> lock(gListenMutex);
    gListeners.emplace_back(secretKey(id.secret), fd);
    if (gListeners.size() > kMaxIdListeners) {
      close(gListeners.front().second);
      gListeners.pop_front();
    }
  }
  memset(out, 0, sizeof *out);
  memcpy(out->internal, &id, sizeof id);
  LOOM_INFO("BOOT", "unique id: root listens on %s port %u", id.host, unsigned(id.port));
}

UniqueIdData decodeUniqueId(const loomUniqueId& raw) {
  UniqueIdData id;
  memcpy(&id, raw.internal, sizeof id);
  if (id.magic != kIdMagic || id.version != kBootVersion)
    fail(loomInvalidArgument, "the unique id is not one made by loomGetUniqueId of this loom version");
  id.host[sizeof id.host - 1] = 0;
  return id;
}

loomUniqueId uniqueIdFor(const std::string& hostPort, const uint8_t secret[16]) {
  SockAddr a = parseHostPort(hostPort);
  UniqueIdData id{};
  id.magic = kIdMagic;
  id.version = kBootVersion;
  id.port = a.port();
  memcpy(id.secret, secret, 16);
  id.localKey = 0;
  std::string host = a.str();
  host = host.substr(0, host.rfind(':'));
  if (!host.empty() && host[0] == '[') host = host.substr(1, host.size() - 2);
  snprintf(id.host, sizeof id.host, "%s", host.c_str());
  loomUniqueId out;
  memset(&out, 0, sizeof out);
  memcpy(out.internal, &id, sizeof id);
  return out;
}

SockAddr rootAddress(const UniqueIdData& id) {
  if (id.localKey != 0 && id.localKey == localKey()) return resolveAddr("127.0.0.1", id.port);
  return resolveAddr(id.host, id.port);
}

Bootstrap::Bootstrap(const UniqueIdData& id, int rank, int nranks, int64_t deadlineMs, BootCheck check)
    : rank_(rank), nranks_(nranks), deadline_(deadlineMs) {
  // A constructor that throws runs no destructor: close what is open here.
  try {
    join(id, check);
  } catch (...) {
    closeFd(rootFd_);
    for (int& fd : fds_) closeFd(fd);
    throw;
  }
}

void Bootstrap::join(const UniqueIdData& id, const BootCheck& check) {
  const int rank = rank_, nranks = nranks_;
  if (rank == 0) {
    serve(id, check);
    return;
  }
  SockAddr root = rootAddress(id);
  try {
    rootFd_ = connectTo(root, check ? std::min(deadline_, nowMs() + 2000) : deadline_);
  } catch (const Error& e) {
    fail(e.code(), "rank %d cannot reach the bootstrap root at %s: %s", rank, root.str().c_str(), e.what());
  }
  local_ = localAddr(rootFd_);
  JoinHello hello{kJoinMagic, kBootVersion, {}, rank, nranks};
  memcpy(hello.secret, id.secret, 16);
  JoinReply reply{};
  try {
    sendAll(rootFd_, &hello, sizeof hello, deadline_);
    recvAll(rootFd_, &reply, sizeof reply, deadline_);
  } catch (const Error& e) {
    fail(e.code(), "rank %d: bootstrap with root %s failed: %s%s", rank, root.str().c_str(), e.what(),
         e.code() == loomTimeout ? " (rank 0 answers once every rank has joined: a rank is missing, or rank 0 "
                                   "itself has not called init)"
                                 : "");
  }
  checkJoinReply(&reply, sizeof reply, rank);
}

Bootstrap::~Bootstrap() {
  closeFd(rootFd_);
  for (int& fd : fds_) closeFd(fd);
}

void Bootstrap::serve(const UniqueIdData& id, const BootCheck& check) {
  int listenFd = -1;
  {
    std::lock_guard<std::mutex> lock(gListenMutex);
    const std::string key = secretKey(id.secret);
    auto it = std::find_if(gListeners.begin(), gListeners.end(), [&](const auto& l) { return l.first == key; });
    if (it != gListeners.end()) {
      listenFd = it->second;
      gListeners.erase(it);
    }
  }
  // The inherited listener (above), when it is on this id's port and no
  // other bootstrap of this process is serving it.
  std::unique_lock<std::mutex> inherited;
  bool ownListener = true;
  if (listenFd < 0) {
    InheritedRoot& ir = inheritedRoot();
    inherited = std::unique_lock<std::mutex>(ir.busy, std::try_to_lock);
    if (inherited.owns_lock() && !ir.value.empty() && ir.fd < 0 && !ir.warned) {
      ir.warned = true;
      LOOM_WARN("BOOT", "LOOM_ROOT_FD=%s is not a listening socket; binding the port instead", ir.value.c_str());
    }
    if (inherited.owns_lock() && ir.fd >= 0 && ir.port == id.port) {
      listenFd = ir.fd;
      ownListener = false;
      LOOM_INFO("BOOT", "bootstrap root: serving port %u on the descriptor loom-run opened (%d)", unsigned(ir.port),
                ir.fd);
    }
  }
  if (listenFd < 0) {
    // The id came from the environment: rank 0 opens the port named in it.
    // Or it is loomGetUniqueId's whose listener was closed (too many unused
    // ids): every address again, as loomGetUniqueId listened (ranks of this
    // host come through loopback).
    SockAddr a = resolveAddr(id.host, id.port);
    if (id.localKey != 0) a = resolveAddr(a.ss.ss_family == AF_INET6 ? "::" : "0.0.0.0", id.port);
    try {
      listenFd = listenOn(a);
    } catch (const Error& e) {
      fail(e.code(),
           "rank 0 cannot open the bootstrap port %s: %s (every rank must name the same free port: "
           "LOOM_ROOT_ADDR=host:port, or LOOM_ROOT_PORT under torchrun, mpirun and srun)",
           a.str().c_str(), e.what());
    }
  }
  local_ = localAddr(listenFd);
  fds_.assign(size_t(nranks_), -1);

  struct Pending {
    int fd;
    size_t got;
    int64_t deadline;
    JoinHello hello;
  };
  std::vector<Pending> pending;
  int joined = 1;
  auto drop = [&](size_t i, const char* why) {
    LOOM_WARN("BOOT", "bootstrap root: dropped a connection (%s); still waiting for the ranks", why);
    close(pending[i].fd);
    pending.erase(pending.begin() + long(i));
  };
  auto reject = [&](int fd, loomResult_t code, const std::string& msg) {
    JoinReply r{kJoinMagic, code, {}};
    snprintf(r.message, sizeof r.message, "%s", msg.c_str());
    try {
      sendAll(fd, &r, sizeof r, nowMs() + 1000);
    } catch (const Error&) {
    }
  };
  try {
    while (joined < nranks_) {
      int64_t now = nowMs();
      if (now >= deadline_) {
        std::string missing;
        for (int r = 1; r < nranks_; ++r)
          if (fds_[size_t(r)] < 0) missing += strf(" %d", r);
        fail(loomTimeout, "bootstrap: %d of %d ranks joined before the timeout; missing:%s", joined,
             nranks_, missing.c_str());
      }
      for (size_t i = 0; i < pending.size();) {
        if (now > pending[i].deadline) drop(i, "no complete hello within 5 s");
        else ++i;
      }
      if (check) {
        std::vector<bool> joinedRanks(fds_.size());
        for (size_t r = 0; r < fds_.size(); ++r) joinedRanks[r] = r == 0 || fds_[r] >= 0;
        check(joinedRanks);
      }
      std::vector<pollfd> pfds{{listenFd, POLLIN, 0}};
      for (auto& p : pending) pfds.push_back({p.fd, POLLIN, 0});
      int rc = poll(pfds.data(), pfds.size(), 100);
      if (rc < 0 && errno != EINTR) failErrno("poll");
      if (rc <= 0) continue;
      for (size_t i = pfds.size() - 1; i >= 1; --i) {
        if (!pfds[i].revents) continue;
        Pending& p = pending[i - 1];
        ssize_t n = recv(p.fd, reinterpret_cast<char*>(&p.hello) + p.got, sizeof p.hello - p.got,
                         MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          drop(i - 1, p.got ? "truncated hello" : "closed without a hello");
          continue;
        }
        if (n < 0) continue;
        p.got += size_t(n);
        if (p.got < sizeof p.hello) continue;
        // A hello whose sender has closed already: a rank of an earlier
        // init that gave up (loom-run's listener outlives inits and keeps
        // what queued in between); taking it would refuse the real one.
        char probe;
        if (recv(p.fd, &probe, 1, MSG_PEEK | MSG_DONTWAIT) == 0) {
          drop(i - 1, "closed after its hello (a rank of an earlier init that gave up)");
          continue;
        }
        std::vector<bool> joinedRanks(fds_.size());
        for (size_t r = 0; r < fds_.size(); ++r) joinedRanks[r] = fds_[r] >= 0;
        JoinCheck chk = checkJoinHello(&p.hello, sizeof p.hello, id.secret, nranks_, joinedRanks);
        if (chk.verdict == JoinVerdict::Drop) {
          drop(i - 1, chk.why.c_str());
          continue;
        }
        if (chk.verdict == JoinVerdict::Reject) {
          reject(p.fd, loomInvalidUsage, chk.why);
          drop(i - 1, "wrong version");
          continue;
        }
        if (chk.verdict == JoinVerdict::Fatal) {
          reject(p.fd, loomInvalidUsage, chk.why);
          fail(loomInvalidUsage, "bootstrap: %s", chk.why.c_str());
        }
        fds_[size_t(chk.rank)] = p.fd;
        pending.erase(pending.begin() + long(i - 1));
        ++joined;
      }
      if (pfds[0].revents & POLLIN) {
        int fd = accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd >= 0) {
          if (pending.size() >= 1024) drop(0, "too many pending connections");
          pending.push_back(Pending{fd, 0, nowMs() + 5000, {}});
        } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // The connection stays in the backlog and poll() keeps saying so:
          // waiting would spin until the timeout while the joiners wait too.
          failErrno("bootstrap root: accept");
        }
      }
    }
  } catch (const Error& e) {
    for (auto& p : pending) close(p.fd);
    for (int r = 1; r < nranks_; ++r)
      if (fds_[size_t(r)] >= 0) reject(fds_[size_t(r)], e.code(), strf("rank 0: %s", e.what()));
    if (ownListener) close(listenFd);
    throw;
  }
  for (auto& p : pending) close(p.fd);
  if (ownListener) close(listenFd);
  JoinReply ok{kJoinMagic, loomSuccess, {}};
  for (int r = 1; r < nranks_; ++r) {
    setNonBlocking(fds_[size_t(r)], false);
    sendAll(fds_[size_t(r)], &ok, sizeof ok, deadline_);
  }
}

std::vector<uint8_t> Bootstrap::allGather(const void* mine, size_t bytes) {
  std::vector<uint8_t> all(bytes * size_t(nranks_));
  memcpy(all.data() + size_t(rank_) * bytes, mine, bytes);
  // Name the rank whose connection failed: during init a dead rank is
  // found here first (the others then see the root's connection close).
  int r = 1;
  try {
    if (rank_ == 0) {
      for (r = 1; r < nranks_; ++r) recvAll(fds_[size_t(r)], all.data() + size_t(r) * bytes, bytes, deadline_);
      for (r = 1; r < nranks_; ++r) sendAll(fds_[size_t(r)], all.data(), all.size(), deadline_);
    } else {
      sendAll(rootFd_, mine, bytes, deadline_);
      recvAll(rootFd_, all.data(), all.size(), deadline_);
    }
  } catch (const Error& e) {
    if (rank_ == 0)
      fail(e.code(), "rank 0: bootstrap exchange with rank %d: %s (did it die during init?)", r, e.what());
    fail(e.code(), "rank %d: bootstrap exchange with the root (rank 0): %s (the root gives up when any rank fails during init)",
         rank_, e.what());
  }
  return all;
}

int bootstrapPortForJob(const std::string& jobKey) {
  // Rank 0's bind failed with "Address already in use" in a CI run when the
  // range reached into the ephemeral ports (mpirun's own connections).
  return 20000 + int(std::hash<std::string>()(jobKey) % 12768);
}

}  // namespace loom
