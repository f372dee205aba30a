// Device, port and GID choice for the ibverbs transport.
#include "transports/ibverbs/ib_device.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"

namespace loom {

IbDevice::~IbDevice() {
  regCache.reset();  // its MRs before the PD
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
}

void IbDevice::checkAsyncEvents(int rank) {
  ibv_async_event ev;
  while (ibv_get_async_event(ctx, &ev) == 0) {
    ibv_event_type t = ev.event_type;
    ibv_ack_async_event(&ev);
    if (t == IBV_EVENT_DEVICE_FATAL || t == IBV_EVENT_PORT_ERR)
      fail(loomRemoteError, "rank %d: RDMA device %s port %d: %s", rank, name.c_str(), port, ibv_event_type_str(t));
    LOOM_WARN("NET", "rank %d: RDMA device %s: async event %s", rank, name.c_str(), ibv_event_type_str(t));
  }
}

namespace {

class IbRegistrar : public Registrar {
 public:
  explicit IbRegistrar(IbDevice& d) : d_(d) {}
  void* reg(uintptr_t addr, size_t bytes, unsigned access, bool onDemand) override {
    int acc = int(access) | (onDemand ? IBV_ACCESS_ON_DEMAND : 0);
    ibv_mr* mr = ibv_reg_mr(d_.pd, reinterpret_cast<void*>(addr), bytes, acc);
    if (!mr)
      fail(loomSystemError, "ibv_reg_mr of %zu bytes at %p on %s failed: %s%s", bytes, reinterpret_cast<void*>(addr),
           d_.name.c_str(), strerror(errno), errno == ENOMEM ? " (locked-memory limit? see ulimit -l)" : "");
    return mr;
  }
  void dereg(void* handle) override { ibv_dereg_mr(static_cast<ibv_mr*>(handle)); }
  bool onDemand() const override { return d_.onDemand; }

 private:
  IbDevice& d_;
};

// RC on-demand paging for both roles of an RDMA WRITE: the requester reads
// local memory (SEND capability) and the responder writes it (WRITE).
bool rcOnDemand(ibv_context* ctx) {
  ibv_device_attr_ex ax{};
  if (ibv_query_device_ex(ctx, nullptr, &ax)) return false;
  uint32_t need = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_WRITE;
  return (ax.odp_caps.general_caps & IBV_ODP_SUPPORT) && (ax.odp_caps.per_transport_caps.rc_odp_caps & need) == need;
}

std::string readSys(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

bool isIpv4Mapped(const ibv_gid& g) {
  static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  return memcmp(g.raw, prefix, 12) == 0;
}

bool isUnsetOrLinkLocal(const ibv_gid& g) {
  static const uint8_t zero[16] = {};
  return memcmp(g.raw, zero, 16) == 0 || (g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80);
}

// The GID index to use on an Ethernet port: the first RoCE v2 one that is an
// IPv4-mapped address (the one routable over the IPv4 UDP rxe/NICs use),
// else the first RoCE v2 one that is set and not link-local (GID 0, link-local,
// hangs on rxe: issue 14).  -1: none.
int autoGidIndex(ibv_context* ctx, const std::string& dev, int port, int tableLen) {
  int fallback = -1;
  for (int i = 0; i < tableLen; ++i) {
    ibv_gid g;
    if (ibv_query_gid(ctx, uint8_t(port), i, &g) || isUnsetOrLinkLocal(g)) continue;
    std::string type = readSys("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/types/" +
                               std::to_string(i));
    if (type != "RoCE v2") continue;
    if (isIpv4Mapped(g)) return i;
    if (fallback < 0) fallback = i;
  }
  return fallback;
}

struct Want {
  std::string dev;
  int port = 0;  // 0: the first active
};

std::vector<Want> parseHca(const std::string& spec) {
  std::vector<Want> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string t = spec.substr(pos, end - pos);
    pos = end + 1;
    if (t.empty()) continue;
    Want w;
    size_t colon = t.find(':');
    w.dev = t.substr(0, colon);
    if (colon != std::string::npos) w.port = atoi(t.c_str() + colon + 1);
    out.push_back(w);
  }
  return out;
}

}  // namespace

std::shared_ptr<IbDevice> ibOpenDevice(std::string* why) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (!list || n == 0) {
    if (list) ibv_free_device_list(list);
    *why = "no RDMA device (ibv_get_device_list found none)";
    return nullptr;
  }
  std::vector<Want> wants = parseHca(config().ibHca);
  if (wants.empty())
    for (int i = 0; i < n; ++i) wants.push_back({ibv_get_device_name(list[i]), 0});
  std::shared_ptr<IbDevice> found;
  std::string tried;
  for (const Want& w : wants) {
    ibv_device* d = nullptr;
    for (int i = 0; i < n && !d; ++i)
      if (w.dev == ibv_get_device_name(list[i])) d = list[i];
    if (!d) {
      tried += strf("%s%s: no such device", tried.empty() ? "" : "; ", w.dev.c_str());
      continue;
    }
    auto dev = std::make_shared<IbDevice>();
    dev->name = w.dev;
    dev->ctx = ibv_open_device(d);
    ibv_device_attr da;
    if (!dev->ctx || ibv_query_device(dev->ctx, &da)) {
      tried += strf("%s%s: cannot open", tried.empty() ? "" : "; ", w.dev.c_str());
      continue;
    }
    for (int p = 1; p <= da.phys_port_cnt && !found; ++p) {
      if (w.port && p != w.port) continue;
      ibv_port_attr pa;
      if (ibv_query_port(dev->ctx, uint8_t(p), &pa) || pa.state != IBV_PORT_ACTIVE) {
        tried += strf("%s%s:%d: not active", tried.empty() ? "" : "; ", w.dev.c_str(), p);
        continue;
      }
      dev->port = p;
      dev->mtu = pa.active_mtu;
      dev->lid = pa.lid;
      dev->linkLayer = pa.link_layer == IBV_LINK_LAYER_INFINIBAND ? 1 : 2;
      int gi = int(config().ibGidIndex);
      if (gi < 0) gi = dev->linkLayer == 1 ? 0 : autoGidIndex(dev->ctx, w.dev, p, pa.gid_tbl_len);
      if (gi < 0 || gi >= pa.gid_tbl_len || ibv_query_gid(dev->ctx, uint8_t(p), gi, &dev->gid)) {
        tried += strf("%s%s:%d: no usable GID (no RoCE v2 GID; set LOOM_IB_GID_INDEX)", tried.empty() ? "" : "; ",
                      w.dev.c_str(), p);
        continue;
      }
      dev->gidIndex = gi;
      found = dev;
    }
    if (found) break;
  }
  ibv_free_device_list(list);
  if (!found) {
    *why = "no usable RDMA port (" + tried + ")";
    return nullptr;
  }
  found->pd = ibv_alloc_pd(found->ctx);
  if (!found->pd) {
    *why = strf("ibv_alloc_pd on %s: %s", found->name.c_str(), strerror(errno));
    return nullptr;
  }
  found->onDemand = rcOnDemand(found->ctx);
  found->registrar = std::make_unique<IbRegistrar>(*found);
  RegCacheLimits lim;
  lim.maxBytes = size_t(config().ibRegCacheBytes);
  found->regCache = std::make_unique<RegCache>(*found->registrar, lim, size_t(sysconf(_SC_PAGESIZE)));
  int fl = fcntl(found->ctx->async_fd, F_GETFL);
  fcntl(found->ctx->async_fd, F_SETFL, fl | O_NONBLOCK);
  return found;
}

}  // namespace loom
