// Printing a stream program and handing it to a backend, after checking
// every address it will touch against the buffers it runs on.
#include "src/device/stream_program.h"

#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

const char* flagName(int f, bool replayable) {
  if (replayable) switch (f) {
      case kFlagGraphEnd:
        return "end";
      case kFlagGraphReset:
        return "reset";
      case kFlagGraphBusy:
        return "busy";
      case kFlagGraphSent:
        return "gsent";
      case kFlagGraphAcked:
        return "gacked";
      case kFlagGraphMessages:
        return "gmsgs";
      case kFlagGraphMessagesNot:
        return "gmsgsnot";
    }
  switch (f) {
    case kFlagInput:
      return "input";
    case kFlagReduced:
      return "reduced";
    case kFlagDone:
      return "done";
    case kFlagP2PSent:
      return "sent";
    case kFlagP2PAcked:
      return "acked";
    case kFlagP2PDone:
      return "p2pdone";
  }
  return "?";
}

std::string refName(const ProgramRef& r) {
  switch (r.space) {
    case Space::Send:
      return r.rank ? strf("send#%d+%zu", r.rank, r.offset) : strf("send+%zu", r.offset);
    case Space::Recv:
      return r.rank ? strf("recv#%d+%zu", r.rank, r.offset) : strf("recv+%zu", r.offset);
    case Space::Window:
      return strf("win[%d]+%zu", r.rank, r.offset);
    case Space::P2POut:
      return strf("out[%d]+%zu", r.rank, r.offset);
    case Space::P2PIn:
      return strf("in[%d]+%zu", r.rank, r.offset);
    case Space::Published:
      return strf("%s[%d]+%zu|win[%d]+%zu", r.cell < kCellRecv0 ? "send" : "recv", r.rank, r.offset, r.rank,
                  r.fallback);
  }
  return "?";
}

const char* cellName(int c) {
  switch (c) {
    case kCellSend0: return "send0";
    case kCellSend1: return "send1";
    case kCellRecv0: return "recv0";
    case kCellRecv1: return "recv1";
  }
  return "?";
}

}  // namespace

std::string StreamProgram::describe() const {
  std::string s;
  for (const StreamOp& o : ops) {
    s += strf("s%d ", o.stream);
    switch (o.kind) {
      case StreamOpKind::WaitFlag:
        s += strf("wait flag[%d].%s >= %llu", o.flagRank, flagName(o.flag, replayable), (unsigned long long)o.value);
        break;
      case StreamOpKind::SetFlag:
        s += strf("set flag[%d].%s = %llu", rank, flagName(o.flag, replayable), (unsigned long long)o.value);
        break;
      case StreamOpKind::SetPeerFlag:
        s += strf("set flag[%d].%s = %llu for rank %d", rank, flagName(o.flag, replayable), (unsigned long long)o.value,
                  o.flagRank);
        break;
      case StreamOpKind::SetCell:
        s += strf("publish cell[%d].%s for rank %d", rank, cellName(o.flag), o.flagRank);
        break;
      case StreamOpKind::SetCellTag:
        s += strf("tag cell[%d].slot%d = %llu for rank %d", rank, o.flag, (unsigned long long)o.value, o.flagRank);
        break;
      case StreamOpKind::Copy:
        s += strf("copy %s <- %s, %zu B", refName(o.dst).c_str(), refName(src(o, 0)).c_str(), o.count);
        break;
      case StreamOpKind::Reduce:
        s += strf("reduce %s%s%s <-", refName(o.dst).c_str(), o.dual ? " and " : "",
                  o.dual ? refName(o.dst2).c_str() : "");
        for (uint32_t i = 0; i < o.srcCount; ++i) s += " " + refName(src(o, i));
        s += strf(", %zu x %s %s", o.count, dtypeName(dtype), redOpName(op));
        break;
      case StreamOpKind::Divide:
        s += strf("divide %s <- %s / %d, %zu x %s", refName(o.dst).c_str(), refName(src(o, 0)).c_str(),
                  o.divisor, o.count, dtypeName(dtype));
        break;
      case StreamOpKind::RecordEvent:
        s += strf("record event %d", o.event);
        break;
      case StreamOpKind::WaitEvent:
        s += strf("wait event %d", o.event);
        break;
      case StreamOpKind::SetLocal:
        s += strf("set own flag[%d].%s = %llu", o.flagRank, flagName(o.flag, replayable),
                  (unsigned long long)o.value);
        break;
    }
    s += "\n";
  }
  return s;
}

namespace {

// Resolves refs of one program against its buffers; fails on anything out of bounds.
struct Resolver {
  const StreamProgram& p;
  const ProgramBuffers& b;
  size_t index = 0;

