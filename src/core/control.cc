#include "src/core/control.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/log.h"

namespace loom {

namespace {

constexpr uint32_t kCtlMagic = 0x4c43544cu;  // "LCTL"
// Extra bytes of one message: a CUDA communicator's signature batch is the
// largest (src/device/op_signature.h); causes and answers stay far below.
constexpr uint32_t kMaxExtra = 16384;
constexpr size_t kMaxCauseText = 2040;

struct CtlHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t commTag;
  uint8_t secret[16];
  int32_t from;
  int32_t count;
  uint32_t extra;
  uint32_t pad;
};
static_assert(sizeof(CtlHeader) == 48, "CtlHeader is a wire format");

void closeQuiet(int fd) {
  if (fd >= 0) close(fd);
}

}  // namespace

std::vector<uint8_t> encodeCtl(const CtlMsg& m, const uint8_t secret[16], uint64_t commTag) {
  CtlHeader h{};
  h.magic = kCtlMagic;
  h.type = uint32_t(m.type);
  h.commTag = commTag;
  memcpy(h.secret, secret, 16);
  h.from = m.from;
  h.count = int32_t(m.ranks.size());
  h.extra = uint32_t(m.extra.size());
  std::vector<uint8_t> out(sizeof h + m.ranks.size() * 4 + m.extra.size());
  memcpy(out.data(), &h, sizeof h);
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    int32_t r = m.ranks[i];
    memcpy(out.data() + sizeof h + i * 4, &r, 4);
  }
  if (!m.extra.empty()) memcpy(out.data() + sizeof h + m.ranks.size() * 4, m.extra.data(), m.extra.size());
  return out;
}

long ctlMissing(const uint8_t* bytes, size_t n, const uint8_t secret[16], uint64_t commTag, int nranks,
                std::string* why) {
  if (n < sizeof(CtlHeader)) return long(sizeof(CtlHeader) - n);
  CtlHeader h;
  memcpy(&h, bytes, sizeof h);
  if (h.magic != kCtlMagic) return *why = "bad magic", -1;
  if (memcmp(h.secret, secret, 16) != 0 || h.commTag != commTag) return *why = "another communicator", -1;
  if (h.type < uint32_t(CtlType::Probe) || h.type > uint32_t(CtlType::ShrankWithout))
    return *why = strf("unknown type %u", h.type), -1;
  if (h.from < 0 || h.from >= nranks) return *why = strf("sender rank %d", h.from), -1;
  if (h.pad != 0) return *why = "reserved bytes set", -1;
  if (h.count < 0 || h.count > nranks || h.extra > kMaxExtra)
    return *why = strf("%d ranks, %u extra bytes", h.count, h.extra), -1;
  size_t total = sizeof h + size_t(h.count) * 4 + h.extra;
  if (n > total) return *why = "trailing bytes", -1;
  return long(total - n);
}

std::vector<uint8_t> encodeCause(const CtlCause& c) {
  size_t text = std::min(c.msg.size(), kMaxCauseText);
  std::vector<uint8_t> out(8 + text);
  int32_t code = c.code, root = c.root;
  memcpy(out.data(), &code, 4);
  memcpy(out.data() + 4, &root, 4);
  if (text) memcpy(out.data() + 8, c.msg.data(), text);
  return out;
}

bool decodeCause(const std::vector<uint8_t>& extra, int nranks, CtlCause* c) {
  if (extra.size() < 8) return false;
  int32_t code, root;
  memcpy(&code, extra.data(), 4);
  memcpy(&root, extra.data() + 4, 4);
  if (code < 0 || code >= loomNumResults || root < -1 || root >= nranks) return false;
  c->code = code;
  c->root = root;
  c->msg.clear();
  for (size_t i = 8; i < extra.size() && c->msg.size() < kMaxCauseText; ++i)  // printable text only: it ends up in logs
    c->msg.push_back(extra[i] >= 0x20 && extra[i] < 0x7f ? char(extra[i]) : '?');
  return true;
}

CtlMsg decodeCtl(const uint8_t* bytes, size_t n) {
  CtlHeader h;
  memcpy(&h, bytes, sizeof h);
  CtlMsg m;
  m.type = CtlType(h.type);
  m.from = h.from;
  for (int i = 0; i < h.count; ++i) {
    int32_t r;
    memcpy(&r, bytes + sizeof h + size_t(i) * 4, 4);
    m.ranks.push_back(r);
  }
  size_t off = sizeof h + size_t(h.count) * 4;
  m.extra.assign(bytes + off, bytes + std::min(n, off + h.extra));
  return m;
}

