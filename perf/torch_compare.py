"""torch.distributed collectives and DDP step time: backend loom vs gloo, same job.

Launch (or use perf/torch_compare.sh, which runs 2 and 4 ranks):
  PYTHONPATH=build/python python3 -m loom_torch.run --nproc_per_node 4 perf/torch_compare.py

Method. Both groups span the same ranks: the default group is loom, a second
one gloo. For each size (float32 sum, 8 B .. 64 MiB by x4, then 64 MiB) the
backends alternate in TRIALS trials; a trial is a barrier, then ITERS
back-to-back blocking all_reduce calls timed on each rank; the time of a trial
is the slowest rank's (max over ranks) divided by ITERS, and the median trial
is reported. algbw = bytes / time; busbw = algbw * 2 (N-1) / N (nccl-tests).
The same for all_to_all_single (size = each rank's whole buffer, busbw =
algbw (N-1)/N), reduce_scatter_tensor (size = the input) and
all_gather_into_tensor (size = the output), both busbw = algbw (N-1)/N.
PyTorch 1.13's gloo has neither of the last two: where gloo refuses them,
their rows time what a gloo user calls instead, all_reduce of the whole
input (reduce-scatter) and all_gather into a list of tensors (all-gather),
said in the table's title; where it has them (torch 2.6), gloo's own.
DDP: the MLP of python/tests/ddp_vs_gloo.py, 32x64 batches, SGD, bucket
0.1 MB (several all-reduces per step); median step time over 30 steps after
10 warm-up steps, per backend, max over ranks.
"""
import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import loom_torch  # noqa: F401

p = argparse.ArgumentParser()
p.add_argument("--max-bytes", type=int, default=64 << 20)
p.add_argument("--trials", type=int, default=5)
p.add_argument("--ddp-steps", type=int, default=30)
p.add_argument("--ops", default="all_reduce,all_to_all_single,reduce_scatter_tensor,all_gather_into_tensor",
               help="comma-separated: all_reduce, all_to_all_single, reduce_scatter_tensor, all_gather_into_tensor")
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
groups = {"loom": None, "gloo": dist.new_group(backend="gloo")}
gloo = groups["gloo"]


def slowest(seconds):
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return t.item()


def iters_for(nbytes):
    return max(3, min(200, (64 << 20) // max(nbytes, 1) // 8))


sizes = []
b = 8
while b < args.max_bytes:
    sizes.append(b)
    b *= 4
sizes.append(args.max_bytes)

def fmt_bytes(v):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v // div} {unit}"
    return f"{v} B"


# name: (make buffers for `nbytes`, run once on group g, busbw factor, gloo's stand-in if any)
def op_all_reduce(nbytes):
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    return lambda g: dist.all_reduce(x, group=g)


def op_all_to_all(nbytes):
    count = max(n, nbytes // 4 // n * n)
    x, y = torch.ones(count, dtype=torch.float32), torch.empty(count, dtype=torch.float32)
    return lambda g: dist.all_to_all_single(y, x, group=g)


def gloo_has(call):
    """Whether gloo runs `call` (torch 1.13's gloo has neither
    reduce_scatter_tensor nor all_gather_into_tensor; newer ones do). Every
    rank refuses or runs it alike, so all take the same path below."""
    try:
        call()
        return True
    except (RuntimeError, NotImplementedError):
        return False


GLOO_RS = gloo_has(lambda: dist.reduce_scatter_tensor(torch.empty(1), torch.ones(n), group=gloo))
GLOO_AG = gloo_has(lambda: dist.all_gather_into_tensor(torch.empty(n), torch.ones(1), group=gloo))


def op_reduce_scatter(nbytes):
    block = max(1, nbytes // 4 // n)
    x, y = torch.ones(block * n, dtype=torch.float32), torch.empty(block, dtype=torch.float32)
    own = lambda g: dist.reduce_scatter_tensor(y, x, group=g)  # noqa: E731
    return lambda g: own(g) if g is None or GLOO_RS else dist.all_reduce(x, group=g)


def op_all_gather(nbytes):
    block = max(1, nbytes // 4 // n)
    x, y = torch.ones(block, dtype=torch.float32), torch.empty(block * n, dtype=torch.float32)
    ys = list(y.chunk(n))
    own = lambda g: dist.all_gather_into_tensor(y, x, group=g)  # noqa: E731
    return lambda g: own(g) if g is None or GLOO_AG else dist.all_gather(ys, x, group=g)


OPS = {
    "all_reduce": (op_all_reduce, lambda: 2 * (n - 1) / n, "float32 sum"),
    "all_to_all_single": (op_all_to_all, lambda: (n - 1) / n, "float32, equal splits"),
    "reduce_scatter_tensor": (op_reduce_scatter, lambda: (n - 1) / n,
                              "float32 sum" + ("" if GLOO_RS else
                                               "; this gloo has none: gloo column = all_reduce of the input")),
    "all_gather_into_tensor": (op_all_gather, lambda: (n - 1) / n,
                               "float32" + ("" if GLOO_AG else
                                            "; this gloo has none: gloo column = all_gather into a list")),
}

for opname in args.ops.split(","):
    make, factor, what = OPS[opname]
    rows = []
    for nbytes in sizes:
        run = make(nbytes)
        iters = iters_for(nbytes)
        times = {k: [] for k in groups}
        for name, g in groups.items():  # warm-up: connections, buffers
            run(g)
        for _ in range(args.trials):
            for name, g in groups.items():
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(iters):
                    run(g)
                times[name].append(slowest((time.perf_counter() - t0) / iters))
        rows.append((nbytes, {k: statistics.median(v) for k, v in times.items()}))
    if rank == 0:
        print(f"\n## {opname} {what}, {n} ranks (torch.distributed, blocking calls)")
        print("| size | loom us | gloo us | loom busbw GB/s | gloo busbw GB/s | gloo/loom time |")
        print("|---:|---:|---:|---:|---:|---:|")
        for nbytes, t in rows:
            bus = lambda s: nbytes / s / 1e9 * factor()  # noqa: E731
            print(f"| {fmt_bytes(nbytes)} | {t['loom'] * 1e6:.1f} | {t['gloo'] * 1e6:.1f} | {bus(t['loom']):.2f} | "
                  f"{bus(t['gloo']):.2f} | {t['gloo'] / t['loom']:.2f} |", flush=True)


def ddp_step_ms(group):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    steps = []
    for i in range(10 + args.ddp_steps):
        xb, yb = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(xb), yb).backward()
        opt.step()
        if i >= 10:
            steps.append(time.perf_counter() - t0)
    return slowest(statistics.median(steps)) * 1e3


ddp = {name: ddp_step_ms(g) for name, g in groups.items()} if args.ddp_steps > 0 else None
if rank == 0 and ddp:
    print(f"\nDDP step, {n} ranks (MLP 64-256-256-10, 85 K params, bucket 0.1 MB): "
          f"loom {ddp['loom']:.2f} ms, gloo {ddp['gloo']:.2f} ms (median of {args.ddp_steps}, slowest rank)",
          flush=True)
dist.barrier(group=gloo)
# Free the DDP modules (reference cycles) so that destroy_process_group really
# destroys both groups and joins their threads: a gloo worker thread still
# alive at interpreter exit can abort the process (PyTorch 1.13, Python 3.11).
gc.collect()
dist.destroy_process_group()
