// UCX transport (see ucx_transport.h for the design).
#include <stdlib.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "src/core/clock.h"
#include "src/core/config.h"
#include "src/core/error.h"
#include "src/core/log.h"
#include "src/core/process_watch.h"
#include "transports/ucx/ucx_transport.h"

namespace loom {

namespace {

// Tag of a slot message: sender rank in the high half, channel in the low;
// bit 31 marks the credit messages that flow back.
ucp_tag_t slotTag(int sender, int channel) { return (ucp_tag_t(uint32_t(sender)) << 32) | uint32_t(channel); }
ucp_tag_t creditTag(int sender, int channel) { return slotTag(sender, channel) | (ucp_tag_t(1) << 31); }
// Bit 30: the data of a direct transfer (one message per transfer).
constexpr ucp_tag_t kDirectBit = ucp_tag_t(1) << 30;
ucp_tag_t directTag(int sender, int channel) { return slotTag(sender, channel) | kDirectBit; }
constexpr ucp_tag_t kFullMask = ~ucp_tag_t(0);

// UCX 1.13 treats a failed cross-memory copy (cma) to a peer whose
// endpoint has no error handling -- the only kind its shared memory allows
// -- as fatal and aborts the survivor.  Such a peer died; the copy returns
// an error to UCX and loom's pidfd watch reports loomRemoteError, so that
// one message is demoted to a loom warning instead of killing this rank.
ucs_log_func_rc_t deadPeerCopyLog(const char* file, unsigned, const char*, ucs_log_level_t level,
                                  const ucs_log_component_config_t*, const char* fmt, va_list ap) {
  if (level != UCS_LOG_LEVEL_FATAL || !file || !strstr(file, "cma_ep.c")) return UCS_LOG_FUNC_RC_CONTINUE;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  LOOM_WARN("NET", "UCX shared-memory copy to a peer failed (peer died?): %s", msg);
  return UCS_LOG_FUNC_RC_STOP;
}

// At the destruction of a worker that abandoned direct transfers (a failed
// operation's, which UCX cannot cancel), UCX's complaints about the requests
// and unmatched messages they leave are expected: they become one loom note.
ucs_log_func_rc_t abandonedLog(const char* file, unsigned, const char*, ucs_log_level_t level,
                               const ucs_log_component_config_t*, const char*, va_list) {
  if (level != UCS_LOG_LEVEL_WARN || !file) return UCS_LOG_FUNC_RC_CONTINUE;
  for (const char* f : {"mpool.c", "callbackq.c", "tag_match.c"})
    if (strstr(file, f)) return UCS_LOG_FUNC_RC_STOP;
  return UCS_LOG_FUNC_RC_CONTINUE;
}

// loom's non-blocking connect for tcp (init), under the name each UCX
// version takes: UCX 1.13 applies a transport's setting given through
// ucp_config_modify without the transport's prefix (CONN_NB), 1.18 only with
// it (TCP_CONN_NB).  Both are set; UCX warns about the one it did not take.
constexpr const char* kConnNbKeys[] = {"CONN_NB", "TCP_CONN_NB"};

// UCX warns about settings given through ucp_config_modify that no
// transport took ("invalid configurations: A=x,B=y"): one of loom's two
// names for CONN_NB always is, and both are whenever tcp is not in use
// (UCX_TLS=sm, ...), which is no mistake of the user's.  A warning that
// names anything else goes through.
ucs_log_func_rc_t unusedTcpConnNbLog(const char* file, unsigned, const char*, ucs_log_level_t level,
                                     const ucs_log_component_config_t*, const char* fmt, va_list ap) {
  if (level != UCS_LOG_LEVEL_WARN || !file || !strstr(file, "ucp_worker.c")) return UCS_LOG_FUNC_RC_CONTINUE;
  char msg[256];
  va_list copy;
  va_copy(copy, ap);
  vsnprintf(msg, sizeof msg, fmt, copy);
  va_end(copy);
  const char* list = strstr(msg, ": ");
  if (strncmp(msg, "invalid configuration", 21) != 0 || !list) return UCS_LOG_FUNC_RC_CONTINUE;
  for (const char* p = list + 2; *p;) {
    std::string item(p, strcspn(p, ","));
    if (item != std::string(kConnNbKeys[0]) + "=y" && item != std::string(kConnNbKeys[1]) + "=y")
      return UCS_LOG_FUNC_RC_CONTINUE;
    p += item.size() + (p[item.size()] == ',');
  }
  return UCS_LOG_FUNC_RC_STOP;
}

// Swallows UCX's log while loom probes for a feature it can do without.
ucs_log_func_rc_t quietLog(const char*, unsigned, const char*, ucs_log_level_t, const ucs_log_component_config_t*,
                           const char*, va_list) {
  return UCS_LOG_FUNC_RC_STOP;
}

struct PeerState {
  std::vector<uint8_t> addr;
  ucp_ep_h ep = nullptr;
  // Direct transfers' endpoint when `ep` is in mode PEER (ucx_transport.h,
  // "Two endpoints"); nullptr: they use `ep`.
  ucp_ep_h dataEp = nullptr;
  bool dataTried = false;  // dataEp was attempted (made once, or its failure warned once)
  ucs_status_t error = UCS_OK;  // set by the endpoint's error handler
  bool dead = false;            // loom saw the peer's process exit
  bool peerMode = true;         // endpoint made with UCP_ERR_HANDLING_MODE_PEER
  int rank = -1;
};

// Completion state of one slot's UCX request.
struct SlotOp {
  void* req = nullptr;       // pending request (nullptr: none or done)
  bool busy = false;         // a request was posted and has not completed
  ucs_status_t status = UCS_OK;
  size_t length = 0;         // receives: bytes that arrived
};

// What UCX callbacks write into: a connection's two slot rings and their
// request states.  Outlives its connection when requests are still pending
// (then the worker frees it once no callback can run any more).
struct Rings {
  size_t bytes = 0;
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  std::vector<SlotOp> sendOps, recvOps;
  // Flow control: cumulative counts of released receive slots, as sent to
  // the peer (creditOut) and as last heard from it (creditIn).
  uint64_t creditOut = 0, creditIn = 0;
  SlotOp creditSend, creditRecv;
  // The direct transfer in each direction (one at a time).
  SlotOp directSend, directRecv;
  ~Rings() {
    free(send);
    free(recv);
  }
  bool pending() const {
    for (const SlotOp& op : sendOps)
      if (op.busy) return true;
    for (const SlotOp& op : recvOps)
      if (op.busy) return true;
    return creditSend.busy || creditRecv.busy || directSend.busy || directRecv.busy;
  }
};

}  // namespace

class UcxWorker {
 public:
  ~UcxWorker() {
    // Close endpoints gracefully (flush) so that the last slot
    // acknowledgements reach peers that are still finishing; force-close
    // the ones whose peer failed, and give up after a bounded wait.
    std::vector<void*> reqs;
    for (auto& kv : peers_) {
      PeerState& p = kv.second;
      for (ucp_ep_h* e : {&p.dataEp, &p.ep}) {
        if (!*e) continue;
        ucp_request_param_t prm{};
        prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        prm.flags = (p.error != UCS_OK || p.dead) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
        void* r = ucp_ep_close_nbx(*e, &prm);
        if (UCS_PTR_IS_PTR(r)) reqs.push_back(r);
        *e = nullptr;
      }
    }
    int64_t deadline = nowMs() + 2000;
    for (void* r : reqs) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && nowMs() < deadline) ucp_worker_progress(worker_);
      if (ucp_request_check_status(r) == UCS_INPROGRESS) {
        ucp_request_cancel(worker_, r);  // the peer is gone or stuck: stop waiting for it
        ucp_worker_progress(worker_);
      }
      ucp_request_free(r);
    }
    drainUnexpected();  // the peers' last credits, which nobody waits for
    for (auto& kv : memh_) ucp_mem_unmap(context_, kv.second);
    if (readyFd_ >= 0) close(readyFd_);
    if (abandoned_) {
      LOOM_INFO("NET", "rank %d: UCX worker closes with %d direct transfer(s) of failed operations left unfinished",
                rank_, abandoned_);
      ucs_log_push_handler(&abandonedLog);
    }
    // A direct transfer that UCX neither finished nor could cancel (a
    // rendezvous already matched when its peer died: UCX 1.18 leaves such a
    // receive, and over sm such a send, in progress after the endpoint is
    // closed by force) keeps its buffer's registration in the context's
    // cache.  ucp_worker_destroy does not give it back, and ucp_cleanup then
    // aborts the process on UCX's assertion that no cached region is in use
    // (rcache.c, "region->refcount == 0").  The context is left to the
    // process's exit instead: one per communicator that failed so, a leak
    // loom cannot avoid while UCX offers no way to end such a request.
    // (Taken before the worker's destruction, which may mark the request
    // done without giving the region back: checked after it, ucx_tests'
    // "killing the sender or the receiver of a 32 MiB direct transfer"
    // aborted again.)
    bool held = false;
    for (const Rings* r : orphans_) held = held || r->directRecv.busy || r->directSend.busy;
    if (worker_) ucp_worker_destroy(worker_);
    if (context_ && held)
      LOOM_INFO("NET", "rank %d: UCX context left uncleaned: a direct transfer of a failed operation is still in "
                "UCX's hands and holds its buffer's registration", rank_);
    else if (context_)
      ucp_cleanup(context_);
    if (abandoned_) ucs_log_pop_handler();
    for (Rings* r : orphans_) delete r;
  }

  // Takes the slot and credit messages nobody will receive.  Direct
  // transfers' data is never matched here: receiving it would make UCX read
  // (or let the sender write) a user buffer of an operation that failed.
  void drainUnexpected() {
    if (!worker_) return;
    std::vector<uint8_t> scratch;
    for (int n = 0; n < 100000; ++n) {
      ucp_tag_recv_info_t info{};
      ucp_tag_message_h m = ucp_tag_probe_nb(worker_, 0, kDirectBit, 1, &info);
      if (!m) break;
      scratch.resize(std::max<size_t>(info.length, 1));
      ucp_request_param_t prm{};
      void* r = ucp_tag_msg_recv_nbx(worker_, scratch.data(), info.length, m, &prm);
      if (!UCS_PTR_IS_PTR(r)) continue;
      int64_t deadline = nowMs() + 1000;
      while (ucp_request_check_status(r) == UCS_INPROGRESS && nowMs() < deadline) ucp_worker_progress(worker_);
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return;  // leave it to ucp_worker_destroy
      ucp_request_free(r);
    }
    ucp_tag_recv_info_t info{};
    if (ucp_tag_probe_nb(worker_, kDirectBit, kDirectBit, 0, &info)) ++abandoned_;
  }

  bool init(int rank, const std::string& tls, size_t slotMessageBytes, std::string* why) {
    rank_ = rank;
    ucp_config_t* cfg = nullptr;
    ucs_status_t s = ucp_config_read("LOOM", nullptr, &cfg);
    if (s != UCS_OK) return bad(why, "ucp_config_read", s);
    if (!tls.empty()) {
      s = ucp_config_modify(cfg, "TLS", tls.c_str());
      if (s != UCS_OK) {
        ucp_config_release(cfg);
        *why = strf("LOOM_UCX_TLS=%s rejected by UCX: %s", tls.c_str(), ucs_status_string(s));
        return false;
      }
    }
    // UCX's default keepalive (20 s) is how long a rank would wait to learn
    // that a shared-memory peer died; 1 s unless the user chose otherwise.
    if (!foreignEnv("UCX_KEEPALIVE_INTERVAL")) ucp_config_modify(cfg, "KEEPALIVE_INTERVAL", "1s");
    // Slot messages go eager: UCX's own threshold (8 KiB on tcp and sm)
    // would make every 64 KiB slot a rendezvous, three small messages and
    // as many wake-ups of the other rank per slot.  A slot is always
    // expected (its receive is posted before the peer may send it: credits),
    // so eager data lands in the ring with one copy out of UCX's buffers.
    // Direct transfers, larger than a slot, stay rendezvous (zero-copy).
    if (!foreignEnv("UCX_RNDV_THRESH"))
      ucp_config_modify(cfg, "RNDV_THRESH", std::to_string(slotMessageBytes + 1).c_str());
    // tcp connects without blocking.  With UCX's default (UCX_TCP_CONN_NB=n)
    // a survivor can crash inside UCX when a peer dies while it is being
    // connected: ucp_ep_create connects and sends tcp's connection request
    // itself; when the peer has just accepted and dies before reading it,
    // the send fails, UCX reconnects, the reconnect is refused, and UCX marks
    // the endpoint failed -- for one without its send side yet that means
    // "destroy at the next progress" -- then gives it its send side and
    // hands it to UCP anyway (uct_tcp_ep_connect and
    // uct_tcp_ep_create_socket_and_connect in 1.13's tcp_ep.c; unchanged in
    // UCX's master of 2026-08).  The next ucp_worker_progress destroys an
    // endpoint UCP still uses: Debian's build aborts on the assertion at
    // tcp_ep.c:478, one without assertions would free it under UCP.  A
    // non-blocking connect returns EINPROGRESS (on loopback too, to a closed
    // port too), so the request and any reconnect happen in progress, after
    // the endpoint is complete, where a failure reaches the endpoint's error
    // handler like any other (loomRemoteError).  The setting's name differs
    // between UCX versions (kConnNbKeys).
    if (!foreignEnv("UCX_TCP_CONN_NB"))
      for (const char* key : kConnNbKeys) ucp_config_modify(cfg, key, "y");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    s = ucp_init(&params, cfg, &context_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return bad(why, "ucp_init", s);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    wp.events = UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV | UCP_WAKEUP_TX | UCP_WAKEUP_RX;
    ucs_log_push_handler(&unusedTcpConnNbLog);
    s = ucp_worker_create(context_, &wp, &worker_);
    ucs_log_pop_handler();
    if (s != UCS_OK) return bad(why, "ucp_worker_create", s);
    s = ucp_worker_get_efd(worker_, &efd_);
    if (s != UCS_OK) {
      efd_ = -1;
      LOOM_WARN("NET", "rank %d: UCX gives no event fd (%s): idle ranks wake every 5 ms to poll it", rank,
                ucs_status_string(s));
    }
    readyFd_ = eventfd(1, EFD_NONBLOCK | EFD_CLOEXEC);  // always readable: "do not sleep"
    if (readyFd_ < 0) failErrno("eventfd");
    return true;
  }

  UcxAddrRecord address(std::string* why) {
    UcxAddrRecord rec{};
    ucp_address_t* a = nullptr;
    size_t len = 0;
    ucs_status_t s = ucp_worker_get_address(worker_, &a, &len);
    if (s != UCS_OK) {
      *why = strf("ucp_worker_get_address: %s", ucs_status_string(s));
      return rec;
    }
    if (len > kUcxAddrMax) {
      *why = strf("the UCX worker address is %zu bytes, more than the %zu loom exchanges (restrict "
                  "LOOM_UCX_TLS / UCX_TLS to fewer transports)", len, kUcxAddrMax);
    } else {
      rec.len = uint32_t(len);
      memcpy(rec.addr, a, len);
    }
    ucp_worker_release_address(worker_, a);
    return rec;
  }

  void setPeer(int peer, const UcxAddrRecord& rec) {
    PeerState& p = peers_[peer];
    p.rank = peer;
    p.addr.assign(rec.addr, rec.addr + rec.len);
  }

  // The endpoint to `peer` (made on first use).
  ucp_ep_h ep(int peer) {
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second.addr.empty())
      fail(loomInternalError, "rank %d has no UCX address of rank %d", rank_, peer);
    PeerState& p = it->second;
    if (p.ep) return p.ep;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(p.addr.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxWorker::onEpError;
    ep.err_handler.arg = &p;
    ucs_log_push_handler(&quietLog);  // an unreachable-in-mode-PEER peer is not an error (below)
    ucs_status_t s = ucp_ep_create(worker_, &ep, &p.ep);
    ucs_log_pop_handler();
    if (s == UCS_ERR_UNREACHABLE) {
      // UCX 1.13's shared-memory transports have no peer-failure support, so
      // mode PEER finds no path to a peer reachable only through them.  Such
      // a peer is on this host: the connection watches its process instead.
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      ep.field_mask &= ~uint64_t(UCP_EP_PARAM_FIELD_ERR_HANDLER);
      s = ucp_ep_create(worker_, &ep, &p.ep);
      p.peerMode = false;
      static bool handlerInstalled = false;  // (init is serialised by the bootstrap's caller)
      if (!handlerInstalled) {
        handlerInstalled = true;
        ucs_log_push_handler(&deadPeerCopyLog);
      }
      if (s == UCS_OK)
        LOOM_INFO("NET", "rank %d: UCX endpoint to rank %d has no peer-failure handling (transport lacks "
                  "it); watching the peer's process instead", rank_, peer);
    }
    if (s != UCS_OK) {
      p.ep = nullptr;
      fail(loomRemoteError, "rank %d cannot open a UCX endpoint to rank %d: %s", rank_, peer, ucs_status_string(s));
    }
    return p.ep;
  }

  // Where direct transfers to `peer` are sent (after ep(peer)): a mode-PEER
  // endpoint's data endpoint, made by both ranks of a pair at its first
  // direct transfer (the sender to send, the receiver when it offers its
  // buffer), so only pairs that use direct transfers have one.  It is each
  // rank's second endpoint to that peer, and UCX pairs a worker's endpoints
  // to one peer in creation order: it meets the peer's data endpoint (same
  // mode), never its mode-PEER one.
  ucp_ep_h dataEp(int peer) {
    PeerState& p = peers_[peer];
    if (!p.peerMode || !p.ep) return p.ep;
    if (p.dataEp || p.dataTried) return p.dataEp ? p.dataEp : p.ep;
    p.dataTried = true;
    ucp_ep_params_t dp{};
    dp.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    dp.address = reinterpret_cast<const ucp_address_t*>(p.addr.data());
    dp.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ucs_status_t s = ucp_ep_create(worker_, &dp, &p.dataEp);
    if (s != UCS_OK) {
      p.dataEp = nullptr;
      LOOM_WARN("NET", "rank %d: no second UCX endpoint to rank %d (%s): its direct transfers share the "
                "error-handling one, which UCX may give no zero-copy path", rank_, peer, ucs_status_string(s));
      return p.ep;
    }
    LOOM_INFO("NET", "rank %d: UCX data endpoint to rank %d (no error handling) for direct transfers", rank_, peer);
    return p.dataEp;
  }

  // The peer's endpoint failure, if any.
  ucs_status_t peerError(int peer) {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return UCS_OK;
    if (it->second.error == UCS_OK && it->second.dead) return UCS_ERR_ENDPOINT_TIMEOUT;
    return it->second.error;
  }
  bool peerMode(int peer) { return peers_[peer].peerMode; }
  void markDead(int peer) { peers_[peer].dead = true; }
  // A connection leaves a direct send that will never complete.
  void abandonDirect(int peer) {
    markDead(peer);
    countAbandoned();
  }
  void countAbandoned() { ++abandoned_; }
  // Rings whose requests are still pending when their connection closes.
  void adopt(Rings* r) { orphans_.push_back(r); }

  // The registration of [p, p+n), made once per buffer.
  ucp_mem_h memh(void* p, size_t n) {
    auto key = std::make_pair(reinterpret_cast<uintptr_t>(p), n);
    auto it = memh_.find(key);
    if (it != memh_.end()) return it->second;
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = p;
    mp.length = n;
    ucp_mem_h h = nullptr;
    ucs_status_t s = ucp_mem_map(context_, &mp, &h);
    if (s != UCS_OK) fail(loomSystemError, "rank %d: ucp_mem_map of %zu bytes: %s", rank_, n, ucs_status_string(s));
    memh_[key] = h;
    return h;
  }

  void unmap(void* p, size_t n) {
    auto it = memh_.find(std::make_pair(reinterpret_cast<uintptr_t>(p), n));
    if (it == memh_.end()) return;
    ucp_mem_unmap(context_, it->second);
    memh_.erase(it);
  }

  void progress() {
    for (int i = 0; i < 16; ++i) {
      unsigned n = ucp_worker_progress(worker_);
      if (!n) break;
      events_ += n;
    }
  }
  // Events progress() handled so far (UcxConnection::directMoved).
  uint64_t events() const { return events_; }

  void addPollFds(std::vector<pollfd>& fds) {
    for (const pollfd& p : fds)
      if (p.fd == efd_ || p.fd == readyFd_) return;  // another connection of this worker did
    if (efd_ < 0) return;
    ucs_status_t s = ucp_worker_arm(worker_);
    fds.push_back(pollfd{s == UCS_OK ? efd_ : readyFd_, POLLIN, 0});
  }

  ucp_worker_h worker() const { return worker_; }
  int rank() const { return rank_; }

 private:
  static void onEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    PeerState* p = static_cast<PeerState*>(arg);
    if (p->error == UCS_OK) {
      p->error = status;
      LOOM_INFO("NET", "UCX endpoint to rank %d failed: %s", p->rank, ucs_status_string(status));
    }
  }

  bool bad(std::string* why, const char* what, ucs_status_t s) {
    *why = strf("%s: %s", what, ucs_status_string(s));
    return false;
  }

  int rank_ = -1;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  uint64_t events_ = 0;  // handled by progress()
  int efd_ = -1;
  int readyFd_ = -1;
  std::map<int, PeerState> peers_;
  std::map<std::pair<uintptr_t, size_t>, ucp_mem_h> memh_;
  std::vector<Rings*> orphans_;
  int abandoned_ = 0;  // direct transfers left pending by failed operations
};

