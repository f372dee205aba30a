// loom-trainer: the reference data-parallel trainer.  Trains an MLP on
// Fashion-MNIST with N ranks through loom's public C API only, the way
// PyTorch DDP, Horovod and DeepSpeed ZeRO do it:
//   - rank 0's initial parameters are broadcast to all ranks;
//   - a distributed sampler gives each rank a disjoint slice of every global
//     batch (per-epoch shuffle from a shared seed);
//   - gradient buckets are synchronised while backward runs (grad_sync.h),
//     with gradient accumulation, compression hooks and ZeRO stages 1-3
//     (optimizer state, gradients and parameters sharded; param_gather.h);
//   - linear learning-rate scaling with warm-up; checkpoint and resume.
// Run it with: loom-run -n N loom-trainer [flags]   (loom-trainer -h lists them)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "include/loom.h"
#include "trainer/check.h"
#include "trainer/checkpoint.h"
#include "trainer/dataset.h"
#include "trainer/elastic.h"
#include "trainer/grad_sync.h"
#include "trainer/loom_buffer.h"
#include "trainer/mlp.h"
#include "trainer/optimizer.h"
#include "trainer/param_gather.h"
#include "trainer/shards.h"

using namespace trainer;

namespace {

const char kUsage[] =
    "usage: loom-run -n N loom-trainer [flags]\n"
    "  --data DIR            Fashion-MNIST IDX files, gzip'd or not\n"
    "                        (default /usr/share/datasets/fashion-mnist; synthetic data if absent)\n"
    "  --synthetic           use the generated dataset even if Fashion-MNIST is present\n"
    "  --hidden W1,W2,...    hidden layer widths (default 1024,1024,1024: 2.9M parameters);\n"
    "                        WxK stands for K layers of width W (2048x16: a deep model)\n"
    "  --epochs E            epochs to train (default 1)\n"
    "  --steps S             stop after S optimizer steps in all (overrides --epochs)\n"
    "  --global-batch B      samples per optimizer step over all ranks (default 256)\n"
    "  --accum K             micro-batches per step; gradients synchronise on the last (default 1)\n"
    "  --optimizer sgd|adam  SGD with momentum (default) or Adam\n"
    "  --lr X                base learning rate at --lr-ref-batch (default sgd 0.05, adam 0.001)\n"
    "  --lr-ref-batch R      linear scaling: lr = X * B / R (default 256)\n"
    "  --warmup W            linear warm-up over the first W steps (default 50)\n"
    "  --momentum M          SGD momentum (default 0.9)\n"
    "  --zero [1|2|3]        ZeRO stage (--zero alone: 1). 1: optimizer state sharded\n"
    "                        (reduce-scatter, shard update, all-gather); 2: gradients sharded\n"
    "                        too, reduce-scattered bucket by bucket during backward; 3: parameters\n"
    "                        sharded too, each layer all-gathered before its forward and backward\n"
    "  --no-prefetch         ZeRO-3: gather each layer when it is needed, not during the previous one\n"
    "  --hook H              allreduce (default), bf16, fp16, topk or powersgd gradient communication\n"
    "  --topk-ratio F        fraction of each bucket top-k sends (default 0.01)\n"
    "  --powersgd-rank R     rank of PowerSGD's approximations (default 4)\n"
    "  --bucket-mb M         gradient bucket cap in MB (default 25)\n"
    "  --first-bucket-mb M   cap of the first bucket (default 1)\n"
    "  --no-overlap          issue all buckets after backward instead of during it\n"
    "  --plain-buffers       gradients, parameters and ZeRO staging/gather buffers in ordinary memory,\n"
    "                        not loomMemAlloc's (--plain-grads: the same; loomMemAlloc's collectives\n"
    "                        read in place on shared memory), for comparison\n"
    "  --seed S              seed of initialisation and shuffling (default 1)\n"
    "  --log-every N         progress line every N steps (default 50)\n"
    "  --no-eval             skip the test-set evaluation at the end\n"
    "  --checkpoint FILE     rank 0 writes a checkpoint here (every --checkpoint-every steps\n"
    "                        and at the end)\n"
    "  --checkpoint-every N  (default 0: only at the end)\n"
    "  --resume FILE         continue from a checkpoint (readable by every rank)\n"
    "  --save-params FILE    rank 0 writes the final parameters (float32, logical order)\n"
    "  --elastic             survive dead ranks: on a failed step revoke, shrink to the survivors,\n"
    "                        rebuild the state of the latest step every part of it survives (with\n"
    "                        --zero each rank also keeps its neighbour's shards) and continue\n"
    "                        (launch with loom-run --keep-going; not with topk or powersgd)\n"
    "  --kill-rank R[,R...] --kill-at-step S  testing --elastic: these ranks SIGKILL themselves\n"
    "                        during step S\n"
    "  --elastic-dump FILE   testing --elastic: rank 0 writes the rebuilt state as a checkpoint\n"
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
  bool prefetch = true;
  bool plainBuffers = false;
  double bucketMb = 25, firstBucketMb = 1;
  uint64_t seed = 1;
  int logEvery = 50;
  bool eval = true;
  std::string checkpoint, resume, saveParams, elasticDump;
  long checkpointEvery = 0;
  bool elastic = false;
  std::vector<int> killRanks;  // testing --elastic: these ranks SIGKILL themselves during step killStep
  long killStep = -1;
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
        std::string item = s.substr(p, q - p);
        size_t x = item.find('x');
        int repeat = x == std::string::npos ? 1 : int(number(a, item.substr(x + 1).c_str(), 1, 1000));
        int width = int(number(a, item.substr(0, x).c_str(), 1, 65536));
        o.hidden.insert(o.hidden.end(), size_t(repeat), width);
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
    else if (a == "--zero") {
      o.sync.zero = 1;
      if (i + 1 < argc && strlen(argv[i + 1]) == 1 && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '3')
        o.sync.zero = argv[++i][0] - '0';
    } else if (a == "--no-prefetch")
      o.prefetch = false;
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
      else if (v == "powersgd")
        o.sync.hook = Hook::PowerSgd;
      else
        usageError("--hook " + v + ": expected allreduce, bf16, fp16, topk or powersgd");
    } else if (a == "--topk-ratio")
      o.sync.topkRatio = number(a, value(), 1e-6, 1);
    else if (a == "--powersgd-rank")
      o.sync.powersgdRank = int(number(a, value(), 1, 4096));
    else if (a == "--bucket-mb")
      o.bucketMb = number(a, value(), 1e-3, 1e5);
    else if (a == "--first-bucket-mb")
      o.firstBucketMb = number(a, value(), 1e-3, 1e5);
    else if (a == "--no-overlap")
      o.sync.overlap = false;
    else if (a == "--plain-buffers" || a == "--plain-grads")
      o.plainBuffers = true, o.sync.loomBuffers = false;
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
    else if (a == "--elastic")
      o.elastic = true;
    else if (a == "--elastic-dump")
      o.elasticDump = value();
    else if (a == "--kill-rank") {
      std::string list = value();
      for (size_t p = 0; p <= list.size();) {
        size_t q = std::min(list.find(',', p), list.size());
        o.killRanks.push_back(int(number(a, list.substr(p, q - p).c_str(), 0, 1 << 20)));
        p = q + 1;
      }
    } else if (a == "--kill-at-step")
      o.killStep = long(number(a, value(), 0, 1e12));
    else
      usageError("unknown flag " + a);
  }
  if (o.lr < 0) o.lr = o.optimizer == OptKind::Adam ? 0.001 : 0.05;
  if (o.sync.zero && o.sync.hook != Hook::AllReduce)
    usageError("--zero reduce-scatters float32 gradients; it does not combine with --hook");
  if (!o.prefetch && o.sync.zero != 3) usageError("--no-prefetch applies to --zero 3 only");
  if (o.elastic && (o.sync.hook == Hook::TopK || o.sync.hook == Hook::PowerSgd))
    usageError("--elastic does not combine with the topk and powersgd hooks: their error feedback is per rank "
               "and dies with it");
  if (!o.elasticDump.empty() && !o.elastic) usageError("--elastic-dump needs --elastic");
  if (o.killRanks.empty() != (o.killStep < 0)) usageError("--kill-rank and --kill-at-step go together");
  return o;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
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
    case Hook::PowerSgd:
      return "powersgd";
  }
  return "?";
}

