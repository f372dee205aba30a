#include "src/core/p2p_tagged.h"

#include <algorithm>
#include <cstring>

#include "src/core/backoff.h"
#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

TaggedP2P::TaggedP2P(int rank, int nranks, TaggedLimits limits)
    : rank_(rank), nranks_(nranks), limits_(limits), in_(size_t(nranks)), sendSeq_(size_t(nranks), 0),
      cts_(size_t(nranks)) {}

std::string TaggedP2P::describe(const OpDesc& op) const {
  size_t bytes = op.count * dtypeSize(op.dtype);
  if (op.isSend) return strf("SendTagged (to rank %d, tag %d, %zu bytes)", op.peer, op.tag, bytes);
  std::string from = op.peer < 0 ? "any source" : strf("rank %d", op.peer);
  std::string tag = op.tag < 0 ? "any tag" : strf("tag %d", op.tag);
  return strf("RecvTagged (from %s, %s, up to %zu bytes)", from.c_str(), tag.c_str(), bytes);
}

loomResult_t TaggedP2P::run(ExecEnv& env, TaggedHost& host, const std::vector<OpDesc>& ops, std::string* usage) {
  recvs_.clear();
  sends_.clear();
  usage_.clear();
  sendQueue_.assign(size_t(nranks_), {});
  deadAny_.assign(size_t(nranks_), false);
  // Sends to this rank are copied into the stash first, so that a receive
  // of the same group (or a later call) finds them.
  for (const OpDesc& op : ops) {
    if (!op.isSend) continue;
    Send s;
    s.op = &op;
    s.bytes = op.count * dtypeSize(op.dtype);
    if (op.peer == rank_) {
      Msg m;
      m.src = rank_;
      m.tag = op.tag;
      m.seq = sendSeq_[size_t(rank_)]++;
      m.bytes = s.bytes;
      m.complete = true;
      m.data.assign(static_cast<const uint8_t*>(op.sendbuf), static_cast<const uint8_t*>(op.sendbuf) + s.bytes);
      stashBytes_ += s.bytes;
      stash_.push_back(std::move(m));
      continue;
    }
    sendQueue_[size_t(op.peer)].push_back(sends_.size());
    sends_.push_back(s);
  }
  for (const OpDesc& op : ops) {
    if (op.isSend) continue;
    Recv r;
    r.op = &op;
    r.esz = dtypeSize(op.dtype);
    r.cap = op.count * r.esz;
    recvs_.push_back(r);
  }
  // Posted receives take stashed messages first, in posting order.
  for (size_t i = 0; i < recvs_.size(); ++i) postFromStash(i);

  Backoff backoff(env.spinUs(), env.oversubscribed(), env.cpuContention());
  int64_t lastCheck = nowNs();
  std::vector<pollfd> fds;
  for (;;) {
    bool progressed = pass(env, host);
    if (finished(host)) break;
    if (progressed) {
      backoff.reset();
      continue;
    }
    if (backoff.spin()) continue;
    env.checkAborted();
    int64_t now = backoff.lastNs();
    if (now - lastCheck > 20 * 1000000LL) {
      lastCheck = now;
      checkPeers(env, host);
    }
    if (backoff.waited() / 1000000 > env.timeoutMs()) timeout(env, host);
    // Sleep on every open tagged connection: any peer may send.
    bool doorbell = false;
    auto collect = [&] {
      fds.clear();
      for (int p = 0; p < nranks_; ++p) {
        if (p == rank_ || deadAny_[size_t(p)]) continue;
        Connection* c = host.taggedConnection(p);  // opened or looked for in pass()
        if (!c) continue;
        if (c->usesDoorbell()) doorbell = true;
        else c->addPollFds(fds);
      }
    };
    collect();
    const bool withFds = !fds.empty();
    uint32_t token = env.sleepBegin(withFds);
    if (pass(env, host)) {
      env.sleepEnd();
      backoff.reset();
      continue;
    }
    collect();
    if (withFds != !fds.empty()) {  // a connection opened in pass(): see the executor's loop
      env.sleepEnd();
      continue;
    }
    // A peer that has not opened its connection yet cannot wake us: 5 ms at most.
    env.sleepWait(token, fds, doorbell, 5000);
    env.sleepEnd();
  }
  if (usage_.empty()) return loomSuccess;
  *usage = usage_[0];
  for (size_t i = 1; i < usage_.size(); ++i) *usage += "; " + usage_[i];
  return loomInvalidUsage;
}

