#include "src/tuner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "src/core/error.h"

namespace loom {

namespace {

// Defaults, and where each comes from.  "dev VM" is the project's 2-core
// Debian 12 machine (no GPU, one NUMA node); the shm numbers are fit to
// `perf/algo_sweep.sh -n "2 3 4 8" -r 3 -i 10` on it, quiet (load < 1):
//   shm        alpha 0.4 us: ring all-reduce of 8 B at N=2 takes 0.8 us in
//              2 steps.  beta 22 GB/s: ring all-reduce of 16 MiB at N=2,
//              1162 us, after 0.5 x S of reduction at 20 GB/s.
//   shm_xnuma  alpha 0.6 us, beta 13 GB/s: not measurable here (one node);
//              assumed: a cross-socket hop costs about 1.5x a local one and
//              an UPI/Infinity-fabric link carries roughly 60% of local copy
//              bandwidth on 2-socket servers.  Calibrate on such a machine.
//   tcp        alpha 9 us: 8 B tcp all-reduce at N=2 took 18 us = 2 steps.
//              beta 1.9 GB/s: tcp busbw 1.7-2.0 GB/s at N=2 over loopback.
//              A 1 Gbit/s link is 0.125 GB/s: calibrate on real networks.
//   ucx        alpha 12 us, beta 0.9 GB/s: loom over UCX_TLS=tcp at N=2
//              (perf/ucx_compare.sh: 0.87-0.90 GB/s at 256 KiB-2 MiB).
//   reduce     20 GB/s: float32 sum of 64 MiB buffers (23 GB/s measured with
//              reduceHost; loom-topo --calibrate reports 15-18 under load).
//   oneshot    0.2 us: one-shot all-reduce of 8 B at N=2.
//   oversub    1.0 us per step and per rank per core: ring steps at 8 B-4 KiB
//              cost 2.5 us at N=4 and 4.3 us at N=8 on 2 cores (0.4 + 1.0 x
//              N/2); shm bandwidth and reductions are divided by N/cores.
const CostParams kDefaults = {
    {{0.4, 22.0}, {0.6, 13.0}, {9.0, 1.9}, {12.0, 0.9}}, 20.0, 0.2, 1.0, "defaults"};

double log2ceil(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return double(k);
}

bool isPow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Time of `bytes` at `gbps` in microseconds.
double xfer(double bytes, double gbps) { return bytes / (gbps * 1e3); }

}  // namespace

const char* costLinkName(CostLink c) {
  switch (c) {
    case CostLink::Shm: return "shm";
    case CostLink::ShmCrossNuma: return "shm_xnuma";
    case CostLink::Tcp: return "tcp";
    case CostLink::Ucx: return "ucx";
  }
  return "?";
}

CostParams CostParams::defaults() { return kDefaults; }

bool CostParams::load(const std::string& path, std::string* why) {
  std::ifstream in(path);
  if (!in) {
    *why = strf("cannot read tuning file %s", path.c_str());
    return false;
  }
  std::string line;
  int lineNo = 0;
  while (std::getline(in, line)) {
    ++lineNo;
    size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    size_t eq = line.find('=');
    auto trim = [](std::string s) {
      size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
      return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
    };
    if (trim(line).empty()) continue;
    if (eq == std::string::npos) {
      *why = strf("%s:%d: expected 'key = value'", path.c_str(), lineNo);
      return false;
    }
    std::string key = trim(line.substr(0, eq)), val = trim(line.substr(eq + 1));
    char* end = nullptr;
    double v = strtod(val.c_str(), &end);
    if (val.empty() || *end || !(v > 0) || !std::isfinite(v)) {
      *why = strf("%s:%d: %s: '%s' is not a positive number", path.c_str(), lineNo, key.c_str(), val.c_str());
      return false;
    }
    double* target = nullptr;
    for (int c = 0; c < kCostLinks; ++c) {
      std::string name = costLinkName(CostLink(c));
      if (key == name + ".alpha_us") target = &link[c].alphaUs;
      if (key == name + ".beta_GBps") target = &link[c].betaGBps;
    }
    if (key == "reduce.GBps") target = &reduceGBps;
    if (key == "oneshot.us") target = &oneShotUs;
    if (key == "oversub.step_us") target = &oversubStepUs;
    if (!target) {
      *why = strf("%s:%d: unknown key '%s'", path.c_str(), lineNo, key.c_str());
      return false;
    }
    *target = v;
  }
  source = path;
  return true;
}

int CommShape::hosts() const {
  int h = 0;
  for (int x : hostOf) h = std::max(h, x + 1);
  return std::max(h, 1);
}

int CommShape::mostPerHost() const {
  std::vector<int> n(size_t(hosts()), 0);
  int most = 1;
  for (int x : hostOf) most = std::max(most, ++n[size_t(x)]);
  return most;
}

double CommShape::oversubscription() const {
  if (cores.empty()) return 1;
  std::vector<int> n(size_t(hosts()), 0);
  for (int x : hostOf) ++n[size_t(x)];
  double f = 1;
  for (size_t h = 0; h < n.size() && h < cores.size(); ++h)
    if (cores[h] > 0) f = std::max(f, double(n[h]) / cores[h]);
  return f;
}

CostLink CommShape::between(int a, int b) const {
  if (hostOf.empty() || hostOf[size_t(a)] != hostOf[size_t(b)] || !shmWithinHost) return network;
  if (!numaOf.empty() && numaOf[size_t(a)] != numaOf[size_t(b)]) return CostLink::ShmCrossNuma;
  return CostLink::Shm;
}

namespace {

struct Model {
  const CommShape& s;
  const CostParams& p;
  int N, H, L;
  double f;     // ranks per core on the busiest host (>= 1)
  double osUs;  // extra per dependent step: a wake-up, longer the more ranks share a core

