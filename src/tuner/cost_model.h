// The tuner's cost model: an alpha-beta estimate of every eligible
// algorithm's time for one (collective, size) on one communicator shape.
//
// A link class has a latency alpha (microseconds per dependent step: the
// time from one rank posting a slot to the next rank acting on it) and a
// bandwidth beta (GB/s one rank can push through it while the others do the
// same).  Host reductions run at gamma GB/s.  An algorithm's time is the sum
// over its sequential steps of alpha plus the bytes on its busiest link over
// beta, plus its reduction work over gamma.  Each algorithm's formula is in
// its own file under algorithms/, reached through the registry
// (algorithms/registry.h); this file holds what they share: the link
// parameters, the communicator's shape and CostInput's helpers.  Every
// default parameter says where it came from (kDefaults in cost_model.cc),
// and a tuning file written by `loom-topo --calibrate` (LOOM_TUNING_FILE)
// replaces any of them.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "transports/transport.h"  // CostLink: the class a transport is costed as

namespace loom {

constexpr int kCostLinks = 5;
const char* costLinkName(CostLink c);  // "shm", "shm_xnuma", "tcp", "ucx", "verbs"

struct LinkParams {
  double alphaUs;
  double betaGBps;
};

struct CostParams {
  LinkParams link[kCostLinks];
  double reduceGBps;       // host reduction (float32 sum), bytes of output per second
  double oneShotUs;        // one round through the shm mailboxes (one-shot path)
  double oversubStepUs;    // extra per dependent step and per rank per core when a host runs more ranks than cores
  std::string source;      // "defaults" or the tuning file's path

  static CostParams defaults();
  // Reads `key = value` lines ('#' comments) over the defaults: shm.alpha_us,
  // shm.beta_GBps, shm_xnuma.*, tcp.*, ucx.*, verbs.*, reduce.GBps, oneshot.us,
  // oversub.step_us.  Returns false and says why for an unreadable file,
  // an unknown key or a bad value.
  bool load(const std::string& path, std::string* why);
};

// What the model needs to know about a communicator.
struct CommShape {
  int nranks = 1;
  std::vector<int> hostOf;          // host number per rank (0..hosts-1)
  std::vector<int> numaOf;          // NUMA node per rank (empty: all the same)
  std::vector<int> cores;           // cores per host (empty: unknown, never oversubscribed)
  CostLink network = CostLink::Tcp;  // between hosts
  bool shmWithinHost = true;        // false: LOOM_TRANSPORTS keeps shm out
  size_t oneShotBytes = 0;          // 0: no one-shot path
  size_t stageBytes = 0;            // 0: no staged path
  int hosts() const;
  int mostPerHost() const;
  double oversubscription() const;  // ranks per core on the busiest host, at least 1
  CostLink between(int a, int b) const;
};

struct Estimate {
  Algorithm algo;
  Algorithm inner;   // hierarchical: the rails' flat algorithm
  double us;         // predicted time; < 0: not eligible
  std::string why;   // not eligible: why
};

// One (collective, size) on one shape, and the quantities and helpers every
// algorithm's cost function uses.
struct CostInput {
  const CommShape& s;
  const CostParams& p;
  Collective coll;
  double S;       // bytes as estimateAll counts them (see there)
  int N, H, L;    // ranks, hosts, most ranks on one host
  double n;       // N as a double
  double f;       // ranks per core on the busiest host (>= 1)
  double osUs;    // extra per dependent step: a wake-up, longer the more ranks share a core
  bool allShm;    // more than one rank, all on one host, shm allowed
  bool reducing;  // all-reduce, reduce-scatter, reduce
  bool rsag;      // reduce-scatter or all-gather
  double block;   // bytes of one rank's argument

  CostInput(Collective coll, size_t bytes, const CommShape& shape, const CostParams& params);
  // Shared-memory bandwidth and reductions are CPU work: with f ranks per
  // core each rank gets 1/f of it.
  LinkParams lp(CostLink c) const;
  double alpha(CostLink c) const { return lp(c).alphaUs + osUs; }
  // The ring r -> r+1: its slowest step latency and the bandwidth of its
  // busiest link, where network edges leaving one host share its link.
  void ring(double* a, double* b) const;
  // Any-pair algorithms (rhd, tree) cross hosts with every rank of a host at
  // once: the slowest class, its bandwidth shared by the ranks of a host.
  void anyPair(double* a, double* b) const;
  double reduce(double bytes) const;
  // Loops of `parts` chunks of the tuner's default chunk over `bytes` (at least one).
  double loops(double bytes, double parts) const;
};

// Time of `bytes` at `gbps` in microseconds.
inline double xfer(double bytes, double gbps) { return bytes / (gbps * 1e3); }
double log2ceil(int n);
inline bool isPow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// `bytes` is the size nccl-tests reports: all-reduce, broadcast and reduce
// count x dtype size; reduce-scatter and all-gather the whole (N x block).
// One estimate per registered algorithm (the hierarchical one per inner
// algorithm), in the registry's order.
std::vector<Estimate> estimateAll(Collective coll, size_t bytes, const CommShape& shape, const CostParams& p);

// The cheapest eligible estimate.
Estimate cheapest(const std::vector<Estimate>& all);

}  // namespace loom
