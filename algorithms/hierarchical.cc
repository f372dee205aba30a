// Hierarchical all-reduce, reduce-scatter and all-gather over ranks grouped
// by host (the two-level scheme of Sack & Gropp's "Collective algorithms for
// multiported torus networks" and of NCCL's and Horovod's hierarchical modes:
// reduce inside each host over its fast links, cross hosts once per shard,
// spread the result inside each host again).
//
// Hosts h = 0..H-1 hold L_h ranks (any sizes, any rank numbering); M is the
// largest L_h.  A rank's local index is its position among its host's ranks.
// "Rail" s (s = 0..M-1) is the set of one rank per host: host h's local
// rank s mod L_h.  A rank with local index j serves the rails s = j (mod L_h),
// so on a host with fewer ranks some ranks serve several rails.
//
// All-reduce of S bytes: the buffer is cut into M shards; shard s belongs
// to rail s.
//   1. intra-host ring reduce-scatter: local rank j ends with its host's sum
//      of the shards it serves (into recv);
//   2. per rail, an all-reduce of its shard among the rail's H ranks, in
//      place in recv, by any flat algorithm (Plan::inner: ring, rhd, tree);
//   3. intra-host ring all-gather of the shards (recv to recv).
// Steps: 2(L_h - 1) inside the host per chunk plus the inner algorithm's
// (ring 2(H-1), rhd 2 log2 H, tree 2 log2 H).  Bytes sent per rank, even hosts
// (L ranks each): 2(L-1)/L x S inside and 2(H-1)/H x S/L between hosts with
// the ring inside the rail, so each host's network traffic is 2(H-1)/H x S
// in all, spread over its L ranks: the flat ring sends 2(N-1)/N x S per rank,
// most of it across hosts.
//
// Reduce-scatter (block g of count elements ends on rank g): block g's local
// index is its owner's.
//   1. intra-host ring reduce-scatter: local rank j gets its host's partial
//      sums of every block whose local index is = j (mod L_h), from every
//      host, into scratch (H > 1) or its own block straight into recv;
//   2. per rail s, a ring reduce-scatter among the rail's ranks where the
//      rank on host h takes block (h, s) if that host has a local rank s
//      (then it is that very rank) and nothing otherwise.
// No third phase: each rail delivers every block to its owner.
// All-gather is the mirror: rail all-gathers first (each rank sends its
// block to its rail), then an intra-host ring all-gather of what each rank
// received.  Both move (N-1) blocks into each rank, (H-1) x L of them across
// hosts per host, each once.
//
// The phases are lanes that wait for the previous phase's lanes
// (Lane::after); nothing needs a barrier across ranks, since a rank's data
// for phase k+1 is final when its own phase k is done.  Rails with the same
// peer share a connection; the executor runs their lanes in order, the same
// order on both sides.
#include <algorithm>
#include <functional>

#include "algorithms/algorithms.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

int mod(int x, int n) { return ((x % n) + n) % n; }

// Elements [elem, elem + n) in the operation's global coordinates.
struct Seg {
  size_t elem;
  size_t n;
};
using Block = std::vector<Seg>;

// The block cut into steps: each segment into chunks of at most `chunk`
// elements.  A step never spans two segments, so a pure send step is never
// more slots than a chunk (the executor needs the first send of a ring step
// sequence to fit the slot ring).
std::vector<Block> pieces(const std::vector<Block>& blocks, size_t chunk, size_t* most) {
  std::vector<Block> out;
  *most = 0;
  for (const Block& b : blocks) {
    Block p;
    for (const Seg& s : b)
      for (size_t o = 0; o < s.n; o += chunk) p.push_back(Seg{s.elem + o, std::min(chunk, s.n - o)});
    *most = std::max(*most, p.size());
    out.push_back(std::move(p));
  }
  return out;
}

// Where a global element lives in one phase (send, recv or scratch).
using PlaceFn = std::function<BufRef(size_t elem)>;

struct RingCtx {
  std::vector<int> members;  // ring order
  int pos;                   // this rank's position
  std::vector<Block> blocks; // per position
  size_t esz;
  size_t chunkElems;
};