bool TaggedP2P::finished(TaggedHost& host) {
  for (const Send& s : sends_)
    if (s.st != Send::Done) return false;
  for (const Recv& r : recvs_)
    if (r.st != Recv::Done && r.st != Recv::Failed) return false;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    if (!cts_[size_t(p)].empty()) return false;
    if (deadAny_[size_t(p)]) continue;
    Connection* c = host.taggedConnection(p);
    if (c && !c->sendIdle()) return false;
  }
  return true;
}

bool TaggedP2P::fits(Recv& r, int src, int tag, uint64_t bytes) {
  if (bytes <= r.cap && bytes % r.esz == 0) return true;
  std::string why = bytes > r.cap ? strf("is larger than the receive buffer (%zu bytes)", r.cap)
                                  : strf("is not a whole number of %s elements", dtypeName(r.op->dtype));
  usage_.push_back(strf("rank %d: %s matched a message of %llu bytes from rank %d with tag %d, which %s; the "
                        "message stays queued for another receive",
                        rank_, describe(*r.op).c_str(), (unsigned long long)bytes, src, tag, why.c_str()));
  r.st = Recv::Failed;
  return false;
}

void TaggedP2P::complete(Recv& r, int src, int tag, uint64_t bytes) {
  r.st = Recv::Done;
  if (r.op->status) {
    r.op->status->source = src;
    r.op->status->tag = tag;
    r.op->status->count = size_t(bytes / r.esz);
  }
  if (r.op->peer < 0) rrStart_ = (src + 1) % nranks_;
}

void TaggedP2P::postFromStash(size_t ri) {
  Recv& r = recvs_[ri];
  for (auto it = stash_.begin(); it != stash_.end(); ++it) {
    Msg& m = *it;
    if (m.claimed) continue;
    if (r.op->peer >= 0 && m.src != r.op->peer) continue;
    if (r.op->tag >= 0 && m.tag != r.op->tag) continue;
    if (!fits(r, m.src, m.tag, m.bytes)) return;
    if (m.rdv) {
      // The sender waits for our Cts; its data then comes straight here.
      In& in = in_[size_t(m.src)];
      if (in.kind != In::Idle)
        fail(loomRemoteError, "rank %d: rank %d sent data of another message before the one it announced",
             rank_, m.src);
      in.kind = In::Rdv;
      in.seq = m.seq;
      in.total = m.bytes;
      in.done = 0;
      in.dest = static_cast<uint8_t*>(r.op->recvbuf);
      in.msg = nullptr;
      in.recv = int(ri);
      cts_[size_t(m.src)].push_back(m.seq);
      r.st = Recv::Receiving;
      r.from = m.src;
      stash_.erase(it);
      return;
    }
    m.claimed = true;
    r.st = Recv::FromStash;
    r.msg = it;
    r.from = m.src;
    return;
  }
}

int TaggedP2P::matchArrival(int src, int tag, uint64_t bytes) {
  for (size_t i = 0; i < recvs_.size(); ++i) {
    Recv& r = recvs_[i];
    if (r.st != Recv::Unmatched) continue;
    if (r.op->peer >= 0 && r.op->peer != src) continue;
    if (r.op->tag >= 0 && r.op->tag != tag) continue;
    if (fits(r, src, tag, bytes)) return int(i);
  }
  return -1;
}

