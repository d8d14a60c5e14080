"""One real, traced all-reduce on a cluster's ranks, next to ``dist.all_reduce`` of the same data.

What the ring figure and player of the course replay: the trace is recorded on the ranks
while they run, and ``reference`` is what PyTorch's own all-reduce gives on the same inputs,
so the last frame of the replay can be checked against it. ``function`` names the function
the ranks called, so a notebook that prints a function's source can check it is what ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .naive import naive_all_reduce, whole_ring_all_reduce
from .ring import ring_all_reduce
from .trace import Trace

# what each algorithm name runs on the ranks: the plain, readable functions
ALGORITHMS = {"ring_all_reduce": ring_all_reduce, "naive_all_reduce": naive_all_reduce,
              "whole_ring_all_reduce": whole_ring_all_reduce}


@dataclass
class TracedRun:
    """``trace``: the merged trace, with values; ``reference[r]``: rank r's tensor after
    ``dist.all_reduce`` of the same input; ``function``: "module.name" of the function every
    rank called (``qualified_name``)."""
    trace: Trace
    reference: list
    function: str = ""


def qualified_name(fn) -> str:
    """"module.name" of a function, e.g. "dpcourse.collectives.ring.ring_all_reduce"."""
    return f"{fn.__module__}.{fn.__qualname__}"


def rank_input(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: ``numel`` integers 0..9 (int64), seeded by (seed, rank), so
    sums are exact and every run shows the same numbers."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, 10, (numel,), generator=g, dtype=torch.int64)


def _traced_on_rank(algorithm: str, numel: int, seed: int):
    x = rank_input(dist.get_rank(), numel, seed)
    expected = x.clone()
    dist.all_reduce(expected)
    trace = Trace(record_values=True)
    fn = ALGORITHMS[algorithm]
    fn(x, trace=trace)
    return trace, expected, qualified_name(fn)


def trace_all_reduce(cluster, numel: int = 8, algorithm: str = "ring_all_reduce",
                     seed: int = 0, timeout: float = 60) -> TracedRun:
    """Run ``algorithm`` on every rank of ``cluster`` with tracing on a tensor of ``numel``
    elements (``rank_input``); return the merged trace and dist.all_reduce's result."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}")
    out = cluster.run(_traced_on_rank, algorithm, numel, seed, timeout=timeout)
    return TracedRun(Trace.merge(t for t, _, _ in out), [e for _, e, _ in out], out[0][2])
