// The communicator's topology: what each rank reported about its machine
// during init (a fixed-size RankTopo inside RankInfo, all-gathered), turned
// into host groups and NUMA placement that the tuner and loom-topo read.
#pragma once
#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

class Topology;

// One rank's summary of its machine, exchanged at init.  Plain bytes: the
// same layout on every rank of a job (one build).
struct RankTopo {
  int32_t numaNode;    // OS index of the NUMA node of the rank's CPU binding, -1: spans several / unknown
  int32_t numaCount;   // NUMA nodes of its machine (>= 1)
  int32_t coreCount;   // cores of its machine
  int32_t puCount;     // hardware threads of its machine
  int32_t gpuCount;    // PCI GPUs of its machine
  int32_t nicCount;    // PCI NICs of its machine
  int32_t gpu;         // index (in its machine's GPU list) of the GPU it uses, -1: none (host memory)
  int32_t nic;         // index (in its machine's NIC list) of the NIC its tcp traffic leaves by, -1: none / virtual
  char nicName[16];    // interface its tcp traffic uses ("eth0", "lo"), "" when unknown
  char gpuBusId[16];   // PCI bus id of that GPU, "" when none
};

// This process's summary; the machine's topology is detected once per process
// (LOOM_TOPO_FILE honoured).  `advertised` is the address the rank's data
// listener advertises; the interface holding it is the rank's NIC.
// Never fails: when hwloc cannot load the machine it says so in the log and
// reports one NUMA node and what sysconf knows.
RankTopo localRankTopo(const sockaddr_storage& advertised);
// The machine's topology, detected once per process (nullptr if hwloc failed).
const Topology* processTopology();

// Link classes between two ranks, for the cost model and calibration.
enum class LinkClass { Self, ShmSameNuma, ShmCrossNuma, Network };
const char* linkClassName(LinkClass c);  // "self", "shm", "shm_xnuma", "net"

class CommTopology {
 public:
  CommTopology() = default;
  // hostIds[r]: rank r's host identity (ranks with equal ids share a host).
  CommTopology(const std::vector<std::string>& hostIds, const std::vector<RankTopo>& ranks);

  int nranks() const { return int(ranks_.size()); }
  int nhosts() const { return int(hosts_.size()); }
  // Hosts are numbered in order of their lowest rank.
  int hostOf(int rank) const { return hostOf_[size_t(rank)]; }
  const std::vector<int>& hostOfRanks() const { return hostOf_; }  // hostOf(r) for every rank
  // Rank's index among the ranks of its host, and how many share it.
  int localRank(int rank) const { return localRank_[size_t(rank)]; }
  int localSize(int rank) const { return int(hosts_[size_t(hostOf(rank))].size()); }
  const std::vector<int>& hostRanks(int host) const { return hosts_[size_t(host)]; }
  const std::vector<std::vector<int>>& hostGroups() const { return hosts_; }
  const std::string& hostName(int host) const { return hostNames_[size_t(host)]; }
  int numaOf(int rank) const { return ranks_[size_t(rank)].numaNode; }
  const RankTopo& rank(int r) const { return ranks_[size_t(r)]; }
  bool sameHost(int a, int b) const { return hostOf(a) == hostOf(b); }
  // Two ranks on one host whose NUMA nodes are known and differ are cross-NUMA.
  LinkClass linkClass(int a, int b) const;
  // Every host runs the same number of ranks.
  bool uniformHosts() const;

 private:
  std::vector<RankTopo> ranks_;
  std::vector<int> hostOf_, localRank_;
  std::vector<std::vector<int>> hosts_;
  std::vector<std::string> hostNames_;
};

}  // namespace loom
