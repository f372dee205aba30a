"""A rank that does not take part: operations fail within about the group's
timeout, naming that rank; loom_torch.monitored_barrier names it too.

Run under the launcher with 3 ranks. Rank 2 stays away: from a barrier on a
loom group created with a 2 s timeout (ranks 0 and 1 must raise in 1.5-6 s
with "rank 2" in the message), then from a monitored_barrier with a 2 s
timeout (rank 0 must raise "Rank 2 failed to pass monitoredBarrier"), then
from a new loom group with a 2 s timeout (ranks 0 and 1 must raise in
1.5-6 s; rank 0 names the missing rank 2). Exits non-zero when a rank does
not see what it should.
"""
import datetime
import sys
import time

import torch
import torch.distributed as dist

import loom_torch

dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
assert n == 3, "run with 3 ranks"
failures = []
short = dist.new_group(backend="loom", timeout=datetime.timedelta(seconds=2))

# Everyone present: both barriers pass.
dist.barrier(group=short)
loom_torch.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)

# 1. A barrier rank 2 never joins.
if rank != 2:
    start = time.monotonic()
    try:
        dist.barrier(group=short)
        failures.append("barrier without rank 2 returned")
    except RuntimeError as e:
        took = time.monotonic() - start
        print(f"[rank {rank}] barrier raised after {took:.1f} s: {e}", flush=True)
        if not 1.5 <= took <= 6:
            failures.append(f"barrier raised after {took:.1f} s, not about the 2 s timeout")
        if "rank 2" not in str(e):
            failures.append(f"the error does not name rank 2: {e}")

# 2. A monitored barrier rank 2 reaches 8 s late (ranks 0 and 1 come ~2 s after it started).
if rank == 2:
    time.sleep(8)
start = time.monotonic()
try:
    loom_torch.monitored_barrier(timeout=datetime.timedelta(seconds=2))
    failures.append("monitored_barrier with a late rank passed")
except RuntimeError as e:
    took = time.monotonic() - start
    print(f"[rank {rank}] monitored_barrier raised after {took:.1f} s: {e}", flush=True)
    if rank == 0 and "Rank 2 failed to pass monitoredBarrier in 2000 ms" not in str(e):
        failures.append(f"rank 0's error does not name rank 2: {e}")
    if took > 8:
        failures.append(f"monitored_barrier raised only after {took:.1f} s")

# 3. A group rank 2 never joins: its creation fails within its timeout on
# the others (it waited for LOOM_TIMEOUT_MS, 10 minutes, before).
if rank != 2:
    start = time.monotonic()
    try:
        dist.new_group(backend="loom", timeout=datetime.timedelta(seconds=2))
        failures.append("new_group without rank 2 returned")
    except RuntimeError as e:
        took = time.monotonic() - start
        print(f"[rank {rank}] new_group raised after {took:.1f} s: {e}", flush=True)
        if not 1.5 <= took <= 6:
            failures.append(f"new_group raised after {took:.1f} s, not about the 2 s timeout")
        if rank == 0 and "missing: 2" not in str(e):
            failures.append(f"rank 0's error does not name rank 2: {e}")

# The default group is unaffected by the failed one.
t = torch.ones(4)
dist.all_reduce(t)
if not torch.equal(t, torch.full((4,), 3.0)):
    failures.append("all_reduce on the default group after the timeout")
dist.destroy_process_group()
if failures:
    print(f"[rank {rank}] FAIL: {failures}", flush=True)
    sys.exit(1)
print(f"[rank {rank}] timeouts and monitored_barrier OK", flush=True)