  [[noreturn]] void bad(const char* why) const {
    fail(loomInternalError, "rank %d: stream program op %zu: %s", p.rank, index, why);
  }
  uint8_t* at(const ProgramRef& r, size_t bytes, bool write) const {
    switch (r.space) {
      case Space::Send: {
        if (write) bad("writes the send buffer");
        if (r.rank < 0 || size_t(r.rank) > b.moreSends.size()) bad("names a send buffer it was not given");
        const size_t n = r.rank ? b.moreSends[size_t(r.rank - 1)].bytes : b.sendBytes;
        const void* base = r.rank ? b.moreSends[size_t(r.rank - 1)].p : b.send;
        if (r.offset > n || bytes > n - r.offset) bad("reads past the send buffer");
        return static_cast<uint8_t*>(const_cast<void*>(base)) + r.offset;
      }
      case Space::Recv: {
        if (r.rank < 0 || size_t(r.rank) > b.moreRecvs.size()) bad("names a recv buffer it was not given");
        const size_t n = r.rank ? b.moreRecvs[size_t(r.rank - 1)].bytes : b.recvBytes;
        void* base = r.rank ? b.moreRecvs[size_t(r.rank - 1)].p : b.recv;
        if (r.offset > n || bytes > n - r.offset) bad("goes past the recv buffer");
        return static_cast<uint8_t*>(base) + r.offset;
      }
      case Space::Window:
        if (r.rank < 0 || size_t(r.rank) >= b.windows.size()) bad("names a rank with no window");
        if (r.offset > b.windowBytes || bytes > b.windowBytes - r.offset) bad("goes past a window");
        return b.windows[size_t(r.rank)] + r.offset;
      case Space::P2POut:
      case Space::P2PIn: {
        const std::vector<uint8_t*>& regions = r.space == Space::P2POut ? b.p2pOut : b.p2pIn;
        if (r.rank < 0 || size_t(r.rank) >= regions.size() || !regions[size_t(r.rank)])
          bad("names a send/recv region it was not given");
        if (r.offset > b.p2pBytes || bytes > b.p2pBytes - r.offset) bad("goes past a send/recv region");
        return regions[size_t(r.rank)] + r.offset;
      }
      case Space::Published:
        // The fallback is checked here; the published range when the op
        // runs (CellRef).
        if (write) bad("writes a peer's published buffer");
        if (r.cell >= kCellCount) bad("names no cell");
        if (r.rank < 0 || size_t(r.rank) >= b.windows.size()) bad("names a rank with no window");
        if (r.fallback > b.windowBytes || bytes > b.windowBytes - r.fallback) bad("goes past a window");
        return b.windows[size_t(r.rank)] + r.fallback;
    }
    bad("names an unknown buffer");
  }
  // Where a Published ref's cell is (null: read the fallback, nobody publishes).
  CellRef cell(const ProgramRef& r) const {
    if (r.space != Space::Published || b.cells.empty()) return CellRef{};
    const uint64_t* row = b.cells[size_t(r.rank)];
    return CellRef{row + size_t(r.cell) * kCellWords, r.offset, row + kCellCount * kCellWords + r.cell % 2, r.minTag};
  }
};

}  // namespace

ProgramEnqueuer::ProgramEnqueuer(StreamBackend& be, const StreamProgram& p, const ProgramBuffers& b)
    : be_(be), p_(p), b_(b) {
  if (!dtypeSize(p.dtype))
    fail(loomInternalError, "rank %d: stream program of unknown datatype %d", p.rank, int(p.dtype));
  if (b.flags.size() != size_t(p.nranks) || b.windows.size() != size_t(p.nranks))
    fail(loomInternalError, "rank %d: stream program for %d ranks given buffers of %zu", p.rank, p.nranks,
         b.flags.size());
  if (!b.flagCopies.empty() && b.flagCopies.size() != size_t(p.nranks))
    fail(loomInternalError, "rank %d: stream program for %d ranks given %zu flag copies", p.rank, p.nranks,
         b.flagCopies.size());
  if (!b.cells.empty() && (b.cells.size() != size_t(p.nranks) || b.peerCells.size() != size_t(p.nranks) ||
                           b.published.size() != size_t(p.nranks)))
    fail(loomInternalError, "rank %d: stream program for %d ranks given cells of %zu", p.rank, p.nranks,
         b.cells.size());
  // Every op checked first: a bad program must not leave half of itself enqueued.
  for (size_t i = 0; i < p.ops.size(); ++i) visit(i, false);
  // Every side stream the program uses is joined back: its last op records
  // an event that a later op of stream 0 waits for (the caller's later
  // work follows it; in a capture, CUDA refuses to end one otherwise).  A
  // replayable program's busy mark goes down last, after every other op of
  // every stream: until then the watchdog, destroy and the reaper take a
  // replay to be running here.  (Streams were checked above: < p.streams.)
  std::vector<size_t> last(size_t(p.streams), p.ops.size());
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const StreamOp& o = p.ops[i];
    last[o.stream] = i;
    if (p.replayable && o.kind == StreamOpKind::SetLocal && o.flagRank == p.rank && o.flag == kFlagGraphBusy &&
        o.value == 0 && (i + 1 != p.ops.size() || o.stream != 0))
      fail(loomInternalError, "rank %d: replayable stream program zeroes its busy mark at op #%zu, before its end",
           p.rank, i);
  }
  for (int s = 1; s < p.streams; ++s) {
    const size_t l = last[size_t(s)];
    if (l == p.ops.size()) continue;
    bool joined = false;
    if (p.ops[l].kind == StreamOpKind::RecordEvent)
      for (size_t i = l + 1; i < p.ops.size() && !joined; ++i)
        joined = p.ops[i].stream == 0 && p.ops[i].kind == StreamOpKind::WaitEvent && p.ops[i].event == p.ops[l].event;
    if (!joined)
      fail(loomInternalError, "rank %d: stream program leaves stream %d unjoined: its last op (#%zu) is no event "
           "record that a later op of stream 0 waits for", p.rank, s, l);
  }
}

