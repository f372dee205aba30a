// loom-run: starts N local ranks of a program with the environment that
// loomCommInitFromEnv reads, forwards their output with a "[rank] " prefix and
// stops the whole job as soon as one rank fails. Standalone on purpose (no
// dependency on libloom), single-threaded: one poll() loop drives everything.
//
// Signals are turned into bytes on a self-pipe so that the poll() loop sees them;
// all state changes (reaping, killing, printing) happen in the loop, never in a
// handler.
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

const char kUsage[] =
    "usage: loom-run -n N [--hosts K] [--timeout SEC] [--keep-going] [--] program [args...]\n"
    "\n"
    "Starts N local ranks of `program` and waits for them.\n"
    "  -n N           number of ranks (N >= 1)\n"
    "  --hosts K      split the ranks into K contiguous, near-equal blocks that pose\n"
    "                 as separate hosts (1 <= K <= N)\n"
    "  --timeout SEC  stop the job and exit 124 if it runs longer (0 = no limit)\n"
    "  --keep-going   a rank killed by a signal does not stop the others (elastic jobs\n"
    "                 that continue without it, loomCommShrink); the exit status is 0\n"
    "                 when every other rank exits 0\n"
    "  -h, --help     show this help\n"
    "\n"
    "Each rank gets:\n"
    "  LOOM_RANK        rank index, 0..N-1\n"
    "  LOOM_WORLD_SIZE  N\n"
    "  LOOM_LOCAL_RANK  index of the rank within its host block\n"
    "  LOOM_LOCAL_SIZE  number of ranks in its host block\n"
    "  LOOM_HOST_ID     loomhost<k> (only with --hosts)\n"
    "  LOOM_ROOT_ADDR   127.0.0.1:<free port> (kept if already set)\n"
    "  LOOM_ROOT_FD     rank 0 only: that port, already listening (unless\n"
    "                   LOOM_ROOT_ADDR was set)\n"
    "  LOOM_SECRET      32 random hex digits (kept if already set)\n"
    "\n"
    "Rank output is forwarded line by line as \"[rank] line\"; stdin is /dev/null.\n"
    "If a rank fails (without --keep-going: exits non-zero or is killed; with it:\n"
    "exits non-zero), the others get SIGTERM (SIGKILL 3 s later) and loom-run exits\n"
    "1, or 128+signal if the rank was killed by a signal. SIGINT/SIGTERM to loom-run\n"
    "are forwarded to the ranks as SIGTERM.\n";

constexpr double kKillGraceSec = 3.0;    // SIGTERM -> SIGKILL escalation
constexpr size_t kMaxLine = 64 * 1024;   // longer lines are split to bound memory

// One output pipe of one rank, with the unterminated tail of what was read.
struct Stream {
  int fd = -1;
  std::string pending;
};

struct Rank {
  pid_t pid = -1;
  bool alive = false;
  Stream out, err;  // forwarded to our fd 1 and fd 2
};

int g_selfpipe[2] = {-1, -1};
volatile sig_atomic_t g_stopSig = 0;    // last SIGINT/SIGTERM/SIGHUP received
volatile sig_atomic_t g_stopCount = 0;  // how many of them so far
bool g_outBroken[3] = {false, false, false};  // EPIPE seen on fd 1 / fd 2

void onSignal(int sig) {
  int saved = errno;
  if (sig != SIGCHLD) {
    g_stopSig = sig;
    g_stopCount = g_stopCount + 1;
  }
  char c = 0;
  ssize_t r = write(g_selfpipe[1], &c, 1);  // non-blocking: a full pipe already wakes us
  (void)r;
  errno = saved;
}

double now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

// Writes everything, retrying on EINTR and waiting if the fd we inherited is
// non-blocking. One call per batch of whole lines is what keeps ranks' lines
// from interleaving: we are the only writer of our stdout/stderr.
void writeAll(int fd, const char* p, size_t n) {
  if (g_outBroken[fd]) return;
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w > 0) {
      p += w;
      n -= size_t(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pfd = {fd, POLLOUT, 0};
      poll(&pfd, 1, 100);
    } else {
      // EPIPE (SIGPIPE is ignored) or similar: the reader went away. Keep
      // draining the ranks so they do not block, but drop their output.
      g_outBroken[fd] = true;
      return;
    }
  }
}

