// loomCommShrink: the surviving ranks agree on who is left, then build a new
// communicator of those ranks.
//
// The agreement runs on the old communicator's control sockets
// (src/core/control.h), which work whatever state its transports are in.
// Each rank keeps `out`, the set of ranks left out (the caller's exclusions,
// the dead it knows of); it only ever grows.  The coordinator is the lowest
// rank not in `out`:
//  1. every other rank connects to it and sends Join with its `out`;
//  2. the coordinator merges what it hears and waits until every rank not
//     in `out` has joined; meanwhile it probes the missing ones, and one
//     whose control socket refuses (its process is gone) joins `out`.  A rank
//     still missing when the communicator's timeout passes joins it too;
//  3. it sends Propose(out) to every member; each merges and answers Ack
//     with its own set; if an Ack adds ranks, or a member's connection
//     breaks, it starts over (at 2, for a broken connection);
//  4. when every member acked the proposed set unchanged it sends
//     Commit(out, new unique id); the new communicator's bootstrap root is
//     the coordinator (new rank 0).
// A member whose coordinator's connection breaks probes it: gone, it joins
// `out` and the next lowest rank coordinates; alive (it started over), the
// member joins again.  A member that dies after agreeing makes the new
// communicator's bootstrap fail (the root probes the ranks it waits for),
// and everyone starts over with that rank out.  Every wait is bounded by
// the deadline, twice the communicator's timeout.
//
// A network cut: a rank on the far side neither answers nor refuses (no
// proof that it is dead), and may agree with the ranks on its side on a
// communicator of their own.  So a communicator is only built by a side
// with more members than the ranks it left out and cannot reach (a refusal
// or an answer settles a rank; silence counts against): the coordinator
// probes the left-out ranks before committing whenever the members are not
// a majority, and sends Refuse instead; a member that cannot reach its
// coordinator asks every other rank at once, so that a rank cut off from
// all others fails within about three seconds instead of dialling each in
// turn.  Two equal halves both fail.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/error.h"
#include "src/core/log.h"

using namespace loom;

namespace {

std::string listRanks(const std::set<int>& s) {
  std::string t;
  for (int r : s) t += strf(" %d", r);
  return t.empty() ? " none" : t;
}

}  // namespace

