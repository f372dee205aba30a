#include "src/core/executor.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "src/core/backoff.h"
#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/core/hot.h"
#include "src/core/trace.h"
#include "src/device/device.h"
#include "src/device/host_reduce.h"

namespace loom {

std::string describeTag(const SlotTag& t) {
  Collective c = Collective(t.coll);
  if (t.flags & kTagTagged) return strf("tagged Send/Recv (tag %d)", t.root);
  std::string s = strf("%s #%llu (count %llu, %s", collectiveName(c), (unsigned long long)t.seq,
                       (unsigned long long)t.count, dtypeName(loomDataType_t(t.dtype)));
  if (reduces(c)) s += strf(", %s", redOpName(loomRedOp_t(t.op)));
  if (rooted(c)) s += strf(", root %d", t.root);
  if (t.flags & kTagPartOfAllToAllv) s += ", part of AllToAllv";
  return s + ")";
}

LOOM_HOT SlotTag operationTag(const OpDesc& op, uint64_t seq) {
  SlotTag t{};
  t.seq = seq;
  t.coll = uint8_t(op.coll);
  t.count = op.count;
  t.dtype = uint8_t(op.dtype);
  t.op = reduces(op.coll) ? uint8_t(op.op) : 0;
  t.root = rooted(op.coll) ? op.root : 0;
  if (op.coll == Collective::P2P && op.inAllToAllv) t.flags |= kTagPartOfAllToAllv;
  return t;
}

LOOM_HOT bool sameOperation(const SlotTag& got, const SlotTag& want) {
  return got.seq == want.seq && got.count == want.count && got.coll == want.coll && got.dtype == want.dtype &&
         got.op == want.op && got.root == want.root &&
         (got.flags & kTagPartOfAllToAllv) == (want.flags & kTagPartOfAllToAllv);
}

void failMismatch(int me, int peer, const SlotTag& got, const SlotTag& want) {
  // The same call on both sides, run different ways: the data went where
  // the other rank does not look (a path, or a slot size, it did not pick).
  if (sameOperation(got, want))
    fail(loomInvalidUsage,
         "rank %d: mismatched operations: rank %d runs %s another way than rank %d: inside groups "
         "(loomGroupStart/End) that hold different operations, or with settings that differ",
         me, peer, describeTag(got).c_str(), me);
  fail(loomInvalidUsage, "rank %d: mismatched operations: rank %d called %s while rank %d called %s", me, peer,
       describeTag(got).c_str(), me, describeTag(want).c_str());
}

uint8_t* ScratchBuffer::get(size_t bytes, Device& device, int rank) {
  if (bytes > bytes_ || mem_.get_deleter().device != &device) {
    size_t size = (bytes + 4095) & ~size_t(4095);
    mem_.reset();
    bytes_ = 0;
    void* p = device.allocate(size);
    if (!p)
      fail(loomSystemError, "rank %d: cannot allocate %zu bytes of scratch space on the %s device", rank, size,
           device.name());
    mem_ = std::unique_ptr<uint8_t, Free>(static_cast<uint8_t*>(p), Free{&device});
    bytes_ = size;
  }
  return mem_.get();
}

namespace {

// Where a lane's current step stands with DirectTransfer (transports/transport.h).
enum class DirectPhase : uint8_t { None, Started, Slots };

struct LaneState {
  const Lane* lane;
  const ExecOp* op;
  size_t esz;
  size_t cur = 0;   // current step
  size_t done = 0;  // bytes of the current step done
  bool finished = false;
  DirectPhase direct = DirectPhase::None;
  // LOOM_TRACE: when the current step started, and its time moving and reducing.
  bool stepStarted = false;
  double stepBeginUs = 0, moveUs = 0, reduceUs = 0;
  std::vector<size_t> blockers;  // lanes that must finish first (shared connections)
  std::vector<Connection*> sendConn, recvConn;  // per step
};

class Runner {
 public:
  Runner(ExecEnv& env, const std::vector<ExecOp>& ops, const Schedule& sched) : env_(env), tracer_(env.tracer()) {
    std::vector<std::pair<int, int>> needed;
    for (const Lane& l : sched.lanes)
      for (const Step& s : l.steps) {
        if (s.recvPeer >= 0) needed.emplace_back(s.recvPeer, l.channel);
        if (s.sendPeer >= 0) needed.emplace_back(s.sendPeer, l.channel);
      }
    std::sort(needed.begin(), needed.end());
    needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
    env.prepare(needed);

    // (connection, direction) -> lanes using it, to serialise lanes that share one.
    std::map<std::pair<Connection*, int>, std::vector<size_t>> users;
    for (const Lane& l : sched.lanes) {
      LaneState st;
      st.lane = &l;
      st.op = &ops[size_t(l.op)];
      st.esz = dtypeSize(st.op->dtype);
      size_t idx = lanes_.size();
      for (const Step& s : l.steps) {
        Connection* sc = s.sendPeer >= 0 ? env.connection(s.sendPeer, l.channel) : nullptr;
        Connection* rc = s.recvPeer >= 0 ? env.connection(s.recvPeer, l.channel) : nullptr;
        st.sendConn.push_back(sc);
        st.recvConn.push_back(rc);
        const std::pair<Connection*, int> keys[] = {{sc, 0}, {rc, 1}};
        for (auto key : keys) {
          if (!key.first) continue;
          auto& v = users[key];
          if (v.empty() || v.back() != idx) v.push_back(idx);
          if (std::find(conns_.begin(), conns_.end(), key.first) == conns_.end())
            conns_.push_back(key.first);
        }
      }
      lanes_.push_back(std::move(st));
    }
    for (auto& kv : users)
      for (size_t i = 1; i < kv.second.size(); ++i)
        lanes_[kv.second[i]].blockers.push_back(kv.second[i - 1]);
    for (size_t i = 0; i < sched.lanes.size(); ++i)
      for (int a : sched.lanes[i].after) {
        if (a < 0 || size_t(a) >= i)
          fail(loomInternalError, "rank %d: lane %zu waits for lane %d, which does not precede it", env.rank(), i, a);
        lanes_[i].blockers.push_back(size_t(a));
      }
    for (Connection* c : conns_) {
      if (c->usesDoorbell()) doorbell_ = true;
      else pollers_.push_back(c);
    }
  }

