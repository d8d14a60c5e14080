"""What travels between the kernel and the ranks, and how it is pickled.

Functions go by value (cloudpickle), so a function defined in a notebook cell, and
the notebook globals it uses, reach the ranks even though the ranks cannot import the
notebook's ``__main__``. Results come back the same way, with tensors moved to the CPU.
"""
from __future__ import annotations

import io
import linecache
import types

import cloudpickle

from ..torch_private import cloudpickle_code_reduce
from .errors import SerializationError

# Messages are tuples whose first item says what they are.
# kernel -> rank (task socket):   (kind, run_id, payload), kind one of "call", "cell",
#                                 "script" (run a file as torchrun would), "reinit" (join a new
#                                 default process group on the port in the payload)
# rank -> kernel (task socket):   ("ready", rank, pid) | ("init_error", rank, text)
#                                 ("ok", run_id, value, observed, after)
#                                 ("exited", run_id, code, observed, after)   (a script's sys.exit(code != 0))
#                                 observed: [observer.result() for each observer of the call]
#                                 ("raised", run_id, summary, tb, exc, after)
#                                 ("interrupted", run_id, after)
#                                 after: (intact, traffic, left): whether the pool's default
#                                 process group still exists; the call's messages and collectives
#                                 (CollectiveTracker.traffic(), None if unknown); (pid, name) of
#                                 the processes a script left running, which the rank stopped
# kernel -> rank (control socket): ("status",)
# rank -> kernel (control socket): ("out", stream, text) | ("status", state_dict)


def _reduce_tensor_to_cpu(obj):
    """Pickle a device tensor as its CPU copy, so results never need a GPU to unpickle."""
    import torch

    if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta") and type(obj) is torch.Tensor:
        return _identity, (obj.detach().cpu(),)
    return NotImplemented


def _identity(x):
    return x


def _reduce_code_keeping_filename(code):
    """cloudpickle renames every code object's file to "<dynamic-code>"; keep the real name
    so a rank's traceback points at the notebook cell (whose source we ship, see below)."""
    reduce = cloudpickle_code_reduce()
    if reduce is None:
        return NotImplemented
    rebuild, args = reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    return rebuild, args


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            reduced = _reduce_code_keeping_filename(obj)
            if reduced is not NotImplemented:
                return reduced
        if type(obj).__module__.startswith("torch"):
            reduced = _reduce_tensor_to_cpu(obj)
            if reduced is not NotImplemented:
                return reduced
        return super().reducer_override(obj)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


loads = cloudpickle.loads


def _describe(obj) -> str:
    text = repr(obj)
    return text if len(text) <= 60 else text[:57] + "..."


def dumps_call(fn, args: tuple, kwargs: dict, observers: list = ()) -> bytes:
    """Pickle a call; on failure, name the function or argument that cannot be pickled."""
    try:
        return dumps((fn, args, kwargs, list(observers)))
    except Exception as whole:
        parts = [("the function " + getattr(fn, "__qualname__", _describe(fn)), fn)]
        parts += [(f"the observer {_describe(o)}", o) for o in observers]
        parts += [(f"positional argument {i} ({_describe(a)})", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r} ({_describe(v)})", v) for k, v in kwargs.items()]
        for label, value in parts:
            try:
                dumps(value)
            except Exception as err:
                raise SerializationError(
                    f"cannot send {label} to the ranks: {type(err).__name__}: {err}. "
                    "Objects such as open files, locks, sockets, generators and live process "
                    "groups cannot be pickled; create them inside the function instead."
                ) from err
        raise SerializationError(f"cannot send the call to the ranks: {whole}") from whole


def notebook_sources(already_sent: set[str]) -> dict[str, tuple]:
    """linecache entries of code that exists only in memory (notebook cells), not yet sent.

    Shipped to the ranks so remote tracebacks show the lines of the cell that failed.
    """
    new = {}
    for name, entry in list(linecache.cache.items()):
        if name in already_sent or len(entry) != 4 or entry[1] is not None:
            continue  # real files have an mtime; the ranks read those from disk
        if name.startswith("<frozen"):
            continue
        new[name] = entry
    return new