std::shared_ptr<loomComm> loomComm::shrink(const std::vector<int>& exclude) {
  const int N = nranks_, me = rank_;
  std::set<int> out(exclude.begin(), exclude.end());
  std::set<int> silentOut;  // left out because they neither answered nor refused (a subset of out)
  if (out.count(me)) return nullptr;
  const int64_t T = timeoutMs();
  const int64_t deadline = nowMs() + 2 * T;
  for (int r : deadRanks()) out.insert(r);
  Control& ctl = *ctl_;
  // Who this rank leaves out, for a coordinator that waits for it in vain
  // (below), numbered: a rank asked about a shrink it has not entered yet
  // answers with its previous one's set, no evidence against this one.
  const uint32_t round = ++shrinkRounds_;
  // A live rank others left out never entered their shrink, so its count
  // falls behind theirs: their answer "shrink `round` done without you"
  // may be that earlier one, which their coordinator told it about.  It is
  // if this rank has issued collectives on the communicator since then
  // (else the shrinks are one call whose lists differ).
  uint64_t collSeqNow;
  {
    std::lock_guard<SeqLock> lock(seqMutex_);
    collSeqNow = collSeq_;
  }
  auto satOutEarlier = [&](uint32_t theirRound) {
    std::lock_guard<std::mutex> lock(satOutMutex_);
    return satOut_.round == theirRound && collSeqNow > satOut_.collSeq;
  };
  ctl.setShrinking(true, std::vector<int>(out.begin(), out.end()), round);
  struct Done {
    Control& c;
    const std::set<int>& out;
    uint32_t round;
    ~Done() { c.setShrinking(false, std::vector<int>(out.begin(), out.end()), round); }  // the set it ended with
  } done{ctl, out, round};
  auto merge = [&](const std::vector<int>& v) {
    bool grew = false;
    for (int r : v)
      if (r >= 0 && r < N && r != me) grew |= out.insert(r).second;
    return grew;
  };
  // The ranks of `who` whose probe ended as `verdict`.
  auto probeFor = [&](const std::set<int>& who, int64_t ms, Reach verdict) {
    std::vector<bool> to(size_t(N), false);
    for (int r : who) to[size_t(r)] = r != me;
    std::vector<Reach> reach = ctl.broadcast(CtlMsg{CtlType::Probe, me, {}, {}}, to, nowMs() + ms);
    std::set<int> found;
    for (int r : who)
      if (r != me && reach[size_t(r)] == verdict) found.insert(r);
    return found;
  };
  auto probe = [&](const std::set<int>& who, int64_t ms) { return probeFor(who, ms, Reach::Refused); };
  auto minority = [&](const std::set<int>& silent, int members) {
    return strf("rank %d: loomCommShrink: ranks%s are unreachable (their control sockets neither answer nor "
                "refuse, as across a network cut) and the %d ranks left are not more than they are: no "
                "communicator is built on what may be the smaller side of a partition",
                me, listRanks(silent).c_str(), members);
  };
  auto outMsg = [&](CtlType t) {
    CtlMsg m;
    m.type = t;
    m.from = me;
    m.ranks.assign(out.begin(), out.end());
    return m;
  };

  // The coordinator's side; true with *id once committed.
  auto coordinate = [&](UniqueIdData* id) {
    std::map<int, int> joined;  // rank -> its Join connection
    std::set<int> askedState;   // pending ranks asked whether they shrink without this rank
    std::set<int> notYet;       // ... that answered from an earlier shrink (or none)
    std::set<int> answered;     // ... that answered at all
    // Alive and in this same shrink (or done with it) without this rank: the
    // ranks passed different lists and follow another coordinator; going
    // on would build a second communicator beside theirs.  A rank that does
    // not answer within 200 ms is not asked again.
    auto checkTheirShrink = [&](int r) {
      bool active = false;
      std::vector<int> theirs;
      uint32_t theirRound = 0;
      notYet.erase(r);
      if (ctl.askShrinking(r, &active, &theirs, &theirRound, std::min(deadline, nowMs() + 200)) != Reach::Acked)
        return;
      answered.insert(r);
      if (theirRound < round) {
        notYet.insert(r);
        return;
      }
      const bool withoutMe = std::find(theirs.begin(), theirs.end(), me) != theirs.end();
      if (theirRound == round && withoutMe && !active && satOutEarlier(theirRound)) {
        notYet.insert(r);  // the shrink this rank sat out, not this one: r has not entered this one yet
        return;
      }
      if (theirRound == round && withoutMe)
        fail(loomInvalidUsage,
             "rank %d: loomCommShrink: rank %d %s without this rank (it leaves out%s; this rank leaves out%s): every "
             "remaining rank must pass the same excludeRanks",
             me, r, active ? "is shrinking" : "shrank this communicator",
             listRanks(std::set<int>(theirs.begin(), theirs.end())).c_str(), listRanks(out).c_str());
    };
    auto dropMember = [&](int r, bool excluded) {
      auto it = joined.find(r);
      if (it == joined.end()) return;
      if (excluded) {
        try {
          ctl.send(it->second, outMsg(CtlType::Excluded), nowMs() + 200);
        } catch (const Error&) {
        }
      }
      close(it->second);
      joined.erase(it);
    };
    auto dropOut = [&]() {
      for (int r : std::vector<int>(out.begin(), out.end())) dropMember(r, true);
    };
    try {
      const int64_t agreeBy = std::min(deadline, nowMs() + T);
      int64_t nextProbe = nowMs();  // at once: a rank shrinking without this one may be done in milliseconds
      for (;;) {
        // ---- 2: wait for every rank not out ----
        for (;;) {
          std::set<int> pending;
          for (int r = 0; r < N; ++r)
            if (r != me && !out.count(r) && !joined.count(r)) pending.insert(r);
          if (pending.empty()) break;
          int64_t now = nowMs();
          if (now >= deadline)
            fail(loomTimeout, "rank %d: loomCommShrink: ranks%s never joined", me,
                 listRanks(pending).c_str());
          if (now >= agreeBy) {
            // Once more before leaving them out: those that had not entered
            // this shrink when first asked, and those whose answer never
            // came (under load the first question's 200 ms may pass): a
            // live rank shrinking without this one follows another
            // coordinator, and going on would build a second communicator.
            for (int r : pending)
              if (notYet.count(r) || !answered.count(r)) checkTheirShrink(r);
            LOOM_WARN("SHRINK", "rank %d: ranks%s did not join the shrink in %lld ms; leaving them out", me,
                      listRanks(pending).c_str(), (long long)T);
            for (int r : pending) out.insert(r);
            dropOut();
            continue;
          }
          int fd;
          CtlMsg m;
          if (ctl.nextJoin(&fd, &m, std::min(agreeBy, now + 20))) {
            if (out.count(m.from)) {
              try {
                ctl.send(fd, outMsg(CtlType::Excluded), nowMs() + 200);
              } catch (const Error&) {
              }
              close(fd);
              continue;
            }
            dropMember(m.from, false);  // an older connection of the same rank
            joined[m.from] = fd;
            if (merge(m.ranks)) dropOut();
          }
          // A member sends nothing after Join: anything readable is its end.
          for (auto it = joined.begin(); it != joined.end();) {
            pollfd p{it->second, POLLIN, 0};
            if (poll(&p, 1, 0) > 0) {
              close(it->second);
              it = joined.erase(it);
            } else {
              ++it;
            }
          }
          if (nowMs() >= nextProbe && !pending.empty()) {
            std::set<int> gone = probe(pending, 300);
            if (!gone.empty()) {
              LOOM_INFO("SHRINK", "rank %d: ranks%s are gone", me, listRanks(gone).c_str());
              out.insert(gone.begin(), gone.end());
            }
            for (int r : pending)
              if (!gone.count(r) && askedState.insert(r).second) checkTheirShrink(r);
            nextProbe = nowMs() + 100;
          }
        }
        // ---- 3: propose until every member acks the same set ----
        bool restart = false;
        for (;;) {
          CtlMsg prop = outMsg(CtlType::Propose);
          std::vector<int> broken;
          bool grew = false;
          for (auto& kv : joined) {
            try {
              ctl.send(kv.second, prop, std::min(deadline, nowMs() + T));
            } catch (const Error&) {
              broken.push_back(kv.first);
            }
          }
          for (auto& kv : joined) {
            if (std::find(broken.begin(), broken.end(), kv.first) != broken.end()) continue;
            CtlMsg ack;
            if (!ctl.recv(kv.second, &ack, deadline) || ack.type != CtlType::Ack)
              broken.push_back(kv.first);
            else
              grew |= merge(ack.ranks);
          }
          if (!broken.empty()) {
            for (int r : broken) dropMember(r, false);
            std::set<int> gone = probe(std::set<int>(broken.begin(), broken.end()), 500);
            out.insert(gone.begin(), gone.end());
            dropOut();
            restart = true;
            break;
          }
          if (!grew) break;
          dropOut();
        }
        if (restart) continue;
        // ---- the smaller side of a cut does not go on ----
        const int members = N - int(out.size());
        if (members <= int(out.size())) {
          std::set<int> silent = probeFor(out, 500, Reach::Timeout);
          if (members <= int(silent.size())) {
            CtlMsg refuse;
            refuse.type = CtlType::Refuse;
            refuse.from = me;
            refuse.ranks.assign(silent.begin(), silent.end());
            for (auto& kv : joined) {
              try {
                ctl.send(kv.second, refuse, nowMs() + 200);
              } catch (const Error&) {
              }
              close(kv.second);
            }
            joined.clear();
            fail(loomRemoteError, "%s", minority(silent, members).c_str());
          }
        }
        // ---- 4: commit ----
        loomUniqueId uid;
        makeUniqueId(&uid);
        *id = decodeUniqueId(uid);
        CtlMsg commit = outMsg(CtlType::Commit);
        commit.extra.assign(reinterpret_cast<const uint8_t*>(&uid),
                            reinterpret_cast<const uint8_t*>(&uid) + sizeof uid);
        for (auto& kv : joined) {
          try {
            ctl.send(kv.second, commit, nowMs() + 1000);
          } catch (const Error&) {
            // It will be missing from the new communicator's bootstrap.
          }
          close(kv.second);
        }
        joined.clear();
        // The live ranks left out (by the lists, or late) are told which
        // shrink this was and where the collectives stood (satOutEarlier
        // above).  Not the ones found dead or silent; nobody waits for the
        // answers.
        std::vector<bool> to(size_t(N), false);
        bool any = false;
        {
          const std::set<int> dead = deadRanks();
          for (int r : out)
            if (!silentOut.count(r) && !dead.count(r))
              to[size_t(r)] = any = true;
        }
        if (any) {
          CtlMsg told{CtlType::ShrankWithout, me, {}, {}};
          told.extra.resize(sizeof round + sizeof collSeqNow);
          memcpy(told.extra.data(), &round, sizeof round);
          memcpy(told.extra.data() + sizeof round, &collSeqNow, sizeof collSeqNow);
          ctl.broadcastAsync(told, to, nowMs() + 1000, [](const std::vector<Reach>&) {});
        }
        return true;
      }
    } catch (...) {
      for (auto& kv : joined) close(kv.second);
      throw;
    }
  };

  // A member's side: true with *id once committed, *excluded when left out;
  // false to start over (with `out` updated).
  auto follow = [&](int coord, UniqueIdData* id, bool* excluded) {
    int fd;
    try {
      fd = ctl.dial(coord, std::min(deadline, nowMs() + 2000));
    } catch (const Error& e) {
      // No answer at all: unreachable.  If a cut is the reason, the others
      // may be beyond it too: ask them all at once rather than one by one.
      LOOM_WARN("SHRINK", "rank %d: the coordinator, rank %d, is unreachable (%s)", me, coord, e.what());
      out.insert(coord);
      silentOut.insert(coord);
      std::set<int> rest;
      for (int r = 0; r < N; ++r)
        if (r != me && !out.count(r)) rest.insert(r);
      if (!rest.empty()) {
        std::vector<bool> to(size_t(N), false);
        for (int r : rest) to[size_t(r)] = true;
        std::vector<Reach> reach =
            ctl.broadcast(CtlMsg{CtlType::Probe, me, {}, {}}, to, std::min(deadline, nowMs() + 1000));
        for (int r : rest) {
          if (reach[size_t(r)] == Reach::Acked) continue;
          out.insert(r);
          if (reach[size_t(r)] == Reach::Timeout) silentOut.insert(r);
        }
      }
      return false;
    }
    if (fd < 0) {
      out.insert(coord);
      return false;
    }
    struct Closer {
      int fd;
      ~Closer() { close(fd); }
    } closer{fd};
    try {
      ctl.send(fd, outMsg(CtlType::Join), std::min(deadline, nowMs() + 2000));
    } catch (const Error& e) {
      if (e.code() == loomTimeout) throw;
    }
    for (;;) {
      CtlMsg m;
      if (!ctl.recv(fd, &m, deadline)) {
        if (!probe({coord}, 500).empty())
          out.insert(coord);
        else
          usleep(10000);  // it started over: join again
        return false;
      }
      if (m.type == CtlType::Propose) {
        merge(m.ranks);
        ctl.send(fd, outMsg(CtlType::Ack), deadline);
      } else if (m.type == CtlType::Commit) {
        if (m.extra.size() != sizeof(loomUniqueId))
          fail(loomRemoteError, "rank %d: loomCommShrink: the coordinator (rank %d) sent a bad commit", me,
               coord);
        out.clear();
        for (int r : m.ranks)
          if (r >= 0 && r < N) out.insert(r);
        loomUniqueId uid;
        memcpy(&uid, m.extra.data(), sizeof uid);
        *id = decodeUniqueId(uid);
        if (out.count(me)) *excluded = true;
        return true;
      } else if (m.type == CtlType::Excluded) {
        *excluded = true;
        return true;
      } else if (m.type == CtlType::Refuse) {
        std::set<int> silent;
        for (int r : m.ranks)
          if (r >= 0 && r < N) silent.insert(r);
        fail(loomRemoteError, "%s (found by the coordinator, rank %d)", minority(silent, N - int(out.size())).c_str(),
             coord);
      }
    }
  };

  int fruitless = 0;
  for (;;) {
    if (nowMs() >= deadline)
      fail(loomTimeout, "rank %d: loomCommShrink reached no agreement in %lld ms (left out so far:%s)", me,
           (long long)(2 * T), listRanks(out).c_str());
    if (N - int(out.size()) <= int(silentOut.size()))
      fail(loomRemoteError, "%s", minority(silentOut, N - int(out.size())).c_str());
    int coord = 0;
    while (out.count(coord)) ++coord;
    UniqueIdData id{};
    bool excluded = false;
    bool agreed = coord == me ? coordinate(&id) : follow(coord, &id, &excluded);
    if (!agreed) continue;
    if (excluded) {
      LOOM_WARN("SHRINK", "rank %d: left out of the shrunken communicator", me);
      return nullptr;
    }
    std::vector<int> members;
    for (int r = 0; r < N; ++r)
      if (!out.count(r)) members.push_back(r);
    int newRank = int(std::find(members.begin(), members.end(), me) - members.begin());
    // The root gives up on a member whose process is gone (it agreed, then died).
    BootCheck check = [&](const std::vector<bool>& joined) {
      std::set<int> missing;
      for (size_t i = 0; i < joined.size() && i < members.size(); ++i)
        if (!joined[i]) missing.insert(members[i]);
      if (missing.empty()) return;
      std::set<int> gone = probe(missing, 200);
      if (!gone.empty())
        fail(loomRemoteError, "rank %d: ranks%s died during loomCommShrink", me, listRanks(gone).c_str());
    };
    try {
      std::shared_ptr<loomComm> c = create(id, int(members.size()), newRank, check, deviceRequest());
      c->setTimeoutMs(T);
      LOOM_INFO("SHRINK", "rank %d: now rank %d of %d; left out:%s", me, newRank, int(members.size()),
                listRanks(out).c_str());
      return c;
    } catch (const Error& e) {
      std::set<int> alive;
      for (int r : members)
        if (r != me) alive.insert(r);
      std::set<int> gone = probe(alive, 500);
      LOOM_WARN("SHRINK", "rank %d: building the shrunken communicator failed (%s); gone since:%s", me,
                e.what(), listRanks(gone).c_str());
      out.insert(gone.begin(), gone.end());
      if (gone.empty() && ++fruitless >= 3) throw;
    }
  }
}
