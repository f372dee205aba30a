// Compiles a collective into per-rank stream programs over peer windows.
//
// The data is cut into rounds that fit one window slot.  Round g of the
// communicator uses slot g % 2 of every window and flag value v = g + 1.
// Per round each rank:
//   1. waits until every rank's done flag is >= g - 1 (everyone finished
//      reading round g - 2, which used the same slot) before writing its own
//      slot, so a slot is never overwritten while someone reads it;
//   2. copies into its slot the input of the round that other ranks read
//      (not the part only it reduces, nor its own all-to-all block), sets
//      input = v;
//   3. waits for the inputs it needs (input >= v of those ranks) and reduces
//      or copies straight out of their windows (and its own send buffer);
//   4. sets done = v once it reads no window of round g any more.
// The reduce-scatter + all-gather all-reduce adds a step between 3 and 4:
// each rank reduces its 1/N part into its slot, where that part of its
// input would be (it never stages it: it reads it from its send buffer), and, in
// the same kernel, into its output (a second destination; loomAvg divides
// in the slot and copies out instead), sets reduced = v, and a second stream
// copies the other ranks' parts out once all reduced flags reach v.  Stream 1
// is forked from the caller's stream at the start and joined back at the
// end (events), so the caller's earlier work precedes everything and its
// later work follows everything.
//
// Reductions combine the ranks' blocks in rank order, one rounding per step,
// so every rank (and the host one-shot path) computes bit-identical results.
// Memory traffic per rank and round of m elements (s = element size; bytes
// read plus bytes written, what bounds a large all-reduce on one GPU):
//   reduce-scatter + all-gather all-reduce: (N-1)/N*m*s copied in, its part
//     reduced from N sources into two destinations, (N-1)/N*m*s copied out:
//     (5N-2)/N*m*s, 4*m*s at N = 2 (11/2*m*s when every part went through
//     the slot: tests/unit_stream_program.cc checks the count);
//   one-shot all-reduce m*s copied in, N*m*s read; reduce-scatter (N-1)*m*s
//     copied in, N*m*s read; all-gather m*s copied in, N*m*s read;
//   broadcast m*s; reduce (root) N*m*s; all-to-all (N-1)*m*s copied in,
//   N*m*s read; gather (root) N*m*s; scatter m*s (the root copies (N-1)*m*s in).
// All-to-all and scatter stage one chunk per rank in a slot (m elements of
// each block per round, as reduce-scatter); gather's root and scatter's
// ranks read only the windows they need, and ranks that read no window set
// done as soon as their part is staged.
// With one rank a program is at most one local copy and uses no round.
#include "algorithms/stream_collectives.h"

#include <algorithm>

#include "src/core/error.h"
#include "src/device/host_reduce.h"  // dtypeSize

namespace loom {

const char* streamAlgorithmName(StreamAlgorithm a) {
  switch (a) {
    case StreamAlgorithm::OneShot:
      return "one-shot";
    case StreamAlgorithm::ReduceScatterAllGather:
      return "reduce-scatter+all-gather";
  }
  return "?";
}

namespace {

ProgramRef sendAt(size_t off) { return ProgramRef{Space::Send, 0, off}; }
ProgramRef recvAt(size_t off) { return ProgramRef{Space::Recv, 0, off}; }
ProgramRef winAt(int r, size_t off) { return ProgramRef{Space::Window, r, off}; }
// Rank r's buffer behind cell c at `off`, else its window at `fallback`.
ProgramRef publishedAt(int r, CellIndex c, size_t off, size_t fallback, uint64_t minTag) {
  ProgramRef ref{Space::Published, r, off};
  ref.cell = c;
  ref.fallback = fallback;
  ref.minTag = minTag;
  return ref;
}

class Builder {
 public:
  Builder(StreamProgram& p) : p_(p) {}