// Ring reduce-scatter over arbitrary blocks: position p ends with the
// reduction of blocks[p], from src into dst.
void ringReduceScatter(const RingCtx& c, const PlaceFn& src, const PlaceFn& dst, bool finalize, Lane* lane) {
  const int L = int(c.members.size()), p = c.pos;
  if (L == 1) {
    for (const Seg& s : c.blocks[0]) {
      BufRef a = src(s.elem), b = dst(s.elem);
      if (s.n && (a.buf != b.buf || a.offset != b.offset))
        lane->steps.push_back(makeStep(StepKind::Copy, -1, -1, a, b, s.n * c.esz));
    }
    return;
  }
  const int next = c.members[size_t(mod(p + 1, L))], prev = c.members[size_t(mod(p - 1, L))];
  size_t most;
  std::vector<Block> cut = pieces(c.blocks, c.chunkElems, &most);
  BufRef none;
  for (size_t q = 0; q < most; ++q) {
    auto emit = [&](StepKind kind, int j, bool last) {
      const Block& b = cut[size_t(mod(p - j, L))];
      if (q >= b.size()) return;
      const Seg& s = b[q];
      int from = kind == StepKind::Send ? -1 : prev, to = last ? -1 : next;
      lane->steps.push_back(
          makeStep(kind, from, to, src(s.elem), last ? dst(s.elem) : none, s.n * c.esz, last && finalize));
    };
    emit(StepKind::Send, 1, false);
    for (int j = 2; j <= L - 1; ++j) emit(StepKind::RecvReduceSend, j, false);
    emit(StepKind::RecvReduce, 0, true);
  }
}

// Ring all-gather over arbitrary blocks: position p's block comes from src,
// every other position's lands in dst (p's own is the caller's business).
void ringAllGather(const RingCtx& c, const PlaceFn& src, const PlaceFn& dst, Lane* lane) {
  const int L = int(c.members.size()), p = c.pos;
  if (L == 1) return;
  const int next = c.members[size_t(mod(p + 1, L))], prev = c.members[size_t(mod(p - 1, L))];
  size_t most;
  std::vector<Block> cut = pieces(c.blocks, c.chunkElems, &most);
  BufRef none;
  for (size_t q = 0; q < most; ++q) {
    if (q < cut[size_t(p)].size()) {
      const Seg& s = cut[size_t(p)][q];
      lane->steps.push_back(makeStep(StepKind::Send, -1, next, src(s.elem), none, s.n * c.esz));
    }
    for (int j = 1; j <= L - 1; ++j) {
      const Block& b = cut[size_t(mod(p - j, L))];
      if (q >= b.size()) continue;
      const Seg& s = b[q];
      lane->steps.push_back(makeStep(j < L - 1 ? StepKind::RecvCopySend : StepKind::Recv, prev,
                                     j < L - 1 ? next : -1, none, dst(s.elem), s.n * c.esz));
    }
  }
}

struct Layout {
  std::vector<std::vector<int>> hosts;  // ranks of each host, ascending
  std::vector<int> host, local;         // per rank
  int M = 1;                            // most ranks on one host
  // Rail s: host h's local rank s mod L_h, in host order.
  std::vector<int> rail(int s) const {
    std::vector<int> r;
    for (const auto& h : hosts) r.push_back(h[size_t(s) % h.size()]);
    return r;
  }
};

Layout makeLayout(const std::vector<int>& hostOf) {
  Layout lay;
  int n = int(hostOf.size());
  std::vector<int> index;  // host id -> host number in order of first rank
  lay.host.resize(size_t(n));
  lay.local.resize(size_t(n));
  for (int r = 0; r < n; ++r) {
    int id = hostOf[size_t(r)];
    auto it = std::find(index.begin(), index.end(), id);
    int h = int(it - index.begin());
    if (it == index.end()) {
      index.push_back(id);
      lay.hosts.emplace_back();
    }
    lay.host[size_t(r)] = h;
    lay.local[size_t(r)] = int(lay.hosts[size_t(h)].size());
    lay.hosts[size_t(h)].push_back(r);
  }
  for (const auto& h : lay.hosts) lay.M = std::max(lay.M, int(h.size()));
  return lay;
}