  uint64_t run() {
    Backoff backoff(env_.spinUs(), env_.oversubscribed(), env_.cpuContention());
    int64_t lastCheck = 0;
    for (;;) {
      bool progressed = pass();
      if (remaining_ == 0 && flushed()) return bytesSent_;
      if (progressed) {
        backoff.reset();
        continue;
      }
      if (backoff.spin()) continue;
      // Idle past the spin budget: check for failures, then sleep.
      env_.checkAborted();
      int64_t now = backoff.lastNs();
      if (now - lastCheck > 20 * 1000000LL) {
        lastCheck = now;
        try {
          // Only the peers we are waiting on now: a peer that finished its
          // part of the operation may already have exited.
          for (const LaneState& l : lanes_) {
            if (l.finished || l.cur >= l.lane->steps.size()) continue;
            if (l.recvConn[l.cur]) l.recvConn[l.cur]->checkPeer();
            if (l.sendConn[l.cur]) l.sendConn[l.cur]->checkPeer();
          }
        } catch (const Error&) {
          // A peer that exited may have posted its last slots after our
          // last look: fail only if they do not let us move.
          if (pass()) {
            backoff.reset();
            continue;
          }
          throw;
        }
        for (const LaneState& l : lanes_) {
          if (l.finished || l.cur >= l.lane->steps.size()) continue;
          const Step& st = l.lane->steps[l.cur];
          if (st.recvPeer >= 0) env_.checkStalled(l.op->tag, st.recvPeer);
          if (st.sendPeer >= 0) env_.checkStalled(l.op->tag, st.sendPeer);
        }
      }
      if (backoff.waited() / 1000000 > env_.timeoutMs()) timeout();
      fds_.clear();
      for (Connection* c : pollers_) c->addPollFds(fds_);
      const bool withFds = !fds_.empty();
      uint32_t token = env_.sleepBegin(withFds);
      if (pass()) {
        env_.sleepEnd();
        backoff.reset();
        continue;
      }
      if (!pollers_.empty()) {  // pass() may have changed what the sockets wait for
        fds_.clear();
        for (Connection* c : pollers_) c->addPollFds(fds_);
      }
      if (withFds != !fds_.empty()) {
        // Peers ring this rank the way begin() announced (futex or wake-up
        // socket), and sleepWait() would now wait the other way: a bell
        // would go unheard for the whole 5 ms.  Look again instead.
        env_.sleepEnd();
        continue;
      }
      env_.sleepWait(token, fds_, doorbell_, 5000);
      env_.sleepEnd();
    }
  }

