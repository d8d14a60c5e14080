"""What 4.2g's try-its share; each try-it is a file of its own (``compile_blocks``, ``hsdp_clip``).
4.2g's try-its: FSDP2 with each block compiled, and HSDP on a 2-D mesh with its gradients
clipped across the mesh (checked on the notebook's ranks).

Each checker runs the learner's function on every rank next to a reference computed on the
same rank (one process on the whole global batch), and judges what happened: the units and
the parameters' placements, the graphs ``torch.compile`` handed its backend (the check passes
a backend that records them and runs each as it was captured), the parameters' names, the
norm returned and the gradients after clipping.
"""
from __future__ import annotations

import torch

from ... import models
from .shared import fsdp_imports

TIMEOUT = 60.0          # seconds for one check's call on the ranks: the first compile takes seconds
BATCH, LR = 4, 0.1      # samples per rank, SGD's learning rate
LINEARS_PER_BLOCK = 4   # a transformer block's qkv, proj, fc1 and fc2


def warm_up() -> None:
    """FSDP, DTensor and Dynamo imported on every rank before a timed call."""
    fsdp_imports()
    torch.compiler.reset()   # loads Dynamo, which a first torch.compile would take seconds to import


def one_process(name: str, x, y, max_norm: float | None = None) -> tuple[dict, dict, float]:
    """One process on the whole global batch: weights after one SGD step, the gradients (clipped
    to ``max_norm`` when given) and their total norm before clipping."""
    model = models.build_model(name, seed=0)
    models.loss_fn(name, model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: p.detach() for k, p in model.named_parameters()}, grads, float(norm)


def linears(gm) -> int:
    """How many linear layers a captured graph computes."""
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_module") and "linear" in str(n.target))
