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
  const char* defaultValue;
  const char* meaning;
};

// Every LOOM_* variable loom reads.
const std::vector<ConfigVar>& configTable();

struct Config {
  std::string debug;          // LOOM_DEBUG
  std::string debugSubsys;    // LOOM_DEBUG_SUBSYS
  int64_t timeoutMs;          // LOOM_TIMEOUT_MS
  std::string transports;     // LOOM_TRANSPORTS
  std::string ucxTls;         // LOOM_UCX_TLS
  std::string socketIfname;   // LOOM_SOCKET_IFNAME
  std::string hostId;         // LOOM_HOST_ID
  int64_t spinUs;             // LOOM_SPIN_US
  int64_t slotBytes;          // LOOM_SLOT_BYTES
  int64_t slots;              // LOOM_SLOTS
  int64_t shmSmallBytes;      // LOOM_SHM_SMALL_BYTES
  int64_t shmStageBytes;      // LOOM_SHM_STAGE_BYTES
  int64_t chunkBytes;         // LOOM_CHUNK_SIZE (0 = tuner decides)
  int64_t channels;           // LOOM_NCHANNELS (0 = tuner decides)
  std::string algo;           // LOOM_ALGO
  std::string tuningFile;     // LOOM_TUNING_FILE
  bool checkMode;             // LOOM_CHECK_MODE
  int64_t dumpSignal;         // LOOM_DUMP_SIGNAL (0 = none)
};

// The process-wide configuration (parsed on first use).
const Config& config();

// Re-reads the environment (tests change variables between communicators).
void configReload();

}  // namespace loom
