// A float buffer in loomMemAlloc memory: host memory the other ranks of the
// host can map, so that all-reduces of it (the gradient buckets) reduce
// straight out of the peers' buffers instead of being copied through loom's
// staging memory (docs/usage.md, "Registered memory").  Where loomMemAlloc
// fails (no memfd, say) the buffer is ordinary memory and says so once.
#pragma once
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <new>

#include "include/loom.h"

namespace trainer {

class LoomFloats {
 public:
  LoomFloats(size_t n, bool shareable) : n_(n) {
    if (!n) return;
    void* p = nullptr;
    if (shareable && loomMemAlloc(&p, n * sizeof(float)) == loomSuccess) {
      fromLoom_ = true;
    } else {
      if (shareable) fprintf(stderr, "loom-trainer: loomMemAlloc failed (%s); gradients in ordinary memory\n",
                             loomGetLastError(nullptr));
      p = ::operator new(n * sizeof(float));
    }
    data_ = static_cast<float*>(p);
    memset(data_, 0, n * sizeof(float));
  }
  ~LoomFloats() {
    if (fromLoom_) loomMemFree(data_);
    else ::operator delete(data_);
  }
  LoomFloats(const LoomFloats&) = delete;
  LoomFloats& operator=(const LoomFloats&) = delete;

  float* data() { return data_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  bool shared() const { return fromLoom_; }

 private:
  float* data_ = nullptr;
  size_t n_;
  bool fromLoom_ = false;
};

}  // namespace trainer
