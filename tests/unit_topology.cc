// The topology detector on this machine (checked against what the kernel
// says in /sys) and on hwloc XML files: our own fixtures (tests/topologies)
// and real machines from hwloc's test data (tests/topologies/hwloc), whose
// expected counts were read with lstopo.  Also the communicator's view
// (CommTopology) built from per-rank summaries.
#include <dirent.h>
#include <limits.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include "loom_catch.h"
#include <fstream>
#include <set>
#include <string>

#include "src/core/backoff.h"
#include "src/core/error.h"
#include "src/topology/comm_topology.h"
#include "src/topology/cpu_bind.h"
#include "src/topology/numa.h"
#include "src/topology/nvml.h"
#include "src/topology/topology.h"

using namespace loom;

namespace {

std::string fixture(const std::string& name) { return std::string(LOOM_TOPO_FIXTURES) + "/" + name; }

std::string readLine(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

const PciDeviceInfo* byBus(const std::vector<PciDeviceInfo>& devs, const std::string& bus) {
  for (const auto& d : devs)
    if (d.busId == bus) return &d;
  return nullptr;
}

// Scoped environment variable.
struct EnvVar {
  std::string name;
  EnvVar(const char* n, const std::string& v) : name(n) { setenv(n, v.c_str(), 1); }
  ~EnvVar() { unsetenv(name.c_str()); }
};

}  // namespace

TEST_CASE("topology of this machine agrees with the kernel's view", "[topology]") {
  std::unique_ptr<Topology> t = Topology::detect();
  REQUIRE(t->source == "this machine");
  // hwloc counts the PUs this process may be given (its cgroup's cpuset):
  // at least those of its affinity mask, at most those online.
  cpu_set_t mask;
  REQUIRE(sched_getaffinity(0, sizeof mask, &mask) == 0);
  CHECK(t->pus >= CPU_COUNT(&mask));
  CHECK(t->pus <= sysconf(_SC_NPROCESSORS_ONLN));
  CHECK(t->cores >= 1);
  CHECK(t->cores <= t->pus);
  CHECK(t->packages >= 1);
  CHECK(t->numaCount() == numaNodeCount());
  int coresInNodes = 0;
  for (const NumaNodeInfo& n : t->numaNodes) coresInNodes += n.cores;
  CHECK(coresInNodes == t->cores);
  if (t->numaCount() == 1) CHECK(t->numaOfThisProcess() == t->numaNodes[0].osIndex);

  // Every network interface backed by a PCI network controller is a NIC,
  // found under its bus id with its name and a NUMA node of this machine.
  DIR* d = opendir("/sys/class/net");
  REQUIRE(d);
  int pciNics = 0;
  while (dirent* e = readdir(d)) {
    std::string ifname = e->d_name;
    char real[PATH_MAX];
    if (ifname[0] == '.' || !realpath(("/sys/class/net/" + ifname + "/device").c_str(), real)) continue;
    // Walk up to the PCI function (virtio devices hang below theirs).
    std::string dev = real;
    while (dev.size() > 1 && readLine(dev + "/class").rfind("0x", 0) != 0) dev = dev.substr(0, dev.rfind('/'));
    std::string cls = readLine(dev + "/class");
    if (cls.rfind("0x02", 0) != 0) continue;
    std::string bus = normalizePciBusId(dev.substr(dev.rfind('/') + 1));
    INFO("interface " << ifname << " at " << bus);
    const PciDeviceInfo* nic = byBus(t->nics, bus);
    REQUIRE(nic);
    CHECK(std::find(nic->osNames.begin(), nic->osNames.end(), ifname) != nic->osNames.end());
    bool knownNode = false;
    for (const NumaNodeInfo& n : t->numaNodes) knownNode |= n.osIndex == nic->numaNode;
    CHECK(knownNode);
    ++pciNics;
  }
  closedir(d);
  CHECK(int(t->nics.size()) >= pciNics);
  // Without an NVIDIA driver NVML is absent and detection still works.
  CHECK(!t->nvlinkSource.empty());
}

TEST_CASE("two-socket fixture: counts, NIC affinity and the cross-socket PCI path", "[topology]") {
  std::unique_ptr<Topology> t = Topology::fromXml(fixture("two-socket.xml"));
  CHECK(t->packages == 2);
  CHECK(t->cores == 8);
  CHECK(t->pus == 16);
  REQUIRE(t->numaCount() == 2);
  for (const NumaNodeInfo& n : t->numaNodes) {
    CHECK(n.cores == 4);
    CHECK(n.memoryBytes == (uint64_t(32) << 30));
  }
  CHECK(t->gpus.empty());
  REQUIRE(t->nics.size() == 2);
  const PciDeviceInfo* eth = byBus(t->nics, "0000:04:00.0");
  const PciDeviceInfo* ib = byBus(t->nics, "0000:81:00.0");
  REQUIRE(eth);
  REQUIRE(ib);
  CHECK(eth->numaNode == 0);
  CHECK(eth->numaLocal);
  CHECK(eth->package == 0);
  CHECK(eth->osNames == std::vector<std::string>{"eth0"});
  CHECK(ib->numaNode == 1);
  CHECK(ib->package == 1);
  CHECK(ib->pciClass == 0x0207);
  CHECK(ib->osNames == std::vector<std::string>{"ib0", "mlx5_0"});
  // nic -> root port -> host bridge -> package -> machine, and down again.
  CHECK(t->pciDistance(eth->busId, ib->busId) == 8);
  CHECK(t->pciDistance(ib->busId, eth->busId) == 8);
  CHECK(t->pciPathClass(eth->busId, ib->busId) == "SYS");
  CHECK(t->pciDistance(eth->busId, "0000:99:00.0") == -1);
  // CPU sets map to the node that holds them, or -1 when they span both.
  CHECK(t->numaOfCpuset("0x0000000f") == 0);
  CHECK(t->numaOfCpuset("0x0000ff00") == 1);
  CHECK(t->numaOfCpuset("0x00000101") == -1);
  CHECK(t->numaOfCpuset("garbage") == -1);
}

TEST_CASE("eight-GPU fixture: GPUs and NICs under PCIe switches, affinities and distances", "[topology]") {
  std::unique_ptr<Topology> t = Topology::fromXml(fixture("eight-gpu.xml"));
  CHECK(t->packages == 2);
  CHECK(t->cores == 16);
  REQUIRE(t->numaCount() == 2);
  REQUIRE(t->gpus.size() == 8);
  REQUIRE(t->nics.size() == 4);
  for (size_t g = 0; g < 8; ++g) {
    INFO("gpu " << g << " " << t->gpus[g].busId);
    CHECK(t->gpus[g].numaNode == int(g / 4));
    CHECK(t->gpus[g].package == int(g / 4));
    CHECK(t->gpus[g].vendor == 0x10de);
    CHECK(t->gpus[g].osNames == std::vector<std::string>{"cuda" + std::to_string(g), "nvml" + std::to_string(g)});
  }
  for (size_t n = 0; n < 4; ++n) CHECK(t->nics[n].numaNode == int(n / 2));
  auto dist = [&](size_t a, size_t b) { return t->pciDistance(t->gpus[a].busId, t->gpus[b].busId); };
  auto cls = [&](size_t a, size_t b) { return t->pciPathClass(t->gpus[a].busId, t->gpus[b].busId); };
  // Same switch: gpu -> downstream port -> switch <- downstream port <- gpu.
  CHECK(dist(0, 1) == 4);
  CHECK(cls(0, 1) == "PIX");
  // Other switch of the same socket: up to the host bridge and down.
  CHECK(dist(0, 2) == 8);
  CHECK(cls(0, 2) == "PHB");
  // Other socket.
  CHECK(dist(0, 4) == 12);
  CHECK(cls(0, 4) == "SYS");
  CHECK(dist(5, 5) == 0);
  // Each GPU's nearest NIC is the one on its own switch.
  for (size_t g = 0; g < 8; ++g) {
    int best = -1, bestDist = 1 << 30;
    for (size_t n = 0; n < 4; ++n) {
      int d = t->pciDistance(t->gpus[g].busId, t->nics[n].busId);
      if (d < bestDist) bestDist = d, best = int(n);
    }
    CHECK(best == int(g / 2));
    CHECK(bestDist == 4);
    CHECK(t->pciPathClass(t->gpus[g].busId, t->nics[size_t(best)].busId) == "PIX");
  }
  CHECK(t->nvlinks.empty());
}

TEST_CASE("DGX-2: 16 GPUs on two sockets, each with 6 NVLinks to NVSwitches", "[topology]") {
  std::unique_ptr<Topology> t = Topology::fromXml(fixture("hwloc/nvidiaDGX2.v2.xml"));
  REQUIRE(t->gpus.size() == 16);  // the 12 NVSwitches (PCI class 0680) are not GPUs
  CHECK(t->nics.empty());
  CHECK(t->numaCount() == 2);
  for (size_t g = 0; g < 16; ++g) CHECK(t->gpus[g].numaNode == int(g / 8));
  CHECK(t->nvlinkSource.find("NVLinkBandwidth") != std::string::npos);
  REQUIRE(t->nvlinks.size() == 96);
  std::vector<int> perGpu(16, 0);
  std::set<std::string> switches;
  for (const NvLinkInfo& l : t->nvlinks) {
    CHECK(l.peerGpu == -1);
    CHECK(l.bandwidthMBps == 25000);
    ++perGpu[size_t(l.gpu)];
    switches.insert(l.peerBusId);
  }
  for (int c : perGpu) CHECK(c == 6);
  CHECK(switches.size() == 12);
  // Two GPUs on one PCIe switch vs. across the sockets.
  CHECK(t->pciPathClass(t->gpus[0].busId, t->gpus[1].busId) == "PIX");
  CHECK(t->pciPathClass(t->gpus[0].busId, t->gpus[8].busId) == "SYS");
}

TEST_CASE("POWER8: GPU pairs joined by NVLink, and other real machines' counts", "[topology]") {
  std::unique_ptr<Topology> p8 = Topology::fromXml(fixture("hwloc/power8gpudistances.xml"));
  REQUIRE(p8->gpus.size() == 4);
  CHECK(p8->numaCount() == 2);
  REQUIRE(p8->nvlinks.size() == 4);
  for (const NvLinkInfo& l : p8->nvlinks) {
    CHECK(l.peerGpu == (l.gpu ^ 1));
    CHECK(l.bandwidthMBps == 40000);
    CHECK(p8->gpus[size_t(l.gpu)].numaNode == p8->gpus[size_t(l.peerGpu)].numaNode);
  }

  std::unique_ptr<Topology> big = Topology::fromXml(fixture("hwloc/96em64t-4n4d3ca2co-pci.xml"));
  CHECK(big->pus == 96);
  CHECK(big->numaCount() == 4);
  for (const NumaNodeInfo& n : big->numaNodes) CHECK(n.cores == 24);
  CHECK(big->gpus.empty());  // its only display device is a server VGA (ES1000)
  CHECK(big->nics.size() == 8);

  std::unique_ptr<Topology> two = Topology::fromXml(fixture("hwloc/24em64t-2n6c2t-pci.xml"));
  CHECK(two->cores == 12);
  CHECK(two->pus == 24);
  REQUIRE(two->gpus.size() == 3);
  REQUIRE(two->nics.size() == 3);
  // Two functions of one NIC sit behind one port.
  CHECK(two->pciDistance("0000:04:00.0", "0000:04:00.1") == 2);
  CHECK(two->pciPathClass("0000:04:00.0", "0000:04:00.1") == "PIX");
}

TEST_CASE("LOOM_TOPO_FILE replaces the machine, and a bad file is a clear error", "[topology]") {
  {
    EnvVar v("LOOM_TOPO_FILE", fixture("eight-gpu.xml"));
    std::unique_ptr<Topology> t = Topology::detect();
    CHECK(t->source == fixture("eight-gpu.xml"));
    CHECK(t->gpus.size() == 8);
  }
  {
    EnvVar v("LOOM_TOPO_FILE", "/nonexistent/topology.xml");
    try {
      Topology::detect();
      FAIL("a missing file loaded");
    } catch (const Error& e) {
      CHECK(e.code() == loomInvalidArgument);
      CHECK(std::string(e.what()).find("/nonexistent/topology.xml") != std::string::npos);
    }
  }
  {
    EnvVar v("LOOM_TOPO_FILE", fixture("make_fixtures.py"));  // not XML
    CHECK_THROWS_AS(Topology::detect(), Error);
  }
}

TEST_CASE("PCI classes: compute GPUs and NICs, not display adapters or switches", "[topology]") {
  CHECK(isGpuPciClass(0x0302, 0x10de, false));
  CHECK(isGpuPciClass(0x0300, 0x10de, false));
  CHECK(isGpuPciClass(0x0380, 0x1002, true));
  CHECK_FALSE(isGpuPciClass(0x0300, 0x1002, false));
  CHECK_FALSE(isGpuPciClass(0x0680, 0x10de, false));
  CHECK(isNicPciClass(0x0200, false));
  CHECK(isNicPciClass(0x0207, false));
  CHECK(isNicPciClass(0x0c06, true));
  CHECK_FALSE(isNicPciClass(0x0106, false));
  CHECK(normalizePciBusId("00000000:3B:00.0") == "0000:3b:00.0");
  CHECK(normalizePciBusId("nonsense") == "");
}

TEST_CASE("communicator topology: host groups, local ranks, NUMA link classes", "[topology]") {
  auto rt = [](int numa) {
    RankTopo t{};
    t.numaNode = numa;
    t.numaCount = 2;
    t.gpu = t.nic = -1;
    return t;
  };
  // Ranks 0, 2, 3 on host "a" (NUMA 0, 1, unknown), 1 and 4 on "b".
  CommTopology c({"a", "b", "a", "a", "b"}, {rt(0), rt(0), rt(1), rt(-1), rt(1)});
  REQUIRE(c.nranks() == 5);
  REQUIRE(c.nhosts() == 2);
  CHECK(c.hostRanks(0) == std::vector<int>{0, 2, 3});
  CHECK(c.hostRanks(1) == std::vector<int>{1, 4});
  CHECK(c.hostName(1) == "b");
  CHECK(c.hostOf(3) == 0);
  CHECK(c.hostOf(4) == 1);
  CHECK(c.localRank(3) == 2);
  CHECK(c.localSize(4) == 2);
  CHECK(c.numaOf(2) == 1);
  CHECK_FALSE(c.uniformHosts());
  CHECK(c.linkClass(0, 0) == LinkClass::Self);
  CHECK(c.linkClass(0, 1) == LinkClass::Network);
  CHECK(c.linkClass(0, 2) == LinkClass::ShmCrossNuma);
  CHECK(c.linkClass(0, 3) == LinkClass::ShmSameNuma);  // unknown NUMA: no cross-NUMA claim
  CHECK(std::string(linkClassName(LinkClass::ShmCrossNuma)) == "shm_xnuma");
  CommTopology even({"x", "x", "y", "y"}, {rt(0), rt(0), rt(0), rt(0)});
  CHECK(even.uniformHosts());
}

// LOOM_CPU_BIND's plan (src/topology/cpu_bind.h).
TEST_CASE("cpu binding: oversubscribed ranks share CPUs in contiguous blocks", "[topology][cpubind]") {
  const std::vector<int> two{0, 1};
  std::vector<std::vector<int>> got;
  for (int i = 0; i < 8; ++i) got.push_back(planCpuBind(CpuBindMode::Auto, i, 8, two, true).cpus);
  for (int i = 0; i < 8; ++i) {
    INFO("local rank " << i);
    CHECK(got[size_t(i)] == std::vector<int>{i < 4 ? 0 : 1});
  }
  // Uneven: 3 ranks on 2 CPUs, CPU numbers from the allowed set, not 0..n-1.
  const std::vector<int> odd{4, 9};
  CHECK(planCpuBind(CpuBindMode::Auto, 0, 3, odd, true).cpus == std::vector<int>{4});
  CHECK(planCpuBind(CpuBindMode::Auto, 1, 3, odd, true).cpus == std::vector<int>{4});
  CHECK(planCpuBind(CpuBindMode::Auto, 2, 3, odd, true).cpus == std::vector<int>{9});
  CHECK_THAT(planCpuBind(CpuBindMode::Auto, 2, 3, odd, true).why, loom_test::contains("oversubscribed"));
}

TEST_CASE("cpu binding: auto leaves enough CPUs, off and a launcher's binding alone, on splits the CPUs",
          "[topology][cpubind]") {
  const std::vector<int> four{0, 1, 2, 3};
  CpuBindPlan p = planCpuBind(CpuBindMode::Auto, 1, 4, four, true);
  CHECK(p.cpus.empty());
  CHECK_THAT(p.why, loom_test::contains("not bound"));
  p = planCpuBind(CpuBindMode::Off, 1, 8, four, true);
  CHECK(p.cpus.empty());
  CHECK_THAT(p.why, loom_test::contains("LOOM_CPU_BIND=off"));
  p = planCpuBind(CpuBindMode::Auto, 1, 8, four, false);
  CHECK(p.cpus.empty());
  CHECK_THAT(p.why, loom_test::contains("launcher"));
  p = planCpuBind(CpuBindMode::On, 1, 8, four, false);
  CHECK(p.cpus.empty());  // on keeps a launcher's binding too
  CHECK(planCpuBind(CpuBindMode::On, 0, 2, four, true).cpus == std::vector<int>({0, 1}));
  CHECK(planCpuBind(CpuBindMode::On, 1, 2, four, true).cpus == std::vector<int>({2, 3}));
  CHECK(planCpuBind(CpuBindMode::On, 2, 3, four, true).cpus == std::vector<int>({2, 3}));
  CHECK(planCpuBind(CpuBindMode::On, 0, 1, four, true).cpus == four);
  // Nonsense input binds nothing.
  CHECK(planCpuBind(CpuBindMode::On, 3, 2, four, true).cpus.empty());
  CHECK(planCpuBind(CpuBindMode::On, 0, 2, {}, true).cpus.empty());
}

TEST_CASE("cpu binding: mode parsing, CPU lists and set hashes", "[topology][cpubind]") {
  bool bad = true;
  CHECK(parseCpuBindMode("auto", &bad) == CpuBindMode::Auto);
  CHECK_FALSE(bad);
  CHECK(parseCpuBindMode("", &bad) == CpuBindMode::Auto);
  CHECK(parseCpuBindMode("on", &bad) == CpuBindMode::On);
  CHECK(parseCpuBindMode("0", &bad) == CpuBindMode::Off);
  CHECK_FALSE(bad);
  CHECK(parseCpuBindMode("cores", &bad) == CpuBindMode::Auto);
  CHECK(bad);
  CHECK(formatCpuList({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9");
  CHECK(formatCpuList({}) == "(none)");
  CHECK(cpuSetHash({0, 1}) == cpuSetHash({0, 1}));
  CHECK(cpuSetHash({0, 1}) != cpuSetHash({0}));
  CHECK(cpuSetHash({0, 1}) != cpuSetHash({1, 2}));
  // This process: what the kernel says it may use.
  std::vector<int> mine = allowedCpus();
  REQUIRE(!mine.empty());
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  CHECK(int(mine.size()) == CPU_COUNT(&set));
  for (int c : mine) CHECK(CPU_ISSET(c, &set));
}

TEST_CASE("waiting: a long yield marks the CPU shared, quick yields wear the mark off", "[cpubind]") {
  std::atomic<uint32_t> c{0};
  Backoff::noteYield(c, 500);  // quick, nothing marked: stays 0
  CHECK(c.load() == 0);
  Backoff::noteYield(c, Backoff::kSharedYieldNs + 1);
  CHECK(c.load() == Backoff::kContentionMemory);
  Backoff::noteYield(c, Backoff::kSharedYieldNs);  // not longer than the bound: quick
  CHECK(c.load() == Backoff::kContentionMemory / 2);
  // Quick yields in a row forget the mark within a few rounds.
  int rounds = 1;
  for (; c.load() != 0 && rounds < 64; ++rounds) Backoff::noteYield(c, 100);
  CHECK(c.load() == 0);
  CHECK(rounds <= 10);
  Backoff::noteYield(c, 100);
  Backoff::noteYield(c, 1000000);  // one long one restores the whole mark
  CHECK(c.load() == Backoff::kContentionMemory);
  // A Backoff spins only while its budget lasts, contended or not.
  Backoff none(0, false, &c);
  CHECK_FALSE(none.spin());
  Backoff some(1000, false, &c);
  CHECK(some.spin());
}
