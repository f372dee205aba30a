// loom-topo --calibrate: measures each link class present among the ranks of
// a communicator (latency of 8-byte ping-pongs, bandwidth of large
// transfers) and the host reduction throughput, for the tuner's tuning file.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "loom.h"

namespace loom {

struct CalibrateOptions {
  int latencyIters = 200;          // timed 8-byte round trips per link
  int bandwidthIters = 8;          // timed large transfers per link
  size_t bandwidthBytes = 16 << 20;
  size_t reduceBytes = 64 << 20;   // float32 buffer reduced to time reduce.GBps
};

struct LinkMeasurement {
  std::string key;        // "shm", "shm_xnuma", "tcp", "ucx", "verbs": the tuning-file prefix
  int peer = -1;          // measured between rank 0 and this rank
  double alphaUs = 0;     // one-way latency of an 8-byte message
  double betaGBps = 0;    // bandwidth of large messages, latency taken out
  double largeOneWayUs = 0;  // median time of one large transfer (+ an 8-byte ack)
};

struct Calibration {
  std::vector<LinkMeasurement> links;
  double reduceGBps = 0;  // float32 sum, bytes of one input per second
  std::vector<std::string> notes;  // classes not measured, and why
  CalibrateOptions options;
};

// Collective over `comm`: every rank must call it.  Rank 0's result holds the
// measurements; other ranks get an empty one.  Throws loom::Error.
Calibration calibrate(loomComm_t comm, const CalibrateOptions& opt);

// The tuning file: `key = value` lines with `#` comments.
std::string tuningFileText(const Calibration& cal, loomComm_t comm);

}  // namespace loom
