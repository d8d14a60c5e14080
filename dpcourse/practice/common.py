"""What every large-model demo shares: the model, the batch each rank trains on, one step.

The model is the course's MLP (``dpcourse.models.MLP``: blocks of Linear + GELU, then a
linear head), sharded with FSDP2 the usual way: ``fully_shard`` on each block, then on the
root. The global batch is the same synthetic data everywhere; rank r trains on its r-th
slice, so a step on N ranks must equal a step of one process on the whole batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import models


def shard(model: nn.Module, **options) -> nn.Module:
    """FSDP2: one unit per block, then the root (the head); ``options`` go to ``fully_shard``."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, **options)
    return fully_shard(model, **options)


def global_batch(batch_size: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``batch_size`` samples (inputs, targets), identical in every process."""
    data = models.make_dataset("mlp", batch_size, seed=seed)
    return data.tensors


def rank_batch(batch_size: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal slice of the global batch (``batch_size`` must divide by the world size)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if batch_size % world_size:
        raise ValueError(f"batch_size={batch_size} must be divisible by world_size={world_size}")
    share = batch_size // world_size
    return tuple(t[rank * share:(rank + 1) * share].clone() for t in global_batch(batch_size, seed))


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the batch (a mean, so the ranks' average is the global loss)."""
    return models.loss_fn("mlp", model(inputs), targets)


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter (a plain parameter is returned whole), detached."""
    from torch.distributed.tensor import DTensor

    return {name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def assemble(shards_by_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Kernel side: glue the ranks' dim-0 shards (``local_shards``) back into whole tensors."""
    return {name: torch.cat([shards[name] for shards in shards_by_rank]) for name in shards_by_rank[0]}
