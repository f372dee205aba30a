#include "trainer/elastic.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "trainer/check.h"
#include "trainer/shards.h"

namespace trainer {

void ElasticState::configure(const Layout& L, int stage, int nState, int rank, int nranks,
                             const std::vector<int>& widths, int optimizer, int hook) {
  L_ = L;
  stage_ = stage;
  nState_ = nState;
  rank_ = rank;
  nranks_ = nranks;
  widths_ = widths;
  optimizer_ = optimizer;
  hook_ = hook;
  for (Copy* c : {&own_[0], &own_[1], &repl_[0], &repl_[1], &buddy_[0], &buddy_[1]}) {
    c->owner = -1;
    c->step = -1;
  }
}

size_t ElasticState::shardFloats() const {
  size_t perRank = Shards(L_, rank_, nranks_).total();
  return stage_ == 0 ? 0 : perRank * size_t((stage_ == 3 ? 1 : 0) + nState_);
}

size_t ElasticState::replFloats() const {
  return (stage_ < 3 ? L_.total : 0) + (stage_ == 0 ? L_.total * size_t(nState_) : 0);
}

void ElasticState::snapshot(uint64_t step, const float* params, const float* state, loomComm_t comm) {
  // The copies of the step before become the older generation.
  std::swap(own_[0], own_[1]);
  std::swap(repl_[0], repl_[1]);
  size_t perRank = Shards(L_, rank_, nranks_).total();
  Copy& r = repl_[0];
  r.owner = nranks_;
  r.step = int64_t(step);
  r.data.resize(replFloats());
  float* out = r.data.data();
  if (stage_ < 3) out = std::copy(params, params + L_.total, out);
  if (stage_ == 0) std::copy(state, state + L_.total * size_t(nState_), out);
  Copy& o = own_[0];
  o.owner = rank_;
  o.step = int64_t(step);
  o.data.resize(shardFloats());
  if (o.data.empty()) return;
  out = o.data.data();
  if (stage_ == 3) out = std::copy(params, params + perRank, out);
  std::copy(state, state + perRank * size_t(nState_), out);
  if (nranks_ < 2) return;
  // Ring order: our shards to the rank below, the shards of the rank above to us.
  int below = (rank_ + nranks_ - 1) % nranks_, above = (rank_ + 1) % nranks_;
  incoming_.resize(o.data.size());
  TRAINER_CHECK_LOOM(loomGroupStart());
  TRAINER_CHECK_LOOM(loomSend(o.data.data(), o.data.size(), loomFloat32, below, comm, nullptr));
  TRAINER_CHECK_LOOM(loomRecv(incoming_.data(), incoming_.size(), loomFloat32, above, comm, nullptr));
  TRAINER_CHECK_LOOM(loomGroupEnd());
  // Only a whole exchange becomes a copy.
  std::swap(buddy_[0], buddy_[1]);
  buddy_[0].owner = above;
  buddy_[0].step = int64_t(step);
  std::swap(buddy_[0].data, incoming_);
}

bool ElasticState::rebuild(loomComm_t comm, Checkpoint* out, std::string* why) const {
  int me = 0, n = 1;
  TRAINER_CHECK_LOOM(loomCommUserRank(comm, &me));
  TRAINER_CHECK_LOOM(loomCommCount(comm, &n));
  // What each survivor holds: (owner, step) for its six copies.
  constexpr int kCopies = 6;
  const Copy* mine[kCopies] = {&repl_[0], &repl_[1], &own_[0], &own_[1], &buddy_[0], &buddy_[1]};
  std::vector<int64_t> held(size_t(2 * kCopies)), all(size_t(2 * kCopies) * size_t(n));
  for (int i = 0; i < kCopies; ++i) {
    held[size_t(2 * i)] = mine[i]->step >= 0 ? mine[i]->owner : -1;
    held[size_t(2 * i + 1)] = mine[i]->step;
  }
  TRAINER_CHECK_LOOM(loomAllGather(held.data(), all.data(), held.size(), loomInt64, comm, nullptr));
  // Every survivor makes the same choice from the same table: the latest step
  // at which the replicated part and every owner's shards are held.
  const bool sharded = shardFloats() > 0;
  std::set<int64_t, std::greater<int64_t>> steps;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < kCopies; ++i)
      if (all[size_t(r * 2 * kCopies + 2 * i + 1)] >= 0) steps.insert(all[size_t(r * 2 * kCopies + 2 * i + 1)]);
  auto holder = [&](int owner, int64_t step) {  // lowest survivor holding it, or -1
    for (int r = 0; r < n; ++r)
      for (int i = 0; i < kCopies; ++i)
        if (all[size_t(r * 2 * kCopies + 2 * i)] == owner && all[size_t(r * 2 * kCopies + 2 * i + 1)] == step)
          return r;
    return -1;
  };
  // The survivors' old ranks: the owners of their own copies.
  std::set<int> alive;
  for (int r = 0; r < n; ++r)
    for (int i = 2; i < 4; ++i)
      if (all[size_t(r * 2 * kCopies + 2 * i)] >= 0) alive.insert(int(all[size_t(r * 2 * kCopies + 2 * i)]));
  int64_t chosen = -1;
  std::vector<int> source(size_t(nranks_) + 1, -1);  // per owner, then the replicated part
  std::string lost;  // what the latest step lacks
  for (int64_t s : steps) {
    bool whole = true;
    for (int owner = sharded ? 0 : nranks_; owner <= nranks_; ++owner) {
      source[size_t(owner)] = holder(owner, s);
      if (source[size_t(owner)] >= 0 || s != *steps.begin()) continue;
      whole = false;
      int keeper = (owner + nranks_ - 1) % nranks_;
      lost += lost.empty() ? "" : ", ";
      if (owner == nranks_)
        lost += "the replicated state";
      else if (!alive.count(owner) && !alive.count(keeper))
        lost += "rank " + std::to_string(owner) + "'s shards (rank " + std::to_string(owner) + " and rank " +
                std::to_string(keeper) + ", which kept their copy, both died)";
      else
        lost += "rank " + std::to_string(owner) + "'s shards";
    }
    for (int owner = sharded ? 0 : nranks_; owner <= nranks_; ++owner) whole = whole && source[size_t(owner)] >= 0;
    if (whole) {
      chosen = s;
      break;
    }
  }
  if (chosen < 0) {
    *why = "no step at which the whole state survives; step " + std::to_string(*steps.begin()) + " lacks " + lost;
    return false;
  }
  // Rebuild the flat arrays of the old layout, one owner at a time.
  std::vector<float> params(L_.total, 0.0f), state(L_.total * size_t(nState_), 0.0f);
  auto copyOf = [&](int owner) -> const Copy* {
    for (const Copy* c : mine)
      if (c->owner == owner && c->step == chosen) return c;
    return nullptr;
  };
  std::vector<float> buf;
  for (int owner = sharded ? 0 : nranks_; owner <= nranks_; ++owner) {
    size_t len = owner == nranks_ ? replFloats() : shardFloats();
    if (!len) continue;
    buf.assign(len, 0.0f);
    if (me == source[size_t(owner)]) {
      const Copy* c = copyOf(owner);
      std::copy(c->data.begin(), c->data.end(), buf.begin());
    }
    TRAINER_CHECK_LOOM(
        loomBroadcast(buf.data(), buf.data(), len, loomFloat32, source[size_t(owner)], comm, nullptr));
    const float* d = buf.data();
    if (owner == nranks_) {
      if (stage_ < 3) {
        std::copy(d, d + L_.total, params.begin());
        d += L_.total;
      }
      if (stage_ == 0) std::copy(d, d + L_.total * size_t(nState_), state.begin());
      continue;
    }
    Shards S(L_, owner, nranks_);
    auto unpack = [&](const float* packed, float* flat) {
      for (size_t b = 0; b < S.buckets(); ++b)
        std::copy(packed + S.packedOff(b), packed + S.packedOff(b) + S.len(b), flat + S.flatOff(b));
    };
    if (stage_ == 3) {
      unpack(d, params.data());
      d += S.total();
    }
    for (int i = 0; i < nState_; ++i) unpack(d + size_t(i) * S.total(), state.data() + size_t(i) * L_.total);
  }
  out->widths = widths_;
  out->optimizer = optimizer_;
  out->hook = hook_;
  out->nextStep = uint64_t(chosen);
  out->nranks = n;
  out->params.assign(L_.logical, 0.0f);
  toLogical(L_, params.data(), out->params.data());
  out->state.assign(L_.logical * size_t(nState_), 0.0f);
  for (int i = 0; i < nState_; ++i)
    toLogical(L_, state.data() + size_t(i) * L_.total, out->state.data() + size_t(i) * L_.logical);
  out->residual.clear();
  out->warmStart.clear();
  return true;
}

}  // namespace trainer
