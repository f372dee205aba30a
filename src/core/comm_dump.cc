// What a rank is doing, for people debugging a hang: the operation it runs,
// for how long, which peer it waits for, and how many operations wait behind
// it.  loomCommDump prints one communicator; LOOM_DUMP_SIGNAL=N makes signal
// N print every communicator of the process (from a thread: the signal
// handler itself only writes a byte to a pipe, which is async-signal-safe).
#include "src/core/comm_dump.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/log.h"
#include "src/device/device_comm.h"

using namespace loom;

LOOM_HOT void loomComm::noteRunning(const SlotTag& tag, size_t nops) {
  actSeq_.store(tag.seq, std::memory_order_relaxed);
  actCount_.store(tag.count, std::memory_order_relaxed);
  actSig_.store(uint32_t(tag.coll) | uint32_t(tag.dtype) << 8 | uint32_t(tag.op) << 16,
                std::memory_order_relaxed);
  actRoot_.store(tag.root, std::memory_order_relaxed);
  actOps_.store(int32_t(nops), std::memory_order_relaxed);
  actPeer_.store(-1, std::memory_order_relaxed);
  actStartNs_.store(nowCoarseNs(), std::memory_order_release);  // shown in ms
}

void loomComm::noteWaiting(int peer) {
  // Called about every 20 ms while the rank waits, once per peer it waits
  // on: the first peer of a round is the one shown (receives come first),
  // and a wait is continuous while the rounds keep coming (tcp connection
  // setup notes every 100 ms).
  int64_t now = nowNs();
  int64_t last = actNoteNs_.load(std::memory_order_relaxed);
  int prev = actPeer_.load(std::memory_order_relaxed);
  if (prev >= 0 && now - last < 10 * 1000000LL) return;
  actNoteNs_.store(now, std::memory_order_relaxed);
  if (prev != peer || now - last > 500 * 1000000LL) {
    actWaitNs_.store(now, std::memory_order_relaxed);
    actPeer_.store(peer, std::memory_order_release);
  }
}

LOOM_HOT void loomComm::noteIdle() { actStartNs_.store(0, std::memory_order_release); }

static SlotTag loadTag(const std::atomic<uint64_t>& seq, const std::atomic<uint64_t>& count,
                       const std::atomic<uint32_t>& sig, const std::atomic<int32_t>& root) {
  SlotTag t{};
  t.seq = seq.load(std::memory_order_relaxed);
  t.count = count.load(std::memory_order_relaxed);
  uint32_t s = sig.load(std::memory_order_relaxed);
  t.coll = uint8_t(s), t.dtype = uint8_t(s >> 8), t.op = uint8_t(s >> 16);
  t.root = root.load(std::memory_order_relaxed);
  return t;
}

std::string loomComm::runningOp() const {
  if (!actStartNs_.load(std::memory_order_acquire)) return "an operation";
  return describeTag(loadTag(actSeq_, actCount_, actSig_, actRoot_));
}

