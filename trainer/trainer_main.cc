// loom-trainer: the reference data-parallel trainer.  Trains an MLP on
// Fashion-MNIST with N ranks through loom's public C API only, the way
// PyTorch DDP, Horovod and DeepSpeed ZeRO do it:
//   - rank 0's initial parameters are broadcast to all ranks;
//   - a distributed sampler gives each rank a disjoint slice of every global
//     batch (per-epoch shuffle from a shared seed);
//   - gradient buckets are synchronised while backward runs (grad_sync.h),
//     with gradient accumulation, a sharded optimizer and compression hooks;
//   - linear learning-rate scaling with warm-up; checkpoint and resume.
// Run it with: loom-run -n N loom-trainer [flags]   (loom-trainer -h lists them)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "include/loom.h"
#include "trainer/check.h"
#include "trainer/checkpoint.h"
#include "trainer/dataset.h"
#include "trainer/grad_sync.h"
#include "trainer/mlp.h"
#include "trainer/optimizer.h"

using namespace trainer;

namespace {

const char kUsage[] =
    "usage: loom-run -n N loom-trainer [flags]\n"
    "  --data DIR            Fashion-MNIST IDX files, gzip'd or not\n"
    "                        (default /usr/share/datasets/fashion-mnist; synthetic data if absent)\n"
    "  --synthetic           use the generated dataset even if Fashion-MNIST is present\n"
    "  --hidden W1,W2,...    hidden layer widths (default 1024,1024,1024: 2.9M parameters)\n"
    "  --epochs E            epochs to train (default 1)\n"
    "  --steps S             stop after S optimizer steps in all (overrides --epochs)\n"
    "  --global-batch B      samples per optimizer step over all ranks (default 256)\n"
    "  --accum K             micro-batches per step; gradients synchronise on the last (default 1)\n"
    "  --optimizer sgd|adam  SGD with momentum (default) or Adam\n"
    "  --lr X                base learning rate at --lr-ref-batch (default sgd 0.05, adam 0.001)\n"
    "  --lr-ref-batch R      linear scaling: lr = X * B / R (default 256)\n"
    "  --warmup W            linear warm-up over the first W steps (default 50)\n"
    "  --momentum M          SGD momentum (default 0.9)\n"
    "  --zero                sharded optimizer: reduce-scatter gradients, update this rank's\n"
    "                        shard, all-gather parameters (ZeRO stage 1/2)\n"
    "  --hook H              allreduce (default), bf16, fp16 or topk gradient communication\n"
    "  --topk-ratio F        fraction of each bucket top-k sends (default 0.01)\n"
    "  --bucket-mb M         gradient bucket cap in MB (default 25)\n"
    "  --first-bucket-mb M   cap of the first bucket (default 1)\n"
    "  --no-overlap          issue all buckets after backward instead of during it\n"
    "  --seed S              seed of initialisation and shuffling (default 1)\n"
    "  --log-every N         progress line every N steps (default 50)\n"
    "  --no-eval             skip the test-set evaluation at the end\n"
    "  --checkpoint FILE     rank 0 writes a checkpoint here (every --checkpoint-every steps\n"
    "                        and at the end)\n"
    "  --checkpoint-every N  (default 0: only at the end)\n"
    "  --resume FILE         continue from a checkpoint (readable by every rank)\n"
    "  --save-params FILE    rank 0 writes the final parameters (float32, logical order)\n"
    "  -h, --help            this text\n";

struct Options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  bool synthetic = false;
  std::vector<int> hidden = {1024, 1024, 1024};
  int epochs = 1;
  long steps = 0;
  int globalBatch = 256, accum = 1;
  OptKind optimizer = OptKind::Sgd;
  double lr = -1, lrRefBatch = 256, momentum = 0.9;
  int warmup = 50;
  SyncConfig sync;
  double bucketMb = 25, firstBucketMb = 1;
  uint64_t seed = 1;
  int logEvery = 50;
  bool eval = true;
  std::string checkpoint, resume, saveParams;
  long checkpointEvery = 0;
};