// A run of zeroings of this rank's own copies of the peers' flags
// (SetLocal to 0 of another rank's row, one stream, consecutive in the
// program: makeReplayable's and the send/recv graph programs' tails),
// which one setFlags enqueues.  Its own row's marks (busy, reset, the
// gate's mark) stay single ops in program order: the watchdog reads them
// and their order matters.
size_t ProgramEnqueuer::batchable(size_t index) const {
  auto zeroing = [&](const StreamOp& o, uint8_t stream) {
    return o.kind == StreamOpKind::SetLocal && o.value == 0 && o.flagRank != p_.rank && o.stream == stream;
  };
  const uint8_t s = p_.ops[index].stream;
  size_t end = index;
  while (end < p_.ops.size() && zeroing(p_.ops[end], s)) ++end;
  return end - index < 2 ? 1 : end - index;
}

bool ProgramEnqueuer::step(size_t n) {
  for (; n > 0 && next_ < p_.ops.size(); --n) {
    const size_t run = batchable(next_);
    if (run == 1) {
      visit(next_++, true);
      continue;
    }
    batch_.clear();
    for (size_t i = next_; i < next_ + run; ++i)
      batch_.push_back(b_.flags[size_t(p_.ops[i].flagRank)] + p_.ops[i].flag);
    be_.setFlags(p_.ops[next_].stream, batch_.data(), batch_.size(), p_.ops[next_].value);
    next_ += run;
  }
  return next_ == p_.ops.size();
}