namespace {

uint8_t* ringAlloc(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, n) != 0) fail(loomSystemError, "cannot allocate a %zu-byte UCX slot ring", n);
  memset(p, 0, n);
  return static_cast<uint8_t*>(p);
}

class UcxConnection : public Connection, public DirectTransfer {
 public:
  UcxConnection(std::shared_ptr<UcxWorker> w, int rank, int peer, int channel, size_t slotBytes, int slots,
                int peerPid, size_t directMin)
      : w_(std::move(w)), rank_(rank), peer_(peer), channel_(channel), slotBytes_(slotBytes),
        slots_(uint64_t(slots)), stride_(sizeof(SlotTag) + slotBytes), peerPid_(peerPid), directMin_(directMin) {
    ep_ = w_->ep(peer);
    if (!w_->peerMode(peer)) {
      if (peerPid_ > 0) peerProcess_ = ProcessWatch::of(peerPid_);
      else if (channel == 0)
        LOOM_WARN("NET", "rank %d: UCX reaches rank %d only through transports without peer-failure handling "
                  "and its process is not visible from here: if it dies, this rank sees only LOOM_TIMEOUT_MS "
                  "(use LOOM_UCX_TLS=tcp to have it reported at once)", rank_, peer_);
    }
    r_ = new Rings();
    r_->bytes = stride_ * slots_;
    r_->send = ringAlloc(r_->bytes);
    r_->recv = ringAlloc(r_->bytes);
    r_->sendOps.resize(slots_);
    r_->recvOps.resize(slots_);
    sendMemh_ = w_->memh(r_->send, r_->bytes);
    recvMemh_ = w_->memh(r_->recv, r_->bytes);
    for (uint64_t i = 0; i < slots_; ++i) postRecv(i);
    postCreditRecv();
  }

