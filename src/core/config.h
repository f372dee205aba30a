// The one configuration mechanism: a table of LOOM_* environment variables,
// read once per process.  Each entry has a type, a default and a meaning;
// `loom-topo --env` and the README print the same table.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct ConfigVar {
  const char* name;
  const char* type;
  // The value loom uses when the variable is unset, maybe followed by a note
  // in parentheses ("0 (none)"); or only a note in parentheses, or "-", when
  // unset means "not given" (tests/unit_config.cc holds config() to this).
  const char* defaultValue;
  const char* meaning;
};

// Every LOOM_* variable loom reads.
const std::vector<ConfigVar>& configTable();

struct Config {
  int64_t timeoutMs;          // LOOM_TIMEOUT_MS
  std::string transports;     // LOOM_TRANSPORTS
  std::string ucxTls;         // LOOM_UCX_TLS
  int64_t ucxRendezvousBytes;  // LOOM_UCX_RENDEZVOUS_BYTES (0 = off)
  std::string ibHca;          // LOOM_IB_HCA
  int64_t ibGidIndex;         // LOOM_IB_GID_INDEX (-1 = automatic)
  int64_t ibRendezvousBytes;  // LOOM_IB_RENDEZVOUS_BYTES (0 = off)
  int64_t ibRegCacheBytes;    // LOOM_IB_REG_CACHE_BYTES
  int64_t ibTimeout;          // LOOM_IB_TIMEOUT (QP timeout exponent)
  std::string socketIfname;   // LOOM_SOCKET_IFNAME
  std::string hostId;         // LOOM_HOST_ID
  std::string topoFile;       // LOOM_TOPO_FILE
  int64_t spinUs;             // LOOM_SPIN_US
  std::string cpuBind;        // LOOM_CPU_BIND (checked by parseCpuBindMode)
  int64_t slotBytes;          // LOOM_SLOT_BYTES
  int64_t slots;              // LOOM_SLOTS
  int64_t shmSmallBytes;      // LOOM_SHM_SMALL_BYTES
  int64_t shmStageBytes;      // LOOM_SHM_STAGE_BYTES
  int64_t p2pEagerBytes;      // LOOM_TAGGED_EAGER_BYTES
  int64_t p2pStashBytes;      // LOOM_TAGGED_STASH_BYTES
  int64_t chunkBytes;         // LOOM_CHUNK_SIZE (0 = tuner decides)
  int64_t channels;           // LOOM_NCHANNELS (0 = tuner decides)
  std::string algo;           // LOOM_ALGO
  std::string tuningFile;     // LOOM_TUNING_FILE
  bool checkMode;             // LOOM_CHECK_MODE
  std::string device;         // LOOM_DEVICE (checked by checkDeviceChoice)
  std::string devicePath;     // LOOM_DEVICE_PATH: auto, ipc, staged or hier
  int64_t deviceHierMinBytes = 1 << 20;  // LOOM_DEVICE_HIER_MIN_BYTES
  int64_t deviceStageBytes = 2 << 20;  // LOOM_DEVICE_STAGE_BYTES
  int64_t deviceSlotBytes = 32 << 20;  // LOOM_DEVICE_SLOT_BYTES
  int64_t deviceGraphSlotBytes = 8 << 20;  // LOOM_DEVICE_GRAPH_SLOT_BYTES (0: no graph lane)
  bool deviceZeroCopy = true;          // LOOM_DEVICE_ZERO_COPY
  int64_t deviceOneShotBytes = 256 << 10;  // LOOM_DEVICE_ONESHOT_BYTES
  int64_t dumpSignal;         // LOOM_DUMP_SIGNAL (0 = none)
  std::string trace;          // LOOM_TRACE (empty = off)
  // Set by loom-run for loomCommInitFromEnv, which checks them (as text: a
  // bad value is an init error there, not a warning and a default here).
  std::string rank;           // LOOM_RANK
  std::string worldSize;      // LOOM_WORLD_SIZE
  std::string rootAddr;       // LOOM_ROOT_ADDR
  std::string rootPort;       // LOOM_ROOT_PORT
  std::string rootFd;         // LOOM_ROOT_FD (read by the bootstrap itself, once)
  std::string secret;         // LOOM_SECRET
};

// The process-wide configuration (parsed on first use).
const Config& config();

// Re-reads the environment (tests change variables between communicators).
void configReload();

// LOOM_DEBUG and LOOM_DEBUG_SUBSYS, read once per process apart from
// config(): parsing config() may log a warning, so the logger cannot wait
// for it.  Reading them never logs.
struct LogConfig {
  std::string level;   // LOOM_DEBUG: NONE, WARN, INFO or TRACE
  std::string subsys;  // LOOM_DEBUG_SUBSYS: comma list or ALL
};
const LogConfig& logConfig();

// Variables of other software that loom reads: launchers' (RANK,
// OMPI_COMM_WORLD_RANK, SLURM_PROCID, MASTER_ADDR, ...) and UCX's.  They
// are not loom's to document, but config.cc still lists them, so that it is
// the one place that knows what loom reads.  Returns the value, or nullptr
// when unset or empty; a name missing from the list is a bug in loom and
// aborts.
const char* foreignEnv(const char* name);

}  // namespace loom
