// The simulated device of tests/sim_device.h.
#include "tests/sim_device.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/device/device.h"
#include "src/device/host_reduce.h"

namespace loomsim {

namespace {

uint64_t nextRandom(uint64_t& s) {  // xorshift64*
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 2685821657736338717ull;
}

}  // namespace

SimStream::SimStream(SimRank& rank, SimGpu& gpu, uint64_t seed)
    : rank_(rank), gpu_(gpu), rng_(seed | 1), thread_([this] { loop(); }) {}

SimStream::~SimStream() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

// A capture in progress: the lanes of the streams in it (lane 0 the one
// that began it), the event records seen (graph nodes), and per lane
// whether its last task is a record (the node; -1: not) and which nodes
// it waits for (endCapture's "every lane is joined back").
class SimCapture {
 public:
  std::mutex mu;
  std::vector<std::vector<SimGraphTask>> lanes;
  std::vector<SimStream*> streams;
  std::vector<long> lastRecord;
  std::vector<std::vector<size_t>> waits;
  size_t nodes = 0;
  std::vector<std::function<void()>> holds;
  bool ended = false;  // endCapture took the lanes
  int addLane(SimStream* s) {
    lanes.emplace_back();
    streams.push_back(s);
    lastRecord.push_back(-1);
    waits.emplace_back();
    return int(lanes.size()) - 1;
  }
  void add(int lane, SimGraphTask t) {
    lanes[size_t(lane)].push_back(std::move(t));
    lastRecord[size_t(lane)] = -1;
  }
};

void SimStream::enqueue(std::function<void()> fn, bool usesGpu) {
  {
    std::unique_lock<std::mutex> g(mu_);
    if (capture_) {
      std::lock_guard<std::mutex> cg(capture_->mu);
      if (!capture_->ended) {
        capture_->add(lane_, SimGraphTask{[fn = std::move(fn)](SimLaunch&) { fn(); }, usesGpu});
        return;
      }
    }
    const SimDeviceOptions& o = rank_.world_.options();
    auto room = [&] { return stop_ || queue_.size() < o.queueDepth; };
    if (o.queueDepth > 0 && !cv_.wait_for(g, std::chrono::milliseconds(o.deadlineMs), room))
      loom::fail(loomInternalError,
                 "simulated rank %d: a stream's queue stayed full (%zu operations) for %lld ms: a GPU's host thread "
                 "would block in this enqueue for ever",
                 rank_.rank(), o.queueDepth, static_cast<long long>(o.deadlineMs));
    queue_.emplace_back(std::move(fn), usesGpu);
  }
  cv_.notify_all();
}

std::shared_ptr<SimCapture> SimStream::capture(int* lane) const {
  std::lock_guard<std::mutex> g(mu_);
  if (lane) *lane = lane_;
  return capture_;
}

void SimStream::setCapture(std::shared_ptr<SimCapture> c, int lane) {
  std::lock_guard<std::mutex> g(mu_);
  capture_ = std::move(c);
  lane_ = lane;
}

int SimStream::join(const std::shared_ptr<SimCapture>& c) {
  // A stream's lock, then the capture's, as enqueue takes them.
  std::lock_guard<std::mutex> g(mu_);
  if (capture_) return capture_ == c ? lane_ : -1;
  std::lock_guard<std::mutex> cg(c->mu);
  if (c->ended) loom::fail(loomInternalError, "sim: a wait for an event recorded in a capture that has ended");
  capture_ = c;
  lane_ = c->addLane(this);
  return lane_;
}

bool SimStream::idle() const {
  std::lock_guard<std::mutex> g(mu_);
  return queue_.empty() && !busy_;
}

namespace {
std::mutex g_captureMu;
std::vector<const void*> g_capturing;  // caller stream handles being captured
}  // namespace

int simStreamCapturing(void* key) {
  std::lock_guard<std::mutex> g(g_captureMu);
  return std::find(g_capturing.begin(), g_capturing.end(), key) != g_capturing.end() ? 1 : 0;
}

void SimRank::beginCapture(const void* key) {
  const int s = callerStream(key);
  if (s == 0) loom::fail(loomInternalError, "sim: capture on a stream that is no added caller stream");
  SimStream& st = stream(s);
  if (st.capture(nullptr))
    loom::fail(loomInternalError, "sim: cudaStreamBeginCapture on a stream already in a capture "
               "(cudaErrorIllegalState)");
  auto c = std::make_shared<SimCapture>();
  c->addLane(&st);
  st.setCapture(c, 0);
  std::lock_guard<std::mutex> g(g_captureMu);
  g_capturing.push_back(key);
}

SimGraph SimRank::endCapture(const void* key) {
  {
    std::lock_guard<std::mutex> g(g_captureMu);
    g_capturing.erase(std::remove(g_capturing.begin(), g_capturing.end(), key), g_capturing.end());
  }
  SimStream& st = stream(callerStream(key));
  int lane = 0;
  std::shared_ptr<SimCapture> c = st.capture(&lane);
  if (!c) loom::fail(loomInternalError, "sim: end of a capture never begun");
  if (lane != 0)
    loom::fail(loomInternalError, "sim: cudaStreamEndCapture on a stream that joined a capture rather than began "
               "it (cudaErrorStreamCaptureUnmatched)");
  auto graph = std::make_shared<SimGraphData>();
  std::vector<SimStream*> streams;
  bool unjoined = false;
  {
    std::lock_guard<std::mutex> g(c->mu);
    // Every joined lane must end in a record that lane 0, or a lane joined
    // back so, waits for (cudaErrorStreamCaptureUnjoined otherwise).
    const size_t n = c->lanes.size();
    std::vector<bool> joined(n, false);
    joined[0] = true;
    for (bool more = true; more;) {
      more = false;
      for (size_t i = 1; i < n; ++i) {
        if (joined[i] || c->lastRecord[i] < 0) continue;
        for (size_t j = 0; j < n && !joined[i]; ++j)
          if (joined[j] && std::count(c->waits[j].begin(), c->waits[j].end(), size_t(c->lastRecord[i])))
            joined[i] = more = true;
      }
    }
    unjoined = std::count(joined.begin(), joined.end(), false) > 0;
    graph->lanes = std::move(c->lanes);
    graph->nodes = c->nodes;
    graph->holds = std::move(c->holds);
    c->ended = true;
    streams = c->streams;
  }
  // Outside the capture's lock (an enqueue takes a stream's, then it).
  for (SimStream* s : streams) s->setCapture(nullptr, 0);
  if (unjoined)  // the capture ends all the same (CUDA invalidates it)
    loom::fail(loomInternalError, "sim: cudaStreamEndCapture while a stream that joined the capture has work not "
               "joined back into the capturing stream (cudaErrorStreamCaptureUnjoined)");
  return graph;
}

void SimRank::launchGraph(const void* key, const SimGraph& graph) {
  SimStream& st = stream(callerStream(key));
  auto launch = std::make_shared<SimLaunch>(graph->nodes);
  std::vector<SimStream*> lanes{&st};
  {
    // Lanes 1.. on idle replay streams (new ones when too few): as CUDA
    // runs a graph's branches concurrently, never behind another launch.
    std::lock_guard<std::mutex> g(replayMu_);
    for (auto& r : replay_)
      if (lanes.size() < graph->lanes.size() && r->idle()) lanes.push_back(r.get());
    while (lanes.size() < graph->lanes.size()) {
      replay_.push_back(std::make_unique<SimStream>(*this, gpu_, seed_ * 7777u + replay_.size() * 131u + 3));
      lanes.push_back(replay_.back().get());
    }
    // As CUDA, a launch is one entry in each stream's queue (a lane runs
    // its tasks in order there), and the graph is kept until the launch
    // has run: its holds go only after the last launch's work.
    for (size_t i = graph->lanes.size(); i-- > 1;) lanes[i]->enqueue(laneTask(*lanes[i], graph, launch, i), false);
  }
  st.enqueue(laneTask(st, graph, launch, 0), false);
}

std::function<void()> SimRank::laneTask(SimStream& on, const SimGraph& graph, const std::shared_ptr<SimLaunch>& launch,
                                        size_t lane) {
  return [&on, graph, launch, lane] {
    if (lane >= graph->lanes.size()) return;
    for (const SimGraphTask& t : graph->lanes[lane]) on.run([&] { t.fn(*launch); }, t.usesGpu);
  };
}

bool SimRank::holdInCapture(const void* key, std::function<void()> release) {
  const int s = callerStream(key);
  if (s == 0) return false;
  std::shared_ptr<SimCapture> c = stream(s).capture(nullptr);
  if (!c) return false;
  std::lock_guard<std::mutex> g(c->mu);
  c->holds.push_back(std::move(release));
  return true;
}

uint64_t SimRank::captureOf(int s) { return uint64_t(uintptr_t(stream(s).capture(nullptr).get())); }

void SimStream::drain() {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait(g, [&] { return queue_.empty() && !busy_; });
}

void SimStream::run(const std::function<void()>& fn, bool usesGpu) {
  const SimDeviceOptions& o = rank_.world_.options();
  // A dead rank runs nothing; a failed one skips the rest of its work.
  if (rank_.world_.dead(rank_.rank()) || rank_.failed()) return;
  try {
    if (usesGpu) {
      std::lock_guard<std::mutex> g(gpu_.busy());
      if (int(nextRandom(rng_) % 1000) < o.pausePermille)
        std::this_thread::sleep_for(std::chrono::microseconds(nextRandom(rng_) % uint64_t(o.maxPauseUs + 1)));
      fn();
    } else {
      fn();
    }
  } catch (const loom::Error& e) {
    rank_.failWith(e.code(), e.what());
  }
}

void SimStream::loop() {
  for (;;) {
    SimTask task;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    cv_.notify_all();  // room in a bounded queue
    run(task.first, task.second);
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = false;
    }
    cv_.notify_all();
  }
}

