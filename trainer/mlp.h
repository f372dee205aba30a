// The model of the reference trainer: a multi-layer perceptron (ReLU between
// layers, softmax cross-entropy on top) whose parameters live in one flat
// float32 buffer, laid out bucket by bucket so that each gradient bucket is one
// contiguous range that a single collective can carry.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace trainer {

// Layer l computes y = x W + b with W stored row-major as [in x out].
struct Layer {
  int in = 0, out = 0;
  size_t w = 0, b = 0;  // offsets of W and b in the flat buffer
};

// A gradient bucket: layers [first, last] (filled from the last layer down),
// occupying [off, off + len) of the flat buffer.  len is padded to a multiple
// of `align` floats so that it splits into equal, aligned shards.
struct Bucket {
  size_t off = 0, len = 0;
  int first = 0, last = 0;
};

struct Layout {
  std::vector<Layer> layers;
  std::vector<Bucket> buckets;  // buckets[0] holds the last layers (ready first)
  std::vector<int> bucketOf;    // layer -> bucket
  size_t total = 0;             // floats in the flat buffer, padding included
  size_t logical = 0;           // real parameters
};

// widths = {inputs, hidden..., classes}.  Buckets take whole layers in reverse
// order; the first closes once it would exceed firstBytes, the others capBytes
// (a layer larger than the cap gets a bucket of its own).
Layout planLayout(const std::vector<int>& widths, size_t firstBytes, size_t capBytes, size_t align);

// Copies between the flat (padded) layout and the logical order: for each
// layer W then b.  Checkpoints and parameter dumps use the logical order, so
// they do not depend on the number of ranks or the bucket sizes.
void toLogical(const Layout& L, const float* flat, float* logical);
void fromLogical(const Layout& L, const float* logical, float* flat);

// He-initialised weights, zero biases, from `seed`.
void initParams(const Layout& L, uint64_t seed, float* flat);
// The same one layer at a time: layer l's weights into w, drawn from rng,
// which must have drawn layers 0..l-1 before (initParams' sequence).
void initLayerWeights(const Layer& l, std::mt19937_64& rng, float* w);

// Where the model finds a layer's parameters and puts its gradients, so that
// they may live in one flat buffer (plain data parallelism), in gradient
// staging buffers (ZeRO-2) or in buffers all-gathered layer by layer (ZeRO-3).
// Both return the start of layer l's block: W at 0, b at Layer::b - Layer::w.
struct LayerAccess {
  // Called before layer l's forward and before its backward (l > 0 only: the
  // first layer's backward needs no weights).  The block must stay valid
  // until the next call.
  std::function<const float*(int l)> params;
  // Called before layer l's gradients are accumulated (backward only).
  std::function<float*(int l)> grads;
  // Layer l's gradients are final (may be empty).
  std::function<void(int l)> gradsReady;
};

// The access of a flat buffer laid out as L says.
LayerAccess flatAccess(const Layout& L, const float* params, float* grads);

// Activations of one micro-batch; sized once for the largest batch.
class Mlp {
 public:
  Mlp(const Layout& L, int maxBatch);

  // The passes below, with parameters and gradients wherever `a` says.
  double forward(const LayerAccess& a, const float* x, const uint8_t* labels, int batch, int* correct);
  void backward(const LayerAccess& a, const uint8_t* labels, int batch, float scale);

  // Forward pass of `batch` samples x [batch x in]; returns the summed loss
  // and stores the number of correct predictions.
  double forward(const float* params, const float* x, const uint8_t* labels, int batch, int* correct);

  // Backward pass of the last forward: adds d(scale * summed loss)/dparam to
  // grads.  onLayerReady(l) is called as soon as layer l's gradients are
  // final, from the last layer to the first, before the backward pass moves on.
  void backward(const float* params, float* grads, const uint8_t* labels, int batch, float scale,
                const std::function<void(int)>& onLayerReady);

 private:
  const Layout& L_;
  std::vector<std::vector<float>> acts_;  // acts_[0]: input copy, acts_[l+1]: output of layer l
  std::vector<float> delta_, deltaPrev_;
};

// y[B x out] = x[B x in] W[in x out] + b
void gemmForward(int B, int in, int out, const float* x, const float* W, const float* b, float* y);
// dx[B x in] = dy[B x out] W^T
void gemmBackwardData(int B, int in, int out, const float* dy, const float* W, float* dx);
// dW[in x out] += x^T dy ; db[out] += column sums of dy
void gemmBackwardWeights(int B, int in, int out, const float* x, const float* dy, float* dW, float* db);

}  // namespace trainer
