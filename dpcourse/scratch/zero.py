"""``ShardedOptimizer``: ZeRO stage 1 -- each rank keeps and steps 1/N of the optimizer state.

    model = BucketedDDP(model)                        # gradients averaged as usual (full)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The constructor has the shape of ``torch.distributed.optim.ZeroRedundancyOptimizer(params,
optimizer_class, process_group=None, **defaults)``. The partition is the ZeRO paper's
(Rajbhandari et al. 2020, sec. 5.1): each parameter group is flattened into one buffer,
padded to a multiple of N, and rank r owns the r-th contiguous slice. The model's
parameters become views of that buffer, so after each rank has stepped its slice, one
all-gather into the buffer updates every parameter on every rank. (PyTorch's
ZeroRedundancyOptimizer assigns whole parameters to ranks instead and broadcasts them.)
Optimizers that work element by element (SGD, Adam, AdamW, ...) give exactly the
unsharded result; frozen parameters are left out, as they would get no update anyway.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class _FlatGroup:
    """One parameter group as a padded flat buffer; the parameters are views of it."""

    def __init__(self, params: list[torch.Tensor], world_size: int, rank: int):
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"the parameters of one group must share dtype and device, got {dtypes}; "
                             "put each dtype in its own parameter group")
        self.params = params
        self.numel = sum(p.numel() for p in params)
        padded = math.ceil(self.numel / world_size) * world_size
        self.flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        self.offsets, offset = [], 0
        with torch.no_grad():
            for p in params:
                self.flat[offset:offset + p.numel()].copy_(p.reshape(-1))
                p.data = self.flat[offset:offset + p.numel()].view_as(p)  # the buffer owns the data
                self.offsets.append(offset)
                offset += p.numel()
        size = padded // world_size
        self.lo, self.hi = rank * size, (rank + 1) * size
        self.shard = nn.Parameter(self.flat[self.lo:self.hi])  # shares the buffer's storage

    def shard_gradient(self) -> torch.Tensor:
        """This rank's slice of the flattened gradients (zeros where a gradient is None)."""
        grad = torch.zeros_like(self.shard)
        for p, start in zip(self.params, self.offsets):
            lo, hi = max(start, self.lo), min(start + p.numel(), self.hi)
            if lo < hi and p.grad is not None:
                grad[lo - self.lo:hi - self.lo].copy_(p.grad.reshape(-1)[lo - start:hi - start])
        return grad


class ShardedOptimizer:
    """ZeRO-1: ``optimizer_class`` over this rank's shard only; parameters all-gathered after."""

    def __init__(self, params, optimizer_class, process_group=None, **defaults):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs a process group: run it on the ranks of a "
                               "dpc.Cluster (cluster.run(fn)) or after dist.init_process_group")
        self.group = process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        groups = list(params)
        if not groups:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.flat_groups, local_groups = [], []
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            flat = _FlatGroup(params, self.world_size, self.rank)
            self.flat_groups.append(flat)
            local_groups.append({"params": [flat.shard], **options})
        self.optim = optimizer_class(local_groups, **defaults)  # sees only this rank's shards

    @property
    def param_groups(self):
        """The local optimizer's groups (one shard each): change lr etc. here, as usual."""
        return self.optim.param_groups

    @property
    def state(self):
        """The local optimizer's state: only this rank's shard of it."""
        return self.optim.state

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shard, then all-gather every rank's updated shard into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for flat in self.flat_groups:
            flat.shard.grad = flat.shard_gradient()
        self.optim.step()
        for flat in self.flat_groups:
            flat.shard.grad = None  # the shard's gradient is a temporary copy
            # in place: our shard is already where the all-gather puts it
            dist.all_gather_single(flat.flat, flat.shard.detach(), group=self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the (full) gradients of the model's parameters."""
        for flat in self.flat_groups:
            for p in flat.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def __repr__(self) -> str:
        return (f"ShardedOptimizer({type(self.optim).__name__}, rank {self.rank} of {self.world_size}, "
                f"{sum(f.shard.numel() for f in self.flat_groups)} of "
                f"{sum(f.numel for f in self.flat_groups)} elements)")