SimRank::SimRank(SimDeviceWorld& world, int rank, SimGpu& gpu, int streams, uint64_t seed)
    : world_(world), rank_(rank), gpu_(gpu), seed_(seed), baseStreams_(streams) {
  for (int s = 0; s < streams + kCaptureSideStreams; ++s)
    streams_.push_back(std::make_unique<SimStream>(*this, gpu, seed * 1000003u + uint64_t(s) * 7919u + 1));
  for (int e = 0; e < 8; ++e) events_.push_back(std::make_unique<Event>());
}

SimRank::~SimRank() {
  replay_.clear();
  streams_.clear();
}

SimStream& SimRank::stream(int s) {
  if (s < 0 || size_t(s) >= streams_.size())
    loom::fail(loomInternalError, "sim rank %d has no stream %d", rank_, s);
  return *streams_[size_t(s)];
}

SimRank::Event& SimRank::event(int e) {
  if (e < 0 || size_t(e) >= events_.size())
    loom::fail(loomInternalError, "sim rank %d has no event %d", rank_, e);
  return *events_[size_t(e)];
}

void SimRank::failWith(loomResult_t code, const std::string& msg) {
  {
    std::lock_guard<std::mutex> g(failMu_);
    if (failCode_ == loomSuccess) {
      failCode_ = code;
      failMsg_ = msg;
    }
    failed_.store(true, std::memory_order_release);
  }
  world_.notify();
}

