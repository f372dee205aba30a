#include "trainer/checkpoint.h"

#include <cstdio>
#include <cstring>

namespace trainer {

// Version 2 added PowerSGD's warm start; version 1 files (without it) still read.
static const char kMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', '2'};
static const char kMagicV1[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', '1'};

namespace {
struct File {
  FILE* f;
  ~File() {
    if (f) fclose(f);
  }
};
}  // namespace

template <typename T>
static bool put(FILE* f, const T& x) {
  return fwrite(&x, sizeof(T), 1, f) == 1;
}
template <typename T>
static bool get(FILE* f, T* x) {
  return fread(x, sizeof(T), 1, f) == 1;
}
static bool putVec(FILE* f, const std::vector<float>& v) {
  uint64_t n = v.size();
  return put(f, n) && fwrite(v.data(), sizeof(float), v.size(), f) == v.size();
}
static bool getVec(FILE* f, std::vector<float>* v) {
  uint64_t n;
  if (!get(f, &n) || n > (uint64_t(1) << 34)) return false;
  v->resize(n);
  return fread(v->data(), sizeof(float), n, f) == n;
}

bool writeCheckpoint(const std::string& path, const Checkpoint& c, std::string* error) {
  std::string tmp = path + ".tmp";
  bool ok;
  {
    File f{fopen(tmp.c_str(), "wb")};
    if (!f.f) {
      *error = tmp + ": cannot create";
      return false;
    }
    uint32_t nw = uint32_t(c.widths.size());
    ok = fwrite(kMagic, 1, 8, f.f) == 8 && put(f.f, nw);
    for (int w : c.widths) ok = ok && put(f.f, int32_t(w));
    ok = ok && put(f.f, int32_t(c.optimizer)) && put(f.f, int32_t(c.hook)) && put(f.f, c.nextStep) &&
         put(f.f, int32_t(c.nranks)) && putVec(f.f, c.params) && putVec(f.f, c.state) &&
         putVec(f.f, c.residual) && putVec(f.f, c.warmStart);
    ok = ok && fflush(f.f) == 0;
  }
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    *error = path + ": write failed";
    remove(tmp.c_str());
    return false;
  }
  return true;
}

bool readCheckpoint(const std::string& path, Checkpoint* c, std::string* error) {
  File f{fopen(path.c_str(), "rb")};
  if (!f.f) {
    *error = path + ": cannot open";
    return false;
  }
  char magic[8];
  uint32_t nw = 0;
  bool read = fread(magic, 1, 8, f.f) == 8;
  bool v1 = read && std::memcmp(magic, kMagicV1, 8) == 0;
  if (!read || (!v1 && std::memcmp(magic, kMagic, 8) != 0) || !get(f.f, &nw) || nw < 2 || nw > 64) {
    *error = path + ": not a loom-trainer checkpoint";
    return false;
  }
  c->widths.resize(nw);
  bool ok = true;
  for (int& w : c->widths) {
    int32_t x = 0;
    ok = ok && get(f.f, &x);
    w = x;
  }
  int32_t opt = 0, hook = 0, nranks = 0;
  ok = ok && get(f.f, &opt) && get(f.f, &hook) && get(f.f, &c->nextStep) && get(f.f, &nranks) &&
       getVec(f.f, &c->params) && getVec(f.f, &c->state) && getVec(f.f, &c->residual);
  c->warmStart.clear();
  if (!v1) ok = ok && getVec(f.f, &c->warmStart);
  if (!ok) {
    *error = path + ": truncated or corrupt checkpoint";
    return false;
  }
  c->optimizer = opt;
  c->hook = hook;
  c->nranks = nranks;
  return true;
}

}  // namespace trainer
