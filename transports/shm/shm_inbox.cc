#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <climits>
#include <cstring>

#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"
#include "src/device/host_memory.h"
#include "src/topology/numa.h"
#include "transports/shm/shm_transport.h"

namespace loom {

static constexpr uint32_t kInboxMagic = 0x4c4d5348;  // "LMSH"

// Fills an abstract unix socket address (leading NUL: no file, gone with
// the socket, scoped to the network namespace like a host).
static socklen_t wakeAddress(const std::string& name, sockaddr_un* a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t n = std::min(name.size(), sizeof a->sun_path - 2);
  memcpy(a->sun_path + 1, name.data(), n);
  return socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
}

std::unique_ptr<ShmInbox> ShmInbox::create(const ShmLayout& layout, const std::string& wakeName) {
  std::unique_ptr<ShmInbox> box(new ShmInbox());
  box->layout_ = layout;
  box->owner_ = true;  // from here on: the destructor closes what create made
  box->fd_ = int(syscall(SYS_memfd_create, "loom-inbox", unsigned(MFD_CLOEXEC)));
  if (box->fd_ < 0) failErrno("memfd_create");
  box->wakeFd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (box->wakeFd_ < 0) failErrno("socket(AF_UNIX)");
  box->wakeLen_ = wakeAddress(wakeName, &box->wakeAddr_);
  if (bind(box->wakeFd_, reinterpret_cast<sockaddr*>(&box->wakeAddr_), box->wakeLen_) != 0)
    failErrno("bind(wake-up socket)");
  fchmod(box->fd_, 0600);
  if (ftruncate(box->fd_, off_t(layout.totalBytes())) != 0) failErrno("ftruncate(shm inbox)");
  void* p = mmap(nullptr, layout.totalBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, box->fd_, 0);
  if (p == MAP_FAILED) failErrno("mmap(shm inbox)");
  box->base_ = static_cast<uint8_t*>(p);
  // The inbox is read by its owner and written by its peers: keep it on the
  // owner's NUMA node rather than wherever a peer happens to touch it first.
  LOOM_INFO("SHM", "inbox of %zu bytes: %s", layout.totalBytes(),
            bindToLocalNumaNode(box->base_, layout.totalBytes()).c_str());
  ShmInboxHeader* h = new (box->base_) ShmInboxHeader();
  h->layout = layout;
  h->bell.store(0);
  h->sleeping.store(0);
  h->aborted.store(0);
  h->freeEpoch.store(0);
  hostMemWatchFrees(&h->freeEpoch);
  // The window needs no initialisation: a new memfd reads as zeros.
  for (uint32_t s = 0; s < layout.nranks; ++s)
    for (uint32_t c = 0; c < layout.channels; ++c) new (box->ring(int(s), int(c))) ShmRingCtl{{0}, {0}};
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kInboxMagic;
  return box;
}

std::unique_ptr<ShmInbox> ShmInbox::map(int pid, int fd, const std::string& wakeName, const ShmLayout& layout,
                                        int bellFd, std::string* why) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
  int myfd = open(path, O_RDWR | O_CLOEXEC);
  if (myfd < 0) {
    *why = strf("cannot open %s: %s", path, strerror(errno));
    return nullptr;
  }
  void* p = mmap(nullptr, layout.totalBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, myfd, 0);
  int e = errno;
  close(myfd);  // the mapping keeps the memory
  if (p == MAP_FAILED) {
    *why = strf("cannot map %s: %s", path, strerror(e));
    return nullptr;
  }
  std::unique_ptr<ShmInbox> box(new ShmInbox());
  box->base_ = static_cast<uint8_t*>(p);
  box->layout_ = layout;
  const ShmInboxHeader* h = box->header();
  if (h->magic != kInboxMagic || memcmp(&h->layout, &layout, sizeof layout) != 0) {
    *why = strf("inbox of pid %d has a different layout", pid);
    return nullptr;
  }
  box->wakeFd_ = bellFd;
  box->wakeLen_ = wakeAddress(wakeName, &box->wakeAddr_);
  return box;
}

ShmInbox::~ShmInbox() {
  if (owner_ && base_) hostMemUnwatchFrees(&header()->freeEpoch);  // harmless if never watched
  if (base_) munmap(base_, layout_.totalBytes());
  if (fd_ >= 0) close(fd_);
  if (owner_ && wakeFd_ >= 0) close(wakeFd_);  // a peer's is its transport's bell socket
}

ShmRingCtl* ShmInbox::ring(int sender, int channel) const {
  size_t index = size_t(sender) * layout_.channels + size_t(channel);
  return reinterpret_cast<ShmRingCtl*>(base_ + layout_.ringOffset() + index * layout_.ringBytes());
}

uint8_t* ShmInbox::slot(int sender, int channel, uint64_t index) const {
  return reinterpret_cast<uint8_t*>(ring(sender, channel)) + 128 +
         size_t(index % layout_.slots) * layout_.slotStride();
}

void shmCheckPeer(const ShmInbox* box, int peer, const ProcessWatch* process) {
  if (box->header()->aborted.load(std::memory_order_relaxed))
    failPeer(peer, loomRemoteError, "rank %d aborted its communicator", peer);
  if (process && process->dead()) failPeer(peer, loomRemoteError, "rank %d (pid %d) died", peer, process->pid());
}

static long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

void ShmInbox::ring_bell() const {
  // Pairs with the fence in sleep(): either the sleeper sees our head/tail
  // update on its last check, or we see its sleeping flag here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  ring_bell_fenced();
}

LOOM_HOT void ShmInbox::ring_bell_fenced() const {
  ShmInboxHeader* h = header();
  uint32_t how = h->sleeping.load(std::memory_order_relaxed);
  if (how == kSleepFutex) {
    h->bell.fetch_add(1, std::memory_order_relaxed);
    futex(&h->bell, FUTEX_WAKE, INT_MAX, nullptr);
  } else if (how == kSleepPoll) {
    char byte = 1;
    ssize_t w = sendto(wakeFd_, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL,
                       reinterpret_cast<const sockaddr*>(&wakeAddr_), wakeLen_);
    (void)w;  // a full queue already wakes the sleeper
  }
}

void ShmInbox::drainWakeFd() const {
  char buf[64];
  while (recv(wakeFd_, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
}

void ShmInbox::sleep(uint32_t seen, int64_t timeoutUs) const {
  timespec ts{time_t(timeoutUs / 1000000), long(timeoutUs % 1000000) * 1000};
  futex(&header()->bell, FUTEX_WAIT, seen, &ts);
}

}  // namespace loom
