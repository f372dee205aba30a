// A float buffer in loomMemAlloc memory: host memory the other ranks of the
// host can map, so that collectives on it (the gradient buckets' all-reduces
// and reduce-scatters, the parameters' all-gathers) move data straight
// between the ranks' buffers instead of through loom's staging memory and
// slots (docs/usage.md, "Registered memory").  Where loomMemAlloc fails (no
// memfd, say) the buffer is ordinary memory and says so once.
#pragma once
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <new>

#include "include/loom.h"

namespace trainer {

class LoomFloats {
 public:
  // what: the buffer's name for the message when loomMemAlloc fails.
  LoomFloats(size_t n, bool shareable, const char* what = "gradients") : n_(n) {
    if (!n) return;
    void* p = nullptr;
    if (shareable && loomMemAlloc(&p, n * sizeof(float)) == loomSuccess) {
      fromLoom_ = true;
    } else {
      if (shareable)
        fprintf(stderr, "loom-trainer: loomMemAlloc failed (%s); %s in ordinary memory\n", loomGetLastError(nullptr),
                what);
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
  const float* data() const { return data_; }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  bool shared() const { return fromLoom_; }

 private:
  float* data_ = nullptr;
  size_t n_;
  bool fromLoom_ = false;
};

}  // namespace trainer
