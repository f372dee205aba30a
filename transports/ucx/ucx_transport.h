// UCX transport: slots travel as UCP tagged messages.
//
// Tag API, not active messages.  A loom connection is a FIFO of fixed-size
// slots per (peer, channel) whose receive side owns a ring of slot buffers.
// The tag API fits that exactly: every free receive slot is a pre-posted
// ucp_tag_recv_nbx into its own ring buffer, matched by the tag (sender
// rank, channel) in send order, so UCX lands each slot where the executor
// will read it (eager: one copy out of UCX's receive buffer; below) with no
// staging copy on loom's side.  Active messages would hand us
// the data in a UCX-owned buffer (eager) or make us answer each rendezvous
// with a receive anyway, which is the tag path with extra steps.
//
// Flow control is the slot count, by credits: the receiver tells the
// sender (a small eager message with tag bit 31 set, carrying the
// cumulative number of released receive slots, sent when half the ring has
// been freed) how far it may run, so at most `slots` messages per direction
// are ever unconsumed at the receiver and UCX's unexpected queue stays
// bounded.  Sends are plain ucp_tag_send_nbx: a send slot is reused once UCX
// has finished with its buffer.  (The first version used
// ucp_tag_send_sync_nbx, whose completion is the receiver's match; its
// acknowledgement round trip at the end of every operation made small
// all-reduces twice as slow as loom's tcp.)

// Eager slots: loom sets UCX's rendezvous threshold (RNDV_THRESH) just above
// a slot message (SlotTag + LOOM_SLOT_BYTES) unless UCX_RNDV_THRESH is set.
// UCX's own choice (8 KiB on tcp and sm in 1.13) made every 64 KiB slot a
// rendezvous: a request, an answer and a completion message per slot, each
// needing the other rank awake, which kept loom at 0.2-0.6x of
// ucx_perftest.  Eager costs one copy out of UCX's receive buffers into the
// ring (the slot's receive is always posted first, by the credits below).
//
// Registration: both slot rings of a connection are page-aligned and
// registered once with ucp_mem_map when the connection is made; the handle
// is passed with every send and receive (UCP_OP_ATTR_FIELD_MEMH), so no
// slot operation registers memory.  The worker keeps these handles in a
// cache keyed by buffer (UcxWorker::memh), so any ring, however many
// collectives run over it, is registered exactly once.  For collectives
// user buffers are never given to UCX: the executor reduces/copies straight
// into the send slot, the data's first and only staging place on this side
// (as for shm and tcp).
//
// Direct transfers (Connection::direct(), transports/transport.h): a
// loomSend/loomRecv step of at least the pair's threshold (the larger of
// the two ends' LOOM_UCX_RENDEZVOUS_BYTES, exchanged in UcxAddrRecord) goes
// as ONE tagged message from the user's buffer into the user's buffer, as
// ucx_perftest's tag_bw moves it: the sender posts the request slot and at
// once ucp_tag_send_nbx of the whole buffer under the direct tag (bit 30);
// the receiver checks the request like any slot and posts
// ucp_tag_recv_nbx into its buffer.  UCX moves it by rendezvous (tcp: puts
// from the sender's buffer; sm: cma reads of it), registering the user
// memory itself.  Neither end ever needs to fall back to slots.  UCX 1.13
// cannot cancel a send: a direct send left by a failed operation stays
// pending and is abandoned at close (its peer never matches it -- direct
// data is received only into a buffer offered for it, and the close-time
// drain skips it), and a direct receive left posted is cancelled before the
// closing connection makes any progress, so nothing lands in a buffer the
// user got back with an error (data lands only inside this rank's progress
// calls: tcp reads, sm's cma reads; a user forcing UCX_RNDV_SCHEME=put_zcopy
// on sm would let the peer write on its own).
//
// Two endpoints per peer where the first is in mode PEER (below): UCX 1.13
// gives a mode-PEER endpoint a zero-copy (put/get) rendezvous lane only on
// transports whose memory domain can invalidate registrations or that
// connect endpoint to endpoint; tcp reached through a worker address is
// neither, so its rendezvous sent every direct transfer as 64 KiB active
// messages copied out of UCX's receive buffers (`ucx_info -e -u te` shows no
// rma_bw lane; ucx_perftest -e dropped to 0.5-0.6x of itself at 2 MiB, and
// loom with it).  So at a pair's first direct transfer each rank makes a
// second endpoint to the peer in mode NONE, and sends only direct data on
// it: UCX pairs the two ranks' endpoints in creation order, and a mode-NONE
// tcp endpoint has the rma_bw lanes (tcp puts from the sender's buffer,
// received straight into the receiver's).  Pairs that only run collectives
// keep one endpoint (and one socket per lane).  The request
// slots, credits and failure detection stay on the mode-PEER endpoint: a
// dead peer fails that one (loomRemoteError as before), and a direct send
// left pending on the data endpoint is abandoned like any other (below).
// A mode-NONE failure on tcp only completes that endpoint's requests with an
// error (no abort), which the direct send reports as the peer's failure.
//
// One UCP context and worker per communicator (a communicator's operations
// are serialised, so the worker runs in UCS_THREAD_MODE_SERIALIZED), one
// endpoint per peer, plus the data endpoint above (error handling mode PEER: a dead peer fails its
// endpoint, and checkPeer() turns that into loomRemoteError; UCX 1.13's
// shared-memory transports cannot do mode PEER, so a peer reachable only
// through them gets a mode-NONE endpoint and its process is watched through
// a pidfd instead -- it is on this host by definition), made lazily
// from worker addresses exchanged through the bootstrap.  Progress happens
// only inside progress() calls by the executor; an idle rank sleeps in
// poll() on the worker's event fd (ucp_worker_get_efd / ucp_worker_arm)
// together with its other descriptors.
#pragma once
#include <poll.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transports/transport.h"

