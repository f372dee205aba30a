#!/usr/bin/env python3
"""torch.distributed's backend "nccl" on loom's NCCL shim, 2 ranks on one GPU.

NCCL itself refuses two ranks on one GPU ("Duplicate GPU detected"); loom's
CUDA communicators allow it.  Every rank uses cuda:0.  Each collective's
result on the default group (backend "nccl": the shim) is compared with a
reference computed from every rank's input (gathered through a gloo group;
small integers, so every type's result is exact); an all_reduce and an
all_gather captured into a CUDA graph are replayed with new inputs; then a
short DDP
run on the shim is compared with the same run whose gradients gloo reduces
(within 1e-5).  Exits non-zero on any difference.  tests/gpu/torch.sh runs it
twice: as is, and with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 (torch
registers its allocator's segments, so loom's device zero-copy reads them in
place; empty_cache between the two parts deregisters them).

On the GPU machine (docs/nccl.md, "On a GPU machine"):
    LD_PRELOAD=$PWD/build-gpu/lib/libloom_nccl.so NCCL_DEBUG=VERSION \
        torchrun --standalone --nproc-per-node 2 tests/gpu/nccl_shim_torch.py
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

failures = []


def check(name, got, want, exact=True):
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape == want.shape and (torch.equal(got, want) if exact else torch.allclose(got, want, 1e-5, 1e-6)):
        return
    diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
    failures.append(f"{name}: differs from the reference (max |diff| {diff}, shapes {tuple(got.shape)} "
                    f"{tuple(want.shape)})")


def gathered(x, world, gloo):
    """Every rank's x (as int64, through gloo): the reference's inputs."""
    parts = [torch.empty_like(x, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(parts, x.to(torch.int64), group=gloo)
    return parts


def collectives(rank, world, dev, gloo):
    g = torch.Generator().manual_seed(1234 + rank)
    # Small integers in every type (bfloat16 holds them exactly up to 256):
    # any reduction order gives the same bits, so results are compared exactly.
    n = 1 << 20
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        x = torch.randint(-60, 60, (n,), generator=g)
        parts = torch.stack(gathered(x, world, gloo))
        for op, ref in ((dist.ReduceOp.SUM, parts.sum(0)), (dist.ReduceOp.MAX, parts.max(0).values),
                        (dist.ReduceOp.MIN, parts.min(0).values)):
            a = x.to(dtype).to(dev)
            dist.all_reduce(a, op=op)
            check(f"all_reduce {dtype} {op}", a, ref.to(dtype))
        if dtype.is_floating_point:
            a = x.to(dtype).to(dev)
            dist.all_reduce(a, op=dist.ReduceOp.AVG)
            check(f"all_reduce {dtype} AVG", a, (parts.sum(0).double() / world).to(dtype))
    m = 4096
    x = torch.randint(-1000, 1000, (m,), generator=g).float()
    parts = gathered(x, world, gloo)
    out = torch.empty(world * m, device=dev)
    dist.all_gather_into_tensor(out, x.to(dev))
    check("all_gather_into_tensor", out, torch.cat(parts).float())
    big = torch.randint(-1000, 1000, (world * m,), generator=g).float()
    bigs = gathered(big, world, gloo)
    rs = torch.empty(m, device=dev)
    dist.reduce_scatter_tensor(rs, big.to(dev))
    check("reduce_scatter_tensor", rs, torch.stack(bigs).sum(0)[rank * m:(rank + 1) * m].float())
    # PreMulSum (ncclRedOpCreatePreMulSum), as FSDP2 reduce-scatters its
    # gradients with a custom divide factor: each input times 0.25 (exact
    # for these integers), then summed; a bfloat16 one too.
    rs = torch.empty(m, device=dev)
    dist.reduce_scatter_tensor(rs, big.to(dev), op=dist._make_nccl_premul_sum(0.25))
    check("reduce_scatter_tensor PREMUL_SUM(0.25)", rs,
          (torch.stack(bigs).double() * 0.25).sum(0)[rank * m:(rank + 1) * m].float())
    small = x.remainder(64)  # bfloat16 holds these, their halves and the sums exactly
    a = small.to(torch.bfloat16).to(dev)
    dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5))
    check("all_reduce bfloat16 PREMUL_SUM(0.5)", a,
          (torch.stack(parts).double().remainder(64) * 0.5).sum(0).to(torch.bfloat16))
    bc = x.to(dev) if rank == 1 else torch.zeros(m, device=dev)
    dist.broadcast(bc, src=1)
    check("broadcast from rank 1", bc, parts[1].float())
    red = x.to(dev)
    dist.reduce(red, dst=0)
    if rank == 0:
        check("reduce to rank 0", red, torch.stack(parts).sum(0).float())
    a2a = torch.empty(world * m, device=dev)
    dist.all_to_all_single(a2a, big.to(dev))
    check("all_to_all_single", a2a, torch.cat([b[rank * m:(rank + 1) * m] for b in bigs]).float())
    peer, src = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(m, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.to(dev), peer), dist.P2POp(dist.irecv, got, src)])
    for r in reqs:
        r.wait()
    check("send/recv ring (batch_isend_irecv)", got, parts[src].float())
    torch.cuda.synchronize()


def graphs(rank, world, dev, gloo):
    """An all_reduce, an all_gather, an all_to_all_single with uneven
    splits (grouped sends and receives) and a PreMulSum all_reduce
    captured into a CUDA graph
    (torch.cuda.graph, global capture mode: loom's graph lane), replayed
    three times with new inputs: exact each time."""
    g = torch.Generator().manual_seed(4321 + rank)
    m, k = 1 << 16, 1024
    x = torch.zeros(m, device=dev)
    y = torch.empty(world * k, device=dev)
    # all_to_all_single: rank r sends (r + q + 1) * 1000 elements to rank q.
    split_out = [(rank + q + 1) * 1000 for q in range(world)]
    split_in = [(q + rank + 1) * 1000 for q in range(world)]
    a2a_in = torch.zeros(sum(split_out), device=dev)
    a2a_out = torch.empty(sum(split_in), device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch asks before a capture
        a = x * 2
        dist.all_reduce(a)
        dist.all_to_all_single(a2a_out, a2a_in, split_in, split_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = x * 2
        dist.all_reduce(a)
        dist.all_gather_into_tensor(y, a[:k])
        dist.all_to_all_single(a2a_out, a2a_in, split_in, split_out)
        h = x * 2  # a PreMulSum all-reduce (scaled into its output in a capture)
        dist.all_reduce(h, op=dist._make_nccl_premul_sum(0.5))
    for rep in range(1, 4):
        vals = torch.randint(-50, 50, (m,), generator=g)
        x.copy_(vals.float().to(dev))
        a2a_in.copy_(vals[: a2a_in.numel()].float().to(dev) + 1000 * rank)
        graph.replay()
        torch.cuda.synchronize()
        every = gathered(vals, world, gloo)
        want = (torch.stack(every) * 2).sum(0).float()
        check(f"CUDA graph replay {rep}: all_reduce", a, want)
        check(f"CUDA graph replay {rep}: all_gather_into_tensor", y, torch.cat([want[:k]] * world))
        check(f"CUDA graph replay {rep}: all_reduce PREMUL_SUM(0.5)", h, want * 0.5)
        # Rank q's a2a_in is its vals' first elements plus 1000 q; its block
        # for this rank starts after its blocks for ranks 0 .. rank - 1.
        blocks = []
        for q, v in enumerate(every):
            off = sum((q + j + 1) * 1000 for j in range(rank))
            blocks.append(v[off: off + (q + rank + 1) * 1000].float() + 1000 * q)
        want_a2a = torch.cat(blocks)
        check(f"CUDA graph replay {rep}: all_to_all_single with uneven splits", a2a_out, want_a2a)


def ddp(rank, dev, gloo):
    def run(group):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(dev)
        net = DDP(model, device_ids=[0], process_group=group)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(99 + rank)  # each rank its own data
        for _ in range(10):
            xb = torch.randn(32, 64, generator=g).to(dev)
            yb = torch.randn(32, 1, generator=g).to(dev)
            opt.zero_grad()
            nn.functional.mse_loss(net(xb), yb).backward()
            opt.step()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    shim = run(None)  # the default group: backend "nccl", the shim
    ref = run(gloo)
    for i, (a, b) in enumerate(zip(shim, ref)):
        check(f"DDP parameter {i} after 10 steps (gloo reducing the gradients as reference)", a, b, exact=False)


def main():
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)  # every rank on the one GPU
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo")
    print(f"rank {rank}/{world}: torch {torch.__version__}, NCCL version reported "
          f"{torch.cuda.nccl.version()}, device {torch.cuda.get_device_name(0)}", flush=True)
    collectives(rank, world, dev, gloo)
    graphs(rank, world, dev, gloo)
    # Give the allocator's segments back to CUDA: with
    # TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 each is deregistered
    # (the peer unmaps what was published), and DDP's tensors then come
    # from new segments, often at the same addresses.
    torch.cuda.empty_cache()
    ddp(rank, dev, gloo)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    for f in failures:
        print(f"rank {rank}: FAIL {f}", flush=True)
    print(f"rank {rank}: {'OK' if not failures else 'FAILED'}: collectives and DDP on the shim match gloo",
          flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
