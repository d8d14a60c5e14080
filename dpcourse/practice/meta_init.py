"""A model too big for one rank: build it on the meta device, shard it, then materialise the shards.

The order is the whole trick (as in torchtitan's training script):

1. ``with torch.device("meta"):`` build the model. Parameters get shapes and dtypes but no
   storage, so building costs no memory however big the model is.
2. ``fully_shard`` each block, then the root. Each parameter becomes a ``DTensor`` whose local
   shard is still on the meta device.
3. ``model.to_empty(device=...)`` allocates real, uninitialised storage for the local shards only.
4. Initialise the shards. Here ``init_weights`` draws each parameter from nn.Linear's default
   distribution with its own generator and keeps this rank's rows: at most one parameter is
   ever whole, never the model, and every rank count gives the same model.

Why not ``reset_parameters()``? On GPUs, DTensor's random-number tracker makes each rank draw
its own part of one random tensor. On a CPU mesh it does not (PyTorch warns "DTensor random
operators may not have complete support on cpu device mesh"): every rank draws its shard
from the same seed, so the ranks' rows repeat each other. ``reset_parameter_shards`` shows it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import models
from .common import local_shards, loss_of, rank_batch, shard


def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every Linear with U(-1/sqrt(fan_in), 1/sqrt(fan_in)) from per-parameter generators;
    a sharded (DTensor) parameter keeps only this rank's rows of the same values."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if sum(p.numel() for m in linears for p in m.parameters(recurse=False)) != sum(
            p.numel() for p in model.parameters()):
        raise ValueError("init_weights knows nn.Linear only; give other layers their own init")
    params = [(m.in_features, p) for m in linears for p in (m.weight, m.bias) if p is not None]
    with torch.no_grad():
        for i, (fan_in, p) in enumerate(params):
            bound = 1 / math.sqrt(fan_in)
            g = torch.Generator().manual_seed(seed * 10_000 + i)
            whole = torch.empty(p.shape).uniform_(-bound, bound, generator=g)  # one parameter at a time
            if isinstance(p, DTensor):  # keep this rank's rows; src_data_rank=None: no communication
                whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
                p.to_local().copy_(whole.to_local())
            else:
                p.copy_(whole)
    return model


def build_on_meta(**sizes) -> nn.Module:
    """The MLP with shapes only: no parameter storage anywhere."""
    with torch.device("meta"):
        return models.MLP(**sizes)


def materialise(model: nn.Module, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """Allocate the local shards on ``device`` and initialise them (after ``shard``)."""
    model.to_empty(device=device)
    return init_weights(model, seed)


def train_from_meta(seed: int = 0, batch_size: int = 16, lr: float = 0.1, observe=None) -> dict:
    """On every rank: meta -> shard -> materialise -> one SGD step; this rank's shards after it.

    ``observe(model)`` is called after each stage (for measuring, e.g.
    ``measure.parameter_bytes``); its results are returned under "observed", by stage.
    """
    observe = observe or (lambda model: None)
    seen = {}
    model = build_on_meta()
    seen["built on meta"] = observe(model)
    shard(model)
    seen["sharded"] = observe(model)
    materialise(model, "cpu", seed)
    seen["materialised"] = observe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_of(model, *rank_batch(batch_size)).backward()
    optimizer.step()
    seen["after one step"] = observe(model)
    return {"observed": seen, "shards": local_shards(model)}


def train_whole(seed: int = 0, batch_size: int = 16, lr: float = 0.1) -> dict[str, torch.Tensor]:
    """The reference in one process: the whole model, built normally, one step on the whole batch."""
    from .common import global_batch

    model = init_weights(models.MLP(), seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_of(model, *global_batch(batch_size)).backward()
    optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reset_parameter_shards(seed: int = 0) -> dict[str, torch.Tensor]:
    """On every rank: meta -> shard -> ``to_empty`` -> ``reset_parameters()`` under one seed; shards."""
    import warnings

    model = shard(build_on_meta())
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # the CPU-mesh warning this function exists to show
        warnings.simplefilter("ignore", UserWarning)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    return local_shards(model)
