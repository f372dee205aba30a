// Starting ranks as real processes from a test: through loom-run, or by hand
// (fault tests, where loom-run would stop the survivors of a killed rank).
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace loomtest {

inline std::string binDir() { return LOOM_BIN_DIR; }

// Runs a shell command; returns its exit status (or 128+signal).
inline int shell(const std::string& cmd) {
  int st = std::system(cmd.c_str());
  if (st == -1) return -1;
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  if (WIFSIGNALED(st)) return 128 + WTERMSIG(st);
  return -1;
}

// `env` is prepended to the loom-run command line (e.g. "LOOM_TRANSPORTS=tcp").
inline int loomRun(const std::string& env, int n, const std::string& args, int timeoutSec = 300,
                   const std::string& extra = "") {
  std::string cmd = env + " " + binDir() + "/loom-run -n " + std::to_string(n) + " --timeout " +
                    std::to_string(timeoutSec) + " " + extra + " -- " + binDir() + "/mp-worker " + args;
  return shell(cmd);
}

struct RankResult {
  bool exited = false;
  int code = -1;
  int signal = 0;
};

// A socket listening on a free port of 127.0.0.1 (*port), or -1.
inline int listenOnFreePort(int* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, 512) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

// Starts n ranks of mp-worker with loom-run's environment, without loom-run,
// and waits for all of them (killing stragglers after timeoutSec).  As
// loom-run does, rank 0 inherits the bootstrap port already listening, so no
// other test can take it first.
inline std::vector<RankResult> spawnRanks(int n, const std::vector<std::string>& args,
                                          const std::vector<std::string>& env, int timeoutSec,
                                          bool* timedOut) {
  int port = 0;
  int rootFd = listenOnFreePort(&port);
  if (rootFd < 0) port = 20000 + int(getpid() % 12000);  // rank 0 binds it itself
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      setenv("LOOM_RANK", std::to_string(r).c_str(), 1);
      setenv("LOOM_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("LOOM_ROOT_ADDR", ("127.0.0.1:" + std::to_string(port)).c_str(), 1);
      setenv("LOOM_SECRET", "0123456789abcdef0123456789abcdef", 1);
      unsetenv("LOOM_ROOT_FD");
      // libloom links UCX, and Debian 13's UCX (1.18, built with its fuse
      // module) starts a thread at load that opens and closes a socket to
      // UCX's VFS daemon: a descriptor that comes and goes while the worker
      // counts its own (mp-worker shrink saw "gone: 6 ?").  Not set where
      // the test's environment says otherwise.
      setenv("UCX_VFS_ENABLE", "n", 0);
      if (r == 0 && rootFd >= 0) {
        fcntl(rootFd, F_SETFD, 0);
        setenv("LOOM_ROOT_FD", std::to_string(rootFd).c_str(), 1);
      }
      for (const std::string& e : env) putenv(strdup(e.c_str()));
      std::vector<char*> argv;
      std::string prog = binDir() + "/mp-worker";
      argv.push_back(const_cast<char*>(prog.c_str()));
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(prog.c_str(), argv.data());
      _exit(127);
    }
    if (r == 0 && rootFd >= 0) close(rootFd);
    pids.push_back(pid);
  }
  std::vector<RankResult> res;
  res.resize(size_t(n));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeoutSec);
  int left = n;
  *timedOut = false;
  while (left > 0) {
    for (int r = 0; r < n; ++r) {
      if (pids[size_t(r)] <= 0) continue;
      int st;
      if (waitpid(pids[size_t(r)], &st, WNOHANG) == pids[size_t(r)]) {
        res[size_t(r)].exited = WIFEXITED(st);
        res[size_t(r)].code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        res[size_t(r)].signal = WIFSIGNALED(st) ? WTERMSIG(st) : 0;
        pids[size_t(r)] = 0;
        --left;
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      *timedOut = true;
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return res;
}

}  // namespace loomtest
