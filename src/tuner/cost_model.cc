#include "src/tuner/cost_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>

#include "algorithms/registry.h"
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
//   verbs      alpha 3 us, beta 11 GB/s: not measurable here (the only RDMA
//              stack is Soft-RoCE under qemu TCG, tests/vm/, whose numbers
//              measure the emulator); assumed for a 100 Gbit/s RoCE/IB NIC:
//              ib_write_bw peaks near 11.5 GB/s on such links and ib_send_lat
//              is 1-2 us, plus loom's step overhead.  Calibrate on real NICs.
//   reduce     20 GB/s: float32 sum of 64 MiB buffers (23 GB/s measured with
//              reduceHost; loom-topo --calibrate reports 15-18 under load).
//   oneshot    0.2 us: one-shot all-reduce of 8 B at N=2.
//   oversub    1.0 us per step and per rank per core: ring steps at 8 B-4 KiB
//              cost 2.5 us at N=4 and 4.3 us at N=8 on 2 cores (0.4 + 1.0 x
//              N/2); shm bandwidth and reductions are divided by N/cores.
const CostParams kDefaults = {
    {{0.4, 22.0}, {0.6, 13.0}, {9.0, 1.9}, {12.0, 0.9}, {3.0, 11.0}}, 20.0, 0.2, 1.0, "defaults"};

}  // namespace

const char* costLinkName(CostLink c) {
  switch (c) {
    case CostLink::Shm: return "shm";
    case CostLink::ShmCrossNuma: return "shm_xnuma";
    case CostLink::Tcp: return "tcp";
    case CostLink::Ucx: return "ucx";
    case CostLink::Verbs: return "verbs";
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

double log2ceil(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return double(k);
}

CostInput::CostInput(Collective c, size_t bytes, const CommShape& shape, const CostParams& params)
    : s(shape), p(params), coll(c), S(double(bytes)), N(shape.nranks), H(shape.hosts()), L(shape.mostPerHost()),
      n(double(N)), f(shape.oversubscription()), osUs(f > 1 ? params.oversubStepUs * f : 0),
      allShm(H == 1 && shape.shmWithinHost && N > 1), reducing(reduces(c)),
      rsag(c == Collective::ReduceScatter || c == Collective::AllGather), block(perRankCount(c) ? S / n : S) {}

LinkParams CostInput::lp(CostLink c) const {
  LinkParams l = p.link[int(c)];
  if (c == CostLink::Shm || c == CostLink::ShmCrossNuma) l.betaGBps /= f;
  return l;
}

void CostInput::ring(double* a, double* b) const {
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

void CostInput::anyPair(double* a, double* b) const {
  bool crossNuma = false;
  for (int x : s.numaOf) crossNuma |= x != s.numaOf[0];
  CostLink worst = H > 1 ? s.network : crossNuma ? CostLink::ShmCrossNuma : CostLink::Shm;
  if (H == 1 && !s.shmWithinHost) worst = s.network;
  *a = alpha(worst);
  *b = lp(worst).betaGBps / (H > 1 ? L : 1);
}

double CostInput::reduce(double bytes) const { return xfer(bytes, p.reduceGBps / f); }

double CostInput::loops(double bytes, double parts) const {
  return std::max(1.0, std::ceil(bytes / (parts * double(kDefaultChunkBytes))));
}

std::vector<Estimate> estimateAll(Collective coll, size_t bytes, const CommShape& shape, const CostParams& p) {
  std::vector<Estimate> out;
  const CostInput in(coll, bytes, shape, p);
  Eligibility q{coll, in.N, in.block, in.allShm, shape.oneShotBytes, shape.stageBytes};
  for (const AlgorithmEntry& a : algorithmRegistry()) {
    std::string why = whyIneligible(a, q);
    if (!why.empty()) out.push_back(Estimate{a.algo, Algorithm::Ring, -1, why});
    else a.estimate(in, &out);
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
