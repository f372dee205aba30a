#include "src/topology/topology.h"

#include <hwloc.h>
#include <sched.h>

#include <cstdlib>
#include <cstring>
#include <map>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/topology/nvml.h"

namespace loom {

struct Topology::Impl {
  hwloc_topology_t topo = nullptr;
  bool isMachine = false;
  std::map<std::string, hwloc_obj_t> pciByBusId;
  ~Impl() {
    if (topo) hwloc_topology_destroy(topo);
  }
};

namespace {

std::string busIdOf(hwloc_obj_t pci) {
  char buf[32];
  snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", pci->attr->pcidev.domain, pci->attr->pcidev.bus,
           pci->attr->pcidev.dev, pci->attr->pcidev.func);
  return buf;
}

bool hasOsdevChild(hwloc_obj_t pci, std::initializer_list<hwloc_obj_osdev_type_t> types) {
  for (hwloc_obj_t c = pci->io_first_child; c; c = c->next_sibling)
    if (c->type == HWLOC_OBJ_OS_DEVICE)
      for (auto t : types)
        if (c->attr->osdev.type == t) return true;
  return false;
}

// Ancestors of obj, itself first, up to the root.
std::vector<hwloc_obj_t> pathToRoot(hwloc_obj_t obj) {
  std::vector<hwloc_obj_t> path;
  for (; obj; obj = obj->parent) path.push_back(obj);
  return path;
}

bool isHostBridge(hwloc_obj_t o) {
  return o->type == HWLOC_OBJ_BRIDGE && o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST;
}

}  // namespace

bool isGpuPciClass(uint16_t pciClass, uint16_t vendor, bool hasCoprocOsdev) {
  if (pciClass == 0x0302) return true;                         // 3D controller (compute GPUs)
  if ((pciClass >> 8) == 0x03 && vendor == 0x10de) return true; // NVIDIA display controller
  return (pciClass >> 8) == 0x03 && hasCoprocOsdev;            // cuda/opencl/rsmi device under it
}

bool isNicPciClass(uint16_t pciClass, bool hasNetOsdev) {
  return (pciClass >> 8) == 0x02 || hasNetOsdev;  // 0x02xx: network controllers (ethernet, IB)
}

Topology::~Topology() = default;

std::unique_ptr<Topology> Topology::detect() {
  // The environment as it is now: loom-topo and tests set LOOM_TOPO_FILE
  // just before they ask.
  configReload();
  const std::string file = config().topoFile;
  if (!file.empty()) return fromXml(file);
  std::unique_ptr<Topology> t(new Topology());
  t->impl_ = std::make_unique<Impl>();
  t->impl_->isMachine = true;
  t->source = "this machine";
  t->read();
  return t;
}

std::unique_ptr<Topology> Topology::fromXml(const std::string& path) {
  std::unique_ptr<Topology> t(new Topology());
  t->impl_ = std::make_unique<Impl>();
  t->source = path;
  t->read();
  return t;
}