  ~UcxConnection() override {
    for (SlotOp& op : r_->recvOps)
      if (op.busy && op.req) ucp_request_cancel(w_->worker(), op.req);
    if (r_->creditRecv.busy && r_->creditRecv.req) ucp_request_cancel(w_->worker(), r_->creditRecv.req);
    // A direct receive still posted belongs to an operation that failed: its
    // buffer is the user's again, so nothing may land there any more.
    if (r_->directRecv.busy && r_->directRecv.req) ucp_request_cancel(w_->worker(), r_->directRecv.req);
    // A direct send still pending belongs to a failed operation too, and UCX
    // cannot cancel sends: the peer never matches it (it receives direct
    // data only into a buffer it offered, and drainUnexpected skips it), so
    // it is not waited for, and the endpoint is closed by force.
    if (r_->directSend.busy) w_->abandonDirect(peer_);
    // Slot sends to a live peer finish (it matched them, or will); wait a
    // little for their completions, then let the worker free what is still
    // in use once no callback can touch it.
    int64_t deadline = nowMs() + (w_->peerError(peer_) == UCS_OK ? 2000 : 0);
    auto waiting = [this] {
      const Rings& r = *r_;
      for (const SlotOp& op : r.sendOps)
        if (op.busy) return true;
      return r.creditSend.busy || (!r.directSend.busy && r.pending());
    };
    do {
      ucp_worker_progress(w_->worker());
    } while (waiting() && nowMs() < deadline);
    // A matched direct receive cannot be cancelled: it is left to UCX too.
    if (r_->directRecv.busy) w_->countAbandoned();
    if (r_->pending()) {
      w_->adopt(r_);
      return;
    }
    w_->unmap(r_->send, r_->bytes);
    w_->unmap(r_->recv, r_->bytes);
    delete r_;
  }

