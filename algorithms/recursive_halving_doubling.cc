// Recursive halving-doubling (Thakur, Rabenseifner & Gropp, "Optimization of
// Collective Communication Operations in MPICH", IJHPCA 2005).
//
// Core: M = 2^floor(log2 N) ranks, numbered v.  With x = N - M, the extra
// ranks 2i (i < x) fold into their partner 2i+1, which becomes v = i; a rank
// r >= 2x is v = r - x.
//
// All-reduce of S bytes: the extras send their vector to their partner,
// which receive-reduces it.  The core cuts the data into M parts and reduces
// them by recursive halving: for m = M/2, M/4, .., 1, v and v^m hold the same
// range of 2m parts; each keeps the half that contains its own part, sends
// the other half and receive-reduces the kept one.  After log2 M steps v
// holds part v fully reduced, and recursive doubling gathers the parts back
// (m = 1, 2, .., M/2: swap the aligned ranges of m parts).  A core rank sends
// (M-1)/M x S each way, 2(N-1)/N x S in 2 log2 N steps for a power of two;
// with extras, a partner also takes S in and sends S back at the end.
// Partial sums live in the receive buffer.
//
// All-gather, block b at b*count: core rank v is responsible for its own
// block and its extra's, blocks [first(v), first(v+1)), so an aligned range
// of virtual ranks is a contiguous range of blocks.  Extras send their block
// to the partner first and receive the N-1 others at the end; the core runs
// recursive doubling over the ranges: (N-1) x count per rank for powers of 2.
//
// Reduce-scatter is recursive halving over the blocks (block b at
// b*count, core rank v responsible for [first(v), first(v+1)) as in
// all-gather): the partial sums of the half a rank keeps live in scratch
// (N x chunk columns per lane), since the output holds one block; the last
// exchange reduces this rank's block into recv and its extra's in scratch,
// which goes back to the extra.  (N-1) x count per core rank for a power of
// two in log2 N exchanges; with extras, a partner also takes N x count in.
//
// Exchanges: a lane runs its steps in order, and a send larger than the slot
// ring waits for the peer to receive, so in each exchange one side sends
// first and the other receives first.  To keep both directions busy, the
// data is split between two lanes (channels 2j and 2j+1) with opposite
// orders; each lane runs the whole algorithm on its own elements, so no data
// crosses lanes (lanes of one operation are not ordered).  Two lanes, four
// when plan.channels >= 3.  Loops of chunkBytes x M (all-reduce) or
// chunkBytes per block keep the working set of a step in cache.
#include <algorithm>
#include <functional>

#include "algorithms/algorithms.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

// Element range [begin, end) of part `i` when `total` is cut into `parts`.

struct Ctx {
  int rank, nranks, core, extra;  // N, M = 2^floor(log2 N), x = N - M
  size_t esz;
  Lane* lane;
  BufRef S(size_t elem) const { return BufRef{Buf::Send, elem * esz}; }
  BufRef R(size_t elem) const { return BufRef{Buf::Recv, elem * esz}; }
  int virt() const { return rank < 2 * extra ? (rank % 2 ? rank / 2 : -1) : rank - extra; }
  int real(int v) const { return v < extra ? 2 * v + 1 : v + extra; }
  int first(int v) const { return v < extra ? 2 * v : v + extra; }
  bool folded() const { return rank < 2 * extra; }  // an extra, or a core rank with one

  void add(StepKind k, int from, int to, BufRef src, BufRef dst, size_t elems, bool fin = false) {
    if (elems == 0) return;  // both sides compute the same sizes and skip
    lane->steps.push_back(makeStep(k, from, to, src, dst, elems * esz, fin));
  }
  void send(int to, BufRef src, size_t elems) { add(StepKind::Send, -1, to, src, BufRef{}, elems); }
  void recv(int from, BufRef dst, size_t elems) { add(StepKind::Recv, from, -1, BufRef{}, dst, elems); }
};

// One exchange with core rank p: `lowFirst` lanes let the lower virtual rank
// send first, the others the higher one.
template <class SendFn, class RecvFn>
void exchange(const Ctx& c, bool lowFirst, int p, SendFn sendPart, RecvFn recvPart) {
  if (lowFirst == (c.virt() < p)) {
    sendPart();
    recvPart();
  } else {
    recvPart();
    sendPart();
  }
}