  void wait(int s, int r, FlagIndex f, uint64_t v) {
    StreamOp o;
    o.kind = StreamOpKind::WaitFlag;
    o.stream = uint8_t(s);
    o.flagRank = r;
    o.flag = f;
    o.value = v;
    p_.ops.push_back(o);
  }
  void waitAll(int s, FlagIndex f, uint64_t v) {
    for (int r = 0; r < p_.nranks; ++r) wait(s, r, f, v);
  }
  // The same but for this rank's own flag, for a flag this rank sets on
  // stream s itself: the stream's order already has it (each stream wait
  // costs a few microseconds of a small operation's latency).
  void waitOthers(int s, FlagIndex f, uint64_t v) {
    for (int r = 0; r < p_.nranks; ++r)
      if (r != p_.rank) wait(s, r, f, v);
  }
  // This rank's own copy of rank r's flag f, on stream s.
  void setLocal(int s, int r, uint8_t f, uint64_t v) {
    StreamOp o;
    o.kind = StreamOpKind::SetLocal;
    o.stream = uint8_t(s);
    o.flagRank = r;
    o.flag = f;
    o.value = v;
    p_.ops.push_back(o);
  }
  void set(int s, FlagIndex f, uint64_t v) {
    StreamOp o;
    o.kind = StreamOpKind::SetFlag;
    o.stream = uint8_t(s);
    o.flagRank = p_.rank;
    o.flag = f;
    o.value = v;
    p_.ops.push_back(o);
  }
  void copy(int s, ProgramRef dst, ProgramRef src, size_t bytes) {
    if (bytes) data(StreamOpKind::Copy, s, dst, {src}, bytes);
  }
  void reduce(int s, ProgramRef dst, const std::vector<ProgramRef>& srcs, size_t n) {
    if (n) data(StreamOpKind::Reduce, s, dst, srcs, n);
  }
  // The same, with the result in dst2 as well.
  void reduce2(int s, ProgramRef dst, ProgramRef dst2, const std::vector<ProgramRef>& srcs, size_t n) {
    if (!n) return;
    data(StreamOpKind::Reduce, s, dst, srcs, n);
    p_.ops.back().dst2 = dst2;
    p_.ops.back().dual = true;
  }
  void divide(int s, ProgramRef dst, size_t n, int divisor) {
    if (!n) return;
    data(StreamOpKind::Divide, s, dst, {dst}, n);
    p_.ops.back().divisor = divisor;
  }
  void setCell(int s, int peer, CellIndex c) {
    StreamOp o;
    o.kind = StreamOpKind::SetCell;
    o.stream = uint8_t(s);
    o.flagRank = peer;
    o.flag = c;
    p_.ops.push_back(o);
  }
  void setCellTag(int s, int peer, int slot, uint64_t v) {
    StreamOp o;
    o.kind = StreamOpKind::SetCellTag;
    o.stream = uint8_t(s);
    o.flagRank = peer;
    o.flag = uint8_t(slot);
    o.value = v;
    p_.ops.push_back(o);
  }
  void setPeer(int s, int peer, FlagIndex f, uint64_t v) {
    StreamOp o;
    o.kind = StreamOpKind::SetPeerFlag;
    o.stream = uint8_t(s);
    o.flagRank = peer;
    o.flag = f;
    o.value = v;
    p_.ops.push_back(o);
  }
  void event(StreamOpKind kind, int s, int e) {
    StreamOp o;
    o.kind = kind;
    o.stream = uint8_t(s);
    o.event = e;
    p_.ops.push_back(o);
  }