  const char* name() const override { return "ucx"; }
  size_t slotBytes() const override { return slotBytes_; }

  // A slot is free when its last send has completed here and the peer has
  // released enough receive slots that this message finds one posted.
  bool sendFree() const { return sendHead_ - sendDone_ < slots_ && sendHead_ - peerReleased_ < slots_; }

  void* sendAcquire() override {
    if (!sendFree()) {
      progress();
      if (!sendFree()) return nullptr;
    }
    return sendSlot(sendHead_) + sizeof(SlotTag);
  }

  void sendPost(const SlotTag& tag) override {
    uint8_t* s = sendSlot(sendHead_);
    memcpy(s, &tag, sizeof tag);
    SlotOp& op = r_->sendOps[size_t(sendHead_ % slots_)];
    ++sendHead_;
    op = SlotOp{};
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    prm.cb.send = &UcxConnection::onSend;
    prm.user_data = &op;
    prm.memh = sendMemh_;
    op.busy = true;
    void* r = ucp_tag_send_nbx(ep_, s, sizeof(SlotTag) + tag.bytes, slotTag(rank_, channel_), &prm);
    if (UCS_PTR_IS_ERR(r)) {
      op.busy = false;
      op.status = UCS_PTR_STATUS(r);
      failPeer("sending");
    }
    if (r == nullptr) op.busy = false;  // done at once
    else if (op.busy) op.req = r;       // (unless the callback already ran)
    ucp_worker_progress(w_->worker());  // start it moving now
  }