void allReduceLane(Ctx& c, bool lowFirst, size_t begin, size_t end, size_t chunkElems) {
  const int M = c.core, v = c.virt(), r = c.rank;
  const size_t loopElems = chunkElems * size_t(M);
  for (size_t ls = begin; ls < end; ls += loopElems) {
    size_t ll = std::min(loopElems, end - ls);
    if (v < 0) {  // extra: hand the vector over, get the result back
      c.send(r + 1, c.S(ls), ll);
      c.recv(r + 1, c.R(ls), ll);
      continue;
    }
    auto at = [&](int part) { return ls + partBegin(ll, M, part); };
    Buf in = Buf::Send;
    if (c.folded()) {
      c.add(StepKind::RecvReduce, r - 1, -1, c.S(ls), c.R(ls), ll);
      in = Buf::Recv;
    }
    int lo = 0;  // v holds parts [lo, lo + 2m)
    for (int m = M / 2; m >= 1; m /= 2) {
      int p = v ^ m, keep = v & m ? lo + m : lo, give = v & m ? lo : lo + m;
      exchange(
          c, lowFirst, p,
          [&] {
            c.send(c.real(p), BufRef{in, at(give) * c.esz}, at(give + m) - at(give));
          },
          [&] {
            c.add(StepKind::RecvReduce, c.real(p), -1, BufRef{in, at(keep) * c.esz}, c.R(at(keep)),
                  at(keep + m) - at(keep), m == 1);
          });
      lo = keep;
      in = Buf::Recv;
    }
    for (int m = 1; m < M; m *= 2) {
      int p = v ^ m, mine = v & ~(m - 1), theirs = mine ^ m;
      exchange(
          c, lowFirst, p, [&] { c.send(c.real(p), c.R(at(mine)), at(mine + m) - at(mine)); },
          [&] { c.recv(c.real(p), c.R(at(theirs)), at(theirs + m) - at(theirs)); });
    }
    if (c.folded()) c.send(r - 1, c.R(ls), ll);
  }
}

// Columns [begin, end) of every block.
void allGatherLane(Ctx& c, bool lowFirst, size_t count, bool inPlace, size_t begin, size_t end,
                   size_t chunkElems) {
  const int M = c.core, N = c.nranks, v = c.virt(), r = c.rank;
  if (!inPlace) c.add(StepKind::Copy, -1, -1, c.S(begin), c.R(size_t(r) * count + begin), end - begin);
  for (size_t o = begin; o < end; o += chunkElems) {
    size_t w = std::min(chunkElems, end - o);
    // Blocks [b0, b1) of these columns: one step when the lane has whole blocks.
    auto blocks = [&](bool isSend, int peer, int b0, int b1) {
      for (int b = b0; b < b1; b = w == count ? b1 : b + 1) {
        size_t elems = (w == count ? size_t(b1 - b) : 1) * w;
        if (isSend)
          c.send(peer, c.R(size_t(b) * count + o), elems);
        else
          c.recv(peer, c.R(size_t(b) * count + o), elems);
      }
    };
    if (v < 0) {
      blocks(true, r + 1, r, r + 1);
      blocks(false, r + 1, 0, r);
      blocks(false, r + 1, r + 1, N);
      continue;
    }
    if (c.folded()) blocks(false, r - 1, r - 1, r);
    for (int m = 1; m < M; m *= 2) {
      int p = v ^ m, mine = v & ~(m - 1), theirs = mine ^ m;
      exchange(
          c, lowFirst, p, [&] { blocks(true, c.real(p), c.first(mine), c.first(mine + m)); },
          [&] { blocks(false, c.real(p), c.first(theirs), c.first(theirs + m)); });
    }
    if (c.folded()) {
      blocks(true, r - 1, 0, r - 1);
      blocks(true, r - 1, r, N);
    }
  }
}

