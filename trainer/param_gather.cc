#include "trainer/param_gather.h"

#include <algorithm>
#include <chrono>

#include "trainer/check.h"

namespace trainer {

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ParamGather::ParamGather(loomComm_t comm, const Layout& L, const Shards& S, const float* shards,
                         bool prefetch, bool shareable)
    : comm_(comm), L_(L), S_(S), shards_(shards), prefetch_(prefetch) {
  for (size_t l = 0; l < L.layers.size(); ++l)
    for (size_t m = l + 1; m < L.layers.size(); ++m)
      if (L.bucketOf[l] == L.bucketOf[m]) trainerFail("ZeRO-3 needs one bucket per layer");
  size_t maxLen = 0;
  for (const Bucket& b : L.buckets) maxLen = std::max(maxLen, b.len);
  buf_[0].reset(new LoomFloats(maxLen, shareable, "ZeRO-3 gather buffers"));
  buf_[1].reset(new LoomFloats(maxLen, shareable, "ZeRO-3 gather buffers"));
  TRAINER_CHECK_LOOM(loomStreamCreate(&stream_));
}

ParamGather::~ParamGather() { loomStreamDestroy(stream_); }

void ParamGather::start(int slot, int layer) {
  size_t b = size_t(L_.bucketOf[layer]);
  TRAINER_CHECK_LOOM(
      loomAllGather(shards_ + S_.packedOff(b), buf_[slot]->data(), S_.len(b), loomFloat32, comm_, stream_));
  layer_[slot] = layer;
  inFlight_ = true;
}

const float* ParamGather::acquire(int l, int next) {
  int s = layer_[0] == l ? 0 : layer_[1] == l ? 1 : -1;
  if (s < 0) {  // not prefetched: gather it now, into the buffer not used last
    s = current_ ^ 1;
    start(s, l);
  }
  if (inFlight_) {  // one stream: waiting for it waits for every gather issued
    double t0 = now();
    TRAINER_CHECK_LOOM(loomStreamSynchronize(stream_));
    blocked_ += now() - t0;
    inFlight_ = false;
  }
  current_ = s;
  if (prefetch_ && next >= 0 && layer_[s ^ 1] != next) start(s ^ 1, next);
  return buf_[s]->data() + (L_.layers[l].w - L_.buckets[size_t(L_.bucketOf[l])].off);
}

void ParamGather::invalidate() {
  if (inFlight_) {
    TRAINER_CHECK_LOOM(loomStreamSynchronize(stream_));
    inFlight_ = false;
  }
  layer_[0] = layer_[1] = -1;
}

void ParamGather::prefetch(int layer) {
  if (!prefetch_ || layer_[0] == layer || layer_[1] == layer) return;
  start(current_ ^ 1, layer);
}

double ParamGather::takeBlocked() {
  double b = blocked_;
  blocked_ = 0;
  return b;
}

}  // namespace trainer
