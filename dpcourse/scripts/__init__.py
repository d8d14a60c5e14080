"""Complete training scripts a learner reads top to bottom, and the paths to run them.

``train_single.py`` trains a small MLP on one device; ``train_ddp.py`` and ``train_fsdp.py``
are the same training made data-parallel with ``DistributedDataParallel`` and FSDP2's
``fully_shard``. They are plain files meant for ``torchrun`` (or ``cluster.run_script`` from
the notebook); this package only says where they are::

    dpc.scripts.path("train_ddp")   # -> absolute path of train_ddp.py
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["path"]

NAMES = ("train_single", "train_ddp", "train_fsdp")


def path(name: str) -> str:
    """Absolute path of the script ``name`` (one of ``NAMES``, without ``.py``)."""
    if name not in NAMES:
        raise ValueError(f"unknown script {name!r}; choose one of {list(NAMES)}")
    return str(Path(__file__).resolve().with_name(f"{name}.py"))
