// PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): each weight matrix's
// gradient M (in x out, plus this rank's error feedback) is sent as a rank-r
// approximation P Q^T, found by one step of power iteration warm-started
// from the previous step's Q:
//   P = M Q            all-reduced (average), then orthonormalised (Gram-Schmidt)
//   Q = M^T P          all-reduced (average)
//   gradient = P Q^T   the same on every rank; residual = M - P Q^T stays here
// Per matrix (in + out) x r floats go on the wire instead of in x out.  Biases,
// and matrices of rank <= r or too small to gain, travel whole in the first
// all-reduce.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "trainer/mlp.h"

namespace trainer {

class PowerSgd {
 public:
  PowerSgd(const Layout& L, int rank);

  // The first message of bucket b: adds g (the bucket's gradients, flat
  // layout from the bucket's start) to the residual and computes P and the
  // whole part.  Average-all-reduce msg[0, n) in place.
  float* first(size_t b, const float* g, size_t* n);
  // After that all-reduce: orthonormalises P and computes Q; the second
  // message, to average-all-reduce likewise.
  float* second(size_t b, size_t* n);
  // After the second all-reduce: writes the approximate gradient into g and
  // keeps M - P Q^T as the residual.
  void finish(size_t b, float* g);

  std::vector<float>& residual() { return residual_; }  // flat layout
  // The Q matrices the next step's power iteration starts from: the same on
  // every rank (each step all-reduces them), part of a checkpoint.
  std::vector<float>& warmStart() { return qState_; }
  size_t wireFloats() const { return wire_; }           // per step, both messages
  size_t bufferBytes() const;

 private:
  struct Matrix {
    int layer;
    bool compressed;
    size_t p, q;  // compressed: offsets of P in msg1_ and of Q in msg2_ and qState_
    size_t raw;   // offset of the whole part (W if not compressed, then b) in msg1_
  };
  const Layout& L_;
  int rank_;
  std::vector<std::vector<Matrix>> buckets_;
  std::vector<size_t> msg1Off_, msg1Len_, msg2Off_, msg2Len_;  // per bucket
  std::vector<float> msg1_, msg2_, qState_, residual_;
  size_t wire_ = 0;
};

}  // namespace trainer
