// Fuzzes the tcp transport's frame reader: the input arrives on a real
// socket (socketpair) as a peer's byte stream of SlotTag + payload frames and
// is read through the Connection interface the executor uses.  Every slot it
// hands out must fit the agreed slot size; a bad stream must end in
// loomRemoteError, never a crash, an overflow or a hang.
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "src/core/error.h"
#include "tests/fuzz/fuzz_common.h"
#include "transports/tcp/tcp_transport.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  loomfuzz::quiet();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // First byte: slot size (64 B .. 1 KiB, small so that frames are cheap to
  // fuzz) and slot count.
  size_t slotBytes = 64u << (data[0] & 3);
  int slots = 2 + (data[0] >> 2) % 4;
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) abort();
  auto conn = loom::makeTcpConnection(sv[0], 1, slotBytes, slots);
  const uint8_t* p = data + 1;
  size_t left = size - 1;
  bool closed = false;
  uint64_t slotsSeen = 0;
  try {
    for (int idle = 0; idle < 4;) {
      if (left > 0) {
        ssize_t w = write(sv[1], p, left);
        if (w > 0) p += w, left -= size_t(w);
      } else if (!closed) {
        close(sv[1]);
        closed = true;
      }
      conn->progress();
      loom::SlotTag tag;
      const void* in = conn->recvPeek(&tag);
      if (in) {
        if (tag.bytes > slotBytes) abort();
        volatile uint8_t sink = 0;
        for (uint32_t i = 0; i < tag.bytes; ++i) sink = sink + static_cast<const uint8_t*>(in)[i];
        conn->recvRelease();
        ++slotsSeen;
        idle = 0;
      } else if (closed) {
        ++idle;  // everything written and nothing more to read: a partial frame at the end
      }
    }
  } catch (const loom::Error& e) {
    if (e.code() != loomRemoteError) abort();
  }
  if (!closed) close(sv[1]);
  (void)slotsSeen;
  return 0;
}
