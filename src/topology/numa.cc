#include "src/topology/numa.h"

#include <dirent.h>
#include <hwloc.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "src/core/error.h"

namespace loom {

namespace {

// The machine's topology, loaded once per process without I/O devices
// (placement only needs cores and NUMA nodes).
hwloc_topology_t machineTopology() {
  static std::once_flag once;
  static hwloc_topology_t topo = nullptr;
  std::call_once(once, [] {
    hwloc_topology_t t;
    if (hwloc_topology_init(&t) != 0) return;
    hwloc_topology_set_io_types_filter(t, HWLOC_TYPE_FILTER_KEEP_NONE);
    if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      return;
    }
    topo = t;
  });
  return topo;
}

// Loading a topology costs ~100 ms here; the kernel's node list answers
// "is there more than one node?" for free.
bool sysfsSaysSingleNode() {
  DIR* d = opendir("/sys/devices/system/node");
  if (!d) return false;
  int nodes = 0;
  while (dirent* e = readdir(d))
    if (strncmp(e->d_name, "node", 4) == 0 && isdigit(static_cast<unsigned char>(e->d_name[4]))) ++nodes;
  closedir(d);
  return nodes == 1;
}

}  // namespace

int numaNodeCount() {
  if (sysfsSaysSingleNode()) return 1;
  hwloc_topology_t t = machineTopology();
  if (!t) return 1;
  int n = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  return n > 0 ? n : 1;
}

std::string bindToLocalNumaNode(void* addr, size_t len) {
  if (numaNodeCount() < 2) return "one NUMA node: nothing to bind";
  hwloc_topology_t t = machineTopology();
  if (!t) return "hwloc could not load the topology: memory left unbound";
  hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
  hwloc_bitmap_t nodes = hwloc_bitmap_alloc();
  std::string result;
  if (hwloc_get_cpubind(t, cpus, HWLOC_CPUBIND_THREAD) != 0 || hwloc_bitmap_iszero(cpus)) {
    result = "cannot read this thread's CPU binding: memory left unbound";
  } else {
    hwloc_cpuset_to_nodeset(t, cpus, nodes);
    char* str = nullptr;
    hwloc_bitmap_asprintf(&str, nodes);
    int w = hwloc_bitmap_weight(nodes);
    if (w <= 0 || w == numaNodeCount())
      result = strf("this rank may run on every NUMA node (%s): memory left unbound (bind ranks to cores to place it)",
                    str ? str : "?");
    else if (hwloc_set_area_membind(t, addr, len, nodes, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0)
      result = strf("binding to NUMA nodeset %s failed: memory left unbound", str ? str : "?");
    else
      result = strf("bound to NUMA nodeset %s", str ? str : "?");
    free(str);
  }
  hwloc_bitmap_free(cpus);
  hwloc_bitmap_free(nodes);
  return result;
}

}  // namespace loom
