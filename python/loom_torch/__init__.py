"""loom as a torch.distributed backend.

    import loom_torch                      # registers the backend "loom"
    torch.distributed.init_process_group(backend="loom")

Works with torchrun's environment (or any init_method / c10d store): rank 0
creates loom's unique id and puts it in the store, the others read it there.
CPU tensors; all_reduce (SUM, AVG, PRODUCT, MIN, MAX), broadcast, reduce,
all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
barrier, send, recv and batch_isend_irecv.
"""
import torch  # loads libtorch_python before the extension needs it
import torch.distributed as dist

from . import _C

__all__ = ["BACKEND_NAME", "loom_version"]

BACKEND_NAME = "loom"
loom_version = _C.loom_version


def _create_process_group(store, rank, size, timeout):
    return _C.create_process_group(store, rank, size, timeout)


if not hasattr(dist.Backend, BACKEND_NAME.upper()):
    dist.Backend.register_backend(BACKEND_NAME, _create_process_group)
