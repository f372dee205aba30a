// loom-topo: what loom sees.  Alone it prints this machine's topology (or
// LOOM_TOPO_FILE's); under loom-run (or any launcher loomCommInitFromEnv
// understands) rank 0 also prints the communicator: each rank's host, NUMA
// node, GPU and NIC, and the host groups.  --env lists every LOOM_* variable,
// --algorithms the algorithm registry (docs/algorithms.md's table), --json prints the
// same facts for machines, --calibrate measures the links and writes a
// tuning file.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "algorithms/registry.h"
#include "loom.h"
#include "src/core/comm.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/topology/comm_topology.h"
#include "src/topology/topology.h"
#include "tools/topo_calibrate.h"

using namespace loom;

namespace {

const char kUsage[] =
    "usage: loom-topo [--json] [--env] [--algorithms] [--calibrate [--out FILE] [--bytes N] [--iters N]]\n"
    "\n"
    "Prints the topology loom detects: this machine (or the hwloc XML file named by\n"
    "LOOM_TOPO_FILE), and, when started by a launcher (loom-run -n N loom-topo), the\n"
    "communicator's ranks, hosts and NUMA nodes (printed by rank 0).\n"
    "  --json         machine-readable output (one JSON object on stdout)\n"
    "  --env          list every LOOM_* variable: name, type, default, meaning\n"
    "  --algorithms   the algorithm registry as a markdown table (the names\n"
    "                 LOOM_ALGO accepts, what each serves, how, its cost)\n"
    "  --calibrate    (under a launcher) measure latency and bandwidth of each link\n"
    "                 class among the ranks (shm, shm_xnuma, tcp) and the host\n"
    "                 reduction, and write a tuning file for LOOM_TUNING_FILE\n"
    "  --out FILE     where --calibrate writes (default loom-tuning.conf)\n"
    "  --bytes N      --calibrate's large-transfer size (default 16M)\n"
    "  --iters N      --calibrate's 8-byte round trips per link (default 200)\n"
    "  -h, --help     this text\n";

struct Options {
  bool json = false, env = false, algorithms = false, calibrate = false;
  std::string out = "loom-tuning.conf";
  CalibrateOptions cal;
};

[[noreturn]] void usageError(const std::string& msg) {
  fprintf(stderr, "loom-topo: %s\n%s", msg.c_str(), kUsage);
  exit(2);
}

size_t parseSize(const char* flag, const char* v, size_t lo, size_t hi) {
  char* end = nullptr;
  unsigned long long x = strtoull(v, &end, 10);
  if (end && (*end == 'K' || *end == 'k')) x <<= 10, ++end;
  else if (end && (*end == 'M' || *end == 'm')) x <<= 20, ++end;
  if (!end || end == v || *end || x < lo || x > hi)
    usageError(strf("%s: '%s' is not a number in [%zu, %zu]", flag, v, lo, hi));
  return size_t(x);
}

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "--json") o.json = true;
    else if (a == "--env") o.env = true;
    else if (a == "--algorithms") o.algorithms = true;
    else if (a == "--calibrate") o.calibrate = true;
    else if (a == "--out") o.out = value();
    else if (a == "--bytes") o.cal.bandwidthBytes = parseSize("--bytes", value(), 1024, size_t(1) << 32);
    else if (a == "--iters") o.cal.latencyIters = int(parseSize("--iters", value(), 1, 1000000));
    else if (a == "-h" || a == "--help") {
      fputs(kUsage, stdout);
      exit(0);
    } else usageError("unknown argument '" + a + "'");
  }
  return o;
}

std::string jsonStr(const std::string& s) {
  std::string r = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') r += '\\', r += char(c);
    else if (c < 0x20) r += strf("\\u%04x", c);
    else r += char(c);
  }
  return r + "\"";
}

