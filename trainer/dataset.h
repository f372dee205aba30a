// Training data: Fashion-MNIST read from IDX files (gzip'd or plain), or a
// generated stand-in of the same shape when the files are absent; and the
// distributed sampler that hands each rank its disjoint share of every batch.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

struct Dataset {
  std::string name;  // "fashion-mnist (DIR)" or "synthetic (...)"
  int rows = 28, cols = 28, classes = 10;
  std::vector<uint8_t> trainImages, trainLabels, testImages, testLabels;
  size_t trainCount() const { return trainLabels.size(); }
  size_t testCount() const { return testLabels.size(); }
  int pixels() const { return rows * cols; }
};

// Loads Fashion-MNIST from dir (train-images-idx3-ubyte[.gz] etc.).  When no
// file of the set exists there, generates the synthetic set instead (and says
// so in name).  A file that exists but is malformed is an error: returns false
// with *error set.
bool loadDataset(const std::string& dir, bool forceSynthetic, uint64_t seed, Dataset* out,
                 std::string* error);

// Ten noisy classes around random prototypes: learnable, but not trivially.
void makeSynthetic(size_t train, size_t test, uint64_t seed, Dataset* out);

// Normalises images [first, first+n) of `images` (indices through idx) into x.
void toFloat(const Dataset& d, const std::vector<uint8_t>& images, const uint32_t* idx, int n, float* x);

// The distributed sampler: epoch e visits a permutation of the training set
// drawn from (seed, e); global batch i is positions [i*B, (i+1)*B) of it, and
// rank r takes the r-th of nranks equal slices.  An incomplete last batch is
// dropped, so every rank sees the same number of steps.
class DistributedSampler {
 public:
  DistributedSampler(size_t n, int globalBatch, int rank, int nranks, uint64_t seed);
  size_t stepsPerEpoch() const { return n_ / batch_; }
  // Indices of this rank's share of global step `step` (epoch = step / stepsPerEpoch).
  const uint32_t* shard(uint64_t step);
  int shardSize() const { return batch_ / nranks_; }

 private:
  size_t n_;
  int batch_, rank_, nranks_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  std::vector<uint32_t> perm_;
};

}  // namespace trainer
