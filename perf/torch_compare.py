"""torch.distributed all_reduce and DDP step time: backend loom vs gloo, same job.

Launch (or use perf/torch_compare.sh, which runs 2 and 4 ranks):
  PYTHONPATH=build/python python3 -m loom_torch.run --nproc_per_node 4 perf/torch_compare.py

Method. Both groups span the same ranks: the default group is loom, a second
one gloo. For each size (float32 sum, 8 B .. 64 MiB by x4, then 64 MiB) the
backends alternate in TRIALS trials; a trial is a barrier, then ITERS
back-to-back blocking all_reduce calls timed on each rank; the time of a trial
is the slowest rank's (max over ranks) divided by ITERS, and the median trial
is reported. algbw = bytes / time; busbw = algbw * 2 (N-1) / N (nccl-tests).
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

rows = []
for nbytes in sizes:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    iters = iters_for(nbytes)
    times = {k: [] for k in groups}
    for name, g in groups.items():  # warm-up: connections, buffers
        dist.all_reduce(x, group=g)
    for _ in range(args.trials):
        for name, g in groups.items():
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x, group=g)
            times[name].append(slowest((time.perf_counter() - t0) / iters))
    rows.append((nbytes, {k: statistics.median(v) for k, v in times.items()}))


def fmt_bytes(v):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v // div} {unit}"
    return f"{v} B"


if rank == 0:
    print(f"\n## all_reduce float32 sum, {n} ranks (torch.distributed, blocking calls)")
    print("| size | loom us | gloo us | loom busbw GB/s | gloo busbw GB/s | gloo/loom time |")
    print("|---:|---:|---:|---:|---:|---:|")
    for nbytes, t in rows:
        bus = lambda s: nbytes / s / 1e9 * 2 * (n - 1) / n  # noqa: E731
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


ddp = {name: ddp_step_ms(g) for name, g in groups.items()}
if rank == 0:
    print(f"\nDDP step, {n} ranks (MLP 64-256-256-10, 85 K params, bucket 0.1 MB): "
          f"loom {ddp['loom']:.2f} ms, gloo {ddp['gloo']:.2f} ms (median of {args.ddp_steps}, slowest rank)",
          flush=True)
dist.barrier(group=gloo)
# Free the DDP modules (reference cycles) so that destroy_process_group really
# destroys both groups and joins their threads: a gloo worker thread still
# alive at interpreter exit can abort the process (PyTorch 1.13, Python 3.11).
gc.collect()
dist.destroy_process_group()