  Model(const CommShape& shape, const CostParams& params)
      : s(shape), p(params), N(shape.nranks), H(shape.hosts()), L(shape.mostPerHost()),
        f(shape.oversubscription()), osUs(f > 1 ? params.oversubStepUs * f : 0) {}

  // Shared-memory bandwidth and reductions are CPU work: with f ranks per
  // core each rank gets 1/f of it.
  LinkParams lp(CostLink c) const {
    LinkParams l = p.link[int(c)];
    if (c == CostLink::Shm || c == CostLink::ShmCrossNuma) l.betaGBps /= f;
    return l;
  }
  double alpha(CostLink c) const { return lp(c).alphaUs + osUs; }

  // The ring r -> r+1: its slowest step latency and the bandwidth of its
  // busiest link, where network edges leaving one host share its link.
  void ring(double* a, double* b) const {
    std::vector<int> leaving(size_t(H), 0);
    for (int r = 0; r < N; ++r)
      if (s.between(r, (r + 1) % N) == s.network && H > 1) ++leaving[size_t(s.hostOf[size_t(r)])];
    *a = 0;
    *b = 1e30;
    for (int r = 0; r < N; ++r) {
      CostLink c = s.between(r, (r + 1) % N);
      *a = std::max(*a, alpha(c));
      double share = (c == s.network && H > 1) ? std::max(1, leaving[size_t(s.hostOf[size_t(r)])]) : 1;
      *b = std::min(*b, lp(c).betaGBps / share);
    }
  }
  // Any-pair algorithms (rhd, tree) cross hosts with every rank of a host at
  // once: the slowest class, its bandwidth shared by the ranks of a host.
  void anyPair(double* a, double* b) const {
    bool crossNuma = false;
    for (int x : s.numaOf) crossNuma |= x != s.numaOf[0];
    CostLink worst = H > 1 ? s.network : crossNuma ? CostLink::ShmCrossNuma : CostLink::Shm;
    if (H == 1 && !s.shmWithinHost) worst = s.network;
    *a = alpha(worst);
    *b = lp(worst).betaGBps / (H > 1 ? L : 1);
  }
  double reduce(double bytes) const { return xfer(bytes, p.reduceGBps / f); }
};

void add(std::vector<Estimate>* out, Algorithm a, double us, Algorithm inner = Algorithm::Ring) {
  out->push_back(Estimate{a, inner, us, ""});
}
void no(std::vector<Estimate>* out, Algorithm a, const char* why, Algorithm inner = Algorithm::Ring) {
  out->push_back(Estimate{a, inner, -1, why});
}

}  // namespace

std::vector<Estimate> estimateAll(Collective coll, size_t bytesIn, const CommShape& shape, const CostParams& p) {
  std::vector<Estimate> out;
  Model m(shape, p);
  const int N = m.N, H = m.H, L = m.L;
  const double S = double(bytesIn), n = double(N);
  const size_t chunk = 128 << 10;  // the tuner's default chunk (tuner.cc)
  auto loops = [&](double bytes, double parts) { return std::max(1.0, std::ceil(bytes / (parts * double(chunk)))); };
  const bool allShm = H == 1 && shape.shmWithinHost && N > 1;
  const bool reducing = coll == Collective::AllReduce || coll == Collective::ReduceScatter || coll == Collective::Reduce;
  const bool rsag = coll == Collective::ReduceScatter || coll == Collective::AllGather;
  const double block = rsag ? S / n : S;  // bytes per rank's argument

  // One-shot: every rank reads every other rank's block from its mailbox.
  if (allShm && shape.oneShotBytes && block <= double(shape.oneShotBytes) && coll != Collective::P2P) {
    double us = p.oneShotUs + 1.5 * m.osUs + xfer((n - 1) * block, m.lp(CostLink::Shm).betaGBps) +
                (reducing ? m.reduce((n - 1) * block) : 0);
    add(&out, Algorithm::OneShot, us);
  } else {
    no(&out, Algorithm::OneShot, allShm ? "blocks above LOOM_SHM_SMALL_BYTES" : "needs every rank to share memory");
  }
  // Staged (all-reduce): per stage three waits for all ranks; each rank
  // copies S into its stage, reads S to reduce its S/N and copies S out.
  // Counted in slot-transfer equivalents (a ring byte is written into a slot
  // and read out of it): about (1 + 0.5/N) x S, since the stage copies move
  // whole chunks with streaming stores and the reduction reads in place.
  // Fit: 3373 us measured for 16 MiB at N=4, 3426 predicted.
  if (coll == Collective::AllReduce && allShm && shape.stageBytes) {
    double stages = std::ceil(S / double(shape.stageBytes));
    double us = stages * 3 * m.alpha(CostLink::Shm) + xfer((1.0 + 0.5 / n) * S, m.lp(CostLink::Shm).betaGBps) +
                m.reduce((n - 1) / n * S);
    add(&out, Algorithm::Staged, us);
  } else {
    no(&out, Algorithm::Staged, coll == Collective::AllReduce ? "needs every rank to share memory" : "all-reduce only");
  }
  if (N == 1) {
    add(&out, Algorithm::Ring, xfer(S, 10.0));
    return out;
  }
  // Ring: 2(N-1) steps per loop of N chunks (all-reduce), N-1 for RS/AG,
  // and a chain of N-1 hops for broadcast and reduce.
  double ra, rb;
  m.ring(&ra, &rb);
  switch (coll) {
    case Collective::AllReduce:
      add(&out, Algorithm::Ring, 2 * (n - 1) * loops(S, n) * ra + xfer(2 * (n - 1) / n * S, rb) + m.reduce((n - 1) / n * S));
      break;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      add(&out, Algorithm::Ring, (n - 1) * loops(S / n, 1) * ra + xfer((n - 1) / n * S, rb) +
                                     (reducing ? m.reduce((n - 1) / n * S) : 0));
      break;
    default:
      add(&out, Algorithm::Ring, ((n - 1) + loops(S, 1)) * ra + xfer(S, rb) + (reducing ? m.reduce(S) : 0));
      break;
  }
  // Recursive halving-doubling: log2 N exchanges each way; non-powers of two
  // fold (one more exchange of the whole buffer before and after).
  double aa, ab;
  m.anyPair(&aa, &ab);
  double fold = isPow2(N) ? 0 : 1;
  double lg = log2ceil(N) - fold;
  // A lane sends, then receives (or the reverse): two dependent steps per exchange.
  if (coll == Collective::AllReduce)
    add(&out, Algorithm::HalvingDoubling, 2 * (2 * lg + 2 * fold) * aa + xfer(2 * (n - 1) / n * S + 2 * fold * S, ab) +
                                              m.reduce(S));
  // Reduce-scatter and all-gather lanes hold part of every block's columns,
  // so an exchange moves a step per block where blocks are strided: the
  // all-gather 2(N-1) steps, the reduce-scatter N + 2 log2 N (first and last
  // exchange); the reduce-scatter's partial sums also pass through scratch.
  // Those steps repeat per loop of chunk columns (two lanes, half each).
  else if (coll == Collective::ReduceScatter)
    add(&out, Algorithm::HalvingDoubling, (n + 2 * (lg + fold)) * loops(S / n / 2, 1) * aa + xfer(2 * (n - 1) / n * S + fold * S, ab) +
                                              m.reduce((n - 1) / n * S + fold * S));
  else if (coll == Collective::AllGather)
    add(&out, Algorithm::HalvingDoubling, 2 * (n - 1) * loops(S / n / 2, 1) * aa + xfer((n - 1) / n * S + fold * S, ab));
  else
    no(&out, Algorithm::HalvingDoubling, "serves all-reduce, reduce-scatter and all-gather");
  // Double binary tree: depth log2 N up and down, pipelined in chunks; an
  // interior rank sends S/2 up each tree and S/2 down to each of its two
  // children in one tree: 2S (broadcast: S).
  double depth = log2ceil(N) + 1;
  if (coll == Collective::AllReduce)
    add(&out, Algorithm::Tree, (2 * depth + loops(S / 2, 1)) * aa + xfer(2 * S, ab) + m.reduce(S));
  else if (coll == Collective::Broadcast)
    add(&out, Algorithm::Tree, (depth + loops(S / 2, 1)) * aa + xfer(S, ab));
  else if (coll == Collective::Reduce)
    add(&out, Algorithm::Tree, (depth + loops(S / 2, 1)) * aa + xfer(S, ab) + m.reduce(S));
  else
    no(&out, Algorithm::Tree, "serves all-reduce, broadcast and reduce");
  // Hierarchical: rings inside hosts, the rails across; the host's network
  // link carries 2(H-1)/H x S (all-reduce) or (H-1)/H x S (RS, AG) in all.
  if (H < 2 || L < 2) {
    no(&out, Algorithm::Hierarchical,
       H < 2 ? "one host: the ring is the same schedule" : "one rank per host: the flat algorithms are the same");
  } else if (coll == Collective::AllReduce || rsag) {
    double l = double(L), h = double(H);
    CostLink local = shape.shmWithinHost ? CostLink::Shm : shape.network;
    double la = m.alpha(local), lb = m.lp(local).betaGBps;
    double na = m.alpha(shape.network), nb = m.lp(shape.network).betaGBps;
    double steps = coll == Collective::AllReduce ? 2 : 1;
    double localUs = L > 1 ? steps * (l - 1) * loops(S / l, 1) * la + xfer(steps * (l - 1) / l * S, lb) : 0;
    double red = reducing ? m.reduce(S) : 0;
    if (coll == Collective::AllReduce) {
      double rail = S / l, netBytes = 2 * (h - 1) / h * S;
      add(&out, Algorithm::Hierarchical, localUs + 2 * (h - 1) * loops(rail, h) * na + xfer(netBytes, nb) + red,
          Algorithm::Ring);
      double lgH = log2ceil(H), foldH = isPow2(H) ? 0 : 1;
      add(&out, Algorithm::Hierarchical, localUs + 2 * lgH * na + xfer(netBytes + 2 * foldH * S, nb) + red,
          Algorithm::HalvingDoubling);
      add(&out, Algorithm::Hierarchical,
          localUs + (2 * (lgH + 1) + loops(rail / 2, 1)) * na + xfer(2 * S, nb) + red, Algorithm::Tree);
    } else {
      add(&out, Algorithm::Hierarchical,
          localUs + (h - 1) * loops(S / (l * h), 1) * na + xfer((h - 1) / h * S, nb) + red, Algorithm::Ring);
    }
  } else {
    no(&out, Algorithm::Hierarchical, "serves all-reduce, reduce-scatter and all-gather");
  }
  return out;
}

Estimate cheapest(const std::vector<Estimate>& all) {
  Estimate best{Algorithm::Ring, Algorithm::Ring, -1, "nothing eligible"};
  for (const Estimate& e : all)
    if (e.us >= 0 && (best.us < 0 || e.us < best.us)) best = e;
  return best;
}

}  // namespace loom