// ---- the control thread's state (touched by it alone, except Job's result under mutex_) ----

struct Control::Job {
  std::vector<uint8_t> bytes;
  std::vector<bool> to;
  int64_t deadline = 0;
  std::vector<Reach> result;
  int open = 0;  // outstanding connections
  bool done = false;
  std::function<void(const std::vector<Reach>&)> cb;
};

struct Control::Out {
  int fd;
  int peer;
  std::shared_ptr<Job> job;
  size_t sent = 0;
  int state = 0;  // 0 connecting, 1 sending, 2 waiting for the answer
};

struct Control::In {
  int fd;
  int64_t deadline;
  std::vector<uint8_t> buf;
};

Control::Control(int rank, int nranks, const uint8_t secret[16], const SockAddr& bindAddr,
                 const SockAddr& advertise)
    : rank_(rank), nranks_(nranks) {
  memcpy(secret_, secret, 16);
  SockAddr b = bindAddr;
  b.setPort(0);
  listenFd_ = listenOn(b);
  setNonBlocking(listenFd_, true);
  advertise_ = advertise;
  advertise_.setPort(localAddr(listenFd_).port());
  wakeFd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);  // one descriptor, not a pipe's two
  if (wakeFd_ < 0) {
    int e = errno;
    close(listenFd_);
    errno = e;
    failErrno("eventfd");
  }
}

void Control::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
}

Control::~Control() {
  stop();
  for (auto& j : joins_) closeQuiet(j.first);
  closeQuiet(listenFd_);
  closeQuiet(wakeFd_);
}

void Control::start(uint64_t commTag, std::vector<SockAddr> peers,
                    std::function<void(const CtlMsg&)> onNotice, std::function<CtlCause()> cause) {
  commTag_.store(commTag);
  peers_ = std::move(peers);
  onNotice_ = std::move(onNotice);
  cause_ = std::move(cause);
  thread_ = std::thread([this] { loop(); });
}

void Control::wake() {
  uint64_t one = 1;
  ssize_t w = write(wakeFd_, &one, sizeof one);
  (void)w;  // EAGAIN only when the counter is full: it is readable already
}

void Control::broadcastAsync(const CtlMsg& m, const std::vector<bool>& to, int64_t deadlineMs,
                             std::function<void(const std::vector<Reach>&)> done) {
  auto job = std::make_shared<Job>();
  job->bytes = encodeCtl(m, secret_, commTag_.load());
  job->to = to;
  job->deadline = deadlineMs;
  job->result.assign(size_t(nranks_), Reach::Timeout);
  job->cb = std::move(done);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stop_) {
      ++active_;
      newJobs_.push_back(job);
      job = nullptr;
    }
  }
  if (job) {  // stopping: nobody is reached
    if (job->cb) job->cb(job->result);
    return;
  }
  wake();
}

std::vector<Reach> Control::broadcast(const CtlMsg& m, const std::vector<bool>& to, int64_t deadlineMs) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::vector<Reach> result;
  };
  auto s = std::make_shared<Shared>();
  s->result.assign(size_t(nranks_), Reach::Timeout);
  broadcastAsync(m, to, deadlineMs, [s](const std::vector<Reach>& r) {
    std::lock_guard<std::mutex> lock(s->mu);
    s->result = r;
    s->done = true;
    s->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(s->mu);
  // The control thread ends every job by its deadline; the margin covers scheduling.
  s->cv.wait_until(lock,
                   std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(std::max<int64_t>(0, deadlineMs - nowMs()) + 2000),
                   [&] { return s->done; });
  return s->result;
}

void Control::waitQuiet(int64_t deadlineMs) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_until(lock,
                 std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(std::max<int64_t>(0, deadlineMs - nowMs())),
                 [&] { return active_ == 0 || stop_; });
}

void Control::settleIncoming(int64_t deadlineMs) {
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Two passes: a connection accepted in one pass is read in the next.
    target = passes_ + 2;
    settleTarget_ = std::max(settleTarget_, target);
  }
  wake();
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_until(lock,
                 std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(std::max<int64_t>(0, deadlineMs - nowMs())),
                 [&] { return passes_ >= target || stop_; });
}

void Control::finish(const std::shared_ptr<Job>& job) {
  if (job->done) return;
  job->done = true;
  if (job->cb) job->cb(job->result);
  std::lock_guard<std::mutex> lock(mutex_);
  --active_;
  cv_.notify_all();
}

