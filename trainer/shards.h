// ZeRO's partition of the flat buffer: rank r owns shard r of every bucket
// (bucket lengths are multiples of 16 x nranks floats, so the shards are
// equal and aligned).  A sharded array (optimizer state from stage 1,
// gradients from stage 2, parameters at stage 3) holds this rank's shards
// packed one after the other: 1/N of the flat buffer.
#pragma once
#include <cstddef>
#include <vector>

#include "trainer/mlp.h"

namespace trainer {

class Shards {
 public:
  Shards(const Layout& L, int rank, int nranks) : L_(L), rank_(rank), nranks_(nranks) {
    for (const Bucket& b : L.buckets) {
      packed_.push_back(total_);
      total_ += b.len / size_t(nranks);
    }
  }
  size_t len(size_t b) const { return L_.buckets[b].len / size_t(nranks_); }
  // Where this rank's shard of bucket b sits in the flat layout and in a packed array.
  size_t flatOff(size_t b) const { return L_.buckets[b].off + size_t(rank_) * len(b); }
  size_t packedOff(size_t b) const { return packed_[b]; }
  size_t total() const { return total_; }  // floats in a packed array
  size_t buckets() const { return packed_.size(); }

 private:
  const Layout& L_;
  int rank_, nranks_;
  size_t total_ = 0;
  std::vector<size_t> packed_;
};

}  // namespace trainer
