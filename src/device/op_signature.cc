#include "src/device/op_signature.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "src/core/clock.h"
#include "src/core/error.h"
#include "src/device/host_reduce.h"

namespace loom {

namespace {

constexpr size_t kEntryBytes = 8 + 8 + 4 + 4;  // seq, count, coll|dtype|op, root

}  // namespace

OpSignature signatureOf(uint64_t seq, const OpDesc& op) {
  OpSignature s;
  s.seq = seq;
  s.count = op.count;
  s.coll = uint8_t(op.coll);
  s.dtype = uint8_t(op.dtype);
  s.op = reduces(op.coll) ? uint8_t(op.op) : 0;
  s.root = rooted(op.coll) ? op.root : 0;
  return s;
}

std::string describeSignature(const OpSignature& s) {
  const Collective c = Collective(s.coll);
  std::string d = strf("%s of %llu x %s", collectiveName(c), (unsigned long long)s.count,
                       dtypeName(loomDataType_t(s.dtype)));
  if (reduces(c)) d += strf(", %s", redOpName(loomRedOp_t(s.op)));
  if (rooted(c)) d += strf(", root %d", s.root);
  return d;
}

uint64_t signatureFlag(const OpSignature& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields but seq
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  mix(s.count);
  mix(uint64_t(s.coll) | uint64_t(s.dtype) << 8 | uint64_t(s.op) << 16);
  mix(uint64_t(uint32_t(s.root)));
  h &= (uint64_t(1) << 61) - 1;
  return h ? h : 1;
}

std::vector<uint8_t> encodeSignatures(const std::vector<OpSignature>& sigs) {
  std::vector<uint8_t> out(sigs.size() * kEntryBytes);
  uint8_t* p = out.data();
  for (const OpSignature& s : sigs) {
    const uint32_t kind = uint32_t(s.coll) | uint32_t(s.dtype) << 8 | uint32_t(s.op) << 16;
    memcpy(p, &s.seq, 8);
    memcpy(p + 8, &s.count, 8);
    memcpy(p + 16, &kind, 4);
    memcpy(p + 20, &s.root, 4);
    p += kEntryBytes;
  }
  return out;
}

bool decodeSignatures(const std::vector<uint8_t>& bytes, std::vector<OpSignature>* sigs) {
  sigs->clear();
  if (bytes.size() % kEntryBytes != 0 || bytes.size() / kEntryBytes > kSignatureBatch) return false;
  for (const uint8_t* p = bytes.data(); p < bytes.data() + bytes.size(); p += kEntryBytes) {
    OpSignature s;
    uint32_t kind;
    memcpy(&s.seq, p, 8);
    memcpy(&s.count, p + 8, 8);
    memcpy(&kind, p + 16, 4);
    memcpy(&s.root, p + 20, 4);
    if (kind >> 24) return false;
    s.coll = uint8_t(kind), s.dtype = uint8_t(kind >> 8), s.op = uint8_t(kind >> 16);
    sigs->push_back(s);
  }
  return true;
}

void SignatureCheck::recordMine(const OpDesc& op) {
  std::lock_guard<std::mutex> g(mu_);
  const OpSignature s = signatureOf(next_++, op);
  mine_.push_back(Mine{s, false});
  ++unchecked_;
  if (mine_.size() > kKeep) {
    if (!mine_.front().checked) --unchecked_, ++skipped_;
    mine_.pop_front();
    ++mineBase_;
    if (sent_ < mineBase_) sent_ = mineBase_;  // never taken: not sent (the next rank skips them)
  }
  auto it = ahead_.find(s.seq);
  if (it != ahead_.end()) {
    compare(mine_.back(), it->second);
    ahead_.erase(it);
  }
}

std::vector<uint8_t> SignatureCheck::takeBatch() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<OpSignature> batch;
  while (sent_ < next_ && batch.size() < kSignatureBatch) batch.push_back(mine_[size_t(sent_++ - mineBase_)].sig);
  return batch.empty() ? std::vector<uint8_t>() : encodeSignatures(batch);
}

size_t SignatureCheck::pending() const {
  std::lock_guard<std::mutex> g(mu_);
  return size_t(next_ - sent_);
}