[[noreturn]] void usageError(const std::string& msg) {
  fprintf(stderr, "loom-trainer: %s\n%s", msg.c_str(), kUsage);
  exit(2);
}

double number(const std::string& flag, const char* v, double lo, double hi) {
  char* end = nullptr;
  double x = strtod(v, &end);
  if (!*v || *end || !(x >= lo && x <= hi))
    usageError(flag + " " + v + ": expected a number in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "]");
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usageError(a + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      fputs(kUsage, stdout);
      exit(0);
    } else if (a == "--data")
      o.data = value();
    else if (a == "--synthetic")
      o.synthetic = true;
    else if (a == "--hidden") {
      o.hidden.clear();
      std::string s = value();
      for (size_t p = 0; p <= s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        o.hidden.push_back(int(number(a, s.substr(p, q - p).c_str(), 1, 65536)));
        p = q + 1;
      }
    } else if (a == "--epochs")
      o.epochs = int(number(a, value(), 1, 1e6));
    else if (a == "--steps")
      o.steps = long(number(a, value(), 1, 1e12));
    else if (a == "--global-batch")
      o.globalBatch = int(number(a, value(), 1, 1 << 20));
    else if (a == "--accum")
      o.accum = int(number(a, value(), 1, 1 << 20));
    else if (a == "--optimizer") {
      std::string v = value();
      if (v == "sgd")
        o.optimizer = OptKind::Sgd;
      else if (v == "adam")
        o.optimizer = OptKind::Adam;
      else
        usageError("--optimizer " + v + ": expected sgd or adam");
    } else if (a == "--lr")
      o.lr = number(a, value(), 0, 1e3);
    else if (a == "--lr-ref-batch")
      o.lrRefBatch = number(a, value(), 1, 1e9);
    else if (a == "--warmup")
      o.warmup = int(number(a, value(), 0, 1e9));
    else if (a == "--momentum")
      o.momentum = number(a, value(), 0, 1);
    else if (a == "--zero")
      o.sync.zero = true;
    else if (a == "--hook") {
      std::string v = value();
      if (v == "allreduce")
        o.sync.hook = Hook::AllReduce;
      else if (v == "bf16")
        o.sync.hook = Hook::Bf16;
      else if (v == "fp16")
        o.sync.hook = Hook::Fp16;
      else if (v == "topk")
        o.sync.hook = Hook::TopK;
      else
        usageError("--hook " + v + ": expected allreduce, bf16, fp16 or topk");
    } else if (a == "--topk-ratio")
      o.sync.topkRatio = number(a, value(), 1e-6, 1);
    else if (a == "--bucket-mb")
      o.bucketMb = number(a, value(), 1e-3, 1e5);
    else if (a == "--first-bucket-mb")
      o.firstBucketMb = number(a, value(), 1e-3, 1e5);
    else if (a == "--no-overlap")
      o.sync.overlap = false;
    else if (a == "--seed")
      o.seed = uint64_t(number(a, value(), 0, 1e15));
    else if (a == "--log-every")
      o.logEvery = int(number(a, value(), 1, 1e9));
    else if (a == "--no-eval")
      o.eval = false;
    else if (a == "--checkpoint")
      o.checkpoint = value();
    else if (a == "--checkpoint-every")
      o.checkpointEvery = long(number(a, value(), 0, 1e12));
    else if (a == "--resume")
      o.resume = value();
    else if (a == "--save-params")
      o.saveParams = value();
    else
      usageError("unknown flag " + a);
  }
  if (o.lr < 0) o.lr = o.optimizer == OptKind::Adam ? 0.001 : 0.05;
  if (o.sync.zero && o.sync.hook != Hook::AllReduce)
    usageError("--zero reduce-scatters float32 gradients; it does not combine with --hook");
  return o;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double peakRssMb() {
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "VmHWM:", 6) == 0) kb = atof(line + 6);
  fclose(f);
  return kb / 1024.0;
}

const char* hookName(Hook h) {
  switch (h) {
    case Hook::AllReduce:
      return "allreduce";
    case Hook::Bf16:
      return "bf16";
    case Hook::Fp16:
      return "fp16";
    case Hook::TopK:
      return "topk";
  }
  return "?";
}

