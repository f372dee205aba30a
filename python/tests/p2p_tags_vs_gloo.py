"""Tagged send/recv, recv from any source and batch_isend_irecv with tags,
irecv posted before the send a peer waits for (the ring exchange), an irecv
polled with is_completed or waited on through its future:
loom against gloo in the same job (the default group is loom, a second group
over the same ranks is gloo).  Exits non-zero on the first difference.

Run under the launcher: python3 -m loom_torch.run --nproc_per_node 3 p2p_tags_vs_gloo.py
"""
import sys
import time

import torch
import torch.distributed as dist

import loom_torch  # noqa: F401  (registers "loom")

dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
failures = []


def check(name, ok, detail=""):
    if not ok:
        failures.append(name)
        print(f"[rank {rank}] FAIL {name} {detail}", flush=True)


def payload(src, tag, count):
    return torch.arange(count, dtype=torch.float32) + 1000.0 * src + 100000.0 * tag


def out_of_order(group):
    """Rank 0 sends tags 1 then 2 to rank 1 (more than a slot ring each, but
    eager: at most LOOM_TAGGED_EAGER_BYTES; a larger send waits for its
    receive, as MPI_Send may, so this order would wait on loom);
    rank 1 receives tag 2 first."""
    got = {}
    count = 200000
    if rank == 0:
        reqs = [dist.isend(payload(0, t, count), 1, group=group, tag=t) for t in (1, 2)]
        for r in reqs:
            r.wait()
    elif rank == 1:
        for t in (2, 1):
            x = torch.empty(count)
            dist.recv(x, 0, group=group, tag=t)
            got[t] = x
    return got


def any_source(group):
    """Rank 0 receives one message from every other rank, from any source."""
    seen = {}
    if rank == 0:
        for _ in range(n - 1):
            x = torch.empty(50)
            src = dist.recv(x, group=group, tag=3)
            seen[src] = x
    else:
        dist.send(payload(rank, 3, 50), 0, group=group, tag=3)
    return seen