void Topology::read() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) failErrno("hwloc_topology_init");
  impl_->topo = topo;
  // Keep GPUs, NICs and the bridges above them; drop the rest of the I/O tree.
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  hwloc_topology_set_type_filter(topo, HWLOC_OBJ_BRIDGE, HWLOC_TYPE_FILTER_KEEP_ALL);
  // On Linux hwloc reads the PCI tree from sysfs itself; its libpciaccess
  // plugin finds nothing more and leaks 1 KB per process, which would fail
  // every leak-checked (ASan) run of a program that makes a communicator.
  if (impl_->isMachine) hwloc_topology_set_components(topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, "pci");
  if (!impl_->isMachine) {
    if (hwloc_topology_set_xml(topo, source.c_str()) != 0)
      fail(loomInvalidArgument, "cannot read hwloc XML topology '%s': %s", source.c_str(), strerror(errno));
  }
  if (hwloc_topology_load(topo) != 0)
    fail(loomSystemError, "hwloc cannot load the topology of %s: %s", source.c_str(), strerror(errno));

  packages = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PACKAGE);
  cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
  int nNuma = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nNuma; ++i) {
    hwloc_obj_t n = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, unsigned(i));
    NumaNodeInfo info;
    info.osIndex = int(n->os_index);
    info.memoryBytes = n->attr->numanode.local_memory;
    info.cores = hwloc_get_nbobjs_inside_cpuset_by_type(topo, n->cpuset, HWLOC_OBJ_CORE);
    numaNodes.push_back(info);
  }
  if (numaNodes.empty()) numaNodes.push_back(NumaNodeInfo{0, cores, 0});

  for (hwloc_obj_t pci = hwloc_get_next_pcidev(topo, nullptr); pci; pci = hwloc_get_next_pcidev(topo, pci)) {
    uint16_t cls = pci->attr->pcidev.class_id, vendor = pci->attr->pcidev.vendor_id;
    bool coproc = hasOsdevChild(pci, {HWLOC_OBJ_OSDEV_COPROC});  // not DRM "card0" of a server VGA
    bool net = hasOsdevChild(pci, {HWLOC_OBJ_OSDEV_NETWORK, HWLOC_OBJ_OSDEV_OPENFABRICS});
    PciDeviceInfo d;
    if (isGpuPciClass(cls, vendor, coproc) && !(pci->subtype && strcmp(pci->subtype, "NVSwitch") == 0))
      d.kind = PciKind::Gpu;
    else if (isNicPciClass(cls, net))
      d.kind = PciKind::Nic;
    else {
      impl_->pciByBusId[busIdOf(pci)] = pci;
      continue;
    }
    d.busId = busIdOf(pci);
    d.vendor = vendor;
    d.device = pci->attr->pcidev.device_id;
    d.pciClass = cls;
    for (hwloc_obj_t c = pci->io_first_child; c; c = c->next_sibling)
      if (c->type == HWLOC_OBJ_OS_DEVICE && c->name) d.osNames.push_back(c->name);
    hwloc_obj_t local = hwloc_get_non_io_ancestor_obj(topo, pci);
    if (local && local->nodeset) {
      int first = hwloc_bitmap_first(local->nodeset);
      d.numaNode = first;
      d.numaLocal = first >= 0 && hwloc_bitmap_weight(local->nodeset) == 1;
    }
    // The package whose CPUs include all of the device's local CPUs (the
    // host bridge may hang from the machine when it has a single package).
    d.package = -1;
    for (int p = 0; local && local->cpuset && p < packages; ++p) {
      hwloc_obj_t pkg = hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, unsigned(p));
      if (hwloc_bitmap_isincluded(local->cpuset, pkg->cpuset)) d.package = p;
    }
    impl_->pciByBusId[d.busId] = pci;
    (d.kind == PciKind::Gpu ? gpus : nics).push_back(d);
  }

  auto gpuIndex = [&](const std::string& bus) {
    for (size_t i = 0; i < gpus.size(); ++i)
      if (gpus[i].busId == bus) return int(i);
    return -1;
  };
  // NVLink: NVML on the machine; an XML file may carry hwloc's NVLinkBandwidth.
  if (impl_->isMachine) {
    std::vector<NvmlLink> links;
    int nvmlGpus = 0;
    std::string why;
    if (nvmlNvLinks(&links, &nvmlGpus, &why)) {
      nvlinkSource = strf("nvml (%d GPUs)", nvmlGpus);
      for (const NvmlLink& l : links) {
        int g = gpuIndex(l.gpuBusId);
        if (g < 0) continue;
        nvlinks.push_back(NvLinkInfo{g, gpuIndex(l.remoteBusId), l.remoteBusId, l.links, 0});
      }
    } else {
      nvlinkSource = why;
    }
  } else {
    nvlinkSource = "none in the XML file";
  }
  hwloc_distances_s* dist = nullptr;
  unsigned nr = 1;
  if (nvlinks.empty() && hwloc_distances_get_by_name(topo, "NVLinkBandwidth", &nr, &dist, 0) == 0 && nr > 0) {
    nvlinkSource = "hwloc distances (NVLinkBandwidth)";
    auto pciOf = [](hwloc_obj_t o) {
      while (o && o->type != HWLOC_OBJ_PCI_DEVICE) o = o->parent;
      return o;
    };
    for (unsigned i = 0; i < dist->nbobjs; ++i) {
      hwloc_obj_t a = pciOf(dist->objs[i]);
      int g = a ? gpuIndex(busIdOf(a)) : -1;
      if (g < 0) continue;
      for (unsigned j = 0; j < dist->nbobjs; ++j) {
        uint64_t bw = dist->values[i * dist->nbobjs + j];
        hwloc_obj_t b = pciOf(dist->objs[j]);
        if (i == j || bw == 0 || !b) continue;
        nvlinks.push_back(NvLinkInfo{g, gpuIndex(busIdOf(b)), busIdOf(b), 0, bw});
      }
    }
    hwloc_distances_release(topo, dist);
  }
}