 private:
  void data(StreamOpKind kind, int s, ProgramRef dst, const std::vector<ProgramRef>& srcs, size_t count) {
    StreamOp o;
    o.kind = kind;
    o.stream = uint8_t(s);
    o.dst = dst;
    o.srcBegin = uint32_t(p_.srcs.size());
    o.srcCount = uint32_t(srcs.size());
    o.count = count;
    p_.srcs.insert(p_.srcs.end(), srcs.begin(), srcs.end());
    p_.ops.push_back(o);
  }
  StreamProgram& p_;
};

// Elements per round: what fits in `bytes`, rounded down to whole 256-byte
// lines when there is room (rounds then start aligned for vector loads).
size_t perRound(size_t bytes, size_t esz) {
  size_t m = bytes / esz, line = 256 / esz;
  return m >= line ? m / line * line : m;
}

}  // namespace

bool readsPublished(const OpDesc& op, int nranks, StreamAlgorithm algo) {
  if (nranks < 2 || op.count == 0) return false;
  return op.coll != Collective::P2P &&
         (op.coll != Collective::AllReduce || algo == StreamAlgorithm::ReduceScatterAllGather);
}

bool writesCells(const OpDesc& op, int rank) {
  switch (op.coll) {
    case Collective::Broadcast:
    case Collective::Scatter: return rank == op.root;  // the others' buffers nobody reads
    case Collective::Reduce:
    case Collective::Gather: return rank != op.root;
    default: return true;
  }
}

size_t zeroCopyBytes(const OpDesc& op, int nranks) {
  return op.count * dtypeSize(op.dtype) * (perRankCount(op.coll) ? size_t(nranks) : 1);
}

bool mayPublish(const OpDesc& op, int rank, int nranks, StreamAlgorithm algo) {
  if (!readsPublished(op, nranks, algo) || !writesCells(op, rank)) return false;
  // Rooted: only the send buffer is read by others, and the publishing
  // side writes no block of it (a broadcast root, a scatter root, which
  // writes its own block of the output only, the senders of a reduce or a
  // gather).
  if (rooted(op.coll)) return true;
  const size_t block = op.count * dtypeSize(op.dtype);
  if (op.coll == Collective::AllGather) {
    // The peers read the send buffer while this rank writes the other
    // blocks of its output: apart from the output, or exactly its own block.
    const uintptr_t in = reinterpret_cast<uintptr_t>(op.sendbuf), out = reinterpret_cast<uintptr_t>(op.recvbuf);
    return in + block <= out || out + size_t(nranks) * block <= in || in == out + uintptr_t(rank) * block;
  }
  // All-to-all: the peers read the send buffer while this rank writes its
  // output, so only out of place (the API allows no other overlap).
  if (op.coll == Collective::AllToAll) return op.sendbuf != op.recvbuf;
  if (op.coll != Collective::ReduceScatter) return true;
  const uintptr_t own = reinterpret_cast<uintptr_t>(op.sendbuf) + uintptr_t(rank) * block;
  const uintptr_t out = reinterpret_cast<uintptr_t>(op.recvbuf);
  const bool apart = own + block <= out || out + block <= own;
  return apart || (own == out && uint32_t(nranks) <= kOnePassSources);
}

StreamProgram compileStreamProgram(const OpDesc& op, int rank, int nranks, StreamAlgorithm algo,
                                   size_t slotBytes, uint64_t* round, const StreamPublish& publish) {
  StreamProgram p;
  p.rank = rank;
  p.nranks = nranks;
  p.dtype = op.dtype;
  p.op = op.op;
  p.firstRound = *round;
  const size_t esz = dtypeSize(op.dtype);
  if (!esz) fail(loomInternalError, "stream program of unknown datatype %d", int(op.dtype));
  if (nranks < 1 || rank < 0 || rank >= nranks)
    fail(loomInternalError, "stream program for rank %d of %d", rank, nranks);
  const size_t n = op.count;
  const int N = nranks, me = rank;
  const bool inPlace = op.sendbuf == op.recvbuf;
  const bool avg = op.op == loomAvg;
  Builder b(p);

  if (n == 0) return p;
  if (N == 1) {
    // One rank: the result is the input (avg divides by 1).
    if (!inPlace) b.copy(0, recvAt(0), sendAt(0), n * esz);
    return p;
  }

  const bool rsag = op.coll == Collective::AllReduce && algo == StreamAlgorithm::ReduceScatterAllGather;
  size_t m = 0;  // elements per round (of each block for reduce-scatter)
  switch (op.coll) {
    case Collective::ReduceScatter:
    case Collective::AllToAll:
    case Collective::Scatter:
      m = perRound(slotBytes / size_t(N), esz);  // a slot holds one chunk per rank
      break;
    case Collective::AllReduce:
      m = perRound(slotBytes, esz);
      break;
    default:
      m = perRound(slotBytes, esz);
      break;
  }
  if (m == 0 || (rsag && m < size_t(N)))
    fail(loomInternalError, "stream program: slots of %zu bytes cannot hold a round of %s x %d ranks",
         slotBytes, dtypeName(op.dtype), N);
  if (op.coll == Collective::P2P)
    fail(loomInternalError, "stream programs do not serve %s yet", collectiveName(op.coll));
  if (rsag) {
    p.streams = 2;
    p.events = 2;
    b.event(StreamOpKind::RecordEvent, 0, 0);  // fork: stream 1 follows the caller's earlier work
    b.event(StreamOpKind::WaitEvent, 1, 0);
  }

  // Gather and scatter in place: the root's own block is already where it
  // belongs (NCCL's layouts: sendbuff = recvbuff + root*count, and the
  // reverse).
  const size_t block = n * esz;
  const bool rootInPlace =
      (op.coll == Collective::Gather &&
       static_cast<const uint8_t*>(op.sendbuf) == static_cast<const uint8_t*>(op.recvbuf) + size_t(op.root) * block) ||
      (op.coll == Collective::Scatter &&
       static_cast<const uint8_t*>(op.recvbuf) == static_cast<const uint8_t*>(op.sendbuf) + size_t(op.root) * block);
  // Reduce-scatter: whether this rank's block of the input lies apart from
  // its output (out of place: not NCCL's in-place layout, nor any overlap).
  const bool ownBlockApart = op.coll == Collective::ReduceScatter && [&] {
    const uintptr_t own = reinterpret_cast<uintptr_t>(op.sendbuf) + uintptr_t(me) * block;
    const uintptr_t out = reinterpret_cast<uintptr_t>(op.recvbuf);
    return own + block <= out || out + block <= own;
  }();
  // Chunk q (c elements from `off`) of an N-block buffer into slot place
  // q, for every q but `skip` (a block no other rank reads; -1: none).
  auto stageBlocks = [&](size_t base, size_t off, size_t c, int skip) {
    if (c == n) {  // one round: the blocks before and after `skip` are contiguous
      const size_t first = skip < 0 ? size_t(N) : size_t(skip);
      const size_t after = skip < 0 ? size_t(N) : size_t(skip) + 1;
      b.copy(0, winAt(me, base), sendAt(0), first * block);
      b.copy(0, winAt(me, base + after * block), sendAt(after * block), (size_t(N) - after) * block);
      return;
    }
    for (int q = 0; q < N; ++q)
      if (q != skip)
        b.copy(0, winAt(me, base + size_t(q) * c * esz), sendAt((size_t(q) * n + off) * esz), c * esz);
  };

  // Zero-copy (StreamPublish): whether the peers are read through their
  // cells, and whether this rank publishes its buffers.
  const bool cells = publish.cells && readsPublished(op, N, algo), mine = cells && publish.mine;
  uint64_t g = *round;
  // The flag value of the program's last round (the cells' tag).
  const uint64_t lastV = *round + (n + m - 1) / m;
  for (size_t off = 0; off < n; off += m, ++g) {
    const size_t c = std::min(m, n - off);  // elements this round
    const uint64_t v = g + 1;
    const size_t base = size_t(g % 2) * slotBytes;
    const int slot = int(g % 2);
    const CellIndex sendCell = slot ? kCellSend1 : kCellSend0, recvCell = slot ? kCellRecv1 : kCellRecv0;
    // Zero-copy: this rank's cells of the round's slot for every peer, in
    // the program's first round on the slot, after its guard: the values
    // when they changed, the tag always.
    auto writeCells = [&] {
      if (!cells || g >= p.firstRound + 2 || !writesCells(op, me)) return;
      for (int q = 0; q < N; ++q)
        if (q != me) {
          if (publish.write[slot]) {
            b.setCell(0, q, sendCell);
            b.setCell(0, q, recvCell);
          }
          b.setCellTag(0, q, slot, lastV);
        }
    };
    auto guard = [&] {
      // Reduce-scatter + all-gather sets done on stream 1, and may read its
      // own slot there; every other program sets it on stream 0.
      if (g >= 2 && rsag) b.waitAll(0, kFlagDone, g - 1);
      if (g >= 2 && !rsag) b.waitOthers(0, kFlagDone, g - 1);
    };
    std::vector<ProgramRef> all;
    switch (op.coll) {
      case Collective::AllReduce: {
        guard();
        // Part q of the round: elements [c*q/N, c*(q+1)/N), each start
        // rounded down to a whole 256-byte line, so that every part (whose
        // round starts on a line, perRound) is aligned for the kernels'
        // 16-byte loads whatever N is.
        const size_t line = 256 / esz;
        auto partStart = [&](int q) { return q == N ? c : c * size_t(q) / size_t(N) / line * line; };
        const size_t ps = partStart(me), pl = partStart(me + 1) - ps;
        // Zero-copy (StreamPublish): the peers' parts are read through
        // their cells of this round's slot, which the program's first round
        // on that slot writes when they change.
        writeCells();
        auto peerPart = [&](int q, CellIndex c, size_t qs) {
          return cells ? publishedAt(q, c, (off + qs) * esz, base + qs * esz, v) : winAt(q, base + qs * esz);
        };
        if (mine) {
          // Nothing staged: the peers read this rank's send buffer.
        } else if (rsag) {
          // Only the parts the others reduce go to the window: this rank's
          // own part is read from its send buffer.
          b.copy(0, winAt(me, base), sendAt(off * esz), ps * esz);
          b.copy(0, winAt(me, base + (ps + pl) * esz), sendAt((off + ps + pl) * esz), (c - ps - pl) * esz);
        } else {
          b.copy(0, winAt(me, base), sendAt(off * esz), c * esz);
        }
        b.set(0, kFlagInput, v);
        b.waitOthers(0, kFlagInput, v);
        if (!rsag) {
          for (int q = 0; q < N; ++q) all.push_back(winAt(q, base));
          b.reduce(0, recvAt(off * esz), all, c);
          if (avg) b.divide(0, recvAt(off * esz), c, N);
          b.set(0, kFlagDone, v);
          break;
        }
        for (int q = 0; q < N; ++q) all.push_back(q == me ? sendAt((off + ps) * esz) : peerPart(q, sendCell, ps));
        if (mine && (all.size() <= kOnePassSources || !inPlace)) {
          // Published: the reduced part goes to the recv buffer alone, where
          // the peers read it (in place that is the part of the send buffer
          // it was just read from, which only this rank reads; one pass
          // reads each element before writing it).
          b.reduce(0, recvAt((off + ps) * esz), all, pl);
          if (avg) b.divide(0, recvAt((off + ps) * esz), pl, N);
        } else if (avg) {
          // The reduced part goes to the window for the others and, unless
          // it is still to be divided, straight to this rank's output as
          // well (in place that is the part of the send buffer it was just
          // read from, which only this rank reads).
          b.reduce(0, winAt(me, base + ps * esz), all, pl);
          b.divide(0, winAt(me, base + ps * esz), pl, N);
          if (mine) b.copy(0, recvAt((off + ps) * esz), winAt(me, base + ps * esz), pl * esz);
        } else {
          b.reduce2(0, winAt(me, base + ps * esz), recvAt((off + ps) * esz), all, pl);
        }
        b.set(0, kFlagReduced, v);
        b.waitAll(1, kFlagReduced, v);
        for (int q = 0; q < N; ++q) {
          size_t qs = partStart(q), ql = partStart(q + 1) - qs;
          if (q != me)
            b.copy(1, recvAt((off + qs) * esz), peerPart(q, recvCell, qs), ql * esz);
          else if (avg && !mine)
            b.copy(1, recvAt((off + qs) * esz), winAt(q, base + qs * esz), ql * esz);
        }
        b.set(1, kFlagDone, v);
        break;
      }
      case Collective::ReduceScatter: {
        // This rank's own block is read by it alone: out of place, straight
        // from the send buffer (in place, recvbuff == sendbuff + rank *
        // recvcount, the output is that block, which the reduction must
        // not write while it may still read it).
        // Zero-copy: the peers' chunks are read from their send buffers
        // through their cells; a publishing rank stages nothing and reads
        // its own block in place (exactly the output, in place: one pass).
        guard();
        writeCells();
        if (!mine) stageBlocks(base, off, c, ownBlockApart ? me : -1);
        b.set(0, kFlagInput, v);
        b.waitOthers(0, kFlagInput, v);
        for (int q = 0; q < N; ++q) {
          const size_t chunk = base + size_t(me) * c * esz;
          if (q == me)
            all.push_back(ownBlockApart || mine ? sendAt((size_t(me) * n + off) * esz) : winAt(q, chunk));
          else
            all.push_back(cells ? publishedAt(q, slot ? kCellSend1 : kCellSend0, (size_t(me) * n + off) * esz, chunk, v)
                                : winAt(q, chunk));
        }
        b.reduce(0, recvAt(off * esz), all, c);
        if (avg) b.divide(0, recvAt(off * esz), c, N);
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::AllGather: {
        // Zero-copy: the peers' chunks are copied straight from their send
        // buffers through their cells; a publishing rank stages nothing and
        // copies its own chunk across (in place it is already there).
        guard();
        writeCells();
        if (!mine) b.copy(0, winAt(me, base), sendAt(off * esz), c * esz);
        b.set(0, kFlagInput, v);
        b.waitOthers(0, kFlagInput, v);
        for (int q = 0; q < N; ++q) {
          const ProgramRef to = recvAt((size_t(q) * n + off) * esz);
          if (q == me && mine) {
            const bool there = static_cast<const uint8_t*>(op.sendbuf) ==
                               static_cast<const uint8_t*>(op.recvbuf) + size_t(me) * block;
            if (!there) b.copy(0, to, sendAt(off * esz), c * esz);
          } else if (q != me && cells) {
            b.copy(0, to, publishedAt(q, slot ? kCellSend1 : kCellSend0, off * esz, base, v), c * esz);
          } else {
            b.copy(0, to, winAt(q, base), c * esz);
          }
        }
        b.set(0, kFlagDone, v);
        break;
      }
      // Rooted collectives, zero-copy: the side whose send buffer the
      // others read (a broadcast's or scatter's root, a reduce's or
      // gather's senders) may publish it and stage nothing; the readers
      // take it through its cells.
      case Collective::Broadcast: {
        if (me == op.root) {
          guard();
          writeCells();
          if (!mine) b.copy(0, winAt(me, base), sendAt(off * esz), c * esz);
          b.set(0, kFlagInput, v);
          if (!inPlace) b.copy(0, recvAt(off * esz), sendAt(off * esz), c * esz);
        } else {
          b.wait(0, op.root, kFlagInput, v);
          b.copy(0, recvAt(off * esz),
                 cells ? publishedAt(op.root, sendCell, off * esz, base, v) : winAt(op.root, base), c * esz);
        }
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::Reduce: {
        guard();
        writeCells();
        if (!mine) b.copy(0, winAt(me, base), sendAt(off * esz), c * esz);
        b.set(0, kFlagInput, v);
        if (me == op.root) {
          b.waitOthers(0, kFlagInput, v);
          for (int q = 0; q < N; ++q)
            all.push_back(q != me && cells ? publishedAt(q, sendCell, off * esz, base, v) : winAt(q, base));
          b.reduce(0, recvAt(off * esz), all, c);
          if (avg) b.divide(0, recvAt(off * esz), c, N);
        }
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::AllToAll: {
        // Every rank stages the chunks the others take, then takes chunk
        // `me` of every other rank's slot into block q of its output; its
        // own block goes straight from send to recv (in place it is there).
        // Zero-copy (out of place only, mayPublish): a publishing rank
        // stages nothing, and the peers copy their chunks straight from
        // block q of its send buffer through its cells.
        guard();
        writeCells();
        if (!mine) stageBlocks(base, off, c, me);
        b.set(0, kFlagInput, v);
        if (!inPlace) b.copy(0, recvAt((size_t(me) * n + off) * esz), sendAt((size_t(me) * n + off) * esz), c * esz);
        b.waitOthers(0, kFlagInput, v);
        for (int q = 0; q < N; ++q) {
          if (q == me) continue;
          const ProgramRef to = recvAt((size_t(q) * n + off) * esz);
          const size_t chunk = base + size_t(me) * c * esz;
          b.copy(0, to, cells ? publishedAt(q, sendCell, (size_t(me) * n + off) * esz, chunk, v) : winAt(q, chunk),
                 c * esz);
        }
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::Gather: {
        if (me != op.root) {
          // Reads no window: done as soon as the chunk is staged (the root's
          // done flag is what guards this slot's reuse).
          guard();
          writeCells();
          if (!mine) b.copy(0, winAt(me, base), sendAt(off * esz), c * esz);
          b.set(0, kFlagInput, v);
        } else {
          if (!rootInPlace) b.copy(0, recvAt((size_t(me) * n + off) * esz), sendAt(off * esz), c * esz);
          for (int q = 0; q < N; ++q) {
            if (q == me) continue;
            b.wait(0, q, kFlagInput, v);
            b.copy(0, recvAt((size_t(q) * n + off) * esz),
                   cells ? publishedAt(q, sendCell, off * esz, base, v) : winAt(q, base), c * esz);
          }
        }
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::Scatter: {
        if (me == op.root) {
          guard();
          writeCells();
          if (!mine) stageBlocks(base, off, c, me);  // the root's own block is copied below, never read from the slot
          b.set(0, kFlagInput, v);
          if (!rootInPlace) b.copy(0, recvAt(off * esz), sendAt((size_t(me) * n + off) * esz), c * esz);
        } else {
          b.wait(0, op.root, kFlagInput, v);
          const size_t chunk = base + size_t(me) * c * esz;
          b.copy(0, recvAt(off * esz),
                 cells ? publishedAt(op.root, sendCell, (size_t(me) * n + off) * esz, chunk, v)
                       : winAt(op.root, chunk),
                 c * esz);
        }
        b.set(0, kFlagDone, v);
        break;
      }
      case Collective::P2P:
        break;  // refused above
    }
  }
  if (mine && g > *round) {
    // The peers read this rank's buffers until their last round is done:
    // the caller's later work (which may write them) waits for that.
    b.waitOthers(rsag ? 1 : 0, kFlagDone, g);
  }
  if (rsag) {
    b.event(StreamOpKind::RecordEvent, 1, 1);  // join: the caller's later work follows stream 1
    b.event(StreamOpKind::WaitEvent, 0, 1);
  }
  p.rounds = g - *round;
  *round = g;
  return p;
}

StreamProgram makeReplayable(StreamProgram p, uint64_t sig) {
  if (sig == 0 || sig >= (uint64_t(1) << 61))
    fail(loomInternalError, "a replayable program's signature must be in [1, 2^61), not %llu", (unsigned long long)sig);
  if (p.firstRound != 0) fail(loomInternalError, "a replayable program must start at round 0, not %llu",
                              (unsigned long long)p.firstRound);
  p.replayable = true;
  // One rank: a local copy at most, no flag, no window.  A call of count 0
  // on several ranks still passes the start gate (a peer may have captured
  // a call that is not empty: a mismatch to report, not a timeout).
  if (p.nranks == 1) return p;
  StreamProgram out = p;
  out.ops.clear();
  Builder b(out);
  // This rank's own reset from the call before, zeroed only now (while
  // busy is still 0): zeroed at that call's end, before its busy went to
  // 0, it would let the watchdog see "before reset" with the old call's
  // signature while a peer already wrote its next call's.
  b.setLocal(0, p.rank, kFlagGraphReset, 0);
  b.setLocal(0, p.rank, kFlagGraphBusy, sig);
  for (int r = 0; r < p.nranks; ++r)
    if (r != p.rank) b.setPeer(0, r, FlagIndex(kFlagGraphSig), sig);
  b.waitOthers(0, FlagIndex(kFlagGraphSig), sig);
  for (StreamOp o : p.ops) {
    switch (o.kind) {
      case StreamOpKind::SetCell:
      case StreamOpKind::SetCellTag:
      case StreamOpKind::SetPeerFlag:
      case StreamOpKind::SetLocal:
        fail(loomInternalError, "a replayable program cannot publish cells or set per-pair or local flags");
      default:
        break;
    }
    out.ops.push_back(o);  // on its own stream: a second one forks after the gate and joins before `end`
  }
  for (const ProgramRef& r : out.srcs)
    if (r.space == Space::Published) fail(loomInternalError, "a replayable program cannot read published buffers");
  b.set(0, FlagIndex(kFlagGraphEnd), 1);
  b.waitOthers(0, FlagIndex(kFlagGraphEnd), 1);
  // The peers' rows first, then the own row: one run of zeroings of the
  // peers' copies, which the enqueuer hands the backend as one batch.
  for (int i = 1; i <= p.nranks; ++i) {
    const int r = (p.rank + i) % p.nranks;
    for (uint8_t f : {uint8_t(kFlagInput), uint8_t(kFlagReduced), uint8_t(kFlagDone), kFlagGraphEnd})
      b.setLocal(0, r, f, 0);
    if (r != p.rank) b.setLocal(0, r, kFlagGraphSig, 0);
  }
  // Its own copy first (SetFlag writes it last): the watchdog, which
  // compares signatures only before this rank's reset, must see it before
  // any peer can start its next call and write that call's signature here.
  b.setLocal(0, p.rank, kFlagGraphReset, 1);
  b.set(0, FlagIndex(kFlagGraphReset), 1);
  b.waitOthers(0, FlagIndex(kFlagGraphReset), 1);
  for (int r = 0; r < p.nranks; ++r)
    if (r != p.rank) b.setLocal(0, r, kFlagGraphReset, 0);
  b.setLocal(0, p.rank, kFlagGraphBusy, 0);
  return out;
}

uint64_t graphP2PMessages(const std::vector<uint64_t>& sizes) {
  uint64_t total = 0, h = 1469598103934665603ull;  // FNV-1a over the counts
  for (uint64_t v : sizes) {
    total += v;
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  }
  if (total == 0) return 0;
  const uint64_t cap = (uint64_t(1) << 40) - 1;
  return (h >> 44) << 40 | std::min(total, cap);  // the hash's top 20 bits
}

std::vector<std::vector<uint64_t>> p2pPairSizes(const std::vector<OpDesc>& ops, int nranks, bool sends) {
  std::vector<std::vector<uint64_t>> out(size_t(std::max(nranks, 0)));
  for (const OpDesc& op : ops) {
    const uint64_t bytes = op.count * dtypeSize(op.dtype);
    if (op.coll == Collective::P2P && op.isSend == sends && op.peer >= 0 && op.peer < nranks)
      out[size_t(op.peer)].push_back(bytes);
  }
  return out;
}

namespace {

// Send/recv's program, eager (graph false: the communicator's per-pair
// counters go on, kFlagP2PDone counts the program) or replayable (graph:
// counters from zero, every per-pair flag back at zero when it ends, see
// compileGraphP2PProgram).
StreamProgram p2pProgram(const std::vector<OpDesc>& ops, int rank, int nranks, size_t slotBytes, P2PCounters* st,
                         bool graph, uint64_t busy) {
  StreamProgram p;
  p.rank = rank;
  p.nranks = nranks;
  p.dtype = loomUint8;  // copies only, in bytes
  p.replayable = graph;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    fail(loomInternalError, "send/recv program for rank %d of %d", rank, nranks);
  const size_t chunk = p2pChunkBytes(slotBytes);
  if (chunk == 0) fail(loomInternalError, "send/recv program: slots of %zu bytes hold no chunk", slotBytes);
  const FlagIndex sentFlag = graph ? kFlagGraphSent : kFlagP2PSent;
  const FlagIndex ackedFlag = graph ? kFlagGraphAcked : kFlagP2PAcked;
  st->sent.resize(size_t(nranks), 0);
  st->recvd.resize(size_t(nranks), 0);
  // Each pair's chunks in the order of its members (the sender's sends
  // to the receiver and the receiver's receives from the sender list the
  // same messages in the same order): {buffer index, offset, bytes}.
  struct Chunk {
    int32_t buffer;
    size_t off, len;
  };
  std::vector<std::vector<Chunk>> sendChunks(static_cast<size_t>(nranks)), recvChunks(static_cast<size_t>(nranks));
  int32_t sends = 0, recvs = 0;
  size_t most = 0;  // chunks of the longest pair
  for (const OpDesc& op : ops) {
    if (op.coll != Collective::P2P || op.peer < 0 || op.peer >= nranks)
      fail(loomInternalError, "send/recv program given %s (peer %d)", collectiveName(op.coll), op.peer);
    const size_t bytes = op.count * dtypeSize(op.dtype);
    const int32_t buffer = op.isSend ? sends++ : recvs++;
    std::vector<Chunk>& list = (op.isSend ? sendChunks : recvChunks)[size_t(op.peer)];
    for (size_t off = 0; off < bytes; off += chunk) list.push_back({buffer, off, std::min(chunk, bytes - off)});
    most = std::max(most, list.size());
  }
  if (graph && most > 0) {
    if (st->programs != 0 || std::any_of(st->sent.begin(), st->sent.end(), [](uint64_t v) { return v != 0; }) ||
        std::any_of(st->recvd.begin(), st->recvd.end(), [](uint64_t v) { return v != 0; }))
      fail(loomInternalError, "a replayable send/recv program must count from zero");
    if (busy < kGraphP2PBusy || busy >= (uint64_t(1) << 62))  // below kReleasedFlag
      fail(loomInternalError, "a replayable send/recv program's busy mark %llu is out of range",
           (unsigned long long)busy);
  }
  Builder b(p);
  // The size gate's values (compileGraphP2PProgram): per pair, 0 when no
  // byte moves (no gate).
  std::vector<uint64_t> gateOut(size_t(nranks), 0), gateIn(size_t(nranks), 0);
  if (graph && most > 0) {
    b.setLocal(0, rank, kFlagGraphBusy, busy);
    const std::vector<std::vector<uint64_t>> outSizes = p2pPairSizes(ops, nranks, true);
    const std::vector<std::vector<uint64_t>> inSizes = p2pPairSizes(ops, nranks, false);
    for (int q = 0; q < nranks; ++q)
      if (q != rank) {
        gateOut[size_t(q)] = graphP2PMessages(outSizes[size_t(q)]);
        gateIn[size_t(q)] = graphP2PMessages(inSizes[size_t(q)]);
      }
    // This rank's values for its receivers, before anything waits.
    for (int i = 1; i < nranks; ++i) {
      const int q = (rank + i) % nranks;
      const uint64_t v = gateOut[size_t(q)];
      if (v == 0) continue;
      b.setPeer(0, q, kFlagGraphMessages, v);
      b.setPeer(0, q, kFlagGraphMessagesNot, kGraphMessagesSum - v);
    }
  }
  // Sends and receives run on two streams, sends on the caller's,
  // receives on a side stream of their own (stream 2: never the
  // collectives' stream 1, whose programs other ranks may order otherwise
  // against these), forked from and joined to the caller's: a send never
  // waits behind a receive, so a receive that needs the partner's later
  // call (rank 0 sends and receives in one group, rank 1 receives in one
  // call and sends in the next) does not hold this rank's sends back, as
  // in NCCL.  Replayable programs too: their side stream joins the
  // capture (DeviceDriver::captureBackend gives them streams no eager
  // call uses).
  bool anySend = false, anyRecv = false;
  for (int q = 0; q < nranks; ++q)
    anySend |= !sendChunks[size_t(q)].empty(), anyRecv |= !recvChunks[size_t(q)].empty();
  const bool split = anySend && anyRecv;
  const int rs = split ? 2 : 0;  // the receives' stream
  if (split) {
    p.streams = 3;
    p.events = 2;
    b.event(StreamOpKind::RecordEvent, 0, 0);  // fork: the receives follow the caller's earlier work
    b.event(StreamOpKind::WaitEvent, rs, 0);
  }
  // Chunk k of a pair (its k-th overall) is in chunk k % 2 of the sender's
  // region for the receiver.
  auto chunkAt = [&](uint64_t k) { return size_t(k % 2) * chunk; };
  // Step t: chunk t of every pair this rank sends on, then chunk t of every
  // pair it receives on.  A send waits only for the ack of its pair's chunk
  // t - 2, which its receiver wrote in step t - 2, and a receive only for
  // its sender's step t, so no rank waits for another in a cycle, however
  // many members a group has per pair (with self-sends: one stream).  The
  // peers in turn from the next one (sends) and the previous one
  // (receives), so that not every rank starts with the same one.
  for (size_t t = 0; t < most; ++t) {
    for (int i = 0; i < nranks; ++i) {
      const int q = (rank + i) % nranks;
      if (t >= sendChunks[size_t(q)].size()) continue;
      const Chunk& c = sendChunks[size_t(q)][t];
      const uint64_t k = st->sent[size_t(q)]++;
      // The receiver has copied out chunk k - 2, which used this chunk.
      if (k >= 2) b.wait(0, q, ackedFlag, k - 1);
      b.copy(0, ProgramRef{Space::P2POut, q, chunkAt(k)}, ProgramRef{Space::Send, c.buffer, c.off}, c.len);
      b.setPeer(0, q, sentFlag, k + 1);
    }
    for (int i = 0; i < nranks; ++i) {
      const int q = (rank + nranks - i) % nranks;
      if (t >= recvChunks[size_t(q)].size()) continue;
      const Chunk& c = recvChunks[size_t(q)][t];
      const uint64_t k = st->recvd[size_t(q)]++;
      if (t == 0 && gateIn[size_t(q)] != 0) {
        // The sender's gate, just before its first chunk (which follows
        // the sender's values on its stream: this waits for nothing more),
        // marked in this rank's own row for the watchdog while it waits.
        const uint64_t v = gateIn[size_t(q)];
        b.setLocal(rs, rank, kFlagGraphMessages, uint64_t(q) + 1);
        b.wait(rs, q, kFlagGraphMessages, v);
        b.wait(rs, q, kFlagGraphMessagesNot, kGraphMessagesSum - v);
        b.setLocal(rs, rank, kFlagGraphMessages, 0);
        b.setLocal(rs, q, kFlagGraphMessages, 0);
        b.setLocal(rs, q, kFlagGraphMessagesNot, 0);
      }
      b.wait(rs, q, sentFlag, k + 1);
      b.copy(rs, ProgramRef{Space::Recv, c.buffer, c.off}, ProgramRef{Space::P2PIn, q, chunkAt(k)}, c.len);
      // The pair's last chunk of a replayable program: the sender wrote
      // its last `sent` of the call (this wait saw it), so zero it here
      // before the ack that lets the sender go on to its next call.
      if (graph && t + 1 == recvChunks[size_t(q)].size()) b.setLocal(rs, q, sentFlag, 0);
      b.setPeer(rs, q, ackedFlag, k + 1);
    }
  }
  if (p.ops.empty()) return p;
  if (split) {
    b.event(StreamOpKind::RecordEvent, rs, 1);  // join: the caller's later work follows the receives
    b.event(StreamOpKind::WaitEvent, 0, 1);
  }
  if (graph) {
    // Wait for each receiver's last ack (it copied everything out of this
    // rank's region and zeroed its copy of `sent`), then zero this rank's
    // copy of `acked`: the receiver acks its next call's chunks only after
    // this rank's next `sent`, written after this.
    // (Every wait first, then every zeroing: one run the enqueuer batches.)
    for (int q = 0; q < nranks; ++q)
      if (!sendChunks[size_t(q)].empty()) b.wait(0, q, ackedFlag, sendChunks[size_t(q)].size());
    for (int q = 0; q < nranks; ++q)
      if (!sendChunks[size_t(q)].empty()) b.setLocal(0, q, ackedFlag, 0);
    b.setLocal(0, rank, kFlagGraphBusy, 0);
    return p;
  }
  // Done: the watchdog, destroy and the reaper tell finished programs by it.
  b.set(0, kFlagP2PDone, ++st->programs);
  return p;
}

}  // namespace

StreamProgram compileP2PProgram(const std::vector<OpDesc>& ops, int rank, int nranks, size_t slotBytes,
                                P2PCounters* st) {
  return p2pProgram(ops, rank, nranks, slotBytes, st, false, 0);
}

StreamProgram compileGraphP2PProgram(const std::vector<OpDesc>& ops, int rank, int nranks, size_t regionBytes,
                                     uint64_t busy) {
  P2PCounters fresh;
  return p2pProgram(ops, rank, nranks, regionBytes, &fresh, true, busy);
}

}  // namespace loom
