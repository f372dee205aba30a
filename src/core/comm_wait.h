// How the shared-memory direct paths (one-shot, staged) wait for a peer:
// spin, then sleep on this rank's doorbell, checking now and then that the
// peer is alive, runs the same operation, and that the timeout has not passed.
#pragma once
#include "src/core/backoff.h"
#include "src/core/clock.h"
#include "src/core/comm.h"
#include "src/core/error.h"

template <class Ready>
void loomComm::waitFor(Ready ready, int peer, const loom::SlotTag& tag, const char* what) {
  if (ready()) return;
  loom::Backoff backoff(spinUs_, oversubscribed_);
  int64_t lastCheck = loom::nowNs();
  for (;;) {
    if (ready()) return;
    if (backoff.spin()) continue;
    int64_t now = loom::nowNs();
    if (now - lastCheck > 20 * 1000000LL) {
      lastCheck = now;
      noteWaiting(peer);
      checkAborted();
      try {
        if (peer != rank_)
          loom::shmCheckPeer(peerInbox_[size_t(peer)].get(), peer, peers_[size_t(peer)].pid, pidfds_[size_t(peer)]);
      } catch (const loom::Error&) {
        if (ready()) return;  // it finished its part before exiting
        throw;
      }
      crossPathCheck(peer, tag);
    }
    if (backoff.waited() / 1000000 > timeoutMs_)
      loom::fail(loomTimeout, "rank %d: %s made no progress for %lld ms waiting for rank %d (%s)", rank_,
           loom::describeTag(tag).c_str(), (long long)timeoutMs_, peer, what);
    uint32_t token = sleepBegin(false);
    if (ready()) {
      sleepEnd();
      return;
    }
    inbox_->sleep(token, 5000);
    sleepEnd();
  }
}