// Optimizer state: with --zero only this rank's shards, packed (shards.h).
struct OptimizerState {
  std::vector<float> data;
  size_t perArray = 0;  // floats per state array
  float* array(int i) { return data.data() + size_t(i) * perArray; }
};

// Full-size (flat layout) copy of an array: a copy, or gathered from every
// rank's packed shards when sharded.
std::vector<float> fullArray(const float* a, bool sharded, const Layout& L, const Shards& S,
                             loomComm_t comm) {
  std::vector<float> full(L.total, 0.0f);
  if (!sharded) {
    std::copy(a, a + L.total, full.begin());
    return full;
  }
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    std::copy(a + S.packedOff(b), a + S.packedOff(b) + S.len(b), full.begin() + long(S.flatOff(b)));
    TRAINER_CHECK_LOOM(loomAllGather(full.data() + S.flatOff(b), full.data() + L.buckets[b].off, S.len(b),
                                     loomFloat32, comm, nullptr));
  }
  return full;
}

// The other way: this rank's part of a full-size array (all of it, or its shards).
void fromFullArray(const float* full, bool sharded, const Layout& L, const Shards& S, float* a) {
  if (!sharded) {
    std::copy(full, full + L.total, a);
    return;
  }
  for (size_t b = 0; b < L.buckets.size(); ++b)
    std::copy(full + S.flatOff(b), full + S.flatOff(b) + S.len(b), a + S.packedOff(b));
}

