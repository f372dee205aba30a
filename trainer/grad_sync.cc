#include "trainer/grad_sync.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "trainer/check.h"

namespace trainer {

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static uint32_t bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}
static float fromBits(uint32_t x) {
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

uint16_t floatToBf16(float f) {
  uint32_t x = bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return uint16_t((x >> 16) | 0x40);  // quiet NaN
  return uint16_t((x + 0x7fff + ((x >> 16) & 1)) >> 16);                 // round to nearest even
}
float bf16ToFloat(uint16_t h) { return fromBits(uint32_t(h) << 16); }

uint16_t floatToHalf(float f) {
  uint32_t x = bits(f), sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
  if (a >= 0x7f800000) return uint16_t(sign | 0x7c00 | (a > 0x7f800000 ? 0x200 : 0));
  if (a >= 0x477ff000) return uint16_t(sign | 0x7c00);  // >= 65520 rounds to infinity
  if (a < 0x38800000)                                   // below 2^-14: subnormal half
    return uint16_t(sign | uint32_t(std::lrint(fromBits(a) * 16777216.0f)));
  uint32_t r = a - 0x38000000;  // rebias the exponent from 127 to 15
  r += 0xfff + ((r >> 13) & 1);
  return uint16_t(sign | (r >> 13));
}

float halfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return fromBits(sign | bits(float(m) * (1.0f / 16777216.0f)));
  if (e == 31) return fromBits(sign | 0x7f800000 | (m << 13));
  return fromBits(sign | ((e + 112) << 23) | (m << 13));
}

GradSync::GradSync(loomComm_t comm, int rank, int nranks, const Layout& L, const SyncConfig& cfg,
                   float* grads)
    : comm_(comm), rank_(rank), nranks_(nranks), L_(L), cfg_(cfg), grads_(grads), shards_(L, rank, nranks) {
  TRAINER_CHECK_LOOM(loomStreamCreate(&stream_));
  size_t nb = L.buckets.size();
  pending_.resize(nb);
  launched_.resize(nb);
  slotOf_.assign(nb, -1);
  if (cfg.zero >= 2) {
    TRAINER_CHECK_LOOM(loomStreamCreate(&stream1_));
    size_t maxLen = 0;
    for (const Bucket& b : L.buckets) maxLen = std::max(maxLen, b.len);
    gradShards_.assign(shards_.total(), 0.0f);
    staging_[0].reset(new LoomFloats(maxLen, cfg.loomBuffers, "ZeRO-2/3 gradient staging"));
    staging_[1].reset(new LoomFloats(maxLen, cfg.loomBuffers, "ZeRO-2/3 gradient staging"));
  }
  if (cfg.hook == Hook::Bf16 || cfg.hook == Hook::Fp16) half_.resize(L.total);
  if (cfg.hook == Hook::TopK) {
    residual_.assign(L.total, 0.0f);
    size_t s = 0, r = 0, maxLen = 0;
    for (const Bucket& b : L.buckets) {
      size_t k = std::max<size_t>(1, size_t(std::ceil(cfg.topkRatio * double(b.len))));
      k = std::min(k, b.len);
      k_.push_back(k);
      sendOff_.push_back(s);
      recvOff_.push_back(r);
      s += 2 * k;
      r += 2 * k * size_t(nranks);
      maxLen = std::max(maxLen, b.len);
    }
    send_.resize(s);
    recv_.resize(r);
    order_.resize(maxLen);
  }
  if (cfg.hook == Hook::PowerSgd) powerSgd_.reset(new PowerSgd(L, cfg.powersgdRank));
}

GradSync::~GradSync() {
  loomStreamDestroy(stream_);
  loomStreamDestroy(stream1_);
}

void GradSync::zeroGrads() {
  if (cfg_.zero >= 2)
    std::fill(gradShards_.begin(), gradShards_.end(), 0.0f);
  else
    std::fill(grads_, grads_ + L_.total, 0.0f);
}

float* GradSync::layerGrads(int l) {
  const Layer& ly = L_.layers[l];
  if (cfg_.zero < 2) return grads_ + ly.w;
  int b = L_.bucketOf[l];
  if (slotOf_[b] < 0) {  // the bucket's first layer in backward: give it a staging buffer
    int s = nextSlot_;
    nextSlot_ ^= 1;
    if (slotBucket_[s] >= 0) retire(s);
    std::fill(staging_[s]->data(), staging_[s]->data() + L_.buckets[b].len, 0.0f);
    slotBucket_[s] = b;
    slotOf_[b] = s;
  }
  return staging_[slotOf_[b]]->data() + (ly.w - L_.buckets[b].off);
}

