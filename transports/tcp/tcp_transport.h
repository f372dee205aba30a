// TCP transport: one socket per (peer, channel) carrying both directions.
// Slots are staged in this process: a posted send slot is written with
// writev (tag + payload) by progress(); arriving bytes are read straight into
// a free receive slot.  TCP's own window is the flow control between the
// two slot rings.
#pragma once
#include <cstdint>
#include <cstddef>
#include <memory>
#include <string>

#include <sys/socket.h>

#include "transports/transport.h"

namespace loom {

// Hello sent by the connecting side of a data connection.
struct TcpHello {
  uint32_t magic;
  uint32_t version;
  uint8_t secret[16];
  uint64_t commTag;  // tells communicators that share nothing else apart
  int32_t rank;
  int32_t channel;
};

constexpr uint32_t kTcpHelloMagic = 0x4c4d5443;  // "LMTC"
constexpr uint32_t kTcpVersion = 1;

// Checks the hello that opens an accepted data connection (the bytes as
// received; n must be sizeof(TcpHello)).  On success fills *out; otherwise
// says why the connection must be dropped.
bool checkTcpHello(const void* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                   int maxChannels, TcpHello* out, std::string* why);

std::unique_ptr<Connection> makeTcpConnection(int fd, int peer, size_t slotBytes, int slots);

// A rank's tcp record in the init all-gather: where its data listener is.
struct TcpRecord {
  sockaddr_storage addr;
  uint32_t len;
  uint32_t pad;
};
// Checks rank r's record (bytes from the network); throws loomRemoteError.
void checkTcpRecord(const TcpRecord& rec, int r);

// The plug-in (tcp_plugin.cc): a listener per rank; of each pair the higher
// rank connects and sends a TcpHello, the lower one accepts.
std::unique_ptr<Transport> makeTcpTransport();
// The address a tcp transport made by makeTcpTransport() listens on (tests).
SockAddr tcpListenAddress(const Transport& t);

}  // namespace loom