 private:
  bool flushed() {
    for (Connection* c : conns_)
      if (!c->sendIdle()) return false;
    return true;
  }

  bool pass() {
    for (Connection* c : pollers_) c->progress();
    bool progressed = false;
    remaining_ = 0;
    for (LaneState& l : lanes_) {
      if (l.finished) continue;
      if (!l.blockers.empty()) {
        bool blocked = false;
        for (size_t b : l.blockers) blocked |= !lanes_[b].finished;
        if (blocked) {
          ++remaining_;
          continue;
        }
      }
      progressed |= advance(l);
      if (!l.finished) ++remaining_;
    }
    return progressed;
  }

  uint8_t* ptr(const LaneState& l, const BufRef& r) {
    if (r.buf == Buf::Send) return const_cast<uint8_t*>(l.op->send) + r.offset;
    if (r.buf == Buf::Recv) return l.op->recv + r.offset;
    if (r.buf == Buf::Scratch) return l.op->scratch + r.offset;
    return nullptr;
  }

  [[noreturn]] void mismatch(const LaneState& l, const SlotTag& got, int peer, size_t expectBytes) {
    SlotTag want = l.op->tag;
    want.bytes = uint32_t(expectBytes);
    if (sameOperation(got, want) && (got.flags & kTagDirect))
      fail(loomInvalidUsage, "rank %d: rank %d sends %s as a direct transfer where this rank expects %zu-byte slots",
           env_.rank(), peer, describeTag(want).c_str(), expectBytes);
    if (got.bytes != expectBytes && got.seq == want.seq && got.coll == want.coll &&
        got.count == want.count && got.dtype == want.dtype && got.root == want.root)
      fail(loomInvalidUsage,
           "rank %d: rank %d sent %u bytes for %s where %zu were expected (do the ranks use "
           "different LOOM_SLOT_BYTES, algorithms or buffers?)",
           env_.rank(), peer, got.bytes, describeTag(want).c_str(), expectBytes);
    failMismatch(env_.rank(), peer, got, want);
  }

  bool tagOk(const LaneState& l, const SlotTag& got, size_t expectBytes) {
    if (got.bytes != expectBytes) return false;
    return !env_.checkMode() || sameOperation(got, l.op->tag);
  }

  // Large point-to-point steps go straight into the receiver's buffer where
  // the connection offers it.  Both ends decide alike: a send step is always
  // matched by a receive step of the same bytes on the same connection,
  // whose threshold the two ends agreed on.
  DirectTransfer* directFor(const LaneState& l, const Step& s, Connection* sc, Connection* rc) const {
    if (l.direct == DirectPhase::Slots || Collective(l.op->tag.coll) != Collective::P2P) return nullptr;
    Connection* c = s.kind == StepKind::Send ? sc : s.kind == StepKind::Recv ? rc : nullptr;
    DirectTransfer* d = c ? c->direct() : nullptr;
    return d && d->directMinBytes() && s.bytes >= d->directMinBytes() ? d : nullptr;
  }

  // One look at a direct step: the sender posts its request, the receiver
  // checks it like any slot and offers its buffer; then both wait for the
  // transfer.  Slots: one end could not register its buffer.
  DirectTransfer::State stepDirect(LaneState& l, const Step& s, DirectTransfer* d, Connection* c, bool* progressed) {
    using State = DirectTransfer::State;
    if (s.kind == StepKind::Send) {
      if (l.direct == DirectPhase::None) {
        if (!d->directSend(ptr(l, s.src), s.bytes, l.op->tag)) return State::Waiting;
        l.direct = DirectPhase::Started;
        *progressed = true;
      }
      State st = d->directSendState();
      if (st == State::Waiting && d->directMoved()) *progressed = true;
      return st;
    }
    if (l.direct == DirectPhase::None) {
      SlotTag got;
      const void* in = c->recvPeek(&got);
      if (!in) return State::Waiting;
      uint64_t request[2] = {0, 0};  // bytes, 1: the data follows in slots
      if (got.bytes == sizeof request) memcpy(request, in, sizeof request);
      if (!sameOperation(got, l.op->tag)) failMismatch(env_.rank(), s.recvPeer, got, l.op->tag);
      if (!(got.flags & kTagDirect) || got.bytes != sizeof request || request[0] != s.bytes)
        fail(loomInvalidUsage,
             "rank %d: rank %d sent %s as %u-byte slots%s where this rank expects a direct transfer of %zu bytes",
             env_.rank(), s.recvPeer, describeTag(l.op->tag).c_str(), got.bytes,
             (got.flags & kTagDirect) ? strf(" (a direct request of %llu bytes)", (unsigned long long)request[0]).c_str()
                                      : "",
             s.bytes);
      c->recvRelease();
      l.direct = DirectPhase::Started;
      *progressed = true;
      if (request[1]) return State::Slots;
      d->directRecv(ptr(l, s.dst), s.bytes);
    }
    State st = d->directRecvState();
    if (st == State::Waiting && d->directMoved()) *progressed = true;
    return st;
  }

