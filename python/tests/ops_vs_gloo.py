"""Every operation of the loom backend against gloo's result in the same job.

Run under the launcher:  python3 -m loom_torch.run --standalone --nproc_per_node N ops_vs_gloo.py
The default group is loom; a second group over the same ranks is gloo. Each
case runs the same call with the same inputs on both and compares. gloo has
no AVG: loom's AVG is compared with gloo's SUM / N. Exits non-zero on the
first mismatch, with the case named.
"""
import gc
import sys

import torch
import torch.distributed as dist

import loom_torch  # noqa: F401  (registers "loom")

dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
failures = []


# float16/bfloat16 are rounded after every reduction step by loom and once by
# the float32 reference: allow a few roundings of their precision.
TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def check(name, got, want, exact):
    tol = TOL.get(got.dtype, 1e-5)
    ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    if not ok:
        failures.append(name)
        print(f"[rank {rank}] FAIL {name}: loom {got.flatten()[:8]} gloo {want.flatten()[:8]}", flush=True)


def make(dtype, count, salt):
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.rand(count, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    lo, hi = (0, 3) if dtype == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, (count,), generator=g).to(dtype)


OPS = {"SUM": dist.ReduceOp.SUM, "PRODUCT": dist.ReduceOp.PRODUCT, "MIN": dist.ReduceOp.MIN,
       "MAX": dist.ReduceOp.MAX, "AVG": dist.ReduceOp.AVG}
# gloo on CPU: no float16/bfloat16 reductions in 1.13; those run against a
# float32 gloo reduction of the same values.
DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float32, torch.float64, torch.float16,
          torch.bfloat16, torch.bool]
SIZES = [1, 7, 1000, 70001]  # one element, odd, one-shot path, staged / ring path

salt = 0
for dtype in DTYPES:
    exact = not dtype.is_floating_point
    for count in SIZES:
        for opname, op in OPS.items():
            if dtype == torch.bool and opname == "AVG":
                continue
            if opname == "PRODUCT" and dtype.is_floating_point and count > 1000:
                continue  # products of 70001 values underflow to 0 on both: says nothing
            salt += 1
            x = make(dtype, count, salt)
            ref_in = x.float() if dtype in (torch.float16, torch.bfloat16) else x
            if dtype == torch.bool:
                ref_in = x.to(torch.uint8)
            name = f"all_reduce {opname} {dtype} x{count}"
            got = x.clone()
            dist.all_reduce(got, op=op)
            want = ref_in.clone()
            gop = dist.ReduceOp.SUM if opname == "AVG" else op
            if dtype == torch.bool:
                gop = {"SUM": dist.ReduceOp.MAX, "PRODUCT": dist.ReduceOp.MIN}.get(opname, gop)
            dist.all_reduce(want, op=gop, group=gloo)
            if opname == "AVG":
                want = torch.div(want, n, rounding_mode="trunc") if exact else want / n
            if dtype == torch.bool:
                want = want.bool()
            # float16/bfloat16: loom rounds after each step, the reference once.
            check(name, got, want.to(got.dtype) if not exact else want, exact)

            root = salt % n
            if opname in ("SUM", "MAX") and dtype != torch.bool:
                got = x.clone()
                dist.reduce(got, dst=root, op=op)
                want = ref_in.clone()
                dist.reduce(want, dst=root, op=op, group=gloo)
                if rank == root:
                    check(f"reduce {opname} root {root} {dtype} x{count}", got, want.to(got.dtype), exact)

                rs_in = [make(dtype, count, salt * 7 + i) for i in range(n)]
                got = torch.empty(count, dtype=dtype)
                dist.reduce_scatter(got, [t.clone() for t in rs_in], op=op)
                # gloo has no reduce_scatter: the reference is an all-reduce of
                # the concatenation, block `rank` of it.
                ref = torch.cat([t.float() if not exact else t for t in rs_in])
                dist.all_reduce(ref, op=op, group=gloo)
                want = ref[rank * count:(rank + 1) * count]
                check(f"reduce_scatter {opname} {dtype} x{count}", got, want.to(got.dtype), exact)
                got = torch.empty(count, dtype=dtype)
                dist.reduce_scatter_tensor(got, torch.cat(rs_in), op=op)
                check(f"reduce_scatter_tensor {opname} {dtype} x{count}", got, want.to(got.dtype), exact)

        # Data movement: bit-exact for every dtype (gloo moves the same bytes
        # as uint8, since it lacks bool and bfloat16).
        salt += 1
        x = make(dtype, count, salt)
        root = salt % n
        got, want = x.clone(), x.clone().view(torch.uint8)
        dist.broadcast(got, src=root)
        dist.broadcast(want, src=root, group=gloo)
        check(f"broadcast root {root} {dtype} x{count}", got.view(torch.uint8), want, True)

        got = [torch.empty(count, dtype=dtype) for _ in range(n)]
        want = [torch.empty(count * x.element_size(), dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(got, x)
        dist.all_gather(want, x.view(torch.uint8), group=gloo)
        for i in range(n):
            check(f"all_gather block {i} {dtype} x{count}", got[i].view(torch.uint8), want[i], True)
        flat = torch.empty(n * count, dtype=dtype)
        dist.all_gather_into_tensor(flat, x)
        check(f"all_gather_into_tensor {dtype} x{count}", flat.view(torch.uint8), torch.cat(want), True)

# send / recv around a ring, and batch_isend_irecv (both directions at once).
x = torch.arange(1000, dtype=torch.float32) + 1000 * rank
right, left = (rank + 1) % n, (rank - 1) % n
got = torch.empty(1000)
if rank % 2 == 0:
    dist.send(x, right)
    dist.recv(got, left)
else:
    dist.recv(got, left)
    dist.send(x, right)
check("send/recv ring", got, torch.arange(1000, dtype=torch.float32) + 1000 * left, True)
got_l, got_r = torch.empty(1000), torch.empty(1000)
reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, right), dist.P2POp(dist.isend, x, left),
                               dist.P2POp(dist.irecv, got_l, left), dist.P2POp(dist.irecv, got_r, right)])