std::string SimRank::failure() const {
  std::lock_guard<std::mutex> g(failMu_);
  return failMsg_;
}

loomResult_t SimRank::synchronize(std::string* msg) {
  for (auto& s : streams_) s->drain();
  {
    std::lock_guard<std::mutex> g(replayMu_);
    for (auto& s : replay_) s->drain();
  }
  if (world_.dead(rank_)) {
    if (msg) *msg = loom::strf("rank %d was killed", rank_);
    return loomRemoteError;
  }
  std::lock_guard<std::mutex> g(failMu_);
  if (msg) *msg = failMsg_;
  return failCode_;
}

void SimRank::enqueueWork(int s, std::function<void()> fn) { stream(s).enqueue(std::move(fn), true); }

void SimRank::enqueueWait(int s, std::function<void()> fn) { stream(s).enqueue(std::move(fn), false); }

int SimRank::addCallerStream(const void* key) {
  const int index = int(streams_.size());
  streams_.push_back(std::make_unique<SimStream>(*this, gpu_, seed_ * 1000003u + uint64_t(index) * 7919u + 1));
  callers_.emplace_back(key, index);
  return index;
}

int SimRank::callerStream(const void* key) const {
  for (const auto& [k, index] : callers_)
    if (k == key) return index;
  return 0;
}