  bool sendIdle() override {
    progress();
    return sendDone_ == sendHead_;
  }

  const void* recvPeek(SlotTag* tag) override {
    SlotOp* op = &r_->recvOps[size_t(recvTail_ % slots_)];
    if (op->busy) {
      progress();
      if (op->busy) return nullptr;
    }
    if (op->status != UCS_OK)
      fail(loomRemoteError, "rank %d: UCX receive from rank %d (channel %d) failed: %s", rank_, peer_, channel_,
           ucs_status_string(op->status));
    uint8_t* s = recvSlot(recvTail_);
    memcpy(tag, s, sizeof *tag);
    if (op->length < sizeof(SlotTag) || tag->bytes > slotBytes_ || op->length != sizeof(SlotTag) + tag->bytes)
      fail(loomRemoteError, "rank %d: rank %d sent a malformed %zu-byte UCX slot (payload %u, slots of %zu)",
           rank_, peer_, op->length, tag->bytes, slotBytes_);
    return s + sizeof(SlotTag);
  }

  void recvRelease() override {
    postRecv(recvTail_ % slots_);
    ++recvTail_;
    sendCredit();
  }

  void progress() override {
    w_->progress();
    SlotOp& cr = r_->creditRecv;
    if (!cr.busy) {
      if (cr.status == UCS_OK && cr.length == sizeof(uint64_t))
        peerReleased_ = std::max(peerReleased_, r_->creditIn);
      postCreditRecv();
    }
    sendCredit();
    while (sendDone_ != sendHead_) {
      SlotOp& op = r_->sendOps[size_t(sendDone_ % slots_)];
      if (op.busy) break;
      if (op.status != UCS_OK) failPeer("sending");
      ++sendDone_;
    }
  }

