#include "trainer/dataset.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace trainer {

static bool exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

// Finds `base` or `base.gz` in dir; "" if neither exists.
static std::string findFile(const std::string& dir, const std::string& base) {
  if (exists(dir + "/" + base + ".gz")) return dir + "/" + base + ".gz";
  if (exists(dir + "/" + base)) return dir + "/" + base;
  return "";
}

static uint32_t bigEndian(const unsigned char* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | p[3];
}

// Reads an IDX file of unsigned bytes (gzopen reads gzip and plain files
// alike).  dims receives the dimension sizes.
static bool readIdx(const std::string& path, int wantDims, std::vector<uint32_t>* dims,
                    std::vector<uint8_t>* data, std::string* error) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) {
    *error = path + ": cannot open";
    return false;
  }
  unsigned char head[4];
  bool ok = gzread(f, head, 4) == 4;
  if (!ok || head[0] != 0 || head[1] != 0 || head[2] != 0x08 || head[3] != wantDims) {
    *error = path + ": not an IDX file of unsigned bytes with " + std::to_string(wantDims) + " dimensions";
    gzclose(f);
    return false;
  }
  size_t total = 1;
  dims->clear();
  for (int i = 0; i < wantDims; ++i) {
    unsigned char b[4];
    if (gzread(f, b, 4) != 4) {
      *error = path + ": truncated header";
      gzclose(f);
      return false;
    }
    dims->push_back(bigEndian(b));
    total *= dims->back();
  }
  if (total == 0 || total > (size_t(1) << 31)) {
    *error = path + ": implausible size " + std::to_string(total);
    gzclose(f);
    return false;
  }
  data->resize(total);
  size_t got = 0;
  while (got < total) {
    int r = gzread(f, data->data() + got, unsigned(std::min<size_t>(total - got, 1 << 30)));
    if (r <= 0) break;
    got += size_t(r);
  }
  gzclose(f);
  if (got != total) {
    *error = path + ": truncated data (" + std::to_string(got) + " of " + std::to_string(total) + " bytes)";
    return false;
  }
  return true;
}

static bool loadSplit(const std::string& dir, const std::string& prefix, Dataset* d,
                      std::vector<uint8_t>* images, std::vector<uint8_t>* labels, std::string* error) {
  std::string ip = findFile(dir, prefix + "-images-idx3-ubyte");
  std::string lp = findFile(dir, prefix + "-labels-idx1-ubyte");
  if (ip.empty() || lp.empty()) {
    *error = dir + ": missing " + prefix + (ip.empty() ? "-images" : "-labels") + "-idx file";
    return false;
  }
  std::vector<uint32_t> idims, ldims;
  if (!readIdx(ip, 3, &idims, images, error) || !readIdx(lp, 1, &ldims, labels, error)) return false;
  if (idims[0] != ldims[0]) {
    *error = ip + ": " + std::to_string(idims[0]) + " images but " + lp + " has " + std::to_string(ldims[0]) +
             " labels";
    return false;
  }
  if (idims[1] != uint32_t(d->rows) || idims[2] != uint32_t(d->cols)) {
    *error =
        ip + ": images are " + std::to_string(idims[1]) + "x" + std::to_string(idims[2]) + ", expected 28x28";
    return false;
  }
  for (uint8_t l : *labels)
    if (l >= d->classes) {
      *error = lp + ": label " + std::to_string(l) + " out of range";
      return false;
    }
  return true;
}

bool loadDataset(const std::string& dir, bool forceSynthetic, uint64_t seed, Dataset* out,
                 std::string* error) {
  const char* names[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                         "t10k-labels-idx1-ubyte"};
  bool any = false;
  for (const char* n : names) any |= !findFile(dir, n).empty();
  if (forceSynthetic || !any) {
    makeSynthetic(60000, 10000, seed, out);
    out->name =
        forceSynthetic ? "synthetic (--synthetic)" : "synthetic (no Fashion-MNIST IDX files in " + dir + ")";
    return true;
  }
  if (!loadSplit(dir, "train", out, &out->trainImages, &out->trainLabels, error) ||
      !loadSplit(dir, "t10k", out, &out->testImages, &out->testLabels, error))
    return false;
  out->name = "fashion-mnist (" + dir + ")";
  return true;
}

void makeSynthetic(size_t train, size_t test, uint64_t seed, Dataset* d) {
  std::mt19937_64 rng(seed ^ 0x5eed5eedULL);
  int px = d->pixels();
  // Prototypes are smooth blobs so that classes overlap under noise.
  std::vector<float> proto(size_t(d->classes) * px);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int c = 0; c < d->classes; ++c)
    for (int k = 0; k < 3; ++k) {
      float cx = 4 + 20 * u(rng), cy = 4 + 20 * u(rng), s = 3 + 4 * u(rng);
      for (int y = 0; y < d->rows; ++y)
        for (int x = 0; x < d->cols; ++x)
          proto[size_t(c) * px + y * d->cols + x] +=
              std::exp(-((x - cx) * (x - cx) + (y - cy) * (y - cy)) / (2 * s * s));
    }
  std::normal_distribution<float> noise(0.0f, 0.35f);
  auto fill = [&](size_t n, std::vector<uint8_t>* img, std::vector<uint8_t>* lab) {
    img->resize(n * px);
    lab->resize(n);
    for (size_t i = 0; i < n; ++i) {
      int c = int(rng() % d->classes);
      (*lab)[i] = uint8_t(c);
      for (int p = 0; p < px; ++p) {
        float v = proto[size_t(c) * px + p] + noise(rng);
        (*img)[i * px + p] = uint8_t(std::clamp(v, 0.0f, 1.0f) * 255.0f);
      }
    }
  };
  fill(train, &d->trainImages, &d->trainLabels);
  fill(test, &d->testImages, &d->testLabels);
}

void toFloat(const Dataset& d, const std::vector<uint8_t>& images, const uint32_t* idx, int n, float* x) {
  // Fashion-MNIST's pixel mean and standard deviation (over the training set).
  const float mean = 0.2860f, invStd = 1.0f / 0.3530f;
  int px = d.pixels();
  for (int i = 0; i < n; ++i) {
    const uint8_t* src = images.data() + size_t(idx[i]) * px;
    for (int p = 0; p < px; ++p) x[size_t(i) * px + p] = (src[p] * (1.0f / 255.0f) - mean) * invStd;
  }
}

DistributedSampler::DistributedSampler(size_t n, int globalBatch, int rank, int nranks, uint64_t seed)
    : n_(n), batch_(globalBatch), rank_(rank), nranks_(nranks), seed_(seed), perm_(n) {}

const uint32_t* DistributedSampler::shard(uint64_t step) {
  int64_t epoch = int64_t(step / stepsPerEpoch());
  if (epoch != epoch_) {
    std::iota(perm_.begin(), perm_.end(), 0u);
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ULL + uint64_t(epoch));
    std::shuffle(perm_.begin(), perm_.end(), rng);
    epoch_ = epoch;
  }
  size_t pos = (step % stepsPerEpoch()) * batch_ + size_t(rank_) * shardSize();
  return perm_.data() + pos;
}

}  // namespace trainer