template <class Ready>
void SimRank::await(Ready ready, int peer, const char* what) {
  const int64_t start = loom::nowMs();
  int spins = 0;
  for (;;) {
    const uint64_t gen = world_.generation();
    if (ready()) return;
    if (world_.dead(rank_) || failed()) loom::fail(loomInternalError, "rank %d stopped", rank_);
    if (world_.options().peerShortcuts && world_.dead(peer))
      loom::fail(loomRemoteError, "rank %d: rank %d died while this rank waited for %s", rank_, peer, what);
    if (world_.options().peerShortcuts && peer != rank_ && world_.rank(peer).failed())
      loom::fail(loomRemoteError, "rank %d: rank %d failed while this rank waited for %s: %s", rank_, peer,
                 what, world_.rank(peer).failure().c_str());
    if (loom::nowMs() - start > world_.options().deadlineMs)
      loom::fail(loomTimeout, "rank %d: no progress for %lld ms waiting for %s of rank %d", rank_,
                 (long long)world_.options().deadlineMs, what, peer);
    if (++spins < 16)
      std::this_thread::yield();
    else
      world_.sleepUnless(gen);
  }
}

void SimRank::waitFlag(int s, const uint64_t* flag, uint64_t value, int ownerRank) {
  auto* f = reinterpret_cast<const std::atomic<uint64_t>*>(flag);
  stream(s).enqueue(
      [this, f, value, ownerRank] {
        await([&] { return f->load(std::memory_order_acquire) >= value; }, ownerRank, "a flag");
      },
      false);
}

void SimRank::setFlag(int s, uint64_t* flag, uint64_t value) {
  auto* f = reinterpret_cast<std::atomic<uint64_t>*>(flag);
  stream(s).enqueue(
      [this, f, value] {
        if (world_.options().beforeSetFlag) world_.options().beforeSetFlag(f->load(std::memory_order_acquire), value);
        f->store(value, std::memory_order_release);
        world_.notify();
      },
      true);
}

void SimRank::setFlags(int s, uint64_t* const* flags, size_t n, uint64_t value) {
  if (n == 0) return;
  std::vector<std::atomic<uint64_t>*> fs;
  for (size_t i = 0; i < n; ++i) fs.push_back(reinterpret_cast<std::atomic<uint64_t>*>(flags[i]));
  // A batch's writes land in no particular order: shuffled.
  uint64_t rng = seed_ * 2654435761u + n * 40503u + uintptr_t(flags[0]);
  for (size_t i = fs.size(); i > 1; --i) std::swap(fs[i - 1], fs[size_t(nextRandom(rng) % i)]);
  stream(s).enqueue(
      [this, fs, value] {
        for (std::atomic<uint64_t>* f : fs) {
          if (world_.options().beforeSetFlag) world_.options().beforeSetFlag(f->load(std::memory_order_acquire), value);
          f->store(value, std::memory_order_release);
        }
        world_.notify();
      },
      true);
}