// This rank's place in the layout, and the ring over rail s whose host-k
// position holds block (k, s) of `count` elements when host k has a local
// rank s (empty otherwise): reduce-scatter and all-gather across hosts.
struct View {
  const Layout& lay;
  size_t esz, chunkElems;
  int n, h, j, L, H, M;
  const std::vector<int>& mine;
  View(const OpDesc& op, int rank, const Layout& l, const Plan& plan)
      : lay(l), esz(dtypeSize(op.dtype)), chunkElems(std::max<size_t>(1, plan.chunkBytes / esz)),
        n(int(l.host.size())), h(l.host[size_t(rank)]), j(l.local[size_t(rank)]),
        L(int(l.hosts[size_t(h)].size())), H(int(l.hosts.size())), M(l.M), mine(l.hosts[size_t(h)]) {}
  RingCtx railBlocks(int s, size_t count) const {
    RingCtx rail{lay.rail(s), h, std::vector<Block>(size_t(H)), esz, chunkElems};
    for (int k = 0; k < H; ++k)
      if (s < int(lay.hosts[size_t(k)].size()))
        rail.blocks[size_t(k)].push_back(Seg{size_t(lay.hosts[size_t(k)][size_t(s)]) * count, count});
    return rail;
  }
};

// Appends `flat`'s lanes for a sub-communicator: virtual rank v is
// members[v], and the flat schedule's send and recv buffers are `base` shifted
// by `offset` bytes.  Every lane waits for `after`.
void appendMapped(const Schedule& flat, const std::vector<int>& members, Buf base, size_t offset,
                  const std::vector<int>& after, Schedule* out) {
  auto mapRef = [&](BufRef r) {
    if (r.buf == Buf::None) return r;
    return BufRef{base, r.offset + offset};
  };
  for (const Lane& l : flat.lanes) {
    Lane m = l;
    m.after = after;
    for (Step& s : m.steps) {
      if (s.recvPeer >= 0) s.recvPeer = members[size_t(s.recvPeer)];
      if (s.sendPeer >= 0) s.sendPeer = members[size_t(s.sendPeer)];
      s.src = mapRef(s.src);
      s.dst = mapRef(s.dst);
    }
    out->lanes.push_back(std::move(m));
  }
}

// Indices of lanes [from, out->lanes.size()).
std::vector<int> lanesSince(size_t from, const Schedule& s) {
  std::vector<int> v;
  for (size_t i = from; i < s.lanes.size(); ++i) v.push_back(int(i));
  return v;
}

void pushLane(Lane&& lane, const std::vector<int>& after, Schedule* out) {
  if (lane.steps.empty()) return;
  lane.after = after;
  out->lanes.push_back(std::move(lane));
}

void allReduce(const OpDesc& op, int opIndex, int rank, const Layout& lay, const Plan& plan, Schedule* out) {
  const View v(op, rank, lay, plan);
  const size_t esz = v.esz;
  const int h = v.h, j = v.j, L = v.L, H = v.H, M = v.M;
  auto shard = [&](int s) { return Seg{partBegin(op.count, M, s), partBegin(op.count, M, s + 1) - partBegin(op.count, M, s)}; };
  RingCtx ring{v.mine, j, std::vector<Block>(size_t(L)), esz, v.chunkElems};
  for (int s = 0; s < M; ++s) ring.blocks[size_t(s % L)].push_back(shard(s));
  PlaceFn S = [&](size_t e) { return BufRef{Buf::Send, e * esz}; };
  PlaceFn R = [&](size_t e) { return BufRef{Buf::Recv, e * esz}; };

  // 1. Intra-host reduce-scatter (the whole result when there is one host).
  size_t first = out->lanes.size();
  Lane l1;
  l1.op = opIndex;
  ringReduceScatter(ring, S, R, H == 1, &l1);
  pushLane(std::move(l1), {}, out);
  std::vector<int> after = lanesSince(first, *out);

  // 2. Per served rail, the shard's all-reduce among the hosts.
  size_t second = out->lanes.size();
  if (H > 1)
    for (int s = j; s < M; s += L) {
      Seg sh = shard(s);
      if (sh.n == 0) continue;
      OpDesc sub = op;
      sub.count = sh.n;
      sub.sendbuf = sub.recvbuf = out;  // in place; only compared, never read
      Plan p = plan;
      p.algo = algorithmEntry(plan.inner).railCost ? plan.inner : Algorithm::Ring;
      Schedule flat;
      buildSchedule(sub, opIndex, h, H, {}, p, &flat);
      appendMapped(flat, lay.rail(s), Buf::Recv, sh.elem * esz, after, out);
    }
  if (out->lanes.size() > second) after = lanesSince(second, *out);

  // 3. Intra-host all-gather of the shards.
  Lane l3;
  l3.op = opIndex;
  ringAllGather(ring, R, R, &l3);
  pushLane(std::move(l3), after, out);
}

