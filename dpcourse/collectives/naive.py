"""Two all-reduces that send more than the ring, for contrast; also built on isend/irecv.

``naive_all_reduce``: every rank sends its whole tensor to a root, which adds them up and
sends the sum back. The root sends and receives (N-1) whole tensors, the others one each,
so the root's link carries (N-1)/2 times what a ring rank sends, and grows with N.

``whole_ring_all_reduce``: the ranks pass *whole* tensors around the ring, each adding what
arrives and passing it on, N-1 times -- the ring of PyTorch's "Writing Distributed
Applications with PyTorch" tutorial. Every rank sends (N-1) whole tensors: (N-1)*S bytes
instead of the ring all-reduce's 2(N-1)/N*S.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import check_same_size, flat_view, group_info, reduce_op_name


def _start(tensor, op, group, trace, caller):
    avg = reduce_op_name(op, tensor, caller) == "avg"
    flat = flat_view(tensor, caller)
    group, rank, n = group_info(group)
    check_same_size(flat, group, n, caller)
    if trace is not None:
        trace.start(caller, n, rank, flat)
    return flat, group, rank, n, avg


def naive_all_reduce(tensor: torch.Tensor, op="sum", group=None, trace=None, root: int = 0) -> None:
    """All-reduce in place by reduce-to-``root`` then broadcast, with whole-tensor messages.

    Bytes sent: (N-1)*S by the root, S by every other rank (S: the tensor's bytes).
    """
    flat, group, rank, n, avg = _start(tensor, op, group, trace, "naive_all_reduce")
    if not 0 <= root < n:
        raise ValueError(f"root must be a rank of the group (0..{n - 1}), got {root}")
    if n > 1:
        if rank == root:
            others = [r for r in range(n) if r != root]
            buffers = [torch.empty_like(flat) for _ in others]
            recvs = [dist.irecv(b, group=group, group_src=r) for b, r in zip(buffers, others)]
            for work, buf in zip(recvs, buffers):  # add in rank order: same sum on every run
                work.wait()
                flat.add_(buf)
            if avg:
                flat.div_(n)
            sends = [dist.isend(flat, group=group, group_dst=r) for r in others]
            if trace is not None:
                for r in others:
                    trace.sent("broadcast", 1, rank, r, None, flat)
            for work in sends:
                work.wait()
        else:
            dist.isend(flat, group=group, group_dst=root).wait()
            if trace is not None:
                trace.sent("reduce", 0, rank, root, None, flat)
            dist.irecv(flat, group=group, group_src=root).wait()
    if trace is not None:
        trace.finish(rank, flat)


def whole_ring_all_reduce(tensor: torch.Tensor, op="sum", group=None, trace=None) -> None:
    """All-reduce in place by passing whole tensors around the ring, N-1 steps.

    Bytes sent: (N-1)*S by every rank (S: the tensor's bytes).
    """
    flat, group, rank, n, avg = _start(tensor, op, group, trace, "whole_ring_all_reduce")
    right, left = (rank + 1) % n, (rank - 1) % n
    outgoing = flat.clone()             # what we pass on: our own tensor first
    incoming = torch.empty_like(flat)
    for step in range(n - 1):
        send = dist.isend(outgoing, group=group, group_dst=right)
        if trace is not None:
            trace.sent("pass", step, rank, right, None, outgoing)
        dist.irecv(incoming, group=group, group_src=left).wait()
        flat.add_(incoming)
        send.wait()
        outgoing, incoming = incoming, outgoing  # pass on what just arrived
    if avg and n > 1:
        flat.div_(n)
    if trace is not None:
        trace.finish(rank, flat)
