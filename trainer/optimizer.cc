#include "trainer/optimizer.h"

#include <cmath>

namespace trainer {

void optimizerStep(const OptConfig& c, float lr, uint64_t t, float* __restrict p, const float* __restrict g,
                   float* __restrict m, float* __restrict v, size_t n) {
  if (c.kind == OptKind::Sgd) {
    for (size_t i = 0; i < n; ++i) {
      m[i] = c.momentum * m[i] + g[i];
      p[i] -= lr * m[i];
    }
    return;
  }
  float bc1 = 1.0f - std::pow(c.beta1, float(t));
  float bc2 = 1.0f - std::pow(c.beta2, float(t));
  float step = lr / bc1, invBc2 = 1.0f / bc2;
  for (size_t i = 0; i < n; ++i) {
    m[i] = c.beta1 * m[i] + (1.0f - c.beta1) * g[i];
    v[i] = c.beta2 * v[i] + (1.0f - c.beta2) * g[i] * g[i];
    p[i] -= step * m[i] / (std::sqrt(v[i] * invBc2) + c.eps);
  }
}

}  // namespace trainer