namespace loom {

// Fixed-size record each rank contributes to the bootstrap allGather.
constexpr size_t kUcxAddrMax = 4088;
struct UcxAddrRecord {
  uint32_t len;        // 0: this rank has no UCX worker for this communicator
  uint32_t directKiB;  // its LOOM_UCX_RENDEZVOUS_BYTES in KiB (0: no direct transfers)
  uint8_t addr[kUcxAddrMax];
};
static_assert(sizeof(UcxAddrRecord) == 4096, "UcxAddrRecord is a wire format");

class UcxWorker;

// Creates a context and worker.  tls: value for UCX_TLS ("" = UCX's own
// environment / default); slotBytes: the connections' slot payload (slot
// messages up to that size go eager).  On failure returns nullptr and says why.
std::shared_ptr<UcxWorker> ucxCreateWorker(int rank, const std::string& tls, size_t slotBytes, std::string* why);
// This worker's address as a bootstrap record (len 0 and *why if too big).
UcxAddrRecord ucxAddress(UcxWorker& w, std::string* why);
// Remembers peer `peer`'s address; its endpoint is made on first use.
void ucxSetPeerAddress(UcxWorker& w, int peer, const UcxAddrRecord& rec);

// peerPid > 0: the peer is a process on this host (same pid namespace),
// watched directly when UCX reaches it only through transports without
// peer-failure handling (UCX 1.13's shared memory); 0 otherwise.
// directMin: point-to-point steps of at least this many bytes go as direct
// transfers (0: never); both ends must pass the same value.
std::unique_ptr<Connection> makeUcxConnection(std::shared_ptr<UcxWorker> w, int rank, int peer,
                                              int channel, size_t slotBytes, int slots, int peerPid,
                                              size_t directMin);

// The plug-in (ucx_plugin.cc): one worker per communicator, made when some
// peer is left for UCX; its address is the init record (UcxAddrRecord).
std::unique_ptr<Transport> makeUcxTransport();

}  // namespace loom
