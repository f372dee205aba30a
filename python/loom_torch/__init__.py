"""loom as a torch.distributed backend.

    import loom_torch                      # registers the backend "loom"
    torch.distributed.init_process_group(backend="loom")

Works with torchrun's environment (or any init_method / c10d store): rank 0
creates loom's unique id and puts it in the store, the others read it there.
CPU tensors; all_reduce (SUM, AVG, PRODUCT, MIN, MAX; sparse tensors through
their dense form), broadcast, reduce, all_gather, all_gather_into_tensor,
all_gather_coalesced, reduce_scatter, reduce_scatter_tensor, gather, scatter,
all_to_all, all_to_all_single (equal or unequal splits), barrier, send, recv
(with tags, and from any source: loomSendTagged/loomRecvTagged) and
batch_isend_irecv; every dtype gloo takes (complex as pairs of reals).
Every operation fails within about the group's timeout when a peer does not
take part, naming that rank; the autograd profiler shows "loom:<operation>".

torch 1.13 refuses dist.monitored_barrier for any backend but gloo: use
loom_torch.monitored_barrier(group, timeout, wait_all_ranks) instead.

After a rank dies, loom_torch.shrink(group) returns the group of the
survivors (loomCommRevoke + loomCommShrink); torch.distributed calls take it
as group=..., with the ranks of the group it was shrunk from.
"""
import collections
import datetime
import inspect

import torch  # loads libtorch_python before the extension needs it
import torch.distributed as dist

from . import _C
from . import _libuv

_libuv.patch()  # a torch without libuv (Debian 13's) could not rendezvous

__all__ = ["BACKEND_NAME", "empty", "loom_version", "monitored_barrier", "shrink"]

BACKEND_NAME = "loom"
loom_version = _C.loom_version


def empty(*size, dtype=torch.float32):
    """An uninitialised CPU tensor in loomMemAlloc memory (when it is 1 MiB or
    more; smaller ones are ordinary tensors): memory the other ranks of the
    host map, so that loom's collectives on it over shared memory move data
    straight between the ranks' tensors (zero-copy; every rank's tensors must
    be such memory). Keep such tensors for buffers used again and again
    (gradient buckets, parameters); their memory goes back to a pool."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    numel = 1
    for d in size:
        if int(d) < 0:
            raise ValueError(f"loom_torch.empty: negative dimension {d}")
        numel *= int(d)
    item = torch.empty((), dtype=dtype).element_size()
    raw = _C.empty_bytes(numel * item)
    return raw.view(dtype).view(size)


def _create_process_group(store, rank, size, timeout):
    return _C.create_process_group(store, rank, size, timeout)


if not hasattr(dist.Backend, BACKEND_NAME.upper()):
    if "devices" in inspect.signature(dist.Backend.register_backend).parameters:
        # torch 2.x: loom serves CPU tensors (CUDA ones stay with nccl in a
        # "cpu:loom,cuda:nccl" group).
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, devices=["cpu"])
    else:
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group)


_monitored_barrier_calls = collections.Counter()


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """gloo's monitored_barrier for any group: rank 0 of the group waits up to
    `timeout` for every other rank to check in through the default store,
    then releases them. A rank that does not arrive in time makes rank 0 raise
    RuntimeError("Rank R failed to pass monitoredBarrier in T ms"), naming
    every late rank when wait_all_ranks; the other ranks raise when rank 0
    does not release them in time. Collective: every rank of the group calls it.
    """
    group = group or dist.group.WORLD
    if timeout is None:
        timeout = datetime.timedelta(minutes=30)
    ranks = sorted(dist.get_process_group_ranks(group)) if hasattr(dist, "get_process_group_ranks") else \
        sorted(dist.distributed_c10d._pg_group_ranks[group].keys())
    me, n = dist.get_rank(group), len(ranks)
    call = ",".join(map(str, ranks))
    seq = _monitored_barrier_calls[call]
    _monitored_barrier_calls[call] += 1
    store = dist.PrefixStore(f"loom_monitored_barrier/{call}/{seq}/", dist.distributed_c10d._get_default_store())
    ms = int(timeout.total_seconds() * 1000)
    deadline = datetime.datetime.now() + timeout
    if me != 0:
        store.set(f"arrived/{me}", "1")
        try:
            store.wait(["released"], timeout)
        except RuntimeError as e:
            raise RuntimeError(f"Rank {me} was not released by rank 0 of the group from monitoredBarrier in "
                               f"{ms} ms: {e}") from None
        return
    late = []
    for r in range(1, n):
        left = max(deadline - datetime.datetime.now(), datetime.timedelta(milliseconds=1))
        try:
            store.wait([f"arrived/{r}"], left)
        except RuntimeError:
            late.append(r)
            if not wait_all_ranks:
                break
    if late:
        who = f"Rank {late[0]}" if len(late) == 1 else "Ranks " + ", ".join(map(str, late))
        raise RuntimeError(f"{who} failed to pass monitoredBarrier in {ms} ms")
    store.set("released", "1")


_shrunk = collections.Counter()


def _c10d_tables():
    """torch.distributed's group tables: module globals in torch 1.13, _world's in 2.x."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    if world is not None and hasattr(world, "pg_group_ranks"):
        return world.pg_map, world.pg_names, world.pg_group_ranks
    return c10d._pg_map, c10d._pg_names, c10d._pg_group_ranks