  void addPollFds(std::vector<pollfd>& fds) override { w_->addPollFds(fds); }

  DirectTransfer* direct() override { return directMin_ ? this : nullptr; }
  size_t directMinBytes() const override { return directMin_; }

  // A direct transfer is one tagged message from the user's buffer into the
  // peer's: the request slot goes first (the receiver checks it like any
  // slot), then the data, at once, under the direct tag.  UCX sends it by
  // rendezvous at these sizes (zero-copy: tcp puts from this buffer, sm's
  // cma reads it), so it moves only once the receiver has posted its
  // buffer; UCX can reach any host memory, so neither end needs "slots".
  bool directSend(const void* src, size_t bytes, const SlotTag& tag) override {
    SlotOp& op = r_->directSend;
    if (op.busy)
      fail(loomInternalError, "rank %d: a second direct transfer to rank %d (channel %d) while one is in progress",
           rank_, peer_, channel_);
    void* slot = sendAcquire();
    if (!slot) return false;
    uint64_t request[2] = {bytes, 0};  // bytes; 0: the data follows as one message, not in slots
    memcpy(slot, request, sizeof request);
    SlotTag t = tag;
    t.flags |= kTagDirect;
    t.bytes = uint32_t(sizeof request);
    sendPost(t);
    op = SlotOp{};
    directSendBytes_ = bytes;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = &UcxConnection::onSend;
    prm.user_data = &op;
    op.busy = true;
    void* r = ucp_tag_send_nbx(w_->dataEp(peer_), src, bytes, directTag(rank_, channel_), &prm);
    if (UCS_PTR_IS_ERR(r)) {
      op.busy = false;
      op.status = UCS_PTR_STATUS(r);
      failPeer("sending");
    }
    if (r == nullptr) op.busy = false;
    else if (op.busy) op.req = r;
    ucp_worker_progress(w_->worker());
    return true;
  }