void SimRank::copy(int s, void* dst, const void* src, size_t bytes) {
  stream(s).enqueue([=] { memcpy(dst, src, bytes); }, true);
}

void SimRank::runReduce(void* dst, void* dst2, const std::vector<const void*>& in, size_t count,
                        loomDataType_t type, loomRedOp_t op) {
  loom::Device& dev = loom::hostDevice();
  const size_t bytes = count * loom::dtypeSize(type);
  // dst may be one of the sources exactly (one pass, stream_program.h):
  // accumulate apart then.
  bool alias = false;
  for (const void* p : in) alias = alias || p == dst;
  std::vector<uint8_t> tmp(alias ? bytes : 0);
  void* acc = alias ? tmp.data() : dst;
  if (in.size() == 1) {
    memcpy(acc, in[0], bytes);
  } else {
    dev.reduce(acc, in[0], in[1], count, type, op);
    for (size_t i = 2; i < in.size(); ++i) dev.reduce(acc, acc, in[i], count, type, op);
  }
  if (alias) memcpy(dst, acc, bytes);
  // Written last, as the CUDA backend does: it may be a source.
  if (dst2) memcpy(dst2, dst, bytes);
}

void SimRank::reduce(int s, void* dst, void* dst2, const void* const* srcs, int nsrcs, size_t count,
                     loomDataType_t type, loomRedOp_t op) {
  std::vector<const void*> in(srcs, srcs + nsrcs);
  if (dst2) ++dualReductions_;
  stream(s).enqueue([=] { runReduce(dst, dst2, in, count, type, op); }, true);
}

const void* SimRank::resolve(const void* fallback, loom::CellRef c, size_t bytes) {
  if (!c.cell) return fallback;
  auto word = [&](int i) {
    return reinterpret_cast<const std::atomic<uint64_t>*>(c.cell + i)->load(std::memory_order_acquire);
  };
  // As the kernels (reduce_kernels.cu, resolveSource): the tag, then addr,
  // bytes and addr again (the owner writes addr = 0, bytes, addr).
  const uint64_t tag =
      c.tag ? reinterpret_cast<const std::atomic<uint64_t>*>(c.tag)->load(std::memory_order_acquire) : c.minTag;
  const uint64_t addr = tag < c.minTag ? 0 : word(0);
  const uint64_t len = addr ? word(1) : 0;
  if (tag < c.minTag || addr == 0 || word(0) != addr || c.offset > len || bytes > len - c.offset) {
    ++fallbackReads_;
    return fallback;
  }
  ++publishedReads_;
  return reinterpret_cast<const uint8_t*>(uintptr_t(addr)) + c.offset;
}

void SimRank::copyIndirect(int s, void* dst, const void* src, loom::CellRef cell, size_t bytes) {
  stream(s).enqueue([=] { memcpy(dst, resolve(src, cell, bytes), bytes); }, true);
}

void SimRank::reduceIndirect(int s, void* dst, void* dst2, const void* const* srcs, const loom::CellRef* cells,
                             int nsrcs, size_t count, loomDataType_t type, loomRedOp_t op) {
  std::vector<const void*> in(srcs, srcs + nsrcs);
  std::vector<loom::CellRef> cs(cells, cells + nsrcs);
  if (dst2) ++dualReductions_;
  stream(s).enqueue(
      [=] {
        std::vector<const void*> at(in.size());
        for (size_t i = 0; i < in.size(); ++i) at[i] = resolve(in[i], cs[i], count * loom::dtypeSize(type));
        runReduce(dst, dst2, at, count, type, op);
      },
      true);
}

void SimRank::divide(int s, void* dst, const void* src, size_t count, loomDataType_t type, int divisor) {
  stream(s).enqueue([=] { loom::hostDevice().divide(dst, src, count, type, divisor); }, true);
}