// Optimizer state: with --zero only this rank's shard of each bucket, packed.
struct OptimizerState {
  std::vector<float> data;
  size_t perArray = 0;            // floats per state array
  std::vector<size_t> bucketOff;  // zero: where bucket b's shard starts in an array
  float* array(int i) { return data.data() + size_t(i) * perArray; }
};

// Full-size (flat layout) copy of state array i, gathered from the shards when sharded.
std::vector<float> fullState(OptimizerState& st, int i, const Layout& L, GradSync& sync, bool zero,
                             loomComm_t comm) {
  std::vector<float> full(L.total, 0.0f);
  if (!zero) {
    std::copy(st.array(i), st.array(i) + L.total, full.begin());
    return full;
  }
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    const Bucket& bk = L.buckets[b];
    std::copy(st.array(i) + st.bucketOff[b], st.array(i) + st.bucketOff[b] + sync.shardLen(bk),
              full.begin() + long(sync.shardOff(bk)));
    TRAINER_CHECK_LOOM(loomAllGather(full.data() + sync.shardOff(bk), full.data() + bk.off, sync.shardLen(bk),
                                     loomFloat32, comm, nullptr));
  }
  return full;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);

  loomComm_t comm;
  bool launched = false;
  for (const char* v : {"LOOM_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    launched |= getenv(v) != nullptr;
  if (launched) {
    TRAINER_CHECK_LOOM(loomCommInitFromEnv(&comm));
  } else {  // started by hand: a communicator of one rank
    loomUniqueId id;
    TRAINER_CHECK_LOOM(loomGetUniqueId(&id));
    TRAINER_CHECK_LOOM(loomCommInitRank(&comm, 1, id, 0));
  }
  int rank = 0, nranks = 1;
  TRAINER_CHECK_LOOM(loomCommUserRank(comm, &rank));
  TRAINER_CHECK_LOOM(loomCommCount(comm, &nranks));
  bool root = rank == 0;

  // Every rank checks the same things and fails the same way, before any collective.
  if (o.globalBatch % (nranks * o.accum) != 0)
    usageError("--global-batch " + std::to_string(o.globalBatch) + " must be a multiple of ranks (" +
               std::to_string(nranks) + ") x --accum (" + std::to_string(o.accum) + ")");
  const int micro = o.globalBatch / (nranks * o.accum);

  Dataset data;
  std::string err;
  if (!loadDataset(o.data, o.synthetic, o.seed, &data, &err)) trainerFail(err.c_str());
  if (size_t(o.globalBatch) > data.trainCount()) usageError("--global-batch is larger than the training set");

  std::vector<int> widths = {data.pixels()};
  widths.insert(widths.end(), o.hidden.begin(), o.hidden.end());
  widths.push_back(data.classes);
  // Buckets are padded to a multiple of 16 floats per rank: equal, aligned shards.
  Layout L = planLayout(widths, size_t(o.firstBucketMb * 1e6), size_t(o.bucketMb * 1e6), 16 * size_t(nranks));

  OptConfig oc;
  oc.kind = o.optimizer;
  oc.momentum = float(o.momentum);
  std::vector<float> params(L.total), grads(L.total, 0.0f);
  GradSync sync(comm, rank, nranks, L, o.sync, grads.data());
  OptimizerState st;
  if (o.sync.zero) {
    for (const Bucket& b : L.buckets) {
      st.bucketOff.push_back(st.perArray);
      st.perArray += sync.shardLen(b);
    }
  } else {
    st.perArray = L.total;
  }
  int nStateArrays = stateArrays(o.optimizer);
  st.data.assign(st.perArray * size_t(nStateArrays), 0.0f);

  // Different seeds per rank on purpose: only the broadcast makes them agree.
  initParams(L, o.seed + uint64_t(rank) * 1000003, params.data());
  uint64_t firstStep = 0;
  if (!o.resume.empty()) {
    Checkpoint c;
    if (!readCheckpoint(o.resume, &c, &err)) trainerFail(err.c_str());
    if (c.widths != widths) trainerFail("--resume: the checkpoint's model has other layer widths");
    if (c.optimizer != int(o.optimizer) || c.hook != int(o.sync.hook))
      trainerFail("--resume: the checkpoint was written with another --optimizer or --hook");
    if (c.params.size() != L.logical || c.state.size() != L.logical * size_t(nStateArrays))
      trainerFail("--resume: the checkpoint's arrays have the wrong sizes");
    fromLogical(L, c.params.data(), params.data());
    std::vector<float> full(L.total, 0.0f);
    for (int i = 0; i < nStateArrays; ++i) {
      fromLogical(L, c.state.data() + size_t(i) * L.logical, full.data());
      if (!o.sync.zero) {
        std::copy(full.begin(), full.end(), st.array(i));
      } else {
        for (size_t b = 0; b < L.buckets.size(); ++b)
          std::copy(full.begin() + long(sync.shardOff(L.buckets[b])),
                    full.begin() + long(sync.shardOff(L.buckets[b]) + sync.shardLen(L.buckets[b])),
                    st.array(i) + st.bucketOff[b]);
      }
    }
    if (o.sync.hook == Hook::TopK) {
      if (c.nranks != nranks || c.residual.size() != L.logical * size_t(nranks))
        trainerFail("--resume: top-k error feedback is per rank; resume with the same number of ranks");
      fromLogical(L, c.residual.data() + size_t(rank) * L.logical, sync.residual().data());
    }
    firstStep = c.nextStep;
  }
  TRAINER_CHECK_LOOM(loomBroadcast(params.data(), params.data(), L.total, loomFloat32, 0, comm, nullptr));

  DistributedSampler sampler(data.trainCount(), o.globalBatch, rank, nranks, o.seed);
  const uint64_t stepsPerEpoch = sampler.stepsPerEpoch();
  const uint64_t totalSteps = o.steps > 0 ? uint64_t(o.steps) : stepsPerEpoch * uint64_t(o.epochs);
  const double lrScaled = o.lr * o.globalBatch / o.lrRefBatch;

  size_t stateBytes = (params.size() + grads.size() + st.data.size()) * sizeof(float) + sync.bufferBytes();
  if (root) {
    std::string arch;
    for (size_t i = 0; i < widths.size(); ++i) arch += (i ? "-" : "") + std::to_string(widths[i]);
    printf("loom-trainer: %d ranks, dataset %s: %zu train / %zu test images\n", nranks, data.name.c_str(),
           data.trainCount(), data.testCount());
    printf("loom-trainer: model %s, %zu parameters (%.1f MB), %zu buckets:", arch.c_str(), L.logical,
           L.logical * 4 / 1e6, L.buckets.size());
    for (const Bucket& b : L.buckets) printf(" [layers %d-%d %.2f MB]", b.first, b.last, b.len * 4 / 1e6);
    printf(
        "\nloom-trainer: global batch %d = %d ranks x %d micro-batches x %d, %s lr %g (scaled %g, "
        "warm-up %d), hook %s, %s, %s, %llu steps (%llu per epoch) from step %llu\n",
        o.globalBatch, nranks, o.accum, micro, o.optimizer == OptKind::Adam ? "adam" : "sgd", o.lr, lrScaled,
        o.warmup, hookName(o.sync.hook), o.sync.zero ? "sharded optimizer" : "replicated optimizer",
        o.sync.overlap ? "overlap" : "no overlap", (unsigned long long)totalSteps,
        (unsigned long long)stepsPerEpoch, (unsigned long long)firstStep);
  }

  Mlp model(L, std::max(micro, 256));
  const int px = data.pixels();
  std::vector<float> x(size_t(std::max(micro, 256)) * px);
  std::vector<uint8_t> labels(std::max(micro, 256));
  const float lossScale = 1.0f / float(micro * o.accum);

  // Window statistics (summed over ranks at each progress line) and totals.
  double winLoss = 0, winCorrect = 0, winSamples = 0, winComm = 0, winCompute = 0, winStart = now();
  double totComm = 0, totCompute = 0, totTime = 0, lastLoss = 0;
  uint64_t totSteps = 0;
  const uint64_t skipSteps = 2;  // the first steps fault pages and open connections

  auto saveCheckpoint = [&](uint64_t nextStep) {
    Checkpoint c;
    c.widths = widths;
    c.optimizer = int(o.optimizer);
    c.hook = int(o.sync.hook);
    c.nextStep = nextStep;
    c.nranks = nranks;
    c.params.resize(L.logical);
    toLogical(L, params.data(), c.params.data());
    c.state.resize(L.logical * size_t(nStateArrays));
    for (int i = 0; i < nStateArrays; ++i) {
      std::vector<float> full = fullState(st, i, L, sync, o.sync.zero, comm);
      toLogical(L, full.data(), c.state.data() + size_t(i) * L.logical);
    }
    if (o.sync.hook == Hook::TopK) {
      std::vector<float> all(L.total * size_t(nranks));
      TRAINER_CHECK_LOOM(
          loomAllGather(sync.residual().data(), all.data(), L.total, loomFloat32, comm, nullptr));
      c.residual.resize(L.logical * size_t(nranks));
      for (int r = 0; r < nranks; ++r)
        toLogical(L, all.data() + size_t(r) * L.total, c.residual.data() + size_t(r) * L.logical);
    }
    if (root) {
      if (!writeCheckpoint(o.checkpoint, c, &err)) trainerFail(err.c_str());
      printf("checkpoint: step %llu written to %s\n", (unsigned long long)nextStep, o.checkpoint.c_str());
    }
  };

  for (uint64_t step = firstStep; step < totalSteps; ++step) {
    double t0 = now();
    std::fill(grads.begin(), grads.end(), 0.0f);
    const uint32_t* idx = sampler.shard(step);
    for (int k = 0; k < o.accum; ++k) {
      const uint32_t* mi = idx + size_t(k) * micro;
      toFloat(data, data.trainImages, mi, micro, x.data());
      for (int i = 0; i < micro; ++i) labels[i] = data.trainLabels[mi[i]];
      int correct = 0;
      winLoss += model.forward(params.data(), x.data(), labels.data(), micro, &correct);
      winCorrect += correct;
      winSamples += micro;
      if (k + 1 < o.accum) {
        model.backward(params.data(), grads.data(), labels.data(), micro, lossScale, nullptr);
      } else {
        sync.beginSyncPass();
        model.backward(params.data(), grads.data(), labels.data(), micro, lossScale,
                       [&](int l) { sync.layerReady(l); });
        sync.endBackward();
      }
    }
    double comm_s = sync.wait();
    double lr = lrScaled * (o.warmup > 0 ? std::min(1.0, double(step + 1) / o.warmup) : 1.0);
    if (o.sync.zero) {
      for (size_t b = 0; b < L.buckets.size(); ++b) {
        const Bucket& bk = L.buckets[b];
        optimizerStep(oc, float(lr), step + 1, params.data() + sync.shardOff(bk),
                      grads.data() + sync.shardOff(bk), st.array(0) + st.bucketOff[b],
                      nStateArrays > 1 ? st.array(1) + st.bucketOff[b] : nullptr, sync.shardLen(bk));
      }
      comm_s += sync.gatherParams(params.data());
    } else {
      optimizerStep(oc, float(lr), step + 1, params.data(), grads.data(), st.array(0),
                    nStateArrays > 1 ? st.array(1) : nullptr, L.total);
    }
    double dt = now() - t0;
    winComm += comm_s;
    winCompute += dt - comm_s;
    if (step - firstStep >= skipSteps) {
      totComm += comm_s;
      totCompute += dt - comm_s;
      totTime += dt;
      ++totSteps;
    }

    bool last = step + 1 == totalSteps;
    if ((step + 1) % uint64_t(o.logEvery) == 0 || last) {
      double stats[5] = {winLoss, winCorrect, winSamples, winComm, winCompute};
      TRAINER_CHECK_LOOM(loomAllReduce(stats, stats, 5, loomFloat64, loomSum, comm, nullptr));
      double wall = now() - winStart;
      uint64_t nsteps = uint64_t(stats[2] / (micro * o.accum * nranks) + 0.5);
      lastLoss = stats[0] / stats[2];
      if (root)
        printf(
            "step %llu/%llu epoch %llu loss %.4f acc %.2f%% lr %.4g samples/s %.0f comm_wait %.2f ms "
            "compute %.2f ms (comm %.1f%%)\n",
            (unsigned long long)(step + 1), (unsigned long long)totalSteps,
            (unsigned long long)(step / stepsPerEpoch), lastLoss, 100.0 * stats[1] / stats[2], lr,
            stats[2] / wall, 1e3 * stats[3] / nranks / nsteps, 1e3 * stats[4] / nranks / nsteps,
            100.0 * stats[3] / (stats[3] + stats[4]));
      winLoss = winCorrect = winSamples = winComm = winCompute = 0;
      winStart = now();
    }
    if (!o.checkpoint.empty() && o.checkpointEvery > 0 && (step + 1) % uint64_t(o.checkpointEvery) == 0 &&
        !last)
      saveCheckpoint(step + 1);
  }
  if (!o.checkpoint.empty()) saveCheckpoint(std::max(totalSteps, firstStep));

  double testAcc = -1;
  if (o.eval) {
    size_t n = data.testCount(), lo = n * size_t(rank) / nranks, hi = n * size_t(rank + 1) / nranks;
    std::vector<uint32_t> ids(256);
    double correct = 0;
    for (size_t i = lo; i < hi; i += 256) {
      int b = int(std::min<size_t>(256, hi - i));
      for (int j = 0; j < b; ++j) ids[j] = uint32_t(i + j), labels[j] = data.testLabels[i + j];
      toFloat(data, data.testImages, ids.data(), b, x.data());
      int c = 0;
      model.forward(params.data(), x.data(), labels.data(), b, &c);
      correct += c;
    }
    TRAINER_CHECK_LOOM(loomAllReduce(&correct, &correct, 1, loomFloat64, loomSum, comm, nullptr));
    testAcc = 100.0 * correct / double(n);
  }

  // Times: averaged over ranks; the step time is the slowest rank's.
  double t[4] = {totComm, totCompute, totTime, peakRssMb()};
  double tmax[2] = {totTime, t[3]};
  TRAINER_CHECK_LOOM(loomAllReduce(t, t, 3, loomFloat64, loomSum, comm, nullptr));
  TRAINER_CHECK_LOOM(loomAllReduce(tmax, tmax, 2, loomFloat64, loomMax, comm, nullptr));
  if (root) {
    double steps = double(std::max<uint64_t>(totSteps, 1));
    double stepMs = 1e3 * tmax[0] / steps;
    printf(
        "summary: dataset=%s ranks=%d steps=%llu timed_steps=%llu global_batch=%d hook=%s zero=%d overlap=%d "
        "samples_per_s=%.1f step_ms=%.2f comm_wait_ms=%.2f compute_ms=%.2f comm_share=%.1f%% "
        "last_window_loss=%.4f test_accuracy=%.2f model_state_mb=%.2f peak_rss_mb=%.1f\n",
        data.name.substr(0, data.name.find(' ')).c_str(), nranks, (unsigned long long)totalSteps,
        (unsigned long long)totSteps, o.globalBatch, hookName(o.sync.hook), int(o.sync.zero),
        int(o.sync.overlap), totSteps ? o.globalBatch * steps / tmax[0] : 0.0, stepMs,
        1e3 * t[0] / nranks / steps, 1e3 * t[1] / nranks / steps, 100.0 * t[0] / std::max(t[0] + t[1], 1e-12),
        lastLoss, testAcc, stateBytes / 1e6, tmax[1]);
  }
  if (root && !o.saveParams.empty()) {
    std::vector<float> logical(L.logical);
    toLogical(L, params.data(), logical.data());
    FILE* f = fopen(o.saveParams.c_str(), "wb");
    if (!f || fwrite(logical.data(), 4, logical.size(), f) != logical.size() || fclose(f) != 0)
      trainerFail(("--save-params: cannot write " + o.saveParams).c_str());
  }
  TRAINER_CHECK_LOOM(loomCommDestroy(comm));
  return 0;
}
