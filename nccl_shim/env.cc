// NCCL_* environment variables -> loom's LOOM_* ones, and the shim's log.
//
// loom reads its configuration from LOOM_* variables when a unique id or a
// communicator is made, so the shim translates before its first loom call:
// a NCCL_* variable with a loom equivalent sets that LOOM_* variable unless
// the user set it (the user's LOOM_* wins); one loom has no equivalent for is
// reported once per process.  docs/nccl.md lists the mapping.
#include <strings.h>
#include <unistd.h>

#include <cctype>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "nccl_shim/shim.h"

extern char** environ;

namespace nccl_shim {
namespace {

// Why a NCCL_* variable does nothing under loom (printed once as a warning).
struct Unsupported {
  const char* name;
  const char* why;
};
const Unsupported kUnsupported[] = {
    {"NCCL_IB_TC", "loom's ibverbs transport leaves the traffic class at its default"},
    {"NCCL_IB_SL", "loom's ibverbs transport leaves the service level at its default"},
    {"NCCL_IB_TIMEOUT", "loom's ibverbs transport sets its own QP timeout (LOOM_TIMEOUT_MS bounds every wait)"},
    {"NCCL_IB_RETRY_CNT", "loom's ibverbs transport sets its own QP retry count"},
    {"NCCL_IB_QPS_PER_CONNECTION", "loom's ibverbs transport opens one QP per connection (LOOM_NCHANNELS connections)"},
    {"NCCL_P2P_LEVEL", "loom's CUDA communicators use CUDA IPC between all ranks of a host or none "
                       "(NCCL_P2P_DISABLE=1 / LOOM_DEVICE_PATH=staged: none)"},
    {"NCCL_NVLS_ENABLE", "loom has no NVLink SHARP support"},
    {"NCCL_CUMEM_ENABLE", "loom's CUDA windows come from cudaMalloc, shared through CUDA IPC handles"},
    {"NCCL_PROTO", "loom has no LL/LL128/Simple protocols (LOOM_SLOT_BYTES sets its slice size)"},
    {"NCCL_BUFFSIZE", "loom's buffers are LOOM_SLOT_BYTES x LOOM_SLOTS per connection"},
    {"NCCL_NTHREADS", "loom's reduction kernels choose their own block size"},
    {"NCCL_MIN_NCHANNELS", "NCCL's channel bounds are not loom's lanes (LOOM_NCHANNELS fixes the count)"},
    {"NCCL_MAX_NCHANNELS", "NCCL's channel bounds are not loom's lanes (LOOM_NCHANNELS fixes the count)"},
    {"NCCL_COMM_ID",
     "ncclGetUniqueId always opens its own listener (loom-run / torchrun variables: LOOM_ROOT_ADDR)"},
    {"NCCL_DEBUG_FILE", "loom logs to stderr"},
    {"NCCL_LAUNCH_MODE", "loom enqueues each rank's work on its own stream (no grouped launch)"},
    {"NCCL_COLLNET_ENABLE", "loom has no CollNet/SHARP support"},
    {"NCCL_NET_GDR_LEVEL", "loom has no GPUDirect RDMA yet"},
};

// The variables translated below (or already loom's behaviour); any other
// NCCL_* one is reported, as unsupported (kUnsupported) or unknown.
bool isMapped(const char* name) {
  static const char* const kMapped[] = {"NCCL_DEBUG",      "NCCL_DEBUG_SUBSYS",   "NCCL_SOCKET_IFNAME",
                                        "NCCL_ALGO",       "NCCL_SHM_DISABLE",    "NCCL_NET",
                                        "NCCL_IB_DISABLE", "NCCL_CHECK_POINTERS", "NCCL_IB_HCA",
                                        "NCCL_IB_GID_INDEX", "NCCL_P2P_DISABLE"};
  for (const char* m : kMapped)
    if (strcmp(m, name) == 0) return true;
  return false;
}

const char* env(const char* name) {
  const char* v = getenv(name);
  return (v && *v) ? v : nullptr;
}

Level gLevel = Level::Warn;
bool gVersionLine = false;

// Sets LOOM_<to>=value unless the user set it; says what it did at INFO.
void mapTo(const char* from, const char* fromValue, const char* to, const std::string& value) {
  if (const char* own = env(to)) {
    logf(Level::Info, "%s=%s not applied: %s=%s is set and wins", from, fromValue, to, own);
    return;
  }
  setenv(to, value.c_str(), 1);
  logf(Level::Info, "%s=%s -> %s=%s", from, fromValue, to, value.c_str());
}

Level parseLevel(const char* v) {
  if (!v) return Level::Warn;
  if (!strcasecmp(v, "NONE")) return Level::None;
  if (!strcasecmp(v, "INFO")) return Level::Info;
  if (!strcasecmp(v, "TRACE")) return Level::Trace;
  return Level::Warn;
}

// NCCL_DEBUG: VERSION prints the version line only; WARN/INFO/TRACE/NONE are
// loom's levels too; ABORT is treated as WARN (loom does not abort on warnings).
void mapDebug() {
  const char* v = env("NCCL_DEBUG");
  if (!v) return;
  gVersionLine = !strcasecmp(v, "VERSION") || !strcasecmp(v, "INFO") || !strcasecmp(v, "TRACE");
  std::string level;
  if (!strcasecmp(v, "NONE") || !strcasecmp(v, "WARN") || !strcasecmp(v, "INFO") || !strcasecmp(v, "TRACE")) {
    level = v;
    for (char& c : level) c = char(toupper(c));
  } else if (!strcasecmp(v, "VERSION") || !strcasecmp(v, "ABORT")) {
    level = "WARN";
  } else {
    logf(Level::Warn, "NCCL_DEBUG=%s is not a level (VERSION, WARN, INFO, TRACE, NONE); ignored", v);
    return;
  }
  mapTo("NCCL_DEBUG", v, "LOOM_DEBUG", level);
}

// NCCL_DEBUG_SUBSYS: the subsystems loom has (INIT, COLL, SHM, NET; BOOTSTRAP
// is BOOT, TUNING is TUNE); the others are dropped with a warning.
void mapSubsys() {
  const char* v = env("NCCL_DEBUG_SUBSYS");
  if (!v) return;
  if (v[0] == '^') {
    logf(Level::Warn, "NCCL_DEBUG_SUBSYS=%s: loom cannot exclude subsystems (^); ignored", v);
    return;
  }
  std::string out, list = v, dropped;
  for (size_t pos = 0; pos <= list.size();) {
    size_t end = list.find(',', pos);
    if (end == std::string::npos) end = list.size();
    std::string s = list.substr(pos, end - pos);
    for (char& c : s) c = char(toupper(c));
    const char* to = nullptr;
    if (s == "ALL" || s == "INIT" || s == "COLL" || s == "SHM" || s == "NET")
      to = s.c_str();
    else if (s == "BOOTSTRAP")
      to = "BOOT";
    else if (s == "TUNING")
      to = "TUNE";
    else if (s == "P2P")
      to = "COLL";
    if (to)
      out += (out.empty() ? "" : ",") + std::string(to);
    else if (!s.empty())
      dropped += (dropped.empty() ? "" : ",") + s;
    pos = end + 1;
  }
  if (!dropped.empty())
    logf(Level::Warn, "NCCL_DEBUG_SUBSYS: loom has no subsystem %s; dropped", dropped.c_str());
  if (!out.empty()) mapTo("NCCL_DEBUG_SUBSYS", v, "LOOM_DEBUG_SUBSYS", out);
}

// NCCL_SOCKET_IFNAME: loom takes one interface name.  "=eth0" (exact) and
// "eth0" map to it; lists and exclusions (^) have no loom equivalent.
void mapIfname() {
  const char* v = env("NCCL_SOCKET_IFNAME");
  if (!v) return;
  std::string name = v[0] == '=' ? v + 1 : v;
  if (name.empty() || name[0] == '^' || name.find(',') != std::string::npos) {
    logf(Level::Warn, "NCCL_SOCKET_IFNAME=%s: loom takes one interface name (no lists, no ^); ignored", v);
    return;
  }
  mapTo("NCCL_SOCKET_IFNAME", v, "LOOM_SOCKET_IFNAME", name);
}

// NCCL_ALGO: Ring and Tree are loom's ring and tree (double binary tree);
// per-collective forms (allreduce:ring) pass through lower-cased.  NVLS,
// CollNet and PAT have no loom counterpart.
void mapAlgo() {
  const char* v = env("NCCL_ALGO");
  if (!v) return;
  std::string s = v;
  for (char& c : s) c = char(tolower(c));
  if (s.find('^') != std::string::npos || s.find("nvls") != std::string::npos ||
      s.find("collnet") != std::string::npos || s.find("pat") != std::string::npos) {
    logf(Level::Warn, "NCCL_ALGO=%s: loom has ring and tree, no NVLS, CollNet, PAT or ^ exclusion; ignored",
         v);
    return;
  }
  mapTo("NCCL_ALGO", v, "LOOM_ALGO", s);
}

// NCCL_SHM_DISABLE=1 and NCCL_NET choose loom's transports: Socket is tcp
// (loom's default between hosts), IB is the ibverbs transport (without a
// fallback to tcp, as NCCL has none); NCCL_IB_DISABLE=1 wins over IB.
void mapTransports() {
  const char* shmOff = env("NCCL_SHM_DISABLE");
  const char* net = env("NCCL_NET");
  const char* ibOff = env("NCCL_IB_DISABLE");
  bool noShm = shmOff && strcmp(shmOff, "0") != 0;
  bool noIb = ibOff && strcmp(ibOff, "0") != 0;
  bool ib = net && !strcasecmp(net, "IB");
  if (net && !ib && strcasecmp(net, "Socket") != 0) {
    logf(Level::Warn, "NCCL_NET=%s: loom's networks are Socket (tcp) and IB (ibverbs); ignored", net);
    net = nullptr;
  }
  if (ib && noIb) {
    logf(Level::Warn, "NCCL_NET=IB with NCCL_IB_DISABLE=%s: InfiniBand disabled, tcp it is", ibOff);
    ib = false;
  }
  if (ib)
    mapTo("NCCL_NET", net, "LOOM_TRANSPORTS", noShm ? "ibverbs" : "shm,ibverbs");
  else if (noShm)
    mapTo("NCCL_SHM_DISABLE", shmOff, "LOOM_TRANSPORTS", "tcp");
  else if (net)
    logf(Level::Info, "NCCL_NET=Socket: loom uses tcp between hosts by default");
  // NCCL_IB_DISABLE=1 alone is loom's default (ibverbs only when chosen);
  // NCCL_CHECK_POINTERS is loom's default (every call checks its arguments).
}

// NCCL_IB_HCA: "[=]dev[:port],..." is LOOM_IB_HCA's list ("=": exact names,
// which is how loom matches anyway); "^" exclusion has no loom equivalent.
// NCCL_IB_GID_INDEX is LOOM_IB_GID_INDEX.
void mapIb() {
  if (const char* v = env("NCCL_IB_HCA")) {
    if (v[0] == '^')
      logf(Level::Warn, "NCCL_IB_HCA=%s: loom cannot exclude devices (^); ignored", v);
    else
      mapTo("NCCL_IB_HCA", v, "LOOM_IB_HCA", v[0] == '=' ? v + 1 : v);
  }
  if (const char* v = env("NCCL_IB_GID_INDEX")) {
    char* end = nullptr;
    long g = strtol(v, &end, 10);
    if (!*v || *end || g < 0 || g > 65535)
      logf(Level::Warn, "NCCL_IB_GID_INDEX=%s is not a GID index (0-65535); ignored", v);
    else
      mapTo("NCCL_IB_GID_INDEX", v, "LOOM_IB_GID_INDEX", std::to_string(g));
  }
}

// NCCL programs pass device buffers: unless the user chose, a communicator
// is a CUDA one where the process has a GPU, a host one otherwise (so the
// shim's host-buffer use keeps working on machines without one).
void mapDevice() {
  // NCCL_P2P_DISABLE=1: no direct access between the GPUs of a host; loom's
  // counterpart stages device buffers through pinned host memory.
  if (const char* v = env("NCCL_P2P_DISABLE")) {
    if (strcmp(v, "0") != 0) mapTo("NCCL_P2P_DISABLE", v, "LOOM_DEVICE_PATH", "staged");
  }
  if (env("LOOM_DEVICE")) return;
  setenv("LOOM_DEVICE", "auto", 1);
  logf(Level::Info, "LOOM_DEVICE=auto: CUDA communicators where there is a GPU, host ones otherwise");
}

void warnOthers() {
  for (char** e = environ; e && *e; ++e) {
    if (strncmp(*e, "NCCL_", 5) != 0) continue;
    // nccl-tests' own settings (NCCL_TESTS_DEVICE, ...), not NCCL's.
    if (strncmp(*e, "NCCL_TESTS_", 11) == 0) continue;
    std::string name(*e, strcspn(*e, "="));
    // NCCL_VERSION: NVIDIA's container images name the NCCL they installed
    // with it; NCCL reads no such setting (seen on the GPU machine's image).
    if (name == "NCCL_VERSION") continue;
    if (isMapped(name.c_str())) continue;
    const char* why = nullptr;
    for (const Unsupported& u : kUnsupported)
      if (name == u.name) why = u.why;
    if (why)
      logf(Level::Warn, "%s has no effect: %s", name.c_str(), why);
    else
      logf(Level::Warn, "%s is not known to loom's NCCL shim; ignored", name.c_str());
  }
}

void readEnv() {
  gLevel = parseLevel(env("LOOM_DEBUG") ? env("LOOM_DEBUG") : env("NCCL_DEBUG"));
  mapDebug();
  gLevel = parseLevel(env("LOOM_DEBUG"));
  if (gVersionLine) {
    int v = 0;
    loomGetVersion(&v);
    fprintf(stderr, "loom-nccl: NCCL %d.%d.%d API (ncclGetVersion %d) on loom %d.%d.%d\n", NCCL_MAJOR,
            NCCL_MINOR, NCCL_PATCH, NCCL_VERSION_CODE, v / 10000, v / 100 % 100, v % 100);
  }
  mapSubsys();
  mapIfname();
  mapAlgo();
  mapTransports();
  mapIb();
  mapDevice();
  warnOthers();
}

std::once_flag gEnvOnce;

}  // namespace

void ensureEnv() { std::call_once(gEnvOnce, readEnv); }

bool logOn(Level level) { return level != Level::None && level <= gLevel; }

void logf(Level level, const char* fmt, ...) {
  if (!logOn(level)) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  const char* tag = level == Level::Warn ? "WARN" : level == Level::Info ? "INFO" : "TRACE";
  fprintf(stderr, "loom-nccl %d %s %s\n", int(getpid()), tag, msg);
}

}  // namespace nccl_shim

// Re-reads the level for the shim's own log (loom reads LOOM_DEBUG once per
// process, as NCCL reads NCCL_DEBUG).
static void resetDebug() {
  using namespace nccl_shim;
  ensureEnv();
  gLevel = parseLevel(env("LOOM_DEBUG") ? env("LOOM_DEBUG") : env("NCCL_DEBUG"));
}
NCCL_SHIM_API(void, ncclResetDebugInit) { resetDebug(); }
// NCCL's internal name for the same (exported by libnccl.so.2, no prototype).
extern "C" __attribute__((visibility("default"))) void ncclResetDebugInitInternal() { resetDebug(); }
