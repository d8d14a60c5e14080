"""What 4.2a's try-its share; each try-it is a file of its own (``comm_hook``, ``ddp_script``,
``no_sync``, ``sampler``). 4.2a's try-its: DDP written by the learner (checked on the notebook's
ranks).

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process's gradient of the whole global batch), and judges what happened:
gradients, and what the ranks sent, seen from outside (a counting comm hook, ``Comm``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import models

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


def grads_of(model) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def global_grads(samples_per_rank: int, world_size: int) -> list[torch.Tensor]:
    """One process: the gradient of the mean loss over every rank's samples (the ground truth)."""
    model = models.build_model("mlp", seed=0)
    x, y = models.make_dataset("mlp", samples_per_rank * world_size).tensors
    F.mse_loss(model(x), y).backward()
    return grads_of(model)
