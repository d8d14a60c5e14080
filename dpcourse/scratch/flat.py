"""One FSDP unit's parameters as one flat tensor: sharded 1/N per rank, gathered when needed.

``FlatUnit`` is the bookkeeping MiniFSDP needs per wrapped unit, modelled on FSDP1's
``FlatParameter`` (Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.2): the unit's
parameters are concatenated, padded to a multiple of the world size, and each rank keeps
one contiguous 1/N slice -- its shard, an fp32 ``nn.Parameter`` the optimizer steps. To
compute, the ranks all-gather the shards into ``full`` (in ``compute_dtype``); the module's
parameters become views of ``full``; afterwards ``full``'s storage is freed (resized to 0
bytes) and refilled for backward. A replicated unit (``sharded=False``) keeps the whole flat
tensor on every rank and all-reduces its gradient instead.

Collectives go through ``comm_hook(collective, output, input, name) -> Work``, which the
wrapper passes in (``MiniFSDP.comm_hook``), so that another collective or an observer
can take their place.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class FlatUnit:
    """The flat parameter of one unit: its shard (fp32 master), its gathered copy, its views."""

    def __init__(self, name: str, params: list, owners: list, sharded: bool, compute_dtype,
                 group):
        """params: the unit's parameters; owners[i]: [(module, attribute)] where params[i] lives."""
        self.name, self.params_names = name, [n for n, _ in params]
        self.sharded, self.group = sharded, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        tensors = [p for _, p in params]
        self.requires_grad = tensors[0].requires_grad
        self.shapes = [p.shape for p in tensors]
        self.numels = [p.numel() for p in tensors]
        self.numel = sum(self.numels)  # elements without padding
        n = self.world_size if sharded else 1
        self.padded = math.ceil(self.numel / n) * n  # FSDP1 pads the flat tensor to a multiple of N
        flat = torch.zeros(self.padded, dtype=torch.float32, device=tensors[0].device)
        torch.cat([p.detach().reshape(-1).float() for p in tensors], out=flat[:self.numel])
        size = self.padded // n
        start = self.rank * size if sharded else 0
        self.shard = nn.Parameter(flat[start:start + size].clone(), requires_grad=self.requires_grad)
        self.dtype = compute_dtype or torch.float32
        self.full = torch.empty(self.padded, dtype=self.dtype, device=flat.device)
        self.full.requires_grad_(self.requires_grad)
        self.owners = owners
        self.gathered = False
        self.free()
        self.pending = []  # (work, output, input) of each gradient reduction in flight

    @property
    def full_nbytes(self) -> int:
        """Bytes of the gathered (padded) flat tensor in the compute dtype."""
        return self.padded * self.full.element_size()

    # --- parameters ---------------------------------------------------------------------
    def gather(self, comm_hook) -> None:
        """Fill ``full`` from every rank's shard (an all-gather, waited for)."""
        self.full.untyped_storage().resize_(self.full_nbytes)
        source = self.shard.detach().to(self.dtype)
        # write through .data: refilling the storage must not look like an in-place change
        # of tensors autograd saved (the views) -- what FSDP1 does too
        if self.sharded:
            comm_hook("all_gather", self.full.data, source, self.name).wait()
        else:
            self.full.data.copy_(source)
        self.gathered = True

    def set_views(self) -> None:
        """Make every owner's attribute a view of ``full`` (call under the forward's grad mode,
        so that the views are created under autograd and gradients flow into ``full``)."""
        views = self.full.split(self.numels + [self.padded - self.numel])
        for view, shape, owners in zip(views, self.shapes, self.owners):
            v = view.view(shape)
            for module, attr in owners:
                module.__dict__[attr] = v

    def free(self) -> None:
        """Release ``full``'s memory (its storage shrinks to 0 bytes; autograd's saved views
        keep pointing at it and see the data again after the next ``gather``)."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        placeholder = torch.empty(0, dtype=self.dtype, device=self.full.device)
        for owners in self.owners:
            for module, attr in owners:
                module.__dict__[attr] = placeholder  # the full parameter is gone

    # --- gradients -----------------------------------------------------------------------
    def reduce_gradient(self, comm_hook) -> None:
        """Start averaging ``full.grad`` over ranks into this rank's shard of it (a
        reduce-scatter, or an all-reduce for a replicated unit)."""
        grad = self.full.grad
        self.full.grad = None
        grad.div_(self.world_size)  # divide before summing: no overflow in half precision
        if self.sharded:
            out = torch.empty(self.shard.numel(), dtype=grad.dtype, device=grad.device)
            work = comm_hook("reduce_scatter", out, grad, self.name)
        else:
            out, work = grad, comm_hook("all_reduce", grad, grad, self.name)
        self.pending.append((work, out, grad))  # the input must live until the work is done

    def finish_gradient(self) -> None:
        """Wait for the reductions (one per backward through this unit since the last call)
        and add their results, in fp32, to the shard's gradient."""
        pending, self.pending = self.pending, []
        for work, out, _ in pending:
            work.wait()
            grad = out.float()  # half precision -> fp32 master gradient (fp32: the same tensor)
            if self.shard.grad is None:
                self.shard.grad = grad
            else:
                self.shard.grad.add_(grad)  # accumulation over several backward passes

    def full_parameters(self) -> list[torch.Tensor]:
        """The unit's full fp32 parameters (all-gathered from the master shards), unpadded."""
        flat = torch.empty(self.padded, dtype=torch.float32, device=self.shard.device)
        if self.sharded:
            dist.all_gather_single(flat, self.shard.detach(), group=self.group)
        else:
            flat.copy_(self.shard.detach())
        return [v.view(s).clone() for v, s in zip(flat.split(self.numels + [self.padded - self.numel]),
                                                  self.shapes)]
