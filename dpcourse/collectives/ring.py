"""Ring reduce-scatter, all-gather and all-reduce, built only on ``dist.isend``/``dist.irecv``.

The ranks form a ring (rank r sends to r+1, receives from r-1) and the tensor is cut into N
chunks (``schedule.chunk_bounds``, as ``torch.tensor_split`` cuts it). Reduce-scatter: N-1
steps, each rank passes one chunk on and adds the chunk that arrives; afterwards rank r holds
chunk r fully reduced. All-gather: N-1 more steps pass the reduced chunks on until every
rank has all of them. Each rank sends (N-1)/N of the tensor per phase, 2(N-1)/N in all --
the least any all-reduce can send per rank (Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009).

Each loop walks the schedule the simulator plays (``schedule.ring_reduce_scatter_steps``,
``ring_all_gather_steps``), one step per iteration, in three verbs: post the send, post the
receive, wait. ``fast_ring.py`` walks the same schedule pipelined, for speed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import check_same_size, flat_view, group_info, reduce_op_name
from .schedule import ring_all_gather_steps, ring_reduce_scatter_steps


def ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, trace=None) -> None:
    """Ring all-reduce in place, like ``dist.all_reduce(tensor)``: reduce-scatter, then
    all-gather; 2(N-1) steps, each rank sends 2(N-1)/N of the tensor's bytes.

    op: "sum" or "avg" (or ``dist.ReduceOp.SUM``/``AVG``). trace: a ``Trace`` to fill.
    """
    ring = Ring(tensor, op, group, trace, "ring_all_reduce")  # same size on every rank?
    reduce_scatter_phase(ring)                    # rank r: chunk r summed over all ranks
    all_gather_phase(ring, first_step=ring.world_size - 1)  # every rank: every chunk
    ring.finish()


def reduce_scatter_phase(ring: "Ring") -> None:
    """N-1 steps: send a chunk to the right, add the chunk that arrives from the left.
    Afterwards chunk ``ring.rank`` holds the sum (or mean) over all ranks."""
    buffer = torch.empty_like(ring.chunks[0])  # receives land here; chunk 0 is the largest
    for step in ring_reduce_scatter_steps(ring.world_size):
        mine, theirs = step[ring.rank], step[ring.left]  # what I send; what comes to me
        incoming = buffer[:ring.chunks[theirs.chunk].numel()]
        ring.observe(mine)  # a Trace, if given, records what is about to be sent
        # the three verbs of a step: post the send, post the receive, wait for both
        send = dist.isend(ring.chunks[mine.chunk], group=ring.group, group_dst=mine.dst)
        recv = dist.irecv(incoming, group=ring.group, group_src=theirs.src)
        send.wait()
        recv.wait()
        ring.chunks[theirs.chunk].add_(incoming)  # my partial sum + everyone's before me
    if ring.average:
        ring.chunks[ring.rank].div_(ring.world_size)


def all_gather_phase(ring: "Ring", first_step: int = 0) -> None:
    """N-1 steps: send a finished chunk to the right, receive one from the left straight
    into place. ``first_step`` numbers the steps (after a reduce-scatter: N-1)."""
    for step in ring_all_gather_steps(ring.world_size, first_step):
        mine, theirs = step[ring.rank], step[ring.left]
        ring.observe(mine)  # a Trace, if given, records what is about to be sent
        # the three verbs of a step: post the send, post the receive, wait for both
        send = dist.isend(ring.chunks[mine.chunk], group=ring.group, group_dst=mine.dst)
        recv = dist.irecv(ring.chunks[theirs.chunk], group=ring.group, group_src=theirs.src)
        send.wait()
        recv.wait()


def ring_reduce_scatter(tensor: torch.Tensor, op="sum", group=None, trace=None) -> torch.Tensor:
    """Ring reduce-scatter in place; returns this rank's reduced chunk (a view of ``tensor``).

    Chunk r of the flattened tensor is ``schedule.chunk_bounds(numel, N)[r]``; the other
    chunks are left holding partial sums. Each rank sends (N-1)/N of the tensor's bytes.
    """
    ring = Ring(tensor, op, group, trace, "ring_reduce_scatter")
    reduce_scatter_phase(ring)
    ring.finish()
    return ring.chunks[ring.rank]


def ring_all_gather(tensor: torch.Tensor, group=None, trace=None) -> torch.Tensor:
    """Ring all-gather in place: rank r's chunk r of ``tensor`` goes to every rank.

    Chunk bounds as in ``ring_reduce_scatter``; each rank sends (N-1)/N of the tensor.
    Returns ``tensor``.
    """
    ring = Ring(tensor, "sum", group, trace, "ring_all_gather")
    all_gather_phase(ring)
    ring.finish()
    return tensor


class Ring:
    """One rank's view of the ring for one call: its chunks (views of the flattened tensor),
    its neighbour on the left, the group, and the trace that observes it (if any).

    Creating it checks the arguments and that every rank passes a tensor of the same size
    and dtype (``checks.check_same_size``: one small all_reduce), raising the same
    ValueError on every rank instead of letting mismatched sends hang.
    """

    def __init__(self, tensor: torch.Tensor, op, group, trace, algorithm: str):
        self.average = reduce_op_name(op, tensor, algorithm) == "avg"
        self.flat = flat_view(tensor, algorithm)
        self.group, self.rank, self.world_size = group_info(group)
        check_same_size(self.flat, self.group, self.world_size, algorithm)
        self.left = (self.rank - 1) % self.world_size
        self.chunks = self.flat.tensor_split(self.world_size)  # = schedule.chunk_bounds
        self.trace = trace
        if trace is not None:
            trace.start(algorithm, self.world_size, self.rank, self.flat)

    def observe(self, send) -> None:
        """Tell the trace (if any) that this rank is about to post ``send`` (a
        ``schedule.Send``); it records the chunk's bytes and, if asked, its values."""
        if self.trace is not None:
            self.trace.sent(send.phase, send.step, send.src, send.dst, send.chunk,
                            self.chunks[send.chunk])

    def finish(self) -> None:
        """Tell the trace (if any) that the call is done (it keeps the result if asked)."""
        if self.trace is not None:
            self.trace.finish(self.rank, self.flat)
