"""torchrun, usable on Debian 12: ``python3 -m loom_torch.run [torchrun args]``.

Debian 12's PyTorch 1.13 torchrun fails at start-up under Python 3.11 with
``AttributeError: 'NoneType' object has no attribute 'get'`` whatever the
backend: it parses --redirects/--tee by iterating an IntFlag, and Python 3.11
no longer yields the zero and composite members (NONE, ALL), so "0" (the
default) maps to None. This module parses those values by number instead and
then runs torch.distributed.run unchanged, with the same arguments.

On a torch built without libuv (Debian 13's 2.6) it first applies
loom_torch._libuv.patch(), so that the launch does not fail.
"""
import re
import sys

from torch.distributed.elastic.multiprocessing import api as _mp_api
from torch.distributed import run as _run

from loom_torch import _libuv


def _std_from_str(vm):
    Std = _mp_api.Std
    if re.match(_mp_api._VALUE_REGEX, vm):
        return Std(int(vm))
    if re.match(_mp_api._MAPPING_REGEX, vm):
        return {int(i): Std(int(v)) for i, v in (m.split(":") for m in vm.split(","))}
    raise ValueError(f"{vm} does not match: <{_mp_api._VALUE_REGEX}> or <{_mp_api._MAPPING_REGEX}>")


def _needs_fix():
    try:
        return _mp_api.Std.from_str("0") is None
    except Exception:
        return True


if _needs_fix():
    _mp_api.Std.from_str = staticmethod(_std_from_str)


_libuv.patch()


def main(argv=None):
    _run.main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
