"""A rank dies; the survivors shrink the loom group and go on (loom_torch.shrink).

Run by tests/shrink_continue.sh under loom-run --keep-going (torchrun would
stop the job when a rank dies).  The last rank SIGKILLs itself after the
first all-reduce; the others' next operation fails with a RuntimeError
(loom's remote error), loom_torch.shrink() gives the group of the survivors,
and collectives on it are exact, with default-group ranks for src/dst; a
second shrink of that group with an excluded rank gives that rank None.
"""
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import loom_torch

rank, n = int(os.environ["LOOM_RANK"]), int(os.environ["LOOM_WORLD_SIZE"])
dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{os.environ['TEST_STORE_PORT']}", rank=rank,
                        world_size=n, timeout=datetime.timedelta(seconds=20))
t = torch.ones(4096)
dist.all_reduce(t)
assert t[0].item() == n, t[0]
victim = n - 1
if rank == victim:
    os.kill(os.getpid(), signal.SIGKILL)

t0 = time.monotonic()
try:
    for _ in range(1000):
        dist.all_reduce(t)
    sys.exit(f"rank {rank}: 1000 all-reduces succeeded although rank {victim} died")
except RuntimeError as e:
    print(f"rank {rank}: the all-reduce failed after {1e3 * (time.monotonic() - t0):.0f} ms: {e}")
    assert "remote error" in str(e), e

new = loom_torch.shrink()
print(f"rank {rank}: shrunk group of {dist.get_world_size(new)} after {1e3 * (time.monotonic() - t0):.0f} ms")
assert new is not None
assert dist.get_world_size(new) == n - 1 and dist.get_rank(new) == rank

x = torch.full((1000,), float(rank + 1))
dist.all_reduce(x, group=new)
assert x.eq(sum(r + 1 for r in range(n - 1))).all(), x[:4]
b = torch.full((10,), 7.0) if rank == 1 else torch.zeros(10)
dist.broadcast(b, src=1, group=new)
assert b.eq(7.0).all(), b
parts = [torch.zeros(3, dtype=torch.int64) for _ in range(n - 1)]
dist.all_gather(parts, torch.full((3,), rank, dtype=torch.int64), group=new)
assert [int(p[0]) for p in parts] == list(range(n - 1)), parts
dist.barrier(group=new)

# Shrinking the shrunken group, leaving out its last member by its
# default-group rank: that rank gets None, the others a group of n - 2.
left_out = n - 2
smaller = loom_torch.shrink(new, exclude=[left_out])
if rank == left_out:
    assert smaller is None, smaller
else:
    assert smaller is not None and dist.get_world_size(smaller) == n - 2 and dist.get_rank(smaller) == rank
    y = torch.full((8,), float(rank + 1))
    dist.all_reduce(y, group=smaller)
    assert y.eq(sum(r + 1 for r in range(n - 2))).all(), y
print(f"rank {rank}: ok")
