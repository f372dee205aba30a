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
// With the sharded optimizer (ZeRO stage 1 and stage 2's reduce-scatter),
// each bucket is reduce-scattered instead: rank r receives the average of
// shard r of the bucket, updates those parameters only, and gatherParams()
// all-gathers the updated shards.
#pragma once
#include <cstdint>
#include <vector>

#include "include/loom.h"
#include "trainer/mlp.h"

namespace trainer {

enum class Hook { AllReduce, Bf16, Fp16, TopK };

struct SyncConfig {
  Hook hook = Hook::AllReduce;
  double topkRatio = 0.01;
  bool zero = false;
  bool overlap = true;
};

class GradSync {
 public:
  GradSync(loomComm_t comm, int rank, int nranks, const Layout& L, const SyncConfig& cfg, float* grads);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Call before the backward pass that synchronises (the last micro-batch).
  void beginSyncPass();
  // The backward hook: layer l's gradients are final.
  void layerReady(int l);
  // After that backward pass: without overlap, issues every bucket now.
  void endBackward();
  // Blocks until every bucket has arrived and finishes the hooks; afterwards
  // grads holds the averaged gradient (with zero: in this rank's shards).
  // Returns the seconds spent blocked on communication.
  double wait();

  // Sharded optimizer: this rank's part of bucket b, and the all-gather of
  // the updated parameters (returns the seconds it took).
  size_t shardLen(const Bucket& b) const { return b.len / size_t(nranks_); }
  size_t shardOff(const Bucket& b) const { return b.off + size_t(rank_) * shardLen(b); }
  double gatherParams(float* params);

  // Top-k error feedback (empty for other hooks), for checkpoints.
  std::vector<float>& residual() { return residual_; }
  // Bytes of communication buffers this object holds.
  size_t bufferBytes() const;

 private:
  void launch(int b);
  void finish(int b);

  loomComm_t comm_;
  int rank_, nranks_;
  const Layout& L_;
  SyncConfig cfg_;
  float* grads_;
  loomStream_t stream_ = nullptr;
  std::vector<int> pending_;  // per bucket: layers whose gradients are not final yet
  std::vector<char> launched_;
  std::vector<uint16_t> half_;                 // bf16/fp16: the compressed gradients, flat layout
  std::vector<float> residual_;                // topk: error feedback, flat layout
  std::vector<size_t> k_, sendOff_, recvOff_;  // topk: per bucket
  std::vector<int32_t> send_, recv_;           // topk: (index, float bits) pairs
  std::vector<uint32_t> order_;                // topk: selection scratch
};

uint16_t floatToBf16(float f);
float bf16ToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float halfToFloat(uint16_t h);

}  // namespace trainer
