// Tests of the reference trainer.  Unit tests check the model's pieces in
// this process; the others run loom-trainer on real ranks through loom-run
// and compare what it prints and the parameters it saves.
#include <unistd.h>

#include "loom_catch.h"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "trainer/checkpoint.h"
#include "trainer/grad_sync.h"
#include "trainer/mlp.h"
#include "trainer/powersgd.h"

using namespace trainer;

namespace {

std::string bin() { return LOOM_BIN_DIR; }

std::string tmpPath(const std::string& name) {
  return "/tmp/loom-trainer-test-" + std::to_string(getpid()) + "-" + name;
}

struct Run {
  int code = -1;
  std::string out;
};

// Runs loom-trainer on n ranks; returns the exit status and everything printed.
Run runTrainer(int n, const std::string& args, const std::string& launcherFlags = "") {
  std::string log = tmpPath("log");
  std::string cmd = bin() + "/loom-run -n " + std::to_string(n) + " --timeout 300 " + launcherFlags + " -- " + bin() +
                    "/loom-trainer " + args + " > " + log + " 2>&1";
  Run r;
  int st = std::system(cmd.c_str());
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  r.out = ss.str();
  std::remove(log.c_str());
  return r;
}

std::vector<float> readFloats(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

// A value from the "summary:" line, e.g. summaryValue(out, "test_accuracy").
double summaryValue(const std::string& out, const std::string& key) {
  size_t s = out.find("summary:");
  REQUIRE(s != std::string::npos);
  size_t k = out.find(" " + key + "=", s);
  REQUIRE(k != std::string::npos);
  return std::atof(out.c_str() + k + key.size() + 2);
}

double maxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, double(std::fabs(a[i] - b[i])));
  return d;
}

// Small model, three buckets (one per layer), 30 steps of 48 samples.
const std::string kSmall =
    "--hidden 64,32 --steps 30 --global-batch 48 --first-bucket-mb 0.001 --bucket-mb 0.01 "
    "--log-every 1000 --no-eval";

// Float32 reduction tolerance.  N ranks sum the same per-sample gradients in a
// different order than 1 rank (per-rank partial sums, then the all-reduce), so
// each gradient differs in its last bits (relative ~N x 2^-24 of the terms);
// 30 steps of lr <= 0.05 carry that into the parameters (|p| < 1).  Measured:
// at most 4e-8.  1e-5 is ~170 ulps at |p| = 1: far above rounding, and far
// below what a real error (a missing average, a lost bucket, a rank training
// on other data) moves a parameter by (1e-3 and more).
const double kTolerance = 1e-5;

std::vector<float> trainAndSave(int n, const std::string& args, const std::string& name) {
  std::string p = tmpPath(name);
  Run r = runTrainer(n, kSmall + " " + args + " --save-params " + p);
  INFO(r.out);
  REQUIRE(r.code == 0);
  std::vector<float> v = readFloats(p);
  std::remove(p.c_str());
  return v;
}

}  // namespace

TEST_CASE("layout: buckets take whole layers from the last, the first is small, shards align") {
  // Layer bytes: 0: 784x256 (~0.8 MB), 1: 256x256 (~0.26 MB), 2: 256x10 (~10 KB).
  Layout L = planLayout({784, 256, 256, 10}, 20000, 1100000, 16 * 3);
  REQUIRE(L.buckets.size() == 2);
  CHECK(L.buckets[0].first == 2);
  CHECK(L.buckets[0].last == 2);
  CHECK(L.buckets[1].first == 0);
  CHECK(L.buckets[1].last == 1);
  CHECK(L.bucketOf == std::vector<int>{1, 1, 0});
  size_t off = 0;
  for (const Bucket& b : L.buckets) {
    CHECK(b.off == off);
    CHECK(b.len % 48 == 0);
    off += b.len;
  }
  CHECK(L.total == off);
  for (const Layer& l : L.layers) {
    const Bucket& b = L.buckets[L.bucketOf[&l - L.layers.data()]];
    CHECK(l.w >= b.off);
    CHECK(l.b + l.out <= b.off + b.len);
    CHECK(l.w % 16 == 0);
  }
  // Logical order round-trips through the padded layout.
  std::vector<float> logical(L.logical), flat(L.total, -1.0f), back(L.logical);
  for (size_t i = 0; i < logical.size(); ++i) logical[i] = float(i);
  fromLogical(L, logical.data(), flat.data());
  toLogical(L, flat.data(), back.data());
  CHECK(back == logical);
}

