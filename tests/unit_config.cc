// The table of LOOM_* variables (configTable(), printed by loom-topo --env and
// copied into the README) against what config() really does.
#include "loom_catch.h"
#include <cctype>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>

#include "src/core/config.h"

using loom::Config;

namespace {

// Every variable of the table unset for the test's duration.
struct CleanEnvironment {
  std::map<std::string, std::string> saved;
  CleanEnvironment() {
    for (const loom::ConfigVar& v : loom::configTable())
      if (const char* e = getenv(v.name)) saved[v.name] = e, unsetenv(v.name);
    loom::configReload();
  }
  ~CleanEnvironment() {
    for (const auto& [name, value] : saved) setenv(name.c_str(), value.c_str(), 1);
    loom::configReload();
  }
};

// A default as config() should hold it: the leading value, or "" when the
// table gives only a note ("(tuner)", "-").
std::string valueOf(const std::string& dflt) {
  if (dflt.empty() || dflt[0] == '(' || dflt == "-") return "";
  return dflt.substr(0, dflt.find(" ("));
}

}  // namespace

TEST_CASE("every default in config.cc's table is the value config() uses when the variable is unset",
          "[config]") {
  CleanEnvironment clean;
  const Config& c = loom::config();
  auto num = [](int64_t v) { return std::to_string(v); };
  const std::map<std::string, std::function<std::string()>> actual = {
      {"LOOM_DEBUG", [] { return loom::logConfig().level; }},
      {"LOOM_DEBUG_SUBSYS", [] { return loom::logConfig().subsys; }},
      {"LOOM_TIMEOUT_MS", [&] { return num(c.timeoutMs); }},
      {"LOOM_TRANSPORTS", [&] { return c.transports; }},
      {"LOOM_UCX_TLS", [&] { return c.ucxTls; }},
      {"LOOM_UCX_RENDEZVOUS_BYTES", [&] { return num(c.ucxRendezvousBytes); }},
      {"LOOM_IB_HCA", [&] { return c.ibHca; }},
      {"LOOM_IB_GID_INDEX", [&] { return num(c.ibGidIndex); }},
      {"LOOM_IB_RENDEZVOUS_BYTES", [&] { return num(c.ibRendezvousBytes); }},
      {"LOOM_IB_REG_CACHE_BYTES", [&] { return num(c.ibRegCacheBytes); }},
      {"LOOM_IB_TIMEOUT", [&] { return num(c.ibTimeout); }},
      {"LOOM_SOCKET_IFNAME", [&] { return c.socketIfname; }},
      {"LOOM_HOST_ID", [&] { return c.hostId; }},
      {"LOOM_TOPO_FILE", [&] { return c.topoFile; }},
      {"LOOM_SPIN_US", [&] { return num(c.spinUs); }},
      {"LOOM_SLOT_BYTES", [&] { return num(c.slotBytes); }},
      {"LOOM_SLOTS", [&] { return num(c.slots); }},
      {"LOOM_TAGGED_EAGER_BYTES", [&] { return num(c.p2pEagerBytes); }},
      {"LOOM_TAGGED_STASH_BYTES", [&] { return num(c.p2pStashBytes); }},
      {"LOOM_SHM_SMALL_BYTES", [&] { return num(c.shmSmallBytes); }},
      {"LOOM_SHM_STAGE_BYTES", [&] { return num(c.shmStageBytes); }},
      {"LOOM_CHUNK_SIZE", [&] { return num(c.chunkBytes); }},
      {"LOOM_NCHANNELS", [&] { return num(c.channels); }},
      {"LOOM_ALGO", [&] { return c.algo; }},
      {"LOOM_TUNING_FILE", [&] { return c.tuningFile; }},
      {"LOOM_CHECK_MODE", [&] { return std::string(c.checkMode ? "on" : "off"); }},
      {"LOOM_DEVICE", [&] { return c.device; }},
      {"LOOM_DEVICE_PATH", [&] { return c.devicePath; }},
      {"LOOM_DEVICE_STAGE_BYTES", [&] { return num(c.deviceStageBytes); }},
      {"LOOM_DEVICE_HIER_MIN_BYTES", [&] { return num(c.deviceHierMinBytes); }},
      {"LOOM_DEVICE_SLOT_BYTES", [&] { return num(c.deviceSlotBytes); }},
      {"LOOM_DEVICE_GRAPH_SLOT_BYTES", [&] { return num(c.deviceGraphSlotBytes); }},
      {"LOOM_DEVICE_ZERO_COPY", [&] { return std::string(c.deviceZeroCopy ? "1" : "0"); }},
      {"LOOM_DEVICE_ONESHOT_BYTES", [&] { return num(c.deviceOneShotBytes); }},
      {"LOOM_CPU_BIND", [&] { return c.cpuBind; }},
      {"LOOM_DUMP_SIGNAL", [&] { return num(c.dumpSignal); }},
      {"LOOM_TRACE", [&] { return c.trace; }},
      {"LOOM_RANK", [&] { return c.rank; }},
      {"LOOM_WORLD_SIZE", [&] { return c.worldSize; }},
      {"LOOM_ROOT_ADDR", [&] { return c.rootAddr; }},
      {"LOOM_ROOT_PORT", [&] { return c.rootPort; }},
      {"LOOM_ROOT_FD", [&] { return c.rootFd; }},
      {"LOOM_SECRET", [&] { return c.secret; }},
      // Set by loom-run for the program; loom itself does not read them.
      {"LOOM_LOCAL_RANK", [] { return std::string(); }},
      {"LOOM_LOCAL_SIZE", [] { return std::string(); }},
  };
  for (const loom::ConfigVar& v : loom::configTable()) {
    INFO(v.name << ": table default \"" << v.defaultValue << "\"");
    auto it = actual.find(v.name);
    REQUIRE(it != actual.end());  // a new variable: add it above
    // LOOM_DEBUG*: read once per process, so only when the run left them unset.
    if (std::string(v.name).rfind("LOOM_DEBUG", 0) == 0 && clean.saved.count(v.name)) continue;
    CHECK(it->second() == valueOf(v.defaultValue));
  }
  CHECK(actual.size() == loom::configTable().size());
}