// Memory of the model state on one rank, in bytes, as held during training.
struct MemoryUse {
  size_t params = 0;    // the parameters it keeps (all of them, or its shards)
  size_t gathered = 0;  // ZeRO-3: the two buffers layers are all-gathered into
  size_t grads = 0;     // the gradient buffer, or the shards plus two staging buffers
  size_t optim = 0;     // optimizer state
  size_t buffers = 0;   // hooks' communication buffers
  size_t total() const { return params + gathered + grads + optim + buffers; }
};

double rssMb(const char* field) {
  FILE* f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  double kb = 0;
  while (fgets(line, sizeof line, f))
    if (strncmp(line, field, strlen(field)) == 0) kb = atof(line + strlen(field));
  fclose(f);
  return kb / 1024.0;
}

}  // namespace

// One run of training on comm: from the start, from --resume, or (elastic)
// from `restart` after a shrink.  In elastic mode `elastic` keeps the state
// at the start of every step.  firstRun: not a restart (--kill-* apply).
int runTraining(const Options& o, loomComm_t comm, const Checkpoint* restart, ElasticState* elastic,
                bool firstRun) {
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
  // Buckets are padded to a multiple of 16 floats per rank: equal, aligned
  // shards.  ZeRO-3 gathers layer by layer: one bucket per layer.
  const int stage = o.sync.zero;
  Layout L = stage == 3 ? planLayout(widths, 0, 0, 16 * size_t(nranks))
                        : planLayout(widths, size_t(o.firstBucketMb * 1e6), size_t(o.bucketMb * 1e6),
                                     16 * size_t(nranks));
  Shards S(L, rank, nranks);

  OptConfig oc;
  oc.kind = o.optimizer;
  oc.momentum = float(o.momentum);
  // What this rank keeps: stage 3 only its parameter shards, stage 2+ no full gradients.
  // The gradient buffer the buckets are all-reduced in: loomMemAlloc memory,
  // so that shared memory reduces straight out of it.
  // Parameters too: ZeRO's all-gathers of them (stage 3's layer by layer,
  // stages 1-2's after the update) are then zero-copy as well.
  LoomFloats params(stage == 3 ? S.total() : L.total, !o.plainBuffers, "parameters");
  LoomFloats grads(stage >= 2 ? 0 : L.total, !o.plainBuffers);
  GradSync sync(comm, rank, nranks, L, o.sync, grads.empty() ? nullptr : grads.data());
  OptimizerState st;
  st.perArray = stage ? S.total() : L.total;
  int nStateArrays = stateArrays(o.optimizer);
  st.data.assign(st.perArray * size_t(nStateArrays), 0.0f);

  uint64_t firstStep = 0;
  if (restart || !o.resume.empty()) {
    Checkpoint c;
    if (restart) c = *restart;
    else if (!readCheckpoint(o.resume, &c, &err)) trainerFail(err.c_str());
    if (c.widths != widths) trainerFail("--resume: the checkpoint's model has other layer widths");
    if (c.optimizer != int(o.optimizer) || c.hook != int(o.sync.hook))
      trainerFail("--resume: the checkpoint was written with another --optimizer or --hook");
    if (c.params.size() != L.logical || c.state.size() != L.logical * size_t(nStateArrays))
      trainerFail("--resume: the checkpoint's arrays have the wrong sizes");
    std::vector<float> full(L.total, 0.0f);
    fromLogical(L, c.params.data(), full.data());
    fromFullArray(full.data(), stage == 3, L, S, params.data());
    for (int i = 0; i < nStateArrays; ++i) {
      fromLogical(L, c.state.data() + size_t(i) * L.logical, full.data());
      fromFullArray(full.data(), stage > 0, L, S, st.array(i));
    }
    if (o.sync.hook == Hook::TopK || o.sync.hook == Hook::PowerSgd) {
      if (c.nranks != nranks || c.residual.size() != L.logical * size_t(nranks))
        trainerFail("--resume: the hook's error feedback is per rank; resume with the same number of ranks");
      fromLogical(L, c.residual.data() + size_t(rank) * L.logical, sync.residual().data());
    }
    if (std::vector<float>* q = sync.warmStart()) {
      if (c.warmStart.size() != q->size())
        trainerFail("--resume: the checkpoint has no PowerSGD warm start of this model and --powersgd-rank");
      *q = c.warmStart;
    }
    firstStep = c.nextStep;
  } else if (stage < 3) {
    // Different seeds per rank on purpose: only the broadcast makes them agree.
    initParams(L, o.seed + uint64_t(rank) * 1000003, params.data());
  } else {
    // Rank 0 draws the same values as initParams, one layer at a time, and
    // each layer is broadcast and cut to shards: no rank holds the full model.
    size_t maxLen = 0;
    for (const Bucket& b : L.buckets) maxLen = std::max(maxLen, b.len);
    std::vector<float> layer(maxLen);
    std::mt19937_64 rng(o.seed);
    for (size_t l = 0; l < L.layers.size(); ++l) {
      size_t b = size_t(L.bucketOf[l]);
      std::fill(layer.begin(), layer.end(), 0.0f);
      if (root) initLayerWeights(L.layers[l], rng, layer.data() + (L.layers[l].w - L.buckets[b].off));
      TRAINER_CHECK_LOOM(
          loomBroadcast(layer.data(), layer.data(), L.buckets[b].len, loomFloat32, 0, comm, nullptr));
      std::copy(layer.begin() + long(size_t(rank) * S.len(b)),
                layer.begin() + long(size_t(rank + 1) * S.len(b)), params.data() + S.packedOff(b));
    }
  }
  if (stage < 3)
    TRAINER_CHECK_LOOM(loomBroadcast(params.data(), params.data(), L.total, loomFloat32, 0, comm, nullptr));

  DistributedSampler sampler(data.trainCount(), o.globalBatch, rank, nranks, o.seed);
  const uint64_t stepsPerEpoch = sampler.stepsPerEpoch();
  const uint64_t totalSteps = o.steps > 0 ? uint64_t(o.steps) : stepsPerEpoch * uint64_t(o.epochs);
  const double lrScaled = o.lr * o.globalBatch / o.lrRefBatch;

  std::unique_ptr<ParamGather> gather;
  if (stage == 3) gather.reset(new ParamGather(comm, L, S, params.data(), o.prefetch, !o.plainBuffers));
  MemoryUse mem;
  mem.params = params.size() * sizeof(float);
  mem.gathered = gather ? gather->bufferBytes() : 0;
  mem.grads = grads.size() * sizeof(float) + sync.shardGradBytes() + sync.stagingBytes();
  mem.optim = st.data.size() * sizeof(float);
  mem.buffers = sync.bufferBytes();
  size_t maxLayer = 0;
  for (const Layer& ly : L.layers) maxLayer = std::max(maxLayer, size_t(ly.in) * ly.out + ly.out);
  if (root) {
    std::string arch;
    for (size_t i = 0; i < widths.size(); ++i) arch += (i ? "-" : "") + std::to_string(widths[i]);
    printf("loom-trainer: %d ranks, dataset %s: %zu train / %zu test images\n", nranks, data.name.c_str(),
           data.trainCount(), data.testCount());
    printf("loom-trainer: model %s, %zu parameters (%.1f MB, largest layer %.2f MB), %zu buckets:",
           arch.c_str(), L.logical, L.logical * 4 / 1e6, maxLayer * 4 / 1e6, L.buckets.size());
    if (L.buckets.size() <= 8)
      for (const Bucket& b : L.buckets) printf(" [layers %d-%d %.2f MB]", b.first, b.last, b.len * 4 / 1e6);
    printf(
        "\nloom-trainer: global batch %d = %d ranks x %d micro-batches x %d, %s lr %g (scaled %g, "
        "warm-up %d), hook %s, ZeRO stage %d%s, %s, %llu steps (%llu per epoch) from step %llu\n",
        o.globalBatch, nranks, o.accum, micro, o.optimizer == OptKind::Adam ? "adam" : "sgd", o.lr, lrScaled,
        o.warmup, hookName(o.sync.hook), stage,
        stage == 3 ? (o.prefetch ? " with prefetch" : " without prefetch") : "",
        o.sync.overlap ? "overlap" : "no overlap", (unsigned long long)totalSteps,
        (unsigned long long)stepsPerEpoch, (unsigned long long)firstStep);
    if (o.sync.hook != Hook::AllReduce)
      printf("loom-trainer: hook %s sends %zu floats per rank per step instead of %zu (%.1fx less)\n",
             hookName(o.sync.hook), sync.wireFloats(), L.total, double(L.total) / double(sync.wireFloats()));
    printf(
        "memory per rank: parameters %.2f MB, gathered layers %.2f MB, gradients %.2f MB, optimizer state "
        "%.2f MB, hook buffers %.2f MB: model state %.2f MB\n",
        mem.params / 1e6, mem.gathered / 1e6, mem.grads / 1e6, mem.optim / 1e6, mem.buffers / 1e6,
        mem.total() / 1e6);
  }

  Mlp model(L, std::max(micro, 256));
  const int px = data.pixels();
  std::vector<float> x(size_t(std::max(micro, 256)) * px);
  std::vector<uint8_t> labels(std::max(micro, 256));
  const float lossScale = 1.0f / float(micro * o.accum);
  const int nl = int(L.layers.size());

  // Where the model reads parameters and writes gradients.  Forward
  // prefetches the next layer, backward the previous one (not layer 0: its
  // backward needs no weights).
  LayerAccess fwd, bwd;
  if (gather) {
    fwd.params = [&](int l) { return gather->acquire(l, l + 1 < nl ? l + 1 : -1); };
    bwd.params = [&](int l) { return gather->acquire(l, l - 1 >= 1 ? l - 1 : -1); };
  } else {
    fwd.params = bwd.params = [&](int l) { return params.data() + L.layers[size_t(l)].w; };
  }
  bwd.grads = [&](int l) { return sync.layerGrads(l); };
  LayerAccess bwdSync = bwd;
  bwdSync.gradsReady = [&](int l) { sync.layerReady(l); };

  // Window statistics (summed over ranks at each progress line) and totals.
  double winLoss = 0, winCorrect = 0, winSamples = 0, winComm = 0, winCompute = 0, winStart = now();
  double totComm = 0, totCompute = 0, totTime = 0, totGather = 0, lastLoss = 0;
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
    toLogical(L, fullArray(params.data(), stage == 3, L, S, comm).data(), c.params.data());
    c.state.resize(L.logical * size_t(nStateArrays));
    for (int i = 0; i < nStateArrays; ++i)
      toLogical(L, fullArray(st.array(i), stage > 0, L, S, comm).data(),
                c.state.data() + size_t(i) * L.logical);
    if (const std::vector<float>* q = sync.warmStart()) c.warmStart = *q;
    if (o.sync.hook == Hook::TopK || o.sync.hook == Hook::PowerSgd) {
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

  if (elastic) elastic->configure(L, stage, nStateArrays, rank, nranks, widths, int(o.optimizer), int(o.sync.hook));
  for (uint64_t step = firstStep; step < totalSteps; ++step) {
    double t0 = now();
    if (elastic) elastic->snapshot(step, params.data(), st.data.data(), comm);
    if (firstRun && step == uint64_t(o.killStep) &&
        std::find(o.killRanks.begin(), o.killRanks.end(), rank) != o.killRanks.end()) {
      // Testing --elastic: die in the middle of this step's communication.
      printf("loom-trainer: rank %d kills itself during step %llu (--kill-rank)\n", rank, (unsigned long long)step);
      std::thread([] {
        usleep(3000);
        raise(SIGKILL);
      }).detach();
    }
    sync.zeroGrads();
    const uint32_t* idx = sampler.shard(step);
    for (int k = 0; k < o.accum; ++k) {
      const uint32_t* mi = idx + size_t(k) * micro;
      toFloat(data, data.trainImages, mi, micro, x.data());
      for (int i = 0; i < micro; ++i) labels[i] = data.trainLabels[mi[i]];
      int correct = 0;
      winLoss += model.forward(fwd, x.data(), labels.data(), micro, &correct);
      winCorrect += correct;
      winSamples += micro;
      if (k + 1 < o.accum && !sync.syncsEveryPass()) {
        model.backward(bwd, labels.data(), micro, lossScale);
      } else {
        sync.beginSyncPass();
        model.backward(bwdSync, labels.data(), micro, lossScale);
        sync.endBackward();
      }
    }
    double comm_s = sync.wait();
    double lr = lrScaled * (o.warmup > 0 ? std::min(1.0, double(step + 1) / o.warmup) : 1.0);
    if (stage) {
      if (gather) gather->invalidate();  // no all-gather may read the shards while they change
      // Stage 3: layer 0's bucket first, and its all-gather for the next
      // step starts at once, while the other buckets are updated.
      const size_t first = gather ? size_t(L.bucketOf[0]) : 0;
      for (size_t i = 0; i < L.buckets.size(); ++i) {
        const size_t b = i == 0 ? first : i <= first ? i - 1 : i;
        float* p = params.data() + (stage == 3 ? S.packedOff(b) : S.flatOff(b));
        optimizerStep(oc, float(lr), step + 1, p, sync.shardGrads(b), st.array(0) + S.packedOff(b),
                      nStateArrays > 1 ? st.array(1) + S.packedOff(b) : nullptr, S.len(b));
        if (gather && i == 0 && step + 1 < totalSteps) gather->prefetch(0);
      }
      if (stage < 3) comm_s += sync.gatherParams(params.data());
    } else {
      optimizerStep(oc, float(lr), step + 1, params.data(), grads.data(), st.array(0),
                    nStateArrays > 1 ? st.array(1) : nullptr, L.total);
    }
    double gather_s = gather ? gather->takeBlocked() : 0.0;
    comm_s += gather_s;
    double dt = now() - t0;
    winComm += comm_s;
    winCompute += dt - comm_s;
    if (step - firstStep >= skipSteps) {
      totComm += comm_s;
      totCompute += dt - comm_s;
      totTime += dt;
      totGather += gather_s;
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
      model.forward(fwd, x.data(), labels.data(), b, &c);
      correct += c;
    }
    TRAINER_CHECK_LOOM(loomAllReduce(&correct, &correct, 1, loomFloat64, loomSum, comm, nullptr));
    testAcc = 100.0 * correct / double(n);
  }

  // Times: averaged over ranks; the step time is the slowest rank's; memory
  // the largest rank's (RSS now, after training, and at its peak).
  double t[4] = {totComm, totCompute, totTime, totGather};
  double tmax[3] = {totTime, rssMb("VmRSS:"), rssMb("VmHWM:")};
  TRAINER_CHECK_LOOM(loomAllReduce(t, t, 4, loomFloat64, loomSum, comm, nullptr));
  TRAINER_CHECK_LOOM(loomAllReduce(tmax, tmax, 3, loomFloat64, loomMax, comm, nullptr));
  if (root) {
    double steps = double(std::max<uint64_t>(totSteps, 1));
    double stepMs = 1e3 * tmax[0] / steps;
    printf(
        "summary: dataset=%s ranks=%d steps=%llu timed_steps=%llu global_batch=%d hook=%s zero=%d overlap=%d shared_grads=%d "
        "shared_params=%d samples_per_s=%.1f step_ms=%.2f comm_wait_ms=%.2f compute_ms=%.2f comm_share=%.1f%% "
        "last_window_loss=%.4f test_accuracy=%.2f compression=%.1f prefetch=%d gather_wait_ms=%.2f "
        "params_mb=%.2f "
        "gathered_mb=%.2f grads_mb=%.2f optim_mb=%.2f model_state_mb=%.2f rss_mb=%.1f peak_rss_mb=%.1f\n",
        data.name.substr(0, data.name.find(' ')).c_str(), nranks, (unsigned long long)totalSteps,
        (unsigned long long)totSteps, o.globalBatch, hookName(o.sync.hook), stage, int(o.sync.overlap),
        int(stage >= 2 ? sync.stagingShared() : grads.shared()),
        int(params.shared() && (!gather || gather->buffersShared())), totSteps ? o.globalBatch * steps / tmax[0] : 0.0, stepMs, 1e3 * t[0] / nranks / steps,
        1e3 * t[1] / nranks / steps, 100.0 * t[0] / std::max(t[0] + t[1], 1e-12), lastLoss, testAcc,
        double(L.total) / double(sync.wireFloats()), int(stage == 3 && o.prefetch),
        1e3 * t[3] / nranks / steps, mem.params / 1e6, mem.gathered / 1e6, mem.grads / 1e6, mem.optim / 1e6,
        mem.total() / 1e6, tmax[1], tmax[2]);
  }
  if (!o.saveParams.empty()) {
    std::vector<float> full = fullArray(params.data(), stage == 3, L, S, comm);
    std::vector<float> logical(L.logical);
    toLogical(L, full.data(), logical.data());
    FILE* f = root ? fopen(o.saveParams.c_str(), "wb") : nullptr;
    if (root && (!f || fwrite(logical.data(), 4, logical.size(), f) != logical.size() || fclose(f) != 0))
      trainerFail(("--save-params: cannot write " + o.saveParams).c_str());
  }
  return 0;
}

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
  if (!o.elastic) {
    int code = runTraining(o, comm, nullptr, nullptr, true);
    TRAINER_CHECK_LOOM(loomCommDestroy(comm));
    return code;
  }
  // Elastic: a failed loom call revokes comm and throws; the survivors shrink
  // it, rebuild the state of the latest step every part of it survived
  // (elastic.h), and train on from there.
  ElasticState state;
  Checkpoint restart;
  bool restarted = false;
  for (;;) {
    elasticComm() = comm;
    try {
      int code = runTraining(o, comm, restarted ? &restart : nullptr, &state, !restarted);
      elasticComm() = nullptr;
      TRAINER_CHECK_LOOM(loomCommDestroy(comm));
      return code;
    } catch (const LoomFailure& f) {
      double t0 = now();
      int oldRank = -1, oldN = 0;
      loomCommUserRank(comm, &oldRank);
      loomCommCount(comm, &oldN);
      elasticComm() = nullptr;
      fprintf(stderr, "loom-trainer: rank %d: %s\n", oldRank, f.what());
      loomCommRevoke(comm);
      loomComm_t next = nullptr;
      loomResult_t r = loomCommShrink(comm, nullptr, 0, &next);
      std::string why = loomGetLastError(comm);
      loomCommAbort(comm);
      if (r != loomSuccess) trainerFail(("--elastic: loomCommShrink failed: " + why).c_str());
      if (!next) trainerFail("--elastic: this rank was left out of the shrunken communicator");
      comm = next;
      int me = 0, n = 1;
      TRAINER_CHECK_LOOM(loomCommUserRank(comm, &me));
      TRAINER_CHECK_LOOM(loomCommCount(comm, &n));
      if (state.empty()) trainerFail("--elastic: failed before the first step; nothing to continue from");
      const char* from = "the survivors' copies";
      if (!state.rebuild(comm, &restart, &why)) {
        // A lost shard: the last checkpoint, if there is one, is the way on.
        std::string err;
        if (o.checkpoint.empty() || !readCheckpoint(o.checkpoint, &restart, &err))
          trainerFail(("--elastic: cannot continue: " + why +
                       (o.checkpoint.empty() ? std::string("; no --checkpoint to fall back on") : "; " + err))
                          .c_str());
        from = "the last checkpoint";
      }
      restart.nranks = n;
      restarted = true;
      if (me == 0) {
        printf("elastic: lost %d of %d ranks; continuing on %d from step %llu, rebuilt from %s (revoke, "
               "shrink and state agreement took %.0f ms)\n",
               oldN - n, oldN, n, (unsigned long long)restart.nextStep, from, 1e3 * (now() - t0));
        std::string err;
        if (!o.elasticDump.empty() && !writeCheckpoint(o.elasticDump, restart, &err)) trainerFail(err.c_str());
      }
    }
  }
}
