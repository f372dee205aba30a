// What --elastic keeps so that the survivors of a dead rank can rebuild the
// training state and continue (trainer_main.cc's elastic loop).
//
// At the start of every step each rank copies what it holds: the replicated
// part (the parameters below ZeRO-3, the optimizer state at stage 0) and its
// own shards (the optimizer state from stage 1, the parameters at stage 3).
// With ZeRO it then sends its shards to the rank below it (ring order), so
// every shard has a second copy on a neighbour, and keeps the two latest
// steps of both.  A rank that dies takes its shards with it; the copy on its
// neighbour replaces them.  The exchange of step s can fail half done (some
// ranks hold their neighbour's shards of step s, others only of s - 1), so
// the survivors agree on the latest step at which every shard is held by
// someone, rebuild the whole state of that step, and continue from it.
// A shard is lost only when a rank and the neighbour below it both die;
// then the last checkpoint on disk is the fallback.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "include/loom.h"
#include "trainer/checkpoint.h"
#include "trainer/mlp.h"

namespace trainer {

class ElasticState {
 public:
  // For one run of training (a communicator of nranks with this rank and
  // layout); `stage` is the ZeRO stage, nState the optimizer's state arrays.
  void configure(const Layout& L, int stage, int nState, int rank, int nranks, const std::vector<int>& widths,
                 int optimizer, int hook);
  // At the start of `step`: copies this rank's part of (params, state) and,
  // with ZeRO, swaps shard copies with the neighbours on comm (a failure
  // throws LoomFailure like every trainer call).  `params` and `state` are
  // what the run holds (packed shards where sharded).
  void snapshot(uint64_t step, const float* params, const float* state, loomComm_t comm);
  bool empty() const { return own_[0].step < 0; }

  // After a shrink, on the new communicator (every survivor calls it): the
  // state of the latest step every shard of the old run is held at, in
  // logical order.  false with *why when a shard was lost.
  bool rebuild(loomComm_t comm, Checkpoint* out, std::string* why) const;

 private:
  struct Copy {
    int owner = -1;  // old rank whose shards these are; nranks_: the replicated part
    int64_t step = -1;
    std::vector<float> data;
  };
  size_t shardFloats() const;  // one rank's shards: params (stage 3) + state (stage >= 1), packed
  size_t replFloats() const;   // the replicated part: params (stage < 3) + state (stage 0), flat

  Layout L_;
  int stage_ = 0, nState_ = 0, rank_ = 0, nranks_ = 1;
  std::vector<int> widths_;
  int optimizer_ = 0, hook_ = 0;
  Copy own_[2], repl_[2], buddy_[2];  // [0]: the latest step
  std::vector<float> incoming_;
};

}  // namespace trainer
