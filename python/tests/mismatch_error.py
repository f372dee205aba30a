"""Ranks that disagree get a clear error from the loom backend, not a hang.

Run under the launcher with 2+ ranks. Rank 0 all-reduces 10 elements, the
others 20: loom detects the mismatch (loomInvalidUsage) and every rank's
work.wait() raises a RuntimeError naming loom and the cause; later calls on
the failed group raise too. Gloo, in the same job, still works.
"""
import gc
import sys

import torch
import torch.distributed as dist

import loom_torch  # noqa: F401

dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
ok = True

try:
    dist.all_reduce(torch.ones(10 if rank == 0 else 20))
    print(f"[rank {rank}] FAIL: mismatched all_reduce did not raise", flush=True)
    ok = False
except RuntimeError as e:
    msg = str(e)
    print(f"[rank {rank}] mismatched all_reduce raised: {msg.splitlines()[0][:300]}", flush=True)
    if "loom" not in msg or "invalid usage" not in msg:
        print(f"[rank {rank}] FAIL: the error does not say loom / invalid usage", flush=True)
        ok = False

try:
    dist.all_reduce(torch.ones(4))
    print(f"[rank {rank}] FAIL: a call on the failed group did not raise", flush=True)
    ok = False
except RuntimeError as e:
    print(f"[rank {rank}] later call raised: {str(e).splitlines()[0][:200]}", flush=True)

t = torch.ones(3)
dist.all_reduce(t, group=gloo)
ok = ok and torch.equal(t, torch.full((3,), float(n)))
gc.collect()
dist.destroy_process_group()
print(f"[rank {rank}] {'ok' if ok else 'FAILED'}", flush=True)
sys.exit(0 if ok else 1)