bool TaggedP2P::pass(ExecEnv& env, TaggedHost& host) {
  (void)env;
  bool progressed = false;
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_ || deadAny_[size_t(p)]) continue;
    guarded(p, [&] {
      if (Connection* c = host.taggedConnection(p)) c->progress();
    });
  }
  // Clear-to-send frames for messages we matched.
  for (int p = 0; p < nranks_; ++p) {
    auto& q = cts_[size_t(p)];
    if (q.empty()) continue;
    Connection* c = host.taggedConnection(p);
    while (c && !q.empty()) {
      if (!c->sendAcquire()) break;
      SlotTag t{};
      t.seq = q.front();
      t.coll = uint8_t(Collective::P2P);
      t.op = kCts;
      t.flags = kTagTagged;
      c->sendPost(t);
      q.pop_front();
      progressed = true;
    }
  }
  for (int p = 0; p < nranks_; ++p) {
    auto& q = sendQueue_[size_t(p)];
    for (size_t idx : q) {
      Send& s = sends_[idx];
      if (s.st == Send::Done) continue;
      progressed |= advanceSend(host, s);
      break;  // one message's data at a time per peer
    }
  }
  // Read every peer, in turn from rrStart_.
  for (int k = 0; k < nranks_; ++k) {
    int p = (rrStart_ + k) % nranks_;
    if (p == rank_ || deadAny_[size_t(p)]) continue;
    guarded(p, [&] {
      if (Connection* c = host.taggedConnection(p)) progressed |= drainPeer(p, c);
    });
  }
  // Receives that matched a stashed message still arriving.
  for (Recv& r : recvs_) {
    if (r.st != Recv::FromStash || !r.msg->complete) continue;
    Msg& m = *r.msg;
    if (m.bytes) memcpy(r.op->recvbuf, m.data.data(), m.bytes);
    complete(r, m.src, m.tag, m.bytes);
    stashBytes_ -= m.data.size();
    stash_.erase(r.msg);
    progressed = true;
  }
  return progressed;
}

bool TaggedP2P::needs(int p) const {
  if (in_[size_t(p)].kind != In::Idle) return true;
  for (const Send& s : sends_)
    if (s.st != Send::Done && s.op->peer == p) return true;
  for (const Recv& r : recvs_)
    if ((r.st == Recv::Unmatched && r.op->peer == p) || ((r.st == Recv::Receiving || r.st == Recv::FromStash) && r.from == p))
      return true;
  return !cts_[size_t(p)].empty();
}

template <class F>
void TaggedP2P::guarded(int p, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    // A broken connection to a rank this batch does not wait on (one that
    // may have finished and exited) only takes it out of any-source matching.
    if (e.code() != loomRemoteError || needs(p)) throw;
    deadAny_[size_t(p)] = true;
  }
}

bool TaggedP2P::advanceSend(TaggedHost& host, Send& s) {
  Connection* c = host.taggedConnection(s.op->peer);
  if (!c) return false;
  if (s.st == Send::Queued) {
    s.seq = sendSeq_[size_t(s.op->peer)]++;
    s.st = s.bytes <= limits_.eagerBytes ? Send::Eager : Send::Rts;
  }
  auto make = [&](Frame kind, uint32_t n) {
    SlotTag t{};
    t.seq = s.seq;
    t.count = s.bytes;
    t.bytes = n;
    t.coll = uint8_t(Collective::P2P);
    t.dtype = uint8_t(s.op->dtype);
    t.op = kind;
    t.flags = kTagTagged;
    t.root = s.op->tag;
    return t;
  };
  bool progressed = false;
  if (s.st == Send::Rts) {
    if (!c->sendAcquire()) return false;
    c->sendPost(make(kRts, 0));
    s.st = Send::WaitCts;
    return true;
  }
  if (s.st != Send::Eager && s.st != Send::Data) return false;
  const uint8_t* src = static_cast<const uint8_t*>(s.op->sendbuf);
  while (s.done < s.bytes || !s.posted) {
    void* out = c->sendAcquire();
    if (!out) return progressed;
    size_t n = std::min<uint64_t>(c->slotBytes(), s.bytes - s.done);
    if (n) memcpy(out, src + s.done, n);
    c->sendPost(make(s.st == Send::Eager ? kEager : kRdvData, uint32_t(n)));
    s.done += n;
    s.posted = true;
    progressed = true;
  }
  s.st = Send::Done;
  return true;
}