// Recursive halving on columns [begin, end) of every block, partial sums in
// scratch: loops of w columns; block b's w columns of partial sums sit at
// scratch (lane base) + b*w.  Core rank v ends with blocks [first(v),
// first(v+1)): its own (into recv) and its extra's (sent back to it).
void reduceScatterHalvingLane(Ctx& c, bool lowFirst, size_t count, size_t base, size_t begin, size_t end,
                              size_t chunkElems) {
  const int M = c.core, N = c.nranks, v = c.virt(), r = c.rank;
  auto X = [&](size_t b, size_t w) { return BufRef{Buf::Scratch, (base + b * w) * c.esz}; };
  for (size_t o = begin; o < end; o += chunkElems) {
    size_t w = std::min(chunkElems, end - o);
    auto S = [&](size_t b) { return c.S(b * count + o); };
    // Blocks [b0, b1): one step, or a step per block (split), the same on
    // both sides of every exchange.
    auto each = [&](int b0, int b1, bool split, const std::function<void(int, int)>& fn) {
      if (!split) {
        if (b1 > b0) fn(b0, b1);
        return;
      }
      for (int b = b0; b < b1; ++b) fn(b, b + 1);
    };
    auto from = [&](bool scratch, int b) { return scratch ? X(size_t(b), w) : S(size_t(b)); };
    if (v < 0) {  // extra: hand everything to the partner, get its own block back
      each(0, N, w != count, [&](int b0, int b1) { c.send(r + 1, S(size_t(b0)), size_t(b1 - b0) * w); });
      c.recv(r + 1, c.R(o), w);
      continue;
    }
    bool inScratch = false;
    if (c.folded()) {
      each(0, N, w != count, [&](int b0, int b1) {
        c.add(StepKind::RecvReduce, r - 1, -1, S(size_t(b0)), X(size_t(b0), w), size_t(b1 - b0) * w);
      });
      inScratch = true;
    }
    int lo = 0;  // v holds virtual ranks [lo, lo + 2m)
    for (int m = M / 2; m >= 1; m /= 2) {
      // The last exchange finishes blocks one by one: this rank's into recv,
      // its extra's in scratch (then sent back).
      int p = v ^ m, keep = v & m ? lo + m : lo, give = v & m ? lo : lo + m;
      // Steps per block where either side reads blocks strided in the send
      // buffer (the first exchange of a partial-column lane), and on the last
      // exchange; else one step for the whole range, contiguous in scratch.
      bool last = m == 1, split = last || (m == M / 2 && w != count);
      exchange(
          c, lowFirst, p,
          [&] {
            each(c.first(give), c.first(give + m), split, [&](int b0, int b1) {
              c.send(c.real(p), from(inScratch, b0), size_t(b1 - b0) * w);
            });
          },
          [&] {
            each(c.first(keep), c.first(keep + m), split, [&](int b0, int b1) {
              bool mine = last && b0 == r;
              c.add(StepKind::RecvReduce, c.real(p), -1, from(inScratch, b0), mine ? c.R(o) : X(size_t(b0), w),
                    size_t(b1 - b0) * w, last);
            });
          });
      lo = keep;
      inScratch = true;
    }
    if (c.folded()) c.send(r - 1, X(size_t(r - 1), w), w);
  }
}

}  // namespace

