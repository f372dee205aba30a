// Fuzzes the configuration parsers: a LOOM_* variable chosen by the first
// byte gets the rest of the input as its value (LOOM_TRANSPORTS also goes
// through parseTransports).  Bad values must be rejected with a warning or
// loomInvalidArgument, never crash.
#include <cstdlib>
#include <string>

#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "tests/fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  loomfuzz::quiet();
  return 0;
}

static const char* kVars[] = {"LOOM_TIMEOUT_MS",      "LOOM_SPIN_US",         "LOOM_SLOT_BYTES",
                              "LOOM_SLOTS",           "LOOM_SHM_SMALL_BYTES", "LOOM_SHM_STAGE_BYTES",
                              "LOOM_CHUNK_SIZE",      "LOOM_NCHANNELS",       "LOOM_CHECK_MODE",
                              "LOOM_TRANSPORTS",      "LOOM_ALGO"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 256) return 0;
  const char* var = kVars[data[0] % (sizeof kVars / sizeof kVars[0])];
  std::string value(reinterpret_cast<const char*>(data + 1), size - 1);
  value = value.substr(0, value.find('\0'));
  setenv(var, value.c_str(), 1);
  loom::configReload();
  const loom::Config& c = loom::config();
  if (c.slots < 2 || c.slotBytes < 4096 || c.timeoutMs < 1 || c.channels < 0) abort();
  try {
    std::vector<std::string> names = loom::parseTransports(c.transports);
    if (names.empty()) abort();
    std::vector<loom::TransportEntry> known = loom::transportRegistry();
    for (const std::string& n : names) {
      bool registered = false;
      for (const loom::TransportEntry& e : known) registered |= e.name == n;
      if (!registered) abort();
    }
  } catch (const loom::Error& e) {
    if (e.code() != loomInvalidArgument) abort();
  }
  unsetenv(var);
  return 0;
}
