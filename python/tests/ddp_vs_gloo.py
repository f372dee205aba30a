"""PyTorch's DistributedDataParallel with backend loom trains like gloo.

Run under the launcher:  python3 -m loom_torch.run --standalone --nproc_per_node N ddp_vs_gloo.py [STEPS]
Trains the same small MLP from the same initial weights on the same per-rank
batches twice in one job: DDP over the loom default group, then DDP over a
gloo group of the same ranks. After STEPS SGD steps the parameters must be
equal within tolerance on every rank, and equal across ranks. Each rank's
initial weights differ on purpose (seeded by rank): DDP's broadcast from rank
0 must make them equal. Also checks that training actually moved the
weights, and prints the mean step time of each backend.
"""
import gc
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import loom_torch  # noqa: F401

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
torch.set_num_threads(1)


def model_for_rank():
    torch.manual_seed(100 + rank)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def batches():
    g = torch.Generator().manual_seed(7 + rank)
    return [(torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(STEPS)]


def train(group):
    model = model_for_rank()
    # A small bucket so that a step runs several all-reduces.
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    start_params = [p.detach().clone() for p in model.parameters()]
    times = []
    for x, y in batches():
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return start_params, [p.detach().clone() for p in model.parameters()], times


loom_start, loom_end, loom_times = train(None)
gloo_start, gloo_end, gloo_times = train(gloo)

failures = []
for i, (a, b) in enumerate(zip(loom_start, gloo_start)):
    if not torch.equal(a, b):
        failures.append(f"param {i}: initial weights after DDP's broadcast differ")
for i, (a, b) in enumerate(zip(loom_end, gloo_end)):
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
        failures.append(f"param {i}: loom vs gloo max diff {(a - b).abs().max().item():.3g}")
moved = max((a - b).abs().max().item() for a, b in zip(loom_start, loom_end))
if moved < 1e-3:
    failures.append(f"training did not move the weights (max change {moved:.3g})")
# Equal across ranks: rank 0's parameters, broadcast over gloo, match mine.
for i, p in enumerate(loom_end):
    ref = p.clone()
    dist.broadcast(ref, src=0, group=gloo)
    if not torch.equal(ref, p):
        failures.append(f"param {i}: rank {rank} differs from rank 0 after training with loom")

mid = slice(len(loom_times) // 4, None)  # leave out the warm-up steps
ms = lambda ts: 1000 * sorted(ts[mid])[len(ts[mid]) // 2]  # noqa: E731
print(f"[rank {rank}] {n} ranks, {STEPS} steps: median step loom {ms(loom_times):.2f} ms, gloo {ms(gloo_times):.2f} ms;"
      f" weights moved by up to {moved:.3g}", flush=True)
dist.barrier(group=gloo)
# Free the DDP modules (reference cycles) so that destroy_process_group really
# destroys both groups and joins their threads: a gloo worker thread still
# alive at interpreter exit can abort the process (PyTorch 1.13, Python 3.11).
gc.collect()
dist.destroy_process_group()
if failures:
    print(f"[rank {rank}] FAIL: " + "; ".join(failures), flush=True)
    sys.exit(1)
print(f"[rank {rank}] DDP with loom equals DDP with gloo", flush=True)