std::string loomComm::dump() {
  uint64_t issued = nextTicket_.load(), served = serving_.load();
  std::string s = strf("loom rank %d of %d%s%s%s (pid %d, comm %016llx): %llu operations issued, %llu done", rank_,
                       nranks_, part_ ? " of a hierarchical path's " : "", part_ ? part_ : "",
                       part_ ? " communicator" : "", int(getpid()), (unsigned long long)peers_[0].commTag,
                       (unsigned long long)issued, (unsigned long long)served);
  int err = asyncError_.load();
  if (err != loomSuccess) s += strf("; failed (%s): %s", loomGetErrorString(loomResult_t(err)), lastError().c_str());
  if (revoked_.load()) s += "; revoked";
  s += "\n";
  std::set<int> dead = deadRanks(), unreachable = unreachableRanks();
  if (!dead.empty()) {
    s += "  dead ranks (their control socket refused):";
    for (int r : dead) s += strf(" %d", r);
    s += "\n";
  }
  if (!unreachable.empty()) {
    s += "  unreachable ranks (their control socket did not answer):";
    for (int r : unreachable) s += strf(" %d", r);
    s += "\n";
  }
  int64_t start = actStartNs_.load(std::memory_order_acquire);
  int64_t now = nowNs();
  if (start) {
    const int64_t coarse = nowCoarseNs();  // noteRunning's clock
    SlotTag t = loadTag(actSeq_, actCount_, actSig_, actRoot_);
    int nops = actOps_.load(std::memory_order_relaxed);
    s += strf("  running: %s%s for %lld ms\n", describeTag(t).c_str(),
              nops > 1 ? strf(" and %d more of its group", nops - 1).c_str() : "",
              (long long)(std::max<int64_t>(coarse - start, 0) / 1000000));
    int peer = actPeer_.load(std::memory_order_acquire);
    if (peer >= 0)
      s += strf("  waiting for rank %d (%s) for %lld ms\n", peer, transportTo(peer),
                (long long)((now - actWaitNs_.load(std::memory_order_relaxed)) / 1000000));
  } else {
    s += "  running: nothing\n";
  }
  uint64_t queued = issued - served - (start && issued > served ? 1 : 0);
  if (queued) s += strf("  queued behind it: %llu operations\n", (unsigned long long)queued);
  if (size_t kept = inPlaceInputs_.bytes())
    s += strf("  kept for in-place all-to-all inputs: %zu bytes of host memory the peers can map\n", kept);
  if (const DeviceCollectives* d = device_.get()) s += d->describe();
  return s;
}

namespace loom {

namespace {

std::mutex gDumpMutex;
std::set<loomComm*>* gComms = nullptr;  // leaked: may be used at exit
int gDumpPipe[2] = {-1, -1};

void onDumpSignal(int) {
  int saved = errno;
  char c = 1;
  ssize_t n = write(gDumpPipe[1], &c, 1);
  (void)n;
  errno = saved;
}

void dumpThread() {
  for (;;) {
    char buf[64];
    ssize_t n = read(gDumpPipe[0], buf, sizeof buf);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    std::string text = dumpAll();
    if (text.empty()) text = "loom: no live communicators in this process\n";
    fputs(text.c_str(), stderr);
    fflush(stderr);
  }
}

void installSignal() {
  int sig = int(config().dumpSignal);
  if (sig <= 0) return;
  if (pipe2(gDumpPipe, O_CLOEXEC) != 0) {
    LOOM_WARN("INIT", "LOOM_DUMP_SIGNAL=%d: no pipe (%s); not installed", sig, strerror(errno));
    return;
  }
  fcntl(gDumpPipe[1], F_SETFL, O_NONBLOCK);  // a storm of signals must not block the handler
  std::thread(dumpThread).detach();
  struct sigaction sa{};
  sa.sa_handler = onDumpSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (sigaction(sig, &sa, nullptr) != 0)
    LOOM_WARN("INIT", "LOOM_DUMP_SIGNAL=%d: sigaction failed (%s)", sig, strerror(errno));
  else
    LOOM_INFO("INIT", "signal %d prints the state of every communicator (LOOM_DUMP_SIGNAL)", sig);
}

}  // namespace

void dumpRegister(loomComm* c) {
  static std::once_flag once;
  std::call_once(once, installSignal);
  std::lock_guard<std::mutex> lock(gDumpMutex);
  if (!gComms) gComms = new std::set<loomComm*>;
  gComms->insert(c);
}

void dumpUnregister(loomComm* c) {
  std::lock_guard<std::mutex> lock(gDumpMutex);
  if (gComms) gComms->erase(c);
}

std::string dumpAll() {
  std::lock_guard<std::mutex> lock(gDumpMutex);
  std::string s;
  if (gComms)
    for (loomComm* c : *gComms) s += c->dump();
  return s;
}

}  // namespace loom
