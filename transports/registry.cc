// The transports of this build, in the order docs list them.  Adding a
// transport: a folder under transports/ with a Transport subclass, and one
// line in builtinTransports() (docs/design.md, "Adding a transport").
#include <algorithm>
#include <mutex>

#include "src/core/error.h"
#include "transports/shm/shm_transport.h"
#include "transports/tcp/tcp_transport.h"
#ifdef LOOM_HAVE_UCX
#include "transports/ucx/ucx_transport.h"
#endif
#ifdef LOOM_HAVE_IBVERBS
#include "transports/ibverbs/ib_transport.h"
#endif

namespace loom {

namespace {

std::vector<TransportEntry> builtinTransports() {
  return {
      {"shm", "shared-memory slot rings between ranks of one host", makeShmTransport},
#ifdef LOOM_HAVE_UCX
      {"ucx", "UCX (UCP tagged messages): any pair, whatever UCX finds", makeUcxTransport},
#endif
#ifdef LOOM_HAVE_IBVERBS
      {"ibverbs", "RDMA verbs (RoCE, InfiniBand): RC QPs between ranks that have an RDMA device", makeIbTransport},
#endif
      {"tcp", "loom's own sockets: any pair", makeTcpTransport},
  };
}

std::mutex& registryMutex() {
  static std::mutex m;
  return m;
}

std::vector<TransportEntry>& added() {
  static std::vector<TransportEntry> v;
  return v;
}

}  // namespace

std::vector<TransportEntry> transportRegistry() {
  std::vector<TransportEntry> all = builtinTransports();
  std::lock_guard<std::mutex> lock(registryMutex());
  for (const TransportEntry& e : added()) {
    auto same = [&](const TransportEntry& x) { return x.name == e.name; };
    auto it = std::find_if(all.begin(), all.end(), same);
    if (it != all.end()) *it = e;
    else all.push_back(e);
  }
  return all;
}

void registerTransport(TransportEntry entry) {
  std::lock_guard<std::mutex> lock(registryMutex());
  auto same = [&](const TransportEntry& x) { return x.name == entry.name; };
  auto it = std::find_if(added().begin(), added().end(), same);
  if (it != added().end()) *it = std::move(entry);
  else added().push_back(std::move(entry));
}

std::vector<std::string> parseTransports(const std::string& spec) {
  std::vector<TransportEntry> known = transportRegistry();
  std::string names;
  for (const TransportEntry& e : known) names += (names.empty() ? "" : ", ") + e.name;
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string t = spec.substr(pos, end - pos);
    pos = end + 1;
    if (t.empty()) continue;
    bool found = std::any_of(known.begin(), known.end(), [&](const TransportEntry& e) { return e.name == t; });
    if (!found) {
#ifndef LOOM_HAVE_UCX
      if (t == "ucx")
        fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: this loom was built without UCX (pkg-config found no "
             "ucx), so it has only %s", spec.c_str(), names.c_str());
#endif
#ifndef LOOM_HAVE_IBVERBS
      if (t == "ibverbs")
        fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: this loom was built without libibverbs (CMake found no "
             "infiniband/verbs.h), so it has only %s", spec.c_str(), names.c_str());
#endif
      fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s: unknown transport '%s' (this build has %s)", spec.c_str(),
           t.c_str(), names.c_str());
    }
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  if (out.empty()) fail(loomInvalidArgument, "LOOM_TRANSPORTS=%s names no transport", spec.c_str());
  return out;
}

}  // namespace loom

namespace loom {

const uint8_t* PeerMemory::importBuffer(int r, const PeerBuffer& b, size_t need, uint64_t op) const {
  (void)b, (void)need, (void)op;
  fail(loomInternalError, "rank %d published a buffer this peer memory cannot map", r);
}

}  // namespace loom
