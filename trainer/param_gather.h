// ZeRO stage 3 (FSDP-style) parameters: each rank keeps only its packed
// shards (trainer/shards.h); a layer's parameters exist in full only while
// the layer computes.  The layout gives every layer a bucket of its own, so a
// layer is all-gathered by one loomAllGather into one of two gather buffers
// (each as large as the largest layer).  Shards and gather buffers in
// loomMemAlloc memory (`shareable`) make the all-gather zero-copy over shared
// memory: each rank copies the peers' shards straight into its buffer, with
// two flag waits per layer instead of a slot hand-off per chunk, which is
// what lets a prefetch progress while compute holds the cores.
//
// acquire(l, next) returns layer l's full block, waiting for its all-gather,
// and with prefetch on starts the all-gather of layer `next` into the other
// buffer on a second loom stream, so that it runs while layer l computes.
// Forward asks for l and prefetches l + 1, backward asks for l and prefetches
// l - 1.  A layer still in a buffer is not gathered again: the last two
// layers of forward are reused by the start of backward.  The optimizer step
// changes the shards, so invalidate() after it.
#pragma once
#include <cstddef>
#include <memory>
#include <vector>

#include "include/loom.h"
#include "trainer/loom_buffer.h"
#include "trainer/mlp.h"
#include "trainer/shards.h"

namespace trainer {

class ParamGather {
 public:
  // shards: this rank's packed parameter shards (updated in place by the optimizer).
  // shareable: gather buffers from loomMemAlloc.
  ParamGather(loomComm_t comm, const Layout& L, const Shards& S, const float* shards, bool prefetch,
              bool shareable);
  ~ParamGather();
  ParamGather(const ParamGather&) = delete;
  ParamGather& operator=(const ParamGather&) = delete;

  const float* acquire(int l, int next);
  void invalidate();
  // With prefetch on, starts gathering `layer` now (after the optimizer
  // updated its shard: the next step's first layer, while the others are
  // updated and the next batch is read).
  void prefetch(int layer);
  // Seconds the caller spent blocked on all-gathers since the last call.
  double takeBlocked();
  // Bytes of the two gather buffers.
  size_t bufferBytes() const { return (buf_[0]->size() + buf_[1]->size()) * sizeof(float); }
  bool buffersShared() const { return buf_[0]->shared() && buf_[1]->shared(); }

 private:
  void start(int slot, int layer);

  loomComm_t comm_;
  const Layout& L_;
  const Shards& S_;
  const float* shards_;
  bool prefetch_;
  loomStream_t stream_ = nullptr;
  std::unique_ptr<LoomFloats> buf_[2];
  int layer_[2] = {-1, -1};  // the layer a buffer holds or receives (-1: none)
  bool inFlight_ = false;    // an all-gather on stream_ has not been waited for
  int current_ = 1;          // the buffer of the layer acquired last
  double blocked_ = 0;
};

}  // namespace trainer