def _wrap_backend(backend, members):
    """torch 2.x: a ProcessGroup around a loom Backend that shrink made."""
    c10d = dist.distributed_c10d
    store = dist.PrefixStore("loom_shrunk/" + ",".join(map(str, members)) + "/", c10d._get_default_store())
    pg = dist.ProcessGroup(store, backend.rank(), backend.size())
    cpu = torch.device("cpu")
    custom = dist.ProcessGroup.BackendType.CUSTOM
    if hasattr(pg, "_set_default_backend"):
        pg._set_default_backend(custom)
    pg._register_backend(cpu, custom, backend)
    return pg


def shrink(group=None, exclude=()):
    """Continue without the dead: revokes `group` (default: the world) and
    returns a new loom group of the ranks still alive, less `exclude` (ranks
    numbered as in the default group), or None on a rank that is left out.

    Every surviving rank calls it (a collective over the survivors; they
    agree on the membership even if another rank dies meanwhile). Pending
    operations on `group` fail at once. The new group's ranks are the
    survivors in order; torch.distributed calls take it as group=new with
    default-group ranks (src=, dst=), and dist.get_rank(new) /
    dist.get_world_size(new) say where this rank is in it. The job's c10d
    store (TCPStore) lives in rank 0's process: that rank must survive, or
    the store must live elsewhere. Launch with a launcher that lets the
    others run on when one dies (loom-run --keep-going; torchrun stops the
    job instead).
    """
    c10d = dist.distributed_c10d
    pg = group if group is not None else c10d._get_default_group()
    pg_map, pg_names, pg_group_ranks = _c10d_tables()
    # global (default-group) rank of each rank of pg
    if pg is c10d._get_default_group():
        globals_of = list(range(pg.size()))
    else:
        globals_of = sorted(pg_group_ranks[pg], key=pg_group_ranks[pg].get)
    local_exclude = []
    for g in exclude:
        if g not in globals_of:
            raise ValueError(f"loom_torch.shrink: rank {g} is not in the group")
        local_exclude.append(globals_of.index(g))
    if hasattr(pg, "_get_backend"):  # torch 2.x: the loom Backend inside the ProcessGroup
        backend = _C.shrink(pg._get_backend(torch.device("cpu")), local_exclude)
        if backend is None:
            return None
        parents = _C.parent_ranks(backend)
        members = [globals_of[p] for p in parents]
        new = _wrap_backend(backend, members)
    else:
        new = _C.shrink(pg, local_exclude)
        if new is None:
            return None
        members = [globals_of[p] for p in _C.parent_ranks(new)]
    key = ",".join(map(str, members))
    name = f"loom_shrunk_{key}_{_shrunk[key]}"
    _shrunk[key] += 1
    pg_map[new] = pg_map.get(pg, (BACKEND_NAME, None))
    pg_names[new] = name
    pg_group_ranks[new] = {g: i for i, g in enumerate(members)}
    return new
