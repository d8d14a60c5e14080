"""What 4.2c's try-its share; each try-it is a file of its own (``checkpointing``, ``meta_init``,
``offload_clip``, ``prefetch``). 4.2c's try-its: the habits of large-model training, written by
the learner (checked on the notebook's ranks). 4.2f's (DCP checkpoints, gradient accumulation)
are in ``long_runs``.

Each checker runs the learner's function on every rank and judges what it did against one
process (weights, gradients, norms of the plain model) and against what the ranks did, seen
from outside: bytes of storage allocated (``MemTracker``), bytes saved for backward
(``Activations``), forward calls of each block, the order of FSDP's all-gathers
(``Timeline``).
"""
from __future__ import annotations

from torch import nn

from ...grading.compare import close
from ...grading.report import Report
from ...torch_private import wrapper_module_names

TIMEOUT = 30.0          # seconds for one check's call on the ranks
RTOL, ATOL = 1e-4, 1e-6


def largest_difference(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).abs().max().item() for k in want if k in got and got[k].shape == want[k].shape),
               default=float("inf"))


def judge_same(report: Report, name: str, got: dict, want: dict, what: str, why: str) -> None:
    """Item ``name``: the tensors ``got`` equal one process's, ``want``; if not, by how much
    ``what`` differ, and ``why`` they should not."""
    if close(got, want):
        report.add(name, True)
    else:
        report.add(name, False, f"{what} from one process's (largest difference "
                                f"{largest_difference(got, want):.3g}): {why}")


def shard_blocks(model) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def plain_name(name: str) -> str:
    """A parameter's name in the plain model: activation checkpointing's wrapper names dropped."""
    return name.replace(wrapper_module_names()[1] + ".", "")
