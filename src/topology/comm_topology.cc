#include "src/topology/comm_topology.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "src/core/error.h"
#include "src/core/log.h"
#include "src/topology/topology.h"

namespace loom {

namespace {

std::once_flag gTopoOnce;
std::unique_ptr<Topology> gTopo;

// The interface that holds address `addr` (port ignored), "" if none does.
std::string interfaceOf(const sockaddr_storage& addr) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* ifa = list; ifa && name.empty(); ifa = ifa->ifa_next) {
    if (!ifa->ifa_addr || ifa->ifa_addr->sa_family != addr.ss_family) continue;
    if (addr.ss_family == AF_INET) {
      auto a = reinterpret_cast<const sockaddr_in*>(&addr), b = reinterpret_cast<const sockaddr_in*>(ifa->ifa_addr);
      if (a->sin_addr.s_addr == b->sin_addr.s_addr) name = ifa->ifa_name;
    } else if (addr.ss_family == AF_INET6) {
      auto a = reinterpret_cast<const sockaddr_in6*>(&addr), b = reinterpret_cast<const sockaddr_in6*>(ifa->ifa_addr);
      if (memcmp(&a->sin6_addr, &b->sin6_addr, sizeof a->sin6_addr) == 0) name = ifa->ifa_name;
    }
  }
  freeifaddrs(list);
  return name;
}

}  // namespace

const Topology* processTopology() {
  std::call_once(gTopoOnce, [] {
    try {
      gTopo = Topology::detect();
    } catch (const Error& e) {
      LOOM_WARN("INIT", "topology detection failed (%s): assuming one NUMA node", e.what());
    }
  });
  return gTopo.get();
}

RankTopo localRankTopo(const sockaddr_storage& advertised) {
  std::string ifname = interfaceOf(advertised);
  RankTopo t{};
  t.numaNode = -1;
  t.numaCount = 1;
  t.coreCount = t.puCount = int32_t(sysconf(_SC_NPROCESSORS_ONLN));
  t.gpu = t.nic = -1;
  snprintf(t.nicName, sizeof t.nicName, "%s", ifname.c_str());
  const Topology* topo = processTopology();
  if (!topo) return t;
  t.numaCount = topo->numaCount();
  t.coreCount = topo->cores;
  t.puCount = topo->pus;
  t.gpuCount = int32_t(topo->gpus.size());
  t.nicCount = int32_t(topo->nics.size());
  t.numaNode = topo->numaOfThisProcess();
  for (size_t i = 0; i < topo->nics.size(); ++i)
    for (const std::string& n : topo->nics[i].osNames)
      if (!ifname.empty() && n == ifname) t.nic = int32_t(i);
  return t;
}

const char* linkClassName(LinkClass c) {
  switch (c) {
    case LinkClass::Self: return "self";
    case LinkClass::ShmSameNuma: return "shm";
    case LinkClass::ShmCrossNuma: return "shm_xnuma";
    case LinkClass::Network: return "net";
  }
  return "?";
}

CommTopology::CommTopology(const std::vector<std::string>& hostIds, const std::vector<RankTopo>& ranks)
    : ranks_(ranks) {
  std::map<std::string, int> index;
  hostOf_.resize(ranks.size());
  localRank_.resize(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto it = index.find(hostIds[r]);
    if (it == index.end()) {
      it = index.emplace(hostIds[r], int(hosts_.size())).first;
      hosts_.emplace_back();
      hostNames_.push_back(hostIds[r]);
    }
    hostOf_[r] = it->second;
    localRank_[r] = int(hosts_[size_t(it->second)].size());
    hosts_[size_t(it->second)].push_back(int(r));
  }
}

LinkClass CommTopology::linkClass(int a, int b) const {
  if (a == b) return LinkClass::Self;
  if (!sameHost(a, b)) return LinkClass::Network;
  int na = numaOf(a), nb = numaOf(b);
  return (na >= 0 && nb >= 0 && na != nb) ? LinkClass::ShmCrossNuma : LinkClass::ShmSameNuma;
}

bool CommTopology::uniformHosts() const {
  for (const auto& h : hosts_)
    if (h.size() != hosts_[0].size()) return false;
  return true;
}

}  // namespace loom
