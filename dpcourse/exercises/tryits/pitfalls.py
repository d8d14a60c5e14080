"""What 4.2d's try-its share; each try-it is a file of its own (``join``, ``sync_batchnorm``).
4.2d's try-its: two pitfalls fixed by the learner (checked on the notebook's ranks).

* ``sync_batchnorm``: a CNN with two BatchNorm layers prepared for DDP so that every layer
  normalises with the global batch's statistics. Judged on the ranks, on uneven per-rank
  batches: each layer's running statistics against those of the inputs all ranks fed it,
  the outputs and one training step against one process on the global batch.
* ``join``: DDP training through uneven numbers of batches per rank. Judged: it finishes
  (a hang is reported within ``JOIN_TIMEOUT``), each rank's optimizer steps, and the final
  weights against a simulation, in one process, of what DDP's join hook does.

SyncBatchNorm on a CPU: this PyTorch runs it on accelerators only. Its forward refuses a CPU
input, DDP refuses to wrap it on a CPU, and the five kernels its autograd function calls
(``torch.batch_norm_stats`` and the rest) have no CPU implementation. For the length of the
learner's call and the check's forward and backward, on the ranks only,
``_sync_batchnorm_on_cpu`` lifts the two refusals and gives the kernels CPU implementations
written from their CUDA definitions; PyTorch's own
``SyncBatchNorm`` module, ``convert_sync_batchnorm`` and autograd function
(``torch/nn/modules/_functions.py``) run unchanged, with its all_gather and all_reduce on
Gloo. The ground truth never goes through them: plain BatchNorm in one process. Ranks with
GPUs under NCCL (``backends.rank_device``) run the model there, SyncBatchNorm as it is.
"""
from __future__ import annotations

import torch

RTOL, ATOL = 1e-4, 1e-5


def ready() -> bool:
    """The warm-up of these checks: every rank imports this module, Join and what DDP imports
    when it first wraps a model, before a call is timed -- on a fresh rank (the first check, or
    one after a failure restarted the ranks) that takes seconds, longer than a short hang timeout."""
    from torch.distributed.algorithms import Join  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel(torch.nn.Linear(1, 1))   # the first one imports torch._dynamo
    return True