void halvingDoublingSchedule(const OpDesc& op, int opIndex, int rank, int nranks, const Plan& plan,
                             Schedule* out) {
  int core = 1;
  while (core * 2 <= nranks) core *= 2;
  Ctx c{rank, nranks, core, nranks - core, dtypeSize(op.dtype), nullptr};
  const char* send = static_cast<const char*>(op.sendbuf);
  const char* recv = static_cast<const char*>(op.recvbuf);
  const size_t blockBytes = op.count * c.esz;
  const size_t chunkElems = std::max<size_t>(1, plan.chunkBytes / c.esz);
  bool inPlace = op.coll == Collective::AllGather       ? send == recv + size_t(rank) * blockBytes
                 : op.coll == Collective::ReduceScatter ? recv == send + size_t(rank) * blockBytes
                                                        : send == recv;
  if (op.coll != Collective::AllReduce && op.coll != Collective::AllGather &&
      op.coll != Collective::ReduceScatter) {
    ringSchedule(op, opIndex, rank, nranks, plan, out);  // no halving-doubling form
    return;
  }
  std::vector<Lane> lanes;
  if (nranks == 1) {
    lanes.push_back(Lane{opIndex, 0, {}, {}});
    c.lane = &lanes[0];
    if (!inPlace) c.add(StepKind::Copy, -1, -1, c.S(0), c.R(0), op.count);
  } else if (op.coll == Collective::ReduceScatter) {
    // Recursive halving with partial sums in scratch: N x w elements per lane.
    int n = plan.channels >= 3 ? 4 : 2;
    size_t per = 0;
    for (int l = 0; l < n; ++l)
      per = std::max(per, std::min(chunkElems, partBegin(op.count, n, l + 1) - partBegin(op.count, n, l)));
    if (per) out->needScratch(opIndex, size_t(n) * size_t(nranks) * per * c.esz);
    for (int l = 0; l < n; ++l) lanes.push_back(Lane{opIndex, l, {}, {}});
    for (int l = 0; l < n; ++l) {
      size_t b = partBegin(op.count, n, l), e = partBegin(op.count, n, l + 1);
      c.lane = &lanes[size_t(l)];
      reduceScatterHalvingLane(c, l % 2 == 0, op.count, size_t(l) * size_t(nranks) * per, b, e, chunkElems);
    }
  } else {
    int n = plan.channels >= 3 ? 4 : 2;
    for (int l = 0; l < n; ++l) lanes.push_back(Lane{opIndex, l, {}, {}});
    for (int l = 0; l < n; ++l) {
      size_t b = partBegin(op.count, n, l), e = partBegin(op.count, n, l + 1);
      c.lane = &lanes[size_t(l)];
      if (op.coll == Collective::AllReduce)
        allReduceLane(c, l % 2 == 0, b, e, chunkElems);
      else
        allGatherLane(c, l % 2 == 0, op.count, inPlace, b, e, chunkElems);
    }
  }
  for (Lane& l : lanes)
    if (!l.steps.empty()) out->lanes.push_back(std::move(l));
}

// Cost (src/tuner/cost_model.h): log2 N exchanges each way; non-powers of
// two fold (one more exchange of the whole buffer before and after).  A lane
// sends, then receives (or the reverse): two dependent steps per exchange.
// Reduce-scatter and all-gather lanes hold part of every block's columns,
// so an exchange moves a step per block where blocks are strided: the
// all-gather 2(N-1) steps, the reduce-scatter N + 2 log2 N (first and last
// exchange); the reduce-scatter's partial sums also pass through scratch.
// Those steps repeat per loop of chunk columns (two lanes, half each).
void halvingDoublingEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const double S = in.S, n = in.n;
  auto add = [&](double us) { out->push_back(Estimate{Algorithm::HalvingDoubling, Algorithm::Ring, us, ""}); };
  if (in.N == 1) {
    out->push_back(Estimate{Algorithm::HalvingDoubling, Algorithm::Ring, -1, "one rank: the ring's copy"});
    return;
  }
  double aa, ab;
  in.anyPair(&aa, &ab);
  double fold = isPow2(in.N) ? 0 : 1;
  double lg = log2ceil(in.N) - fold;
  if (in.coll == Collective::AllReduce)
    add(2 * (2 * lg + 2 * fold) * aa + xfer(2 * (n - 1) / n * S + 2 * fold * S, ab) + in.reduce(S));
  else if (in.coll == Collective::ReduceScatter)
    add((n + 2 * (lg + fold)) * in.loops(S / n / 2, 1) * aa + xfer(2 * (n - 1) / n * S + fold * S, ab) +
        in.reduce((n - 1) / n * S + fold * S));
  else
    add(2 * (n - 1) * in.loops(S / n / 2, 1) * aa + xfer((n - 1) / n * S + fold * S, ab));
}

// As the rails' all-reduce: 2 log2 H exchanges; a non-power of two H moves
// the whole buffer twice more.
StepsAndBytesUs halvingDoublingRailCost(const CostInput& in, const RailCost& r) {
  double lgH = log2ceil(in.H), foldH = isPow2(in.H) ? 0 : 1;
  return {2 * lgH * r.na, xfer(r.netBytes + 2 * foldH * r.S, r.nb)};
}

}  // namespace loom