void SimRank::recordEvent(int s, int e) {
  Event& ev = event(e);
  int lane = 0;
  std::shared_ptr<SimCapture> c = stream(s).capture(&lane);
  std::unique_lock<std::mutex> eg(eventMu_);
  if (c) {  // a node of the graph: each launch completes its own
    std::lock_guard<std::mutex> g(c->mu);
    if (c->ended) loom::fail(loomInternalError, "sim: an event recorded on a stream whose capture just ended");
    const size_t node = c->nodes++;
    c->add(lane, SimGraphTask{[this, node](SimLaunch& l) {
                                l.done[node].store(true, std::memory_order_release);
                                world_.notify();
                              },
                              false});
    c->lastRecord[size_t(lane)] = long(node);
    ev.capture = c;
    ev.node = node;
    return;
  }
  ev.capture.reset();
  const uint64_t gen = ++ev.recorded;
  eg.unlock();  // an enqueue may block (a bounded queue)
  stream(s).enqueue(
      [this, &ev, gen] {
        ev.completed.store(gen, std::memory_order_release);
        world_.notify();
      },
      false);
}

void SimRank::waitNode(int s, const std::shared_ptr<SimCapture>& c, size_t node, const char* what) {
  SimStream& st = stream(s);
  int lane = 0;
  std::shared_ptr<SimCapture> mine = st.capture(&lane);
  if (mine && mine != c)
    loom::fail(loomInternalError, "sim: a stream in one capture waits for %s of another "
               "(cudaErrorStreamCaptureIsolation)", what);
  if (!mine) {  // the fork: the stream joins the capture, in a lane of its own
    lane = st.join(c);
    if (lane < 0)
      loom::fail(loomInternalError, "sim: a stream joined another capture while this one waited for %s "
                 "(cudaErrorStreamCaptureIsolation)", what);
  }
  std::lock_guard<std::mutex> g(c->mu);
  if (c->ended) loom::fail(loomInternalError, "sim: a wait for %s recorded in a capture that has ended", what);
  c->add(lane, SimGraphTask{[this, node](SimLaunch& l) {
                              await([&] { return l.done[node].load(std::memory_order_acquire); }, rank_,
                                    "an event of its graph");
                            },
                            false});
  c->waits[size_t(lane)].push_back(node);
}

void SimRank::joinStream(int waiter, int waited) {
  if (waiter == waited) return;
  int lane = 0;
  std::shared_ptr<SimCapture> c = stream(waited).capture(&lane);
  if (c) {  // as an event recorded there and waited for here
    size_t node = 0;
    {
      std::lock_guard<std::mutex> g(c->mu);
      if (c->ended) loom::fail(loomInternalError, "sim: a join of a stream whose capture just ended");
      node = c->nodes++;
      c->add(lane, SimGraphTask{[this, node](SimLaunch& l) {
                                  l.done[node].store(true, std::memory_order_release);
                                  world_.notify();
                                },
                                false});
      c->lastRecord[size_t(lane)] = long(node);
    }
    waitNode(waiter, c, node, "another stream's work");
    return;
  }
  if (stream(waiter).capture(nullptr))
    loom::fail(loomInternalError, "sim: a stream in a capture waits for a stream outside it "
               "(cudaErrorStreamCaptureIsolation)");
  auto done = std::make_shared<std::atomic<bool>>(false);
  stream(waited).enqueue(
      [this, done] {
        done->store(true, std::memory_order_release);
        world_.notify();
      },
      false);
  stream(waiter).enqueue(
      [this, done] { await([&] { return done->load(std::memory_order_acquire); }, rank_, "another stream's work"); },
      false);
}

void SimRank::waitEvent(int s, int e) {
  Event& ev = event(e);
  std::shared_ptr<SimCapture> c;
  size_t node = 0;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> eg(eventMu_);
    c = ev.capture;
    node = ev.node;
    gen = ev.recorded;
  }
  if (c) {
    waitNode(s, c, node, "an event");
    return;
  }
  if (stream(s).capture(nullptr))
    loom::fail(loomInternalError, "sim: a stream in a capture waits for an event recorded outside it "
               "(cudaErrorStreamCaptureIsolation)");
  stream(s).enqueue(
      [this, &ev, gen] {
        await([&] { return ev.completed.load(std::memory_order_acquire) >= gen; }, rank_, "an event");
      },
      false);
}

