"""Gradient clipping when every rank holds only a shard of the gradients.

Clipping scales all gradients by ``max_norm / total_norm`` when the norm of *all* gradients
together exceeds ``max_norm``. With sharding no rank has all gradients, so the norm needs a
collective: each rank sums the squares of its shard, an all-reduce adds the ranks' sums.

* FSDP2: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` does it by itself,
  since the gradients are DTensors: the norm it returns is a DTensor (``.full_tensor()``).
* FSDP1: call the wrapper's own ``model.clip_grad_norm_(max_norm)``. The plain
  ``torch.nn.utils.clip_grad_norm_`` sees only this rank's flat shard, so each rank computes
  a different, too small norm and clips by its own factor: silently wrong.
"""
from __future__ import annotations

import torch

from .. import models
from .common import global_batch, loss_of, rank_batch, shard


def _grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {name: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters()}


def clip_fully_shard(max_norm: float = 0.1, batch_size: int = 16) -> dict:
    """On every rank: FSDP2 backward, then ``clip_grad_norm_``; total norm and this rank's clipped grads."""
    model = shard(models.build_model("mlp"))
    loss_of(model, *rank_batch(batch_size)).backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {"total_norm": total_norm.full_tensor().item(), "grads": _grads(model)}


def clip_fsdp1(method: str, max_norm: float = 0.1, batch_size: int = 16) -> dict:
    """On every rank: FSDP1 backward, then ``method`` "fsdp" (``model.clip_grad_norm_``) or
    "torch" (``torch.nn.utils.clip_grad_norm_``, the bug); the norm this rank computed."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(models.build_model("mlp"), device_id=torch.device("cpu"), use_orig_params=True)
    loss_of(model, *rank_batch(batch_size)).backward()
    if method == "fsdp":
        total_norm = model.clip_grad_norm_(max_norm)
    else:
        total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    with FSDP.summon_full_params(model, with_grads=True):
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"total_norm": total_norm.item(), "grads": grads}


def clip_whole(max_norm: float = 0.1, batch_size: int = 16) -> dict:
    """The reference in one process: whole model, whole batch, ``clip_grad_norm_``."""
    model = models.build_model("mlp")
    loss_of(model, *global_batch(batch_size)).backward()
    total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return {"total_norm": total_norm.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}

