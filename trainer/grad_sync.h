// Gradient synchronisation through loom, as DDP / Horovod / ZeRO do it.
//
// Gradients are grouped into buckets (trainer/mlp.h).  During the backward
// pass of the micro-batch that synchronises, the moment the last layer of a
// bucket is done its collective is issued on a loom host stream, so that
// communication runs while backward computes the earlier layers; wait()
// blocks only on what is still in flight.  Without overlap every bucket is
// issued after backward, which is what the overlap saves.
//
// Per bucket, the communication hook decides what goes on the wire:
//   allreduce  float32 average (loomAvg)
//   bf16/fp16  the gradient / nranks rounded to 16 bits, summed in 16 bits
//              (loom reduces in float32 and rounds once per step), widened back
//   topk       the k = ratio x len largest magnitudes of gradient + residual,
//              as (index, value) pairs all-gathered from every rank and summed;
//              what was not sent stays in the residual (error feedback)
//   powersgd   rank-r approximations of each weight matrix (trainer/powersgd.h):
//              P all-reduced while backward runs, Q after it, with error feedback
// With ZeRO (cfg.zero >= 1) each bucket is reduce-scattered instead: rank r
// receives the average of shard r of the bucket (trainer/shards.h) and
// updates those parameters only.
//   stage 1  backward writes the full gradient buffer (the caller's `grads`);
//            the reduce-scatter lands in it, in place; gatherParams()
//            all-gathers the updated parameter shards.
//   stage 2+ no full gradient buffer: backward writes each bucket into one
//            of two staging buffers (as large as the largest bucket) and its
//            reduce-scatter runs on that buffer's stream; before a staging
//            buffer takes the next bucket, the previous one's reduce-scatter
//            is waited for and its shard added to the packed gradient shards
//            (1/N of the gradients), so a bucket's full gradients live only
//            from its first layer's backward to the end of its reduce-scatter.
//            Every micro-batch synchronises (accumulation is in the shards).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "include/loom.h"
#include "trainer/loom_buffer.h"
#include "trainer/mlp.h"
#include "trainer/powersgd.h"
#include "trainer/shards.h"

namespace trainer {

enum class Hook { AllReduce, Bf16, Fp16, TopK, PowerSgd };

struct SyncConfig {
  Hook hook = Hook::AllReduce;
  double topkRatio = 0.01;
  int powersgdRank = 4;
  int zero = 0;  // ZeRO stage 0-3
  bool overlap = true;
  bool loomBuffers = true;  // stage 2+: staging buffers from loomMemAlloc (zero-copy reduce-scatter)
};

class GradSync {
 public:
  // grads: the flat gradient buffer (stages 0 and 1); nullptr from stage 2.
  GradSync(loomComm_t comm, int rank, int nranks, const Layout& L, const SyncConfig& cfg, float* grads);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Whether every micro-batch's backward synchronises (stage 2 and 3).
  bool syncsEveryPass() const { return cfg_.zero >= 2; }
  // Zeroes the gradients (flat or the shards) before a step.
  void zeroGrads();
  // Where backward accumulates layer l's gradients (Mlp's LayerAccess::grads).
  float* layerGrads(int l);
  // Call before the backward pass that synchronises (the last micro-batch).
  void beginSyncPass();
  // The backward hook: layer l's gradients are final.
  void layerReady(int l);
  // After that backward pass: without overlap, issues every bucket now.
  void endBackward();
  // Blocks until every bucket has arrived and finishes the hooks; afterwards
  // grads holds the averaged gradient (with zero: in this rank's shards).
  // Returns the seconds spent blocked on communication since the last wait()
  // (stage 2+: including waits for staging buffers during backward).
  double wait();

  // Sharded optimizer: this rank's averaged gradients of bucket b (after
  // wait()), and the all-gather of the updated parameters of stages 1 and 2
  // (returns the seconds it took).
  const Shards& shards() const { return shards_; }
  const float* shardGrads(size_t b) const;
  double gatherParams(float* params);

  // The hook's error feedback, for checkpoints: top-k's or PowerSGD's (flat
  // layout, per rank), empty for other hooks.
  std::vector<float>& residual();
  // PowerSGD's warm start (the same on every rank); nullptr for other hooks.
  std::vector<float>* warmStart();
  // Floats a rank puts on the wire per step, and without compression.
  size_t wireFloats() const;
  // Bytes of communication buffers this object holds (hooks' buffers).
  size_t bufferBytes() const;
  // Bytes of gradients it holds from stage 2: the packed shards and the
  // staging buffers.
  size_t shardGradBytes() const { return gradShards_.size() * sizeof(float); }
  size_t stagingBytes() const {
    return staging_[0] ? (staging_[0]->size() + staging_[1]->size()) * sizeof(float) : 0;
  }
  // Stage 2+: whether the staging buffers are loomMemAlloc memory.
  bool stagingShared() const { return staging_[0] && staging_[0]->shared() && staging_[1]->shared(); }

 private:
  void launch(int b);
  void finish(int b);
  void retire(int slot);  // stage 2+: waits for the slot's bucket, adds its shard in

  loomComm_t comm_;
  int rank_, nranks_;
  const Layout& L_;
  SyncConfig cfg_;
  float* grads_;
  Shards shards_;
  loomStream_t stream_ = nullptr;   // stage 2+: staging buffer 0's stream
  loomStream_t stream1_ = nullptr;  // stage 2+: staging buffer 1's stream
  std::vector<float> gradShards_;   // stage 2+: packed
  std::unique_ptr<LoomFloats> staging_[2];  // stage 2+: each as long as the largest bucket
  int slotBucket_[2] = {-1, -1};    // the bucket a staging buffer holds (-1: none)
  int nextSlot_ = 0;
  std::vector<int> slotOf_;  // per bucket this pass: its staging buffer (-1: none yet)
  double blocked_ = 0;
  std::vector<int> pending_;  // per bucket: layers whose gradients are not final yet
  std::vector<char> launched_;
  std::vector<uint16_t> half_;                 // bf16/fp16: the compressed gradients, flat layout
  std::vector<float> residual_;                // topk: error feedback, flat layout
  std::vector<size_t> k_, sendOff_, recvOff_;  // topk: per bucket
  std::vector<int32_t> send_, recv_;           // topk: (index, float bits) pairs
  std::vector<uint32_t> order_;                // topk: selection scratch
  std::unique_ptr<PowerSgd> powerSgd_;
};

uint16_t floatToBf16(float f);
float bf16ToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float halfToFloat(uint16_t h);

}  // namespace trainer
