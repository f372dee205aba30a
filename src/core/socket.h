// Thin, checked wrappers over TCP sockets for the bootstrap and the tcp
// transport.  Blocking helpers take an absolute deadline (nowMs() based) and
// fail with loomTimeout past it; a closed peer is loomRemoteError.
#pragma once
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom {

struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  std::string str() const;  // "1.2.3.4:5678" or "[::1]:5678"
  uint16_t port() const;
  void setPort(uint16_t port);
};

// Parses "host:port" / "[v6]:port" or resolves a host name.
SockAddr resolveAddr(const std::string& host, uint16_t port);
SockAddr parseHostPort(const std::string& hostPort);

// Address of interface `ifname` (IPv4 preferred); fails if it has none.
SockAddr interfaceAddr(const std::string& ifname);
// First non-loopback interface that is up, else loopback.
SockAddr defaultInterfaceAddr();
// An address no other host can reach us on: unspecified (0.0.0.0, ::) or
// loopback (127.0.0.0/8, ::1, ::ffff:127.x.x.x).
bool isLocalOnly(const SockAddr& a);

// Listening socket bound to addr (port 0 = any free port); CLOEXEC.
int listenOn(const SockAddr& addr, int backlog = 512);
SockAddr localAddr(int fd);

// Connects, retrying while the listener is not up yet, until the deadline.
int connectTo(const SockAddr& addr, int64_t deadlineMs);
// Accepts one connection or returns -1 if none arrived before the deadline.
int acceptUntil(int listenFd, int64_t deadlineMs);

void sendAll(int fd, const void* buf, size_t n, int64_t deadlineMs);
void recvAll(int fd, void* buf, size_t n, int64_t deadlineMs);

void setNonBlocking(int fd, bool on);
void setNoDelay(int fd);
void closeFd(int& fd);

}  // namespace loom
