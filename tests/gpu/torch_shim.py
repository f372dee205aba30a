"""PyTorch's "nccl" backend on loom's NCCL drop-in, 2 ranks on one GPU (issue 16).

Run on the GPU machine through tests/gpu/torch.sh, which builds the shim and
sets LD_PRELOAD=libloom_nccl.so and LOOM_DEVICE=cuda, so the libnccl that
torch loads resolves to loom (NCCL itself refuses two ranks on one GPU:
"Duplicate GPU detected").

Each rank runs every collective through the "nccl" group on cuda:0 and the
same through a "gloo" group on CPU copies of the same inputs, and compares;
then a short DDP run through each, comparing the parameters.  Exits non-zero
on any mismatch or error; prints one line per check.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def inputs(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 8 - 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def same(a, b, what, failures):
    a = a.cpu()
    try:
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2 if a.element_size() == 2 else 1e-5,
                                       atol=1e-2 if a.element_size() == 2 else 1e-5)
        else:
            assert torch.equal(a, b), "values differ"
        print(f"ok   {what}", flush=True)
    except Exception as e:  # noqa: BLE001 - report and go on
        failures.append(what)
        print(f"FAIL {what}: {e}", flush=True)


def worker(rank, port, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=dev)
    gloo = dist.new_group(backend="gloo")
    failures = []
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG]
    for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]:
        for n in [1, 1000, 1 << 20]:
            for i, op in enumerate(ops):
                if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                x = inputs(rank, n, dtype, i)
                g, h = x.to(dev), x.clone()
                dist.all_reduce(g, op=op)
                if op == dist.ReduceOp.AVG:  # gloo has no AVG: the sum, divided
                    dist.all_reduce(h, group=gloo)
                    h.div_(WORLD)
                else:
                    dist.all_reduce(h, op=op, group=gloo)
                same(g, h, f"all_reduce {dtype} n={n} {op}", failures)
            x = inputs(rank, n, dtype, 7)
            g, h = x.to(dev), x.clone()
            dist.broadcast(g, src=1)
            dist.broadcast(h, src=1, group=gloo)
            same(g, h, f"broadcast {dtype} n={n}", failures)
            go = torch.empty(WORLD * n, dtype=dtype, device=dev)
            ho = torch.empty(WORLD * n, dtype=dtype)
            dist.all_gather_into_tensor(go, x.to(dev))
            dist.all_gather(list(ho.chunk(WORLD)), x.clone(), group=gloo)
            same(go, ho, f"all_gather_into_tensor {dtype} n={n}", failures)
            y = inputs(rank, WORLD * n, dtype, 8)
            gr = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(gr, y.to(dev))
            hr = y.clone()
            dist.all_reduce(hr, group=gloo)  # gloo has no reduce_scatter: the rank's block of the sum
            same(gr, hr.chunk(WORLD)[rank], f"reduce_scatter_tensor {dtype} n={n}", failures)
            ga = torch.empty(WORLD * n, dtype=dtype, device=dev)
            ha = torch.empty(WORLD * n, dtype=dtype)
            dist.all_to_all_single(ga, y.to(dev))
            dist.all_to_all_single(ha, y.clone(), group=gloo)
            same(ga, ha, f"all_to_all_single {dtype} n={n}", failures)
    # Unequal splits: rank r sends r + q + 1 elements to rank q.
    send_splits = [rank + q + 1 for q in range(WORLD)]
    recv_splits = [q + rank + 1 for q in range(WORLD)]
    z = inputs(rank, sum(send_splits), torch.float32, 9)
    gz = torch.empty(sum(recv_splits), device=dev)
    hz = torch.empty(sum(recv_splits))
    dist.all_to_all_single(gz, z.to(dev), recv_splits, send_splits)
    dist.all_to_all_single(hz, z.clone(), recv_splits, send_splits, group=gloo)
    same(gz, hz, "all_to_all_single unequal splits", failures)
    # Send/recv around the ring, as one batch.
    w = inputs(rank, 4096, torch.float32, 10)
    gw = torch.empty(4096, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, w.to(dev), (rank + 1) % WORLD),
                                   dist.P2POp(dist.irecv, gw, (rank - 1) % WORLD)])
    for r in reqs:
        r.wait()
    same(gw, inputs((rank - 1) % WORLD, 4096, torch.float32, 10), "batch_isend_irecv ring", failures)
    dist.barrier()

    # DDP: the same model, data and steps through each backend.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    cpu_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    cpu_model.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(dev), device_ids=[0])
    ddp_cpu = torch.nn.parallel.DistributedDataParallel(cpu_model, process_group=gloo)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_cpu = torch.optim.SGD(ddp_cpu.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        xb, yb = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        for m, o, d in ((ddp, opt, dev), (ddp_cpu, opt_cpu, torch.device("cpu"))):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(xb.to(d)), yb.to(d)).backward()
            o.step()
    for (name, p), q in zip(ddp.module.named_parameters(), ddp_cpu.module.parameters()):
        same(p.detach(), q.detach(), f"DDP 5 steps: {name}", failures)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    result[rank] = len(failures)


def main():
    port = 29500 + os.getpid() % 1000
    result = mp.Manager().dict()
    mp.spawn(worker, args=(port, result), nprocs=WORLD, join=True)
    bad = sum(result.get(r, 1) for r in range(WORLD))
    print(f"torch {torch.__version__}, nccl {torch.cuda.nccl.version()}: {bad} failures", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
