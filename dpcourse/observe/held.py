"""What a rank holds, by the memory ledger's roles, measured two independent ways.

Runs on the ranks (inside ``dpc.observe.Memory``), never draws.

* ``held_bytes``: walks the model, its wrapper's own buffers and the optimizer, and sums the
  unique storages in each role (DTensor shards via ``to_local``, FSDP1 FlatParameters via
  their local shard, DDP's buckets as captured by ``capture_buckets``).
* ``record.StepRecorder``: PyTorch's ``MemTracker`` (``FSDPMemTracker`` for FSDP2) sees every
  storage created, resized or freed during a step; we log each change with the phase it
  happened in (forward/backward of which unit, optimizer step) and, after the step, file
  every storage under the role ``held_bytes`` found it in at some moment of the step. A
  storage seen in no role is filed by the tracker's own label (FSDP2's all-gather and
  reduce-scatter buffers) or else by when it was born: forward -> activations, later ->
  temporaries.
"""
from __future__ import annotations

import torch
from torch import nn

from ..torch_private import fsdp1_flat_param, fsdp1_flat_tensors, fsdp2_param_tensors
from .watch import local as _local

ROLE_ORDER = ("parameters", "gradients", "optimizer_state", "bucket_buffers",
              "unsharded_parameters", "unsharded_gradients")
# FSDPMemTracker's own labels for buffers no role walk can see (they live inside FSDP2).
TOOL_LABELS = {"All Gather": "unsharded_parameters", "Unsharded Param": "unsharded_parameters",
               "Reduce Scatter": "unsharded_gradients", "Unsharded Grad": "unsharded_gradients"}


def wrapper_kind(model: nn.Module) -> str:
    """'fsdp', 'fully_shard' or 'plain' (DDP, a bare module, or a from-scratch wrapper)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return "fully_shard"
    return "plain"


def role_tensors(model: nn.Module, optimizer, buckets=()):
    """(role, tensor) pairs for everything the model, its wrapper and the optimizer hold now."""
    kind = wrapper_kind(model)
    if kind == "fsdp":
        for flat in fsdp1_flat_params(model):
            inside = fsdp1_flat_tensors(flat)
            yield "parameters", inside["local_shard"]
            grad = flat.grad
            if grad is not None:  # unsharded between accumulation and the reduce-scatter
                yield ("gradients" if grad.numel() == inside["local_shard"].numel() else "unsharded_gradients"), grad
            if inside["saved_grad_shard"] is not None:
                yield "gradients", inside["saved_grad_shard"]
            if inside["full_param_padded"] is not None:
                yield "unsharded_parameters", inside["full_param_padded"]
    elif kind == "fully_shard":
        for fp in _fsdp2_params(model):
            yield "parameters", _local(fp["sharded_param"])
            if fp["sharded_param"].grad is not None:
                yield "gradients", _local(fp["sharded_param"].grad)
            unsharded = fp["unsharded_param"]
            if unsharded is not None:
                yield "unsharded_parameters", unsharded
                if unsharded.grad is not None:
                    yield "unsharded_gradients", unsharded.grad
            for out in fp["all_gather_outputs"]:
                yield "unsharded_parameters", out
    else:
        for p in model.parameters():
            yield "parameters", _local(p)
            if p.grad is not None:
                yield "gradients", _local(p.grad)
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                yield "optimizer_state", _local(value)
    for bucket in (buckets.values() if isinstance(buckets, dict) else buckets):
        yield "bucket_buffers", bucket


def fsdp1_flat_params(model):
    """FSDP1's FlatParameters, one per unit that holds parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for module in model.modules():
        flat = fsdp1_flat_param(module) if isinstance(module, FullyShardedDataParallel) else None
        if flat is not None:
            yield flat


def _fsdp2_params(model):
    """FSDP2's tensors of each parameter (``torch_private.fsdp2_param_tensors``), unit by unit."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield from fsdp2_param_tensors(module)


def held_bytes(model: nn.Module, optimizer, buckets=()) -> dict:
    """Bytes of unique storages this rank holds now, by role (per rank, no double counting).

    A storage in two roles counts once, in the first of ``ROLE_ORDER`` (DDP's
    ``gradient_as_bucket_view`` makes gradients views of the buckets: they count as gradients).
    Storages resized to 0 (FSDP's freed unsharded buffers) count 0.
    """
    seen, out = set(), dict.fromkeys(ROLE_ORDER, 0)
    for role, tensor in sorted(role_tensors(model, optimizer, buckets), key=lambda rt: ROLE_ORDER.index(rt[0])):
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else ("empty", id(storage))
        if key not in seen:
            seen.add(key)
            out[role] += storage.nbytes()
    return out


def capture_buckets(ddp_model) -> dict:
    """Register a DDP comm hook that keeps the latest flat bucket buffers: {bucket index: buffer}.

    The reducer's buckets live in C++; the comm hook is where DDP hands them to Python. The
    hook then all-reduces the bucket exactly as DDP's default does (average over ranks).
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets: dict = {}  # bucket index -> its flat buffer (the latest one DDP handed over)

    def hook(state, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(dist.group.WORLD, hook)
    return buckets
