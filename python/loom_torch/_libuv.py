"""torch.distributed on a PyTorch built without libuv (Debian 13's 2.6).

Since torch 2.4 the stores that torchrun's rendezvous makes ask for libuv:
the static rendezvous (--master_addr/--master_port), the c10d rendezvous
backend (--standalone, --rdzv-backend=c10d) and its store server, and the
ranks' client store under torchrun; none of them reads USE_LIBUV. A torch
built without libuv refuses: "use_libuv was requested but PyTorch was build
without libuv support". Every launch fails, with any backend. Where torch
lacks libuv, patch() sets USE_LIBUV=0 (torch's own switch, which the
env:// rendezvous outside torchrun reads) and makes those places ask for the
plain store. Anywhere else it does nothing.
"""
import datetime
import importlib
import os

_patched = False


def lacks_libuv():
    """True when this torch offers libuv stores but was built without them."""
    from torch.distributed import TCPStore
    try:
        # No world size: the server waits for nobody; it is dropped at once.
        TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, timeout=datetime.timedelta(seconds=5))
    except TypeError:
        return False  # before torch 2.2: no such option, nothing to choose
    except RuntimeError as e:
        return "libuv" in str(e)
    return False


def _plain_store(module):
    made = module.TCPStore

    def make(*args, **kwargs):
        kwargs["use_libuv"] = False  # True cannot work on this torch
        return made(*args, **kwargs)

    module.TCPStore = make


def patch():
    global _patched
    if _patched or not lacks_libuv():
        return
    _patched = True
    os.environ["USE_LIBUV"] = "0"
    # The modules that took TCPStore by name (torch.distributed.rendezvous is
    # also a function's name: import by path).  torch.distributed.TCPStore
    # itself stays: isinstance checks elsewhere use it.
    for name in ("torch.distributed.rendezvous", "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
                 "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "TCPStore"):
            _plain_store(module)
    # The c10d rendezvous's store server for the ranks (torch 2.4 on) calls
    # torch.distributed.TCPStore through the package.
    try:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        return
    if hasattr(DynamicRendezvousHandler, "_create_tcp_store_server"):
        def server(self, master_addr, master_port):
            return TCPStore(host_name=master_addr, port=master_port, is_master=True, multi_tenant=True,
                            use_libuv=False)

        DynamicRendezvousHandler._create_tcp_store_server = server