int Topology::pciDistance(const std::string& busA, const std::string& busB) const {
  auto ia = impl_->pciByBusId.find(busA), ib = impl_->pciByBusId.find(busB);
  if (ia == impl_->pciByBusId.end() || ib == impl_->pciByBusId.end()) return -1;
  std::vector<hwloc_obj_t> pa = pathToRoot(ia->second), pb = pathToRoot(ib->second);
  for (size_t i = 0; i < pa.size(); ++i)
    for (size_t j = 0; j < pb.size(); ++j)
      if (pa[i] == pb[j]) return int(i + j);
  return -1;
}

std::string Topology::pciPathClass(const std::string& busA, const std::string& busB) const {
  auto ia = impl_->pciByBusId.find(busA), ib = impl_->pciByBusId.find(busB);
  if (ia == impl_->pciByBusId.end() || ib == impl_->pciByBusId.end()) return "";
  hwloc_obj_t common = hwloc_get_common_ancestor_obj(impl_->topo, ia->second, ib->second);
  if (common->type == HWLOC_OBJ_BRIDGE)
    return isHostBridge(common) ? "PHB" : (pciDistance(busA, busB) <= 4 ? "PIX" : "PXB");
  if (common->type == HWLOC_OBJ_PCI_DEVICE) return "PIX";  // functions of one device
  // The common ancestor is a CPU-side object: same NUMA node or across sockets.
  hwloc_obj_t la = hwloc_get_non_io_ancestor_obj(impl_->topo, ia->second);
  hwloc_obj_t lb = hwloc_get_non_io_ancestor_obj(impl_->topo, ib->second);
  return hwloc_bitmap_isequal(la->nodeset, lb->nodeset) ? "PHB" : "SYS";
}

int Topology::numaOfCpuset(const std::string& cpuset) const {
  hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
  hwloc_bitmap_t nodes = hwloc_bitmap_alloc();
  int node = -1;
  if (hwloc_bitmap_sscanf(cpus, cpuset.c_str()) == 0 && !hwloc_bitmap_iszero(cpus)) {
    hwloc_cpuset_to_nodeset(impl_->topo, cpus, nodes);
    if (hwloc_bitmap_weight(nodes) == 1) node = hwloc_bitmap_first(nodes);
  }
  hwloc_bitmap_free(cpus);
  hwloc_bitmap_free(nodes);
  return node;
}

int Topology::numaOfThisProcess() const {
  if (numaNodes.size() == 1) return numaNodes[0].osIndex;
  // The kernel's affinity mask, looked up in this topology (for a loaded XML
  // file: as if this process ran on those CPU numbers of that machine).
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof mask, &mask) != 0) return -1;
  hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mask)) hwloc_bitmap_set(cpus, unsigned(c));
  char* s = nullptr;
  hwloc_bitmap_asprintf(&s, cpus);
  int node = s ? numaOfCpuset(s) : -1;
  free(s);
  hwloc_bitmap_free(cpus);
  return node;
}

}  // namespace loom