bool Control::nextJoin(int* fd, CtlMsg* m, int64_t deadlineMs) {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait_until(lock,
                 std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(std::max<int64_t>(0, deadlineMs - nowMs())),
                 [&] { return !joins_.empty() || stop_; });
  if (joins_.empty()) return false;
  *fd = joins_.front().first;
  *m = joins_.front().second;
  joins_.pop_front();
  return true;
}

int Control::dial(int r, int64_t deadlineMs) {
  const SockAddr& a = peers_[size_t(r)];
  int fd = socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) failErrno("socket");
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len);
  int err = rc == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    for (;;) {
      // Polled at least once, even past the deadline: a process that was
      // not scheduled for the whole time (a loaded machine) finds the
      // connection made rather than taking a live peer for cut off.
      const int64_t left = std::max<int64_t>(0, deadlineMs - nowMs());
      pollfd p{fd, POLLOUT, 0};
      int n = poll(&p, 1, int(std::min<int64_t>(left, 100)));
      if (n > 0) break;
      if (n < 0 && errno == EINTR) continue;
      if (left == 0) {
        close(fd);
        fail(loomTimeout, "connecting to rank %d's control socket at %s timed out", r, a.str().c_str());
      }
    }
    err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  }
  if (err != 0) {
    close(fd);
    // Only a refusal says the process is gone; no route to the host (a cut
    // link, a neighbour that never answered) says nothing about the process.
    if (err == ECONNREFUSED) return -1;
    fail(loomTimeout, "rank %d's control socket at %s is unreachable: %s", r, a.str().c_str(), strerror(err));
  }
  setNoDelay(fd);
  return fd;
}

void Control::send(int fd, const CtlMsg& m, int64_t deadlineMs) {
  std::vector<uint8_t> b = encodeCtl(m, secret_, commTag_.load());
  sendAll(fd, b.data(), b.size(), deadlineMs);
}

namespace {

// One question to rank r on a connection of its own, and its answer.
Reach ask(Control& ctl, int rank, int r, CtlType type, CtlMsg* a, int64_t deadlineMs,
          const std::vector<uint8_t>& extra = {}) {
  try {
    int fd = ctl.dial(r, deadlineMs);
    if (fd < 0) return Reach::Refused;
    CtlMsg q;
    q.type = type;
    q.from = rank;
    q.extra = extra;
    bool ok = false;
    try {
      ctl.send(fd, q, deadlineMs);
      ok = ctl.recv(fd, a, deadlineMs);
    } catch (const Error& e) {
      close(fd);
      if (e.code() == loomTimeout) return Reach::Timeout;
      return Reach::Refused;
    }
    close(fd);
    // A connection accepted and then closed unanswered: the process died
    // between the two (its listener would refuse the next one).
    if (!ok) return Reach::Refused;
    if (a->type != type || a->from != r) return Reach::Timeout;
    return Reach::Acked;
  } catch (const Error&) {
    return Reach::Timeout;
  }
}

}  // namespace

Reach Control::askWhy(int r, CtlCause* c, int64_t deadlineMs) {
  CtlMsg a;
  Reach reach = ask(*this, rank_, r, CtlType::Why, &a, deadlineMs);
  if (reach == Reach::Acked && !decodeCause(a.extra, nranks_, c)) return Reach::Timeout;
  return reach;
}

Reach Control::askRegion(int r, std::vector<uint8_t>* answer, int64_t deadlineMs,
                         const std::vector<uint8_t>& question) {
  CtlMsg a;
  Reach reach = ask(*this, rank_, r, CtlType::Region, &a, deadlineMs, question);
  if (reach == Reach::Acked) *answer = std::move(a.extra);
  return reach;
}

void Control::setShrinking(bool active, const std::vector<int>& out, uint32_t round) {
  std::lock_guard<std::mutex> lock(mutex_);
  shrinking_ = active;
  shrinkOut_ = out;
  shrinkRound_ = round;
}

Reach Control::askShrinking(int r, bool* active, std::vector<int>* out, uint32_t* round, int64_t deadlineMs) {
  CtlMsg a;
  Reach reach = ask(*this, rank_, r, CtlType::Shrinking, &a, deadlineMs);
  if (reach == Reach::Acked) {
    if (a.extra.size() != 5) return Reach::Timeout;  // not an answer this build gives
    *active = a.extra[0] == 1;
    memcpy(round, a.extra.data() + 1, 4);
    *out = std::move(a.ranks);
  }
  return reach;
}