bool TaggedP2P::drainPeer(int p, Connection* c) {
  bool progressed = false;
  for (;;) {
    SlotTag t;
    const void* data = c->recvPeek(&t);
    if (!data) return progressed;
    if (!frame(p, c, t, data)) return progressed;
    progressed = true;
  }
}

bool TaggedP2P::frame(int p, Connection* c, const SlotTag& t, const void* data) {
  if (!(t.flags & kTagTagged) || t.coll != uint8_t(Collective::P2P) || t.bytes > c->slotBytes())
    fail(loomRemoteError, "rank %d: rank %d sent a slot that is no tagged message on the tagged channel", rank_, p);
  In& in = in_[size_t(p)];
  if (t.op == kCts) {
    for (size_t idx : sendQueue_[size_t(p)]) {
      Send& s = sends_[idx];
      if (s.st == Send::WaitCts && s.seq == t.seq) {
        s.st = Send::Data;
        c->recvRelease();
        return true;
      }
    }
    fail(loomRemoteError, "rank %d: rank %d cleared message #%llu to be sent, which this rank does not send", rank_,
         p, (unsigned long long)t.seq);
  }
  if ((t.op == kEager || t.op == kRts) && in.kind == In::Idle) {
    uint64_t bytes = t.count;
    int r = matchArrival(p, t.root, bytes);
    if (t.op == kRts) {
      if (t.bytes != 0) fail(loomRemoteError, "rank %d: rank %d sent a ready-to-send frame with data", rank_, p);
      if (r >= 0) {
        in = In{In::Rdv, t.seq, bytes, 0, static_cast<uint8_t*>(recvs_[size_t(r)].op->recvbuf), nullptr, r};
        recvs_[size_t(r)].st = Recv::Receiving;
        recvs_[size_t(r)].from = p;
        cts_[size_t(p)].push_back(t.seq);
      } else {
        Msg m;
        m.src = p;
        m.tag = t.root;
        m.seq = t.seq;
        m.bytes = bytes;
        m.rdv = true;
        m.complete = true;
        stash_.push_back(std::move(m));
      }
      c->recvRelease();
      return true;
    }
    if (r >= 0) {
      in = In{In::Eager, t.seq, bytes, 0, static_cast<uint8_t*>(recvs_[size_t(r)].op->recvbuf), nullptr, r};
      recvs_[size_t(r)].st = Recv::Receiving;
      recvs_[size_t(r)].from = p;
    } else {
      // Unexpected: keep it, within the stash's bound (else the sender waits).
      if (bytes > limits_.stashBytes || stashBytes_ > limits_.stashBytes - bytes) return false;
      Msg m;
      m.src = p;
      m.tag = t.root;
      m.seq = t.seq;
      m.bytes = bytes;
      m.data.resize(bytes);
      stashBytes_ += bytes;
      stash_.push_back(std::move(m));
      Msg* mp = &stash_.back();
      in = In{In::Eager, t.seq, bytes, 0, mp->data.data(), mp, -1};
    }
    consume(p, c, t, data);
    return true;
  }
  bool continues = (t.op == kEager && in.kind == In::Eager) || (t.op == kRdvData && in.kind == In::Rdv);
  if (!continues || t.seq != in.seq)
    fail(loomRemoteError, "rank %d: rank %d sent frame %u of message #%llu while message #%llu was in progress", rank_,
         p, unsigned(t.op), (unsigned long long)t.seq, (unsigned long long)in.seq);
  consume(p, c, t, data);
  return true;
}

