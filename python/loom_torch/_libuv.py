"""torch.distributed on a PyTorch built without libuv (Debian 13's 2.6).

Since torch 2.4, torchrun's static rendezvous and the client store of an
env:// rendezvous under torchrun create their TCPStore with libuv, whatever
USE_LIBUV says, and a torch built without libuv refuses: "use_libuv was
requested but PyTorch was build without libuv support". Every launch fails,
with any backend. Where torch lacks libuv, patch() sets USE_LIBUV=0 (torch's
own switch, which the other paths read) and makes those two places ask for
the plain store. Anywhere else it does nothing.
"""
import importlib
import os


def lacks_libuv():
    """True when this torch offers libuv stores but was built without them."""
    from torch.distributed import TCPStore
    try:
        TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    except TypeError:
        return False  # before torch 2.2: no such option, nothing to choose
    except RuntimeError as e:
        return "libuv" in str(e)
    return False


def _plain_store(module):
    made = module.TCPStore

    def make(*args, **kwargs):
        kwargs.setdefault("use_libuv", False)
        return made(*args, **kwargs)

    module.TCPStore = make


def patch():
    if not lacks_libuv():
        return
    os.environ["USE_LIBUV"] = "0"
    # torch.distributed.rendezvous is also a function's name: import by path.
    for name in ("torch.distributed.rendezvous", "torch.distributed.elastic.rendezvous.static_tcp_rendezvous"):
        _plain_store(importlib.import_module(name))
