// Bootstrap: how the ranks of a new communicator find each other.
//
// The unique id names the root's listener and carries a 128-bit secret.
// Every rank connects to the root and presents the secret; the root drops
// any connection that does not (garbage, wrong secret, truncated frames,
// silence) with a warning and keeps waiting for the real ranks.  Once all
// have joined, allGather() exchanges fixed-size records through the root;
// the connections close when init is done.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "loom.h"
#include "src/core/socket.h"

namespace loom {

// The bootstrap's wire version (unique ids, join hellos, the RankInfo
// records exchanged): ranks of different versions refuse each other.
// 2: RankInfo carries the device slot and one-shot sizes.
constexpr uint16_t kBootVersion = 2;

struct UniqueIdData {
  uint32_t magic;
  uint16_t version;
  uint16_t port;
  uint8_t secret[16];
  uint64_t localKey;  // the root's loopback domain (see localKey())
  char host[88];      // numeric address of the root for ranks elsewhere
};
static_assert(sizeof(UniqueIdData) <= LOOM_UNIQUE_ID_BYTES, "unique id too large");

// Ranks with equal keys share a kernel and network namespace, so they can
// reach each other through 127.0.0.1.
uint64_t localKey();
// hostname + boot id: ranks with equal ids share memory (unless LOOM_HOST_ID).
std::string machineHostId();

void fillRandom(void* buf, size_t n);

// Opens a listener for a new root and describes it in *id.  It advertises
// `advertise`'s host when given (an address peers are known to reach: a
// hierarchical device path's sub-communicators use their parent's), else
// LOOM_SOCKET_IFNAME's, else the first interface that is up.
void makeUniqueId(loomUniqueId* id, const SockAddr* advertise = nullptr);
UniqueIdData decodeUniqueId(const loomUniqueId& id);
// Builds an id for a root at hostPort with the given secret (environment
// launchers); rank 0 binds the port itself.
loomUniqueId uniqueIdFor(const std::string& hostPort, const uint8_t secret[16]);
// The bootstrap port loomCommInitFromEnv derives from a launcher's job id
// when nothing names one: 20000-32767, below Linux's default ephemeral
// range (32768-60999), where an outgoing connection could hold it.
int bootstrapPortForJob(const std::string& jobKey);

// The address this process should use to reach the root described by id.
SockAddr rootAddress(const UniqueIdData& id);

// The bootstrap's wire messages and their checks, as pure functions of the
// received bytes so that tests/fuzz can drive them without sockets.
struct JoinHello {
  uint32_t magic;
  uint32_t version;
  uint8_t secret[16];
  int32_t rank;
  int32_t nranks;
};
struct JoinReply {
  uint32_t magic;
  int32_t status;  // loomResult_t
  char message[248];
};
enum class JoinVerdict {
  Drop,    // not a rank of this communicator: close it with a warning
  Reject,  // a loom rank that cannot join (version): tell it why, then close
  Fatal,   // a rank of this communicator that disagrees (nranks, rank): init fails
  Accept,
};
struct JoinCheck {
  JoinVerdict verdict;
  int rank;         // Accept: the joining rank
  std::string why;  // otherwise
};
// Checks a complete hello (n must be sizeof(JoinHello)); joined[r] says
// whether rank r has joined already.
JoinCheck checkJoinHello(const void* bytes, size_t n, const uint8_t secret[16], int nranks,
                         const std::vector<bool>& joined);
// Reads the root's reply to a hello; throws loom::Error for a refusal or for
// bytes that are not a reply.
void checkJoinReply(const void* bytes, size_t n, int rank);

// Called by the root about every 100 ms while it waits for ranks to join,
// with who has joined; throws to give up (the shrink uses it to notice a
// member that died after agreeing).  Set, it also bounds a joining rank's
// attempts to reach a root that refuses (one that exists already) to 2 s.
using BootCheck = std::function<void(const std::vector<bool>& joined)>;

class Bootstrap {
 public:
  // Joins the communicator (rank 0 serves).  Blocks until every rank has
  // joined or deadlineMs passes.
  Bootstrap(const UniqueIdData& id, int rank, int nranks, int64_t deadlineMs, BootCheck check = nullptr);
  ~Bootstrap();
  // Every rank contributes `bytes` bytes; returns nranks*bytes in rank order.
  std::vector<uint8_t> allGather(const void* mine, size_t bytes);
  // The local address of this rank's connection to the root (the interface
  // that reaches it).
  SockAddr localAddress() const { return local_; }

 private:
  void join(const UniqueIdData& id, const BootCheck& check);
  void serve(const UniqueIdData& id, const BootCheck& check);
  int rank_, nranks_;
  int64_t deadline_;
  int rootFd_ = -1;         // rank > 0
  std::vector<int> fds_;    // rank 0: connection of each rank
  SockAddr local_;
};

}  // namespace loom
