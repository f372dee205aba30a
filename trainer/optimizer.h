// SGD with momentum and Adam over a contiguous range of parameters.  The same
// function updates the whole model (plain data parallelism) or one rank's
// shard (the sharded optimizer): only the range and the state differ.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace trainer {

enum class OptKind { Sgd, Adam };

struct OptConfig {
  OptKind kind = OptKind::Sgd;
  float momentum = 0.9f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
};

// Number of float state arrays per parameter: 1 (momentum) or 2 (Adam's m, v).
inline int stateArrays(OptKind k) { return k == OptKind::Adam ? 2 : 1; }

// One step t (1-based) with learning rate lr on p[0..n) given g; m and v are
// the state of the same range (v unused by SGD).
void optimizerStep(const OptConfig& c, float lr, uint64_t t, float* p, const float* g, float* m, float* v,
                   size_t n);

}  // namespace trainer