// Launcher messages, always to stderr and as one write.
void say(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  size_t len = std::min(size_t(n), sizeof buf - 2);
  buf[len++] = '\n';
  writeAll(2, buf, len);
}

[[noreturn]] void usageError(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  say("loom-run: %s", buf);
  writeAll(2, "\n", 1);
  writeAll(2, kUsage, sizeof kUsage - 1);
  exit(2);
}

// Strict integer parse: the whole string, within [lo, hi].
bool parseInt(const char* s, long lo, long hi, long* out) {
  if (!s || !*s) return false;
  char* end = nullptr;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// A socket listening on 127.0.0.1 at `port` (0: any), or -1.
int listenAt(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  // As loom's own listeners: the port stays ours while we listen (Linux lets
  // nobody bind a listening port), and rank 0 can bind it again later.
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, 512) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

// The bootstrap port, listening, for rank 0 to inherit as LOOM_ROOT_FD: held
// from here on, it cannot be taken by another process before rank 0 serves
// it, and ranks that connect early wait in its backlog.  The kernel's own
// pick (port 0) comes from the ephemeral range, where every outgoing
// connection on the host also draws its port and a later listener on the same
// host could not bind; so a port below that range, tried at random, first.
int openRootListener(int* port) {
  int lo = 32768;
  if (FILE* f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    int a = 0, b = 0;
    if (fscanf(f, "%d %d", &a, &b) == 2 && a > 0) lo = a;
    fclose(f);
  }
  const int first = 10000, span = lo - first;
  int fd = -1;
  if (span >= 1000) {
    unsigned seed = unsigned(getpid()) * 2654435761u ^ unsigned(time(nullptr));
    for (int i = 0; i < 64 && fd < 0; ++i) {
      seed = seed * 1103515245u + 12345u;
      fd = listenAt(first + int((seed >> 8) % unsigned(span)));
    }
  }
  if (fd < 0) fd = listenAt(0);
  if (fd >= 0 && fd <= 2) {  // started with a standard stream closed: keep clear of 0..2
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    close(fd);
    fd = moved;
  }
  sockaddr_in a{};
  socklen_t len = sizeof a;
  if (fd >= 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    fd = -1;
  }
  if (fd >= 0) *port = ntohs(a.sin_port);
  return fd;
}

// 16 random bytes as 32 hex digits: getrandom(), or /dev/urandom if unavailable.
bool randomSecret(std::string* out) {
  unsigned char b[16];
  size_t got = 0;
  while (got < sizeof b) {
    ssize_t r = getrandom(b + got, sizeof b - got, 0);
    if (r > 0) got += size_t(r);
    else if (r < 0 && errno == EINTR) continue;
    else break;
  }
  if (got < sizeof b) {
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    got = 0;
    while (got < sizeof b) {
      ssize_t r = read(fd, b + got, sizeof b - got);
      if (r > 0) got += size_t(r);
      else if (r < 0 && errno == EINTR) continue;
      else break;
    }
    close(fd);
    if (got < sizeof b) return false;
  }
  static const char hex[] = "0123456789abcdef";
  out->clear();
  for (unsigned char c : b) {
    out->push_back(hex[c >> 4]);
    out->push_back(hex[c & 15]);
  }
  return true;
}

// Turns complete lines of `s.pending` into "[r] line\n" and writes them in one go.
// At EOF the unterminated tail is flushed as a line of its own.
void emitLines(int rank, Stream& s, int outFd, bool eof) {
  char prefix[24];
  int plen = snprintf(prefix, sizeof prefix, "[%d] ", rank);
  std::string out;
  size_t start = 0;
  for (;;) {
    size_t nl = s.pending.find('\n', start);
    size_t end;
    if (nl != std::string::npos) end = nl;
    else if (s.pending.size() - start >= kMaxLine) end = start + kMaxLine;
    else if (eof && start < s.pending.size()) end = s.pending.size();
    else break;
    out.append(prefix, size_t(plen));
    out.append(s.pending, start, end - start);
    out.push_back('\n');
    start = (nl != std::string::npos) ? nl + 1 : end;
  }
  s.pending.erase(0, start);
  if (!out.empty()) writeAll(outFd, out.data(), out.size());
}

// Reads from a rank's pipe (non-blocking fd). With `drain`, until it is empty;
// otherwise one read, so that one chatty rank cannot starve the others.
void pump(int rank, Stream& s, int outFd, bool drain) {
  char buf[65536];
  while (s.fd >= 0) {
    ssize_t r = read(s.fd, buf, sizeof buf);
    if (r > 0) {
      s.pending.append(buf, size_t(r));
      emitLines(rank, s, outFd, false);
      if (!drain) return;
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return;
    } else {  // EOF (or a read error, treated the same)
      emitLines(rank, s, outFd, true);
      close(s.fd);
      s.fd = -1;
    }
  }
}

// Signals a rank's whole process group (it leads its own, see the child code):
// `sh -c '...; sleep 30'` must lose its sleep too, or the sleep would keep the
// output pipe open.
void signalRanks(std::vector<Rank>& ranks, int sig) {
  for (Rank& r : ranks)
    if (r.alive && kill(-r.pid, sig) < 0) kill(r.pid, sig);
}

}  // namespace