void SignatureCheck::receive(const std::vector<uint8_t>& bytes) {
  std::vector<OpSignature> sigs;
  if (!decodeSignatures(bytes, &sigs)) return;  // not a batch: nothing to compare
  std::lock_guard<std::mutex> g(mu_);
  for (const OpSignature& s : sigs) {
    if (s.coll == uint8_t(Collective::P2P)) continue;  // a send's size (P2PCheck's), not a collective
    if (s.seq < mineBase_) continue;  // dropped here already (counted then)
    if (s.seq < next_) {
      compare(mine_[size_t(s.seq - mineBase_)], s);
    } else if (ahead_.size() < kKeep || s.seq < ahead_.rbegin()->first) {
      ahead_[s.seq] = s;
      if (ahead_.size() > kKeep) ahead_.erase(std::prev(ahead_.end()));  // the newest waits longest
    }
  }
}

std::vector<std::vector<uint8_t>> SignatureCheck::due(int64_t nowMs, bool flush, int64_t* nextMs) {
  std::vector<std::vector<uint8_t>> out;
  const size_t waiting = pending();
  const int64_t since = nowMs - sentMs_;
  if (waiting == 0) {
    *nextMs = 100;
  } else if (!flush && waiting < kSignatureBatch && since < 10) {
    *nextMs = 10 - since;
  } else {
    do out.push_back(takeBatch());
    while (flush && pending() > 0);
    sentMs_ = nowMs;
    *nextMs = pending() >= kSignatureBatch ? 1 : 10;
  }
  return out;
}

