"""What 4.2e's try-its share; each try-it is a file of its own (``eval_metric``, ``powersgd``,
``zero1``). 4.2e's try-its: an evaluation metric shared by the ranks, PowerSGD sent in fp16, and
ZeRO-1 as PyTorch ships it, with a learning rate of its own for the head (checked on the
notebook's ranks).

Each checker runs the learner's function on every rank and judges what it did against one
process or a rule derived apart from the learner's code: the samples the model was shown (a
forward hook), the value every rank returned, the bytes each step all-reduced, the weights
after a few steps, the optimizer state each rank holds.
"""
from __future__ import annotations

import functools

import torch

from ... import models

TIMEOUT = 20.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-5, 1e-6


@functools.lru_cache(maxsize=None)
def mlp() -> tuple[tuple[torch.Size, ...], int]:
    """The demo MLP's parameter shapes and its bytes (fp32; it has no buffers): what the
    checkers' formulas count, read once."""
    shapes = tuple(p.shape for p in models.build_model("mlp").parameters())
    return shapes, 4 * sum(s.numel() for s in shapes)