void reduceScatter(const OpDesc& op, int opIndex, int rank, const Layout& lay, const Plan& plan, Schedule* out) {
  const View v(op, rank, lay, plan);
  const size_t esz = v.esz, rc = op.count, chunkElems = v.chunkElems;
  const int n = v.n, j = v.j, L = v.L, H = v.H, M = v.M;
  const std::vector<int>& mine = v.mine;
  // Blocks this rank reduces in phase 1, in rank order, and their scratch slots.
  std::vector<long long> slot(size_t(n), -1);
  size_t slots = 0;
  RingCtx ring{mine, j, std::vector<Block>(size_t(L)), esz, chunkElems};
  for (int g = 0; g < n; ++g) {
    int p = lay.local[size_t(g)] % L;
    ring.blocks[size_t(p)].push_back(Seg{size_t(g) * rc, rc});
    if (p == j && H > 1) slot[size_t(g)] = (long long)slots++;
  }
  if (rc == 0) return;
  out->needScratch(opIndex, slots * rc * esz);
  PlaceFn S = [&](size_t e) { return BufRef{Buf::Send, e * esz}; };
  // Block g's partial: scratch slot (several hosts) or the result (one host).
  PlaceFn partial = [&](size_t e) {
    size_t g = e / rc;
    if (slot[g] < 0) return BufRef{Buf::Recv, (e - g * rc) * esz};
    return BufRef{Buf::Scratch, (size_t(slot[g]) * rc + (e - g * rc)) * esz};
  };
  size_t first = out->lanes.size();
  Lane l1;
  l1.op = opIndex;
  ringReduceScatter(ring, S, partial, H == 1, &l1);
  pushLane(std::move(l1), {}, out);
  if (H == 1) return;
  std::vector<int> after = lanesSince(first, *out);
  PlaceFn R = [&](size_t e) { return BufRef{Buf::Recv, (e - size_t(rank) * rc) * esz}; };
  for (int s = j; s < M; s += L) {
    RingCtx rail = v.railBlocks(s, rc);
    Lane l2;
    l2.op = opIndex;
    ringReduceScatter(rail, partial, R, true, &l2);
    pushLane(std::move(l2), after, out);
  }
}