  State directSendState() override {
    progress();
    const SlotOp& op = r_->directSend;
    if (op.busy) return State::Waiting;
    if (op.status != UCS_OK) failPeer("sending directly", op.status);
    if (directSendBytes_) {
      LOOM_TRACE("NET", "rank %d: direct transfer of %zu bytes to rank %d (channel %d) done over UCX", rank_,
                 directSendBytes_, peer_, channel_);
      directSendBytes_ = 0;
    }
    return State::Done;
  }

  void directRecv(void* dst, size_t bytes) override {
    SlotOp& op = r_->directRecv;
    if (op.busy)
      fail(loomInternalError, "rank %d: a second direct transfer from rank %d (channel %d) while one is in progress",
           rank_, peer_, channel_);
    op = SlotOp{};
    directBytes_ = bytes;
    w_->dataEp(peer_);  // this rank's half of the pair's data endpoints (the peer sends on its own)
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.cb.recv = &UcxConnection::onRecv;
    prm.user_data = &op;
    op.busy = true;
    void* r = ucp_tag_recv_nbx(w_->worker(), dst, bytes, directTag(peer_, channel_), kFullMask, &prm);
    if (UCS_PTR_IS_ERR(r)) {
      op.busy = false;
      fail(loomRemoteError, "rank %d: cannot post a UCX receive from rank %d: %s", rank_, peer_,
           ucs_status_string(UCS_PTR_STATUS(r)));
    }
    if (op.busy) op.req = r;
    ucp_worker_progress(w_->worker());
  }

  bool directMoved() override {
    const uint64_t e = w_->events();
    const bool moved = e != seenEvents_;
    seenEvents_ = e;
    return moved;
  }

  State directRecvState() override {
    progress();
    const SlotOp& op = r_->directRecv;
    if (op.busy) return State::Waiting;
    if (op.status == UCS_ERR_MESSAGE_TRUNCATED)
      fail(loomRemoteError, "rank %d: rank %d sent more than the %zu bytes of its direct transfer over UCX "
           "(channel %d)", rank_, peer_, directBytes_, channel_);
    if (op.status != UCS_OK) failPeer("receiving directly", op.status);
    if (!directBytes_) return State::Done;  // (reported before)
    if (op.length != directBytes_)
      fail(loomRemoteError, "rank %d: rank %d sent %zu bytes in a direct transfer of %zu over UCX (channel %d)",
           rank_, peer_, op.length, directBytes_, channel_);
    LOOM_TRACE("NET", "rank %d: direct transfer of %zu bytes from rank %d (channel %d) done over UCX", rank_,
               directBytes_, peer_, channel_);
    directBytes_ = 0;
    return State::Done;
  }

  void checkPeer() override {
    if (peerProcess_ && peerProcess_->dead()) w_->markDead(peer_);
    if (w_->peerError(peer_) == UCS_OK) return;
    // Slots the peer delivered before it went away stay readable.
    const SlotOp& op = r_->recvOps[size_t(recvTail_ % slots_)];
    if (!op.busy && op.status == UCS_OK) return;
    failPeer("waiting");
  }

 private:
  uint8_t* sendSlot(uint64_t i) { return r_->send + size_t(i % slots_) * stride_; }
  uint8_t* recvSlot(uint64_t i) { return r_->recv + size_t(i % slots_) * stride_; }

  void postRecv(uint64_t i) {
    SlotOp& op = r_->recvOps[size_t(i)];
    op = SlotOp{};
    // Always a request and a callback (UCP_OP_ATTR_FLAG_NO_IMM_CMPL): one
    // completion path, which reports the arrived length reliably.
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH |
                       UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.cb.recv = &UcxConnection::onRecv;
    prm.user_data = &op;
    prm.memh = recvMemh_;
    op.busy = true;
    void* r = ucp_tag_recv_nbx(w_->worker(), recvSlot(i), stride_, slotTag(peer_, channel_), kFullMask, &prm);
    if (UCS_PTR_IS_ERR(r)) {
      op.busy = false;
      fail(loomRemoteError, "rank %d: cannot post a UCX receive from rank %d: %s", rank_, peer_,
           ucs_status_string(UCS_PTR_STATUS(r)));
    }
    if (r == nullptr) fail(loomInternalError, "UCX completed a receive at once despite NO_IMM_CMPL");
    if (op.busy) op.req = r;  // (the callback may already have run)
  }

