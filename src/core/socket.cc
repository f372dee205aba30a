#include "src/core/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "src/core/clock.h"
#include "src/core/error.h"

namespace loom {

std::string SockAddr::str() const {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    return strf("%s:%u", host, unsigned(ntohs(a->sin_port)));
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return strf("[%s]:%u", host, unsigned(ntohs(a->sin6_port)));
  }
  return "?";
}

uint16_t SockAddr::port() const {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6)
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

void SockAddr::setPort(uint16_t port) {
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(port);
  if (ss.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(port);
}

SockAddr resolveAddr(const std::string& host, uint16_t port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) fail(loomInvalidArgument, "cannot resolve '%s': %s", host.c_str(), gai_strerror(rc));
  SockAddr a;
  memcpy(&a.ss, res->ai_addr, res->ai_addrlen);
  a.len = res->ai_addrlen;
  freeaddrinfo(res);
  a.setPort(port);
  return a;
}

SockAddr parseHostPort(const std::string& hp) {
  std::string host;
  std::string port;
  if (!hp.empty() && hp[0] == '[') {
    size_t close = hp.find(']');
    if (close == std::string::npos || close + 1 >= hp.size() || hp[close + 1] != ':')
      fail(loomInvalidArgument, "bad address '%s' (expected [v6]:port)", hp.c_str());
    host = hp.substr(1, close - 1);
    port = hp.substr(close + 2);
  } else {
    size_t colon = hp.rfind(':');
    if (colon == std::string::npos) fail(loomInvalidArgument, "bad address '%s' (expected host:port)", hp.c_str());
    host = hp.substr(0, colon);
    port = hp.substr(colon + 1);
  }
  char* end = nullptr;
  long p = strtol(port.c_str(), &end, 10);
  if (port.empty() || *end || p < 0 || p > 65535)
    fail(loomInvalidArgument, "bad port in address '%s'", hp.c_str());
  return resolveAddr(host, uint16_t(p));
}

static bool ifaddrToSock(const ifaddrs* ifa, SockAddr* out) {
  if (!ifa->ifa_addr) return false;
  int fam = ifa->ifa_addr->sa_family;
  if (fam != AF_INET && fam != AF_INET6) return false;
  out->len = fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  memcpy(&out->ss, ifa->ifa_addr, out->len);
  return true;
}

SockAddr interfaceAddr(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) failErrno("getifaddrs");
  SockAddr best;
  bool found = false;
  for (ifaddrs* ifa = list; ifa; ifa = ifa->ifa_next) {
    if (ifname != ifa->ifa_name) continue;
    SockAddr a;
    if (!ifaddrToSock(ifa, &a)) continue;
    if (!found || (a.ss.ss_family == AF_INET && best.ss.ss_family != AF_INET)) best = a, found = true;
  }
  freeifaddrs(list);
  if (!found) fail(loomInvalidArgument, "LOOM_SOCKET_IFNAME=%s: no such interface with an IP address", ifname.c_str());
  return best;
}

SockAddr defaultInterfaceAddr() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) failErrno("getifaddrs");
  SockAddr best;
  bool found = false;
  for (ifaddrs* ifa = list; ifa; ifa = ifa->ifa_next) {
    if (!(ifa->ifa_flags & IFF_UP) || (ifa->ifa_flags & IFF_LOOPBACK)) continue;
    SockAddr a;
    if (ifaddrToSock(ifa, &a) && a.ss.ss_family == AF_INET) { best = a; found = true; break; }
  }
  freeifaddrs(list);
  if (!found) best = resolveAddr("127.0.0.1", 0);
  best.setPort(0);
  return best;
}

bool isLocalOnly(const SockAddr& a) {
  if (a.ss.ss_family == AF_INET) {
    uint32_t ip = ntohl(reinterpret_cast<const sockaddr_in*>(&a.ss)->sin_addr.s_addr);
    return ip == 0 || (ip >> 24) == 127;
  }
  if (a.ss.ss_family == AF_INET6) {
    const in6_addr& ip = reinterpret_cast<const sockaddr_in6*>(&a.ss)->sin6_addr;
    if (IN6_IS_ADDR_UNSPECIFIED(&ip) || IN6_IS_ADDR_LOOPBACK(&ip)) return true;
    return IN6_IS_ADDR_V4MAPPED(&ip) && ip.s6_addr[12] == 127;
  }
  return false;
}

int listenOn(const SockAddr& addr, int backlog) {
  int fd = socket(addr.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) failErrno("socket");
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr.ss), addr.len) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    failErrno(strf("bind %s", addr.str().c_str()).c_str());
  }
  if (listen(fd, backlog) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    failErrno("listen");
  }
  return fd;
}

SockAddr localAddr(int fd) {
  SockAddr a;
  a.len = sizeof a.ss;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&a.ss), &a.len) != 0) failErrno("getsockname");
  return a;
}

static int pollOne(int fd, short events, int64_t deadlineMs) {
  for (;;) {
    int64_t left = deadlineMs - nowMs();
    if (left < 0) left = 0;
    pollfd p{fd, events, 0};
    int rc = poll(&p, 1, int(left > 1000 ? 1000 : left));
    if (rc > 0) return p.revents;
    if (rc < 0 && errno != EINTR) failErrno("poll");
    if (rc == 0 && nowMs() >= deadlineMs) return 0;
  }
}

int connectTo(const SockAddr& addr, int64_t deadlineMs) {
  for (int attempt = 0;; ++attempt) {
    int fd = socket(addr.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) failErrno("socket");
    int rc = connect(fd, reinterpret_cast<const sockaddr*>(&addr.ss), addr.len);
    if (rc != 0 && errno == EINPROGRESS) {
      int ev = pollOne(fd, POLLOUT, deadlineMs);
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (ev == 0) err = ETIMEDOUT;
      rc = err ? -1 : 0;
      errno = err;
    }
    if (rc == 0) {
      setNonBlocking(fd, false);
      setNoDelay(fd);
      return fd;
    }
    int e = errno;
    close(fd);
    bool retry = e == ECONNREFUSED || e == ETIMEDOUT || e == ECONNRESET || e == EAGAIN;
    if (!retry || nowMs() >= deadlineMs)
      fail(e == ETIMEDOUT || retry ? loomTimeout : loomSystemError, "connect to %s: %s",
           addr.str().c_str(), strerror(e));
    usleep(attempt < 20 ? 2000 : 20000);
  }
}

int acceptUntil(int listenFd, int64_t deadlineMs) {
  for (;;) {
    int ev = pollOne(listenFd, POLLIN, deadlineMs);
    if (ev == 0) return -1;
    int fd = accept4(listenFd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      setNoDelay(fd);
      return fd;
    }
    if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) failErrno("accept");
  }
}

void sendAll(int fd, const void* buf, size_t n, int64_t deadlineMs) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= size_t(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (pollOne(fd, POLLOUT, deadlineMs) == 0) fail(loomTimeout, "send timed out");
      continue;
    }
    if (errno == EPIPE || errno == ECONNRESET) fail(loomRemoteError, "connection closed by peer");
    failErrno("send");
  }
}

void recvAll(int fd, void* buf, size_t n, int64_t deadlineMs) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= size_t(r);
      continue;
    }
    if (r == 0) fail(loomRemoteError, "connection closed by peer");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (pollOne(fd, POLLIN, deadlineMs) == 0) fail(loomTimeout, "receive timed out");
      continue;
    }
    if (errno == ECONNRESET) fail(loomRemoteError, "connection reset by peer");
    failErrno("recv");
  }
}

void setNonBlocking(int fd, bool on) {
  int fl = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void closeFd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}

}  // namespace loom