  void finalize(const LaneState& l, const Step& s, void* data, size_t bytes) {
    if (s.finalize && l.op->op == loomAvg && l.op->divisor > 1)
      l.op->device->divide(data, data, bytes / l.esz, l.op->dtype, l.op->divisor);
  }

  // Moves the lane's current step as far as its connections allow.
  bool advance(LaneState& l) {
    Device& dev = *l.op->device;
    bool progressed = false;
    while (l.cur < l.lane->steps.size()) {
      const Step& s = l.lane->steps[l.cur];
      Connection* sc = l.sendConn[l.cur];
      Connection* rc = l.recvConn[l.cur];
      if (tracer_ && !l.stepStarted) {
        l.stepStarted = true;
        l.stepBeginUs = Tracer::nowUs();
        l.moveUs = l.reduceUs = 0;
      }
      if (s.kind == StepKind::Copy) {
        double t0 = tracer_ ? Tracer::nowUs() : 0;
        if (s.bytes && ptr(l, s.src) != ptr(l, s.dst))
          dev.copy(ptr(l, s.dst), ptr(l, s.src), s.bytes, CopyHint::Cached);
        l.done = s.bytes;
        if (tracer_) l.moveUs += Tracer::nowUs() - t0;
      }
      if (DirectTransfer* d = l.done == 0 ? directFor(l, s, sc, rc) : nullptr) {
        double t0 = tracer_ ? Tracer::nowUs() : 0;
        DirectTransfer::State st = stepDirect(l, s, d, sc ? sc : rc, &progressed);
        if (tracer_) l.moveUs += Tracer::nowUs() - t0;
        if (st == DirectTransfer::State::Waiting) return progressed;
        if (st == DirectTransfer::State::Slots) {
          l.direct = DirectPhase::Slots;
        } else {
          l.done = s.bytes;
          if (sc) bytesSent_ += s.bytes;
        }
      }
      while (l.done < s.bytes) {
        size_t slot = (sc ? sc : rc)->slotBytes();
        size_t n = std::min(slot, s.bytes - l.done);
        SlotTag tag;
        const void* in = nullptr;
        void* out = nullptr;
        if (rc) {
          in = rc->recvPeek(&tag);
          if (!in) return progressed;
          if (!tagOk(l, tag, n)) mismatch(l, tag, s.recvPeer, n);
        }
        if (sc) {
          out = sc->sendAcquire();
          if (!out) return progressed;
        }
        uint8_t* src = ptr(l, s.src);
        uint8_t* dst = ptr(l, s.dst);
        size_t off = l.done;
        double t0 = tracer_ ? Tracer::nowUs() : 0;
        switch (s.kind) {
          case StepKind::Send:
            dev.copy(out, src + off, n, CopyHint::Cached);
            break;
          case StepKind::Recv:
            dev.copy(dst + off, in, n, CopyHint::Cached);
            break;
          case StepKind::RecvReduce:
            dev.reduce(dst + off, src + off, in, n / l.esz, l.op->dtype, l.op->op);
            finalize(l, s, dst + off, n);
            break;
          case StepKind::RecvReduceSend:
            dev.reduce(out, src + off, in, n / l.esz, l.op->dtype, l.op->op);
            finalize(l, s, out, n);
            if (dst) dev.copy(dst + off, out, n, CopyHint::Cached);
            break;
          case StepKind::RecvCopySend:
            dev.copy(out, in, n, CopyHint::Cached);
            if (dst) dev.copy(dst + off, in, n, CopyHint::Cached);
            break;
          case StepKind::Handshake:
            if (out) memset(out, 0, n);  // the tag says it all
            break;
          case StepKind::Copy:
            break;
        }
        if (tracer_) {
          double us = Tracer::nowUs() - t0;
          (s.kind == StepKind::RecvReduce || s.kind == StepKind::RecvReduceSend ? l.reduceUs : l.moveUs) += us;
        }
        if (sc) {
          SlotTag t = l.op->tag;
          t.bytes = uint32_t(n);
          sc->sendPost(t);
          bytesSent_ += n;
        }
        if (rc) rc->recvRelease();
        l.done += n;
        progressed = true;
      }
      if (tracer_) traceStep(l, s);
      ++l.cur;
      l.done = 0;
      l.direct = DirectPhase::None;
      progressed = true;
    }
    l.finished = true;
    return progressed;
  }

