// What one machine looks like to loom: NUMA nodes, packages, cores, and the
// PCI GPUs and NICs with their NUMA affinity and PCI distance, read with
// hwloc from the machine or from an hwloc XML file (LOOM_TOPO_FILE); NVLink
// peers from NVML (loaded with dlopen when present) or, for XML files, from
// hwloc's "NVLinkBandwidth" distance matrix.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom {

struct NumaNodeInfo {
  int osIndex = -1;
  int cores = 0;        // cores whose CPUs belong to this node
  uint64_t memoryBytes = 0;
};

enum class PciKind { Gpu, Nic };

struct PciDeviceInfo {
  PciKind kind = PciKind::Gpu;
  std::string busId;          // "0000:3b:00.0"
  uint16_t vendor = 0, device = 0;
  uint16_t pciClass = 0;      // class + subclass, e.g. 0x0302 (3D controller), 0x0200 (ethernet)
  std::vector<std::string> osNames;  // what the OS calls it: "eth0", "mlx5_0", "cuda0", "nvml0"
  int numaNode = -1;          // OS index of the nearest NUMA node (-1: unknown)
  bool numaLocal = false;     // true when exactly one NUMA node is local to it
  int package = -1;           // logical index of its package (-1: unknown)
};

// One NVLink connection of a GPU: to another GPU, or to a switch (NVSwitch).
struct NvLinkInfo {
  int gpu = -1;               // index into Topology::gpus
  int peerGpu = -1;           // index into Topology::gpus, -1 when the peer is not a GPU
  std::string peerBusId;      // PCI bus id of the peer (GPU or switch)
  int links = 0;              // link count (NVML); 0 when only the bandwidth is known
  uint64_t bandwidthMBps = 0; // from hwloc's NVLinkBandwidth matrix; 0 when unknown
};

class Topology {
 public:
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  // The machine, or the hwloc XML named by LOOM_TOPO_FILE.  Throws loom::Error
  // (loomSystemError) when hwloc cannot load it.
  static std::unique_ptr<Topology> detect();
  // An hwloc XML file.  Throws loom::Error when it cannot be loaded.
  static std::unique_ptr<Topology> fromXml(const std::string& path);

  std::string source;         // "this machine" or the XML path
  int packages = 0, cores = 0, pus = 0;
  std::vector<NumaNodeInfo> numaNodes;  // at least one entry
  std::vector<PciDeviceInfo> gpus, nics;
  std::vector<NvLinkInfo> nvlinks;
  std::string nvlinkSource;   // "nvml", "hwloc distances", or why there is none

  int numaCount() const { return int(numaNodes.size()); }

  // Edges in hwloc's object tree between two PCI devices (each bridge or
  // switch port on the way counts one; two functions behind one port are 2
  // apart).  -1 when a bus id is unknown.
  int pciDistance(const std::string& busA, const std::string& busB) const;
  // NCCL-style class of that path: "PIX" (one switch between them: at most 4
  // edges below a non-host bridge),
  // "PXB" (several bridges, no host bridge), "PHB" (through a host bridge,
  // same NUMA node), "SYS" (across the inter-socket link), "" when unknown.
  std::string pciPathClass(const std::string& busA, const std::string& busB) const;

  // OS index of the NUMA node holding every CPU this process may run on
  // (sched_getaffinity), -1 when they span several.  For a loaded XML file the
  // CPU numbers are looked up in that machine (tests pose with taskset).
  int numaOfThisProcess() const;
  // NUMA node of a CPU set given as hwloc's bitmap string ("0x0000000f").
  int numaOfCpuset(const std::string& cpuset) const;

 private:
  Topology() = default;
  void read();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The PCI class of a device that loom treats as a GPU or a NIC, by class,
// vendor and the OS devices hwloc found under it.
bool isGpuPciClass(uint16_t pciClass, uint16_t vendor, bool hasCoprocOsdev);
bool isNicPciClass(uint16_t pciClass, bool hasNetOsdev);

}  // namespace loom
