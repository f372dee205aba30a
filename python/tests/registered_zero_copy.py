"""loom_torch.empty and the backend's own buffers: zero-copy over shared memory.

Run under the launcher:  python3 -m loom_torch.run --standalone --nproc_per_node N registered_zero_copy.py

Tensors from loom_torch.empty (1 MiB and more) lie in loomMemAlloc memory, and
so do the buffers the backend allocates itself (all_gather's and
all_gather_coalesced's targets, flattened lists): on one host loom then moves
their data straight between the ranks' buffers. Each case checks the result
exactly (integer-valued floats) and that loom took the zero-copy path: loom's
COLL trace says so on stderr, which this script reads back from a file. A
small loom_torch.empty tensor is an ordinary one.
"""
import os
import sys
import tempfile

# Set before loom reads its configuration (at the group's creation).
os.environ["LOOM_DEBUG"] = "TRACE"
os.environ["LOOM_DEBUG_SUBSYS"] = "COLL"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import loom_torch  # noqa: E402

failures = []
ZERO_COPY = "every rank's buffers can be mapped: zero-copy"


class Stderr:
    """Captures the process's file descriptor 2 (loom's log) into a file."""

    def __enter__(self):
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()
        sys.stderr.write("".join(l + "\n" for l in self.text.splitlines() if ZERO_COPY not in l))


def case(name, fn, want_zero_copy):
    with Stderr() as log:
        ok = fn()
    zc = log.text.count(ZERO_COPY)
    if not ok:
        failures.append(name)
        print(f"[rank {rank}] FAIL {name}: wrong result", flush=True)
    if want_zero_copy and zc == 0:
        failures.append(name)
        print(f"[rank {rank}] FAIL {name}: loom did not take the zero-copy path", flush=True)
    if not want_zero_copy and zc:
        failures.append(name)
        print(f"[rank {rank}] FAIL {name}: zero-copy on buffers that are not all loomMemAlloc's", flush=True)


dist.init_process_group(backend="loom")
rank, n = dist.get_rank(), dist.get_world_size()
M = (1 << 20) + 3  # float32 elements: 4 MiB, above the size every rank votes at

# loom_torch.empty: shapes, dtypes, small tensors.
t = loom_torch.empty(4, 5, dtype=torch.float64)
assert t.shape == (4, 5) and t.dtype == torch.float64, (t.shape, t.dtype)
t = loom_torch.empty((3, M), dtype=torch.bfloat16)
assert t.shape == (3, M) and t.is_contiguous()
try:
    loom_torch.empty(-1)
    failures.append("negative size accepted")
except ValueError:
    pass


def allreduce_empty():
    x = loom_torch.empty(M)
    x.copy_(torch.arange(M, dtype=torch.float32) % 97 + rank)
    dist.all_reduce(x)
    want = (torch.arange(M, dtype=torch.float32) % 97) * n + n * (n - 1) / 2
    return torch.equal(x, want)


def allreduce_plain():
    x = torch.arange(M, dtype=torch.float32) % 97 + rank
    dist.all_reduce(x)
    want = (torch.arange(M, dtype=torch.float32) % 97) * n + n * (n - 1) / 2
    return torch.equal(x, want)


def allgather_list():
    # An ordinary input: the backend copies it into its own target.
    x = torch.full((M // n + 1,), float(rank + 1))
    outs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outs, x)
    return all(torch.equal(o, torch.full_like(x, float(r + 1))) for r, o in enumerate(outs))


def allgather_into_tensor():
    m = M // n + 5
    x = loom_torch.empty(m)
    x.fill_(float(rank) - 0.5)
    out = loom_torch.empty(n * m)
    dist.all_gather_into_tensor(out, x)
    return torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(m) - 0.5)


def reduce_scatter_tensor():
    m = M // n + 7
    x = loom_torch.empty(n * m)
    x.copy_(torch.arange(n * m, dtype=torch.float32) % 13 + rank)
    out = loom_torch.empty(m)
    dist.reduce_scatter_tensor(out, x)
    want = (torch.arange(rank * m, (rank + 1) * m, dtype=torch.float32) % 13) * n + n * (n - 1) / 2
    return torch.equal(out, want)


def reduce_scatter_list():
    # The backend flattens the inputs into its own buffer.
    m = M // n + 1
    ins = [torch.full((m,), float(rank * 10 + j)) for j in range(n)]
    out = loom_torch.empty(m)
    dist.reduce_scatter(out, ins)
    return torch.equal(out, torch.full((m,), float(sum(r * 10 + rank for r in range(n)))))


def broadcast_empty():
    x = loom_torch.empty(M, dtype=torch.int32)
    x.fill_(rank * 3 + 1)
    dist.broadcast(x, src=n - 1)
    return torch.equal(x, torch.full((M,), (n - 1) * 3 + 1, dtype=torch.int32))


for i in range(2):  # the second round reuses the pooled blocks
    case(f"all_reduce on loom_torch.empty, round {i}", allreduce_empty, True)
    case(f"all_gather into a list, round {i}", allgather_list, True)
    case(f"all_gather_into_tensor on loom_torch.empty, round {i}", allgather_into_tensor, True)
    case(f"reduce_scatter_tensor on loom_torch.empty, round {i}", reduce_scatter_tensor, True)
    case(f"reduce_scatter of a list into loom_torch.empty, round {i}", reduce_scatter_list, True)
    case(f"broadcast on loom_torch.empty, round {i}", broadcast_empty, True)
case("all_reduce on an ordinary tensor", allreduce_plain, False)

dist.barrier()
dist.destroy_process_group()
if failures:
    print(f"[rank {rank}] {len(failures)} failures: {failures}", flush=True)
    sys.exit(1)
print(f"[rank {rank}] ok", flush=True)