bool underLauncher() {
  for (const char* v : {"LOOM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    if (getenv(v) && *getenv(v)) return true;
  return false;
}

// ---- --env ----

void printEnv(bool json) {
  const auto& table = configTable();
  if (json) {
    printf("{\"variables\": [\n");
    for (size_t i = 0; i < table.size(); ++i)
      printf("  {\"name\": %s, \"type\": %s, \"default\": %s, \"meaning\": %s}%s\n",
             jsonStr(table[i].name).c_str(), jsonStr(table[i].type).c_str(),
             jsonStr(table[i].defaultValue).c_str(), jsonStr(table[i].meaning).c_str(),
             i + 1 < table.size() ? "," : "");
    printf("]}\n");
    return;
  }
  printf("%-28s %-22s %-22s %s\n", "variable", "type", "default", "meaning");
  for (const ConfigVar& v : table) {
    const char* set = getenv(v.name);
    printf("%-28s %-22s %-22s %s%s\n", v.name, v.type, v.defaultValue, v.meaning,
           set ? strf(" [set: %s]", set).c_str() : "");
  }
}

// ---- the machine ----

std::string pciIds(const PciDeviceInfo& d) {
  return strf("%04x:%04x class %04x", d.vendor, d.device, d.pciClass);
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

void printMachineText(const Topology& t) {
  printf("machine: %s\n", t.source.c_str());
  printf("  %d packages, %d cores, %d PUs, %d NUMA nodes\n", t.packages, t.cores, t.pus, t.numaCount());
  for (const NumaNodeInfo& n : t.numaNodes)
    printf("  NUMA node %d: %d cores, %.1f GiB\n", n.osIndex, n.cores, double(n.memoryBytes) / (1 << 30));
  std::vector<std::pair<std::string, const PciDeviceInfo*>> devs;
  for (size_t i = 0; i < t.gpus.size(); ++i) devs.push_back({strf("gpu%zu", i), &t.gpus[i]});
  for (size_t i = 0; i < t.nics.size(); ++i) devs.push_back({strf("nic%zu", i), &t.nics[i]});
  printf("  %zu GPUs, %zu NICs\n", t.gpus.size(), t.nics.size());
  for (const auto& d : devs)
    printf("    %-6s %s  %s  NUMA %d%s  package %d  [%s]\n", d.first.c_str(), d.second->busId.c_str(),
           pciIds(*d.second).c_str(), d.second->numaNode, d.second->numaLocal ? "" : " (not local to one node)",
           d.second->package, joined(d.second->osNames).c_str());
  if (devs.size() > 1) {
    printf("  PCI distance (edges in the hwloc tree) and path class:\n  %-8s", "");
    for (const auto& d : devs) printf("%-9s", d.first.c_str());
    printf("\n");
    for (const auto& a : devs) {
      printf("  %-8s", a.first.c_str());
      for (const auto& b : devs)
        printf("%-9s", a.second == b.second ? "-"
                                            : strf("%d %s", t.pciDistance(a.second->busId, b.second->busId),
                                                   t.pciPathClass(a.second->busId, b.second->busId).c_str())
                                                  .c_str());
      printf("\n");
    }
  }
  printf("  NVLink: %s", t.nvlinkSource.c_str());
  if (t.nvlinks.empty()) printf(", no links\n");
  else printf(", %zu connections\n", t.nvlinks.size());
  for (const NvLinkInfo& l : t.nvlinks)
    printf("    gpu%d -> %s%s%s\n", l.gpu,
           l.peerGpu >= 0 ? strf("gpu%d", l.peerGpu).c_str() : strf("switch %s", l.peerBusId.c_str()).c_str(),
           l.links ? strf("  %d links", l.links).c_str() : "",
           l.bandwidthMBps ? strf("  %llu MB/s", (unsigned long long)l.bandwidthMBps).c_str() : "");
}

std::string deviceJson(const PciDeviceInfo& d) {
  std::string names;
  for (const std::string& n : d.osNames) names += (names.empty() ? "" : ", ") + jsonStr(n);
  return strf("{\"busId\": %s, \"vendor\": %u, \"device\": %u, \"class\": %u, \"numa\": %d, \"numaLocal\": %s, "
              "\"package\": %d, \"osNames\": [%s]}",
              jsonStr(d.busId).c_str(), d.vendor, d.device, d.pciClass, d.numaNode, d.numaLocal ? "true" : "false",
              d.package, names.c_str());
}

std::string machineJson(const Topology& t) {
  std::string s = strf("{\"source\": %s, \"packages\": %d, \"cores\": %d, \"pus\": %d, \"numaNodes\": [",
                       jsonStr(t.source).c_str(), t.packages, t.cores, t.pus);
  for (size_t i = 0; i < t.numaNodes.size(); ++i)
    s += strf("%s{\"os\": %d, \"cores\": %d, \"memoryBytes\": %llu}", i ? ", " : "", t.numaNodes[i].osIndex,
              t.numaNodes[i].cores, (unsigned long long)t.numaNodes[i].memoryBytes);
  s += "], \"gpus\": [";
  for (size_t i = 0; i < t.gpus.size(); ++i) s += (i ? ", " : "") + deviceJson(t.gpus[i]);
  s += "], \"nics\": [";
  for (size_t i = 0; i < t.nics.size(); ++i) s += (i ? ", " : "") + deviceJson(t.nics[i]);
  s += "], \"pciDistance\": [";
  std::vector<const PciDeviceInfo*> devs;
  for (const auto& d : t.gpus) devs.push_back(&d);
  for (const auto& d : t.nics) devs.push_back(&d);
  bool first = true;
  for (size_t i = 0; i < devs.size(); ++i)
    for (size_t j = i + 1; j < devs.size(); ++j) {
      s += strf("%s{\"a\": %s, \"b\": %s, \"hops\": %d, \"class\": %s}", first ? "" : ", ",
                jsonStr(devs[i]->busId).c_str(), jsonStr(devs[j]->busId).c_str(),
                t.pciDistance(devs[i]->busId, devs[j]->busId),
                jsonStr(t.pciPathClass(devs[i]->busId, devs[j]->busId)).c_str());
      first = false;
    }
  s += strf("], \"nvlinkSource\": %s, \"nvlinks\": [", jsonStr(t.nvlinkSource).c_str());
  for (size_t i = 0; i < t.nvlinks.size(); ++i) {
    const NvLinkInfo& l = t.nvlinks[i];
    s += strf("%s{\"gpu\": %d, \"peerGpu\": %d, \"peerBusId\": %s, \"links\": %d, \"bandwidthMBps\": %llu}",
              i ? ", " : "", l.gpu, l.peerGpu, jsonStr(l.peerBusId).c_str(), l.links,
              (unsigned long long)l.bandwidthMBps);
  }
  return s + "]}";
}

// ---- the communicator ----

void printCommText(loomComm_t comm) {
  const CommTopology& t = comm->topology();
  printf("communicator: %d ranks on %d hosts%s\n", t.nranks(), t.nhosts(),
         t.uniformHosts() ? "" : " (hosts run different rank counts)");
  printf("  %-5s %-5s %-7s %-5s %-6s %-5s %-5s %-10s %-10s %s\n", "rank", "host", "local", "numa", "cores", "gpus",
         "nics", "nic", "class", "transport (from rank 0)");
  for (int r = 0; r < t.nranks(); ++r) {
    const RankTopo& rt = t.rank(r);
    printf("  %-5d %-5d %-7s %-5s %-6d %-5d %-5d %-10s %-10s %s\n", r, t.hostOf(r),
           strf("%d/%d", t.localRank(r), t.localSize(r)).c_str(),
           rt.numaNode >= 0 ? strf("%d/%d", rt.numaNode, rt.numaCount).c_str() : strf("?/%d", rt.numaCount).c_str(),
           rt.coreCount, rt.gpuCount, rt.nicCount, rt.nicName[0] ? rt.nicName : "?",
           linkClassName(t.linkClass(0, r)), comm->transportTo(r));
  }
  printf("host groups:\n");
  for (int h = 0; h < t.nhosts(); ++h) {
    printf("  host %d (%s): ranks", h, t.hostName(h).c_str());
    for (int r : t.hostRanks(h)) printf(" %d", r);
    printf("\n");
  }
}

std::string commJson(loomComm_t comm) {
  const CommTopology& t = comm->topology();
  std::string s = strf("{\"nranks\": %d, \"nhosts\": %d, \"ranks\": [", t.nranks(), t.nhosts());
  for (int r = 0; r < t.nranks(); ++r) {
    const RankTopo& rt = t.rank(r);
    s += strf("%s{\"rank\": %d, \"host\": %d, \"localRank\": %d, \"numa\": %d, \"numaCount\": %d, \"cores\": %d, "
              "\"pus\": %d, \"gpus\": %d, \"nics\": %d, \"gpu\": %d, \"nic\": %d, \"nicName\": %s, "
              "\"classFromRank0\": %s, \"transportFromRank0\": %s}",
              r ? ", " : "", r, t.hostOf(r), t.localRank(r), rt.numaNode, rt.numaCount, rt.coreCount, rt.puCount,
              rt.gpuCount, rt.nicCount, rt.gpu, rt.nic, jsonStr(rt.nicName).c_str(),
              jsonStr(linkClassName(t.linkClass(0, r))).c_str(), jsonStr(comm->transportTo(r)).c_str());
  }
  s += "], \"hosts\": [";
  for (int h = 0; h < t.nhosts(); ++h) {
    s += strf("%s{\"id\": %s, \"ranks\": [", h ? ", " : "", jsonStr(t.hostName(h)).c_str());
    for (size_t i = 0; i < t.hostRanks(h).size(); ++i) s += strf("%s%d", i ? ", " : "", t.hostRanks(h)[i]);
    s += "]}";
  }
  return s + "]}";
}

// The cost model's view of this communicator: per collective and size, every
// eligible algorithm's predicted time (us) and the tuner's choice (which all
// ranks adopt from rank 0; LOOM_ALGO, when set, still overrides it per call).
void printPredictions(loomComm_t comm, bool json, std::string* jsonOut) {
  const Tuner& tuner = comm->tuner();
  auto name = [](Algorithm a, Algorithm inner) { return choiceName(a, inner); };
  std::string js = "{\"parameters\": " + jsonStr(tuner.params().source) + ", \"collectives\": [";
  if (!json) {
    const CostParams& p = tuner.params();
    printf("\ncost model (%s): ", p.source.c_str());
    for (int c = 0; c < kCostLinks; ++c)
      printf("%s alpha %.1f us beta %.2f GB/s; ", costLinkName(CostLink(c)), p.link[c].alphaUs, p.link[c].betaGBps);
    printf("reduce %.1f GB/s\n", p.reduceGBps);
  }
  bool firstColl = true;
  for (Collective coll : kTunedCollectives) {
    if (!json) printf("\n%s: predicted time (us) per algorithm, * = chosen\n", collectiveName(coll));
    js += strf("%s{\"collective\": \"%s\", \"rows\": [", firstColl ? "" : ", ", collectiveName(coll));
    firstColl = false;
    bool firstRow = true;
    for (int b = 3; b <= 30; b += 3) {
      size_t bytes = size_t(1) << b;
      const Estimate& chosen = tuner.decided(coll, b);
      std::string line = strf("%12zu ", bytes), row;
      for (const Estimate& e : tuner.estimates(coll, bytes)) {
        if (e.us < 0) continue;
        bool star = e.algo == chosen.algo && (e.algo != Algorithm::Hierarchical || e.inner == chosen.inner);
        line += strf(" %s%s=%.1f", star ? "*" : "", name(e.algo, e.inner).c_str(), e.us);
        row += strf("%s\"%s\": %.3f", row.empty() ? "" : ", ", name(e.algo, e.inner).c_str(), e.us);
      }
      if (!json) printf("%s\n", line.c_str());
      js += strf("%s{\"bytes\": %zu, \"choice\": \"%s\", \"us\": {%s}}", firstRow ? "" : ", ", bytes,
                 name(chosen.algo, chosen.inner).c_str(), row.c_str());
      firstRow = false;
    }
    js += "]}";
  }
  js += "]}";
  if (json) *jsonOut = js;
}

int run(const Options& o) {
  if (o.env) {
    printEnv(o.json);
    return 0;
  }
  if (o.algorithms) {
    fputs(algorithmTableMarkdown().c_str(), stdout);
    return 0;
  }
  if (o.calibrate && !underLauncher()) {
    fprintf(stderr, "loom-topo: --calibrate measures links between ranks: start it with a launcher, e.g.\n"
                    "  loom-run -n 2 loom-topo --calibrate            (shm)\n"
                    "  loom-run -n 4 --hosts 2 loom-topo --calibrate  (shm and tcp)\n");
    return 2;
  }
  std::unique_ptr<Topology> machine;
  try {
    machine = Topology::detect();
  } catch (const Error& e) {
    fprintf(stderr, "loom-topo: %s\n", e.what());
    return 1;
  }
  if (!underLauncher()) {
    if (o.json) printf("{\"machine\": %s}\n", machineJson(*machine).c_str());
    else printMachineText(*machine);
    return 0;
  }
  loomComm_t comm = nullptr;
  if (loomCommInitFromEnv(&comm) != loomSuccess) {
    fprintf(stderr, "loom-topo: cannot join the communicator: %s\n", loomGetLastError(nullptr));
    return 1;
  }
  int rc = 0;
  try {
    Calibration cal;
    if (o.calibrate) cal = calibrate(comm, o.cal);
    if (comm->rank() == 0) {
      std::string predictions;
      if (o.json) {
        printPredictions(comm, true, &predictions);
        printf("{\"machine\": %s,\n \"communicator\": %s,\n \"predictions\": %s", machineJson(*machine).c_str(),
               commJson(comm).c_str(), predictions.c_str());
      } else {
        printMachineText(*machine);
        printCommText(comm);
        printPredictions(comm, false, nullptr);
      }
      if (o.calibrate) {
        std::string text = tuningFileText(cal, comm);
        std::ofstream f(o.out);
        f << text;
        f.close();
        if (!f) throw Error(loomSystemError, "cannot write the tuning file " + o.out);
        if (o.json) {
          printf(",\n \"calibration\": {\"file\": %s, \"links\": [", jsonStr(o.out).c_str());
          for (size_t i = 0; i < cal.links.size(); ++i)
            printf("%s{\"key\": %s, \"peer\": %d, \"alpha_us\": %.3f, \"beta_GBps\": %.3f}", i ? ", " : "",
                   jsonStr(cal.links[i].key).c_str(), cal.links[i].peer, cal.links[i].alphaUs,
                   cal.links[i].betaGBps);
          printf("], \"reduce_GBps\": %.3f}", cal.reduceGBps);
        } else {
          printf("calibration (written to %s):\n%s", o.out.c_str(), text.c_str());
        }
      }
      if (o.json) printf("}\n");
    }
  } catch (const Error& e) {
    fprintf(stderr, "loom-topo: %s\n", e.what());
    rc = 1;
  }
  if (rc) loomCommAbort(comm);
  else loomCommDestroy(comm);
  return rc;
}

}  // namespace

int main(int argc, char** argv) { return run(parseArgs(argc, argv)); }
