"""Argument checks shared by our collectives: the op, the group, and equal sizes on all ranks.

A point-to-point algorithm whose ranks disagree about the tensor size does not fail: the
ranks wait for messages of sizes that never come, and hang. So every collective first
agrees on (numel, dtype) and raises the same ValueError on every rank when they differ.

The agreement is one all_reduce(MAX) of two integers, [key, -key], with the key encoding
numel, dtype and element size: all ranks agree exactly when max(key) == min(key). Only when
they disagree does a second, slower all_gather fetch every rank's values for the message.
(On Gloo a 2-element all_reduce is cheaper than an all_gather of a few bytes per rank;
``python -m dpcourse.bench collectives`` measures both.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# dtypes are compared across ranks by their index here (-1: any other dtype)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def reduce_op_name(op, tensor: torch.Tensor, caller: str) -> str:
    """'sum' or 'avg' from a string or ``dist.ReduceOp``; a clear error for anything else."""
    name = op.lower() if isinstance(op, str) else None
    if name is None:
        for candidate in ("sum", "avg"):
            try:
                if op == getattr(dist.ReduceOp, candidate.upper()):
                    name = candidate
            except TypeError:
                pass
    if name not in ("sum", "avg"):
        raise ValueError(f"{caller} supports op='sum' or op='avg' (or dist.ReduceOp.SUM/AVG), "
                         f"not {op!r}")
    if name == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"{caller}(op='avg') needs a floating-point tensor, got {tensor.dtype} "
                         "(dist.all_reduce refuses it too); use op='sum' and divide, or convert "
                         "the tensor with .float()")
    return name


def group_info(group) -> tuple:
    """(group, this rank in the group, the group's size); a clear error outside of one."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("no process group: call dist.init_process_group first, or run this "
                           "on the ranks of a dpc.Cluster (cluster.run(fn))")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given group; call the collective "
                         "only on the group's ranks")
    return group, rank, dist.get_world_size(group)


def flat_view(tensor: torch.Tensor, caller: str) -> torch.Tensor:
    """The tensor as 1-D without copying; a clear error if that is impossible."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{caller} needs a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{caller} works in place and needs a contiguous tensor; "
                         "call it on tensor.contiguous() and copy the result back")
    return tensor.view(-1)


def check_same_size(flat: torch.Tensor, group, world_size: int, caller: str) -> None:
    """Raise the same ValueError on every rank unless all ranks pass equal numel and dtype."""
    code = _DTYPES.index(flat.dtype) + 1 if flat.dtype in _DTYPES else 0  # < 16
    key = (flat.numel() * 16 + code) * 32 + flat.element_size()  # element_size <= 16
    bounds = torch.tensor([key, -key], dtype=torch.int64, device=flat.device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    largest, minus_smallest = bounds.tolist()
    if largest == -minus_smallest:  # all ranks passed the same key
        return
    mine = torch.tensor([flat.numel(), code], dtype=torch.int64, device=flat.device)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=group)
    names = {i + 1: str(d).replace("torch.", "") for i, d in enumerate(_DTYPES)}
    listed = ", ".join(f"rank {r}: {n} elements of {names.get(c, 'another dtype')}"
                       for r, (n, c) in enumerate(t.tolist() for t in everyone))
    raise ValueError(f"{caller} needs the same number of elements and dtype on every rank, "
                     f"got {listed}. Pass tensors of one size on all ranks (pad the smaller "
                     "ones), or use dist.all_gather_object for data of varying size.")