void TaggedP2P::consume(int p, Connection* c, const SlotTag& t, const void* data) {
  In& in = in_[size_t(p)];
  if (t.bytes > in.total - in.done)
    fail(loomRemoteError, "rank %d: rank %d sent more than the %llu bytes of message #%llu", rank_, p,
         (unsigned long long)in.total, (unsigned long long)in.seq);
  if (t.bytes) memcpy(in.dest + in.done, data, t.bytes);
  in.done += t.bytes;
  c->recvRelease();
  if (in.done < in.total) return;
  if (in.recv >= 0) complete(recvs_[size_t(in.recv)], p, t.root, in.total);
  else in.msg->complete = true;
  in = In{};
}

void TaggedP2P::checkPeers(ExecEnv& env, TaggedHost& host) {
  // The peers this batch waits on: a send's destination, a receive's
  // source (any-source: every peer; it fails once none is left alive).
  std::vector<bool> need(size_t(nranks_), false);
  bool any = false;
  for (const Send& s : sends_)
    if (s.st != Send::Done) need[size_t(s.op->peer)] = true;
  for (const Recv& r : recvs_) {
    if (r.st == Recv::Receiving || r.st == Recv::FromStash) need[size_t(r.from)] = true;
    else if (r.st == Recv::Unmatched && r.op->peer >= 0) need[size_t(r.op->peer)] = true;
    else if (r.st == Recv::Unmatched) any = true;
  }
  for (int p = 0; p < nranks_; ++p) {
    if (p == rank_) continue;
    Connection* c = host.taggedConnection(p);
    if (need[size_t(p)]) env.checkStalled(SlotTag{0, 0, 0, uint8_t(Collective::P2P), 0, 0, kTagTagged, 0, 0}, p);
    if (!c || (!need[size_t(p)] && !(any && !deadAny_[size_t(p)]))) continue;
    try {
      c->checkPeer();
    } catch (const Error&) {
      // What it posted before it died still counts.
      if (drainPeer(p, c)) return;
      if (need[size_t(p)]) throw;
      deadAny_[size_t(p)] = true;
    }
  }
  if (!any) return;
  for (int p = 0; p < nranks_; ++p)
    if (p != rank_ && !deadAny_[size_t(p)]) return;
  for (const Recv& r : recvs_)
    if (r.st == Recv::Unmatched && r.op->peer < 0)
      fail(loomRemoteError, "rank %d: %s cannot complete: every other rank is dead", rank_, describe(*r.op).c_str());
}

void TaggedP2P::timeout(ExecEnv& env, TaggedHost& host) {
  long long ms = (long long)env.timeoutMs();
  for (const Recv& r : recvs_) {
    if (r.st == Recv::Done || r.st == Recv::Failed) continue;
    if (r.st == Recv::Unmatched)
      fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for a matching message (%zu messages "
           "stashed here, none matches)", rank_, describe(*r.op).c_str(), ms, stash_.size());
    const In& in = in_[size_t(r.from)];
    fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (%llu of %llu bytes received)",
         rank_, describe(*r.op).c_str(), ms, r.from, (unsigned long long)in.done, (unsigned long long)in.total);
  }
  for (const Send& s : sends_) {
    if (s.st == Send::Done) continue;
    const char* what = !host.taggedConnection(s.op->peer)
                           ? "to open its tagged connection (it does at its first tagged operation)"
                       : s.st == Send::WaitCts
                           ? "to post a matching receive (rendezvous: the message is larger than LOOM_TAGGED_EAGER_BYTES)"
                           : "to take more of the message (it runs no tagged operation, or its stash is full)";
    fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d %s (%llu of %llu bytes sent)",
         rank_, describe(*s.op).c_str(), ms, s.op->peer, what, (unsigned long long)s.done,
         (unsigned long long)s.bytes);
  }
  fail(loomTimeout, "rank %d: tagged point-to-point operation made no progress for %lld ms (flushing sends)", rank_,
       ms);
}

}  // namespace loom
