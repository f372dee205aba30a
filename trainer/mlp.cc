#include "trainer/mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

namespace trainer {

static size_t roundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

Layout planLayout(const std::vector<int>& widths, size_t firstBytes, size_t capBytes, size_t align) {
  Layout L;
  int n = int(widths.size()) - 1;
  L.layers.resize(n);
  L.bucketOf.resize(n);
  for (int l = 0; l < n; ++l) {
    L.layers[l].in = widths[l];
    L.layers[l].out = widths[l + 1];
    L.logical += size_t(widths[l]) * widths[l + 1] + widths[l + 1];
  }
  // Group layers into buckets from the last one down, as backward produces them.
  size_t curBytes = 0;
  for (int l = n - 1; l >= 0; --l) {
    size_t bytes = (size_t(L.layers[l].in) * L.layers[l].out + L.layers[l].out) * sizeof(float);
    size_t cap = L.buckets.size() == 1 ? firstBytes : capBytes;  // bucket 0 is the small one
    if (L.buckets.empty() || (curBytes > 0 && curBytes + bytes > cap)) {
      L.buckets.push_back(Bucket{0, 0, l, l});
      curBytes = 0;
    }
    L.buckets.back().first = l;
    curBytes += bytes;
    L.bucketOf[l] = int(L.buckets.size()) - 1;
  }
  // Lay the buckets out one after the other; 16-float aligned rows start.
  size_t off = 0;
  for (Bucket& b : L.buckets) {
    b.off = off;
    size_t p = off;
    for (int l = b.last; l >= b.first; --l) {
      L.layers[l].w = p = roundUp(p, 16);
      p += size_t(L.layers[l].in) * L.layers[l].out;
      L.layers[l].b = p = roundUp(p, 16);
      p += L.layers[l].out;
    }
    b.len = roundUp(p - b.off, align);
    off = b.off + b.len;
  }
  L.total = off;
  return L;
}

void toLogical(const Layout& L, const float* flat, float* logical) {
  for (const Layer& l : L.layers) {
    size_t nw = size_t(l.in) * l.out;
    std::memcpy(logical, flat + l.w, nw * sizeof(float));
    std::memcpy(logical + nw, flat + l.b, l.out * sizeof(float));
    logical += nw + l.out;
  }
}

void fromLogical(const Layout& L, const float* logical, float* flat) {
  for (const Layer& l : L.layers) {
    size_t nw = size_t(l.in) * l.out;
    std::memcpy(flat + l.w, logical, nw * sizeof(float));
    std::memcpy(flat + l.b, logical + nw, l.out * sizeof(float));
    logical += nw + l.out;
  }
}

void initParams(const Layout& L, uint64_t seed, float* flat) {
  std::fill(flat, flat + L.total, 0.0f);
  std::mt19937_64 rng(seed);
  for (const Layer& l : L.layers) initLayerWeights(l, rng, flat + l.w);
}

void initLayerWeights(const Layer& l, std::mt19937_64& rng, float* w) {
  std::normal_distribution<float> dist(0.0f, std::sqrt(2.0f / float(l.in)));
  for (size_t i = 0; i < size_t(l.in) * l.out; ++i) w[i] = dist(rng);
}

// The three kernels keep the innermost loop over contiguous, independent
// elements (or fixed lanes), so the compiler vectorises them and the result of
// each element does not depend on the vector width: AVX2 and SSE2 builds give
// the same bits.
#define TRAINER_KERNEL __attribute__((target_clones("avx2", "default")))

TRAINER_KERNEL
void gemmForward(int B, int in, int out, const float* x, const float* W, const float* bias, float* y) {
  for (int r = 0; r < B; ++r) {
    float* __restrict yr = y + size_t(r) * out;
    const float* xr = x + size_t(r) * in;
    std::memcpy(yr, bias, out * sizeof(float));
    for (int i = 0; i < in; ++i) {
      float a = xr[i];
      if (a == 0.0f) continue;  // ReLU outputs are half zeros
      const float* __restrict w = W + size_t(i) * out;
      for (int j = 0; j < out; ++j) yr[j] += a * w[j];
    }
  }
}

TRAINER_KERNEL
void gemmBackwardWeights(int B, int in, int out, const float* x, const float* dy, float* dW, float* db) {
  for (int i = 0; i < in; ++i) {
    float* __restrict g = dW + size_t(i) * out;
    for (int r = 0; r < B; ++r) {
      float a = x[size_t(r) * in + i];
      if (a == 0.0f) continue;
      const float* __restrict d = dy + size_t(r) * out;
      for (int j = 0; j < out; ++j) g[j] += a * d[j];
    }
  }
  for (int r = 0; r < B; ++r) {
    const float* __restrict d = dy + size_t(r) * out;
    float* __restrict gb = db;
    for (int j = 0; j < out; ++j) gb[j] += d[j];
  }
}

// dx = dy W^T, zero where mask (the layer's input, a ReLU output) is <= 0.
TRAINER_KERNEL
static void gemmBackwardDataMasked(int B, int in, int out, const float* dy, const float* W, const float* mask,
                                   float* dx) {
  constexpr int kLanes = 16;
  for (int r = 0; r < B; ++r) {
    const float* __restrict d = dy + size_t(r) * out;
    for (int i = 0; i < in; ++i) {
      if (mask && mask[size_t(r) * in + i] <= 0.0f) {
        dx[size_t(r) * in + i] = 0.0f;
        continue;
      }
      const float* __restrict w = W + size_t(i) * out;
      float acc[kLanes] = {};
      int j = 0;
      for (; j + kLanes <= out; j += kLanes)
        for (int k = 0; k < kLanes; ++k) acc[k] += d[j + k] * w[j + k];
      float s = 0.0f;
      for (; j < out; ++j) s += d[j] * w[j];
      for (int k = 0; k < kLanes; ++k) s += acc[k];
      dx[size_t(r) * in + i] = s;
    }
  }
}

void gemmBackwardData(int B, int in, int out, const float* dy, const float* W, float* dx) {
  gemmBackwardDataMasked(B, in, out, dy, W, nullptr, dx);
}

Mlp::Mlp(const Layout& L, int maxBatch) : L_(L) {
  int maxWidth = 0;
  acts_.resize(L.layers.size() + 1);
  for (size_t l = 0; l < L.layers.size(); ++l) {
    acts_[l + 1].resize(size_t(maxBatch) * L.layers[l].out);
    maxWidth = std::max({maxWidth, L.layers[l].in, L.layers[l].out});
  }
  acts_[0].resize(size_t(maxBatch) * L.layers[0].in);
  delta_.resize(size_t(maxBatch) * maxWidth);
  deltaPrev_.resize(size_t(maxBatch) * maxWidth);
}

LayerAccess flatAccess(const Layout& L, const float* params, float* grads) {
  LayerAccess a;
  a.params = [&L, params](int l) { return params + L.layers[l].w; };
  a.grads = [&L, grads](int l) { return grads + L.layers[l].w; };
  return a;
}

double Mlp::forward(const float* params, const float* x, const uint8_t* labels, int batch, int* correct) {
  return forward(flatAccess(L_, params, nullptr), x, labels, batch, correct);
}

void Mlp::backward(const float* params, float* grads, const uint8_t* labels, int batch, float scale,
                   const std::function<void(int)>& onLayerReady) {
  LayerAccess a = flatAccess(L_, params, grads);
  a.gradsReady = onLayerReady;
  backward(a, labels, batch, scale);
}

double Mlp::forward(const LayerAccess& a, const float* x, const uint8_t* labels, int batch, int* correct) {
  size_t nl = L_.layers.size();
  std::memcpy(acts_[0].data(), x, size_t(batch) * L_.layers[0].in * sizeof(float));
  for (size_t l = 0; l < nl; ++l) {
    const Layer& ly = L_.layers[l];
    float* y = acts_[l + 1].data();
    const float* p = a.params(int(l));
    gemmForward(batch, ly.in, ly.out, acts_[l].data(), p, p + (ly.b - ly.w), y);
    if (l + 1 < nl)
      for (size_t i = 0; i < size_t(batch) * ly.out; ++i) y[i] = y[i] > 0.0f ? y[i] : 0.0f;
  }
  // Softmax in place over the logits; loss = -log p(label).
  int classes = L_.layers[nl - 1].out;
  double loss = 0.0;
  int ok = 0;
  for (int r = 0; r < batch; ++r) {
    float* z = acts_[nl].data() + size_t(r) * classes;
    int arg = int(std::max_element(z, z + classes) - z);
    float zmax = z[arg];
    float sum = 0.0f;
    for (int c = 0; c < classes; ++c) sum += (z[c] = std::exp(z[c] - zmax));
    for (int c = 0; c < classes; ++c) z[c] /= sum;
    loss -= std::log(std::max(z[labels[r]], 1e-30f));
    ok += arg == labels[r];
  }
  if (correct) *correct = ok;
  return loss;
}

void Mlp::backward(const LayerAccess& a, const uint8_t* labels, int batch, float scale) {
  int nl = int(L_.layers.size());
  int classes = L_.layers[nl - 1].out;
  const float* p = acts_[nl].data();
  for (int r = 0; r < batch; ++r)
    for (int c = 0; c < classes; ++c)
      delta_[size_t(r) * classes + c] = (p[size_t(r) * classes + c] - (c == labels[r])) * scale;
  for (int l = nl - 1; l >= 0; --l) {
    const Layer& ly = L_.layers[l];
    // Asked first, so that a prefetch it starts runs during both products.
    const float* p = l > 0 ? a.params(l) : nullptr;
    float* g = a.grads(l);
    gemmBackwardWeights(batch, ly.in, ly.out, acts_[l].data(), delta_.data(), g, g + (ly.b - ly.w));
    if (a.gradsReady) a.gradsReady(l);
    if (l > 0) {
      gemmBackwardDataMasked(batch, ly.in, ly.out, delta_.data(), p, acts_[l].data(), deltaPrev_.data());
      delta_.swap(deltaPrev_);
    }
  }
}

}  // namespace trainer