int main(int argc, char** argv) {
  // ---- arguments -----------------------------------------------------------
  long n = -1, hosts = 0;
  bool keepGoing = false;
  double timeout = 0;
  const char* timeoutArg = "0";
  int progIdx = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    // Options take "--opt V", "--opt=V" and, for -n, "-nV".
    auto value = [&](const char* name) -> const char* {
      size_t l = strlen(name);
      if (a == name) {
        if (i + 1 >= argc) usageError("%s needs a value", name);
        return argv[++i];
      }
      if (a.compare(0, l, name) == 0 && a.size() > l) {
        if (a[l] == '=') return argv[i] + l + 1;
        if (l == 2) return argv[i] + 2;  // -nV
      }
      return nullptr;
    };
    const char* v;
    if (a == "-h" || a == "--help") {
      writeAll(1, kUsage, sizeof kUsage - 1);
      return 0;
    } else if (a == "--") {
      if (i + 1 < argc) progIdx = i + 1;
      break;
    } else if ((v = value("-n"))) {
      if (!parseInt(v, 1, 1 << 20, &n)) usageError("-n: '%s' is not a rank count >= 1", v);
    } else if ((v = value("--hosts"))) {
      if (!parseInt(v, 1, 1 << 20, &hosts)) usageError("--hosts: '%s' is not a host count >= 1", v);
    } else if ((v = value("--timeout"))) {
      char* end = nullptr;
      timeout = strtod(v, &end);
      if (!*v || *end || !std::isfinite(timeout) || timeout < 0)
        usageError("--timeout: '%s' is not a number of seconds >= 0", v);
      timeoutArg = v;
    } else if (a == "--keep-going") {
      keepGoing = true;
    } else if (a.size() > 1 && a[0] == '-') {
      usageError("unknown option '%s'", a.c_str());
    } else {
      progIdx = i;  // the program; everything after it belongs to it
      break;
    }
  }
  if (n < 0) usageError("missing -n N");
  if (hosts > n) usageError("--hosts %ld is more than the %ld ranks", hosts, n);
  if (progIdx < 0) usageError("no program given");
  const bool hostsGiven = hosts > 0;
  if (!hostsGiven) hosts = 1;

  // ---- process setup -------------------------------------------------------
  // With fd 0/1/2 closed, pipe() could hand out e.g. fd 1 and the dup2()s in the
  // child would go wrong; make sure they exist.
  for (int fd = 0; fd < 3; ++fd)
    if (fcntl(fd, F_GETFD) < 0) open("/dev/null", O_RDWR);
  // Two pipe ends per rank stay open in the launcher: raise the fd limit if needed.
  rlimit rl;
  rlim_t need = rlim_t(2 * n + 32);
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < need) {
    rl.rlim_cur = std::min(need, rl.rlim_max);
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  int devNull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (pipe2(g_selfpipe, O_CLOEXEC | O_NONBLOCK) < 0 || devNull < 0) {
    say("loom-run: setup failed: %s", strerror(errno));
    return 1;
  }

  // Signals. The children get back exactly the dispositions and mask we were
  // started with (SIG_IGN survives exec, so e.g. our ignored SIGPIPE must not
  // leak into the ranks). SIGINT/SIGHUP ignored on entry (nohup, `cmd &` in a
  // script) stay ignored, as shells do.
  const int kSigs[] = {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE};
  struct sigaction origAct[5];
  sigset_t origMask, handled;
  sigemptyset(&handled);
  for (int i = 0; i < 5; ++i) {
    sigaction(kSigs[i], nullptr, &origAct[i]);
    sigaddset(&handled, kSigs[i]);
  }
  struct sigaction sa{};
  sa.sa_handler = onSignal;  // no SA_RESTART: poll() returns EINTR, which we handle
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_NOCLDSTOP;
  for (int i = 0; i < 4; ++i)  // all but SIGPIPE
    if (kSigs[i] == SIGTERM || kSigs[i] == SIGCHLD || origAct[i].sa_handler != SIG_IGN)
      sigaction(kSigs[i], &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a closed stdout is an EPIPE in writeAll, not our death
  // Block the handled signals while forking so a child never runs our handler;
  // the child restores everything before exec.
  sigprocmask(SIG_BLOCK, &handled, &origMask);
  sigset_t loopMask = origMask;  // and unblock them in the loop, even if we were
  for (int s : kSigs) sigdelset(&loopMask, s);  // started with them blocked

  // ---- environment shared by all ranks ----------------------------------------
  // A LOOM_ROOT_FD we inherited (loom-run as a rank of another loom-run) is
  // not ours to pass on or keep: holding it, we would keep its port
  // listening where our rank 0 binds it.
  if (const char* e = getenv("LOOM_ROOT_FD"); e && *e) {
    char* end = nullptr;
    long fd = strtol(e, &end, 10);
    int listening = 0;
    socklen_t len = sizeof listening;
    if (*end == 0 && fd > 2 && fd < (1l << 30) &&
        getsockopt(int(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) == 0 && listening)
      close(int(fd));
  }
  std::string rootAddr, secret;
  int rootFd = -1;  // the port we chose, listening, until rank 0 has it
  if (const char* e = getenv("LOOM_ROOT_ADDR"); e && *e) {
    rootAddr = e;
  } else {
    int port = 0;
    rootFd = openRootListener(&port);
    if (rootFd < 0) {
      say("loom-run: cannot listen on a TCP port of 127.0.0.1: %s", strerror(errno));
      return 1;
    }
    rootAddr = "127.0.0.1:" + std::to_string(port);
  }
  // A caller-provided secret goes with a caller-provided root (e.g. one root for
  // several launchers), so keep it too.
  if (const char* e = getenv("LOOM_SECRET"); e && *e) {
    secret = e;
  } else if (!randomSecret(&secret)) {
    say("loom-run: cannot read random bytes: %s", strerror(errno));
    return 1;
  }

  // ---- start the ranks --------------------------------------------------------
  std::vector<Rank> ranks(static_cast<size_t>(n));
  int exitCode = 0;
  bool stopping = false;  // SIGTERM sent; later rank deaths are expected
  double killAt = INFINITY, timeoutAt = timeout > 0 ? now() + timeout : INFINITY;
  const pid_t parent = getpid();
  const long base = n / hosts, extra = n % hosts;  // first `extra` hosts get one more
  long host = 0, hostStart = 0;
  for (long r = 0; r < n; ++r) {
    long hostSize = base + (host < extra ? 1 : 0);
    if (r >= hostStart + hostSize) {
      hostStart += hostSize;
      ++host;
      hostSize = base + (host < extra ? 1 : 0);
    }
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) < 0) {
      say("loom-run: cannot start rank %ld: pipe: %s", r, strerror(errno));
      exitCode = 1;
      break;
    }
    if (pipe2(err, O_CLOEXEC) < 0) {
      say("loom-run: cannot start rank %ld: pipe: %s", r, strerror(errno));
      close(out[0]);
      close(out[1]);
      exitCode = 1;
      break;
    }
    pid_t pid = fork();
    if (pid == 0) {
      // Child. Single-threaded parent, so setenv/snprintf are safe here.
      for (int i = 0; i < 5; ++i) sigaction(kSigs[i], &origAct[i], nullptr);
      sigprocmask(SIG_SETMASK, &origMask, nullptr);
      // Own process group: the terminal's Ctrl-C reaches only loom-run, which
      // forwards SIGTERM; and we can kill a rank together with its children.
      setpgid(0, 0);
      // If loom-run itself is SIGKILLed, do not leave the ranks running.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      // dup2 clears CLOEXEC on 0/1/2; every other fd of ours closes on exec.
      dup2(devNull, 0);
      dup2(out[1], 1);
      dup2(err[1], 2);
      setenv("LOOM_RANK", std::to_string(r).c_str(), 1);
      setenv("LOOM_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("LOOM_LOCAL_RANK", std::to_string(r - hostStart).c_str(), 1);
      setenv("LOOM_LOCAL_SIZE", std::to_string(hostSize).c_str(), 1);
      if (hostsGiven) setenv("LOOM_HOST_ID", ("loomhost" + std::to_string(host)).c_str(), 1);
      setenv("LOOM_ROOT_ADDR", rootAddr.c_str(), 1);
      setenv("LOOM_SECRET", secret.c_str(), 1);
      if (rootFd >= 0) {  // only rank 0 has it: loom-run closes it once rank 0 is started
        fcntl(rootFd, F_SETFD, 0);
        setenv("LOOM_ROOT_FD", std::to_string(rootFd).c_str(), 1);
      } else {
        unsetenv("LOOM_ROOT_FD");
      }
      execvp(argv[progIdx], argv + progIdx);
      dprintf(2, "loom-run: cannot run %s: %s\n", argv[progIdx], strerror(errno));
      _exit(127);
    }
    int forkErr = errno;
    // The write ends must close here, or we would never see EOF on them.
    close(out[1]);
    close(err[1]);
    // Only rank 0 serves the port; were we to hold it too, ranks would queue
    // on it after rank 0 died instead of being refused.
    if (rootFd >= 0) {
      close(rootFd);
      rootFd = -1;
    }
    if (pid < 0) {
      say("loom-run: cannot start rank %ld: fork: %s", r, strerror(forkErr));
      close(out[0]);
      close(err[0]);
      exitCode = 1;
      break;
    }
    setpgid(pid, pid);  // also here, so kill(-pid) works before the child ran; EACCES after exec is fine
    Rank& rk = ranks[size_t(r)];
    rk.pid = pid;
    rk.alive = true;
    rk.out.fd = out[0];
    rk.err.fd = err[0];
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    if (g_stopCount) break;  // Ctrl-C while starting: stop starting more
  }
  sigprocmask(SIG_SETMASK, &loopMask, nullptr);

  auto stop = [&](int code) {
    if (stopping) return;
    stopping = true;
    exitCode = code;
    signalRanks(ranks, SIGTERM);
    killAt = now() + kKillGraceSec;
  };
  if (exitCode) stop(exitCode);  // a rank failed to start: stop the others

  // ---- main loop ----------------------------------------------------------------
  int stopsSeen = 0;
  std::vector<pollfd> pfds;
  std::vector<std::pair<int, int>> pwho;  // (rank, our fd 1 or 2) per pfds entry
  for (;;) {
    // Reap every child that has exited (SIGCHLD only says "some"), draining its
    // pipes first so its last words come before our verdict on it.
    bool failedNow = false;
    int failCode = 0;
    for (;;) {
      int st;
      pid_t pid = waitpid(-1, &st, WNOHANG);
      if (pid < 0 && errno == EINTR) continue;
      if (pid <= 0) break;
      for (size_t r = 0; r < ranks.size(); ++r) {
        Rank& rk = ranks[r];
        if (rk.pid != pid || !rk.alive) continue;
        rk.alive = false;
        pump(int(r), rk.out, 1, true);
        pump(int(r), rk.err, 2, true);
        bool bad = !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        if (bad && !stopping && keepGoing && WIFSIGNALED(st)) {
          say("loom-run: rank %zu killed by signal %d (--keep-going: the others continue)", r, WTERMSIG(st));
          continue;
        }
        if (bad && !stopping) {
          // Every failure found before we start stopping is a real one: report all.
          if (WIFSIGNALED(st)) say("loom-run: rank %zu killed by signal %d", r, WTERMSIG(st));
          else say("loom-run: rank %zu exited with status %d", r, WEXITSTATUS(st));
          if (!failedNow) failCode = WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1;
          failedNow = true;
        }
      }
    }
    if (failedNow) stop(failCode);

    // Our own SIGINT/SIGTERM/SIGHUP: forward SIGTERM; a second one means SIGKILL now.
    if (g_stopCount != stopsSeen) {
      stopsSeen = g_stopCount;
      int sig = g_stopSig;
      if (!stopping) {
        say("loom-run: caught %s, terminating ranks",
            sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM");
        stop(128 + sig);
      } else {
        signalRanks(ranks, SIGKILL);
        killAt = INFINITY;
      }
    }

    double t = now();
    if (t >= timeoutAt) {
      timeoutAt = INFINITY;
      if (!stopping) {
        say("loom-run: timeout after %s s", timeoutArg);
        stop(124);
      }
    }
    if (t >= killAt) {
      killAt = INFINITY;
      signalRanks(ranks, SIGKILL);
    }

    bool anyAlive = false;
    for (Rank& rk : ranks) anyAlive |= rk.alive;
    if (!anyAlive) break;

    // Wait for output, a signal or the next deadline.
    pfds.assign(1, pollfd{g_selfpipe[0], POLLIN, 0});
    pwho.assign(1, {-1, -1});
    for (size_t r = 0; r < ranks.size(); ++r)
      for (int o : {1, 2})
        if (int fd = (o == 1 ? ranks[r].out : ranks[r].err).fd; fd >= 0) {
          pfds.push_back(pollfd{fd, POLLIN, 0});
          pwho.push_back({int(r), o});
        }
    double next = std::min(timeoutAt, killAt);
    int waitMs = -1;  // no deadline: sleep until output or a signal
    if (next != INFINITY) waitMs = int(std::clamp(std::ceil((next - t) * 1000.0), 0.0, 1e9));
    int pr = poll(pfds.data(), pfds.size(), waitMs);
    if (pr < 0) {
      if (errno == EINTR) continue;
      say("loom-run: poll: %s", strerror(errno));
      signalRanks(ranks, SIGKILL);
      return 1;
    }
    if (pfds[0].revents) {
      char buf[256];
      while (read(g_selfpipe[0], buf, sizeof buf) > 0) {
      }
    }
    for (size_t i = 1; i < pfds.size(); ++i)
      if (pfds[i].revents) {
        Rank& rk = ranks[size_t(pwho[i].first)];
        pump(pwho[i].first, pwho[i].second == 1 ? rk.out : rk.err, pwho[i].second, false);
      }
  }

  // All ranks are gone. Whatever they wrote is in the pipes already; take what is
  // there but do not wait for EOF, which a leftover grandchild could hold off forever.
  for (size_t r = 0; r < ranks.size(); ++r) {
    pump(int(r), ranks[r].out, 1, true);
    pump(int(r), ranks[r].err, 2, true);
    emitLines(int(r), ranks[r].out, 1, true);
    emitLines(int(r), ranks[r].err, 2, true);
  }
  return exitCode;
}
