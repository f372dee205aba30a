#include "src/core/trace.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "src/core/error.h"

namespace loom {

namespace {

// Communicators traced so far in this process: the first writes path.<rank>,
// later ones (splits, shrinks) path.<rank>.c<N>.
std::atomic<int> gTraced{0};

std::string fileFor(const std::string& path, int rank) {
  int n = gTraced.fetch_add(1);
  std::string f = path;
  size_t at = f.find("%r");
  if (at != std::string::npos) f.replace(at, 2, std::to_string(rank));
  else f += "." + std::to_string(rank);
  if (n > 0) f += ".c" + std::to_string(n);
  return f;
}

}  // namespace

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += strf("\\u%04x", c);
        else out += c;
    }
  }
  return out + "\"";
}

Tracer::Tracer(const std::string& path, int rank, int nranks)
    : file_(fileFor(path, rank)), rank_(rank), nranks_(nranks) {
  events_.reserve(1024);
}

Tracer::~Tracer() {
  std::string why;
  if (!written_ && !write(&why)) fprintf(stderr, "loom: LOOM_TRACE: %s\n", why.c_str());
}

double Tracer::nowUs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return double(ts.tv_sec) * 1e6 + double(ts.tv_nsec) / 1e3;
}

void Tracer::add(Event e) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  if (e.tid > maxTid_) maxTid_ = e.tid;
  events_.push_back(std::move(e));
}

void Tracer::op(double beginUs, double endUs, const std::string& name, const std::string& args) {
  add(Event{0, beginUs, endUs - beginUs, name, args});
}

void Tracer::step(int lane, double beginUs, double endUs, const char* kind, int from, int to, size_t bytes,
                  double moveUs, double reduceUs, const std::string& op) {
  double dur = endUs - beginUs;
  double wait = dur - moveUs - reduceUs;
  if (wait < 0) wait = 0;
  std::string args = strf("\"op\": %s, \"from\": %d, \"to\": %d, \"bytes\": %zu, \"move_us\": %.3f, "
                          "\"reduce_us\": %.3f, \"wait_us\": %.3f",
                          jsonString(op).c_str(), from, to, bytes, moveUs, reduceUs, wait);
  add(Event{1 + lane, beginUs, dur, kind, args});
}

bool Tracer::write(std::string* why) {
  std::lock_guard<std::mutex> lock(mutex_);
  written_ = true;
  std::string tmp = file_ + ".tmp";
  FILE* f = fopen(tmp.c_str(), "w");
  if (!f) {
    *why = strf("cannot create %s: %s", tmp.c_str(), strerror(errno));
    return false;
  }
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  fprintf(f, "{\"displayTimeUnit\": \"ns\",\n \"otherData\": {\"loom_rank\": %d, \"loom_nranks\": %d, "
             "\"host\": %s, \"pid\": %d, \"events\": %zu, \"dropped\": %zu},\n \"traceEvents\": [\n",
          rank_, nranks_, jsonString(host).c_str(), int(getpid()), events_.size(), dropped_);
  fprintf(f, "  {\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": %s}},\n", rank_,
          jsonString(strf("rank %d (%s)", rank_, host)).c_str());
  fprintf(f, "  {\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"sort_index\": %d}}",
          rank_, rank_);
  for (int t = 0; t <= maxTid_; ++t)
    fprintf(f, ",\n  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, \"args\": {\"name\": %s}}",
            rank_, t, jsonString(t == 0 ? std::string("operations") : strf("lane %d", t - 1)).c_str());
  for (const Event& e : events_)
    fprintf(f, ",\n  {\"name\": %s, \"ph\": \"X\", \"pid\": %d, \"tid\": %d, \"ts\": %.3f, \"dur\": %.3f, "
               "\"args\": {%s}}",
            jsonString(e.name).c_str(), rank_, e.tid, e.ts, e.dur, e.args.c_str());
  fprintf(f, "\n]}\n");
  bool ok = fflush(f) == 0 && !ferror(f);
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp.c_str(), file_.c_str()) != 0) {
    *why = strf("cannot write %s", file_.c_str());
    remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace loom