def batch_with_tags(group):
    """Each rank sends to the right with tag 5 and to the left with tag 6;
    receives are listed first and from the other side first."""
    right, left = (rank + 1) % n, (rank + n - 1) % n
    from_left, from_right = torch.empty(1000), torch.empty(1000)
    ops = [dist.P2POp(dist.irecv, from_right, right, group, 6), dist.P2POp(dist.irecv, from_left, left, group, 5),
           dist.P2POp(dist.isend, payload(rank, 5, 1000), right, group, 5),
           dist.P2POp(dist.isend, payload(rank, 6, 1000), left, group, 6)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    return from_left, from_right


def exchange(group, count):
    """Every rank posts irecv from the left, then sends to the right (blocking
    send): each receive is in front of the send its neighbour waits for.
    count = 300000 floats is over LOOM_TAGGED_EAGER_BYTES (rendezvous)."""
    left, right = (rank + n - 1) % n, (rank + 1) % n
    x = torch.empty(count)
    req = dist.irecv(x, left, group=group, tag=7)
    dist.send(payload(rank, 7, count), right, group=group, tag=7)
    req.wait()
    return x


def polled(group):
    """Rank 0 posts irecv and polls is_completed (then a second one through
    its future) while rank 1 sends only later: the receive must make
    progress without wait()."""
    if rank == 0:
        x, y = torch.empty(10), torch.empty(10)
        req = dist.irecv(x, 1, group=group, tag=8)
        if group is None:
            deadline = time.time() + 20
            while not req.is_completed() and time.time() < deadline:
                time.sleep(0.01)
            check("irecv reports completion while polled, without wait()", req.is_completed())
        else:  # gloo's irecv (torch 1.13) says completed only once waited for: 20 s of polling for nothing
            req.wait()
        req2 = dist.irecv(y, 1, group=group, tag=9)
        if group is None:
            req2.get_future().wait()
        else:  # gloo's receives have no future in torch 1.13
            req2.wait()
        return x, y
    if rank == 1:
        time.sleep(0.2)
        dist.send(payload(1, 8, 10), 0, group=group, tag=8)
        dist.send(payload(1, 9, 10), 0, group=group, tag=9)
    return None, None


def halo(group, count):
    """The 1-D halo exchange: irecv from both neighbours, isend to both,
    then wait for all four."""
    left, right = (rank + n - 1) % n, (rank + 1) % n
    a, b = torch.empty(count), torch.empty(count)
    reqs = [dist.irecv(a, left, group=group, tag=12), dist.irecv(b, right, group=group, tag=13),
            dist.isend(payload(rank, 13, count), right, group=group, tag=12),
            dist.isend(payload(rank, 12, count), left, group=group, tag=13)]
    for q in reqs:
        q.wait()
    return a, b


def irecv_then_batch(group):
    """irecv from the left, then batch_isend_irecv([isend to the right])."""
    left, right = (rank + n - 1) % n, (rank + 1) % n
    x = torch.empty(500)
    r = dist.irecv(x, left, group=group, tag=14)
    for q in dist.batch_isend_irecv([dist.P2POp(dist.isend, payload(rank, 14, 500), right, group, 14)]):
        q.wait()
    r.wait()
    return x


def irecv_across_groups():
    """Rank 0 posts a large irecv on the loom group, then joins a collective
    of the gloo group before waiting; rank 1 sends (blocking) first.  The
    held receive must go out by itself (the completer), or rank 1's
    rendezvous send never finds it."""
    count = 1 << 20  # 4 MiB: over LOOM_TAGGED_EAGER_BYTES
    x = torch.empty(count)
    r = None
    if rank == 0:
        r = dist.irecv(x, 1, tag=15)
    elif rank == 1:
        dist.send(payload(1, 15, count), 0, tag=15)
    dist.all_reduce(torch.ones(1), group=gloo)
    if r is not None:
        r.wait()
    return x


for count in (1000, 300000):
    la, lb = halo(None, count)
    ga, gb = halo(gloo, count)
    check(f"halo exchange, {count} floats", torch.equal(la, ga) and torch.equal(lb, gb) and
          torch.equal(la, payload((rank + n - 1) % n, 13, count)) and torch.equal(lb, payload((rank + 1) % n, 12, count)))
lo, gl = irecv_then_batch(None), irecv_then_batch(gloo)
check("irecv then batch_isend_irecv", torch.equal(lo, gl) and torch.equal(lo, payload((rank + n - 1) % n, 14, 500)))
x = irecv_across_groups()
if rank == 0:
    check("a held irecv progresses while the rank waits in another group", torch.equal(x, payload(1, 15, 1 << 20)))

for count in (1000, 300000):
    lo, gl = exchange(None, count), exchange(gloo, count)
    check(f"irecv then send around the ring, {count} floats", torch.equal(lo, gl) and
          torch.equal(lo, payload((rank + n - 1) % n, 7, count)))
(lx, ly), (gx, gy) = polled(None), polled(gloo)
if rank == 0:
    check("irecv completes while polled with is_completed", torch.equal(lx, gx) and torch.equal(lx, payload(1, 8, 10)))
    check("irecv completes through its future", torch.equal(ly, gy) and torch.equal(ly, payload(1, 9, 10)))

lo, gl = out_of_order(None), out_of_order(gloo)
if rank == 1:
    for t in (1, 2):
        check(f"out-of-order tag {t}", torch.equal(lo[t], gl[t]) and torch.equal(lo[t], payload(0, t, 200000)))

lo, gl = any_source(None), any_source(gloo)
if rank == 0:
    check("any source: every sender once", sorted(lo) == sorted(gl) == list(range(1, n)), f"{sorted(lo)} {sorted(gl)}")
    for s in lo:
        check(f"any source: data of rank {s}", torch.equal(lo[s], gl.get(s, torch.empty(0))) and
              torch.equal(lo[s], payload(s, 3, 50)))

(ll, lr), (gl_, gr) = batch_with_tags(None), batch_with_tags(gloo)
check("batch_isend_irecv with tags, from the left", torch.equal(ll, gl_) and torch.equal(ll, payload((rank + n - 1) % n, 5, 1000)))
check("batch_isend_irecv with tags, from the right", torch.equal(lr, gr) and torch.equal(lr, payload((rank + 1) % n, 6, 1000)))

# The group still works.
t = torch.ones(3)
dist.all_reduce(t)
check("all_reduce after tagged point to point", torch.equal(t, torch.full((3,), float(n))))
dist.barrier()
dist.destroy_process_group()
if failures:
    print(f"[rank {rank}] {len(failures)} failures: {failures}", flush=True)
    sys.exit(1)
print(f"[rank {rank}] tagged point to point equals gloo", flush=True)
