#include "src/core/config.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "src/core/log.h"

namespace loom {

// The default keeps loom's own tcp between hosts even in builds with UCX:
// perf/ucx_compare.sh -A (2026-11-24, after issue 18's eager slots and direct
// transfers) measured all-reduces over UCX's tcp at 0.30-0.32 GB/s busbw for
// 2-64 MiB against 0.34-0.60 for loom's tcp in the same run (one way, UCX's
// direct transfers now beat loom's tcp); with no RDMA NIC to test UCX on,
// nothing here shows it faster for collectives.  LOOM_TRANSPORTS=shm,ucx,tcp
// prefers ucx between hosts (see docs/usage.md).
static const char* const kDefaultTransports = "shm,tcp";

const std::vector<ConfigVar>& configTable() {
  static const std::vector<ConfigVar> table = {
      {"LOOM_DEBUG", "NONE|WARN|INFO|TRACE", "WARN", "what loom logs to stderr"},
      {"LOOM_DEBUG_SUBSYS", "list", "ALL",
       "subsystems logged at INFO/TRACE: INIT,BOOT,NET,SHM,COLL,TUNE"},
      {"LOOM_TIMEOUT_MS", "int", "600000",
       "an operation or init that makes no progress for this long fails with loomTimeout"},
      {"LOOM_TRANSPORTS", "list", kDefaultTransports,
       "transports loom may use, in order of preference: each takes the peers it reaches that no earlier one "
       "took (shm: same host; ucx: any pair, builds with UCX only; ibverbs: pairs with RDMA devices, builds with libibverbs only; tcp: any pair; more with registerTransport); "
       "e.g. tcp forces tcp, shm,ucx,tcp puts UCX between hosts"},
      {"LOOM_UCX_TLS", "list", "(UCX_TLS)",
       "UCX transports for the ucx transport (passed to UCX as UCX_TLS, e.g. tcp or sm); unset: UCX_TLS / UCX's choice"},
      {"LOOM_UCX_RENDEZVOUS_BYTES", "int", "262144",
       "ucx: loomSend/loomRecv steps of at least this many bytes go as one UCX tagged message from the sender's "
       "buffer straight into the receiver's (UCX's rendezvous) instead of through the slots; 0: never (a pair "
       "uses the larger of its two values)"},
      {"LOOM_IB_HCA", "list", "(first active port)",
       "RDMA devices for the ibverbs transport, device[:port] in order of preference (e.g. mlx5_0:1,rxe0); "
       "unset: the first device with an active port"},
      {"LOOM_IB_GID_INDEX", "int", "-1 (automatic)",
       "GID index for the ibverbs transport on RoCE; -1: the first RoCE v2 IPv4-mapped GID (read from sysfs), "
       "skipping unset and link-local ones"},
      {"LOOM_IB_RENDEZVOUS_BYTES", "int", "1048576",
       "ibverbs: loomSend/loomRecv steps of at least this many bytes are written by RDMA straight into the "
       "receiver's buffer (rendezvous) instead of through the slots; 0: never (a pair uses the larger of its two "
       "values)"},
      {"LOOM_IB_TIMEOUT", "int", "18",
       "ibverbs: the queue pairs' transport timeout, 4.096 us x 2^N (18: 1.07 s, InfiniBand's encoding, 1-31): "
       "a write not acknowledged within it is sent again, up to 7 times; too short a timeout resends whole "
       "windows whose acknowledgement was only late (a loaded host, a slow link)"},
      {"LOOM_IB_REG_CACHE_BYTES", "int", "1073741824",
       "ibverbs: bytes of user-buffer memory registrations kept cached while unused (least recently used "
       "dropped first); only memory the kernel keeps coherent (on-demand paging) is cached beyond its operation"},
      {"LOOM_SOCKET_IFNAME", "name", "(route to root)",
       "network interface for bootstrap and tcp; default: loopback for ranks on one machine, else the one "
       "that reaches the root"},
      {"LOOM_HOST_ID", "string", "(hostname+boot id)",
       "host identity; ranks with equal ids share a host (tests pose as several hosts)"},
      {"LOOM_TOPO_FILE", "path", "(this machine)",
       "hwloc XML file read instead of this machine's topology (tests pose as a 2-socket server or an "
       "8-GPU box; loom-topo shows what loom sees)"},
      {"LOOM_SPIN_US", "int", "20",
       "microseconds a waiting rank spins before it sleeps (futex / poll); when a host runs more ranks "
       "than cores the spin yields the CPU"},
      {"LOOM_CPU_BIND", "auto|on|off", "auto",
       "auto: when a host runs more ranks than they may use CPUs and every rank of the host has the same CPU set "
       "(nobody bound them), each rank binds all its threads to an even share of that set at init, ranks of the "
       "host in contiguous blocks; on: bind even without oversubscription; off: never (a launcher's binding is "
       "always kept)"},
      {"LOOM_SLOT_BYTES", "int", "65536", "bytes per slot of a connection (the slice size)"},
      {"LOOM_SLOTS", "int", "8", "slots per connection ring (pipelining depth)"},
      {"LOOM_TAGGED_EAGER_BYTES", "int", "1048576",
       "tagged sends (loomSendTagged) of at most this many bytes go at once and wait at the receiver until "
       "matched; larger ones wait until the receiver has matched them (rendezvous)"},
      {"LOOM_TAGGED_STASH_BYTES", "int", "67108864",
       "bytes of tagged messages that arrived before their receive a rank keeps at most; past that it stops "
       "reading the sender's channel and the sender waits"},
      {"LOOM_SHM_SMALL_BYTES", "int", "16384",
       "per-rank blocks up to this size use the one-shot shared-memory path (0 = never)"},
      {"LOOM_SHM_STAGE_BYTES", "int", "262144",
       "staging buffer per rank for the staged shared-memory all-reduce (0 = never stage)"},
      {"LOOM_CHUNK_SIZE", "int", "0 (128 KiB)",
       "bytes per ring chunk (a ring loop covers nranks chunks); 0: the tuner's default, 128 KiB; capped "
       "at (LOOM_SLOTS-1) x LOOM_SLOT_BYTES"},
      {"LOOM_NCHANNELS", "int", "0 (1)",
       "parallel channels (lanes) per collective, at most 4 (a communicator's connections); 0: the "
       "tuner's default, 1"},
      {"LOOM_ALGO", "string", "(tuner)",
       "force an algorithm (the names loom-topo --algorithms lists; an unknown one is ignored with a warning, "
       "one that cannot serve a collective falls back to the ring, or pairwise for all-to-all/gather/scatter, "
       "with a warning), globally or per collective (allreduce:tree,allgather:ring,alltoall:bruck; keys allreduce, "
       "reducescatter, allgather, broadcast, reduce, alltoall, gather, scatter); hier-X: hierarchical with X "
       "between hosts"},
      {"LOOM_TUNING_FILE", "path", "(built-in)",
       "cost-model parameters (key = value lines, as written by loom-topo --calibrate) replacing the "
       "built-in ones; rank 0's decisions are used by all ranks"},
      {"LOOM_DEVICE", "host|cuda|auto", "host",
       "where a new communicator's collectives run: host memory, or CUDA device memory on the CUDA device "
       "current at init (cuda fails init with the reason on machines without a usable GPU; auto: cuda where "
       "the process has a usable GPU, else host; every rank must choose alike); loomCommInitRankConfig's "
       "config may name the kind and device instead"},
      {"LOOM_DEVICE_PATH", "auto|ipc|staged|hier", "auto",
       "how a CUDA communicator moves device buffers: ipc maps the ranks' device memory through CUDA IPC (one host "
       "only); staged copies through pinned host memory and the host transports (any hosts); hier: all-reduce as "
       "reduce-scatter over CUDA IPC within each host, all-reduce of the shard staged between hosts, all-gather "
       "within each host (several hosts with the same number of ranks, more than one, on each; the rest staged); "
       "auto: ipc when every rank is on one host, else hier where it applies, else staged (rank 0's value is used "
       "by all)"},
      {"LOOM_DEVICE_HIER_MIN_BYTES", "int", "1048576",
       "the hierarchical device path takes all-reduces of at least this many bytes, and reduce-scatters and "
       "all-gathers whose whole buffer (N blocks) is at least this many; smaller ones are staged whole (a guess, "
       "not measured on GPUs: below it the programs' latency should outweigh the bytes saved; rank 0's value is "
       "used by all)"},
      {"LOOM_DEVICE_STAGE_BYTES", "int", "2097152",
       "the staged path's piece: bytes a CUDA communicator stages per side and step through pinned host memory; "
       "it keeps 4 slots of 2 pieces (16 MiB pinned at the default), and stages up to 3 pieces ahead of the one "
       "on the network (a multiple of 256; rank 0's value is used by all)"},
      {"LOOM_DEVICE_SLOT_BYTES", "int", "33554432",
       "the CUDA IPC path's slot: each rank's window is two slots of device memory that the other ranks map, and "
       "a collective moves through it in rounds of at most a slot, each round synchronised by flags; send/recv "
       "staging is one slot per pair (a multiple of 4096, 65536 to 268435456; each round costs about 35 us, so "
       "larger slots move large buffers faster: on an H200 with 2 processes, a 256 MiB all-reduce reached 51 GB/s "
       "with 4 MiB slots, 134 with 16 MiB, 211 with 32 MiB, 280 with 64 MiB, measured when an all-reduce's round "
       "was half a slot and moved 11/8 of today's bytes; rank 0's value is used by all)"},
      {"LOOM_DEVICE_GRAPH_SLOT_BYTES", "int", "8388608",
       "the CUDA IPC path's graph lane: collectives, sends and receives issued on a stream being captured into a "
       "CUDA graph run replayable programs (they count their rounds or chunks from zero and return their flags to "
       "zero at the end, so every replay synchronises with the peers anew) in a second window of two slots of this "
       "size and flags of their own, allocated at init next to the first (captured sends stage in a region of "
       "2 x this / ranks per receiver); 0: no graph lane, and such calls are refused (a multiple of 4096, "
       "up to 268435456, raised to 65536 if smaller but not 0; rank 0's value is used by all)"},
      {"LOOM_DEVICE_ZERO_COPY", "bool", "1",
       "CUDA IPC path, collectives (not send/recv, not the in-place all-to-all) above "
       "LOOM_DEVICE_ONESHOT_BYTES: a rank whose send and recv buffers come from loomMemAlloc, or lie in device memory registered "
       "with loomCommRegister, publishes them, and the peers reduce from and copy out of them in place instead of "
       "through its window (all-reduce: 2.5 instead of 4 times the bytes of memory traffic per rank at 2 ranks); "
       "other buffers are staged as before, and each rank decides for itself per call. loomMemFree or "
       "loomCommDeregister of published memory first has the peers unmap it. 0: windows only, and the copies out "
       "use the copy engine (rank 0's value is used by all)"},
      {"LOOM_DEVICE_ONESHOT_BYTES", "int", "262144",
       "CUDA IPC path: all-reduces up to this many bytes run one-shot (every rank reduces every window), larger "
       "ones reduce-scatter + all-gather; other collectives up to it (their whole buffer, N blocks for per-rank "
       "counts) take no device zero-copy (not yet measured on GPUs; rank 0's value is used by all)"},
      {"LOOM_CHECK_MODE", "on|off", "on",
       "check that ranks call the same operation (sequence number + signature per slot; rooted collectives: "
       "headers to and from the root at one-shot sizes, a tag handshake with the neighbouring ranks on the "
       "executor path, the zero-copy votes' tags compared); also 1|0; rank 0's value is used by all; "
       "perf/check_mode_cost.sh measures its cost"},
      {"LOOM_DUMP_SIGNAL", "int", "0 (none)",
       "signal number (e.g. 10 = SIGUSR1) that makes loom print every communicator's pending operation to stderr"},
      {"LOOM_TRACE", "path", "(off)",
       "write a Chrome-trace/Perfetto JSON timeline of operations and executor steps (waiting, moving, reducing) "
       "per rank to PATH.<rank> (or PATH with %r replaced by the rank) when the communicator is destroyed; "
       "tools/loom_trace_merge.py merges the ranks"},
      {"LOOM_RANK", "int", "-", "this process's rank; set by loom-run, read by loomCommInitFromEnv"},
      {"LOOM_WORLD_SIZE", "int", "-", "number of ranks; set by loom-run, read by loomCommInitFromEnv"},
      {"LOOM_LOCAL_RANK", "int", "-", "rank within its host; set by loom-run for the program (loom does not read it)"},
      {"LOOM_LOCAL_SIZE", "int", "-", "ranks on its host; set by loom-run for the program (loom does not read it)"},
      {"LOOM_ROOT_ADDR", "host:port", "-", "bootstrap root for loomCommInitFromEnv"},
      {"LOOM_ROOT_FD", "int", "-",
       "set by loom-run for rank 0 only: a descriptor already listening on LOOM_ROOT_ADDR's port (so no other "
       "process can take the port first), kept by the process for every loomCommInitFromEnv on that port and "
       "made close-on-exec when libloom loads; not for users to set"},
      {"LOOM_ROOT_PORT", "int", "(MASTER_PORT+1)",
       "bootstrap port under torchrun/mpirun/srun when LOOM_ROOT_ADDR is unset"},
      {"LOOM_SECRET", "32 hex", "(derived from job id)",
       "bootstrap secret for loomCommInitFromEnv; loom-run sets a random one"},
  };
  return table;
}

static const char* env(const char* name) {
  const char* v = getenv(name);
  return (v && *v) ? v : nullptr;
}

static int64_t envInt(const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  const char* v = env(name);
  if (!v) return dflt;
  char* end = nullptr;
  long long x = strtoll(v, &end, 0);
  long long scale = 1;
  if (end && (*end == 'k' || *end == 'K')) scale = 1 << 10, ++end;
  else if (end && (*end == 'm' || *end == 'M')) scale = 1 << 20, ++end;
  // Multiplying, not shifting: "-9k" must not shift a negative value and
  // "9e18k" must not overflow (both were undefined behaviour; found by fuzz_env).
  bool overflow = __builtin_mul_overflow(x, scale, &x);
  if (!end || *end || overflow || x < lo || x > hi) {
    LOOM_WARN("INIT", "ignoring %s=%s: expected an integer in [%lld, %lld]", name, v,
              (long long)lo, (long long)hi);
    return dflt;
  }
  return x;
}

static bool envBool(const char* name, bool dflt) {
  const char* v = env(name);
  if (!v) return dflt;
  std::string s(v);
  if (s == "1" || s == "on" || s == "ON" || s == "yes" || s == "true") return true;
  if (s == "0" || s == "off" || s == "OFF" || s == "no" || s == "false") return false;
  LOOM_WARN("INIT", "ignoring %s=%s: expected on or off (1 or 0)", name, v);
  return dflt;
}

static std::string envStr(const char* name, const char* dflt = "") {
  const char* v = env(name);
  return v ? v : dflt;
}

// One of `choices`; anything else is warned about and the default used.
static std::string envChoice(const char* name, std::initializer_list<const char*> choices, const char* dflt) {
  const char* v = env(name);
  if (!v) return dflt;
  std::string list;
  for (const char* c : choices) {
    if (strcmp(v, c) == 0) return v;
    list += list.empty() ? c : std::string("|") + c;
  }
  LOOM_WARN("INIT", "ignoring %s=%s: expected %s", name, v, list.c_str());
  return dflt;
}

static Config readConfig() {
  Config c;
  c.timeoutMs = envInt("LOOM_TIMEOUT_MS", 600000, 1, int64_t(1) << 40);
  c.transports = envStr("LOOM_TRANSPORTS", kDefaultTransports);
  c.ucxTls = envStr("LOOM_UCX_TLS");
  c.ucxRendezvousBytes = envInt("LOOM_UCX_RENDEZVOUS_BYTES", 256 << 10, 0, int64_t(1) << 40);
  c.ibHca = envStr("LOOM_IB_HCA");
  c.ibGidIndex = envInt("LOOM_IB_GID_INDEX", -1, -1, 65535);
  c.ibRendezvousBytes = envInt("LOOM_IB_RENDEZVOUS_BYTES", 1 << 20, 0, int64_t(1) << 40);
  c.ibRegCacheBytes = envInt("LOOM_IB_REG_CACHE_BYTES", int64_t(1) << 30, 0, int64_t(1) << 50);
  c.ibTimeout = envInt("LOOM_IB_TIMEOUT", 18, 1, 31);
  c.socketIfname = envStr("LOOM_SOCKET_IFNAME");
  c.hostId = envStr("LOOM_HOST_ID");
  c.topoFile = envStr("LOOM_TOPO_FILE");
  c.spinUs = envInt("LOOM_SPIN_US", 20, 0, 10000000);
  c.cpuBind = envStr("LOOM_CPU_BIND", "auto");
  c.slotBytes = envInt("LOOM_SLOT_BYTES", 65536, 4096, 64 << 20) & ~int64_t(63);
  c.slots = envInt("LOOM_SLOTS", 8, 2, 1024);
  c.shmSmallBytes = envInt("LOOM_SHM_SMALL_BYTES", 16384, 0, 1 << 20) & ~int64_t(63);
  c.shmStageBytes = envInt("LOOM_SHM_STAGE_BYTES", 256 << 10, 0, 1 << 30) & ~int64_t(4095);
  c.p2pEagerBytes = envInt("LOOM_TAGGED_EAGER_BYTES", 1 << 20, 0, int64_t(1) << 40);
  c.p2pStashBytes = envInt("LOOM_TAGGED_STASH_BYTES", 64 << 20, 0, int64_t(1) << 40);
  c.chunkBytes = envInt("LOOM_CHUNK_SIZE", 0, 0, int64_t(1) << 40);
  c.channels = envInt("LOOM_NCHANNELS", 0, 0, 16);
  c.algo = envStr("LOOM_ALGO");
  c.tuningFile = envStr("LOOM_TUNING_FILE");
  c.checkMode = envBool("LOOM_CHECK_MODE", true);
  c.device = envStr("LOOM_DEVICE", "host");
  c.deviceStageBytes = envInt("LOOM_DEVICE_STAGE_BYTES", 2 << 20, 4096, 1 << 30) & ~int64_t(255);
  c.devicePath = envChoice("LOOM_DEVICE_PATH", {"auto", "ipc", "staged", "hier"}, "auto");
  c.deviceHierMinBytes = envInt("LOOM_DEVICE_HIER_MIN_BYTES", 1 << 20, 0, int64_t(1) << 31);
  c.deviceSlotBytes = envInt("LOOM_DEVICE_SLOT_BYTES", 32 << 20, 65536, 1 << 28) & ~int64_t(4095);
  c.deviceGraphSlotBytes = envInt("LOOM_DEVICE_GRAPH_SLOT_BYTES", 8 << 20, 0, 1 << 28);
  if (c.deviceGraphSlotBytes > 0)  // 0 turns the lane off; anything else is a usable slot
    c.deviceGraphSlotBytes = std::max<int64_t>(65536, c.deviceGraphSlotBytes & ~int64_t(4095));
  c.deviceZeroCopy = envBool("LOOM_DEVICE_ZERO_COPY", true);
  c.deviceOneShotBytes = envInt("LOOM_DEVICE_ONESHOT_BYTES", 256 << 10, 0, int64_t(1) << 31);
  c.dumpSignal = envInt("LOOM_DUMP_SIGNAL", 0, 0, 64);
  c.trace = envStr("LOOM_TRACE");
  c.rank = envStr("LOOM_RANK");
  c.worldSize = envStr("LOOM_WORLD_SIZE");
  c.rootAddr = envStr("LOOM_ROOT_ADDR");
  c.rootPort = envStr("LOOM_ROOT_PORT");
  c.rootFd = envStr("LOOM_ROOT_FD");
  c.secret = envStr("LOOM_SECRET");
  return c;
}

const LogConfig& logConfig() {
  static const LogConfig c{envStr("LOOM_DEBUG", "WARN"), envStr("LOOM_DEBUG_SUBSYS", "ALL")};
  return c;
}

const char* foreignEnv(const char* name) {
  static const char* const kForeign[] = {
      // torchrun
      "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
      // Open MPI's mpirun
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE",
      // Slurm's srun
      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_STEP_ID",
      // UCX's own settings, which loom's defaults give way to
      "UCX_TLS", "UCX_KEEPALIVE_INTERVAL", "UCX_RNDV_THRESH", "UCX_TCP_CONN_NB",
  };
  for (const char* f : kForeign)
    if (strcmp(f, name) == 0) return env(name);
  fprintf(stderr, "loom: internal error: %s is read but not listed in config.cc\n", name);
  abort();
}

static std::mutex gConfigMutex;
static Config* gConfig = nullptr;
static std::string gSnapshot;  // the environment gConfig was read from
static std::string envSnapshot();

const Config& config() {
  std::lock_guard<std::mutex> lock(gConfigMutex);
  if (!gConfig) {
    gConfig = new Config(readConfig());
    gSnapshot = envSnapshot();
  }
  return *gConfig;
}

// The environment a Config was read from (every variable of the table).
static std::string envSnapshot() {
  std::string snap;
  for (const ConfigVar& v : configTable()) {
    const char* e = getenv(v.name);  // "LOOM_RANK / LOOM_WORLD_SIZE" reads as unset: fine
    snap += e ? e : "\x01";
    snap += '\0';
  }
  return snap;
}

void configReload() {
  // Another thread may be initialising a communicator with the reference
  // config() gave it, so a Config is never changed in place: a changed
  // environment gets a new one, and the old ones stay alive (reachable, a
  // few hundred bytes each, only when the environment really changed).
  static std::vector<std::unique_ptr<Config>> retired;
  std::string snap = envSnapshot();
  std::lock_guard<std::mutex> lock(gConfigMutex);
  if (gConfig && snap == gSnapshot) return;
  Config* fresh = new Config(readConfig());
  if (gConfig) retired.emplace_back(gConfig);
  gConfig = fresh;
  gSnapshot = snap;
}

}  // namespace loom