void GradSync::retire(int s) {
  int b = slotBucket_[s];
  // --no-overlap: a bucket of this pass is issued when its buffer is needed.
  if (slotOf_[b] == s && !launched_[b]) launch(b);
  double t0 = now();
  TRAINER_CHECK_LOOM(loomStreamSynchronize(s ? stream1_ : stream_));
  blocked_ += now() - t0;
  const float* part = staging_[s]->data() + size_t(rank_) * shards_.len(size_t(b));
  float* acc = gradShards_.data() + shards_.packedOff(size_t(b));
  for (size_t i = 0; i < shards_.len(size_t(b)); ++i) acc[i] += part[i];
  slotBucket_[s] = -1;
}

const float* GradSync::shardGrads(size_t b) const {
  return cfg_.zero >= 2 ? gradShards_.data() + shards_.packedOff(b) : grads_ + shards_.flatOff(b);
}

size_t GradSync::bufferBytes() const {
  return half_.size() * 2 + residual_.size() * 4 + (send_.size() + recv_.size()) * 4 + order_.size() * 4 +
         (powerSgd_ ? powerSgd_->bufferBytes() : 0);
}

size_t GradSync::wireFloats() const {
  switch (cfg_.hook) {
    case Hook::Bf16:
    case Hook::Fp16:
      return L_.total / 2;
    case Hook::TopK:
      return send_.size();
    case Hook::PowerSgd:
      return powerSgd_->wireFloats();
    default:
      return L_.total;
  }
}

void GradSync::beginSyncPass() {
  std::fill(pending_.begin(), pending_.end(), 0);
  std::fill(launched_.begin(), launched_.end(), 0);
  std::fill(slotOf_.begin(), slotOf_.end(), -1);
  for (size_t l = 0; l < L_.layers.size(); ++l) ++pending_[L_.bucketOf[l]];
}

void GradSync::layerReady(int l) {
  int b = L_.bucketOf[l];
  if (--pending_[b] == 0 && cfg_.overlap) launch(b);
}

void GradSync::endBackward() {
  for (size_t b = 0; b < L_.buckets.size(); ++b)
    if (!launched_[b]) launch(int(b));
}

// Runs on the compute thread: the hook's preparation (compression,
// selection) is compute; the collective it issues runs on the stream.
void GradSync::launch(int bi) {
  const Bucket& b = L_.buckets[bi];
  launched_[bi] = 1;
  size_t shard = shards_.len(size_t(bi));
  if (cfg_.zero >= 2) {
    int s = slotOf_[bi];
    float* g = staging_[s]->data();
    TRAINER_CHECK_LOOM(loomReduceScatter(g, g + size_t(rank_) * shard, shard, loomFloat32, loomAvg, comm_,
                                         s ? stream1_ : stream_));
    return;
  }
  float* g = grads_ + b.off;
  if (cfg_.zero == 1) {
    TRAINER_CHECK_LOOM(loomReduceScatter(g, grads_ + shards_.flatOff(size_t(bi)), shard, loomFloat32, loomAvg,
                                         comm_, stream_));
    return;
  }
  switch (cfg_.hook) {
    case Hook::AllReduce:
      TRAINER_CHECK_LOOM(loomAllReduce(g, g, b.len, loomFloat32, loomAvg, comm_, stream_));
      break;
    case Hook::Bf16:
    case Hook::Fp16: {
      // Pre-divide so that the 16-bit sum cannot overflow where the average would not.
      float inv = 1.0f / float(nranks_);
      uint16_t* h = half_.data() + b.off;
      bool bf = cfg_.hook == Hook::Bf16;
      for (size_t i = 0; i < b.len; ++i) h[i] = bf ? floatToBf16(g[i] * inv) : floatToHalf(g[i] * inv);
      TRAINER_CHECK_LOOM(
          loomAllReduce(h, h, b.len, bf ? loomBfloat16 : loomFloat16, loomSum, comm_, stream_));
      break;
    }
    case Hook::TopK: {
      float* res = residual_.data() + b.off;
      for (size_t i = 0; i < b.len; ++i) res[i] += g[i];
      size_t k = k_[bi];
      uint32_t* ord = order_.data();
      for (size_t i = 0; i < b.len; ++i) ord[i] = uint32_t(i);
      // A total order (magnitude, then index) makes the chosen set unique.
      std::nth_element(ord, ord + (k - 1), ord + b.len, [res](uint32_t x, uint32_t y) {
        float ax = std::fabs(res[x]), ay = std::fabs(res[y]);
        return ax > ay || (ax == ay && x < y);
      });
      int32_t* s = send_.data() + sendOff_[bi];
      for (size_t i = 0; i < k; ++i) {
        s[2 * i] = int32_t(ord[i]);
        s[2 * i + 1] = int32_t(bits(res[ord[i]]));
        res[ord[i]] = 0.0f;  // sent: no longer owed
      }
      TRAINER_CHECK_LOOM(loomAllGather(s, recv_.data() + recvOff_[bi], 2 * k, loomInt32, comm_, stream_));
      break;
    }
    case Hook::PowerSgd: {
      size_t n = 0;
      float* msg = powerSgd_->first(size_t(bi), g, &n);
      TRAINER_CHECK_LOOM(loomAllReduce(msg, msg, n, loomFloat32, loomAvg, comm_, stream_));
      break;
    }
  }
}