TEST_CASE("kernels: the three matrix products match a double-precision reference") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  const int B = 5, in = 37, out = 21;
  std::vector<float> x(B * in), W(in * out), b(out), dy(B * out);
  for (auto* v : {&x, &W, &b, &dy})
    for (float& f : *v) f = u(rng);
  x[3] = 0.0f;  // the kernels skip zero inputs
  std::vector<float> y(B * out), dx(B * in), dW(in * out, 0.5f), db(out, 0.25f);
  gemmForward(B, in, out, x.data(), W.data(), b.data(), y.data());
  gemmBackwardData(B, in, out, dy.data(), W.data(), dx.data());
  gemmBackwardWeights(B, in, out, x.data(), dy.data(), dW.data(), db.data());
  for (int r = 0; r < B; ++r)
    for (int j = 0; j < out; ++j) {
      double s = b[j];
      for (int i = 0; i < in; ++i) s += double(x[r * in + i]) * W[i * out + j];
      CHECK(y[r * out + j] == Approx(s).margin(1e-5));
    }
  for (int r = 0; r < B; ++r)
    for (int i = 0; i < in; ++i) {
      double s = 0;
      for (int j = 0; j < out; ++j) s += double(dy[r * out + j]) * W[i * out + j];
      CHECK(dx[r * in + i] == Approx(s).margin(1e-5));
    }
  for (int i = 0; i < in; ++i)
    for (int j = 0; j < out; ++j) {
      double s = 0.5;
      for (int r = 0; r < B; ++r) s += double(x[r * in + i]) * dy[r * out + j];
      CHECK(dW[i * out + j] == Approx(s).margin(1e-5));
    }
  for (int j = 0; j < out; ++j) {
    double s = 0.25;
    for (int r = 0; r < B; ++r) s += dy[r * out + j];
    CHECK(db[j] == Approx(s).margin(1e-5));
  }
}

TEST_CASE("model: backward matches finite differences and reports layers last to first") {
  Layout L = planLayout({6, 9, 7, 4}, 1 << 20, 1 << 20, 16);
  std::vector<float> p(L.total), g(L.total, 0.0f);
  initParams(L, 3, p.data());
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const Layer& l : L.layers)
    for (int j = 0; j < l.out; ++j) p[l.b + j] = 0.1f * u(rng);
  const int B = 3;
  std::vector<float> x(B * 6);
  for (float& f : x) f = u(rng);
  std::vector<uint8_t> y = {0, 3, 1};
  Mlp m(L, B);
  m.forward(p.data(), x.data(), y.data(), B, nullptr);
  std::vector<int> order;
  m.backward(p.data(), g.data(), y.data(), B, 1.0f, [&](int l) { order.push_back(l); });
  CHECK(order == std::vector<int>{2, 1, 0});
  for (const Layer& l : L.layers)
    for (size_t i : {l.w, l.w + 5, l.w + size_t(l.in * l.out) - 1, l.b, l.b + size_t(l.out) - 1}) {
      const float h = 1e-3f;
      float keep = p[i];
      p[i] = keep + h;
      double up = m.forward(p.data(), x.data(), y.data(), B, nullptr);
      p[i] = keep - h;
      double down = m.forward(p.data(), x.data(), y.data(), B, nullptr);
      p[i] = keep;
      CHECK(g[i] == Approx((up - down) / (2 * h)).margin(2e-3).epsilon(2e-2));
    }
}