  // Tells the peer how many of its slots this side has released, once half
  // the ring is free again (and never with two credit messages in flight:
  // the count is cumulative, so a later one says everything).
  void sendCredit() {
    SlotOp& op = r_->creditSend;
    if (op.busy || recvTail_ - reported_ < std::max<uint64_t>(1, slots_ / 2)) return;
    r_->creditOut = recvTail_;
    reported_ = recvTail_;
    op = SlotOp{};
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    prm.cb.send = &UcxConnection::onSend;
    prm.user_data = &op;
    op.busy = true;
    void* r = ucp_tag_send_nbx(ep_, &r_->creditOut, sizeof r_->creditOut, creditTag(rank_, channel_), &prm);
    // A peer that is gone needs no credit; its failure shows on the data path.
    if (r == nullptr || UCS_PTR_IS_ERR(r)) op.busy = false;
    else if (op.busy) op.req = r;
  }

  void postCreditRecv() {
    SlotOp& op = r_->creditRecv;
    op = SlotOp{};
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.cb.recv = &UcxConnection::onRecv;
    prm.user_data = &op;
    op.busy = true;
    void* r = ucp_tag_recv_nbx(w_->worker(), &r_->creditIn, sizeof r_->creditIn, creditTag(peer_, channel_),
                               kFullMask, &prm);
    if (UCS_PTR_IS_ERR(r)) {
      op.busy = false;
      fail(loomRemoteError, "rank %d: cannot post a UCX receive from rank %d: %s", rank_, peer_,
           ucs_status_string(UCS_PTR_STATUS(r)));
    }
    if (op.busy) op.req = r;
  }

  // seen: the failed request's own status, if any.
  [[noreturn]] void failPeer(const char* doing, ucs_status_t seen = UCS_OK) {
    ucs_status_t s = w_->peerError(peer_);
    if (s == UCS_OK) s = seen;
    for (const SlotOp& op : r_->sendOps)
      if (s == UCS_OK && !op.busy && op.status != UCS_OK) s = op.status;
    if (w_->peerError(peer_) == UCS_ERR_ENDPOINT_TIMEOUT && peerProcess_ && peerProcess_->dead())
      loom::failPeer(peer_, loomRemoteError, "rank %d: rank %d (pid %d) died; its UCX connection (channel %d) failed while %s",
           rank_, peer_, peerPid_, channel_, doing);
    loom::failPeer(peer_, loomRemoteError, "rank %d: UCX connection to rank %d (channel %d) failed while %s: %s", rank_, peer_,
         channel_, doing, ucs_status_string(s));
  }

  static void onSend(void* req, ucs_status_t status, void* user) {
    SlotOp* op = static_cast<SlotOp*>(user);
    op->status = status;
    op->busy = false;
    op->req = nullptr;
    ucp_request_free(req);
  }

  static void onRecv(void* req, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
    SlotOp* op = static_cast<SlotOp*>(user);
    op->status = status;
    op->length = status == UCS_OK ? info->length : 0;
    op->busy = false;
    op->req = nullptr;
    ucp_request_free(req);
  }

  std::shared_ptr<UcxWorker> w_;
  int rank_, peer_, channel_;
  size_t slotBytes_;
  uint64_t slots_;
  size_t stride_;
  int peerPid_;     // > 0: the peer is a process on this host (and pid namespace)
  size_t directMin_;         // direct transfers from this many bytes (0: none)
  size_t directBytes_ = 0;      // the direct receive in progress (0: none, or reported done)
  size_t directSendBytes_ = 0;  // the direct send in progress (likewise)
  uint64_t seenEvents_ = 0;     // the worker's events at the last directMoved()
  std::shared_ptr<const ProcessWatch> peerProcess_;  // watched when UCX cannot report the peer's failure
  ucp_ep_h ep_ = nullptr;
  Rings* r_ = nullptr;
  ucp_mem_h sendMemh_ = nullptr, recvMemh_ = nullptr;
  uint64_t sendHead_ = 0, sendDone_ = 0;
  uint64_t peerReleased_ = 0;  // the peer's released receive slots (its last credit)
  uint64_t recvTail_ = 0;
  uint64_t reported_ = 0;      // recvTail_ as last sent to the peer
};

}  // namespace

std::shared_ptr<UcxWorker> ucxCreateWorker(int rank, const std::string& tls, size_t slotBytes, std::string* why) {
  auto w = std::make_shared<UcxWorker>();
  if (!w->init(rank, tls, sizeof(SlotTag) + slotBytes, why)) return nullptr;
  return w;
}

UcxAddrRecord ucxAddress(UcxWorker& w, std::string* why) { return w.address(why); }

void ucxSetPeerAddress(UcxWorker& w, int peer, const UcxAddrRecord& rec) { w.setPeer(peer, rec); }

std::unique_ptr<Connection> makeUcxConnection(std::shared_ptr<UcxWorker> w, int rank, int peer, int channel,
                                              size_t slotBytes, int slots, int peerPid, size_t directMin) {
  return std::make_unique<UcxConnection>(std::move(w), rank, peer, channel, slotBytes, slots, peerPid, directMin);
}

}  // namespace loom
