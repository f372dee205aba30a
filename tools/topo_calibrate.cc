// Measurement method (BENCHMARKING.md): rank 0 and one peer per link class
// ping-pong through the public API (loomSend / loomRecv, blocking: NULL
// stream) while the other ranks wait in a barrier.  Latency alpha is half the
// median 8-byte round trip.  Bandwidth: rank 0 sends N bytes, the peer answers
// with 8 bytes, so one iteration costs alpha + N/beta + alpha, and
// beta = N / (median - 2 alpha).  Medians, not means: the machines are shared.
#include "tools/topo_calibrate.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <vector>

#include "src/core/comm.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"
#include "src/topology/topology.h"

namespace loom {

namespace {

double nowUs() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void check(loomResult_t r, loomComm_t comm, const char* what) {
  if (r != loomSuccess) fail(r, "%s: %s", what, loomGetLastError(comm));
}

void barrier(loomComm_t comm) {
  int32_t x = 0;
  check(loomAllReduce(&x, &x, 1, loomInt32, loomSum, comm, nullptr), comm, "barrier");
}

// Median time (us) of one iteration of: rank 0 sends `bytes`, peer answers 8.
double pingPong(loomComm_t comm, int me, int peer, std::vector<uint8_t>& buf, size_t bytes, int warm, int iters) {
  std::vector<double> times;
  uint8_t ack[8] = {};
  for (int i = 0; i < warm + iters; ++i) {
    double t0 = nowUs();
    if (me == 0) {
      check(loomSend(buf.data(), bytes, loomUint8, peer, comm, nullptr), comm, "loomSend");
      check(loomRecv(ack, sizeof ack, loomUint8, peer, comm, nullptr), comm, "loomRecv");
    } else {
      check(loomRecv(buf.data(), bytes, loomUint8, 0, comm, nullptr), comm, "loomRecv");
      check(loomSend(ack, sizeof ack, loomUint8, 0, comm, nullptr), comm, "loomSend");
    }
    if (i >= warm) times.push_back(nowUs() - t0);
  }
  return median(times);
}

double measureReduce(size_t bytes) {
  size_t n = bytes / sizeof(float);
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {
    double t0 = nowUs();
    reduceHost(a.data(), a.data(), b.data(), n, loomFloat32, loomSum);
    if (i > 0) times.push_back(nowUs() - t0);
  }
  return double(n * sizeof(float)) / median(times) / 1e3;
}

}  // namespace

Calibration calibrate(loomComm_t comm, const CalibrateOptions& opt) {
  Calibration cal;
  cal.options = opt;
  const CommTopology& topo = comm->topology();
  int me = comm->rank(), n = comm->nranks();
  // Rank 0 picks one peer per class, as it sees the links, and tells everyone.
  // Network pairs are measured under the transport they use (LOOM_TRANSPORTS
  // decides: shm,ucx puts ucx between hosts).
  // The keys are the cost model's link names (costLinkName).
  const char* keys[] = {"shm", "shm_xnuma", "tcp", "ucx", "verbs"};
  constexpr int kKeys = int(sizeof keys / sizeof keys[0]);
  int32_t peerFor[kKeys] = {-1, -1, -1, -1, -1};
  if (me == 0) {
    for (int r = 1; r < n; ++r) {
      int k;
      if (strcmp(comm->transportTo(r), "shm") == 0)
        k = topo.linkClass(0, r) == LinkClass::ShmCrossNuma ? 1 : 0;
      else if (strcmp(comm->transportTo(r), "ucx") == 0)
        k = 3;
      else if (strcmp(comm->transportTo(r), "ibverbs") == 0)
        k = 4;
      else
        k = 2;
      if (peerFor[k] < 0) peerFor[k] = r;
    }
  }
  check(loomBroadcast(peerFor, peerFor, kKeys, loomInt32, 0, comm, nullptr), comm, "loomBroadcast");

  std::vector<uint8_t> buf(std::max<size_t>(opt.bandwidthBytes, 8), 0x5a);
  for (int k = 0; k < kKeys; ++k) {
    int peer = peerFor[k];
    if (peer < 0) {
      if (me == 0)
        cal.notes.push_back(strf("%s: no pair of ranks uses this link class here", keys[k]));
      continue;
    }
    if (me == 0 || me == peer) {
      int warm = std::max(5, opt.latencyIters / 10);
      double rtt = pingPong(comm, me, peer, buf, 8, warm, opt.latencyIters);
      double big = pingPong(comm, me, peer, buf, opt.bandwidthBytes, 2, opt.bandwidthIters);
      if (me == 0) {
        LinkMeasurement m;
        m.key = keys[k];
        m.peer = peer;
        m.alphaUs = rtt / 2;
        m.largeOneWayUs = big;
        double transfer = big - rtt;  // 2 alpha: the send's and the ack's latency
        if (transfer <= 0) transfer = big;
        m.betaGBps = double(opt.bandwidthBytes) / transfer / 1e3;
        cal.links.push_back(m);
      }
    }
    barrier(comm);
  }
  if (me == 0) cal.reduceGBps = measureReduce(opt.reduceBytes);
  barrier(comm);
  if (me != 0) cal.links.clear(), cal.notes.clear();
  return cal;
}

std::string tuningFileText(const Calibration& cal, loomComm_t comm) {
  const CommTopology& topo = comm->topology();
  char date[64];
  time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S UTC", gmtime(&now));
  std::string s;
  s += "# loom tuning file, written by loom-topo --calibrate (read through LOOM_TUNING_FILE)\n";
  s += strf("# %s; %d ranks on %d hosts; measured from rank 0 (host %s)\n", date, topo.nranks(), topo.nhosts(),
            topo.hostName(0).c_str());
  const Topology* machine = processTopology();
  s += strf("# topology: %s\n", machine ? machine->source.c_str() : "(hwloc failed)");
  s += strf("# alpha_us: half the median round trip of an 8-byte message (%d iterations)\n",
            cal.options.latencyIters);
  s += strf("# beta_GBps: %zu-byte transfers answered by 8 bytes, beta = bytes / (median - 2 alpha), "
            "%d iterations; GB = 1e9 bytes\n",
            cal.options.bandwidthBytes, cal.options.bandwidthIters);
  for (const LinkMeasurement& m : cal.links) {
    s += strf("# %s: rank 0 <-> rank %d\n", m.key.c_str(), m.peer);
    s += strf("%s.alpha_us = %.3f\n", m.key.c_str(), m.alphaUs);
    s += strf("%s.beta_GBps = %.3f\n", m.key.c_str(), m.betaGBps);
  }
  for (const std::string& note : cal.notes) s += "# not measured: " + note + "\n";
  s += strf("# reduce.GBps: float32 sum a += b over %zu bytes, bytes of one input per second (rank 0)\n",
            cal.options.reduceBytes);
  s += strf("reduce.GBps = %.3f\n", cal.reduceGBps);
  return s;
}

}  // namespace loom
