"""A group's whole life, many times over: init, all_reduce, broadcast,
all_gather on a few sizes and dtypes, barrier, destroy_process_group.

Run under the launcher:  python3 -m loom_torch.run --nproc_per_node 3 lifecycle_stress.py [ROUNDS]
Each rank runs ROUNDS (default 30) rounds in one process (torch is imported
once, so 30 rounds take seconds); every round meets through its own prefix of
torchrun's store. Before the fix of issue 17 about 1 round in 6 died with
"terminate called ... Resource deadlock avoided": a work released on the
group's completer thread after destroy_process_group ran the group's
destructor there, which joined that thread. Half the operations are issued
with async_op=True and their works dropped without waiting, so the completer
is the one that releases them. Exits non-zero on a wrong result or an error.
"""
import datetime
import faulthandler
import os
import sys

import torch
import torch.distributed as dist

import loom_torch  # registers "loom"

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
# A hang prints every thread's stack and fails instead of waiting for ctest.
faulthandler.dump_traceback_later(5 * rounds + 60, exit=True)
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# A torch built without libuv (Debian 13's) needs the plain store asked for
# (older torch has no such option).
plain = {"use_libuv": False} if loom_torch._libuv.lacks_libuv() else {}
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), n, False,
                      timeout=datetime.timedelta(seconds=60), **plain)


def expect(name, got, want):
    if not torch.equal(got, want):
        print(f"[rank {rank}] FAIL round {r} {name}: {got.flatten()[:6]} != {want.flatten()[:6]}", flush=True)
        sys.exit(1)


for r in range(rounds):
    dist.init_process_group("loom", store=dist.PrefixStore(f"round{r}", store), rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    asynchronous = r % 2 == 1
    for dtype in (torch.float32, torch.int64, torch.float64):
        for count in (1, 1000, 70001):
            t = torch.full((count,), rank + 1, dtype=dtype)
            dist.all_reduce(t, async_op=asynchronous)
            if asynchronous:
                dist.barrier()  # the all_reduce was issued before it: done when the barrier is
            expect("all_reduce", t, torch.full((count,), n * (n + 1) // 2, dtype=dtype))
            b = torch.full((count,), rank, dtype=dtype)
            work = dist.broadcast(b, src=r % n, async_op=asynchronous)
            if work is not None:
                work.wait()
            expect("broadcast", b, torch.full((count,), r % n, dtype=dtype))
            outs = [torch.empty(count, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, torch.full((count,), rank, dtype=dtype))
            for i, o in enumerate(outs):
                expect("all_gather", o, torch.full((count,), i, dtype=dtype))
    if asynchronous:
        dist.all_reduce(torch.ones(8), async_op=True)  # dropped: the completer releases it
    dist.barrier()
    dist.destroy_process_group()
    print(f"[rank {rank}] round {r} done", flush=True)

print(f"[rank {rank}] {rounds} rounds OK", flush=True)