TEST_CASE("hooks: bfloat16 and float16 conversions round to nearest even") {
  CHECK(floatToBf16(1.0f) == 0x3f80);
  CHECK(floatToBf16(1.0f + 1.0f / 256) == 0x3f80);  // tie, even stays
  CHECK(floatToBf16(1.0f + 3.0f / 256) == 0x3f82);  // tie, odd rounds up
  CHECK(bf16ToFloat(floatToBf16(-2.5f)) == -2.5f);
  CHECK(std::isnan(bf16ToFloat(floatToBf16(NAN))));
  CHECK(floatToHalf(1.0f) == 0x3c00);
  CHECK(floatToHalf(1.0f + 1.0f / 2048) == 0x3c00);  // tie, even stays
  CHECK(floatToHalf(1.0f + 3.0f / 2048) == 0x3c02);  // tie, odd rounds up
  CHECK(floatToHalf(65504.0f) == 0x7bff);
  CHECK(floatToHalf(65519.0f) == 0x7bff);
  CHECK(floatToHalf(65520.0f) == 0x7c00);       // rounds to infinity
  CHECK(floatToHalf(-1e-8f) == 0x8000);         // below half the smallest subnormal
  CHECK(floatToHalf(5.9604645e-8f) == 0x0001);  // smallest subnormal
  CHECK(floatToHalf(6.1035156e-5f) == 0x0400);  // smallest normal
  CHECK(std::isnan(halfToFloat(floatToHalf(NAN))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaNs
    REQUIRE(floatToHalf(halfToFloat(uint16_t(h))) == h);
  }
}

TEST_CASE("powersgd: a low-rank gradient passes exactly, and what is not sent stays in the residual") {
  // One layer 40 x 30 (compressed at rank 2: 140 floats instead of 1200) and
  // one 30 x 2 (rank 2 at most: sent whole).  One rank: the all-reduces
  // are identities, so first/second/finish run back to back.
  Layout L = planLayout({40, 30, 2}, 1 << 20, 1 << 20, 16);
  REQUIRE(L.buckets.size() == 1);
  PowerSgd p(L, 2);
  CHECK(p.wireFloats() == (40 + 30) * 2 + 30 + 30 * 2 + 2);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  const Layer& l0 = L.layers[0];
  std::vector<float> g(L.total, 0.0f), a(40), b(30);
  for (float& f : a) f = u(rng);
  for (float& f : b) f = u(rng);
  for (size_t i = 0; i < 40; ++i)  // rank 1: a b^T
    for (size_t j = 0; j < 30; ++j) g[l0.w + i * 30 + j] = a[i] * b[j];
  for (size_t i = l0.b; i < l0.b + 30; ++i) g[i] = u(rng);
  for (size_t i = L.layers[1].w; i < L.layers[1].b + 2; ++i) g[i] = u(rng);
  std::vector<float> sent = g;
  size_t n = 0;
  p.first(0, g.data(), &n);
  p.second(0, &n);
  p.finish(0, g.data());
  double worst = 0;
  for (size_t i = 0; i < L.total; ++i) worst = std::max(worst, double(std::fabs(g[i] - sent[i])));
  CHECK(worst < 1e-5);
  // A full-rank gradient is approximated; gradient + residual is what was owed.
  for (size_t i = l0.w; i < l0.w + 1200; ++i) g[i] = sent[i] = u(rng);
  p.residual().assign(L.total, 0.0f);
  p.first(0, g.data(), &n);
  p.second(0, &n);
  p.finish(0, g.data());
  double lost = 0, kept = 0;
  for (size_t i = l0.w; i < l0.w + 1200; ++i) {
    worst = std::max(worst, double(std::fabs(g[i] + p.residual()[i] - sent[i])));
    lost += double(p.residual()[i]) * p.residual()[i];
    kept += double(sent[i]) * sent[i];
  }
  CHECK(worst < 1e-5);
  CHECK(lost > 0.5 * kept);  // rank 2 of a random 40 x 30 matrix misses most of it
  CHECK(lost < kept);
}

TEST_CASE("equivalence: plain data parallel on 2 and 3 ranks gives 1 rank's parameters") {
  for (const char* opt : {"sgd", "adam"}) {
    std::string a = std::string("--optimizer ") + opt;
    std::vector<float> one = trainAndSave(1, a, "one");
    for (int n : {2, 3}) {
      INFO(opt << " on " << n << " ranks");
      CHECK(maxAbsDiff(trainAndSave(n, a, "n"), one) <= kTolerance);
    }
    // Without overlap the same buckets go out after backward: same result.
    CHECK(maxAbsDiff(trainAndSave(2, a + " --no-overlap", "n"), one) <= kTolerance);
  }
}

TEST_CASE("equivalence: gradient accumulation on N ranks gives 1 rank's parameters") {
  std::vector<float> one = trainAndSave(1, "", "one");
  CHECK(maxAbsDiff(trainAndSave(1, "--accum 3", "a"), one) <= kTolerance);
  CHECK(maxAbsDiff(trainAndSave(2, "--accum 2", "a"), one) <= kTolerance);
  CHECK(maxAbsDiff(trainAndSave(3, "--accum 2 --optimizer sgd", "a"), one) <= kTolerance);
}

TEST_CASE("equivalence: every ZeRO stage with SGD and Adam on 1-4 ranks gives 1 rank's parameters") {
  for (const char* opt : {"sgd", "adam"}) {
    std::string a = std::string("--optimizer ") + opt;
    std::vector<float> one = trainAndSave(1, a, "one");
    for (int stage : {0, 1, 2, 3}) {
      std::string z = a + " --zero " + std::to_string(stage);
      // One rank sharding over itself does the same arithmetic: bit-identical.
      INFO(opt << " --zero " << stage << " on 1 rank");
      CHECK(maxAbsDiff(trainAndSave(1, z, "z"), one) == 0.0);
      for (int n : {2, 3, 4}) {
        INFO(opt << " --zero " << stage << " on " << n << " ranks");
        CHECK(maxAbsDiff(trainAndSave(n, z, "z"), one) <= kTolerance);
      }
    }
    // Accumulation: stage 1 reduce-scatters once per step, stages 2 and 3
    // every micro-batch into the gradient shards.
    for (int stage : {1, 2, 3}) {
      INFO(opt << " --zero " << stage << " --accum 2 on 3 ranks");
      CHECK(maxAbsDiff(trainAndSave(3, a + " --zero " + std::to_string(stage) + " --accum 2", "z"), one) <=
            kTolerance);
    }
  }
}

TEST_CASE("equivalence: ZeRO-3 prefetch and ZeRO-2 overlap change timing, not results") {
  std::string a = "--optimizer adam --zero 3";
  CHECK(maxAbsDiff(trainAndSave(2, a, "p"), trainAndSave(2, a + " --no-prefetch", "np")) == 0.0);
  a = "--optimizer adam --zero 2";
  CHECK(maxAbsDiff(trainAndSave(2, a, "o"), trainAndSave(2, a + " --no-overlap", "no")) == 0.0);
}

TEST_CASE("memory: ZeRO-2 keeps 1/N of the gradients, ZeRO-3 1/N of the model state plus a few layers") {
  // 16 hidden layers of 512 (the largest 784 x 512 + 512 floats, 1.6 MB), 4 ranks.
  const std::string m = "--hidden 512x16 --steps 3 --global-batch 16 --no-eval --optimizer adam --zero ";
  Run r0 = runTrainer(4, m + "0"), r2 = runTrainer(4, m + "2 --bucket-mb 1"), r3 = runTrainer(4, m + "3");
  INFO(r0.out << r2.out << r3.out);
  REQUIRE(r0.code == 0);
  REQUIRE(r2.code == 0);
  REQUIRE(r3.code == 0);
  const double largest = (784.0 * 512 + 512) * 4 / 1e6;
  double params0 = summaryValue(r0.out, "params_mb"), grads0 = summaryValue(r0.out, "grads_mb");
  double state0 = summaryValue(r0.out, "model_state_mb");
  // Stage 2: the gradient shards (1/4, padding aside) and two staging buffers
  // of the largest bucket (with 1 MB buckets: the largest layer).
  CHECK(summaryValue(r2.out, "grads_mb") <= grads0 / 4 + 2 * largest + 0.01);
  CHECK(summaryValue(r2.out, "grads_mb") < grads0 / 2);
  CHECK(summaryValue(r2.out, "params_mb") == params0);
  // Stage 3: parameters, gradients and Adam state at 1/4, plus two gathered
  // and two gradient staging buffers of the largest layer.
  CHECK(summaryValue(r3.out, "params_mb") <= params0 / 4 + 0.01);
  CHECK(summaryValue(r3.out, "gathered_mb") <= 2 * largest + 0.01);
  CHECK(summaryValue(r3.out, "model_state_mb") <= state0 / 4 + 4 * largest + 0.05);
  CHECK(summaryValue(r3.out, "model_state_mb") < state0 / 2);
  // What the process holds follows: less resident memory than stage 0.
  CHECK(summaryValue(r3.out, "rss_mb") < summaryValue(r0.out, "rss_mb"));
}

TEST_CASE("equivalence: another seed does not match (the check has teeth)") {
  std::vector<float> one = trainAndSave(1, "", "one");
  CHECK(maxAbsDiff(trainAndSave(2, "--seed 2", "s"), one) > 1e-3);
}

// One epoch of a 784-128-10 MLP with global batch 256 on 2 ranks (234 steps).
const std::string kEpoch = "--hidden 128 --epochs 1 --log-every 1000";

TEST_CASE(
    "fashion-mnist: one epoch on 2 ranks gets past 80% test accuracy, ZeRO-3 within 0.5 points, the hooks "
    "close") {
  Run plain = runTrainer(2, kEpoch);
  INFO(plain.out);
  REQUIRE(plain.code == 0);
  // The install script installs dataset-fashion-mnist: without it this fails.
  REQUIRE(plain.out.find("dataset=fashion-mnist") != std::string::npos);
  double base = summaryValue(plain.out, "test_accuracy");
  CHECK(base > 80.0);
  Run z3 = runTrainer(2, kEpoch + " --zero 3");
  INFO("zero 3: " << z3.out);
  REQUIRE(z3.code == 0);
  CHECK(std::fabs(summaryValue(z3.out, "test_accuracy") - base) <= 0.5);
  for (const char* hook : {"bf16", "fp16", "topk", "powersgd"}) {
    Run r = runTrainer(2, kEpoch + " --hook " + hook);
    INFO(hook << ": " << r.out);
    REQUIRE(r.code == 0);
    double acc = summaryValue(r.out, "test_accuracy");
    CHECK(acc > 80.0);
    CHECK(acc > base - 3.0);
  }
}

TEST_CASE("synthetic data: used when the IDX files are absent, and said so") {
  Run r = runTrainer(2, "--data /nonexistent-dir --hidden 32 --steps 40 --log-every 1000");
  INFO(r.out);
  REQUIRE(r.code == 0);
  CHECK(r.out.find("dataset synthetic (no Fashion-MNIST IDX files in /nonexistent-dir)") !=
        std::string::npos);
  CHECK(summaryValue(r.out, "test_accuracy") > 50.0);  // learnable: chance is 10%
}

TEST_CASE("checkpoint: a resumed run follows the uninterrupted trajectory exactly") {
  std::string ck = tmpPath("ckpt");
  for (const char* a : {"--optimizer sgd", "--optimizer adam --zero", "--optimizer sgd --zero 2",
                        "--optimizer adam --zero 2 --accum 2", "--optimizer sgd --zero 3",
                        "--optimizer adam --zero 3", "--hook topk --topk-ratio 0.05",
                        "--hook powersgd --powersgd-rank 2"}) {
    INFO(a);
    std::string common = std::string(kSmall) + " " + a + " --log-every 10";
    std::string full = tmpPath("full"), res = tmpPath("res");
    Run straight = runTrainer(2, common + " --steps 40 --save-params " + full);
    REQUIRE(straight.code == 0);
    Run first = runTrainer(2, common + " --steps 20 --checkpoint " + ck);
    REQUIRE(first.code == 0);
    Run second = runTrainer(2, common + " --steps 40 --resume " + ck + " --save-params " + res);
    INFO(second.out);
    REQUIRE(second.code == 0);
    CHECK(second.out.find("from step 20") != std::string::npos);
    CHECK(readFloats(full) == readFloats(res));
    // The progress line of step 40 (loss and accuracy) is the same too.
    auto line = [](const std::string& out) {
      size_t p = out.find("step 40/40");
      return out.substr(p, out.find("samples/s", p) - p);
    };
    CHECK(line(straight.out) == line(second.out));
    std::remove(full.c_str());
    std::remove(res.c_str());
  }
  // A sharded checkpoint from 2 ranks resumes on 3 (the state is saved
  // whole), and one of ZeRO-3 at stage 1.
  for (const char* z : {"--zero", "--zero 3"}) {
    INFO(z);
    std::string common = std::string(kSmall) + " --optimizer adam " + z;
    std::string full = tmpPath("full"), res = tmpPath("res");
    REQUIRE(runTrainer(2, common + " --steps 40 --save-params " + full).code == 0);
    REQUIRE(runTrainer(2, common + " --steps 20 --checkpoint " + ck).code == 0);
    REQUIRE(runTrainer(3, common + " --steps 40 --resume " + ck + " --save-params " + res).code == 0);
    CHECK(maxAbsDiff(readFloats(full), readFloats(res)) <= kTolerance);
    std::string other = std::string(kSmall) + " --optimizer adam --zero 1";
    REQUIRE(runTrainer(2, other + " --steps 40 --resume " + ck + " --save-params " + res).code == 0);
    CHECK(maxAbsDiff(readFloats(full), readFloats(res)) <= kTolerance);
    for (const std::string& p : {ck, full, res}) std::remove(p.c_str());
  }
}

TEST_CASE("elastic: 4 ranks with one killed mid-epoch finish on 3 at the undisturbed run's test accuracy") {
  // Fashion-MNIST (or the synthetic set where it is absent), 300 steps of 48.
  const std::string common = "--hidden 64 --global-batch 48 --steps 300 --log-every 50 --elastic";
  Run whole = runTrainer(4, common, "--keep-going");
  INFO(whole.out);
  REQUIRE(whole.code == 0);
  double want = summaryValue(whole.out, "test_accuracy");
  Run cut = runTrainer(4, common + " --kill-rank 2 --kill-at-step 120", "--keep-going");
  INFO(cut.out);
  REQUIRE(cut.code == 0);
  CHECK(cut.out.find("rank 2 killed by signal 9") != std::string::npos);
  CHECK(cut.out.find("elastic: lost 1 of 4 ranks; continuing on 3") != std::string::npos);
  CHECK(summaryValue(cut.out, "ranks") == 3);
  double got = summaryValue(cut.out, "test_accuracy");
  CHECK(want > 50);  // it learned something
  CHECK(std::fabs(got - want) <= 1.0);
  // The global batch is the same samples on 3 ranks: the last window's loss
  // matches the undisturbed run's up to summation order.
  CHECK(std::fabs(summaryValue(cut.out, "last_window_loss") - summaryValue(whole.out, "last_window_loss")) < 0.01);
  // Without --keep-going the launcher stops the job, as before.
  Run stopped = runTrainer(4, common + " --kill-rank 2 --kill-at-step 120");
  CHECK(stopped.code != 0);
  Run bad = runTrainer(1, "--elastic --hook topk");
  CHECK(bad.code != 0);
  CHECK(bad.out.find("--elastic does not combine with the topk and powersgd hooks") != std::string::npos);
}

// The step an elastic run continued from ("... from step T, rebuilt from ...").
static long continuedFrom(const std::string& out) {
  size_t at = out.find(" from step ", std::min(out.size(), out.find("elastic: lost")));
  return at == std::string::npos ? -1 : std::atol(out.c_str() + at + 11);
}

TEST_CASE("elastic with ZeRO: a dead rank's shards are rebuilt from its neighbour's copy, exactly") {
  // Every stage, Adam (two state arrays), a different victim each time
  // (rank 0: its copy is on rank 3, the ring's wrap).  The state the
  // survivors rebuild equals, bit for bit, the checkpoint an undisturbed
  // 4-rank run writes at the same step.
  const std::string common = "--hidden 64,32 --global-batch 48 --steps 100 --log-every 50 --optimizer adam --no-eval";
  for (int zero = 0; zero <= 3; ++zero) {
    INFO("--zero " << zero);
    std::string dump = tmpPath("dump"), ck = tmpPath("ck");
    std::string args = common + " --zero " + std::to_string(zero);
    Run cut = runTrainer(4, args + " --elastic --kill-rank " + std::to_string(zero) + " --kill-at-step 30 --elastic-dump " + dump,
                         "--keep-going");
    INFO(cut.out);
    REQUIRE(cut.code == 0);
    CHECK(cut.out.find("elastic: lost 1 of 4 ranks; continuing on 3") != std::string::npos);
    CHECK(cut.out.find("rebuilt from the survivors' copies") != std::string::npos);
    CHECK(summaryValue(cut.out, "ranks") == 3);
    long step = continuedFrom(cut.out);
    REQUIRE(step >= 30);
    Run whole = runTrainer(4, args + " --steps " + std::to_string(step) + " --checkpoint " + ck);
    INFO(whole.out);
    REQUIRE(whole.code == 0);
    trainer::Checkpoint a, b;
    std::string err;
    REQUIRE(trainer::readCheckpoint(ck, &a, &err));
    REQUIRE(trainer::readCheckpoint(dump, &b, &err));
    CHECK(a.nextStep == uint64_t(step));
    CHECK(b.nextStep == uint64_t(step));
    CHECK(a.params == b.params);
    CHECK(a.state == b.state);
    for (const std::string& p : {dump, ck}) std::remove(p.c_str());
  }
}

TEST_CASE("elastic with ZeRO: a lost shard falls back on the last checkpoint, or fails with a clear error") {
  // Ranks 1 and 2 die together: rank 2's shards and their only copy (on rank 1) are gone.
  const std::string common = "--hidden 64 --global-batch 48 --steps 80 --log-every 40 --optimizer adam --zero 1 "
                             "--elastic --kill-rank 1,2 --kill-at-step 30";
  std::string ck = tmpPath("ck");
  Run back = runTrainer(4, common + " --checkpoint " + ck + " --checkpoint-every 20", "--keep-going");
  INFO(back.out);
  REQUIRE(back.code == 0);
  CHECK(back.out.find("elastic: lost 2 of 4 ranks; continuing on 2 from step 20, rebuilt from the last checkpoint") !=
        std::string::npos);
  CHECK(summaryValue(back.out, "ranks") == 2);
  Run none = runTrainer(4, common, "--keep-going");
  INFO(none.out);
  CHECK(none.code != 0);
  CHECK(none.out.find("cannot continue: no step at which the whole state survives; step ") != std::string::npos);
  // (The latest step may lack other ranks' shards too: their copies of that step may not have arrived.)
  CHECK(none.out.find("rank 2's shards (rank 2 and rank 1, which kept their copy, both died)") != std::string::npos);
  CHECK(none.out.find("; no --checkpoint to fall back on") != std::string::npos);
  std::remove(ck.c_str());
}

TEST_CASE("bad input: clear errors, no hang") {
  Run r = runTrainer(2, "--global-batch 7 --steps 1");
  CHECK(r.code != 0);
  CHECK(r.out.find("must be a multiple of ranks (2)") != std::string::npos);
  r = runTrainer(1, "--frobnicate");
  CHECK(r.code != 0);
  CHECK(r.out.find("unknown flag --frobnicate") != std::string::npos);
  r = runTrainer(1, "--zero --hook topk");
  CHECK(r.code != 0);
  CHECK(r.out.find("does not combine") != std::string::npos);
  r = runTrainer(1, "--zero 2 --no-prefetch");
  CHECK(r.code != 0);
  CHECK(r.out.find("--no-prefetch applies to --zero 3 only") != std::string::npos);
  // A data directory with broken IDX files is an error, not a silent fallback.
  std::string dir = tmpPath("data");
  REQUIRE(std::system(("mkdir -p " + dir + " && echo garbage > " + dir +
                       "/train-images-idx3-ubyte && echo garbage > " + dir + "/train-labels-idx1-ubyte")
                          .c_str()) == 0);
  r = runTrainer(1, "--data " + dir + " --steps 1");
  CHECK(r.code != 0);
  CHECK(r.out.find("not an IDX file") != std::string::npos);
  std::system(("rm -rf " + dir).c_str());
  std::string junk = tmpPath("junk");
  REQUIRE(std::system(("echo not-a-checkpoint > " + junk).c_str()) == 0);
  r = runTrainer(2, "--hidden 32 --steps 2 --resume " + junk);
  CHECK(r.code != 0);
  CHECK(r.out.find("not a loom-trainer checkpoint") != std::string::npos);
  std::remove(junk.c_str());
}

TEST_CASE("gradients in loomMemAlloc memory (the default) train like ordinary ones") {
  // A bucket above 1 MiB (the zero-copy vote's floor): 784x512 floats.
  const std::string args = "--synthetic --hidden 512 --global-batch 32 --steps 20 --bucket-mb 4 --first-bucket-mb 2 --no-eval";
  Run shared = runTrainer(2, args);
  INFO(shared.out);
  REQUIRE(shared.code == 0);
  CHECK(summaryValue(shared.out, "shared_grads") == 1);
  Run plain = runTrainer(2, args + " --plain-grads");
  REQUIRE(plain.code == 0);
  CHECK(summaryValue(plain.out, "shared_grads") == 0);
  std::vector<float> a = trainAndSave(2, args, "shared"), b = trainAndSave(2, args + " --plain-grads", "plain");
  REQUIRE(a.size() == b.size());
  CHECK(maxAbsDiff(a, b) <= kTolerance);
}

TEST_CASE("ZeRO-2/3 buffers in loomMemAlloc memory (zero-copy reduce-scatter and all-gather) train like ordinary ones") {
  // Layers above 1 MiB (the zero-copy vote's floor at 2 ranks): 784x512 and
  // 512x512 floats; ZeRO-3 gathers each layer, ZeRO-2 reduce-scatters its
  // buckets, with Adam.
  for (const char* zero : {"--zero 2 --bucket-mb 4", "--zero 3"}) {
    const std::string args = std::string("--synthetic --hidden 512,512 --global-batch 32 --steps 12 --no-eval "
                                         "--optimizer adam ") + zero;
    INFO(args);
    Run shared = runTrainer(2, args);
    INFO(shared.out);
    REQUIRE(shared.code == 0);
    CHECK(summaryValue(shared.out, "shared_grads") == 1);
    CHECK(summaryValue(shared.out, "shared_params") == 1);
    Run plain = runTrainer(2, args + " --plain-buffers");
    REQUIRE(plain.code == 0);
    CHECK(summaryValue(plain.out, "shared_grads") == 0);
    CHECK(summaryValue(plain.out, "shared_params") == 0);
    std::vector<float> a = trainAndSave(2, args, "shared"), b = trainAndSave(2, args + " --plain-buffers", "plain");
    REQUIRE(a.size() == b.size());
    CHECK(maxAbsDiff(a, b) <= kTolerance);
  }
}
