"""Count the bytes a rank sends in a collective: logically, and on the wire.

Logical bytes of PyTorch's own collectives come from the c10d operators they call:
``C10dMeter`` is a ``TorchDispatchMode`` that sees every ``torch.ops.c10d`` op with its
tensors (``torch.distributed.tensor.debug.CommDebugMode`` counts the same calls, but not
bytes) and records the payload S as nccl-tests defines it, and what a bandwidth-optimal
algorithm would make this rank send (``cost.bus_factor``). Our own algorithms report their
logical bytes in their ``Trace``.

Wire bytes: ``/proc/self/io``'s ``wchar`` counts every byte the process hands to write
calls, socket writes included -- what Gloo's TCP transport really sends, plus a few header
bytes. Linux only; anything else the rank writes meanwhile (prints) counts too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..pool.tracker import C10D_OPS
from .cost import bus_factor

# Where S (nccl-tests' size) is among a c10d op's arguments: 0, the input; 1, the output
# (all_gather's input is one rank's share, reduce_scatter's output is); None, no payload.
# The op -> collective names are the pool's table, the one the hang diagnosis uses.
_PAYLOAD_ARG = {"_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1,
                "alltoall_base_": 1, "alltoall_": 1, "gather_": 1, "barrier": None,
                "monitored_barrier_": None}


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return 0


@dataclass
class CommRecord:
    """One c10d op a rank called: ``collective`` on ``nbytes`` (S, nccl-tests' size: the
    all_gather output, the reduce_scatter input, the message of a send) in a group of
    ``world_size``; ``logical_sent``: bytes a bandwidth-optimal algorithm sends from this
    rank (None where that depends on more than S, e.g. gather and scatter); ``group_ranks``:
    the global ranks of the process group it ran on (HYBRID_SHARD uses two groups)."""
    op: str
    collective: str
    nbytes: int
    world_size: int
    logical_sent: int | None
    group_ranks: tuple | None = None


class C10dMeter(TorchDispatchMode):
    """``with C10dMeter() as meter:`` records every c10d op called inside, in ``records``."""

    def __init__(self):
        super().__init__()
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            collective = C10D_OPS.get(name, name)
            where = _PAYLOAD_ARG.get(name, 0) if name in C10D_OPS else None
            nbytes = _nbytes(args[where]) if where is not None and len(args) > where else 0
            group = next((g for g in map(_process_group, args) if g is not None), None)
            n = group.size() if group is not None else dist.get_world_size()
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
            self.records.append(CommRecord(name, collective, nbytes, n, _logical(collective, nbytes, n), ranks))
        return func(*args, **kwargs)

    def logical_bytes_sent(self) -> int | None:
        """Sum of ``logical_sent`` over the records (None if any is unknown)."""
        values = [r.logical_sent for r in self.records]
        return None if any(v is None for v in values) else int(sum(values))


def _process_group(arg):
    """The ProcessGroup a c10d op was called on: ops receive it boxed as a ScriptObject."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in arg._type().qualified_name():
        return dist.ProcessGroup.unbox(arg)
    return None


def _logical(collective: str, nbytes: int, world_size: int) -> int | None:
    if collective == "send":
        return nbytes
    if collective in ("recv", "barrier"):
        return 0
    try:
        return round(nbytes * bus_factor(collective, world_size))
    except ValueError:
        return None


def wire_bytes_written() -> int | None:
    """Bytes this process has handed to write calls so far (``wchar``); None off Linux."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class BytesSent:
    """What one rank sent while running a function (bytes; wire is None off Linux)."""
    wire: int | None
    logical: int | None
    records: list = field(default_factory=list)
    result: object = None


def measure_bytes_sent(fn, *args, group=None, **kwargs) -> BytesSent:
    """On a rank: run ``fn(*args, **kwargs)`` between barriers; bytes this rank sent.

    Call it on every rank of ``group`` together. Barriers make sure every message of the
    collective has been written before the counter is read; one barrier's own bytes,
    measured just before, are subtracted.
    """
    dist.barrier(group=group)
    start = wire_bytes_written()
    dist.barrier(group=group)
    own = wire_bytes_written() - start if start is not None else None
    with C10dMeter() as meter:
        start = wire_bytes_written()
        result = fn(*args, **kwargs)
    dist.barrier(group=group)
    end = wire_bytes_written()
    wire = end - start - own if start is not None else None
    return BytesSent(wire, meter.logical_bytes_sent(), meter.records, result)