void GradSync::finish(int bi) {
  if (cfg_.zero || cfg_.hook == Hook::AllReduce) return;
  const Bucket& b = L_.buckets[bi];
  float* g = grads_ + b.off;
  if (cfg_.hook == Hook::Bf16 || cfg_.hook == Hook::Fp16) {
    const uint16_t* h = half_.data() + b.off;
    bool bf = cfg_.hook == Hook::Bf16;
    for (size_t i = 0; i < b.len; ++i) g[i] = bf ? bf16ToFloat(h[i]) : halfToFloat(h[i]);
    return;
  }
  if (cfg_.hook == Hook::PowerSgd) {  // the second all-reduce needs the first's result: blocking
    size_t n = 0;
    float* msg = powerSgd_->second(size_t(bi), &n);
    double t0 = now();
    TRAINER_CHECK_LOOM(loomAllReduce(msg, msg, n, loomFloat32, loomAvg, comm_, nullptr));
    blocked_ += now() - t0;
    powerSgd_->finish(size_t(bi), g);
    return;
  }
  std::fill(g, g + b.len, 0.0f);
  size_t k = k_[bi];
  const int32_t* r = recv_.data() + recvOff_[bi];
  for (size_t i = 0; i < k * size_t(nranks_); ++i) {
    uint32_t idx = uint32_t(r[2 * i]);
    if (idx >= b.len) trainerFail("top-k: a peer sent an index outside the bucket");
    g[idx] += fromBits(uint32_t(r[2 * i + 1]));
  }
  float inv = 1.0f / float(nranks_);
  for (size_t i = 0; i < b.len; ++i) g[i] *= inv;
}

double GradSync::wait() {
  if (cfg_.zero >= 2) {
    for (int s : {nextSlot_, nextSlot_ ^ 1})  // the older bucket first
      if (slotBucket_[s] >= 0) retire(s);
  } else {
    double t0 = now();
    TRAINER_CHECK_LOOM(loomStreamSynchronize(stream_));
    blocked_ += now() - t0;
    for (size_t b = 0; b < L_.buckets.size(); ++b) finish(int(b));
  }
  double waited = blocked_;
  blocked_ = 0;
  return waited;
}

double GradSync::gatherParams(float* params) {
  double t0 = now();
  for (size_t b = 0; b < L_.buckets.size(); ++b)
    TRAINER_CHECK_LOOM(loomAllGather(params + shards_.flatOff(b), params + L_.buckets[b].off, shards_.len(b),
                                     loomFloat32, comm_, stream_));
  TRAINER_CHECK_LOOM(loomStreamSynchronize(stream_));
  return now() - t0;
}

std::vector<float>& GradSync::residual() { return powerSgd_ ? powerSgd_->residual() : residual_; }

std::vector<float>* GradSync::warmStart() { return powerSgd_ ? &powerSgd_->warmStart() : nullptr; }

}  // namespace trainer
