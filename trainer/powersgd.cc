#include "trainer/powersgd.h"

#include <algorithm>
#include <cmath>
#include <random>

namespace trainer {

PowerSgd::PowerSgd(const Layout& L, int rank) : L_(L), rank_(rank) {
  size_t n1 = 0, n2 = 0;
  buckets_.resize(L.buckets.size());
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    msg1Off_.push_back(n1);
    msg2Off_.push_back(n2);
    size_t s1 = n1, s2 = n2;
    for (int l = L.buckets[b].first; l <= L.buckets[b].last; ++l) {
      const Layer& ly = L.layers[size_t(l)];
      size_t in = size_t(ly.in), out = size_t(ly.out), r = size_t(rank);
      // Compressed only where rank r loses something and the wire gains.
      Matrix m{l, r < std::min(in, out) && (in + out) * r < in * out, 0, 0, 0};
      if (m.compressed) {
        m.p = n1;
        n1 += in * r;
        m.q = n2;
        n2 += out * r;
      }
      m.raw = n1;
      n1 += (m.compressed ? 0 : in * out) + out;
      buckets_[b].push_back(m);
    }
    msg1Len_.push_back(n1 - s1);
    msg2Len_.push_back(n2 - s2);
  }
  msg1_.assign(n1, 0.0f);
  msg2_.assign(n2, 0.0f);
  residual_.assign(L.total, 0.0f);
  wire_ = n1 + n2;
  // Every rank starts from the same Q (a fixed seed): the all-reduces keep it so.
  qState_.resize(n2);
  std::mt19937_64 rng(0x9e3779b97f4a7c15ull);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& q : qState_) q = dist(rng);
}

size_t PowerSgd::bufferBytes() const {
  return (msg1_.size() + msg2_.size() + qState_.size() + residual_.size()) * sizeof(float);
}

float* PowerSgd::first(size_t b, const float* g, size_t* n) {
  const size_t base = L_.buckets[b].off, r = size_t(rank_);
  for (const Matrix& m : buckets_[b]) {
    const Layer& ly = L_.layers[size_t(m.layer)];
    const size_t in = size_t(ly.in), out = size_t(ly.out);
    float* M = residual_.data() + ly.w;
    const float* gw = g + (ly.w - base);
    for (size_t i = 0; i < in * out; ++i) M[i] += gw[i];
    float* raw = msg1_.data() + m.raw;
    if (m.compressed) {
      float* P = msg1_.data() + m.p;
      const float* Q = qState_.data() + m.q;
      std::fill(P, P + in * r, 0.0f);
      for (size_t i = 0; i < in; ++i)
        for (size_t j = 0; j < out; ++j)
          for (size_t k = 0; k < r; ++k) P[i * r + k] += M[i * out + j] * Q[j * r + k];
    } else {  // sent whole: nothing is owed afterwards
      std::copy(M, M + in * out, raw);
      std::fill(M, M + in * out, 0.0f);
      raw += in * out;
    }
    std::copy(g + (ly.b - base), g + (ly.b - base) + out, raw);
  }
  *n = msg1Len_[b];
  return msg1_.data() + msg1Off_[b];
}

float* PowerSgd::second(size_t b, size_t* n) {
  const size_t r = size_t(rank_);
  for (const Matrix& m : buckets_[b]) {
    if (!m.compressed) continue;
    const Layer& ly = L_.layers[size_t(m.layer)];
    const size_t in = size_t(ly.in), out = size_t(ly.out);
    float* P = msg1_.data() + m.p;
    // Gram-Schmidt on the columns of P (in x r, row-major), each projection
    // done twice for orthogonality in float32.  A column that is (nearly) a
    // combination of the earlier ones, as when M has rank < r, is zeroed:
    // normalising its rounding noise would give a direction that is not
    // orthogonal to them.
    for (size_t k = 0; k < r; ++k) {
      auto norm = [&] {
        double n = 0;
        for (size_t i = 0; i < in; ++i) n += double(P[i * r + k]) * P[i * r + k];
        return std::sqrt(n);
      };
      double before = norm();
      for (int pass = 0; pass < 2; ++pass)
        for (size_t c = 0; c < k; ++c) {
          double dot = 0;
          for (size_t i = 0; i < in; ++i) dot += double(P[i * r + k]) * P[i * r + c];
          for (size_t i = 0; i < in; ++i) P[i * r + k] -= float(dot) * P[i * r + c];
        }
      double after = norm();
      float scale = after > 1e-4 * before && after > 0 ? float(1.0 / after) : 0.0f;
      for (size_t i = 0; i < in; ++i) P[i * r + k] *= scale;
    }
    const float* M = residual_.data() + ly.w;
    float* Q = msg2_.data() + m.q;
    std::fill(Q, Q + out * r, 0.0f);
    for (size_t i = 0; i < in; ++i)
      for (size_t j = 0; j < out; ++j)
        for (size_t k = 0; k < r; ++k) Q[j * r + k] += M[i * out + j] * P[i * r + k];
  }
  *n = msg2Len_[b];
  return msg2_.data() + msg2Off_[b];
}

void PowerSgd::finish(size_t b, float* g) {
  const size_t base = L_.buckets[b].off, r = size_t(rank_);
  for (const Matrix& m : buckets_[b]) {
    const Layer& ly = L_.layers[size_t(m.layer)];
    const size_t in = size_t(ly.in), out = size_t(ly.out);
    float* gw = g + (ly.w - base);
    const float* raw = msg1_.data() + m.raw;
    if (m.compressed) {
      const float* P = msg1_.data() + m.p;
      const float* Q = msg2_.data() + m.q;
      float* M = residual_.data() + ly.w;
      for (size_t i = 0; i < in; ++i)
        for (size_t j = 0; j < out; ++j) {
          float a = 0;
          for (size_t k = 0; k < r; ++k) a += P[i * r + k] * Q[j * r + k];
          gw[i * out + j] = a;
          M[i * out + j] -= a;
        }
      std::copy(Q, Q + out * r, qState_.data() + m.q);  // warm start of the next step
    } else {
      std::copy(raw, raw + in * out, gw);
      raw += in * out;
    }
    std::copy(raw, raw + out, g + (ly.b - base));
  }
}

}  // namespace trainer