for r in reqs:
    r.wait()
check("batch_isend_irecv from left", got_l, torch.arange(1000, dtype=torch.float32) + 1000 * left, True)
check("batch_isend_irecv from right", got_r, torch.arange(1000, dtype=torch.float32) + 1000 * right, True)

# Async work objects: several in flight, then waited on in reverse; futures.
ts = [torch.full((5000,), float(rank + i)) for i in range(6)]
works = [dist.all_reduce(t, async_op=True) for t in ts]
for w in reversed(works):
    w.wait()
for i, t in enumerate(ts):
    check(f"async all_reduce {i}", t, torch.full((5000,), float(sum(range(n)) + n * i)), True)
fut = dist.all_reduce(torch.ones(10), async_op=True).get_future()
check("future value", fut.wait()[0], torch.full((10,), float(n)), True)

dist.barrier()

# gather, scatter, all_to_all_single (equal and unequal splits), all_to_all,
# all_gather_coalesced: bit-exact against gloo (on the same bytes as uint8,
# since gloo lacks bool, bfloat16 and complex) or, where gloo has no such
# operation (all_to_all of lists), against the values every rank can compute.
def make_of(r, dtype, shape, salt):
    g = torch.Generator().manual_seed(1000 * salt + r)
    if dtype.is_complex:
        return torch.complex(torch.rand(shape, generator=g, dtype=torch.float64),
                             torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def raw(t):
    return (torch.view_as_real(t) if t.is_complex() else t).contiguous().view(torch.uint8)


MOVE_DTYPES = [torch.float32, torch.int64, torch.uint8, torch.bool, torch.bfloat16, torch.float64, torch.complex64,
               torch.complex128]
for dtype in MOVE_DTYPES:
    for count in (1, 7, 1000, 70001):
        salt += 1
        root = salt % n
        x = make_of(rank, dtype, (count,), salt)
        got = [torch.empty_like(x) for _ in range(n)] if rank == root else None
        dist.gather(x, got, dst=root)
        want = [torch.empty_like(raw(x)) for _ in range(n)] if rank == root else None
        dist.gather(raw(x), want, dst=root, group=gloo)
        if rank == root:
            for i in range(n):
                check(f"gather block {i} root {root} {dtype} x{count}", raw(got[i]), want[i], True)

        parts = [make_of(rank, dtype, (count,), salt * 3 + i) for i in range(n)] if rank == root else None
        got = torch.empty_like(x)
        dist.scatter(got, parts, src=root)
        want = torch.empty_like(raw(x))
        dist.scatter(want, [raw(p) for p in parts] if rank == root else None, src=root, group=gloo)
        check(f"scatter root {root} {dtype} x{count}", raw(got), want, True)

        # all_to_all_single, equal blocks: 2-D so that rows split whole.
        rows = 2 * n
        xin = make_of(rank, dtype, (rows, (count + 1) // 2), salt)
        got = torch.empty_like(xin)
        dist.all_to_all_single(got, xin)
        want = torch.empty_like(raw(xin))
        dist.all_to_all_single(want, raw(xin), group=gloo)
        check(f"all_to_all_single equal {dtype} x{count}", raw(got), want, True)

        # Unequal splits: rank r sends (r + j) % 3 rows to rank j (some empty).
        cols = max(1, count // 50)
        send_splits = [(rank + j) % 3 for j in range(n)]
        recv_splits = [(j + rank) % 3 for j in range(n)]
        xin = make_of(rank, dtype, (sum(send_splits), cols), salt + 1)
        got = torch.empty((sum(recv_splits), cols), dtype=dtype)
        dist.all_to_all_single(got, xin, recv_splits, send_splits)
        want = torch.empty_like(raw(got))
        dist.all_to_all_single(want, raw(xin), recv_splits, send_splits, group=gloo)
        check(f"all_to_all_single unequal {dtype} x{cols}", raw(got), want, True)

        # all_to_all of lists (gloo has none): block j of rank r goes to rank j.
        sizes = lambda a, b: (a + 2 * b) % 4 + (count % 5)  # noqa: E731
        ins = [make_of(rank, dtype, (sizes(rank, j),), salt * 5 + j) for j in range(n)]
        outs = [torch.empty(sizes(i, rank), dtype=dtype) for i in range(n)]
        dist.all_to_all(outs, ins)
        for i in range(n):
            check(f"all_to_all from {i} {dtype}", raw(outs[i]),
                  raw(make_of(i, dtype, (sizes(i, rank),), salt * 5 + rank)), True)

    # all_gather_coalesced: three tensors of different shapes per rank.
    salt += 1
    ins = [make_of(rank, dtype, shape, salt + k) for k, shape in enumerate([(3,), (2, 5), (1000,)])]
    got = [[torch.empty_like(t) for t in ins] for _ in range(n)]
    dist.all_gather_coalesced(got, ins)
    for i in range(n):
        for k, shape in enumerate([(3,), (2, 5), (1000,)]):
            check(f"all_gather_coalesced rank {i} tensor {k} {dtype}", raw(got[i][k]),
                  raw(make_of(i, dtype, shape, salt + k)), True)

# Complex all_reduce (SUM, AVG) against gloo's float all_reduce of the real views.
for dtype in (torch.complex64, torch.complex128):
    for count in (1, 1000, 70001):
        salt += 1
        x = make_of(rank, dtype, (count,), salt)
        got = x.clone()
        dist.all_reduce(got)
        want = torch.view_as_real(x.clone()).contiguous()
        dist.all_reduce(want, group=gloo)
        check(f"all_reduce SUM {dtype} x{count}", torch.view_as_real(got), want, False)
        got = x.clone()
        dist.all_reduce(got, op=dist.ReduceOp.AVG)
        check(f"all_reduce AVG {dtype} x{count}", torch.view_as_real(got), want / n, False)

# Sparse all_reduce (loom reduces the dense form, with a warning) equals gloo's.
i = torch.tensor([[rank, (rank * 3) % 7], [1, 2]])
v = torch.tensor([1.5 + rank, -2.0], dtype=torch.float32)
sp = torch.sparse_coo_tensor(i, v, (8, 4))
got = sp.clone()
dist.all_reduce(got)
want = sp.clone()
dist.all_reduce(want, group=gloo)
check("sparse all_reduce", got.to_dense(), want.to_dense(), False)

# Profiler: each operation records "loom:<operation>".
with torch.autograd.profiler.profile() as prof:
    dist.all_reduce(torch.ones(10))
    dist.all_to_all_single(torch.empty(2 * n), torch.ones(2 * n))
names = {e.name for e in prof.function_events}
for want_name in ("loom:all_reduce", "loom:all_to_all_single"):
    if want_name not in names:
        failures.append(f"profiler event {want_name}")
        print(f"[rank {rank}] FAIL profiler: no {want_name} in {sorted(names)[:20]}", flush=True)

# Clear errors for what loom does not support.
def expect_error(name, fn, words):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        if not all(w in str(e) for w in words):
            failures.append(name)
            print(f"[rank {rank}] FAIL {name}: unclear error: {e}", flush=True)
        return
    failures.append(name)
    print(f"[rank {rank}] FAIL {name}: no error", flush=True)


expect_error("BAND is refused", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND),
             ["loom", "BAND"])
expect_error("int16 is refused", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16)), ["loom", "dtype"])
expect_error("non-contiguous is refused", lambda: dist.all_reduce(torch.ones(4, 4).t()), ["loom", "contiguous"])
expect_error("complex MAX is refused", lambda: dist.all_reduce(torch.ones(4, dtype=torch.complex64),
                                                                 op=dist.ReduceOp.MAX), ["complex"])
expect_error("all_to_all_single splits that do not add up are refused",
             lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, [2] * n), ["loom", "split"])

# The group still works after refused calls.
t = torch.ones(3)
dist.all_reduce(t)
check("all_reduce after refused calls", t, torch.full((3,), float(n)), True)

dist.barrier(group=gloo)
# Free the DDP modules (reference cycles) so that destroy_process_group really
# destroys both groups and joins their threads: a gloo worker thread still
# alive at interpreter exit can abort the process (PyTorch 1.13, Python 3.11).
gc.collect()
dist.destroy_process_group()
if failures:
    print(f"[rank {rank}] {len(failures)} failures: {failures[:10]}", flush=True)
    sys.exit(1)
print(f"[rank {rank}] all {salt} cases equal gloo's", flush=True)