SimDeviceWorld::SimDeviceWorld(int nranks, int gpus, size_t windowBytes, SimDeviceOptions opts)
    : nranks_(nranks), windowBytes_(windowBytes), opts_(opts), dead_(new std::atomic<bool>[size_t(nranks)]) {
  for (int g = 0; g < gpus; ++g) gpus_.push_back(std::make_unique<SimGpu>(g));
  for (int r = 0; r < nranks; ++r) {
    windows_.emplace_back(windowBytes + 256);
    flags_.emplace_back(new std::atomic<uint64_t>[loom::kFlagCount]);
    for (int f = 0; f < loom::kFlagCount; ++f) flags_.back()[size_t(f)].store(0);
    const size_t words = size_t(nranks) * loom::kCellRowWords;
    cells_.emplace_back(new std::atomic<uint64_t>[words]);
    for (size_t w = 0; w < words; ++w) cells_.back()[w].store(0);
    dead_[size_t(r)].store(false);
    rounds_.push_back(0);
  }
  for (int r = 0; r < nranks; ++r)
    ranks_.push_back(
        std::make_unique<SimRank>(*this, r, *gpus_[size_t(r % gpus)], 3, opts.seed + uint64_t(r)));
}

SimDeviceWorld::~SimDeviceWorld() { ranks_.clear(); }

void SimDeviceWorld::notify() {
  {
    std::lock_guard<std::mutex> g(wakeMu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  wakeCv_.notify_all();
}

void SimDeviceWorld::sleepUnless(uint64_t gen) {
  std::unique_lock<std::mutex> g(wakeMu_);
  wakeCv_.wait_for(g, std::chrono::milliseconds(2),
                   [&] { return generation_.load(std::memory_order_acquire) != gen; });
}

void SimDeviceWorld::addCells(int r, loom::ProgramBuffers& b, bool publish) {
  const size_t row = loom::kCellRowWords;
  auto word = [](std::atomic<uint64_t>* a) { return reinterpret_cast<uint64_t*>(a); };
  b.cells.clear();
  b.peerCells.clear();
  b.published.assign(size_t(nranks_), {});
  for (int q = 0; q < nranks_; ++q) {
    b.cells.push_back(word(&cells_[size_t(r)][size_t(q) * row]));
    b.peerCells.push_back(word(&cells_[size_t(q)][size_t(r) * row]));
    if (!publish || q == r) continue;
    auto& c = b.published[size_t(q)];
    c[loom::kCellSend0] = c[loom::kCellSend1] = {uint64_t(uintptr_t(b.send)), b.sendBytes};
    c[loom::kCellRecv0] = c[loom::kCellRecv1] = {uint64_t(uintptr_t(b.recv)), b.recvBytes};
  }
}

loom::ProgramBuffers SimDeviceWorld::buffers(int r, const void* send, size_t sendBytes, void* recv,
                                             size_t recvBytes) {
  (void)r;
  loom::ProgramBuffers b;
  b.send = send;
  b.sendBytes = sendBytes;
  b.recv = recv;
  b.recvBytes = recvBytes;
  b.windowBytes = windowBytes_;
  for (int q = 0; q < nranks_; ++q) {
    // Windows start on a 256-byte boundary, as device allocations do.
    uintptr_t p = reinterpret_cast<uintptr_t>(windows_[size_t(q)].data());
    b.windows.push_back(reinterpret_cast<uint8_t*>((p + 255) & ~uintptr_t(255)));
    b.flags.push_back(reinterpret_cast<uint64_t*>(&flags_[size_t(q)][0]));
  }
  return b;
}

}  // namespace loomsim