  void traceStep(LaneState& l, const Step& s) {
    l.stepStarted = false;
    tracer_->step(int(&l - lanes_.data()), l.stepBeginUs, Tracer::nowUs(), stepKindName(s.kind), s.recvPeer,
                  s.sendPeer, s.bytes, l.moveUs, l.reduceUs, describeTag(l.op->tag));
  }

  [[noreturn]] void timeout() {
    for (const LaneState& l : lanes_) {
      if (l.finished || l.cur >= l.lane->steps.size()) continue;
      const Step& s = l.lane->steps[l.cur];
      int peer = s.recvPeer >= 0 ? s.recvPeer : s.sendPeer;
      fail(loomTimeout,
           "rank %d: %s made no progress for %lld ms waiting for rank %d (%s, channel %d, step %zu of %zu, "
           "%zu of %zu bytes done)",
           env_.rank(), describeTag(l.op->tag).c_str(), (long long)env_.timeoutMs(), peer,
           s.recvPeer >= 0 ? "receiving" : "sending", l.lane->channel, l.cur + 1, l.lane->steps.size(),
           l.done, s.bytes);
    }
    fail(loomTimeout, "rank %d: operation made no progress for %lld ms (flushing sends)",
         env_.rank(), (long long)env_.timeoutMs());
  }

  ExecEnv& env_;
  Tracer* tracer_;  // LOOM_TRACE; nullptr when off
  std::vector<LaneState> lanes_;
  std::vector<Connection*> conns_;
  std::vector<Connection*> pollers_;
  std::vector<pollfd> fds_;
  bool doorbell_ = false;
  size_t remaining_ = 0;
  uint64_t bytesSent_ = 0;
};

// Every operation of a run uses one device, which can reach its buffers:
// host kernels given a CUDA pointer would fault instead of failing.
Device& runDevice(const ExecEnv& env, const std::vector<ExecOp>& ops) {
  Device* dev = ops.empty() ? &hostDevice() : ops[0].device;
  for (const ExecOp& op : ops) {
    if (!op.device || op.device != dev)
      fail(loomInternalError, "rank %d: the operations of one run use different devices", env.rank());
    if (!dev->canAccess(op.sendMem) || !dev->canAccess(op.recvMem)) {
      MemoryKind k = dev->canAccess(op.sendMem) ? op.recvMem : op.sendMem;
      fail(loomInvalidUsage, "rank %d: %s has a buffer in %s memory, which the %s device cannot access",
           env.rank(), describeTag(op.tag).c_str(), memoryKindName(k), dev->name());
    }
  }
  return *dev;
}

}  // namespace

uint64_t execute(ExecEnv& env, const std::vector<ExecOp>& ops, const Schedule& sched) {
  if (sched.lanes.empty()) return 0;
  Device& dev = runDevice(env, ops);
  size_t total = 0;
  for (size_t i = 0; i < ops.size(); ++i) total += (sched.scratchOf(int(i)) + 63) & ~size_t(63);
  if (total == 0) {
    Runner runner(env, ops, sched);
    return runner.run();
  }
  std::vector<ExecOp> withScratch(ops);
  uint8_t* base = env.scratch(total, dev);
  for (size_t i = 0; i < ops.size(); ++i) {
    withScratch[i].scratch = base;
    base += (sched.scratchOf(int(i)) + 63) & ~size_t(63);
  }
  Runner runner(env, withScratch, sched);
  return runner.run();
}

}  // namespace loom