void allGather(const OpDesc& op, int opIndex, int rank, const Layout& lay, const Plan& plan, Schedule* out) {
  const View v(op, rank, lay, plan);
  const size_t esz = v.esz, sc = op.count, chunkElems = v.chunkElems;
  const int n = v.n, j = v.j, L = v.L, H = v.H, M = v.M;
  const std::vector<int>& mine = v.mine;
  if (sc == 0) return;
  const size_t own = size_t(rank) * sc;
  bool inPlace = static_cast<const char*>(op.sendbuf) == static_cast<const char*>(op.recvbuf) + own * esz;
  PlaceFn R = [&](size_t e) { return BufRef{Buf::Recv, e * esz}; };
  // My block comes from the send buffer; everything else lives in recv.
  PlaceFn fromSend = [&](size_t e) {
    if (e >= own && e < own + sc) return BufRef{Buf::Send, (e - own) * esz};
    return BufRef{Buf::Recv, e * esz};
  };
  size_t first = out->lanes.size();
  if (!inPlace) {
    Lane copy;
    copy.op = opIndex;
    copy.steps.push_back(makeStep(StepKind::Copy, -1, -1, fromSend(own), R(own), sc * esz));
    pushLane(std::move(copy), {}, out);
  }
  // 1. Rail all-gathers: each block reaches its local index's rail on every host.
  for (int s = j; s < M && H > 1; s += L) {
    RingCtx rail = v.railBlocks(s, sc);
    Lane l1;
    l1.op = opIndex;
    ringAllGather(rail, fromSend, R, &l1);
    pushLane(std::move(l1), {}, out);
  }
  // 2. Intra-host all-gather of the blocks each rank's rails brought.  It
  // waits for the copy too: its first send may read my block from recv.
  std::vector<int> after = lanesSince(first, *out);
  RingCtx ring{mine, j, std::vector<Block>(size_t(L)), esz, chunkElems};
  for (int g = 0; g < n; ++g) ring.blocks[size_t(lay.local[size_t(g)] % L)].push_back(Seg{size_t(g) * sc, sc});
  Lane l2;
  l2.op = opIndex;
  ringAllGather(ring, fromSend, R, &l2);
  pushLane(std::move(l2), after, out);
}

}  // namespace

void hierarchicalSchedule(const OpDesc& op, int opIndex, int rank, const std::vector<int>& hostOf,
                          const Plan& plan, Schedule* out) {
  const int n = int(hostOf.size());
  bool served = op.coll == Collective::AllReduce || op.coll == Collective::ReduceScatter ||
                op.coll == Collective::AllGather;
  if (n <= 1 || !served) {
    ringSchedule(op, opIndex, rank, n, plan, out);
    return;
  }
  Layout lay = makeLayout(hostOf);
  if (op.coll == Collective::AllReduce) allReduce(op, opIndex, rank, lay, plan, out);
  else if (op.coll == Collective::ReduceScatter) reduceScatter(op, opIndex, rank, lay, plan, out);
  else allGather(op, opIndex, rank, lay, plan, out);
}

// Cost (src/tuner/cost_model.h): rings inside hosts, the rails across; the
// host's network link carries 2(H-1)/H x S (all-reduce) or (H-1)/H x S (RS,
// AG) in all.  All-reduce: one estimate per registered rail algorithm.
void hierarchicalEstimate(const CostInput& in, std::vector<Estimate>* out) {
  const int H = in.H, L = in.L;
  const double S = in.S;
  if (H < 2 || L < 2) {
    out->push_back(Estimate{Algorithm::Hierarchical, Algorithm::Ring, -1,
                            H < 2 ? "one host: the ring is the same schedule"
                                  : "one rank per host: the flat algorithms are the same"});
    return;
  }
  double l = double(L), h = double(H);
  CostLink local = in.s.shmWithinHost ? CostLink::Shm : in.s.network;
  double la = in.alpha(local), lb = in.lp(local).betaGBps;
  double na = in.alpha(in.s.network), nb = in.lp(in.s.network).betaGBps;
  double steps = in.coll == Collective::AllReduce ? 2 : 1;
  double localUs = L > 1 ? steps * (l - 1) * in.loops(S / l, 1) * la + xfer(steps * (l - 1) / l * S, lb) : 0;
  double red = in.reducing ? in.reduce(S) : 0;
  if (in.coll == Collective::AllReduce) {
    RailCost r{l, h, S, S / l, 2 * (h - 1) / h * S, na, nb};
    for (const AlgorithmEntry& a : algorithmRegistry())
      if (a.railCost) {
        StepsAndBytesUs c = a.railCost(in, r);
        out->push_back(Estimate{Algorithm::Hierarchical, a.algo, localUs + c.stepsUs + c.bytesUs + red, ""});
      }
  } else {
    // The rails of RS and AG are rings whatever the inner algorithm.
    out->push_back(Estimate{Algorithm::Hierarchical, Algorithm::Ring,
                            localUs + (h - 1) * in.loops(S / (l * h), 1) * na + xfer((h - 1) / h * S, nb) + red, ""});
  }
}

}  // namespace loom
