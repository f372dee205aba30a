// The shm plug-in: each rank's inbox (rings, doorbell, PeerMemory window),
// mapped by the ranks of its host that are in the same communicator.
//
// Record: the inbox's descriptor number in the owner's process (-1: none);
// a peer opens /proc/<pid>/fd/<fd>.  A pair uses shm only when both ends
// mapped each other's inbox.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"
#include "src/core/process_watch.h"
#include "transports/shm/shm_transport.h"

namespace loom {

namespace {

struct ShmRecord {
  int32_t inboxFd;
  int32_t pad;
};

class ShmTransport : public Transport, public Doorbell, public PeerMemory {
 public:
  ~ShmTransport() override {
    peerInbox_.clear();  // they ring through bellFd_
    if (bellFd_ >= 0) close(bellFd_);
  }

  const char* name() const override { return "shm"; }
  bool mayReach(const TransportEnv& env, int peer) const override { return env.sameHost(peer); }
  size_t recordBytes() const override { return sizeof(ShmRecord); }

  void publish(const TransportEnv& env, const std::vector<bool>& want, void* record) override {
    env_ = env;
    layout_ = ShmLayout{uint32_t(env.nranks), uint32_t(env.maxChannels), env.slots, env.slotBytes, env.windowBytes};
    peerInbox_.resize(size_t(env.nranks));
    watches_.assign(size_t(env.nranks), nullptr);
    ShmRecord rec{-1, 0};
    bool any = false;
    for (bool w : want) any |= w;
    if (any) {
      inbox_ = ShmInbox::create(layout_, wakeName(env.rank));
      rec.inboxFd = inbox_->fd();
      // One socket to ring every peer's bell from.  Per communicator, not
      // per process: the kernel charges each unread wake-up datagram to
      // the socket that sent it, and a socket's send buffer holds only a
      // few hundred, so one socket for every communicator could have one
      // idle inbox's leftovers silence the bells of all the others.
      bellFd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (bellFd_ < 0) failErrno("socket(AF_UNIX)");
      // Room for every peer's queue of unread bells (net.unix.max_dgram_qlen
      // + 1 of them, 11 by default, about 768 bytes each) where the default
      // send buffer (about 280 bells) is too small.  The kernel doubles the
      // value and caps it at twice net.core.wmem_max (212992 by default:
      // full queues of about 50 peers).
      const int sndbuf = env.nranks * 8 * 1024;
      if (sndbuf > 100 * 1024) setsockopt(bellFd_, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    }
    memcpy(record, &rec, sizeof rec);
  }

  bool accept(int r, const void* record, std::string* why) override {
    ShmRecord rec;
    memcpy(&rec, record, sizeof rec);
    if (rec.inboxFd < -1) fail(loomRemoteError, "rank %d sent shm descriptor %d during init", r, rec.inboxFd);
    if (!inbox_) {
      *why = "this rank made no inbox";
      return false;
    }
    if (rec.inboxFd < 0) {
      *why = strf("rank %d made no inbox", r);
      return false;
    }
    int pid = env_.pid[size_t(r)];
    peerInbox_[size_t(r)] = ShmInbox::map(pid, rec.inboxFd, wakeName(r), layout_, bellFd_, why);
    if (!peerInbox_[size_t(r)]) {
      LOOM_WARN("SHM", "rank %d: no shared memory with rank %d (%s)", env_.rank, r, why->c_str());
      return false;
    }
    watches_[size_t(r)] = ProcessWatch::of(pid);
    return true;
  }

  void serve(const std::vector<bool>& chosen) override {
    for (size_t r = 0; r < chosen.size(); ++r)
      if (!chosen[r]) {
        peerInbox_[r].reset();
        watches_[r].reset();
      }
    headers_.assign(peerInbox_.size(), nullptr);
    for (size_t r = 0; r < peerInbox_.size(); ++r)
      if (peerInbox_[r]) headers_[r] = peerInbox_[r]->header();
  }

  std::unique_ptr<Connection> connect(int peer, int channel, int64_t, ConnectHost&) override {
    return makeShmConnection(inbox_.get(), peerInbox_[size_t(peer)].get(), env_.rank, peer, channel,
                             watches_[size_t(peer)]);
  }

  void abort() override {
    if (inbox_) inbox_->header()->aborted.store(1);
  }

  bool peekIncoming(int peer, int channel, SlotTag* tag) const override {
    if (!inbox_ || channel >= env_.maxChannels) return false;
    ShmRingCtl* r = inbox_->ring(peer, channel);
    uint64_t tail = r->tail.load(std::memory_order_acquire);
    if (r->head.load(std::memory_order_acquire) == tail) return false;
    memcpy(tag, inbox_->slot(peer, channel, tail), sizeof *tag);
    return true;
  }

  Doorbell* doorbell() override { return inbox_ ? this : nullptr; }
  PeerMemory* peerMemory() override { return inbox_ && layout_.windowBytes ? this : nullptr; }
  CostLink costAs() const override { return CostLink::Shm; }

  // ---- Doorbell ----
  uint32_t begin(bool withFds) override {
    // Bells rung while this rank was not about to poll are stale: the
    // caller checks for work after begin() anyway.  Emptied before saying
    // it sleeps, so that no bell rung for this sleep is lost, and so that
    // leftovers do not pile up (each is charged to its sender's socket).
    if (withFds) inbox_->drainWakeFd();
    ShmInboxHeader* h = inbox_->header();
    h->sleeping.store(withFds ? kSleepPoll : kSleepFutex, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return h->bell.load(std::memory_order_relaxed);
  }
  void sleep(uint32_t token, std::vector<pollfd>& fds, int64_t timeoutUs) override {
    if (fds.empty()) {
      inbox_->sleep(token, timeoutUs);
      return;
    }
    timespec ts{time_t(timeoutUs / 1000000), long(timeoutUs % 1000000) * 1000};
    fds.push_back(pollfd{inbox_->wakeFd(), POLLIN, 0});
    ppoll(fds.data(), fds.size(), &ts, nullptr);
    inbox_->drainWakeFd();
  }
  void end() override { inbox_->header()->sleeping.store(0, std::memory_order_relaxed); }

  // ---- PeerMemory (ranks this transport serves, and this rank) ----
  size_t windowBytes() const override { return layout_.windowBytes; }
  uint8_t* window(int r) const override { return box(r)->window(); }
  void wake(int r) const override {
    if (r != env_.rank) box(r)->ring_bell();
  }
  // The one-shot paths wake every peer twice per operation: one fence
  // (what each ring_bell pays) for all of them, and one look per peer at its
  // `sleeping` word through headers_ (one array), not through its ShmInbox.
  LOOM_HOT void wakeOthers(int me, int nranks) const override {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    for (int r = 0; r < nranks; ++r) {
      if (r == me) continue;
      const ShmInboxHeader* h = size_t(r) < headers_.size() ? headers_[size_t(r)] : nullptr;
      if (!h || h->sleeping.load(std::memory_order_relaxed)) box(r)->ring_bell_fenced();
    }
  }
  void checkPeer(int r) const override {
    if (r != env_.rank) shmCheckPeer(box(r), r, watches_[size_t(r)].get());
  }
  // Memory from loomMemAlloc: peers map its memfd as they map inboxes.
  bool exportBuffer(const void* p, size_t bytes, PeerBuffer* out) const override {
    return hostMemExport(p, bytes, out);
  }
  const uint8_t* importBuffer(int r, const PeerBuffer& b, size_t need, uint64_t op) const override {
    if (r == env_.rank) return reinterpret_cast<const uint8_t*>(uintptr_t(b.addr));
    uint64_t epoch = box(r)->header()->freeEpoch.load(std::memory_order_acquire);
    return imports_.import(r, env_.pid[size_t(r)], b, need, epoch, op);
  }

 private:
  std::string wakeName(int r) const { return strf("loom/%016llx/%d", (unsigned long long)env_.commTag, r); }
  ShmInbox* box(int r) const {
    ShmInbox* b = r == env_.rank ? inbox_.get() : peerInbox_[size_t(r)].get();
    if (!b) fail(loomInternalError, "rank %d: no shared memory with rank %d", env_.rank, r);
    return b;
  }

  TransportEnv env_;
  ShmLayout layout_;
  std::unique_ptr<ShmInbox> inbox_;
  std::vector<std::unique_ptr<ShmInbox>> peerInbox_;
  int bellFd_ = -1;  // the peer inboxes' bell socket (this communicator's)
  std::vector<const ShmInboxHeader*> headers_;  // peerInbox_[r]'s header, or nullptr
  std::vector<std::shared_ptr<const ProcessWatch>> watches_;  // the peers' processes (shared process-wide)
  mutable HostImportCache imports_;  // peers' loomMemAlloc buffers mapped here
};

}  // namespace

std::unique_ptr<Transport> makeShmTransport() { return std::make_unique<ShmTransport>(); }

}  // namespace loom
