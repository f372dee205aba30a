// LOOM_TRACE: a per-rank timeline of operations and their steps, written as
// Chrome-trace JSON (chrome://tracing, ui.perfetto.dev) when the
// communicator is destroyed.  tools/loom_trace_merge.py merges the ranks'
// files into one timeline and sums where the time went.
//
// One event per operation (tid 0: collective, count, type, algorithm,
// bytes) and, for operations the executor runs, one per step of each lane
// (tid 1 + lane: the step kind, its peers and bytes, and its time split
// into moving bytes (copies into and out of slots and local copies),
// reducing, and waiting: the rest, spent on peers and slots).  Timestamps
// are CLOCK_REALTIME microseconds, so ranks of one host line up exactly
// and hosts as well as their clocks agree.
//
// Off (no file named) it costs one predictable branch per step.  On, it
// reads the clock around each copy and reduction, and keeps at most
// kMaxEvents events in memory (later ones are counted, not kept).
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace loom {

class Tracer {
 public:
  static constexpr size_t kMaxEvents = 1000000;

  // path: LOOM_TRACE as given; the file is path + ".<rank>" (or path with
  // "%r" replaced by the rank), and ".c<N>" for a process's N-th further
  // communicator.
  Tracer(const std::string& path, int rank, int nranks);
  ~Tracer();

  // Microseconds on CLOCK_REALTIME.
  static double nowUs();

  // An operation, [beginUs, endUs).
  void op(double beginUs, double endUs, const std::string& name, const std::string& args);
  // A step of lane `lane`.
  void step(int lane, double beginUs, double endUs, const char* kind, int from, int to, size_t bytes,
            double moveUs, double reduceUs, const std::string& op);
  // Writes the file (once); false and why on failure.
  bool write(std::string* why);
  const std::string& file() const { return file_; }

 private:
  struct Event {
    int tid;
    double ts, dur;
    std::string name, args;  // args: a JSON object's members, without braces
  };
  void add(Event e);

  std::string file_;
  int rank_, nranks_;
  std::mutex mutex_;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  int maxTid_ = 0;
  bool written_ = false;
};

// Quotes s as a JSON string.
std::string jsonString(const std::string& s);

}  // namespace loom
