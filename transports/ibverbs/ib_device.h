// The RDMA device a communicator uses: which device, port and GID
// (LOOM_IB_HCA, LOOM_IB_GID_INDEX, else the first active port's RoCEv2
// IPv4 GID or, on InfiniBand, its LID), opened with one protection domain.
#pragma once
#include <infiniband/verbs.h>

#include <memory>
#include <string>

#include "transports/ibverbs/ib_reg_cache.h"

namespace loom {

struct IbDevice {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  std::string name;
  int port = 1;
  int gidIndex = 0;
  ibv_gid gid{};
  uint16_t lid = 0;
  uint8_t linkLayer = 2;  // 1: InfiniBand, 2: Ethernet
  ibv_mtu mtu = IBV_MTU_1024;
  // On-demand paging for RC writes (both ends' roles): cached registrations
  // of user memory then stay coherent with the page tables.
  bool onDemand = false;
  // User-buffer registrations (ib_reg_cache.h), made in this PD.
  std::unique_ptr<Registrar> registrar;
  std::unique_ptr<RegCache> regCache;
  ~IbDevice();
  // Reads the device's async events (never blocks); throws loomRemoteError
  // for the ones that break every connection (port down, device fatal).
  void checkAsyncEvents(int rank);
};

// The MR behind a cache entry.
inline ibv_mr* entryMr(const RegCache::Entry* e) { return static_cast<ibv_mr*>(e->handle); }

// Opens the device LOOM_IB_HCA names (or the first one with an active
// port); nullptr and *why when there is none.
std::shared_ptr<IbDevice> ibOpenDevice(std::string* why);

}  // namespace loom