bool Control::recv(int fd, CtlMsg* m, int64_t deadlineMs) {
  std::vector<uint8_t> buf;
  std::string why;
  for (;;) {
    long want = ctlMissing(buf.data(), buf.size(), secret_, commTag_.load(), nranks_, &why);
    if (want < 0) {
      LOOM_WARN("CTL", "rank %d: dropped a control message (%s)", rank_, why.c_str());
      return false;
    }
    if (want == 0) break;
    size_t at = buf.size();
    buf.resize(at + size_t(want));
    try {
      recvAll(fd, buf.data() + at, size_t(want), deadlineMs);
    } catch (const Error& e) {
      if (e.code() == loomTimeout) throw;
      return false;
    }
  }
  *m = decodeCtl(buf.data(), buf.size());
  return true;
}

void Control::loop() {
  std::vector<std::shared_ptr<Job>> jobs;
  std::vector<Out> outs;
  std::vector<In> ins;
  std::vector<pollfd> pfds;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) break;
      while (!newJobs_.empty()) {
        jobs.push_back(newJobs_.front());
        newJobs_.pop_front();
      }
    }
    // Start the connections of new jobs.
    for (auto& job : jobs) {
      if (job->open || job->done) continue;
      for (int r = 0; r < nranks_; ++r) {
        if (!job->to[size_t(r)] || r == rank_) continue;
        const SockAddr& a = peers_[size_t(r)];
        int fd = socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        int rc = connect(fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len);
        if (rc != 0 && errno != EINPROGRESS) {
          job->result[size_t(r)] = errno == ECONNREFUSED ? Reach::Refused : Reach::Timeout;
          close(fd);
          continue;
        }
        outs.push_back(Out{fd, r, job, 0, rc == 0 ? 1 : 0});
        ++job->open;
      }
      if (!job->open) finish(job);
    }
    jobs.erase(
        std::remove_if(jobs.begin(), jobs.end(), [](const std::shared_ptr<Job>& j) { return j->done; }),
        jobs.end());

    int64_t now = nowMs();
    // Idle: sleep until a connection or a wake-up (no periodic wake-ups).
    int timeout = outs.empty() && ins.empty() ? -1 : 100;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (settleTarget_ > passes_) timeout = 0;  // settleIncoming waits for passes
    }
    for (const Out& o : outs)
      timeout = int(std::max<int64_t>(0, std::min<int64_t>(timeout, o.job->deadline - now)));
    pfds.clear();
    pfds.push_back({wakeFd_, POLLIN, 0});
    pfds.push_back({listenFd_, POLLIN, 0});
    for (const In& in : ins) pfds.push_back({in.fd, POLLIN, 0});
    for (const Out& o : outs) pfds.push_back({o.fd, short(o.state == 2 ? POLLIN : POLLOUT), 0});
    int n = poll(pfds.data(), pfds.size(), timeout);
    if (n < 0 && errno != EINTR) {
      LOOM_WARN("CTL", "rank %d: poll failed: %s", rank_, strerror(errno));
      usleep(10000);
      continue;
    }
    now = nowMs();
    if (pfds[0].revents) {
      uint64_t count;
      ssize_t r = read(wakeFd_, &count, sizeof count);  // resets the counter
      (void)r;
    }
    // Incoming messages (the pfds entries match ins / outs as they were before this pass).
    std::vector<In> keptIns;
    for (size_t i = 0; i < ins.size(); ++i) {
      In& in = ins[i];
      short ev = pfds[2 + i].revents;
      bool drop = false, handed = false;
      if (ev) {
        std::string why;
        long want = ctlMissing(in.buf.data(), in.buf.size(), secret_, commTag_.load(), nranks_, &why);
        if (want > 0) {
          size_t at = in.buf.size();
          in.buf.resize(at + size_t(want));
          ssize_t got = ::recv(in.fd, in.buf.data() + at, size_t(want), MSG_DONTWAIT);
          in.buf.resize(at + size_t(std::max<ssize_t>(got, 0)));
          if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR))
            drop = true;
          else
            want = ctlMissing(in.buf.data(), in.buf.size(), secret_, commTag_.load(), nranks_, &why);
        }
        if (!drop && want < 0) {
          LOOM_WARN("CTL", "rank %d: dropped a control connection (%s)", rank_, why.c_str());
          drop = true;
        }
        if (!drop && want == 0) {
          CtlMsg m = decodeCtl(in.buf.data(), in.buf.size());
          if (m.type == CtlType::Join) {
            setNonBlocking(in.fd, false);
            std::lock_guard<std::mutex> lock(mutex_);
            joins_.emplace_back(in.fd, m);
            cv_.notify_all();
            handed = true;
          } else if (m.type == CtlType::Why || m.type == CtlType::Region || m.type == CtlType::Shrinking) {
            CtlMsg a;
            a.type = m.type;
            a.from = rank_;
            if (m.type == CtlType::Why) {
              a.extra = encodeCause(cause_ ? cause_() : CtlCause{});
            } else if (m.type == CtlType::Shrinking) {
              std::lock_guard<std::mutex> lock(mutex_);
              a.extra.resize(5);
              a.extra[0] = uint8_t(shrinking_ ? 1 : 0);
              memcpy(a.extra.data() + 1, &shrinkRound_, 4);
              a.ranks = shrinkOut_;
            } else if (region_) {
              a.extra = region_(m.from, m.extra);
            }
            if (a.extra.size() > kMaxExtra) a.extra.clear();
            std::vector<uint8_t> b = encodeCtl(a, secret_, commTag_.load());
            // A fresh connection's send buffer takes it whole; if not, the asker times out.
            ssize_t w = ::send(in.fd, b.data(), b.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)w;
            drop = true;
          } else {
            char ack = 1;
            ssize_t w = ::send(in.fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)w;
            drop = true;
            if ((m.type == CtlType::Fail || m.type == CtlType::Revoke || m.type == CtlType::Sigs ||
                 m.type == CtlType::ShrankWithout) &&
                onNotice_)
              onNotice_(m);
          }
        }
      }
      if (!drop && !handed && now > in.deadline) drop = true;
      if (drop)
        close(in.fd);
      else if (!handed)
        keptIns.push_back(std::move(in));
    }
    ins.swap(keptIns);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++passes_;
      cv_.notify_all();
    }
    // Outgoing messages.
    std::vector<Out> keptOuts;
    size_t base = pfds.size() - outs.size();
    for (size_t i = 0; i < outs.size(); ++i) {
      Out& o = outs[i];
      short ev = pfds[base + i].revents;
      Reach verdict = Reach::Timeout;
      bool resolved = false;
      if (ev && o.state == 0) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(o.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
          resolved = true;
          verdict = err == ECONNREFUSED || err == ECONNRESET ? Reach::Refused : Reach::Timeout;
        } else {
          o.state = 1;
        }
      }
      if (!resolved && o.state == 1 && (ev || o.sent == 0)) {
        ssize_t w = ::send(o.fd, o.job->bytes.data() + o.sent, o.job->bytes.size() - o.sent,
                           MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0)
          o.sent += size_t(w);
        else if (w < 0 && errno != EAGAIN && errno != EINTR)
          resolved = true, verdict = Reach::Refused;
        if (o.sent == o.job->bytes.size()) o.state = 2;
      } else if (!resolved && o.state == 2 && ev) {
        char c;
        ssize_t got = ::recv(o.fd, &c, 1, MSG_DONTWAIT);
        if (got == 1)
          resolved = true, verdict = Reach::Acked;
        else if (got == 0 || (errno != EAGAIN && errno != EINTR))
          resolved = true, verdict = Reach::Refused;
      }
      if (!resolved && now >= o.job->deadline) resolved = true, verdict = Reach::Timeout;
      if (resolved) {
        close(o.fd);
        o.job->result[size_t(o.peer)] = verdict;
        if (--o.job->open == 0) finish(o.job);
      } else {
        keptOuts.push_back(std::move(o));
      }
    }
    outs.swap(keptOuts);
    if (pfds[1].revents & POLLIN) {
      for (;;) {
        int fd = accept4(listenFd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
          // Out of descriptors: the connection stays in the backlog and
          // poll() keeps saying so.  Do not spin on it: the peer's own
          // deadline ends its wait, and this thread looks again later.
          if (!acceptWarned_) LOOM_WARN("CTL", "rank %d: cannot accept a control connection: %s", rank_, strerror(errno));
          acceptWarned_ = true;
          usleep(20000);
          break;
        }
        if (fd < 0) break;
        acceptWarned_ = false;
        setNoDelay(fd);
        if (ins.size() >= 1024) {
          close(fd);
          continue;
        }
        ins.push_back(In{fd, now + 5000, {}});
      }
    }
  }
  for (In& in : ins) close(in.fd);
  for (Out& o : outs) {
    close(o.fd);
    o.job->result[size_t(o.peer)] = Reach::Timeout;
    if (--o.job->open == 0) finish(o.job);
  }
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    left.swap(newJobs_);
  }
  for (auto& j : jobs) left.push_back(j);
  for (auto& j : left) finish(j);
}

}  // namespace loom