// Checks op `index`; with `enqueue`, also enqueues it.
void ProgramEnqueuer::visit(size_t index, bool enqueue) {
  const StreamProgram& p = p_;
  const ProgramBuffers& b = b_;
  StreamBackend& be = be_;
  const size_t esz = dtypeSize(p.dtype);
  Resolver res{p, b};
  res.index = index;
  std::vector<const void*>& srcs = srcs_;
  std::vector<CellRef>& cells = cells_;
  bool indirect = false;
  const StreamOp& o = p.ops[index];
  if (o.stream >= p.streams) res.bad("uses a stream the program does not declare");
  const size_t bytes = o.kind == StreamOpKind::Copy ? o.count : o.count * esz;
  void* dst = nullptr;
  void* dst2 = nullptr;
  srcs.clear();
  cells.clear();
  switch (o.kind) {
    case StreamOpKind::WaitFlag:
    case StreamOpKind::SetFlag:
    case StreamOpKind::SetPeerFlag:
    case StreamOpKind::SetLocal:
      if (o.flag >= kFlagCount || o.flagRank < 0 || o.flagRank >= p.nranks) res.bad("names no flag");
      if (o.kind == StreamOpKind::SetFlag && o.flagRank != p.rank) res.bad("sets another rank's flag");
      if (o.kind == StreamOpKind::SetPeerFlag && b.peerFlags.size() != size_t(p.nranks))
        res.bad("sets a per-pair flag, but the buffers have no per-reader flag copies");
      break;
    case StreamOpKind::SetCell:
    case StreamOpKind::SetCellTag:
      if (o.flag >= (o.kind == StreamOpKind::SetCell ? kCellCount : kCellTagWords) || o.flagRank < 0 ||
          o.flagRank >= p.nranks || o.flagRank == p.rank)
        res.bad("names no peer's cell");
      if (b.cells.empty()) res.bad("publishes a cell, but the buffers have no cells");
      break;
    case StreamOpKind::RecordEvent:
    case StreamOpKind::WaitEvent:
      if (o.event < 0 || o.event >= p.events) res.bad("uses an event the program does not declare");
      break;
    case StreamOpKind::Copy:
    case StreamOpKind::Reduce:
    case StreamOpKind::Divide:
      if (o.srcCount == 0 || size_t(o.srcBegin) + o.srcCount > p.srcs.size()) res.bad("has no sources");
      if (o.kind != StreamOpKind::Reduce && o.srcCount != 1) res.bad("has more than one source");
      if (o.kind == StreamOpKind::Divide && o.divisor < 1) res.bad("divides by less than 1");
      dst = res.at(o.dst, bytes, true);
      if (o.dual && o.kind != StreamOpKind::Reduce) res.bad("has a second destination but is no reduction");
      if (o.dual) dst2 = res.at(o.dst2, bytes, true);
      for (uint32_t i = 0; i < o.srcCount; ++i) {
        srcs.push_back(res.at(p.src(o, i), bytes, false));
        cells.push_back(res.cell(p.src(o, i)));
        indirect = indirect || cells.back().cell;
      }
      if (o.kind == StreamOpKind::Divide && indirect) res.bad("divides a peer's published buffer");
      if (o.kind == StreamOpKind::Reduce) {
        // A backend may write dst before it has read every source (a
        // reduction over more sources than one kernel takes is chained
        // through dst), so dst may be a source exactly only in one pass;
        // dst2 is written last, so it may be a source exactly.  (A
        // published source is in a peer's memory, never this rank's.)
        auto overlap = [&](const void* a, const void* c) {
          auto x = static_cast<const uint8_t*>(a), y = static_cast<const uint8_t*>(c);
          return x < y + bytes && y < x + bytes;
        };
        for (const void* s : srcs) {
          if (bytes && overlap(dst, s) && !(dst == s && o.srcCount <= kOnePassSources))
            res.bad("reduces into one of its sources");
          if (bytes && dst2 && s != dst2 && overlap(dst2, s)) res.bad("writes its second destination over part of a source");
        }
        if (bytes && dst2 && overlap(dst, dst2)) res.bad("has overlapping destinations");
      }
      break;
  }
  if (!enqueue) return;
  switch (o.kind) {
    case StreamOpKind::WaitFlag:
      be.waitFlag(o.stream, b.flags[size_t(o.flagRank)] + o.flag, o.value, o.flagRank);
      break;
    case StreamOpKind::SetFlag:
      if (b.flagCopies.empty()) be.setFlag(o.stream, b.flags[size_t(p.rank)] + o.flag, o.value);
      for (uint64_t* copy : b.flagCopies) be.setFlag(o.stream, copy + o.flag, o.value);
      break;
    case StreamOpKind::SetPeerFlag:
      be.setFlag(o.stream, b.peerFlags[size_t(o.flagRank)] + o.flag, o.value);
      break;
    case StreamOpKind::SetCell: {
      const ProgramBuffers::Cell& c = b.published[size_t(o.flagRank)][o.flag];
      uint64_t* at = b.peerCells[size_t(o.flagRank)] + size_t(o.flag) * kCellWords;
      // addr = 0, bytes, addr: a reader that sees the same nonzero addr
      // before and after reading bytes has that buffer's size, even one
      // released while this rewrites the cell (the kernels' resolveSource).
      be.setFlag(o.stream, at, 0);
      be.setFlag(o.stream, at + 1, c.bytes);
      be.setFlag(o.stream, at, c.addr);
      break;
    }
    case StreamOpKind::SetCellTag:
      be.setFlag(o.stream, b.peerCells[size_t(o.flagRank)] + kCellCount * kCellWords + o.flag, o.value);
      break;
    case StreamOpKind::Copy:
      if (indirect)
        be.copyIndirect(o.stream, dst, srcs[0], cells[0], o.count);
      else
        be.copy(o.stream, dst, srcs[0], o.count);
      break;
    case StreamOpKind::Reduce:
      if (indirect)
        be.reduceIndirect(o.stream, dst, dst2, srcs.data(), cells.data(), int(srcs.size()), o.count, p.dtype, p.op);
      else
        be.reduce(o.stream, dst, dst2, srcs.data(), int(srcs.size()), o.count, p.dtype, p.op);
      break;
    case StreamOpKind::Divide:
      be.divide(o.stream, dst, srcs[0], o.count, p.dtype, o.divisor);
      break;
    case StreamOpKind::RecordEvent:
      be.recordEvent(o.stream, o.event);
      break;
    case StreamOpKind::WaitEvent:
      be.waitEvent(o.stream, o.event);
      break;
    case StreamOpKind::SetLocal:
      be.setFlag(o.stream, b.flags[size_t(o.flagRank)] + o.flag, o.value);
      break;
  }
}

void enqueueProgram(StreamBackend& be, const StreamProgram& p, const ProgramBuffers& b) {
  ProgramEnqueuer(be, p, b).step(p.ops.size());
}

}  // namespace loom