void SignatureCheck::awaitChecked(int64_t deadlineMs) const {
  while (unchecked() > 0 && mismatch().empty() && nowMs() < deadlineMs)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

std::string SignatureCheck::mismatch() const {
  std::lock_guard<std::mutex> g(mu_);
  return mismatch_;
}

size_t SignatureCheck::unchecked() const {
  std::lock_guard<std::mutex> g(mu_);
  return unchecked_;
}

size_t SignatureCheck::skipped() const {
  std::lock_guard<std::mutex> g(mu_);
  return skipped_;
}

void SignatureCheck::compare(Mine& m, const OpSignature& theirs) {
  if (!m.checked) m.checked = true, --unchecked_;
  const OpSignature& mine = m.sig;
  if (mine == theirs || !mismatch_.empty()) return;
  mismatch_ = strf("rank %d: mismatched operations: the collective #%llu on this communicator is %s on rank %d but "
                   "%s on rank %d",
                   rank_, (unsigned long long)mine.seq, describeSignature(theirs).c_str(), from_,
                   describeSignature(mine).c_str(), rank_);
}

P2PCheck::P2PCheck(int rank, int nranks) : rank_(rank), nranks_(nranks), pairs_(size_t(std::max(nranks, 0))) {}

void P2PCheck::recordSend(int to, uint64_t bytes) {
  if (to < 0 || to >= nranks_ || to == rank_) return;
  std::lock_guard<std::mutex> g(mu_);
  Pair& p = pairs_[size_t(to)];
  OpSignature s;
  s.seq = p.sends++;
  s.count = bytes;
  s.coll = uint8_t(Collective::P2P);
  s.root = to;
  p.unsent.push_back(s);
  // Never taken (no watchdog to send them): the oldest go unsent, and the
  // receiver drops its own copies of them unchecked in time.
  if (p.unsent.size() > kKeep) p.unsent.erase(p.unsent.begin(), p.unsent.begin() + (p.unsent.size() - kKeep));
}

void P2PCheck::recordRecv(int from, uint64_t bytes) {
  if (from < 0 || from >= nranks_ || from == rank_) return;
  std::lock_guard<std::mutex> g(mu_);
  Pair& p = pairs_[size_t(from)];
  const uint64_t seq = p.recvNext++;
  p.recvs.push_back(Recv{bytes, false});
  ++unchecked_;
  if (p.recvs.size() > kKeep) {
    if (!p.recvs.front().checked) --unchecked_, ++skipped_;
    p.recvs.pop_front();
    ++p.recvBase;
  }
  auto it = p.ahead.find(seq);
  if (it != p.ahead.end()) {
    compare(from, seq, p.recvs.back(), it->second);
    p.ahead.erase(it);
  }
}

size_t P2PCheck::pendingLocked() const {
  size_t n = 0;
  for (const Pair& p : pairs_) n = std::max(n, p.unsent.size());
  return n;
}

std::vector<std::pair<int, std::vector<uint8_t>>> P2PCheck::due(int64_t nowMs, bool flush, int64_t* nextMs) {
  std::vector<std::pair<int, std::vector<uint8_t>>> out;
  std::lock_guard<std::mutex> g(mu_);
  const size_t most = pendingLocked();  // the most any receiver waits for
  const int64_t since = nowMs - sentMs_;
  if (most == 0) {
    *nextMs = 100;
    return out;
  }
  if (!flush && most < kSignatureBatch && since < 10) {
    *nextMs = 10 - since;
    return out;
  }
  for (int q = 0; q < nranks_; ++q) {
    std::vector<OpSignature>& unsent = pairs_[size_t(q)].unsent;
    size_t taken = 0;
    do {
      const size_t n = std::min(kSignatureBatch, unsent.size() - taken);
      if (n == 0) break;
      out.emplace_back(q, encodeSignatures(std::vector<OpSignature>(unsent.begin() + ptrdiff_t(taken),
                                                                   unsent.begin() + ptrdiff_t(taken + n))));
      taken += n;
    } while (flush);
    unsent.erase(unsent.begin(), unsent.begin() + ptrdiff_t(taken));
  }
  sentMs_ = nowMs;
  *nextMs = pendingLocked() >= kSignatureBatch ? 1 : 10;
  return out;
}

bool P2PCheck::isP2PBatch(const std::vector<uint8_t>& bytes) {
  std::vector<OpSignature> sigs;
  if (!decodeSignatures(bytes, &sigs) || sigs.empty()) return false;
  for (const OpSignature& s : sigs)
    if (s.coll != uint8_t(Collective::P2P)) return false;
  return true;
}

void P2PCheck::receive(int from, const std::vector<uint8_t>& bytes) {
  std::vector<OpSignature> sigs;
  if (from < 0 || from >= nranks_ || from == rank_ || !decodeSignatures(bytes, &sigs)) return;
  std::lock_guard<std::mutex> g(mu_);
  Pair& p = pairs_[size_t(from)];
  for (const OpSignature& s : sigs) {
    if (s.coll != uint8_t(Collective::P2P) || s.root != rank_) continue;  // not a send to this rank
    if (s.seq < p.recvBase) continue;  // dropped here already (counted then)
    if (s.seq < p.recvNext) {
      compare(from, s.seq, p.recvs[size_t(s.seq - p.recvBase)], s.count);
    } else if (p.ahead.size() < kKeep || s.seq < p.ahead.rbegin()->first) {
      p.ahead[s.seq] = s.count;
      if (p.ahead.size() > kKeep) p.ahead.erase(std::prev(p.ahead.end()));  // the newest waits longest
    }
  }
}

void P2PCheck::compare(int from, uint64_t seq, Recv& mine, uint64_t theirs) {
  if (!mine.checked) mine.checked = true, --unchecked_;
  if (mine.bytes == theirs || !mismatch_.empty()) return;
  mismatch_ = strf("rank %d: mismatched send/recv: message #%llu from rank %d to rank %d on this communicator is a "
                   "send of %llu bytes on rank %d but a receive of %llu bytes on rank %d; a receive must have the "
                   "size of its send (each pair's messages match in the order they are issued)",
                   rank_, (unsigned long long)seq, from, rank_, (unsigned long long)theirs, from,
                   (unsigned long long)mine.bytes, rank_);
}

std::string P2PCheck::mismatch() const {
  std::lock_guard<std::mutex> g(mu_);
  return mismatch_;
}

size_t P2PCheck::unchecked() const {
  std::lock_guard<std::mutex> g(mu_);
  return unchecked_;
}

size_t P2PCheck::skipped() const {
  std::lock_guard<std::mutex> g(mu_);
  return skipped_;
}

void P2PCheck::awaitChecked(int64_t deadlineMs) const {
  while (unchecked() > 0 && mismatch().empty() && nowMs() < deadlineMs)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

}  // namespace loom
